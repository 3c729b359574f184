"""Tiny-ImageNet-200 (Le & Yang, 2015; FedFFT's third benchmark, seed 004) from its official layout.

``tiny-imagenet-200/``: ``wnids.txt`` (the 200 classes, in label order), ``train/<wnid>/images/*.JPEG``
(500 per class) and ``val/images/*.JPEG`` with ``val/val_annotations.txt`` (``file<TAB>wnid<TAB>box``),
which serves as the test split (the official test split has no labels); or the official
``tiny-imagenet-200.zip``, extracted next to itself (or into fedflat's cache when that folder is
read-only) through a temporary folder renamed at the end.

Decoding 110,000 JPEGs is slow, so each split is decoded once into a uint8 ``[N, 3, 64, 64]`` array cached
as ``.npy`` (memory-mapped when read; written to a temporary file and renamed, so an interrupted or failed
decode leaves no cache), keyed by the image files' names, sizes and modification times. The dataset keeps the
pixels uint8 and standardizes each batch (:class:`~fedflat.data.dataset.Standardize`): 1.2 GiB for the training
split instead of 4.9 GiB of float32, on the host or the GPU. The decoding helpers here serve the domain
benchmarks too (:mod:`fedflat.data.domains`).
Training uses CIFAR's augmentation (pad 4, random crop, horizontal flip), as FedFFT follows its CIFAR setup.
"""
from __future__ import annotations

import hashlib
import logging
import os
import time
import shutil
import zipfile
from pathlib import Path

import numpy as np

from .dataset import Dataset, DatasetError, pixel_moments, uint8_dataset
from .npy import write_npy
from .sources import DatasetNotFoundError, base_dirs, cache_dir, cache_home, not_found

log = logging.getLogger(__name__)

FOLDER = "tiny-imagenet-200"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp")
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
    raise not_found("Tiny-ImageNet-200 ('tinyimagenet') not found", searched,
                    f"put the official {FOLDER}.zip (http://cs231n.stanford.edu/{FOLDER}.zip) or its extracted folder "
                    "into one of these folders (data.root or $FEDFLAT_DATA)")


def _extract(archive: Path) -> Path:
    return extract_zip(archive, FOLDER, "wnids.txt")


def extract_zip(archive: Path, folder: str, marker: str) -> Path:
    """``archive``'s top folder ``folder`` extracted next to it (into fedflat's cache when that folder is
    read-only), through a temporary folder renamed at the end; skipped when ``folder/marker`` exists."""
    home = archive.parent if os.access(archive.parent, os.W_OK) else cache_dir() / folder
    target = home / folder
    if (target / marker).exists():
        return target
    partial = home / f".{folder}.partial"
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
    inner = partial / folder if (partial / folder).is_dir() else partial
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
    """Decodes ``files`` into ``out[i]`` (uint8 ``[3, S, S]``, resized to ``S x S`` bilinearly where they differ;
    greyscale and palette images become RGB); a missing or unreadable image is a :class:`DatasetError` naming it.
    A large JPEG is decoded at a reduced scale first (Pillow's ``draft``: the DCT does the shrinking)."""
    from PIL import Image, UnidentifiedImageError

    size = out.shape[-1]
    for i, path in enumerate(files):
        try:
            with Image.open(path) as image:
                image.draft("RGB", (size, size))
                rgb = image.convert("RGB")
                if rgb.size != (size, size):
                    rgb = rgb.resize((size, size), Image.BILINEAR)
                out[i] = np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
        except (OSError, UnidentifiedImageError) as err:
            raise DatasetError(f"{path}: not a readable image ({err}); replace it from the official archive") from None


def cached_images(files: list[Path], home: Path, stem: str, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The images ``files`` as one uint8 ``[N, 3, size, size]`` array memory-mapped from ``home/stem-KEY.npy``,
    and each image's per-channel pixel moments ``[N, 2, 3]`` (sums of ``x/255`` and of its square, float64) from
    ``stem-KEY.moments.npy``, so the standardization of any set of images costs no pass over the pixels.
    Decoded on the first call into temporary files renamed at the end (an interrupted or failed decode leaves no
    cache). KEY digests the files' names, sizes and modification times and ``size``: a changed file or another
    size decodes anew."""
    key = hashlib.sha256(repr((size, [(str(f), *_size_and_time(f)) for f in files])).encode()).hexdigest()[:16]
    path, moments_path = home / f"{stem}-{key}.npy", home / f"{stem}-{key}.moments.npy"
    if not (path.is_file() and moments_path.is_file()):
        home.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()

        def fill(images: np.ndarray) -> None:
            decode(files, images)
            atomic_save(moments_path, pixel_moments(images))

        write_npy(path, np.uint8, (len(files), 3, size, size), fill)
        log.info("decoded %d images into %s in %.1f s (later loads map it)", len(files), path,
                 time.perf_counter() - started)
    return np.load(path, mmap_mode="r"), np.load(moments_path)


def concatenated_cache(parts: list[np.ndarray], home: Path, stem: str, chunk: int = 1024) -> np.ndarray:
    """``np.concatenate(parts)`` as a memory-mapped ``home/stem-KEY.npy`` instead of an array in memory: cached
    uint8 images (memory maps of :func:`cached_images`) stay on disk, paged in as batches need them. Written a
    chunk at a time through a temporary file renamed at the end; KEY digests the parts' files and shapes, so a
    changed part writes anew. One part is returned as it is; parts that are not all memory maps are joined in
    memory."""
    if len(parts) == 1:
        return parts[0]
    files = [getattr(p, "filename", None) for p in parts]
    if None in files:
        return np.concatenate(parts)
    key = hashlib.sha256(repr([(f, p.shape, *_size_and_time(Path(f))) for f, p in zip(files, parts)]).encode())
    key = key.hexdigest()[:16]
    path = home / f"{stem}-{key}.npy"
    if path.is_file():
        return np.load(path, mmap_mode="r")
    home.mkdir(parents=True, exist_ok=True)

    def fill(out: np.ndarray) -> None:
        row = 0
        for part in parts:
            for lo in range(0, len(part), chunk):
                block = part[lo:lo + chunk]
                out[row:row + len(block)] = block
                row += len(block)

    return write_npy(path, parts[0].dtype, (sum(len(p) for p in parts), *parts[0].shape[1:]), fill)


def _size_and_time(path: Path) -> tuple[int, int]:
    """``path``'s size and modification time (``(-1, 0)`` when it is missing: the decode then names it)."""
    try:
        stat = path.stat()
    except FileNotFoundError:
        return -1, 0
    return stat.st_size, stat.st_mtime_ns


def atomic_save(path: Path, array: np.ndarray) -> None:
    """``np.save`` through a temporary file renamed onto ``path``."""
    partial = path.with_name(path.name + ".partial.npy")
    np.save(partial, array)
    os.replace(partial, path)


def cached_split(folder: Path, split: str, classes: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The split's uint8 images (memory-mapped), their moments and labels, decoded on the first call and cached."""
    files, labels = _split_files(folder, split, classes)
    images, moments = cached_images(files, cache_home(folder, "tiny-imagenet"), split, SIZE)
    return images, moments, labels


def load_tiny_imagenet(root: str | Path | None = None, download: bool = False) -> Dataset:
    """Tiny-ImageNet-200: 100,000 training and 10,000 validation (= test) images ``[3, 64, 64]``, 200 classes."""
    if download:
        raise DatasetNotFoundError(f"fetch http://cs231n.stanford.edu/{FOLDER}.zip yourself and set data.root "
                                   "(data.download=false): fedflat holds no checksum for it", [])
    folder = find_tiny_imagenet(root)
    wnids = [w.strip() for w in (folder / "wnids.txt").read_text().split() if w.strip()]
    classes = {w: i for i, w in enumerate(wnids)}
    x_train, moments, y_train = cached_split(folder, "train", classes)
    x_test, _, y_test = cached_split(folder, "val", classes)
    return uint8_dataset("tinyimagenet", x_train, y_train, x_test, y_test, len(wnids), augmentation="cifar",
                         source=str(folder), moments=moments)
