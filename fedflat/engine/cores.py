"""Torch threads that never oversubscribe the cores (``threads: auto``, the default): thread counts and core shares.

Measured on the 2-core machine of docs/benchmarks.md ("Threads"): with torch's default of one thread per core,
two quickstart runs sharing the cores took more than 300 s for 30 rounds that take 11 s alone (OpenMP
threads spin-waiting for peers that another process has descheduled); with one thread each, 22 s. On small
per-step work a second thread buys little even alone (W1: 2.0 vs 1.8 ms per step, 0.044 GFLOP), on large
work it nearly halves the step (W2 0.8 GFLOP: 35 vs 20 ms; ResNet-18, 166 GFLOP: 4.9 vs 2.6 s). So:

- ``auto`` takes one thread when a local step is small (below ``SMALL_STEP_FLOPS``), otherwise this
  process's share of the cores: the cores it may run on divided by the processes sharing them (sweep
  workers, Ray workers — each sets its share with :func:`set_core_share`);
- OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE``, set when fedflat is imported unless you
  set it): two 2-thread runs sharing 2 cores then took 30 s instead of more than 300 s. It costs up to
  ~20% on one multi-threaded run alone on its cores; export ``OMP_WAIT_POLICY=ACTIVE`` to trade back.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

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
