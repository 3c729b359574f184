"""FedSpeed as FL-Simulator implements it: FedDyn's correction, state and server with the SAM gradient.

Local direction ``g(w + eps) - h_i + alpha (w - w^t)``, ``eps = rho g(w)/||g(w)||``; FedDyn's duals and
server. This is the simplified form of the project spec (an optional method); details of the FedSpeed paper
beyond it are not reproduced. Defaults ``rho = 0.1``, ``alpha = 0.1``.
"""
from __future__ import annotations

from fedflat.algorithms.registry import RHO_GRID, Recipe, register_recipe

register_recipe(Recipe(
    name="fedspeed", summary="FedDyn with the SAM gradient (FL-Simulator's FedSpeed)",
    source="Sun et al., ICLR 2023, as in FL-Simulator",
    perturbation="sam", correction="dyn", server="dyn", defaults={"rho": 0.1, "alpha": 0.1},
    tunable={"algo.rho": RHO_GRID}))
