"""The standard benchmark workloads (W1-W3 and a test-sized one) and the engines a bench compares."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ENGINES = ("sequential", "vectorized", "streams", "bare", "plain")


@dataclass(frozen=True)
class Workload:
    """A standard benchmark setting: a config tree and how many rounds a CPU run should time."""

    name: str
    description: str
    tree: dict[str, Any]
    cpu_rounds: int | None = None  # cap on timed rounds on CPU (W3: one)
    cpu_warmup: int | None = None


def _tree(shape: list[int], train_size: int, num_clients: int, partition: dict, model: dict, per_round: int,
          epochs: int, batch: int) -> dict[str, Any]:
    return {"seed": 0, "rounds": 1000,
            "data": {"name": "synthetic", "num_clients": num_clients, "partition": partition,
                     "options": {"shape": shape, "num_classes": 10, "train_size": train_size, "test_size": 1000}},
            "model": model, "sampling": {"clients_per_round": per_round},
            "train": {"local_epochs": epochs, "batch_size": batch}, "eval": {"batch_size": 1000}}


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("W1", "Fashion-MNIST-shaped, MLP 784-200-200-10, 100 clients Dirichlet 0.1, 10/round, 5 epochs, batch 50",
             _tree([1, 28, 28], 60000, 100, {"scheme": "dirichlet", "alpha": 0.1, "min_size": 10},
                   {"name": "mlp"}, 10, 5, 50)),
    Workload("W2", "CIFAR-10-shaped, cnn, 1,000 clients x 50 samples, 50/round, 1 epoch, batch 10",
             _tree([3, 32, 32], 50000, 1000, {"scheme": "iid"}, {"name": "cnn"}, 50, 1, 10)),
    Workload("W3", "CIFAR-10-shaped, ResNet-18-GN, 10 clients x 500 samples, 10/round, 5 epochs, batch 50",
             _tree([3, 32, 32], 5000, 10, {"scheme": "iid"}, {"name": "resnet18"}, 10, 5, 50),
             cpu_rounds=1, cpu_warmup=0),
    Workload("W4", "CIFAR-10-shaped, ResNet-20-GN, 500 clients x 100 samples, 10/round, 1 epoch, batch 50",
             _tree([3, 32, 32], 50000, 500, {"scheme": "iid"}, {"name": "resnet20"}, 10, 1, 50)),
    Workload("tiny", "test-sized: 4x4 inputs, MLP hidden 8, 6 clients, 3/round, 1 epoch, batch 10",
             {"seed": 0, "rounds": 1000,
              "data": {"name": "synthetic", "num_clients": 6, "partition": {"scheme": "iid"},
                       "options": {"shape": [1, 4, 4], "num_classes": 3, "train_size": 180, "test_size": 60}},
              "model": {"name": "mlp", "hidden": [8]}, "sampling": {"clients_per_round": 3},
              "train": {"local_epochs": 1, "batch_size": 10}}),
)}
