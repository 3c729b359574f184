r"""FedGF (Lee & Yoon, *Rethinking the Flat Minima Searching in Federated Learning*, ICML 2024).

Clients evaluate their gradient at an interpolation of two perturbed models: the global one the server builds
from its last update, :math:`\tilde{w}_g = w^t + \rho_g (w^{t-1} - w^t) / \lVert w^{t-1} - w^t \rVert` (an ascent along the global
pseudo-gradient, a point fixed for the round), and the local SAM one, :math:`w + \rho\, g(w) / \lVert g(w) \rVert`:

.. math::

    \bar{w} = c\, \tilde{w}_g + (1 - c) \Big(w + \rho \frac{g(w)}{\lVert g(w) \rVert}\Big),

    \text{i.e.} \quad \epsilon = c\, (\tilde{w}_g - w) + (1 - c)\, \rho \frac{g(w)}{\lVert g(w) \rVert} .

The weight :math:`c` is the share of the last :math:`W` rounds whose divergence :math:`D_t = \frac{1}{K} \sum_i \lVert w_{i,E} - w^t \rVert`
exceeded the threshold :math:`T_D`: the more clients drift apart, the more the global perturbation counts.
Round 0 (no global perturbation yet, :math:`c = 0`) is FedSAM; :math:`c = 0` throughout (a threshold never exceeded) is
FedSAM exactly. Two backprops per step; two model-sized vectors down (:math:`w^t` and :math:`\tilde{w}_g - w^t`) and :math:`c`.

Source of the rules and defaults: the authors' code (github.com/hwan-sig/Official-FedGF,
``fedlab/contrib/algorithm/fedgf.py``): :math:`\rho_g = \rho` unless given, :math:`W = 30`; its CIFAR script grids
:math:`\rho \in \{0.02, 0.05, 0.1\}` and passes :math:`\{0.2, 0.3\}` as ``--c_o``, a flag its argument parser does not define; we
read them as the threshold :math:`T_D` it needs (the paper's text was not reachable here).
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.algorithms.fedsam import LocalSAM, SAMParams
from fedflat.core import NORM_EPS, ClientContext, Cohort, Recipe, RoundContext, init, register_recipe

GLOBAL_PERTURBATION = "gf.global_perturbation"  # w~_g - w^t = rho_g (w^{t-1} - w^t)/||.||, sent to clients
WEIGHT = "gf.c"  # c, sent to clients
WINDOW = "gf.window"  # the last W divergence indicators 1[D > T_D] (a ring), kept on the server
SEEN = "gf.seen"  # rounds recorded in the window so far


class GlobalFlatnessParams(SAMParams):
    rho_g: float | None = Field(None, ge=0, description="radius of the global perturbation (None: rho)")
    threshold: float = Field(0.2, ge=0, description="T_D: the divergence mean_i ||w_i,E - w^t|| above which a "
                                                    "round counts towards c")
    window: int = Field(30, ge=1, description="W: rounds over which c averages the divergence indicators")


def flatness_weight(window: torch.Tensor, seen: int, divergence: float, threshold: float) -> tuple[torch.Tensor, float]:
    """The window with round ``seen``'s indicator ``1[divergence > threshold]`` in its ring slot, and ``c``: the
    mean of the indicators of the last ``min(seen + 1, W)`` rounds."""
    window = window.clone()
    window[seen % window.numel()] = float(divergence > threshold)
    return window, float(window[:min(seen + 1, window.numel())].mean())


class GlobalFlatness(LocalSAM):
    r"""FedGF's perturbation: :math:`\epsilon = c\, (\tilde{w}_g - w) + (1 - c)\, \rho\, g(w) / \lVert g(w) \rVert`, the server's part of it."""

    name = "gf"
    summary = "FedGF: interpolates the global perturbed model and the local SAM one with a drift-adaptive c"
    individual = "its weight c follows the mean norm of the clients' own updates"
    Params = GlobalFlatnessParams
    server_state = {GLOBAL_PERTURBATION: init.zeros, WEIGHT: init.scalar(0.0),
                    WINDOW: init.vector("window", dtype=torch.float64, device="cpu"),
                    SEEN: init.scalar(0, dtype=torch.long, device="cpu")}
    sends = (GLOBAL_PERTURBATION, WEIGHT)
    global_direction = (GLOBAL_PERTURBATION, 1.0)

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch) -> torch.Tensor | None:
        local = super().perturb(ctx, cohort, k, W, batch)
        c = ctx.server[WEIGHT]  # a tensor, never branched on (no host sync); c = 0 leaves FedSAM's eps bit for bit
        toward_global = c * (ctx.w_start + ctx.server[GLOBAL_PERTURBATION] - W)  # c (w~_g - w)
        return toward_global if local is None else toward_global + (1 - c) * local

    def finish(self, ctx: RoundContext) -> None:
        r"""Records the round's divergence :math:`D_t = \frac{1}{K} \sum_i \lVert w_{i,E} - w^t \rVert` and updates :math:`c`."""
        divergence = float(ctx.deltas.norm(dim=1).mean())
        seen = int(ctx.server[SEEN])
        window, c = flatness_weight(ctx.server[WINDOW], seen, divergence, self.p.threshold)
        ctx.server[WINDOW], ctx.server[SEEN] = window, torch.tensor(seen + 1)
        ctx.server[WEIGHT] = torch.tensor(c, dtype=ctx.w.dtype, device=ctx.w.device)
        ctx.log.update(gf_divergence=divergence, gf_c=c)

    def after_step(self, ctx: RoundContext, w_new: torch.Tensor) -> None:
        r""":math:`\tilde{w}_g - w^{t+1} = \rho_g (w^t - w^{t+1}) / \lVert w^t - w^{t+1} \rVert`: an ascent along the pseudo-gradient."""
        step = ctx.w - w_new
        rho_g = self.p.rho if self.p.rho_g is None else self.p.rho_g
        ctx.server[GLOBAL_PERTURBATION] = rho_g * step / (step.norm() + NORM_EPS)


register_recipe(Recipe(
    name="fedgf", display="FedGF",
    summary="FedGF: local SAM at an interpolation of the global and the local perturbed model",
    source="Lee & Yoon, ICML 2024; the authors' code (github.com/hwan-sig/Official-FedGF)",
    perturbation="gf", defaults={"rho": 0.05},
    # T_D: the authors' two values (their local work: 1 epoch of batch 64 at lr 0.01), then two on the scale of the
    # divergence under the seeds' shared setting (5 epochs at lr 0.1), where theirs make c = 1 from round 1 on
    tunable={"algo.rho": (0.02, 0.05, 0.1), "algo.threshold": (0.2, 0.3, 1.0, 3.0)}))
