"""The GPU convergence check's one figure and its numbers (docs/benchmarks.md, "GPU"): every run of a
`configs/gpu_converge.yaml` sweep in one convergence plot, each labelled by method and precision.

    python scripts/gpu_converge_figure.py RUNS_FOLDER docs/figures/gpu_converge     # writes .png and .csv

(`fedflat report --plot` draws one figure per setting, and bf16 and TF32 are two settings.)
"""
from __future__ import annotations

import sys
from pathlib import Path

from fedflat.experiments.plots import plot_convergence
from fedflat.experiments.report import Group, find_runs, group_runs


def main(runs_folder: str, out: str) -> None:
    groups = [Group("all", f"{g.method} ({'bf16' if 'bf16' in g.setting else 'TF32'})", g.runs)
              for g in group_runs(find_runs([runs_folder]))]
    title = "ResNet-18-GN on Fashion-MNIST (H100)"
    for path in plot_convergence(groups, Path(out), title, formats=["png", "csv"], dpi=200):
        print(path)


if __name__ == "__main__":
    main(*sys.argv[1:])
