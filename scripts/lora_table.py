"""The table of docs/lora_evidence.md from the LoRA sweep's folder (configs/lora_fmnist_sweep.yaml): one row per cell
of the grid (its seeds averaged), its numbers those of ``fedflat report`` on that cell's runs (final and best test
accuracy, mean ± sample std over seeds; rounds to each target accuracy; trainable parameters; the bytes a client
uploads a round; seconds a round), labelled by what the cell is: its federation, how the model is fine-tuned, the
method and its radius, and the privacy budget with its calibrated noise multiplier.

    python scripts/lora_table.py runs/sweeps/lora_fmnist --target-acc 0.7 0.8
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fedflat.experiments.report import DASH, Row, Run, build_rows, find_runs


def cells_in_order(sweep: Path) -> dict[str, list[Path]]:
    """The run folders of each grid cell (the part of its name before ``__seed``), in the sweep's order."""
    index = sweep / "sweep.json"
    names = ([c["name"] for c in json.loads(index.read_text())["cells"]] if index.is_file()
             else sorted(p.name for p in sweep.iterdir() if p.is_dir()))
    cells: dict[str, list[Path]] = {}
    for name in names:
        if (sweep / name / "summary.json").is_file():
            cells.setdefault(name.split("__seed")[0], []).append(sweep / name)
    return cells


def fine_tuning(run: Run) -> str:
    """LoRA (its rank; A frozen for FFA-LoRA), full fine-tuning or from scratch, from the run's config."""
    c = run.config
    if c.get("adapter.r") is not None:
        return f"LoRA r={c['adapter.r']}" + (", A frozen" if c.get("adapter.freeze_a") else "")
    return "from scratch" if c.get("model.pretrained") is None else "full fine-tuning"


def federation(run: Run) -> str:
    c = run.config
    if c.get("sampling.participation") == "bernoulli":
        return f"{c['data.num_clients']} clients, Poisson q={c['sampling.clients_per_round'] / c['data.num_clients']:g}"
    return f"{c['data.num_clients']} clients, {c['sampling.clients_per_round']} a round"


def privacy(run: Run) -> str:
    eps, z = run.config.get("privacy.target_epsilon"), run.config.get("privacy.noise_multiplier")
    return DASH if eps is None else f"{eps:g} (z={z:.3g})"


def line(runs: list[Run], row: Row, targets: list[float], most: int) -> str:
    pm = lambda ms: DASH if ms[0] is None else (f"{ms[0]:.2f}" if ms[1] is None else f"{ms[0]:.2f} ± {ms[1]:.2f}")  # noqa: E731
    reached = []
    for t in targets:
        rounds, _, hit = row.targets[t]
        shown = DASH if rounds is None else f"{rounds:.0f}" if rounds == int(rounds) else f"{rounds:.1f}"
        reached.append(shown + (f" ({hit}/{row.seeds})" if rounds is not None and hit < row.seeds else ""))
    seeds = "" if row.seeds == most else f" ({row.seeds} seed{'s' if row.seeds > 1 else ''})"
    cells = [federation(runs[0]), fine_tuning(runs[0]), row.method + seeds, row.radius or DASH, privacy(runs[0]),
             pm(row.final), pm(row.best), *reached, f"{row.parameters:,.0f}", f"{row.up_bytes / 1000:.1f}",
             f"{row.sec_per_round:.1f}"]
    return "| " + " | ".join(cells) + " |"


def table(sweep: Path, targets: list[float]) -> str:
    head = ["federation", "fine-tuning", "method", "radius", "epsilon (z)", "final acc (%)", "best acc (%)",
            *(f"rounds to {100 * t:g}%" for t in targets), "trainable params", "up (KB/client/round)", "s/round"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    groups = []
    for folders in cells_in_order(sweep).values():
        runs = [r for r in find_runs(folders) if r.summary.get("status") == "completed"]
        if runs:
            (row,) = build_rows(runs, targets)
            groups.append((runs, row))
    most = max((row.seeds for _, row in groups), default=0)
    return "\n".join(out + [line(runs, row, targets, most) for runs, row in groups])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweep", type=Path, help="the sweep's folder (its 'out')")
    parser.add_argument("--target-acc", type=float, nargs="*", default=[0.7, 0.8])
    args = parser.parse_args(argv)
    if not args.sweep.is_dir():
        print(f"lora_table: {args.sweep} is not a folder: give the sweep's out folder", file=sys.stderr)
        return 2
    print(table(args.sweep, sorted(args.target_acc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
