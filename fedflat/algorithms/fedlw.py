r"""Loss-based aggregation weights: FedLW (Yao & Wang, ICCAI 2025) and FedNoLoWe (Le et al., PLOS ONE 2025).

Both are RECONSTRUCTIONS from the FedSCAM paper's description (seed 003, refs. [9], [10]), with :math:`F_i` the
client's mean training loss of the round:
FedLW :math:`p_i \propto n_i / (F_i + 10^{-8})`; FedNoLoWe :math:`l_i = F_i / \sum_j F_j`, :math:`p_i = (1 - l_i) / (K - 1)`.
"""
from __future__ import annotations

import torch

from fedflat.core import Aggregation, Recipe, RoundContext, register_recipe


def fedlw_weights(num_samples: torch.Tensor, losses: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    r""":math:`p_i = \frac{n_i / (F_i + \varepsilon)}{\sum_j n_j / (F_j + \varepsilon)}`."""
    score = num_samples.to(losses.dtype) / (losses + eps)
    return score / score.sum()


def fednolowe_weights(losses: torch.Tensor) -> torch.Tensor:
    r""":math:`p_i = (1 - F_i / \sum_j F_j) / (K - 1)`: lower loss, larger weight; sums to one.
    One client gets weight 1; all-zero losses give uniform weights."""
    K = losses.shape[0]
    total = losses.sum()
    if K == 1 or total == 0:
        return torch.full_like(losses, 1.0 / K)
    return (1 - losses / total) / (K - 1)


class FedLW(Aggregation):
    name = "fedlw"
    summary = "p_i ∝ n_i / (F_i + 1e-8), F_i the client's mean training loss (reconstruction)"
    individual = "weighs each client by its own training loss"

    def weights(self, ctx: RoundContext) -> torch.Tensor:
        return fedlw_weights(ctx.num_samples, ctx.train_loss)


class FedNoLoWe(Aggregation):
    name = "fednolowe"
    summary = "p_i = (1 - F_i / sum F_j) / (K - 1), F_i the client's mean training loss (reconstruction)"
    individual = "weighs each client by its own training loss"

    def weights(self, ctx: RoundContext) -> torch.Tensor:
        return fednolowe_weights(ctx.train_loss)


register_recipe(Recipe(
    name="fedlw", display="FedLW", summary="local SGD, loss-weighted average p_i ∝ n_i / F_i (reconstruction)",
    source="Yao & Wang, ICCAI 2025 (as described by FedSCAM, seed 003)", aggregation="fedlw"))
register_recipe(Recipe(
    name="fednolowe", display="FedNoLoWe",
    summary="local SGD, normalized loss-based weights (1 - F_i/sum F)/(K-1) (reconstruction)",
    source="Le et al., PLOS ONE 2025 (as described by FedSCAM, seed 003)", aggregation="fednolowe"))
