"""A sweep's cells: one run folder each, run, resumed or skipped by what the folder holds, one at a time, in
processes side by side (``--workers N`` or ``auto``: :mod:`fedflat.experiments.packing`), or as Ray tasks.

:func:`run_cells` is what a sweep (:func:`fedflat.experiments.sweep.run_sweep`) and a tune study
(:mod:`fedflat.experiments.tune`) run their cells with; :func:`run_cell` runs one, and never raises: a cell's failure
is recorded in its result and ``FOLDER/error.txt`` while the others go on. A cell's process dies with the sweep
(Linux), and Ctrl-C stops the running cells, which write their checkpoints, before it starts no new one.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable

from fedflat.config import Config, load_config, read_yaml, resolve
from fedflat.core import ConfigError
from fedflat.engine.cores import available_cores
from fedflat.experiments.packing import Footprint, Packing
from fedflat.experiments.report import flatten
from fedflat.experiments.rundir import FINISHED, LOCK, TRACKING_FILE, RunFolderBusy, hold
from fedflat.files import atomic_write_text, json_safe, read_jsonl


@dataclass
class Cell:
    """One run of a sweep: its folder name, the option chosen on each axis, its overrides."""

    name: str
    options: dict[str, str]
    overrides: list[tuple[str, Any]]
    config: Config | None = None
    error: str | None = None

    def __post_init__(self) -> None:
        name = self.name  # its folder is OUT/name: nothing may lead elsewhere, or onto the sweep's .lock
        if not name or name.startswith(".") or any(c in name for c in ("/", "\\", "\0")):
            raise ConfigError(f"cell name {name!r} is not a folder name inside the sweep folder: name options and "
                              f"methods with letters, digits and . _ = - (not starting with .)")

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "options": self.options,
                "overrides": [f"{k}={json.dumps(v) if not isinstance(v, str) else v}" for k, v in self.overrides]}


def _comparable(tree: dict[str, Any]) -> dict[str, Any]:
    """The config keys that make a cell's results: all but where it runs, and its length (``rounds``, which a
    rerun may extend: the learning rate decays per round, so an extended run equals one planned that long)."""
    tree = copy.deepcopy(tree)
    for key in ("out", "threads", "device", "rounds", "loggers", "tensorboard"):
        tree.pop(key, None)
    return json.loads(json.dumps(json_safe(tree)))


def config_change(on_disk: dict[str, Any], cfg: Config) -> str | None:
    """How ``cfg`` differs from a cell's ``config.yaml`` in the keys that make its results, or None.

    Both are read by this version of fedflat, so a key added since the cell ran (say ``algo.personalization``)
    compares at its default and leaves the cell valid; a changed value, or a key this version no longer
    knows, is a change."""
    try:
        then = _comparable(resolve(load_config(None, (), base=on_disk)))
    except ConfigError as err:
        return f"its config.yaml is not a valid config now ({err})"
    now = _comparable(resolve(cfg))
    if then == now:
        return None
    then_flat, now_flat = flatten(then), flatten(now)
    changed = [key for key in sorted(set(then_flat) | set(now_flat)) if then_flat.get(key) != now_flat.get(key)]
    shown = ", ".join(f"{key}: {then_flat.get(key)!r} there, {now_flat.get(key)!r} here" for key in changed[:3])
    return shown + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")


def cell_state(folder: Path, cfg: Config | None) -> tuple[str, str | None]:
    """``(state, reason)``: 'new', 'completed', 'diverged', 'resume' (unfinished, or completed with fewer rounds
    than ``cfg`` asks: a rerun with more ``rounds`` extends it) or 'stale' (config changed, or fewer rounds)."""
    if not folder.exists():
        return "new", None
    config_file, summary_file = folder / "config.yaml", folder / "summary.json"
    if not config_file.exists():
        return "new", None  # killed before its config was written: nothing worth keeping
    extend = False
    if cfg is not None:
        on_disk = read_yaml(config_file.read_text())
        change = config_change(on_disk, cfg)
        if change is not None:
            return "stale", (f"{folder} holds a run of a different config ({change}); delete the folder or "
                             "change the sweep's out")
        planned = on_disk.get("rounds", cfg.rounds)
        if cfg.rounds < planned:
            return "stale", (f"{folder} holds a run of {planned} rounds: rounds={cfg.rounds} cannot shorten it "
                             f"(rerun with rounds={planned} or more, or change the sweep's out)")
        extend = cfg.rounds > planned
    if summary_file.exists():
        status = json.loads(summary_file.read_text()).get("status")
        if status in FINISHED and not (status == "completed" and extend):
            return status, None
    return "resume", None


def run_cell(tree: dict[str, Any], folder: str, progress: bool = False, threads: int | None = None,
             group: str | None = None, job: str | None = None, callbacks: tuple = ()) -> dict[str, Any]:
    """Runs, resumes or skips one cell; never raises (errors are recorded in the result and
    ``FOLDER/error.txt``). ``tree`` is the cell's config (a plain tree, so it crosses processes); ``group``
    (the sweep's name) and ``job`` group its tracked runs."""
    if threads:
        from fedflat.engine.cores import set_core_share

        set_core_share(threads)  # this worker's share of the cores: `threads: auto` stays within it
    folder_path = Path(folder)
    folder_path.mkdir(parents=True, exist_ok=True)
    try:
        with hold(folder_path):  # one writer per cell: a second sweep over the same cells is refused here
            return _run_held_cell(tree, folder_path, progress, group, job, callbacks)
    except RunFolderBusy as err:
        return {"status": "busy", "reason": str(err), "action": "none"}


def _run_held_cell(tree: dict[str, Any], folder_path: Path, progress: bool, group: str | None,
                   job: str | None, callbacks: tuple = ()) -> dict[str, Any]:
    from fedflat.experiments.resume import resume
    from fedflat.experiments.runner import run_experiment

    start = time.perf_counter()
    try:
        cfg = load_config(None, (), base=tree)
        state, reason = cell_state(folder_path, cfg)
        if state in FINISHED:
            return _result(folder_path, "skipped")
        if state == "stale":
            return {"status": "failed", "reason": reason, "action": "none"}
        if state == "new":  # killed before its config was written: start afresh (the lock stays ours)
            for leftover in folder_path.iterdir():  # (the tracked runs' ids stay: the start continues them)
                if leftover.name not in (LOCK, TRACKING_FILE):
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
            run_experiment(cfg, run_dir=folder_path, progress=progress, group=group, job=job, callbacks=callbacks)
        else:
            resume(folder_path, config=cfg, progress=progress, group=group, job=job, callbacks=callbacks)
        return _result(folder_path, "resumed" if state == "resume" else "ran", time.perf_counter() - start)
    except BaseException as err:  # noqa: BLE001 - a cell's failure must not stop the sweep
        if isinstance(err, KeyboardInterrupt):
            raise
        atomic_write_text(folder_path / "error.txt", traceback.format_exc())
        return {"status": "failed", "reason": f"{type(err).__name__}: {err}", "action": "failed",
                "seconds": time.perf_counter() - start}


def _result(folder: Path, action: str, seconds: float = 0.0) -> dict[str, Any]:
    s = json.loads((folder / "summary.json").read_text())
    return {"status": s.get("status"), "reason": s.get("reason"), "action": action, "seconds": seconds,
            "rounds": s.get("rounds"), "final_test_acc": s.get("final_test_acc"),
            "best_test_acc": s.get("best_test_acc"),
            **({"final_val_acc": s.get("final_val_acc"), "best_val_acc": s.get("best_val_acc")}
               if s.get("evaluated_on") == "val" else {})}


def _rounds_done(folder: Path) -> int:
    """The last round a cell's folder has metrics of (0: none yet, or none readable: this only orders the cells and
    shows their progress; the cell's run checks its folder itself and records what it finds wrong)."""
    try:
        lines = read_jsonl(folder / "metrics.jsonl")
        return int(lines[-1]["round"]) if lines else 0
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def longest_first(todo: list[Cell], out: Path) -> list[Cell]:
    """The cells to run side by side, in decreasing expected work, ties in the sweep's order (longest processing time
    first, Graham 1969): the sweep then ends soon after its longest cell instead of starting it last, and on a GPU the
    first cell, whose footprint decides how many fit (:mod:`fedflat.experiments.packing`), is the heaviest method's.
    A cell's work is estimated as its rounds left x clients a round x local steps (or epochs) x backward passes a
    step, which within a sweep over one dataset and model is proportional to the backward passes it will take."""
    def work(cell: Cell) -> int:
        cfg = cell.config
        left = max(cfg.rounds - _rounds_done(out / cell.name), 0)
        local = cfg.train.local_steps or cfg.train.local_epochs
        return left * cfg.sampling.clients_per_round * local * cfg.algo.build().backprops_per_step

    return sorted(todo, key=work, reverse=True)  # (a stable sort, reversed or not)


@dataclass
class RayCells:
    """Where a sweep's cells run on Ray: the cluster (None: a local instance; ``auto``; ``HOST:PORT``) and
    what each cell reserves (its run's torch threads follow ``cpus``)."""

    address: str | None = None
    cpus: float = 1.0
    gpus: float = 0.0


def run_cells(cells: list[Cell], out: Path, workers: int | str = 1, progress: bool = True, ray: RayCells | None = None,
              on_record: Callable[[dict[str, dict[str, Any]]], None] | None = None, group: str | None = None,
              job: str | None = None) -> dict[str, dict[str, Any]]:
    """Runs, resumes or skips each cell in ``out/<cell name>``, ``workers`` at a time or as Ray tasks; a cell
    with an invalid config is recorded as failed. Returns each cell's result by name; ``on_record`` sees the
    results so far after every cell (and once before the first). The cells' loggers are checked first (a
    logger that cannot start stops the sweep before any cell runs, unless optional); their tracked runs are
    grouped by ``group`` and ``job``."""
    if workers != "auto" and (not isinstance(workers, int) or workers < 1):
        raise ConfigError(f"sweep workers must be a whole number at least 1 or auto, got {workers!r}")
    out.mkdir(parents=True, exist_ok=True)
    # one sweep per folder: two at once each found the other's live cells busy and wrote that in sweep.json
    with hold(out, "sweep folder"):
        return _run_held_cells(cells, out, workers, progress, ray, on_record, group, job)


def _run_held_cells(cells: list[Cell], out: Path, workers: int | str, progress: bool, ray: RayCells | None,
                    on_record: Callable[[dict[str, dict[str, Any]]], None] | None, group: str | None,
                    job: str | None) -> dict[str, dict[str, Any]]:
    from fedflat.progress import progress_bar

    _mlflow_store_in(cells, out.parent if job is not None else out)  # a tune study's: above trials/ and final/
    _prepare_loggers([c for c in cells if c.config is not None], group)
    results: dict[str, dict[str, Any]] = {}
    for cell in cells:
        if cell.error:
            results[cell.name] = {"status": "failed", "reason": cell.error, "action": "invalid config"}
    todo = [c for c in cells if c.name not in results]
    if on_record:
        on_record(results)
    bar = progress_bar(total=len(cells), initial=len(results), desc="cells", unit="cell", enabled=progress,
                       dynamic_ncols=True, position=0)

    def record(cell: Cell, result: dict[str, Any]) -> None:
        results[cell.name] = result
        if on_record:
            on_record(results)
        bar.update(1)
        if result["action"] != "skipped" and progress:
            acc = result.get("final_test_acc")
            bar.write(f"{cell.name}: {result['status']}" + (f", final test acc {acc:.4f}" if acc is not None else "")
                      + (f" ({result['reason']})" if result.get("reason") else ""))

    try:
        if ray is not None:
            _run_on_ray(out, todo, ray, record, bar, group, job)
        elif workers == 1:
            for cell in todo:
                bar.set_postfix_str(cell.name)
                try:
                    result = run_cell(cell.config.model_dump(), str(out / cell.name), progress=progress,
                                      group=group, job=job)
                except KeyboardInterrupt:
                    record(cell, interrupted_cell(out / cell.name))
                    raise
                record(cell, result)
        else:
            _run_in_processes(out, todo, workers, record, bar, group, job)
    finally:
        bar.close()
    return results


def _mlflow_store_in(cells: list[Cell], folder: Path) -> None:
    """An ``mlflow`` logger that names no store (no ``tracking_uri``, no ``$MLFLOW_TRACKING_URI``) writes the
    sweep's runs to ``FOLDER/mlflow.db``, not MLflow's default ``mlflow.db`` in the working folder: the sweep's
    results stay together (``loggers`` is not part of what makes a cell, so finished cells stay finished)."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return
    uri = f"sqlite:///{(folder / 'mlflow.db').absolute()}"
    for cell in cells:
        if cell.config is None or not any(e.name == "mlflow" and e.tracking_uri is None for e in cell.config.loggers):
            continue
        loggers = [e.model_copy(update={"tracking_uri": uri}) if e.name == "mlflow" and e.tracking_uri is None else e
                   for e in cell.config.loggers]
        cell.config = cell.config.model_copy(update={"loggers": loggers})


def _prepare_loggers(cells: list[Cell], group: str | None) -> None:
    """Each distinct ``loggers`` setting of the cells checked once, here, before any cell starts: a missing
    library or an unusable store is one message instead of a failure per cell, and a store shared by the cells
    (an SQLite file) is made before they write to it at once."""
    from fedflat.experiments.loggers import build_loggers

    seen = []
    for cell in cells:
        if cell.config.loggers and cell.config.loggers not in seen:
            seen.append(cell.config.loggers)
            build_loggers(cell.config.loggers, group)


def interrupted_cell(folder: Path) -> dict[str, Any]:
    """The true state of a cell whose run was stopped: what its summary says, and that rerunning resumes it."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    return {"status": "interrupted", "reason": summary.get("reason") or "stopped before its first round",
            "action": "interrupted", "rounds": summary.get("rounds")}


def _die_with_parent() -> None:
    """Linux: this process is killed when the sweep that started it dies, however it dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _stopped_by_the_sweep(_signum, _frame) -> None:
    raise KeyboardInterrupt("the sweep was stopped")


def _cell_process(tree: dict[str, Any], folder: str, threads: int, parent: int, results, group: str | None,
                  job: str | None, admitted=None) -> None:
    _die_with_parent()
    if os.getppid() != parent:  # the sweep died before the line above took effect
        return
    signal.signal(signal.SIGTERM, _stopped_by_the_sweep)  # _stop: the run writes its checkpoint and status
    try:
        if admitted is not None:  # started warm (packing on a GPU): imported, it waits for room on the device
            _import_the_run()
            admitted.wait()
        results.put((folder, run_cell(tree, folder, False, threads, group, job, (Footprint(folder),))))
    except KeyboardInterrupt:
        results.put((folder, interrupted_cell(Path(folder))))


def _import_the_run() -> None:
    """What a cell's run imports before its first round (torch, the engine, the FLOP counter's torch._dynamo):
    seconds a waiting cell spends while the device is busy, not after it is let in."""
    import torch._dynamo  # noqa: F401 - the model's step FLOPs are counted under it

    from fedflat.experiments import resume, runner  # noqa: F401


def _run_in_processes(out: Path, todo: list[Cell], workers: int | str, record, bar, group: str | None = None,
                      job: str | None = None) -> None:
    """At most ``workers`` cells at a time (``auto``: :class:`~fedflat.experiments.packing.Packing`), each in its own
    process that dies with the sweep. Ctrl-C (or SIGTERM through the command line) stops the running cells, which
    record a checkpoint, and starts no new one.

    Packing on a GPU, the cells' processes start warm (:meth:`~fedflat.experiments.packing.Packing.alive` of them):
    each imports what its run needs and waits until it is let in, so the cells let in when the first cell's footprint
    is known start training at once instead of starting their processes then."""
    context = get_context("spawn")
    queue = context.Queue()
    packing = Packing.of([c.config.device for c in todo], available_cores(), time.time()) if workers == "auto" else None
    threads = packing.threads if packing else max(1, available_cores() // workers)
    warm = packing is not None and packing.gpu
    if packing is not None:
        bar.write(f"sweep: {packing.reason}" if packing.limit else "sweep: the first cell runs alone for a round, "
                  "then as many cells as its GPU memory leaves room for")
    pending, running = longest_first(todo, out), {}
    gates: dict[str, Any] = {}  # warm cells' processes: the event that lets each in (held while it lives)
    started: list[Path] = []  # the cells' folders, in the order they were let in (the first one's footprint decides)

    def room() -> int:
        if packing is None:
            return workers
        decided = packing.limit is not None
        limit = packing.workers(started)
        if not decided and packing.limit is not None:
            bar.write(f"sweep: {packing.reason}")
        return limit

    def waiting() -> list[str]:
        return [folder for folder, gate in gates.items() if not gate.is_set()]

    try:
        while pending or running:
            limit = room()
            while pending and len(running) < (packing.alive(limit) if warm else limit):
                cell = pending.pop(0)
                folder = str(out / cell.name)
                gate = context.Event() if warm else None
                process = context.Process(target=_cell_process, daemon=True,
                                          args=(cell.config.model_dump(), folder, threads, os.getpid(), queue,
                                                group, job, gate))
                _start_deaf_to_ctrl_c(process)
                running[folder] = (cell, process)
                if gate is None:
                    started.append(Path(folder))
                else:
                    gates[folder] = gate
            held = waiting()
            for folder in held[:max(0, limit - (len(running) - len(held)))]:  # let in while there is room
                gates[folder].set()
                started.append(Path(folder))
            _collect(queue, running, record)
            for folder in [f for f in gates if f not in running]:  # (its process ended: the event may go)
                gates.pop(folder)
            held = waiting()
            live = [f"{c.name} r{_rounds_done(Path(f))}" for f, (c, _) in running.items() if f not in held]
            bar.set_postfix_str("; ".join(live)[:200])
    except KeyboardInterrupt:
        _stop(running, queue, record)
        raise


def _start_deaf_to_ctrl_c(process) -> None:
    """Starts a cell's process with SIGINT ignored, a disposition that survives its exec. Ctrl-C at a terminal
    signals the whole process group, and a worker it reached while still importing printed a 40-line traceback;
    the sweep stops its cells itself (:func:`_stop`: SIGTERM, which a cell's run takes as Ctrl-C)."""
    if threading.current_thread() is not threading.main_thread():  # (signal dispositions: main thread only)
        process.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        process.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _collect(queue, running: dict, record, timeout: float = 1.0) -> None:
    """Records the results that arrived, and cells whose process died without one."""
    from queue import Empty

    try:
        folder, result = queue.get(timeout=timeout)
    except Empty:
        pass
    else:
        # A stopping sweep (:func:`_stop`) may have recorded the cell from its folder already: its process put
        # its result on the queue and exited before the result was read. The folder says the same.
        if folder in running:
            cell, process = running.pop(folder)
            process.join()
            record(cell, result)
    for folder, (cell, process) in list(running.items()):
        if not process.is_alive() and process.exitcode not in (0, None):
            running.pop(folder)
            record(cell, {"status": "failed", "reason": f"worker process died (exit code {process.exitcode}); "
                                                         "rerunning the sweep resumes the cell", "action": "failed"})


def _stop(running: dict, queue, record, grace: float = 30.0) -> None:
    """Interrupts the running cells (their runs write status and checkpoint), waits ``grace`` seconds, then
    kills what is left; each cell is recorded as its folder says."""
    def settle(seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while running and time.monotonic() < deadline:
            _collect(queue, running, record, timeout=0.2)
            for folder, (cell, process) in list(running.items()):
                if not process.is_alive():
                    running.pop(folder)
                    record(cell, interrupted_cell(Path(folder)))

    for _, process in running.values():
        if process.is_alive():
            os.kill(process.pid, signal.SIGTERM)  # (cells ignore Ctrl-C: _start_deaf_to_ctrl_c)
    settle(grace)
    for folder, (cell, process) in running.items():
        process.kill()
        record(cell, interrupted_cell(Path(folder)))


def _run_on_ray(out: Path, todo: list[Cell], where: RayCells, record, bar, group: str | None = None,
                job: str | None = None) -> None:
    """Every cell a Ray task reserving ``where.cpus``/``where.gpus``; a task whose worker dies is recorded as
    failed (its folder keeps its checkpoint, so the next run of the sweep resumes it)."""
    from fedflat.config import ExecutorConfig
    from fedflat.engine.ray_executor import connect, release, require_ray

    ray = require_ray()
    started = connect(ray, ExecutorConfig(name="ray", address=where.address),
                      sorted({p for c in todo for p in c.config.plugins}))
    try:
        task = ray.remote(run_cell).options(num_cpus=where.cpus, num_gpus=where.gpus, max_retries=0)
        share = max(1, int(where.cpus))
        running = {task.remote(c.config.model_dump(), str(out / c.name), False, share, group, job): c
                   for c in longest_first(todo, out)}
        while running:
            (done,), _ = ray.wait(list(running), num_returns=1)
            cell = running.pop(done)
            try:
                result = ray.get(done)
            except (ray.exceptions.RayTaskError, ray.exceptions.WorkerCrashedError,
                    ray.exceptions.RayActorError) as err:
                result = {"status": "failed", "reason": f"ray worker: {type(err).__name__}: {err}"[:500],
                          "action": "failed"}
            record(cell, result)
            bar.set_postfix_str(f"{len(running)} cells running or queued on Ray")
    finally:
        if started:
            release(ray)

