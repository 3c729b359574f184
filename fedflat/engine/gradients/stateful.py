"""The backends of a module with buffers, dropout or batch statistics: every pass with its own client's state.

A module with buffers, dropout or batch statistics (:class:`fedflat.engine.modes.ModelTraits`) is run per client
within a :class:`~fedflat.engine.gradients.session.ClientSession` that :func:`fedflat.engine.client.fit` opens:
training passes in ``train()`` mode, each client with its own buffers (``[C, Q]``) and its own dropout masks, a
step's batch never padded (clients of the vectorized engine are grouped by their batch's length), and the buffers
a local step leaves are those of its first training pass (:meth:`ClientSession.first_pass`). Loss evaluations
without a gradient and a distillation teacher's logits run in ``eval()`` mode with the buffers the clients started
from.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Iterator

import torch

from fedflat.core import Batch, ConfigError, stream_seed, torch_stream
from fedflat.engine.gradients.backend import Backend
from fedflat.engine.gradients.forward import Forward
from fedflat.engine.gradients.objectives import DATA_LOSS, Objective
from fedflat.engine.gradients.session import ClientSession
from fedflat.engine.modes import DropoutCall, ModelTraits, Replay, draw_keep, drawing, recording


class Stateful(Backend):
    """What both stateful backends share: the open session (:meth:`clients`), and the evaluations with the
    clients' own buffers."""

    def __init__(self, forward: Forward, traits: ModelTraits):
        super().__init__(forward)
        self.traits = traits
        self.session: ClientSession | None = None

    @contextmanager
    def clients(self, ids, round, seed, buffers) -> Iterator[ClientSession]:
        """The :class:`ClientSession` of the clients ``ids`` of round ``round`` starting from ``buffers[C, Q]``
        (None: a model without buffers). A module drawing random numbers outside dropout draws them from the
        global generator seeded from its client's stream ``"forward"`` (the sequential engine: one client at a
        time)."""
        device = self.forward.model.initial.device
        if buffers is None:
            buffers = torch.zeros(len(ids), 0, dtype=torch.float64, device=device)
        dropout = [torch_stream(seed, round, i, "dropout", device) for i in ids] if self.traits.dropout else None
        session = ClientSession(buffers.to(device, torch.float64), dropout)
        previous, self.session = self.session, session
        try:
            with self._keyed_global_stream(ids, round, seed):
                yield session
        finally:
            self.session = previous

    @contextmanager
    def _keyed_global_stream(self, ids: list[int], round: int, seed: int) -> Iterator[None]:
        if self.traits.random is None:
            yield
            return
        if len(ids) != 1:
            raise RuntimeError(f"a module drawing {self.traits.random} in its forward trains one client at a time")
        device = self.forward.model.initial.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(stream_seed(seed, round, ids[0], "forward"))
            yield

    def open_session(self, rows: int) -> ClientSession:
        session = self.session
        if session is None or session.size != rows:
            raise RuntimeError(f"the oracle of a module with buffers, dropout or batch statistics computes the clients "
                               f"of an open ClientSession (fit opens it); got {rows} rows for "
                               f"{'no session' if session is None else f'a session of {session.size}'}")
        return session

    def _training(self, W: torch.Tensor, objective: Objective) -> tuple[ClientSession, bool]:
        """The session of a training call, and whether the pass updates the buffers."""
        if objective.stateful_refusal:
            raise ConfigError(objective.stateful_refusal)
        session = self.open_session(W.shape[0])
        return session, session.first_pass() and self.forward.model.buffer_layout.size > 0

    @torch.no_grad()
    def cohort_logits(self, w, x):
        """Each client's rows of ``x[C, B, ...]`` at ``w`` with the buffers it started from."""
        start = self.open_session(x.shape[0]).start
        return torch.stack([self._eval_logits(w, start[c], x[c]) for c in range(x.shape[0])])

    @torch.no_grad()
    def client_logits(self, w, x, c):
        """Client ``c``'s samples ``x[n, ...]`` at ``w`` with the buffers it started from."""
        session = self.session
        start = self.open_session(0 if session is None else session.size).start
        return self._eval_logits(w, start[c], x)

    @torch.no_grad()
    def loss(self, W, batch):
        """Each client's loss in ``eval()`` mode with its current buffers."""
        buffers, losses = self._eval_buffers(W.shape[0]), []
        for c in range(W.shape[0]):
            x, y = batch.row(c)
            logits = self._eval_logits(W[c], buffers[c], self.forward.arranged(x))
            losses.append(DATA_LOSS.value(self.forward, logits, y))
        return torch.stack(losses)

    def _eval_buffers(self, rows: int) -> torch.Tensor:
        """The buffers of an eval-mode loss of ``rows`` clients: the session's, or for one row (q-FedAvg's ``F_i``,
        client by client) the cohort's when all its clients have the same."""
        session = self.session
        if session is not None and rows == 1 and bool((session.buffers == session.buffers[:1]).all()):
            return session.buffers[:1]
        return self.open_session(rows).buffers

    def _eval_logits(self, w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Logits of one client's ``x`` at ``w`` with the buffers ``b``, in ``eval()`` mode."""
        model = self.forward.model
        model.module.eval()
        model.bind_buffers(model.buffer_layout.tensors(b))
        return self.forward.logits(tuple(model.layout.views(w)), x)


class StatefulPerClient(Stateful):
    """The sequential engine's: one client's training pass at a time on its real samples, its buffers bound and its
    dropout masks drawn from its stream as the calls come."""

    def loss_grad(self, W, batch, objective):
        session, update = self._training(W, objective)
        forward, layout = self.forward, self.forward.model.buffer_layout
        losses, grads = [], []
        for c in range(W.shape[0]):
            x, y = batch.row(c)
            extra = objective.prepare_client(self, x, c)  # (one client's shapes: the same bits in any cohort)
            forward.model.module.train()
            views = forward.leaves(W[c])
            tensors = layout.tensors(session.buffers[c])
            forward.model.bind_buffers(tensors)
            with drawing(session.dropout[c]) if session.dropout else nullcontext():
                total, reported = objective(forward, views, forward.arranged(x), y, *extra)
            grads.append(forward.flat(torch.autograd.grad(total, views), ()))
            losses.append(reported.detach())
            if update:
                session.commit(torch.tensor([c], device=session.buffers.device),
                               layout.pack([t.detach() for t in tensors])[None])
        return torch.stack(losses), torch.stack(grads)


class StatefulGroups(Stateful):
    """The vectorized engine's: the clients whose batches have the same number of real samples under one ``vmap``
    (no padding), with stacked buffers and the dropout masks each client's stream gives, drawn before the call."""

    def __init__(self, forward: Forward, traits: ModelTraits):
        super().__init__(forward, traits)
        self._dropout_calls: dict[tuple, tuple[DropoutCall, ...]] = {}

    def loss_grad(self, W, batch, objective):
        session, update = self._training(W, objective)
        prepared = objective.prepare(self, W, batch)
        self.forward.model.module.train()
        losses = torch.empty(W.shape[0], dtype=W.dtype, device=W.device)
        grads = torch.empty_like(W)
        for rows, length in equal_lengths(batch):
            losses[rows], grads[rows] = self._group(session, rows, length, W, batch, objective, prepared, update)
        return losses, grads

    def _group(self, session: ClientSession, rows: torch.Tensor, length: int, W: torch.Tensor, batch: Batch,
               objective: Objective, prepared: tuple, update: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The training passes of the clients ``rows``, whose batches have ``length`` real samples."""
        model = self.forward.model
        x, y = batch.x[rows, :length], batch.y[rows, :length]
        Wg = W[rows].detach()
        buffers = tuple(model.buffer_layout.tensors(session.buffers[rows]))
        calls = self._dropout_shapes(Wg[0], session.buffers[rows[0]], x[0]) if session.dropout else ()
        keeps = self._keeps(session, rows.tolist(), calls)
        extra = tuple(t[rows, :length] for t in prepared)  # (a distillation teacher's per-sample log-probabilities)
        client = partial(self._client_pass, objective=objective, calls=calls)
        grads, (_, (reported, new)) = torch.func.vmap(torch.func.grad_and_value(client, has_aux=True))(
            self.forward.views(Wg), buffers, keeps, x, y, *extra)
        if update:
            session.commit(rows, model.buffer_layout.pack(list(new)))
        return reported, self.forward.flat(grads, (len(rows),))

    def _client_pass(self, views: tuple[torch.Tensor, ...], buffers: tuple[torch.Tensor, ...],
                     keeps: tuple[torch.Tensor, ...], x: torch.Tensor, y: torch.Tensor, *extra: torch.Tensor,
                     objective: Objective, calls: tuple[DropoutCall, ...]):
        """One client's training pass inside ``vmap``: ``(objective, (reported loss, its updated buffers))``."""
        own = [b.clone() for b in buffers]
        self.forward.model.bind_buffers(own)
        with Replay(keeps, calls) if calls else nullcontext():
            total, reported = objective(self.forward, views, x, y, *extra)
        return total, (reported, tuple(own))

    @torch.no_grad()
    def _dropout_shapes(self, w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> tuple[DropoutCall, ...]:
        """The dropout calls of a training pass on one client's batch ``x`` (found once per batch shape)."""
        key = (tuple(x.shape), x.dtype)
        if key not in self._dropout_calls:
            model = self.forward.model
            model.bind_buffers(model.buffer_layout.tensors(b))
            with recording() as record:
                self.forward.logits(tuple(model.layout.views(w)), x)
            self._dropout_calls[key] = tuple(record.calls)
        return self._dropout_calls[key]

    @staticmethod
    def _keeps(session: ClientSession, rows: list[int], calls: tuple[DropoutCall, ...]) -> tuple[torch.Tensor, ...]:
        """``[G, *shape]`` keep-masks per call, each client's drawn from its own stream in call order (as the
        sequential engine draws them); a client whose steps are exhausted draws none."""
        if not calls:
            return ()
        active = session.active.tolist() if session.active is not None else [True] * session.size
        device = session.dropout[0].device
        per_client = [[draw_keep(call, session.dropout[r]) if active[r] else
                       torch.ones(call.shape, dtype=torch.bool, device=device) for call in calls] for r in rows]
        return tuple(torch.stack([masks[j] for masks in per_client]) for j in range(len(calls)))


def equal_lengths(batch: Batch) -> list[tuple[torch.Tensor, int]]:
    """The rows of a cohort's batch grouped by their number of real samples (longest first), so no group is padded."""
    C, B = batch.y.shape[:2]
    if batch.weight is None:
        return [(torch.arange(C, device=batch.y.device), B)]
    lengths = (batch.weight > 0).sum(1)
    return [((lengths == n).nonzero().flatten(), int(n)) for n in lengths.unique().flip(0).tolist()]
