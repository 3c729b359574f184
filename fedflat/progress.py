"""Progress that suits where the output goes: tqdm's live bar on a terminal, plain lines in a log.

Off a terminal (a file, a pipe, CI, ``nohup``, a scheduler's log) a run prints one line at most every
``FEDFLAT_PROGRESS_INTERVAL`` seconds (default 30), when a round ends, and one at the end::

    fedsam: round 37/100 (37%), 1.92 round/s, ETA 0:00:33, acc=0.871 loss=0.412

with the rounds really completed, the rate since this process started the run, the time left at that rate and
the last evaluation's accuracy: no carriage returns, no escape codes.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
from typing import Any, Callable, Iterable, Iterator, TextIO

from tqdm.auto import tqdm

INTERVAL_ENV = "FEDFLAT_PROGRESS_INTERVAL"
FALLBACK_COLUMNS = 80  # the bar's width on a terminal that reports none (0 columns)
LOG_INTERVAL = 30.0  # seconds between progress lines when the output is a file or a pipe (INTERVAL_ENV overrides)


def log_interval() -> float:
    """Seconds between two progress lines off a terminal: ``$FEDFLAT_PROGRESS_INTERVAL``, else 30."""
    text = os.environ.get(INTERVAL_ENV)
    if text is None or not text.strip():
        return LOG_INTERVAL
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{INTERVAL_ENV}={text!r}: give the seconds between progress lines, e.g. 30") from None
    if value < 0:
        raise ValueError(f"{INTERVAL_ENV}={text!r}: the interval cannot be negative")
    return value


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=round(seconds)))


class LogProgress:
    """Plain progress lines for a log: the part of tqdm's interface fedflat uses (iteration, ``update``,
    ``set_postfix``, ``set_postfix_str``, ``refresh``, ``write``, ``close``), printing at most one line per
    ``interval`` seconds (when the count or the postfix moves: a sweep's running cells' rounds) and a last line
    at :meth:`close`."""

    def __init__(self, iterable: Iterable | None = None, *, stream: TextIO, interval: float, desc: str = "",
                 unit: str = "it", total: int | None = None, initial: int = 0,
                 clock: Callable[[], float] = time.monotonic, **_ignored: Any):
        self.iterable, self.stream, self.interval, self.clock = iterable, stream, interval, clock
        self.desc, self.unit, self.initial, self.n = desc, unit, initial, initial
        self.total = total if total is not None else (len(iterable) + initial if hasattr(iterable, "__len__") else None)
        self.postfix = ""
        self.started = self.last_line = clock()
        self.closed = False

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update(1)  # the item's work is done: count it

    def update(self, n: int = 1) -> None:
        self.n += n
        self.refresh()

    def refresh(self) -> None:
        """A line, if ``interval`` seconds have passed since the last one."""
        if self.clock() - self.last_line >= self.interval:
            self._line()

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        """The text after the count (``key=value ...``); with ``refresh``, a line if one is due. A run sets its
        round's accuracy before counting the round, without ``refresh``: its line then shows both."""
        self.postfix = " ".join(f"{key}={value}" for key, value in values.items())
        if refresh:
            self.refresh()

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix = text
        if refresh:
            self.refresh()

    def write(self, text: str) -> None:
        self.stream.write(text.rstrip("\n") + "\n")
        self.stream.flush()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._line()

    def line(self) -> str:
        """The progress line as it stands: count, share of the total, rate, time left, postfix."""
        elapsed = self.clock() - self.started
        done = self.n - self.initial
        rate = done / elapsed if elapsed > 0 and done > 0 else None
        parts = [f"{self.unit} {self.n}" + (f"/{self.total}" if self.total else "")
                 + (f" ({100 * self.n / self.total:.0f}%)" if self.total else "")]
        parts.append(f"{rate:.3g} {self.unit}/s" if rate else f"? {self.unit}/s")
        if self.total:
            parts.append(f"ETA {_duration((self.total - self.n) / rate)}" if rate else "ETA ?")
        parts.append(f"elapsed {_duration(elapsed)}")
        text = f"{self.desc}: " if self.desc else ""
        return text + ", ".join(parts) + (f", {self.postfix}" if self.postfix else "")

    def _line(self) -> None:
        self.last_line = self.clock()
        self.write(self.line())


def progress_bar(iterable: Any = None, *, enabled: bool = True, stream: TextIO | None = None,
                 interval: float | None = None, **kwargs) -> tqdm | LogProgress:
    """``tqdm`` on a terminal; elsewhere (CI logs, ``nohup``, pipes) a :class:`LogProgress` that prints a plain
    line every ``interval`` seconds (default :func:`log_interval`) and at the end. Disabled: a silent tqdm.
    A terminal that reports a width of 0 (a pseudo-terminal nobody sized: ``docker exec -t``, some CI runners and
    editors' shells), where tqdm would draw a bar of no width, gets one :data:`FALLBACK_COLUMNS` wide."""
    stream = sys.stderr if stream is None else stream
    if enabled and not (hasattr(stream, "isatty") and stream.isatty()):
        return LogProgress(iterable, stream=stream, interval=log_interval() if interval is None else interval,
                           **kwargs)
    if enabled and terminal_columns(stream) == 0:
        kwargs = {**kwargs, "dynamic_ncols": False, "ncols": FALLBACK_COLUMNS}
    return tqdm(iterable, disable=not enabled, file=stream, **kwargs)


def terminal_columns(stream: TextIO) -> int | None:
    """The width the terminal of ``stream`` reports (0 when it reports none), or None when it cannot say."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None
