"""How many sweep cells run at once: ``fedflat sweep --workers auto`` (docs/experiments.md, "Packing a sweep").

A cell's process on a GPU uses a small share of it when the model is small (Fashion-MNIST's MLP: the GPU waits on
the host's Python and kernel launches) and a few GB of its memory, so several cells' processes side by side finish
more cells an hour than one cell at a time. How many fit is measured, not guessed: the first cell runs alone for
one round, writes what the device holds then (:class:`Footprint`: its CUDA context, its caching allocator's peak),
and the sweep starts as many more as fit in the memory left (:func:`cells_that_fit`), never more than one a core
(each cell's process feeds its GPU work from a core of its own). On CPU, ``auto`` runs one cell a core.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedflat.experiments.callbacks import Callback, RunInfo
from fedflat.files import atomic_write_text

FOOTPRINT_FILE = "gpu_footprint.json"
HEADROOM = 1.25  # a cell's later rounds (evaluations, the diagnostics) may hold more than its first round did
RESERVE = 0.05  # of the device's memory left free beside the cells


def cells_that_fit(free: int, total: int, footprint: int) -> int:
    """Further cells beside the measured one: the memory left free after its first round, less ``RESERVE`` of the
    device, over its footprint with ``HEADROOM`` (none when one footprint does not fit)."""
    room = free - RESERVE * total
    return max(0, int(room // (HEADROOM * max(footprint, 1))))


class Footprint(Callback):
    """After its first round on a GPU, a cell writes ``gpu_footprint.json`` in its folder: the device memory in use
    (``total - free``: its context and everything its allocator holds, the first cell running alone), the
    allocator's peak, and the device's total."""

    def __init__(self, folder: str | Path):
        self.path = Path(folder) / FOOTPRINT_FILE
        self.written = False

    def on_round_end(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        if self.written or not on_gpu(str(run.config.get("device", "cpu"))) or not torch.cuda.is_initialized():
            return
        free, total = torch.cuda.mem_get_info()
        record = {"used_bytes": total - free, "free_bytes": free, "total_bytes": total,
                  "peak_reserved_bytes": torch.cuda.max_memory_reserved(), "round": round}
        atomic_write_text(self.path, json.dumps(record) + "\n")
        self.written = True


def read_footprint(folder: Path, since: float = 0.0) -> dict[str, int] | None:
    """A cell's :class:`Footprint` record written at ``since`` (a time) or later, or None before it has one (or
    where it ran on a CPU)."""
    path = folder / FOOTPRINT_FILE
    try:
        return json.loads(path.read_text()) if path.stat().st_mtime >= since else None
    except (OSError, ValueError):
        return None


def on_gpu(device: str) -> bool:
    """Whether a cell's ``device`` setting trains on a GPU (``auto``: where torch sees one)."""
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


@dataclass
class Packing:
    """``--workers auto``: one cell a core on CPU; on a GPU one cell until its footprint is known, then as many as fit
    its memory (at most one a core). ``decided`` says how many and why, once known."""

    cores: int
    cells: int
    gpu: bool
    since: float = 0.0  # footprints older than this (an earlier sweep's) are not this machine's measurement
    limit: int | None = None
    reason: str = ""

    @classmethod
    def of(cls, devices: list[str], cores: int, since: float = 0.0) -> Packing:
        gpu = any(on_gpu(d) for d in devices)
        packing = cls(cores, len(devices), gpu, since)
        if not gpu:
            packing.limit = max(1, min(cores, len(devices)))
            packing.reason = f"{packing.limit} cell(s) at once: one a core ({cores} cores), CPU cells"
        return packing

    @property
    def threads(self) -> int:
        """Torch threads of each cell: the cores shared among the cells that may run at once."""
        return max(1, self.cores // max(1, min(self.cells, self.cores)))

    def workers(self, folders: list[Path]) -> int:
        """Cells that may run now: 1 on a GPU until one of ``folders`` has a footprint, then as many as fit."""
        if self.limit is None:
            record = next((r for r in (read_footprint(f, self.since) for f in folders) if r is not None), None)
            if record is None:
                return 1
            self.decide(record)
        return self.limit

    def alive(self, limit: int) -> int:
        """Cells' processes started at once when they start warm (:mod:`fedflat.experiments.cells`: imported, waiting
        to be let in): one a core while the first cell measures, then one waiting beside each running cell."""
        spares = self.cores - 1 if self.limit is None else limit
        return min(max(limit, self.cores), limit + spares)

    def decide(self, record: dict[str, int]) -> None:
        more = cells_that_fit(record["free_bytes"], record["total_bytes"], record["used_bytes"])
        self.limit = max(1, min(self.cores, self.cells, 1 + more))
        gib = 2 ** 30
        self.reason = (f"{self.limit} cell(s) at once on the GPU: the first cell held {record['used_bytes'] / gib:.1f} "
                       f"GiB after its first round, {record['free_bytes'] / gib:.1f} of {record['total_bytes'] / gib:.1f}"
                       f" GiB were free (room for {1 + more} with {HEADROOM}x headroom), {self.cores} cores, "
                       f"{self.cells} cells")
