"""Slows the checkpoint writer of the process that calls :func:`install`, so a test can SIGKILL it mid-write.

A test's child process (tests/test_resume.py, tests/test_loggers.py) imports this module and calls
``install(delay)`` before it runs: from then on, the open file fedflat's own writer
(``fedflat.files.atomic_write_bytes``: temporary file, write, fsync, rename) writes a checkpoint's bytes to gets them
in two halves with ``delay`` seconds between them. Nothing else of the writer changes, and nothing outside that one
process: the test kills a real run while ``checkpoint.pt``'s temporary file holds half its bytes.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from fedflat.engine.checkpoint import CHECKPOINT


class HalvedWrites:
    """An open binary file whose writes land in two flushed halves, ``delay`` seconds apart."""

    def __init__(self, file: Any, delay: float):
        self.file, self.delay = file, delay

    def write(self, data: bytes) -> int:
        half = len(data) // 2
        written = self.file.write(data[:half])
        self.file.flush()  # the first half on disk: a kill now leaves a torn temporary file
        time.sleep(self.delay)
        return written + self.file.write(data[half:])

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)

    def __enter__(self) -> HalvedWrites:
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.file.__exit__(*exc)


def is_checkpoint_temporary(fd: int) -> bool:
    """Whether ``fd`` is open on a temporary file of ``checkpoint.pt`` (``.checkpoint.pt.XXXX.tmp``)."""
    try:
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
    except OSError:
        return False
    return name.startswith(f".{CHECKPOINT}.") and name.endswith(".tmp")


def install(delay: float) -> None:
    """Every checkpoint this process writes from now on pauses ``delay`` seconds halfway through its bytes."""
    fdopen = os.fdopen

    def slowed_fdopen(fd: int, *args: Any, **kwargs: Any) -> Any:
        file = fdopen(fd, *args, **kwargs)
        return HalvedWrites(file, delay) if is_checkpoint_temporary(fd) else file

    os.fdopen = slowed_fdopen
