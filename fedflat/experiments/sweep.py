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
others go on. The cells run in :mod:`fedflat.experiments.cells`: with ``workers > 1`` (or ``auto``) in separate
processes; with ``backend="ray"`` each cell is a Ray task on a cluster (one GPU per cell, or a fraction), with the
same skip/resume/failure rules.
"""
from __future__ import annotations

import copy
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedflat.config import (Config, apply_override, base_file, config_file, file_kind, inherited, load_config, located,
                            parse_override, read_yaml_file, suggest, wrong_kind)
from fedflat.core import ConfigError
from fedflat.experiments.cells import Cell, RayCells, cell_state, run_cell, run_cells  # noqa: F401 (the sweep's API)
from fedflat.files import atomic_write_text, json_safe

SWEEP_FILE = "sweep.json"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=-]+")
SHORTHAND_KEYS = ("algo", "model", "data", "data.partition", "data.partition.scheme", "algo.name", "model.name")


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


def run_sweep(sweep: Sweep, workers: int | str = 1, progress: bool = True, ray: RayCells | None = None) -> SweepResult:
    """Runs every cell of ``sweep`` (skipping finished ones), ``workers`` at a time (``auto``: as many as fit,
    :mod:`fedflat.experiments.packing`), or as Ray tasks."""
    cells = sweep.cells()
    results = run_cells(cells, sweep.out, workers, progress, ray,
                        on_record=lambda done: _write_index(sweep, cells, done), group=sweep.out.name)
    return SweepResult(folder=sweep.out, cells=[{"name": c.name, **results[c.name]} for c in cells])


