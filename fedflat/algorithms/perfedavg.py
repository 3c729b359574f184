r"""Per-FedAvg (Fallah, Mokhtari and Ozdaglar, *Personalized Federated Learning with Theoretical Guarantees: A
Model-Agnostic Meta-Learning Approach*, NeurIPS 2020; first-order and Hessian-free variants; TsingZ0/PFLlib's
``clientperavg.py`` runs the first-order one): FedAvg of MAML's meta-objective :math:`F_i\big(w - \alpha \nabla F_i(w)\big)`.

At local step :math:`k` a client takes an inner step on an independent batch :math:`D` and descends, at rate :math:`\beta`
(``train.lr``), along the gradient at the adapted point on the step's batch :math:`D'` (Algorithm 1; the Hessian-vector
product by the paper's §5 estimate):

.. math::

    \text{FO:}\quad d = g\big(w - \alpha\, g(w; D);\, D'\big)

.. math::

    \text{HF:}\quad d = \big(I - \alpha H(w; D'')\big)\, g\big(w - \alpha\, g(w; D);\, D'\big),

    H(w; D'')\, v \approx \frac{g(w + \delta v;\, D'') - g(w - \delta v;\, D'')}{2 \delta}

:math:`D` and :math:`D''` are drawn from each client's own streams (``perfedavg.inner``, ``perfedavg.hessian``), one batch
per local step. The perturbation ``perfedavg`` (:math:`\epsilon = -\alpha\, g(w; D)`, the HF correction in its descent gradient)
carries the meta-gradient, so the rest of a recipe composes with it (1 extra backprop per step for FO, 3 for HF).
The personalization ``perfedavg`` gives each client its personalized model, the received :math:`w^t` after
``adapt_steps`` steps :math:`w \leftarrow w - \alpha (g + \lambda_{wd} w)` on its own data (the paper's evaluation: one step), and the
evaluation is personalized. PFLlib differences (docs/algorithms.md): it splits one batch of ``2B`` into ``D`` and
``D'`` (an epoch has half as many steps), and its one-step adaptation before evaluation takes a batch of the
client's *test* data; fedflat adapts on training data.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedflat.algorithms.fedbabu import OwnModel, finetune
from fedflat.core import (Batch, ClientContext, Cohort, PartParams, Perturbation, Recipe,
                          register_recipe, shared)

PERSONAL = "perfedavg.w_i"  # client state: the client's adapted model
INNER, HESSIAN = "perfedavg.inner", "perfedavg.hessian"  # the clients' streams of the batches D and D''


class MetaParams(PartParams):
    alpha: float = shared(0.01, ge=0, description="alpha: the inner (adaptation) step size of MAML's objective")
    variant: Literal["fo", "hf"] = Field("fo", description="fo: first-order; hf: Hessian-free (finite-difference "
                                                          "Hessian-vector product)")
    delta: float = Field(1e-3, gt=0, description="HF: the finite-difference radius delta")


class MetaGradient(Perturbation):
    r""":math:`\epsilon = -\alpha\, g(w; D)`; HF: the descent gradient :math:`v - \alpha H(w; D'')\, v` of :math:`v = g(w + \epsilon; D')`."""

    name = "perfedavg"
    summary = "Per-FedAvg: the gradient at w - alpha g(w; D) (FO), with the Hessian-free correction (HF)"
    Params = MetaParams
    beyond_batch = "its inner step and Hessian estimate take batches beyond the step's"

    def __init__(self, params: MetaParams | None = None):
        super().__init__(params)
        self.extra_backprops = 1 if self.p.variant == "fo" else 3

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        own, ids, steps = cohort.own(self), cohort.ids.tolist(), cohort.steps.tolist()
        own[INNER] = [ctx.batches.extra(ctx.round, int(i), int(e), INNER) for i, e in zip(ids, steps)]
        if self.p.variant == "hf":
            own[HESSIAN] = [ctx.batches.extra(ctx.round, int(i), int(e), HESSIAN) for i, e in zip(ids, steps)]

    def _batch(self, ctx: ClientContext, cohort: Cohort, stream: str, k: int, like: Batch) -> Batch:
        schedules = cohort.own(self)[stream]
        batch = ctx.batches.batch([s[min(k, len(s) - 1)] for s in schedules], None)
        batch.clients = like.clients
        return batch

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch: Batch) -> torch.Tensor:
        own = cohort.own(self)
        _, g = ctx.oracle.loss_grad(W, self._batch(ctx, cohort, INNER, k, batch))
        if self.p.variant == "hf":
            own["W"], own["hessian_batch"] = W, self._batch(ctx, cohort, HESSIAN, k, batch)
        return g.mul_(-self.p.alpha)

    def descent_gradient(self, ctx: ClientContext, cohort: Cohort, grad: torch.Tensor) -> torch.Tensor:
        if self.p.variant == "fo":
            return grad
        own, delta = cohort.own(self), self.p.delta
        _, g_plus = ctx.oracle.loss_grad(own["W"] + delta * grad, own["hessian_batch"])
        _, g_minus = ctx.oracle.loss_grad(own["W"] - delta * grad, own["hessian_batch"])
        return grad - (self.p.alpha / (2 * delta)) * (g_plus - g_minus)


class AdaptParams(PartParams):
    alpha: float = shared(0.01, ge=0, description="alpha: the inner (adaptation) step size of MAML's objective")
    adapt_steps: int = Field(1, ge=0, description="steps of adaptation of w^t that make a client's personalized "
                                                  "model (the paper evaluates after one)")


class Adapted(OwnModel):
    r"""Each client's personalized model: :math:`w^t` after ``adapt_steps`` steps
    :math:`w \leftarrow w - \alpha (g + \lambda_{wd} w)`."""

    name = "perfedavg"
    summary = "Per-FedAvg: each client's model is w^t adapted by adapt_steps gradient steps of size alpha"
    Params = AdaptParams
    keeps = (PERSONAL,)
    own_entry = PERSONAL
    beyond_batch = "it adapts on the client's data beyond the local steps' batches"

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        steps = [self.p.adapt_steps] * cohort.size
        cohort.new_state[PERSONAL] = finetune(ctx, cohort, ctx.w_broadcast, steps, None, self.p.alpha,
                                              "perfedavg.adapt")


PER_FEDAVG = "Fallah, Mokhtari and Ozdaglar, NeurIPS 2020"
register_recipe(Recipe(
    name="perfedavg", display="Per-FedAvg", summary="Per-FedAvg (FO): FedAvg of MAML's objective; w^t adapted by one step per client",
    source=PER_FEDAVG, perturbation="perfedavg", personalization="perfedavg",
    tunable={"algo.alpha": (0.001, 0.01, 0.1)}))
register_recipe(Recipe(
    name="perfedavg-hf", display="Per-FedAvg (HF)", summary="Per-FedAvg (HF): the meta-gradient with a finite-difference Hessian-vector product",
    source=PER_FEDAVG, perturbation="perfedavg", personalization="perfedavg", defaults={"variant": "hf"},
    tunable={"algo.alpha": (0.001, 0.01, 0.1)}))
