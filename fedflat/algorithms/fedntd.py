r"""FedNTD (Lee, Jeong, Shin, Kim, Yun and Yun, *Preservation of the Global Knowledge by Not-True Distillation in
Federated Learning*, NeurIPS 2022; code github.com/Lee-Gihun/FedNTD, and Lee-Gihun/FedSOL's ``algorithms/fedntd``):
each client distills from the global model it received on the classes other than each sample's label.

The local objective (paper eq. 4) is

.. math::

    \mathrm{CE}\big(f(w, x), y\big) + \beta \tau^2\, \mathrm{KL}(\tilde{q} \,\Vert\, \tilde{p}),

    \tilde{q} = \mathrm{softmax}\big(f(w^t, x)_{-y} / \tau\big), \quad \tilde{p} = \mathrm{softmax}\big(f(w, x)_{-y} / \tau\big)

over the :math:`C - 1` not-true classes (:math:`C` classes), the KL averaged over the batch
(``nn.KLDivLoss(reduction="batchmean")``, as the code). The teacher is the broadcast model :math:`w^t`, evaluated
without gradient (in ``eval()`` mode for a module with batch statistics; the code's ``dg_model`` runs in whatever
mode it was left, see docs/algorithms.md). A correction part, so that it goes on top of a perturbation
(``algo=fedsam algo.correction=ntd``); the client's direction is then the gradient of this objective.
"""
from __future__ import annotations

from pydantic import Field

from fedflat.core import ClientContext, Correction, Distillation, PartParams, Recipe, register_recipe


class NTDParams(PartParams):
    beta: float = Field(1.0, ge=0, description="beta: weight of the not-true distillation term (0: FedAvg)")
    tau: float = Field(1.0, gt=0, description="tau: distillation temperature")


class NotTrueDistillation(Correction):
    r""":math:`\nabla \big[\mathrm{CE} + \beta \tau^2\, \mathrm{KL}\big(\tilde{q}(w^t) \,\Vert\, \tilde{p}(w)\big)\big]`: FedNTD's local objective, the KL on the not-true classes."""

    name = "ntd"
    summary = "FedNTD: CE + beta tau^2 KL over the not-true classes, from the global model w^t"
    beyond_batch = "its distillation term's gradient is not taken example by example"
    Params = NTDParams

    def distillation(self, ctx: ClientContext) -> Distillation | None:
        r"""FedNTD's term, the received model :math:`w^t` as the teacher (None with :math:`\beta = 0`)."""
        if not self.p.beta:
            return None
        return Distillation(ctx.w_broadcast, self.p.beta, self.p.tau, not_true=True)


register_recipe(Recipe(
    name="fedntd", display="FedNTD", summary="not-true distillation: CE + beta tau^2 KL on the not-true classes from w^t",
    source="Lee et al., NeurIPS 2022 (github.com/Lee-Gihun/FedNTD)", correction="ntd",
    defaults={"beta": 1.0, "tau": 1.0}, tunable={"algo.beta": (0.1, 0.3, 1.0, 3.0)}))
