r"""FedRep (Collins, Hassani, Mokhtari and Shakkottai, *Exploiting Shared Representations for Personalized Federated
Learning*, ICML 2021): the head stays on each client (FedPer's mechanics) and the local update alternates.

A client first trains its head with the representation (the body) frozen, then the body with the head frozen
(FedRep's Algorithm 1; its code: the first ``local_epochs - rep_epochs`` epochs the head, the last ``rep_epochs``
the body). With :math:`E_i` steps of :math:`\lceil n_i / B \rceil` per epoch, step :math:`k` of client :math:`i` moves

.. math::

    \begin{cases}
    \text{the head} & \text{if } k < E_i - \min\big(E_i,\ \mathrm{rep\_epochs} \lceil n_i / B \rceil\big), \\
    \text{the body} & \text{otherwise}
    \end{cases}

(the direction of the method's local step, masked; the frozen entries keep their values, weight decay included).
The server aggregates the bodies; each client keeps its head; evaluation is personalized, as FedPer's.

Parts: personalization ``fedrep`` (FedPer's private head, providing its mask to the chunk) and correction ``fedrep``
(the alternation, which needs it). Recipe ``fedrep`` (as published: SGD); ``algo=fedrep algo.perturbation=sam``
takes SAM's perturbation in both phases. The correction takes the role SCAFFOLD's or FedDyn's would, so FedRep
composes with perturbations, filters, aggregations and server updates, not with another correction.
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.algorithms.fedper import FedPer
from fedflat.core import ClientContext, Cohort, Correction, Direction, PartParams, Recipe, Slot, register_recipe

HEAD = Slot("fedrep.head", "the mask [P] of the private head's entries (the personalization's)")


class FedRepHead(FedPer):
    """FedPer's private head, with its mask shared with the chunk's alternating correction."""

    name = "fedrep"
    summary = "FedRep: FedPer's private head (the last personal_layers layers), its mask given to the local steps"
    provides = frozenset({HEAD})

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        cohort.shared.put(HEAD, self.private(ctx.settings).to(ctx.w_start.device))


class AlternatingParams(PartParams):
    rep_epochs: int = Field(1, ge=1, description="the last rep_epochs local epochs train the body (the head frozen); "
                                                 "the epochs before train the head (the body frozen)")


class Alternating(Correction):
    """FedRep's local update: the head's steps, then the body's (the direction masked to the trained entries)."""

    name = "fedrep"
    summary = "FedRep: the first steps train the head only, the last rep_epochs epochs the body only"
    Params = AlternatingParams
    requires = frozenset({HEAD})

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        per_epoch = (cohort.num_samples + ctx.settings.batch_size - 1) // ctx.settings.batch_size
        body_steps = torch.minimum(cohort.steps, self.p.rep_epochs * per_epoch)
        cohort.own(self)["head_steps"] = (cohort.steps - body_steps).to(ctx.w_start.device)

    def trained(self, cohort: Cohort, k: int) -> torch.Tensor:
        """The entries step ``k`` moves, ``[C, P]``: the head in a client's head steps, the body after."""
        on_head = (k < cohort.own(self)["head_steps"])[:, None]
        return on_head == cohort.shared[HEAD][None, :]

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> Direction:
        """``(mask (g + wd w), 0)``: the whole masked direction is clipped (a frozen entry gets no decay to add back
        after the clip)."""
        if ctx.settings.weight_decay:
            grad.add_(W, alpha=ctx.settings.weight_decay)
        return Direction(grad.masked_fill_(~self.trained(cohort, k), 0.0), 0.0)


FEDREP = "Collins, Hassani, Mokhtari and Shakkottai, ICML 2021"
register_recipe(Recipe(
    name="fedrep", display="FedRep",
    summary="FedRep: a shared body and a private head per client, trained in turn (head, then body)",
    source=FEDREP, correction="fedrep", personalization="fedrep"))
