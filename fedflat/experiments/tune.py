"""Fair hyperparameter tuning: every method the same budget of trials, selected on a validation split.

A tune file (YAML)::

    base: ../fmnist_mlp.yaml            # as a sweep's: a config file, or 'quickstart'
    overrides: [rounds=100]             # applied to trials and final runs
    methods:                            # name -> overrides (as a sweep's method axis)
      fedavg: {algo: fedavg}
      fedsam: {algo: fedsam}            # searched over its recipe's grid (`fedflat list --grids`)
      fedadam: {algo: fedadam, tune: {algo.server_lr: [0.1, 0.01]}}   # or a grid of your own
    search:
      budget: 6                         # at most this many candidates per method (an even, seeded sample of larger grids)
      grid: {train.lr: [0.1, 0.05]}     # axes every method searches, crossed with its own
      validation: 0.1                   # fraction of each class of the training set held out for selection
      select: final                     # the final or the best validation accuracy, averaged over the seeds
      seeds: [0]
      overrides: []                     # trials only (e.g. fewer rounds)
    final:                              # the selected configs, on the whole training set, tested over seeds
      seeds: [0, 1, 2]
      overrides: []
    out: runs/tune/fmnist
    variants: {small: {overrides: [rounds=5], methods: [fedavg, fedsam], search: {budget: 2}, final: {seeds: [0]}}}

Trials run in ``OUT/trials`` with ``data.validation`` set: their runs evaluate on held-out training samples and
never see the test set (:func:`fedflat.data.validation_split`). A key a method's overrides set is fixed for that
method, not searched. Every method gets the same budget of candidates and the same rounds, seeds and validation
split; one whose grid is smaller runs all of it. When all trials finished, each method's best candidate runs
over the final seeds in ``OUT/final`` (a sweep folder: ``fedflat report OUT/final``); ``only`` (the command's
``--methods``) runs a group of the methods, whose cells are those of the whole study. Cells are sweep cells:
rerunning skips finished ones and resumes interrupted ones; ``tune.json`` records trials, scores and selections.
"""
from __future__ import annotations

import itertools
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedflat.config import config_file, parse_override
from fedflat.core import ConfigError
from fedflat.core.registry import display_label
from fedflat.experiments.cells import Cell, RayCells, run_cells
from fedflat.experiments.sweep import (_option_name, _parse_axis, _parse_overrides, _refuse_unknown, config_from,
                                       pick_variant, read_experiment_file)
from fedflat.experiments.rundir import SUCCEEDED
from fedflat.files import atomic_write_text, json_safe

TUNE_FILE = "tune.json"
TUNE_KEYS = {"base", "config", "overrides", "methods", "search", "final", "out", "variants"}
SEARCH_KEYS = {"budget", "grid", "validation", "select", "seeds", "overrides", "sample_seed"}
FINAL_KEYS = {"seeds", "overrides"}
VARIANT_KEYS = {"overrides", "methods", "search", "final", "out"}
SELECT = ("final", "best")


@dataclass
class Method:
    """A method of the study: its overrides and the grid of every hyperparameter it searches."""

    name: str
    overrides: list[tuple[str, Any]]
    space: dict[str, list[Any]]
    grid_size: int = 0
    candidates: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Study:
    """A parsed tune file (see the module docstring)."""

    source: Path | None
    base: dict[str, Any]
    overrides: list[tuple[str, Any]]
    methods: dict[str, Method]
    budget: int
    validation: float
    select: str
    trial_seeds: list[int]
    final_seeds: list[int]
    trial_overrides: list[tuple[str, Any]]
    final_overrides: list[tuple[str, Any]]
    out: Path
    variant: str | None = None
    sample_seed: int = 0
    listed: list[str] = field(default_factory=list)  # the file's methods, of which ``methods`` may be a group

    def trial_cells(self) -> dict[str, list[tuple[dict[str, Any], list[Cell]]]]:
        """Per method, each candidate and its trial cells (one per trial seed)."""
        return {name: [(params, [self._cell(method, params, seed, trial=True) for seed in self.trial_seeds])
                       for params in method.candidates] for name, method in self.methods.items()}

    def final_cells(self, name: str, params: dict[str, Any]) -> list[Cell]:
        return [self._cell(self.methods[name], params, seed, trial=False) for seed in self.final_seeds]

    def _cell(self, method: Method, params: dict[str, Any], seed: int, trial: bool) -> Cell:
        phase = [*self.trial_overrides, ("data.validation", self.validation)] if trial else self.final_overrides
        overrides = [*self.overrides, *method.overrides, *params.items(), *phase, ("seed", seed)]
        label = [method.name, *(_option_name(k, v) for k, v in params.items()), f"seed{seed}"]
        cell = Cell(name="__".join(label), options={"method": method.name, **{k: str(v) for k, v in params.items()},
                                                   "seed": str(seed)}, overrides=overrides)
        try:
            cell.config = config_from(self.base, overrides)
        except ConfigError as err:
            cell.error = str(err)
        return cell


def _named_keys(overrides: list[tuple[str, Any]]) -> set[str]:
    """The dotted keys a list of overrides sets (``algo: {name: x, rho: 1}`` sets algo.name and algo.rho)."""
    keys: set[str] = set()

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            keys.add(f"{prefix}.name" if prefix in ("algo", "model", "data") else prefix)

    for key, value in overrides:
        walk(key, value)
    return keys


def _grid(spec: Any, where: str) -> dict[str, list[Any]]:
    if spec is None:
        return {}
    if not isinstance(spec, dict) or any(not isinstance(v, list) or not v for v in spec.values()):
        raise ConfigError(f"{where}: a grid maps dotted keys to non-empty lists of values, e.g. {{algo.rho: [0.1, 0.01]}}")
    return {str(k): list(v) for k, v in spec.items()}


def _parse_methods(spec: Any, where: str) -> dict[str, tuple[list[tuple[str, Any]], dict[str, list[Any]] | None]]:
    """``name -> (overrides, own grid or None)``: a sweep's method axis (a list of algorithm names, or name ->
    overrides), whose entries may carry a ``tune:`` grid of their own."""
    if not spec or not isinstance(spec, (dict, list)):
        raise ConfigError(f"{where}: 'methods' must name at least one method (a list of algorithm names, or "
                          "name -> overrides)")
    own: dict[Any, dict[str, list[Any]]] = {}
    if isinstance(spec, dict):
        spec = dict(spec)
        for name, entry in spec.items():
            if isinstance(entry, dict) and "tune" in entry:
                entry = dict(entry)
                own[name] = _grid(entry.pop("tune") or {}, f"{where}: method '{name}' tune")
                spec[name] = entry
    options = _parse_axis("algo", spec, where)  # keeps the order of spec: option i is entry i
    return {name: (overrides, own.get(raw)) for (name, overrides), raw in zip(options.items(), spec)}


def _candidates(space: dict[str, list[Any]], budget: int, seed: int) -> tuple[list[dict[str, Any]], int]:
    """Every point of the grid ``space`` (in grid order) when it has at most ``budget``; else a Latin-hypercube
    sample of ``budget`` points: each axis' values spread evenly over its range (the ends included), paired
    across axes by a seeded shuffle, topped up with seeded grid points where pairs repeat. Returns the
    candidates and the grid's size."""
    sizes = [len(v) for v in space.values()]
    total = math.prod(sizes)
    if total <= budget:
        return [dict(zip(space, values)) for values in itertools.product(*space.values())], total
    rng = np.random.default_rng(seed)
    columns = [np.rint(np.linspace(0, n - 1, budget)).astype(int) for n in sizes]
    columns = [columns[0], *(rng.permutation(c) for c in columns[1:])]
    chosen = list(dict.fromkeys(zip(*(c.tolist() for c in columns))))
    for flat in rng.permutation(total):
        if len(chosen) == budget:
            break
        point = tuple(int(i) for i in np.unravel_index(flat, sizes))
        if point not in chosen:
            chosen.append(point)
    chosen.sort()
    return [{k: space[k][i] for k, i in zip(space, point)} for point in chosen], total


def _int_list(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(v, int) and not isinstance(v, bool)
                                                           for v in value):
        raise ConfigError(f"{where}: give a non-empty list of integer seeds, e.g. [0, 1, 2]")
    return list(value)


def load_study(path: str | Path, variant: str | None = None, out: str | Path | None = None,
               extra_overrides: list[str] | tuple[str, ...] = (), only: list[str] | None = None) -> Study:
    """Reads a tune file (a path, or a shipped tune file's name); ``variant`` picks an entry of its ``variants``
    (e.g. ``small``); ``only`` keeps these of its methods (in the file's order)."""
    from fedflat.core import RECIPES

    given, path = path, config_file(path, "tune")
    spec, base = read_experiment_file(path, "tune", TUNE_KEYS, given)
    overrides = _parse_overrides(spec.get("overrides"), str(path))
    search, final = dict(spec.get("search") or {}), dict(spec.get("final") or {})
    out_dir = spec.get("out") or f"runs/tune/{path.stem}"
    if variant is not None:
        v = pick_variant(spec, path, variant, VARIANT_KEYS)
        overrides += _parse_overrides(v.get("overrides"), f"{path} variant {variant}")
        if v.get("methods"):  # a subset of the methods, or methods of its own
            spec = {**spec, "methods": v["methods"]}
        search.update(v.get("search") or {})
        final.update(v.get("final") or {})
        out_dir = v.get("out") or f"{out_dir}-{variant}"
    overrides += [parse_override(o) for o in extra_overrides]
    _refuse_unknown(search, SEARCH_KEYS, f"{path}: unknown search key")
    _refuse_unknown(final, FINAL_KEYS, f"{path}: unknown final key")
    budget = search.get("budget", 6)
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ConfigError(f"{path}: search.budget must be a positive integer (candidates per method), got {budget!r}")
    validation = search.get("validation", 0.1)
    if not isinstance(validation, (int, float)) or not 0 < validation < 1:
        raise ConfigError(f"{path}: search.validation must be a fraction in (0, 1) of the training set, "
                          f"got {validation!r}")
    select = search.get("select", "final")
    if select not in SELECT:
        raise ConfigError(f"{path}: search.select must be one of {', '.join(SELECT)}, got {select!r}")
    study = Study(source=path, base=base, overrides=overrides, methods={}, budget=budget,
                  validation=float(validation), select=select,
                  trial_seeds=_int_list(search.get("seeds", [0]), f"{path}: search.seeds"),
                  final_seeds=_int_list(final.get("seeds", [0, 1, 2]), f"{path}: final.seeds"),
                  trial_overrides=_parse_overrides(search.get("overrides"), f"{path} search"),
                  final_overrides=_parse_overrides(final.get("overrides"), f"{path} final"),
                  out=Path(out or out_dir), variant=variant, sample_seed=int(search.get("sample_seed", 0)))
    common = _grid(search.get("grid"), f"{path}: search.grid")
    for name, (method_overrides, own) in _parse_methods(spec.get("methods"), str(path)).items():
        algo = config_from(base, [*overrides, *method_overrides]).algo.get("name", "fedavg")
        recipe = RECIPES.get(algo)
        fixed = _named_keys(method_overrides)
        space = own if own is not None else {**(dict(recipe.tunable) if recipe else {}), **common}
        space = {k: list(v) for k, v in space.items() if k not in fixed}
        method = Method(name, method_overrides, space)
        method.candidates, method.grid_size = _candidates(space, budget, study.sample_seed)
        study.methods[name] = method
    if only is not None:
        unknown = [name for name in only if name not in study.methods]
        if unknown:
            raise ConfigError(f"{path}: no method {', '.join(map(repr, unknown))} in this file; its methods: "
                              f"{', '.join(study.methods)}")
        study.listed = list(study.methods)
        study.methods = {name: m for name, m in study.methods.items() if name in only}
    return study


# --- running a study --------------------------------------------------------------------------------

def _score(results: list[dict[str, Any]], select: str) -> tuple[float | None, str]:
    """A candidate's validation accuracy (mean over its trial seeds) and its state: ``scored``, ``diverged``
    (scores -inf: never selected), or ``unfinished`` (a trial failed or is still to run)."""
    if any(r.get("status") == "diverged" for r in results):
        return -math.inf, "diverged"
    values = [r.get(f"{select}_val_acc") for r in results]
    if any(r.get("status") not in SUCCEEDED for r in results) or any(v is None for v in values):
        return None, "unfinished"
    return statistics.fmean(values), "scored"


def select_candidate(scored: list[tuple[dict[str, Any], float | None, str]]) -> dict[str, Any] | None:
    """The candidate with the highest validation score (the first in grid order on a tie), or None when any
    candidate is unfinished or none has a finite score."""
    if any(state == "unfinished" for _, _, state in scored):
        return None
    finite = [(score, -i, params) for i, (params, score, _) in enumerate(scored) if math.isfinite(score)]
    return max(finite, key=lambda t: (t[0], t[1]))[2] if finite else None


@dataclass
class StudyResult:
    folder: Path
    methods: dict[str, dict[str, Any]]

    @property
    def incomplete(self) -> list[str]:
        return [name for name, m in self.methods.items() if m.get("test_acc") is None]


def run_study(study: Study, workers: int = 1, progress: bool = True, ray: RayCells | None = None) -> StudyResult:
    """Runs the trials, selects each method's candidate on the validation split, runs the selections over the
    final seeds; a rerun skips what finished. Writes ``OUT/tune.json``."""
    trials = study.trial_cells()
    results = run_cells([c for per in trials.values() for _, cells in per for c in cells], study.out / "trials",
                        workers, progress, ray, group=study.out.name, job="trials")
    index: dict[str, dict[str, Any]] = {}
    finals: list[Cell] = []
    for name, per in trials.items():
        scored = []
        rows = []
        for params, cells in per:
            score, state = _score([results[c.name] for c in cells], study.select)
            scored.append((params, score, state))
            rows.append({"params": params, "cells": [c.name for c in cells], "state": state,
                         "val_acc": score if score is None or math.isfinite(score) else None})
        selected = select_candidate(scored)
        method = study.methods[name]
        index[name] = {"space": method.space, "grid_size": method.grid_size, "trials": rows, "selected": selected}
        if selected is not None:
            index[name]["val_acc"] = next(s for p, s, _ in scored if p == selected)
            cells = study.final_cells(name, selected)
            index[name]["final"] = [c.name for c in cells]
            finals += cells
    tested = run_cells(finals, study.out / "final", workers, progress, ray, group=study.out.name,
                       job="final") if finals else {}
    for name, entry in index.items():
        tests = [tested[c].get("final_test_acc") for c in entry.get("final", [])]
        entry["test_acc"] = tests if tests and all(t is not None for t in tests) else None
    _write_index(study, index)
    return StudyResult(folder=study.out, methods=index)


def _write_index(study: Study, methods: dict[str, dict[str, Any]]) -> None:
    """Writes ``OUT/tune.json`` in the file's order; the entries of the file's methods that this run left out
    (``--methods``) stay when the earlier index was made with the same budget, validation split, selection and
    seeds."""
    protocol = {"budget": study.budget, "validation": study.validation, "select": f"{study.select}_val_acc",
                "trial_seeds": study.trial_seeds, "final_seeds": study.final_seeds}
    path = study.out / TUNE_FILE
    try:
        earlier = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):  # unreadable: rewritten from this run (the runs themselves are on disk)
        earlier = {}
    if study.listed and all(earlier.get(k) == v for k, v in protocol.items()):
        merged = {**earlier.get("methods", {}), **methods}
        methods = {name: merged[name] for name in study.listed if name in merged}
    index = {"source": str(study.source) if study.source else None, "variant": study.variant,
             "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **protocol, "methods": methods}
    atomic_write_text(path, json.dumps(json_safe(index), indent=2) + "\n")


def selection_table(result: StudyResult, study: Study) -> str:
    """Markdown: per method, the trials run of its grid, the selection, its validation and test accuracy."""
    lines = [f"| method | trials (of grid) | selected | val acc ({study.select}, %) | test acc (%, "
             f"{len(study.final_seeds)} seeds) |", "|---|---|---|---|---|"]
    for name, m in result.methods.items():
        selected = ", ".join(f"{k}={v}" for k, v in (m["selected"] or {}).items()) or (
            "(as configured)" if m["selected"] is not None else "–")
        val = f"{100 * m['val_acc']:.2f}" if m.get("val_acc") is not None else "–"
        tests = m.get("test_acc")
        if tests:
            test = f"{100 * statistics.fmean(tests):.2f}" + (
                f" ± {100 * statistics.stdev(tests):.2f}" if len(tests) > 1 else "")
        else:
            test = "–"
        lines.append(f"| {display_label(name)} | {len(m['trials'])} (of {m['grid_size']}) | {selected} | {val} | "
                     f"{test} |")
    return "\n".join(lines) + "\n"
