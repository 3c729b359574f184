"""Checkpoint and resume: a resumed run equals one never interrupted, number for number."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agreement import bitwise
from conftest import BN_DROPOUT_CNN

import fedflat
from fedflat.algorithms import PARTS, RECIPES, Recipe, register_part, register_recipe
from fedflat.cli import main
from fedflat.core import ConfigError, Correction, Direction, PartParams, init
from fedflat.engine.checkpoint import CHECKPOINT, CheckpointError, load_run, read_checkpoint
from fedflat.experiments.resume import metrics_equal, resume
from fedflat.files import read_jsonl

REPO = Path(__file__).resolve().parents[1]


class ClientMemory(Correction):
    """A test part with client AND server state: ``d = g + beta m_i``, where ``m_i`` is client i's
    last pseudo-gradient (kept by the client) and the server counts rounds (server state)."""

    name = "test_client_memory"
    summary = "test only"
    keeps = ("test.memory",)
    server_state = {"test.rounds_seen": init.scalar(0.0)}

    class Params(PartParams):
        beta: float = 0.5

    def direction(self, ctx, cohort, k, W, grad):
        return Direction(grad + self.p.beta * cohort.state["test.memory"], ctx.settings.weight_decay)

    def end(self, ctx, cohort, W):
        steps = cohort.steps.to(W.dtype)[:, None]
        cohort.new_state["test.memory"] = (ctx.w_start - W) / (steps * ctx.lr)

    def after_step(self, ctx, w_new):
        ctx.server["test.rounds_seen"] = ctx.server["test.rounds_seen"] + 1  # server state is replaced, not edited


@pytest.fixture
def stateful_recipe():
    register_part(ClientMemory)
    register_recipe(Recipe(name="test_memory", summary="test only", source="test", correction=ClientMemory.name))
    yield "test_memory"
    PARTS["correction"].pop(ClientMemory.name, None)
    RECIPES.pop("test_memory", None)


def _interrupted(tiny_cfg, tmp_path: Path, stop_after: int) -> Path:
    """A run of the config killed (SIGKILL: nothing more is written) right after round ``stop_after`` wrote
    its metrics line: it leaves no checkpoint of that round."""
    class Stop(Exception):
        pass

    from fedflat.experiments import runner

    original, finish = runner.Runner._round, runner.Runner._finish

    def round_then_maybe_stop(self, t, bar):
        original(self, t, bar)
        if t + 1 == stop_after:
            raise Stop

    folder = tmp_path / "interrupted"
    runner.Runner._round, runner.Runner._finish = round_then_maybe_stop, lambda self, wall_seconds: None
    try:
        with pytest.raises(Stop):
            fedflat.run(tiny_cfg, run_dir=folder, progress=False)
    finally:
        runner.Runner._round, runner.Runner._finish = original, finish
    return folder


@pytest.mark.parametrize("algo", ["fedavg", "scaffold", "stateful", "fedper-sam"])
def test_resume_equals_uninterrupted(tiny, tmp_path, algo, stateful_recipe):
    """FedAvg; SCAFFOLD (server c and client c_i); a test part with server and client state; FedPer (private
    heads in the store, personalized evaluation)."""
    name = stateful_recipe if algo == "stateful" else algo
    cfg = tiny(f"algo={name}", "rounds=6", "checkpoint_every=2", "eval.every=1")
    full = fedflat.run(cfg, run_dir=tmp_path / "full", progress=False)
    # dies in round 5: the last checkpoint is round 4's; round 5's metrics line is already on disk
    # and must not appear twice after resuming.
    folder = _interrupted(cfg, tmp_path, stop_after=5)
    assert read_checkpoint(folder)["round"] == 4
    assert len(read_jsonl(folder / "metrics.jsonl")) == 5
    resumed = resume(folder, progress=False)
    assert resumed.summary["status"] == "completed"
    assert metrics_equal(read_jsonl(folder / "metrics.jsonl"), read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    assert [m["round"] for m in read_jsonl(folder / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert torch.equal(resumed.final_parameters, full.final_parameters)
    a, b = read_checkpoint(folder)["state"], read_checkpoint(tmp_path / "full")["state"]
    assert a["server"].keys() == b["server"].keys()
    for key in a["server"]:
        assert torch.equal(a["server"][key], b["server"][key])
    assert a["store"].keys() == b["store"].keys()
    for slot in a["store"]:
        assert a["store"][slot].keys() == b["store"][slot].keys()
        for client in a["store"][slot]:
            assert torch.equal(a["store"][slot][client], b["store"][slot][client])
    if algo == "stateful":
        assert a["store"]["test.memory"] and float(a["server"]["test.rounds_seen"]) == 6
    if algo != "fedavg":
        assert a["store"], "the method keeps client state, so the comparison covers the store"
    s = json.loads((folder / "summary.json").read_text())
    assert s["rounds"] == 6 and s["resumed"][0]["round"] == 4
    assert s["best_test_acc"] == full.summary["best_test_acc"]


def test_resume_of_a_completed_run_changes_nothing(tiny, tmp_path):
    cfg = tiny("rounds=3", "checkpoint_every=0")
    full = fedflat.run(cfg, run_dir=tmp_path / "run", progress=False)
    assert read_checkpoint(tmp_path / "run")["round"] == 3  # the final checkpoint
    def results():  # every file but the lock, which names the process holding the folder
        return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "run").iterdir()
                if p.is_file() and p.name != ".lock"}

    files = results()
    again = resume(tmp_path / "run", overrides=["threads=1"], progress=False)
    assert results() == files  # not a byte rewritten
    assert torch.equal(again.final_parameters, full.final_parameters)
    assert again.metrics == full.metrics and again.summary["rounds"] == 3


def test_resume_extends_a_run_with_rounds_and_refuses_other_changes(tiny, tmp_path):
    longer = fedflat.run(tiny("rounds=5"), save=False, progress=False)
    fedflat.run(tiny("rounds=3"), run_dir=tmp_path / "run", progress=False)
    with pytest.raises(ConfigError, match="can change only rounds"):
        resume(tmp_path / "run", overrides=["train.lr=0.5"], progress=False)
    with pytest.raises(CheckpointError, match="cannot shorten"):
        resume(tmp_path / "run", overrides=["rounds=2"], progress=False)
    extended = resume(tmp_path / "run", overrides=["rounds=5", "threads=1"], progress=False)
    assert extended.summary["status"] == "completed" and extended.summary["rounds"] == 5
    assert metrics_equal(extended.metrics, longer.metrics)  # the lr decays per round: same as planned 5
    assert torch.equal(extended.final_parameters, longer.final_parameters)
    assert "rounds: 5" in (tmp_path / "run" / "config.yaml").read_text()


def test_a_resume_on_other_thread_counts_says_so_and_records_it(tiny, tmp_path, capsys):
    """A reduction split over other torch threads rounds differently (issue 32: Fashion-MNIST SCAFFOLD run on 2
    threads and resumed on 1 moved in round 3's fourth digit): such a resume continues, warns that from its
    first round the numbers may differ in the last bits from an uninterrupted run's, and records it; one on the
    same counts records nothing."""
    one, two = {"server": 1, "clients": 1}, {"server": 2, "clients": 2}
    for name in ("changed", "kept"):
        fedflat.run(tiny("rounds=2", "threads=2"), run_dir=tmp_path / name, progress=False)
    capsys.readouterr()
    changed = resume(tmp_path / "changed", overrides=["rounds=4", "threads=1"], progress=False).summary
    assert changed["threads"] == one and changed["threads_changed"] == [{"round": 3, "from": two, "to": one}]
    assert "from round 3 on its numbers may differ in the last bits" in capsys.readouterr().err
    assert json.loads((tmp_path / "changed" / "summary.json").read_text())["threads_changed"][0]["round"] == 3
    kept = resume(tmp_path / "kept", overrides=["rounds=4"], progress=False).summary
    assert kept["threads"] == two and "threads_changed" not in kept
    assert "last bits" not in capsys.readouterr().err


def test_a_garbage_checkpoint_says_what_to_do(tiny, tmp_path, capsys):
    cfg = tiny("rounds=3", "checkpoint_every=1")
    fedflat.run(cfg, run_dir=tmp_path / "run", progress=False)
    (tmp_path / "run" / CHECKPOINT).write_bytes(b"not a checkpoint")
    json_path = tmp_path / "run" / "summary.json"
    json_path.write_text(json_path.read_text().replace('"completed"', '"failed"'))
    assert main(["resume", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unreadable checkpoint" in err and "move it away" in err and f"fedflat resume {tmp_path / 'run'}" in err


def test_load_run_restores_checkpoint_or_model(tiny, tmp_path, stateful_recipe):
    cfg = tiny(f"algo={stateful_recipe}", "rounds=3")
    full = fedflat.run(cfg, run_dir=tmp_path / "run", progress=False)
    sim = load_run(tmp_path / "run")
    assert sim.rounds_done == 3 and torch.equal(sim.server.w.cpu(), full.final_parameters)
    assert float(sim.server.state["test.rounds_seen"]) == 3 and sim.server.store.count("test.memory") > 0
    (tmp_path / "run" / CHECKPOINT).unlink()
    sim = load_run(tmp_path / "run")  # only model.pt: the model, fresh server state
    assert sim.rounds_done is None and torch.equal(sim.server.w.cpu(), full.final_parameters)
    assert float(sim.server.state["test.rounds_seen"]) == 0
    assert sim.evaluate()[0] == full.summary["final_test_acc"]


def test_run_dir_is_never_reused(tiny, tmp_path):
    fedflat.run(tiny("rounds=1"), run_dir=tmp_path / "run", progress=False)
    with pytest.raises(FileExistsError, match="fedflat resume"):
        fedflat.run(tiny("rounds=1"), run_dir=tmp_path / "run", progress=False)


_CHILD = """
import sys
import fedflat
from fedflat.cli import main
from fedflat.core import ConfigError
from fedflat.config import load_config
sys.path.insert(0, {tests!r})
from conftest import tiny_tree
{slowed}cfg = load_config(None, ["rounds=8", "checkpoint_every=1", *{overrides!r}], base=tiny_tree())
fedflat.run(cfg, run_dir={folder!r}, progress=False)
"""


def _sigkill_child_when(folder, slow_write: float, ready, poll: float, overrides: tuple[str, ...] = ()) -> None:
    """Runs the 8-round child, its checkpoint writer slowed where ``slow_write`` > 0 (tests/slow_checkpoint.py:
    ``slow_write`` seconds between the halves of each checkpoint's bytes), and SIGKILLs it once ``ready()`` holds."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    slowed = f"import slow_checkpoint\nslow_checkpoint.install({slow_write!r})\n" if slow_write else ""
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(tests=str(REPO / "tests"), folder=str(folder),
                                                                  overrides=list(overrides), slowed=slowed)],
                             env=env, cwd=folder.parent)
    try:
        # The wait ends when ready() holds (or the child exits, a failure at once): on a loaded machine the child's
        # imports and rounds take minutes, so the bound only catches a child that hangs, never a slow one.
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if ready():
                break
            assert child.poll() is None, "child exited early"
            time.sleep(poll)
        else:
            pytest.fail("the checkpoint writer never reached the point to kill it")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == -signal.SIGKILL


def _tmp_checkpoint(folder) -> bool:
    return folder.exists() and bool(list(folder.glob(f".{CHECKPOINT}.*.tmp")))


def test_sigkill_mid_checkpoint_write_still_resumes(tiny, tmp_path):
    """A child process is SIGKILLed while the checkpoint bytes are half written (tests/slow_checkpoint.py pauses
    the child's writer between the halves): the previous checkpoint survives and the run resumes to the same
    result."""
    folder = tmp_path / "killed"

    def first_write_half_done() -> bool:  # the first write is round 1's checkpoint
        if _tmp_checkpoint(folder):
            time.sleep(0.2)
            return True
        return False

    _sigkill_child_when(folder, 30.0, first_write_half_done, poll=0.05)
    assert not (folder / CHECKPOINT).exists()  # killed during the very first write: no checkpoint at all
    [torn] = folder.glob(".*.tmp")  # the torn temporary is there, half of a checkpoint's bytes...
    assert torn.stat().st_size > 0
    with pytest.raises(RuntimeError, match="zip archive"):
        torch.load(torn, weights_only=True)
    resumed = resume(folder, progress=False)
    assert not list(folder.glob(".*.tmp"))  # ...and removed on resume
    full = fedflat.run(tiny("rounds=8", "checkpoint_every=1"), run_dir=tmp_path / "full", progress=False)
    assert metrics_equal(read_jsonl(folder / "metrics.jsonl"), read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    assert torch.equal(resumed.final_parameters, full.final_parameters)


def test_sigkill_after_some_checkpoints_loses_at_most_checkpoint_every(tiny, tmp_path):
    """Killed while writing round 3's checkpoint: round 2's survives and is complete."""
    folder = tmp_path / "killed"

    def third_write_started() -> bool:
        lines = read_jsonl(folder / "metrics.jsonl") if folder.exists() else []
        return len(lines) >= 3 and _tmp_checkpoint(folder)

    _sigkill_child_when(folder, 0.4, third_write_started, poll=0.02)
    ckpt = read_checkpoint(folder)
    assert ckpt is not None and ckpt["round"] >= 2
    assert len(read_jsonl(folder / "metrics.jsonl")) - ckpt["round"] <= 1  # at most checkpoint_every lost
    resumed = resume(folder, progress=False)
    full = fedflat.run(tiny("rounds=8", "checkpoint_every=1"), run_dir=tmp_path / "full", progress=False)
    assert torch.equal(resumed.final_parameters, full.final_parameters)
    assert metrics_equal(read_jsonl(folder / "metrics.jsonl"), read_jsonl(tmp_path / "full" / "metrics.jsonl"))




def _assert_same_state(a: dict, b: dict) -> None:
    """Two checkpoints' simulation states, bit for bit: model, buffers, server state, client store."""
    assert torch.equal(a["w"], b["w"]) and torch.equal(a["buffers"], b["buffers"])
    assert a["server"].keys() == b["server"].keys() and a["store"].keys() == b["store"].keys()
    for key in a["server"]:
        assert torch.equal(a["server"][key], b["server"][key]), key
    for slot in a["store"]:
        assert a["store"][slot].keys() == b["store"][slot].keys()
        for client in a["store"][slot]:
            assert torch.equal(a["store"][slot][client], b["store"][slot][client]), (slot, client)


def test_a_batch_norm_dropout_cnn_killed_after_round_3_resumes_to_the_uninterrupted_run(tiny, tmp_path):
    """SCAFFOLD on the BatchNorm + dropout CNN in a child process, SIGKILLed once round 3's metrics line is written:
    resumed, its metrics, model, BatchNorm statistics (checkpointed as the buffer vector), server state and client
    store equal a run never interrupted, bit for bit."""
    overrides = bitwise("algo=scaffold", *BN_DROPOUT_CNN, "train.batch_size=7")  # (on a GPU: engine=sequential)
    folder = tmp_path / "killed"
    _sigkill_child_when(folder, 0.0, lambda: folder.exists() and len(read_jsonl(folder / "metrics.jsonl")) >= 3,
                        poll=0.02, overrides=overrides)
    assert read_checkpoint(folder)["round"] < 8
    resumed = resume(folder, progress=False)
    full = fedflat.run(tiny("rounds=8", "checkpoint_every=1", *overrides), run_dir=tmp_path / "full", progress=False)
    assert metrics_equal(read_jsonl(folder / "metrics.jsonl"), read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    assert torch.equal(resumed.final_parameters, full.final_parameters)
    _assert_same_state(read_checkpoint(folder)["state"], read_checkpoint(tmp_path / "full")["state"])
    assert not torch.equal(read_checkpoint(folder)["state"]["buffers"][:64], torch.zeros(64, dtype=torch.float64))


def test_fedbn_resumes_with_each_clients_batch_norm(tiny, tmp_path):
    """FedBN's private statistics live in the client store, checkpointed with it: a run stopped after round 5
    (its last checkpoint round 4's) resumes to the uninterrupted run, the clients' BatchNorm included."""
    cfg = tiny(*bitwise("algo=fedbn", *BN_DROPOUT_CNN, "rounds=6", "checkpoint_every=2", "eval.every=1"))
    full = fedflat.run(cfg, run_dir=tmp_path / "full", progress=False)
    folder = _interrupted(cfg, tmp_path, stop_after=5)
    assert read_checkpoint(folder)["round"] == 4
    resume(folder, progress=False)
    assert metrics_equal(read_jsonl(folder / "metrics.jsonl"), read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    state = read_checkpoint(folder)["state"]
    _assert_same_state(state, read_checkpoint(tmp_path / "full")["state"])
    assert state["store"]["buffers"] and full.summary["evaluation"] == "personalized"

