"""The gradient oracle: loss and gradient of each client's objective at its own parameters.

Both engines call the same oracle interface with a leading client dimension ``C``:
``loss_grad(W[C, P], batch) -> (loss[C], g[C, P])``. The sequential oracle loops over the rows on
one reused model; the vectorized oracle runs all rows at once with ``torch.func.vmap``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedflat.params import FlatModel


@dataclass
class Batch:
    """One local step's mini-batches of a cohort: ``x[C, B, ...]``, ``y[C, B]``.

    ``weight[C, B]`` (1 for a real sample, 0 for padding) is set only when clients' batches had to be
    padded to a common size; the loss is then the mean over real samples.
    """

    x: torch.Tensor
    y: torch.Tensor
    weight: torch.Tensor | None = None


class Oracle:
    """Stochastic loss and gradient ``g(w)`` for a cohort, counting backprops.

    ``backprops`` counts per-client backward passes, so a method's "backprops per local step"
    (seed 002, Table 7) can be measured rather than declared.
    """

    def __init__(self, model: FlatModel, vectorized: bool = False):
        self.model = model
        self.vectorized = vectorized
        self.backprops = 0
        if vectorized:
            self._vgrad = torch.func.vmap(torch.func.grad_and_value(self._weighted_loss))
            self._vloss = torch.func.vmap(self._weighted_loss)

    def _weighted_loss(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(self.model(w, x), y, reduction="none")
        return (losses * weight).sum() / weight.sum()

    def _loss_grad_one(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = w.detach().requires_grad_(True)
        loss = F.cross_entropy(self.model(leaf, x), y)
        (grad,) = torch.autograd.grad(loss, leaf)
        return loss.detach(), grad

    def loss_grad(self, W: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss[C], g[C, P])`` of each client's mini-batch loss at its row of ``W``."""
        C = W.shape[0]
        self.backprops += C
        if self.vectorized:
            weight = batch.weight if batch.weight is not None else torch.ones(batch.y.shape, device=W.device)
            grad, loss = self._vgrad(W.detach(), batch.x, batch.y, weight)
            return loss, grad
        if C == 1:
            loss, grad = self._loss_grad_one(W[0], batch.x[0], batch.y[0])
            return loss.unsqueeze(0), grad.unsqueeze(0)
        pairs = [self._loss_grad_one(W[c], batch.x[c], batch.y[c]) for c in range(C)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    @torch.no_grad()
    def loss(self, W: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``loss[C]`` without a backward pass."""
        if self.vectorized:
            weight = batch.weight if batch.weight is not None else torch.ones(batch.y.shape, device=W.device)
            return self._vloss(W, batch.x, batch.y, weight)
        return torch.stack([F.cross_entropy(self.model(W[c], batch.x[c]), batch.y[c]) for c in range(W.shape[0])])
