r"""MoFedSAM (Qu et al., ICML 2022): FedCM's client momentum with local SAM.

Local direction :math:`a\, g(w + \epsilon) + (1 - a)\, m`, :math:`\epsilon = \rho\, g(w) / \lVert g(w) \rVert`, :math:`m` the previous round's
:math:`\bar{G}`; FedAvg server. Defaults :math:`\rho = 0.1`, :math:`a = 0.1`.
"""
from __future__ import annotations

from fedflat.core import MOMENTUM_WEIGHT_GRID, RHO_GRID, Recipe, register_recipe

register_recipe(Recipe(
    name="mofedsam", display="MoFedSAM", summary="FedCM momentum with local SAM: a g(w + eps) + (1 - a) m",
    source="Qu et al., ICML 2022",
    perturbation="sam", correction="momentum", defaults={"rho": 0.1, "a": 0.1},
    tunable={"algo.rho": RHO_GRID, "algo.a": MOMENTUM_WEIGHT_GRID}))
