r"""FedNova (Wang, Liu, Liang, Joshi and Poor, *Tackling the Objective Inconsistency Problem in Heterogeneous Federated
Optimization*, NeurIPS 2020): normalized averaging by each client's number of local steps.

Client :math:`i` takes :math:`\tau_i` local steps (:math:`E_i` here); its update is normalized by :math:`\lVert a_i \rVert_1`, the sum of the
coefficients its local optimizer gives the step gradients: :math:`\tau_i` for plain SGD,
:math:`\big(\tau_i - \rho (1 - \rho^{\tau_i}) / (1 - \rho)\big) / (1 - \rho)` for SGD with heavy-ball momentum :math:`\rho` (paper §4,
eq. (11); the authors' ``distoptim/FedNova.py`` accumulates the same sum step by step). The server steps

.. math::

    w^{t+1} = w^t + \eta_g \tau_{\mathrm{eff}} \sum_i p_i \frac{\Delta_i}{\lVert a_i \rVert_1}, \qquad
    \tau_{\mathrm{eff}} = \sum_i p_i \lVert a_i \rVert_1

(paper eq. (7), :math:`d_i = -\Delta_i / (\eta_l \lVert a_i \rVert_1)`), with the sample-size weights :math:`p_i = n_i / \sum_{j \in S} n_j`
of the paper and of both public codes (the recipe's ``weighting: samples``). With equal :math:`\tau_i` it is FedAvg with
the same weights.

Public codes. github.com/JYWa/FedNova (the authors') and Lee-Gihun/FedSOL's ``algorithms/fednova`` compute the same
step (FedSOL's as :math:`c\, w^t + \sum_i c_1 p_i w_i / a_i`, :math:`c = 1 - c_1 c_2`). Not here: the authors' optional server
momentum ``gmf`` (the ``avgm`` server is FedAvgM's momentum, not normalized), their FedProx normalizer :math:`a_i =
\sum_k (1 - \eta \mu)^k` with :math:`\tau_{\mathrm{eff}} = \sum_i p_i \tau_i` (the ``nova`` server sees no proximal coefficient: a
``correction=prox`` run is normalized as plain SGD), and FedSOL's ``nova_ccvr`` control variate.
"""
from __future__ import annotations

import torch

from fedflat.core import AlgorithmError, Recipe, RoundContext, ServerUpdate, TrainSettings, register_recipe


def normalizer(steps: torch.Tensor, settings: TrainSettings) -> torch.Tensor:
    r""":math:`\lVert a_i \rVert_1` per client from its local step counts ``steps[K]``: :math:`\tau_i` under plain SGD, eq. (11)'s
    :math:`\big(\tau - \rho (1 - \rho^\tau) / (1 - \rho)\big) / (1 - \rho)` under heavy-ball momentum :math:`\rho` (fresh every round)."""
    tau = steps.to(torch.float64)
    opt = settings.optimizer
    if opt.plain:
        return tau
    if opt.name != "sgd" or opt.nesterov or opt.dampening or opt.keep != "round":
        raise AlgorithmError("FedNova's normalizer ||a_i||_1 is derived for plain SGD or heavy-ball momentum restarted "
                             f"every round; got train.optimizer={opt.name} (nesterov {opt.nesterov}, dampening "
                             f"{opt.dampening}, keep {opt.keep}): use train.optimizer=sgd with train.momentum only")
    rho = opt.momentum
    return (tau - rho * (1 - rho ** tau) / (1 - rho)) / (1 - rho)


class NormalizedAverage(ServerUpdate):
    r""":math:`w^{t+1} = w^t + \eta_g \tau_{\mathrm{eff}} \sum_i p_i \Delta_i / \lVert a_i \rVert_1` (FedNova eq. (7))."""

    name = "nova"
    summary = "FedNova: w <- w + eta_g tau_eff sum_i p_i Delta_i / ||a_i||_1, tau_eff = sum_i p_i ||a_i||_1"
    individual = "scales each client's own update by its normalizer 1 / ||a_i||_1"

    def step(self, ctx: RoundContext) -> torch.Tensor:
        a = normalizer(ctx.steps, ctx.settings)
        p = ctx.weights.to(torch.float64)
        tau_eff = float(p @ a)
        scale = (p * tau_eff / a).to(ctx.w.dtype)  # FedNova's weight of each client's Delta_i
        ctx.log["nova_tau_eff"] = tau_eff
        return ctx.w + ctx.settings.global_lr * (scale @ ctx.deltas)


register_recipe(Recipe(
    name="fednova", display="FedNova", summary="normalized averaging: w <- w + tau_eff sum_i p_i Delta_i / ||a_i||_1 (sample weights)",
    source="Wang et al., NeurIPS 2020 (github.com/JYWa/FedNova)", server="nova", defaults={"weighting": "samples"}))
