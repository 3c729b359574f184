"""Checkpoints of a run folder, resuming a run, and loading a run back as a :class:`Simulation`.

``checkpoint.pt`` holds everything a run needs to continue exactly where it stopped: the number of
rounds completed, ``Simulation.state_dict()`` (global model ``w^t``, server state, client-state
store), the metrics lines written so far, the summary counters and the oracle's backprop count.
Random streams are keyed by (seed, round, client, purpose), so no generator state is saved: round
``t`` draws the same clients, batches and perturbations whether or not the run was interrupted.

The file is written atomically: the bytes go to a temporary file in the same folder, which is synced
and then renamed over ``checkpoint.pt``. A process killed at any moment (SIGKILL included) leaves the
previous checkpoint or the new one, never a torn one; a stray temporary file is removed on resume.
On resume, ``metrics.jsonl`` is rewritten to exactly the checkpoint's lines, so lines written after
the last checkpoint (by rounds that will be run again) do not appear twice.
"""
from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from fedflat.config import ConfigError
from fedflat.experiments.rundir import RunDir, atomic_write_bytes, hold, json_safe, read_jsonl

if TYPE_CHECKING:
    from torch import nn

    from fedflat.api import History
    from fedflat.config import Config
    from fedflat.data import Dataset
    from fedflat.engine.simulation import Simulation

CHECKPOINT = "checkpoint.pt"
FORMAT = 1
# Test hook: seconds to sleep halfway through writing the checkpoint bytes, so a test can kill the
# writer mid-write (tests/test_resume.py).
SLOW_WRITE_ENV = "FEDFLAT_TEST_CHECKPOINT_SLEEP"


class CheckpointError(ConfigError):
    """A run folder that cannot be resumed or loaded (missing files, unreadable checkpoint)."""


def checkpoint_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT


def save_checkpoint(run_dir: str | Path, payload: dict[str, Any]) -> Path:
    """Atomically writes ``payload`` (see :func:`make_payload`) as ``RUN_DIR/checkpoint.pt``."""
    path = checkpoint_path(run_dir)
    buffer = io.BytesIO()
    torch.save({"format": FORMAT, **payload}, buffer)
    data = buffer.getvalue()
    delay = float(os.environ.get(SLOW_WRITE_ENV, "0") or 0)
    if delay <= 0:
        atomic_write_bytes(path, data)
        return path
    _slow_atomic_write(path, data, delay)
    return path


def _slow_atomic_write(path: Path, data: bytes, delay: float) -> None:
    """The same protocol as ``atomic_write_bytes`` with a pause after the first half (test hook)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data[: len(data) // 2])
        fh.flush()
        time.sleep(delay)
        fh.write(data[len(data) // 2:])
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def read_checkpoint(run_dir: str | Path) -> dict[str, Any] | None:
    """The checkpoint of a run folder, or None when it has none."""
    path = checkpoint_path(run_dir)
    if not path.exists():
        return None
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # only reachable if the file was changed by something else: writes are atomic
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(err).__name__}: {err}); fedflat writes "
                              f"checkpoints atomically, so something else changed it: restore it from a copy, or "
                              f"move it away and `fedflat resume {run_dir}` runs the experiment again from round "
                              f"0") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{path}: checkpoint format {found!r}, expected {FORMAT}: resume it with the fedflat "
                              f"version that wrote it, or move it away to run the experiment again from round 0")
    return payload


def remove_temporaries(run_dir: str | Path) -> list[Path]:
    """Deletes temporary files left by a writer that was killed mid-write; returns them."""
    stale = sorted(Path(run_dir).glob(".*.tmp"))
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def make_payload(sim: "Simulation", rounds_done: int, metrics: list[dict[str, Any]],
                 summary: dict[str, Any], owed: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint holds after ``rounds_done`` complete rounds; ``owed``: the last round's result when
    its evaluation and metrics line were interrupted (a resume evaluates it first)."""
    return {"round": rounds_done, "state": sim.state_dict(), "metrics": [dict(m) for m in metrics],
            "summary": dict(summary), "backprops": sim.backprops, "owed": owed}


def run_config(run_dir: str | Path) -> "Config":
    """The validated config of a run folder (its ``config.yaml``, every default filled in)."""
    from fedflat.config import ConfigError, load_config

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise CheckpointError(f"{run_dir}: not a run folder (no config.yaml)")
    try:
        return load_config(path)
    except ConfigError as err:
        if "user:" in path.read_text():
            raise CheckpointError(f"{run_dir} was run on a user-supplied dataset, model or split; pass config=, "
                                  "dataset=, model_fn= and clients= as the run had them to load or resume it") from None
        raise


def load_run(run_dir: str | Path, *, config: "Config | None" = None, dataset: "Dataset | None" = None,
             model_fn: "Callable[[], nn.Module] | None" = None, clients=None) -> "Simulation":
    """A :class:`Simulation` of a run folder, restored to the latest state on disk.

    State comes from ``checkpoint.pt`` (global model, server state, client store) when present,
    otherwise the global model from ``model.pt`` (server and client state then start fresh).
    ``sim.rounds_done`` tells which round the state belongs to (None when only model.pt was found).
    """
    from fedflat.engine.simulation import Simulation

    run_dir = Path(run_dir)
    cfg = config if config is not None else run_config(run_dir)
    sim = Simulation(cfg, dataset=dataset, model_fn=model_fn, clients=clients)
    payload = read_checkpoint(run_dir)
    if payload is not None:
        sim.load_state_dict(payload["state"])
        sim.backprops = payload.get("backprops", 0)
        sim.rounds_done = payload["round"]
        return sim
    model_file = run_dir / "model.pt"
    if not model_file.exists():
        raise CheckpointError(f"{run_dir}: neither {CHECKPOINT} nor model.pt; the run saved no state yet")
    state = torch.load(model_file, map_location="cpu", weights_only=True)
    missing = [n for n in sim.model.layout.names if n not in state]
    if missing:
        raise CheckpointError(f"{model_file}: does not match the configured model (missing {missing[:3]})")
    sim.w = torch.cat([state[n].reshape(-1) for n in sim.model.layout.names]).to(sim.device)
    sim.rounds_done = None
    return sim


# What a resume may change: none of them changes a result (rounds= only extends the run: the learning rate
# decays per round, so an extended run equals one planned that long).
RESUMABLE = ("rounds", "threads", "checkpoint_every", "executor")


def resume(run_dir: str | Path, *, overrides: list[str] | tuple[str, ...] = (), progress: bool = True,
           config: "Config | None" = None, dataset: "Dataset | None" = None,
           model_fn: "Callable[[], nn.Module] | None" = None, clients=None, driver=None) -> "History":
    """Continues the run in ``run_dir`` from its latest checkpoint (from round 0 if it has none).

    The resumed run's ``metrics.jsonl`` equals that of a run never interrupted, number for number
    apart from wall-clock fields (same engine, same machine). ``overrides`` may change only
    :data:`RESUMABLE` keys (``rounds=`` to extend a run). A completed run with no more rounds to run is
    returned as it is on disk: nothing in its folder is written. A run whose rounds went through a
    ``driver`` (a Flower federation, whose nodes keep their clients' state) continues only through one.
    """
    from fedflat.api import run

    run_dir = Path(run_dir)
    cfg = config if config is not None else run_config(run_dir)
    if overrides:
        cfg = _resumed_config(cfg, overrides)
    with hold(run_dir):  # a folder another process is writing is refused, finished or not
        recorded = _summary(run_dir).get("driver")
        if recorded and driver is None:
            raise CheckpointError(f"{run_dir} trained its clients through {recorded}, whose nodes keep the clients' "
                                  "state: resume it there (a Flower run: the run config's resume=FOLDER, "
                                  "docs/flower.md)")
        completed = _completed_summary(run_dir)
        done = completed["rounds"] if completed is not None else None
        if done is not None and cfg.rounds < done:
            raise CheckpointError(f"{run_dir} has completed {done} rounds: rounds={cfg.rounds} cannot shorten it "
                                  f"(rounds= extends a run)")
        if done is not None and cfg.rounds == done:
            return _finished_history(run_dir, completed, cfg, dataset, model_fn, clients)
        return run(cfg, dataset=dataset, model_fn=model_fn, clients=clients, resume=run_dir, progress=progress,
                   driver=driver)


def _resumed_config(cfg: "Config", overrides: list[str] | tuple[str, ...]) -> "Config":
    from fedflat.config import load_config, parse_override

    for text in overrides:
        key = parse_override(text)[0]
        if key.split(".")[0] not in RESUMABLE:
            raise ConfigError(f"{key}: a resume continues the run as it was configured; it can change only "
                              f"{', '.join(RESUMABLE)} (start a new run to change {key})")
    return load_config(None, overrides, base=cfg.model_dump())


def _summary(run_dir: Path) -> dict[str, Any]:
    """A run folder's summary ({} when it has none or it cannot be read)."""
    try:
        return json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}


def _completed_summary(run_dir: Path) -> dict[str, Any] | None:
    """The summary of a run that completed, or None when it did not (or says nothing)."""
    summary = _summary(run_dir)
    return summary if summary.get("status") == "completed" and "rounds" in summary else None


def _finished_history(run_dir: Path, summary: dict[str, Any], cfg: "Config", dataset: "Dataset | None",
                      model_fn: "Callable[[], nn.Module] | None", clients=None) -> "History":
    """The :class:`History` of a completed run, read from its folder without writing to it."""
    from fedflat.api import History
    from fedflat.config import read_yaml

    sim = load_run(run_dir, config=cfg, dataset=dataset, model_fn=model_fn, clients=clients)
    try:
        return History(metrics=read_jsonl(run_dir / "metrics.jsonl"), summary=summary,
                       config=read_yaml((run_dir / "config.yaml").read_text()),
                       final_parameters=sim.w.detach().cpu().clone(), run_dir=run_dir,
                       state_dict=sim.model.state_dict(sim.w))
    finally:
        sim.close()


def metrics_equal(a: list[dict[str, Any]], b: list[dict[str, Any]],
                  ignore: tuple[str, ...] = ("seconds", "eval_seconds", "train_seconds")) -> bool:
    """Whether two metrics lists agree exactly on every field but the wall-clock ones."""
    strip = [{k: v for k, v in m.items() if k not in ignore} for m in a]
    return strip == [{k: v for k, v in m.items() if k not in ignore} for m in b]


__all__ = ["CHECKPOINT", "RESUMABLE", "CheckpointError", "checkpoint_path", "load_run", "make_payload", "metrics_equal",
           "read_checkpoint", "read_jsonl", "remove_temporaries", "resume", "run_config", "save_checkpoint"]


def prepare_resume(run_dir: str | Path) -> dict[str, Any] | None:
    """Readies a run folder to continue: removes torn temporaries, reads the checkpoint, and rewrites
    ``metrics.jsonl`` to exactly the checkpoint's lines (dropping those of rounds that will run again).
    Returns the checkpoint, or None when the run must start from round 0."""
    run_dir = Path(run_dir)
    remove_temporaries(run_dir)
    payload = read_checkpoint(run_dir)
    metrics = payload["metrics"] if payload is not None else []
    rundir = RunDir(run_dir)
    if rundir.metrics_path.exists() or metrics:
        text = "".join(json.dumps(json_safe(m)) + "\n" for m in metrics)
        atomic_write_bytes(rundir.metrics_path, text.encode())
    return payload
