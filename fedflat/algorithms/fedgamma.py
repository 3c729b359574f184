r"""FedGAMMA (Dai et al., IEEE TNNLS 2024): SCAFFOLD with local SAM.

Local direction :math:`g(w + \epsilon) + c - c_i` with SCAFFOLD's variates, state and server; :math:`\epsilon = \rho\, u / \lVert u \rVert`
from the uncorrected :math:`u = g(w)` (default), or from the corrected :math:`u = g(w) + c - c_i` with
``algo.perturbation=sam_corrected``. Default :math:`\rho = 0.01` (FL-Simulator's tuned value).
"""
from __future__ import annotations

import torch

from fedflat.algorithms.fedsam import LocalSAM
from fedflat.algorithms.scaffold import SHIFT
from fedflat.core import RHO_GRID, ClientContext, Cohort, Recipe, register_recipe


class CorrectedSAM(LocalSAM):
    """SAM whose ascent direction carries SCAFFOLD's correction: ``u = g(w) + c - c_i``."""

    name = "sam_corrected"
    summary = "SAM with the SCAFFOLD-corrected ascent u = g(w) + c - c_i (needs correction 'scaffold')"
    requires = frozenset({SHIFT})

    def ascent(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        return grad + cohort.shared[SHIFT]


register_recipe(Recipe(
    name="fedgamma", display="FedGAMMA",
    summary="SCAFFOLD with local SAM: g(w + eps) + c - c_i (algo.perturbation=sam_corrected: "
                         "eps from g + c - c_i)",
    source="Dai et al., IEEE TNNLS 2024",
    perturbation="sam", correction="scaffold", defaults={"rho": 0.01},
    tunable={"algo.rho": RHO_GRID}))
