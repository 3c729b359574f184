"""Files written so that a reader never sees half of one, and read so that a torn line is ignored.

Whole files are written atomically (temporary file in the same folder, fsync, ``os.replace``): a process
killed at any moment leaves the old file or the new one. Files follow the user's umask, like any file the
user writes. Run folders, sweeps, diagnostics and plots all write through these helpers.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


FILE_MODE = 0o666 & ~_umask()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that ``path`` is always either the old or the new file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp makes 0600; the user's umask decides, as for any file
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_torch_save(path: Path, obj: Any) -> None:
    """``torch.save(obj)`` to ``path`` atomically, the same bytes for the same ``obj``: torch names the archive's
    records after the file it is given a path of (here a random temporary name), so it is given the open file
    instead (records under ``archive/``; its zip entries carry a fixed date)."""
    import torch

    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.fchmod(fd, FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def json_safe(value: Any) -> Any:
    """NaN/inf become None so that every line is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a JSONL file (a torn last line, from a killed writer, is ignored)."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    if not text.endswith("\n"):
        lines = lines[:-1]
    return [json.loads(line) for line in lines if line.strip()]
