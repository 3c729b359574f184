"""Sweeps: a grid of runs over a base config, each cell its own run folder, safe to rerun.

A sweep file (YAML)::

    base: ../fmnist_mlp.yaml          # a config file relative to this file, or a shipped one's name (quickstart)
    overrides: [rounds=500]           # applied to every cell
    grid:                             # axes, in order; a cell takes one option of each axis
      method:                         # a named axis: option name -> overrides
        fedavg: {algo: fedavg}
        fedsam: {algo: fedsam, algo.rho: 0.05}
      data.partition.alpha: [0.3, 0.6]   # a key axis: one cell per value
      seed: [0, 1, 2]
    out: runs/sweeps/fmnist           # the sweep folder (default runs/sweeps/<file stem>)
    variants:                         # `--variant small`: replaces out and the named axes, adds overrides
      small: {overrides: [rounds=20], grid: {seed: [0]}}   # (an axis set to null is dropped)

Cell folders are named from their options (``fedsam__alpha0.3__seed1``), so rerunning the sweep finds
them: a completed, stopped (a callback ended it) or diverged cell is skipped, an unfinished one resumes from its
checkpoint, a missing one starts; rerun with more ``rounds`` (``fedflat sweep FILE rounds=500``), completed cells
continue to the new length. A cell that fails (an exception) or diverges is recorded in ``sweep.json`` and the
others go on. With ``workers > 1`` cells run in separate processes; with ``backend="ray"`` each cell is a
Ray task on a cluster (one GPU per cell, or a fraction), with the same skip/resume/failure rules.
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable

import yaml

from fedflat.config import (Config, apply_override, base_file, config_file, file_kind, inherited, load_config, located,
                            parse_override, read_yaml_file, resolve, suggest, wrong_kind)
from fedflat.core import ConfigError
from fedflat.engine.threads import available_cores
from fedflat.experiments.packing import Footprint, Packing
from fedflat.experiments.report import flatten
from fedflat.experiments.rundir import FINISHED, LOCK, TRACKING_FILE, RunFolderBusy, hold
from fedflat.files import atomic_write_text, json_safe, read_jsonl

SWEEP_FILE = "sweep.json"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]+")
SHORTHAND_KEYS = ("algo", "model", "data", "data.partition", "data.partition.scheme", "algo.name", "model.name")


def _read_yaml(text: str) -> Any:
    try:
        from fedflat.config import read_yaml
    except ImportError:  # older config module
        return yaml.safe_load(text)
    return read_yaml(text)


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


@dataclass
class Sweep:
    """A parsed sweep file: a base config tree, common overrides, axes and the sweep folder."""

    source: Path | None
    base: dict[str, Any]
    overrides: list[tuple[str, Any]]
    axes: dict[str, dict[str, list[tuple[str, Any]]]]
    out: Path
    variant: str | None = None
    variants: list[str] = field(default_factory=list)

    def cells(self) -> list[Cell]:
        """Every combination of axis options, in the order of the axes (the last varies fastest)."""
        combos: list[list[tuple[str, str, list[tuple[str, Any]]]]] = [[]]
        for axis, options in self.axes.items():
            combos = [c + [(axis, name, ovr)] for c in combos for name, ovr in options.items()]
        cells = []
        for combo in combos:
            name = "__".join(option for _, option, _ in combo) or "run"
            cell = Cell(name=name, options={axis: option for axis, option, _ in combo},
                        overrides=[*self.overrides, *(o for _, _, ovr in combo for o in ovr)])
            try:
                cell.config = self.config_of(cell)
            except ConfigError as err:
                cell.error = str(err)
            cells.append(cell)
        names = [c.name for c in cells]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ConfigError(f"sweep: option names repeat across axes, cells collide: {dup[:3]}")
        return cells

    def config_of(self, cell: Cell) -> Config:
        return config_from(self.base, cell.overrides)


def config_from(base: dict[str, Any], overrides: list[tuple[str, Any]]) -> Config:
    """The validated config of a base tree with ``overrides`` applied (the base is left as it was)."""
    tree = copy.deepcopy(base)
    for key, value in overrides:
        apply_override(tree, key, copy.deepcopy(value))
    return load_config(None, (), base=tree)


def _option_name(key: str, value: Any) -> str:
    """``seed, 1 -> seed1``; ``algo, fedsam -> fedsam``; a mapping value -> its values joined."""
    if isinstance(value, dict):
        text = "-".join(f"{v}" if k in ("scheme", "name") else f"{k}{v}" for k, v in value.items())
    elif key in SHORTHAND_KEYS:
        text = str(value)
    else:
        text = f"{key.rsplit('.', 1)[-1]}{value}"
    return folder_name(text) or "x"


def folder_name(text: str) -> str:
    """``text`` as one folder name inside the sweep folder: runs of characters other than letters, digits and
    ``. _ = -`` become ``-``, and leading dots go (no ``..``, ``.``, hidden folder or fedflat's ``.lock``); ``""``
    when nothing is left."""
    return _UNSAFE.sub("-", text).lstrip(".-").rstrip("-")


def _one_folder_each(seen: dict[str, Any], safe: str, given: Any, where: str, axis: str, fix: str) -> None:
    """Refuses a second option of an axis whose folder name is ``safe`` (``a/b`` and ``a-b`` both clean to ``a-b``):
    one of the two cells would silently be lost. ``seen``: folder name -> the option given for it so far."""
    if safe in seen:
        raise ConfigError(f"{where}: grid axis '{axis}': {seen[safe]!r} and {given!r} make the same cell folder name "
                          f"'{safe}' (folder names keep letters, digits and . _ = -): {fix}")
    seen[safe] = given


def _parse_axis(axis: str, spec: Any, where: str) -> dict[str, list[tuple[str, Any]]]:
    if isinstance(spec, list):
        if not spec:
            raise ConfigError(f"{where}: grid axis '{axis}' has no values")
        options: dict[str, list[tuple[str, Any]]] = {}
        seen: dict[str, Any] = {}
        for value in spec:
            _one_folder_each(seen, _option_name(axis, value), value, where, axis,
                             "give the axis named options instead (option name: {key: value})")
            options[_option_name(axis, value)] = [(axis, value)]
        return options
    if isinstance(spec, dict):
        if not spec:
            raise ConfigError(f"{where}: grid axis '{axis}' has no options")
        options, seen = {}, {}
        for name, ovr in spec.items():
            safe = folder_name(str(name))
            if not safe:
                raise ConfigError(f"{where}: grid axis '{axis}': option name {name!r} is empty after cleaning")
            _one_folder_each(seen, safe, name, where, axis, "rename one")
            if isinstance(ovr, dict):
                options[safe] = list(ovr.items())
            elif isinstance(ovr, list):
                options[safe] = [parse_override(o) for o in ovr]
            else:  # `fedsam: fedsam` shorthand: the axis is a key and this its value
                options[safe] = [(axis, ovr)]
        return options
    raise ConfigError(f"{where}: grid axis '{axis}' must be a list of values or a mapping of named options")


def _parse_overrides(items: Any, where: str) -> list[tuple[str, Any]]:
    if items is None:
        return []
    if isinstance(items, dict):
        return list(items.items())
    if isinstance(items, list):
        return [parse_override(str(i)) for i in items]
    raise ConfigError(f"{where}: 'overrides' must be a list of key=value or a mapping")


SWEEP_KEYS = {"base", "config", "overrides", "grid", "out", "variants"}
VARIANT_KEYS = {"overrides", "grid", "out"}


def _refuse_unknown(spec: dict[str, Any], allowed: set[str], what: str, hint: str = "") -> None:
    """A key of ``spec`` outside ``allowed`` is a ConfigError naming it, the closest allowed key, and the rest."""
    unknown = sorted(map(str, set(spec) - allowed))
    if unknown:
        raise ConfigError(f"{what} '{unknown[0]}'{suggest(unknown[0], sorted(allowed))}; allowed: "
                          f"{', '.join(sorted(allowed))}{hint}")


def read_experiment_file(path: Path, what: str, allowed: set[str],
                         name: str | Path | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The top-level mapping of a sweep or tune file (its keys checked against ``allowed``) and its base config
    tree: the ``base`` file read, the ``config`` keys applied. ``name``: the file as the user gave it."""
    spec = read_yaml_file(path) or {}
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: the top level must be a mapping")
    if set(spec) - allowed and file_kind(spec) != what and not _mistyped(spec, allowed):
        raise wrong_kind(name or path, file_kind(spec), what)
    _refuse_unknown(spec, allowed, f"{path}: unknown {what} key", " (config keys go under 'config:' or 'overrides:')")
    base: dict[str, Any] = {}
    if spec.get("base"):
        parent = base_file(str(spec["base"]), path)
        base = inherited(located(read_yaml_file(parent) or {}, parent.parent), parent)  # a base may inherit too
    for key, value in located(dict(spec.get("config") or {}), path.parent).items():
        apply_override(base, key, value)
    return spec, base


def _mistyped(spec: dict[str, Any], allowed: set[str]) -> bool:
    """Whether a file with a ``base`` reads as a sweep or tune file with a mistyped key (``grdi``) rather than as one
    run's config inheriting its base: a key that is neither the file's nor a config key."""
    return "base" in spec and any(k not in allowed and k not in Config.model_fields for k in spec)


def pick_variant(spec: dict[str, Any], path: Path, variant: str, allowed: set[str]) -> dict[str, Any]:
    """The entry ``variant`` of a sweep or tune file's ``variants``, its keys checked against ``allowed``."""
    variants = spec.get("variants") or {}
    if variant not in variants:
        raise ConfigError(f"{path}: no variant '{variant}'; variants: {', '.join(variants) or '(none)'}")
    chosen = variants[variant] or {}
    _refuse_unknown(chosen, allowed, f"{path}: variant '{variant}': unknown key")
    return chosen


def load_sweep(path: str | Path, variant: str | None = None, out: str | Path | None = None,
               extra_overrides: list[str] | tuple[str, ...] = ()) -> Sweep:
    """Reads a sweep file (a path, or a shipped sweep's name); ``variant`` picks an entry of its ``variants``
    (e.g. ``small``)."""
    given, path = path, config_file(path, "sweep")
    spec, base = read_experiment_file(path, "sweep", SWEEP_KEYS, given)
    overrides = _parse_overrides(spec.get("overrides"), str(path))
    grid = spec.get("grid") or {}
    variants = spec.get("variants") or {}
    sweep_out = spec.get("out") or f"runs/sweeps/{path.stem}"
    if variant is not None:
        v = pick_variant(spec, path, variant, VARIANT_KEYS)
        overrides += _parse_overrides(v.get("overrides"), f"{path} variant {variant}")
        grid = {axis: options for axis, options in {**grid, **(v.get("grid") or {})}.items() if options is not None}
        sweep_out = v.get("out") or f"{sweep_out}-{variant}"
    overrides += [parse_override(o) for o in extra_overrides]
    axes = {axis: _parse_axis(axis, s, str(path)) for axis, s in grid.items()}
    return Sweep(source=path, base=base, overrides=overrides, axes=axes, out=Path(out or sweep_out),
                 variant=variant, variants=list(variants))


# --- the state of a cell folder --------------------------------------------------------------------

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
        on_disk = _read_yaml(config_file.read_text())
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
        from fedflat.engine.threads import set_core_share

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
    from fedflat.experiments.checkpoint import resume
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


# --- running a sweep -------------------------------------------------------------------------------

@dataclass
class SweepResult:
    folder: Path
    cells: list[dict[str, Any]]

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [c for c in self.cells if c.get("status") == "failed"]


def _write_index(sweep: Sweep, cells: list[Cell], results: dict[str, dict[str, Any]]) -> None:
    index = {"source": str(sweep.source) if sweep.source else None, "variant": sweep.variant,
             "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "cells": [{**c.as_dict(), **results.get(c.name, {"status": "pending"})} for c in cells]}
    atomic_write_text(sweep.out / SWEEP_FILE, json.dumps(json_safe(index), indent=2) + "\n")


def _live_round(folder: Path) -> str:
    lines = read_jsonl(folder / "metrics.jsonl") if folder.exists() else []
    return f"r{lines[-1]['round']}" if lines else "r0"


@dataclass
class RayCells:
    """Where a sweep's cells run on Ray: the cluster (None: a local instance; ``auto``; ``HOST:PORT``) and
    what each cell reserves (its run's torch threads follow ``cpus``)."""

    address: str | None = None
    cpus: float = 1.0
    gpus: float = 0.0


def run_sweep(sweep: Sweep, workers: int | str = 1, progress: bool = True, ray: RayCells | None = None) -> SweepResult:
    """Runs every cell of ``sweep`` (skipping finished ones), ``workers`` at a time (``auto``: as many as fit,
    :mod:`fedflat.experiments.packing`), or as Ray tasks."""
    cells = sweep.cells()
    results = run_cells(cells, sweep.out, workers, progress, ray,
                        on_record=lambda done: _write_index(sweep, cells, done), group=sweep.out.name)
    return SweepResult(folder=sweep.out, cells=[{"name": c.name, **results[c.name]} for c in cells])


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
                  job: str | None) -> None:
    _die_with_parent()
    if os.getppid() != parent:  # the sweep died before the line above took effect
        return
    signal.signal(signal.SIGTERM, _stopped_by_the_sweep)  # _stop: the run writes its checkpoint and status
    try:
        results.put((folder, run_cell(tree, folder, False, threads, group, job, (Footprint(folder),))))
    except KeyboardInterrupt:
        results.put((folder, interrupted_cell(Path(folder))))


def _run_in_processes(out: Path, todo: list[Cell], workers: int | str, record, bar, group: str | None = None,
                      job: str | None = None) -> None:
    """At most ``workers`` cells at a time (``auto``: :class:`~fedflat.experiments.packing.Packing`), each in its own
    process that dies with the sweep. Ctrl-C (or SIGTERM through the command line) stops the running cells, which
    record a checkpoint, and starts no new one."""
    context = get_context("spawn")
    queue = context.Queue()
    packing = Packing.of([c.config.device for c in todo], available_cores(), time.time()) if workers == "auto" else None
    threads = packing.threads if packing else max(1, available_cores() // workers)
    if packing is not None:
        bar.write(f"sweep: {packing.reason}" if packing.limit else "sweep: the first cell runs alone for a round, "
                  "then as many cells as its GPU memory leaves room for")
    pending, running = list(todo), {}
    started: list[Path] = []  # the cells' folders, in the order they started (the first one's footprint decides)

    def room() -> int:
        if packing is None:
            return workers
        decided = packing.limit is not None
        limit = packing.workers(started)
        if not decided and packing.limit is not None:
            bar.write(f"sweep: {packing.reason}")
        return limit

    try:
        while pending or running:
            while pending and len(running) < room():
                cell = pending.pop(0)
                folder = str(out / cell.name)
                process = context.Process(target=_cell_process, daemon=True,
                                          args=(cell.config.model_dump(), folder, threads, os.getpid(), queue,
                                                group, job))
                _start_deaf_to_ctrl_c(process)
                running[folder] = (cell, process)
                started.append(Path(folder))
            _collect(queue, running, record)
            live = [f"{c.name} {_live_round(Path(f))}" for f, (c, _) in running.items()]
            bar.set_postfix_str("; ".join(live)[:200])
    except KeyboardInterrupt:
        _stop(running, queue, record)
        raise


def _start_deaf_to_ctrl_c(process) -> None:
    """Starts a cell's process with SIGINT ignored, a disposition that survives its exec. Ctrl-C at a terminal
    signals the whole process group, and a worker it reached while still importing printed a 40-line traceback
    (issue 32); the sweep stops its cells itself (:func:`_stop`: SIGTERM, which a cell's run takes as Ctrl-C)."""
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
        running = {task.remote(c.config.model_dump(), str(out / c.name), False, share, group, job): c for c in todo}
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
