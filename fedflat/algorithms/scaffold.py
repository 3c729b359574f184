r"""SCAFFOLD (Karimireddy et al., ICML 2020), option II: control variates correct client drift.

Client :math:`i` keeps :math:`c_i` (0 at first participation), the server keeps :math:`c`. Local direction
:math:`g(w) + c - c_i`; after training and on the server (with FedAvg's model update)

.. math::

    c_i^+ = c_i - c + \frac{w^t - w_{i,E}}{E_i \eta_l}, \qquad c \leftarrow c + \frac{1}{N} \sum_{i \in S} (c_i^+ - c_i) .

Uploads :math:`\Delta_i` and :math:`c_i^+ - c_i`, downloads :math:`w^t` and :math:`c`.

The two update rules are plain functions so methods that keep the same variates (FedGAMMA,
FedLESAM-S, FedFFT-S through the ``scaffold`` correction; FedWMSAM on the server) share them.
Client :math:`i` keeps :math:`c_i`; :math:`c` goes down with the model; :math:`c_i^+ - c_i` goes up.

``lamb`` (:math:`\lambda`) scales the correction in the local direction, :math:`g + \lambda (c - c_i)`, and nothing else (the variates
update as above): FedLESAM's public FedLESAM-S adds :math:`\lambda \langle w, c - c_i \rangle` to its loss with ``--lamb`` 0.1 by
default (github.com/MediaBrain-SJTU/FedLESAM, ``client/fedlesam_s.py:5-6``, ``train.py:48``), where the paper's
Algorithm 3 and SCAFFOLD have coefficient 1, the default.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.core import (ClientContext, Cohort, Correction, Direction, PartParams, Recipe, RoundContext, Slot, init,
                          register_recipe)

SERVER_VARIATE = "scaffold.c"  # server state, broadcast: c
CLIENT_VARIATE = "scaffold.c_i"  # client state: c_i
SHIFT = Slot("scaffold.shift", "lamb (c - c_i) of the chunk's clients [C, P], the correction added to the gradient")
VARIATE_CHANGE = "scaffold.dc"  # upload: c_i^+ - c_i


COLUMN_BLOCK = 1 << 13  # columns a blocked [K, P] operation takes at a time (see column_blocks)


def column_blocks(X: torch.Tensor) -> list[slice]:
    """Slices of ``X``'s last dimension, :data:`COLUMN_BLOCK` columns each and the remainder with the last (a narrow
    block would reduce in another order), on the CPU (one slice, everything,
    elsewhere): round-level ``[K, P]`` work done block by block keeps its temporaries cache-sized instead of fresh
    ``[K, P]`` tensors, whose page faults cost more than the arithmetic (about 75 ms of a 95 ms subtraction for W2's
    50 x 797,962, docs/benchmarks.md). Elementwise operations give the same bits on any slicing; a width that is a
    multiple of the vector width keeps reductions over rows (``sum(0)``, ``weights @ X``) exact too (tests/test_column_blocks.py)."""
    if X.device.type != "cpu":
        return [slice(None)]
    starts = range(0, max(X.shape[-1] - COLUMN_BLOCK, 0) + 1, COLUMN_BLOCK)  # (the remainder joins the last block)
    return [slice(start, start + COLUMN_BLOCK if i < len(starts) - 1 else None) for i, start in enumerate(starts)]


def scaffold_client_variate(c_i: torch.Tensor, c: torch.Tensor, w_start: torch.Tensor, w_final: torch.Tensor,
                            steps: torch.Tensor, lr: float) -> torch.Tensor:
    r"""Option II of SCAFFOLD's Algorithm 1: :math:`c_i^+ = c_i - c + (w^t - w_{i,E}) / (E_i \eta_l)`, row by row
    (``c_i, w_final [C, P]``, ``c, w_start [P]``, ``steps [C]``): ``c_i - c``, then the drift ``(w^t - w_{i,E}) / (E_i
    \eta_l)`` added block by block (:func:`column_blocks`; the same roundings as whole rows, one fresh tensor)."""
    divisor = steps.to(w_final.dtype)[:, None] * lr
    c_plus = torch.sub(c_i, c)
    for b in column_blocks(c_plus):
        c_plus[:, b].add_(torch.sub(w_start[..., b], w_final[:, b]).div_(divisor))
    return c_plus


def variate_change(c_plus: torch.Tensor, c_i: torch.Tensor) -> torch.Tensor:
    r""":math:`\sum_{i \in S} (c_i^+ - c_i)`, ``[P]``, block by block (:func:`column_blocks`: no fresh ``[K, P]``)."""
    total = torch.empty(c_plus.shape[-1], dtype=c_plus.dtype, device=c_plus.device)
    for b in column_blocks(c_plus):
        total[b] = torch.sub(c_plus[:, b], c_i[:, b]).sum(0)
    return total


def scaffold_server_variate(c: torch.Tensor, sum_dc: torch.Tensor, num_clients: int) -> torch.Tensor:
    r""":math:`c \leftarrow c + \frac{1}{N} \sum_{i \in S} (c_i^+ - c_i)` (``sum_dc`` the sum over the sampled clients)."""
    return c + sum_dc / num_clients


class ScaffoldParams(PartParams):
    lamb: float = Field(1.0, ge=0, description="scale of the correction, grad + lamb (c - c_i): 1 is SCAFFOLD and "
                                               "FedLESAM's Algorithm 3; 0.1 FedLESAM's public FedLESAM-S")


class Scaffold(Correction):
    """``d = grad + lamb (c - c_i)`` with SCAFFOLD's client and server control variates (``lamb = 1``: SCAFFOLD)."""

    name = "scaffold"
    summary = "SCAFFOLD control variates: grad + lamb (c - c_i) (option II update; lamb 1)"
    Params = ScaffoldParams
    server_state = {SERVER_VARIATE: init.zeros}
    sends = (SERVER_VARIATE,)
    keeps = (CLIENT_VARIATE,)
    provides = frozenset({SHIFT})

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        shift = ctx.server[SERVER_VARIATE] - cohort.state[CLIENT_VARIATE]
        cohort.shared.put(SHIFT, shift if self.p.lamb == 1 else self.p.lamb * shift)

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> Direction:
        return Direction(grad.add_(cohort.shared[SHIFT]), ctx.settings.weight_decay)

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        c_i = cohort.state[CLIENT_VARIATE]
        c_plus = scaffold_client_variate(c_i, ctx.server[SERVER_VARIATE], ctx.w_start, W, cohort.steps, ctx.lr)
        cohort.new_state[CLIENT_VARIATE] = c_plus
        cohort.upload[VARIATE_CHANGE] = c_plus - c_i

    def after_step(self, ctx: RoundContext, w_new: torch.Tensor) -> None:
        ctx.server[SERVER_VARIATE] = scaffold_server_variate(ctx.server[SERVER_VARIATE],
                                                             ctx.uploads[VARIATE_CHANGE].sum(0), ctx.settings.num_clients)


register_recipe(Recipe(
    name="scaffold", display="SCAFFOLD",
    summary="control variates c, c_i correct client drift (option II), FedAvg server",
    source="Karimireddy et al., ICML 2020", correction="scaffold"))
