r"""MOON (Li, He and Song, *Model-Contrastive Federated Learning*, CVPR 2021; code github.com/QinbinLi/MOON, and
Lee-Gihun/FedSOL's ``algorithms/moon``): a contrastive term pulls each local representation toward the global
model's and away from the client's previous local model's.

The local objective (eq. 3-4) is :math:`\mathrm{CE} + \mu\, \ell_{con}`,

.. math::

    \ell_{con} = -\log \frac{\exp\big(\mathrm{sim}(z, z^{glob})/T\big)}{\exp\big(\mathrm{sim}(z, z^{glob})/T\big) + \exp\big(\mathrm{sim}(z, z^{prev})/T\big)}

averaged over the batch, :math:`\mathrm{sim}` the cosine similarity, :math:`z` the representation at the
local model, :math:`z^{glob}` at the received global model :math:`w^t` and :math:`z^{prev}` at the client's own last local model
:math:`w_i^{prev}`, both without gradient. The representation is the model's ``features(x)`` (the input of its linear
head, :class:`fedflat.models.base.FedModel`): the paper adds a projection head (two linear layers) on top of the
base encoder and uses its output; PFLlib's MOON, like fedflat, uses the base's output (docs/algorithms.md). A client
with no previous model yet (its first participation) has no negative: its term is 0, as in the authors' code's first
round, where the pool of previous models is empty (FedSOL's code takes the initial model :math:`w^0` instead).

A correction part (``moon``): its term enters the oracle's one backward pass through the chunk's
:data:`~fedflat.core.OBJECTIVE_TERM` slot (two extra forward passes per step, no extra backprop), so it composes with
a perturbation (``algo=fedsam algo.correction=moon``). Each client keeps :math:`w_i^{prev}` (one model-sized vector).
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.core import (OBJECTIVE_TERM, ClientContext, Cohort, Contrast, Correction, PartParams, Recipe,
                          register_recipe)

PREVIOUS = "moon.w_prev"  # client state: the client's last local model


class MoonParams(PartParams):
    mu: float = Field(1.0, ge=0, description="mu: weight of the model-contrastive term (0: FedAvg)")
    temperature: float = Field(0.5, gt=0, description="T: temperature of the contrastive logits")


class ModelContrast(Correction):
    r""":math:`\nabla [\mathrm{CE} + \mu\, \ell_{con}]` with MOON's model-contrastive loss; keeps each client's last local model."""

    name = "moon"
    summary = "MOON: CE + mu l_con, the representation pulled to the global model's, pushed from the previous local's"
    beyond_batch = "its contrastive term's gradient is not taken example by example"
    Params = MoonParams
    keeps = (PREVIOUS,)
    provides = frozenset({OBJECTIVE_TERM})

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        if self.p.mu:
            on = cohort.known[PREVIOUS].to(torch.bool)
            cohort.shared.put(OBJECTIVE_TERM, Contrast(ctx.w_broadcast, cohort.state[PREVIOUS], on, self.p.mu,
                                                       self.p.temperature))

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        cohort.new_state[PREVIOUS] = W


register_recipe(Recipe(
    name="moon", display="MOON", summary="model-contrastive FL: CE + mu l_con on the representations (global +, previous local -)",
    source="Li, He and Song, CVPR 2021 (github.com/QinbinLi/MOON)", correction="moon",
    defaults={"mu": 1.0, "temperature": 0.5}, tunable={"algo.mu": (0.1, 1.0, 5.0, 10.0)}))
