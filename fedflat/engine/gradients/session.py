"""The per-client state a stateful module's passes compute with (its buffers and dropout streams)."""
from __future__ import annotations

import torch


class ClientSession:
    """The cohort a stateful module's oracle calls compute (:func:`fedflat.engine.client.fit` opens one per chunk).

    ``buffers[C, Q]``: each client's buffers, which the first training pass of every local step updates
    (``step`` marks a step's start; ``active`` rows only: a client whose steps are exhausted keeps its own);
    ``start``: the buffers the clients started from (eval-mode passes); ``dropout``: each client's generator of
    dropout masks, ``torch_stream(seed, round, client, "dropout")``."""

    def __init__(self, buffers: torch.Tensor, dropout: list[torch.Generator] | None):
        self.start = buffers
        self.buffers = buffers.clone()
        self.dropout = dropout
        self.active: torch.Tensor | None = None
        self.fresh = False

    @property
    def size(self) -> int:
        return int(self.buffers.shape[0])

    def step(self, active: torch.Tensor | None) -> None:
        """A local step begins: its first training pass updates the buffers of the ``active`` rows."""
        self.active, self.fresh = active, True

    def first_pass(self) -> bool:
        """Whether this training pass is the step's first (it updates the buffers); later passes of the step
        (SAM's descent at ``w + eps`` after its ascent at ``w``) leave them, as ``disable_running_stats`` does in
        the SAM authors' code."""
        first, self.fresh = self.fresh, False
        return first

    def commit(self, rows: torch.Tensor, new: torch.Tensor) -> None:
        """The buffers ``new[G, Q]`` of the clients at positions ``rows``, where active."""
        if self.active is not None:
            new = torch.where(self.active[rows][:, None], new, self.buffers[rows])
        self.buffers[rows] = new
