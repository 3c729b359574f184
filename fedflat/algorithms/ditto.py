r"""Ditto (Li, Hu, Beirami and Smith, *Ditto: Fair and Robust Federated Learning Through Personalization*, ICML
2021): the personalization role, a personal model trained beside the federated one.

Each client ``k`` keeps a whole personal model ``v_k``. In a round it trains the federated model as the method's
local step does (FedAvg's SGD, SAM, ... from the broadcast ``w^t``: that part is the recipe's global update, which
the server aggregates as usual) and, at each of the same ``E_k`` local steps on the same mini-batch, its personal
model on its own regularized objective (Ditto's eq. 2 and Algorithm 1):

.. math::

    h_k(v; w^t) = F_k(v) + \frac{\lambda}{2} \lVert v - w^t \rVert^2,

    v \leftarrow v - \eta_l\, \mathrm{clip}\big(g_k(v) + \lambda_{wd} v + \lambda (v - w^t)\big)

Evaluation is personalized: each client's ``v_k`` (``w`` before its first round) on its own test share. Recipe
``ditto`` (FedAvg's global update, as published); any method takes ``algo.personalization=ditto``, and any part
swapped into ``ditto`` (``algo=ditto algo.perturbation=sam``: SAM on the global update) acts on the global update only:
the personal update stays Ditto's SGD.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.core import (Batch, ClientContext, Cohort, PartParams, Personalization, Recipe, TrainSettings,
                          clip_rows, register_recipe)

PERSONAL = "ditto.v_k"  # client state: the client's personal model v_k


def own_models(name: str, w: torch.Tensor, state: dict[str, torch.Tensor],
               known: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each client's kept vector ``name`` (``[C, P]``), ``w`` where it has none yet."""
    return torch.where(known[name][:, None].to(w.device), state[name].to(w.device), w)


class DittoParams(PartParams):
    lam: float = Field(1.0, ge=0, description="lambda of h_k(v; w) = F_k(v) + lambda/2 ||v - w||^2: how close the "
                                              "personal model stays to the global one (0: purely local models)")


class Ditto(Personalization):
    """Ditto's personal model ``v_k``: one proximal SGD step per local step, toward the broadcast ``w^t``."""

    name = "ditto"
    summary = "Ditto: a personal model per client, trained beside the global one on F_k(v) + lam/2 ||v - w^t||^2"
    Params = DittoParams
    keeps = (PERSONAL,)
    extra_backprops = 1
    steps_locally = True

    def private(self, settings: TrainSettings) -> torch.Tensor:
        """No entry of the federated model stays on the client (its personal model is a model of its own)."""
        return torch.zeros(settings.layout.size if settings.layout is not None else 0, dtype=torch.bool)

    def models(self, w: torch.Tensor, state: dict[str, torch.Tensor], known: dict[str, torch.Tensor],
               settings: TrainSettings) -> torch.Tensor:
        return own_models(PERSONAL, w, state, known)

    def start(self, w: torch.Tensor, state: dict[str, torch.Tensor], known: dict[str, torch.Tensor],
              settings: TrainSettings) -> None:
        return None  # the global update starts from the broadcast

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        cohort.own(self)["v"] = own_models(PERSONAL, ctx.w_broadcast, cohort.state, cohort.known)

    def local_step(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch: Batch) -> None:
        r""":math:`v \leftarrow v - \eta_l\, \mathrm{clip}\big(g(v) + \lambda_{wd} v + \lambda (v - w^t)\big)` on the step's batch (active rows only)."""
        own = cohort.own(self)
        v = own["v"]
        _, g = ctx.oracle.loss_grad(v, batch)
        d = g.add_(v, alpha=ctx.settings.weight_decay).add_(v - ctx.w_broadcast, alpha=self.p.lam)
        stepped = v - ctx.lr * clip_rows(d, ctx.settings.clip)
        own["v"] = torch.where(cohort.active[:, None], stepped, v)

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        cohort.new_state[PERSONAL] = cohort.own(self)["v"]


DITTO = "Li, Hu, Beirami and Smith, ICML 2021"
register_recipe(Recipe(
    name="ditto", display="Ditto",
    summary="Ditto: FedAvg's global model, and a personal model per client regularized toward it",
    source=DITTO, personalization="ditto", tunable={"algo.lam": (0.1, 1.0, 2.0)}))
