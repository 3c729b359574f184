"""The round loop: sampling, broadcast, clients' local work on an executor, aggregation, server update, evaluation.

The driver keeps the global model, the server state and the client-state store. Every round it builds the
broadcast once (:meth:`Algorithm.configure`), hands the sampled clients to its executor (in this process,
or Ray workers) together with their state rows, writes the state they return back to the store, and
reduces their uploads in ascending client-id order (:meth:`Algorithm.aggregate`). Communication is
measured from the payloads.
"""
from __future__ import annotations

import functools
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from fedflat import plugins
from fedflat.algorithms import Algorithm, AlgorithmError, build_algorithm, renamed_state
from fedflat.algorithms.attacks import backdoor_of, for_dataset
from fedflat.config import Config
from fedflat.core import (BUFFERS, MODEL, SERVER, TRAIN_LOSS, Broadcast, ClientResult, ConfigError, Diverged,
                          NoClients, RoundContext, TrainSettings, numpy_stream, payload_size, stream_seed)
from fedflat.data import (Dataset, augmentation_fn, client_split, client_test_split, load_dataset, user_split,
                          validation_split)
from fedflat.engine.batches import local_steps
from fedflat.engine.client import ClientBatches, own_buffers
from fedflat.engine.heap import retain_freed_memory
from fedflat.engine.losses import LossFn, check_loss, configured_loss, summed_loss
from fedflat.engine.modes import inspect_module, module_name
from fedflat.engine.privacy import PrivacyLedger
from fedflat.engine.optim import check_recipe, optimizer_of, round_lr, state_keys, state_widths
from fedflat.engine.runtime import (ClientRuntime, LocalExecutor, RoundTask, ThreadExecutor, WorkerSpec,
                                    build_client_runtime, choose_engine, resolve_engine, set_tf32, step_flops,
                                    vmap_problem)
from fedflat.engine.scores import MetricSet
from fedflat.engine.store import ClientStore
from fedflat.engine.threads import choose_threads, core_share, torch_threads
from fedflat.engine.validation import checked
from fedflat.models import build_model
from fedflat.params import FlatModel


def all_finite(x: torch.Tensor) -> bool:
    """Whether every entry of ``x`` is finite, in one reading pass (``aminmax`` propagates NaN; no ``[K, P]`` mask)."""
    if not x.numel() or not x.is_floating_point():
        return True
    low, high = torch.aminmax(x)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def _user_model(model_fn: Callable[[], nn.Module]) -> nn.Module:
    module = model_fn()
    if not isinstance(module, nn.Module):
        raise ConfigError(f"model_fn must return a torch.nn.Module, got {type(module).__name__}")
    if not any(True for _ in module.parameters()):
        raise ConfigError("model_fn returned a module without parameters: nothing to train")
    if any(nn.parameter.is_lazy(p) for p in module.parameters()):
        raise ConfigError(f"model_fn returned {type(module).__name__} with uninitialized (lazy) parameters: run one "
                          "forward pass on a sample batch in model_fn before returning it")
    return module


def _configured_model(cfg: Config, dataset: Dataset) -> nn.Module:
    """The config's model for the dataset's inputs; a model that cannot take them is a clear error."""
    options = {k: v for k, v in cfg.model.items() if k != "name"}
    try:
        return build_model(cfg.model["name"], dataset.input_shape, dataset.num_classes, **options)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"model={cfg.model['name']} on {dataset.name} (inputs {tuple(dataset.input_shape)}): "
                          f"{err}") from None


def _check_outputs(model: FlatModel, x: torch.Tensor, dataset: Dataset) -> None:
    """One output per class, before round 0: cross-entropy takes a model with fewer outputs as an index error deep
    in training, and trains one with more without a word (the extra outputs are never a target)."""
    training = model.module.training
    model.module.eval()  # (a normalization layer's running statistics stay as they are)
    try:
        with torch.no_grad():
            width = model.call_views(model.layout.views(model.initial), x[:1]).shape[-1]
    finally:
        model.module.train(training)
    if width != dataset.num_classes:
        raise ConfigError(f"the model gives {width} outputs for {dataset.name}'s {dataset.num_classes} classes: its "
                          f"last layer needs {dataset.num_classes} outputs, one per class")


PERSONAL_EVAL_ENTRIES = 2 ** 26  # parameters of the client models a personalized evaluation holds at once (256 MB)


@dataclass
class ClientScores:
    """A personalized evaluation's per-client results: correct predictions, summed loss and test samples."""

    clients: list[int]
    correct: list[int]
    loss: list[float]
    samples: list[int]


def pooled_accuracy(scores: ClientScores) -> tuple[float, float]:
    """``(accuracy, mean loss)`` over every scored test sample, summed in ascending client order (so a
    federation's scores, gathered from its nodes in any order, pool to the same bits as one process's)."""
    order = sorted(range(len(scores.clients)), key=scores.clients.__getitem__)
    total = sum(scores.samples)
    if not total:
        raise ConfigError("personalized evaluation: no test sample was scored (no class of the test set is in any "
                          "client's training data, or in a federation no node answered)")
    correct, loss = 0, 0.0
    for i in order:
        correct += scores.correct[i]
        loss += scores.loss[i]
    return correct / total, loss / total


@dataclass
class OpenRound:
    """A round between its broadcast and its aggregation: the server's context, the broadcast, the clients'
    task (ids, sample counts, step counts) and when the round began."""

    ctx: RoundContext
    broadcast: Broadcast
    task: RoundTask
    start: float


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


def resolve_device(name: str) -> torch.device:
    """``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (a GPU when there is one); anything else is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"device: {name!r} is not a device; use cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device={name}: this torch ({torch.__version__}) sees no CUDA GPU; use device=cpu "
                          "(or device=auto)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device={name}: there are only {torch.cuda.device_count()} GPUs")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={name}: fedflat runs on cpu or cuda")
    return device


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
    log: dict[str, float] = field(default_factory=dict)  # the parts' per-round scalars (ctx.log)
    rejected: dict[str, str] = field(default_factory=dict)  # client -> why its upload was rejected (validation)


def _dp_sgd(cfg: Config, traits, module: nn.Module) -> tuple[float, float] | None:
    """``(C, z)`` of DP-SGD for ``privacy.level: instance`` (None otherwise); a model whose forward draws random
    numbers (dropout) is refused: per-example gradients need the same forward for every example's copy."""
    p = cfg.privacy
    if p is None or p.level != "instance":
        return None
    if traits.random is not None or traits.dropout or traits.mixes:
        raise ConfigError(f"privacy.level=instance: model {module_name(module)} draws random numbers in its forward "
                          "(dropout) or mixes the samples of a batch (batch statistics); DP-SGD's per-example "
                          "gradients need neither: set its dropout to 0, use GroupNorm")
    return (p.clip, p.noise_multiplier)


def _without_heldout(clients: Sequence[Sequence[int]], kept: np.ndarray, num_samples: int, num_clients: int,
                     fraction: float) -> list[np.ndarray]:
    """A user's split of the ``num_samples`` training samples, checked, then re-indexed into the ``kept`` ones:
    the samples held out for validation leave their clients."""
    position = np.full(num_samples, -1, dtype=np.int64)
    position[kept] = np.arange(kept.size)
    remapped = []
    for i, client in enumerate(user_split(clients, num_samples, num_clients)):
        ix = position[client]
        if (ix < 0).all():
            raise ConfigError(f"data.validation={fraction}: client {i} gave all its samples to the validation set; "
                              "lower the fraction or give it more samples")
        remapped.append(ix[ix >= 0])
    return remapped


class Simulation:
    """One federated experiment in memory: data, split, model, algorithm, server and client state.

    ``dataset`` and ``model_fn`` let a Python user bring their own tensors and ``nn.Module`` factory, and
    ``clients`` their own split (one sequence of training-sample indices per client, in place of
    ``data.partition``: :func:`fedflat.data.user_split`).
    """

    def __init__(self, cfg: Config, dataset: Dataset | None = None, model_fn: Callable[[], nn.Module] | None = None,
                 clients: Sequence[Sequence[int]] | None = None, loss_fn: LossFn | None = None):
        self.cfg = cfg
        plugins.load(cfg.plugins)  # a config that crossed into another process (a Flower node) names its plugins
        self.device = resolve_device(cfg.device)
        set_tf32(self.device, cfg.tf32)
        retain_freed_memory()
        if dataset is None:
            # on one thread: torch splits a long reduction (the standardization's mean and std) across its threads,
            # so the data's bits, and every number trained on them, would depend on the process's thread count
            with torch_threads(1):
                dataset = load_dataset(cfg.data.name, root=cfg.data.root, download=cfg.data.download,
                                       **cfg.data.options)
        if cfg.data.validation:
            full = dataset.y_train.shape[0]
            dataset, kept = validation_split(dataset, cfg.data.validation)
            if clients is not None:
                clients = _without_heldout(clients, kept, full, cfg.data.num_clients, cfg.data.validation)
        self.dataset = dataset.to(self.device)
        self.client_indices_np = (
            user_split(clients, dataset.y_train.shape[0], cfg.data.num_clients) if clients is not None else
            client_split(dataset.y_train.cpu().numpy(), cfg.data.num_clients, cfg.data.partition, cfg.seed,
                         dataset.name, owners=dataset.owners))
        self.client_indices = [torch.as_tensor(ix, dtype=torch.long, device=self.device) for ix in self.client_indices_np]
        self.num_samples = torch.tensor([len(ix) for ix in self.client_indices_np], device=self.device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(stream_seed(cfg.seed, -1, SERVER, "init"))
            module = _user_model(model_fn) if model_fn is not None else _configured_model(cfg, dataset)
        self.model = FlatModel(module.to(self.device))
        try:  # one sample forward and backward: also the first check that the model takes these inputs
            sample = self.dataset.features(self.dataset.x_train[:1])
            _check_outputs(self.model, sample, dataset)
            self.step_flops = step_flops(self.model, self.model.initial, sample, self.dataset.y_train,
                                         cfg.train.batch_size)
        except (RuntimeError, ValueError, TypeError, IndexError) as err:
            raise ConfigError(f"the model does not accept {dataset.name}'s inputs of shape "
                              f"{tuple(dataset.input_shape)} with {dataset.num_classes} classes: {err}") from None
        # docs: fedflat/engine/threads.py; thread workers share this process's intra-op threads, so each its share
        share = core_share() / cfg.executor.workers if cfg.executor.name == "threads" else None
        self.threads = choose_threads(cfg.threads, self.step_flops, cores=share)
        if self.threads:
            torch.set_num_threads(self.threads)
        self.traits = self._inspect()
        # the upload path (privacy, compression, attacks, robust rules), z calibrated once here
        self.stage_specs = for_dataset(cfg.stage_specs(), dataset.num_classes, tuple(dataset.input_shape))
        self.algorithm: Algorithm = build_algorithm(cfg.algo, self.stage_specs)
        self.engine = resolve_engine(cfg.engine, self.device, self.step_flops)
        # a module vmap cannot run: engine=auto trains it sequentially (saying why), engine=vectorized is refused
        may_vectorize = self.engine == "vectorized" or (cfg.engine == "auto" and cfg.executor.gpus_per_worker > 0)
        loss = loss_fn if loss_fn is not None else configured_loss(cfg.train)
        self._check_loss(loss)
        self.vmap_problem = vmap_problem(self.model, self.traits, self._probe_inputs(), self.dataset.y_train,
                                         cfg.precision, loss) if may_vectorize else None
        self.engine = choose_engine(cfg.engine, self.engine, self.vmap_problem, module)
        layout = self.model.buffer_layout
        if cfg.privacy is not None and layout.size:
            raise ConfigError(f"privacy: model {module_name(module)} has buffers ({', '.join(layout.names[:3])}...), "
                              "data statistics its clients would upload unprotected; use a model without them "
                              "(e.g. model.norm=group)")
        self.settings = TrainSettings(weight_decay=cfg.train.weight_decay, clip=cfg.train.clip,
                                      batch_size=cfg.train.batch_size, global_lr=cfg.train.global_lr,
                                      num_clients=cfg.data.num_clients, seed=cfg.seed,
                                      layout=self.model.layout, total_samples=int(self.num_samples.sum()),
                                      clip_scope=cfg.train.clip_scope, lr_decay=cfg.train.lr_decay,
                                      dp_sgd=_dp_sgd(cfg, self.traits, module),
                                      optimizer=optimizer_of(cfg.train),
                                      loss=loss,
                                      buffers=layout if layout.size else None,
                                      batch_norms=tuple(n for n, m in module.named_modules()
                                                        if isinstance(m, nn.modules.batchnorm._BatchNorm)))
        check_recipe(self.algorithm.parts, cfg.algo["name"], self.settings.optimizer, cfg.train.schedule)
        personalization = self.algorithm.parts["personalization"]
        try:  # clients keep private parameters (FedPer): evaluation is then per client (evaluate_personalized)
            self.personalized = personalization.private(self.settings) is not None
            # ... and private buffer entries (FedBN's statistics), kept per client in the store
            self.private_buffers = personalization.private_buffers(self.settings) if layout.size else None
        except AlgorithmError as err:  # e.g. more private layers than the model has
            raise ConfigError(str(err)) from None
        self.personal_evaluation: Callable[[torch.Tensor], ClientScores] | None = None  # set by a federation
        # eval.metrics (torchmetrics), and their values at the last evaluate() ({} without any)
        self.metric_set = MetricSet(cfg.eval.metrics, dataset.num_classes, self.device) if cfg.eval.metrics else None
        self.eval_metrics: dict[str, float] = {}
        self.w = self.model.initial.clone()
        self.buffers = self.model.initial_buffers.clone()  # b^t: the global model's buffers ([0] without any)
        self.server: dict[str, torch.Tensor] = self.algorithm.initial_server_state(self.w, self.settings)
        self.store = ClientStore(self.model.layout.size, self.device, memory_mb=cfg.store.memory_mb,
                                 directory=cfg.store.dir,
                                 widths={BUFFERS: (layout.size, torch.float64), **state_widths(self.settings.optimizer)})
        self.batches = ClientBatches(self.dataset.x_train, self.dataset.y_train, self.client_indices,
                                     cfg.train.batch_size, cfg.seed, augmentation_fn(dataset.augmentation),
                                     dataset.standardize)
        self.runtime = ClientRuntime(self.algorithm, self.model, self.batches, self.settings, self.engine,
                                     cfg.chunk_size, cfg.precision, cfg.channels_last, self.traits)
        self.oracle = self.runtime.oracle  # the driver's own gradient oracle (diagnostics use it too)
        self.model_fn = model_fn
        self.executor = {"local": lambda: LocalExecutor(self.runtime), "threads": self._thread_executor,
                         "ray": self._ray_executor}[cfg.executor.name]()
        self.backprops = 0  # backward passes of every client's local training so far
        # the last round whose aggregation used each client's upload (-1: none yet)
        self.aggregated_round = torch.full((cfg.data.num_clients,), -1, dtype=torch.long)
        self.last_round: RoundResult | None = None  # set in the commit: an interrupt right after it loses nothing
        self.privacy = PrivacyLedger.of(cfg, self.num_samples.cpu(), self.algorithm.backprops_per_step)

    def _check_loss(self, loss: LossFn | None) -> None:
        """The run's loss (``loss_fn`` or ``train.loss``) on the model's logits of a few training samples, before
        round 0: one loss per sample, or a one-line error (:func:`fedflat.engine.losses.check_loss`)."""
        if loss is None:
            return
        x = self._probe_inputs()
        with torch.no_grad():
            logits = self.model(self.model.initial, x, self.model.initial_buffers)
        check_loss(loss, logits, self.dataset.y_train[:x.shape[0]])

    def thread_counts(self) -> dict[str, int | None]:
        """The torch threads a run's bits depend on: ``server`` (this process: aggregation, evaluation) and
        ``clients`` (the local training, or each Ray worker's; None: the worker's own default)."""
        server = torch.get_num_threads()
        spec = getattr(self.executor, "spec", None)
        return {"server": server, "clients": spec.threads if spec is not None else server}

    def _probe_inputs(self, count: int = 4) -> torch.Tensor:
        """The first ``count`` training inputs (features applied): what the up-front checks run the model on."""
        return self.dataset.features(self.dataset.x_train[:count])

    def _inspect(self):
        """The model's :class:`~fedflat.engine.modes.ModelTraits`, checked before round 0 (a forward pass in each
        mode on a few training samples): what fedflat cannot train correctly is a ConfigError saying why."""
        try:
            return inspect_module(self.model, self._probe_inputs())
        except (RuntimeError, ValueError, TypeError, IndexError) as err:
            raise ConfigError(f"model {module_name(self.model.module)}: its forward pass in train() mode on "
                              f"{min(4, len(self.dataset.y_train))} training samples fails: {err}") from None

    def worker_spec(self, **options):
        """What a Ray or thread worker needs to build this run's client runtime (:class:`WorkerSpec`; ``options``
        override its fields)."""
        from fedflat.engine.ray_executor import default_cpus

        cfg, ex = self.cfg, self.cfg.executor
        threads = choose_threads(cfg.threads, self.step_flops, cores=ex.cpus_per_worker or default_cpus(ex.workers))
        spec = WorkerSpec(algo=dict(cfg.algo), model=dict(cfg.model), model_fn=self.model_fn,
                          input_shape=self.dataset.input_shape, num_classes=self.dataset.num_classes,
                          settings=self.settings, chunk_size=cfg.chunk_size, threads=threads,
                          engine="sequential" if self.vmap_problem else cfg.engine,
                          traits=self.traits,
                          augmentation=self.dataset.augmentation, use_gpu=ex.gpus_per_worker > 0,
                          tf32=cfg.tf32, precision=cfg.precision, channels_last=cfg.channels_last,
                          step_flops=self.step_flops, standardize=self.dataset.standardize,
                          plugins=tuple(cfg.plugins), stages=tuple(self.stage_specs))
        return replace(spec, **options)

    def worker_data(self) -> tuple:
        """The training data every worker holds: ``(x_train, y_train, client indices)`` as NumPy arrays."""
        return self.dataset.x_train.cpu().numpy(), self.dataset.y_train.cpu().numpy(), self.client_indices_np

    def _thread_executor(self) -> ThreadExecutor:
        """``executor.workers`` threads: the driver's runtime and runtimes built again from the run's spec (their
        models drawn on a forked generator: the driver's random streams are untouched), sharing its data."""
        if self.traits.random is not None:
            raise ConfigError(f"executor=threads: model {module_name(self.model.module)} draws random numbers "
                              f"({self.traits.random}) from PyTorch's global generator, which threads would share; "
                              "use executor=local or executor=ray")
        spec = self.worker_spec(threads=self.threads, engine=self.engine)
        with torch.random.fork_rng(devices=[]):
            others = [build_client_runtime(spec, self.batches, self.device) for _ in range(self.cfg.executor.workers - 1)]
        return ThreadExecutor([self.runtime, *others])

    def _ray_executor(self):
        """Ray workers that each hold the training data (sent once) and build the same model and engine."""
        from fedflat.engine.ray_executor import RayExecutor

        return RayExecutor(self.worker_spec(), self.worker_data(), self.cfg.executor)

    def close(self) -> None:
        """Releases the executor's workers (a no-op for the local executor)."""
        self.executor.close()

    @property
    def heldout(self) -> str:
        """The prefix of the evaluation's metrics: ``test``, or ``val`` when ``data.validation`` held out part of
        the training set (the test set is then never evaluated)."""
        return "val" if self.dataset.heldout == "validation" else "test"

    @property
    def num_parameters(self) -> int:
        return self.model.layout.size

    def sample_clients(self, round: int) -> torch.Tensor:
        """Round ``t``'s clients: ``K`` uniformly without replacement, or Bernoulli(K/N) participation
        (at least one client, as FL-Simulator)."""
        N, K = self.cfg.data.num_clients, self.cfg.sampling.clients_per_round
        rng = numpy_stream(self.cfg.seed, round, SERVER, "sampling")
        if self.cfg.sampling.participation == "bernoulli":
            chosen = (rng.random(N) < K / N).nonzero()[0]
            if len(chosen) == 0 and self.privacy is None:  # (under DP, Poisson sampling as the accountant assumes)
                chosen = rng.choice(N, 1)
        else:
            chosen = rng.choice(N, K, replace=False)
        return torch.as_tensor(sorted(chosen.tolist()), dtype=torch.long)

    def lr_at(self, round: int) -> float:
        """``eta_l^t`` (:func:`fedflat.engine.optim.round_lr`: ``train.schedule`` after ``train.warmup_rounds``)."""
        return round_lr(self.cfg.train, round, self.cfg.rounds)

    def chunk_size(self, K: int) -> int:
        """Clients trained together by the local executor (see :meth:`ClientRuntime.chunk_size`)."""
        return self.runtime.chunk_size(K)

    def new_context(self, round: int) -> RoundContext:
        sampled = self.sample_clients(round)
        n = self.num_samples[sampled.to(self.device)]
        t = self.cfg.train
        steps = torch.tensor([local_steps(int(ni), t.batch_size, t.local_epochs, t.local_steps) for ni in n.tolist()],
                             device=self.device)
        held, held_known = self.load_state(sampled, self.algorithm.held_keys())
        return RoundContext(round=round, lr=self.lr_at(round), w=self.w, sampled=sampled.to(self.device),
                            num_samples=n, steps=steps, server=dict(self.server), settings=self.settings,
                            held=held, held_known=held_known)

    def client_state_keys(self) -> list[str]:
        """Names of the state each client keeps: its parts', and its own buffers where some are private (FedBN)."""
        return (self.algorithm.state_keys() + ([BUFFERS] if self.private_buffers is not None else [])
                + state_keys(self.settings.optimizer))

    def load_state(self, ids: torch.Tensor, names: list[str] | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The state rows of the clients ``ids`` (zeros and ``known = False`` before their first round):
        by default those the clients keep; ``names`` for others (the ones the server holds)."""
        state, known = {}, {}
        for name in self.client_state_keys() if names is None else names:
            state[name], known[name] = self.store.get(name, ids)
        return state, known

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

    def configure(self, ctx: RoundContext) -> Broadcast:
        """The round's broadcast (:meth:`Algorithm.configure`) with the global model's buffers ``b^t``."""
        broadcast = self.algorithm.configure(ctx)
        broadcast.buffers = self.buffers if self.model.buffer_layout.size else None
        return broadcast

    def run_round(self, round: int) -> RoundResult:
        """One communication round on the executor; updates ``self.w``, the server state and the store."""
        opened = self.begin_round(round)
        if not len(opened.task):  # Poisson sampling under DP drew nobody: nothing is trained or released
            return self.finish_round(opened, None)
        return self.finish_round(opened, self.executor.fit(opened.broadcast, opened.task, self.load_state))

    def finish_round(self, opened: OpenRound, result: ClientResult) -> RoundResult:
        """Aggregation, server update and commit of an open round (Flower's ``aggregate_train``).

        ``result`` holds the clients that answered, in ascending id order: all sampled clients, or (a
        federation whose nodes failed or timed out) a subset, which the round aggregates as if only they
        had been sampled; the round's ``dropped`` count says how many were not. A round is a transaction:
        the parts work on a copy of the server state, and the new model, server state and client state
        are committed together at the end; an exception or an interrupt before that leaves the simulation
        exactly at the previous round."""
        ctx, broadcast, round = opened.ctx, opened.broadcast, opened.ctx.round
        if result is None:
            return self._empty_round(opened)
        dropped = sorted(set(ctx.sampled.tolist()) - set(result.ids.tolist()))
        if dropped:
            if not len(result.ids):
                raise NoClients(f"round {round + 1}: none of the {ctx.K} sampled clients answered")
            ctx = ctx.answered(result.ids.to(ctx.sampled.device))
        result = result.to(self.device)
        # NaN/Inf or (validation.max_norm) too large: rejected with a warning naming the client, or the run fails
        ctx, result, rejected = checked(self.algorithm, ctx, result, self.cfg.validation)
        if rejected:
            ctx.log["rejected"] = float(len(rejected))
        w_new = self.algorithm.aggregate(ctx, result)
        if not all_finite(w_new):
            raise Diverged(f"round {round + 1}: the global model became non-finite")
        b_new = self.aggregate_buffers(ctx, result)
        P, buffer_bytes = self.num_parameters, self.model.buffer_layout.nbytes  # buffers: at their own dtypes' size
        down_vectors, down_bytes = payload_size(broadcast.shared(), P, broadcast.personal)
        up_vectors, up_bytes = payload_size({}, P, {k: v for k, v in result.upload.items() if k != BUFFERS})
        down_bytes, up_bytes = down_bytes + buffer_bytes, up_bytes + buffer_bytes
        drift = ctx.deltas.norm(dim=1).mean().item()
        train_loss = ctx.train_loss.mean().item()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        with uninterrupted():  # the commit
            for name, rows in (*result.state.items(), *ctx.held.items()):
                self.store.put(name, result.ids, rows)
            self.server = ctx.server
            self.w = w_new
            self.buffers = b_new
            self.aggregated_round[result.ids.cpu()] = round
            self.backprops += result.backprops
            log = dict(ctx.log)
            if self.privacy is not None:
                log.update(self.privacy.spend(round, result.ids.cpu(), ctx.steps.cpu()))
            self.last_round = RoundResult(
                round=round, lr=ctx.lr, train_loss=train_loss, drift=drift, clients=ctx.K,
                seconds=time.perf_counter() - opened.start,
                backprops_per_step=result.backprops / ctx.steps.sum().item(), store=self.store.count(),
                up_vectors=up_vectors, down_vectors=down_vectors, up_bytes=up_bytes, down_bytes=down_bytes,
                dropped=dropped, log=log, rejected={str(c): why for c, why in rejected.items()})
        return self.last_round

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

    def model_state(self) -> dict[str, torch.Tensor]:
        """The global model as a state dict of the user's module (parameters and buffers): ``model.pt``, which a
        fresh instance loads with ``load_state_dict(strict=True)``."""
        return self.model.state_dict(self.w, self.buffers)

    def state_dict(self) -> dict:
        """Everything that evolves across rounds: the global model and its buffers, server state, client-state
        store. (Random streams are keyed by round, so no generator state needs saving.)"""
        return {"w": self.w.detach().cpu().clone(), "buffers": self.buffers.detach().cpu().clone(),
                "server": {k: v.detach().cpu().clone() for k, v in self.server.items()},
                "store": self.store.state_dict(), "aggregated_round": self.aggregated_round.clone(),
                **({"privacy": self.privacy.state_dict()} if self.privacy is not None else {})}

    def load_state_dict(self, state: dict) -> None:
        self.w = state["w"].to(self.device)
        if "buffers" in state:  # (checkpoints before buffers were federated lack it: their models had none)
            self.buffers = state["buffers"].to(self.device)
        self.server.clear()
        self.server.update({k: v.to(self.device) for k, v in renamed_state(state["server"]).items()})
        self.store.load_state_dict(renamed_state(state["store"]))
        if "aggregated_round" in state:  # (checkpoints before fedflat 0.x's Flower layer lack it)
            self.aggregated_round = state["aggregated_round"].clone()
        if self.privacy is not None and "privacy" in state:
            self.privacy.load_state_dict(state["privacy"])

    @functools.cached_property
    def client_tests(self) -> list[torch.Tensor]:
        """Each client's share of the held-out set (:func:`fedflat.data.client_test_split`: its owner's
        samples under LEAF's natural split, otherwise a share following its label distribution)."""
        data = self.dataset
        shares = client_test_split(data.y_train.cpu().numpy(), self.client_indices_np, data.y_test.cpu().numpy(),
                                   stream_seed(self.cfg.seed, -1, SERVER, "test_split"),
                                   train_owners=data.owners, test_owners=data.test_owners)
        return [torch.as_tensor(ix, dtype=torch.long, device=self.device) for ix in shares]

    @torch.no_grad()
    def evaluate(self, w: torch.Tensor | None = None) -> tuple[float, float]:
        """``(accuracy, mean loss)`` of ``w`` (default: the global model) on the held-out set; without ``w`` a
        personalized run evaluates its clients' own models instead (:meth:`evaluate_personalized`). The
        ``eval.metrics`` of the same predictions are left in :attr:`eval_metrics` (``{}`` without any)."""
        personalized = w is None and self.personalized
        collect = self.metric_set
        if collect is not None:
            collect.reset()
        if personalized:
            acc, loss = self.evaluate_personalized(collect)
        else:
            correct, total = self._scores(self.w if w is None else w, self.dataset.x_test, self.dataset.y_test,
                                          self.buffers, collect)
            count = self.dataset.x_test.shape[0]
            acc, loss = correct.item() / count, total.item() / count
        # a federation's personal scores come from its nodes, without the predictions torchmetrics needs
        pooled = collect is not None and not (personalized and self.personal_evaluation is not None)
        self.eval_metrics = collect.compute() if pooled else {}
        return acc, loss

    @torch.no_grad()
    def evaluate_personalized(self, collect: MetricSet | None = None) -> tuple[float, float]:
        """FedPer's evaluation: every client's model (the global model with its private entries; the global
        model's where it has not trained yet) on its own test share, pooled: ``(accuracy, mean loss)`` over all
        the test samples some client holds, i.e. the clients' accuracies weighted by their test shares. A
        federation sets :attr:`personal_evaluation`: the private entries never leave its nodes, which score
        their clients (:meth:`personal_scores`) for it. ``collect`` gathers the pooled predictions' ``eval.metrics``
        (in this process only)."""
        if self.personal_evaluation is not None:
            scores = self.personal_evaluation(self.w)
        else:
            scores = self.personal_scores(self.w, list(range(self.cfg.data.num_clients)), self.load_state,
                                          collect=collect)
        return pooled_accuracy(scores)

    @torch.no_grad()
    def personal_scores(self, w: torch.Tensor, clients: list[int], load_state: Callable[..., Any],
                        buffers: torch.Tensor | None = None, collect: MetricSet | None = None) -> ClientScores:
        """Each of ``clients`` (those with a test share) scored with its own model — ``w`` with its private
        entries, from ``load_state(ids, names)``, and the global buffers ``buffers`` (default ``b^t``) with its
        private ones (FedBN) — on its own test share, a few client models at a time."""
        shares, personalization = self.client_tests, self.algorithm.parts["personalization"]
        b = (self.buffers if buffers is None else buffers).to(self.device)
        tested = [c for c in clients if shares[c].numel()]
        correct, loss = [], []
        per_chunk = max(1, PERSONAL_EVAL_ENTRIES // self.num_parameters)  # client models held at once
        names = list(personalization.kept()) + ([BUFFERS] if self.private_buffers is not None else [])
        for lo in range(0, len(tested), per_chunk):
            ids = torch.tensor(tested[lo:lo + per_chunk], dtype=torch.long)
            state, known = load_state(ids, names)
            state = {k: v.to(self.device) for k, v in state.items()}
            models = personalization.models(w.to(self.device), state, known, self.settings)
            own = own_buffers(b, self.private_buffers, state, known, len(ids))
            for row, client in enumerate(ids.tolist()):
                share = shares[client]
                c, l = self._scores(models[row], self.dataset.x_test[share], self.dataset.y_test[share], own[row],
                                    collect)
                correct.append(c)
                loss.append(l)
        if not tested:
            return ClientScores([], [], [], [])
        # one host copy for all clients (each score is a device scalar: no synchronisation per client)
        return ClientScores(tested, torch.stack(correct).tolist(), torch.stack(loss).tolist(),
                            [int(shares[c].numel()) for c in tested])

    @torch.no_grad()
    def backdoor_accuracy(self) -> float | None:
        """Under ``attack: backdoor``: the fraction of held-out samples not of the target class that the global model
        classifies as the target once the trigger is stamped on them (:mod:`fedflat.algorithms.attacks`); else None."""
        attack = backdoor_of(self.algorithm.stages)
        if attack is None:
            return None
        keep = self.dataset.y_test != attack.p.target
        x, size = self.dataset.x_test[keep], int(keep.sum())
        hits = torch.zeros((), dtype=torch.long, device=x.device)
        for lo in range(0, size, self.cfg.eval.batch_size):
            logits = self.model(self.w, attack.trigger(self.dataset.features(x[lo:lo + self.cfg.eval.batch_size])),
                                self.buffers)
            hits += (logits.argmax(1) == attack.p.target).sum()
        return hits.item() / max(size, 1)

    def _scores(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, buffers: torch.Tensor,
                collect: MetricSet | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Correct predictions and summed loss (``train.loss``; cross-entropy by default) of the model ``(w, buffers)`` on ``(x, y)`` in ``eval()``
        mode, on the device (no sync); ``collect`` (the ``eval.metrics``) is updated with every batch."""
        correct = torch.zeros((), dtype=torch.long, device=x.device)
        loss = torch.zeros((), dtype=torch.float64, device=x.device)
        for lo in range(0, x.shape[0], self.cfg.eval.batch_size):
            logits = self.model(w, self.dataset.features(x[lo:lo + self.cfg.eval.batch_size]), buffers)
            target = y[lo:lo + self.cfg.eval.batch_size]
            loss += summed_loss(self.settings.loss, logits, target).double()
            correct += (logits.argmax(1) == target).sum()
            if collect is not None:
                collect.update(logits, target)
        return correct, loss
