"""Readers of the standard on-disk formats: IDX (MNIST family) and the CIFAR python pickles."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import tarfile
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterable, Iterator

import numpy as np

from .errors import DatasetError

__all__ = ["read_idx", "read_cifar_batch", "read_cifar_split", "extract_tar_safely", "CIFAR_LAYOUT"]

# IDX type byte -> big-endian numpy dtype (http://yann.lecun.com/exdb/mnist/, "THE IDX FILE FORMAT").
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}

# CIFAR archive layout: top folder, train member names, test member names, label key.
CIFAR_LAYOUT: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], bytes]] = {
    "cifar10": ("cifar-10-batches-py", tuple(f"data_batch_{i}" for i in range(1, 6)),
                ("test_batch",), b"labels"),
    "cifar100": ("cifar-100-python", ("train",), ("test",), b"fine_labels"),
}


# What to do about a dataset file that cannot be read (the end of each such error's one line).
REPLACE = "delete it and download it again (data.download=true), or copy the official file there"


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (gzipped or raw, detected from its first bytes) into a writable array. A truncated or
    corrupt file is a :class:`DatasetError` naming it."""
    with open(path, "rb") as stream:
        gzipped = stream.read(2) == b"\x1f\x8b"
    opener = gzip.open if gzipped else open
    try:
        with opener(path, "rb") as stream:
            data = stream.read()
    except (EOFError, OSError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        raise DatasetError(f"{path}: truncated or corrupt gzip file ({err}): {REPLACE}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _IDX_DTYPES:
        raise DatasetError(f"{path}: not an IDX file (bad magic number {data[:4].hex()}): {REPLACE}")
    dtype, ndim = np.dtype(_IDX_DTYPES[data[2]]), data[3]
    header = 4 + 4 * ndim
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(shape)) * dtype.itemsize
    if len(data) - header != expected:
        raise DatasetError(f"{path}: IDX header says shape {shape} ({expected} bytes) "
                           f"but the file holds {len(data) - header} bytes of data: {REPLACE}")
    array = np.frombuffer(data, dtype=dtype, offset=header).reshape(shape)
    return array.astype(dtype.newbyteorder("="))  # native byte order, and a writable copy


class _ArrayUnpickler(pickle.Unpickler):
    """Unpickler that only rebuilds numpy arrays and plain containers (no arbitrary code)."""

    _ALLOWED = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
                ("numpy._core.multiarray", "_reconstruct"), ("_codecs", "encode")}

    def find_class(self, module: str, name: str):  # noqa: D401 - pickle API
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a CIFAR pickle")
        return super().find_class(module, name)


def read_cifar_batch(stream: IO[bytes], label_key: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Read one CIFAR python batch: images uint8 ``[N, 3, 32, 32]`` and labels int64 ``[N]``."""
    batch = _ArrayUnpickler(stream, encoding="bytes").load()
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        raise ValueError(f"not a CIFAR batch: expected keys b'data' and {label_key!r}")
    images = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
    labels = np.asarray(batch[label_key], dtype=np.int64)
    if len(images) != len(labels):
        raise ValueError(f"CIFAR batch has {len(images)} images but {len(labels)} labels")
    return images, labels


def _concat(parts: Iterable[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = zip(*parts)
    return np.concatenate(xs), np.concatenate(ys)


def read_cifar_split(location: Path, name: str, train: bool) -> tuple[np.ndarray, np.ndarray]:
    """Read a CIFAR split from the extracted folder or, if ``location`` is a file, the tar.gz."""
    folder, train_members, test_members, label_key = CIFAR_LAYOUT[name]
    members = train_members if train else test_members
    if location.is_dir():
        def read(member: str) -> tuple[np.ndarray, np.ndarray]:
            with open(location / member, "rb") as stream, _corrupt(location / member):
                return read_cifar_batch(stream, label_key)
        return _concat(read(m) for m in members)
    with _corrupt(location), tarfile.open(location, "r:*") as archive:
        def read_member(member: str) -> tuple[np.ndarray, np.ndarray]:
            stream = archive.extractfile(f"{folder}/{member}")
            if stream is None:
                raise ValueError(f"{location}: {folder}/{member} is not a regular file")
            return read_cifar_batch(io.BytesIO(stream.read()), label_key)
        return _concat(read_member(m) for m in members)


@contextmanager
def _corrupt(path: Path) -> Iterator[None]:
    """A dataset file that fails to parse (truncated, garbage, a refused pickle) as one :class:`DatasetError`
    line naming it."""
    try:
        yield
    except DatasetError:
        raise
    except (EOFError, ValueError, pickle.UnpicklingError, tarfile.TarError, zlib.error, gzip.BadGzipFile) as err:
        detail = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DatasetError(f"{path}: truncated or corrupt ({detail}): {REPLACE}") from None


def extract_tar_safely(archive: Path, dest: Path, members: Iterable[str] | None = None) -> None:
    """Extract ``members`` (all if None) of ``archive`` into ``dest``.

    Only regular files and folders whose paths stay inside ``dest`` are accepted; anything
    else (absolute paths, ``..``, links, devices) raises ``ValueError`` before anything is written.
    Files are written under temporary names and renamed, so an interrupted run leaves no
    truncated member behind.
    """
    dest = dest.resolve()
    wanted = None if members is None else set(members)
    with tarfile.open(archive, "r:*") as tar:
        chosen = [m for m in tar.getmembers() if wanted is None or m.name in wanted]
        for member in chosen:
            target = (dest / member.name).resolve()
            if not (member.isfile() or member.isdir()) or not target.is_relative_to(dest):
                raise ValueError(f"{archive}: unsafe member {member.name!r} refused")
        if wanted is not None and len(chosen) != len(wanted):
            missing = sorted(wanted - {m.name for m in chosen})
            raise ValueError(f"{archive}: members missing from the archive: {missing}")
        for member in chosen:
            target = dest / member.name
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.part")
            with tar.extractfile(member) as source, open(partial, "wb") as out:
                while block := source.read(1 << 20):
                    out.write(block)
            os.replace(partial, target)
