"""The sequential engine's general backend: autograd, one client's row at a time on the one reused module."""
from __future__ import annotations

from typing import Callable

import torch

from fedflat.engine.gradients.backend import Backend
from fedflat.engine.gradients.objectives import DATA_LOSS

Pass = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class PerClient(Backend):
    """Each client's objective on its real samples (padding dropped), differentiated by autograd with respect to
    its per-tensor views (:meth:`fedflat.engine.gradients.forward.Forward.leaves`)."""

    def loss_grad(self, W, batch, objective):
        forward = self.forward
        prepared = objective.prepare(self, W, batch)
        forward.mode(True)  # (a term's preparation was an evaluation)
        losses, grads = [], []
        for c in range(W.shape[0]):
            x, y = batch.row(c)
            views = forward.leaves(W[c])
            total, reported = objective(forward, views, forward.arranged(x), y,
                                        *objective.row(prepared, c, batch.real(c)))
            grads.append(forward.flat(torch.autograd.grad(total, views), ()))
            losses.append(reported.detach())
        return torch.stack(losses), torch.stack(grads)

    def data_pass(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, g[P])`` of one client's data loss (the pass an accelerated backend graphs or replaces)."""
        forward = self.forward
        views = forward.leaves(w)
        loss, _ = DATA_LOSS(forward, views, forward.arranged(x), y)
        return loss.detach(), forward.flat(torch.autograd.grad(loss, views), ())

    @staticmethod
    def rows(W: torch.Tensor, batch, one: Pass) -> tuple[torch.Tensor, torch.Tensor]:
        """``one(w_c, x_c, y_c)`` of every client's row and real samples, stacked."""
        if W.shape[0] == 1 and batch.weight is None:
            loss, grad = one(W[0], batch.x[0], batch.y[0])
            return loss.unsqueeze(0), grad.unsqueeze(0)
        pairs = [one(W[c], *batch.row(c)) for c in range(W.shape[0])]
        return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])

    @torch.no_grad()
    def loss(self, W, batch):
        forward = self.forward
        forward.mode(False)
        losses = []
        for c in range(W.shape[0]):
            x, y = batch.row(c)
            losses.append(DATA_LOSS(forward, tuple(forward.model.layout.views(W[c])), forward.arranged(x), y)[0])
        return torch.stack(losses)
