"""Progress bars that suit where the output goes: a live bar on a terminal, plain lines in a log."""
from __future__ import annotations

import re
import sys
from typing import Any, TextIO

from tqdm.auto import tqdm

LOG_INTERVAL = 30.0  # seconds between progress lines when the output is a file or a pipe
_CONTROL = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class LogLines:
    """A stream for tqdm that turns its carriage-return redraws into whole lines (no escape codes)."""

    def __init__(self, stream: TextIO):
        self.stream = stream

    def write(self, text: str) -> None:
        for piece in re.split(r"[\r\n]", _CONTROL.sub("", text)):
            if piece.strip():
                self.stream.write(piece.rstrip() + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(iterable: Any = None, *, enabled: bool = True, stream: TextIO | None = None, **kwargs) -> tqdm:
    """``tqdm`` on a terminal; elsewhere (CI logs, ``nohup``, pipes) a plain line every 30 seconds and at the end."""
    stream = sys.stderr if stream is None else stream
    if enabled and not (hasattr(stream, "isatty") and stream.isatty()):
        kwargs.update(file=LogLines(stream), mininterval=LOG_INTERVAL, dynamic_ncols=False, ncols=100, ascii=True)
    return tqdm(iterable, disable=not enabled, **kwargs)
