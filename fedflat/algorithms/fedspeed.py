r"""FedSpeed (Sun et al., ICLR 2023): FedDyn's prox-correction with a merged SAM gradient.

Local direction :math:`\tilde{g} - h_i + \alpha (w - w^t)` with FedDyn's duals and server, where the quasi-gradient merges
the plain and the perturbed minibatch gradients (Algorithm 1, lines 7-10), with :math:`\mu` = ``merge``:

.. math::

    \tilde{g} = (1 - \mu)\, g(w) + \mu\, g(w + \epsilon), \qquad \epsilon = \rho\, \frac{g(w)}{\lVert g(w) \rVert},

both on the step's batch.
:math:`\mu = 1` (the default) is the plain SAM gradient, as the authors' code (FL-Simulator) runs FedSpeed.
Defaults :math:`\rho = 0.1`, :math:`\alpha = 0.1`, :math:`\mu = 1`.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.algorithms.fedsam import LocalSAM, SAMParams
from fedflat.core import RHO_GRID, ClientContext, Cohort, Recipe, register_recipe

MERGE_GRID = (0.5, 0.75, 0.875, 0.9375, 1.0)  # the merge coefficients of FedSpeed's ablation


class QuasiGradientParams(SAMParams):
    merge: float = Field(1.0, ge=0, le=1, description="weight of the perturbed gradient in the quasi-gradient "
                         "(1 - merge) g(w) + merge g(w + eps) (FedSpeed's alpha; 1: the SAM gradient, 0: the plain one)")


class QuasiGradient(LocalSAM):
    r"""FedSpeed's gradient merging: the SAM ascent, and a descent along :math:`(1 - \mu)\, g(w) + \mu\, g(w + \epsilon)` (:math:`\mu` = ``merge``).

    Both gradients exist in a SAM step already (:math:`g(w)` gives the ascent), so merging costs no backprop."""

    name = "speed"
    summary = "FedSpeed's quasi-gradient (1 - merge) g(w) + merge g(w + eps), eps = rho g(w)/||g(w)||"
    Params = QuasiGradientParams

    def ascent(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        if self.p.merge < 1:
            cohort.own(self)["plain_gradient"] = grad  # g(w) of the current step, [C, P]
        return grad

    def descent_gradient(self, ctx: ClientContext, cohort: Cohort, grad: torch.Tensor) -> torch.Tensor:
        plain = cohort.own(self).pop("plain_gradient", None)
        if plain is None:  # merge = 1, or rho = 0 (then g(w + eps) = g(w) and the merge is the plain gradient)
            return grad
        return self.p.merge * grad + (1 - self.p.merge) * plain


register_recipe(Recipe(
    name="fedspeed", display="FedSpeed", summary="FedDyn's prox-correction with FedSpeed's merged SAM gradient",
    source="Sun et al., ICLR 2023 (Algorithm 1); merge = 1 as in the authors' FL-Simulator",
    perturbation="speed", correction="dyn", server="dyn", defaults={"rho": 0.1, "alpha": 0.1},
    tunable={"algo.rho": RHO_GRID, "algo.merge": MERGE_GRID}))
