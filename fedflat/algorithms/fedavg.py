r"""FedAvg (McMahan et al., AISTATS 2017) and the neutral part of every role.

Local :math:`w \leftarrow w - \eta_l (g(w) + \lambda_{wd} w)`; server :math:`w^{t+1} = w^t + \eta_g \sum_i p_i \Delta_i`.
"""
from __future__ import annotations

from typing import Literal

import torch

from fedflat.core import (Aggregation, Correction, Filter, PartParams, Perturbation, Recipe, RoundContext, ServerUpdate,
                          register_recipe)


class NoPerturbation(Perturbation):
    name = "none"
    summary = "plain gradient g(w) (SGD-like local steps)"


class NoFilter(Filter):
    name = "none"
    summary = "the perturbation as computed"


class NoCorrection(Correction):
    name = "none"
    summary = "the gradient itself (FedAvg's local SGD)"



class MeanParams(PartParams):
    weighting: Literal["uniform", "samples"] = "uniform"


class Mean(Aggregation):
    r""":math:`p_i = 1/K` (uniform, the SAM papers' default) or :math:`p_i = n_i / \sum_j n_j` (sample-weighted)."""

    name = "mean"
    summary = "uniform (1/K) or sample-weighted (n_i / sum n_j) average"
    Params = MeanParams

    def weights(self, ctx: RoundContext) -> torch.Tensor:
        if self.p.weighting == "samples":
            n = ctx.num_samples.to(ctx.w.dtype)
            return n / n.sum()
        return torch.full((ctx.K,), 1.0 / ctx.K, dtype=ctx.w.dtype, device=ctx.w.device)


class Average(ServerUpdate):
    r"""FedAvg's server: :math:`w^{t+1} = w^t + \eta_g \sum_i p_i \Delta_i`."""

    name = "avg"
    summary = "w <- w + eta_g sum_i p_i Delta_i"

    def step(self, ctx: RoundContext) -> torch.Tensor:
        return ctx.w + ctx.settings.global_lr * ctx.aggregate(ctx.deltas)


register_recipe(Recipe(
    name="fedavg", display="FedAvg", summary="local SGD, average of the updates (algo.weighting: uniform | samples)",
    source="McMahan et al., AISTATS 2017"))
