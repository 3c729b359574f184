"""The gradient oracle: loss and gradient of each client's objective at its own parameters.

Both engines call the same oracle interface with a leading client dimension ``C``:
``loss_grad(W[C, P], batch) -> (loss[C], g[C, P])``. The sequential oracle loops over the rows on
one reused model; the vectorized oracle runs all rows at once with ``torch.func.vmap``.

Gradients are taken with respect to the per-tensor views of ``w`` (not ``w`` itself) and written
into one flat ``[C, P]`` tensor by a single ``torch.cat``: differentiating through the views of one
flat leaf would make autograd materialise a zero-filled ``[P]`` gradient per tensor and add them up,
which costs more than the backward pass itself for a small MLP. The values are the same.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from fedflat.core import Batch, Distillation
from fedflat.params import FlatModel


def distilled_objective(logits: torch.Tensor, y: torch.Tensor, teacher_logp: torch.Tensor, gamma: float, tau: float,
                        weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(CE + gamma tau^2 KL(q || p), CE)`` of a batch, ``q = softmax(z_e / tau)`` the teacher's probabilities
    (``teacher_logp`` their logarithms), ``p = softmax(z / tau)``: Hinton et al.'s distillation loss, the KL being
    ``torch.nn.KLDivLoss(reduction="batchmean")`` of ``log p`` against ``q``. Means over the samples, or with
    ``weight[B]`` (0 for padding) weighted means over the real ones."""
    log_p = F.log_softmax(logits / tau, dim=-1)
    if weight is None:
        ce = F.cross_entropy(logits, y)
        kl = F.kl_div(log_p, teacher_logp, reduction="batchmean", log_target=True)
    else:
        mean = (lambda per_sample: (per_sample * weight).sum() / weight.sum())
        ce = mean(F.cross_entropy(logits, y, reduction="none"))
        kl = mean(F.kl_div(log_p, teacher_logp, reduction="none", log_target=True).sum(-1))
    return ce + gamma * tau ** 2 * kl, ce


class Oracle:
    """Stochastic loss and gradient ``g(w)`` for a cohort, counting backprops.

    ``backprops`` counts per-client backward passes, so a method's "backprops per local step"
    (seed 002, Table 7) can be measured rather than declared; rows of clients whose local steps are
    exhausted (masked padding of the vectorized engine) are not counted.
    """

    def __init__(self, model: FlatModel, vectorized: bool = False, precision: str = "float32",
                 channels_last: bool = False):
        self.model = model
        self.vectorized = vectorized
        self.autocast = {"float32": None, "bf16": torch.bfloat16}[precision]
        self.channels_last = channels_last
        self.backprops = 0
        if vectorized:
            self._vgrad = torch.func.vmap(torch.func.grad_and_value(self._mean_loss))
            self._vgrad_weighted = torch.func.vmap(torch.func.grad_and_value(self._weighted_loss))
            self._vloss = torch.func.vmap(self._mean_loss)
            self._vloss_weighted = torch.func.vmap(self._weighted_loss)

    def _logits(self, views: tuple[torch.Tensor, ...], x: torch.Tensor) -> torch.Tensor:
        """The model's forward pass at ``views``; with ``precision: bf16`` under ``torch.autocast`` (matrix
        products and convolutions in bfloat16, reductions and normalizations in float32, as autocast decides),
        the logits returned in float32. Parameters and gradients stay float32 leaves either way."""
        if self.autocast is None:
            return self.model.call_views(views, x)
        with torch.autocast(x.device.type, dtype=self.autocast):
            logits = self.model.call_views(views, x)
        return logits.float()

    def _arranged(self, x: torch.Tensor) -> torch.Tensor:
        """One client's image batch in channels-last memory order when ``channels_last`` is set (cuDNN's
        tensor-core convolutions want NHWC). Only outside ``vmap``, which cannot change a memory format: the
        vectorized engine keeps its grouped convolutions' layout."""
        return x.contiguous(memory_format=torch.channels_last) if self.channels_last and x.dim() == 4 else x

    # Per-client losses of the tensors ``views`` (one client's parameters, per tensor).
    def _mean_loss(self, views: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self._logits(views, x), y)

    def _weighted_loss(self, views: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor,
                       weight: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(self._logits(views, x), y, reduction="none")
        return (losses * weight).sum() / weight.sum()

    def _distilled_loss(self, views: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor,
                        teacher_logp: torch.Tensor, weight: torch.Tensor | None = None, *, gamma: float,
                        tau: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(objective, CE)`` of one client's batch."""
        return distilled_objective(self._logits(views, x), y, teacher_logp, gamma, tau, weight)

    @torch.no_grad()
    def teacher_log_probs(self, distill: Distillation, x: torch.Tensor) -> torch.Tensor:
        """``log softmax(f(teacher, x) / tau)`` of a cohort's batch ``x[C, B, ...]`` in one forward pass, ``[C, B, K]``."""
        C, B = x.shape[:2]
        logits = self.model(distill.teacher, x.reshape(C * B, *x.shape[2:]))
        return F.log_softmax(logits / distill.temperature, dim=-1).reshape(C, B, -1)

    def _loss_grad_distilled(self, W: torch.Tensor, batch: Batch,
                             distill: Distillation) -> tuple[torch.Tensor, torch.Tensor]:
        """``(CE[C], grad[C, P])`` of the distilled objective; the reported loss is the data loss, as it is for
        methods whose regularizer enters through the gradient (FedProx, FedDyn)."""
        C = W.shape[0]
        teacher_logp = self.teacher_log_probs(distill, batch.x)
        objective = partial(self._distilled_loss, gamma=distill.weight, tau=distill.temperature)
        if self.vectorized:
            views = tuple(self.model.layout.views(W.detach()))
            padded = () if batch.weight is None else (batch.weight,)
            grads, (_, ce) = torch.func.vmap(torch.func.grad_and_value(objective, has_aux=True))(
                views, batch.x, batch.y, teacher_logp, *padded)
            return ce, self._flat(grads, (C,))
        losses, rows = [], []
        for c in range(C):
            views = [v.detach().requires_grad_(True) for v in self.model.layout.views(W[c])]
            x, y = batch.row(c)
            total, ce = objective(views, self._arranged(x), y, teacher_logp[c][batch.real(c)])
            rows.append(self._flat(torch.autograd.grad(total, views), ()))
            losses.append(ce.detach())
        return torch.stack(losses), torch.stack(rows)

    def _flat(self, grads: tuple[torch.Tensor, ...], lead: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([g.reshape(*lead, -1) for g in grads], dim=-1)

    def _loss_grad_one(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        views = [v.detach().requires_grad_(True) for v in self.model.layout.views(w)]
        loss = self._mean_loss(views, self._arranged(x), y)
        grads = torch.autograd.grad(loss, views)
        return loss.detach(), self._flat(grads, ())

    def loss_grad(self, W: torch.Tensor, batch: Batch,
                  distill: Distillation | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss[C], g[C, P])`` of each client's mini-batch loss at its row of ``W``; with ``distill``, ``g`` is
        the gradient of the loss plus the distillation term (:func:`distilled_objective`)."""
        C = W.shape[0]
        self.backprops += C if batch.clients is None else batch.clients
        if distill is not None:
            return self._loss_grad_distilled(W, batch, distill)
        if self.vectorized:
            views = tuple(self.model.layout.views(W.detach()))
            if batch.weight is None:
                grads, loss = self._vgrad(views, batch.x, batch.y)
            else:
                grads, loss = self._vgrad_weighted(views, batch.x, batch.y, batch.weight)
            return loss, self._flat(grads, (C,))
        if C == 1 and batch.weight is None:
            loss, grad = self._loss_grad_one(W[0], batch.x[0], batch.y[0])
            return loss.unsqueeze(0), grad.unsqueeze(0)
        pairs = [self._loss_grad_one(W[c], *batch.row(c)) for c in range(C)]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    @torch.no_grad()
    def loss(self, W: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``loss[C]`` without a backward pass."""
        if self.vectorized:
            views = tuple(self.model.layout.views(W))
            if batch.weight is None:
                return self._vloss(views, batch.x, batch.y)
            return self._vloss_weighted(views, batch.x, batch.y, batch.weight)
        losses = []
        for c in range(W.shape[0]):
            x, y = batch.row(c)
            losses.append(self._mean_loss(tuple(self.model.layout.views(W[c])), self._arranged(x), y))
        return torch.stack(losses)
