"""Your own split from flwr-datasets: any Flower Datasets partitioner decides which client holds which sample.

fedflat takes a split as ``clients=``, one list of training-sample indices per client (it replaces
``data.partition`` and sets ``data.num_clients``). A flwr-datasets partitioner works on a Hugging Face
``datasets.Dataset``: ``fedflat.data.flwr_partitions(partitioner, data)`` gives it the training labels with each
sample's index as a column, so every partition it makes names its samples by that index (docs/data.md). Here the
quickstart (FedSAM on scikit-learn's digits) runs on flwr-datasets' Dirichlet or pathological split instead of its
own.

    pip install flwr-datasets                                      # (in `make setup` already)
    python examples/flwr_datasets_split.py                         # Dirichlet(0.3), 20 clients
    python examples/flwr_datasets_split.py --partitioner pathological rounds=30 threads=1
"""
from __future__ import annotations

import argparse

from flwr_datasets.partitioner import DirichletPartitioner, PathologicalPartitioner

import fedflat
from fedflat.data import flwr_partitions, load_dataset

PARTITIONERS = {
    "dirichlet": lambda n: DirichletPartitioner(num_partitions=n, partition_by="label", alpha=0.3,
                                                min_partition_size=10, self_balancing=True, seed=42),
    "pathological": lambda n: PathologicalPartitioner(num_partitions=n, partition_by="label",
                                                      num_classes_per_partition=2,
                                                      class_assignment_mode="first-deterministic", seed=42),
}


def main(argv: list[str] | None = None) -> fedflat.History:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (the quickstart's)")
    parser.add_argument("--partitioner", choices=sorted(PARTITIONERS), default="dirichlet")
    parser.add_argument("--clients", type=int, default=20, help="number of partitions")
    parser.add_argument("--out", default="runs/examples", help="parent folder of the run folder")
    args = parser.parse_args(argv)

    data = load_dataset("digits")
    clients = flwr_partitions(PARTITIONERS[args.partitioner](args.clients), data)
    print(f"{args.partitioner} split of {len(data.y_train)} samples: client sizes {[len(c) for c in clients]}")
    history = fedflat.run(None, overrides=args.overrides, clients=clients, out=args.out, progress=False)
    s = history.summary
    print(f"{s['algorithm']}: {s['status']}, final test accuracy {s['final_test_acc']:.4f} after {s['rounds']} rounds "
          f"({history.run_dir})")
    return history


if __name__ == "__main__":
    main()
