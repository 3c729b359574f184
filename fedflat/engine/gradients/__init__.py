"""Gradient backends: how a cohort's ``(loss[C], grad[C, P])`` is computed, chosen once per run.

Every backend answers ``loss_grad(W[C, P], batch, objective) -> (loss[C], g[C, P])`` and ``loss(W, batch) ->
loss[C]`` (:class:`~fedflat.engine.gradients.backend.Backend`); the oracle (:class:`fedflat.engine.client.Oracle`)
builds one with :func:`choose_backend` from the run's :class:`~fedflat.engine.compute.ComputeOptions` and the
model's :class:`~fedflat.engine.modes.ModelTraits`, and calls it without branching. The objective of a call (the
data loss, a distillation or contrastive term, FedMAN's activation penalty) is an
:class:`~fedflat.engine.gradients.objectives.Objective` that every general backend runs the same way.

General backends (any objective): :class:`PerClient` (sequential: autograd client by client),
:class:`Vectorized` (``vmap`` over a chunk), :class:`StatefulPerClient` and :class:`StatefulGroups` (a module with
buffers, dropout or batch statistics: each client's own state). Accelerated backends (the data loss alone, faster;
any other objective goes to their general backend): :class:`HandMLP` and :class:`HandCNN` (fedflat's MLP's and
CNN's gradients by hand),
:class:`Compiled` (``torch.compile``), :class:`Graphed` (CUDA graphs), :class:`Lanes` (``engine: streams``) and
:class:`PerExampleDP` (DP-SGD's clipped, noised per-example gradient, which replaces every objective by the data
loss).
"""
from __future__ import annotations

from fedflat.core import ConfigError
from fedflat.engine.compute import ComputeOptions
from fedflat.engine.gradients.backend import Accelerated, Backend, PerClient
from fedflat.engine.gradients.compiled import Compiled
from fedflat.engine.gradients.convnet import CNNGradient, HandCNN, hand_gradient_of
from fedflat.engine.gradients.forward import ACTIVATIONS, Forward
from fedflat.engine.gradients.graphed import Graphed
from fedflat.engine.gradients.hand import HandMLP, MLPGradient
from fedflat.engine.gradients.lanes import Lanes
from fedflat.engine.gradients.objectives import (DATA_LOSS, Contrastive, DataLoss, Distilled, Objective, Penalized,
                                                 activation_norms, contrastive_objective, distilled_objective,
                                                 not_true_columns)
from fedflat.engine.gradients.private import PerExampleDP
from fedflat.engine.gradients.session import ClientSession
from fedflat.engine.gradients.stateful import StatefulGroups, StatefulPerClient
from fedflat.engine.gradients.vectorized import Vectorized
from fedflat.engine.graphs import check_cuda_graphs
from fedflat.engine.modes import ModelTraits

__all__ = ["ACTIVATIONS", "DATA_LOSS", "Accelerated", "Backend", "ClientSession", "Compiled", "Contrastive", "DataLoss",
           "Distilled", "Forward", "Graphed", "HandCNN", "HandMLP", "Lanes", "Objective", "Penalized", "PerClient",
           "PerExampleDP", "StatefulGroups", "StatefulPerClient", "Vectorized", "activation_norms", "choose_backend",
           "contrastive_objective", "distilled_objective", "general_backend", "not_true_columns"]


def general_backend(forward: Forward, options: ComputeOptions, traits: ModelTraits) -> Backend:
    """The backend that computes any objective: per client or vectorized, with per-client state where the module
    has some (``traits.stateful``)."""
    if traits.stateful:
        return (StatefulGroups if options.vectorized else StatefulPerClient)(forward, traits)
    return Vectorized(forward) if options.vectorized else PerClient(forward)


def check_compile(options: ComputeOptions, traits: ModelTraits, dp_sgd: tuple[float, float] | None) -> None:
    """``compile: true`` compiles one client's data pass: refused, with what to change, where a run has none."""
    if options.vectorized:
        raise ConfigError("compile: true compiles one client's pass (engine sequential or streams); the vectorized "
                          "engine's vmap is not compiled: set engine: sequential or streams, or compile: false")
    if traits.stateful:
        raise ConfigError("compile: true compiles the pass of a module without per-client state; this model has "
                          "buffers, dropout or batch statistics (each client's own state): set compile: false")
    if dp_sgd is not None:
        raise ConfigError("compile: true does not apply to DP-SGD's per-example gradients (privacy.level: "
                          "instance): set compile: false")


def choose_backend(forward: Forward, options: ComputeOptions, traits: ModelTraits,
                   dp_sgd: tuple[float, float] | None = None) -> Backend:
    """The run's backend: DP-SGD's per-example gradient under ``privacy.level: instance`` (``dp_sgd = (C, z)``);
    else for a stateless module the general backend accelerated where it can be: the hand-derived gradient
    (fedflat's MLP, LogReg or CNN, cross-entropy, not vectorized, on the CPU; the MLP's in float32, the CNN's in
    NCHW order, in float32 or under bfloat16 autocast), then ``engine: streams``'s lanes
    or ``cuda_graphs``' replays; with ``compile`` the data pass compiled by ``torch.compile`` (in place of the hand
    gradient), graphed or laned in turn."""
    if options.cuda_graphs:
        check_cuda_graphs(forward.model.initial.device)
    backend = general_backend(forward, options, traits)
    if options.compile:
        check_compile(options, traits, dp_sgd)
    if dp_sgd is not None:
        return PerExampleDP(backend, *dp_sgd)
    if traits.stateful:
        return backend
    plain = not options.vectorized and forward.loss_fn is None and not options.compile
    hand = hand_gradient_of(forward.model, forward.autocast) if traits.hand_gradient and plain else None
    if isinstance(hand, CNNGradient) and not forward.channels_last:
        backend = HandCNN(hand, backend)
    elif isinstance(hand, MLPGradient) and forward.autocast is None:
        backend = HandMLP(hand, backend)
    if options.compile:
        backend = Compiled(backend)
    if options.engine == "streams":
        return Lanes(backend, options.cuda_graphs)
    return Graphed(backend) if options.cuda_graphs else backend
