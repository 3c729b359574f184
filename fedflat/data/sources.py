"""Where datasets live on disk, where they come from, and how they are found.

Search order for a file-backed dataset (first match wins):

1. the ``root`` argument (``data.root`` in a config, ``--data-dir`` on the command line),
2. every folder in ``$FEDFLAT_DATA`` (``os.pathsep``-separated),
3. the download cache (``$XDG_CACHE_HOME/fedflat/data``, by default ``~/.cache/fedflat/data``),
4. system folders (Debian's ``dataset-fashion-mnist`` package installs
   ``/usr/share/datasets/fashion-mnist``).

Within each of the first three, the folder itself and then its per-dataset subfolders
(``mnist/``, ``fashion-mnist/``, torchvision's ``MNIST/raw/`` ...) are tried.
Downloads go to the first writable of ``root``, ``$FEDFLAT_DATA`` and the cache.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DatasetNotFoundError", "RemoteFile", "REMOTE", "SUBFOLDERS", "SYSTEM_DIRS",
           "IDX_FILES", "base_dirs", "cache_dir", "cache_home", "candidate_dirs", "not_found", "writable_dir"]


class DatasetNotFoundError(FileNotFoundError):
    """A dataset's files are in none of the searched places: ``message`` says which and how to get them,
    ``searched`` lists the places."""

    def __init__(self, message: str, searched: list[Path] | None = None):
        super().__init__(message)
        self.searched = list(searched or [])


@dataclass(frozen=True)
class RemoteFile:
    """One official file: where to get it and its published checksum."""

    url: str
    filename: str
    checksum: str
    algorithm: str = "sha256"


_FMNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
_MNIST_URL = "https://ossci-datasets.s3.amazonaws.com/mnist/"  # torchvision's mirror of yann.lecun.com

# SHA-256 of the official .gz / .tar.gz files, as published alongside (and consistent with) the
# publishers' MD5s in many independent public projects (TFDS, Keras, torchvision-based loaders):
# Fashion-MNIST README MD5s 8d4fb7e6..., 25c81989..., bef4ecab..., bb300cfd... (train-images is
# 26,421,880 bytes); torchvision's MNIST MD5s f68b3c2d..., d53e105e..., 9fb629c4..., ec29112d...;
# CIFAR page MD5s c58f3010... (CIFAR-10), eb9058c3... (CIFAR-100).
# Debian's dataset-fashion-mnist ships the same IDX data recompressed (its train-images .gz is
# 26,421,856 bytes, sha256 b0564c3e...), so its digests differ from these; files found locally
# are read as they are and never checked against REMOTE, which is only used for downloads.
REMOTE: dict[str, tuple[RemoteFile, ...]] = {
    "fmnist": (
        RemoteFile(_FMNIST_URL + "train-images-idx3-ubyte.gz", "train-images-idx3-ubyte.gz",
                   "3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84"),
        RemoteFile(_FMNIST_URL + "train-labels-idx1-ubyte.gz", "train-labels-idx1-ubyte.gz",
                   "a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845"),
        RemoteFile(_FMNIST_URL + "t10k-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                   "346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073"),
        RemoteFile(_FMNIST_URL + "t10k-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte.gz",
                   "67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5"),
    ),
    "mnist": (
        RemoteFile(_MNIST_URL + "train-images-idx3-ubyte.gz", "train-images-idx3-ubyte.gz",
                   "440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609"),
        RemoteFile(_MNIST_URL + "train-labels-idx1-ubyte.gz", "train-labels-idx1-ubyte.gz",
                   "3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c"),
        RemoteFile(_MNIST_URL + "t10k-images-idx3-ubyte.gz", "t10k-images-idx3-ubyte.gz",
                   "8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6"),
        RemoteFile(_MNIST_URL + "t10k-labels-idx1-ubyte.gz", "t10k-labels-idx1-ubyte.gz",
                   "f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6"),
    ),
    "cifar10": (
        RemoteFile("https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz", "cifar-10-python.tar.gz",
                   "6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce"),
    ),
    "cifar100": (
        RemoteFile("https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz", "cifar-100-python.tar.gz",
                   "85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7"),
    ),
}

# IDX file stems, in the order train images, train labels, test images, test labels.
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

# Subfolders tried inside each base folder; the first one is where downloads go.
SUBFOLDERS: dict[str, tuple[str, ...]] = {
    "mnist": ("mnist", "MNIST", "MNIST/raw"),
    "fmnist": ("fashion-mnist", "fmnist", "FashionMNIST", "FashionMNIST/raw"),
    "cifar10": ("cifar10", "CIFAR10"),
    "cifar100": ("cifar100", "CIFAR100"),
}

SYSTEM_DIRS: dict[str, tuple[Path, ...]] = {
    "fmnist": (Path("/usr/share/datasets/fashion-mnist"),),
}


def cache_dir() -> Path:
    """The download cache: ``$XDG_CACHE_HOME/fedflat/data`` (default ``~/.cache/fedflat/data``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "fedflat" / "data"


def cache_home(folder: Path, name: str) -> Path:
    """Where what fedflat derives from ``folder``'s files (decoded images, encoded text) is cached:
    ``folder/.fedflat-cache``, or ``cache_dir()/name`` when ``folder`` is read-only."""
    return folder / ".fedflat-cache" if os.access(folder, os.W_OK) else cache_dir() / name


def not_found(what: str, searched: list[Path], advice: str) -> DatasetNotFoundError:
    """The error for a dataset found in none of ``searched``: ``what`` (its name and what was missing), every
    place searched in order, and ``advice`` on how to get it."""
    places = "\n".join(f"  - {p}" for p in searched)
    return DatasetNotFoundError(f"{what}. Searched, in order:\n{places}\nTo get it: {advice}", searched)


def base_dirs(root: str | Path | None) -> list[Path]:
    """Base folders in search order: ``root``, each ``$FEDFLAT_DATA`` entry, the cache."""
    bases = [Path(root).expanduser()] if root else []
    env = os.environ.get("FEDFLAT_DATA", "")
    bases += [Path(p).expanduser() for p in env.split(os.pathsep) if p]
    bases.append(cache_dir())
    unique: list[Path] = []
    for base in bases:
        if base not in unique:
            unique.append(base)
    return unique


def candidate_dirs(name: str, root: str | Path | None) -> list[Path]:
    """Every folder searched for dataset ``name``, in order."""
    dirs: list[Path] = []
    for base in base_dirs(root):
        dirs += [base] + [base / sub for sub in SUBFOLDERS.get(name, ())]
    return dirs + list(SYSTEM_DIRS.get(name, ()))


def writable_dir(root: str | Path | None) -> Path:
    """The first base folder (``root``, ``$FEDFLAT_DATA``, cache) that exists or could be made, and is writable.
    Nothing is created here: the download makes the folders it needs, and removes them if it fails."""
    tried = []
    for base in base_dirs(root):
        existing = base
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
            return base
        tried.append(base)
    raise PermissionError("no writable folder to download into; tried: " + ", ".join(map(str, tried)))
