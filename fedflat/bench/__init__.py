"""``fedflat bench``: seconds per round of each engine and method on standard workloads, against a
bare PyTorch loop doing the same work in the same run.

For every (workload, method, engine) the bench builds the :class:`Simulation`, runs warm-up rounds,
then times ``run_round`` (training only; one evaluation is timed separately). The **bare loop** is
the plainest per-client PyTorch loop: one ``nn.Module``, global weights copied in per client,
``torch.optim.SGD`` with coupled weight decay, ``clip_grad_norm_``, the same clients and the same
batch indices as fedflat's round, and a second backward pass per step for two-backprop (SAM-type)
methods. Under an ``adapter`` section (the LoRA workloads W5 and W6) it is plain PyTorch + peft:
``get_peft_model`` with the same ``LoraConfig``, SGD over the adapters and the head. fedflat's overhead
is then ``fedflat s/round / bare s/round`` measured side by side.

Data is synthetic of each workload's shape (only speed is measured), seeded.
"""
from __future__ import annotations

import argparse
import json

from fedflat.bench.workloads import ENGINES, WORKLOADS
from fedflat.cliutil import at_least_one

_MEASURING = ("BareLoop", "Contestant", "Row", "bench", "executor_overrides", "flops_per_sample", "format_table",
              "kernels", "machine", "matmul_flops", "profile_round", "race", "round_samples")


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
    p.add_argument("--executors", default="local", help="comma-separated: local, threads:N (N threads of "
                                                        "one process), ray:N (N Ray workers), e.g. "
                                                        "local,threads:2,ray:2 (default local)")
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
