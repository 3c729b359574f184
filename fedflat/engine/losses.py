"""The clients' loss ``l(f(w, x), y)`` (``train.loss`` by name, :func:`fedflat.engine.problem.configured_loss`, or
``loss_fn`` in the Python API).

A loss is a function ``loss(logits[B, K], y[B]) -> [B]`` of one loss per sample (``reduction="none"``), which
the engines average over a batch's real samples (both engines, under ``torch.func.vmap`` too: it must be a
functional PyTorch expression, without ``.item()`` or in-place writes to its inputs), the evaluation sums over
the held-out set and the diagnostics average over their samples. ``None`` is cross-entropy computed as before
(``F.cross_entropy``'s own mean), so a run that names no loss keeps every number.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from fedflat.core import ConfigError

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def focal_loss(logits: torch.Tensor, y: torch.Tensor, gamma: float = 2.0) -> torch.Tensor:
    """Lin et al.'s focal loss, ``FL(p_t) = -(1 - p_t)^gamma log p_t`` per sample (their eq. 4 without the class
    weights ``alpha``); ``gamma = 0`` is cross-entropy."""
    log_pt = F.log_softmax(logits, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
    return -(1 - log_pt.exp()).pow(gamma) * log_pt


def mean_loss(loss: LossFn | None, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The batch's mean loss."""
    return F.cross_entropy(logits, y) if loss is None else loss(logits, y).mean()


def per_sample(loss: LossFn | None, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One loss per sample ``[B]``."""
    return F.cross_entropy(logits, y, reduction="none") if loss is None else loss(logits, y)


def summed_loss(loss: LossFn | None, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The batch's summed loss (the evaluation's)."""
    return F.cross_entropy(logits, y, reduction="sum") if loss is None else loss(logits, y).sum()


def check_loss(loss: LossFn | None, logits: torch.Tensor, y: torch.Tensor) -> None:
    """A one-line error for a loss that does not give one finite value per sample (checked before round 0)."""
    if loss is None:
        return
    if not callable(loss):
        raise ConfigError(f"loss_fn must be a function (logits, y) -> one loss per sample, got {type(loss).__name__}")
    try:
        out = loss(logits, y)
    except Exception as err:  # noqa: BLE001 - whatever the user's function raises, said in one line
        raise ConfigError(f"loss_fn(logits[B, K], y[B]) failed on a sample batch: {type(err).__name__}: {err}") from None
    if not torch.is_tensor(out) or out.shape != y.shape:
        shape = tuple(out.shape) if torch.is_tensor(out) else type(out).__name__
        raise ConfigError(f"loss_fn must return one loss per sample, shape {tuple(y.shape)}, got {shape}: "
                          "use reduction='none'")
