"""Empirical objectives on fixed, seeded data subsets: loss, gradient and Hessian-vector products.

Every diagnostic evaluates some ``F(w) = (1/n) sum_j l(w; x_j, y_j)`` (the global training objective,
one client's objective ``F_i``, ...) on a seeded subset of samples that stays the same at every round, so a
curve over rounds shows the model changing, not resampling noise. :class:`DataObjective` computes it in
chunks of samples (memory stays bounded on CNNs); anything with ``loss``/``grad``/``hvp`` (a quadratic in
the tests) can stand in for it.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from fedflat.core import SERVER, numpy_stream
from fedflat.engine.losses import LossFn, mean_loss
from fedflat.params import FlatModel

FIXED = -1  # the round coordinate of draws that stay the same at every round (subsets, directions)


class Objective(Protocol):
    """A scalar function of a flat parameter vector with first and second-order oracles."""

    def loss(self, w: torch.Tensor) -> float: ...

    def grad(self, w: torch.Tensor) -> torch.Tensor: ...

    def hvp(self, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


def seeded_subset(n: int, size: int | None, seed: int, client: int, purpose: str) -> torch.Tensor:
    """Sorted indices of ``min(size, n)`` of ``range(n)`` drawn without replacement from the
    ``(seed, FIXED, client, purpose)`` stream; all of them when ``size`` is None or ``>= n``."""
    if size is None or size >= n:
        return torch.arange(n)
    picks = numpy_stream(seed, FIXED, client, purpose).choice(n, size, replace=False)
    return torch.as_tensor(np.sort(picks), dtype=torch.long)


class DataObjective:
    """Mean loss (``loss``, per-sample losses as :mod:`fedflat.engine.losses` takes them; None: cross-entropy, the
    default) of ``model`` on ``(x, y)``, plus ``wd/2 ||w||^2`` when ``weight_decay`` is set.

    Sums over chunks of ``chunk`` samples weighted by their size, so the result equals the full-batch
    value whatever the chunking. The model runs in ``eval()`` mode with the buffers ``buffers`` (the global
    model's, for a model that has any), so every value is a function of ``w`` alone.
    """

    def __init__(self, model: FlatModel, x: torch.Tensor, y: torch.Tensor, chunk: int = 1000,
                 weight_decay: float = 0.0, buffers: torch.Tensor | None = None, loss: LossFn | None = None):
        if x.shape[0] == 0:
            raise ValueError("an objective needs at least one sample")
        self.model, self.x, self.y, self.buffers = model, x, y, buffers
        self.chunk = chunk
        self.loss_fn = loss
        self.weight_decay = weight_decay

    @property
    def size(self) -> int:
        return int(self.y.shape[0])

    def _chunks(self):
        n = self.size
        for lo in range(0, n, self.chunk):
            hi = min(n, lo + self.chunk)
            yield self.x[lo:hi], self.y[lo:hi], (hi - lo) / n

    def _regularizer(self, w: torch.Tensor) -> torch.Tensor:
        return 0.5 * self.weight_decay * w.pow(2).sum() if self.weight_decay else w.new_zeros(())

    @torch.no_grad()
    def loss(self, w: torch.Tensor) -> float:
        total = sum(share * mean_loss(self.loss_fn, self.model(w, x, self.buffers), y).item()
                    for x, y, share in self._chunks())
        return total + self._regularizer(w).item()

    @torch.no_grad()
    def accuracy(self, w: torch.Tensor) -> float:
        correct = sum((self.model(w, x, self.buffers).argmax(1) == y).sum().item() for x, y, _ in self._chunks())
        return correct / self.size

    def grad(self, w: torch.Tensor) -> torch.Tensor:
        """``nabla F(w)``, shape ``[P]``."""
        total = torch.zeros_like(w)
        for x, y, share in self._chunks():
            leaf = w.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(mean_loss(self.loss_fn, self.model(leaf, x, self.buffers), y), leaf)
            total += share * g
        return total + self.weight_decay * w.detach()

    def hvp(self, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``nabla^2 F(w) v`` by double backward through the flat model (Pearlmutter's trick)."""
        total = torch.zeros_like(w)
        for x, y, share in self._chunks():
            leaf = w.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(mean_loss(self.loss_fn, self.model(leaf, x, self.buffers), y), leaf,
                                       create_graph=True)
            (hv,) = torch.autograd.grad(g @ v, leaf)
            total += share * hv
        return total + self.weight_decay * v


def global_objective(sim, samples: int | None, weight_decay: float = 0.0, purpose: str = "diagnostics/train") -> DataObjective:
    """The global training objective ``F`` on a seeded subset of ``samples`` training samples
    (all clients' data together, i.e. ``F = sum_i (n_i/n) F_i``)."""
    data = sim.dataset
    idx = seeded_subset(data.y_train.shape[0], samples, sim.cfg.seed, -1, purpose).to(data.y_train.device)
    return DataObjective(sim.model, data.features(data.x_train[idx]), data.y_train[idx], weight_decay=weight_decay,
                         buffers=sim.server.buffers, loss=sim.settings.loss)


def client_objective(sim, client: int, samples: int | None, purpose: str = "diagnostics/client") -> DataObjective:
    """Client ``i``'s objective ``F_i`` on a seeded subset of ``samples`` of its training samples."""
    indices = sim.client_indices[client]
    pick = seeded_subset(indices.shape[0], samples, sim.cfg.seed, client, purpose).to(indices.device)
    idx = indices[pick]
    return DataObjective(sim.model, sim.dataset.features(sim.dataset.x_train[idx]), sim.dataset.y_train[idx],
                         buffers=sim.server.buffers, loss=sim.settings.loss)


def seeded_clients(sim, count: int | None, purpose: str = "diagnostics/clients") -> torch.Tensor:
    """A fixed seeded subset of ``count`` client ids (sorted; all clients when ``count`` is None)."""
    N = sim.cfg.data.num_clients
    if count is None or count >= N:
        return torch.arange(N)
    picks = numpy_stream(sim.cfg.seed, FIXED, SERVER, purpose).choice(N, count, replace=False)
    return torch.as_tensor(np.sort(picks), dtype=torch.long)
