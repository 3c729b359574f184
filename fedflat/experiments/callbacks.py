"""Callbacks: what a run tells the code that watches it (``fedflat.run(..., callbacks=[...])``).

A callback is any object with some of these methods (subclass :class:`Callback` to get the others as no-ops)::

    on_run_start(run)                      before the first round, the run folder made; run.config is the
                                           resolved config (what config.yaml holds), run.metrics the lines so far
    on_round_end(run, round, metrics)      after every round: its metrics line when it was evaluated, else the
                                           round's training numbers (train_loss, lr, seconds, communication)
    on_evaluation(run, round, metrics)     after an evaluated round's line is written to metrics.jsonl
    on_checkpoint(run, round, path)        after checkpoint.pt is written (every checkpoint_every rounds, the end)
    on_run_end(run, summary, status)       once, after summary.json and model.pt are written, whatever happened:
                                           status is completed, diverged or failed (summary['reason'] says why)

``round`` counts rounds completed (1 for the first, as in metrics.jsonl). Callbacks observe: they get copies,
and nothing they do changes training. Those of ``fedflat.run`` come after the config's ``loggers``, in order.

Failures never cost the run its results. A callback that raises in ``on_run_start`` stops the run before its
first round with a :class:`CallbackError` (no run folder is left of a new run), unless it is ``optional``
(an attribute, default False), which makes that a :class:`CallbackWarning` and the run goes on without it. A
callback that raises later is always a warning: it is dropped, the run goes on, and ``summary.json`` lists the
failure under ``callback_errors``. Ctrl-C is never swallowed.
"""
from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from fedflat.core import ConfigError

EVENTS = ("on_run_start", "on_round_end", "on_evaluation", "on_checkpoint", "on_run_end")


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
    by which trackers group runs."""

    config: dict[str, Any]
    run_dir: Path | None
    name: str
    start_round: int = 0
    metrics: list[dict[str, Any]] = field(default_factory=list)
    group: str | None = None
    job: str | None = None

    @property
    def resumed(self) -> bool:
        return self.start_round > 0 or bool(self.metrics)


class Callback:
    """The callback interface with every event a no-op (see the module docstring)."""

    optional: bool = False

    def on_run_start(self, run: RunInfo) -> None:
        pass

    def on_round_end(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        pass

    def on_evaluation(self, run: RunInfo, round: int, metrics: dict[str, Any]) -> None:
        pass

    def on_checkpoint(self, run: RunInfo, round: int, path: Path) -> None:
        pass

    def on_run_end(self, run: RunInfo, summary: dict[str, Any], status: str) -> None:
        pass


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

    def _call(self, cb: Any, event: str, *args: Any) -> None:
        method = getattr(cb, event, None)
        if callable(method):
            method(self.run, *copy.deepcopy(args))

    def _drop(self, cb: Any, message: str) -> None:
        if cb in self.active:
            self.active.remove(cb)
        self.errors.append(message)
        warnings.warn(message, CallbackWarning, stacklevel=3)
