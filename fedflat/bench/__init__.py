"""``fedflat bench``: seconds per round of each engine and method on standard workloads, against a
bare PyTorch loop doing the same work in the same run.

For every (workload, method, engine) the bench builds the :class:`Simulation`, runs warm-up rounds,
then times ``run_round`` (training only; one evaluation is timed separately). The **bare loop** is
the plainest per-client PyTorch loop: one ``nn.Module``, global weights copied in per client,
``torch.optim.SGD`` with coupled weight decay, ``clip_grad_norm_``, the same clients and the same
batch indices as fedflat's round, and a second backward pass per step for two-backprop (SAM-type)
methods. fedflat's overhead is then ``fedflat s/round / bare s/round`` measured side by side.

Data is synthetic of each workload's shape (only speed is measured), seeded.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from fedflat.cliutil import at_least_one

ENGINES = ("sequential", "vectorized", "bare")


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
    Workload("tiny", "test-sized: 4x4 inputs, MLP hidden 8, 6 clients, 3/round, 1 epoch, batch 10",
             {"seed": 0, "rounds": 1000,
              "data": {"name": "synthetic", "num_clients": 6, "partition": {"scheme": "iid"},
                       "options": {"shape": [1, 4, 4], "num_classes": 3, "train_size": 180, "test_size": 60}},
              "model": {"name": "mlp", "hidden": [8]}, "sampling": {"clients_per_round": 3},
              "train": {"local_epochs": 1, "batch_size": 10}}),
)}



_MEASURING = ("BareLoop", "Contestant", "Row", "bench", "executor_overrides", "flops_per_sample", "format_table",
              "machine", "matmul_flops", "profile_round", "race", "round_samples")


def __getattr__(name: str):
    """The measuring code (and torch) load on first use, so ``fedflat --help`` stays fast."""
    if name in _MEASURING:
        from fedflat.bench import measure

        return getattr(measure, name)
    raise AttributeError(f"module 'fedflat.bench' has no attribute {name!r}")


# ----------------------------------------------------------------------------- the command

def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def cmd_bench(args: argparse.Namespace) -> int:
    from fedflat.bench.measure import bench, format_table

    report = bench(_split(args.workload), _split(args.algos), _split(args.engines), args.rounds, args.warmup,
                   args.device, args.threads, tuple(args.overrides),
                   progress=(lambda msg: None) if args.quiet else (lambda msg: print(msg, flush=True)),
                   executors=tuple(_split(args.executors)), profile=args.profile)
    print(format_table(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"json: {args.json}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="seconds per round per engine and method, against a bare PyTorch loop",
                              description=__doc__)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides applied to every workload")
    p.add_argument("--workload", default="W1", help=f"comma-separated: {', '.join(WORKLOADS)} (default W1)")
    p.add_argument("--algos", default="fedavg,fedsam", help="comma-separated recipes (default fedavg,fedsam)")
    p.add_argument("--engines", default="sequential,vectorized,bare", help="comma-separated: " + ", ".join(ENGINES))
    p.add_argument("--executors", default="local", help="comma-separated: local, ray:N (N Ray workers), e.g. "
                                                        "local,ray:1,ray:2 (default local)")
    p.add_argument("--rounds", type=at_least_one, default=5, help="timed rounds per measurement (W3 on CPU: 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first (W3 on CPU: 0)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto")
    p.add_argument("--threads", type=at_least_one, default=None, help="torch intra-op threads of every contestant "
                                                              "(default: each run's threads: auto)")
    p.add_argument("--json", default=None, help="write the results and the machine description here")
    p.add_argument("--profile", default=None, metavar="DIR", help="profile one more round of every contestant "
                                                                  "(torch.profiler) and write its table to DIR")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_bench)
