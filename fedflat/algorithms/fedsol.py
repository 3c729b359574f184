r"""FedSOL (Lee, Jeong, Kim, Oh and Yun, *FedSOL: Stabilized Orthogonal Learning with Proximal Restrictions in
Federated Learning*, CVPR 2024; code github.com/Lee-Gihun/FedSOL): the local step descends the task loss at a point
perturbed along the gradient of a proximal objective, the distillation from the global model (``KLDivLoss(batchmean)``, :math:`\tau = 3`)

.. math::

    L_p(w) = \mathrm{KL}\big(\mathrm{softmax}(f(w_g, x)/\tau) \,\Vert\, \mathrm{softmax}(f(w, x)/\tau)\big)

so that local learning is robust to moves that change the proximal objective:

.. math::

    \epsilon = \rho\, s(w) \odot \frac{\nabla L_p(w)}{\lVert \nabla L_p(w) \rVert}, \qquad g = \nabla \mathrm{CE}(w + \epsilon)

``strength=fixed``: :math:`s = 1` (the code's ``fedsol_fixed``, a SAM step on :math:`L_p`); ``strength=adaptive`` (default,
the code's ``fedsol_adaptive``, ``ExpSAM.first_step``): :math:`s = \mathrm{normalize}(\lvert w - w_g \rvert)`, each parameter tensor's
:math:`\lvert w - w_g \rvert` divided by its L2 norm along the tensor's first dimension (``F.normalize(.., 2, dim=0)``: per column of
a linear layer's weight, the whole of a bias), so the first local step (:math:`w = w_g`) is unperturbed and entries that
moved more from the global model are perturbed more. :math:`\lVert \nabla L_p \rVert` is one norm over all parameters. Two backprops
per step; the global model is the broadcast, so nothing is kept.

At a round's first step :math:`w = w_g` and :math:`\nabla L_p = 0`: fedflat takes :math:`\epsilon = 0` there (and saves the backprop),
where the code's ``fedsol_fixed`` divides the rounding residue of that zero gradient (about 1e-9) by its norm and so
perturbs by ``rho`` along a direction rounding decides (its adaptive variant multiplies it by ``s = 0``).
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedflat.core import (ClientContext, Cohort, Distillation, PartParams, Perturbation, Recipe, normalize_rows,
                          register_recipe)


class ProximalPerturbationParams(PartParams):
    rho: float = Field(1.0, ge=0, description="perturbation radius (the code's configs: 1.0)")
    tau: float = Field(3.0, gt=0, description="temperature of the proximal KL (the code's 3)")
    strength: Literal["adaptive", "fixed"] = Field(
        "adaptive", description="'adaptive': scaled by |w - w_g| normalized per tensor (fedsol_adaptive); 'fixed': "
                                "SAM on the proximal loss (fedsol_fixed)")


def column_normalized(D: torch.Tensor, layout) -> torch.Tensor:
    """``F.normalize(D_j, p=2, dim=0)`` of every parameter tensor ``D_j`` of the rows ``D[C, P]``: each divided by
    ``max(||.||, 1e-12)`` along the tensor's first dimension."""
    parts = []
    for view in layout.views(D):
        parts.append(torch.nn.functional.normalize(view, p=2, dim=1).reshape(D.shape[0], -1))
    return torch.cat(parts, dim=-1)


class ProximalPerturbation(Perturbation):
    r""":math:`\epsilon = \rho\, s \odot \nabla \mathrm{KL}(p_g \Vert p_w) / \lVert \nabla \mathrm{KL} \rVert` with :math:`s` 1 or :math:`\mathrm{normalize}(\lvert w - w_g \rvert)` (module
    docstring)."""

    name = "sol"
    summary = "FedSOL: eps = rho s grad KL(global || local)/||.||, s = |w - w_g| normalized per tensor (adaptive) or 1"
    Params = ProximalPerturbationParams
    extra_backprops = 1
    beyond_batch = ("its perturbation is the gradient of a distillation from the global model, which DP-SGD's private "
                    "per-example gradients do not compute")

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch) -> torch.Tensor | None:
        if self.p.rho == 0 or (k == 0 and ctx.w_start is ctx.w_broadcast):
            return None  # w = w_g: grad L_p = 0 (the code normalizes its rounding residue to radius rho)
        proximal = Distillation(ctx.w_broadcast, 1.0, self.p.tau, data_weight=0.0)
        _, g = ctx.oracle.loss_grad(W, batch, proximal)  # tau^2 grad KL: the scale cancels in the normalization
        eps = normalize_rows(g, self.p.rho)
        if self.p.strength == "fixed":
            return eps
        return column_normalized((W - ctx.w_broadcast).abs(), ctx.settings.layout) * eps


register_recipe(Recipe(
    name="fedsol", display="FedSOL", summary="FedSOL: local SAM-like steps perturbed along the gradient of the KL to the global model",
    source="Lee et al., CVPR 2024 (github.com/Lee-Gihun/FedSOL)", perturbation="sol", defaults={"rho": 1.0},
    tunable={"algo.rho": (0.1, 0.5, 1.0, 2.0)}))
