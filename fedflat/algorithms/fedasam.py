r"""FedASAM (Caldarola, Caputo and Ciccone, *Improving Generalization in Federated Learning by Seeking Flat Minima*,
ECCV 2022): FedAvg with Adaptive SAM (Kwon et al., ICML 2021) on the clients.

ASAM makes SAM's ascent scale-invariant with the normalization operator :math:`T_w = \lvert w \rvert + \eta` (elementwise), Kwon et al. 2021, eq. 6:

.. math::

    \epsilon = \rho\, \frac{T_w^2\, g(w)}{\lVert T_w\, g(w) \rVert}

then descends along :math:`g(w + \epsilon)`, one extra backprop per step as SAM. ``normalize`` says which entries ``T_w``
scales: ``weights`` (default), the tensors whose name holds ``weight``, with ``T = 1`` on the others (biases), as
both public codes do (debcaldarola/fedsam ``models/clients/minimizers.py`` and Kwon et al.'s ASAM); ``all``, every
entry, as the equation reads; ``none``, :math:`T = I`: FedSAM's :math:`\epsilon = \rho\, g / \lVert g \rVert` exactly.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedflat.algorithms.fedsam import LocalSAM, SAMParams, warmed_up
from fedflat.core import NORM_EPS, ClientContext, Cohort, Recipe, TrainSettings, normalize_rows, register_recipe


class ASAMParams(SAMParams):
    rho: float = Field(0.5, ge=0, description="ASAM radius (in units normalized by T_w: larger than SAM's)")
    eta: float = Field(0.01, ge=0, description="eta of T_w = |w| + eta, for parameters near zero")
    normalize: Literal["weights", "all", "none"] = Field(
        "weights", description="the entries T_w scales: 'weights' (tensors named *weight*, the public codes), "
                               "'all' (the equation), 'none' (T = I: FedSAM)")


def weight_mask(settings: TrainSettings, like: torch.Tensor) -> torch.Tensor | None:
    """``[P]``: True on the entries of the tensors whose name holds ``weight`` (None without a layout: all)."""
    layout = settings.layout
    if layout is None:
        return None
    return torch.cat([torch.full((n,), "weight" in name, dtype=torch.bool, device=like.device)
                      for name, n in zip(layout.names, layout.numels)])


class AdaptiveSAM(LocalSAM):
    r""":math:`\epsilon = \rho\, T^2 g / \lVert T g \rVert`, :math:`T = \lvert w \rvert + \eta` on the entries ``normalize`` names (1 elsewhere), one L2
    norm per client over all parameters (Kwon et al. 2021, eq. 6)."""

    name = "asam"
    summary = "ASAM: eps = rho T^2 g/||T g||, T = |w| + eta on the weights (one extra backprop)"
    Params = ASAMParams

    def scaling(self, ctx: ClientContext, W: torch.Tensor) -> torch.Tensor:
        r""":math:`T_w` ``[C, P]``: :math:`\lvert w \rvert + \eta` where ``normalize`` says, 1 elsewhere."""
        T = W.abs() + self.p.eta
        mask = weight_mask(ctx.settings, W) if self.p.normalize == "weights" else None
        return T if mask is None else torch.where(mask, T, torch.ones_like(T))

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch) -> torch.Tensor | None:
        if self.p.rho == 0:
            return None
        _, g = ctx.oracle.loss_grad(W, batch)
        radius = warmed_up(self.radius(ctx, cohort), ctx.round, self.p.warmup_rounds)
        if self.p.normalize == "none":
            return normalize_rows(g, radius)
        T = self.scaling(ctx, W)
        scaled = T * g
        return radius * T * scaled / (scaled.norm(dim=-1, keepdim=True) + NORM_EPS)


register_recipe(Recipe(
    name="fedasam", display="FedASAM", summary="FedAvg with Adaptive SAM on the clients (eps = rho T^2 g/||T g||, T = |w| + eta)",
    source="Caldarola et al., ECCV 2022 (github.com/debcaldarola/fedsam); Kwon et al., ICML 2021",
    perturbation="asam", defaults={"rho": 0.5, "eta": 0.01},
    # the authors' CIFAR grids (paper_experiments/cifar10.sh runs rho 0.7, eta 0.2 with SWA)
    tunable={"algo.rho": (0.05, 0.1, 0.5, 0.7, 1.0), "algo.eta": (0.0, 0.01, 0.2)}))
