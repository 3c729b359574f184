r"""FedAWA (Shi et al., CVPR 2025): aggregation weights optimized on the server from the client vectors.

The client vector of round :math:`t` is :math:`\tau_i = w_{i,E} - w^t` (:math:`\Delta_i`). The server keeps one logit :math:`T_i`
per client and, each round, takes ``awa_steps`` optimizer steps on the sampled clients' logits, with
:math:`\lambda = \mathrm{softmax}(T_S)`, on

.. math::

    L(\lambda) = \sum_i \lambda_i \Big\lVert \tau_i - \sum_j \lambda_j \tau_j \Big\rVert_2 + \sum_i \lambda_i\, d(w^t, w_{i,E})

where :math:`d = 1 - \cos` (``awa_distance: cos``) or the mean squared difference (``euc``): the first term weights up
clients whose update agrees with the weighted aggregate, the second those whose model stays near the global one.
The server then averages with :math:`\lambda` (:math:`w^{t+1} = w^t + \eta_g \sum_i \lambda_i \tau_i`; FedAvg's server).

As the authors' code (github.com/ChanglongShi/FedAWA, ``server_funct.py``) runs it, which fedflat follows:

- a logit starts at the client's sample fraction ``n_i / n`` (so the softmax starts near uniform);
- the optimizer is created afresh every round: Adam, lr 0.001, betas (0.5, 0.999) (or SGD, lr 0.01, momentum
  0.9, weight decay 5e-4), one step per round by default (the code's ``server_epochs = 1``);
- the round aggregates with the ``lambda`` of the last step's forward pass, taken before that step moved the
  logits, so with one step a client's new logit weighs from its next participation on.

One difference, kept on purpose: the code carries the logits from round to round by *position* in the cohort
(``global_T_weights``), which only names the same client under full participation; fedflat keeps them per
client, which is what the code's own bookkeeping (``size_weights_global[select_list[i]]``) records and the paper
describes. The code's ``gamma`` (a scale of the averaged model) is left at its default, 1.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedflat.core import Aggregation, PartParams, Recipe, RoundContext, init, register_recipe

SHIFT = "fedawa.shift"  # server state [N]: T_i - n_i / n, how far each client's logit has moved from its start
DEFAULT_LR = {"adam": 1e-3, "sgd": 1e-2}  # the authors' code


def distance_to_global(w: torch.Tensor, W: torch.Tensor, kind: str) -> torch.Tensor:
    r""":math:`d(w^t, w_{i,E})` for every row of ``W[K, P]``: :math:`1 - \cos` or the mean squared difference, ``[K]``."""
    if kind == "cos":
        return 1 - F.cosine_similarity(W, w.unsqueeze(0), dim=1, eps=1e-8)
    return (W - w).pow(2).mean(dim=1)


def client_vector_objective(lam: torch.Tensor, tau: torch.Tensor, distance: torch.Tensor) -> torch.Tensor:
    r""":math:`L(\lambda) = \sum_i \lambda_i \lVert \tau_i - \lambda^\top \tau \rVert_2 + \sum_i \lambda_i d_i` (``tau[K, P]``, ``d[K]``)."""
    spread = (tau - lam @ tau).norm(dim=1)
    return (lam * spread).sum() + (lam * distance).sum()


class AWAParams(PartParams):
    awa_steps: int = Field(1, ge=1, description="optimizer steps on the logits per round (the code's server_epochs)")
    awa_optimizer: Literal["adam", "sgd"] = "adam"
    awa_lr: float | None = Field(None, gt=0, description="None: 0.001 for adam, 0.01 for sgd (the authors' code)")
    awa_distance: Literal["cos", "euc"] = "cos"


class FedAWA(Aggregation):
    """``p = softmax(T_S)``, the logits optimized on the client-vector objective (module docstring)."""

    name = "fedawa"
    summary = "softmax of per-client logits optimized on the client vectors (FedAWA)"
    individual = "optimizes each client's weight on its own update"
    Params = AWAParams
    server_state = {SHIFT: init.per_client}

    def _optimizer(self, T: torch.Tensor) -> torch.optim.Optimizer:
        lr = self.p.awa_lr or DEFAULT_LR[self.p.awa_optimizer]
        if self.p.awa_optimizer == "adam":
            return torch.optim.Adam([T], lr=lr, betas=(0.5, 0.999))
        return torch.optim.SGD([T], lr=lr, momentum=0.9, weight_decay=5e-4)

    def start(self, ctx: RoundContext) -> torch.Tensor:
        """``n_i / n`` of the sampled clients, where their logits started."""
        n = ctx.num_samples.to(ctx.w.dtype)
        return n / (ctx.settings.total_samples or float(n.sum()))

    def weights(self, ctx: RoundContext) -> torch.Tensor:
        start = self.start(ctx)
        T = (start + ctx.server[SHIFT][ctx.sampled]).requires_grad_(True)
        optimizer = self._optimizer(T)
        tau = ctx.deltas.detach()
        distance = distance_to_global(ctx.w, ctx.w_final, self.p.awa_distance).detach()
        with torch.enable_grad():
            for _ in range(self.p.awa_steps):
                lam = torch.softmax(T, dim=0)
                loss = client_vector_objective(lam, tau, distance)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        shift = ctx.server[SHIFT].clone()  # a new tensor: the round commits the server state as a whole
        shift[ctx.sampled] = T.detach() - start
        ctx.server[SHIFT] = shift
        lam = lam.detach()
        ctx.log["awa_objective"] = loss.item()
        ctx.log["awa_weight_max"] = lam.max().item()
        return lam


register_recipe(Recipe(
    name="fedawa", display="FedAWA",
    summary="local SGD, aggregation weights optimized on the client vectors (server side)",
    source="Shi et al., CVPR 2025 (the authors' code); seed 004 (FedFFT) Table 9 runs it with SAM clients",
    aggregation="fedawa"))
