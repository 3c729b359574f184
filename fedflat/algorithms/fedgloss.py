r"""FedGloSS (Caldarola et al., CVPR 2025): server-side SAM on the global model, local SAM + ADMM on clients.

The server sends :math:`\tilde{w} = w^t + \rho_s\, d / \lVert d \rVert` with :math:`d = -\bar{\Delta}` of the previous round (the last
pseudo-gradient; no perturbation at round 0). Clients start from :math:`\tilde{w}` and run local SAM (radius
:math:`\rho_l` = ``algo.rho``) on the ADMM direction :math:`g(w + \epsilon) - \lambda_i + (w - \tilde{w}) / \beta`, then
:math:`\lambda_i \leftarrow \lambda_i - (w_{i,E} - \tilde{w}) / \beta`. The server removes the perturbation:

.. math::

    \sigma \leftarrow \sigma - \sum_i \frac{w_{i,E} - \tilde{w}}{\beta N}, \qquad
    w^{t+1} = w^t + \eta_g \sum_i p_i (w_{i,E} - \tilde{w}) - \beta \sigma .

``algo.warmup_rounds`` warms up both radii, :math:`\rho_s` and the local :math:`\rho`, linearly from 0.001 (0: off; the
authors' scripts use a fifth of the rounds, and aggregate sample-weighted: ``algo.weighting=samples``). The
public code divides the :math:`\sigma` update by a further :math:`\lvert S \rvert`; the spec's rule is followed here.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.algorithms.feddyn import feddyn_client_dual, feddyn_server_dual
from fedflat.algorithms.fedsam import warmed_up
from fedflat.core import (RHO_GRID, ClientContext, Cohort, Correction, Direction, PartParams, Recipe, RoundContext,
                          ServerUpdate, init, normalize_rows, register_recipe, shared)

SIGMA = "gloss.sigma"  # ctx.server: the server's dual
PSEUDO_GRADIENT = "gloss.d"  # ctx.server: d = -Dbar of the last round
HAS_PSEUDO_GRADIENT = "gloss.has_d"
CLIENT_DUAL = "gloss.lambda_i"  # client state


class ADMMParams(PartParams):
    beta: float = shared(10.0, gt=0, description="ADMM penalty: the proximal term is (w - w~)/beta (one value on the "
                                                 "clients and the server)")


class ADMMCorrection(Correction):
    r""":math:`d = g - \lambda_i + (w - \tilde{w})/\beta` (FedDyn's form with :math:`\alpha = 1/\beta`, anchored at :math:`\tilde{w}`)."""

    name = "gloss"
    summary = "FedGloSS ADMM: grad - lambda_i + (w - w~)/beta, lambda_i <- lambda_i - (w_E - w~)/beta"
    Params = ADMMParams
    keeps = (CLIENT_DUAL,)

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> Direction:
        r""":math:`\big(g - (\lambda_i + \tilde{w}/\beta) + w/\beta,\ \lambda_{wd}\big)`, the pull formed once per chunk (the whole term is the
        loss's)."""
        own = cohort.own(self)
        if "pull" not in own:
            own["pull"] = torch.add(cohort.state[CLIENT_DUAL], ctx.w_start, alpha=1 / self.p.beta)
        return Direction(grad.sub_(own["pull"]).add_(W, alpha=1 / self.p.beta), ctx.settings.weight_decay)

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        cohort.new_state[CLIENT_DUAL] = feddyn_client_dual(cohort.state[CLIENT_DUAL], 1 / self.p.beta, ctx.w_start, W)


class GlobalSAMParams(ADMMParams):
    rho_s: float = Field(0.1, ge=0, description="server-side SAM radius")
    warmup_rounds: int = shared(0, ge=0, description="rounds over which rho_s (and the local rho) grow linearly "
                                                     "from 0.001 (0: off)")


class GlobalSAMServer(ServerUpdate):
    r"""Broadcasts :math:`\tilde{w} = w^t + \rho_s\, d / \lVert d \rVert`; steps :math:`w^{t+1} = w^t + \eta_g \sum_i p_i (w_{i,E} - \tilde{w}) - \beta \sigma`."""

    name = "gloss"
    summary = "FedGloSS: send w~ = w + rho_s d/||d|| (d = last pseudo-gradient), ADMM server dual sigma"
    Params = GlobalSAMParams
    server_state = {SIGMA: init.zeros, PSEUDO_GRADIENT: init.zeros, HAS_PSEUDO_GRADIENT: init.flag}
    global_direction = (PSEUDO_GRADIENT, 1.0)  # d, the pseudo-gradient the server perturbs along (zero before round 1)

    def broadcast(self, ctx: RoundContext) -> torch.Tensor:
        if not bool(ctx.server[HAS_PSEUDO_GRADIENT]):
            return ctx.w
        radius = warmed_up(self.p.rho_s, ctx.round, self.p.warmup_rounds)
        return ctx.w + normalize_rows(ctx.server[PSEUDO_GRADIENT][None], radius)[0]

    def step(self, ctx: RoundContext) -> torch.Tensor:
        local_updates = ctx.w_final - ctx.w_start  # Delta~_i, measured from the perturbed model
        ctx.server[SIGMA] = feddyn_server_dual(ctx.server[SIGMA], 1 / self.p.beta, local_updates.sum(0),
                                               ctx.settings.num_clients)
        mean_update = ctx.aggregate(local_updates)
        ctx.server[PSEUDO_GRADIENT] = -mean_update
        ctx.server[HAS_PSEUDO_GRADIENT] = torch.ones_like(ctx.server[HAS_PSEUDO_GRADIENT])
        return ctx.w + ctx.settings.global_lr * mean_update - self.p.beta * ctx.server[SIGMA]


register_recipe(Recipe(
    name="fedgloss", display="FedGloSS",
    summary="server-side SAM along the last pseudo-gradient, local SAM with ADMM correction",
    source="Caldarola et al., CVPR 2025",
    perturbation="sam", correction="gloss", server="gloss",
    defaults={"rho": 0.1, "rho_s": 0.1, "beta": 10.0},
    tunable={"algo.rho": RHO_GRID}))
