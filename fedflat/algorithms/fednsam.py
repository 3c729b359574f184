r"""FedNSAM (Liu, Shang, Tian, Liu and Liu, *FedNSAM: Consistency of Local and Global Flatness for Federated
Learning*, arXiv 2602.23827, 2026; code github.com/junkangLiu0/FedNSAM): SAM whose perturbation and starting point
come from the server's global Nesterov momentum.

The server keeps the momentum of the global updates (FedACG's server: :math:`m \leftarrow \lambda m + \frac{1}{K} \sum_{i \in S} (w_{i,E} - \hat{w})`,
:math:`w^{t+1} = w^t + m`) and broadcasts the Nesterov extrapolation :math:`\hat{w} = w^t + \lambda m`; clients start from it and
take their gradient at a point perturbed along the momentum, the clients' estimate of the global ascent direction (perturbation ``nsam``; :math:`m = 0`, round 0: no perturbation):

.. math::

    \epsilon = -\rho\, \frac{m}{\lVert m \rVert}

one backprop per step (the perturbation is the round's, not the batch's). The paper's abstract: "FedNSAM uses the
global Nesterov momentum as the direction of local estimation of client global perturbations and extrapolation"; its
text was not read here, so the form above (the sign that makes :math:`\epsilon` an ascent: :math:`m` is the accumulated descent)
is fedflat's reading of it.

The authors' code (``main_FedNSAM.py`` at c3c9e90, ``update_NSAM`` l.1082, ``apply_weights_avgACG`` l.1355) runs
something else, offered as ``fednsam-code``: clients start from :math:`w^t + \gamma m` (:math:`\gamma = 0.85` hard-coded) and
take local SAM steps (:math:`\epsilon = \rho\, g / \lVert g \rVert`, :math:`\rho = 0.05` hard-coded, no pull toward :math:`\hat{w}`), and its server's
loop ``for k, v in sum_weights.items(): momen_m[k] = gamma * v + sum_weights[k]`` reads the update where the
momentum is meant, so :math:`m = (1 + \gamma) \frac{1}{K} \sum_{i \in S} \Delta_i` after round 0 (:math:`m = \frac{1}{K} \sum_{i \in S} \Delta_i` in it): no memory of earlier
rounds (its ``apply_weights_avgACG2``, l.1332, has the momentum, unused). ``algo.momentum=code`` is that rule,
``nesterov`` (default) the momentum.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedflat.algorithms.fedacg import MOMENTUM, ACGServer, ACGServerParams
from fedflat.core import (ClientContext, Cohort, PartParams, Perturbation, Recipe, RoundContext, normalize_rows,
                          register_recipe)


class NesterovPerturbationParams(PartParams):
    rho: float = Field(0.05, ge=0, description="perturbation radius (the code's 0.05)")


class NesterovPerturbation(Perturbation):
    r""":math:`\epsilon = -\rho\, m / \lVert m \rVert`, :math:`m` the server's momentum of global updates (0: no perturbation)."""

    name = "nsam"
    summary = "FedNSAM: eps = -rho m/||m||, the server's Nesterov momentum as the global ascent estimate (no backprop)"
    Params = NesterovPerturbationParams
    sends = (MOMENTUM,)
    requires = frozenset({MOMENTUM})
    global_direction = (MOMENTUM, -1.0)

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch) -> torch.Tensor | None:
        if self.p.rho == 0:
            return None
        m = ctx.server[MOMENTUM]
        return normalize_rows(-m.expand_as(W), self.p.rho)  # m = 0 gives eps = 0


class NesterovServerParams(ACGServerParams):
    momentum: Literal["nesterov", "code"] = Field(
        "nesterov", description="'nesterov': m <- lambda m + mean Delta; 'code': the authors' apply_weights_avgACG, "
                                "m = (1 + lambda) mean Delta after round 0")


class NesterovServer(ACGServer):
    r"""FedACG's server (broadcast :math:`w + \lambda m`, :math:`m \leftarrow \lambda m + \bar{\Delta}`, :math:`w \leftarrow w + \eta_g m`), or with
    ``momentum=code`` the authors' FedNSAM server (module docstring)."""

    name = "nsam"
    summary = "FedNSAM: broadcast w + lambda m; m <- lambda m + mean Delta (or the code's (1 + lambda) mean Delta)"
    Params = NesterovServerParams

    def step(self, ctx: RoundContext) -> torch.Tensor:
        if self.p.momentum == "nesterov":
            return super().step(ctx)
        mean = ctx.aggregate(ctx.w_final - ctx.w_start)
        m = ctx.server[MOMENTUM] = mean if ctx.round == 0 else self.p.lam * mean + mean
        return ctx.w + ctx.settings.global_lr * m


SOURCE = "Liu et al., arXiv 2602.23827 (2026; github.com/junkangLiu0/FedNSAM)"
register_recipe(Recipe(
    name="fednsam", display="FedNSAM", summary="FedNSAM: start at w + lambda m, perturb along -m (the global Nesterov momentum)",
    source=SOURCE, perturbation="nsam", server="nsam", defaults={"rho": 0.05, "lam": 0.85},
    tunable={"algo.rho": (0.01, 0.05, 0.1), "algo.lam": (0.5, 0.85)}))
register_recipe(Recipe(
    name="fednsam-code", display="FedNSAM (code)", summary="FedNSAM as the authors' code runs it: FedACG's lookahead start, local SAM, its server",
    source=SOURCE + ", update_NSAM", perturbation="sam", server="nsam",
    defaults={"rho": 0.05, "lam": 0.85, "momentum": "code"}, tunable={"algo.rho": (0.01, 0.05, 0.1)}))
