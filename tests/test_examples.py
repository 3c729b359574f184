"""Every script in examples/ runs as a user runs it (a fresh process in an empty folder) and does what it says."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

import fedflat
from fedflat.data import flwr_partitions, load_dataset

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run_example(script: str, *args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def run_folders(stdout: str, cwd: Path) -> dict[str, Path]:
    """``{algorithm: run folder}`` from the scripts' lines ``ALGO: completed, ... (FOLDER)``."""
    return {algo: cwd / folder for algo, folder in re.findall(r"^(\S+): completed, .*\((\S+)\)$", stdout, re.M)}


def test_every_example_is_tested():
    tested = set(re.findall(r'run_example\("(\w+\.py)"', Path(__file__).read_text()))
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_own_data_trains_a_users_dataset_and_model(tmp_path):
    """Both methods learn the breast-cancer table well above its majority class (0.632 of the test split)."""
    out = run_example("own_data.py", "rounds=20", "threads=1", "--out", "runs", cwd=tmp_path)
    assert "455 training and 114 test samples, majority class 0.632" in out
    folders = run_folders(out, tmp_path)
    assert sorted(folders) == ["fedavg", "fedsam"]
    for algo, folder in folders.items():
        summary = json.loads((folder / "summary.json").read_text())
        config = yaml.safe_load((folder / "config.yaml").read_text())
        assert summary["status"] == "completed" and summary["rounds"] == 20
        assert summary["final_test_acc"] > 0.85, (algo, summary["final_test_acc"])
        assert config["data"]["name"] == "user:breast_cancer" and config["model"]["name"] == "user:my_model"
        assert config["algo"]["name"] == algo and config["data"]["num_clients"] == 10


@pytest.mark.slow  # ~15 s (moved from make test: its 10 minutes)
def test_flwr_datasets_split_trains_on_the_partitioners_split(tmp_path):
    """The bridge (fedflat.data.flwr_partitions) hands fedflat exactly flwr-datasets' partitions: every client's
    samples are those the partitioner put in its partition (two classes each, disjoint), and the script's run
    equals one given that split."""
    pytest.importorskip("flwr_datasets", reason="flwr-datasets is not installed: `make setup` (the dev extra)")
    sys.path.insert(0, str(EXAMPLES))
    try:
        from flwr_datasets_split import PARTITIONERS
    finally:
        sys.path.remove(str(EXAMPLES))
    labels = load_dataset("digits").y_train.numpy()
    partitioner = PARTITIONERS["pathological"](20)
    clients = flwr_partitions(partitioner, labels)
    assert len(clients) == 20
    for i, indices in enumerate(clients):
        assert partitioner.load_partition(i)["label"] == labels[indices].tolist()
        assert len(set(labels[indices].tolist())) <= 2
    flat = np.concatenate(clients)
    assert len(flat) == len(set(flat.tolist())) <= len(labels)

    out = run_example("flwr_datasets_split.py", "--partitioner", "pathological", "rounds=4", "threads=1",
                      "--out", "runs", cwd=tmp_path)
    assert f"client sizes {[len(c) for c in clients]}" in out
    (folder,) = run_folders(out, tmp_path).values()
    summary = json.loads((folder / "summary.json").read_text())
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert config["data"]["partition"] == {"scheme": "user:20 clients"} and config["data"]["num_clients"] == 20
    same = fedflat.run(None, overrides=["rounds=4", "threads=1"], clients=clients, save=False, progress=False)
    assert summary["final_test_acc"] == same.summary["final_test_acc"]
    assert json.loads((folder / "metrics.jsonl").read_text().splitlines()[-1])["test_loss"] == \
        same.metrics[-1]["test_loss"]


@pytest.mark.slow  # two sweeps of six cells: about 45 s
def test_wandb_sweep_tracks_one_offline_run_per_cell_grouped_by_the_sweep(tmp_path):
    """Six cells on two worker processes, each one W&B run (offline files read back) named after its folder,
    grouped under the sweep, holding its config and every metrics line; a rerun skips them and adds none."""
    pytest.importorskip("wandb", reason="wandb is not installed: `make setup` (the dev extra)")
    from test_loggers import wandb_runs

    out = run_example("wandb_sweep.py", "rounds=2", "eval.every=1", "--workers", "2", cwd=tmp_path)
    assert out.count(": completed") == 6
    sweep = tmp_path / "runs" / "examples" / "wandb_sweep"
    runs = wandb_runs(sweep)
    assert len(runs) == 6 and {r["group"] for r in runs.values()} == {"wandb_sweep"}
    for run in runs.values():
        (folder,) = {p.parents[1] for p in run["folders"]}
        lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        assert sorted(run["history"]) == [m["round"] for m in lines] == [1, 2]
        assert run["config"]["algo"]["name"] == folder.name.split("__")[0]
    again = run_example("wandb_sweep.py", "rounds=2", "eval.every=1", "--workers", "2", cwd=tmp_path)
    assert again.count(": completed") == 6 and len(wandb_runs(sweep)) == 6


@pytest.mark.slow  # three runs in a fresh process: ~15 s on 2 cores
def test_loss_and_optimizer_trains_three_ways_and_reports_the_metrics(tmp_path):
    """Plain SGD, AdamW with kept moments and a warm-up into cosine annealing, and AdamW on a user's focal loss: each
    run's folder records what it trained with, its lr follows the schedule, and the report has the metrics' columns."""
    out = run_example("loss_and_optimizer.py", "rounds=5", "threads=1", "--out", "runs", cwd=tmp_path)
    folders = run_folders(out, tmp_path)
    assert sorted(folders) == ["adamw", "adamw-focal", "sgd"]
    for name, folder in folders.items():
        summary = json.loads((folder / "summary.json").read_text())
        train = yaml.safe_load((folder / "config.yaml").read_text())["train"]
        assert summary["status"] == "completed" and 0 < summary["final_test_f1"] <= 1
        assert 0.5 < summary["final_test_auroc"] <= 1  # better than chance after 5 rounds
        assert train["optimizer"] == ("sgd" if name == "sgd" else "adamw")
        assert train["loss"] == ("user:focal" if name == "adamw-focal" else "cross_entropy")
    lines = [json.loads(x) for x in (folders["adamw"] / "metrics.jsonl").read_text().splitlines()]
    # eval.every=5: round 5 only, t = 4, t' = t - 1 warm-up round = 3 of T' = 5 - 1
    assert [m["lr"] for m in lines] == pytest.approx([0.003 * (1 + np.cos(np.pi * 3 / 4)) / 2], rel=1e-12)
    assert "final f1 (%)" in out and "final auroc (%)" in out
