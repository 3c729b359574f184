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
        return ctx.w + ctx.settings.global_lr * mean_update(ctx)


def mean_update(ctx: RoundContext) -> torch.Tensor:
    r""":math:`\sum_i p_i \Delta_i` (``ctx.aggregate(ctx.deltas)``); on a CPU where no part made ``ctx.deltas``, column
    block by column block (:func:`~fedflat.algorithms.scaffold.column_blocks`), so that the round holds no ``[K, P]``
    of updates beside the uploads (100 LoRA clients of RoBERTa-base: 700 MB). Each block's ``weights @ D`` is a BLAS
    product of another width than the whole row's: the same bits where the BLAS sums a column alike for every width
    (the AMD EPYC of docs/benchmarks.md), within a K-term sum's rounding elsewhere (docs/architecture.md,
    "Exactness")."""
    if ctx.has_deltas or ctx.w.device.type != "cpu":
        return ctx.aggregate(ctx.deltas)
    from fedflat.algorithms.scaffold import column_blocks

    w_final, w, dtype = ctx.w_final, ctx.w, torch.result_type(ctx.w_final, ctx.w)
    weights, mean = ctx.weights.to(dtype), torch.empty(w_final.shape[-1], dtype=dtype)
    for b in column_blocks(w_final):
        mean[b] = weights @ torch.sub(w_final[:, b], w[..., b])
    return mean


register_recipe(Recipe(
    name="fedavg", display="FedAvg", summary="local SGD, average of the updates (algo.weighting: uniform | samples)",
    source="McMahan et al., AISTATS 2017"))
