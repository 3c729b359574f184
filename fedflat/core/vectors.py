"""Flat parameter vectors and the row-wise helpers parts compute with.

Every algorithm in fedflat works on a model's parameters as ONE flat vector ``w`` of length ``P``
(or a stack ``W`` of shape ``[C, P]``, one row per client). Norms such as the SAM radius
``||eps||`` are then single L2 norms over all parameters, client state is a flat tensor, and
aggregation is one weighted sum. :class:`ParamLayout` knows where each named tensor lives inside
the vector (per-tensor filters such as FedFFT's work through it).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch import nn

NORM_EPS = 1e-12


def row_norm(X: torch.Tensor) -> torch.Tensor:
    """One L2 norm per row of ``X[C, P]`` over all parameters, shape ``[C, 1]``."""
    return X.norm(dim=-1, keepdim=True)


def normalize_rows(X: torch.Tensor, radius: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``radius * X / (||X|| + 1e-12)`` row by row (the SAM ascent step of the spec)."""
    return radius * X / (row_norm(X) + NORM_EPS)


@dataclass(frozen=True)
class ParamLayout:
    """Names, shapes and offsets of a model's parameters inside a flat vector."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, model: nn.Module) -> "ParamLayout":
        names, shapes, offsets, offset = [], [], [], 0
        for name, p in model.named_parameters():
            names.append(name)
            shapes.append(p.shape)
            offsets.append(offset)
            offset += p.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(prod(s) for s in self.shapes)

    @property
    def size(self) -> int:
        """``P``, the number of scalar parameters."""
        return sum(self.numels)

    def segments(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-tensor slices ``[..., numel_j]`` of ``flat[..., P]`` (views, no copy)."""
        return [flat[..., o:o + n] for o, n in zip(self.offsets, self.numels)]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-tensor views ``[..., *shape_j]`` of ``flat[..., P]``."""
        lead = flat.shape[:-1]
        return [seg.view(*lead, *shape) for seg, shape in zip(self.segments(flat), self.shapes)]

    def flatten(self, model: nn.Module) -> torch.Tensor:
        """The model's current parameters as one detached flat vector."""
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
