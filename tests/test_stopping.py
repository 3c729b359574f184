"""Stopping a run from a callback (``should_stop``), EarlyStopping and ModelCheckpoint, through resume and sweeps."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

import fedflat
from fedflat.api import Callback, EarlyStopping, ModelCheckpoint, RunInfo
from fedflat.cli import main
from fedflat.config import load_config
from fedflat.core import ConfigError
from fedflat.engine.checkpoint import read_checkpoint
from fedflat.experiments.resume import metrics_equal, resume
from fedflat.experiments.sweep import load_sweep, run_sweep
from fedflat.files import read_jsonl
from tests.conftest import tiny_tree

# On the tiny problem (tests/conftest.py, 12 rounds, every round evaluated) test accuracy rises to 0.983 at
# round 8 and falls back after it: early stopping with these options ends the run at round 10 of 12, and the
# best test accuracy (what model_checkpoint keeps) is round 8's.
CALLBACKS = [{"name": "early_stopping", "metric": "test_acc", "patience": 2, "min_delta": 0.02},
             {"name": "model_checkpoint", "metric": "test_acc"}]


def stopping_tree(**extra) -> dict:
    tree = tiny_tree(**{"rounds": 12, "threads": 1, "checkpoint_every": 3, **extra})
    tree["eval"] = {"every": 1}
    tree["callbacks"] = CALLBACKS
    return tree


def fake_run() -> RunInfo:
    return RunInfo(config={}, run_dir=None, name="t")


def feed(callback, values: list[float], key: str = "test_acc") -> RunInfo:
    """``values`` as the metrics lines of rounds 1, 2, ... until the callback stops the run."""
    run = fake_run()
    for r, v in enumerate(values, start=1):
        callback.on_evaluation(run, r, {key: v})
        if run.should_stop:
            break
    return run


class StopAt(Callback):
    def __init__(self, round: int):
        self.round = round

    def on_round_end(self, run, round, metrics):
        if round == self.round:
            run.stop(f"asked at round {round}")


def test_a_callback_stops_the_run_which_returns_its_history(tiny, tmp_path):
    """Stopped after round 2 of 5: status, reason, files and History as a completed run's, and the model is
    the one a run planned for 2 rounds ends with (the learning rate decays per round, not over the plan)."""
    cfg = tiny("rounds=5", "eval.every=2", "checkpoint_every=0")
    history = fedflat.run(cfg, run_dir=tmp_path / "run", progress=False, callbacks=[StopAt(2)])
    short = fedflat.run(tiny("rounds=2", "eval.every=2"), save=False, progress=False)
    assert history.summary["status"] == "stopped" and history.summary["reason"] == "asked at round 2"
    assert history.summary["rounds"] == 2 and history.summary["rounds_planned"] == 5
    assert torch.equal(history.final_parameters, short.final_parameters)
    assert metrics_equal(history.metrics, short.metrics)
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["status"] == "stopped" and on_disk["reason"] == "asked at round 2"
    assert read_checkpoint(tmp_path / "run")["round"] == 2
    model = torch.load(tmp_path / "run" / "model.pt")
    assert all(torch.equal(model[k], v) for k, v in short.state_dict.items())


def test_should_stop_as_lightning_sets_it_and_on_the_last_round_the_run_completes(tiny):
    class Flag(Callback):
        def on_round_end(self, run, round, metrics):
            run.should_stop = round >= 1

    history = fedflat.run(tiny("rounds=3"), save=False, progress=False, callbacks=[Flag()])
    assert history.summary["status"] == "stopped" and history.summary["rounds"] == 1
    assert "should_stop" in history.summary["reason"]
    last = fedflat.run(tiny("rounds=3"), save=False, progress=False, callbacks=[StopAt(3)])
    assert last.summary["status"] == "completed" and last.summary["reason"] is None


def test_early_stopping_counts_evaluations_without_improvement_by_min_delta():
    # max: best 0.5 (r1), 0.6 (r2); 0.6 and 0.605 are not above 0.6 + 0.01: waits 1, 2 -> stops at round 4
    es = EarlyStopping("test_acc", patience=2, min_delta=0.01)
    run = feed(es, [0.5, 0.6, 0.6, 0.605, 0.9])
    assert run.should_stop and es.stopped_round == 4 and (es.best, es.best_round, es.wait) == (0.6, 2, 2)
    assert "test_acc" in run.stop_reason and "round 2" in run.stop_reason
    # min (inferred from the name): an improvement resets the count; NaN never improves
    es = EarlyStopping("val_loss", patience=2)
    run = feed(es, [1.0, 0.9, 0.95, 0.8, math.nan, 0.85], key="val_loss")
    assert es.mode == "min" and run.should_stop and es.stopped_round == 6 and es.best == 0.8
    es = EarlyStopping("test_acc", patience=3)
    assert not feed(es, [0.1, 0.2, 0.3, 0.3, 0.3]).should_stop and es.wait == 2


def test_model_checkpoint_keeps_the_strictly_best_and_the_earliest_on_ties():
    states = iter(range(10))
    run = fake_run()
    run.state_fn = lambda: {"w": torch.tensor([float(next(states))])}
    mc = ModelCheckpoint("test_loss")
    for r, v in enumerate([0.9, 0.5, 0.5, 0.7], start=1):
        mc.on_evaluation(run, r, {"test_loss": v})
    assert (mc.best, mc.best_round) == (0.5, 2) and mc.best_state["w"].item() == 1.0
    assert run.notes["best_model"] == {"file": None, "metric": "test_loss", "mode": "min", "value": 0.5,
                                       "round": 2}


def test_bad_callback_options_are_clear_errors():
    with pytest.raises(ConfigError, match="mode: max or mode: min"):
        EarlyStopping("drift")
    with pytest.raises(ConfigError, match="patience must be >= 1"):
        EarlyStopping("test_acc", patience=0)
    with pytest.raises(ConfigError, match="model.pt"):
        ModelCheckpoint("test_acc", filename="model.pt")
    base = tiny_tree()
    with pytest.raises(ConfigError, match=r"callbacks: unknown early_stopping option 'patince' \(did you mean "
                                          r"'patience'\?\)"):
        load_config(None, (), base={**base, "callbacks": [{"name": "early_stopping", "metric": "test_acc",
                                                           "patince": 3}]})
    with pytest.raises(ConfigError, match="unknown callback 'early_stop'.*did you mean 'early_stopping'"):
        load_config(None, (), base={**base, "callbacks": [{"name": "early_stop", "metric": "test_acc"}]})
    with pytest.raises(ConfigError, match="callbacks.0.early_stopping.metric"):
        load_config(None, (), base={**base, "callbacks": [{"name": "early_stopping"}]})


def test_a_metric_the_lines_lack_is_a_warning_naming_it(tiny):
    with pytest.warns(UserWarning, match="metric 'tset_acc' is not in the metrics line; it has round, test_acc"):
        history = fedflat.run(tiny("rounds=2"), save=False, progress=False,
                              callbacks=[EarlyStopping("tset_acc", mode="max")])
    assert history.summary["status"] == "completed"


def test_config_callbacks_stop_early_and_keep_the_best_model(tmp_path):
    history = fedflat.run(stopping_tree(), run_dir=tmp_path / "run", progress=False)
    accs = history.column("test_acc")
    best = max(range(len(accs)), key=lambda i: (accs[i], -i)) + 1  # the earliest of the best
    assert history.summary["status"] == "stopped" and history.summary["rounds"] == 10
    assert history.summary["reason"].startswith("early stopping: test_acc did not improve by more than 0.02 in 2")
    assert all(a <= accs[best - 1] + 0.02 for a in accs[best:]) and len(accs) - best == 2
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["best_model"] == {"file": "best_model.pt", "metric": "test_acc", "mode": "max",
                               "value": accs[best - 1], "round": best}
    assert s["early_stopping"]["stopped_round"] == 10 and s["early_stopping"]["best_round"] == best
    # best_model.pt is the global model after round `best`: what a run planned for that many rounds ends with
    at_best = fedflat.run({**stopping_tree(rounds=best), "callbacks": []}, save=False, progress=False)
    saved = torch.load(tmp_path / "run" / "best_model.pt")
    assert saved.keys() == at_best.state_dict.keys()
    assert all(v.device.type == "cpu" for v in at_best.state_dict.values())  # as final_parameters, on any device
    assert all(torch.equal(saved[k], at_best.state_dict[k]) for k in saved)


def _killed_after(tree: dict, folder: Path, round: int) -> None:
    """The run of ``tree`` killed (SIGKILL: nothing more is written) right after round ``round``."""
    from fedflat.experiments import runner

    class Killed(Exception):
        pass

    original, finish = runner.Runner._round, runner.Runner._finish

    def round_then_die(self, t, bar):
        original(self, t, bar)
        if t + 1 == round:
            raise Killed

    runner.Runner._round, runner.Runner._finish = round_then_die, lambda self, wall_seconds: None
    try:
        with pytest.raises(Killed):
            fedflat.run(tree, run_dir=folder, progress=False)
    finally:
        runner.Runner._round, runner.Runner._finish = original, finish


def test_a_resumed_run_stops_at_the_same_round_with_the_same_best_model(tmp_path):
    """Killed after round 9 (checkpoint at 6, best_model.pt already round 8's): the resume restores both
    callbacks' state from the checkpoint, rewrites best_model.pt as it was at round 6, stops at round 10 and
    ends with the files of the uninterrupted run."""
    full = fedflat.run(stopping_tree(), run_dir=tmp_path / "full", progress=False)
    folder = tmp_path / "killed"
    _killed_after(stopping_tree(), folder, 9)
    assert read_checkpoint(folder)["round"] == 6
    at_6 = fedflat.run({**stopping_tree(rounds=6), "callbacks": []}, save=False, progress=False)
    at_6_best = max(range(6), key=lambda i: at_6.metrics[i]["test_acc"]) + 1
    assert at_6_best == 6  # (so the file at the checkpoint is round 6's model, not round 8's)

    seen = {}

    class Probe(Callback):  # after the config's callbacks: sees best_model.pt as the resume left it
        def on_run_start(self, run):
            seen["file"] = torch.load(run.run_dir / "best_model.pt")

    resumed = resume(folder, progress=False, callbacks=[Probe()])
    assert all(torch.equal(seen["file"][k], at_6.state_dict[k]) for k in at_6.state_dict)
    assert resumed.summary["status"] == "stopped" and resumed.summary["rounds"] == 10
    assert resumed.summary["reason"] == full.summary["reason"]
    assert metrics_equal(read_jsonl(folder / "metrics.jsonl"), read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    a, b = (json.loads((f / "summary.json").read_text()) for f in (folder, tmp_path / "full"))
    assert a["best_model"] == b["best_model"] and a["early_stopping"] == b["early_stopping"]
    best_a, best_b = (torch.load(f / "best_model.pt") for f in (folder, tmp_path / "full"))
    assert all(torch.equal(best_a[k], best_b[k]) for k in best_b)
    # a stopped run is finished: resuming it again returns it as it is, writing nothing
    files = {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file() and p.name != ".lock"}
    again = resume(folder, progress=False)
    assert again.summary["status"] == "stopped" and again.summary["rounds"] == 10
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir() if p.is_file() and p.name != ".lock"} == files


def test_a_stopped_cell_is_finished_and_a_rerun_skips_it(tmp_path):
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(stopping_tree()))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "base.yaml", "out": str(tmp_path / "out"), "grid": {"seed": [0]}}))
    first = run_sweep(load_sweep(path), progress=False)
    assert [(c["status"], c["action"], c["rounds"]) for c in first.cells] == [("stopped", "ran", 10)]
    second = run_sweep(load_sweep(path), progress=False)
    assert [(c["status"], c["action"]) for c in second.cells] == [("stopped", "skipped")]


def test_the_cli_reports_a_stopped_run_and_exits_0(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    tree = tiny_tree(rounds=4, threads=1)
    tree["callbacks"] = [{"name": "early_stopping", "metric": "train_loss", "mode": "max", "patience": 1}]
    config.write_text(yaml.safe_dump(tree))
    assert main(["run", str(config), "--out", str(tmp_path / "runs"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "status: stopped (early stopping: train_loss did not improve" in out


def test_the_docs_callbacks_section_is_a_valid_config():
    text = (Path(__file__).resolve().parents[1] / "docs" / "experiments.md").read_text()
    section = text.split("### Stopping early and keeping the best model", 1)[1]
    block = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = load_config(None, (), base={**tiny_tree(), **yaml.safe_load(block)})
    assert [c.name for c in cfg.callbacks] == ["early_stopping", "model_checkpoint"]
    assert cfg.callbacks[0].patience == 5 and cfg.callbacks[1].metric == "val_loss"
