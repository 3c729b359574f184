"""The table of docs/privacy.md, "Evidence", from the run folders of a sweep over methods and privacy budgets (such
as configs/privacy2_fmnist.yaml): the final evaluated round's test accuracy per method (rows) and target epsilon
(columns, "inf" without DP), in percent, mean ± sample std over seeds, and what each method lost at the smallest
epsilon (its mean without DP minus its mean there); below it, the calibrated noise multiplier of each epsilon.

    python scripts/privacy_table.py runs/sweeps/privacy2_fmnist
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

from attack_table import cell_text, final_line  # (this folder: scripts/)

METHODS = {"fedavg": "FedAvg", "fedsam": "FedSAM", "dpfedsam": "DP-FedSAM", "fedlesam": "FedLESAM",
           "fedvssam": "FedVSSAM"}


def collect(sweep: Path) -> tuple[dict, dict]:
    """``(method, epsilon) -> [test accuracy %]`` over the completed runs, and ``epsilon -> {z}``."""
    cells, noise = defaultdict(list), defaultdict(set)
    for run in sorted(p for p in sweep.iterdir() if (p / "summary.json").is_file()):
        if json.loads((run / "summary.json").read_text()).get("status") != "completed":
            print(f"privacy_table: {run.name} did not complete: left out", file=sys.stderr)
            continue
        config, line = yaml.safe_load((run / "config.yaml").read_text()), final_line(run)
        if line is None:
            continue
        privacy = config.get("privacy")
        eps = math.inf if privacy is None else float(privacy["target_epsilon"])
        cells[(config["algo"]["name"], eps)].append(100 * line["test_acc"])
        if privacy is not None:
            noise[eps].add(round(float(privacy["noise_multiplier"]), 3))
    return cells, noise


def table(cells: dict, noise: dict) -> str:
    budgets = sorted({e for _, e in cells}, reverse=True)
    methods = [m for m in METHODS if any(k[0] == m for k in cells)] + sorted({m for m, _ in cells} - set(METHODS))
    most = max(len(v) for v in cells.values())
    smallest = budgets[-1]
    names = ["epsilon = inf (no DP)" if e == math.inf else f"epsilon = {e:g}" for e in budgets]
    out = ["| method | " + " | ".join(names) + f" | lost at epsilon = {smallest:g} |",
           "|---|" + "---|" * (len(budgets) + 1)]
    for m in methods:
        row = [cell_text(cells.get((m, e), []), most, digits=2) for e in budgets]
        free, tight = cells.get((m, math.inf)), cells.get((m, smallest))
        lost = f"{statistics.mean(free) - statistics.mean(tight):.2f}" if free and tight else "—"
        out.append(f"| {METHODS.get(m, m)} | " + " | ".join(row) + f" | {lost} |")
    zs = ", ".join(f"epsilon {e:g}: z = {'/'.join(f'{z:g}' for z in sorted(noise[e]))}"
                   for e in budgets if e != math.inf and noise.get(e))
    return "\n".join(out) + (f"\n\n(calibrated noise: {zs})" if zs else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="the sweep's folder (its 'out')")
    args = parser.parse_args(argv)
    if not args.sweep.is_dir():
        print(f"privacy_table: {args.sweep} is not a folder: give the sweep's out folder", file=sys.stderr)
        return 2
    cells, noise = collect(args.sweep)
    if not cells:
        print(f"privacy_table: no completed run in {args.sweep}", file=sys.stderr)
        return 1
    print(table(cells, noise))
    return 0


if __name__ == "__main__":
    sys.exit(main())
