"""`fedflat tune` and the validation split it selects on: the test set is never read before selection, every
method gets the same budget, a rerun resumes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedflat.algorithms import build_algorithm
from fedflat.config import load_config
from fedflat.core import RECIPES, ConfigError
from fedflat.data import load_dataset, validation_split
from fedflat.engine.simulation import Simulation, UserInputs
from fedflat.experiments.tune import _candidates, load_study, run_study, select_candidate
from fedflat.files import read_jsonl
from tests.conftest import tiny_tree


def test_validation_split_holds_out_each_class_and_drops_the_test_set():
    data = load_dataset("synthetic", shape=[4], num_classes=3, train_size=90, test_size=30)
    split, kept = validation_split(data, 0.2)
    assert split.heldout == "validation"
    held = np.setdiff1d(np.arange(90), kept)
    # a fifth of every class (30 each) held out; trained-on and held-out samples partition the training set
    assert np.bincount(data.y_train[held].numpy(), minlength=3).tolist() == [6, 6, 6]
    assert torch.equal(split.x_train, data.x_train[kept]) and torch.equal(split.x_test, data.x_train[held])
    assert torch.equal(split.y_test, data.y_train[held])
    # none of the test rows is in the result
    rows = torch.cat([split.x_train, split.x_test])
    assert not any(torch.equal(rows[i], t) for t in data.x_test for i in range(rows.shape[0]))
    again, kept_again = validation_split(data, 0.2)
    assert np.array_equal(kept, kept_again) and torch.equal(again.x_test, split.x_test)
    with pytest.raises(ConfigError, match="fraction"):
        validation_split(data, 1.0)


def test_a_validation_run_evaluates_on_held_out_training_samples(tmp_path):
    from fedflat.api import run

    cfg = load_config(None, ["data.validation=0.25"], base=tiny_tree())
    history = run(cfg, run_dir=tmp_path / "run", progress=False)
    s = history.summary
    assert s["evaluated_on"] == "val" and s["final_val_acc"] is not None
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all("val_acc" in m and "test_acc" not in m for m in lines)  # rounds select on validation only
    sim = Simulation(cfg)
    full = load_dataset("synthetic", **tiny_tree()["data"]["options"])
    assert sim.dataset.x_train.shape[0] + sim.dataset.x_test.shape[0] == full.x_train.shape[0] == 180
    assert sum(len(ix) for ix in sim.client_indices_np) == sim.dataset.x_train.shape[0]
    sim.server.w = history.final_parameters.to(sim.server.w)
    assert sim.evaluate()[0] == pytest.approx(s["final_val_acc"])


def test_a_validation_run_reports_the_test_accuracy_of_the_model_it_selected(tmp_path, capsys):
    """The number a paper reports: the model chosen on validation (best_model.pt of model_checkpoint on val_acc),
    scored on the test split at the run's end, in summary.json, `fedflat report` and `fedflat evaluate`; checked
    against the same model file scored by a run configured without a validation split (whose held-out set is the
    test split)."""
    from fedflat.api import run
    from fedflat.cli import main

    tree = tiny_tree(rounds=4, train__lr=0.5)
    tree["callbacks"] = [{"name": "model_checkpoint", "metric": "val_acc"}]
    cfg = load_config(None, ["data.validation=0.25"], base=tree)
    s = run(cfg, run_dir=tmp_path / "run", progress=False).summary
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    best = max(lines, key=lambda m: (m["val_acc"], -m["round"]))["round"]
    assert s["selected_file"] == "best_model.pt" and s["selected_round"] == best == s["best_model"]["round"]
    plain = Simulation(load_config(None, base=tiny_tree(rounds=4, train__lr=0.5)))  # no validation: evaluates on test
    for file, key in (("best_model.pt", "selected_test"), ("model.pt", "final_test")):
        state = torch.load(tmp_path / "run" / file, weights_only=True)
        w, b = plain.model.vectors(state)
        plain.server.w, plain.server.buffers = w.to(plain.device), b.to(plain.device)  # (the file holds CPU tensors)
        acc, loss = plain.evaluate()
        assert s[f"{key}_acc"] == acc and s[f"{key}_loss"] == pytest.approx(loss, rel=1e-12), file
    assert main(["evaluate", str(tmp_path / "run"), "--model", "best_model.pt", "--split", "test"]) == 0
    out = capsys.readouterr().out
    assert f"test accuracy {s['selected_test_acc']:.4f}" in out and "selected_test_acc" in out and "(reproduced)" in out
    assert main(["evaluate", str(tmp_path / "run"), "--model", "nope.pt"]) == 2
    assert "no model file 'nope.pt'" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "run"), "--format", "csv"]) == 0
    rows = capsys.readouterr().out.splitlines()
    column = rows[0].split(",").index("selected_test_acc_mean")
    assert float(rows[1].split(",")[column]) == pytest.approx(100 * s["selected_test_acc"], rel=1e-5)


def test_a_validation_run_without_a_kept_model_selects_its_final_one(tmp_path):
    from fedflat.api import run

    s = run(load_config(None, ["data.validation=0.25"], base=tiny_tree()), run_dir=tmp_path / "run",
            progress=False).summary
    assert s["selected_file"] == "model.pt" and s["selected_round"] == 3
    assert s["selected_test_acc"] == s["final_test_acc"] is not None


def test_a_users_split_loses_its_held_out_samples():
    cfg = load_config(None, ["data.validation=0.2", "data.num_clients=2", "sampling.clients_per_round=2"], base=tiny_tree())
    clients = [list(range(0, 90)), list(range(90, 180))]
    sim = Simulation(cfg, UserInputs(clients=clients))
    kept = validation_split(load_dataset("synthetic", **tiny_tree()["data"]["options"]), 0.2)[1]
    assert [len(ix) for ix in sim.client_indices_np] == [int((kept < 90).sum()), int((kept >= 90).sum())]
    assert np.array_equal(kept[sim.client_indices_np[1]], kept[kept >= 90])  # the same samples, re-indexed
    with pytest.raises(ConfigError, match="validation set"):
        Simulation(load_config(None, ["data.validation=0.5", "data.num_clients=2", "sampling.clients_per_round=2"],
                               base=tiny_tree()), UserInputs(clients=[[0], list(range(1, 180))]))


def test_every_recipe_grid_names_its_own_hyperparameters():
    for name, recipe in RECIPES.items():
        for key, values in recipe.tunable.items():
            assert key.startswith(("algo.", "train.")) and len(values) == len(set(values)) > 1, (name, key)
            for value in values:
                if key.startswith("algo."):
                    build_algorithm({"name": name, key[5:]: value})
                else:
                    load_config(None, [f"{key}={value}"])


def test_fedcm_and_mofedsam_search_the_same_momentum_weights():
    # MoFedSAM is FedCM with local SAM: a tune must not give its momentum weight a narrower range
    assert RECIPES["mofedsam"].tunable["algo.a"] == RECIPES["fedcm"].tunable["algo.a"]


def test_a_grid_larger_than_the_budget_is_sampled_evenly_and_reproducibly():
    rho = [0.1, 0.05, 0.01, 0.005, 0.001, 0.0005]
    assert _candidates({"algo.rho": rho}, 3, 0) == ([{"algo.rho": 0.1}, {"algo.rho": 0.01}, {"algo.rho": 0.0005}], 6)
    assert _candidates({"algo.rho": rho}, 6, 0)[0] == [{"algo.rho": r} for r in rho]  # all of a grid that fits
    space = {"algo.rho": rho, "algo.alpha": [0.3, 0.6, 0.9], "algo.beta": [0.1, 0.3, 0.5]}
    points, size = _candidates(space, 5, 0)
    assert size == 54 and len(points) == 5 and len({tuple(p.values()) for p in points}) == 5
    for key, values in space.items():  # every axis reaches both ends of its range
        assert {values[0], values[-1]} <= {p[key] for p in points}
    assert _candidates(space, 5, 0) == (points, size) and _candidates(space, 5, 1) != (points, size)


def test_selection_takes_the_best_score_first_on_ties_and_waits_for_unfinished():
    a, b, c = {"algo.rho": 0.1}, {"algo.rho": 0.01}, {"algo.rho": 0.001}
    assert select_candidate([(a, 0.5, "scored"), (b, 0.7, "scored"), (c, 0.7, "scored")]) == b
    assert select_candidate([(a, -math.inf, "diverged"), (b, 0.2, "scored")]) == b
    assert select_candidate([(a, -math.inf, "diverged")]) is None
    assert select_candidate([(a, 0.9, "scored"), (b, None, "unfinished")]) is None


def write_study(tmp_path: Path, test_size: int = 60, **search) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    base = tiny_tree(rounds=2)
    base["data"]["options"]["test_size"] = test_size
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    spec = {"base": "base.yaml", "out": str(tmp_path / "out"),
            "methods": {"fedavg": {"algo": "fedavg"}, "fedsam": {"algo": "fedsam"},
                        "fedprox": {"algo": "fedprox", "tune": {"algo.mu": [0.1, 0.01]}},
                        "fedsam-fixed": {"algo": "fedsam", "algo.rho": 0.05}},
            "search": {"budget": 3, "validation": 0.2, "seeds": [0], **search}, "final": {"seeds": [0, 1]}}
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_every_method_gets_the_same_budget_rounds_seeds_and_validation_split(tmp_path):
    study = load_study(write_study(tmp_path))
    trials = study.trial_cells()
    assert {name: len(per) for name, per in trials.items()} == {"fedavg": 1, "fedsam": 3, "fedprox": 2,
                                                               "fedsam-fixed": 1}
    assert study.methods["fedsam"].grid_size == len(RECIPES["fedsam"].tunable["algo.rho"])
    assert study.methods["fedsam-fixed"].space == {}  # a key the method sets is not searched
    shared = {(c.config.rounds, c.config.seed, c.config.data.validation, c.config.train.lr)
              for per in trials.values() for _, cells in per for c in cells}
    assert shared == {(2, 0, 0.2, 0.1)}
    rhos = [cells[0].config.algo["rho"] for _, cells in trials["fedsam"]]
    assert set(rhos) <= set(RECIPES["fedsam"].tunable["algo.rho"]) and len(set(rhos)) == 3
    finals = study.final_cells("fedprox", {"algo.mu": 0.01})
    assert [(c.config.seed, c.config.data.validation, c.config.algo["mu"]) for c in finals] == [(0, 0.0, 0.01),
                                                                                                 (1, 0.0, 0.01)]


def test_selection_never_reads_the_test_set_and_a_rerun_resumes(tmp_path):
    first = run_study(load_study(write_study(tmp_path / "a", test_size=60)), progress=False)
    # the same study on the same training data with another test set: every trial scores the same and the same
    # candidates are selected; only the final runs' test accuracies may move
    other = run_study(load_study(write_study(tmp_path / "b", test_size=150)), progress=False)
    for name, m in first.methods.items():
        assert [t["val_acc"] for t in m["trials"]] == [t["val_acc"] for t in other.methods[name]["trials"]]
        assert m["selected"] == other.methods[name]["selected"] is not None
        assert len(m["test_acc"]) == 2
    best = first.methods["fedsam"]
    assert best["val_acc"] == max(t["val_acc"] for t in best["trials"])
    index = json.loads((tmp_path / "a" / "out" / "tune.json").read_text())
    assert index["methods"]["fedprox"]["selected"] == first.methods["fedprox"]["selected"]

    # resume: a trial and a final run lost; the rerun redoes those two alone and reaches the same result
    out = tmp_path / "a" / "out"
    lost_trial = out / "trials" / first.methods["fedsam"]["trials"][1]["cells"][0]
    lost_final = out / "final" / first.methods["fedavg"]["final"][1]
    kept = out / "final" / first.methods["fedprox"]["final"][0] / "summary.json"
    stamp = kept.stat().st_mtime_ns
    for folder in (lost_trial, lost_final):
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    again = run_study(load_study(write_study(tmp_path / "a", test_size=60)), progress=False)
    assert again.methods == first.methods
    assert (lost_trial / "summary.json").exists() and (lost_final / "summary.json").exists()
    assert kept.stat().st_mtime_ns == stamp


def test_a_group_of_methods_runs_the_whole_studys_cells_and_the_index_keeps_the_others(tmp_path):
    path = write_study(tmp_path)
    group = run_study(load_study(path, only=["fedprox", "fedavg"]), progress=False)
    assert list(group.methods) == ["fedavg", "fedprox"]  # the file's order
    out = tmp_path / "out"
    assert {d.name.split("__")[0] for d in (out / "trials").iterdir() if d.is_dir()} == {"fedavg", "fedprox"}
    stamps = {f: f.stat().st_mtime_ns for f in out.glob("*/*/summary.json")}
    rest = run_study(load_study(path, only=["fedsam", "fedprox"]), progress=False)
    index = json.loads((out / "tune.json").read_text())
    assert list(index["methods"]) == ["fedavg", "fedsam", "fedprox"]  # the file's order
    assert index["methods"]["fedprox"]["selected"] == group.methods["fedprox"]["selected"]
    whole = run_study(load_study(path), progress=False)  # runs fedsam-fixed alone; the groups' cells are skipped
    assert all(f.stat().st_mtime_ns == t for f, t in stamps.items())
    assert whole.methods["fedsam"] == rest.methods["fedsam"] and whole.methods["fedavg"] == group.methods["fedavg"]
    other = run_study(load_study(write_study(tmp_path / "b"), only=["fedsam"]), progress=False)
    assert other.methods["fedsam"] == rest.methods["fedsam"]  # the same cells as a study of fedsam alone
    with pytest.raises(ConfigError, match="no method 'fedsma' in this file; its methods: fedavg, fedsam"):
        load_study(path, only=["fedsma"])


def test_bad_tune_files_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown search key 'budjet'.*did you mean 'budget'"):
        load_study(write_study(tmp_path, budjet=2))
    with pytest.raises(ConfigError, match="search.budget must be a positive integer"):
        load_study(write_study(tmp_path, budget=0))
    with pytest.raises(ConfigError, match="search.validation must be a fraction"):
        load_study(write_study(tmp_path, validation=1.5))
    with pytest.raises(ConfigError, match="search.select"):
        load_study(write_study(tmp_path, select="median"))
    with pytest.raises(ConfigError, match="not found"):
        load_study(tmp_path / "missing.yaml")


def test_the_command_runs_a_study_and_prints_the_selections(tmp_path, capsys):
    from fedflat.cli import main

    path = write_study(tmp_path)
    assert main(["tune", str(path), "--dry-run"]) == 0
    listing = capsys.readouterr().out
    assert "FedProx (fedprox): 2 of 2 candidates over algo.mu [0.1, 0.01]" in listing
    assert "fedprox__mu0.01__seed0" in listing
    assert main(["tune", str(path), "--methods", "fedprox, fedavg", "--dry-run"]) == 0
    assert [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")] == [
        "FedAvg (fedavg)", "FedProx (fedprox)"]
    assert main(["tune", str(path), "rounds=1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    # the methods as `fedflat report` names them (each recipe's display name), not their config ids
    assert "| FedProx | 2 (of 2) | algo.mu=" in out and f"fedflat report {tmp_path / 'out' / 'final'}" in out
    assert main(["list", "--grids"]) == 0
    assert "fedsam" in capsys.readouterr().out.split("tuning grids")[1]


def test_the_demo_runs_every_method_at_a_radius_chosen_the_same_way():
    """Issue 59: the demo ran FedLESAM at its default 0.01 beside FedSAM at 0.05. Every method of the demo sets its
    radius, each one the study configs/tune_demo.yaml selects from: the same setting (base and overrides), the same
    grid for every method, the demo's methods exactly."""
    from fedflat.experiments.sweep import load_sweep

    demo, study = load_sweep("demo_sweep"), load_study("tune_demo")
    assert demo.base == study.base and demo.overrides == study.overrides
    options = demo.axes["method"]
    assert set(options) == set(study.methods)
    grids = {name: method.space for name, method in study.methods.items()}
    assert grids["fedavg"] == {}
    assert len({tuple(values) for space in grids.values() for values in space.values()}) == 1  # one grid for all
    for name, overrides in options.items():
        chosen = {key: value for key, value in overrides if key != "algo"}
        assert set(chosen) == set(grids[name]), name  # the radius is set, and it is the tuned key
        for key, value in chosen.items():
            assert value in grids[name][key], (name, key, value)
        assert dict(overrides)["algo"] == name
