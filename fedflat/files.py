"""Files written so that a reader never sees half of one, and read so that a torn line is ignored.

Whole files are written atomically (temporary file in the same folder, fsync, ``os.replace``): a process
killed at any moment leaves the old file or the new one. Files follow the user's umask, like any file the
user writes. Run folders, sweeps, diagnostics and plots all write through these helpers.
"""
from __future__ import annotations

import collections
import io
import json
import math
import os
import pickle
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO

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
    opcode by opcode (:mod:`pickletools`): nothing is built or run, and besides the names only the last two values
    pushed and the memo's strings are kept (never a list that grows with every opcode). A ``STACK_GLOBAL`` whose module
    and name are not plain strings pushed before it names ``<unresolved>``."""
    import pickletools

    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    names: list[str] = []
    for _ in range(count):
        recent: collections.deque[str | None] = collections.deque(maxlen=2)
        memo: dict[int, str | None] = {}
        try:
            for op, arg, _pos in pickletools.genops(stream):
                if op.name in ("GLOBAL", "INST"):
                    names.append(python3_name(*str(arg).split(" ", 1)))
                elif op.name == "STACK_GLOBAL":
                    module, name = recent if len(recent) == 2 else (None, None)
                    names.append(python3_name(module, name) if module and name else "<unresolved>")
                if op.name in _STRING_OPS:
                    recent.append(str(arg))
                elif op.name == "MEMOIZE":
                    _remember(memo, len(memo), recent)
                elif op.name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    _remember(memo, int(arg), recent)
                elif op.name in ("GET", "BINGET", "LONG_BINGET"):
                    recent.append(memo.get(int(arg)))
                elif op.name not in ("FRAME", "PROTO"):
                    recent.append(None)
        except Exception:  # noqa: BLE001 - not a pickle, or a damaged one: torch's load says what it is
            break
    return names


def _remember(memo: dict[int, str | None], index: int, recent) -> None:
    """Memo entry ``index``: the string just pushed, if any (only strings are ever looked up: a ``STACK_GLOBAL``'s
    module and name). A memo index that holds no string is not kept, so the memo holds at most the pickle's strings."""
    if recent and recent[-1] is not None:
        memo[index] = recent[-1]
    else:
        memo.pop(index, None)


def memory_bytes() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say): no file larger than it can be
    loaded whole, so :func:`safe_load` refuses one before reading it."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def open_regular(path: str | Path, what: str, remedy: str, max_bytes: int | None) -> BinaryIO:
    """``path`` opened for reading, once it is known to be a regular file (after symbolic links) of at most
    ``max_bytes`` bytes: a device (``/dev/zero``), a FIFO or a socket would be read without end or block for ever.
    It is checked on the open file itself (``fstat``), so the file read is the file checked; ``O_NONBLOCK`` keeps the
    open of a FIFO from waiting for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise CheckpointError(f"{path}: unreadable {what} ({err.strerror or type(err).__name__}); {remedy}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path}: refused: this {what} is not a regular file (a device, FIFO, socket or "
                                  f"folder, or a link to one), which could be read without end; {remedy}")
        if max_bytes is not None and info.st_size > max_bytes:
            raise CheckpointError(f"{path}: refused: this {what} holds {info.st_size} bytes, more than the "
                                  f"{max_bytes} that can be loaded here (this machine's memory); {remedy}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class ArchiveRefused(ValueError):
    """A zip file that ``torch.save`` would not write and whose reading could differ between two readers."""


def named_objects(source: str | Path | BinaryIO, max_bytes: int | None = None) -> list[str]:
    """Every Python object a torch file's pickles name: every ``.pkl`` member of a zip file (``torch.save``'s format;
    the name compared without case, as torch's reader looks records up), else the pickles at the head of the legacy
    format (magic number, protocol, system info, the data, storage keys). ``source``: a path or an open file.

    A zip file is :class:`ArchiveRefused` when two members share a name (without case: torch reads one of them, this
    scan could read the other) or its members unpack to more than ``max_bytes``; each member is read as a stream."""
    import zipfile

    if isinstance(source, (str, Path)):
        with open(source, "rb") as stream:
            return named_objects(stream, max_bytes)
    source.seek(0)
    if not zipfile.is_zipfile(source):
        source.seek(0)
        return pickle_objects(source, count=5)
    source.seek(0)
    with zipfile.ZipFile(source) as archive:
        members = archive.infolist()
        count = collections.Counter(member.filename.lower() for member in members)
        twins = [member.filename for member in members if count[member.filename.lower()] > 1]
        if twins:
            raise ArchiveRefused(f"it holds {len(twins)} members named {twins[0]!r} (compared without case: torch "
                                 "reads one of them; torch.save never writes two)")
        unpacked = sum(member.file_size for member in members)
        if max_bytes is not None and unpacked > max_bytes:
            raise ArchiveRefused(f"its members unpack to {unpacked} bytes, more than the {max_bytes} that can be "
                                 "loaded here (this machine's memory)")
        names = []
        for member in members:
            if member.filename.lower().endswith(".pkl"):
                with archive.open(member) as pickle_stream:
                    names += pickle_objects(pickle_stream)
        return names


def _refusal(path: str | Path, what: str, remedy: str, name: str) -> UnsafeFile:
    return UnsafeFile(f"{path}: refused: this {what} would rebuild the Python object {name} on load, which can run code "
                      f"(fedflat's own files hold only tensors and plain values): nothing of it was run; use only files "
                      f"you trust, or {remedy}")


def safe_load(path: str | Path, what: str, remedy: str, max_bytes: int | None = None) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain values, never code. Only a regular file of at most
    ``max_bytes`` (None: this machine's memory, :func:`memory_bytes`) is read
    (:func:`open_regular`), once: the scan and the load read the same open file. A file whose pickles name any other
    Python object is refused (:class:`UnsafeFile`) before torch reads it (:func:`named_objects`, whatever the torch
    version's wording), as is a zip file two readers could read differently; an unreadable one (truncated, not a torch
    file) is a :class:`CheckpointError`; each one line naming the file, ``what`` it is and the ``remedy`` (never
    torch's advice to load it unsafely)."""
    import torch

    import zipfile

    cap = memory_bytes() if max_bytes is None else max_bytes
    with open_regular(path, what, remedy, cap) as stream:
        try:
            allowed = allowed_objects()
            named = named_objects(stream, cap)
        except ArchiveRefused as err:
            raise UnsafeFile(f"{path}: refused: this {what} is not a zip file torch.save wrote: {err}; use only "
                             f"files you trust, or {remedy}") from None
        except (zipfile.BadZipFile, EOFError) as err:
            raise CheckpointError(f"{path}: unreadable {what} (a damaged zip file: {err}); {remedy}") from None
        except OSError as err:
            raise CheckpointError(f"{path}: unreadable {what} ({err.strerror or type(err).__name__}); "
                                  f"{remedy}") from None
        refused = [name for name in named if name not in allowed and not _TORCH_NAMES.match(name)]
        if refused:
            raise _refusal(path, what, remedy, refused[0])
        stream.seek(0)
        try:
            with torch.serialization.safe_globals(_old_globals()):
                return torch.load(stream, map_location="cpu", weights_only=True)
        except Exception as err:
            raise _unreadable(path, what, remedy, err) from None


def _unreadable(path: str | Path, what: str, remedy: str, err: Exception) -> CheckpointError:
    """torch's error loading ``path`` as one line: a refusal where its unpickler names an object, else unreadable."""
    text = str(err)
    found = re.search(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.<>]+)", text)
    if found:
        return _refusal(path, what, remedy, found.group(1).rstrip("."))
    cause = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)  # (torch's advice around it: load unsafely)
    if cause or isinstance(err, pickle.UnpicklingError):
        detail = f"not tensors and plain values: {cause.group(1) if cause else type(err).__name__}"
    else:
        detail = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    if "weights_only" in detail or "unsafe" in detail.lower():  # (never pass on advice to load it unsafely)
        detail = type(err).__name__
    return CheckpointError(f"{path}: unreadable {what} ({detail}); {remedy}")
