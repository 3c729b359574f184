"""The tables of docs/security.md, "Evidence", from the run folders of a sweep with attacks (such as
configs/security_fmnist.yaml): per method and robust rule (rows) and fraction of malicious clients (columns), the
final round's test accuracy and backdoor accuracy in percent, mean ± sample std over seeds.

    python scripts/security_table.py runs/sweeps/security_fmnist

``fedflat report`` gives the test accuracy of every cell; this pivots it by the attackers' fraction and adds the
backdoor accuracy (``backdoor_acc`` of the last evaluated round's line of ``metrics.jsonl``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

NAMES = {"fedavg": "FedAvg", "fedsam": "FedSAM", "fedlesam": "FedLESAM", "fedvssam": "FedVSSAM",
         "fedscam": "FedSCAM", "fedwmsam": "FedWMSAM", "fedfft": "FedFFT"}


def final_line(run: Path) -> dict | None:
    """The last line of ``run/metrics.jsonl`` that holds ``test_acc`` (None if the run never evaluated)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return next((line for line in reversed(lines) if "test_acc" in line), None)


def rule_of(config: dict) -> str:
    robust = config.get("robust") or {}
    name = robust.get("name")
    if name is None:
        return "averaging"
    return f"norm_bound (M = {robust['bound']:g})" if name == "norm_bound" else name


def collect(sweep: Path) -> dict[tuple[str, str, float], dict[str, list[float]]]:
    """``(method, rule, fraction) -> {"test": [...], "backdoor": [...]}`` over the completed runs, in percent."""
    cells: dict = defaultdict(lambda: {"test": [], "backdoor": []})
    for run in sorted(p for p in sweep.iterdir() if (p / "summary.json").is_file()):
        if json.loads((run / "summary.json").read_text()).get("status") != "completed":
            print(f"security_table: {run.name} did not complete: left out", file=sys.stderr)
            continue
        config = yaml.safe_load((run / "config.yaml").read_text())
        line = final_line(run)
        key = (config["algo"]["name"], rule_of(config), float((config.get("attack") or {}).get("fraction", 0.0)))
        cells[key]["test"].append(100 * line["test_acc"])
        cells[key]["backdoor"].append(100 * line["backdoor_acc"])
    return cells


def cell_text(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.1f} (1 seed)"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def table(cells: dict, metric: str) -> str:
    """One markdown table of ``metric`` ("test" or "backdoor"): a row per method and rule, a column per fraction."""
    fractions = sorted({f for _, _, f in cells})
    rows = sorted({(m, r) for m, r, _ in cells}, key=lambda mr: (list(NAMES).index(mr[0]) if mr[0] in NAMES else 99,
                                                                 mr[1] != "averaging", mr[1]))
    seeds = sorted({len(v[metric]) for v in cells.values()})
    out = ["| method | rule | " + " | ".join(f"{f:.0%} attackers" for f in fractions) + " |",
           "|---|---|" + "---|" * len(fractions)]
    for method, rule in rows:
        out.append(f"| {NAMES.get(method, method)} | {rule} | "
                   + " | ".join(cell_text(cells.get((method, rule, f), {metric: []})[metric]) for f in fractions)
                   + " |")
    return "\n".join(out) + f"\n\n(seeds per cell: {', '.join(map(str, seeds))})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="the sweep's folder (its 'out')")
    args = parser.parse_args(argv)
    if not args.sweep.is_dir():
        print(f"security_table: {args.sweep} is not a folder: give the sweep's out folder", file=sys.stderr)
        return 2
    cells = collect(args.sweep)
    if not cells:
        print(f"security_table: no completed run in {args.sweep}: run the sweep first", file=sys.stderr)
        return 2
    print("Test accuracy (%), final round\n\n" + table(cells, "test"))
    print("\nBackdoor accuracy (%), final round\n\n" + table(cells, "backdoor"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
