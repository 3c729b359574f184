"""Tiny-ImageNet-200 (Le & Yang, 2015; FedFFT's third benchmark, seed 004) from its official layout.

``tiny-imagenet-200/``: ``wnids.txt`` (the 200 classes, in label order), ``train/<wnid>/images/*.JPEG``
(500 per class) and ``val/images/*.JPEG`` with ``val/val_annotations.txt`` (``file<TAB>wnid<TAB>box``),
which serves as the test split (the official test split has no labels); or the official
``tiny-imagenet-200.zip``, extracted next to itself (or into fedflat's cache when that folder is
read-only) through a temporary folder renamed at the end.

Decoding 110,000 JPEGs is slow, so each split is decoded once into a uint8 ``[N, 3, 64, 64]`` array cached
as ``.npy`` (memory-mapped when read; written to a temporary file and renamed, so an interrupted or failed
decode leaves no cache), keyed by the image files' count, total size and latest modification time.
Training uses CIFAR's augmentation (pad 4, random crop, horizontal flip), as FedFFT follows its CIFAR setup.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np

from .dataset import Dataset, DatasetError, to_tensors
from .sources import DatasetNotFoundError, base_dirs, cache_dir

FOLDER = "tiny-imagenet-200"
SIZE = 64


def find_tiny_imagenet(root: str | Path | None) -> Path:
    """The extracted ``tiny-imagenet-200`` folder (its zip is extracted first) under the first base folder
    (``root``, ``$FEDFLAT_DATA``, the cache) that holds one."""
    searched = []
    for base in base_dirs(root):
        for folder in (base / FOLDER, base / "tiny-imagenet" / FOLDER, base):
            searched.append(folder)
            if (folder / "wnids.txt").is_file() and (folder / "train").is_dir() and (folder / "val").is_dir():
                return folder
        archive = base / f"{FOLDER}.zip"
        searched.append(archive)
        if archive.is_file():
            return _extract(archive)
    places = "\n".join(f"  - {p}" for p in searched)
    raise DatasetNotFoundError(
        f"Tiny-ImageNet-200 ('tinyimagenet') not found. Searched, in order:\n{places}\nTo get it: put the official "
        f"{FOLDER}.zip (http://cs231n.stanford.edu/{FOLDER}.zip) or its extracted folder into one of these folders "
        "(data.root or $FEDFLAT_DATA)", searched)


def _extract(archive: Path) -> Path:
    home = archive.parent if os.access(archive.parent, os.W_OK) else cache_dir() / "tiny-imagenet"
    target = home / FOLDER
    if (target / "wnids.txt").is_file():
        return target
    partial = home / f".{FOLDER}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with zipfile.ZipFile(archive) as z:
            for member in z.namelist():  # no absolute paths or '..' out of the folder
                if member.startswith("/") or ".." in Path(member).parts:
                    raise DatasetError(f"{archive}: unsafe member path {member!r}")
            z.extractall(partial)
    except zipfile.BadZipFile as err:
        shutil.rmtree(partial, ignore_errors=True)
        raise DatasetError(f"{archive}: not a readable zip file ({err}); download it again") from None
    inner = partial / FOLDER if (partial / FOLDER).is_dir() else partial
    os.replace(inner, target)
    shutil.rmtree(partial, ignore_errors=True)
    return target


def _split_files(folder: Path, split: str, classes: dict[str, int]) -> tuple[list[Path], np.ndarray]:
    if split == "train":
        files = sorted(folder.glob("train/*/images/*.JPEG"))
        labels = [classes.get(f.parent.parent.name, -1) for f in files]
        unknown = [f for f, k in zip(files, labels) if k < 0]
        if unknown:
            raise DatasetError(f"{unknown[0]}: its class folder is not in wnids.txt")
        return files, np.asarray(labels, dtype=np.int64)
    annotations = folder / "val" / "val_annotations.txt"
    if not annotations.is_file():
        raise DatasetError(f"{annotations} is missing: the validation labels are needed for the test split")
    files, labels = [], []
    for line_no, line in enumerate(annotations.read_text().splitlines(), start=1):
        parts = line.split("\t")
        if len(parts) < 2 or parts[1] not in classes:
            raise DatasetError(f"{annotations}, line {line_no}: expected 'file<TAB>wnid<TAB>box' with a known wnid")
        files.append(folder / "val" / "images" / parts[0])
        labels.append(classes[parts[1]])
    return files, np.asarray(labels, dtype=np.int64)


def decode(files: list[Path], out: np.ndarray) -> None:
    """Decodes ``files`` into ``out[i]`` (``[3, 64, 64]`` uint8; greyscale images become RGB); a missing or
    unreadable image is a :class:`DatasetError` naming it."""
    from PIL import Image, UnidentifiedImageError

    for i, path in enumerate(files):
        try:
            with Image.open(path) as image:
                rgb = image.convert("RGB")
                if rgb.size != (SIZE, SIZE):
                    rgb = rgb.resize((SIZE, SIZE), Image.BILINEAR)
                out[i] = np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
        except (OSError, UnidentifiedImageError) as err:
            raise DatasetError(f"{path}: not a readable image ({err}); replace it from the official archive") from None


def cached_split(folder: Path, split: str, classes: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """The split's uint8 images (memory-mapped) and labels, decoded on the first call and cached."""
    files, labels = _split_files(folder, split, classes)
    stats = [f.stat() for f in files if f.exists()]
    key = hashlib.sha256(repr((len(files), sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats),
                                                                          default=0))).encode()).hexdigest()[:16]
    home = folder / ".fedflat-cache" if os.access(folder, os.W_OK) else cache_dir() / "tiny-imagenet"
    path = home / f"{split}-{key}.npy"
    if not path.is_file():
        home.mkdir(parents=True, exist_ok=True)
        partial = home / f"{split}-{key}.partial.npy"
        images = np.lib.format.open_memmap(partial, mode="w+", dtype=np.uint8, shape=(len(files), 3, SIZE, SIZE))
        try:
            decode(files, images)
            images.flush()
        except BaseException:
            del images
            partial.unlink(missing_ok=True)
            raise
        del images
        os.replace(partial, path)
    return np.load(path, mmap_mode="r"), labels


def load_tiny_imagenet(root: str | Path | None = None, download: bool = False) -> Dataset:
    """Tiny-ImageNet-200: 100,000 training and 10,000 validation (= test) images ``[3, 64, 64]``, 200 classes."""
    if download:
        raise DatasetNotFoundError(f"fetch http://cs231n.stanford.edu/{FOLDER}.zip yourself and set data.root "
                                   "(data.download=false): fedflat holds no checksum for it", [])
    folder = find_tiny_imagenet(root)
    wnids = [w.strip() for w in (folder / "wnids.txt").read_text().split() if w.strip()]
    classes = {w: i for i, w in enumerate(wnids)}
    x_train, y_train = cached_split(folder, "train", classes)
    x_test, y_test = cached_split(folder, "val", classes)
    return to_tensors("tinyimagenet", x_train, y_train, x_test, y_test, len(wnids), scale=255.0,
                      augmentation="cifar", source=str(folder))
