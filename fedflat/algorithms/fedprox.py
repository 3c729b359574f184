"""FedProx (Li et al., MLSys 2020): a proximal term pulls every local model toward the model it received."""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.core import ClientContext, Cohort, Correction, Direction, PartParams, Recipe, register_recipe


class ProxParams(PartParams):
    mu: float = Field(0.01, ge=0, description="proximal coefficient mu")


class Prox(Correction):
    r""":math:`d = g + \mu (w - w_{start})`: the gradient of :math:`F_i(w) + \frac{\mu}{2} \lVert w - w^t \rVert^2`.

    The anchor is the model the client received, ``ctx.w_start`` (:math:`w^t` unless the server
    broadcasts another point, as FedACG's lookahead). Subclasses rename the coefficient.
    """

    name = "prox"
    summary = "FedProx: grad + mu (w - w^t)"
    Params = ProxParams

    def coefficient(self) -> float:
        return self.p.mu

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> Direction:
        r""":math:`(g - \mu w^t,\ \lambda_{wd} + \mu)`: FL-Simulator's FedProx puts :math:`-\mu \langle w, w^t \rangle` in the loss and :math:`\mu` in SGD's
        weight decay (``client/fedprox.py:10, 26-28``), so :math:`\mu w` is added after the clip."""
        mu = self.coefficient()
        return Direction(grad.sub_(ctx.w_start, alpha=mu) if mu else grad, ctx.settings.weight_decay + mu)


register_recipe(Recipe(
    name="fedprox", display="FedProx", summary="local SGD with a proximal term mu (w - w^t), FedAvg server",
    source="Li et al., MLSys 2020", correction="prox", defaults={"mu": 0.01},
    tunable={"algo.mu": (1.0, 0.1, 0.01, 0.001)}))
