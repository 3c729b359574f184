"""Data from where researchers keep it: torch datasets (an image folder too), Hugging Face datasets, Flower
Datasets' partitioners, and arrays on disk larger than memory (docs/data.md). ``Dataset.from_torch``,
``Dataset.from_hf`` and ``Dataset.from_memmap`` make a :class:`~fedflat.data.Dataset` of the arrays these make:

- :func:`torch_arrays`: any map-style ``torch.utils.data.Dataset`` whose items are ``(input, label)``: a tensor,
  a NumPy array or a PIL image (an image folder's), and an integer label;
- :func:`hf_arrays`: a Hugging Face ``datasets.Dataset`` with a feature column (images, arrays) or several
  numeric columns, and a label column;
- :func:`memmap_arrays`: a folder of ``.npy`` files (``x_train``, ``y_train``, ``x_test``, ``y_test``) whose
  inputs are memory-mapped: pages are read from disk as batches need them, so the data may be larger than
  memory, and a run gives the same numbers as with the arrays in memory;
- :func:`flwr_partitions`: a ``flwr_datasets`` partitioner's split of a Hugging Face training set as fedflat's
  ``clients=`` (one index array per partition).

Images become uint8 ``[N, C, H, W]`` standardized per batch with the training split's per-channel statistics
(:class:`~fedflat.data.dataset.Standardize`), as fedflat's own image datasets; float inputs are used as they are
(normalize them in the dataset, as for :class:`~fedflat.data.Dataset`); integer inputs are token ids. With
``cache=FOLDER`` the converted arrays are written there as they are made and memory-mapped
(:func:`memmap_arrays` maps them again later without converting), so a dataset larger than memory is never held
whole.
"""
from __future__ import annotations

import json
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from .errors import DatasetError
from .npy import write_npy

FILES = ("x_train", "y_train", "x_test", "y_test")
META = "dataset.json"
INDEX = "__fedflat_index__"


@dataclass
class Arrays:
    """A dataset's splits as arrays (inputs possibly memory-mapped), its name, classes and where it came from."""

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    source: str


def _pixels(image: Any, mode: str) -> np.ndarray:
    """A PIL image as uint8 ``[C, H, W]`` in ``mode`` (``L``: one channel; ``RGB``: three)."""
    array = np.asarray(image.convert(mode) if image.mode != mode else image, dtype=np.uint8)
    return array[None] if array.ndim == 2 else array.transpose(2, 0, 1)


def _input(value: Any, mode: str | None) -> np.ndarray:
    """One sample's input as an array: a PIL image as uint8 ``[C, H, W]``, a tensor or array as it is
    (floats as float32, integers other than uint8 as int64 token ids)."""
    if hasattr(value, "convert") and hasattr(value, "mode"):  # a PIL image
        return _pixels(value, mode or "RGB")
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype == np.uint8:
        return array
    if np.issubdtype(array.dtype, np.floating) or array.dtype == np.bool_:
        return array.astype(np.float32)
    if np.issubdtype(array.dtype, np.integer):
        return array.astype(np.int64)
    raise DatasetError(f"an input of type {type(value).__name__} ({array.dtype}) is not a tensor, array or image")


def _label(value: Any, where: str) -> int:
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value
    if isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, bool):
        return int(value)
    raise DatasetError(f"{where}: the label must be an integer class id, got {value!r}")


def _image_mode(first: Any) -> str | None:
    """Greyscale images stay one channel; any other mode (palette, RGBA, CMYK, ...) becomes RGB."""
    if hasattr(first, "convert") and hasattr(first, "mode"):
        return "L" if first.mode in ("L", "1", "I;16", "I", "F") else "RGB"
    return None


def _fill(samples: Iterator[tuple[Any, Any]], count: int, where: str,
          file: Path | None) -> tuple[np.ndarray, np.ndarray]:
    """The inputs and labels of ``count`` samples, the inputs written into ``file`` (a memory-mapped ``.npy``:
    :func:`~fedflat.data.npy.write_npy`) or kept in memory."""
    if count < 1:
        raise DatasetError(f"{where} is empty")
    first_input, first_label = next(samples)
    mode = _image_mode(first_input)
    first = _input(first_input, mode)
    y = np.empty(count, dtype=np.int64)

    def fill(x: np.ndarray) -> None:
        x[0], y[0] = first, _label(first_label, f"{where}[0]")
        done = 1
        for i, (value, label) in enumerate(samples, start=1):
            if i >= count:
                break
            array = _input(value, mode)
            if array.shape != first.shape:
                raise DatasetError(f"{where}[{i}] has shape {array.shape} but {where}[0] has {first.shape}: every "
                                   "input needs the same shape (resize images in the dataset's transform)")
            x[i], y[i] = array, _label(label, f"{where}[{i}]")
            done += 1
        if done != count:
            raise DatasetError(f"{where} gave {done} samples but says it has {count}")

    if file is not None:
        return write_npy(file, first.dtype, (count, *first.shape), fill), y
    x = np.empty((count, *first.shape), dtype=first.dtype)
    fill(x)
    return x, y


def _arrays(name: str, train: tuple[np.ndarray, np.ndarray], test: tuple[np.ndarray, np.ndarray],
            num_classes: int | None, source: str, cache: Path | None) -> Arrays:
    """The converted splits; with a ``cache`` folder, the labels and ``dataset.json`` (name, classes) are written
    beside the inputs, so that :func:`memmap_arrays` reads the folder back."""
    (x_train, y_train), (x_test, y_test) = train, test
    if num_classes is None:
        num_classes = max(2, int(max(y_train.max(), y_test.max())) + 1)
    if cache is not None:
        np.save(cache / "y_train.npy", y_train)
        np.save(cache / "y_test.npy", y_test)
        (cache / META).write_text(json.dumps({"name": name, "num_classes": num_classes}) + "\n")
    return Arrays(name, x_train, y_train, x_test, y_test, num_classes, source)


def _cache_folder(cache: str | Path | None) -> Path | None:
    if cache is None:
        return None
    folder = Path(cache)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def torch_arrays(train: Sequence, test: Sequence, *, name: str = "torch", num_classes: int | None = None,
                 cache: str | Path | None = None) -> Arrays:
    """The arrays of two map-style torch datasets (``len`` and ``[i]``) whose items are ``(input, label)``: a
    tensor, a NumPy array or a PIL image (an image folder's items: greyscale images stay one channel, others
    become RGB), and an integer label. ``num_classes``: default the dataset's ``classes`` (an image folder's),
    else the largest label + 1. ``cache``: a folder where the arrays are written and memory-mapped, for data
    larger than memory."""
    folder = _cache_folder(cache)
    if num_classes is None and hasattr(train, "classes"):
        num_classes = len(train.classes)
    split = {}
    for which, data in (("train", train), ("test", test)):
        if not hasattr(data, "__len__") or not hasattr(data, "__getitem__"):
            raise DatasetError(f"from_torch: the {which} dataset must be map-style (len() and [i]), got "
                               f"{type(data).__name__}")
        split[which] = _fill((_pair(data[i], f"{which}[{i}]") for i in range(len(data))), len(data),
                             f"{name} {which}", folder / f"x_{which}.npy" if folder else None)
    return _arrays(name, split["train"], split["test"], num_classes, f"torch datasets {type(train).__name__}", folder)


def _pair(item: Any, where: str) -> tuple[Any, Any]:
    if isinstance(item, (tuple, list)) and len(item) == 2:
        return item[0], item[1]
    raise DatasetError(f"from_torch: {where} must be an (input, label) pair, got {type(item).__name__}; for items "
                       "that are mappings (a Hugging Face dataset), use Dataset.from_hf")


def hf_arrays(train: Any, test: Any, *, features: str | Sequence[str] = "image", label: str = "label",
              name: str | None = None, num_classes: int | None = None, cache: str | Path | None = None) -> Arrays:
    """The arrays of two Hugging Face ``datasets.Dataset`` splits. ``features``: the input column (an ``Image``
    column becomes uint8 images, an array or sequence column its values) or a list of numeric columns (a tabular
    row, float32); ``label``: the label column (a ``ClassLabel`` gives ``num_classes``). Other arguments as for
    :func:`torch_arrays`."""
    columns = [features] if isinstance(features, str) else list(features)
    if not columns:
        raise DatasetError("from_hf: name the input column(s) with features=")
    folder = _cache_folder(cache)
    split = {}
    for which, data in (("train", train), ("test", test)):
        missing = [c for c in (*columns, label) if c not in getattr(data, "column_names", [])]
        if missing:
            raise DatasetError(f"from_hf: the {which} split has no column {missing[0]!r}; its columns: "
                               f"{', '.join(getattr(data, 'column_names', [])) or '(not a datasets.Dataset)'}")
        split[which] = _fill(_hf_rows(data, columns, label), len(data), f"{name or 'hf'} {which}",
                             folder / f"x_{which}.npy" if folder else None)
    if num_classes is None and hasattr(train.features[label], "num_classes"):
        num_classes = train.features[label].num_classes
    return _arrays(name or getattr(train.info, "dataset_name", None) or "hf", split["train"], split["test"],
                   num_classes, "Hugging Face datasets", folder)


def _hf_rows(data: Any, columns: list[str], label: str, batch: int = 256) -> Iterator[tuple[Any, Any]]:
    """``(input, label)`` of every row: one column's value, or the row of several numeric columns."""
    for rows in data.select_columns([*columns, label]).iter(batch_size=batch):
        for i, y in enumerate(rows[label]):
            yield (rows[columns[0]][i] if len(columns) == 1 else [rows[c][i] for c in columns]), y


def flwr_partitions(partitioner: Any, train: Any) -> list[np.ndarray]:
    """A Flower Datasets partitioner's split of the training set as fedflat's ``clients=``: partition ``i``'s
    samples (their indices, in the partition's order) are client ``i``'s.

    ``partitioner`` is a fresh ``flwr_datasets.partitioner.Partitioner`` (Dirichlet, pathological, IID, shard,
    ...). ``train`` is the Hugging Face training set (converted by ``Dataset.from_hf`` in its order), or a
    fedflat ``Dataset`` or its training labels: the partitioner then splits a dataset of those labels, in the
    column it partitions by. Either way it gets an index column, so any partitioner's rows map back to their
    positions in ``train``."""
    if not hasattr(train, "add_column"):
        import datasets

        labels = train.y_train if hasattr(train, "y_train") else train
        labels = labels.cpu().numpy() if isinstance(labels, torch.Tensor) else np.asarray(labels)
        column = getattr(partitioner, "_partition_by", None) or "label"
        train = datasets.Dataset.from_dict({column: labels.astype(np.int64).tolist()})
    if INDEX in train.column_names:
        raise DatasetError(f"flwr_partitions: the dataset already has a column {INDEX!r}")
    partitioner.dataset = train.add_column(INDEX, np.arange(len(train), dtype=np.int64))
    return [np.asarray(partitioner.load_partition(i).with_format("numpy")[INDEX], dtype=np.int64)
            for i in range(partitioner.num_partitions)]


def memmap_arrays(folder: str | Path, *, name: str | None = None, num_classes: int | None = None) -> Arrays:
    """The dataset in ``folder``: ``x_train.npy``, ``y_train.npy``, ``x_test.npy``, ``y_test.npy`` (and
    ``dataset.json``, which :func:`torch_arrays`/:func:`hf_arrays` with ``cache=`` write, for its name and
    classes). The inputs are memory-mapped, never read whole: uint8 images ``[N, C, H, W]`` (standardized per
    batch; their statistics are summed a chunk at a time), float32 features or int64 token ids. Labels are read
    into memory."""
    folder = Path(folder)
    missing = [f"{f}.npy" for f in FILES if not (folder / f"{f}.npy").is_file()]
    if missing:
        raise DatasetError(f"{folder}: no {', '.join(missing)}; a memory-mapped dataset is the four files "
                           f"{', '.join(f + '.npy' for f in FILES)}")
    meta = json.loads((folder / META).read_text()) if (folder / META).is_file() else {}
    x_train, x_test = (np.load(folder / f"x_{s}.npy", mmap_mode="r") for s in ("train", "test"))
    y_train, y_test = (np.asarray(np.load(folder / f"y_{s}.npy"), dtype=np.int64) for s in ("train", "test"))
    if x_train.dtype not in (np.uint8, np.float32, np.int64):  # (a non-image uint8 array is converted: loaded)
        raise DatasetError(f"{folder}/x_train.npy is {x_train.dtype}: memory-mapped inputs are uint8 images, float32 "
                           "features or int64 token ids (fedflat never converts a mapped array: that would load it)")
    return _arrays(name or meta.get("name") or folder.name, (x_train, y_train), (x_test, y_test),
                   num_classes or meta.get("num_classes"), str(folder), None)


__all__ = ["Arrays", "flwr_partitions", "hf_arrays", "memmap_arrays", "torch_arrays"]
