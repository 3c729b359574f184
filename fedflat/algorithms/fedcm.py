r"""FedCM (Xu et al., 2021, arXiv:2106.10874): client-level momentum from the server's last average.

The server keeps :math:`m = \bar{G}` of the previous round (0 at round 0), the average update in gradient
scale, and sends it with the model (2 vectors down). Local direction :math:`a\, g(w) + (1 - a)\, m + \lambda_{wd} w`
(weight decay unscaled, as FL-Simulator's FedCM adds it through ``torch.optim.SGD``).
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedflat.core import (MOMENTUM_WEIGHT_GRID, ClientContext, Cohort, Correction, Direction, MeasuredDirection,
                          PartParams, Recipe, RoundContext, init, register_recipe)
from fedflat.core.vectors import NOT_RUN, run_kernel

MOMENTUM = "momentum.m"  # server state, broadcast: m, the previous round's Gbar


DecayPlacement = Literal["outside", "inside"]
DECAY_DESCRIPTION = ("outside: a g + (1 - a) m + wd w, weight decay unscaled as torch.optim.SGD adds it in FL-Simulator and "
                     "the FedWMSAM code; inside: a (g + wd w) + (1 - a) m, the spec's (effective decay a wd)")


def momentum_direction(a: float | torch.Tensor, grad: torch.Tensor, m: torch.Tensor, weight_decay: float,
                       decay: DecayPlacement, complement: torch.Tensor | None = None) -> Direction:
    """The momentum-mixed local direction ``a g + (1 - a) m`` from the raw gradient ``g``, written over ``grad`` in
    one pass (``g + (1 - a) (m - g)``, ``lerp_``; ``complement``: ``1 - a`` made before), with its weight decay ``wd``
    (``decay = outside``, the decay ``wd w`` whatever ``a``) or ``a wd`` (``inside``). FL-Simulator's FedCM/MoFedSAM
    and the FedWMSAM code clip ``a g + (1 - a) m`` (``client/fedcm.py:26-32``) before SGD adds ``wd w``. Where the
    native kernel takes the operands, the mix and its rows' norms in that pass (:func:`mix_norm`: a
    :class:`~fedflat.core.MeasuredDirection`, whose norms the loss-scope clip takes)."""
    weight = 1 - a if complement is None else complement
    decayed = weight_decay if decay == "outside" else a * weight_decay
    norms = mix_norm(grad, m, weight)
    if norms is not None:
        return MeasuredDirection(grad, decayed, norms)
    return Direction(grad.lerp_(m, weight), decayed)


def mix_norm_torch(g: torch.Tensor, m: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor:
    """``g.lerp_(m, weight)`` and the rows' norms of the result as the engine's clip computes them."""
    return torch.linalg.vector_norm(g.lerp_(m, weight), dim=-1, keepdim=True)


def mix_norm(g: torch.Tensor, m: torch.Tensor, weight: float | torch.Tensor) -> torch.Tensor | None:
    """:func:`mix_norm_torch` in one pass by the native ``mix_norm`` (fedflat/engine/native/vector_ops.cpp: lerp's fma
    and an 8-lane norm, its own rounding, ATen's on its AVX2 and AVX-512 levels; at ATen's default level, whose
    ``lerp`` runs element by element, several times faster) where it is built and takes the operands (it checks them
    before it writes ``g``), else None (``g`` untouched)."""
    if not isinstance(weight, torch.Tensor):
        weight = torch.tensor(weight, dtype=torch.float32)
    norms = run_kernel("mix_norm", g.device, g, m, weight)
    return None if norms is NOT_RUN else norms


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
