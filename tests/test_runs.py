"""Run folders: contents, atomicity, and what a diverged, interrupted or failed run leaves behind."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import fedflat
from fedflat.cli import main
from fedflat.engine.checkpoint import read_checkpoint
from fedflat.engine.simulation import Simulation
from fedflat.experiments.resume import metrics_equal, resume
from fedflat.experiments.rundir import RunDir
from fedflat.files import atomic_write_text, read_jsonl
from fedflat.models import build_model

REQUIRED_METRICS = {"round", "test_acc", "test_loss", "train_loss", "lr", "seconds", "up_vectors", "down_vectors",
                    "drift"}


def test_run_folder_contents_and_rerun_from_its_config(tiny, tmp_path):
    hist = fedflat.run(tiny("eval.every=2"), out=tmp_path, progress=False)
    folder = hist.run_dir
    assert {"config.yaml", "metrics.jsonl", "model.pt", "summary.json"} <= {p.name for p in folder.iterdir()}
    metrics = read_jsonl(folder / "metrics.jsonl")
    assert [m["round"] for m in metrics] == [2, 3]  # every 2 rounds, and the last
    assert REQUIRED_METRICS <= set(metrics[0])
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["rounds"] == 3
    assert summary["final_test_acc"] == metrics[-1]["test_acc"]
    assert summary["best_test_acc"] == max(m["test_acc"] for m in metrics)
    assert {"python", "torch", "fedflat"} <= set(summary["versions"]) and summary["machine"]["cpu_count"]
    # the final model loads into a fresh module and equals the returned parameters
    state = torch.load(folder / "model.pt")
    module = build_model("mlp", (1, 4, 4), 3, hidden=[8])
    module.load_state_dict(state)
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    torch.testing.assert_close(flat, hist.final_parameters)
    # config.yaml is complete: rerunning it reproduces the metrics
    again = fedflat.run(folder / "config.yaml", out=tmp_path, progress=False)
    assert again.run_dir != folder
    assert metrics_equal(again.metrics, metrics)


def test_run_folders_are_never_reused(tmp_path):
    a, b = RunDir.create(tmp_path, "x"), RunDir.create(tmp_path, "x")
    assert a.path != b.path and a.path.is_dir() and b.path.is_dir()


def test_atomic_write_leaves_old_file_when_writing_fails(tmp_path, monkeypatch):
    target = tmp_path / "summary.json"
    atomic_write_text(target, "old")

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fsync", broken_fsync)
    with pytest.raises(OSError, match="No space"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary left behind


def test_torn_last_metrics_line_is_ignored(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 1}\n{"round": 2}\n{"rou')
    assert read_jsonl(path) == [{"round": 1}, {"round": 2}]


def test_diverged_run_keeps_metrics_and_says_so(tiny, tmp_path):
    cfg = tiny("rounds=30", "train.lr=1e6", "train.clip=null", "train.weight_decay=0")
    hist = fedflat.run(cfg, out=tmp_path, progress=False)
    summary = json.loads((hist.run_dir / "summary.json").read_text())
    assert summary["status"] == "diverged" and ("non-finite" in summary["reason"] or "is nan" in summary["reason"])
    assert summary["rounds"] < 30
    # counted from 1, like the summary: a round that diverged in training is not counted, one whose model evaluated to
    # NaN is (and its metrics line recorded)
    assert summary["reason"].startswith((f"round {summary['rounds'] + 1}:", f"round {summary['rounds']}: the test"))
    assert len(read_jsonl(hist.run_dir / "metrics.jsonl")) == summary["rounds"]
    assert (hist.run_dir / "model.pt").exists() and (hist.run_dir / "config.yaml").exists()


@pytest.mark.parametrize("error, status_reason", [(KeyboardInterrupt, "interrupted"), (MemoryError, "MemoryError")])
def test_interrupted_or_crashed_run_leaves_a_consistent_folder(tiny, tmp_path, monkeypatch, error, status_reason):
    original = Simulation.run_round

    def failing(self, t):
        if t == 2:
            raise error()
        return original(self, t)

    monkeypatch.setattr(Simulation, "run_round", failing)
    with pytest.raises(error):
        fedflat.run(tiny("rounds=5"), out=tmp_path, progress=False)
    (folder,) = list(tmp_path.iterdir())
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "failed" and status_reason in summary["reason"]
    assert [m["round"] for m in read_jsonl(folder / "metrics.jsonl")] == [1, 2]
    assert summary["rounds"] == 2 and (folder / "model.pt").exists()


def _interrupt_once(monkeypatch, cls, name: str, when) -> None:
    """Makes ``cls.name`` raise KeyboardInterrupt once, after (or instead of) its work, when ``when(self)``."""
    original, fired = getattr(cls, name), []

    def patched(self, *args):
        out = original(self, *args)
        if not fired and when(self):
            fired.append(True)
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(cls, name, patched)


@pytest.mark.parametrize("where", ["evaluation", "after the commit"])
def test_an_interrupt_between_the_commit_and_the_metrics_line_loses_no_round(tiny, tmp_path, monkeypatch, where):
    """Ctrl-C lands after round 3 is committed but before its metrics line is written: the checkpoint is
    of round 3 and owes that line; the resume writes it and ends equal to a run never interrupted."""
    full = fedflat.run(tiny("rounds=5"), save=False, progress=False)
    if where == "evaluation":
        _interrupt_once(monkeypatch, Simulation, "evaluate", lambda sim: sim.server.last_round.round == 2)
    else:
        _interrupt_once(monkeypatch, Simulation, "run_round", lambda sim: sim.server.last_round.round == 2)
    with pytest.raises(KeyboardInterrupt):
        fedflat.run(tiny("rounds=5", "checkpoint_every=1"), out=tmp_path, progress=False)
    monkeypatch.undo()
    (folder,) = list(tmp_path.iterdir())
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["rounds"] == 3 and read_checkpoint(folder)["round"] == 3
    assert [m["round"] for m in read_jsonl(folder / "metrics.jsonl")] == [1, 2]
    resumed = resume(folder, progress=False)
    assert metrics_equal(resumed.metrics, full.metrics)
    assert torch.equal(resumed.final_parameters, full.final_parameters)


def test_cli_run_list_and_partition(tiny, tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny().model_dump()))
    assert main(["run", str(config), "rounds=2", "--out", str(tmp_path / "runs"), "--no-progress",
                 "algo=fedlesam", "algo.filter=fft"]) == 0
    out = capsys.readouterr().out
    assert "run folder:" in out and "status: completed" in out
    # the method as the report's tables name it (its recipe's display name), not its config id
    assert "\nFedLESAM[filter=fft] on synthetic: 2 rounds, final test accuracy" in out
    assert main(["list"]) == 0
    listing = capsys.readouterr().out
    for name in ("fedavg", "fedsam", "digits", "fmnist", "resnet18", "dirichlet", "pathological"):
        assert f"  {name} " in listing
    png = tmp_path / "split.png"
    assert main(["partition", str(config), "data.partition=pathological", "data.partition.classes=2",
                 "--png", str(png)]) == 0
    table = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in table if line.strip() and line.split()[0].isdigit()]
    assert len(rows) == 6 and all(int(r[2]) == 2 for r in rows)  # 2 classes per client
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # ~11 s (moved from make test: its 10 minutes)
def test_a_terminal_sees_the_run_folder_once(tmp_path):
    """On a terminal the run folder is announced at the start (stderr) and was printed again at the end (stdout):
    twice (issue 32). A script reading stdout still gets it at the end (test_cli_run_list_and_partition)."""
    import os
    import pty
    import subprocess
    import sys

    controller, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "fedflat.cli", "run", "rounds=2", "--out", str(tmp_path),
                             "--no-progress"], stdout=terminal, stderr=terminal, cwd=Path(__file__).parents[1])
    os.close(terminal)
    output = b""
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # the terminal's other end closed: the run ended
            break
        if not chunk:
            break
        output += chunk
    assert proc.wait(timeout=120) == 0
    os.close(controller)
    assert output.decode().count("run folder:") == 1 and "status: completed" in output.decode()


def test_cli_takes_overrides_after_the_options_and_refuses_unknown_ones(tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": "quickstart", "out": str(tmp_path / "out"), "grid": {"seed": [0, 1]}}))
    assert main(["sweep", str(sweep), "--dry-run", "rounds=7", "train.lr=0.2"]) == 0
    cells = [line for line in capsys.readouterr().out.splitlines() if "seed=" in line]
    assert len(cells) == 2 and all("rounds=7" in c and "train.lr=0.2" in c for c in cells)
    for stray in (["--bogus"], ["rounds"]):
        with pytest.raises(SystemExit):
            main(["sweep", str(sweep), "--dry-run", *stray])
        assert f"unrecognized arguments: {stray[0]}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["list", "algo=fedsam"])  # list takes no overrides


def test_cli_reports_config_errors_without_traceback(capsys):
    assert main(["run", "train.lr_rate=0.1"]) == 2
    assert "did you mean 'train.lr'" in capsys.readouterr().err


def test_quickstart_learns_digits():
    """The embedded quickstart, shortened to 30 rounds: measured 0.93 test accuracy (chance 0.10)."""
    hist = fedflat.run(None, overrides=["rounds=30"], save=False, progress=False)
    assert hist.summary["final_test_acc"] > 0.85


def test_missing_dataset_names_every_place_searched(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FEDFLAT_DATA", str(tmp_path / "env"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "mine").mkdir()  # a data folder without the files (one that does not exist: tests/test_faults.py)
    assert main(["run", "data=cifar10", "model=cnn", "--data-dir", str(tmp_path / "mine"),
                 "--out", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err
    for place in ("mine", "env", "cache"):
        assert place in err
    assert "download" in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
