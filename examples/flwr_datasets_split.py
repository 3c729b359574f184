"""Your own split from flwr-datasets: any Flower Datasets partitioner decides which client holds which sample.

fedflat takes a split as ``clients=``, one list of training-sample indices per client (it replaces
``data.partition`` and sets ``data.num_clients``). A flwr-datasets partitioner works on a Hugging Face
``datasets.Dataset``: give it the training labels with each sample's index as a column, and every partition it
makes names its samples by that index. Here the quickstart (FedSAM on scikit-learn's digits) runs on
flwr-datasets' Dirichlet or pathological split instead of its own.

    pip install flwr-datasets                                      # (in `make setup` already)
    python examples/flwr_datasets_split.py                         # Dirichlet(0.3), 20 clients
    python examples/flwr_datasets_split.py --partitioner pathological rounds=30 threads=1
"""
from __future__ import annotations

import argparse

import datasets
from flwr_datasets.partitioner import DirichletPartitioner, Partitioner, PathologicalPartitioner

import fedflat
from fedflat.data import load_dataset

PARTITIONERS = {
    "dirichlet": lambda n: DirichletPartitioner(num_partitions=n, partition_by="label", alpha=0.3,
                                                min_partition_size=10, self_balancing=True, seed=42),
    "pathological": lambda n: PathologicalPartitioner(num_partitions=n, partition_by="label",
                                                      num_classes_per_partition=2,
                                                      class_assignment_mode="first-deterministic", seed=42),
}


def flwr_split(partitioner: Partitioner, labels) -> list[list[int]]:
    """The partitioner's split of the training samples as fedflat's ``clients=``: one index list per client."""
    partitioner.dataset = datasets.Dataset.from_dict({"label": list(map(int, labels)),
                                                      "index": list(range(len(labels)))})
    return [partitioner.load_partition(i)["index"] for i in range(partitioner.num_partitions)]


def main(argv: list[str] | None = None) -> fedflat.History:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides (the quickstart's)")
    parser.add_argument("--partitioner", choices=sorted(PARTITIONERS), default="dirichlet")
    parser.add_argument("--clients", type=int, default=20, help="number of partitions")
    parser.add_argument("--out", default="runs/examples", help="parent folder of the run folder")
    args = parser.parse_args(argv)

    data = load_dataset("digits")
    clients = flwr_split(PARTITIONERS[args.partitioner](args.clients), data.y_train.numpy())
    print(f"{args.partitioner} split of {len(data.y_train)} samples: client sizes {[len(c) for c in clients]}")
    history = fedflat.run(None, overrides=args.overrides, clients=clients, out=args.out, progress=False)
    s = history.summary
    print(f"{s['algorithm']}: {s['status']}, final test accuracy {s['final_test_acc']:.4f} after {s['rounds']} rounds "
          f"({history.run_dir})")
    return history


if __name__ == "__main__":
    main()
