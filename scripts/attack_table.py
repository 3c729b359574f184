"""The tables of docs/security.md, "Evidence: robust rules against ALIE, IPM and a backdoor", from the run folders
of configs/security2_fmnist.yaml (or any sweep over methods, robust rules and attacks): the final evaluated round's
clean test accuracy per method and attack (rows) and robust rule (columns), and the backdoor accuracy of the runs
under the backdoor, in percent, mean ± sample std over seeds (the seed count where a cell has fewer than the most).

    python scripts/attack_table.py runs/sweeps/security2_fmnist
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import yaml

METHODS = {"fedavg": "FedAvg", "fedsam": "FedSAM", "fedlesam": "FedLESAM", "fedvssam": "FedVSSAM"}
RULES = ["mean", "median", "trimmed_mean", "krum", "bulyan", "centered_clip", "norm_bound"]
ATTACKS = ["none", "alie", "ipm", "backdoor"]
LABELS = {"none": "no attack", "alie": "ALIE", "ipm": "IPM", "backdoor": "backdoor", "mean": "mean",
          "median": "median", "trimmed_mean": "trimmed mean", "krum": "Krum", "bulyan": "Bulyan",
          "centered_clip": "centered clipping", "norm_bound": "norm bounding"}


def final_line(run: Path) -> dict | None:
    """The last line of ``run/metrics.jsonl`` that holds ``test_acc`` (None if the run never evaluated)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return next((line for line in reversed(lines) if "test_acc" in line), None)


def collect(sweep: Path) -> dict[tuple[str, str, str], dict[str, list[float]]]:
    """``(method, attack, rule) -> {"test": [...], "backdoor": [...]}`` over the completed runs, in percent."""
    cells: dict = defaultdict(lambda: {"test": [], "backdoor": []})
    for run in sorted(p for p in sweep.iterdir() if (p / "summary.json").is_file()):
        if json.loads((run / "summary.json").read_text()).get("status") != "completed":
            print(f"attack_table: {run.name} did not complete: left out", file=sys.stderr)
            continue
        config = yaml.safe_load((run / "config.yaml").read_text())
        line = final_line(run)
        if line is None:
            continue
        attack = (config.get("attack") or {}).get("name", "none")
        rule = (config.get("robust") or {}).get("name", "mean")
        key = (config["algo"]["name"], attack, rule)
        cells[key]["test"].append(100 * line["test_acc"])
        if "backdoor_acc" in line:
            cells[key]["backdoor"].append(100 * line["backdoor_acc"])
    return cells


def cell_text(values: list[float], most: int, digits: int = 1) -> str:
    """``mean ± std`` over the seeds (sample std), saying how many where fewer than ``most`` finished."""
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.{digits}f} (1 seed)"
    text = f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"
    return text if len(values) == most else f"{text} ({len(values)} seeds)"


def tables(cells: dict) -> str:
    methods = [m for m in METHODS if any(k[0] == m for k in cells)] + sorted({k[0] for k in cells} - set(METHODS))
    rules = [r for r in RULES if any(k[2] == r for k in cells)]
    attacks = [a for a in ATTACKS if any(k[1] == a for k in cells)]
    most = max((len(v["test"]) for v in cells.values()), default=0)
    head = "| | " + " | ".join(LABELS.get(r, r) for r in rules) + " |\n|---|" + "---|" * len(rules)
    out = ["Clean test accuracy (%)\n", "| method, attack " + head[2:]]
    for method in methods:
        for attack in attacks:
            row = [cell_text(cells.get((method, attack, r), {"test": []})["test"], most) for r in rules]
            out.append(f"| {METHODS.get(method, method)}, {LABELS.get(attack, attack)} | " + " | ".join(row) + " |")
    if "backdoor" in attacks:
        out += ["\nBackdoor accuracy (%) under the backdoor\n", "| method " + head[2:]]
        for method in methods:
            row = [cell_text(cells.get((method, "backdoor", r), {"backdoor": []})["backdoor"], most) for r in rules]
            out.append(f"| {METHODS.get(method, method)} | " + " | ".join(row) + " |")
    done = sum(len(v["test"]) for v in cells.values())
    return "\n".join(out) + f"\n\n({done} runs; {most} seeds where a cell says nothing else)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="the sweep's folder (its 'out')")
    args = parser.parse_args(argv)
    if not args.sweep.is_dir():
        print(f"attack_table: {args.sweep} is not a folder: give the sweep's out folder", file=sys.stderr)
        return 2
    cells = collect(args.sweep)
    if not cells:
        print(f"attack_table: no completed run in {args.sweep}", file=sys.stderr)
        return 1
    print(tables(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
