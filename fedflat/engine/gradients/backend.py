"""What every gradient backend is: ``loss_grad(W, batch, objective) -> (loss[C], grad[C, P])`` and ``loss``; the
sequential engine's general backend (:class:`PerClient`: autograd, one client's row at a time on the one reused
module); and what an accelerated backend adds (:class:`Accelerated`)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from fedflat.core import Batch
from fedflat.engine.gradients.forward import Forward
from fedflat.engine.gradients.objectives import DATA_LOSS, Objective

if TYPE_CHECKING:
    from fedflat.engine.gradients.session import ClientSession

Pass = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class Backend:
    """Loss and gradient of each client's objective at its own row of ``W[C, P]``, computed one way, chosen once per
    run (:func:`fedflat.engine.gradients.choose_backend`). A backend that computes any objective is *general*
    (:attr:`general` is itself); an accelerated one computes the data loss alone faster and leaves every other
    objective to its general backend."""

    gradient = "autograd"  # how the gradient is computed (summary.json's "gradient")

    def __init__(self, forward: Forward):
        self.forward = forward
        self.general: Backend = self  # the backend that computes any objective (a general backend is its own)

    def loss_grad(self, W: torch.Tensor, batch: Batch, objective: Objective) -> tuple[torch.Tensor, torch.Tensor]:
        """``(reported loss[C], g[C, P])``: each client's gradient of ``objective`` on its mini-batch."""
        raise NotImplementedError

    def loss(self, W: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``loss[C]`` without a backward pass (an evaluation, in ``eval()`` mode)."""
        raise NotImplementedError

    @torch.no_grad()
    def cohort_logits(self, w: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``[C, B, K]``: the logits of a cohort's batch ``x[C, B, ...]`` at one model ``w`` (a teacher), one pass in
        ``eval()`` mode."""
        C, B = x.shape[:2]
        return self.forward.model(w, x.reshape(C * B, *x.shape[2:])).reshape(C, B, -1)

    @torch.no_grad()
    def client_logits(self, w: torch.Tensor, x: torch.Tensor, c: int) -> torch.Tensor:
        """``[n, K]``: the logits of client ``c``'s samples ``x[n, ...]`` at one model ``w``, in ``eval()`` mode."""
        return self.forward.model(w, x)

    @contextmanager
    def clients(self, ids: list[int], round: int, seed: int,
                buffers: torch.Tensor | None) -> Iterator[ClientSession | None]:
        """The per-client state the calls inside compute with (None: a module that needs none)."""
        yield None


class PerClient(Backend):
    """Each client's objective on its real samples (padding dropped), differentiated by autograd with respect to
    its per-tensor views (:meth:`fedflat.engine.gradients.forward.Forward.leaves`)."""

    def loss_grad(self, W, batch, objective):
        forward = self.forward
        losses, grads = [], []
        for c in range(W.shape[0]):
            x, y = batch.row(c)
            extra = objective.prepare_client(self, x, c)  # (one client's shapes: the same bits in any cohort)
            forward.mode(True)  # (a term's preparation was an evaluation)
            views = forward.leaves(W[c])
            total, reported = objective(forward, views, forward.arranged(x), y, *extra)
            grads.append(forward.flat(torch.autograd.grad(total, views), ()))
            losses.append(reported.detach())
        return torch.stack(losses), torch.stack(grads)

    def data_pass(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, g[P])`` of one client's data loss (the pass an accelerated backend graphs, compiles or
        replaces)."""
        return autograd_pass(self.forward, w, x, y, self.data_loss)

    def data_loss(self, views: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """One client's data loss at its per-tensor ``views``."""
        return DATA_LOSS(self.forward, views, x, y)[0]

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


def autograd_pass(forward: Forward, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                  data_loss: Callable[[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor], torch.Tensor],
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, g[P])``: ``data_loss(views, x, y)`` at ``w``'s per-tensor views (:meth:`Forward.leaves
    <fedflat.engine.gradients.forward.Forward.leaves>`), differentiated by autograd, the gradient flat."""
    views = forward.leaves(w)
    loss = data_loss(tuple(views), forward.arranged(x), y)
    return loss.detach(), forward.flat(torch.autograd.grad(loss, views), ())


class Accelerated(Backend):
    """A backend that computes the data loss's gradient faster than ``inner`` (a general backend, or another
    accelerated one it builds on) and sends every other objective, and every evaluation, to the general backend.

    ``data_pass(w, x, y[, weight])`` is the data loss's pass of the tensors the general backend's :meth:`rows` hands
    it (one client's, or the vectorized engine's whole chunk)."""

    def __init__(self, inner: Backend):
        super().__init__(inner.forward)
        self.inner = inner
        self.general = inner.general

    @property
    def gradient(self) -> str:
        return self.inner.gradient

    def loss_grad(self, W, batch, objective):
        if not objective.plain:  # a term's objective: the general backend's autograd
            return self.general.loss_grad(W, batch, objective)
        self.forward.mode(True)
        return self.general.rows(W, batch, self.data_pass)

    def data_pass(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def loss(self, W, batch):
        return self.general.loss(W, batch)

    def cohort_logits(self, w, x):
        return self.general.cohort_logits(w, x)

    def client_logits(self, w, x, c):
        return self.general.client_logits(w, x, c)

    def clients(self, ids, round, seed, buffers):
        return self.general.clients(ids, round, seed, buffers)
