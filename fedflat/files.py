"""Files written so that a reader never sees half of one, and read so that a torn line is ignored.

Whole files are written atomically (temporary file in the same folder, fsync, ``os.replace``): a process
killed at any moment leaves the old file or the new one. Files follow the user's umask, like any file the
user writes. Run folders, sweeps, diagnostics and plots all write through these helpers.
"""
from __future__ import annotations

import io
import json
import math
import os
import pickle
import re
import tempfile
from pathlib import Path
from typing import Any

from fedflat.core import ConfigError


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


# Safe loading: a torch file is read only when it holds tensors and plain values (what run folders, model and
# personal files and checkpoints hold); any other Python object its pickles name is refused before torch reads it.

class CheckpointError(ConfigError):
    """A run folder that cannot be resumed or loaded (missing files, unreadable checkpoint)."""


class UnsafeFile(CheckpointError):
    """A file that would rebuild Python objects beyond tensors and plain values on load (could run code)."""


def _old_globals() -> list[Any]:
    """The one non-plain type that checkpoints written before :func:`plain` hold: ``torch.__version__``'s
    :class:`~torch.torch_version.TorchVersion` (a ``str`` subclass) in the summary's versions."""
    from torch.torch_version import TorchVersion

    return [TorchVersion]


def allowed_objects() -> set[str]:
    """The Python objects a tensors-and-plain-values file may name: those torch's ``weights_only`` unpickler rebuilds
    (its table: tensors' and storages' rebuild functions, dtypes, ``collections.OrderedDict``, ...), those registered
    with ``torch.serialization.add_safe_globals`` and :func:`_old_globals`."""
    import torch

    names = {f"{g.__module__}.{g.__qualname__}" for g in _old_globals()}
    try:  # (torch's own table, as in 2.6-2.13; the patterns below where a release moved it)
        from torch._weights_only_unpickler import _get_allowed_globals

        names |= set(_get_allowed_globals())
    except ImportError:
        pass
    for g in torch.serialization.get_safe_globals():
        g = g[0] if isinstance(g, tuple) else g
        names.add(f"{getattr(g, '__module__', '')}.{getattr(g, '__qualname__', getattr(g, '__name__', ''))}")
    return names


_TORCH_NAMES = re.compile(r"torch\.(_utils\._rebuild_\w+|_tensor\._rebuild_from_type_v2|(cuda\.)?\w*Storage|Size|device|"
                          r"(b?float|u?int|bool|complex|half|double|long|short|bits)\w*)$|collections\.OrderedDict$")
_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}


def python3_name(module: str, name: str = "") -> str:
    """``module.name`` as the unpickler resolves it: a protocol-2 pickle names Python 2's modules
    (``__builtin__.exec`` is ``builtins.exec``: :mod:`_compat_pickle`)."""
    import _compat_pickle

    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def pickle_objects(data: bytes | io.BufferedIOBase, count: int = 1) -> list[str]:
    """The Python objects the first ``count`` pickles of ``data`` name (``GLOBAL``, ``INST``, ``STACK_GLOBAL``), read
    opcode by opcode (:mod:`pickletools`): nothing is built or run. A ``STACK_GLOBAL`` whose module and name are not
    plain strings pushed before it names ``<unresolved>``."""
    import pickletools

    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    names: list[str] = []
    for _ in range(count):
        recent: list[str | None] = []
        memo: dict[int, str | None] = {}
        try:
            for op, arg, _pos in pickletools.genops(stream):
                if op.name in ("GLOBAL", "INST"):
                    names.append(python3_name(*str(arg).split(" ", 1)))
                elif op.name == "STACK_GLOBAL":
                    module, name = (recent[-2:] + [None, None])[:2] if len(recent) >= 2 else (None, None)
                    names.append(python3_name(module, name) if module and name else "<unresolved>")
                if op.name in _STRING_OPS:
                    recent.append(str(arg))
                elif op.name == "MEMOIZE":
                    memo[len(memo)] = recent[-1] if recent else None
                elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    memo[int(arg)] = recent[-1] if recent else None
                elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                    recent.append(memo.get(int(arg)))
                elif op.name not in ("FRAME", "PROTO"):
                    recent.append(None)
        except Exception:  # noqa: BLE001 - not a pickle, or a damaged one: torch's load says what it is
            break
    return names


def named_objects(path: str | Path) -> list[str]:
    """Every Python object a torch file's pickles name: the ``.pkl`` members of a zip file (``torch.save``'s format),
    else the pickles at the head of the legacy format (magic number, protocol, system info, the data, storage keys)."""
    import zipfile

    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            return [name for member in archive.namelist() if member.endswith(".pkl")
                    for name in pickle_objects(archive.read(member))]
    with open(path, "rb") as stream:
        return pickle_objects(stream, count=5)


def _refusal(path: str | Path, what: str, remedy: str, name: str) -> UnsafeFile:
    return UnsafeFile(f"{path}: refused: this {what} would rebuild the Python object {name} on load, which can run code "
                      f"(fedflat's own files hold only tensors and plain values): nothing of it was run; use only files "
                      f"you trust, or {remedy}")


def safe_load(path: str | Path, what: str, remedy: str) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain values, never code. A file whose pickles name any
    other Python object is refused (:class:`UnsafeFile`) before torch reads it (:func:`named_objects`, whatever the
    torch version's wording), an unreadable one (truncated, not a torch file) is a :class:`CheckpointError`; both one
    line naming the file, ``what`` it is and the ``remedy`` (never torch's advice to load it unsafely)."""
    import torch

    try:
        allowed = allowed_objects()
        refused = [name for name in named_objects(path) if name not in allowed and not _TORCH_NAMES.match(name)]
    except OSError as err:
        raise CheckpointError(f"{path}: unreadable {what} ({err.strerror or type(err).__name__}); {remedy}") from None
    if refused:
        raise _refusal(path, what, remedy, refused[0])
    try:
        with torch.serialization.safe_globals(_old_globals()):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        text = str(err)
        found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.<>]+)", text)
        if found:
            raise _refusal(path, what, remedy, found.group(1).rstrip(".")) from None
        cause = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)  # (torch's advice around it: load unsafely)
        if cause or isinstance(err, pickle.UnpicklingError):
            detail = f"not tensors and plain values: {cause.group(1) if cause else type(err).__name__}"
        else:
            detail = text.strip().splitlines()[0] if text.strip() else type(err).__name__
        if "weights_only" in detail or "unsafe" in detail.lower():  # (never pass on advice to load it unsafely)
            detail = type(err).__name__
        raise CheckpointError(f"{path}: unreadable {what} ({detail}); {remedy}") from None
