"""A sweep tracked in Weights & Biases: one W&B run per cell, grouped under the sweep, the config and every metric.

Three methods x two seeds on the quickstart's split of scikit-learn's digits (no download). W&B runs offline unless
you say otherwise: `wandb sync runs/examples/wandb_sweep/*/wandb/offline-run-*` uploads them later, or set
`WANDB_MODE=online` (and `wandb login`) to stream them. Rerunning skips finished cells; a killed cell resumes and
continues its W&B run (same id).

    python examples/wandb_sweep.py                       # 30 rounds per cell, 2 worker processes
    python examples/wandb_sweep.py rounds=5 --workers 1  # any key=value applies to every cell
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml

from fedflat.experiments.sweep import load_sweep, run_sweep

SWEEP = {
    "base": "quickstart",  # the embedded quickstart config (20 clients, Dirichlet 0.3, an MLP)
    "overrides": ["rounds=30", "eval.every=5", "threads=1"],
    "config": {"loggers": [{"name": "wandb", "project": "fedflat-examples"}]},
    "grid": {"algo": ["fedavg", "fedsam", "fedlesam"], "seed": [0, 1]},
}


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every cell")
    parser.add_argument("--workers", type=int, default=2, help="cells run at once, each in its own process")
    parser.add_argument("--out", default="runs/examples/wandb_sweep", help="the sweep folder")
    args = parser.parse_args(argv)
    os.environ.setdefault("WANDB_MODE", "offline")  # no account needed; sync later
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out.parent / "wandb_sweep.yaml"
    path.write_text(yaml.safe_dump({**SWEEP, "out": str(out.resolve()), "overrides": SWEEP["overrides"] + args.overrides}))
    result = run_sweep(load_sweep(path), workers=args.workers, progress=False)
    for cell in result.cells:
        acc = cell.get("final_test_acc")
        print(f"{cell['name']}: {cell['status']}" + (f", final test acc {acc:.4f}" if acc is not None else ""))
    return result


if __name__ == "__main__":
    main()
