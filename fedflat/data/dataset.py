"""The in-memory dataset every part of fedflat trains on: whole splits as tensors."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

__all__ = ["Dataset", "channel_stats", "normalize", "to_tensors"]


@dataclass
class Dataset:
    """Train and test splits held as tensors (keep them on the training device, index batches).

    ``x_*`` are float32 ``[N, *input_shape]``, already normalized; ``y_*`` are int64 ``[N]``.
    ``augmentation`` names a train-time augmentation (``"cifar"``: pad-4 random crop and
    horizontal flip, see :func:`fedflat.data.cifar_augment`) or is None.
    ``source`` says where the data came from (a folder, an archive, or a generator).
    """

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int
    augmentation: str | None = None
    source: str = ""

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
                f"augmentation={self.augmentation!r}, device={self.x_train.device})")


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel (dim 1) mean and std of ``x``, shaped to broadcast against it."""
    dims = [0] + list(range(2, x.dim()))
    return x.mean(dim=dims, keepdim=True), x.std(dim=dims, keepdim=True).clamp_min(1e-8)


def normalize(x_train: torch.Tensor, x_test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Standardize both splits per channel with the train split's mean and std (new tensors)."""
    mean, std = channel_stats(x_train)
    return (x_train - mean) / std, (x_test - mean) / std


def to_tensors(name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray,
               y_test: np.ndarray, num_classes: int, scale: float = 1.0,
               augmentation: str | None = None, source: str = "") -> Dataset:
    """Build a normalized :class:`Dataset` from numpy splits; inputs are divided by ``scale`` first.

    Normalization is per channel with the train split's mean and std, done in place to keep
    peak memory near one copy of the data.
    """
    xtr = torch.from_numpy(np.ascontiguousarray(x_train)).float().div_(scale)
    xte = torch.from_numpy(np.ascontiguousarray(x_test)).float().div_(scale)
    mean, std = channel_stats(xtr)
    xtr.sub_(mean).div_(std)
    xte.sub_(mean).div_(std)
    return Dataset(name, xtr, torch.from_numpy(np.asarray(y_train, dtype=np.int64)),
                   xte, torch.from_numpy(np.asarray(y_test, dtype=np.int64)),
                   num_classes, augmentation, source)
