"""The executor factory: where a round's clients train (``executor.name``), made in one place.

``local`` trains them in the driver's :class:`~fedflat.engine.runtime.ClientRuntime`, ``threads`` on threads of
this process each with a runtime of its own (:class:`~fedflat.engine.runtime.ThreadExecutor`), ``ray`` on Ray worker
processes (:class:`~fedflat.engine.ray_executor.RayExecutor`). Each has ``fit(broadcast, task, load_state)`` and
``close()``; the numbers are the same bits on every one.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Protocol

import torch

from fedflat.config import ExecutorConfig
from fedflat.core import Broadcast, ClientResult, ConfigError
from fedflat.engine.modes import module_name
from fedflat.engine.ray_executor import RayExecutor
from fedflat.engine.runtime import (ClientRuntime, LocalExecutor, RoundTask, StateLoader, ThreadExecutor, WorkerSpec,
                                    build_client_runtime)


class Executor(Protocol):
    """Where a round's clients train: :class:`LocalExecutor`, :class:`ThreadExecutor` or
    :class:`fedflat.engine.ray_executor.RayExecutor` (:func:`make_executor`)."""

    name: str

    def fit(self, broadcast: Broadcast, task: RoundTask, load_state: StateLoader) -> ClientResult: ...

    def close(self) -> None: ...


def make_executor(executor: ExecutorConfig, runtime: ClientRuntime, spec: Callable[..., WorkerSpec],
                  data: Callable[[], tuple]) -> Executor:
    """The run's executor (``executor.name``): ``local`` trains on the driver's ``runtime``; ``threads`` on it and
    ``executor.workers - 1`` runtimes built again from ``spec(...)`` over its data (their models drawn on a forked
    generator: the driver's random streams are untouched); ``ray`` on Ray workers that each build a runtime from
    ``spec()`` and hold ``data()`` (sent once)."""
    if executor.name == "local":
        return LocalExecutor(runtime)
    if executor.name == "threads":
        traits = runtime.oracle.traits
        if traits.random is not None:
            raise ConfigError(f"executor=threads: model {module_name(runtime.model.module)} draws random numbers "
                              f"({traits.random}) from PyTorch's global generator, which threads would share; "
                              "use executor=local or executor=ray")
        # threads=None: the driver's own torch threads, already set, are the ones the thread workers share
        worker = spec(compute=replace(runtime.options, threads=None))
        with torch.random.fork_rng(devices=[]):
            others = [build_client_runtime(worker, runtime.batches, runtime.device)
                      for _ in range(executor.workers - 1)]
        return ThreadExecutor([runtime, *others])
    return RayExecutor(spec(), data(), executor)
