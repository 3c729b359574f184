"""The domain-shift benchmarks of FedLESAM (seed 002, Table 3) and FedWMSAM (seed 001, Table 2).

**OfficeHome** (Venkateswara et al., CVPR 2017): 15,588 images of 65 classes in 4 domains, the official
``OfficeHomeDataset_10072016/<Domain>/<Class>/*.jpg`` (domains ``Art``, ``Clipart``, ``Product``,
``Real World``) or its zip. It has no official train/test split: every image of a domain is used.

**DomainNet** (Peng et al., ICCV 2019): 586,575 images of 345 classes in 6 domains, the official folders
``<domain>/<class>/*.jpg`` with the split lists ``<domain>_train.txt`` / ``<domain>_test.txt`` (lines
``clipart/aircraft_carrier/clipart_001_000001.jpg 0``) side by side. ``split="official"`` (default) trains on
the training domains' train lists and tests on the target domain's test list; ``split="all"`` uses both lists
everywhere.

**Leave-one-domain-out** (both seeds): the ``test_domain`` is the test set, every other domain is training data,
and each training sample's domain is its owner (:attr:`Dataset.owners`), so the ``domain`` partition makes
``per_domain`` clients of each training domain — FedLESAM's "each training domain divided into 1 client (100%
active) or 10 clients (20% active)"; FedWMSAM's OfficeHome setting is 1 client per domain with a 10% sample rate
(``fraction=0.1``). Images are resized to ``size x size`` (224 for ViT-B/32 and ResNet-50), decoded once per
domain into a uint8 cache (:func:`fedflat.data.images.cached_images`) and kept uint8, standardized per batch.
Training batches are flipped horizontally at random (augmentation ``flip``).

Memory at 224: OfficeHome 2.3 GB of uint8 pixels; DomainNet's training domains about 60 GB. On the CPU they stay
memory-mapped from the cache (the training domains joined into one more cached file: disk, not memory), so a
machine with less memory pages them in as batches need them; on a GPU they are copied to its memory (an H200's
holds DomainNet at 224; ``size=112``, a quarter, suits smaller ones).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .dataset import Dataset, DatasetError, uint8_dataset
from .images import IMAGE_SUFFIXES, cached_images, concatenated_cache, extract_zip
from .sources import DatasetNotFoundError, base_dirs, cache_home, not_found

OFFICEHOME_DOMAINS = {"art": "Art", "clipart": "Clipart", "product": "Product", "real_world": "Real World"}
OFFICEHOME_FOLDER = "OfficeHomeDataset_10072016"
DOMAINNET_DOMAINS = ("clipart", "infograph", "painting", "quickdraw", "real", "sketch")


def _check_options(name: str, domains, test_domain: str, size: int) -> list[str]:
    """The training domains (every domain but ``test_domain``), after checking the options."""
    if test_domain not in domains:
        raise DatasetError(f"{name}: test_domain must be one of {', '.join(domains)}, got {test_domain!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < 8:
        raise DatasetError(f"{name}: size must be an int >= 8 (pixels per side), got {size!r}")
    return [d for d in domains if d != test_domain]


def _domain_dataset(name: str, parts: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]], train: list[str],
                    test_domain: str, num_classes: int, source: Path, home: Path, size: int) -> Dataset:
    """Leave-one-domain-out: ``parts[domain] = (images, moments, labels)``; the training domains' images in
    their order, owners = the domain's position in ``train``. The images stay memory-mapped: the training
    domains' are joined into one cached file in ``home`` (paged from disk, never held whole in memory)."""
    x_train = concatenated_cache([parts[d][0] for d in train], home, f"train-{'-'.join(train)}-{size}")
    moments = np.concatenate([parts[d][1] for d in train])
    y_train = np.concatenate([parts[d][2] for d in train])
    owners = np.concatenate([np.full(len(parts[d][2]), k, dtype=np.int64) for k, d in enumerate(train)])
    x_test, _, y_test = parts[test_domain]
    return uint8_dataset(name, x_train, y_train, x_test, y_test, num_classes,
                         augmentation="flip", source=f"{source} (test domain {test_domain})", moments=moments,
                         owners=owners, owner_names=list(train))


# ----------------------------------------------------------------------------- OfficeHome

def find_officehome(root: str | Path | None) -> Path:
    """The folder holding OfficeHome's four domain folders (its zip is extracted first)."""
    searched = []
    for base in base_dirs(root):
        for folder in (base / OFFICEHOME_FOLDER, base / "OfficeHome", base / "officehome", base):
            searched.append(folder)
            if all(_officehome_domain(folder, d) is not None for d in OFFICEHOME_DOMAINS):
                return folder
        archive = base / f"{OFFICEHOME_FOLDER}.zip"
        searched.append(archive)
        if archive.is_file():
            return extract_zip(archive, OFFICEHOME_FOLDER, "Art")
    raise not_found("OfficeHome ('officehome') not found", searched,
                    f"put the official {OFFICEHOME_FOLDER}.zip (https://www.hemanthdv.org/officeHomeDataset.html) or "
                    "its extracted folder, with the domain folders Art, Clipart, Product and Real World, into one of "
                    "these folders (data.root or $FEDFLAT_DATA)")


def _officehome_domain(folder: Path, domain: str) -> Path | None:
    """A domain's folder, spelled as the official archive does (``Real World``) or with ``_``."""
    for name in (OFFICEHOME_DOMAINS[domain], OFFICEHOME_DOMAINS[domain].replace(" ", "_"), domain):
        if (folder / name).is_dir():
            return folder / name
    return None


def load_officehome(root: str | Path | None = None, download: bool = False, *, test_domain: str = "art",
                    size: int = 224) -> Dataset:
    """OfficeHome, leave-one-domain-out: the three other domains train, ``test_domain`` (art, clipart, product,
    real_world) tests; 65 classes (class folders in sorted order), images ``[3, size, size]``."""
    if download:
        raise DatasetNotFoundError("OfficeHome cannot be downloaded by fedflat (its site asks for a form): fetch "
                                   f"{OFFICEHOME_FOLDER}.zip yourself and set data.root (data.download=false)", [])
    train = _check_options("officehome", list(OFFICEHOME_DOMAINS), test_domain, size)
    folder = find_officehome(root)
    domain_dirs = {d: _officehome_domain(folder, d) for d in OFFICEHOME_DOMAINS}
    classes = sorted({c.name for path in domain_dirs.values() for c in path.iterdir() if c.is_dir()})
    index = {c: k for k, c in enumerate(classes)}
    parts = {}
    for domain, path in domain_dirs.items():
        files = sorted(f for f in path.glob("*/*") if f.suffix.lower() in IMAGE_SUFFIXES)
        if not files:
            raise DatasetError(f"{path}: no images (expected {path}/<Class>/*.jpg)")
        labels = np.asarray([index[f.parent.name] for f in files], dtype=np.int64)
        images, moments = cached_images(files, cache_home(folder, "officehome"), f"{domain}-{size}", size)
        parts[domain] = (images, moments, labels)
    return _domain_dataset("officehome", parts, train, test_domain, len(classes), folder,
                           cache_home(folder, "officehome"), size)


# ----------------------------------------------------------------------------- DomainNet

def find_domainnet(root: str | Path | None) -> Path:
    """The folder holding DomainNet's domain folders and their ``<domain>_train.txt`` / ``_test.txt`` lists."""
    searched = []
    for base in base_dirs(root):
        for folder in (base / "domainnet", base / "DomainNet", base):
            searched.append(folder)
            if all((folder / d).is_dir() and (folder / f"{d}_train.txt").is_file() for d in DOMAINNET_DOMAINS):
                return folder
    raise not_found("DomainNet ('domainnet') not found", searched,
                    "from http://ai.bu.edu/M3SDA/ extract each domain's zip (clipart.zip ... sketch.zip) and put its "
                    "split lists (clipart_train.txt, clipart_test.txt, ...) beside the domain folders, in one of "
                    "these folders (data.root or $FEDFLAT_DATA)")


def read_split_list(path: Path, folder: Path) -> tuple[list[Path], np.ndarray]:
    """A DomainNet split list: ``relative/path.jpg label`` per line -> image paths and labels."""
    if not path.is_file():
        raise DatasetError(f"{path} is missing: DomainNet's split lists come with the dataset (see its site)")
    files, labels = [], []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        parts = line.rsplit(maxsplit=1)
        if len(parts) != 2 or not parts[1].isdigit():
            raise DatasetError(f"{path}, line {line_no}: expected 'domain/class/file.jpg <label>', got {line!r}")
        files.append(folder / parts[0])
        labels.append(int(parts[1]))
    return files, np.asarray(labels, dtype=np.int64)


def load_domainnet(root: str | Path | None = None, download: bool = False, *, test_domain: str = "clipart",
                   size: int = 224, split: str = "official") -> Dataset:
    """DomainNet, leave-one-domain-out over clipart, infograph, painting, quickdraw, real, sketch; 345 classes
    (labels from the split lists), images ``[3, size, size]``. ``split``: ``official`` (train lists train, the
    target's test list tests) or ``all`` (both lists of every domain)."""
    if download:
        raise DatasetNotFoundError("DomainNet is ~20 GB of zips: fetch them from http://ai.bu.edu/M3SDA/ yourself "
                                   "and set data.root (data.download=false)", [])
    train = _check_options("domainnet", list(DOMAINNET_DOMAINS), test_domain, size)
    if split not in ("official", "all"):
        raise DatasetError(f"domainnet: split must be 'official' or 'all', got {split!r}")
    folder = find_domainnet(root)
    parts = {}
    for domain in DOMAINNET_DOMAINS:
        lists = ["train", "test"] if split == "all" else ["test" if domain == test_domain else "train"]
        read = [read_split_list(folder / f"{domain}_{which}.txt", folder) for which in lists]
        files = [f for fs, _ in read for f in fs]
        labels = np.concatenate([ls for _, ls in read])
        images, moments = cached_images(files, cache_home(folder, "domainnet"), f"{domain}-{'-'.join(lists)}-{size}",
                                        size)
        parts[domain] = (images, moments, labels)
    num_classes = 1 + max(int(p[2].max()) for p in parts.values() if len(p[2]))
    return _domain_dataset("domainnet", parts, train, test_domain, max(num_classes, 2), folder,
                           cache_home(folder, "domainnet"), size)
