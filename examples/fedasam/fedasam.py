"""FedASAM: federated averaging with Adaptive SAM on the clients (Caldarola et al., ECCV 2022, after Kwon et al.,
ICML 2021) — written as a plugin against the contract in ``fedflat.core``, the worked example of docs/extending.md.
fedflat now ships FedASAM itself (``algo=fedasam``, fedflat/algorithms/fedasam.py, which scales the weights only,
as the authors' code does); this plugin's ``myasam`` scales every parameter, as the equation reads.

ASAM makes the ascent scale-invariant with the normalization operator ``T_w = |w| + eta`` (elementwise):

    eps = rho T_w^2 g(w) / ||T_w g(w)||                                  (Kwon et al. 2021, eq. 6)

then descends along ``g(w + eps)``, one extra backprop per step as SAM. Use it with ``plugins: [fedasam.py]`` in a
config (docs/extending.md); the parts compose with fedflat's own (``algo.correction=scaffold``).
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.core import PartParams, Perturbation, Recipe, register_part, register_recipe


class ASAMParams(PartParams):
    rho: float = Field(0.5, ge=0, description="ASAM radius (larger than SAM's: the ball is in normalized units)")
    eta: float = Field(0.01, gt=0, description="eta of T_w = |w| + eta, for parameters near zero")


@register_part
class AdaptiveSAM(Perturbation):
    """``eps = rho T^2 g / ||T g||`` with ``T = |w| + eta``, one L2 norm per client over all parameters."""

    name = "myasam"
    summary = "ASAM: eps = rho T^2 g/||T g||, T = |w| + eta (one extra backprop)"
    Params = ASAMParams
    extra_backprops = 1

    def perturb(self, ctx, cohort, k, W, batch):
        if self.p.rho == 0:
            return None
        _, g = ctx.oracle.loss_grad(W, batch)  # g(w) at each client's own row of W [C, P]
        T = W.abs() + self.p.eta
        scaled = T * g
        return self.p.rho * T * scaled / (scaled.norm(dim=-1, keepdim=True) + 1e-12)


register_recipe(Recipe(name="myfedasam", display="MyFedASAM", summary="FedAvg with Adaptive SAM on the clients",
                       source="Caldarola et al., ECCV 2022; Kwon et al., ICML 2021", perturbation="myasam",
                       defaults={"rho": 0.5, "eta": 0.01}, tunable={"algo.rho": (0.1, 0.5, 1.0)}))
