"""FedGMT (*One Arrow, Two Hawks: Sharpness-aware Minimization for Federated Learning via Global Model
Trajectory*, ICML 2025; seed 000 [40]): flatness from the global model's trajectory, consistency from ADMM duals,
with one backprop per step and one model uploaded.

- **Global trajectory.** The server keeps an exponential moving average of its models,
  ``e^{t+1} = ema e^t + (1 - ema) w^{t+1}`` (``e^0 = w^0``), and sends it with the model. A client adds
  ``gamma tau^2 KL(softmax(f(e, x)/tau) || softmax(f(w, x)/tau))`` to its mini-batch loss: distillation from the
  trajectory, which the paper uses in place of SAM's ascent step to measure sharpness along the global path
  (one extra forward pass, no extra backprop).
- **ADMM duals.** Client ``i`` keeps ``lambda_i = sum of its past updates Delta_i = w_{i,E} - w^t`` (0 at first
  participation) and descends ``g + lambda_i / beta``; after training ``lambda_i <- lambda_i + Delta_i``. The server
  keeps ``lambda = (1/N) sum_i lambda_i`` over all clients and steps
  ``w^{t+1} = w^t + eta_g sum_i p_i Delta_i + lambda`` (with ``eta_g = 1`` and uniform ``p_i``:
  ``mean_S w_{i,E} + lambda``). This is FedDyn's dual pair without its proximal term (``h_i = -lambda_i / beta``).

Sources. Neither the paper's text nor its authors' code was reachable here; the rules are those every public
implementation found agrees on — a third-party restatement of the paper (``u_m <- u_m - (1/beta)(w_K - w_t)``,
local step ``g - u_m``, ``w^{t+1} = mean(w_K - beta u_m)``), the PFLlib-based ``clientgmt.py``/``servergmt.py`` of
github.com/Ultraman6/FedScar, and an FL-Simulator port. The defaults are that repository's FedGMT run
(``alpha=0.95, beta=0.01, gama=1.0, tau=3.0``, CIFAR-10): its ``alpha`` is our ``ema``, and its ``beta``, set on
the client after construction, multiplies the dual term directly, i.e. it is ``1/beta`` here (``beta = 100``).
Its server averages ``lambda_i`` over all clients (as here; the port averages the sampled ones) and weights
models by sample counts (``algo.weighting=samples``); its clients use SGD momentum 0.9, which no fedflat
method's local step has.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.algorithms.base import (ClientContext, Cohort, Correction, Distillation, PartParams, Perturbation,
                                     RoundContext, ServerUpdate, TrainSettings)
from fedflat.algorithms.registry import Recipe, register_recipe

TRAJECTORY = "gmt.trajectory"  # server state, sent to clients: e^t, the EMA of the global models
CLIENT_DUAL = "gmt.lambda_i"  # client state and cohort.extra: lambda_i, the sum of the client's past updates
SERVER_DUAL = "gmt.lambda"  # server state: lambda = (1/N) sum_i lambda_i


class TrajectoryParams(PartParams):
    gamma: float = Field(1.0, ge=0, description="gamma: weight of the trajectory distillation term (0: none)")
    tau: float = Field(3.0, gt=0, description="tau: distillation temperature")
    ema: float = Field(0.95, ge=0, lt=1, description="EMA coefficient of the global trajectory e <- ema e + (1-ema) w")


class DualParams(PartParams):
    beta: float = Field(100.0, gt=0, description="beta: ADMM penalty; clients descend g + lambda_i / beta")


def trajectory_step(e: torch.Tensor, w_new: torch.Tensor, ema: float) -> torch.Tensor:
    """``e^{t+1} = ema e^t + (1 - ema) w^{t+1}``."""
    return ema * e + (1 - ema) * w_new


class GlobalTrajectory(Perturbation):
    """Distillation from the EMA of the global models (no perturbation of ``w``)."""

    name = "gmt"
    summary = "FedGMT: gamma tau^2 KL(f(e)/tau || f(w)/tau) toward the EMA e of the global models"
    Params = TrajectoryParams
    sends = (TRAJECTORY,)

    def setup(self, server: dict[str, torch.Tensor], w0: torch.Tensor, settings: TrainSettings) -> None:
        server[TRAJECTORY] = w0.clone()

    def downlink(self, ctx: RoundContext) -> dict[str, torch.Tensor]:
        return {TRAJECTORY: ctx.server[TRAJECTORY]} if self.p.gamma else {}

    def distillation(self, ctx: ClientContext) -> Distillation | None:
        if not self.p.gamma:
            return None
        return Distillation(ctx.server[TRAJECTORY], self.p.gamma, self.p.tau)

    def after_step(self, ctx: RoundContext, w_new: torch.Tensor) -> None:
        ctx.server[TRAJECTORY] = trajectory_step(ctx.server[TRAJECTORY], w_new, self.p.ema)


class ADMMDual(Correction):
    """``d = grad + lambda_i / beta``; keeps ``lambda_i`` per client and ``lambda`` on the server."""

    name = "gmt"
    summary = "FedGMT: grad + lambda_i / beta, lambda_i the sum of the client's updates, server lambda their mean"
    Params = DualParams
    keeps = (CLIENT_DUAL,)
    provides = frozenset({SERVER_DUAL})

    def setup(self, server: dict[str, torch.Tensor], w0: torch.Tensor, settings: TrainSettings) -> None:
        server[SERVER_DUAL] = torch.zeros_like(w0)

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        cohort.extra[CLIENT_DUAL] = cohort.state[CLIENT_DUAL]

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return grad + cohort.extra[CLIENT_DUAL] / self.p.beta

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        cohort.new_state[CLIENT_DUAL] = cohort.extra[CLIENT_DUAL] + (W - ctx.w_start)

    def finish(self, ctx: RoundContext) -> None:
        # lambda = (1/N) sum_i lambda_i over all N clients: only the sampled ones' lambda_i changed, by Delta_i.
        ctx.server[SERVER_DUAL] = ctx.server[SERVER_DUAL] + (ctx.w_final - ctx.w_start).sum(0) / ctx.settings.num_clients


class DualServer(ServerUpdate):
    """``w^{t+1} = w^t + eta_g sum_i p_i Delta_i + lambda``."""

    name = "gmt"
    summary = "FedGMT: w <- mean_i w_{i,E} + lambda, the mean of all clients' duals"
    requires = frozenset({SERVER_DUAL})

    def step(self, ctx: RoundContext) -> torch.Tensor:
        return ctx.w + ctx.settings.global_lr * ctx.aggregate(ctx.deltas) + ctx.server[SERVER_DUAL]


register_recipe(Recipe(
    name="fedgmt", summary="FedGMT: distillation from the global trajectory (EMA) + ADMM duals, one backprop",
    source="One Arrow, Two Hawks, ICML 2025 (seed 000 [40]); rules and defaults from public re-implementations",
    perturbation="gmt", correction="gmt", server="gmt",
    tunable={"algo.beta": (10.0, 100.0, 1000.0), "algo.gamma": (0.5, 1.0, 2.0)}))
