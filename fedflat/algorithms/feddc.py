r"""FedDC (Gao, Xu, Xu, Zhou, Shi and Wang, *FedDC: Federated Learning with Non-IID Data via Local Drift Decoupling
and Correction*, CVPR 2022; code github.com/gaoliang13/FedDC): a local drift variable ``h_i`` bridges each local
model and the global one, and SCAFFOLD-like gradient variates correct the local direction.

Client :math:`i` keeps its drift :math:`h_i` and its variate :math:`g_i` (both 0 at first participation); the server keeps the
global variate :math:`g` (sent) and :math:`\bar{h} = \frac{1}{N} \sum_{\text{all } i} h_i`. With :math:`s_i = 1` (or, ``algo.size_scaled=true``,
the code's :math:`s_i = n_i N / n`), the local objective is

.. math::

    F_i(\theta) + \frac{\alpha / s_i}{2} \lVert \theta + h_i - w^t \rVert^2 + \langle \theta, g / s_i - g_i \rangle

(its gradient is the local direction, clipped together, weight decay added after: the code's loss and
``torch.optim.SGD``). After :math:`E_i` steps, :math:`\Delta_i = \theta_i - w^t`, the client updates and uploads

.. math::

    h_i \leftarrow h_i + \Delta_i, \qquad g_i^+ = g_i - g / s_i - \frac{\Delta_i}{E_i \eta_l}, \qquad
    \mathrm{d}g_i = s_i (g_i^+ - g_i)

and the server

.. math::

    g \leftarrow g + \frac{1}{N} \sum_{i \in S} \mathrm{d}g_i,

    \bar{h} \leftarrow \bar{h} + \frac{1}{N} \sum_{i \in S} \Delta_i,

    w^{t+1} = w^t + \eta_g \sum_i p_i \Delta_i + \bar{h}

(the code's ``mean_S theta_i + mean_all h_i``).

Differences with the code (``utils_methods_FedDC.py``): its variate divides by ``n_minibatch * learning_rate``, a
step count common to all clients (equal to :math:`E_i` on its equal-size splits) and the *initial* local rate (equal to
:math:`\eta_l^t` without a decaying schedule); fedflat uses each client's :math:`E_i` and the round's :math:`\eta_l^t`, as
SCAFFOLD's option II does.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.core import (AlgorithmError, ClientContext, Cohort, Correction, Direction, PartParams, Recipe,
                          RoundContext, ServerUpdate, init, register_recipe, shared)

GLOBAL_VARIATE = "feddc.g"  # server state, sent: g
MEAN_DRIFT = "feddc.hbar"  # server state: (1/N) sum over all clients of h_i
DRIFT = "feddc.h_i"  # client state: h_i
LOCAL_VARIATE = "feddc.g_i"  # client state: g_i
VARIATE_CHANGE = "feddc.dg"  # upload: s_i (g_i^+ - g_i)


class DriftParams(PartParams):
    alpha: float = shared(0.01, ge=0, description="FedDC's penalty alpha on ||theta + h_i - w||^2 (the code's "
                                                  "alpha_coef; 0: no drift penalty)")
    size_scaled: bool = Field(False, description="the code's per-client scaling s_i = n_i N / n of alpha and g "
                                                 "(false: s_i = 1; equal on equal-size splits)")


def size_scale(cohort: Cohort, ctx: ClientContext, scaled: bool) -> torch.Tensor:
    """``s_i [C, 1]``: 1, or the code's ``weight_list`` ``n_i N / n``."""
    n_i = cohort.num_samples.to(ctx.w_broadcast.dtype)[:, None]
    if not scaled:
        return torch.ones_like(n_i)
    if not ctx.settings.total_samples:
        raise AlgorithmError("feddc size_scaled=true needs the federation's sample count n; set algo.size_scaled=false")
    return n_i * ctx.settings.num_clients / ctx.settings.total_samples


def feddc_variate(g_i: torch.Tensor, g: torch.Tensor, s: torch.Tensor, delta: torch.Tensor, steps: torch.Tensor,
                  lr: float) -> torch.Tensor:
    r""":math:`g_i^+ = g_i - g / s_i - \Delta_i / (E_i \eta_l)`, row by row."""
    return g_i - g / s - delta / (steps.to(delta.dtype)[:, None] * lr)


class DriftCorrection(Correction):
    r""":math:`d = \nabla F_i(w) + (\alpha / s_i) (w + h_i - w^t) + g / s_i - g_i` with FedDC's drift and variates."""

    name = "feddc"
    summary = "FedDC: grad + alpha (w + h_i - w^t) + g - g_i; drift h_i += Delta_i, SCAFFOLD-like variates"
    Params = DriftParams
    server_state = {GLOBAL_VARIATE: init.zeros, MEAN_DRIFT: init.zeros}
    sends = (GLOBAL_VARIATE,)
    keeps = (DRIFT, LOCAL_VARIATE)

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        own = cohort.own(self)
        own["s"] = s = size_scale(cohort, ctx, self.p.size_scaled)
        own["anchor"] = ctx.w_start - cohort.state[DRIFT]  # the penalty's centre w^t - h_i
        own["shift"] = ctx.server[GLOBAL_VARIATE] / s - cohort.state[LOCAL_VARIATE]

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> Direction:
        own = cohort.own(self)
        grad.add_(own["shift"])
        if self.p.alpha:
            grad.add_((self.p.alpha / own["s"]) * (W - own["anchor"]))
        return Direction(grad, ctx.settings.weight_decay)

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        s, g_i = cohort.own(self)["s"], cohort.state[LOCAL_VARIATE]
        delta = W - ctx.w_start
        g_plus = feddc_variate(g_i, ctx.server[GLOBAL_VARIATE], s, delta, cohort.steps, ctx.lr)
        cohort.new_state[DRIFT] = cohort.state[DRIFT] + delta
        cohort.new_state[LOCAL_VARIATE] = g_plus
        cohort.upload[VARIATE_CHANGE] = s * (g_plus - g_i)

    def finish(self, ctx: RoundContext) -> None:
        N = ctx.settings.num_clients
        ctx.server[GLOBAL_VARIATE] = ctx.server[GLOBAL_VARIATE] + ctx.uploads[VARIATE_CHANGE].sum(0) / N
        ctx.server[MEAN_DRIFT] = ctx.server[MEAN_DRIFT] + (ctx.w_final - ctx.w_start).sum(0) / N


class DriftServer(ServerUpdate):
    r""":math:`w^{t+1} = w^t + \eta_g \sum_i p_i \Delta_i + \bar{h}` (FedDC's ``mean_S theta_i + mean_all h_i``)."""

    name = "feddc"
    summary = "FedDC: w <- w + eta_g sum_i p_i Delta_i + (1/N) sum_all h_i"
    requires = frozenset({MEAN_DRIFT})

    def step(self, ctx: RoundContext) -> torch.Tensor:
        return ctx.w + ctx.settings.global_lr * ctx.aggregate(ctx.deltas) + ctx.server[MEAN_DRIFT]


register_recipe(Recipe(
    name="feddc", display="FedDC", summary="local drift h_i decoupled and corrected: alpha-penalty, SCAFFOLD-like variates, "
                          "w <- mean theta_i + mean h_i",
    source="Gao et al., CVPR 2022 (github.com/gaoliang13/FedDC)", correction="feddc", server="feddc",
    defaults={"alpha": 0.01}, tunable={"algo.alpha": (0.1, 0.01, 0.001)}))
