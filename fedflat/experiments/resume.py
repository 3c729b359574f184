"""Resuming a run folder from its checkpoint (:mod:`fedflat.engine.checkpoint` writes and reads it).

On resume, ``metrics.jsonl`` is rewritten to exactly the checkpoint's lines, so lines written after
the last checkpoint (by rounds that will be run again) do not appear twice.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from fedflat.config import Config, load_config, parse_override, read_yaml
from fedflat.core import ConfigError
from fedflat.engine.checkpoint import CheckpointError, load_run, run_config
from fedflat.engine.inputs import UserInputs
from fedflat.experiments.rundir import hold
from fedflat.experiments.runner import History, run_experiment
from fedflat.experiments.summary import cpu_state
from fedflat.files import read_jsonl

if TYPE_CHECKING:
    from torch import nn

    from fedflat.data import Dataset

# What a resume may change. rounds= only extends the run (the learning rate decays per round, so an extended run
# equals one planned that long); checkpoint_every and loggers change no result. threads= and executor.* can change
# the torch thread counts, and with them the rounding of reductions split over threads: the resume says so and
# records it (summary.json's threads_changed), and from there the numbers may differ in the last bits.
RESUMABLE = ("rounds", "threads", "checkpoint_every", "executor", "loggers")


def resume(run_dir: str | Path, *, overrides: list[str] | tuple[str, ...] = (), progress: bool = True,
           config: Config | None = None, dataset: "Dataset | None" = None,
           model_fn: "Callable[[], nn.Module] | None" = None, clients=None, driver=None,
           callbacks: Sequence[Any] = (), group: str | None = None, job: str | None = None,
           loss_fn: "Callable | None" = None) -> History:
    """Continues the run in ``run_dir`` from its latest checkpoint (from round 0 if it has none).

    The resumed run's ``metrics.jsonl`` equals that of a run never interrupted, number for number
    apart from wall-clock fields (same engine, machine and torch thread counts). ``overrides`` may change only
    :data:`RESUMABLE` keys (``rounds=`` to extend a run; a change of thread counts is reported and recorded). A
    completed run with no more rounds to run, and a stopped one (a callback ended it), is returned as it is on disk:
    nothing in its folder is written. A run
    whose rounds went through a ``driver`` (a Flower federation, whose nodes keep their clients' state) continues
    only through one.
    ``callbacks``, ``group`` and ``job`` as for :func:`~fedflat.experiments.runner.run_experiment`: the config's
    loggers continue the run's tracked runs (the ids in ``tracking.json``). ``loss_fn``: the run's own loss, as it
    had it (``train.loss: user:<name>`` in its ``config.yaml``; pass ``config=`` too).
    """
    run_dir = Path(run_dir)
    inputs = UserInputs(dataset, model_fn, clients, loss_fn)
    cfg = config if config is not None else run_config(run_dir)
    if overrides:
        cfg = _resumed_config(cfg, overrides)
    with hold(run_dir):  # a folder another process is writing is refused, finished or not
        recorded = _summary(run_dir).get("driver")
        if recorded and driver is None:
            raise CheckpointError(f"{run_dir} trained its clients through {recorded}, whose nodes keep the clients' "
                                  "state: resume it there (a Flower run: the run config's resume=FOLDER, "
                                  "docs/flower.md)")
        stopped = _summary(run_dir)
        if stopped.get("status") == "stopped":  # a callback ended it (early stopping): finished, as completed
            return _finished_history(run_dir, stopped, cfg, inputs)
        completed = _completed_summary(run_dir)
        done = completed["rounds"] if completed is not None else None
        if done is not None and cfg.rounds < done:
            raise CheckpointError(f"{run_dir} has completed {done} rounds: rounds={cfg.rounds} cannot shorten it "
                                  f"(rounds= extends a run)")
        if done is not None and cfg.rounds == done:
            return _finished_history(run_dir, completed, cfg, inputs)
        return run_experiment(cfg, **inputs.keywords(), resume=run_dir, progress=progress, driver=driver,
                              callbacks=callbacks, group=group, job=job)


def _resumed_config(cfg: Config, overrides: list[str] | tuple[str, ...]) -> Config:
    for text in overrides:
        key = parse_override(text)[0]
        if key.split(".")[0] not in RESUMABLE:
            raise ConfigError(f"{key}: a resume continues the run as it was configured; it can change only "
                              f"{', '.join(RESUMABLE)} (start a new run to change {key})")
    resumed = load_config(None, overrides, base=cfg.model_dump())
    if cfg.train.schedule == "cosine" and resumed.rounds != cfg.rounds:
        raise ConfigError(f"train.schedule=cosine anneals eta_l over the planned {cfg.rounds} rounds: rounds="
                          f"{resumed.rounds} would change the rates of the rounds left; start a new run")
    return resumed


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


def _finished_history(run_dir: Path, summary: dict[str, Any], cfg: Config, inputs: UserInputs) -> History:
    """The :class:`History` of a completed run, read from its folder without writing to it."""
    sim = load_run(run_dir, config=cfg, inputs=inputs)
    try:
        return History(metrics=read_jsonl(run_dir / "metrics.jsonl"), summary=summary,
                       config=read_yaml((run_dir / "config.yaml").read_text()),
                       final_parameters=sim.server.w.detach().cpu().clone(), run_dir=run_dir,
                       state_dict=cpu_state(sim.server.model_state()))
    finally:
        sim.close()


def metrics_equal(a: list[dict[str, Any]], b: list[dict[str, Any]],
                  ignore: tuple[str, ...] = ("seconds", "eval_seconds", "train_seconds")) -> bool:
    """Whether two metrics lists agree exactly on every field but the wall-clock ones."""
    strip = [{k: v for k, v in m.items() if k not in ignore} for m in a]
    return strip == [{k: v for k, v in m.items() if k not in ignore} for m in b]


__all__ = ["RESUMABLE", "metrics_equal", "resume"]
