"""The model's training pass at per-tensor views, shared by every gradient backend."""
from __future__ import annotations

from contextlib import nullcontext

import torch

from fedflat.core import ConfigError
from fedflat.engine.losses import LossFn
from fedflat.params import FlatModel

# The activation modules whose outputs MAN's penalty reads (the hidden layers' nonlinearities)
ACTIVATIONS = (torch.nn.ReLU, torch.nn.ReLU6, torch.nn.LeakyReLU, torch.nn.ELU, torch.nn.GELU, torch.nn.SiLU,
               torch.nn.Tanh, torch.nn.Sigmoid, torch.nn.Softplus, torch.nn.Mish, torch.nn.Hardtanh)


class Forward:
    """``model`` evaluated at one client's per-tensor ``views`` (the leaves a backend differentiates), in its
    precision and memory order, with the run's per-sample ``loss`` (None: cross-entropy)."""

    def __init__(self, model: FlatModel, precision: str = "float32", channels_last: bool = False,
                 loss: LossFn | None = None, graphed: bool = False):
        self.model = model
        self.loss_fn = loss
        self.autocast = {"float32": None, "bf16": torch.bfloat16}[precision]
        self.channels_last = channels_last
        self.graphed = graphed  # passes captured in CUDA graphs (autocast's weight cache off)

    def logits(self, views: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
        """The model's forward pass at ``views``; with ``precision: bf16`` under ``torch.autocast`` (matrix
        products and convolutions in bfloat16, reductions and normalizations in float32, as autocast decides),
        the logits returned in float32. Parameters and gradients stay float32 leaves either way."""
        if self.autocast is None:
            return self.model.call_views(views, x)
        with self._autocast(x):
            logits = self.model.call_views(views, x)
        return logits.float()

    def logits_features(self, views: tuple[torch.Tensor, ...], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logits, z)`` of the module at ``views``: ``z = features(x)``, ``logits = head(z)`` (a fedflat model's
        ``forward``, :class:`fedflat.models.base.FedModel`), in float32 as :meth:`logits` gives them."""
        module = self.model.module
        if not (hasattr(module, "features") and hasattr(module, "head")):
            raise ValueError(f"{type(module).__name__} has no features()/head split: a representation loss (MOON) "
                             "needs a model whose forward is head(features(x)) (docs/models.md)")
        for owner, attr, j in self.model._slots:
            owner.__dict__[attr] = views[j]
        with self._autocast(x) if self.autocast is not None else nullcontext():
            z = module.features(x)
            logits = module.head(z)
        return logits.float(), z.float()

    def _autocast(self, x: torch.Tensor) -> torch.autocast:
        # (autocast's cache of cast weights would hold tensors of a graph's capture past it: off under CUDA graphs)
        return torch.autocast(x.device.type, dtype=self.autocast, cache_enabled=not self.graphed)

    def arranged(self, x: torch.Tensor) -> torch.Tensor:
        """One client's image batch in channels-last memory order when ``channels_last`` is set (cuDNN's
        tensor-core convolutions want NHWC). Only outside ``vmap``, which cannot change a memory format: the
        vectorized engine keeps its grouped convolutions' layout."""
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last and x.dim() == 4 else x

    def activations(self) -> list[torch.nn.Module]:
        """The module's activation modules (:data:`ACTIVATIONS`), whose outputs FedMAN's penalty reads."""
        modules = [m for m in self.model.module.modules() if isinstance(m, ACTIVATIONS)]
        if not modules:
            raise ConfigError(f"an activation penalty reads the outputs of the model's activation modules "
                             f"({', '.join(a.__name__ for a in ACTIVATIONS)}); {type(self.model.module).__name__} "
                             "has none")
        return modules

    def mode(self, training: bool) -> None:
        """The module's mode for a pass of a module without per-client state, whose passes set none themselves: an
        evaluation (``FlatModel.__call__``, the chunk budget's probe) leaves ``eval()`` mode behind, and a forward
        that reads ``self.training`` would otherwise train in it."""
        if self.model.module.training != training:
            self.model.module.train(training)

    def leaves(self, w: torch.Tensor) -> list[torch.Tensor]:
        """One client's per-tensor views of ``w[P]`` as fresh leaves to differentiate.

        Gradients are taken with respect to these views, not ``w``, and written into one flat ``[P]`` by a single
        ``torch.cat`` (:meth:`flat`): differentiating through the views of one flat leaf would make autograd
        materialise a zero-filled ``[P]`` gradient per tensor and add them up, which costs more than the backward
        pass itself for a small MLP. The values are the same."""
        return [v.detach().requires_grad_(True) for v in self.model.layout.views(w)]

    def views(self, W: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The per-tensor views of the rows ``W[C, P]`` (detached), as ``vmap`` takes them."""
        return tuple(self.model.layout.views(W.detach()))

    @staticmethod
    def flat(grads: tuple[torch.Tensor, ...], lead: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([g.reshape(*lead, -1) for g in grads], dim=-1)
