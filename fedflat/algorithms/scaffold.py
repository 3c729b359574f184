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


def scaffold_client_variate(c_i: torch.Tensor, c: torch.Tensor, w_start: torch.Tensor, w_final: torch.Tensor,
                            steps: torch.Tensor, lr: float) -> torch.Tensor:
    r"""Option II of SCAFFOLD's Algorithm 1: :math:`c_i^+ = c_i - c + (w^t - w_{i,E}) / (E_i \eta_l)`, row by row
    (``c_i, w_final [C, P]``, ``c, w_start [P]``, ``steps [C]``)."""
    drift = torch.sub(w_start, w_final).div_(steps.to(w_final.dtype)[:, None] * lr)  # (in place: the same bits)
    return torch.sub(c_i, c).add_(drift)


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
