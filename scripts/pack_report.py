"""Cells per hour of one sweep run one cell at a time and packed (``--workers auto``), issue 60.

    python scripts/pack_report.py SERIAL_FOLDER SERIAL_START PACKED_FOLDER PACKED_START AT_ONCE

``*_START``: the sweep's start (seconds since the epoch). A sweep's rate is its completed cells over the wall time
from its start to its last completed cell's ``summary.json`` (so a sweep stopped at a time limit is measured on the
cells it completed). Also printed: the median seconds of a round's training (metrics.jsonl ``seconds``), whose ratio
gives the steady state a long sweep (500 rounds a cell) approaches, where each cell's start (its process, imports,
data and CUDA context) no longer counts.
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def summarize(folder: Path, start: float) -> dict:
    done = [p for p in folder.iterdir() if (p / "summary.json").exists()
            and json.loads((p / "summary.json").read_text()).get("status") == "completed"]
    end = max(((p / "summary.json").stat().st_mtime for p in done), default=start)
    rounds = [json.loads(line)["seconds"] for p in done for line in (p / "metrics.jsonl").read_text().splitlines()
              if line.strip()]
    wall = max(end - start, 1e-9)
    return {"cells": len(done), "wall": wall, "cells_per_hour": 3600 * len(done) / wall,
            "round_s": statistics.median(rounds) if rounds else float("nan")}


def main(argv: list[str]) -> None:
    serial = summarize(Path(argv[0]), float(argv[1]))
    packed = summarize(Path(argv[2]), float(argv[3]))
    at_once = int(argv[4])  # the cells the packed sweep ran at once (its "N cell(s) at once" line)
    for name, s in (("one at a time", serial), ("packed", packed)):
        print(f"{name}: {s['cells']} cells completed in {s['wall']:.1f} s = {s['cells_per_hour']:.0f} cells/hour; "
              f"median round {s['round_s']:.3f} s")
    ratio = packed["cells_per_hour"] / max(serial["cells_per_hour"], 1e-9)
    steady = at_once * serial["round_s"] / max(packed["round_s"], 1e-9)
    print(f"packed / one at a time: {ratio:.2f}x cells per hour; steady state ~{steady:.2f}x ({at_once} cells at "
          "once x round time alone / round time packed)")


if __name__ == "__main__":
    main(sys.argv[1:])
