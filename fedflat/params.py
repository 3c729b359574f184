"""A module run at a flat parameter vector.

:class:`FlatModel` runs an ``nn.Module`` at any flat vector ``w[P]`` (:class:`fedflat.core.ParamLayout` says
where each tensor lives in it), batched or not, without copying parameters (views are bound into the
module), which also works under ``torch.func.vmap``.
"""
from __future__ import annotations

import torch
from torch import nn

from fedflat.core.vectors import ParamLayout

__all__ = ["FlatModel", "ParamLayout"]


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
