"""The server of a run: the global model, its buffers, the declared server state and the client-state store.

One :class:`Server` per run, driven the same way by every transport: :class:`fedflat.engine.simulation.Simulation`
(the local, threads and Ray executors) and the Flower strategy (:mod:`fedflat.flower.server`) each call
:meth:`Server.begin_round` (sampling, the privacy budget, the broadcast of :meth:`Algorithm.configure`), have the
clients trained their own way, and hand what came back to :meth:`Server.finish_round` (validation, aggregation in
ascending client-id order, the server update, and the commit of model, server state and client state together).

The server checks what it receives before the upload path's stages (:func:`checked`, docs/security.md). Every
answering client's upload is checked on every executor (in process, threads, Ray, Flower nodes): an entry with a NaN
or an infinity, or (``validation.max_norm``) a release ``x_i = (Delta_i, extra_i)`` whose L2 norm is beyond the
bound, is invalid. With ``validation.invalid: reject`` (the default) the client's upload and new state
are dropped and the round aggregates the others, as if it had not been sampled; a warning names the client and
the reason, and the run's summary keeps them (``rejected_clients``). With ``invalid: fail`` the run stops.
"""
from __future__ import annotations

import functools
import logging
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator

import torch

from fedflat.algorithms import Algorithm, renamed_state
from fedflat.config import Config, ValidationConfig
from fedflat.core import (BUFFERS, Broadcast, ClientResult, ConfigError, Diverged, NoClients, Release, RoundContext,
                          TrainSettings, all_finite, non_finite_rows, payload_size, release_norms, sample_clients)
from fedflat.engine.client import local_steps
from fedflat.engine.optim import round_lr, state_keys, state_widths
from fedflat.engine.runtime import RoundTask
from fedflat.engine.store import ClientStore
from fedflat.params import FlatModel
from fedflat.privacy import Mechanism, PrivacyLedger, calibrated_noise, client_mechanism, delta_of


@contextmanager
def uninterrupted() -> Iterator[None]:
    """Holds SIGINT and SIGTERM back (they arrive right after the block) while a round commits its state, so
    an interrupted run always stops at a round boundary: the last complete round can be checkpointed."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


@dataclass
class OpenRound:
    """A round between its broadcast and its aggregation: the server's context, the broadcast, the clients'
    task (ids, sample counts, step counts) and when the round began."""

    ctx: RoundContext
    broadcast: Broadcast
    task: RoundTask
    start: float


@dataclass
class RoundResult:
    round: int
    lr: float
    train_loss: float
    drift: float
    clients: int
    seconds: float
    backprops_per_step: float = 0.0  # measured: the clients' backward passes / the round's local steps
    store: int = 0  # client-state vectors held in the store after the round
    up_vectors: int = 0  # measured per sampled client: model-sized vectors in its upload
    down_vectors: int = 0  # ... and in the broadcast it received
    up_bytes: int = 0
    down_bytes: int = 0
    dropped: list[int] = field(default_factory=list)  # sampled clients whose upload never came (failed nodes)
    log: dict[str, float] = field(default_factory=dict)  # the round's scalars: the parts' (ctx.log), rejected, epsilon
    logged: list[str] = field(default_factory=list)  # the keys of log the parts wrote (ctx.log): recorded every round
    rejected: dict[str, str] = field(default_factory=dict)  # client -> why its upload was rejected (validation)


@dataclass
class Aggregate:
    """What a round computed before its commit: the new model ``w^{t+1}`` and buffers ``b^{t+1}``, the server's
    context after the update, the clients that were aggregated and the ones rejected."""

    ctx: RoundContext
    result: ClientResult
    w: torch.Tensor
    buffers: torch.Tensor
    dropped: list[int]
    rejected: dict[int, str]


# -- the checks of what the server receives -------------------------------------------------------------------
logger = logging.getLogger(__name__)


class UploadRejected(ConfigError):
    """An invalid upload under ``validation.invalid: fail``, or a round whose every upload was invalid."""


def upload_problems(algorithm: Algorithm, ctx: RoundContext, result: ClientResult,
                    check: ValidationConfig) -> tuple[dict[int, str], Decoded | None]:
    """``{client: reason}`` for every invalid upload of ``result`` (module docstring), and the release of the
    decodable rows where ``validation.max_norm`` needed it decoded (else None)."""
    problems: dict[int, str] = {}
    decoded = None
    ids = result.ids.tolist()
    malformed = algorithm.path.malformed(result.upload, ctx.w.numel()).cpu()
    for row in malformed.nonzero().flatten().tolist():
        problems[ids[row]] = (f"its upload cannot be decoded by {algorithm.path.encoder!r} (indices or levels out of "
                              "range)")
    for name in sorted(result.upload):
        for row in non_finite_rows(result.upload[name]).nonzero().flatten().tolist():
            problems.setdefault(ids[row], f"NaN or Inf in its '{name}'")
    if check.max_norm is not None:
        decodable = (~malformed).nonzero().flatten()
        upload = {k: v[decodable.to(v.device)] for k, v in result.upload.items()}
        decoded = Decoded(decodable.tolist(), algorithm.path.received_release(ctx, upload))
        norms = release_norms(decoded.release).tolist()
        for client, norm in zip(result.ids[decodable].tolist(), norms):
            if norm > check.max_norm and client not in problems:
                problems[client] = f"its update's norm {norm:.4g} exceeds validation.max_norm={check.max_norm:g}"
    return problems, decoded


def checked(algorithm: Algorithm, ctx: RoundContext, result: ClientResult,
            check: ValidationConfig) -> tuple[RoundContext, ClientResult, dict[int, str], Release | None]:
    """The round's context and result without the invalid uploads, ``{client: reason}`` of those rejected
    (``invalid: fail`` raises :class:`UploadRejected` instead), and the kept rows' release where the checks decoded
    it (``validation.max_norm``: :meth:`Algorithm.aggregate` then does not decode the payload again), else None."""
    problems, decoded = upload_problems(algorithm, ctx, result, check)
    if not problems:
        return ctx, result, {}, decoded.release if decoded is not None else None  # every row decodable: all of them
    said = "; ".join(f"client {c}: {why}" for c, why in sorted(problems.items()))
    where = f"round {ctx.round + 1}"
    if check.invalid == "fail":
        raise UploadRejected(f"{where}: {said} (validation.invalid=fail stops the run; invalid=reject would "
                             "aggregate the round without it)")
    if len(problems) == len(result.ids) and all(why.startswith("NaN") for why in problems.values()):
        raise Diverged(f"{where}: non-finite local loss or model from every client (try a smaller train.lr or algo "
                       "radius)")
    if len(problems) == len(result.ids):
        raise UploadRejected(f"{where}: every upload was rejected ({said}); if the clients are honest, lower train.lr "
                             "(or the method's radius) or raise validation.max_norm")
    for client, why in sorted(problems.items()):
        logger.warning("%s: the upload of client %d is rejected: %s", where, client, why)
    kept = [row for row, c in enumerate(result.ids.tolist()) if c not in problems]
    result = result.rows(torch.tensor(kept, dtype=torch.long))
    release = decoded.rows(kept) if decoded is not None else None
    return ctx.answered(result.ids.to(ctx.sampled.device)), result, problems, release


@dataclass
class Decoded:
    """The release the checks decoded, of the result's rows :attr:`rows_of` (those the encoder could decode), in
    order."""

    rows_of: list[int]
    release: Release

    def rows(self, rows: list[int]) -> Release:
        """The release of the result's ``rows`` (each one of :attr:`rows_of`)."""
        where = {row: i for i, row in enumerate(self.rows_of)}
        index = torch.tensor([where[row] for row in rows], dtype=torch.long)
        return {name: v[index.to(v.device)] for name, v in self.release.items()}


def privacy_ledger(cfg: Config, num_samples: torch.Tensor, algorithm: Algorithm) -> PrivacyLedger | None:
    """The privacy ledger of ``cfg`` (None without ``privacy``): client level, the mechanism its accountant composes
    with the noise multiplier calibrated; instance level (DP-SGD), each step's sampling of the smallest client's
    ``num_samples`` and the noised gradients a local step takes of its batch (``algorithm.backprops_per_step``)."""
    p = cfg.privacy
    if p is None:
        return None
    N, K = cfg.data.num_clients, cfg.sampling.clients_per_round
    if p.level == "instance":
        mechanism = Mechanism("fixed", N, K, p.noise_multiplier, accountant=p.accountant, level="instance",
                              dataset_size=int(num_samples.min()), batch_size=cfg.train.batch_size,
                              gradients=algorithm.backprops_per_step)
        delta = delta_of(p, int(num_samples.sum()))
    else:
        mechanism, delta = client_mechanism(p, N, K, cfg.sampling.participation), delta_of(p, N)
        mechanism = replace(mechanism, noise_multiplier=calibrated_noise(p, mechanism, cfg.rounds, delta, cfg.seed))
    return PrivacyLedger(mechanism, delta, p.target_epsilon, torch.zeros(N, dtype=torch.long))


def drift_norms(ctx: RoundContext) -> torch.Tensor:
    """``||Delta_i||`` of every sampled client (``ctx.deltas.norm(dim=1)``): row by row where no part made
    ``ctx.deltas`` (each row's norm the same reduction, the same bits), so that no ``[K, P]`` is made for it."""
    if ctx.has_deltas:
        return ctx.deltas.norm(dim=1)
    return torch.stack([torch.sub(row, ctx.w).norm() for row in ctx.w_final])


class Server:
    """The server's side of a run: ``w^t``, ``b^t``, the server state the parts declared
    (:meth:`Algorithm.initial_server_state`), every client's state rows (:class:`ClientStore`), the last round that
    aggregated each client, the privacy ledger, and the round protocol :meth:`begin_round` / :meth:`finish_round`."""

    def __init__(self, cfg: Config, algorithm: Algorithm, model: FlatModel, settings: TrainSettings,
                 num_samples: torch.Tensor, private_buffers: torch.Tensor | None):
        self.cfg, self.algorithm, self.model, self.settings = cfg, algorithm, model, settings
        self.num_samples, self.private_buffers = num_samples, private_buffers
        self.device = model.initial.device
        self.w = model.initial.clone()
        self.buffers = model.initial_buffers.clone()  # b^t: the global model's buffers ([0] without any)
        self.state: dict[str, torch.Tensor] = algorithm.initial_server_state(self.w, settings)
        self.store = ClientStore(model.layout.size, self.device, memory_mb=cfg.store.memory_mb, directory=cfg.store.dir,
                                 widths={BUFFERS: (model.buffer_layout.size, torch.float64),
                                         **state_widths(settings.optimizer)})
        self.backprops = 0  # backward passes of every client's local training so far
        # the last round whose aggregation used each client's upload (-1: none yet)
        self.aggregated_round = torch.full((cfg.data.num_clients,), -1, dtype=torch.long)
        self.last_round: RoundResult | None = None  # set in the commit: an interrupt right after it loses nothing
        self.privacy = privacy_ledger(cfg, num_samples.cpu(), algorithm)

    # -- who trains, and from what ---------------------------------------------------------------------------------
    def sample_clients(self, round: int) -> torch.Tensor:
        """Round ``t``'s clients: ``K`` uniformly without replacement, or Bernoulli(K/N) participation
        (at least one client, as FL-Simulator)."""
        cfg = self.cfg  # (under DP, an empty Poisson sample stays empty, as the accountant assumes)
        return torch.as_tensor(sample_clients(cfg.seed, round, cfg.data.num_clients, cfg.sampling.clients_per_round,
                                              cfg.sampling.participation, at_least_one=self.privacy is None),
                               dtype=torch.long)

    def lr_at(self, round: int) -> float:
        """``eta_l^t`` (:func:`fedflat.engine.optim.round_lr`: ``train.schedule`` after ``train.warmup_rounds``)."""
        return round_lr(self.cfg.train, round, self.cfg.rounds)

    def new_context(self, round: int) -> RoundContext:
        """The server's context of round ``t``: its clients, their sample and step counts ``E_i``, a copy of the
        server state, and the state rows the server holds for them (:meth:`Algorithm.held_keys`)."""
        sampled = self.sample_clients(round)
        n = self.num_samples[sampled.to(self.device)]
        t = self.cfg.train
        steps = torch.tensor([local_steps(int(ni), t.batch_size, t.local_epochs, t.local_steps) for ni in n.tolist()],
                             device=self.device)
        held, held_known = self.load_state(sampled, self.held_keys)
        return RoundContext(round=round, lr=self.lr_at(round), w=self.w, sampled=sampled.to(self.device),
                            num_samples=n, steps=steps, server=dict(self.state), settings=self.settings,
                            held=held, held_known=held_known)

    @functools.cached_property
    def client_state_keys(self) -> list[str]:
        """Names of the state each client keeps: its parts', its own buffers where some are private (FedBN) and its
        local optimizer's; fixed for the run (parts keep no state), so listed once."""
        return (self.algorithm.state_keys() + ([BUFFERS] if self.private_buffers is not None else [])
                + state_keys(self.settings.optimizer))

    @functools.cached_property
    def held_keys(self) -> list[str]:
        """Names of the per-client rows the server holds (:meth:`Algorithm.held_keys`), fixed for the run: listed
        once."""
        return self.algorithm.held_keys()

    def load_state(self, ids: torch.Tensor, names: list[str] | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The state rows of the clients ``ids`` (zeros and ``known = False`` before their first round):
        by default those the clients keep; ``names`` for others (the ones the server holds)."""
        state, known = {}, {}
        for name in self.client_state_keys if names is None else names:
            state[name], known[name] = self.store.get(name, ids)
        return state, known

    def configure(self, ctx: RoundContext) -> Broadcast:
        """The round's broadcast (:meth:`Algorithm.configure`) with the global model's buffers ``b^t``."""
        broadcast = self.algorithm.configure(ctx)
        broadcast.buffers = self.buffers if self.model.buffer_layout.size else None
        return broadcast

    # -- the round protocol --------------------------------------------------------------------------------------
    def begin_round(self, round: int) -> OpenRound:
        """The server side of round ``t`` before training: its clients and the broadcast (Flower's
        ``configure_train``). Nothing is committed: a round never finished leaves no trace."""
        start = time.perf_counter()
        ctx = self.new_context(round)
        if self.privacy is not None:
            self.privacy.check_budget(round, ctx.sampled.cpu(), ctx.steps.cpu())
        broadcast = self.configure(ctx)
        task = RoundTask(ctx.sampled.cpu(), ctx.num_samples.cpu(), ctx.steps.cpu())
        return OpenRound(ctx, broadcast, task, start)

    def finish_round(self, opened: OpenRound, result: ClientResult | None) -> RoundResult:
        """Aggregation, server update and commit of an open round (Flower's ``aggregate_train``).

        ``result`` holds the clients that answered, in ascending id order: all sampled clients, or (a
        federation whose nodes failed or timed out) a subset, which the round aggregates as if only they
        had been sampled; the round's ``dropped`` count says how many were not. A round is a transaction:
        the parts work on a copy of the server state, and the new model, server state and client state
        are committed together at the end; an exception or an interrupt before that leaves the server
        exactly at the previous round."""
        if result is None:  # Poisson sampling under DP drew nobody: nothing is trained or released
            return self._empty_round(opened)
        done = self.aggregate(opened, result)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with uninterrupted():
            self._commit(done)
            self.last_round = self._round_result(opened, done)
        return self.last_round

    def aggregate(self, opened: OpenRound, result: ClientResult) -> Aggregate:
        """The answered clients' uploads checked (:func:`checked`) and reduced by
        :meth:`Algorithm.aggregate` into ``w^{t+1}``, with their buffers into ``b^{t+1}``; nothing committed."""
        ctx, round = opened.ctx, opened.ctx.round
        dropped = sorted(set(ctx.sampled.tolist()) - set(result.ids.tolist()))
        if dropped:
            if not len(result.ids):
                raise NoClients(f"round {round + 1}: none of the {ctx.K} sampled clients answered")
            ctx = ctx.answered(result.ids.to(ctx.sampled.device))
        result = result.to(self.device)
        # NaN/Inf or (validation.max_norm) too large: rejected with a warning naming the client, or the run fails
        ctx, result, rejected, release = checked(self.algorithm, ctx, result, self.cfg.validation)
        w_new = self.algorithm.aggregate(ctx, result, release)  # the payload decoded once: by the checks, or here
        if not all_finite(w_new):
            raise Diverged(f"round {round + 1}: the global model became non-finite")
        return Aggregate(ctx, result, w_new, self.aggregate_buffers(ctx, result), dropped, rejected)

    def aggregate_buffers(self, ctx: RoundContext, result: ClientResult) -> torch.Tensor:
        """``b^{t+1}``: the clients' buffers averaged with the round's aggregation weights ``ctx.weights``
        (:meth:`BufferLayout.average`; server optimizers act on the parameters only), or ``b^t`` for a model
        without buffers."""
        layout = self.model.buffer_layout
        if not layout.size:
            return self.buffers
        b_new = layout.average(self.buffers, result.upload[BUFFERS], ctx.weights).to(self.device)
        if not all_finite(b_new):
            raise Diverged(f"round {ctx.round + 1}: the model's buffers (e.g. BatchNorm statistics) became non-finite")
        return b_new

    def _commit(self, done: Aggregate) -> None:
        """The round's new model, buffers, server state and client state, together (inside :func:`uninterrupted`)."""
        result = done.result
        for name, rows in (*result.state.items(), *done.ctx.held.items()):
            self.store.put(name, result.ids, rows)
        self.state = done.ctx.server
        self.w, self.buffers = done.w, done.buffers
        self.aggregated_round[result.ids.cpu()] = done.ctx.round
        self.backprops += result.backprops

    def _round_result(self, opened: OpenRound, done: Aggregate) -> RoundResult:
        """The committed round's line: loss, drift ``mean_i ||Delta_i||``, measured communication, the parts' log
        and (under DP) the privacy spent."""
        ctx, result = done.ctx, done.result
        P, buffer_bytes = self.model.layout.size, self.model.buffer_layout.nbytes  # buffers: at their dtypes' size
        down_vectors, down_bytes = payload_size(opened.broadcast.shared(), P, opened.broadcast.personal)
        up_vectors, up_bytes = payload_size({}, P, {k: v for k, v in result.upload.items() if k != BUFFERS})
        log = {"rejected": float(len(done.rejected))} if done.rejected else {}
        log.update(ctx.log)
        if self.privacy is not None:
            log.update(self.privacy.spend(ctx.round, result.ids.cpu(), ctx.steps.cpu()))
        return RoundResult(
            round=ctx.round, lr=ctx.lr, train_loss=ctx.train_loss.mean().item(),
            drift=drift_norms(ctx).mean().item(), clients=ctx.K, seconds=time.perf_counter() - opened.start,
            backprops_per_step=result.backprops / ctx.steps.sum().item(), store=self.store.count(),
            up_vectors=up_vectors, down_vectors=down_vectors, up_bytes=up_bytes + buffer_bytes,
            down_bytes=down_bytes + buffer_bytes, dropped=done.dropped, log=log, logged=list(ctx.log),
            rejected={str(c): why for c, why in done.rejected.items()})

    def _empty_round(self, opened: OpenRound) -> RoundResult:
        """A round whose Poisson sample under DP was empty: the model stays, the accountant counts the round."""
        round = opened.ctx.round
        with uninterrupted():
            none = torch.zeros(0, dtype=torch.long)
            log = self.privacy.spend(round, none, none)
            self.last_round = RoundResult(round=round, lr=opened.ctx.lr, train_loss=float("nan"), drift=0.0, clients=0,
                                          seconds=time.perf_counter() - opened.start, store=self.store.count(),
                                          log=log)
        return self.last_round

    # -- what evolves across rounds ------------------------------------------------------------------------------
    def model_state(self) -> dict[str, torch.Tensor]:
        """The global model as a state dict of the user's module (parameters and buffers): ``model.pt``, which a
        fresh instance loads with ``load_state_dict(strict=True)``."""
        return self.model.state_dict(self.w, self.buffers)

    def state_dict(self) -> dict:
        """Everything that evolves across rounds: the global model and its buffers, server state, client-state
        store. (Random streams are keyed by round, so no generator state needs saving.)"""
        return {"w": self.w.detach().cpu().clone(), "buffers": self.buffers.detach().cpu().clone(),
                "server": {k: v.detach().cpu().clone() for k, v in self.state.items()},
                "store": self.store.state_dict(), "aggregated_round": self.aggregated_round.clone(),
                **({"privacy": self.privacy.state_dict()} if self.privacy is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.w = state["w"].to(self.device)
        if "buffers" in state:  # (checkpoints before buffers were federated lack it: their models had none)
            self.buffers = state["buffers"].to(self.device)
        self.state.clear()
        self.state.update({k: v.to(self.device) for k, v in renamed_state(state["server"]).items()})
        self.store.load_state_dict(renamed_state(state["store"]))
        if "aggregated_round" in state:  # (checkpoints before fedflat 0.x's Flower layer lack it)
            self.aggregated_round = state["aggregated_round"].clone()
        if self.privacy is not None and "privacy" in state:
            self.privacy.load_state_dict(state["privacy"])
