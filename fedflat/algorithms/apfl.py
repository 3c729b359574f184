r"""APFL (Deng, Kamani and Mahdavi, *Adaptive Personalized Federated Learning*, arXiv:2003.13461, 2020): the
personalization role, a personal model mixed with the federated one.

Each client :math:`i` keeps a local model :math:`v_i` and a mixing weight :math:`\alpha_i`; its personalized model is
:math:`\bar{v}_i = \alpha_i v_i + (1 - \alpha_i) w` (APFL's eq. 3). At each local step, on the step's mini-batch and from the
step's federated iterate :math:`w` (the method's own local step then moves :math:`w`: APFL's :math:`w` update, Algorithm 1),
with :math:`g = \nabla f_i(\bar{v}_i)`, the :math:`v` update of Algorithm 1 and, with ``algo.adaptive``, eq. 10 (both
from the old :math:`v_i` and :math:`w`):

.. math::

    v_i \leftarrow v_i - \eta_l\, \mathrm{clip}(\alpha_i g + \lambda_{wd} v_i),

    \alpha_i \leftarrow \mathrm{clamp}\big(\alpha_i - \eta_l \langle v_i - w, g \rangle, 0, 1\big)

Evaluation is personalized: each client's :math:`\bar{v}_i` with the current global model :math:`w` (``w`` before its first
round). Recipe ``apfl`` (APFL as published: the federated model by local SGD); any method takes
``algo.personalization=apfl``, and a part swapped into ``apfl`` (``algo.perturbation=sam``) acts on the federated
model's steps only: the local model's steps stay APFL's SGD.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.algorithms.ditto import own_models
from fedflat.core import (Batch, ClientContext, Cohort, PartParams, Personalization, Recipe, TrainSettings,
                          clip_rows, register_recipe)

LOCAL = "apfl.v_i"  # client state: the client's local model v_i
ALPHA = "apfl.alpha_i"  # client state: its mixing weight alpha_i (a model-sized row; entry 0 is read)


class APFLParams(PartParams):
    alpha: float = Field(0.25, ge=0, le=1, description="alpha_i of vbar = alpha v + (1 - alpha) w at a client's "
                                                       "first round (APFL's experiments: 0.25, 0.5, 0.75)")
    adaptive: bool = Field(True, description="update alpha_i by gradient descent (eq. 10); false keeps it fixed")


class APFL(Personalization):
    r"""APFL's local model :math:`v_i` and weight :math:`\alpha_i`, stepped beside the federated model."""

    name = "apfl"
    summary = "APFL: each client mixes a local model with the global one, vbar = alpha v + (1 - alpha) w"
    Params = APFLParams
    keeps = (LOCAL, ALPHA)
    extra_backprops = 1
    steps_locally = True

    def kept(self) -> tuple[str, ...]:
        return self.keeps if self.p.adaptive else (LOCAL,)

    def private(self, settings: TrainSettings) -> torch.Tensor:
        """No entry of the federated model stays on the client (its local model is a model of its own)."""
        return torch.zeros(settings.layout.size if settings.layout is not None else 0, dtype=torch.bool)

    def alphas(self, state: dict[str, torch.Tensor], known: dict[str, torch.Tensor], rows: int,
               device: torch.device) -> torch.Tensor:
        r""":math:`\alpha_i` of each client, ``[C, 1]``: kept (adaptive), else the initial :math:`\alpha`."""
        initial = torch.full((rows, 1), self.p.alpha, device=device)
        if not self.p.adaptive:
            return initial
        return torch.where(known[ALPHA][:, None].to(device), state[ALPHA][:, :1].to(device), initial)

    def models(self, w: torch.Tensor, state: dict[str, torch.Tensor], known: dict[str, torch.Tensor],
               settings: TrainSettings) -> torch.Tensor:
        r""":math:`\bar{v}_i = \alpha_i v_i + (1 - \alpha_i) w` (eq. 3)."""
        v = own_models(LOCAL, w, state, known)
        alpha = self.alphas(state, known, v.shape[0], w.device)
        return alpha * v + (1 - alpha) * w

    def start(self, w: torch.Tensor, state: dict[str, torch.Tensor], known: dict[str, torch.Tensor],
              settings: TrainSettings) -> None:
        return None  # the federated model's steps start from the broadcast

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        own = cohort.own(self)
        own["v"] = own_models(LOCAL, ctx.w_broadcast, cohort.state, cohort.known)
        own["alpha"] = self.alphas(cohort.state, cohort.known, cohort.size, own["v"].device)

    def local_step(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch: Batch) -> None:
        r"""One step of :math:`v_i` (and of :math:`\alpha_i`) at :math:`\bar{v}_i = \alpha_i v_i + (1 - \alpha_i) w` (active rows)."""
        own = cohort.own(self)
        v, alpha = own["v"], own["alpha"]
        _, g = ctx.oracle.loss_grad(alpha * v + (1 - alpha) * W, batch)
        active = cohort.active[:, None]
        if self.p.adaptive:
            stepped = (alpha - ctx.lr * ((v - W) * g).sum(dim=-1, keepdim=True)).clamp(0.0, 1.0)
            own["alpha"] = torch.where(active, stepped, alpha)
        d = torch.add(alpha * g, v, alpha=ctx.settings.weight_decay)
        own["v"] = torch.where(active, v - ctx.lr * clip_rows(d, ctx.settings.clip), v)

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        own = cohort.own(self)
        cohort.new_state[LOCAL] = own["v"]
        if self.p.adaptive:
            cohort.new_state[ALPHA] = own["alpha"].expand_as(own["v"]).clone()


APFL_SOURCE = "Deng, Kamani and Mahdavi, arXiv:2003.13461, 2020"
register_recipe(Recipe(
    name="apfl", display="APFL",
    summary="APFL: FedAvg's global model mixed with a local model per client, adaptive alpha_i",
    source=APFL_SOURCE, personalization="apfl", tunable={"algo.alpha": (0.25, 0.5, 0.75)}))
