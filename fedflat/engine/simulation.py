"""The round loop in one process: a thin composition of the run's pieces.

:class:`Simulation` builds the problem (:func:`fedflat.engine.problem.build_problem`: data and split), the model
and its one report (:func:`fedflat.engine.problem.inspect_model`), the algorithm (once, from the config's typed
``algo`` spec), the :class:`~fedflat.engine.server.Server` (global model, buffers, server state, client-state store)
and the executor (:func:`make_executor`: local, threads or Ray). A round
(:meth:`Simulation.run_round`) is the server's :meth:`~fedflat.engine.server.Server.begin_round`, the executor's
``fit`` of the sampled clients, and the server's :meth:`~fedflat.engine.server.Server.finish_round`; the Flower
strategy (:mod:`fedflat.flower.server`) drives the same server with its nodes in place of the executor.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import torch

from fedflat import plugins
from fedflat.algorithms import Algorithm, AlgorithmError
from fedflat.algorithms.attacks import backdoor_of, for_dataset
from fedflat.config import Config, ExecutorConfig
from fedflat.core import BUFFERS, SERVER, Broadcast, ClientResult, ConfigError, TrainSettings, stream_seed
from fedflat.data import augmentation_fn, client_test_split
from fedflat.engine.client import ClientBatches, own_buffers
from fedflat.engine.compute import ComputeOptions
from fedflat.engine.inputs import UserInputs
from fedflat.engine.losses import summed_loss
from fedflat.engine.optim import check_recipe
from fedflat.engine.problem import build_module, build_problem, configured_loss, inspect_model, train_settings
from fedflat.engine.modes import module_name
from fedflat.engine.ray_executor import RayExecutor
from fedflat.engine.runtime import (ClientRuntime, LocalExecutor, RoundTask, StateLoader, ThreadExecutor, WorkerSpec,
                                    build_client_runtime, set_tf32)
from fedflat.engine.scores import MetricSet
from fedflat.engine.server import OpenRound, RoundResult, Server, all_finite, uninterrupted
from fedflat.engine.cores import choose_threads, default_cpus, retain_freed_memory
from fedflat.params import FlatModel

__all__ = ["ClientScores", "OpenRound", "RoundResult", "Server", "Simulation", "UserInputs", "all_finite",
           "pooled_accuracy", "resolve_device", "uninterrupted"]

NO_INPUTS = UserInputs()  # the config's data, model, split and loss
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


def prepare_process(cfg: Config) -> torch.device:
    """This process made ready for the run: the config's plugins imported (a config that crossed into another
    process, a Flower node, names them), TF32 set for its device, freed memory kept for reuse; the run's device."""
    plugins.load(cfg.plugins)
    device = resolve_device(cfg.device)
    set_tf32(device, cfg.tf32)
    retain_freed_memory()
    return device


class Executor(Protocol):
    """Where a round's clients train: :class:`LocalExecutor`, :class:`ThreadExecutor` or
    :class:`fedflat.engine.ray_executor.RayExecutor` (:func:`make_executor`)."""

    name: str

    def fit(self, broadcast: Broadcast, task: RoundTask, load_state: StateLoader) -> ClientResult: ...

    def close(self) -> None: ...


def make_executor(executor: ExecutorConfig, runtime: ClientRuntime, spec: Callable[..., WorkerSpec],
                  data: Callable[[], tuple]) -> Executor:
    """The run's executor (``executor.name``): ``local`` trains on the driver's ``runtime``; ``threads`` on it and
    ``executor.workers - 1`` runtimes built again from ``spec(...)`` over its data (their models drawn on a forked
    generator: the driver's random streams are untouched); ``ray`` on Ray workers that each build a runtime from
    ``spec()`` and hold ``data()`` (sent once)."""
    if executor.name == "local":
        return LocalExecutor(runtime)
    if executor.name == "threads":
        traits = runtime.oracle.traits
        if traits.random is not None:
            raise ConfigError(f"executor=threads: model {module_name(runtime.model.module)} draws random numbers "
                              f"({traits.random}) from PyTorch's global generator, which threads would share; "
                              "use executor=local or executor=ray")
        # threads=None: the driver's own torch threads, already set, are the ones the thread workers share
        worker = spec(compute=replace(runtime.options, threads=None))
        with torch.random.fork_rng(devices=[]):
            others = [build_client_runtime(worker, runtime.batches, runtime.device, base=runtime.model)
                      for _ in range(executor.workers - 1)]
        return ThreadExecutor([runtime, *others])
    return RayExecutor(spec(), data(), executor)


def personal_layout(algorithm: Algorithm, settings: TrainSettings) -> tuple[bool, torch.Tensor | None]:
    """Whether clients keep private parameters (FedPer: evaluation is then per client), and the mask of the private
    buffer entries they keep in the store (FedBN's statistics; None: none)."""
    personalization = algorithm.parts["personalization"]
    try:
        personalized = personalization.private(settings) is not None
        return personalized, personalization.private_buffers(settings) if settings.buffers is not None else None
    except AlgorithmError as err:  # e.g. more private layers than the model has
        raise ConfigError(str(err)) from None


class Simulation:
    """One federated experiment in memory: the problem, the model, the algorithm, the :class:`Server` and an
    executor, composed (the module docstring).

    ``inputs``: what a Python user brings in place of the config's data, model, split or loss
    (:class:`~fedflat.engine.inputs.UserInputs`). The global model, its buffers, the server state (``server.state``),
    the client store and the privacy ledger are the :class:`Server`'s (``sim.server``).
    """

    def __init__(self, cfg: Config, inputs: UserInputs = NO_INPUTS):
        self.cfg, self.inputs = cfg, inputs
        self.compute = ComputeOptions.of(cfg)
        self.device = prepare_process(cfg)
        self.problem = build_problem(cfg, self.device, inputs.dataset, inputs.clients)
        self.dataset, self.client_indices_np = self.problem.dataset, self.problem.client_indices_np
        self.client_indices, self.num_samples = self.problem.client_indices, self.problem.num_samples
        self.model = FlatModel(build_module(cfg, self.dataset, inputs.model_fn).to(self.device))
        loss = inputs.loss_fn if inputs.loss_fn is not None else configured_loss(cfg.train)
        self.report = inspect_model(cfg, self.problem, self.model, loss)
        if self.report.threads:
            torch.set_num_threads(self.report.threads)
        self.settings = train_settings(cfg, self.problem, self.model, self.report, loss)
        self.algorithm = self.build_algorithm()
        self.personalized, self.private_buffers = personal_layout(self.algorithm, self.settings)
        self.server = Server(cfg, self.algorithm, self.model, self.settings, self.num_samples, self.private_buffers)
        self.runtime = self.client_runtime()
        self.oracle = self.runtime.oracle  # the driver's own gradient oracle (diagnostics use it too)
        self.executor = make_executor(cfg.executor, self.runtime, self.worker_spec, self.worker_data)
        self.personal_evaluation: Callable[[torch.Tensor], ClientScores] | None = None  # set by a federation
        self.metric_set = (MetricSet(cfg.eval.metrics, self.dataset.num_classes, self.device) if cfg.eval.metrics
                           else None)
        self.eval_metrics: dict[str, float] = {}  # eval.metrics at the last evaluate() ({} without any)

    def build_algorithm(self) -> Algorithm:
        """The run's algorithm: the config's method (its parts built once in this process, when the config was
        loaded: :meth:`fedflat.config.AlgoSpec.build`) with the upload path's stages (privacy, compression, attacks,
        robust rules; the noise multiplier calibrated once here), checked against the optimizer and schedule."""
        cfg, data = self.cfg, self.dataset
        self.stage_specs = for_dataset(cfg.stage_specs(), data.num_classes, tuple(data.input_shape))
        algorithm = cfg.algo.build(self.stage_specs)
        check_recipe(algorithm.parts, algorithm.name, self.settings.optimizer, cfg.train.schedule)
        return algorithm

    def client_runtime(self) -> ClientRuntime:
        """The driver's own client runtime: the algorithm's parts, the model's oracle and every client's batches."""
        cfg, data = self.cfg, self.dataset
        self.batches = ClientBatches(data.x_train, data.y_train, self.client_indices, cfg.train.batch_size, cfg.seed,
                                     augmentation_fn(data.augmentation), data.standardize)
        return ClientRuntime(self.algorithm, self.model, self.batches, self.settings,
                             replace(self.compute, engine=self.report.engine), self.report.traits)

    def thread_counts(self) -> dict[str, int | None]:
        """The torch threads a run's bits depend on: ``server`` (this process: aggregation, evaluation) and
        ``clients`` (the local training, or each Ray worker's; None: the worker's own default)."""
        server = torch.get_num_threads()
        spec = getattr(self.executor, "spec", None)
        return {"server": server, "clients": spec.compute.threads if spec is not None else server}

    def worker_spec(self, **options) -> WorkerSpec:
        """What a Ray or thread worker needs to build this run's client runtime (:class:`WorkerSpec`; ``options``
        override its fields)."""
        cfg, ex, data = self.cfg, self.cfg.executor, self.dataset
        threads = choose_threads(cfg.threads, self.report.step_flops,
                                 cores=ex.cpus_per_worker or default_cpus(ex.workers))
        compute = replace(self.compute, threads=threads,
                          engine="sequential" if self.report.vmap_problem else self.compute.engine)
        spec = WorkerSpec(algo=cfg.algo.section(), model=dict(cfg.model), model_fn=self.inputs.model_fn,
                          input_shape=data.input_shape, num_classes=data.num_classes, settings=self.settings,
                          compute=compute, traits=self.report.traits, augmentation=data.augmentation,
                          use_gpu=ex.gpus_per_worker > 0, step_flops=self.report.step_flops,
                          standardize=data.standardize, plugins=tuple(cfg.plugins), stages=tuple(self.stage_specs),
                          seed=cfg.seed, adapter=cfg.adapter.model_dump() if cfg.adapter else None,
                          base_hash=self.report.base_hash)
        return replace(spec, **options)

    def worker_data(self) -> tuple:
        """The training data every worker holds: ``(x_train, y_train, client indices)`` as NumPy arrays."""
        return self.dataset.x_train.cpu().numpy(), self.dataset.y_train.cpu().numpy(), self.client_indices_np

    def close(self) -> None:
        """Releases the executor's workers (a no-op for the local executor)."""
        self.executor.close()

    @property
    def heldout(self) -> str:
        """The prefix of the evaluation's metrics: ``test``, or ``val`` when ``data.validation`` held out part of
        the training set (the test set is then never evaluated)."""
        return "val" if self.dataset.heldout == "validation" else "test"

    @contextlib.contextmanager
    def on_test_split(self):
        """Within it, :meth:`evaluate` scores on the test split: for a run that selected on ``data.validation``, the
        test accuracy of the model it selected (the number a paper reports); the training data and split are
        untouched. A run that evaluates on the test split all along is left as it is."""
        if self.problem.test_split is None:
            yield
            return
        saved, tests = self.dataset, self.__dict__.pop("client_tests", None)
        x, y, owners = self.problem.test_split
        self.dataset = replace(saved, x_test=x.to(saved.x_test.device), y_test=y.to(saved.y_test.device),
                               test_owners=owners, heldout="test")
        try:
            yield
        finally:
            self.dataset = saved
            self.__dict__.pop("client_tests", None)
            if tests is not None:
                self.__dict__["client_tests"] = tests

    @torch.no_grad()
    def evaluate_model(self, w: torch.Tensor, buffers: torch.Tensor) -> tuple[float, float]:
        """``(accuracy, mean loss)`` of the global model ``(w, buffers)`` on the held-out set (the run's state is not
        touched: a kept model, such as ``best_model.pt``'s)."""
        correct, total = self._scores(w.to(self.device), self.dataset.x_test, self.dataset.y_test,
                                      buffers.to(self.device))
        count = self.dataset.x_test.shape[0]
        return correct.item() / count, total.item() / count

    @property
    def num_parameters(self) -> int:
        return self.model.layout.size

    # -- a round: the server's protocol around the executor ----------------------------------------------------------
    def run_round(self, round: int) -> RoundResult:
        """One communication round on the executor; updates ``self.server.w``, the server state and the store."""
        opened = self.server.begin_round(round)
        if not len(opened.task):  # Poisson sampling under DP drew nobody: nothing is trained or released
            return self.server.finish_round(opened, None)
        result = self.executor.fit(opened.broadcast, opened.task, self.server.load_state)
        return self.server.finish_round(opened, result)

    def updates(self, opened: OpenRound, result: ClientResult) -> dict[str, torch.Tensor]:
        """What each client of ``result`` released, as the server receives it before its own stages: the update
        ``Delta_i = w_{i,E} - w^t`` under ``model`` (decoded where compressed; clipped under DP; a malicious
        client's as its attack left it) and the method's other released entries, rows in ``result.ids``' order.
        One meaning under every upload path, unlike ``result.upload["model"]``, which is what travels
        (:class:`~fedflat.core.ClientResult`): docs/extending.md, "Checking a round by hand"."""
        return self.algorithm.path.received_release(opened.ctx, result.upload)

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
            correct, total = self._scores(self.server.w if w is None else w, self.dataset.x_test, self.dataset.y_test,
                                          self.server.buffers, collect)
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
            scores = self.personal_evaluation(self.server.w)
        else:
            scores = self.personal_scores(self.server.w, list(range(self.cfg.data.num_clients)), self.server.load_state,
                                          collect=collect)
        return pooled_accuracy(scores)

    @torch.no_grad()
    def personal_scores(self, w: torch.Tensor, clients: list[int], load_state: Callable[..., Any],
                        buffers: torch.Tensor | None = None, collect: MetricSet | None = None) -> ClientScores:
        """Each of ``clients`` (those with a test share) scored with its own model — ``w`` with its private
        entries, from ``load_state(ids, names)``, and the global buffers ``buffers`` (default ``b^t``) with its
        private ones (FedBN) — on its own test share, a few client models at a time."""
        shares, personalization = self.client_tests, self.algorithm.parts["personalization"]
        b = (self.server.buffers if buffers is None else buffers).to(self.device)
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
        attack = backdoor_of(self.algorithm.path.stages)
        if attack is None:
            return None
        keep = self.dataset.y_test != attack.p.target
        x, size = self.dataset.x_test[keep], int(keep.sum())
        hits = torch.zeros((), dtype=torch.long, device=x.device)
        for lo in range(0, size, self.cfg.eval.batch_size):
            x_b = attack.trigger(self.dataset.features(x[lo:lo + self.cfg.eval.batch_size]))
            logits = self.model(self.server.w, x_b, self.server.buffers)
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
