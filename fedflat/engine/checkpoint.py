"""A run's state on disk: ``checkpoint.pt``, written atomically, read back as a :class:`Simulation`.

``checkpoint.pt`` holds everything a run needs to continue exactly where it stopped: the number of
rounds completed, ``Simulation.state_dict()`` (global model ``w^t``, server state, client-state
store), the metrics lines written so far, the summary counters and the oracle's backprop count.
Random streams are keyed by (seed, round, client, purpose), so no generator state is saved: round
``t`` draws the same clients, batches and perturbations whether or not the run was interrupted.

The file is written atomically: the bytes go to a temporary file in the same folder, which is synced
and then renamed over ``checkpoint.pt``. A process killed at any moment (SIGKILL included) leaves the
previous checkpoint or the new one, never a torn one; a stray temporary file is removed on resume.
Resuming (:mod:`fedflat.experiments.resume`) and the diagnostics of a finished run
(:mod:`fedflat.metrics`) both read a run back through :func:`load_run`.

Loading is safe: a checkpoint holds only tensors and plain values (dicts, lists, numbers, strings, None), written
so by :func:`plain`, and is read with ``torch.load(weights_only=True)``, whose unpickler rebuilds nothing else. A
file that names any other Python object (a crafted pickle whose ``__reduce__`` would run code) is refused before
anything in it runs (:class:`UnsafeFile`).
"""
from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fedflat.config import Config, load_config
from fedflat.files import (CheckpointError, UnsafeFile, allowed_objects, atomic_write_bytes, named_objects,  # noqa: F401
                           pickle_objects, safe_load)

if TYPE_CHECKING:
    from fedflat.engine.inputs import UserInputs
    from fedflat.engine.simulation import Simulation

CHECKPOINT = "checkpoint.pt"
FORMAT = 1

# What a checkpoint must hold to be resumed, at its top level and in its ``state``.
REQUIRED = ("round", "state", "metrics", "summary")
REQUIRED_STATE = ("w", "server", "store")


def plain(value: Any) -> Any:
    """``value`` as tensors and plain Python values only (what ``torch.load(weights_only=True)`` rebuilds): numpy
    scalars become Python numbers, ``str`` subclasses (``torch.__version__``) ``str``, tuples lists."""
    import numpy as np

    if isinstance(value, torch.Tensor) or value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value.copy())
    for kind in (bool, int, float, str):  # subclasses (TorchVersion, IntEnum, ...) as their base type
        if isinstance(value, kind):
            return kind(value)
    raise TypeError(f"a checkpoint holds tensors and plain values only, not {type(value).__name__}")


def checkpoint_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINT


def save_checkpoint(run_dir: str | Path, payload: dict[str, Any]) -> Path:
    """Atomically writes ``payload`` (see :func:`make_payload`) as ``RUN_DIR/checkpoint.pt``."""
    path = checkpoint_path(run_dir)
    buffer = io.BytesIO()
    torch.save(plain({"format": FORMAT, **payload}), buffer)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def read_checkpoint(run_dir: str | Path) -> dict[str, Any] | None:
    """The checkpoint of a run folder, or None when it has none."""
    path = checkpoint_path(run_dir)
    if not path.exists():
        return None
    payload = safe_load(path, "checkpoint", f"fedflat writes checkpoints atomically, so something else changed it: "
                        f"restore it from a copy, or move it away and `fedflat resume {run_dir}` runs the experiment "
                        f"again from round 0")
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        found = payload.get("format") if isinstance(payload, dict) else type(payload).__name__
        raise CheckpointError(f"{path}: checkpoint format {found!r}, expected {FORMAT}: resume it with the fedflat "
                              f"version that wrote it, or move it away to run the experiment again from round 0")
    missing = [k for k in REQUIRED if k not in payload]
    state = payload.get("state")
    missing += [f"state.{k}" for k in REQUIRED_STATE if not isinstance(state, dict) or k not in state]
    if missing:
        raise CheckpointError(f"{path}: not a complete checkpoint (it lacks {', '.join(missing)}): restore it from a "
                              f"copy, or move it away and `fedflat resume {run_dir}` runs the experiment again from "
                              f"round 0")
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
    return {"round": rounds_done, "state": sim.server.state_dict(), "metrics": [dict(m) for m in metrics],
            "summary": dict(summary), "backprops": sim.server.backprops, "owed": owed}


def run_config(run_dir: str | Path) -> "Config":
    """The validated config of a run folder (its ``config.yaml``, every default filled in)."""
    from fedflat.core import ConfigError

    path = Path(run_dir) / "config.yaml"
    if not path.exists():
        raise CheckpointError(f"{run_dir}: not a run folder (no config.yaml)")
    try:
        return load_config(path)
    except ConfigError:
        if "user:" in path.read_text():
            raise CheckpointError(f"{run_dir} was run on a user-supplied dataset, model, split or loss; pass config=, "
                                  "dataset=, model_fn=, clients= and loss_fn= as the run had them to load or resume "
                                  "it") from None
        raise


def load_run(run_dir: str | Path, *, config: Config | None = None,
             inputs: "UserInputs | None" = None) -> "Simulation":
    """A :class:`Simulation` of a run folder, restored to the latest state on disk.

    State comes from ``checkpoint.pt`` (global model, server state, client store) when present,
    otherwise the global model from ``model.pt`` (server and client state then start fresh).
    ``sim.rounds_done`` tells which round the state belongs to (None when only model.pt was found).
    ``inputs``: the user's dataset, model, split or loss as the run had them
    (:class:`~fedflat.engine.inputs.UserInputs`).
    """
    from fedflat.engine.inputs import UserInputs
    from fedflat.engine.simulation import Simulation

    run_dir = Path(run_dir)
    cfg = config if config is not None else run_config(run_dir)
    sim = Simulation(cfg, inputs if inputs is not None else UserInputs())
    payload = read_checkpoint(run_dir)
    if payload is not None:
        sim.server.load_state_dict(payload["state"])
        sim.server.backprops = payload.get("backprops", 0)
        sim.rounds_done = payload["round"]
        return sim
    model_file = run_dir / "model.pt"
    if not model_file.exists():
        raise CheckpointError(f"{run_dir}: neither {CHECKPOINT} nor model.pt; the run saved no state yet")
    state = safe_load(model_file, "model file", "restore it from a copy, or run the experiment again")
    try:
        w, b = sim.model.vectors(state)
    except ValueError as err:
        raise CheckpointError(f"{model_file}: does not match the configured model ({err})") from None
    sim.server.w, sim.server.buffers = w.to(sim.device), b.to(sim.device)
    sim.rounds_done = None
    return sim
