"""The gradient oracle: loss and gradient of each client's objective at its own parameters.

Both engines call the same oracle interface with a leading client dimension ``C``:
``loss_grad(W[C, P], batch) -> (loss[C], g[C, P])``. How it is computed is the run's gradient backend
(:mod:`fedflat.engine.gradients`), chosen once when the oracle is built from the run's
:class:`~fedflat.engine.compute.ComputeOptions`, the model's :class:`~fedflat.engine.modes.ModelTraits` and DP-SGD's
settings; what is differentiated is the call's objective (:func:`objective_of`: the data loss, with a part's
distillation or contrastive term and FedMAN's activation penalty).
"""
from __future__ import annotations

from typing import ContextManager

import torch

from fedflat.core import Batch, Contrast, Distillation
from fedflat.engine.compute import ComputeOptions
from fedflat.engine.gradients import ClientSession, Forward, choose_backend
from fedflat.engine.gradients.objectives import DATA_LOSS, TERMS, Objective, Penalized
from fedflat.engine.gradients.hand import hand_derived
from fedflat.engine.losses import LossFn
from fedflat.engine.modes import ModelTraits
from fedflat.params import FlatModel


DEFAULT_OPTIONS = ComputeOptions()  # the sequential engine in float32


def objective_of(term: Distillation | Contrast | None, penalty: float = 0.0) -> Objective:
    """The objective of an oracle call: the data loss, with the part's ``term`` and FedMAN's ``penalty`` weight."""
    objective = DATA_LOSS if term is None else TERMS[type(term)](term)
    if not penalty:
        return objective
    if isinstance(term, Contrast):
        raise ValueError("FedMAN's activation penalty beside MOON's contrastive term is not implemented: "
                         "use one of them")
    return Penalized(objective, penalty)


class Oracle:
    """Stochastic loss and gradient ``g(w)`` for a cohort, counting backprops.

    ``backprops`` counts per-client backward passes, so a method's "backprops per local step"
    (seed 002, Table 7) can be measured rather than declared; rows of clients whose local steps are
    exhausted (masked padding of the vectorized engine) are not counted. ``traits`` (found by
    :func:`fedflat.engine.modes.inspect_module`) say whether the module needs the per-client passes of a
    :class:`~fedflat.engine.gradients.ClientSession`; by default, when it has buffers or normalizes with batch
    statistics. ``loss``: per-sample losses (None: cross-entropy, :mod:`fedflat.engine.losses`); ``dp_sgd``:
    ``(C, z)`` of per-example DP-SGD (``privacy.level: instance``).
    """

    def __init__(self, model: FlatModel, options: ComputeOptions = DEFAULT_OPTIONS, traits: ModelTraits | None = None,
                 loss: LossFn | None = None, dp_sgd: tuple[float, float] | None = None):
        self.model = model
        self.backprops = 0
        self.traits = traits if traits is not None else ModelTraits(
            buffers=model.buffer_layout.size > 0,
            mixes=any(isinstance(m, torch.nn.modules.batchnorm._NormBase) for m in model.module.modules()),
            hand_gradient=hand_derived(model))
        self.forward = Forward(model, options.precision, options.channels_last, loss, options.cuda_graphs)
        self.backend = choose_backend(self.forward, options, self.traits, dp_sgd)

    def loss_grad(self, W: torch.Tensor, batch: Batch, distill: Distillation | Contrast | None = None,
                  penalty: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss[C], g[C, P])`` of each client's mini-batch loss at its row of ``W``; with ``distill``, ``g`` is
        the gradient of the loss plus the distillation term (:func:`~fedflat.engine.gradients.distilled_objective`)
        or MOON's contrastive term (:func:`~fedflat.engine.gradients.contrastive_objective`); with ``penalty``
        ``mu``, plus ``mu/2`` times the layerwise activation norms (FedMAN,
        :func:`~fedflat.engine.gradients.activation_norms`)."""
        self.backprops += W.shape[0] if batch.clients is None else batch.clients
        return self.backend.loss_grad(W, batch, objective_of(distill, penalty))

    def loss(self, W: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``loss[C]`` without a backward pass (an evaluation: ``eval()`` mode, each client's current buffers)."""
        return self.backend.loss(W, batch)

    def clients(self, ids: list[int], round: int, seed: int,
                buffers: torch.Tensor | None) -> ContextManager[ClientSession | None]:
        """The :class:`~fedflat.engine.gradients.ClientSession` of the clients ``ids`` of round ``round`` starting
        from ``buffers[C, Q]`` (None: a model without buffers), for the oracle calls inside; None, and nothing to
        do, for a module that needs none. Under DP-SGD each client's noise comes from its stream ``"dpsgd"``."""
        return self.backend.clients(ids, round, seed, buffers)

    @property
    def gradient(self) -> str:
        """Which gradient the steps run: ``native`` (the hand-derived MLP gradient as one C++ operator), ``python``
        (the same hand-derived gradient in Python: the operator is off or could not be built) or ``autograd``
        (any other model, engine, precision or loss); ``summary.json`` records it."""
        return self.backend.gradient


class PenalizedOracle:
    """``oracle`` with FedMAN's activation penalty ``mu/2 sum_l mean |a_l|^2`` added to every :meth:`loss_grad`'s
    local objective (:class:`~fedflat.engine.gradients.Penalized`): what a cohort's local steps see as ``ctx.oracle``
    where a part penalizes activations (:func:`fedflat.engine.client.fit`). Evaluations, the clients' sessions and
    the backprop count are the oracle's."""

    def __init__(self, oracle: Oracle, penalty: float):
        self.oracle, self.penalty = oracle, penalty

    def loss_grad(self, W: torch.Tensor, batch: Batch,
                  distill: Distillation | Contrast | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.oracle.loss_grad(W, batch, distill, self.penalty)

    def loss(self, W: torch.Tensor, batch: Batch) -> torch.Tensor:
        return self.oracle.loss(W, batch)

    def clients(self, ids: list[int], round: int, seed: int,
                buffers: torch.Tensor | None) -> ContextManager[ClientSession | None]:
        return self.oracle.clients(ids, round, seed, buffers)

    @property
    def backprops(self) -> int:
        return self.oracle.backprops
