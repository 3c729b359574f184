"""The problem a run trains, built once in the driver: the data and its split into clients (:func:`build_problem`),
the model (:func:`build_module`, the one place the driver calls a user's ``model_fn``), the loss the config names
(:func:`configured_loss`), and what the engines must know about the model, found by probing it once before round 0
(:func:`inspect_model`, a :class:`ModelReport`).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedflat.config import Config
from fedflat.core import Batch, ConfigError, TrainSettings
from fedflat.data import Dataset, client_split, load_dataset, user_split, validation_split
from fedflat.engine.compute import ComputeOptions
from fedflat.engine.cores import choose_threads, core_share, torch_threads
from fedflat.engine.losses import LossFn, check_loss, focal_loss
from fedflat.engine.modes import ModelTraits, inspect_module, module_name
from fedflat.engine.optim import optimizer_of
from fedflat.engine.client import Oracle
from fedflat.engine.runtime import engine_choice
from fedflat.models import assemble, build_model, frozen_hash
from fedflat.params import FlatModel

PROBE_SAMPLES = 4  # training samples the up-front checks run the model on


@dataclass
class Problem:
    """The run's data on its device and its clients: each client's training-sample indices (NumPy, and as
    tensors on the device) and sample counts ``n_i``."""

    dataset: Dataset
    client_indices_np: list[np.ndarray]
    client_indices: list[torch.Tensor]
    num_samples: torch.Tensor
    # the test split a run that selects on ``data.validation`` never evaluates while it trains: ``(x_test, y_test,
    # test_owners)`` on the CPU, for the test accuracy of the model it selected, at its end
    test_split: tuple[torch.Tensor, torch.Tensor, np.ndarray | None] | None = None

    def probe_inputs(self, count: int = PROBE_SAMPLES) -> torch.Tensor:
        """The first ``count`` training inputs (features applied): what the up-front checks run the model on."""
        return self.dataset.features(self.dataset.x_train[:count])


def build_problem(cfg: Config, device: torch.device, dataset: Dataset | None = None,
                  clients: Sequence[Sequence[int]] | None = None) -> Problem:
    """The config's dataset (or the user's ``dataset``) on ``device``, its validation hold-out
    (``data.validation``) and its split into ``data.num_clients`` clients (``data.partition``, or the user's
    ``clients``: :func:`fedflat.data.user_split`)."""
    if dataset is None:
        # on one thread: torch splits a long reduction (the standardization's mean and std) across its threads,
        # so the data's bits, and every number trained on them, would depend on the process's thread count
        with torch_threads(1):
            dataset = load_dataset(cfg.data.name, root=cfg.data.root, download=cfg.data.download, **cfg.data.options)
    test_split = None
    if cfg.data.validation:
        test_split = (dataset.x_test, dataset.y_test, dataset.test_owners)
        full = dataset.y_train.shape[0]
        dataset, kept = validation_split(dataset, cfg.data.validation)
        if clients is not None:
            clients = _without_heldout(clients, kept, full, cfg.data.num_clients, cfg.data.validation)
    indices = (user_split(clients, dataset.y_train.shape[0], cfg.data.num_clients) if clients is not None else
               client_split(dataset.y_train.cpu().numpy(), cfg.data.num_clients, cfg.data.partition, cfg.seed,
                            dataset.name, owners=dataset.owners))
    return Problem(dataset.to(device), indices,
                   [torch.as_tensor(ix, dtype=torch.long, device=device) for ix in indices],
                   torch.tensor([len(ix) for ix in indices], device=device), test_split)


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


def build_module(cfg: Config, dataset: Dataset, model_fn: Callable[[], nn.Module] | None = None) -> nn.Module:
    """The run's ``nn.Module``, its initialization drawn from the server's keyed stream ``(seed, -1, server,
    init)``: ``model_fn()`` (checked: a module with initialized parameters) or the config's model for the
    dataset's inputs (a model that cannot take them is a clear error), with the config's adapters
    (:func:`fedflat.models.assemble`)."""
    module = assemble(lambda: _user_model(model_fn) if model_fn is not None else _configured_model(cfg, dataset),
                      cfg.seed, cfg.adapter)
    if not any(p.requires_grad for p in module.parameters()):
        raise ConfigError(f"model {module_name(module)}: every parameter is frozen (requires_grad=False), so "
                          "there is nothing to train; unfreeze what the clients train, or set an adapter section")
    return module


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
    options = {k: v for k, v in cfg.model.items() if k != "name"}
    try:
        return build_model(cfg.model["name"], dataset.input_shape, dataset.num_classes, **options)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"model={cfg.model['name']} on {dataset.name} (inputs {tuple(dataset.input_shape)}): "
                          f"{err}") from None


def configured_loss(train) -> LossFn | None:
    """The loss a config's ``train`` section names: ``cross_entropy`` (``label_smoothing``: Szegedy et al.'s, as
    ``F.cross_entropy`` computes it) or ``focal`` (``focal_gamma``); None for plain cross-entropy."""
    if train.loss == "focal":
        return partial(focal_loss, gamma=train.focal_gamma)
    if train.label_smoothing:
        return partial(F.cross_entropy, label_smoothing=train.label_smoothing, reduction="none")
    return None


@dataclass
class ModelReport:
    """Everything the run knows about its model from probing it once before round 0: its
    :class:`~fedflat.engine.modes.ModelTraits`, the FLOPs of one local step, the torch threads chosen for it
    (``threads: auto``), why the vectorized engine cannot train it (None: it can), and the engine it trains on."""

    traits: ModelTraits
    step_flops: float
    threads: int | None
    vmap_problem: str | None
    engine: str
    engine_reason: str = ""  # why this engine (engine=auto's measured rule, or the config)
    base_hash: str | None = None  # the frozen parameters' digest (a pretrained base under adapters), or None


def inspect_model(cfg: Config, problem: Problem, model: FlatModel, loss: LossFn | None) -> ModelReport:
    """The model's :class:`ModelReport`: one output per class and its step FLOPs (one sample forward and backward),
    its traits (:func:`~fedflat.engine.modes.inspect_module`), the run's loss on its logits
    (:func:`~fedflat.engine.losses.check_loss`) and, where the vectorized engine may run, one vectorized step
    (:func:`~vmap_problem`). What fedflat cannot train is a ConfigError saying why."""
    flops = _step_flops(cfg, problem, model)
    # docs: fedflat/engine/cores.py; thread workers share this process's intra-op threads, so each its share
    share = core_share() / cfg.executor.workers if cfg.executor.name == "threads" else None
    threads = choose_threads(cfg.threads, flops, cores=share)
    traits = _traits(problem, model)
    engine, why = engine_choice(cfg.engine, model.initial.device, flops, cfg.cuda_graphs, cfg.compile)
    if cfg.engine == "auto" and engine == "streams" and traits.random is not None:
        engine, why = "sequential", f"engine=auto: the model draws random numbers ({traits.random}): one client at a time"
    # a module vmap cannot run: engine=auto trains it sequentially (saying why), engine=vectorized is refused
    may_vectorize = engine == "vectorized" or (cfg.engine == "auto" and cfg.executor.gpus_per_worker > 0)
    _check_loss(problem, model, loss)
    problem_ = vmap_problem(model, traits, problem.probe_inputs(), problem.dataset.y_train, cfg.precision,
                            loss) if may_vectorize else None
    chosen = choose_engine(cfg.engine, engine, problem_, model.module)
    if chosen != engine:
        why = f"engine=auto: the model cannot run under torch.func.vmap ({problem_}): one client at a time"
    return ModelReport(traits, flops, threads, problem_, chosen, why, frozen_hash(model.module))


def _step_flops(cfg: Config, problem: Problem, model: FlatModel) -> float:
    """One sample forward and backward: the first check that the model takes the inputs, then its step FLOPs."""
    data = problem.dataset
    try:
        sample = problem.probe_inputs(1)
        _check_outputs(model, sample, data)
        return step_flops(model, model.initial, sample, data.y_train, cfg.train.batch_size)
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise ConfigError(f"the model does not accept {data.name}'s inputs of shape {tuple(data.input_shape)} with "
                          f"{data.num_classes} classes: {err}") from None


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


def _traits(problem: Problem, model: FlatModel) -> ModelTraits:
    """The model's traits from a forward pass in each mode on a few training samples."""
    try:
        return inspect_module(model, problem.probe_inputs())
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise ConfigError(f"model {module_name(model.module)}: its forward pass in train() mode on "
                          f"{min(PROBE_SAMPLES, len(problem.dataset.y_train))} training samples fails: {err}") from None


def _check_loss(problem: Problem, model: FlatModel, loss: LossFn | None) -> None:
    """The run's loss on the model's logits of a few training samples: one loss per sample, or a one-line error."""
    if loss is None:
        return
    x = problem.probe_inputs()
    with torch.no_grad():
        logits = model(model.initial, x, model.initial_buffers)
    check_loss(loss, logits, problem.dataset.y_train[:x.shape[0]])


def train_settings(cfg: Config, problem: Problem, model: FlatModel, report: ModelReport,
                   loss: LossFn | None) -> TrainSettings:
    """The settings every part and client reads (:class:`fedflat.core.TrainSettings`), from the config, the
    problem and the model's report; a model with buffers under DP, or DP-SGD on a model that draws random
    numbers, is refused."""
    layout, module = model.buffer_layout, model.module
    if cfg.privacy is not None and layout.size:
        raise ConfigError(f"privacy: model {module_name(module)} has buffers ({', '.join(layout.names[:3])}...), "
                          "data statistics its clients would upload unprotected; use a model without them "
                          "(e.g. model.norm=group)")
    t = cfg.train
    return TrainSettings(weight_decay=t.weight_decay, clip=t.clip, batch_size=t.batch_size, global_lr=t.global_lr,
                         num_clients=cfg.data.num_clients, seed=cfg.seed, layout=model.layout,
                         total_samples=int(problem.num_samples.sum()), clip_scope=t.clip_scope,
                         lr_decay=t.lr_decay, dp_sgd=_dp_sgd(cfg, report.traits, module),
                         optimizer=optimizer_of(t), loss=loss, rounds=cfg.rounds,
                         buffers=layout if layout.size else None,
                         batch_norms=tuple(n for n, m in module.named_modules()
                                           if isinstance(m, nn.modules.batchnorm._BatchNorm)))


def _dp_sgd(cfg: Config, traits: ModelTraits, module: nn.Module) -> tuple[float, float] | None:
    """``(C, z)`` of DP-SGD for ``privacy.level: instance`` (None otherwise); a model whose forward draws random
    numbers (dropout) is refused: per-example gradients need the same forward for every example's copy."""
    p = cfg.privacy
    if p is None or p.level != "instance":
        return None
    if traits.random is not None or traits.dropout or traits.mixes:
        raise ConfigError(f"privacy.level=instance: model {module_name(module)} draws random numbers in its forward "
                          "(dropout) or mixes the samples of a batch (batch statistics); DP-SGD's per-example "
                          "gradients need neither: set its dropout to 0 (adapter.dropout=0 under LoRA), use GroupNorm")
    return (p.clip, p.noise_multiplier)


# -- the probes of the model's report ----------------------------------------------------------------------------
def step_flops(model: FlatModel, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> float:
    """FLOPs of one local step (forward and backward of a batch of ``batch_size``), counted on one sample
    with ``FlopCounterMode`` and scaled (the work of every layer is linear in the batch); in ``eval()`` mode, where
    BatchNorm takes one sample."""
    from torch.utils.flop_counter import FlopCounterMode

    model.module.eval()
    model.bind_buffers(model.buffer_layout.tensors(model.initial_buffers))
    views = [v.detach().requires_grad_(True) for v in model.layout.views(w)]
    with FlopCounterMode(display=False) as counter:
        loss = torch.nn.functional.cross_entropy(model.call_views(views, x[:1]), y[:1])
        torch.autograd.grad(loss, views, allow_unused=True)  # eval mode may skip a train-only branch
    return counter.get_total_flops() * batch_size


def vmap_problem(model: FlatModel, traits: ModelTraits, x: torch.Tensor, y: torch.Tensor,
                 precision: str = "float32", loss=None) -> str | None:
    """Why the vectorized engine cannot train ``model`` (one line), or None: one vectorized step of two clients on
    two samples ``x[:2]`` is tried (data-dependent control flow, in-place writes into tensors vmap cannot batch and
    other unsupported operations fail there), leaving the model, its buffers and every generator as they were."""
    if traits.random is not None:
        return (f"its forward draws random numbers ({traits.random}) outside PyTorch's dropout functions, which the "
                "vectorized engine cannot draw per client")
    options = ComputeOptions(engine="vectorized", precision=precision)
    problem = _vmap_step(Oracle(model, options, traits), model, x, y)
    if problem is None and loss is not None:  # the model runs: then the user's loss_fn is what vmap refuses
        problem = _vmap_step(Oracle(model, options, traits, loss), model, x, y)
        return None if problem is None else f"with its loss_fn: {problem}"
    return problem


def _vmap_step(oracle: Oracle, model: FlatModel, x: torch.Tensor, y: torch.Tensor) -> str | None:
    """The error of one vectorized step of ``oracle`` on two clients (one line), or None."""
    batch = Batch(torch.stack([x[:2], x[:2]]), torch.stack([y[:2], y[:2]]))
    buffers = model.initial_buffers.expand(2, -1) if model.buffer_layout.size else None
    try:
        with torch.random.fork_rng(devices=[]), oracle.clients([0, 1], 0, 0, buffers) as session:
            if session is not None:
                session.step(None)
            oracle.loss_grad(model.initial.expand(2, -1).clone(), batch)
    except Exception as err:  # noqa: BLE001 - whatever vmap refuses is the reason, said in one line
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        return f"{type(err).__name__}: {text[:240]}"
    return None


def choose_engine(requested: str, resolved: str, problem: str | None, module: torch.nn.Module) -> str:
    """The engine for a module the vectorized engine cannot train (``problem``, :func:`vmap_problem`): an explicit
    ``engine=vectorized`` is a ``ConfigError`` naming the module and the reason; ``engine=auto`` trains it on the
    sequential engine, with a warning that says why (once, when the run starts)."""
    if problem is None:
        return resolved
    message = f"model {module_name(module)} cannot run under torch.func.vmap ({problem})"
    if requested == "vectorized":
        raise ConfigError(f"engine=vectorized: {message}; use engine=sequential or engine=auto")
    if requested == "auto":
        warnings.warn(f"engine=auto: {message}: its clients train on the sequential engine", stacklevel=3)
    return "sequential"
