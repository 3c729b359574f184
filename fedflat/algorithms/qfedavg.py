r"""q-FedAvg (Li et al., ICLR 2020, "Fair Resource Allocation in Federated Learning").

With :math:`L = 1 / \eta_l` and :math:`F_i` client :math:`i`'s loss at :math:`w^t` over its local data (before training):

.. math::

    \Delta w_i = L (w^t - w_{i,E}), \quad \Delta_i^q = F_i^q\, \Delta w_i,

    h_i = q F_i^{q-1} \lVert \Delta w_i \rVert^2 + L F_i^q,

    w^{t+1} = w^t - \frac{\sum_i \Delta_i^q}{\sum_i h_i} .

:math:`q = 0` is FedAvg with uniform weights and :math:`\eta_g = 1`.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.core import ClientContext, Cohort, PartParams, Recipe, RoundContext, ServerUpdate, register_recipe

CLIENT_LOSS = "qfedavg.F"  # upload: F_i of the round's clients, [K]
_EVAL_CHUNK = 1024


@torch.no_grad()
def client_objective(ctx: ClientContext, client: int, w: torch.Tensor) -> torch.Tensor:
    """``F_i(w)``: the mean loss of client ``client`` over all of its local samples (no augmentation,
    no backprop), in chunks of at most 1024 samples."""
    total, count = torch.zeros((), dtype=w.dtype, device=w.device), 0
    for batch in ctx.batches.full(client, _EVAL_CHUNK):
        total += ctx.oracle.loss(w.unsqueeze(0), batch)[0] * batch.y.shape[1]
        count += batch.y.shape[1]
    return total / count


def qfedavg_step(w: torch.Tensor, w_final: torch.Tensor, F: torch.Tensor, q: float, lr: float) -> torch.Tensor:
    r""":math:`w - \sum_i \Delta_i^q / \sum_i h_i` with :math:`\Delta_i^q = F_i^q L (w - w_{i,E})`,
    :math:`h_i = q F_i^{q-1} \lVert L (w - w_{i,E}) \rVert^2 + L F_i^q`, :math:`L = 1/\mathrm{lr}`."""
    L = 1.0 / lr
    dw = L * (w - w_final)
    Fq = F.pow(q)
    D = Fq[:, None] * dw
    h = L * Fq
    if q != 0:
        h = h + q * F.pow(q - 1) * dw.pow(2).sum(1)
    return w - D.sum(0) / h.sum()


class QParams(PartParams):
    q: float = Field(1.0, ge=0, description="fairness exponent (0: FedAvg)")


class QFedAvg(ServerUpdate):
    """q-FedAvg's server step; each client computes ``F_i`` at the broadcast model and uploads it."""

    name = "qfedavg"
    summary = "q-FedAvg: w <- w - sum F_i^q dw_i / sum (q F_i^(q-1) ||dw_i||^2 + L F_i^q)"
    individual = "its step uses each client's own loss and update norm"
    beyond_batch = "each client computes its loss over all its data"
    Params = QParams

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        cohort.upload[CLIENT_LOSS] = torch.stack(
            [client_objective(ctx, client, ctx.w_start) for client in cohort.ids.tolist()])

    def step(self, ctx: RoundContext) -> torch.Tensor:
        w_new = qfedavg_step(ctx.w, ctx.w_final, ctx.uploads[CLIENT_LOSS], self.p.q, ctx.lr)
        return ctx.w + ctx.settings.global_lr * (w_new - ctx.w)


register_recipe(Recipe(
    name="qfedavg", display="q-FedAvg",
    summary="fair aggregation: clients with higher loss F_i weigh more (q-FFL, q = 1)",
    source="Li et al., ICLR 2020", server="qfedavg", defaults={"q": 1.0},
    tunable={"algo.q": (0.1, 1.0, 5.0)}))
