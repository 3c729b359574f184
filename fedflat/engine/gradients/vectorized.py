"""The vectorized engine's general backend: a cohort's clients at once under ``torch.func.vmap``."""
from __future__ import annotations

from functools import partial

import torch

from fedflat.engine.gradients.backend import Backend
from fedflat.engine.gradients.objectives import DATA_LOSS, Objective


def _gradient(objective: Objective, forward):
    """``vmap`` of ``grad_and_value`` of one client's ``objective``: ``(grads, (objective, reported))``."""
    return torch.func.vmap(torch.func.grad_and_value(partial(objective, forward), has_aux=True))


class Vectorized(Backend):
    """Every row's objective in one ``vmap``ped pass: stacked per-tensor views of ``W[C, P]``, the padded batches'
    ``weight[C, B]`` last (each client's loss the mean over its real samples)."""

    def __init__(self, forward):
        super().__init__(forward)
        self._data = _gradient(DATA_LOSS, forward)
        self._loss = torch.func.vmap(lambda *inputs: DATA_LOSS(forward, *inputs)[0])

    def loss_grad(self, W, batch, objective):
        prepared = objective.prepare(self, W, batch)
        self.forward.mode(True)  # (a term's preparation was an evaluation)
        padded = () if batch.weight is None else (batch.weight,)
        grads, (_, reported) = _gradient(objective, self.forward)(self.forward.views(W), batch.x, batch.y, *prepared,
                                                                  *padded)
        return reported, self.forward.flat(grads, (W.shape[0],))

    def data_pass(self, W: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                  *weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss[C], g[C, P])`` of a chunk's data loss (the pass a CUDA graph replays)."""
        grads, (_, loss) = self._data(self.forward.views(W), x, y, *weight)
        return loss, self.forward.flat(grads, (W.shape[0],))

    @staticmethod
    def rows(W, batch, one):
        """``one(W, x, y[, weight])`` of the whole chunk."""
        return one(W, batch.x, batch.y, *(() if batch.weight is None else (batch.weight,)))

    @torch.no_grad()
    def loss(self, W, batch):
        self.forward.mode(False)
        padded = () if batch.weight is None else (batch.weight,)
        return self._loss(self.forward.views(W), batch.x, batch.y, *padded)
