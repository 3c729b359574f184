"""Your own data: a federated run on arrays you already have, with a model of your own.

The Wisconsin breast-cancer table (569 patients, 30 features, 2 classes; shipped with scikit-learn, no download)
stands in for your data: it becomes a ``fedflat.data.Dataset`` from tensors, is split across 10 clients with
Dirichlet(0.5) label skew, and FedAvg and FedSAM train a small MLP of your own on it, side by side.

    python examples/own_data.py                       # 40 rounds each, a run folder per method under runs/examples
    python examples/own_data.py rounds=5 threads=1    # any config key=value applies to both runs
"""
from __future__ import annotations

import argparse

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer
from sklearn.model_selection import train_test_split
from torch import nn

import fedflat
from fedflat.data import Dataset


def breast_cancer() -> Dataset:
    """Standardized float32 features (train-split statistics) and int64 labels, as ``Dataset`` wants them."""
    x, y = load_breast_cancer(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, stratify=y, random_state=0)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    features = [torch.from_numpy(((part - mean) / std).astype(np.float32)) for part in (x_train, x_test)]
    labels = [torch.from_numpy(part.astype(np.int64)) for part in (y_train, y_test)]
    return Dataset("breast_cancer", features[0], labels[0], features[1], labels[1], num_classes=2)


def my_model() -> nn.Module:
    """Any ``nn.Module`` mapping a batch of inputs to class logits."""
    return nn.Sequential(nn.Linear(30, 32), nn.ReLU(), nn.Linear(32, 2))


CONFIG = {
    "rounds": 40,
    "data": {"num_clients": 10, "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 10}},
    "sampling": {"clients_per_round": 5},
    "train": {"local_epochs": 2, "batch_size": 16, "lr": 0.05},
    "eval": {"every": 5},
}


def main(argv: list[str] | None = None) -> dict[str, fedflat.History]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for both runs")
    parser.add_argument("--out", default="runs/examples", help="parent folder of the run folders")
    args = parser.parse_args(argv)

    data = breast_cancer()
    majority = max(data.y_test.float().mean().item(), 1 - data.y_test.float().mean().item())
    print(f"{data.name}: {len(data.y_train)} training and {len(data.y_test)} test samples, "
          f"majority class {majority:.3f} of the test split")
    histories = {}
    for algo in ("fedavg", "fedsam"):
        histories[algo] = fedflat.run(CONFIG, overrides=[f"algo={algo}", *args.overrides], dataset=data,
                                      model_fn=my_model, out=args.out, progress=False)
        s = histories[algo].summary
        print(f"{algo}: {s['status']}, final test accuracy {s['final_test_acc']:.3f} after {s['rounds']} rounds "
              f"({histories[algo].run_dir})")
    return histories


if __name__ == "__main__":
    main()
