r"""DP-FedSAM (Shi et al., CVPR 2023, arXiv 2303.11242) and DP-FedSAM-top_k (the journal version, arXiv 2305.00873):
local sharpness-aware minimization under client-level differential privacy, whose flatter local models have
smaller, more noise-robust updates.

A client runs local SAM steps — ASAM's (Kwon et al., ICML 2021) adaptive ascent with :math:`T_w = \lvert w \rvert`, as the public
code runs it (``sam.py``, ``adaptive=True`` by default): :math:`\epsilon = \rho\, T_w^2 g / \lVert T_w g \rVert` — and its update
:math:`\Delta_i` is clipped to :math:`C` and noised, :math:`\mathcal{N}(0, \sigma^2 C^2 I)` on the sum of the round's updates, averaged over the
:math:`m` sampled clients: the upload path's ``dp`` stage (:mod:`fedflat.privacy.stage`) with the code's defaults
:math:`C = 0.2`, :math:`\sigma = 0.95`, :math:`\rho = 0.5`. DP-FedSAM-top_k sparsifies each update to its largest entries before
the clip (:mod:`fedflat.algorithms.compression`), so the same noise covers a smaller update.

Where fedflat differs from the public code (github.com/YMJS-Irfan/DP-FedSAM, read at 016bd7f):

- the code clips each parameter tensor to ``C`` separately (``dpfedsam_api.py`` L65-77), so a whole update's norm
  is bounded by :math:`C \sqrt{L}` for :math:`L` tensors while its accountant uses :math:`\sigma` as if it were bounded by :math:`C`;
  fedflat clips the whole update to :math:`C` (the papers' algorithm), which the accountant's sensitivity then holds;
- the code adds :math:`\mathcal{N}(0, \sigma^2 C^2 I / m)` on each client and weighs clients by their sample counts; fedflat adds the
  same total :math:`\mathcal{N}(0, \sigma^2 C^2 I)` to the sum at the server and divides by :math:`m` (the distribution of the uniform
  mean is the same; a sample-weighted mean would change the sensitivity);
- the code's local optimizer has momentum 0.5 and weight decay 5e-4 over 30 local epochs; fedflat's recipe keeps the
  run's ``train`` section (set it as the paper's experiments do);
- the code's accountant assumes Poisson sampling while it samples a fixed number of clients; fedflat accounts
  the sampling it runs (docs/privacy.md);
- DP-FedSAM-top_k has no public code (the repository holds only file-name traces of a ``spar_topk`` option): the
  ratio of kept entries, 0.5 here, and the order sparsify -> clip -> noise (noise on every entry, at the server) are
  fedflat's reading of the journal paper.
"""
from __future__ import annotations

import torch

from fedflat.algorithms.fedsam import LocalSAM, warmed_up
from fedflat.core import ClientContext, Cohort, Recipe, normalize_rows, register_recipe

DP_FEDSAM_PRIVACY = {"mode": "central", "clip": 0.2, "noise_multiplier": 0.95}


class AdaptiveSAM(LocalSAM):
    r"""ASAM's ascent with :math:`T_w = \lvert w \rvert`: :math:`\epsilon = \rho\, \lvert w \rvert (\lvert w \rvert g) / \lVert \lvert w \rvert g \rVert` (Kwon et al. 2021, Eq. (9) with
    :math:`\eta = 0`; DP-FedSAM's ``sam.py`` with ``adaptive=True``)."""

    name = "dpfedsam"
    summary = "DP-FedSAM's adaptive SAM (ASAM with T_w = |w|): eps = rho w^2 g / || |w| g || (one extra backprop)"

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch) -> torch.Tensor | None:
        if self.p.rho == 0:
            return None
        _, grad = ctx.oracle.loss_grad(W, batch)
        scale = W.abs()
        return scale * normalize_rows(scale * grad, warmed_up(self.p.rho, ctx.round, self.p.warmup_rounds))


register_recipe(Recipe(
    name="dpfedsam", display="DP-FedSAM",
    summary="DP-FedSAM: local ASAM steps under client-level DP (clip 0.2, noise 0.95 on the sum)",
    source="Shi et al., CVPR 2023 (arXiv 2303.11242); github.com/YMJS-Irfan/DP-FedSAM",
    perturbation="dpfedsam", defaults={"rho": 0.5}, privacy=DP_FEDSAM_PRIVACY))
register_recipe(Recipe(
    name="dpfedsam-topk", display="DP-FedSAM-top_k",
    summary="DP-FedSAM-top_k: DP-FedSAM with each update sparsified to its top 50% before the clip",
    source="Shi et al., arXiv 2305.00873 (journal version; no public code for top_k)",
    perturbation="dpfedsam", defaults={"rho": 0.5}, privacy=DP_FEDSAM_PRIVACY,
    compression={"name": "topk", "ratio": 0.5}))
