"""Callbacks and loggers: every event in order, nothing they do changes a run or costs its results, and the
real TensorBoard, CSV, W&B (offline) and MLflow (SQLite) loggers record the config and every metrics line,
continue their tracked run on resume and track one run per sweep or tune cell."""
from __future__ import annotations

import csv
import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import fedflat
from fedflat.cli import main
from fedflat.engine.checkpoint import read_checkpoint
from fedflat.experiments.callbacks import Callback, CallbackError, CallbackWarning
from fedflat.experiments.loggers import LOGGERS, TRACKING_FILE, hyperparameters, scalars
from fedflat.experiments.resume import metrics_equal, resume
from fedflat.experiments.sweep import load_sweep, run_sweep
from fedflat.files import read_jsonl
from tests.conftest import tiny_tree

REPO = Path(__file__).resolve().parents[1]
WALL = ("seconds", "eval_seconds", "train_seconds")  # wall-clock fields: the only ones a rerun changes


class Recorder(Callback):
    """Records every event it is told, with copies of what it got."""

    def __init__(self, stop_at: int | None = None):
        self.events: list[tuple] = []
        self.stop_at = stop_at

    def on_run_start(self, run):
        self.events.append(("start", run))

    def on_round_end(self, run, round, metrics):
        self.events.append(("round", round, metrics))
        if round == self.stop_at:
            raise KeyboardInterrupt("test stop")  # Ctrl-C, as the user would press it

    def on_evaluation(self, run, round, metrics):
        self.events.append(("evaluation", round, metrics))

    def on_checkpoint(self, run, round, path):
        self.events.append(("checkpoint", round, path.exists()))

    def on_run_end(self, run, summary, status):
        self.events.append(("end", summary, status))


def kinds(recorder: Recorder) -> list[str]:
    return [f"{e[0]}{e[1] if e[0] in ('round', 'evaluation', 'checkpoint') else ''}" for e in recorder.events]


def test_callbacks_are_told_every_event_in_order(tiny, tmp_path):
    rec = Recorder()
    hist = fedflat.run(tiny("rounds=4", "eval.every=2", "checkpoint_every=3"), run_dir=tmp_path / "run",
                       progress=False, callbacks=[rec])
    assert kinds(rec) == ["start", "round1", "evaluation2", "round2", "round3", "checkpoint3", "evaluation4",
                          "round4", "checkpoint4", "end"]
    start = rec.events[0][1]
    assert start.config == yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert (start.run_dir, start.name, start.start_round, start.metrics) == (tmp_path / "run", "run", 0, [])
    lines = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [e[2] for e in rec.events if e[0] == "evaluation"] == lines
    assert rec.events[3][2] == lines[0]  # an evaluated round's end carries its metrics line
    first = rec.events[1][2]  # ... an unevaluated one its training numbers
    assert first["round"] == 1 and "test_acc" not in first and set(first) >= {"train_loss", "lr", "clients"}
    assert all(e[2] for e in rec.events if e[0] == "checkpoint")
    _, summary, status = rec.events[-1]
    assert status == "completed" and summary == json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary == hist.summary


def test_a_resumed_run_tells_callbacks_where_it_starts(tiny, tmp_path):
    rec = Recorder(stop_at=3)
    with pytest.raises(KeyboardInterrupt):
        fedflat.run(tiny("rounds=5", "checkpoint_every=2"), run_dir=tmp_path / "run", progress=False, callbacks=[rec])
    _, summary, status = rec.events[-1]
    assert status == "failed" and summary["reason"].startswith("interrupted") and summary["rounds"] == 3
    again = Recorder()
    resume(tmp_path / "run", progress=False, callbacks=[again])
    start = again.events[0][1]
    assert start.start_round == 3 and start.resumed  # the interrupt wrote round 3's checkpoint
    assert start.metrics == read_jsonl(tmp_path / "run" / "metrics.jsonl")[:3]
    assert kinds(again) == ["start", "evaluation4", "round4", "checkpoint4", "evaluation5", "round5", "checkpoint5",
                            "end"]


def test_callbacks_change_nothing_and_their_failures_cost_nothing(tiny, tmp_path):
    class Meddler(Callback):
        def on_run_start(self, run):
            run.config["rounds"] = 1

        def on_evaluation(self, run, round, metrics):
            metrics["test_acc"] = -1.0
            if round == 2:
                raise RuntimeError("the tracking service went away")

    plain = fedflat.run(tiny(), run_dir=tmp_path / "plain", progress=False)
    with pytest.warns(CallbackWarning, match="Meddler failed in on_evaluation: RuntimeError: the tracking service"):
        watched = fedflat.run(tiny(), run_dir=tmp_path / "watched", progress=False, callbacks=[Meddler(), Recorder()])
    assert metrics_equal(plain.metrics, watched.metrics) and plain.final_parameters.equal(watched.final_parameters)
    assert watched.summary["status"] == "completed"
    assert watched.summary["callback_errors"] == ["Meddler failed in on_evaluation: RuntimeError: the tracking "
                                                  "service went away; the run goes on without it"]
    assert json.loads((tmp_path / "watched" / "summary.json").read_text())["callback_errors"]


def test_a_callback_that_cannot_start_stops_the_run_before_its_folder_unless_optional(tiny, tmp_path):
    class Broken(Callback):
        def on_run_start(self, run):
            raise OSError("store is read-only")

    ended = Recorder()
    with pytest.raises(CallbackError, match="Broken could not start: OSError: store is read-only .*optional"):
        fedflat.run(tiny(), out=tmp_path / "out", progress=False, callbacks=[ended, Broken()])
    assert not (tmp_path / "out").exists()  # no run folder is left, nor the --out folder the run made for it
    assert ended.events[-1][0] == "end" and ended.events[-1][2] == "failed"  # those started are ended
    optional = Broken()
    optional.optional = True
    with pytest.warns(CallbackWarning, match="Broken could not start.*goes on without it"):
        hist = fedflat.run(tiny(), out=tmp_path / "out", progress=False, callbacks=[optional])
    assert hist.summary["status"] == "completed" and len(hist.summary["callback_errors"]) == 1
    with pytest.raises(CallbackError, match="has none of the methods"):
        fedflat.run(tiny(), save=False, progress=False, callbacks=[object()])


def test_every_logger_of_the_config_has_a_class():
    from fedflat.config import LOGGER_CONFIGS

    assert set(LOGGERS) == set(LOGGER_CONFIGS) == {"tensorboard", "csv", "wandb", "mlflow"}


def _csv_rows(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def _same_as_lines(rows: list[dict], lines: list[dict]) -> None:
    """CSV cells hold the metrics lines' values as Python writes them (floats round-trip exactly)."""
    assert len(rows) == len(lines)
    for row, line in zip(rows, lines):
        for key, value in line.items():
            assert row[key] == str(value), (key, row[key], value)


def _tensorboard(folder: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def test_csv_and_tensorboard_record_the_config_and_every_line_and_a_resume_each_round_once(tiny, tmp_path):
    from tensorboard.plugins.hparams import plugin_data_pb2

    cfg = tiny("rounds=5", "checkpoint_every=2", "loggers=[csv, tensorboard]")
    with pytest.raises(KeyboardInterrupt):
        fedflat.run(cfg, run_dir=tmp_path / "run", progress=False, callbacks=[Recorder(stop_at=3)])
    folder = tmp_path / "run"
    lines = read_jsonl(folder / "metrics.jsonl")
    assert len(_csv_rows(folder / "metrics.csv")) == len(lines) == 3
    resume(folder, progress=False)
    lines = read_jsonl(folder / "metrics.jsonl")
    _same_as_lines(_csv_rows(folder / "metrics.csv"), lines)
    board = _tensorboard(folder / "tensorboard")
    for key in ("test_acc", "train_loss", "lr", "drift"):
        events = board.Scalars(key)
        assert [e.step for e in events] == [1, 2, 3, 4, 5]  # each round once: the resume purged nothing twice
        assert [e.value for e in events] == pytest.approx([m[key] for m in lines], rel=2 ** -23)  # float32 events
    text = board.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    config = yaml.safe_load((folder / "config.yaml").read_text())
    assert yaml.safe_load(text.strip("`").removeprefix("yaml\n")) == config
    start = plugin_data_pb2.HParamsPluginData.FromString(
        board.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["train.lr"].number_value == 0.1 and start.hparams["algo.name"].string_value == "fedavg"


def test_the_old_tensorboard_key_is_the_tensorboard_logger(tiny, tmp_path):
    assert [e.name for e in tiny("tensorboard=true").loggers] == ["tensorboard"]
    assert tiny("tensorboard=false").loggers == []
    old = tiny_tree(rounds=2)
    old["tensorboard"] = True  # a run folder of an older fedflat: its config.yaml has the key
    hist = fedflat.run(old, run_dir=tmp_path / "run", progress=False)
    assert "tensorboard" not in hist.config and hist.config["loggers"][0]["name"] == "tensorboard"
    assert _tensorboard(tmp_path / "run" / "tensorboard").Scalars("test_acc")
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    config.pop("loggers")
    config["tensorboard"] = False
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(config))
    assert resume(tmp_path / "run", overrides=["rounds=3"], progress=False).summary["rounds"] == 3


# --- W&B (offline) and MLflow (SQLite): the real libraries, their real files and database ------------------

def wandb_records(path: Path) -> list:
    """The records of an offline W&B run file (``run-ID.wandb``: W&B's header, then LevelDB's log format of 32 KiB
    blocks, each record a 7-byte header (CRC, length, type: full, first, middle, last) and its bytes)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pos, partial = [], 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        partial += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            records.append(wandb_internal_pb2.Record.FromString(partial))
            partial = b""
    return records


def _items(items) -> dict:
    """W&B's key/value items (a key, or a nested key path), values decoded from JSON."""
    return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}


def wandb_runs(folder: Path) -> dict[str, dict]:
    """Per W&B run id under ``folder``: its offline folders, config, group, summary and history by step as
    ``wandb sync`` makes one run of them: folders in the order they started, a step below the run's last
    dropped."""
    segments = []
    for file in folder.rglob("offline-run-*/run-*.wandb"):
        records = wandb_records(file)
        runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        if runs:  # (a folder of a process killed before W&B wrote anything holds only the header)
            segments.append((runs[0].start_time.ToNanoseconds(), file.parent, runs[0], records))
    merged: dict[str, dict] = {}
    for _, path, head, records in sorted(segments, key=lambda s: s[0]):
        run = merged.setdefault(head.run_id, {"folders": [], "history": {}, "summary": {}})
        run["folders"].append(path)
        run["group"], run["name"] = head.run_group, head.display_name
        run["config"] = {k: v for k, v in _items(head.config.update).items() if k != "_wandb"}
        steps = []
        for record in records:
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = _items(record.history.item)
                step = items.pop("_step")
                assert step not in steps, f"round {step} logged twice by one process"
                steps.append(step)
                if step > max(run["history"], default=0):
                    run["history"][step] = {k: v for k, v in items.items() if not k.startswith("_")}
            elif kind == "summary":
                run["summary"].update(_items(record.summary.update))
    return merged


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """An MLflow tracking store in SQLite, its tables made once for the module (a machine without MLflow, as the
    GPU machines lent here, skips the tests that use it)."""
    MlflowClient = pytest.importorskip("mlflow").MlflowClient

    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments()
    return uri


def mlflow_runs(uri: str, experiment: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    return client.search_runs([found.experiment_id]) if found else []


def mlflow_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    return sorted((m.step, m.value) for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key))


def _check_tracked(lines: list[dict], config: dict, wandb_run: dict, uri: str, mlflow_run) -> None:
    """Both trackers hold the config and every metrics line once (wall-clock fields aside: a resume reruns
    rounds whose first values the tracker keeps)."""
    assert wandb_run["config"] == json.loads(json.dumps(config))
    assert sorted(wandb_run["history"]) == [m["round"] for m in lines]
    for m in lines:
        logged = wandb_run["history"][m["round"]]
        assert {k: v for k, v in logged.items() if k not in WALL} == {
            k: v for k, v in scalars(m).items() if k not in (*WALL, "round")}
    assert mlflow_run.data.params == {k: str(v) for k, v in hyperparameters(config).items()}
    for key in [k for k in scalars(lines[0]) if k not in (*WALL, "round")]:
        assert mlflow_history(uri, mlflow_run.info.run_id, key) == [(m["round"], m[key]) for m in lines], key


def test_wandb_and_mlflow_record_the_config_every_line_and_the_end(tiny, tmp_path, store):
    cfg = tiny("rounds=3", f"loggers=[{{name: wandb, mode: offline}}, {{name: mlflow, tracking_uri: '{store}', "
                           "experiment: single}]")
    hist = fedflat.run(cfg, run_dir=tmp_path / "run", progress=False)
    [run] = mlflow_runs(store, "single")
    [(run_id, wb)] = wandb_runs(tmp_path / "run" / "wandb").items()
    _check_tracked(hist.metrics, hist.config, wb, store, run)
    assert run.info.status == "FINISHED" and run.info.run_name == "run" and wb["name"] == "run"
    assert run.data.tags["fedflat.status"] == "completed" and run.data.metrics["summary.final_test_acc"] == \
        hist.summary["final_test_acc"]
    assert wb["summary"]["status"] == "completed" and wb["summary"]["summary.best_round"] == hist.summary["best_round"]
    tracking = json.loads((tmp_path / "run" / TRACKING_FILE).read_text())
    assert tracking["wandb"]["id"] == run_id and tracking["mlflow"]["run_id"] == run.info.run_id


@pytest.mark.parametrize("name, module", [("wandb", "wandb"), ("mlflow", "mlflow"), ("tensorboard", "tensorboard")])
def test_a_missing_library_is_an_error_at_start_or_a_warning_when_optional(tiny, tmp_path, monkeypatch, name, module):
    monkeypatch.setitem(sys.modules, module, None)  # what `import` meets where the package is not installed
    with pytest.raises(CallbackError, match=rf"the {name} logger needs the '{module}' package .*pip install "
                                            rf"'fedflat\[{name}\]'"):
        fedflat.run(tiny(f"loggers=[{name}]"), out=tmp_path, progress=False)
    assert not any(tmp_path.iterdir())  # no run folder was made
    with pytest.warns(CallbackWarning, match=f"the {name} logger needs .*goes on without it"):
        hist = fedflat.run(tiny(f"loggers=[{{name: {name}, optional: true}}]"), out=tmp_path, progress=False)
    assert hist.summary["status"] == "completed" and (hist.run_dir / "model.pt").exists()


def test_an_unusable_store_is_an_error_at_start_or_a_warning_when_optional(tiny, tmp_path):
    pytest.importorskip("mlflow")
    (tmp_path / "file").write_text("not a folder")
    bad_store = f"sqlite:///{tmp_path / 'file' / 'mlflow.db'}"
    with pytest.raises(CallbackError, match="mlflow: the tracking store .*file/mlflow.db cannot be used"):
        fedflat.run(tiny(f"loggers=[{{name: mlflow, tracking_uri: '{bad_store}'}}]"), out=tmp_path / "out",
                    progress=False)
    assert not (tmp_path / "out").exists()
    bad_dir = tmp_path / "file" / "wandb"
    with pytest.raises(CallbackError, match="wandb could not start"):
        fedflat.run(tiny(f"loggers=[{{name: wandb, mode: offline, dir: '{bad_dir}'}}]"), out=tmp_path / "out",
                    progress=False)
    assert not (tmp_path / "out").exists()  # (nor the --out folder the run made)
    with pytest.warns(CallbackWarning):
        hist = fedflat.run(tiny(f"loggers=[csv, {{name: mlflow, optional: true, tracking_uri: '{bad_store}'}}, "
                                f"{{name: wandb, mode: offline, optional: true, dir: '{bad_dir}'}}]"),
                           out=tmp_path / "out", progress=False)
    assert hist.summary["status"] == "completed" and (hist.run_dir / "metrics.csv").exists()
    assert [e for e in hist.summary["callback_errors"] if e.startswith("wandb could not start")]


def test_the_command_line_chooses_loggers(tmp_path, capsys):
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(tiny_tree(rounds=2)))
    assert main(["run", str(tmp_path / "tiny.yaml"), "--out", str(tmp_path / "out"), "--no-progress",
                 "--loggers", "csv,tensorboard"]) == 0
    [folder] = (tmp_path / "out").iterdir()
    assert (folder / "metrics.csv").exists() and (folder / "tensorboard").is_dir()
    assert main(["run", str(tmp_path / "tiny.yaml"), "--no-progress", "--loggers", "csvv"]) == 2
    assert "unknown logger 'csvv' (did you mean 'csv'?)" in capsys.readouterr().err


def _sweep_file(tmp_path: Path, store: str, cells: dict, rounds: int, out: str) -> Path:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_tree(rounds=rounds)))
    loggers = ["csv", {"name": "mlflow", "tracking_uri": store}, {"name": "wandb", "mode": "offline"}]
    spec = {"base": "base.yaml", "config": {"loggers": loggers}, "out": str(tmp_path / out),
            "grid": {"method": cells}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return tmp_path / "sweep.yaml"


@pytest.mark.slow
def test_a_sweep_tracks_one_run_per_cell_grouped_by_the_sweep(tmp_path, store):
    path = _sweep_file(tmp_path, store, {"fedavg": {"algo": "fedavg"}, "fedprox": {"algo": "fedprox"}}, rounds=3,
                       out="tracked")
    result = run_sweep(load_sweep(path), workers=2, progress=False)  # each cell in a spawned process
    assert [c["status"] for c in result.cells] == ["completed", "completed"]
    runs = {r.info.run_name: r for r in mlflow_runs(store, "tracked")}  # the experiment is the sweep's name
    assert sorted(runs) == ["fedavg", "fedprox"]
    for name, run in runs.items():
        folder = tmp_path / "tracked" / name
        [wb] = wandb_runs(folder / "wandb").values()
        assert wb["group"] == "tracked" and run.data.tags["fedflat.group"] == "tracked"
        _check_tracked(read_jsonl(folder / "metrics.jsonl"), yaml.safe_load((folder / "config.yaml").read_text()),
                       wb, store, run)
        _same_as_lines(_csv_rows(folder / "metrics.csv"), read_jsonl(folder / "metrics.jsonl"))


@pytest.mark.slow  # ~14 s (moved from make test: its 10 minutes)
def test_a_killed_cell_continues_its_tracked_runs(tmp_path, store):
    """``kill -9`` of a sweep mid-cell, then the sweep again: the cell resumes, and its W&B and MLflow runs go on
    (same ids), each round logged once, equal to the metrics lines."""
    path = _sweep_file(tmp_path, store, {"fedavg": {"algo": "fedavg"}}, rounds=12, out="killed")
    folder = tmp_path / "killed" / "fedavg"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    env.pop("WANDB_SERVICE", None)  # a command of its own, not a client of this process's W&B service
    # `fedflat sweep` with its checkpoint writer slowed (tests/slow_checkpoint.py), so the kill lands mid-run
    command = ("import sys, slow_checkpoint; slow_checkpoint.install(0.15); from fedflat.cli import main; "
               f"sys.exit(main(['sweep', {str(path)!r}, '--no-progress', 'checkpoint_every=1']))")
    child = subprocess.Popen([sys.executable, "-c", command], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(read_jsonl(folder / "metrics.jsonl") if folder.exists() else []) < 4:
            assert child.poll() is None and time.monotonic() < deadline, "the cell never reached round 4"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    before = json.loads((folder / TRACKING_FILE).read_text())
    assert 3 <= read_checkpoint(folder)["round"] < 12  # killed mid-run (the trackers may hold a round more)
    time.sleep(2)  # W&B's own process writes what it was sent, then ends with its parent
    result = run_sweep(load_sweep(path, extra_overrides=["checkpoint_every=1"]), progress=False)
    assert result.cells[0]["action"] == "resumed" and result.cells[0]["status"] == "completed"
    after = json.loads((folder / TRACKING_FILE).read_text())
    assert after["wandb"]["id"] == before["wandb"]["id"] and after["mlflow"]["run_id"] == before["mlflow"]["run_id"]
    [run] = mlflow_runs(store, "killed")
    runs = wandb_runs(folder / "wandb")
    assert list(runs) == [before["wandb"]["id"]] and len(list((folder / "wandb").glob("offline-run-*"))) == 2
    lines = read_jsonl(folder / "metrics.jsonl")
    assert [m["round"] for m in lines] == list(range(1, 13)) and run.info.status == "FINISHED"
    _check_tracked(lines, yaml.safe_load((folder / "config.yaml").read_text()), runs[before["wandb"]["id"]], store,
                   run)


def test_a_cell_killed_while_its_loggers_started_keeps_their_runs(tmp_path, store):
    """Killed after the trackers began (ids recorded, the MLflow run made) but before config.yaml: the cell
    starts afresh, with the same W&B id and the same MLflow run (found by the uid the start recorded first)."""
    from mlflow import MlflowClient

    path = _sweep_file(tmp_path, store, {"fedavg": {"algo": "fedavg"}}, rounds=2, out="early")
    folder = tmp_path / "early" / "fedavg"
    client = MlflowClient(tracking_uri=store)
    experiment = client.create_experiment("early")
    made = client.create_run(experiment, run_name="fedavg", tags={"fedflat.uid": "u1"}).info.run_id
    folder.mkdir(parents=True)
    (folder / TRACKING_FILE).write_text(json.dumps({"wandb": {"id": "early123"},
                                                    "mlflow": {"uid": "u1", "tracking_uri": store}}))
    (folder / "metrics.jsonl").write_text("")  # what else a killed start may leave: removed
    result = run_sweep(load_sweep(path), progress=False)
    assert result.cells[0]["action"] == "ran" and result.cells[0]["status"] == "completed"
    [run] = mlflow_runs(store, "early")
    assert run.info.run_id == made and run.info.status == "FINISHED"
    assert list(wandb_runs(folder / "wandb")) == ["early123"]
    assert json.loads((folder / TRACKING_FILE).read_text())["mlflow"]["run_id"] == made


def test_tune_tracks_trials_and_final_runs_by_study(tmp_path, store):
    from fedflat.experiments.tune import load_study, run_study

    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_tree(rounds=2)))
    spec = {"base": "base.yaml", "config": {"loggers": [{"name": "mlflow", "tracking_uri": store}]},
            "methods": {"fedavg": {"algo": "fedavg"}}, "out": str(tmp_path / "study"),
            "search": {"grid": {"train.lr": [0.1, 0.05]}, "budget": 2, "seeds": [0]}, "final": {"seeds": [0]}}
    (tmp_path / "tune.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    run_study(load_study(tmp_path / "tune.yaml"), progress=False)
    runs = mlflow_runs(store, "study")  # the experiment is the study's name
    trials = sorted(r.info.run_name for r in runs if r.data.tags["fedflat.job"] == "trials")
    finals = [r.info.run_name for r in runs if r.data.tags["fedflat.job"] == "final"]
    assert trials == ["fedavg__lr0.05__seed0", "fedavg__lr0.1__seed0"] and len(runs) == 3
    assert finals == [json.loads((tmp_path / "study" / "tune.json").read_text())["methods"]["fedavg"]["final"][0]]
    assert all(r.info.status == "FINISHED" and r.data.tags["fedflat.group"] == "study" for r in runs)


@pytest.mark.slow
def test_the_demo_sweep_with_csv_mlflow_and_wandb(tmp_path):
    """The issue's check: `make demo`'s sweep (small variant) with the three loggers, from the command line, in
    two worker processes: one MLflow run and one offline W&B run per cell, with the config and every metric."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": uri}
    out = subprocess.run([sys.executable, "-m", "fedflat.cli", "sweep", str(REPO / "configs" / "demo_sweep.yaml"),
                          "--variant", "small", "--out", str(tmp_path / "demo"), "--workers", "2", "--no-progress",
                          "--loggers", "csv,mlflow,wandb", "rounds=2", "eval.every=1"],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    cells = [c["name"] for c in json.loads((tmp_path / "demo" / "sweep.json").read_text())["cells"]]
    runs = {r.info.run_name: r for r in mlflow_runs(uri, "demo")}
    assert len(cells) == 7 and sorted(runs) == sorted(cells)
    ids = set()
    for name in cells:
        folder = tmp_path / "demo" / name
        [(run_id, wb)] = wandb_runs(folder / "wandb").items()
        ids.add(run_id)
        _check_tracked(read_jsonl(folder / "metrics.jsonl"), yaml.safe_load((folder / "config.yaml").read_text()),
                       wb, uri, runs[name])
    assert len(ids) == 7 and not math.isnan(runs[cells[0]].data.metrics["test_acc"])
