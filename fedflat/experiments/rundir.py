"""Run folders: ``DIR/<run-id>/`` with config.yaml, metrics.jsonl, summary.json and model.pt.

Whole files are written atomically (temporary file in the same folder, fsync, ``os.replace``), so a
reader sees the old or the new version and never half of one. ``metrics.jsonl`` grows by one
complete line per evaluated round (a single write, flushed and synced); a reader ignores a final
line without its newline. A run folder is created exclusively and never overwritten. Files follow the
user's umask (readable by colleagues where the umask allows), like any file the user writes.

A run folder has one writer at a time: :func:`hold` takes an OS lock on ``RUN_DIR/.lock`` (released by
the kernel when its holder dies, however it dies), and a second process — a ``fedflat resume`` of a live
run, a second sweep over the same cells — is refused with the holder's pid. A small ``.reserve`` file is
kept while the run writes, and given back when the disk fills, so the failure can still be recorded.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import platform
import secrets
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from fedflat._version import __version__
from fedflat.files import atomic_torch_save, atomic_write_text, json_safe, read_jsonl

LOCK, RESERVE = ".lock", ".reserve"
TRACKING_FILE = "tracking.json"  # the ids of the run's tracked runs (W&B, MLflow): fedflat.experiments.loggers
# A run's status when it ended as planned: its rounds done, stopped by a callback (early stopping), or stopped before a
# round that would exceed its privacy budget; and every status with nothing left to do (a sweep rerun skips them).
SUCCEEDED = ("completed", "stopped", "budget spent")
FINISHED = (*SUCCEEDED, "diverged")
RESERVE_BYTES = 256 * 1024  # room for the final summary, model-free, when the disk is full


class RunFolderBusy(RuntimeError):
    """Another process is writing this run folder."""


def machine_info() -> dict[str, Any]:
    import torch

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
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "fedflat": __version__}


_HELD: dict[Path, list] = {}  # run folders this process holds: path -> [lock file, depth]


@contextmanager
def hold(folder: str | Path, what: str = "run folder") -> Iterator[None]:
    """This process's exclusive hold on a run folder, or on a sweep's folder (``what`` names it in the message
    that refuses a second holder; re-entrant within the process)."""
    folder = Path(folder).resolve()
    if folder in _HELD:
        _HELD[folder][1] += 1
        try:
            yield
        finally:
            _HELD[folder][1] -= 1
        return
    fh = open(folder / LOCK, "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        raise RunFolderBusy(f"{what} {folder} is in use by process {holder} (a fedflat run, resume, sweep or tune); "
                            "wait for it to finish or stop it, then try again") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    _HELD[folder] = [fh, 1]
    try:
        yield
    finally:
        _HELD[folder][1] -= 1
        if _HELD[folder][1] == 0:
            del _HELD[folder]
            fh.close()  # closing the file releases the lock (the kernel does it for a dead holder)


def is_disk_full(err: BaseException) -> bool:
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def interruption(err: KeyboardInterrupt) -> str:
    """What interrupted a run: the signal or stop request a ``KeyboardInterrupt`` names, else Ctrl-C (an exception
    object is truthy even when its text is empty: ``err or 'Ctrl-C'`` printed ``interrupted ()``)."""
    return str(err) or "Ctrl-C"


class DiskFull(OSError):
    """The disk filled up during a run; the message says where and how to continue."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.args[1]


def check_output_folder(path: str | Path) -> list[Path]:
    """Refuses, before any data are loaded, an output folder ``path`` that cannot be made or written; makes it (with
    its parents) where it is missing, as the run would make it, and returns the folders it made, outermost first
    (:func:`remove_if_empty` takes them away again if the run stops before its folder exists). Making is idempotent
    (``os.makedirs(exist_ok=True)``), so runs started at once into one new folder never trip over each other: each
    then makes its own run folder in it (:meth:`RunDir.create`, exclusive)."""
    from fedflat.core import ConfigError

    target = Path(path).absolute()
    probe, missing = target, []
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"output folder {path}: {probe} is a file, not a folder; choose another --out")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"output folder {path}: {probe} is not writable; choose another --out")
    try:  # (/proc is "writable" and takes no folder: only making one tells)
        os.makedirs(target, exist_ok=True)
    except FileExistsError:  # a file in the way, made since the look above
        raise ConfigError(f"output folder {path}: a file is in its way, not a folder; choose another --out") from None
    except OSError as err:
        raise ConfigError(f"output folder {path}: cannot be made in {probe} ({err.strerror or err}); choose "
                          "another --out") from None
    if not os.access(target, os.W_OK | os.X_OK):
        raise ConfigError(f"output folder {path}: {target} is not writable; choose another --out")
    return missing[::-1]


def remove_if_empty(made: list[Path]) -> None:
    """Removes the folders :func:`check_output_folder` made, innermost first, each only while it is empty: a run
    that stopped before its folder existed (a bad ``--data-dir``, an unknown dataset) leaves no empty ``--out``
    behind, and a folder another run has written into stays (``os.rmdir`` removes only an empty folder)."""
    for folder in reversed(made):
        try:
            folder.rmdir()
        except OSError:  # not empty (another run's folder is in it), or gone already
            return


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
            except FileNotFoundError:  # another run into this new folder failed early and took it away again
                out.mkdir(parents=True, exist_ok=True)
        raise RuntimeError(f"could not create a unique run folder in {out}")

    @classmethod
    def at(cls, path: str | Path) -> "RunDir":
        """Creates exactly ``path`` (a sweep cell's folder); a folder with a run in it is an error, never
        reused (an empty one, or one holding only the lock a sweep took first and the tracked runs' ids of a
        start that was killed, is taken)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir()
        except FileExistsError:
            if any(p.name not in (LOCK, RESERVE, TRACKING_FILE) for p in path.iterdir()):
                raise FileExistsError(f"run folder {path} already exists; resume it (`fedflat resume {path}`) "
                                      "or choose another folder") from None
        return cls(path)

    def reserve(self) -> None:
        """Sets aside a little disk space (given back by :meth:`release_reserve` when the disk is full)."""
        with open(self.path / RESERVE, "wb") as fh:
            fh.write(b"\0" * RESERVE_BYTES)
            fh.flush()
            os.fsync(fh.fileno())

    def release_reserve(self) -> None:
        (self.path / RESERVE).unlink(missing_ok=True)

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

    def save_model(self, state_dict: dict[str, Any]) -> None:
        atomic_torch_save(self.path / "model.pt", state_dict)

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)
