"""Run folders: ``DIR/<run-id>/`` with config.yaml, metrics.jsonl, summary.json and model.pt.

Whole files are written atomically (temporary file in the same folder, fsync, ``os.replace``), so a
reader sees the old or the new version and never half of one. ``metrics.jsonl`` grows by one
complete line per evaluated round (a single write, flushed and synced); a reader ignores a final
line without its newline. A run folder is created exclusively and never overwritten.
"""
from __future__ import annotations

import json
import math
import os
import platform
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` so that ``path`` is always either the old or the new file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
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
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as fh:
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


def machine_info() -> dict[str, Any]:
    info = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def versions() -> dict[str, str]:
    from fedflat import __version__

    return {"python": sys.version.split()[0], "torch": torch.__version__, "fedflat": __version__}


class RunDir:
    """One run's folder. ``create`` makes a new, unique folder; ``open`` reuses an existing one."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def create(cls, out: str | Path, label: str) -> "RunDir":
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for _ in range(100):
            path = out / f"{stamp}-{label}-{secrets.token_hex(3)}"
            try:
                path.mkdir()
                return cls(path)
            except FileExistsError:
                continue
        raise RuntimeError(f"could not create a unique run folder in {out}")

    @classmethod
    def at(cls, path: str | Path) -> "RunDir":
        """Creates exactly ``path`` (a sweep cell's folder); an existing folder is an error, never reused."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
        except FileExistsError:
            raise FileExistsError(f"run folder {path} already exists; resume it (`fedflat resume {path}`) "
                                  "or choose another folder") from None
        return cls(path)

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    def write_config(self, yaml_text: str) -> None:
        atomic_write_text(self.path / "config.yaml", yaml_text)

    def append_metrics(self, record: dict[str, Any]) -> None:
        line = json.dumps(json_safe(record)) + "\n"
        with open(self.metrics_path, "a") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write_text(self.path / "summary.json", json.dumps(json_safe(summary), indent=2) + "\n")

    def read_summary(self) -> dict[str, Any]:
        return json.loads((self.path / "summary.json").read_text())

    def save_model(self, state_dict: dict[str, torch.Tensor]) -> None:
        atomic_torch_save(self.path / "model.pt", state_dict)

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)
