"""The four parts a federated method is made of, and the context they share.

A method is a *recipe*: a perturbation (where the local gradient is evaluated), an optional filter
on that perturbation, a correction (what is added to the local direction), an aggregation (client
weights ``p_i``) and a server update (what the server does with the aggregate). Parts are stateless
apart from their hyperparameters: server state lives in ``ctx.server`` (a dict of tensors) and
client state in ``ctx.store``, so a run can be checkpointed generically and a part can be reused in
any recipe.

Every tensor a part sees carries a leading client dimension ``C``: the sequential engine calls the
parts with chunks of one client, the vectorized engine with the whole cohort.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from fedflat.engine.oracle import Batch, Oracle
    from fedflat.engine.store import ClientStore
    from fedflat.params import ParamLayout

NORM_EPS = 1e-12


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
    """The local-training settings every part may read."""

    weight_decay: float
    clip: float | None
    batch_size: int
    global_lr: float
    num_clients: int
    seed: int
    layout: "ParamLayout | None" = None  # where each parameter tensor lives in the flat vector (per-tensor filters)


@dataclass
class Cohort:
    """A chunk of the round's sampled clients trained together (``C`` rows).

    ``rows`` locates the chunk inside the round's sampled list. ``active[C]`` is set by the engine
    before every local step: ``k < E_i``; a part that keeps per-step state must leave inactive rows
    unchanged (the vectorized engine pads clients with fewer steps). ``extra`` carries per-chunk
    quantities that one part computes and another reads (a personalized momentum, a radius).
    """

    ids: torch.Tensor
    num_samples: torch.Tensor
    steps: torch.Tensor
    rows: slice
    active: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class RoundContext:
    """Everything a part may read or write during one round ``t``.

    Filled by the engine: ``w`` (the global model ``w^t``), ``w_start`` (what clients start from;
    ``w^t`` unless the server update broadcasts another point), ``lr`` (``eta_l^t``), the sampled
    clients with their sample counts and local step counts ``E_i``; after local training
    ``w_final[K, P]`` and ``train_loss[K]``. Parts may add per-client results to ``info`` and set
    ``weights[K]`` (the aggregation).
    """

    round: int
    lr: float
    w: torch.Tensor
    sampled: torch.Tensor
    num_samples: torch.Tensor
    steps: torch.Tensor
    server: dict[str, torch.Tensor]
    store: "ClientStore"
    oracle: "Oracle"
    settings: TrainSettings
    w_start: torch.Tensor | None = None
    w_final: torch.Tensor | None = None
    train_loss: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    info: dict[str, Any] = field(default_factory=dict)
    batches: Any = None  # engine's batch source, for parts that need extra client batches (pilot gradients)

    @property
    def K(self) -> int:
        return int(self.sampled.shape[0])

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


class Part:
    """Base of every part. Hooks default to doing nothing.

    Class attributes declare what the part costs and needs, so recipes can be accounted for and
    compositions checked: ``up``/``down`` extra model-sized vectors per sampled client and round
    (the model itself is counted by the engine), ``client_vectors`` model-sized vectors stored per
    client, ``extra_backprops`` per local step beyond the one of the descent gradient,
    ``provides``/``requires`` names of shared quantities in ``cohort.extra`` or ``ctx.server``.
    """

    role: ClassVar[str] = ""
    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    Params: ClassVar[type[PartParams]] = PartParams
    up: ClassVar[int] = 0
    down: ClassVar[int] = 0
    client_vectors: ClassVar[int] = 0
    extra_backprops: ClassVar[int] = 0
    supports_vectorized: ClassVar[bool] = True  # False: the vectorized engine refuses the method, naming this part
    provides: ClassVar[frozenset[str]] = frozenset()
    requires: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, params: PartParams | None = None):
        self.p = params if params is not None else self.Params()

    def setup(self, server: dict[str, torch.Tensor], w0: torch.Tensor, settings: TrainSettings) -> None:
        """Creates this part's server state in ``server`` (called once, before round 0)."""

    def begin(self, ctx: RoundContext, cohort: Cohort) -> None:
        """Before a chunk's local training: load client state, compute per-chunk quantities."""

    def end(self, ctx: RoundContext, cohort: Cohort, W: torch.Tensor) -> None:
        """After a chunk's local training, with its final models ``W[C, P]``."""

    def finish(self, ctx: RoundContext) -> None:
        """After all clients trained and weights are set, before the server step."""

    def after_step(self, ctx: RoundContext, w_new: torch.Tensor) -> None:
        """After the server step produced ``w^{t+1}``."""

    def global_direction(self, server: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The method's current estimate of the global direction it steers by (FedVSSAM's ``v``,
        FedWMSAM's momentum, FedLESAM's estimated global perturbation), or None; for diagnostics.

        Always in gradient sign (a descent step moves along its negative), so directions of different
        methods compare with the same reference gradient."""
        return None


class Perturbation(Part):
    """Where the descent gradient is evaluated: ``g(w + eps)``."""

    role = "perturbation"

    def perturb(self, ctx: RoundContext, cohort: Cohort, k: int, W: torch.Tensor, batch: "Batch") -> torch.Tensor | None:
        """``eps[C, P]`` for local step ``k``, or ``None`` for no perturbation."""
        return None


class Filter(Part):
    """A transform of the perturbation (e.g. FedFFT's high-pass filter)."""

    role = "filter"

    def apply(self, ctx: RoundContext, cohort: Cohort, eps: torch.Tensor) -> torch.Tensor:
        return eps


class Correction(Part):
    """What is added to (or mixed with) the local gradient to form the local direction."""

    role = "correction"

    def direction(self, ctx: RoundContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The local direction from ``grad = g(w + eps) + wd w`` (identity by default)."""
        return grad


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
