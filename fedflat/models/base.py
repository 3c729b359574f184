"""Common base class for fedflat models, and the normalization layers the built-in models choose from.

Every model is split into a feature extractor and a linear ``head`` so that
``forward(x) == head(features(x))`` holds by construction; ``features`` gives the
penultimate-layer representation used for t-SNE plots.

The built-in models default to what the seed papers train: GroupNorm in the ResNet family and DenseNet (no
running statistics), no normalization and no dropout in the CNN. ``norm: group | batch | none`` (and the CNN's
``dropout``) give the common BatchNorm and dropout variants; fedflat federates BatchNorm's statistics as buffers
and keys dropout to each client's stream. What any module must satisfy, a user's included, is in docs/models.md.
"""

from __future__ import annotations

import math
import numbers
from typing import Sequence

import torch
from torch import nn


class FedModel(nn.Module):
    """A classifier ``head(features(x))`` with metadata about its inputs.

    Attributes:
        input_shape: per-example input shape (without the batch dimension).
        num_classes: number of output logits.
        feature_dim: size ``D`` of the representation returned by ``features``.
        input_dtype: dtype the model expects (``torch.float32`` or ``torch.long``).
        head: the final linear classifier mapping ``[B, D] -> [B, num_classes]``.
    """

    input_dtype: torch.dtype = torch.float32

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__()
        self.input_shape = tuple(int(s) for s in input_shape)
        self.num_classes = int(num_classes)
        self.feature_dim = 0  # set by subclasses

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """Return the penultimate-layer representation ``[B, feature_dim]`` of the batch ``x``."""
        raise NotImplementedError(f"{type(self).__name__} must implement features()")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return the logits ``[B, num_classes]`` of the batch ``x``."""
        return self.head(self.features(x))

    def extra_repr(self) -> str:
        return (f"input_shape={self.input_shape}, num_classes={self.num_classes}, "
                f"feature_dim={self.feature_dim}")


def check_positive_int(name: str, value: object) -> int:
    """Validate that ``value`` is a positive integer and return it as ``int``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def check_common(input_shape: Sequence[int], num_classes: int) -> tuple[int, ...]:
    """Validate ``input_shape`` / ``num_classes`` and return the shape as a tuple."""
    shape = tuple(input_shape)
    if not shape:
        raise ValueError("input_shape must have at least one dimension")
    for s in shape:
        check_positive_int("input_shape entries", s)
    check_positive_int("num_classes", num_classes)
    return tuple(int(s) for s in shape)


def check_image_shape(model: str, input_shape: Sequence[int]) -> tuple[int, int, int]:
    """Validate a ``(C, H, W)`` image shape for convolutional models."""
    if len(input_shape) != 3:
        raise ValueError(f"{model} expects input_shape (C, H, W), got {tuple(input_shape)}")
    c, h, w = (int(s) for s in input_shape)
    return c, h, w


def flat_size(input_shape: Sequence[int]) -> int:
    """Number of features after flattening an input of ``input_shape``."""
    return int(math.prod(input_shape))


NORMS = ("group", "batch", "none")


def check_norm(model: str, norm: str) -> str:
    """Validate a ``norm`` option (:data:`NORMS`)."""
    if norm not in NORMS:
        raise ValueError(f"{model} norm must be one of {', '.join(NORMS)}, got {norm!r}")
    return norm


def norm_layer(norm: str, channels: int, groups: int = 2) -> nn.Module:
    """The normalization of ``channels`` feature maps: ``GroupNorm(groups, channels)`` (the seeds', no buffers),
    ``BatchNorm2d(channels)`` (running statistics, federated as buffers) or none (``nn.Identity``)."""
    if norm == "group":
        return nn.GroupNorm(groups, channels)
    if norm == "batch":
        return nn.BatchNorm2d(channels)
    return nn.Identity()
