"""The parts a federated method is made of, and the client/server contract they run under.

A method is a *recipe*: a perturbation (where the local gradient is evaluated), an optional filter
on that perturbation, a correction (what is added to the local direction), an aggregation (client
weights ``p_i``), a server update (what the server does with the aggregate) and a personalization (which
parameters stay on the client, FedPer's head). Parts are stateless
apart from their hyperparameters, and every part has a client side and a server side:

- **client side** (``begin``, ``perturb``, ``apply``, ``direction``, ``end``): a client's local work
  is a function of the :class:`Broadcast` (the model, the server-state entries the parts ``send``,
  and its personal rows, e.g. FedWMSAM's personalized momentum), the client's own state (the vectors
  the parts ``keep``), its data and its random streams. It returns a :class:`ClientResult`: its upload, its new state, its measured work. It
  sees no server state beyond the broadcast, shares nothing mutable, and so runs anywhere: one
  client or a vectorized cohort in this process, in a Ray worker, in a Flower ``ClientApp``.
- **server side** (``setup``, ``downlink``, ``personal``, ``weights``, ``finish``, ``step``,
  ``after_step``): the server keeps its state in ``ctx.server`` (a dict of tensors) and per-client
  vectors it ``holds`` itself in ``ctx.held`` (FedWMSAM's ``c_i``, computed from uploaded models), and
  reads the round's uploads stacked in **ascending client-id order**, whatever order they arrived in,
  so results never depend on where or when clients ran.

Every client-side tensor carries a leading client dimension ``C``: the sequential engine runs the
parts on chunks of one client, the vectorized engine on the whole cohort.
"""
from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from fedflat.core.round import Batch, ClientContext, Cohort, Distillation, RoundContext, TrainSettings


class PartParams(BaseModel):
    """Hyperparameters of a part; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class Part:
    """Base of every part. Hooks default to doing nothing.

    Class attributes declare what the part needs, so recipes can be assembled and checked:
    ``sends`` server-state entries sent to every sampled client with the model (see :meth:`downlink`),
    ``keeps`` per-client state vectors each client keeps across rounds (see :meth:`kept`), ``holds``
    per-client vectors the server keeps about each client (never sent as such),
    ``extra_backprops`` per local step beyond the one of the descent gradient, ``provides``/``requires``
    names of shared quantities in ``cohort.extra`` or the broadcast. What is uploaded is whatever the
    part's ``end`` puts in ``cohort.upload``; communication is measured from the payloads.
    """

    role: ClassVar[str] = ""
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    Params: ClassVar[type[PartParams]] = PartParams
    sends: ClassVar[tuple[str, ...]] = ()
    keeps: ClassVar[tuple[str, ...]] = ()
    holds: ClassVar[tuple[str, ...]] = ()
    extra_backprops: ClassVar[int] = 0
    supports_vectorized: ClassVar[bool] = True  # False: the vectorized engine refuses the method, naming this part
    provides: ClassVar[frozenset[str]] = frozenset()
    requires: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, params: PartParams | None = None):
        self.p = params if params is not None else self.Params()

    # -- server side ---------------------------------------------------------------------------
    def setup(self, server: dict[str, torch.Tensor], w0: torch.Tensor, settings: TrainSettings) -> None:
        """Creates this part's server state in ``server`` (called once, before round 0)."""

    def downlink(self, ctx: RoundContext) -> dict[str, torch.Tensor]:
        """What this part sends every sampled client with the model (the ``sends`` entries by default)."""
        return {key: ctx.server[key] for key in self.sends}

    def personal(self, ctx: RoundContext) -> dict[str, torch.Tensor]:
        """Rows the server computes for each sampled client and sends it alone, ``[K, ...]``."""
        return {}

    def kept(self) -> tuple[str, ...]:
        """Names of the state vectors each client keeps (``keeps`` unless options change it)."""
        return self.keeps

    def finish(self, ctx: RoundContext) -> None:
        """After all clients trained and weights are set, before the server step (reads ``ctx.uploads``)."""

    def after_step(self, ctx: RoundContext, w_new: torch.Tensor) -> None:
        """After the server step produced ``w^{t+1}``."""

    def global_direction(self, server: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The method's current estimate of the global direction it steers by (FedVSSAM's ``v``,
        FedWMSAM's momentum, FedLESAM's estimated global perturbation), or None; for diagnostics.

        Always in gradient sign (a descent step moves along its negative), so directions of different
        methods compare with the same reference gradient."""
        return None

    # -- client side ---------------------------------------------------------------------------
    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        """Before a chunk's local training: per-chunk quantities from the broadcast and ``cohort.state``."""

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        """After a chunk's local training, with its final models ``W[C, P]``: write ``cohort.new_state``
        and ``cohort.upload``."""


class Perturbation(Part):
    """Where the descent gradient is evaluated: ``g(w + eps)``, and what the local loss adds to find flat
    regions without a perturbation (:meth:`distillation`, FedGMT)."""

    role = "perturbation"

    def distillation(self, ctx: ClientContext) -> Distillation | None:
        """A distillation term of this round's local objective (the same at every step), or None."""
        return None

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """``eps[C, P]`` for local step ``k``, or ``None`` for no perturbation."""
        return None

    def descent_gradient(self, ctx: ClientContext, cohort: Cohort, grad: torch.Tensor) -> torch.Tensor:
        """The minibatch gradient the step descends along, from ``grad = g(w + eps)`` (itself by default;
        FedSpeed merges in the plain ``g(w)``)."""
        return grad


class Filter(Part):
    """A transform of the perturbation (e.g. FedFFT's high-pass filter)."""

    role = "filter"

    def apply(self, ctx: ClientContext, cohort: Cohort, eps: torch.Tensor) -> torch.Tensor:
        return eps

    def apply_gradient(self, ctx: ClientContext, cohort: Cohort, grad: torch.Tensor) -> torch.Tensor:
        """A transform of the raw minibatch gradient, before weight decay and correction (identity: filters
        act on perturbations; seed 004 §E.6 filters the gradient instead)."""
        return grad


class Correction(Part):
    """What is added to (or mixed with) the local gradient to form the local direction."""

    role = "correction"

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The local direction from ``grad = g(w + eps) + wd w`` (identity by default)."""
        return grad


class Personalization(Part):
    """Which parameters stay with the client (personalized FL): a client starts from the broadcast model with its
    private entries replaced by its own, and uploads the broadcast's values there, so the server never learns or
    changes them. ``none`` keeps nothing private."""

    role = "personalization"

    def private(self, settings: TrainSettings) -> torch.Tensor | None:
        """A boolean mask ``[P]`` of the private entries, or None when every entry is shared."""
        return None

    def models(self, w: torch.Tensor, state: dict[str, torch.Tensor], known: dict[str, torch.Tensor],
               settings: TrainSettings) -> torch.Tensor | None:
        """The clients' own models ``[C, P]``: ``w`` (the broadcast or global model) with each client's private
        entries from its ``state`` rows (``w``'s where it has none yet), or None when nothing is private. Clients
        start their local training from it, and a personalized evaluation tests it."""
        return None

    def private_buffers(self, settings: TrainSettings) -> torch.Tensor | None:
        """A boolean mask ``[Q]`` of the buffer entries (:attr:`TrainSettings.buffers`) that stay on each client, or
        None. The engine keeps those entries per client as it keeps buffers at all: a client starts from the
        broadcast buffers with its own private entries, keeps its final ones, and uploads the broadcast's there;
        a personalized evaluation runs each client's model with its own (FedBN's BatchNorm statistics)."""
        return None


class Aggregation(Part):
    """The client weights ``p_i`` of the round (summing to one)."""

    role = "aggregation"

    def weights(self, ctx: RoundContext) -> torch.Tensor:
        raise NotImplementedError


class ServerUpdate(Part):
    """The server's use of the aggregate: ``w^{t+1}`` from ``w^t`` and the clients' results."""

    role = "server"

    def broadcast(self, ctx: RoundContext) -> torch.Tensor:
        """The point clients start from (``w^t`` by default)."""
        return ctx.w

    def step(self, ctx: RoundContext) -> torch.Tensor:
        raise NotImplementedError
