r"""FedLESAM (Fan et al., ICML 2024; seed 002): a locally estimated global perturbation, one backprop per step.

Seed 002 Algorithm 1: client :math:`i` remembers :math:`w_i^{old}`, the global model it received at its
previous participation, and perturbs every local step of round ``t`` by the same

.. math::

    \epsilon_i = \rho \, \frac{w_i^{old} - w^t}{\lVert w_i^{old} - w^t \rVert},

then stores :math:`w_i^{old} = w^t`. No gradient is needed for the perturbation, so a step costs one
backprop. FedLESAM-S (Algorithm 3) and FedLESAM-D (Algorithm 4) put the same perturbation on
SCAFFOLD's and FedDyn's correction, state and server.

Options (``algo.first``, ``algo.reference``):

- ``first: none`` (default): a client's first participation has no perturbation (:math:`\epsilon = 0`), as the
  public code does at round 0; ``first: zero`` takes the pseudo-code's initialisation :math:`w_i^{old} = 0`
  literally (:math:`\epsilon = -\rho\, w^t / \lVert w^t \rVert`).
- ``reference: own`` (default, the paper): :math:`w_i^{old}` is the client's own memory;
  ``reference: previous_round`` uses :math:`w^{t-1}` for every client, as the public code does (equal to
  ``own`` under full participation; no client memory).

The public code computes the norm and the shift with ``g_update[idx]`` on a FLAT vector, i.e. it
shifts each parameter tensor by one scalar; here :math:`\epsilon` is the full vector, as the paper writes.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedflat.core import (RHO_GRID, ClientContext, Cohort, PartParams, Perturbation, Recipe, RoundContext, init,
                          normalize_rows, register_recipe)

OLD_MODEL = "lesam.w_old"  # client state: w_i^old, the model the client received last time
GLOBAL = "lesam.global"  # server state: w^{t-1} - w^t of the last round (zero before it)
HAS_PREVIOUS = "lesam.has_prev"  # server state: whether a round has happened (w^{t-1} exists)
PREVIOUS_MODEL = "lesam.w_prev"  # broadcast (reference: previous_round): w^{t-1}


class LESAMParams(PartParams):
    rho: float = Field(0.01, ge=0, description="perturbation radius")
    first: Literal["none", "zero"] = "none"
    reference: Literal["own", "previous_round"] = "own"


class LocallyEstimatedPerturbation(Perturbation):
    r""":math:`\epsilon_i = \rho (w_i^{old} - w_{start}) / \lVert w_i^{old} - w_{start} \rVert`, constant within the round.

    ``w_start`` is the model the client received (``w^t`` for every shipped server update).
    """

    name = "lesam"
    summary = "FedLESAM: eps = rho (w_old - w^t)/||w_old - w^t||, w_old = model received last time (no extra backprop)"
    Params = LESAMParams
    server_state = {GLOBAL: init.zeros, HAS_PREVIOUS: init.flag}
    # the estimated global perturbation w^{t-1} - w^t (what a client of the previous round perturbs along)
    global_direction = (GLOBAL, 1.0)

    def kept(self) -> tuple[str, ...]:
        return (OLD_MODEL,) if self.p.reference == "own" else ()

    def downlink(self, ctx: RoundContext) -> dict[str, torch.Tensor]:
        """``reference: previous_round`` sends ``w^{t-1}`` with the model (the clients keep nothing)."""
        if self.p.reference != "previous_round":
            return {}
        return {PREVIOUS_MODEL: ctx.server[GLOBAL] + ctx.w, HAS_PREVIOUS: ctx.server[HAS_PREVIOUS]}

    def reference_models(self, ctx: ClientContext, cohort: Cohort) -> tuple[torch.Tensor, torch.Tensor]:
        """``(w_old[C, P], known[C])``: the model each client perturbs away from, and whether it has one."""
        if self.p.reference == "previous_round":
            return (ctx.server[PREVIOUS_MODEL].expand(cohort.size, -1),
                    ctx.server[HAS_PREVIOUS].expand(cohort.size))
        return cohort.state[OLD_MODEL], cohort.known[OLD_MODEL]

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        w_old, known = self.reference_models(ctx, cohort)
        if self.p.first == "zero":  # the pseudo-code's w_i^old = 0 before any participation
            w_old = torch.where(known[:, None], w_old, torch.zeros_like(w_old))
            known = torch.ones_like(known)
        direction = torch.where(known[:, None], w_old - ctx.w_start, torch.zeros_like(w_old))
        cohort.own(self)["eps"] = normalize_rows(direction, self.p.rho)  # a zero direction gives eps = 0

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch) -> torch.Tensor | None:
        if self.p.rho == 0:
            return None
        return cohort.own(self)["eps"]

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        if self.p.reference == "own":
            cohort.new_state[OLD_MODEL] = ctx.w_start.expand(cohort.size, -1)

    def after_step(self, ctx: RoundContext, w_new: torch.Tensor) -> None:
        ctx.server[GLOBAL] = ctx.w - w_new
        ctx.server[HAS_PREVIOUS] = torch.ones((), dtype=torch.bool, device=ctx.w.device)


register_recipe(Recipe(
    name="fedlesam", display="FedLESAM",
    summary="FedAvg with the locally estimated global perturbation (1 backprop/step)",
    source="Fan et al., ICML 2024 (seed 002), Algorithm 1",
    perturbation="lesam", defaults={"rho": 0.01},
    tunable={"algo.rho": RHO_GRID}))
register_recipe(Recipe(
    name="fedlesam-s", display="FedLESAM-S", summary="FedLESAM perturbation on SCAFFOLD's correction, state and server",
    source="Fan et al., ICML 2024 (seed 002), Algorithm 3",
    perturbation="lesam", correction="scaffold", defaults={"rho": 0.1},
    tunable={"algo.rho": RHO_GRID}))
register_recipe(Recipe(
    name="fedlesam-d", display="FedLESAM-D", summary="FedLESAM perturbation on FedDyn's correction, state and server",
    source="Fan et al., ICML 2024 (seed 002), Algorithm 4",
    perturbation="lesam", correction="dyn", server="dyn", defaults={"rho": 0.1},
    tunable={"algo.rho": RHO_GRID}))
