"""Checked, atomic downloads (urllib only).

A file is streamed into a temporary file next to its destination, hashed while it is
written, and moved into place with ``os.replace`` only when its checksum matches. A
failed or interrupted download therefore never leaves a partial file behind.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

__all__ = ["ChecksumError", "DownloadError", "download_file", "file_checksum", "verify_file"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_USER_AGENT = "fedflat (https://pypi.org/project/fedflat)"


class ChecksumError(ValueError):
    """A file's checksum differs from the expected one."""


class DownloadError(ConnectionError):
    """A download that could not be made (no network, a refused or failed connection)."""


def _hasher(algorithm: str) -> "hashlib._Hash":
    """A fresh hash object for ``algorithm`` ("sha256", "md5", ...)."""
    try:
        return hashlib.new(algorithm.lower())
    except ValueError as err:
        raise ValueError(f"unknown checksum algorithm {algorithm!r}; use 'sha256' or 'md5'") from err


def file_checksum(path: str | Path, algorithm: str = "sha256") -> str:
    """Hex digest of the file at ``path`` (``algorithm``: a :mod:`hashlib` name)."""
    digest = _hasher(algorithm)
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_file(path: str | Path, checksum: str, algorithm: str = "sha256") -> bool:
    """True when ``path`` exists and its ``algorithm`` digest equals ``checksum``."""
    path = Path(path)
    return path.is_file() and file_checksum(path, algorithm) == checksum.lower()


def download_file(url: str, dest: str | Path, checksum: str, algorithm: str = "sha256",
                  timeout: float = 60) -> Path:
    """Download ``url`` to ``dest``, verifying its ``algorithm`` digest against ``checksum``; ``timeout``: seconds
    a connection may wait for data.

    The data goes to a temporary file in ``dest``'s folder (created if needed) and is moved
    into place atomically after the check. On a mismatch a :class:`ChecksumError` naming the
    expected and actual digests is raised and neither ``dest`` nor the temporary file is left.
    """
    dest = Path(dest)
    created = [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    digest = _hasher(algorithm)
    fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    tmp = Path(tmp_name)
    log.info("downloading %s -> %s", url, dest)
    try:
        request = urllib.request.Request(url, headers={"User-Agent": _USER_AGENT})
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(request, timeout=timeout) as response:
            for block in iter(lambda: response.read(_CHUNK), b""):
                digest.update(block)
                out.write(block)
        actual = digest.hexdigest()
        if actual != checksum.lower():
            raise ChecksumError(f"{algorithm} checksum mismatch for {url}: expected {checksum.lower()}, "
                                f"got {actual}; the file was discarded")
        os.replace(tmp, dest)
    except (OSError, urllib.error.URLError) as err:  # no network, refused, reset, timed out
        tmp.unlink(missing_ok=True)
        _remove_empty(created)
        reason = getattr(err, "reason", None) or err
        raise DownloadError(f"could not download {url} ({reason}); without network access, copy {dest.name} "
                            f"from elsewhere into {dest.parent} (or any folder fedflat searches: docs/data.md) "
                            "and run again") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        _remove_empty(created)
        raise
    return dest


def _remove_empty(folders: list[Path]) -> None:
    """Removes the folders a failed download created, deepest first, if they are still empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break
