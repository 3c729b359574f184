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

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from fedflat.engine.oracle import Batch, Oracle
    from fedflat.params import ParamLayout

NORM_EPS = 1e-12
MODEL = "model"  # upload: the client's final model w_{i,E}, [C, P]
TRAIN_LOSS = "train_loss"  # upload: the client's mean local loss of the round, [C]


def row_norm(X: torch.Tensor) -> torch.Tensor:
    """One L2 norm per row of ``X[C, P]`` over all parameters, shape ``[C, 1]``."""
    return X.norm(dim=-1, keepdim=True)


def normalize_rows(X: torch.Tensor, radius: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``radius * X / (||X|| + 1e-12)`` row by row (the SAM ascent step of the spec)."""
    return radius * X / (row_norm(X) + NORM_EPS)


class PartParams(BaseModel):
    """Hyperparameters of a part; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


@dataclass
class TrainSettings:
    """The local-training settings every part may read (the same on the server and on every client)."""

    weight_decay: float
    clip: float | None
    batch_size: int
    global_lr: float
    num_clients: int
    seed: int
    layout: "ParamLayout | None" = None  # where each parameter tensor lives in the flat vector (per-tensor filters)
    total_samples: int = 0  # training samples over all clients, n (FedAWA's initial logits n_i / n); 0: unknown


def payload_size(shared: dict[str, torch.Tensor], size: int,
                 per_client: dict[str, torch.Tensor] | None = None) -> tuple[int, int]:
    """``(model-sized vectors, bytes)`` one client sends or receives: the ``shared`` tensors plus one row of
    each ``per_client`` tensor (stacked ``[K, ...]``). A vector is model-sized when it has ``size`` entries."""
    tensors = list(shared.values()) + [t[0] for t in (per_client or {}).values() if t.shape[0]]
    return (sum(1 for t in tensors if t.numel() == size),
            sum(t.numel() * t.element_size() for t in tensors))


@dataclass
class Broadcast:
    """The downlink of round ``t`` (Flower's ``FitIns``), the same for every sampled client.

    ``w`` is the point clients start from (``w^t``, or what the server update broadcasts, e.g.
    FedACG's lookahead); ``server`` holds the server-state entries the parts send every client
    (:meth:`Part.downlink`), e.g. SCAFFOLD's ``c``; ``personal`` the rows the server computes for each
    client (:meth:`Part.personal`), ``[K, ...]`` in the order of ``ids``. ``lr`` is ``eta_l^t``.
    """

    round: int
    lr: float
    w: torch.Tensor
    server: dict[str, torch.Tensor]
    ids: torch.Tensor | None = None
    personal: dict[str, torch.Tensor] = field(default_factory=dict)

    def shared(self) -> dict[str, torch.Tensor]:
        """What every client receives alike: the model and the parts' shared entries."""
        return {MODEL: self.w, **self.server}

    def to(self, device: torch.device | str) -> "Broadcast":
        return Broadcast(self.round, self.lr, self.w.to(device), {k: v.to(device) for k, v in self.server.items()},
                         self.ids, {k: v.to(device) for k, v in self.personal.items()})

    def for_clients(self, ids: torch.Tensor) -> "Broadcast":
        """The broadcast as the clients ``ids`` (a subset of ``self.ids``) receive it: their personal rows only."""
        if not self.personal:
            return Broadcast(self.round, self.lr, self.w, self.server, ids)
        position = {int(c): row for row, c in enumerate(self.ids.tolist())}
        index = torch.tensor([position[int(c)] for c in ids.tolist()], dtype=torch.long)
        return Broadcast(self.round, self.lr, self.w, self.server, ids,
                         {k: v[index.to(v.device)] for k, v in self.personal.items()})


@dataclass
class ClientContext:
    """What a client's local work may read: the broadcast, the shared settings, and its means to
    compute (the gradient ``oracle`` and the ``batches`` of its own data).

    ``w_start`` is where local training starts: the broadcast model ``w_broadcast`` ``[P]``, or with a
    personalization part each client's own model ``[C, P]`` (the broadcast with its private entries)."""

    round: int
    lr: float
    w_start: torch.Tensor
    server: dict[str, torch.Tensor]  # the broadcast entries only: a part reading anything else is a contract error
    settings: TrainSettings
    oracle: "Oracle"
    batches: Any
    w_broadcast: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.w_broadcast is None:
            self.w_broadcast = self.w_start

    @classmethod
    def of(cls, broadcast: Broadcast, settings: TrainSettings, oracle: "Oracle", batches: Any) -> "ClientContext":
        return cls(round=broadcast.round, lr=broadcast.lr, w_start=broadcast.w, server=broadcast.server,
                   settings=settings, oracle=oracle, batches=batches)


@dataclass
class Cohort:
    """A chunk of the round's sampled clients trained together (``C`` rows), with their own state.

    In: ``state[name][C, P]`` (zeros where a client has none yet) and ``known[name][C]`` for every
    name the parts keep; ``personal[name]`` the clients' rows of the broadcast. ``active[C]`` is set before every local step: ``k < E_i``; a part that keeps
    per-step state must leave inactive rows unchanged (the vectorized engine pads clients with
    fewer steps). ``extra`` carries per-chunk quantities one part computes and another reads.
    Out: ``new_state`` (what each client keeps for its next participation) and ``upload`` (what it
    sends the server, rows ``[C, ...]``), both written by the parts' ``end``.
    """

    ids: torch.Tensor
    num_samples: torch.Tensor
    steps: torch.Tensor
    active: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    known: dict[str, torch.Tensor] = field(default_factory=dict)
    personal: dict[str, torch.Tensor] = field(default_factory=dict)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    new_state: dict[str, torch.Tensor] = field(default_factory=dict)
    upload: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class ClientResult:
    """What a cohort of clients returns (Flower's ``FitRes``), one row per client in the order of ``ids``:
    the ``upload`` (``"model"`` = ``w_{i,E}``, ``"train_loss"``, and the parts' entries), the
    ``state`` each client keeps, and ``backprops``, the backward passes it took."""

    ids: torch.Tensor
    upload: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    backprops: int = 0

    def rows(self, index: torch.Tensor) -> "ClientResult":
        """The clients at positions ``index``."""
        pick = (lambda d: {k: v[index.to(v.device)] for k, v in d.items()})
        return ClientResult(self.ids[index], pick(self.upload), pick(self.state), self.backprops)

    def to(self, device: torch.device | str) -> "ClientResult":
        move = (lambda d: {k: v.to(device) for k, v in d.items()})
        return ClientResult(self.ids.to(device), move(self.upload), move(self.state), self.backprops)


def merge_results(results: list[ClientResult]) -> ClientResult:
    """One result with every client's rows in ascending client-id order (the canonical reduction order),
    whatever order the results arrived in."""
    ids = torch.cat([r.ids.cpu() for r in results])
    order = ids.argsort()
    if len(set(ids.tolist())) != len(ids):
        raise ValueError(f"a client appears in more than one result: {sorted(ids.tolist())}")

    def stack(name: str, part: str) -> torch.Tensor:
        rows = torch.cat([getattr(r, part)[name] for r in results])
        return rows[order.to(rows.device)]
    upload_names = results[0].upload.keys()
    state_names = results[0].state.keys()
    return ClientResult(ids[order], {k: stack(k, "upload") for k in upload_names},
                        {k: stack(k, "state") for k in state_names}, sum(r.backprops for r in results))


@dataclass
class RoundContext:
    """The server's view of round ``t``.

    Before training: ``w`` (the global model ``w^t``), ``lr`` (``eta_l^t``), the sampled clients in
    ascending id order with their sample counts and local step counts ``E_i``, the server state, and
    the per-client vectors the server holds for them (``held[name][K, P]``, zeros and
    ``held_known = False`` before a client's first round; parts replace the rows they update).
    After training: ``w_start`` (what clients started from), ``uploads`` (every upload stacked over
    the sampled clients, ``[K, ...]``, rows in the order of ``sampled``) and ``weights[K]`` (the
    aggregation). Parts may add per-round scalars to ``log`` (written to the round's metrics line)
    and anything else to ``info``.
    """

    round: int
    lr: float
    w: torch.Tensor
    sampled: torch.Tensor
    num_samples: torch.Tensor
    steps: torch.Tensor
    server: dict[str, torch.Tensor]
    settings: TrainSettings
    held: dict[str, torch.Tensor] = field(default_factory=dict)
    held_known: dict[str, torch.Tensor] = field(default_factory=dict)
    w_start: torch.Tensor | None = None
    uploads: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: torch.Tensor | None = None
    log: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def K(self) -> int:
        return int(self.sampled.shape[0])

    @property
    def w_final(self) -> torch.Tensor:
        """``w_{i,E}`` of every sampled client, ``[K, P]``."""
        return self.uploads[MODEL]

    @property
    def train_loss(self) -> torch.Tensor:
        return self.uploads[TRAIN_LOSS]

    @property
    def deltas(self) -> torch.Tensor:
        """``Delta_i = w_{i,E} - w^t`` for every sampled client, ``[K, P]``."""
        return self.w_final - self.w

    @property
    def pseudo_gradients(self) -> torch.Tensor:
        """``G_i = -Delta_i / (E_i eta_l^t)``, the gradient-scale conversion of the spec, ``[K, P]``."""
        return -self.deltas / (self.steps.to(self.w.dtype)[:, None] * self.lr)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        """``sum_i p_i X_i`` with the round's aggregation weights."""
        return self.weights.to(X.dtype) @ X

    def answered(self, ids: torch.Tensor) -> "RoundContext":
        """The context of the round as if only the clients ``ids`` (a subset of ``sampled``, ascending) had
        been sampled: a federation aggregates the clients whose uploads came back. Called after
        :meth:`Algorithm.configure`, before any upload is read; the server state, log and info carry over."""
        position = {int(c): row for row, c in enumerate(self.sampled.tolist())}
        missing = [int(c) for c in ids.tolist() if int(c) not in position]
        if missing:
            raise ValueError(f"round {self.round}: clients {missing} answered but were not sampled")
        keep = torch.tensor([position[int(c)] for c in ids.tolist()], dtype=torch.long, device=self.sampled.device)
        rows = (lambda d: {k: v[keep.to(v.device)] for k, v in d.items()})
        return replace(self, sampled=self.sampled[keep], num_samples=self.num_samples[keep], steps=self.steps[keep],
                       held=rows(self.held), held_known=rows(self.held_known))


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


@dataclass(frozen=True)
class Distillation:
    """A distillation term added to every client's mini-batch loss: ``weight * temperature^2 *
    KL(softmax(f(teacher, x)/temperature) || softmax(f(w, x)/temperature))``, averaged over the batch (Hinton et
    al.'s knowledge distillation; FedGMT's global-trajectory term). ``teacher`` ``[P]`` is the same for a cohort."""

    teacher: torch.Tensor
    weight: float
    temperature: float


class Perturbation(Part):
    """Where the descent gradient is evaluated: ``g(w + eps)``, and what the local loss adds to find flat
    regions without a perturbation (:meth:`distillation`, FedGMT)."""

    role = "perturbation"

    def distillation(self, ctx: ClientContext) -> Distillation | None:
        """A distillation term of this round's local objective (the same at every step), or None."""
        return None

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch: "Batch") -> torch.Tensor | None:
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


DecayPlacement = Literal["outside", "inside"]
DECAY_DESCRIPTION = ("outside: a g + (1 - a) m + wd w, weight decay unscaled as torch.optim.SGD adds it in FL-Simulator and "
                     "the FedWMSAM code; inside: a (g + wd w) + (1 - a) m, the spec's (effective decay a wd)")


def momentum_mix(a: float | torch.Tensor, grad: torch.Tensor, m: torch.Tensor, W: torch.Tensor, weight_decay: float,
                 decay: DecayPlacement) -> torch.Tensor:
    """The momentum-mixed local direction from ``grad = g + wd w``: ``a grad + (1 - a) m``, plus
    ``(1 - a) wd w`` with ``decay = outside`` so that the decay is ``wd w`` whatever ``a``
    (FedCM/MoFedSAM/FedWMSAM/FedVSSAM as their public codes run them)."""
    d = a * grad + (1 - a) * m
    if decay == "outside" and weight_decay:
        d = d + (1 - a) * weight_decay * W
    return d


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
