"""The data of a round, as parts see it: what the server broadcasts, what a cohort of clients computes with
and returns, and the server's view of the round.

A round runs as Flower's vocabulary has it: the server configures it (:class:`Broadcast`, ``configure_fit``),
each client computes a pure function of the broadcast, its own state, its data and its random streams
(:class:`ClientContext`, :class:`Cohort` -> :class:`ClientResult`, ``fit``), and the server reduces the uploads
in ascending client-id order (:class:`RoundContext`, ``aggregate_fit``). Every client-side tensor carries a
leading client dimension ``C``: the sequential engine runs chunks of one client, the vectorized engine a cohort.

Every random draw of a run comes from its own generator (:func:`torch_stream`, :func:`numpy_stream`: random streams
keyed by (seed, round, client, purpose)), derived from the experiment seed and the coordinates of the draw, never
from a global generator whose position depends on what ran before. Results therefore do not depend on the engine,
the chunk size or the order in which clients train, and a resumed run draws exactly what an uninterrupted one would.
"""
from __future__ import annotations

import threading
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Iterator, Literal, Protocol

import numpy as np
import torch

from fedflat.core.errors import AlgorithmError, ContractError
from fedflat.core.vectors import BufferLayout, ParamLayout

# -- random streams keyed by (seed, round, client, purpose) -----------------------------------------------------------
SERVER = -1  # the client coordinate of server-side draws (client sampling, model init)


def _purpose_id(purpose: str) -> int:
    return zlib.crc32(purpose.encode())


def stream_seed(seed: int, round: int, client: int, purpose: str) -> int:
    """A 63-bit seed that depends on all four coordinates (NumPy's SeedSequence hashing)."""
    entropy = [seed, round + 1, client + 2, _purpose_id(purpose)]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def torch_stream(seed: int, round: int, client: int, purpose: str, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` for one (seed, round, client, purpose) stream."""
    generator = torch.Generator(device=device)
    generator.manual_seed(stream_seed(seed, round, client, purpose))
    return generator


def numpy_stream(seed: int, round: int, client: int, purpose: str) -> np.random.Generator:
    """A NumPy ``Generator`` for one (seed, round, client, purpose) stream."""
    return np.random.default_rng(stream_seed(seed, round, client, purpose))


def sample_clients(seed: int, round: int, num_clients: int, clients_per_round: int, participation: str,
                   at_least_one: bool) -> list[int]:
    """Round ``round``'s clients, ascending, from its keyed ``sampling`` stream: ``K`` of ``N`` uniformly without
    replacement (``participation`` ``uniform``), or each with probability ``K / N`` (``bernoulli``; when none was
    drawn and ``at_least_one``, one uniformly, as FL-Simulator). Data-independent: the whole schedule is known
    before round 0 (the privacy calibration reads it)."""
    rng = numpy_stream(seed, round, SERVER, "sampling")
    if participation == "bernoulli":
        chosen = (rng.random(num_clients) < clients_per_round / num_clients).nonzero()[0]
        if len(chosen) == 0 and at_least_one:
            chosen = rng.choice(num_clients, 1)
    else:
        chosen = rng.choice(num_clients, clients_per_round, replace=False)
    return sorted(chosen.tolist())


# -- a round's data ----------------------------------------------------------------------------------------------------
ClipScope = Literal["loss", "step"]

MODEL = "model"  # upload: the client's final model w_{i,E}, [C, P]
TRAIN_LOSS = "train_loss"  # upload: the client's mean local loss of the round, [C]
BUFFERS = "buffers"  # upload: the client's final buffers b_{i,E}, [C, Q] float64 (models with buffers only)


@dataclass
class Batch:
    """One local step's mini-batches of a cohort: ``x[C, B, ...]``, ``y[C, B]``.

    ``weight[C, B]`` (1 for a real sample, 0 for padding) is set only when clients' batches had to be
    padded to a common size; the loss is then the mean over real samples. ``clients`` is how many rows
    are real work (the engine sets it when padded steps are masked), for counting backprops.
    """

    x: torch.Tensor
    y: torch.Tensor
    weight: torch.Tensor | None = None
    clients: int | None = None

    def real(self, c: int) -> slice | torch.Tensor:
        """The index of client ``c``'s real samples in its row (all of them, or a mask dropping the padding)."""
        return slice(None) if self.weight is None else self.weight[c] > 0

    def row(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Client ``c``'s real samples ``(x[n_c, ...], y[n_c])`` (padding dropped)."""
        if self.weight is None:
            return self.x[c], self.y[c]
        keep = self.real(c)
        return self.x[c][keep], self.y[c][keep]


@dataclass(frozen=True)
class Distillation:
    """A distillation term added to every client's mini-batch loss: ``weight * temperature^2 *
    KL(softmax(f(teacher, x)/temperature) || softmax(f(w, x)/temperature))``, averaged over the batch (Hinton et
    al.'s knowledge distillation; FedGMT's global-trajectory term). ``teacher`` ``[P]`` is the same for a cohort.
    ``not_true``: both distributions over the classes other than each sample's label only (FedNTD's not-true
    distillation, each softmax renormalized over those ``K - 1`` classes)."""

    teacher: torch.Tensor
    weight: float
    temperature: float
    data_weight: float = 1.0  # the weight of the data loss beside it (0: the distillation term alone, FedSOL's)
    not_true: bool = False


@dataclass(frozen=True)
class Contrast:
    """MOON's model-contrastive term added to every client's mini-batch loss (Li, He and Song, CVPR 2021, eq. 3):
    ``weight * mean_b -log(exp(cos(z_b, z_b^glob)/T) / (exp(cos(z_b, z_b^glob)/T) + exp(cos(z_b, z_b^prev)/T)))``, ``z``
    the model's representation (``features``) at the client's row, ``z^glob`` at ``anchor`` ``[P]`` (the global model)
    and ``z^prev`` at the client's ``previous`` ``[C, P]`` (its last local model), both without gradient. ``on[C]``
    (1 or 0) switches the term per client (0: no previous model yet)."""

    anchor: torch.Tensor
    previous: torch.Tensor
    on: torch.Tensor
    weight: float
    temperature: float


class GradientOracle(Protocol):
    """Loss and gradient of each client's mini-batch loss at its own row of ``W[C, P]`` (the engine's oracle:
    one reused module for the sequential engine, ``torch.func.vmap`` for the vectorized one). Every call of
    :meth:`loss_grad` is a counted backward pass per client."""

    backprops: int

    def loss_grad(self, W: torch.Tensor, batch: Batch,
                  distill: Distillation | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss[C], grad[C, P])``; with ``distill`` the gradient of the loss plus the distillation term."""
        ...

    def loss(self, W: torch.Tensor, batch: Batch) -> torch.Tensor:
        """``loss[C]`` without a backward pass."""
        ...


class ClientData(Protocol):
    """A cohort's own training data, as parts may draw from it beyond the local steps' batches."""

    def extra(self, round: int, client: int, count: int, purpose: str) -> list[torch.Tensor]:
        """``count`` further batches (index tensors) of ``client``, from their own random stream ``purpose``."""
        ...

    def batch(self, picks: list[torch.Tensor], generators: list[torch.Generator] | None) -> Batch:
        """The cohort batch of one index tensor per client (augmented when ``generators`` are given)."""
        ...

    def full(self, client: int, size: int) -> Iterator[Batch]:
        """Every training sample of ``client`` once, in order, as one-client batches of at most ``size``."""
        ...


@dataclass(frozen=True)
class LocalOptimizer:
    """The clients' local optimizer (``train.optimizer``), as ``torch.optim`` defines it, acting on the local
    direction ``d`` the parts compute (the gradient ``p.grad`` would hold): ``sgd`` with ``momentum`` (heavy ball,
    ``dampening``, ``nesterov``), ``adam`` (L2 ``weight_decay`` coupled into ``d``) or ``adamw`` (decoupled:
    ``w <- w (1 - eta wd)``). ``keep``: the state's lifetime, ``round`` (fresh every round, as the papers' codes
    build their optimizer) or ``client`` (each client's state kept in the client-state store)."""

    name: Literal["sgd", "adam", "adamw"] = "sgd"
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    keep: Literal["round", "client"] = "round"

    @property
    def plain(self) -> bool:
        """Plain SGD, ``w <- w - eta d``: the step every method's equations are written for."""
        return self.name == "sgd" and self.momentum == 0


@dataclass
class TrainSettings:
    """The local-training settings every part may read (the same on the server and on every client)."""

    weight_decay: float
    clip: float | None
    batch_size: int
    global_lr: float
    num_clients: int
    seed: int
    layout: ParamLayout | None = None  # where each parameter tensor lives in the flat vector (per-tensor filters)
    total_samples: int = 0  # training samples over all clients, n (FedAWA's initial logits n_i / n); 0: unknown
    buffers: BufferLayout | None = None  # where each buffer lives in the flat buffer vector b (models with buffers)
    batch_norms: tuple[str, ...] = ()  # names of the model's BatchNorm modules (FedBN keeps them on the clients)
    # What ``clip`` bounds: "loss", the direction without the terms in w that the authors' codes hand to their
    # optimizer as weight decay (:class:`Direction`'s ``decay``), added after the clip; "step": all of it
    clip_scope: ClipScope = "loss"
    lr_decay: float = 1.0  # eta_l^{t+1} = lr_decay * eta_l^t
    dp_sgd: tuple[float, float] | None = None  # (C, z): local steps take DP-SGD's private gradients (privacy.level)
    optimizer: LocalOptimizer = field(default_factory=LocalOptimizer)  # the local step (plain SGD by default)
    # the loss, (logits[B, K], y[B]) -> per-sample losses [B]; None: cross-entropy (fedflat/engine/losses.py)
    loss: Any = None
    rounds: int = 0  # the run's rounds T (server-side SWA starts at a fraction of them); 0: unknown


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
    client (:meth:`Part.personal`), ``[K, ...]`` in the order of ``ids``. ``lr`` is ``eta_l^t``. ``buffers`` is
    the global model's buffers ``b^t`` (``[Q]`` float64, :class:`BufferLayout`) for a model that has any.
    """

    round: int
    lr: float
    w: torch.Tensor
    server: dict[str, torch.Tensor]
    ids: torch.Tensor | None = None
    personal: dict[str, torch.Tensor] = field(default_factory=dict)
    buffers: torch.Tensor | None = None

    def shared(self) -> dict[str, torch.Tensor]:
        """What every client receives alike: the model and the parts' shared entries."""
        return {MODEL: self.w, **self.server}

    def to(self, device: torch.device | str) -> "Broadcast":
        return Broadcast(self.round, self.lr, self.w.to(device), {k: v.to(device) for k, v in self.server.items()},
                         self.ids, {k: v.to(device) for k, v in self.personal.items()},
                         None if self.buffers is None else self.buffers.to(device))

    def for_clients(self, ids: torch.Tensor) -> "Broadcast":
        """The broadcast as the clients ``ids`` (a subset of ``self.ids``) receive it: their personal rows only."""
        if not self.personal:
            return Broadcast(self.round, self.lr, self.w, self.server, ids, buffers=self.buffers)
        position = {int(c): row for row, c in enumerate(self.ids.tolist())}
        index = torch.tensor([position[int(c)] for c in ids.tolist()], dtype=torch.long)
        return Broadcast(self.round, self.lr, self.w, self.server, ids,
                         {k: v[index.to(v.device)] for k, v in self.personal.items()}, self.buffers)


@dataclass
class ClientContext:
    """What a client's local work may read: the broadcast, the shared settings, and its means to
    compute (the gradient ``oracle`` and the ``batches`` of its own data).

    ``w_start`` is where local training starts: the broadcast model ``w_broadcast`` ``[P]``, or with a
    personalization part each client's own model ``[C, P]`` (the broadcast with its private entries).
    ``buffers`` is the broadcast's ``b^t`` (``[Q]``, None for a model without buffers): the engine runs each
    client's forward passes with its own copy, which parts never need to touch."""

    round: int
    lr: float
    w_start: torch.Tensor
    server: dict[str, torch.Tensor]  # the broadcast entries only: a part reading anything else is a contract error
    settings: TrainSettings
    oracle: GradientOracle
    batches: ClientData
    w_broadcast: torch.Tensor | None = None
    buffers: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.w_broadcast is None:
            self.w_broadcast = self.w_start

    @classmethod
    def of(cls, broadcast: Broadcast, settings: TrainSettings, oracle: GradientOracle,
           batches: ClientData) -> "ClientContext":
        return cls(round=broadcast.round, lr=broadcast.lr, w_start=broadcast.w, server=broadcast.server,
                   settings=settings, oracle=oracle, batches=batches, buffers=broadcast.buffers)


@dataclass(frozen=True)
class Slot:
    """A named value parts share within a chunk's round, ``<part>.<symbol>``: written by the part that declares it
    in ``provides``, read by parts that declare it in ``requires`` (or test ``slot in cohort.shared``)."""

    name: str
    doc: str = ""

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


OBJECTIVE_TERM = Slot("objective.term", "a Contrast (or Distillation) term of the chunk's local objective, which "
                                       "the engine's local loop passes to the oracle (MOON's contrastive term)")


class Shared:
    """The typed channel of a chunk: the :class:`Slot` s its parts provide, written by their provider (in ``begin``
    or a step) and read by the parts after it in role order. An undeclared write, or a read of a slot
    nobody provides, is an error naming the slot."""

    def __init__(self, provided: dict[Slot, str] | None = None):
        self._providers = dict(provided or {})  # slot -> "role 'name'" of its provider
        self._values: dict[Slot, Any] = {}

    def put(self, slot: Slot, value: Any) -> None:
        if slot not in self._providers:
            raise KeyError(f"{slot.name}: no part of this method declares it in `provides`")
        self._values[slot] = value

    def __getitem__(self, slot: Slot) -> Any:
        if slot not in self._values:
            who = self._providers.get(slot)
            raise KeyError(f"{slot.name}: not written yet" + (f" (its provider is {who}; parts run in role order)"
                                                              if who else ": no part of this method provides it"))
        return self._values[slot]

    def __contains__(self, slot: Slot) -> bool:
        return slot in self._values

    def get(self, slot: Slot, default: Any = None) -> Any:
        return self._values.get(slot, default)


class Declared(dict):
    """Per-client vectors of the declared names only (``cohort.state``: a part's ``keeps``; ``ctx.held``: its
    ``holds``): reading a name nobody declared is a one-line error naming the declaration, not a bare KeyError."""

    where: ClassVar[str] = ""
    declaration: ClassVar[str] = ""

    def __missing__(self, key: str) -> Any:
        raise ContractError(f"{self.where}[{key!r}]: no part of this method declares it; add it to the part's "
                            f"`{self.declaration}` ({self.declaration} = ({key!r},)) so that fedflat creates, stores "
                            "and checkpoints it (docs/extending.md#what-a-part-declares)")

    @classmethod
    def of(cls, entries: dict[str, torch.Tensor]) -> "Declared":
        return entries if isinstance(entries, cls) else cls(entries)


class Kept(Declared):
    where, declaration = "cohort.state", "keeps"


class KeptKnown(Declared):
    where, declaration = "cohort.known", "keeps"


class Held(Declared):
    where, declaration = "ctx.held", "holds"


class HeldKnown(Declared):
    where, declaration = "ctx.held_known", "holds"


@dataclass
class Cohort:
    """A chunk of the round's sampled clients trained together (``C`` rows), with their own state.

    In: ``state[name][C, P]`` (zeros where a client has none yet) and ``known[name][C]`` for every
    name the parts keep; ``personal[name]`` the clients' rows of the broadcast. ``active[C]`` is set before every
    local step: ``k < E_i``; a part that keeps per-step state must leave inactive rows unchanged (the vectorized
    engine pads clients with fewer steps). ``shared`` is the chunk's typed channel between parts (:class:`Shared`);
    :meth:`own` a part's private working values for the chunk.
    Out: ``new_state`` (what each client keeps for its next participation) and ``upload`` (what it
    sends the server, rows ``[C, ...]``), both written by the parts' ``end`` (or ``begin``).
    """

    ids: torch.Tensor
    num_samples: torch.Tensor
    steps: torch.Tensor
    active: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    known: dict[str, torch.Tensor] = field(default_factory=dict)
    personal: dict[str, torch.Tensor] = field(default_factory=dict)
    shared: Shared = field(default_factory=Shared)
    new_state: dict[str, torch.Tensor] = field(default_factory=dict)
    upload: dict[str, torch.Tensor] = field(default_factory=dict)
    _own: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.state, self.known = Kept.of(self.state), KeptKnown.of(self.known)

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def own(self, part: object) -> dict[str, Any]:
        """``part``'s private working values for this chunk (FedLESAM's ``eps``, FedSMOO's running dual)."""
        return self._own.setdefault(id(part), {})


@dataclass
class ClientResult:
    """What a cohort of clients returns (Flower's ``FitRes``), one row per client in the order of ``ids``:
    the ``upload``, what travels; the ``state`` each client keeps; ``backprops``, the backward passes it took.

    ``upload`` holds ``"train_loss"``, the parts' entries and the model's entry as it travels: for a method without
    upload stages ``"model"`` is the final local model ``w_{i,E}``; with any stage (an attack, a robust rule, DP,
    compression: :mod:`fedflat.core.upload`) the client sends its release instead, ``"model"`` the update
    ``Delta_i`` as the stages left it, or its encoding (top-k's ``"model/values"`` and ``"model/index"``, QSGD's
    ``"model/norm"`` and ``"model/levels"``). For ``Delta_i`` under every upload path, decoded, read
    :meth:`fedflat.engine.simulation.Simulation.updates` (``UploadPath.received_release``)."""

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
    rows = ResultRows(torch.cat([r.ids.cpu() for r in results]))
    for result in results:
        rows.add(result)
    return rows.result()


class ResultRows:
    """A round's client results assembled as they arrive: each result's rows are copied at once into one
    ``[K, ...]`` tensor per entry, at their clients' rank among ``ids`` (ascending client id, the canonical
    reduction order), so that a round holds each client's upload once — not in its own result and again stacked
    (a LoRA round of 100 clients: 700 MB less). Threads may add to it at once (thread workers)."""

    def __init__(self, ids: torch.Tensor):
        self.ids = ids.cpu().sort().values
        if len(set(self.ids.tolist())) != len(self.ids):
            raise ValueError(f"a client appears in more than one result: {self.ids.tolist()}")
        self.upload: dict[str, torch.Tensor] = {}
        self.state: dict[str, torch.Tensor] = {}
        self.filled = torch.zeros(len(self.ids), dtype=torch.bool)
        self.backprops = 0
        self._lock = threading.Lock()

    def add(self, result: ClientResult) -> None:
        """Copies ``result``'s rows to their places (the result can then be dropped)."""
        ids = result.ids.cpu()
        where = torch.searchsorted(self.ids, ids).clamp_(max=max(len(self.ids) - 1, 0))
        with self._lock:
            if not torch.equal(self.ids[where], ids) or self.filled[where].any() or len(set(ids.tolist())) != len(ids):
                raise ValueError(f"a client appears in more than one result, or was not expected: {ids.tolist()} "
                                 f"(expected {self.ids.tolist()}, {self.ids[self.filled].tolist()} in already)")
            for entries, out in ((result.upload, self.upload), (result.state, self.state)):
                for name, rows in entries.items():
                    if name not in out:
                        out[name] = rows.new_empty((len(self.ids), *rows.shape[1:]))
                    out[name].index_copy_(0, where.to(out[name].device), rows.to(out[name].device))
            self.filled[where] = True
            self.backprops += result.backprops

    def result(self) -> ClientResult:
        """Every client's rows; a client whose result never came is an error naming it."""
        if not self.filled.all():
            raise ValueError(f"no result for clients {self.ids[~self.filled].tolist()}")
        return ClientResult(self.ids, self.upload, self.state, self.backprops)


@dataclass
class RoundContext:
    """The server's view of round ``t``.

    Before training: ``w`` (the global model ``w^t``), ``lr`` (``eta_l^t``), the sampled clients in
    ascending id order with their sample counts and local step counts ``E_i``, the server state, and
    the per-client vectors the server holds for them (``held[name][K, P]``, zeros and
    ``held_known = False`` before a client's first round; parts replace the rows they update).
    After training: ``w_start`` (what clients started from), ``uploads`` (every upload stacked over
    the sampled clients, ``[K, ...]``, rows in the order of ``sampled``) and ``weights[K]`` (the
    aggregation). Parts may add per-round scalars to ``log`` (written to the round's metrics line).
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
    _deltas: tuple | None = field(default=None, repr=False, compare=False)  # (w_final, w, Delta) of the last call

    def __post_init__(self) -> None:
        self.held, self.held_known = Held.of(self.held), HeldKnown.of(self.held_known)

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
        """``Delta_i = w_{i,E} - w^t`` for every sampled client, ``[K, P]`` (computed once for the uploads and model
        it is asked about: the aggregation, the parts and the round's drift share it; read only)."""
        cached = self._deltas
        if cached is None or cached[0] is not self.w_final or cached[1] is not self.w:
            self._deltas = cached = (self.w_final, self.w, self.w_final - self.w)
        return cached[2]

    @property
    def has_deltas(self) -> bool:
        """Whether :attr:`deltas` is computed already for the current uploads (reading it then costs nothing)."""
        return self._deltas is not None and self._deltas[0] is self.w_final and self._deltas[1] is self.w

    @property
    def pseudo_gradients(self) -> torch.Tensor:
        """``G_i = -Delta_i / (E_i eta_l^t)``, the gradient-scale conversion of the spec, ``[K, P]``: the mean local
        direction only under plain SGD steps, so a part reading it under another ``train.optimizer`` is refused."""
        if not self.settings.optimizer.plain:
            raise AlgorithmError(f"-Delta_i / (E_i eta_l) is the mean local direction only under plain SGD steps, not "
                                 f"train.optimizer={self.settings.optimizer.name} (momentum "
                                 f"{self.settings.optimizer.momentum}): use train.optimizer=sgd train.momentum=0")
        return torch.neg(self.deltas).div_(self.steps.to(self.w.dtype)[:, None] * self.lr)  # (one fresh tensor)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        """``sum_i p_i X_i`` with the round's aggregation weights."""
        return self.weights.to(X.dtype) @ X

    def answered(self, ids: torch.Tensor) -> "RoundContext":
        """The context of the round as if only the clients ``ids`` (a subset of ``sampled``, ascending) had
        been sampled: a federation aggregates the clients whose uploads came back. Called after
        :meth:`Algorithm.configure`, before any upload is read; the server state and log carry over."""
        position = {int(c): row for row, c in enumerate(self.sampled.tolist())}
        missing = [int(c) for c in ids.tolist() if int(c) not in position]
        if missing:
            raise ValueError(f"round {self.round}: clients {missing} answered but were not sampled")
        keep = torch.tensor([position[int(c)] for c in ids.tolist()], dtype=torch.long, device=self.sampled.device)
        rows = (lambda d: {k: v[keep.to(v.device)] for k, v in d.items()})
        return replace(self, sampled=self.sampled[keep], num_samples=self.num_samples[keep], steps=self.steps[keep],
                       held=rows(self.held), held_known=rows(self.held_known))
