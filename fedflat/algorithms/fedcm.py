r"""FedCM (Xu et al., 2021, arXiv:2106.10874): client-level momentum from the server's last average.

The server keeps :math:`m = \bar{G}` of the previous round (0 at round 0), the average update in gradient
scale, and sends it with the model (2 vectors down). Local direction :math:`a\, g(w) + (1 - a)\, m + \lambda_{wd} w`
(weight decay unscaled, as FL-Simulator's FedCM adds it through ``torch.optim.SGD``).
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedflat.core import (MOMENTUM_WEIGHT_GRID, ClientContext, Cohort, Correction, Direction, PartParams, Recipe,
                          RoundContext, init, register_recipe)

MOMENTUM = "momentum.m"  # server state, broadcast: m, the previous round's Gbar


DecayPlacement = Literal["outside", "inside"]
DECAY_DESCRIPTION = ("outside: a g + (1 - a) m + wd w, weight decay unscaled as torch.optim.SGD adds it in FL-Simulator and "
                     "the FedWMSAM code; inside: a (g + wd w) + (1 - a) m, the spec's (effective decay a wd)")


def momentum_direction(a: float | torch.Tensor, grad: torch.Tensor, m: torch.Tensor, weight_decay: float,
                       decay: DecayPlacement) -> Direction:
    """The momentum-mixed local direction ``a g + (1 - a) m`` from the raw gradient ``g``, written over ``grad`` in
    one pass (``g + (1 - a) (m - g)``), with its weight decay ``wd`` (``decay = outside``, the decay ``wd w``
    whatever ``a``) or ``a wd`` (``inside``). FL-Simulator's FedCM/MoFedSAM and the FedWMSAM code clip
    ``a g + (1 - a) m`` (``client/fedcm.py:26-32``) before SGD adds ``wd w``."""
    return Direction(grad.lerp_(m, 1 - a), weight_decay if decay == "outside" else a * weight_decay)


class MomentumParams(PartParams):
    a: float = Field(0.1, ge=0, le=1, description="weight of the local gradient (1 - a on the momentum)")
    decay: DecayPlacement = Field("outside", description=DECAY_DESCRIPTION)


class Momentum(Correction):
    r""":math:`d = a\, g + (1 - a)\, m + \lambda_{wd} w` with :math:`m = \sum_i p_i G_i` of the previous round,
    :math:`G_i = -\Delta_i / (E_i \eta_l^t)` (uniform :math:`p_i`: the spec's :math:`\bar{G}`); ``decay = inside``:
    :math:`a (g + \lambda_{wd} w) + (1 - a)\, m` (:func:`momentum_direction`)."""

    name = "momentum"
    summary = "FedCM: a grad + (1 - a) m, m the previous round's average update (gradient scale)"
    Params = MomentumParams
    server_state = {MOMENTUM: init.zeros}
    sends = (MOMENTUM,)
    global_direction = (MOMENTUM, 1.0)

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> Direction:
        return momentum_direction(self.p.a, grad, ctx.server[MOMENTUM], ctx.settings.weight_decay, self.p.decay)

    def after_step(self, ctx: RoundContext, w_new: torch.Tensor) -> None:
        ctx.server[MOMENTUM] = ctx.aggregate(ctx.pseudo_gradients)


register_recipe(Recipe(
    name="fedcm", display="FedCM",
    summary="client-level momentum: a g + (1 - a) m, m the last average update; FedAvg server",
    source="Xu et al., arXiv:2106.10874, 2021", correction="momentum", defaults={"a": 0.1},
    tunable={"algo.a": MOMENTUM_WEIGHT_GRID}))
