r"""FedBABU (Oh, Kim and Yun, *FedBABU: Toward Enhanced Representation for Federated Image Classification*, ICLR
2022; code github.com/jhoon-oh/FedBABU, and TsingZ0/PFLlib's ``clientbabu.py``): only the body is federated; the
head stays at its random initialization during training, and each client fine-tunes the model for its own use.

- **Federated training** (correction ``babu``): a client's local direction is masked to the body; the head (the
  model's last ``head_layers`` layers, FedPer's mask) neither moves nor decays, so every upload carries the
  initial head and the global head never changes (the paper's "body update, head frozen"; PFLlib's
  ``requires_grad = False`` on ``model.head``).
- **Personalization** (``babu``): at each participation, after its local training, a client fine-tunes a copy of
  the received global model :math:`w^t` for ``finetune_epochs`` epochs of its own data (plain SGD at :math:`\eta_l^t` with
  the weight decay; ``finetune=full`` trains body and head, as the paper's evaluation and PFLlib's default
  ``fine_tune(['base', 'head'])``; ``head`` only the head) and keeps it as its personal model. Evaluation is
  personalized: each client's latest fine-tuned model on its own test share (the global model before its first
  round).

Difference with PFLlib (docs/algorithms.md): PFLlib fine-tunes every client once, after the last round, from the
final global body; fedflat, whose personalized models are those clients keep from their participations (as Ditto's
and APFL's), fine-tunes at every participation from the :math:`w^t` received that round.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from fedflat.algorithms.fedper import private_layers
from fedflat.core import (AlgorithmError, ClientContext, Cohort, Correction, Direction, PartParams, Personalization,
                          Recipe, TrainSettings, register_recipe)

PERSONAL = "babu.w_i"  # client state: the client's fine-tuned model


def head_mask(settings: TrainSettings, layers: int) -> torch.Tensor:
    """The mask ``[P]`` of the head, the model's last ``layers`` layers."""
    if settings.layout is None:
        raise AlgorithmError("FedBABU needs the model's parameter layout (settings.layout) to find its head")
    return private_layers(settings.layout, layers)


class FrozenHeadParams(PartParams):
    head_layers: int = Field(1, ge=1, description="the head: the model's last head_layers layers, frozen during "
                                                  "federated training (1 = the classifier)")


class FrozenHead(Correction):
    r""":math:`d = M_{body} \odot (g + \lambda_{wd} w)`: the body's direction, the head frozen at its initialization (clipped whole)."""

    name = "babu"
    summary = "FedBABU: only the body moves; the head stays at its random initialization"
    Params = FrozenHeadParams

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        cohort.own(self)["head"] = head_mask(ctx.settings, self.p.head_layers).to(ctx.w_start.device)

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> Direction:
        if ctx.settings.weight_decay:
            grad.add_(W, alpha=ctx.settings.weight_decay)
        return Direction(grad.masked_fill_(cohort.own(self)["head"], 0.0), 0.0)


class FineTuneParams(PartParams):
    finetune_epochs: int = Field(1, ge=0, description="epochs of local fine-tuning of w^t at each participation "
                                                      "(0: the personal model is w^t itself)")
    finetune: Literal["full", "head"] = Field("full", description="what fine-tuning trains: the whole model (the "
                                                                  "paper, PFLlib's default) or the head only")
    head_layers: int = Field(1, ge=1, description="the head for finetune=head: the model's last head_layers layers")


def epochs_of(cohort: Cohort, batch_size: int, epochs: int) -> list[int]:
    r"""The steps of ``epochs`` epochs of each client's data, :math:`\mathrm{epochs} \cdot \lceil n_i / B \rceil`."""
    return [epochs * -(-int(n) // batch_size) for n in cohort.num_samples.tolist()]


def finetune(ctx: ClientContext, cohort: Cohort, start: torch.Tensor, steps: list[int],
             trained: torch.Tensor | None, lr: float | None = None, stream: str = "finetune") -> torch.Tensor:
    r"""Each client's ``start`` after its ``steps`` of plain SGD on its own data, :math:`w \leftarrow w - \mathrm{lr}\, (g + \lambda_{wd} w)` (``lr``:
    :math:`\eta_l^t` unless given; only the ``trained`` entries move, when given), ``[C, P]``; batches from each client's
    stream ``stream``."""
    lr = ctx.lr if lr is None else lr
    schedules = [ctx.batches.extra(ctx.round, int(i), e, stream) for i, e in zip(cohort.ids.tolist(), steps)]
    W = start.expand(cohort.size, -1).clone()
    for k in range(max(steps, default=0)):
        active = torch.tensor([k < e for e in steps], device=W.device)
        batch = ctx.batches.batch([s[min(k, len(s) - 1)] for s in schedules], None)
        batch.clients = int(active.sum())  # the backprops of real rows only, as the local loop counts them
        _, g = ctx.oracle.loss_grad(W, batch)
        d = g.add_(W, alpha=ctx.settings.weight_decay) if ctx.settings.weight_decay else g
        if trained is not None:
            d.masked_fill_(~trained, 0.0)
        W = torch.where(active[:, None], W - lr * d, W)
    return W


class OwnModel(Personalization):
    """A personalization whose clients each keep a whole model of their own in the client-state entry
    :attr:`own_entry` (FedBABU's, Per-FedAvg's, FedALA's): no entry of the federated model stays private, a client's
    model is its kept one once it has one (else ``w``), and the federated update starts from the broadcast."""

    own_entry: str  # the client-state entry holding the client's model (not `personal`: a hook of every part)

    def private(self, settings: TrainSettings) -> torch.Tensor:
        """No entry of the federated model stays on the client (its personal model is a model of its own)."""
        return torch.zeros(settings.layout.size if settings.layout is not None else 0, dtype=torch.bool)

    def models(self, w: torch.Tensor, state: dict[str, torch.Tensor], known: dict[str, torch.Tensor],
               settings: TrainSettings) -> torch.Tensor:
        return torch.where(known[self.own_entry][:, None].to(w.device), state[self.own_entry].to(w.device), w)

    def start(self, w: torch.Tensor, state: dict[str, torch.Tensor], known: dict[str, torch.Tensor],
              settings: TrainSettings) -> None:
        return None  # the federated update starts from the broadcast (FedALA's initialize computes its own)


class FineTune(OwnModel):
    """Each client's personal model: :math:`w^t` fine-tuned on its data at each participation (FedBABU's evaluation)."""

    name = "babu"
    summary = "FedBABU: each client fine-tunes the received global model and keeps it as its personal model"
    Params = FineTuneParams
    keeps = (PERSONAL,)
    own_entry = PERSONAL
    beyond_batch = "it fine-tunes on the client's data beyond the local steps' batches"

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        trained = head_mask(ctx.settings, self.p.head_layers).to(W.device) if self.p.finetune == "head" else None
        steps = epochs_of(cohort, ctx.settings.batch_size, self.p.finetune_epochs)
        cohort.new_state[PERSONAL] = finetune(ctx, cohort, ctx.w_broadcast, steps, trained)


register_recipe(Recipe(
    name="fedbabu", display="FedBABU", summary="FedBABU: the body federated with the head frozen at init; each client fine-tunes w^t",
    source="Oh, Kim and Yun, ICLR 2022 (github.com/jhoon-oh/FedBABU)", correction="babu", personalization="babu",
    defaults={"finetune_epochs": 1}, tunable={"algo.finetune_epochs": (1, 2, 5)}))
