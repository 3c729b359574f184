"""glibc's allocator set for training: a step's large tensors reuse the heap's freed memory, not fresh pages.

PyTorch's CPU tensors come from ``malloc``. glibc serves a block above its mmap threshold (128 KiB, raised as large
blocks are freed, to 32 MiB at most) with a fresh mapping and returns it to the kernel when freed, and it gives the
top of its heap back above its trim threshold; the next step's tensors then land on pages the kernel zero-fills on
first touch. On W2 (a CNN, 50 clients a round, 800k parameters) that was 110,000 page faults a round in the driver
and 120,000 in each Ray worker, about 0.2 s of a 2.2 s round (docs/benchmarks.md, "CPU speed, issue 37"). With the
mmap threshold at 256 MiB and the trim threshold at 512 MiB the heap keeps what it had: a few faults a round after
the first two. A process then keeps up to 512 MiB of freed memory for its next step (blocks of 256 MiB and more are
still mapped and returned one by one), as PyTorch's GPU caching allocator keeps its own.

Every run's process sets it once: a :class:`~fedflat.engine.simulation.Simulation` (the driver, a Flower node, a sweep
cell, and so the threads executor's process) and a Ray worker's runtime; ``FEDFLAT_MALLOC=default`` keeps glibc's own
settings. Elsewhere (macOS, Windows, musl) it does nothing.
"""
from __future__ import annotations

import ctypes
import os
import sys

MMAP_THRESHOLD = 256 << 20  # blocks below it come from the heap (W2's [50, 800k] uploads: 160 MB)
TRIM_THRESHOLD = 512 << 20  # free memory at the heap's top kept up to this
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
ENV = "FEDFLAT_MALLOC"
_DONE: list[bool] = []


def retain_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds once per process (see the module); whether they are set."""
    if not _DONE:
        _DONE.append(_set_thresholds())
    return _DONE[0]


def _set_thresholds() -> bool:
    if sys.platform != "linux" or os.environ.get(ENV, "") == "default":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
