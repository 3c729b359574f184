"""A user's module as fedflat trains it: dropout from the client's keyed stream, and what is checked up front.

**Dropout.** While a client trains, every call of PyTorch's dropout functions (``F.dropout``, ``dropout1d/2d/3d``,
``alpha_dropout``, ``feature_alpha_dropout``; ``nn.Dropout`` and its kin call them) is intercepted
(:class:`KeyedDropout`, a ``TorchFunctionMode``) and computed from a keep-mask drawn from the client's own stream
``torch_stream(seed, round, client, "dropout")``, mask by mask in call order, with the arithmetic of PyTorch's
kernels (``x * keep / (1 - p)``; the alpha variants' affine correction). The sequential engine draws each mask when
the call comes; the vectorized engine draws the same masks, client by client, before its ``vmap`` call and hands
them in batched (:class:`Replay`): both engines, every chunking and every executor use the same masks.

**The up-front check** (:func:`inspect_module`, before round 0): one forward pass in ``train()`` and one in
``eval()`` mode on a few training samples finds what the engines must know (:class:`ModelTraits`: dropout,
other random operations, samples that see each other through batch statistics, buffers, a gradient the oracle
computes by hand) and refuses, with a one-line reason, what would be silently wrong: a forward that changes the
parameters or a non-persistent buffer, and randomness in ``eval()`` mode.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from fedflat.core import ConfigError

ALPHA = 1.7580993408473766  # SELU's alpha: ATen's alpha dropout constant

# PyTorch's dropout functions and the noise each draws: elementwise, or one value per (sample, channel) (feature)
DROPOUTS: dict[Callable, tuple[str, bool]] = {  # function -> (kind, alpha)
    F.dropout: ("elementwise", False), F.alpha_dropout: ("elementwise", True),
    F.dropout1d: ("feature", False), F.dropout2d: ("feature", False), F.dropout3d: ("feature", False),
    F.feature_alpha_dropout: ("feature", True),
}
_BATCHED_DIM = {F.dropout1d: 3, F.dropout3d: 5}  # the others' inputs are always taken as batched
_SIGNATURES = {f: inspect.signature(f) for f in DROPOUTS}


@dataclass(frozen=True)
class DropoutCall:
    """One dropout call of a forward pass: the keep-mask's ``shape`` and the drop probability ``p``."""

    shape: tuple[int, ...]
    p: float
    alpha: bool


def noise_shape(func: Callable, x: torch.Tensor) -> tuple[int, ...]:
    """The shape of the noise ``func`` draws for ``x`` (ATen's ``make_feature_noise`` for the feature variants:
    one value per sample and channel; ``dropout1d/3d`` add a batch dimension to an unbatched input first)."""
    kind, _ = DROPOUTS[func]
    if kind == "elementwise":
        return tuple(x.shape)
    if x.dim() == _BATCHED_DIM.get(func, -1) - 1:  # unbatched: the channel is the first dimension
        return (x.shape[0],) + (1,) * (x.dim() - 1)
    return (x.shape[0], x.shape[1]) + (1,) * (x.dim() - 2)


def apply_dropout(call: DropoutCall, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """PyTorch's dropout of ``x`` with the keep-mask ``keep`` (ATen's ``_dropout_impl``): ``x * keep / (1 - p)``, or
    for alpha dropout ``x * (a keep) + b`` with ``a = 1 / sqrt((alpha^2 p + 1)(1 - p))`` and
    ``b = (keep - 1) alpha a + alpha a p``, which keeps SELU's mean and variance."""
    noise = keep.to(device=x.device, dtype=x.dtype)  # (a recorded all-keep mask is made on the CPU)
    if not call.alpha:
        return x * noise.div_(1 - call.p)
    a = 1.0 / ((ALPHA * ALPHA * call.p + 1) * (1 - call.p)) ** 0.5
    b = noise.add(-1).mul_(ALPHA * a).add_(ALPHA * a * call.p)
    return x * noise.mul(a) + b


def draw_keep(call: DropoutCall, generator: torch.Generator) -> torch.Tensor:
    """A keep-mask (``True`` with probability ``1 - p``) from ``generator``, on its device."""
    return torch.rand(call.shape, generator=generator, device=generator.device) < 1 - call.p


class KeyedDropout(TorchFunctionMode):
    """Computes the dropout functions with keep-masks from ``source(call)``; every other function runs as is."""

    def __init__(self, source: Callable[[DropoutCall], torch.Tensor]):
        super().__init__()
        self.source = source
        self.calls: list[DropoutCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in DROPOUTS:
            return func(*args, **kwargs)
        bound = _SIGNATURES[func].bind(*args, **kwargs)
        bound.apply_defaults()
        x, p, training = bound.arguments["input"], float(bound.arguments["p"]), bound.arguments["training"]
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
        if not training or p == 0.0 or x.numel() == 0:
            return x
        if p == 1.0:
            return x * torch.zeros((), dtype=x.dtype, device=x.device)
        call = DropoutCall(noise_shape(func, x), p, DROPOUTS[func][1])
        self.calls.append(call)
        return apply_dropout(call, x, self.source(call))


def drawing(generator: torch.Generator) -> KeyedDropout:
    """Dropout drawing each mask from ``generator`` as the call comes (the sequential engine)."""
    return KeyedDropout(lambda call: draw_keep(call, generator))


def recording() -> KeyedDropout:
    """Dropout that keeps everything and records the calls (the shapes the vectorized engine draws masks for)."""
    return KeyedDropout(lambda call: torch.ones(call.shape, dtype=torch.bool))


class Replay(KeyedDropout):
    """Dropout with the masks ``keeps`` (one per call, in order; batched under ``vmap``): the vectorized engine's."""

    def __init__(self, keeps: tuple[torch.Tensor, ...], expected: tuple[DropoutCall, ...]):
        self.keeps, self.expected, self.position = keeps, expected, 0
        super().__init__(self._next)

    def _next(self, call: DropoutCall) -> torch.Tensor:
        if self.position >= len(self.expected) or self.expected[self.position] != call:
            raise RuntimeError(f"dropout call {self.position + 1} ({call}) differs from the forward pass that drew the "
                               "masks: the module's dropout depends on the data")
        self.position += 1
        return self.keeps[self.position - 1]


class RandomOps(TorchDispatchMode):
    """Records the random operations (ATen ops tagged ``nondeterministic_seeded``) a forward pass runs."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if torch.Tag.nondeterministic_seeded in func.tags and not _without_dropout(func, args, kwargs or {}):
            self.seen.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def _without_dropout(func, args: tuple, kwargs: dict) -> bool:
    """Whether a seeded op draws nothing this call: its dropout probability argument (``dropout_p``, attention's)
    is 0, as in every evaluation of a transformer whose attention is ``scaled_dot_product_attention``."""
    names = [a.name for a in func._schema.arguments]
    if "dropout_p" not in names:
        return False
    at = names.index("dropout_p")
    value = kwargs.get("dropout_p", args[at] if at < len(args) else func._schema.arguments[at].default_value)
    return value == 0


@dataclass(frozen=True)
class ModelTraits:
    """What the engines must know about a module (found by :func:`inspect_module`).

    ``dropout``: its training forward calls a dropout function (masks from the client's stream);
    ``random``: another random operation of its training forward (its name; it draws from the global generator,
    which the sequential engine seeds from the client's stream ``"forward"``; the vectorized engine refuses it);
    ``mixes``: a sample's output depends on the other samples of its batch (BatchNorm's batch statistics), so a
    vectorized step never pads a client's batch; ``buffers``: it has persistent buffers (federated state);
    ``hand_gradient``: it is fedflat's MLP, LogReg or CNN as built, whose cross-entropy gradient the sequential oracle
    computes without autograd, bit for bit autograd's (:mod:`fedflat.engine.gradients.hand`, :mod:`~fedflat.engine.gradients.convnet`)."""

    dropout: bool = False
    random: str | None = None
    mixes: bool = False
    buffers: bool = False
    hand_gradient: bool = False

    @property
    def stateful(self) -> bool:
        """Whether the engines run the module's training passes per client (own buffers, masks and rows)."""
        return self.dropout or self.random is not None or self.mixes or self.buffers


def module_name(module: nn.Module) -> str:
    return type(module).__name__


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the module's non-persistent buffers (fedflat does not federate them: a forward must not change
    them)."""
    out = {}
    for name, buffer in module.named_buffers():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if attr in owner._non_persistent_buffers_set:
            out[name] = buffer.detach().clone()
    return out


def inspect_module(model, x: torch.Tensor) -> ModelTraits:
    """The :class:`ModelTraits` of ``model`` (a :class:`fedflat.params.FlatModel`) from forward passes on the
    training inputs ``x`` (a few samples); a module fedflat cannot train correctly is a ``ConfigError`` saying
    why and what to do."""
    # (imported here: the gradients package builds on these traits, and its hand-derived gradient is one of them)
    from fedflat.engine.gradients.convnet import hand_gradient_of

    module = model.module
    w = model.initial.clone()
    layout = model.buffer_layout
    frozen = _snapshot(module)
    with torch.no_grad():
        module.train()
        model.bind(w)
        model.bind_buffers(layout.tensors(model.initial_buffers))
        with recording() as dropout, RandomOps() as random:
            module(x)
        if not torch.equal(w, model.initial):
            raise ConfigError(f"model {module_name(module)}: its forward pass changes its parameters in place; fedflat "
                              "runs every client from the same flat parameter vector and cannot train such a module")
        changed = [k for k, v in _snapshot(module).items() if not torch.equal(v, frozen[k])]
        if changed:
            raise ConfigError(f"model {module_name(module)}: its forward pass changes the non-persistent buffer "
                              f"{changed[0]!r}, which is not saved and so cannot be federated; register it with "
                              "persistent=True")
        module.eval()
        with RandomOps() as eval_random:  # as fedflat evaluates: no dropout interception
            module(x)
        if eval_random.seen:
            raise ConfigError(f"model {module_name(module)} draws random numbers in eval() mode "
                              f"({eval_random.seen[0]}), so its evaluation is not deterministic: give F.dropout "
                              "training=self.training (or use nn.Dropout)")
        mixes = _mixes_samples(model, w, x)
    return ModelTraits(dropout=bool(dropout.calls), random=random.seen[0] if random.seen else None, mixes=mixes,
                       buffers=layout.size > 0, hand_gradient=hand_gradient_of(model) is not None)


def _mixes_samples(model, w: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether a training forward pass lets the samples of a batch see each other (BatchNorm's batch
    statistics): a BatchNorm or InstanceNorm module, or sample 0's output changing when sample 1 does."""
    module = model.module
    if any(isinstance(m, nn.modules.batchnorm._NormBase) for m in module.modules()):
        return True
    others = [i for i in range(2, x.shape[0]) if not torch.equal(x[i], x[1])]
    if not others:
        return False
    module.train()
    outputs = []
    for pair in ([0, 1], [0, others[0]]):
        model.bind(w)
        model.bind_buffers(model.buffer_layout.tensors(model.initial_buffers))
        with recording():
            outputs.append(module(x[pair])[0])
    return not torch.equal(*outputs)
