"""Batched train-time augmentation on the training device (no per-sample Python loop)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

__all__ = ["AUGMENTATIONS", "apply_augmentation", "augmentation_fn", "cifar_augment", "crop_flip", "flip_augment"]


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
    """Apply the augmentation ``name`` (a :attr:`Dataset.augmentation` value) to a batch; None: unchanged."""
    augment = augmentation_fn(name)
    return x if augment is None else augment(x, generator)
