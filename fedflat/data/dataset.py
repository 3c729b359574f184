"""The in-memory dataset every part of fedflat trains on: whole splits as tensors, and how a training batch is
prepared from them: stored uint8 pixels standardized (:class:`Standardize`) and batched train-time augmentation on
the training device, with no per-sample Python loop (:func:`augmentation_fn`)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .errors import DatasetError

if TYPE_CHECKING:  # (Hugging Face datasets, an optional extra: only named in from_hf's signature)
    import datasets

STATS_BYTES = 256 * 2 ** 20  # the most of a memory map's training images read for its pixel statistics
STATS_SEED = 0

__all__ = ["AUGMENTATIONS", "Dataset", "DatasetError", "Standardize", "apply_augmentation", "augmentation_fn",
           "channel_stats", "cifar_augment", "crop_flip", "flip_augment", "normalize", "pixel_moments", "to_tensors",
           "sampled_standardize", "uint8_dataset", "validation_split"]


@dataclass(frozen=True)
class Standardize:
    """Per-channel standardization of stored uint8 pixels, applied to each batch as it is indexed:
    ``x -> (x / scale - mean_c) / std_c`` in float32, with ``mean`` and ``std`` one value per channel (of the pixels
    divided by ``scale``, 255 by default). Large image sets (Tiny-ImageNet, OfficeHome, DomainNet) stay uint8 on the
    training device, a quarter of float32's memory."""

    mean: tuple[float, ...]
    std: tuple[float, ...]
    scale: float = 255.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: uint8 ``[..., C, H, W]`` (a batch, or a cohort's ``[clients, B, C, H, W]``)."""
        mean, std = _channel_constants(self.mean, self.std, x.device)
        return (x.float() / self.scale - mean) / std


@functools.lru_cache(maxsize=32)
def _channel_constants(mean: tuple[float, ...], std: tuple[float, ...],
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``mean`` and ``std`` as float32 ``[C, 1, 1]`` tensors on ``device``, made once (not copied every batch)."""
    return tuple(torch.tensor(v, dtype=torch.float32, device=device).view(-1, 1, 1) for v in (mean, std))


@dataclass
class Dataset:
    """Train and test splits held as tensors (keep them on the training device, index batches).

    ``name`` names the data in messages and run folders. The inputs ``x_train`` and ``x_test`` are float32
    ``[N, *input_shape]``, already normalized (or int64 token ids for text models), or uint8 pixels ``[N, C, H, W]``
    with ``standardize`` set, which :meth:`features` applies to every batch; the labels ``y_train`` and ``y_test``
    are integer class ids ``[N]`` in ``[0, num_classes)``. NumPy arrays are accepted and converted.
    ``augmentation`` names a train-time augmentation (``"cifar"``: pad-4 random crop and horizontal flip, see
    :func:`fedflat.data.cifar_augment`; ``"flip"``: the flip alone) or is None.
    ``source`` says where the data came from (a folder, an archive, or a generator). ``owners`` (optional,
    int64 ``[N_train]``) is each training sample's natural owner, e.g. its writer or its domain, and
    ``owner_names`` their names: ``data.partition: {scheme: natural}`` makes one client per owner (LEAF's natural
    split), ``{scheme: domain, per_domain: M}`` M clients per owner (the domain benchmarks); ``test_owners`` the
    test samples' owners in the same ids (LEAF's per-user test split: a personalized evaluation tests each client
    on its owner's samples, :func:`fedflat.data.client_test_split`). ``heldout`` names what
    ``x_test``/``y_test`` hold: ``"test"``, or ``"validation"`` after :func:`validation_split` (training samples
    held out; the test split is then gone). ``files``: the files a loader read (the run's summary.json records
    them).

    Everything is checked when the dataset is made: a wrong dtype, shape, length, label or a NaN is a
    :class:`DatasetError` naming the field and what is expected, before any run starts.
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    augmentation: str | None = None
    source: str = ""
    owners: np.ndarray | None = None
    owner_names: list[str] | None = None
    test_owners: np.ndarray | None = None
    standardize: Standardize | None = None
    heldout: str = "test"
    files: tuple[str, ...] = ()  # the files the loader read (the run folder's summary.json records them)

    def __post_init__(self) -> None:
        for field in ("x_train", "y_train", "x_test", "y_test"):
            value = getattr(self, field)
            if isinstance(value, np.ndarray):  # shared, not copied (a memory map stays one)
                setattr(self, field, _tensor(np.ascontiguousarray(value)))
            elif not isinstance(value, torch.Tensor):
                raise DatasetError(f"Dataset {self.name!r}: {field} must be a torch tensor or NumPy array, "
                                   f"got {type(value).__name__}")
        if not isinstance(self.num_classes, (int, np.integer)) or self.num_classes < 2:
            raise DatasetError(f"Dataset {self.name!r}: num_classes must be an integer >= 2, got {self.num_classes!r}")
        for split in ("train", "test"):
            self._check_split(split)
        for field, split in (("owners", "train"), ("test_owners", "test")):
            if getattr(self, field) is None:
                continue
            owners, count = np.asarray(getattr(self, field)), getattr(self, f"x_{split}").shape[0]
            if owners.shape != (count,) or not np.issubdtype(owners.dtype, np.integer):
                raise DatasetError(f"Dataset {self.name!r}: {field} must be one integer owner id per {split} sample "
                                   f"({count}), got {owners.dtype} {owners.shape}")
            setattr(self, field, owners)
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise DatasetError(f"Dataset {self.name!r}: x_train samples have shape {tuple(self.x_train.shape[1:])} "
                               f"but x_test samples {tuple(self.x_test.shape[1:])}; both splits need the same features")

    def _check_split(self, split: str) -> None:
        x, y = getattr(self, f"x_{split}"), getattr(self, f"y_{split}")
        where = f"Dataset {self.name!r}: x_{split}"
        if x.dim() < 2:
            raise DatasetError(f"{where} has shape {tuple(x.shape)}; it needs a sample dimension and feature "
                               "dimensions, e.g. [N, features] or [N, channels, height, width]")
        if (x.dtype == torch.uint8) != (self.standardize is not None):
            raise DatasetError(f"{where} is {x.dtype}: uint8 pixels need standardize=Standardize(mean, std) (per "
                               "channel, after dividing by 255; or divide by 255 and pass float32), and only uint8 "
                               "inputs take one")
        if x.dtype == torch.uint8:
            if x.dim() < 3 or x.shape[1] != len(self.standardize.mean) or len(self.standardize.std) != x.shape[1]:
                raise DatasetError(f"{where}: uint8 images [N, C, ...] need one standardize mean and std per channel "
                                   f"(C={x.shape[1] if x.dim() > 1 else '?'}), got {len(self.standardize.mean)}")
        elif x.dtype == torch.float64:
            raise DatasetError(f"{where} is float64; fedflat trains in float32: pass x_{split}.float()")
        if x.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.uint8):
            raise DatasetError(f"{where} is {x.dtype}; expected float32 features (scaled and normalized), uint8 "
                               "pixels with standardize=, or int64 token ids")
        if x.is_floating_point() and not all(torch.isfinite(x[lo:lo + 4096]).all() for lo in range(0, len(x), 4096)):
            raise DatasetError(f"{where} holds NaN or infinite values; clean or impute them first")
        if y.dim() != 1 or y.shape[0] != x.shape[0]:
            raise DatasetError(f"Dataset {self.name!r}: y_{split} must be one label per sample ({x.shape[0]} for "
                               f"x_{split}), got shape {tuple(y.shape)}")
        if y.is_floating_point() or y.dtype == torch.bool:
            raise DatasetError(f"Dataset {self.name!r}: y_{split} is {y.dtype}; labels must be integer class ids "
                               f"(y_{split}.long())")
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
            raise DatasetError(f"Dataset {self.name!r}: y_{split} has labels in [{int(y.min())}, {int(y.max())}] "
                               f"but num_classes={self.num_classes}; labels must be 0 .. num_classes - 1")
        if y.dtype != torch.int64:
            setattr(self, f"y_{split}", y.long())

    @classmethod
    def from_torch(cls, train: torch.utils.data.Dataset, test: torch.utils.data.Dataset, *, name: str = "torch",
                   num_classes: int | None = None, standardize: "Standardize | None" = None,
                   augmentation: str | None = None, cache: str | os.PathLike | None = None) -> "Dataset":
        """The splits ``train`` and ``test``: two map-style torch datasets (``len()`` and ``[i]``) of
        ``(input, label)`` items, a tensor, an array or a PIL image (an image folder's) and an integer label
        (:func:`fedflat.data.adapters.torch_arrays`). Images become uint8 ``[N, C, H, W]`` standardized per batch
        (``standardize``: default the training split's statistics), floats are used as they are. ``name`` names the
        data in messages and run folders. ``num_classes``: default the dataset's ``classes``, else the largest
        label + 1. ``augmentation``: ``"cifar"`` or ``"flip"``, fedflat's batched train-time augmentation, or None.
        ``cache``: a folder the arrays are written to and memory-mapped from (data larger than memory;
        :meth:`from_memmap` maps them again). docs/data.md."""
        from .adapters import torch_arrays

        return _from_arrays(torch_arrays(train, test, name=name, num_classes=num_classes, cache=cache), standardize,
                            augmentation)

    @classmethod
    def from_hf(cls, train: datasets.Dataset, test: datasets.Dataset, *, features: str | list[str] = "image",
                label: str = "label", name: str | None = None, num_classes: int | None = None,
                standardize: "Standardize | None" = None, augmentation: str | None = None,
                cache: str | os.PathLike | None = None) -> "Dataset":
        """The splits ``train`` and ``test``: two Hugging Face ``datasets.Dataset`` splits. ``features`` names the
        input column (images, arrays) or a list of numeric columns, ``label`` the label column (a ``ClassLabel``
        gives ``num_classes``); ``name`` (default the dataset's), ``standardize``, ``augmentation`` and ``cache``
        as for :meth:`from_torch` (:func:`fedflat.data.adapters.hf_arrays`). docs/data.md."""
        from .adapters import hf_arrays

        return _from_arrays(hf_arrays(train, test, features=features, label=label, name=name, num_classes=num_classes,
                                      cache=cache), standardize, augmentation)

    @classmethod
    def from_memmap(cls, folder: str | os.PathLike, *, name: str | None = None, num_classes: int | None = None,
                    standardize: "Standardize | None" = None, augmentation: str | None = None,
                    stats_bytes: int | None = STATS_BYTES) -> "Dataset":
        """``folder``'s ``x_train.npy``, ``y_train.npy``, ``x_test.npy``, ``y_test.npy``, the inputs memory-mapped
        and never read whole: data larger than memory trains with the numbers it has in memory
        (:func:`fedflat.data.adapters.memmap_arrays`). The pixel statistics of uint8 images (unless
        ``standardize`` is given) come from at most ``stats_bytes`` of training images (:func:`sampled_standardize`:
        all of them, exactly, when they fit; None: every image, a chunk at a time). ``name``, ``num_classes`` and
        ``augmentation`` as for :meth:`from_torch`. docs/data.md."""
        from .adapters import memmap_arrays

        arrays = memmap_arrays(folder, name=name, num_classes=num_classes)
        if standardize is None and arrays.x_train.dtype == np.uint8 and arrays.x_train.ndim == 4:
            standardize = sampled_standardize(arrays.x_train, stats_bytes)
        return _from_arrays(arrays, standardize, augmentation)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The model's input for raw rows ``x`` of ``x_train``/``x_test``: standardized float32 for uint8
        pixels, ``x`` itself otherwise."""
        return x if self.standardize is None else self.standardize(x)

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one input, without the batch dimension."""
        return tuple(self.x_train.shape[1:])

    def to(self, device: torch.device | str) -> "Dataset":
        """A copy whose tensors live on ``device``."""
        return replace(self, x_train=self.x_train.to(device), y_train=self.y_train.to(device),
                       x_test=self.x_test.to(device), y_test=self.y_test.to(device))

    def __repr__(self) -> str:
        return (f"Dataset({self.name!r}, train={len(self.y_train)}, test={len(self.y_test)}, "
                f"input_shape={self.input_shape}, num_classes={self.num_classes}, "
                f"augmentation={self.augmentation!r}, device={self.x_train.device}"
                f"{', stored uint8' if self.standardize else ''})")


def validation_split(data: Dataset, fraction: float, seed: int = 0) -> tuple[Dataset, np.ndarray]:
    """Holds out ``fraction`` of each class of ``data``'s training split as the evaluation set, in place of the
    test split, which the result does not contain (model selection then never sees it). The draw depends only on the
    labels, ``fraction`` and ``seed``, so every run of a tuning study validates on the same samples. Returns the
    dataset (``heldout="validation"``) and the indices of the original training samples it trains on."""
    if not 0 < fraction < 1:
        raise DatasetError(f"data.validation must be a fraction in (0, 1), got {fraction}")
    labels = data.y_train.cpu().numpy()
    rng = np.random.default_rng(seed)
    held = []
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        take = int(round(fraction * members.size))
        held.append(rng.permutation(members)[:take])
    held = np.sort(np.concatenate(held))
    if held.size == 0 or held.size == labels.size:
        raise DatasetError(f"data.validation={fraction} of {labels.size} training samples leaves "
                           f"{'no validation' if held.size == 0 else 'no training'} samples; choose another fraction")
    kept = np.setdiff1d(np.arange(labels.size), held)
    take_kept, take_held = (torch.as_tensor(ix, device=data.y_train.device) for ix in (kept, held))
    split = replace(data, x_train=data.x_train[take_kept], y_train=data.y_train[take_kept],
                    x_test=data.x_train[take_held], y_test=data.y_train[take_held],
                    owners=None if data.owners is None else data.owners[kept],
                    test_owners=None if data.owners is None else data.owners[held], heldout="validation")
    return split, kept


def check_classes(classes: object) -> list[int]:
    """``data.options.classes`` as a list of distinct class ids (at least two), or a :class:`DatasetError` saying
    what is wrong; whether each id is one of the dataset's is known once it is loaded (:func:`select_classes`)."""
    if (not isinstance(classes, (list, tuple)) or len(classes) < 2
            or not all(isinstance(c, (int, np.integer)) and not isinstance(c, bool) and c >= 0 for c in classes)):
        raise DatasetError(f"data.options.classes must be a list of at least two class ids (integers >= 0), "
                           f"e.g. [5, 6, 7, 8, 9]; got {classes!r}")
    repeated = sorted({int(c) for c in classes if list(classes).count(c) > 1})
    if repeated:
        raise DatasetError(f"data.options.classes lists class {repeated[0]} more than once: {list(classes)}")
    return [int(c) for c in classes]


def select_classes(data: Dataset, classes: Sequence[int]) -> Dataset:
    """The samples of ``classes`` alone, in both splits, labelled ``0 .. k-1`` in the order ``classes`` lists them
    (class ``classes[j]`` becomes label ``j``): a new task made of some classes of a dataset, e.g. Fashion-MNIST's
    footwear and bags beside a model pretrained on its clothes. Inputs are kept as they are, so the pixels stay
    standardized with the whole training split's statistics (a model trained on other classes of the dataset sees
    these preprocessed alike); the samples keep their order, and their owners (``owners``, ``test_owners``) with
    them. A class id the dataset does not have is a :class:`DatasetError` naming its classes."""
    classes = check_classes(classes)
    unknown = [c for c in classes if c >= data.num_classes]
    if unknown:
        raise DatasetError(f"data.options.classes: {data.name!r} has classes 0..{data.num_classes - 1}, not "
                           f"{', '.join(map(str, unknown))}; choose among those")
    relabel = torch.full((data.num_classes,), -1, dtype=torch.long)
    relabel[torch.tensor(classes)] = torch.arange(len(classes))
    picked = {}
    for split in ("train", "test"):
        y = getattr(data, f"y_{split}")
        new = relabel[y.cpu()]
        rows = torch.nonzero(new >= 0).flatten()
        owners = getattr(data, "owners" if split == "train" else "test_owners")
        picked.update({f"x_{split}": getattr(data, f"x_{split}")[rows.to(y.device)],
                       f"y_{split}": new[rows].to(y.device),
                       "owners" if split == "train" else "test_owners":
                           None if owners is None else owners[rows.numpy()]})
    if picked["y_train"].numel() == 0:
        raise DatasetError(f"data.options.classes {classes}: {data.name!r} has no training sample of these classes")
    return replace(data, num_classes=len(classes), **picked)


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (dim 1) mean and std of ``x``, shaped to broadcast against it."""
    dims = [0] + list(range(2, x.dim()))
    return x.mean(dim=dims, keepdim=True), x.std(dim=dims, keepdim=True).clamp_min(1e-8)


def normalize(x_train: torch.Tensor, x_test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardize both splits per channel with the train split's mean and std (new tensors)."""
    mean, std = channel_stats(x_train)
    return (x_train - mean) / std, (x_test - mean) / std


def _writable_float32(x: np.ndarray) -> np.ndarray:
    """``x`` as a contiguous float32 array torch may write to (a read-only memory map is copied)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    return x if x.flags.writeable else x.copy()


def to_tensors(name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
               y_test: np.ndarray, num_classes: int, scale: float = 1.0,
               augmentation: str | None = None, source: str = "") -> Dataset:
    """Build a normalized :class:`Dataset` from numpy splits; inputs are divided by ``scale`` first.

    Normalization is per channel with the train split's mean and std, done in place to keep
    peak memory near one copy of the data.
    """
    xtr, xte = (torch.from_numpy(_writable_float32(x)).div_(scale) for x in (x_train, x_test))
    mean, std = channel_stats(xtr)
    xtr.sub_(mean).div_(std)
    xte.sub_(mean).div_(std)
    return Dataset(name, xtr, torch.from_numpy(np.asarray(y_train, dtype=np.int64)),
                   xte, torch.from_numpy(np.asarray(y_test, dtype=np.int64)),
                   num_classes, augmentation, source)


def pixel_moments(images: np.ndarray, chunk: int = 256) -> np.ndarray:
    """Per image and channel, the sum of ``x / 255`` and of its square: float64 ``[N, 2, C]``."""
    out = np.empty((len(images), 2, images.shape[1]))
    for lo in range(0, len(images), chunk):
        block = np.ascontiguousarray(images[lo:lo + chunk], dtype=np.float64) / 255.0  # sums: one order, any layout
        out[lo:lo + chunk, 0] = block.sum(axis=(2, 3))
        out[lo:lo + chunk, 1] = np.square(block).sum(axis=(2, 3))
    return out


class _Rows:
    """Rows ``index`` of ``images``, read a slice at a time (what :func:`pixel_moments` reads)."""

    def __init__(self, images: np.ndarray, index: np.ndarray):
        self.images, self.index = images, index
        self.shape = (len(index), *images.shape[1:])

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, rows: slice) -> np.ndarray:
        return self.images[self.index[rows]]


def sampled_standardize(images: np.ndarray, stats_bytes: int | None = STATS_BYTES) -> "Standardize":
    """Per-channel mean and (unbiased) std of ``images / 255`` (uint8 ``[N, C, H, W]``, e.g. a memory map) from
    at most ``stats_bytes`` of them: every image when they fit (then exactly :func:`uint8_dataset`'s numbers), else
    a uniform sample without replacement of ``stats_bytes // image_bytes`` images (at least 1; seed
    :data:`STATS_SEED`, read in file order), so the disk read and the pages the map keeps resident are bounded
    (256 MiB by default, whatever the file's size). With ``stats_bytes=None`` every image is read, a chunk at a
    time. A sample of n images estimates each channel's mean to about std / sqrt(n H W) (pixels of one image are
    correlated: n is the honest count)."""
    n = len(images)
    per_image = int(np.prod(images.shape[1:])) * images.itemsize
    take = n if stats_bytes is None else min(n, max(1, stats_bytes // max(per_image, 1)))
    rows = images if take == n else _Rows(images, np.sort(
        np.random.default_rng(STATS_SEED).choice(n, size=take, replace=False)))
    return moments_standardize(pixel_moments(rows), take * images.shape[2] * images.shape[3])


def moments_standardize(moments: np.ndarray, pixels: int) -> "Standardize":
    """The :class:`Standardize` of per-image sums ``moments`` (:func:`pixel_moments`) over ``pixels`` values per
    channel: mean = S1 / n and std = sqrt((S2 / n - mean^2) n / (n - 1))."""
    total, count = moments.sum(axis=0), max(2, pixels)
    mean = total[0] / count
    std = np.sqrt(np.maximum(total[1] / count - mean ** 2, 0.0) * count / (count - 1)).clip(min=1e-8)
    return Standardize(tuple(mean.tolist()), tuple(std.tolist()))


def uint8_dataset(name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
                  num_classes: int, augmentation: str | None = None, source: str = "",
                  moments: np.ndarray | None = None, **fields) -> Dataset:
    """A :class:`Dataset` that keeps uint8 images ``[N, C, H, W]`` (a memory map stays one: nothing is copied
    here) and standardizes each batch with the training split's per-channel mean and (unbiased) std of ``x/255``.
    ``moments``: the training images' per-image sums of ``x/255`` and its square, float64 ``[N, 2, C]``
    (:func:`pixel_moments`; computed here when not given). ``fields``: further
    :class:`Dataset` fields (``owners``...)."""
    if moments is None:
        moments = pixel_moments(x_train)
    standardize = moments_standardize(moments, x_train.shape[0] * x_train.shape[2] * x_train.shape[3])
    return Dataset(name, _tensor(x_train), torch.from_numpy(np.asarray(y_train, dtype=np.int64)),
                   _tensor(x_test), torch.from_numpy(np.asarray(y_test, dtype=np.int64)), num_classes,
                   augmentation, source, standardize=standardize, **fields)


def _from_arrays(arrays, standardize: Standardize | None, augmentation: str | None) -> Dataset:
    """A :class:`Dataset` of an adapter's arrays (:class:`fedflat.data.adapters.Arrays`): uint8 images
    ``[N, C, H, W]`` standardized per batch, other uint8 features as float32, the rest as they are; arrays are
    shared, not copied (a memory map stays one)."""
    a = arrays
    if a.x_train.dtype == np.uint8 and a.x_train.ndim == 4:
        if standardize is None:
            return uint8_dataset(a.name, a.x_train, a.y_train, a.x_test, a.y_test, a.num_classes, augmentation,
                                 a.source)
        return Dataset(a.name, _tensor(a.x_train), torch.from_numpy(a.y_train), _tensor(a.x_test),
                       torch.from_numpy(a.y_test), a.num_classes, augmentation, a.source, standardize=standardize)
    x_train, x_test = a.x_train, a.x_test
    if x_train.dtype == np.uint8:  # uint8 features that are not images: their values
        x_train, x_test = x_train.astype(np.float32), x_test.astype(np.float32)
    return Dataset(a.name, x_train, a.y_train, x_test, a.y_test, a.num_classes, augmentation, a.source)


def _tensor(x: np.ndarray) -> torch.Tensor:
    """``x`` as a tensor sharing its memory; a read-only memory map is shared too (fedflat never writes data)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(x)


# -- batched train-time augmentation -----------------------------------------------------------------------------------
def crop_flip(x: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor, padding: int = 4) -> torch.Tensor:
    """Zero-pad ``x [B, C, H, W]`` by ``padding``, crop ``H x W`` at per-sample ``offsets``, flip some.

    ``offsets`` is an integer ``[B, 2]`` tensor of (row, column) crop corners in the padded image,
    each in ``[0, 2 * padding]`` (``padding, padding`` is the unshifted image); ``flips`` is a
    bool ``[B]`` tensor choosing a horizontal flip of the crop. One ``gather`` does all samples.
    """
    batch, channels, height, width = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    padded_width = width + 2 * padding
    offsets = offsets.to(device=x.device, dtype=torch.long)
    rows = offsets[:, :1] + torch.arange(height, device=x.device)  # [B, H]
    cols = offsets[:, 1:] + torch.arange(width, device=x.device)  # [B, W]
    cols = torch.where(flips.to(x.device).view(-1, 1), cols.flip(1), cols)
    flat = (rows[:, :, None] * padded_width + cols[:, None, :]).view(batch, 1, height * width)
    out = padded.flatten(2).gather(2, flat.expand(batch, channels, height * width))
    return out.view(batch, channels, height, width)


def cifar_augment(x: torch.Tensor, generator: torch.Generator, padding: int = 4, flip: bool = True) -> torch.Tensor:
    """The standard CIFAR augmentation, batched: pad ``padding`` with zeros, random crop back to
    ``H x W`` (offsets uniform in ``0..2*padding`` per sample) and a horizontal flip with
    probability 1/2 per sample.

    Random numbers are drawn on ``generator``'s device (x's device, or a CPU generator whose
    draws are moved), so the output is a deterministic function of ``x`` and the generator state.
    """
    batch = x.shape[0]
    offsets = torch.randint(0, 2 * padding + 1, (batch, 2), generator=generator, device=generator.device)
    if flip:
        flips = torch.randint(0, 2, (batch,), generator=generator, device=generator.device).bool()
    else:
        flips = torch.zeros(batch, dtype=torch.bool)
    return crop_flip(x, offsets, flips, padding)


def flip_augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A horizontal flip with probability 1/2 per sample (the usual train transform of the 224 x 224 domain
    benchmarks, whose images are resized, not cropped): :func:`cifar_augment` without padding."""
    return cifar_augment(x, generator, padding=0)


AUGMENTATIONS: dict[str, Callable[[torch.Tensor, torch.Generator], torch.Tensor]] = {
    "cifar": cifar_augment,
    "flip": flip_augment,
}


def augmentation_fn(name: str | None) -> Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None:
    """The batch augmentation ``name`` (a :attr:`Dataset.augmentation` value), None for None."""
    if name is None:
        return None
    if name not in AUGMENTATIONS:
        raise ValueError(f"unknown augmentation {name!r}; available: {', '.join(AUGMENTATIONS)} or None")
    return AUGMENTATIONS[name]


def apply_augmentation(name: str | None, x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Apply the augmentation ``name`` (a :attr:`Dataset.augmentation` value) to the batch ``x``, its randomness
    drawn from ``generator``; None: ``x`` unchanged."""
    augment = augmentation_fn(name)
    return x if augment is None else augment(x, generator)
