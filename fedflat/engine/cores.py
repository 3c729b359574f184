"""The CPU machine as a run's process uses it: torch threads that never oversubscribe the cores (``threads: auto``,
the default), each worker's share of the cores, and a heap that keeps the memory a step freed.

**Threads and cores.** Measured on the 2-core machine of docs/benchmarks.md ("Threads"): with torch's default of
one thread per core, two quickstart runs sharing the cores took more than 300 s for 30 rounds that take 11 s alone
(OpenMP threads spin-waiting for peers that another process has descheduled); with one thread each, 22 s. On small
per-step work a second thread buys little even alone (W1: 2.0 vs 1.8 ms per step, 0.044 GFLOP), on large work it
nearly halves the step (W2 0.8 GFLOP: 35 vs 20 ms; ResNet-18, 166 GFLOP: 4.9 vs 2.6 s). So:

- ``auto`` takes one thread when a local step is small (below ``SMALL_STEP_FLOPS``), otherwise this
  process's share of the cores: the cores it may run on divided by the processes sharing them (sweep
  workers, Ray workers — each sets its share with :func:`set_core_share`);
- OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``, set when fedflat is imported unless you
  set it): two 2-thread runs sharing 2 cores then took 30 s instead of more than 300 s. It costs up to
  ~20% on one multi-threaded run alone on its cores; export ``OMP_WAIT_POLICY=ACTIVE`` to trade back.

**The heap** (:func:`retain_freed_memory`). glibc's allocator is set for training, so a step's large tensors reuse the
heap's freed memory, not fresh pages. PyTorch's CPU tensors come from ``malloc``. glibc serves a block above its mmap
threshold (128 KiB, raised as large blocks are freed, to 32 MiB at most) with a fresh mapping and returns it to the
kernel when freed, and it gives the top of its heap back above its trim threshold; the next step's tensors then land on
pages the kernel zero-fills on first touch. On W2 (a CNN, 50 clients a round, 800k parameters) that was 110,000 page
faults a round in the driver and 120,000 in each Ray worker, about 0.2 s of a 2.2 s round (docs/benchmarks.md, "CPU
speed"). With the mmap threshold at 256 MiB and the trim threshold at 512 MiB the heap keeps what it had: a
few faults a round after the first two. A process then keeps up to 512 MiB of freed memory for its next step (blocks of
256 MiB and more are still mapped and returned one by one), as PyTorch's GPU caching allocator keeps its own.

Every run's process sets it once: a :class:`~fedflat.engine.simulation.Simulation` (the driver, a Flower node, a sweep
cell, and so the threads executor's process) and a Ray worker's runtime; ``FEDFLAT_MALLOC=default`` keeps glibc's own
settings. Elsewhere (macOS, Windows, musl) it does nothing.
"""
from __future__ import annotations

import ctypes
import os
import sys
from contextlib import contextmanager
from typing import Iterator

MMAP_THRESHOLD = 256 << 20  # blocks below it come from the heap (W2's [50, 800k] uploads: 160 MB)
TRIM_THRESHOLD = 512 << 20  # free memory at the heap's top kept up to this
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
ENV = "FEDFLAT_MALLOC"
_DONE: list[bool] = []

SMALL_STEP_FLOPS = 1e8  # FLOPs of one local step (forward + backward of a batch) below which one thread is best
_CORE_SHARE: list[int | None] = [None]


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and schedulers set)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def set_core_share(cores: int | None) -> None:
    """Declares how many cores this process may use (a sweep or Ray worker sharing the machine); None: all."""
    _CORE_SHARE[0] = None if cores is None else max(1, int(cores))


def core_share() -> int:
    """This process's cores: its declared share, never more than it may run on."""
    return min(_CORE_SHARE[0] or available_cores(), available_cores())


def choose_threads(requested: int | str | None, step_flops: float | None = None,
                   cores: float | None = None) -> int | None:
    """Torch intra-op threads for a run: ``requested`` when it is a number; None (torch's own choice) when it
    is None; for ``"auto"``, 1 for small steps and the process's core share otherwise (``cores``, or what
    :func:`set_core_share` declared, or every available core)."""
    if requested is None or isinstance(requested, int):
        return requested
    if step_flops is not None and step_flops < SMALL_STEP_FLOPS:
        return 1
    return max(1, int(cores)) if cores is not None else core_share()


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Sets torch's intra-op threads for the block and restores the caller's count after it."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def default_cpus(workers: int) -> float:
    """The cores of this machine shared evenly among ``workers`` Ray workers (Ray accepts fractions)."""
    return max(available_cores() / workers, 0.01)


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
