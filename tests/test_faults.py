"""Issue 59's faults: concurrent starts into one new output folder, sweep cells whose folder names collide, a data
folder that does not exist (and the files a run read), a run diverging in training."""
from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedflat.cli import main
from fedflat.core import ConfigError
from fedflat.experiments.rundir import RunDir, check_output_folder, remove_if_empty
from fedflat.experiments.sweep import load_sweep
from fedflat.files import read_jsonl
from tests.conftest import tiny_tree

REPO = Path(__file__).resolve().parents[1]
PROCESSES, FOLDERS = 8, 15


def _start_runs(root: str, barrier, errors) -> None:
    """What a run does with its output folder before its first round, into FOLDERS new nested folders, at once."""
    barrier.wait()
    for k in range(FOLDERS):
        try:
            out = Path(root) / f"new{k}" / "deep"
            check_output_folder(out)
            RunDir.create(out, "tiny")
        except BaseException as err:  # noqa: BLE001 - every failure is the finding
            errors.put(f"{type(err).__name__}: {err}")


def test_concurrent_starts_into_one_new_folder_all_succeed_each_in_its_own_run_folder(tmp_path):
    """Issue 59: check_output_folder made and removed the folder, so starts at once tripped over each other (136
    of 240 failed in an 8-process hammer, some with `OSError: Directory not empty`)."""
    ctx = multiprocessing.get_context("fork")
    barrier, errors = ctx.Barrier(PROCESSES), ctx.Queue()
    procs = [ctx.Process(target=_start_runs, args=(str(tmp_path), barrier, errors)) for _ in range(PROCESSES)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert failures == [] and all(p.exitcode == 0 for p in procs)
    for k in range(FOLDERS):
        assert len(list((tmp_path / f"new{k}" / "deep").iterdir())) == PROCESSES


def test_concurrent_cli_runs_into_one_new_out_folder_all_complete(tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_tree(rounds=1)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "runs" / "seeds"
    procs = [subprocess.Popen([sys.executable, "-m", "fedflat.cli", "run", str(config), f"seed={s}", "--out", str(out),
                               "--no-progress"], env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for s in range(3)]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in procs]
    assert [code for code, _ in results] == [0, 0, 0], results
    folders = sorted(out.iterdir())
    assert len(folders) == 3
    assert all(json.loads((f / "summary.json").read_text())["status"] == "completed" for f in folders)


@pytest.mark.parametrize("grid, message", [
    ({"method": {"a/b": {"seed": 1}, "a-b": {"seed": 2}}}, "grid axis 'method': 'a/b' and 'a-b' make the same cell "
                                                           "folder name 'a-b'"),
    ({"algo.name": ["x/y", "x-y", "x y"]}, "grid axis 'algo.name': 'x/y' and 'x-y' make the same cell folder name "
                                           "'x-y'"),
])
def test_sweep_options_whose_folder_names_collide_are_refused(tmp_path, grid, message):
    """Issue 59: such a sweep silently kept one of the cells."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": "quickstart", "grid": grid}, sort_keys=False))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_sweep(path)


def test_a_data_folder_that_does_not_exist_is_an_error_and_the_run_records_the_files_it_read(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert main(["run", "fmnist_mlp", "rounds=1", "--data-dir", str(missing), "--out", str(tmp_path / "r"),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"fedflat: data folder {missing} (data.root, --data-dir) does not exist: give the folder that "
                   "holds the fmnist files, or leave it out to search $FEDFLAT_DATA and the cache")
    fmnist = Path("/usr/share/datasets/fashion-mnist")
    if not fmnist.is_dir():
        pytest.skip("no Fashion-MNIST at /usr/share/datasets/fashion-mnist")
    assert main(["run", "fmnist_mlp", "rounds=1", "data.num_clients=10", "sampling.clients_per_round=2",
                 "train.local_epochs=1", "--data-dir", str(fmnist), "--out", str(tmp_path / "r"),
                 "--no-progress"]) == 0
    (folder,) = (tmp_path / "r").iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["data_source"] == str(fmnist)
    assert sorted(Path(f).name for f in summary["data_files"]) == sorted(p.name for p in fmnist.iterdir()
                                                                         if "idx" in p.name)
    assert all(Path(f).parent == fmnist for f in summary["data_files"])


def test_a_run_stopped_before_its_folder_leaves_no_empty_out_folder_and_keeps_one_it_did_not_make(tmp_path):
    """A bad --data-dir stopped the run after its --out folder was made: an empty folder stayed behind. The folders
    the run made go; a folder that was there before, or that another run wrote into, stays."""
    args = ["run", "fmnist_mlp", "rounds=1", "--data-dir", str(tmp_path / "nowhere"), "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "new" / "deeper")]) == 2
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "mine").mkdir()
    assert main([*args, "--out", str(tmp_path / "mine" / "runs")]) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["mine"] and list((tmp_path / "mine").iterdir()) == []
    made = check_output_folder(tmp_path / "a" / "b" / "c")
    assert made == [tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"]
    (tmp_path / "a" / "other run").mkdir()
    remove_if_empty(made)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["other run"]
    assert check_output_folder(tmp_path / "a") == []


def test_a_run_diverging_in_training_writes_the_rounds_line_with_its_loss_null(tmp_path):
    """docs/experiments.md: "that round's metrics line is written (its loss null)"; a run whose training diverged
    wrote none (issue 59)."""
    assert main(["run", "quickstart", "rounds=3", "train.lr=1e6", "train.clip=null", "--out", str(tmp_path),
                 "--no-progress"]) == 3
    (folder,) = tmp_path.iterdir()
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["reason"].startswith("round 1: ")
    (line,) = read_jsonl(folder / "metrics.jsonl")
    assert line["round"] == 1 and line["diverged"] is True
    assert line["train_loss"] is None and line["test_loss"] is None and line["test_acc"] is None


def test_the_readme_and_the_docs_name_every_file_a_run_folder_holds(tmp_path):
    """Issue 59: `.lock`, left in every run folder, was in neither table (nor checkpoint.pt in the README's)."""
    import fedflat
    from fedflat.config import load_config

    tree = tiny_tree(rounds=1)
    tree["callbacks"] = [{"name": "model_checkpoint", "metric": "test_acc"}]
    fedflat.run(load_config(None, base=tree), run_dir=tmp_path / "run", progress=False)
    files = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert ".lock" in files and "best_model.pt" in files
    for doc in ("README.md", "docs/experiments.md"):
        text = (REPO / doc).read_text()
        assert [f for f in files if f"| `{f}` |" not in text] == [], doc
