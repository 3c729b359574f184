r"""Server optimizers on the averaged update: FedAdam (Reddi et al., ICLR 2021) and FedAvgM (Hsu et al., 2019).

The clients run FedAvg's local SGD; the server treats :math:`\bar{\Delta} = \sum_i p_i \Delta_i` as a (negative)
pseudo-gradient and keeps optimizer state (:math:`m`, :math:`v`) in ``ctx.server``.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.core import (ConfigError, PartParams, Recipe, RoundContext, ServerUpdate, TrainSettings, init,
                          register_recipe)

ADAM_M, ADAM_V = "adam.m", "adam.v"
AVGM_M = "avgm.m"


class AdamParams(PartParams):
    b1: float = Field(0.9, ge=0, lt=1, description="first-moment decay")
    b2: float = Field(0.99, ge=0, lt=1, description="second-moment decay")
    tau: float = Field(1e-3, gt=0, description="adaptivity (added to sqrt(v))")
    server_lr: float | None = Field(None, gt=0, description="eta_g of the Adam step; null: train.global_lr "
                                                            "(the fedadam recipe sets 0.1, as Reddi et al.)")


def first_moment(w0: torch.Tensor, settings: TrainSettings, params: AdamParams) -> torch.Tensor:
    """``m = 0``, once ``eta_g`` is unambiguous: ``algo.server_lr`` and a ``train.global_lr`` other than 1 disagree."""
    if params.server_lr is not None and settings.global_lr != 1.0 and settings.global_lr != params.server_lr:
        raise ConfigError(
            f"the adam server takes eta_g from algo.server_lr ({params.server_lr}), but train.global_lr is "
            f"{settings.global_lr}: set algo.server_lr={settings.global_lr}, or algo.server_lr=null to use "
            "train.global_lr")
    return init.zeros(w0, settings, params)


class Adam(ServerUpdate):
    r""":math:`m \leftarrow \beta_1 m + (1 - \beta_1) \bar{\Delta}`, :math:`v \leftarrow \beta_2 v + (1 - \beta_2) \bar{\Delta}^2`, :math:`w^{t+1} = w^t + \eta_g\, m / (\sqrt{v} + \tau)`
    (no bias correction, as in the paper's Algorithm 2)."""

    name = "adam"
    summary = "FedAdam: Adam on the averaged update (m, v on the server)"
    Params = AdamParams
    server_state = {ADAM_M: first_moment, ADAM_V: init.zeros}
    global_direction = (ADAM_M, -1.0)  # the momentum of updates, in gradient sign

    def eta_g(self, ctx: RoundContext) -> float:
        return self.p.server_lr if self.p.server_lr is not None else ctx.settings.global_lr

    def step(self, ctx: RoundContext) -> torch.Tensor:
        d = ctx.aggregate(ctx.deltas)
        m = ctx.server[ADAM_M] = self.p.b1 * ctx.server[ADAM_M] + (1 - self.p.b1) * d
        v = ctx.server[ADAM_V] = self.p.b2 * ctx.server[ADAM_V] + (1 - self.p.b2) * d * d
        return ctx.w + self.eta_g(ctx) * m / (v.sqrt() + self.p.tau)


class AvgMParams(PartParams):
    beta: float = Field(0.9, ge=0, lt=1, description="server momentum")


class AvgM(ServerUpdate):
    r""":math:`m \leftarrow \beta m + \bar{\Delta}`, :math:`w^{t+1} = w^t + \eta_g m` (server momentum, Hsu et al. 2019)."""

    name = "avgm"
    summary = "FedAvgM: heavy-ball momentum on the averaged update"
    Params = AvgMParams
    server_state = {AVGM_M: init.zeros}
    global_direction = (AVGM_M, -1.0)  # the momentum of updates, in gradient sign

    def step(self, ctx: RoundContext) -> torch.Tensor:
        m = ctx.server[AVGM_M] = self.p.beta * ctx.server[AVGM_M] + ctx.aggregate(ctx.deltas)
        return ctx.w + ctx.settings.global_lr * m


register_recipe(Recipe(
    name="fedadam", display="FedAdam",
    summary="local SGD, Adam on the averaged update at the server (eta_g = algo.server_lr = 0.1)",
    source="Reddi et al., ICLR 2021", server="adam",
    defaults={"b1": 0.9, "b2": 0.99, "tau": 1e-3, "server_lr": 0.1},
    tunable={"algo.server_lr": (0.3, 0.1, 0.03, 0.01, 0.003, 0.001)}))
register_recipe(Recipe(
    name="fedavgm", display="FedAvgM", summary="local SGD, server momentum m <- beta m + Dbar",
    source="Hsu et al., arXiv:1909.06335, 2019", server="avgm", defaults={"beta": 0.9},
    tunable={"algo.beta": (0.7, 0.9, 0.97), "train.global_lr": (1.0, 0.3, 0.1)}))
