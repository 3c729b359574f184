r"""FedSMOO (Sun et al., ICML 2023): FedDyn's correction plus a globally corrected SAM perturbation.

Client dual :math:`\mu_i` (0 at first participation), server correction :math:`s` (0). Every local step:

.. math::

    u = g(w) - \mu_i - s, \qquad \epsilon = \rho\, \frac{u}{\lVert u \rVert}, \qquad \mu_i \leftarrow \mu_i + \epsilon - s;

the descent gradient is
:math:`g(w + \epsilon)` inside FedDyn's direction. After the round the server sets
:math:`s = \rho\, \bar{\mu} / \lVert \bar{\mu} \rVert`, :math:`\bar{\mu} = \frac{1}{K} \sum_{i \in S} \mu_i` (the clients upload :math:`\mu_i`: 2 vectors up; :math:`s` goes down
with the model: 2 down), then takes FedDyn's step. Default :math:`\rho = 0.1`.

That :math:`s` is the authors' code's (FL-Simulator, ``server/FedSMOO.py``: "we simplify the solution of
global_dynamic_dual as s / ||average_s(mu_i)|| * rho by ignoring the \hat{s}_{i,K} term"). ``s_update=full`` keeps
the term: :math:`s = \rho\, m / \lVert m \rVert` with :math:`m = \frac{1}{K} \sum_{i \in S} (\mu_i + \hat{s}_{i,K})`, :math:`\hat{s}_{i,K}` the client's last
perturbation (uploaded too: 3 vectors up), the consensus step of the ADMM the duals come from (:math:`\mu_i` is the
scaled dual of :math:`s_i = s`). The paper's text was not reachable here: this form is reconstructed from that comment.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedflat.algorithms.fedsam import LocalSAM, SAMParams
from fedflat.core import RHO_GRID, ClientContext, Cohort, Recipe, RoundContext, init, normalize_rows, register_recipe

SERVER_CORRECTION = "smoo.s"  # server state, broadcast: s
CLIENT_DUAL = "smoo.mu_i"  # client state and upload (updated every step in the part's own values)
LAST_PERTURBATION = "smoo.s_hat"  # s_update=full: the client's last perturbation s_hat_{i,K}, upload


class SMOOParams(SAMParams):
    s_update: Literal["simplified", "full"] = Field(
        "simplified", description="simplified: s from mean mu_i (the authors' code); full: from mean (mu_i + s_hat_i,K)")


class CorrectedPerturbation(LocalSAM):
    r""":math:`\epsilon = \rho (g - \mu_i - s) / \lVert g - \mu_i - s \rVert`, then :math:`\mu_i \leftarrow \mu_i + \epsilon - s` (active rows only)."""

    name = "smoo"
    summary = "FedSMOO: eps = rho u/||u||, u = g(w) - mu_i - s, mu_i <- mu_i + eps - s; s from the mean mu_i"
    Params = SMOOParams
    server_state = {SERVER_CORRECTION: init.zeros}
    sends = (SERVER_CORRECTION,)  # s, used in every local step
    keeps = (CLIENT_DUAL,)  # mu_i, also uploaded
    global_direction = (SERVER_CORRECTION, 1.0)  # s, the server's estimate of the global perturbation

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        own = cohort.own(self)
        own[CLIENT_DUAL] = cohort.state[CLIENT_DUAL]
        if self.p.s_update == "full":
            own[LAST_PERTURBATION] = torch.zeros_like(cohort.state[CLIENT_DUAL])

    def ascent(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return grad - cohort.own(self)[CLIENT_DUAL] - ctx.server[SERVER_CORRECTION]

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch) -> torch.Tensor | None:
        eps = super().perturb(ctx, cohort, k, W, batch)
        step = -ctx.server[SERVER_CORRECTION] if eps is None else eps - ctx.server[SERVER_CORRECTION]
        own = cohort.own(self)
        own[CLIENT_DUAL] = torch.where(cohort.active[:, None], own[CLIENT_DUAL] + step, own[CLIENT_DUAL])
        if self.p.s_update == "full" and eps is not None:
            own[LAST_PERTURBATION] = torch.where(cohort.active[:, None], eps, own[LAST_PERTURBATION])
        return eps

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        own = cohort.own(self)
        cohort.new_state[CLIENT_DUAL] = cohort.upload[CLIENT_DUAL] = own[CLIENT_DUAL]
        if self.p.s_update == "full":
            cohort.upload[LAST_PERTURBATION] = own[LAST_PERTURBATION]

    def finish(self, ctx: RoundContext) -> None:
        duals = ctx.uploads[CLIENT_DUAL]
        if self.p.s_update == "full":
            duals = duals + ctx.uploads[LAST_PERTURBATION]
        ctx.server[SERVER_CORRECTION] = normalize_rows((duals.sum(0) / ctx.K)[None], self.p.rho)[0]


register_recipe(Recipe(
    name="fedsmoo", display="FedSMOO", summary="FedDyn + SAM with the dual-corrected perturbation u = g - mu_i - s",
    source="Sun et al., ICML 2023",
    perturbation="smoo", correction="dyn", server="dyn", defaults={"rho": 0.1},
    tunable={"algo.rho": RHO_GRID}))
