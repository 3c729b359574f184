r"""FedALA (Zhang, Hua, Wang, Song, Xue, Ma and Guan, *FedALA: Adaptive Local Aggregation for Personalized Federated
Learning*, AAAI 2023; code github.com/TsingZ0/FedALA, and TsingZ0/PFLlib's ``utils/ALA.py``): each client starts
its local training from an element-wise learned mix of its previous local model and the global model.

Client ``i`` keeps its last local model ``theta_i`` and its aggregation weights ``W_i`` (ones at first). On receiving
``w^t`` it sets the lower layers to ``w^t`` and, on the higher ones (the model's last ``ala_tensors`` parameter
tensors; 0: all of them, as the code's ``layer_idx = 0``), learns

.. math::

    \hat{\theta} = \theta_i + (w^t - \theta_i) \odot W_i,

    W_i \leftarrow \mathrm{clip}_{[0,1]}\Big(W_i - \eta\, \nabla_{\hat{\theta}} L(\hat{\theta}; b) \odot (w^t - \theta_i)\Big)

batch by batch over :math:`\lceil s\, n_i / B \rceil` batches of its data (``s = rand_percent / 100``, the batches drawn from its
stream ``ala``, the same every epoch): one epoch, or at its first adaptation epochs until the standard deviation of the
last ``num_pre_loss`` epochs' last-batch losses is below ``threshold`` (at most ``ala_max_epochs``). Local training
(the recipe's: SGD) starts from ``theta^``; the server averages (``weighting: samples``, as the code). A client's
first participation has no ``theta_i`` and starts from ``w^t`` (the code skips ALA while the local model equals the
global one, i.e. in round 0). Evaluation is personalized: each client's ``theta^`` of its last participation (the
code evaluates the clients' models right after this initialization).

Differences with the code (docs/algorithms.md): its subset is a random contiguous slice of ``s n_i`` samples, here
batches of the client's own shuffled stream; its start phase has no cap (``ala_max_epochs`` bounds it here); a
client that never trained starts its first ALA from the initial model in the code, from ``w^t`` here; the start
phase is the code's first ALA of a client, here an ALA whose ``W_i`` is still all ones (they are kept as the client's
rows; an ALA that left every weight at exactly 1 would start again).
"""
from __future__ import annotations

import math

import torch
from pydantic import Field

from fedflat.algorithms.fedbabu import OwnModel
from fedflat.core import (AlgorithmError, ClientContext, Cohort, PartParams, Recipe, TrainSettings,
                          register_recipe)

LOCAL = "ala.theta_i"  # client state: the client's last local model
WEIGHTS = "ala.W_i"  # client state: its element-wise aggregation weights (1 outside the adapted tensors)
PERSONAL = "ala.w_i"  # client state: the model its last local training started from (its personalized model)


class ALAParams(PartParams):
    eta: float = Field(1.0, ge=0, description="eta: the step size of the aggregation weights (0: FedAvg)")
    rand_percent: float = Field(80.0, gt=0, le=100, description="s: the percent of local data ALA learns on")
    ala_tensors: int = Field(2, ge=0, description="the model's last ala_tensors parameter tensors are adapted (the "
                                                  "code's layer_idx; 2: the head's weight and bias; 0: all)")
    threshold: float = Field(0.1, gt=0, description="start phase: stop when the loss std is below it")
    num_pre_loss: int = Field(10, ge=1, description="start phase: the std over this many last epochs")
    ala_max_epochs: int = Field(100, ge=1, description="start phase: at most this many epochs (the code has no cap)")


def adapted_mask(settings: TrainSettings, tensors: int) -> torch.Tensor:
    """The mask ``[P]`` of the model's last ``tensors`` parameter tensors (all of them for 0)."""
    layout = settings.layout
    if layout is None:
        raise AlgorithmError("FedALA needs the model's parameter layout (settings.layout)")
    if tensors > len(layout.names):
        raise AlgorithmError(f"algo.ala_tensors={tensors}: the model has {len(layout.names)} parameter tensors")
    mask = torch.zeros(layout.size, dtype=torch.bool)
    start = 0 if tensors == 0 else layout.offsets[len(layout.names) - tensors]
    mask[start:] = True
    return mask


def ala_converged(losses: list[torch.Tensor], window: int, threshold: float) -> torch.Tensor:
    """``[C]``: more than ``window`` epochs and the (population) std of the last ``window`` losses below
    ``threshold`` (the code's ``np.std(losses[-num_pre_loss:]) < threshold``)."""
    if len(losses) <= window:
        return torch.zeros_like(losses[-1], dtype=torch.bool)
    return torch.stack(losses[-window:]).double().std(0, unbiased=False) < threshold


class AdaptiveLocalAggregation(OwnModel):
    r"""FedALA's start model :math:`\hat{\theta} = \theta_i + (w^t - \theta_i) \odot W_i` on the adapted tensors,
    :math:`w^t` below."""

    name = "ala"
    summary = "FedALA: local training starts from theta_i + (w - theta_i) * W_i, W_i learned on local data"
    Params = ALAParams
    keeps = (LOCAL, WEIGHTS, PERSONAL)
    own_entry = PERSONAL
    beyond_batch = "it learns its aggregation weights on the client's data beyond the local steps' batches"

    def round_backprops(self, num_samples: int, settings: TrainSettings) -> int:
        """At most ``ala_max_epochs`` epochs of ``ceil(s n_i / B)`` batches (:meth:`initialize`'s loops)."""
        return self.p.ala_max_epochs * self.batches(num_samples, settings)

    def batches(self, num_samples: int, settings: TrainSettings) -> int:
        """The batches of one ALA epoch: ``ceil(s n_i / B)`` of the ``rand_percent`` ``s`` of the client's data."""
        return math.ceil(self.p.rand_percent / 100 * int(num_samples) / settings.batch_size)

    def initialize(self, ctx: ClientContext, cohort: Cohort) -> torch.Tensor:
        w = ctx.w_broadcast
        mask = adapted_mask(ctx.settings, self.p.ala_tensors).to(w.device)
        has_local = cohort.known[LOCAL].to(torch.bool).to(w.device)
        theta = torch.where(has_local[:, None], cohort.state[LOCAL].to(w), w)
        theta = torch.where(mask, theta, w)  # the lower layers: the global model's
        weights = torch.where(cohort.known[WEIGHTS].to(torch.bool).to(w.device)[:, None],
                              cohort.state[WEIGHTS].to(w), torch.ones_like(theta))
        gap = w - theta  # zero outside the adapted tensors, and for a client without theta_i
        count = [self.batches(n, ctx.settings) if known else 0
                 for n, known in zip(cohort.num_samples.tolist(), has_local.tolist())]
        schedules = [ctx.batches.extra(ctx.round, int(i), max(c, 1), "ala") for i, c in zip(cohort.ids.tolist(), count)]
        # the start phase: W_i never learned yet (all ones: the code's ``start_phase`` flag, as a client's rows)
        start_phase = ((weights == 1) | ~mask).all(dim=1)
        running = has_local.clone()
        losses: list[torch.Tensor] = []
        last = torch.zeros(cohort.size, device=w.device)
        for epoch in range(self.p.ala_max_epochs):
            for k in range(max(count, default=0)):
                active = running & torch.tensor([k < c for c in count], device=w.device)
                if not bool(active.any()):
                    continue
                batch = ctx.batches.batch([s[min(k, len(s) - 1)] for s in schedules], None)
                batch.clients = int(active.sum())
                loss, g = ctx.oracle.loss_grad(theta + gap * weights, batch)
                stepped = torch.clamp(weights - self.p.eta * g * gap, 0, 1)
                weights = torch.where(active[:, None] & mask, stepped, weights)
                last = torch.where(active, loss.to(last.dtype), last)
            losses.append(last.clone())
            running = running & start_phase & ~ala_converged(losses, self.p.num_pre_loss, self.p.threshold)
            if not bool(running.any()):
                break
        cohort.own(self)["weights"] = weights
        return theta + gap * weights

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        cohort.new_state[LOCAL] = W
        cohort.new_state[PERSONAL] = ctx.w_start
        cohort.new_state[WEIGHTS] = cohort.own(self)["weights"]


register_recipe(Recipe(
    name="fedala", display="FedALA", summary="FedALA: each client starts from an element-wise learned mix of its model and the global",
    source="Zhang et al., AAAI 2023 (github.com/TsingZ0/FedALA)", personalization="ala",
    defaults={"weighting": "samples"}, tunable={"algo.eta": (0.1, 1.0, 10.0)}))
