"""Callbacks: what a run tells the code that watches it (``fedflat.run(..., callbacks=[...])``).

A callback is any object with some of these methods (subclass :class:`Callback` to get the others as no-ops)::

    on_run_start(run)                      before the first round, the run folder made; run.config is the
                                           resolved config (what config.yaml holds), run.metrics the lines so far
    on_round_end(run, round, metrics)      after every round: its metrics line when it was evaluated, else the
                                           round's training numbers (train_loss, lr, seconds, communication)
    on_evaluation(run, round, metrics)     after an evaluated round's line is written to metrics.jsonl
    on_log(run, round, metrics)            after the line of a round not evaluated is written to metrics.jsonl
                                           (a round whose parts logged values, ctx.log: every such round has one)
    on_checkpoint(run, round, path)        after checkpoint.pt is written (every checkpoint_every rounds, the end)
    on_run_end(run, summary, status)       once, after summary.json and model.pt are written, whatever happened:
                                           status is completed, stopped, diverged or failed (summary['reason']
                                           says why)

**Stopping** (PyTorch Lightning's ``trainer.should_stop``): a callback sets ``run.should_stop = True`` (or calls
``run.stop(reason)``) in any event; the run ends after the round in progress with status ``stopped`` and the
reason, writes its files as a completed run does and returns its History. A stopped run is finished: a sweep
rerun skips it and ``fedflat resume`` returns it as it is. :class:`EarlyStopping` and :class:`ModelCheckpoint`
are built in (also the config's ``callbacks:`` section). A callback with state gives ``state_dict()`` and
``load_state_dict(state)`` (Lightning's names): the state goes into ``checkpoint.pt``, so a resumed run goes on
as one never interrupted; ``run.notes`` are entries a callback adds to ``summary.json``; ``run.model_state()``
is the global model's state dict (what ``model.pt`` holds) at that moment.

``round`` counts rounds completed (1 for the first, as in metrics.jsonl). Callbacks observe: they get copies,
and nothing they do changes training (they may only stop it). Those of ``fedflat.run`` come after the config's
``loggers`` and ``callbacks``, in order.

Failures never cost the run its results. A callback that raises in ``on_run_start`` stops the run before its
first round with a :class:`CallbackError` (no run folder is left of a new run), unless it is ``optional``
(an attribute, default False), which makes that a :class:`CallbackWarning` and the run goes on without it. A
callback that raises later is always a warning: it is dropped, the run goes on, and ``summary.json`` lists the
failure under ``callback_errors``. Ctrl-C is never swallowed.
"""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

import torch

from fedflat.core import ConfigError
from fedflat.files import atomic_torch_save

EVENTS = ("on_run_start", "on_round_end", "on_evaluation", "on_log", "on_checkpoint", "on_run_end")


class CallbackError(ConfigError):
    """A callback (a logger) that is not optional could not start: the run did not start either."""


class CallbackWarning(UserWarning):
    """An optional callback could not start, or a callback failed during the run (which went on)."""


@dataclass
class RunInfo:
    """What a callback knows of the run it watches.

    ``config``: the resolved config; ``run_dir``: the run folder (None without ``save``); ``name``: the run's
    name (its folder's, or its label); ``start_round``: rounds done before this process took the run over (a
    resume's checkpoint; 0 for a new run); ``metrics``: the metrics lines so far (a resume's, from its
    checkpoint); ``group`` and ``job``: the sweep or tune study the run is a cell of (``trials``, ``final``),
    by which trackers group runs. ``should_stop`` and ``stop_reason``: a callback's request to end the run after
    the round in progress (:meth:`stop`); ``notes``: entries callbacks add to ``summary.json``; ``state_fn``: what
    :meth:`model_state` calls for the global model's state (set by the run)."""

    config: dict[str, Any]
    run_dir: Path | None
    name: str
    start_round: int = 0
    metrics: list[dict[str, Any]] = field(default_factory=list)
    group: str | None = None
    job: str | None = None
    should_stop: bool = False
    stop_reason: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    state_fn: Callable[[], dict[str, torch.Tensor]] | None = field(default=None, repr=False)

    @property
    def resumed(self) -> bool:
        return self.start_round > 0 or bool(self.metrics)

    def stop(self, reason: str) -> None:
        """Asks the run to end after the round in progress, with status ``stopped`` and ``reason``."""
        self.should_stop, self.stop_reason = True, reason

    def model_state(self) -> dict[str, torch.Tensor]:
        """The global model's state dict now (parameters and buffers, on the CPU): what ``model.pt`` holds."""
        if self.state_fn is None:
            raise RuntimeError("this run gives no model state")
        return {k: v.detach().cpu().clone() for k, v in self.state_fn().items()}


class Callback:
    """The callback interface with every event a no-op (see the module docstring)."""

    optional: bool = False

    def on_run_start(self, run: RunInfo) -> None:
        """Before the first round, the run folder made: ``run`` is the :class:`RunInfo` of the run (its resolved
        config, folder and the metrics lines so far)."""

    def on_round_end(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        """After every round of ``run``: ``round`` counts the rounds done (1 for the first); ``metrics`` is its
        metrics line when it was evaluated, else the round's training numbers (train_loss, lr, seconds,
        communication)."""

    def on_evaluation(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        """After ``run``'s evaluated round ``round``'s line, ``metrics``, is written to metrics.jsonl."""

    def on_log(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        """After the line ``metrics`` of ``run``'s round ``round``, not evaluated, is written to metrics.jsonl (a
        round whose parts logged values)."""

    def on_checkpoint(self, run: RunInfo, round: int, path: Path) -> None:
        """After ``run``'s ``path`` (checkpoint.pt) is written at the end of round ``round``."""

    def on_run_end(self, run: RunInfo, summary: dict[str, Any], status: str) -> None:
        """Once, after ``run``'s summary.json and model.pt are written, whatever happened: ``summary`` is what
        summary.json holds, ``status`` completed, stopped, diverged or failed (``summary["reason"]`` says why)."""


def label(callback: Any) -> str:
    """A callback's name in messages: a logger's ``name``, else its class."""
    return getattr(callback, "name", None) or type(callback).__name__


class Callbacks:
    """The run's callbacks, called in order, each failure kept from the run (see the module docstring)."""

    def __init__(self, callbacks: Iterable[Any], run: RunInfo):
        self.active = list(callbacks)
        for cb in self.active:
            if not any(callable(getattr(cb, event, None)) for event in EVENTS):
                raise CallbackError(f"callback {label(cb)} has none of the methods {', '.join(EVENTS)} "
                                    "(subclass fedflat.experiments.callbacks.Callback)")
        self.run = run
        self.errors: list[str] = []
        self.ended = False

    def start(self, summary: dict[str, Any]) -> None:
        """``on_run_start`` of each; a non-optional one that fails ends those started (status failed) and
        raises."""
        started = []
        for cb in list(self.active):
            try:
                self._call(cb, "on_run_start")
            except Exception as err:  # noqa: BLE001 - any failure of a callback is reported, never lost
                message = f"{label(cb)} could not start: {type(err).__name__}: {err}"
                if not getattr(cb, "optional", False):
                    self.active = started
                    self.end({**summary, "status": "failed", "reason": message})
                    raise CallbackError(f"{message} (mark it optional: true to run without it)") from err
                self._drop(cb, f"{message}; the run goes on without it")
            else:
                started.append(cb)

    def emit(self, event: str, *args: Any) -> None:
        """``event`` of every active callback; one that raises is dropped with a warning."""
        for cb in list(self.active):
            try:
                self._call(cb, event, *args)
            except Exception as err:  # noqa: BLE001
                self._drop(cb, f"{label(cb)} failed in {event}: {type(err).__name__}: {err}; the run goes on "
                               "without it")

    def end(self, summary: dict[str, Any]) -> None:
        """``on_run_end`` of each, once."""
        if not self.ended:
            self.ended = True
            self.emit("on_run_end", summary, summary.get("status"))

    def state_dict(self) -> dict[str, Any]:
        """The state of every callback that has one (``state_dict()``), by :func:`state_keys`."""
        return {key: cb.state_dict() for key, cb in state_keys(self.active).items()}

    def load_state_dict(self, states: dict[str, Any]) -> None:
        """Gives each callback its state from a checkpoint; one new to the run starts fresh."""
        for key, cb in state_keys(self.active).items():
            if key in states and callable(getattr(cb, "load_state_dict", None)):
                cb.load_state_dict(copy.deepcopy(states[key]))

    def _call(self, cb: Any, event: str, *args: Any) -> None:
        method = getattr(cb, event, None)
        if callable(method):
            method(self.run, *copy.deepcopy(args))

    def _drop(self, cb: Any, message: str) -> None:
        if cb in self.active:
            self.active.remove(cb)
        self.errors.append(message)
        warnings.warn(message, CallbackWarning, stacklevel=3)


def state_keys(callbacks: Iterable[Any]) -> dict[str, Any]:
    """The callbacks that have state, by key: their ``state_key`` (else their class), ``#2`` ... on repeats."""
    keyed: dict[str, Any] = {}
    for cb in callbacks:
        if not callable(getattr(cb, "state_dict", None)):
            continue
        base = getattr(cb, "state_key", None) or type(cb).__qualname__
        key, n = base, 1
        while key in keyed:
            n += 1
            key = f"{base}#{n}"
        keyed[key] = cb
    return keyed


Mode = Literal["min", "max"]


def _mode(metric: str, mode: str | None) -> str:
    """``mode`` as given, else from the metric's name: accuracies and scores rise, losses fall."""
    if mode is not None:
        if mode not in ("min", "max"):
            raise ConfigError(f"mode must be 'min' or 'max' (got {mode!r})")
        return mode
    if metric.endswith(("_acc", "_f1", "_auroc", "accuracy")):
        return "max"
    if metric.endswith("loss"):
        return "min"
    raise ConfigError(f"say whether {metric!r} improves upward or downward: mode: max or mode: min")


class _Monitor(Callback):
    """The best value so far of one metric of the metrics lines (the evaluated rounds)."""

    def __init__(self, metric: str, mode: str | None = None, min_delta: float = 0.0):
        if min_delta < 0:
            raise ConfigError(f"min_delta must be >= 0 (got {min_delta})")
        self.metric, self.mode, self.min_delta = metric, _mode(metric, mode), float(min_delta)
        self.best: float | None = None
        self.best_round: int | None = None

    @property
    def state_key(self) -> str:
        return f"{type(self).__name__}{{metric={self.metric}, mode={self.mode}}}"

    def value(self, metrics: dict[str, Any]) -> float:
        if self.metric not in metrics:
            raise ValueError(f"metric {self.metric!r} is not in the metrics line; it has "
                           f"{', '.join(k for k, v in metrics.items() if isinstance(v, (int, float)))}")
        return float(metrics[self.metric])

    def improves(self, value: float) -> bool:
        """``value`` beats the best by more than ``min_delta`` (a first finite value always does; NaN never)."""
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return value < self.best - self.min_delta if self.mode == "min" else value > self.best + self.min_delta

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_round": self.best_round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.best_round = state["best"], state["best_round"]


class EarlyStopping(_Monitor):
    """Stops the run when ``metric`` has not improved by more than ``min_delta`` for ``patience`` evaluations
    in a row (PyTorch Lightning's ``EarlyStopping``): with best value :math:`b` and ``mode`` max, an evaluation
    improves when :math:`v > b + \\delta` (min: :math:`v < b - \\delta`); a NaN or infinite value never does.
    ``patience`` counts evaluated rounds (``eval.every`` apart), not rounds."""

    def __init__(self, metric: str, mode: str | None = None, patience: int = 3, min_delta: float = 0.0):
        super().__init__(metric, mode, min_delta)
        if patience < 1:
            raise ConfigError(f"patience must be >= 1 (got {patience})")
        self.patience, self.wait, self.stopped_round = int(patience), 0, None

    def on_run_start(self, run: RunInfo) -> None:
        """A resumed ``run`` that had stopped stays stopped."""
        if self.stopped_round is not None:
            run.stop(self.reason())

    def on_evaluation(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        """Counts evaluation ``round`` as an improvement of ``metric`` in ``metrics`` or not, and stops ``run``
        after ``patience`` evaluations without one."""
        value = self.value(metrics)
        if self.improves(value):
            self.best, self.best_round, self.wait = value, round, 0
        else:
            self.wait += 1
        if self.wait >= self.patience:
            self.stopped_round = round
            run.stop(self.reason())
        run.notes["early_stopping"] = {"metric": self.metric, "mode": self.mode, "best": self.best,
                                       "best_round": self.best_round, "wait": self.wait,
                                       "stopped_round": self.stopped_round}

    def reason(self) -> str:
        return (f"early stopping: {self.metric} did not improve by more than {self.min_delta:g} in {self.patience} "
                f"evaluations (best {self.best} at round {self.best_round})")

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "wait": self.wait, "stopped_round": self.stopped_round}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The best value, its round, the evaluations waited and the round it stopped, from a checkpoint's
        ``state`` (:meth:`state_dict`)."""
        super().load_state_dict(state)
        self.wait, self.stopped_round = state["wait"], state["stopped_round"]


class ModelCheckpoint(_Monitor):
    """Keeps the global model of the evaluation with the best ``metric`` (PyTorch Lightning's
    ``ModelCheckpoint(monitor, mode)`` with one model kept): ``RUN_DIR/<filename>`` (default ``best_model.pt``,
    a state dict as ``model.pt``), written when a round beats the best (strictly; the earliest round wins
    ties), and ``summary.json``'s ``best_model`` says its round and value. The best model is part of the
    callback's state, so ``checkpoint.pt`` carries it and a resume rewrites the file from it: the file always
    matches the round the run continues from. Without a run folder (``save=False``) it is kept in memory
    (``best_state``)."""

    def __init__(self, metric: str, mode: str | None = None, filename: str = "best_model.pt"):
        super().__init__(metric, mode)
        if not filename or "/" in filename or filename in ("model.pt", "checkpoint.pt"):
            raise ConfigError(f"filename must be a file name other than model.pt and checkpoint.pt "
                              f"(got {filename!r})")
        self.filename = filename
        self.best_state: dict[str, torch.Tensor] | None = None

    def on_run_start(self, run: RunInfo) -> None:
        """A resumed ``run`` writes the best model file as it was at its checkpoint's round."""
        if self.best_state is not None:
            self._write(run)

    def on_evaluation(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        """Keeps ``run``'s global model when evaluation ``round`` beats the best ``metric`` in ``metrics``."""
        value = self.value(metrics)
        if self.improves(value):
            self.best, self.best_round, self.best_state = value, round, run.model_state()
            self._write(run)

    def _write(self, run: RunInfo) -> None:
        if run.run_dir is not None:
            atomic_torch_save(run.run_dir / self.filename, self.best_state)
        run.notes["best_model"] = {"file": self.filename if run.run_dir is not None else None,
                                   "metric": self.metric, "mode": self.mode, "value": self.best,
                                   "round": self.best_round}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "state": self.best_state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The best value, its round and its model, from a checkpoint's ``state`` (:meth:`state_dict`)."""
        super().load_state_dict(state)
        self.best_state = state["state"]


BUILT_IN = {"early_stopping": EarlyStopping, "model_checkpoint": ModelCheckpoint}


def build_callbacks(entries: Iterable[Any]) -> list[Callback]:
    """The config's ``callbacks`` section as callbacks (each entry a mapping, or its pydantic model)."""
    built = []
    for entry in entries:
        options = entry.model_dump() if hasattr(entry, "model_dump") else dict(entry)
        built.append(BUILT_IN[options.pop("name")](**options))
    return built
