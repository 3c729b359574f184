"""The parts a federated method is made of, and the contract they are written against.

A method is a *recipe*: a perturbation (where, and on what objective, the local gradient is taken), an optional
filter (of the perturbation or of the gradient), a correction (what is added to the local direction), an
aggregation (client weights ``p_i``), a server update (what the server does with the aggregate) and a
personalization (which parameters stay on the client, FedPer's head). Every part has a client side and a server
side:

- **client side** (``begin``, ``perturb``, ``apply``, ``direction``, ``end``): a client's local work
  is a function of the :class:`Broadcast` (the model, the server-state entries the parts ``send``,
  and its personal rows, e.g. FedWMSAM's personalized momentum), the client's own state (the vectors
  the parts ``keep``), its data and its random streams. It returns a :class:`ClientResult`: its upload, its new
  state, its measured work. It sees no server state beyond the broadcast, shares nothing mutable, and so runs
  anywhere: one client or a vectorized cohort in this process, in a Ray worker, in a Flower ``ClientApp``.
- **server side** (``downlink``, ``personal``, ``weights``, ``finish``, ``step``, ``after_step``): the server
  keeps the state the parts *declare* (:attr:`Part.server_state`, created by fedflat before round 0, shipped,
  checkpointed and counted) in ``ctx.server``, and per-client vectors it ``holds`` itself in ``ctx.held``
  (FedWMSAM's ``c_i``, computed from uploaded models); it reads the round's uploads stacked in **ascending
  client-id order**, whatever order they arrived in, so results never depend on where or when clients ran.

The rules a part keeps (rule 1 watched for a plugin's parts in every run and for fedflat's own with
``FEDFLAT_CHECK_CONTRACT=1``, which the test suite sets: :mod:`fedflat.core.contract`; rule 4 enforced always):

1. A part never modifies in place a tensor it did not make in this call: the broadcast, ``ctx.server``,
   ``ctx.held``, the uploads, ``cohort.state``, another part's values. It assigns new tensors instead
   (``ctx.server[KEY] = ...``), so the round stays a transaction: a failed round leaves the server as it was.
   (The one tensor handed over is :meth:`Correction.direction`'s ``grad``, which it may overwrite.)
2. Parts share values within a chunk only through declared :class:`Slot` s (``provides`` / ``requires``, read and
   written through ``cohort.shared``); a part's own working values for the chunk live in ``cohort.own(self)``.
3. Names of state entries and slots read ``<part>.<symbol>`` (``scaffold.c``, ``lesam.w_old``), the symbol
   the paper's.
4. Everything that evolves is declared (``server_state``, ``keeps``, ``holds``): a part keeps nothing on itself, and
   setting an attribute after construction is a :class:`ContractError`.

Hooks run in the order of the roles (perturbation, filter, correction, aggregation, server, personalization), so
a slot a perturbation provides in ``begin`` is there for the aggregation's ``begin``. Every client-side tensor
carries a leading client dimension ``C``: the sequential engine runs chunks of one client, the vectorized engine
a whole cohort. docs/extending.md has the table of hooks, where each runs and what it may read and write.
"""
from __future__ import annotations

import functools
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field

from fedflat.core.errors import ContractError
from fedflat.core.init import Init
from fedflat.core.round import Batch, ClientContext, Cohort, Distillation, RoundContext, Slot, TrainSettings
from fedflat.core.vectors import NOT_RUN, run_kernel

SHARED = {"shared": True}  # json_schema_extra of a hyperparameter several parts of one method hold as one value


class PartParams(BaseModel):
    """Hyperparameters of a part; unknown keys are errors.

    A field declared ``Field(..., json_schema_extra=SHARED)`` (or with :func:`shared`) is one quantity wherever
    it appears in a method: FedDyn's ``alpha`` on its client and its server, FedSCAM's ``kappa`` in its radius
    and its weights. A flat ``algo.alpha`` then sets every part that shares it, and the parts must agree."""

    model_config = ConfigDict(extra="forbid")

    @classmethod
    def shared_fields(cls) -> frozenset[str]:
        return frozenset(k for k, f in cls.model_fields.items()
                         if isinstance(f.json_schema_extra, dict) and f.json_schema_extra.get("shared"))


def shared(default: Any, **kwargs: Any) -> Any:
    """``Field(default, ...)`` of a hyperparameter shared by the parts of a method that hold it (:data:`SHARED`)."""
    return Field(default, json_schema_extra=SHARED, **kwargs)


class Part:
    """Base of every part. Hooks default to doing nothing.

    What a part declares (class attributes), so a method is assembled, checked, shipped and checkpointed
    without the part building anything by hand:

    - ``server_state``: the server entries it owns, each with its initial value (:data:`Init`), created before
      round 0; two parts may declare the same entry only with the same initial value (they then share it).
    - ``sends``: server entries sent to every sampled client with the model (:meth:`downlink`).
    - ``keeps``: per-client vectors each client keeps across rounds (:meth:`kept` where options change them);
      ``holds``: per-client vectors the server keeps about each client (never sent as such).
    - ``provides`` / ``requires``: the :class:`Slot` s it writes / reads in ``cohort.shared``, and (``requires``)
      the server entries of other parts it reads; an assembly without a provider is refused, naming one.
    - ``extra_backprops``: backward passes per local step beyond the descent gradient's;
      ``supports_vectorized``: False refuses the vectorized engine, naming the part;
      ``global_direction``: the server entry that is the method's estimate of the global direction, with the
      sign that turns it into gradient sign (FedVSSAM's ``v``, FedWMSAM's momentum), read by the tracking
      diagnostic;
      ``individual``: why the part reads each client's own upload rather than only the uploads' weighted mean
      (FedAWA's weights, FedWMSAM's ``c_i``), empty when it does not. Central DP and secure aggregation release
      only the (noised) sum, so a method with such a part is refused there, with this reason;
      ``beyond_batch``: why its local work computes on the client's data beyond the step's batch, or not example by
      example (FedSCAM's pilot batches, q-FedAvg's loss over all data, FedGMT's distillation); DP-SGD
      (``privacy.level: instance``) cannot account it and refuses the method with this reason;
      ``schedules_steps``: the engine scales each local step's rate by :meth:`step_lr` (FedSWA's within-round
      schedule; plain SGD steps only); ``penalizes_activations``: the engine adds :meth:`activation_penalty`'s
      layerwise activation norms to every gradient of the round's local objective (FedMAN).

    What is uploaded is whatever ``end`` (or ``begin``) puts in ``cohort.upload``; communication is measured from
    the payloads.
    """

    role: ClassVar[str] = ""
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    Params: ClassVar[type[PartParams]] = PartParams
    server_state: ClassVar[dict[str, Init]] = {}
    sends: ClassVar[tuple[str, ...]] = ()
    keeps: ClassVar[tuple[str, ...]] = ()
    holds: ClassVar[tuple[str, ...]] = ()
    provides: ClassVar[frozenset[Slot]] = frozenset()
    requires: ClassVar[frozenset[Slot | str]] = frozenset()
    extra_backprops: ClassVar[int] = 0
    supports_vectorized: ClassVar[bool] = True
    global_direction: ClassVar[tuple[str, float] | None] = None
    individual: ClassVar[str] = ""
    beyond_batch: ClassVar[str] = ""
    schedules_steps: ClassVar[bool] = False  # whether the engine asks step_lr at every local step (FedSWA's schedule)
    penalizes_activations: ClassVar[bool] = False  # whether the engine asks activation_penalty (FedMAN's)

    def __init__(self, params: PartParams | None = None):
        self.p = params if params is not None else self.Params()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "__init__" in cls.__dict__:
            cls.__init__ = _constructing(cls.__dict__["__init__"])

    def __setattr__(self, name: str, value: Any) -> None:
        """Rule 4: a part keeps nothing on itself once built (what evolves is declared, so that it is shipped,
        checkpointed and the same on every executor); only its constructor sets attributes."""
        if not self.__dict__.get("_constructing", 0):
            raise ContractError(
                f"{self!r} set self.{name} after construction: a part keeps no state on itself (the contract's rule "
                "4, docs/extending.md#the-rules); declare what evolves: server_state (the server's), keeps (each "
                "client's), holds (the server's, per client), or cohort.own(self) for a chunk's working values")
        object.__setattr__(self, name, value)

    def __repr__(self) -> str:
        return f"{self.role} '{self.name}'"

    # -- server side ---------------------------------------------------------------------------
    def initial_state(self, w0: torch.Tensor, settings: TrainSettings) -> dict[str, torch.Tensor]:
        """The declared server entries at round 0 (:attr:`server_state`)."""
        return {key: init(w0, settings, self.p) for key, init in self.server_state.items()}

    def downlink(self, ctx: RoundContext) -> dict[str, torch.Tensor]:
        """What this part sends every sampled client with the model (the ``sends`` entries by default)."""
        return {key: ctx.server[key] for key in self.sends}

    def personal(self, ctx: RoundContext) -> dict[str, torch.Tensor]:
        """Rows the server computes for each sampled client and sends it alone, ``[K, ...]``."""
        return {}

    def kept(self) -> tuple[str, ...]:
        """Names of the state vectors each client keeps (``keeps`` unless options change it)."""
        return self.keeps

    def round_backprops(self, num_samples: int, settings: TrainSettings) -> int:
        """The most backward passes a client of ``num_samples`` samples takes in a round beyond its local steps'
        (the descent gradient and ``extra_backprops`` per step): work done once a round on its data, as FedALA's
        start phase. An upper bound, which a Flower server checks what a node reports against
        (:func:`fedflat.flower.protocol.most_backprops`); a pass a round of one step already takes needs none."""
        return 0

    def finish(self, ctx: RoundContext) -> None:
        """After all clients trained and weights are set, before the server step (reads ``ctx.uploads``)."""

    def after_step(self, ctx: RoundContext, w_new: torch.Tensor) -> None:
        """After the server step produced ``w^{t+1}``."""

    # -- client side ---------------------------------------------------------------------------
    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        """Before a chunk's local training: per-chunk quantities from the broadcast and ``cohort.state``."""

    def end(self, ctx: ClientContext, cohort: Cohort, W: torch.Tensor) -> None:
        """After a chunk's local training, with its final models ``W[C, P]``: write ``cohort.new_state``
        and ``cohort.upload``."""

    def activation_penalty(self, ctx: ClientContext) -> float:
        """``mu``: the weight of the layerwise activation-norm penalty ``mu/2 sum_l mean |a_l|^2`` this part adds to
        the local objective of every gradient the round's clients take (FedMAN), where
        :attr:`penalizes_activations`."""
        return 0.0

    def step_lr(self, ctx: ClientContext, cohort: Cohort, k: int) -> torch.Tensor:
        """``[C]``: the factor of ``eta_l^t`` at local step ``k`` of each client (a within-round schedule, FedSWA's),
        called where :attr:`schedules_steps`; the step is then ``w <- w - eta_l^t prod(factors) d``."""
        return torch.ones(cohort.size, dtype=ctx.w_start.dtype, device=ctx.w_start.device)


def _constructing(init: Any) -> Any:
    """``init`` with the part's attributes settable while it (and the constructors it calls) run."""
    @functools.wraps(init)
    def constructor(self: Part, *args: Any, **kwargs: Any) -> None:
        depth = self.__dict__.get("_constructing", 0)
        self.__dict__["_constructing"] = depth + 1
        try:
            init(self, *args, **kwargs)
        finally:
            if depth:
                self.__dict__["_constructing"] = depth
            else:
                del self.__dict__["_constructing"]
    return constructor


Part.__init__ = _constructing(Part.__init__)  # type: ignore[method-assign]


def point_sum(W: torch.Tensor, eps: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``W + eps``, into ``out`` (the local loop's buffer of ``W``'s shape) where ``eps`` has ``W``'s shape and dtype,
    else the plain sum (a broadcast ``eps``, another dtype). On the CPU the native ``point_sum`` where it is built and
    takes the operands: one rounded sum, the same bits, several times faster than ATen's default level's add."""
    if eps.shape != W.shape or eps.dtype != W.dtype:
        return W + eps
    if run_kernel("point_sum", W.device, W, eps, out) is not NOT_RUN:
        return out
    return torch.add(W, eps, out=out)


class Perturbation(Part):
    """Where, and of what objective, the descent gradient is taken: ``g = grad [loss + term](w + eps)``.

    ``eps`` is :meth:`perturb`'s (SAM's ascent, FedLESAM's estimate); ``term`` is :meth:`distillation`'s, a loss
    term that seeks flat regions without a perturbation (FedGMT's distillation toward the global trajectory)."""

    role = "perturbation"
    fuses_point: ClassVar[bool] = False  # True: the loop takes W + eps from perturbed_point (a fused form)

    def distillation(self, ctx: ClientContext) -> Distillation | None:
        """A distillation term of this round's local objective (the same at every step), or None."""
        return None

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch: Batch) -> torch.Tensor | None:
        """``eps[C, P]`` for local step ``k``, or ``None`` for no perturbation."""
        return None

    def perturbed_point(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch: Batch,
                        out: torch.Tensor) -> torch.Tensor | None:
        """``W + eps`` for local step ``k``, or None for no perturbation: where the local loop takes the gradient, asked
        instead of :meth:`perturb` where ``fuses_point`` is True and no filter transforms ``eps``. ``out`` is the
        loop's buffer of ``W``'s shape, which the sum may be written into. The default is :meth:`perturb` and the
        sum; a part overrides it only with a fused form of the same expression (SAM's native kernel: the scale and the
        sum in one pass, the same bits; FedWMSAM's: the whole point in two passes, the same bits where ATen rounds
        alike)."""
        eps = self.perturb(ctx, cohort, k, W, batch)
        return None if eps is None else point_sum(W, eps, out)

    def descent_gradient(self, ctx: ClientContext, cohort: Cohort, grad: torch.Tensor) -> torch.Tensor:
        """The minibatch gradient the step descends along, from ``grad = g(w + eps)`` (itself by default;
        FedSpeed merges in the plain ``g(w)``)."""
        return grad


class Filter(Part):
    """A transform of the perturbation (FedFFT's high-pass filter), or with ``acts_on = "gradient"`` of the raw
    minibatch gradient before weight decay and correction (seed 004 §E.6)."""

    role = "filter"
    acts_on: ClassVar[Literal["perturbation", "gradient"]] = "perturbation"

    def apply(self, ctx: ClientContext, cohort: Cohort, X: torch.Tensor) -> torch.Tensor:
        """The filtered ``X[C, P]`` (the perturbation, or the gradient)."""
        return X


class Direction(NamedTuple):
    """A correction's local direction ``d = loss + decay w`` in its two parts (:meth:`Correction.direction`):
    ``loss``, the gradient of the local objective the method's public code backpropagates (the raw minibatch
    gradient with the method's terms), and ``decay``, the coefficient ``c`` of the term ``c w`` that code gives its
    optimizer as weight decay, which ``torch.optim.SGD`` adds after ``clip_grad_norm_``. The engine forms ``d`` in
    one place: ``clip(loss) + c w`` under ``train.clip_scope=loss``, ``clip(loss + c w)`` under ``step``."""

    loss: torch.Tensor
    decay: float | torch.Tensor


class MeasuredDirection(Direction):
    """A :class:`Direction` that also carries ``loss_norm``, the ``[C, 1]`` L2 norms of the rows of ``loss`` exactly as
    ``torch.linalg.vector_norm`` gives them, computed in the pass that made ``loss`` (FedWMSAM's fused momentum mix):
    the engine's ``train.clip_scope=loss`` clip takes them instead of reading ``loss`` once more."""

    def __new__(cls, loss: torch.Tensor, decay: float | torch.Tensor, loss_norm: torch.Tensor) -> "MeasuredDirection":
        direction = super().__new__(cls, loss, decay)
        direction.loss_norm = loss_norm
        return direction


class Correction(Part):
    """What is added to (or mixed with) the local gradient to form the local direction."""

    role = "correction"

    def direction(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> Direction:
        """The local direction at step ``k`` from the raw minibatch gradient ``grad = g(w + eps)`` (no weight decay),
        as a :class:`Direction` ``(L, c)``, ``d = L + c w``: plain SGD by default, ``(g, wd)``. ``grad`` is the
        engine's fresh tensor, read by nothing after: the hook may overwrite it and return it as ``L`` (the one
        exception to rule 1); ``c`` is ``ctx.settings.weight_decay`` unless the method's public code gives its
        optimizer more (FedProx's ``wd + mu``) or less (FedRep's 0: the whole direction is clipped)."""
        return Direction(grad, ctx.settings.weight_decay)

    def distillation(self, ctx: ClientContext) -> Distillation | None:
        """A distillation term of this round's local objective (FedNTD's not-true distillation), or None; a method has
        at most one, the perturbation's or the correction's (:func:`fedflat.algorithms.compose.build_parts`)."""
        return None


class Personalization(Part):
    """Which parameters stay with the client (personalized FL): a client starts from the broadcast model with its
    private entries replaced by its own, and uploads the broadcast's values there, so the server never learns or
    changes them. ``none`` keeps nothing private."""

    role = "personalization"
    steps_locally: ClassVar[bool] = False  # whether the engine calls local_step at every local step

    def private(self, settings: TrainSettings) -> torch.Tensor | None:
        """A boolean mask ``[P]`` of the private entries, or None when every entry is shared."""
        return None

    def models(self, w: torch.Tensor, state: dict[str, torch.Tensor], known: dict[str, torch.Tensor],
               settings: TrainSettings) -> torch.Tensor | None:
        """The clients' own models ``[C, P]``: ``w`` (the broadcast or global model) with each client's private
        entries from its ``state`` rows (``w``'s where it has none yet), or None when nothing is private. Clients
        start their local training from it, and a personalized evaluation tests it."""
        return None

    def start(self, w: torch.Tensor, state: dict[str, torch.Tensor], known: dict[str, torch.Tensor],
              settings: TrainSettings) -> torch.Tensor | None:
        """The models ``[C, P]`` clients start their local training of the federated model from, or None for the
        broadcast itself: :meth:`models` by default (FedPer's clients train from their own head); a method whose
        personal model is trained beside the federated one (Ditto, APFL) starts from the broadcast."""
        return self.models(w, state, known, settings)

    def initialize(self, ctx: ClientContext, cohort: Cohort) -> torch.Tensor | None:
        """The models ``[C, P]`` the clients' local training starts from when computing them needs the clients' data
        and the oracle (FedALA's adaptive local aggregation), or None for ``ctx.w_start`` (:meth:`start`'s). Runs in
        the chunk's oracle session, before every part's ``begin``."""
        return None

    def local_step(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch: Batch) -> None:
        """Called at every local step ``k`` where :attr:`steps_locally`, with the federated rows ``W[C, P]`` before
        the step moves them and the step's ``batch``: a personal model trained beside the federated one (APFL's
        ``v_i``, Ditto's) steps here, in ``cohort.own(self)``, leaving inactive rows (``cohort.active``) as
        they are."""

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

    def round_lr(self, ctx: RoundContext) -> float:
        """The local learning rate of the round, ``eta_l^t`` (``ctx.lr``, the run's schedule, by default; server-side
        SWA's cyclic rate): clients receive it with the broadcast, and ``ctx.lr`` holds it for the round."""
        return ctx.lr

    def step(self, ctx: RoundContext) -> torch.Tensor:
        raise NotImplementedError
