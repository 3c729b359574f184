"""MoFedSAM (Qu et al., ICML 2022): FedCM's client momentum with local SAM.

Local direction ``a g(w + eps) + (1 - a) m``, ``eps = rho g(w)/||g(w)||``, ``m`` the previous round's
``Gbar``; FedAvg server. Defaults ``rho = 0.1``, ``a = 0.1``.
"""
from __future__ import annotations

from fedflat.core import MOMENTUM_WEIGHT_GRID, RHO_GRID, Recipe, register_recipe

register_recipe(Recipe(
    name="mofedsam", display="MoFedSAM", summary="FedCM momentum with local SAM: a g(w + eps) + (1 - a) m",
    source="Qu et al., ICML 2022",
    perturbation="sam", correction="momentum", defaults={"rho": 0.1, "a": 0.1},
    tunable={"algo.rho": RHO_GRID, "algo.a": MOMENTUM_WEIGHT_GRID}))
