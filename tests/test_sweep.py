"""Sweeps: grid expansion, deterministic cell folders, skipping finished cells, resuming, failures."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from fedflat.config import packaged_configs
from fedflat.core import ConfigError
from fedflat.engine.checkpoint import CHECKPOINT, read_checkpoint
from fedflat.engine.cores import available_cores
from fedflat.experiments.packing import FOOTPRINT_FILE
from fedflat.experiments.resume import metrics_equal
from fedflat.experiments.sweep import load_sweep, run_sweep
from fedflat.files import read_jsonl
from tests.conftest import tiny_tree


def write_sweep(tmp_path: Path, spec: dict, base: dict | None = None) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base or tiny_tree()))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "base.yaml", "out": str(tmp_path / "out"), **spec}, sort_keys=False))
    return path


def test_grid_expands_to_every_combination_in_axis_order(tmp_path):
    path = write_sweep(tmp_path, {
        "overrides": ["rounds=2"],
        "grid": {"method": {"fedavg": {"algo": "fedavg"}, "fedsam": {"algo": "fedsam", "algo.rho": 0.05}},
                 "data.partition.alpha": [0.1, 1.0],
                 "seed": [0, 1, 2]}})
    cells = load_sweep(path).cells()
    assert len(cells) == 2 * 2 * 3
    assert [c.name for c in cells[:4]] == ["fedavg__alpha0.1__seed0", "fedavg__alpha0.1__seed1",
                                           "fedavg__alpha0.1__seed2", "fedavg__alpha1.0__seed0"]
    last = cells[-1]
    assert last.name == "fedsam__alpha1.0__seed2"
    cfg = last.config
    assert (cfg.algo, cfg.data.partition["alpha"], cfg.seed, cfg.rounds) == ({"name": "fedsam", "rho": 0.05}, 1.0, 2, 2)
    assert cells[0].config.algo == {"name": "fedavg"}  # `algo: X` starts X from its own defaults
    assert load_sweep(path).cells()[5].name == cells[5].name  # deterministic


def test_variant_replaces_axes_adds_overrides_and_moves_out(tmp_path):
    path = write_sweep(tmp_path, {"grid": {"seed": [0, 1, 2]},
                                  "variants": {"small": {"overrides": ["rounds=1"], "grid": {"seed": [7]}}}})
    sweep = load_sweep(path, variant="small")
    cells = sweep.cells()
    assert [c.name for c in cells] == ["seed7"] and cells[0].config.rounds == 1
    assert sweep.out == tmp_path / "out-small"
    with pytest.raises(ConfigError, match="no variant 'big'"):
        load_sweep(path, variant="big")


def test_a_variant_drops_an_axis_set_to_null(tmp_path):
    path = write_sweep(tmp_path, {"grid": {"data.partition.alpha": [0.1, 1.0], "seed": [0, 1]},
                                  "variants": {"one": {"grid": {"data.partition.alpha": None, "seed": [3]}}}})
    assert [c.name for c in load_sweep(path, variant="one").cells()] == ["seed3"]
    assert len(load_sweep(path).cells()) == 4


def test_bad_sweeps_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown sweep key 'grdi' \\(did you mean 'grid'\\?\\)"):
        load_sweep(write_sweep(tmp_path, {"grdi": {}}))
    with pytest.raises(ConfigError, match="variant 'small': unknown key 'overides' \\(did you mean 'overrides'"):
        load_sweep(write_sweep(tmp_path, {"variants": {"small": {"overides": []}}}), variant="small")
    with pytest.raises(ConfigError, match="workers must be a whole number at least 1 or auto"):
        run_sweep(load_sweep(write_sweep(tmp_path, {"grid": {"seed": [0]}})), workers=0)
    with pytest.raises(ConfigError, match="no values"):
        load_sweep(write_sweep(tmp_path, {"grid": {"seed": []}}))
    cells = load_sweep(write_sweep(tmp_path, {"grid": {"algo.rho": [0.1]}})).cells()
    assert "not a hyperparameter of 'fedavg'" in cells[0].error  # invalid cells are reported, not run


def test_rerun_skips_finished_cells_and_resumes_unfinished(tmp_path):
    path = write_sweep(tmp_path, {"overrides": ["rounds=4", "checkpoint_every=2"],
                                  "grid": {"algo": ["fedavg", "fedsam"], "seed": [0, 1]}})
    sweep = load_sweep(path)
    first = run_sweep(sweep, progress=False)
    assert [c["status"] for c in first.cells] == ["completed"] * 4
    assert {c["action"] for c in first.cells} == {"ran"}
    out = tmp_path / "out"
    index = json.loads((out / "sweep.json").read_text())
    assert [c["name"] for c in index["cells"]] == ["fedavg__seed0", "fedavg__seed1", "fedsam__seed0", "fedsam__seed1"]
    reference = read_jsonl(out / "fedsam__seed1" / "metrics.jsonl")
    # make fedsam__seed1 look killed after its round-2 checkpoint, with round 3's line already written
    cell = out / "fedsam__seed1"
    import torch

    from fedflat import run
    run(sweep.cells()[3].config.model_copy(update={"rounds": 2}), run_dir=tmp_path / "r2", progress=False)
    torch.save(read_checkpoint(tmp_path / "r2"), cell / CHECKPOINT)
    (cell / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in reference[:3]))
    summary = json.loads((cell / "summary.json").read_text())
    (cell / "summary.json").write_text(json.dumps({**summary, "status": "running"}))
    # and delete another cell entirely
    import shutil
    shutil.rmtree(out / "fedavg__seed0")
    second = run_sweep(load_sweep(path), progress=False)
    actions = {c["name"]: c["action"] for c in second.cells}
    assert actions == {"fedavg__seed0": "ran", "fedavg__seed1": "skipped", "fedsam__seed0": "skipped",
                       "fedsam__seed1": "resumed"}
    resumed = read_jsonl(cell / "metrics.jsonl")
    assert metrics_equal(resumed, reference)


def test_failed_cell_is_recorded_and_the_others_run(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # CIFAR-100 is nowhere to be found
    monkeypatch.setenv("FEDFLAT_DATA", "")
    path = write_sweep(tmp_path, {"overrides": ["rounds=1"],
                                  "grid": {"data": {"ok": {"data.name": "synthetic"},
                                                    "missing": {"data.name": "cifar100", "data.options": {},
                                                                "data.root": str(tmp_path)}},
                                           "seed": [0]}})
    result = run_sweep(load_sweep(path), progress=False)
    status = {c["name"]: c for c in result.cells}
    assert status["ok__seed0"]["status"] == "completed"
    assert status["missing__seed0"]["status"] == "failed"
    assert "DatasetNotFoundError" in status["missing__seed0"]["reason"]
    assert (tmp_path / "out" / "missing__seed0" / "error.txt").exists()
    index = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert [c["status"] for c in index["cells"]] == ["completed", "failed"]


def test_cell_with_a_changed_config_is_not_overwritten(tmp_path):
    path = write_sweep(tmp_path, {"overrides": ["rounds=1"], "grid": {"seed": [0]}})
    run_sweep(load_sweep(path), progress=False)
    before = (tmp_path / "out" / "seed0" / "metrics.jsonl").read_text()
    changed = run_sweep(load_sweep(path, extra_overrides=["train.lr=0.5"]), progress=False)
    assert changed.cells[0]["status"] == "failed" and "different config" in changed.cells[0]["reason"]
    assert "train.lr: 0.1 there, 0.5 here" in changed.cells[0]["reason"]
    assert (tmp_path / "out" / "seed0" / "metrics.jsonl").read_text() == before


def test_a_key_added_since_a_cell_ran_compares_at_its_default(tmp_path):
    """A cell written by an older fedflat, whose config.yaml lacks keys added since (here the parts'
    ``personalization`` and the data's ``validation``) and holds the algorithm's hyperparameters flat (before they
    were scoped to their parts), is still the same cell: skipped when finished, extended by more rounds; the same
    key at another value is a changed config."""
    path = write_sweep(tmp_path, {"overrides": ["rounds=1", "algo=fedavgm"], "grid": {"seed": [0]}})
    run_sweep(load_sweep(path), progress=False)
    config = tmp_path / "out" / "seed0" / "config.yaml"
    tree = yaml.safe_load(config.read_text())
    assert tree["algo"]["server"] == {"name": "avgm", "beta": 0.9} and tree["data"].pop("validation") == 0.0
    tree["algo"] = {"name": "fedavgm", "perturbation": "none", "filter": "none", "correction": "none",
                    "aggregation": "mean", "server": "avgm", "weighting": "uniform", "beta": 0.9}  # as fedflat 0.1 wrote
    config.write_text(yaml.safe_dump(tree))
    assert run_sweep(load_sweep(path), progress=False).cells[0]["action"] == "skipped"
    longer = run_sweep(load_sweep(path, extra_overrides=["rounds=2"]), progress=False).cells[0]
    assert (longer["status"], longer["action"], longer["rounds"]) == ("completed", "resumed", 2)
    summary = json.loads((tmp_path / "out" / "seed0" / "summary.json").read_text())
    assert summary["rounds_planned"] == 2
    other = run_sweep(load_sweep(path, extra_overrides=["rounds=2", "data.validation=0.1"]), progress=False)
    assert "data.validation: 0.0 there, 0.1 here" in other.cells[0]["reason"]


def test_rerun_with_more_rounds_extends_completed_cells_and_never_shortens_them(tmp_path):
    """``fedflat sweep FILE rounds=N``: completed cells continue to N rounds, equal to runs planned that long;
    fewer rounds than a cell holds is refused and leaves it as it was."""
    path = write_sweep(tmp_path, {"overrides": ["rounds=2"], "grid": {"algo": ["fedavg", "fedsam"]}})
    run_sweep(load_sweep(path), progress=False)
    longer = run_sweep(load_sweep(path, extra_overrides=["rounds=3"]), progress=False)
    assert [(c["status"], c["action"], c["rounds"]) for c in longer.cells] == [("completed", "resumed", 3)] * 2
    planned = run_sweep(load_sweep(path, out=tmp_path / "planned", extra_overrides=["rounds=3"]), progress=False)
    for cell in ("fedavg", "fedsam"):
        assert metrics_equal(read_jsonl(tmp_path / "out" / cell / "metrics.jsonl"),
                             read_jsonl(tmp_path / "planned" / cell / "metrics.jsonl"))
    assert {c["action"] for c in planned.cells} == {"ran"}
    before = (tmp_path / "out" / "fedsam" / "metrics.jsonl").read_text()
    shorter = run_sweep(load_sweep(path), progress=False)
    assert all(c["status"] == "failed" and "cannot shorten" in c["reason"] for c in shorter.cells)
    assert (tmp_path / "out" / "fedsam" / "metrics.jsonl").read_text() == before
    again = run_sweep(load_sweep(path, extra_overrides=["rounds=3"]), progress=False)
    assert {c["action"] for c in again.cells} == {"skipped"}


@pytest.mark.parametrize("workers", [2, "auto"])
def test_workers_run_cells_in_processes_with_the_same_results(tmp_path, workers):
    """Two workers, or ``auto`` (CPU cells: one a core, fedflat/experiments/packing.py), give the serial sweep's
    results, each cell within its share of the cores, and CPU cells write no GPU footprint."""
    path = write_sweep(tmp_path, {"overrides": ["rounds=2", "device=cpu"], "grid": {"seed": [0, 1]}})
    parallel = run_sweep(load_sweep(path, out=tmp_path / "par"), workers=workers, progress=False)
    serial = run_sweep(load_sweep(path, out=tmp_path / "ser"), progress=False)
    assert [c["status"] for c in parallel.cells] == [c["status"] for c in serial.cells] == ["completed", "completed"]
    for name in ("seed0", "seed1"):
        a = read_jsonl(tmp_path / "par" / name / "metrics.jsonl")
        b = read_jsonl(tmp_path / "ser" / name / "metrics.jsonl")
        assert [m["test_acc"] for m in a] == [m["test_acc"] for m in b]
        # each of the 2 workers keeps to its share of the cores (threads: auto within a share)
        summary = json.loads((tmp_path / "par" / name / "summary.json").read_text())
        assert summary["machine"]["torch_threads"] <= max(1, available_cores() // 2)
        assert not (tmp_path / "par" / name / FOOTPRINT_FILE).exists()


SHIPPED = sorted(packaged_configs().rglob("*.yaml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[str(p.relative_to(packaged_configs())) for p in SHIPPED])
def test_every_shipped_config_names_registered_things(path):
    """Every shipped config, sweep and tune file (and each variant) expands to valid cells: algorithm, dataset,
    model and partition names exist and every hyperparameter belongs to its method."""
    from fedflat.config import load_config
    from fedflat.experiments.sweep import SWEEP_KEYS

    spec = yaml.safe_load(path.read_text())
    if "methods" in spec:  # a tune file
        from fedflat.experiments.tune import load_study

        for variant in [None, *(spec.get("variants") or {})]:
            trials = load_study(path, variant=variant).trial_cells()
            bad = [(c.name, c.error) for per in trials.values() for _, cells in per for c in cells if c.error]
            assert trials and not bad, f"{path.name} variant {variant}: {bad[:2]}"
        return
    if not set(spec) & {"grid", "base", "variants"}:
        load_config(path)
        return
    variants = [None, *(spec.get("variants") or {})]
    for variant in variants:
        cells = load_sweep(path, variant=variant).cells()
        assert cells
        bad = [(c.name, c.error) for c in cells if c.error]
        assert not bad, f"{path.name} variant {variant}: {bad[:2]}"
    assert set(spec) <= SWEEP_KEYS
    if "papers" in path.parts:
        assert "small" in spec["variants"], "every paper setup has a small variant"
        assert "Table" in path.read_text().split("\n", 1)[0], "the first line names the table reproduced"


def test_a_stopping_sweep_takes_a_result_that_arrives_after_its_cell_was_recorded(tmp_path, monkeypatch):
    """The GPU session's sweep, stopped by its time limit, crashed with KeyError: a cell's process put its result on
    the queue and exited; _stop saw it dead, recorded it from its folder, then read the queued result while another
    cell was still stopping. Each cell is recorded once, and the stop ends cleanly."""
    import queue as queues

    from fedflat.experiments import cells as sweep

    class Cell:
        pid, exitcode = 0, 0

        def __init__(self, alive_checks: int) -> None:
            self.alive_checks = alive_checks

        def is_alive(self) -> bool:
            self.alive_checks -= 1
            return self.alive_checks >= 0

        def join(self) -> None:
            pass

    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    results = queues.Queue()
    running = {first: ("first", Cell(alive_checks=0)), second: ("second", Cell(alive_checks=3))}
    recorded = []

    def from_folder(path):  # the first cell's result lands while _stop records it from its folder
        if str(path) == first:
            results.put((first, {"status": "completed"}))
        return {"status": "failed", "reason": "interrupted (the sweep was stopped)"}

    monkeypatch.setattr(sweep, "interrupted_cell", from_folder)
    monkeypatch.setattr(sweep.os, "kill", lambda pid, sig: None)  # (no real processes here)
    sweep._stop(running, results, lambda cell, result: recorded.append((cell, result["status"])), grace=5.0)
    assert recorded == [("first", "failed"), ("second", "failed")] and running == {}
