"""A run's outcome says what happened (issue 44.3, 44.8): a non-finite evaluation ends it ``diverged`` at that round,
a collapse to chance accuracy is a warning, the run folder is printed once, and a resume keeps config.yaml."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import fedflat
from fedflat.cli import main
from fedflat.config import load_config
from fedflat.experiments.resume import resume
from fedflat.experiments.summary import at_chance
from fedflat.files import read_jsonl

REPO = Path(__file__).resolve().parents[1]


class _Overflowing(nn.Module):
    """Trains as a linear model; evaluates with logits scaled past float32's range (the model stays finite: only
    its evaluation overflows, as a poisoned aggregate's did)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 3)

    def forward(self, x):
        logits = self.linear(x.flatten(1))
        return logits if self.training else logits * 1e38 * 1e38


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_a_non_finite_evaluation_ends_the_run_diverged_at_its_round(tiny, tmp_path, engine):
    """(The vectorized engine, engine=auto's on a GPU, once trained this module in the eval() mode its chunk
    budget's probe left behind: a non-finite local loss instead.)"""
    history = fedflat.run(tiny("rounds=3", f"engine={engine}"), model_fn=_Overflowing, run_dir=tmp_path / "run",
                          progress=False)
    s = history.summary
    assert s["status"] == "diverged" and s["reason"].startswith("round 1: the test loss is nan"), s["reason"]
    assert s["rounds"] == 1 and all(torch.isfinite(history.final_parameters))
    line, = read_jsonl(tmp_path / "run" / "metrics.jsonl")  # the round that diverged is recorded
    assert line["round"] == 1 and line["test_loss"] is None
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "diverged"


def test_a_huge_learning_rate_without_clipping_is_diverged_not_completed(tiny):
    """The clients whose uploads are already non-finite are rejected (validation.invalid: reject), the others' huge
    model then evaluates to NaN: diverged, naming the round, within the three rounds."""
    history = fedflat.run(tiny("rounds=3", "train.lr=1e6", "train.clip=null"), save=False, progress=False)
    reason = history.summary["reason"]
    assert history.summary["status"] == "diverged" and reason.split(":")[0] in ("round 1", "round 2", "round 3")


def test_chance_level_is_three_binomial_standard_errors():
    # p = 0.1, n = 10,000: sqrt(0.1 * 0.9 / 10,000) = 0.003, so the band is 0.1 +- 0.009
    assert at_chance(0.1, 10, 10_000) and at_chance(0.1089, 10, 10_000) and at_chance(0.0911, 10, 10_000)
    assert not at_chance(0.1091, 10, 10_000) and not at_chance(0.0909, 10, 10_000)
    # p = 1/3, n = 60: sqrt(2/9 / 60) = 0.0609, band 1/3 +- 0.1826
    assert at_chance(0.51, 3, 60) and not at_chance(0.52, 3, 60) and not at_chance(0.75, 3, 60)
    assert not at_chance(0.5, 2, 0)


def test_a_collapse_to_chance_is_a_warning_in_the_summary_and_the_output(tiny_tree_file, tmp_path, capsys):
    """lr 2.5 without clipping: every round's loss stays finite, and the model ends at chance (0.40 on 60 test
    samples of 3 classes). The run completes, and says so."""
    code = main(["run", str(tiny_tree_file), "rounds=5", "train.lr=2.5", "train.clip=null", "--out",
                 str(tmp_path / "runs"), "--no-progress"])
    out = capsys.readouterr()
    folder, = (tmp_path / "runs").iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert code == 0 and summary["status"] == "completed"
    assert at_chance(summary["final_test_acc"], 3, 60)
    warning, = summary["warnings"]
    assert "at chance level (1/3 = 0.3333)" in warning and f"warning: {warning}" in out.err
    assert (summary["test_samples"], summary["num_classes"]) == (60, 3)  # what the report judges it by
    assert main(["report", str(tmp_path / "runs")]) == 0
    table = capsys.readouterr().out
    assert "| at chance 1/1 |" in table and "Held out: 60 test samples (synthetic): one is 1.7 points" in table


def test_a_run_that_learned_has_no_warning(tiny):
    history = fedflat.run(tiny("rounds=5"), save=False, progress=False)
    assert not at_chance(history.summary["final_test_acc"], 3, 60) and "warnings" not in history.summary


@pytest.fixture
def tiny_tree_file(tmp_path):
    import yaml

    from conftest import tiny_tree

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump({**tiny_tree(), "threads": 1}))
    return path


@pytest.mark.slow  # two command lines in new processes (torch's import)
def test_the_run_folder_is_printed_once_when_stdout_and_stderr_are_one_stream(tiny_tree_file, tmp_path):
    log = tmp_path / "log.txt"
    with open(log, "w") as fh:  # `fedflat run ... > log.txt 2>&1`
        done = subprocess.run([sys.executable, "-m", "fedflat.cli", "run", str(tiny_tree_file), "rounds=1", "--out",
                               str(tmp_path / "runs"), "--no-progress"], stdout=fh, stderr=subprocess.STDOUT,
                              cwd=REPO, timeout=120)
    assert done.returncode == 0 and log.read_text().count("run folder:") == 1, log.read_text()
    apart = subprocess.run([sys.executable, "-m", "fedflat.cli", "run", str(tiny_tree_file), "rounds=1", "--out",
                            str(tmp_path / "runs"), "--no-progress"], capture_output=True, text=True, cwd=REPO,
                           timeout=120)
    assert "run folder:" in apart.stdout and "run folder:" in apart.stderr  # scripts read stdout


def test_a_resume_keeps_config_yaml_as_written(tiny, tmp_path):
    from fedflat.experiments.sweep import run_cell

    from conftest import tiny_tree

    folder = tmp_path / "cell"  # a sweep's cell validates its config once: the default 4096 stays a whole number
    assert run_cell(tiny_tree(rounds=1), str(folder))["status"] == "completed"
    before = (folder / "config.yaml").read_text()
    assert "memory_mb: 4096," in before
    resume(folder, overrides=["rounds=2"], progress=False)
    assert (folder / "config.yaml").read_text() == before.replace("rounds: 1\n", "rounds: 2\n")
    assert math.isclose(load_config(folder / "config.yaml").store.memory_mb, 4096)


class _TrainsOnlyInTrainMode(nn.Module):
    """A module without buffers, dropout or randomness whose forward reads ``self.training``: the engines keep no
    per-client state for it and set its mode for every pass themselves."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 3)
        self.grad_modes: list[bool] = []  # the mode of each pass that builds a graph (training passes)

    def forward(self, x):
        if torch.is_grad_enabled():
            self.grad_modes.append(self.training)
        return self.linear(x.flatten(1))


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_a_module_without_state_trains_in_train_mode_after_an_evaluation(tiny, engine):
    from fedflat.engine.simulation import Simulation, UserInputs

    sim = Simulation(tiny("rounds=2", f"engine={engine}"), UserInputs(model_fn=_TrainsOnlyInTrainMode))
    module = sim.model.module
    for t in range(2):
        module.grad_modes.clear()
        sim.run_round(t)
        assert module.grad_modes and all(module.grad_modes), t
        sim.evaluate()  # eval() mode: the next round's passes must not inherit it
        assert not module.training
