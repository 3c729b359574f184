"""The client side of a round: local training of a cohort of clients, the part-driven inner loop shared by
both engines and by every executor (in process, Ray workers, Flower clients).

:func:`fit` is the client contract: a function of the broadcast, the clients' own state, their data and
their random streams, returning their uploads, new state and measured work — nothing else. Its batches are
indexed from device tensors, no DataLoader (:class:`ClientBatches`, :func:`local_schedule`, :func:`stack_batches`).

Its steps call the gradient oracle (:class:`Oracle`): loss and gradient of each client's objective at its own
parameters, with a leading client dimension ``C`` on both engines, ``loss_grad(W[C, P], batch) -> (loss[C],
g[C, P])``. How it is computed is the run's gradient backend (:mod:`fedflat.engine.gradients`), chosen once when the
oracle is built from the run's :class:`~fedflat.engine.compute.ComputeOptions`, the model's
:class:`~fedflat.engine.modes.ModelTraits` and DP-SGD's settings; what is differentiated is the call's objective
(:func:`objective_of`: the data loss, with a part's distillation or contrastive term and FedMAN's activation penalty).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from math import ceil
from typing import Any, ContextManager, Iterator

import torch

from fedflat.algorithms import Algorithm
from fedflat.algorithms.attacks import DataAttack
from fedflat.core import (BUFFERS, MODEL, OBJECTIVE_TERM, TRAIN_LOSS, Batch, ClientContext, ClientResult, Cohort,
                          Contrast, ContractError, Correction, Direction, Distillation, clip_rows, clip_scale,
                          torch_stream)
from fedflat.core.part import point_sum
from fedflat.engine.compute import ComputeOptions
from fedflat.engine.gradients import ClientSession, Forward, choose_backend
from fedflat.engine.gradients.convnet import hand_gradient_of
from fedflat.engine.gradients.objectives import DATA_LOSS, TERMS, Objective, Penalized
from fedflat.engine.losses import LossFn
from fedflat.engine.modes import ModelTraits
from fedflat.engine.optim import OptimizerState
from fedflat.params import FlatModel


# -- batches: local schedules, indexed from device tensors ----------------------------------------------------
def local_steps(num_samples: int, batch_size: int, local_epochs: int, fixed_steps: int | None) -> int:
    """``E_i = local_epochs * ceil(n_i / B)``, or the fixed ``local_steps``."""
    if fixed_steps is not None:
        return fixed_steps
    return local_epochs * ceil(num_samples / batch_size)


def local_schedule(indices: torch.Tensor, steps: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The client's batches for ``steps`` local steps: a fresh permutation every epoch, the last
    batch of an epoch possibly smaller (no samples dropped), as the reference simulators do."""
    n = indices.shape[0]
    batches: list[torch.Tensor] = []
    while len(batches) < steps:
        order = torch.randperm(n, generator=generator, device=generator.device).to(indices.device)
        batches.extend(indices[order].split(batch_size))
    return batches[:steps]


def independent_schedule(indices: torch.Tensor, steps: int, batch_size: int,
                         generator: torch.Generator) -> list[torch.Tensor]:
    """``steps`` batches of ``min(B, n)`` samples, each drawn without replacement independently of the others: the
    sampling DP-SGD's accountant assumes at every step (``privacy.level: instance``), where an epoch's permutation
    would tie the steps together."""
    n = indices.shape[0]
    return [indices[torch.randperm(n, generator=generator, device=generator.device)[:batch_size].to(indices.device)]
            for _ in range(steps)]


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for an index tensor of any shape; ``index_select`` is several times faster on CPU
    than advanced indexing for small batches (13 vs 100 us for 50 Fashion-MNIST images)."""
    return x.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:])


def stack_batches(x: torch.Tensor, y: torch.Tensor, picks: list[torch.Tensor], batch_size: int) -> Batch:
    """A cohort's step batch ``[C, B, ...]``; rows shorter than ``B`` are padded and masked by weight."""
    if len(picks) == 1:
        idx = picks[0].unsqueeze(0)
        return Batch(gather(x, idx), gather(y, idx))
    lengths = [p.shape[0] for p in picks]
    width = max(lengths)
    if min(lengths) == width:
        idx = torch.stack(picks)
        return Batch(gather(x, idx), gather(y, idx))
    # Padding repeats the row's first sample; its weight 0 keeps it out of the loss and gradient.
    idx = torch.stack([torch.cat([p, p[:1].expand(width - p.shape[0])]) for p in picks])
    n = torch.tensor(lengths, device=x.device)
    weight = (torch.arange(width, device=x.device) < n[:, None]).to(x.dtype if x.is_floating_point() else torch.float32)
    return Batch(gather(x, idx), gather(y, idx), weight)


# -- the gradient oracle -----------------------------------------------------------------------------------------------
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
            hand_gradient=hand_gradient_of(model) is not None)
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


# -- local training ----------------------------------------------------------------------------------------------------
def local_direction(correction: Correction, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor,
                    grad: torch.Tensor, clip: float | None, clip_scope: str) -> torch.Tensor:
    """The step's direction ``d``, clipped as ``train.clip_scope`` says, from the raw gradient ``grad`` (the oracle's
    fresh tensor, overwritten): the correction's :class:`~fedflat.core.Direction` ``(L, c)`` made ``d = L + c w``
    by :func:`add_decay`, the one place the clip scope and the decay are applied."""
    direction = correction.direction(ctx, cohort, k, W, grad)
    if not isinstance(direction, Direction):
        raise ContractError(f"{correction!r}.direction returned {type(direction).__name__}; it returns "
                            "fedflat.core.Direction(loss, decay), d = loss + decay w (docs/extending.md)")
    return add_decay(direction.loss, W, direction.decay, clip, clip_scope, getattr(direction, "loss_norm", None))


def add_decay(L: torch.Tensor, W: torch.Tensor, decay: float | torch.Tensor, max_norm: float | None,
              clip_scope: str, loss_norm: torch.Tensor | None = None) -> torch.Tensor:
    """``clip(L) + c W`` (``clip_scope=loss``: ``clip_grad_norm_`` on the loss gradient, then ``torch.optim.SGD``'s
    weight decay ``c`` as its ``d_p.add(p, alpha=c)``) or ``clip(L + c W)`` (``step``), per row; ``L`` is
    overwritten. A row within ``max_norm`` is scaled by exactly 1. ``loss_norm``: ``L``'s row norms where the
    correction measured them (:class:`~fedflat.core.MeasuredDirection`), taken by the loss-scope clip."""
    if clip_scope == "loss" and max_norm is not None:
        scale = clip_scale(L, max_norm) if loss_norm is None else clip_scale(L, max_norm, loss_norm)
        if scale is not None:
            L.mul_(scale)
    if torch.is_tensor(decay):
        L.addcmul_(W, decay)
    elif decay:
        L.add_(W, alpha=decay)
    return clip_rows(L, max_norm) if clip_scope == "step" else L


class ClientBatches:
    """Each sampled client's batch schedule for the round, drawn from its own (seed, round, client) stream.

    Schedules are drawn on the host (CPU generators, CPU copies of the clients' indices) and sent to the
    data's device in one copy per call, so a GPU round waits for the host once, not once per client epoch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, client_indices: list[torch.Tensor], batch_size: int,
                 seed: int, augment=None, features=None):
        self.x, self.y = x, y
        self.features = features  # raw rows -> model inputs (Dataset.features: uint8 pixels standardized)
        self.client_indices = client_indices
        self.host_indices = [ix.cpu() for ix in client_indices]
        self.batch_size = batch_size
        self.seed = seed
        self.augment = augment
        # DP-SGD (privacy.level: instance) samples every step's batch on its own (independent_schedule)
        self.independent = False

    def schedules(self, round: int, ids: list[int], steps: list[int]) -> list[list[torch.Tensor]]:
        schedule = independent_schedule if self.independent else local_schedule
        return self._to_device([schedule(self.host_indices[i], e, self.batch_size,
                                         torch_stream(self.seed, round, i, "batches"))
                                for i, e in zip(ids, steps)])

    def extra(self, round: int, client: int, count: int, purpose: str) -> list[torch.Tensor]:
        """``count`` further batches of a client from a separate stream (pilot gradients, estimates)."""
        return self._to_device([local_schedule(self.host_indices[client], count, self.batch_size,
                                               torch_stream(self.seed, round, client, purpose))])[0]

    def full(self, client: int, size: int) -> Iterator[Batch]:
        """Every training sample of ``client`` once, in order, as one-client batches of at most ``size`` (model
        inputs: features applied, no augmentation)."""
        for chunk in self.client_indices[client].split(size):
            x = self.x[chunk] if self.features is None else self.features(self.x[chunk])
            yield Batch(x.unsqueeze(0), self.y[chunk].unsqueeze(0))

    def _to_device(self, plans: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """The host schedules ``plans`` on the data's device, every batch a view of one copied tensor."""
        device = self.x.device
        batches = [b for plan in plans for b in plan]
        if device.type == "cpu" or not batches:
            return plans
        moved = iter(torch.cat(batches).to(device).split([b.shape[0] for b in batches]))
        return [[next(moved) for _ in plan] for plan in plans]

    def batch(self, picks: list[torch.Tensor], generators: list[torch.Generator] | None) -> Batch:
        """The step batch of a cohort; augmentation (if any) draws from each client's own stream and
        touches only its real samples, so padding never shifts a client's random numbers."""
        batch = stack_batches(self.x, self.y, picks, self.batch_size)
        if self.features is not None:
            batch.x = self.features(batch.x)
        if self.augment is not None and generators is not None:
            rows = []
            for c, pick in enumerate(picks):
                n = pick.shape[0]
                row = self.augment(batch.x[c, :n], generators[c])
                rows.append(row if n == batch.x.shape[1] else torch.cat([row, batch.x[c, n:]]))
            batch.x = torch.stack(rows)
        return batch


def fit(algorithm: Algorithm, ctx: ClientContext, cohort: Cohort) -> ClientResult:
    """Runs ``E_i`` local steps for every client of ``cohort`` and returns what the clients send and keep.

    One step, for every client row at once:
    ``eps = filter(perturbation)``, ``g = descent(g(w + eps))`` (``g`` of the loss plus the
    perturbation part's distillation term, if any; ``descent`` is the perturbation's, e.g. FedSpeed's merging;
    a filter that ``acts_on`` the gradient filters ``descent(...)`` instead of ``eps``),
    ``(L, c) = correction.direction(g)``, ``d = clip(L + c w)`` (``train.clip_scope=step``) or ``clip(L) + c w``
    (``loss``, as the methods' public codes step: :func:`local_direction`),
    ``w <- w - eta_l^t d`` (or, with ``train.optimizer``, the local optimizer's step along ``d``:
    :mod:`fedflat.engine.optim`); rows whose ``E_i`` is exhausted are left unchanged (padding/masking).
    The upload holds ``model`` (``w_{i,E}``), ``train_loss`` (the mean loss over the client's own
    steps) and what the parts' ``end`` adds; the new state is what they put in ``cohort.new_state``.
    A model with buffers trains each client from the broadcast buffers (with its own private entries, FedBN's)
    within the oracle's :class:`~fedflat.engine.client.ClientSession` and uploads its final ones as ``buffers``
    (the broadcast's in the private entries, which the client keeps in its state): docs/models.md.
    """
    personalization, settings = algorithm.parts["personalization"], ctx.settings
    ctx = _client_context(algorithm, ctx, cohort)
    backprops_before = ctx.oracle.backprops
    ids = cohort.ids.tolist()
    private = personalization.private_buffers(settings) if ctx.buffers is not None else None
    start = None if ctx.buffers is None else own_buffers(ctx.buffers, private, cohort.state, cohort.known, cohort.size)
    with ctx.oracle.clients(ids, ctx.round, settings.seed, start) as session:
        initial = personalization.initialize(ctx, cohort)
        if initial is not None:  # start models computed on the clients' data (FedALA's adaptive local aggregation)
            ctx = replace(ctx, w_start=initial)
        algorithm.begin(ctx, cohort)
        W, loss_sum = _local_steps(algorithm, ctx, cohort, session)
        cohort.upload[MODEL] = W
        cohort.upload[TRAIN_LOSS] = loss_sum / cohort.steps.to(loss_sum.dtype)
        if start is not None:  # the buffers: kept where private (FedBN), uploaded as broadcast there
            if private is not None:
                cohort.new_state[BUFFERS] = session.buffers
            cohort.upload[BUFFERS] = (session.buffers if private is None else
                                      torch.where(private.to(start.device), ctx.buffers, session.buffers))
        for part in algorithm.ordered:
            part.end(ctx, cohort, W)
        algorithm.path.release(ctx, cohort)  # the upload path: what leaves the client (fedflat.core.upload)
    return ClientResult(cohort.ids, cohort.upload, cohort.new_state, ctx.oracle.backprops - backprops_before)


def _client_context(algorithm: Algorithm, ctx: ClientContext, cohort: Cohort) -> ClientContext:
    """``ctx`` as the cohort's local steps see it: the oracle with FedMAN's activation penalty where a part
    declares one, and each client's own start model where the personalization keeps one."""
    penalty = sum(part.activation_penalty(ctx) for part in algorithm.ordered if part.penalizes_activations)
    if penalty:  # FedMAN: every gradient of the round's local objective with the activation penalty
        ctx = replace(ctx, oracle=PenalizedOracle(ctx.oracle, penalty))
    own = algorithm.parts["personalization"].start(ctx.w_start, cohort.state, cohort.known, ctx.settings)
    if own is not None:  # each client starts from its own model: the broadcast with its private entries
        ctx = replace(ctx, w_start=own)
    return ctx


def own_buffers(b: torch.Tensor, private: torch.Tensor | None, state: dict[str, torch.Tensor],
                known: dict[str, torch.Tensor], clients: int) -> torch.Tensor:
    """The buffers ``[C, Q]`` clients start from (and a personalized evaluation runs them with): the broadcast
    ``b``, with each client's own values of the ``private`` entries where it has kept some (FedBN's)."""
    rows = b.expand(clients, -1).clone()
    if private is None:
        return rows
    return torch.where(private.to(b.device) & known[BUFFERS][:, None].to(b.device), state[BUFFERS].to(b), rows)


def _local_steps(algorithm: Algorithm, ctx: ClientContext, cohort: Cohort,
                 session: ClientSession | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``E_i`` local steps of :func:`fit` from ``ctx.w_start``: the final models ``W[C, P]`` and each client's
    summed step losses."""
    loop = LocalLoop.start(algorithm, ctx, cohort, session)
    W = ctx.w_start.expand(cohort.size, -1).clone()
    optimizer = loop.optimizer_state(W)
    loss_sum = torch.zeros(cohort.size, device=W.device)
    cohort.active = torch.ones(cohort.size, dtype=torch.bool, device=W.device)
    for k in range(max(loop.steps)):
        batch = loop.batch(k)
        loss, direction = loop.direction(k, W, batch)
        W = loop.update(W, direction, loss, loss_sum, optimizer, k)
    if optimizer is not None:
        optimizer.save(cohort.new_state)
    return W, loss_sum


def objective_term(algorithm: Algorithm, ctx: ClientContext) -> Any:
    """The distillation term of this round's local objective: the perturbation's (FedGMT's trajectory) or the
    correction's (FedNTD's not-true distillation); :func:`fedflat.algorithms.compose.build_parts` refuses a method
    whose perturbation and correction each have one."""
    term = algorithm.parts["perturbation"].distillation(ctx)
    return term if term is not None else algorithm.parts["correction"].distillation(ctx)


@dataclass
class LocalLoop:
    """What the local steps of one cohort share (set up once by :meth:`start`), and one step in three parts:
    :meth:`batch` (the clients' batches of step ``k``), :meth:`direction` (``d`` at ``W``) and :meth:`update`
    (``w <- w - eta_l^t d``, or the local optimizer's step, on the rows still active)."""

    algorithm: Algorithm
    ctx: ClientContext
    cohort: Cohort
    session: ClientSession | None
    schedules: list[list[torch.Tensor]]  # each client's batch indices, step by step
    generators: list[torch.Generator] | None  # each client's augmentation stream (None: no augmentation)
    poisoners: list[DataAttack]  # the data attacks' stages
    personal: Any  # a personalization that steps locally (Ditto, APFL), else None
    direction_ctx: ClientContext  # the context the correction sees (without AdamW's decoupled decay)
    decay: float  # AdamW's decoupled weight decay (0 otherwise)
    distill: Any  # the perturbation's distillation term (None without one)
    steps: list[int]  # E_i per client
    uniform: bool  # every client takes the same number of steps (no masking)
    rate_parts: tuple = ()  # the parts that scale the step's rate (Part.step_lr: FedSWA's within-round schedule)
    perturbed: torch.Tensor | None = None  # the loop's buffer of the perturbed point w + eps (:meth:`perturbed_point`)

    @classmethod
    def start(cls, algorithm: Algorithm, ctx: ClientContext, cohort: Cohort,
              session: ClientSession | None) -> "LocalLoop":
        settings, batches = ctx.settings, ctx.batches
        ids, steps = cohort.ids.tolist(), cohort.steps.tolist()
        generators = ([torch_stream(settings.seed, ctx.round, i, "augment", batches.x.device) for i in ids]
                      if batches.augment is not None else None)
        # AdamW's weight decay is decoupled: d is computed without it, and the optimizer shrinks w by 1 - eta wd
        decay = settings.weight_decay if settings.optimizer.name == "adamw" else 0.0
        direction_ctx = replace(ctx, settings=replace(settings, weight_decay=0.0)) if decay else ctx
        personal = algorithm.parts["personalization"]
        return cls(algorithm, ctx, cohort, session, batches.schedules(ctx.round, ids, steps), generators,
                   [s for s in algorithm.path.stages if isinstance(s, DataAttack)],
                   personal if personal.steps_locally else None,
                   direction_ctx, decay, objective_term(algorithm, ctx) or cohort.shared.get(OBJECTIVE_TERM), steps,
                   min(steps) == max(steps), tuple(p for p in algorithm.ordered if p.schedules_steps))

    def optimizer_state(self, W: torch.Tensor) -> OptimizerState | None:
        """The local optimizer's state (``train.optimizer``; None for plain SGD) from the clients' kept rows."""
        optimizer, cohort = self.ctx.settings.optimizer, self.cohort
        return None if optimizer.plain else OptimizerState.start(optimizer, W, cohort.state, cohort.known)

    def batch(self, k: int) -> Batch:
        """Step ``k``'s batch of every client (poisoned for a data attack's clients), the active rows marked."""
        cohort, steps = self.cohort, self.steps
        if not self.uniform:
            cohort.active = cohort.steps > k
        if self.session is not None:
            self.session.step(cohort.active)
        picks = [sched[min(k, len(sched) - 1)] for sched in self.schedules]
        batch = self.ctx.batches.batch(picks, self.generators)
        for stage in self.poisoners:  # a malicious client's batches (label flips, a backdoor's trigger)
            batch = stage.poison(self.ctx, cohort, batch)
        if not self.uniform:
            batch.clients = sum(e > k for e in steps)
        return batch

    def direction(self, k: int, W: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's losses and direction ``d`` (:func:`fit`'s equation: perturbation, filter, oracle, descent,
        correction, clip and decay); a personalization that steps locally (Ditto, APFL) takes its step too."""
        parts, ctx, cohort = self.algorithm.parts, self.ctx, self.cohort
        perturbation, filt = parts["perturbation"], parts["filter"]
        if perturbation.fuses_point and (filt.acts_on != "perturbation" or filt.name == "none"):  # w + eps fused
            point = perturbation.perturbed_point(ctx, cohort, k, W, batch, self.point_buffer(W))
        else:
            eps = perturbation.perturb(ctx, cohort, k, W, batch)
            if eps is not None and filt.acts_on == "perturbation":
                eps = filt.apply(ctx, cohort, eps)
            point = None if eps is None else self.perturbed_point(W, eps)
        loss, grad = ctx.oracle.loss_grad(W if point is None else point, batch, self.distill)
        grad = perturbation.descent_gradient(ctx, cohort, grad)
        if filt.acts_on == "gradient":
            grad = filt.apply(ctx, cohort, grad)
        settings = ctx.settings
        direction = local_direction(parts["correction"], self.direction_ctx, cohort, k, W, grad, settings.clip,
                                    settings.clip_scope)
        if self.personal is not None:
            self.personal.local_step(ctx, cohort, k, W, batch)
        return loss, direction

    def perturbed_point(self, W: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """``W + eps``, written into one buffer the loop reuses at every step: ``W + eps`` bit for bit, without a fresh
        ``[C, P]`` tensor a step (on the CPU a fresh model-sized tensor costs its page faults, about as much as the
        addition itself on W1's MLP, docs/benchmarks.md). The oracle reads the point and keeps nothing of it."""
        if eps.shape != W.shape or eps.dtype != W.dtype:  # (a broadcast eps or another dtype: the plain sum)
            return W + eps
        return point_sum(W, eps, self.point_buffer(W))

    def point_buffer(self, W: torch.Tensor) -> torch.Tensor:
        """The loop's buffer of the perturbed point, ``W``'s shape (made at the first step that needs it)."""
        if self.perturbed is None or self.perturbed.shape != W.shape or self.perturbed.device != W.device:
            self.perturbed = torch.empty_like(W)
        return self.perturbed

    def update(self, W: torch.Tensor, direction: torch.Tensor, loss: torch.Tensor, loss_sum: torch.Tensor,
               optimizer: OptimizerState | None, k: int = 0) -> torch.Tensor:
        """``w <- w - eta_l^t d`` on the active rows (or the optimizer's step along ``d``), their losses added to
        ``loss_sum``; the new ``W``."""
        lr, uniform, active = self.ctx.lr, self.uniform, self.cohort.active
        if self.rate_parts:  # a within-round schedule (plain SGD only: optim.PLAIN_SGD_PARTS): w - eta_l^t f_k d
            factor = self.rate_parts[0].step_lr(self.ctx, self.cohort, k)
            for part in self.rate_parts[1:]:
                factor = factor * part.step_lr(self.ctx, self.cohort, k)
            step = direction * (lr * factor).to(direction.dtype)[:, None]
            W = W.sub_(step) if uniform else torch.where(active[:, None], W - step, W)
            loss_sum += loss if uniform else torch.where(active, loss, torch.zeros_like(loss))
        elif optimizer is not None:  # a stateful optimizer (train.optimizer): its step along d
            W = optimizer.step(W, direction, lr, self.decay, None if uniform else active)
            loss_sum += loss if uniform else torch.where(active, loss, torch.zeros_like(loss))
        elif uniform:
            W.add_(direction, alpha=-lr)  # w - eta d in one pass
            loss_sum += loss
        else:
            W = torch.where(active[:, None], torch.add(W, direction, alpha=-lr), W)  # the same arithmetic
            loss_sum += torch.where(active, loss, torch.zeros_like(loss))
        return W
