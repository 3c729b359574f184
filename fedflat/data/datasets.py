"""Dataset loaders and the registry behind ``load_dataset`` and ``fedflat list``.

Every loader takes ``root`` and ``download`` plus its own keyword options and returns a
normalized :class:`~fedflat.data.dataset.Dataset` on the CPU. See :mod:`fedflat.data.sources`
for where files are searched and downloaded.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import replace
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from fedflat.core.registry import add, origin_of

from .dataset import Dataset, check_classes, select_classes, to_tensors
from .domains import load_domainnet, load_officehome
from .errors import DatasetError
from .images import load_tiny_imagenet
from .leaf import load_femnist, load_shakespeare
from .text import load_dbpedia
from .download import download_file, verify_file
from .readers import CIFAR_LAYOUT, extract_tar_safely, read_cifar_split, read_idx
from .sources import (IDX_FILES, REMOTE, SUBFOLDERS, DatasetNotFoundError, candidate_dirs,
                      writable_dir)

__all__ = ["DATASETS", "load_dataset", "load_digits", "load_mnist", "load_fmnist",
           "load_cifar10", "load_cifar100", "load_synthetic"]

log = logging.getLogger(__name__)

_DISPLAY = {"mnist": "MNIST", "fmnist": "Fashion-MNIST", "cifar10": "CIFAR-10", "cifar100": "CIFAR-100"}


# ----------------------------------------------------------------------------- finding files

def _idx_file(folder: Path, stem: str) -> Path | None:
    """The IDX file ``stem`` in ``folder`` in any usual spelling (``-idx3`` or ``.idx3``, ``.gz`` or not)."""
    dotted = stem.replace("-idx", ".idx", 1)
    for name in (stem + ".gz", stem, dotted + ".gz", dotted):
        if (folder / name).is_file():
            return folder / name
    return None


def _find_idx(name: str, folder: Path) -> list[Path] | None:
    """The four IDX files (train images, train labels, test images, test labels) if all are in ``folder``."""
    files = [_idx_file(folder, stem) for stem in IDX_FILES]
    return None if any(f is None for f in files) else files


def _find_cifar(name: str, folder: Path) -> Path | None:
    """The extracted CIFAR folder (preferred) or the official archive inside ``folder``."""
    top, train, test, _ = CIFAR_LAYOUT[name]
    if all((folder / top / member).is_file() for member in train + test):
        return folder / top
    archive = folder / REMOTE[name][0].filename
    return archive if archive.is_file() else None


def _not_found(name: str, root: str | Path | None, searched: list[Path]) -> DatasetNotFoundError:
    """The error for a missing dataset: every place searched and how to get the files."""
    wanted = ", ".join(f.filename for f in REMOTE[name])
    if name in ("mnist", "fmnist"):
        wanted += " (gzipped or not)"
    else:
        wanted = f"{wanted} or its extracted folder {CIFAR_LAYOUT[name][0]}/"
    ways = ["set download=True (config or command line: data.download=true) to fetch the official "
            "files, checksum-verified, into the first writable of root, $FEDFLAT_DATA, the cache"]
    if name == "fmnist":
        ways.append("on Debian/Ubuntu: apt-get install dataset-fashion-mnist")
    first = searched[0]
    ways.append(f"put {wanted} into one of the folders above, e.g. {first / SUBFOLDERS[name][0]} "
                "(choose the folder with the root argument, data.root, --data-dir or $FEDFLAT_DATA)")
    places = "\n".join(f"  - {p}" for p in searched)
    unset = [what for what, value in (("root", root), ("$FEDFLAT_DATA", os.environ.get("FEDFLAT_DATA")))
             if not value]
    if unset:
        places += f"\n  ({' and '.join(unset)} not set)"
    hints = "\n".join(f"  * {w}" for w in ways)
    return DatasetNotFoundError(f"{_DISPLAY[name]} ({name!r}) not found. Searched, in order:\n"
                                f"{places}\nTo get it:\n{hints}", searched)


def _locate(name: str, root: str | Path | None, download: bool, find: Callable) -> Any:
    """Search every candidate folder with ``find``; download into the first writable base if asked."""
    searched = candidate_dirs(name, root)
    for folder in searched:
        found = find(name, folder)
        if found is not None:
            log.info("%s: using %s", name, found)
            return found
    if not download:
        raise _not_found(name, root, searched)
    target = writable_dir(root) / SUBFOLDERS[name][0]
    for remote in REMOTE[name]:
        dest = target / remote.filename
        if not verify_file(dest, remote.checksum, remote.algorithm):
            download_file(remote.url, dest, remote.checksum, remote.algorithm)
    found = find(name, target)
    if found is None:  # the official files always contain what we look for
        raise DatasetNotFoundError(f"{name}: downloaded files in {target} are incomplete", [target])
    return found


# ----------------------------------------------------------------------------- loaders

def _load_idx_dataset(name: str, root: str | Path | None, download: bool) -> Dataset:
    files = _locate(name, root, download, _find_idx)
    x_train, y_train, x_test, y_test = (read_idx(f) for f in files)
    for images, labels, split in ((x_train, y_train, "train"), (x_test, y_test, "test")):
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise DatasetError(f"{name} {split} files in {files[0].parent}: images {images.shape} do not match "
                               f"labels {labels.shape}: delete them and download them again (data.download=true), "
                               "or copy the official files there")
    data = to_tensors(name, x_train[:, None], y_train, x_test[:, None], y_test, 10, scale=255.0,
                      source=str(files[0].parent))
    return replace(data, files=tuple(str(f) for f in files))


def load_mnist(root: str | Path | None = None, download: bool = False) -> Dataset:
    """MNIST handwritten digits from the IDX files: 60,000/10,000 images ``[1, 28, 28]``, 10 classes."""
    return _load_idx_dataset("mnist", root, download)


def load_fmnist(root: str | Path | None = None, download: bool = False) -> Dataset:
    """Fashion-MNIST from the IDX files: 60,000/10,000 images ``[1, 28, 28]``, 10 classes."""
    return _load_idx_dataset("fmnist", root, download)


def _load_cifar(name: str, root: str | Path | None, download: bool, num_classes: int) -> Dataset:
    location = _locate(name, root, download, _find_cifar)
    if location.is_file():
        location = _extract_cifar(name, location)
    x_train, y_train = read_cifar_split(location, name, train=True)
    x_test, y_test = read_cifar_split(location, name, train=False)
    data = to_tensors(name, x_train, y_train, x_test, y_test, num_classes, scale=255.0,
                      augmentation="cifar", source=str(location))
    return replace(data, files=(str(location),))


def _writable(folder: Path) -> bool:
    """Whether files can be created in ``folder``."""
    return os.access(folder, os.W_OK | os.X_OK)


def _extract_cifar(name: str, archive: Path) -> Path:
    """Extract the batches next to ``archive``; if that folder is read-only, read the archive itself."""
    if not _writable(archive.parent):
        log.info("%s: %s is read-only; reading the archive directly", name, archive.parent)
        return archive
    top, train, test, _ = CIFAR_LAYOUT[name]
    extract_tar_safely(archive, archive.parent, [f"{top}/{m}" for m in train + test])
    return archive.parent / top


def load_cifar10(root: str | Path | None = None, download: bool = False) -> Dataset:
    """CIFAR-10 from the python pickles (folder or tar.gz): 50,000/10,000 images ``[3, 32, 32]``, 10 classes."""
    return _load_cifar("cifar10", root, download, 10)


def load_cifar100(root: str | Path | None = None, download: bool = False) -> Dataset:
    """CIFAR-100 (fine labels) from the python pickles: 50,000/10,000 images ``[3, 32, 32]``, 100 classes."""
    return _load_cifar("cifar100", root, download, 100)


def load_digits(root: str | Path | None = None, download: bool = False) -> Dataset:
    """scikit-learn's 8x8 digits (1,797 images ``[1, 8, 8]``, 10 classes), embedded, no files needed.

    Pixels (0..16) are divided by 16, then standardized with the train split's mean and std.
    The train/test split is fixed and independent of any experiment seed: per class, a
    ``numpy.random.default_rng(0)`` permutation puts ``round(0.2 * n_class)`` samples in the
    test split and the rest in train (1,438 train / 359 test).
    """
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    images, labels = bunch.images.astype(np.float32), bunch.target.astype(np.int64)
    rng = np.random.default_rng(0)
    test = np.zeros(len(labels), dtype=bool)
    for k in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == k))
        test[members[: int(round(0.2 * len(members)))]] = True
    return to_tensors("digits", images[~test, None], labels[~test], images[test, None], labels[test],
                      10, scale=16.0, source="sklearn.datasets.load_digits")


def load_synthetic(root: str | Path | None = None, download: bool = False, *,
                   shape: Sequence[int] = (1, 28, 28), num_classes: int = 10, train_size: int = 6000,
                   test_size: int = 1000, seed: int = 0, noise: float = 1.0, domains: int = 0,
                   tokens: int = 0) -> Dataset:
    """Seeded class-conditional Gaussian data of any ``shape``, for tests and benchmarks.

    Each class ``k`` has a mean pattern ``mu_k ~ N(0, 1)`` of the given shape; a sample is
    ``mu_k + noise * N(0, 1)``. Labels are balanced (as equal as the sizes allow) and shuffled.
    Train and test are drawn from the same distribution; the result depends only on the options.

    ``domains > 0`` gives the shape of a leave-one-domain-out benchmark: domain ``d`` adds its own style pattern
    ``s_d ~ N(0, 0.25)`` to every sample, training sample ``j`` is in domain ``j mod domains`` (its owner, for the
    ``domain`` partition) and the test set is one further, unseen domain.

    ``tokens > 0`` gives text-shaped data for ``textcnn`` and ``lstm``: int64 token ids in ``[0, tokens)`` of
    ``shape`` (a sequence length), drawn i.i.d. from a class-specific distribution ``~ Dir(0.5)`` over the tokens.
    """
    shape = _check_synthetic(shape, num_classes, train_size, test_size, noise)
    if isinstance(domains, bool) or not isinstance(domains, int) or domains < 0:
        raise ValueError(f"synthetic: domains must be an int >= 0, got {domains!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0 or (tokens and domains):
        raise ValueError(f"synthetic: tokens must be an int >= 0 (and not combined with domains), got {tokens!r}")
    rng = np.random.default_rng(seed)
    if tokens:
        return _synthetic_tokens(rng, shape, num_classes, train_size, test_size, tokens)
    means = rng.standard_normal((num_classes, *shape), dtype=np.float32)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.permutation(np.arange(n) % num_classes).astype(np.int64)
        x = means[labels] + np.float32(noise) * rng.standard_normal((n, *shape), dtype=np.float32)
        return x, labels

    (x_train, y_train), (x_test, y_test) = draw(train_size), draw(test_size)
    source = f"synthetic(shape={shape}, num_classes={num_classes}, seed={seed}, noise={noise}, domains={domains})"
    if not domains:
        return to_tensors("synthetic", x_train, y_train, x_test, y_test, num_classes, source=source)
    styles = np.float32(0.5) * rng.standard_normal((domains + 1, *shape), dtype=np.float32)
    owners = np.arange(train_size) % domains
    data = to_tensors("synthetic", x_train + styles[owners], y_train, x_test + styles[domains], y_test, num_classes,
                      source=source)
    return replace(data, owners=owners.astype(np.int64), owner_names=[f"domain{d}" for d in range(domains)])


def _synthetic_tokens(rng: np.random.Generator, shape: tuple[int, ...], num_classes: int, train_size: int,
                      test_size: int, tokens: int) -> Dataset:
    """Class-conditional i.i.d. token sequences (see :func:`load_synthetic`)."""
    emission = rng.dirichlet(np.full(tokens, 0.5), size=num_classes)
    cumulative = np.cumsum(emission, axis=1)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.permutation(np.arange(n) % num_classes).astype(np.int64)
        u = rng.random((n, int(np.prod(shape))))
        ids = np.empty(u.shape, dtype=np.int64)
        for k in range(num_classes):  # the number of cumulative probabilities below u (no [n, L, tokens] array)
            rows = labels == k
            ids[rows] = np.searchsorted(cumulative[k], u[rows], side="left")
        ids = np.minimum(ids, tokens - 1)
        return ids.reshape(n, *shape).astype(np.int64), labels

    (x_train, y_train), (x_test, y_test) = draw(train_size), draw(test_size)
    return Dataset("synthetic", x_train, y_train, x_test, y_test, num_classes,
                   source=f"synthetic(shape={shape}, num_classes={num_classes}, tokens={tokens})")


def _check_synthetic(shape: Sequence[int], num_classes: int, train_size: int, test_size: int,
                     noise: float) -> tuple[int, ...]:
    """Validate the synthetic options; return ``shape`` as a tuple of ints."""
    if isinstance(shape, int):
        shape = (shape,)
    if not all(isinstance(s, (int, np.integer)) and s > 0 for s in shape) or len(shape) == 0:
        raise ValueError(f"synthetic: shape must be a non-empty sequence of positive ints, got {shape!r}")
    for key, value, low in (("num_classes", num_classes, 2), ("train_size", train_size, 1),
                            ("test_size", test_size, 1)):
        if not isinstance(value, (int, np.integer)) or value < low:
            raise ValueError(f"synthetic: {key} must be an int >= {low}, got {value!r}")
    if not noise >= 0:
        raise ValueError(f"synthetic: noise must be >= 0, got {noise!r}")
    return tuple(int(s) for s in shape)


# ----------------------------------------------------------------------------- registry

DATASETS: dict[str, tuple[Callable[..., Dataset], str]] = {
    "digits": (load_digits, "scikit-learn 8x8 digits, 1,438/359 images [1,8,8], 10 classes; embedded, no download"),
    "mnist": (load_mnist, "MNIST digits, 60,000/10,000 images [1,28,28], 10 classes (IDX files)"),
    "fmnist": (load_fmnist, "Fashion-MNIST, 60,000/10,000 images [1,28,28], 10 classes (IDX files)"),
    "cifar10": (load_cifar10, "CIFAR-10, 50,000/10,000 images [3,32,32], 10 classes, crop+flip augmentation"),
    "cifar100": (load_cifar100, "CIFAR-100 (fine labels), 50,000/10,000 images [3,32,32], 100 classes, crop+flip"),
    "tinyimagenet": (load_tiny_imagenet, "Tiny-ImageNet-200, 100,000/10,000 (val) images [3,64,64], 200 classes, "
                                         "crop+flip; the official folder or zip, decoded once to a uint8 cache"),
    "officehome": (load_officehome, "OfficeHome, 65 classes in 4 domains (art, clipart, product, real_world), "
                                    "leave-one-domain-out (option test_domain; partition domain), [3,size,size] "
                                    "(size=224), flip; the official folder or zip, decoded once to a uint8 cache"),
    "domainnet": (load_domainnet, "DomainNet, 345 classes in 6 domains (clipart, infograph, painting, quickdraw, "
                                  "real, sketch), leave-one-domain-out (options test_domain, split=official|all; "
                                  "partition domain), [3,size,size] (size=224), flip; uint8 cache"),
    "femnist": (load_femnist, "LEAF FEMNIST, 28x28 characters of 3,500 writers, 62 classes, natural split by writer "
                              "(LEAF's JSON; partition natural)"),
    "shakespeare": (load_shakespeare, "LEAF Shakespeare, 80-character windows -> next character (80 symbols), natural "
                                      "split by role (LEAF's JSON; model lstm)"),
    "dbpedia": (load_dbpedia, "DBpedia-14 (dbpedia_csv), 14 classes, token ids [128] for textcnn; FedVSSAM's "
                              "balanced 10,000/1,000 per class, vocabulary 30,000 from the training split (cached)"),
    "synthetic": (load_synthetic, "seeded Gaussian class clusters of any shape/size (options: shape, "
                                  "num_classes, train_size, test_size, seed, noise, domains: styled domains, the "
                                  "test set an unseen one; tokens: int64 token sequences for text models)"),
}


GENERIC_OPTIONS = {"classes": None}  # what every dataset takes, applied after its loader (load_dataset)


def register_dataset(name: str, loader: Callable[..., Dataset], description: str) -> Callable[..., Dataset]:
    """Makes ``loader(root=None, download=False, **options) -> Dataset`` available as ``data.name: NAME``, its
    keyword options as ``data.options`` (a plugin's dataset, docs/extending.md); a name taken by another module is
    an error naming both. ``description`` is its line in ``fedflat list``. ``classes`` is every dataset's own option
    (:func:`load_dataset`): a loader may not take it."""
    taken = sorted(set(inspect.signature(loader).parameters) & set(GENERIC_OPTIONS))
    if taken:
        raise ValueError(f"dataset {name!r}: its loader takes {', '.join(taken)}, which fedflat applies to every "
                         "dataset after its loader (data.options.classes selects classes); rename the parameter")
    add(DATASETS, "dataset", name, (loader, description), origin=origin_of(loader))
    return loader


def dataset_options(name: str) -> dict[str, object]:
    """The options dataset ``name`` accepts, with their defaults: its loader's, and ``classes``."""
    loader = DATASETS[name][0]
    params = inspect.signature(loader).parameters
    return {**{k: p.default for k, p in params.items() if k not in ("root", "download")}, **GENERIC_OPTIONS}


def load_dataset(name: str, root: str | Path | None = None, download: bool = False, **options) -> Dataset:
    """Load dataset ``name`` (a key of :data:`DATASETS`) on the CPU.

    ``root`` is searched first for the files, then ``$FEDFLAT_DATA``, the download cache and
    system folders; with ``download=True`` missing files are fetched and checksum-verified.
    ``options`` go to the loader; an unknown one raises ``ValueError`` listing the valid ones. ``classes`` (every
    dataset): keep the samples of these class ids alone, relabelled ``0 .. k-1`` in the order given
    (:func:`fedflat.data.dataset.select_classes`).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)}")
    valid = dataset_options(name)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        allowed = ", ".join(valid) if valid else "none"
        raise ValueError(f"dataset {name!r}: unknown option(s) {', '.join(unknown)}; valid options: {allowed}")
    if root not in (None, "") and not download and not Path(root).expanduser().is_dir():
        what = "is a file, not a folder" if Path(root).expanduser().exists() else "does not exist"
        raise DatasetNotFoundError(f"data folder {root} (data.root, --data-dir) {what}: give the folder that holds "
                                   f"the {name} files, or leave it out to search $FEDFLAT_DATA and the cache",
                                   [Path(root)])
    classes = options.pop("classes", None)
    if classes is not None:
        classes = check_classes(classes)  # (before the files are read: a bad list costs no load)
    data = DATASETS[name][0](root=root, download=download, **options)
    return data if classes is None else select_classes(data, classes)
