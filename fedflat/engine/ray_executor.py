"""``executor: ray``: a round's clients spread over long-lived Ray workers, with the same results.

Each worker is a Ray actor that holds, for the whole run, the training data (put once in Ray's object
store, not once per round or client), its own model and its own :class:`ClientRuntime` (sequential or
vectorized engine on its device). Per round the driver puts the broadcast once, assigns the sampled
clients to workers longest-first by their local step counts (known before training), ships each client's
state rows from its store, and reduces the results in ascending client-id order. Every client's work is
a pure function of what it is sent (:func:`fedflat.engine.client.fit`), so which worker ran it, and in
which order results came back, never changes a number.

A worker that dies mid-round costs a redo, never a wrong result: nothing a client computed is used until
the whole round is back, its clients are trained again on another (or the restarted) worker, and if no
worker is left the run stops with its last checkpoint intact (``fedflat resume`` continues it).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import replace
from typing import Any, Callable

import numpy as np
import torch

from fedflat import plugins
from fedflat.config import ExecutorConfig
from fedflat.core import Broadcast, ClientResult, ConfigError, merge_results
from fedflat.data import augmentation_fn
from fedflat.engine.client import ClientBatches
from fedflat.engine.runtime import (ClientRuntime, RoundTask, StateLoader, WorkerSpec, build_client_runtime,
                                    longest_first, rows_loader)
from fedflat.engine.cores import default_cpus, retain_freed_memory

RAY_HINT = "executor=ray needs Ray: pip install 'fedflat[ray]' (Ray 2.55.1)"
# A Ray instance this process starts for itself listens on a loopback address only: Ray replaces 127.0.0.1
# itself by the machine's network address (to be reachable from other nodes), so another address of the
# loopback range is used, where Linux has one (macOS has only 127.0.0.1, which Ray keeps local there).
LOCAL_NODE_IP = "127.0.0.2" if sys.platform.startswith("linux") else None


class WorkersLost(RuntimeError):
    """Every Ray worker died: the round cannot be completed (the run stops with its last checkpoint)."""


def require_ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(RAY_HINT) from None
    return ray


def build_runtime(spec: WorkerSpec, data: tuple[np.ndarray, np.ndarray, list[np.ndarray]]) -> ClientRuntime:
    """A worker's runtime: its model, oracle and batches on its device, from the spec and the shared data."""
    plugins.load(spec.plugins)  # a fresh process: the config's own parts, recipes and models first
    retain_freed_memory()  # this worker's process, before the data's copy (the driver's: its Simulation)
    device = torch.device("cuda" if spec.use_gpu else "cpu")
    x, y, indices = data
    batches = ClientBatches(torch.tensor(x, device=device), torch.tensor(y, device=device),
                            [torch.tensor(ix, dtype=torch.long, device=device) for ix in indices],
                            spec.settings.batch_size, spec.settings.seed,
                            augmentation_fn(spec.augmentation), spec.standardize)
    return build_client_runtime(spec, batches, device)


Data = tuple[np.ndarray, np.ndarray, list[np.ndarray]]


class ClientWorker:
    """The body of a Ray actor: one long-lived client runtime (made a Ray actor class by :func:`worker_class`).

    :meth:`setup` builds the runtime; ``data`` comes boxed (``[ref]``) so the actor fetches it from the
    object store itself. A live actor can be set up again for another run on the same workers."""

    def __init__(self):
        self.runtime: ClientRuntime | None = None

    def setup(self, spec: WorkerSpec, boxed_data: list) -> int:
        import ray

        self.spec = spec
        self.runtime = build_runtime(spec, ray.get(boxed_data[0]))
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def fit(self, shared: Broadcast, personal: dict[str, torch.Tensor], task: RoundTask,
            state: dict[str, torch.Tensor], known: dict[str, torch.Tensor]) -> ClientResult:
        """The clients of ``task`` trained from the broadcast (shared part + their personal rows) and their
        own state rows (``[C, P]`` in the order of ``task.ids``)."""
        if self.runtime is None:
            raise RuntimeError("this Ray worker was not set up: call setup(spec, [data_ref]) first")
        shared, personal, task, state, known = from_wire((shared, personal, task, state, known), copy=True)
        broadcast = replace(shared, ids=task.ids, personal=personal)
        return to_wire(self.runtime.fit(broadcast, task, rows_loader(task.ids, state, known)).to("cpu"))


# Tensors cross the object store as NumPy arrays: Ray writes an array's memory into the store once and reads it
# back without a copy, where a pickled torch tensor is copied into bytes on both sides (W1, five clients' uploads of
# 0.8 MB each: 7.5 ms as arrays against 15 ms as tensors a round trip; docs/benchmarks.md, "CPU speed").
_NO_NUMPY = (torch.bfloat16,)  # dtypes NumPy has not: these travel as tensors


def _first_line(err: BaseException) -> str:
    """The first line of Ray's error (its message goes on with the actor's whole history)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def to_wire(obj: Any) -> Any:
    """``obj`` (a tensor, a dict, list or tuple of them, or a dataclass holding them) with every CPU tensor as a
    NumPy array sharing its memory; :func:`from_wire` undoes it."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.dtype in _NO_NUMPY else obj.detach().cpu().numpy()
    return _map(obj, to_wire)


def from_wire(obj: Any, copy: bool) -> Any:
    """The tensors of :func:`to_wire`'s ``obj``: copies (``copy``: a worker's inputs, which the parts may write to),
    or views of the received arrays (the driver's results, which :func:`merge_results` copies anyway)."""
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj.copy()) if copy else _view(obj)
    return _map(obj, lambda x: from_wire(x, copy))


def _view(array: np.ndarray) -> torch.Tensor:
    """A tensor over an array of the object store (read-only), without a copy: never written, only read and copied."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the given NumPy array is not writable"
        return torch.from_numpy(array)


def _map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(obj, dict):
        return {k: fn(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(fn(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: fn(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                            if f.init})
    return obj


def worker_class(ray):
    return ray.remote(ClientWorker)


class RayExecutor:
    """Trains a round's clients on ``workers`` Ray actors (see the module docstring)."""

    name = "ray"

    def __init__(self, spec: WorkerSpec, data: Data, cfg: ExecutorConfig, actors: list | None = None):
        """``actors``: live workers to reuse (given a new runtime; not ended by :meth:`close`) instead of
        starting ``cfg.workers`` new ones."""
        self.ray = ray = require_ray()
        self.cfg, self.spec = cfg, spec
        self.cpus = cfg.cpus_per_worker or default_cpus(cfg.workers)
        self.owns_actors = actors is None
        self.actors = []
        start = time.perf_counter()
        self.started_ray = connect(ray, cfg, spec.plugins)
        self.connect_seconds = time.perf_counter() - start  # ray.init of a local instance, or joining a cluster
        try:
            start = time.perf_counter()
            self.data_ref = ray.put(data)  # held for the executor's life: replacement workers read it again
            if actors is None:
                self._check_resources()
                self.actors = [self._new_actor() for _ in range(cfg.workers)]
            else:
                self.actors = list(actors)
            # every worker builds its runtime now: fail here, not in round 0, if one cannot start
            ray.get([a.setup.remote(spec, [self.data_ref]) for a in self.actors])
            self.startup_seconds = time.perf_counter() - start
        except BaseException:
            self.close()
            raise
        self.failures = [0] * len(self.actors)  # worker deaths seen by this executor
        self.redone_clients = 0
        self.deaths: list[dict[str, Any]] = []  # each death not yet taken by the run (take_deaths)

    def _new_actor(self):
        cls = worker_class(self.ray).options(num_cpus=self.cpus, num_gpus=self.cfg.gpus_per_worker,
                                             max_restarts=0, max_task_retries=0)
        return cls.remote()

    def _replace(self, worker: int) -> None:
        """Starts a fresh worker in place of a dead one, while ``executor.max_restarts`` allows (only for
        workers this executor started)."""
        if not self.owns_actors or self.failures[worker] > self.cfg.max_restarts:
            return
        actor = self._new_actor()
        try:
            self.ray.get(actor.setup.remote(self.spec, [self.data_ref]))
        except self.ray.exceptions.RayActorError:
            self.failures[worker] = self.cfg.max_restarts + 1  # cannot even start: give this slot up
            return
        self.actors[worker] = actor

    def _check_resources(self, patience_s: float = 30.0) -> None:
        """Workers that cannot all be placed would wait forever: refuse them up front, saying why. Resources
        that exist but are still held (by workers of a run that just ended) get ``patience_s`` to free up."""
        need_cpu, need_gpu = self.cfg.workers * self.cpus, self.cfg.workers * self.cfg.gpus_per_worker

        def fits(resources: dict) -> bool:
            return need_cpu <= resources.get("CPU", 0) + 1e-9 and need_gpu <= resources.get("GPU", 0) + 1e-9

        total, free = self.ray.cluster_resources(), self.ray.available_resources()
        deadline = time.monotonic() + patience_s
        while fits(total) and not fits(free) and time.monotonic() < deadline:
            time.sleep(0.2)
            free = self.ray.available_resources()
        if not fits(free):
            raise ConfigError(
                f"executor.workers={self.cfg.workers} need {need_cpu:g} CPUs and {need_gpu:g} GPUs, but the Ray cluster "
                f"has {total.get('CPU', 0):g} CPUs and {total.get('GPU', 0):g} GPUs ({free.get('CPU', 0):g} CPUs and "
                f"{free.get('GPU', 0):g} GPUs free): lower executor.workers, executor.cpus_per_worker or "
                "executor.gpus_per_worker, or add nodes (docs/distributed.md)")

    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and monitoring)."""
        return self.ray.get([a.pid.remote() for a in self.actors])

    def _alive(self) -> list[int]:
        limit = self.cfg.max_restarts if self.owns_actors else 0
        return [w for w, n in enumerate(self.failures) if n <= limit]

    def fit(self, broadcast: Broadcast, task: RoundTask, load_state: StateLoader) -> ClientResult:
        ray = self.ray
        shared = ray.put(to_wire(replace(broadcast.to("cpu"), ids=None, personal={})))  # once, for every worker

        def submit(worker: int, rows: torch.Tensor):
            sub = task.rows(rows)
            state, known = load_state(sub.ids)
            personal = {k: v.cpu() for k, v in broadcast.for_clients(sub.ids).personal.items()}
            return self.actors[worker].fit.remote(shared, *to_wire((personal, sub, state, known)))

        pending = {submit(w, rows): (w, rows) for w, rows in longest_first(task.steps, self._alive()).items()}
        results = []
        while pending:
            (ref,), _ = ray.wait(list(pending), num_returns=1)
            worker, rows = pending.pop(ref)
            try:
                results.append(from_wire(ray.get(ref), copy=False))
            except ray.exceptions.RayActorError as err:
                self.failures[worker] += 1
                self.redone_clients += len(rows)
                self._replace(worker)
                death = {"worker": worker, "clients": len(rows), "error": _first_line(err),
                         "restarted": self.failures[worker] <= self.cfg.max_restarts and self.owns_actors}
                self.deaths.append(death)
                target = self._redo_on(worker, pending)
                death["redone_on"] = target
                pending[submit(target, rows)] = (target, rows)
            except ray.exceptions.RayTaskError as err:
                raise err.as_instanceof_cause() from None
        return merge_results(results)

    def take_deaths(self) -> list[dict[str, Any]]:
        """The worker deaths since the last call: worker index, its clients (trained again on ``redone_on``),
        Ray's error, whether a fresh worker took its place; the run records them (summary.json's
        ``worker_deaths``)."""
        deaths, self.deaths = self.deaths, []
        return deaths

    def _redo_on(self, failed: int, pending: dict) -> int:
        """A worker for the clients of ``failed``: the live one with the least pending work (the replacement
        of ``failed`` itself when it is the only one left)."""
        alive = self._alive()
        if not alive:
            raise WorkersLost(f"all {len(self.actors)} Ray workers died (each restarted up to "
                              f"executor.max_restarts={self.cfg.max_restarts} times); the round was not completed")
        busy = {w: 0 for w in alive}
        for w, rows in pending.values():
            if w in busy:
                busy[w] += len(rows)
        return min(alive, key=lambda w: (w == failed, busy[w], w))

    def close(self) -> None:
        """Ends the workers it started, and the local Ray instance when the last executor using it closes."""
        if self.ray.is_initialized():
            for actor in self.actors if self.owns_actors else []:
                try:
                    self.ray.kill(actor)
                except Exception:  # already gone
                    pass
        self.actors = []
        if self.started_ray:
            release(self.ray)
            self.started_ray = False


# executors using the Ray connection fedflat opened (0: fedflat opened none), and the watchdog of the Ray it started
_SESSION: dict[str, Any] = {"executors": 0}


def connect(ray, cfg: ExecutorConfig, plugin_names: tuple[str, ...] | list[str] = ()) -> bool:
    """Joins the Ray cluster of ``executor.address`` or starts a local one. True when fedflat opened the
    connection (now or for an executor still open): :func:`release` then closes it after the last user.
    A connection the caller opened (``ray.init`` before fedflat) is used and left alone. A cluster's workers on
    other machines receive ``plugin_names``' code through Ray's ``py_modules`` (local ones inherit PYTHONPATH)."""
    if ray.is_initialized():
        if _SESSION["executors"]:
            _SESSION["executors"] += 1
            return True
        return False
    # CPU workers train on device cpu explicitly; take Ray's future default quietly (its FutureWarning says so).
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    if not sys.stderr.isatty():  # the workers' lines in a log or a pipe: no colour codes around their prefixes
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    options = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
    try:
        if cfg.address:
            host = cfg.address.rsplit(":", 1)[0]
            warn_if_open(host)
            if host.startswith("127."):  # a cluster on a loopback address is on this machine: join it there
                options["_node_ip_address"] = host
            shipped = plugins.package_folders(plugin_names)
            if shipped:
                options["runtime_env"] = {"py_modules": shipped}
            ray.init(address=cfg.address, **options)
        else:
            # Ray lowers its workers' priority (nice 15) by default, for a driver that schedules and waits;
            # here the workers do the training, and at nice 15 any other job on a shared machine starves them.
            ray.init(address="local", _node_ip_address=LOCAL_NODE_IP, _system_config={"worker_niceness": 0},
                     **options)
            _SESSION["reaper"] = start_reaper(ray)
        protect_token_file()
    except ConnectionError as err:
        raise ConfigError(f"executor.address={cfg.address!r}: no Ray cluster answered ({err}); start one with "
                          "`ray start --head` (docs/distributed.md) or leave executor.address unset; a cluster "
                          f"started with RAY_AUTH_MODE=token answers only a driver holding its token{token_hint()}"
                          ) from None
    _SESSION["executors"] = 1
    return True


AUTH_MODE_ENV = "RAY_AUTH_MODE"


def token_hint() -> str:
    """What a driver needs to join a cluster that requires Ray's token authentication, if it lacks it."""
    if os.environ.get(AUTH_MODE_ENV, "").lower() == "token":
        return " (this driver's RAY_AUTH_MODE is token: is RAY_AUTH_TOKEN_PATH, RAY_AUTH_TOKEN or ~/.ray/auth_token " \
               "the cluster's token?)"
    return ": export RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH=FILE (the cluster's token) before the run"


def protect_token_file() -> None:
    """Makes Ray's default token file (``~/.ray/auth_token``, which Ray 2.55 writes readable by every account of the
    machine when ``RAY_AUTH_MODE=token`` makes it one) readable by its owner only."""
    if os.environ.get(AUTH_MODE_ENV, "").lower() != "token":
        return
    from pathlib import Path

    token = Path.home() / ".ray" / "auth_token"
    try:
        if token.is_file() and token.stat().st_uid == os.getuid() and token.stat().st_mode & 0o077:
            token.chmod(0o600)
    except OSError:
        pass  # (another account's file, or gone: nothing of ours to protect)


def warn_if_open(host: str) -> None:
    """Warns when this driver joins a cluster on a network address without Ray's token authentication: such a
    cluster runs the code of whoever reaches its ports (docs/distributed.md#several-nodes). A loopback address
    is this machine's."""
    if host in ("auto", "localhost") or host.startswith(("127.", "ray://127.", "ray://localhost")):
        return
    if os.environ.get(AUTH_MODE_ENV, "").lower() != "token":
        logging.getLogger(__name__).warning(
            "joining the Ray cluster at %s without token authentication (RAY_AUTH_MODE is not 'token'): whoever "
            "reaches its ports runs code on every machine of it; start the cluster and this run with "
            "RAY_AUTH_MODE=token and its token (docs/distributed.md#several-nodes)", host)


def start_reaper(ray):
    """A watchdog that ends the local Ray instance this process started when this process is gone, even killed by
    SIGKILL (:mod:`fedflat.engine.reaper`); None where there is no ``/proc``. It watches a pipe only this process
    holds: :func:`release` closes it after ``ray.shutdown()``."""
    if not os.path.isdir("/proc"):
        return None
    import subprocess
    from pathlib import Path

    node = ray._private.worker._global_node  # the processes ray.init started: GCS, raylet, monitors
    roots = [str(p.process.pid) for infos in node.all_processes.values() for p in infos if p.process is not None]
    return subprocess.Popen([sys.executable, str(Path(__file__).with_name("reaper.py")), *roots],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def release(ray) -> None:
    """One executor fewer on fedflat's own Ray connection; the last one shuts it down (and its watchdog ends)."""
    _SESSION["executors"] = max(0, _SESSION["executors"] - 1)
    if _SESSION["executors"] == 0:
        if ray.is_initialized():
            ray.shutdown()
        reaper = _SESSION.pop("reaper", None)
        if reaper is not None:
            reaper.stdin.close()  # it ends what is left and exits (subprocess reaps it later: no wait here)
