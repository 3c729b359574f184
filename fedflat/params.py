"""Flat parameter vectors.

Every algorithm in fedflat works on a model's parameters as ONE flat vector ``w`` of length ``P``
(or a stack ``W`` of shape ``[C, P]``, one row per client). Norms such as the SAM radius
``||eps||`` are then single L2 norms over all parameters, client state is a flat tensor, and
aggregation is one weighted sum. :class:`ParamLayout` knows where each named tensor lives inside
the vector; :class:`FlatModel` runs an ``nn.Module`` at any flat vector, batched or not, without
copying parameters (views are bound into the module), which also works under ``torch.func.vmap``.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from torch import nn


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


class FlatModel:
    """Evaluates an ``nn.Module`` at a flat parameter vector.

    The module's ``nn.Parameter`` objects are removed once; before each call, views of the given flat
    vector are bound in their place. Gradients with respect to that vector are then one
    ``autograd.grad`` call, with no concatenation, and the same code runs batched under ``vmap``.
    """

    def __init__(self, module: nn.Module):
        self.layout = ParamLayout.of(module)
        self.initial = self.layout.flatten(module)
        self.module = module
        self._slots: list[tuple[nn.Module, str]] = []
        for name in self.layout.names:
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            del owner._parameters[attr]
            self._slots.append((owner, attr))
        self.bind(self.initial)

    def bind(self, flat: torch.Tensor) -> None:
        """Makes the module's parameters views of ``flat`` (shape ``[P]``)."""
        for (owner, attr), view in zip(self._slots, self.layout.views(flat)):
            owner.__dict__[attr] = view

    def __call__(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.bind(flat)
        return self.module(x)

    def call_views(self, views, x: torch.Tensor) -> torch.Tensor:
        """The module at per-tensor ``views`` (as from ``layout.views``): lets autograd differentiate
        with respect to each tensor directly (the engine's oracle), also under ``vmap``."""
        for (owner, attr), view in zip(self._slots, views):
            owner.__dict__[attr] = view
        return self.module(x)

    def features(self, flat: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Penultimate-layer features at ``flat`` (models expose ``features``)."""
        self.bind(flat)
        return self.module.features(x)

    def state_dict(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{name: tensor}`` for ``flat``, loadable by a fresh module's ``load_state_dict``."""
        return {n: v.detach().clone() for n, v in zip(self.layout.names, self.layout.views(flat))}
