"""The hand-derived gradient of fedflat's MLP and LogReg, and the backend that runs it (:class:`HandMLP`).

fedflat's own MLP and LogReg under plain cross-entropy in float32 on the CPU (``ModelTraits.hand_gradient``, decided
once per model; the backend chosen once per run by :func:`fedflat.engine.gradients.choose_backend`) skip autograd
on the sequential engine: :class:`MLPGradient` runs the forward pass and the backward formulas autograd would run,
the same ATen operations on the same operands, and writes each layer's gradient into its slice of ``g[P]`` (no
graph, no ``torch.cat``): the same bits, and W1's rounds in less CPU time (docs/architecture.md, "Gradient
backends"). Every other objective, a batch it does not take and every evaluation keep the general backend's
autograd.

The gradient is autograd's own operations, without autograd. For ``a_0 = flatten(x)``,
``z_l = a_{l-1} W_l^T + b_l`` (``nn.Linear``), ``a_l = relu(z_l)`` for the hidden layers and the batch's mean
cross-entropy ``l = -1/B sum_j log softmax(z_L)_j[y_j]`` (``F.cross_entropy``), backpropagation (Rumelhart, Hinton
and Williams 1986) gives, from ``G_L = dl/dz_L = (softmax(z_L) - onehot(y)) / B`` and
``G_{l-1} = (G_l W_l) * [a_{l-1} > 0]``,

    dl/dW_l = G_l^T a_{l-1},        dl/db_l = sum_j G_l[j, :].

Each term is computed with the ATen operation, and the operand layout, that PyTorch's autograd uses for it
(``tools/autograd/derivatives.yaml``): ``nll_loss_backward`` and ``_log_softmax_backward_data`` for the
cross-entropy, ``threshold_backward`` on ReLU's output, and for ``nn.Linear`` (``addmm(b, a, W^T)``) the
``mm_mat2_backward`` of the column-major ``W^T`` (``mm(G^T, a)``, then transposed back), the
``mm_mat1_backward`` ``mm(G, W)`` and the bias's gradient summed to its shape (``sum(G, 0, keepdim=True)``). The
gradient is therefore autograd's bit for bit (tests/test_mlp_gradient.py), without autograd's graph and its ~60
small operations per step, and each term is written into its own slice of one flat ``g[P]``, so no ``torch.cat``
follows (docs/benchmarks.md, "A hand-derived MLP gradient"). One thing autograd's arithmetic depends on besides the
operations: MKL's ``gemm`` may round differently into an output at another alignment than a fresh tensor's 64 bytes,
so a weight whose slice of ``g`` starts elsewhere gets its product in an aligned scratch matrix, then copied.

Where the machine has a C++ compiler the same operations run as one native operator
(:mod:`fedflat.engine.native`, ``mlp_gradient.cpp``): one call with the GIL released instead of ~35 Python-level
calls, bit for bit the Python method's (:meth:`MLPGradient.python_loss_grad`, which runs where it cannot be built).

It applies on the CPU only, to a module that *is* fedflat's :class:`~fedflat.models.mlp.MLP` or
:class:`~fedflat.models.mlp.LogReg` as built (exact classes, no hooks, the parameters in their order):
:meth:`MLPGradient.of`, decided once per model (:class:`fedflat.engine.modes.ModelTraits`). Anything else, a
subclass included, keeps autograd.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from fedflat.engine import native
from fedflat.engine.gradients.backend import Accelerated, Backend
from fedflat.models.mlp import MLP, LogReg

# The bytes to which a fresh CPU tensor is aligned (c10's allocator), and to which a BLAS (Intel's MKL says so of its
# gemm) needs an output aligned to round as it does into a fresh one: an [out, in] slice of g at another alignment
# gets its matrix product in an aligned scratch matrix first (measured: [10, 5] products written 4 bytes off differ
# in the last bits in about half the trials; tests/test_mlp_gradient.py holds such a layer)
ALIGNMENT = 64
UNLOADED = object()  # MLPGradient's native operator before its first use
MEAN = 1  # ATen's Reduction::Mean, F.cross_entropy's default
IGNORE_INDEX = -100  # F.cross_entropy's default ignore_index
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def as_built(module: nn.Module, classes: tuple[type, ...]) -> bool:
    """Whether ``module`` is exactly one of fedflat's ``classes`` with its own ``forward`` and ``features`` (none set
    on the instance) and no hook registered on any of its modules or globally: a module whose forward pass is the one
    a hand-derived gradient differentiates."""
    if type(module) not in classes or {"forward", "features"} & set(vars(module)):
        return False
    if any(getattr(m, h) for m in module.modules() for h in _HOOKS):
        return False
    return not any(getattr(module_hooks, h, None) for h in _GLOBAL_HOOKS)


def dense_layers(body: list[nn.Module], head: nn.Module) -> list[nn.Linear] | None:
    """The ``nn.Linear`` layers of ``body`` (``[Linear, ReLU] * k``, exact classes) and ``head``, first to last, or
    None where they are not that."""
    if len(body) % 2 or any(type(m) is not nn.Linear for m in body[::2]) or any(
            type(m) is not nn.ReLU for m in body[1::2]):
        return None
    layers = body[::2] + [head]
    return layers if all(type(m) is nn.Linear for m in layers) else None


def linear_stack(module: nn.Module) -> list[nn.Linear] | None:
    """The ``nn.Linear`` layers of ``module``, first to last, when it is fedflat's MLP (``[Linear, ReLU] * k`` then
    the head) or LogReg (the head alone), exact classes whose forward is their own, with no hook registered on any
    of its modules or globally; None otherwise."""
    if not as_built(module, (MLP, LogReg)):
        return None
    body = list(module.body) if type(module) is MLP else []
    if type(module) is MLP and type(module.body) is not nn.Sequential:
        return None
    return dense_layers(body, module.head)


@dataclass(frozen=True)
class Slot:
    """Where one layer's weight ``[out, in]`` and bias ``[out]`` live in the flat vector."""

    weight: int
    bias: int
    out: int
    inp: int


def weights_and_biases(prefixes: list[str]) -> tuple[str, ...]:
    """The parameter names of layers with a weight and a bias each, in order (a layout's ``names``)."""
    return tuple(f"{p}.{kind}" for p in prefixes for kind in ("weight", "bias"))


def layer_slots(layout, prefixes: list[str], layers: list[nn.Linear]) -> tuple[Slot, ...] | None:
    """Where each ``nn.Linear`` of ``layers`` (named ``prefixes``) keeps its weight and bias in the flat ``layout``
    (:class:`fedflat.params.Layout`), or None where a shape is not the layer's."""
    index = {name: i for i, name in enumerate(layout.names)}
    slots = []
    for prefix, layer in zip(prefixes, layers):
        i, j = index[f"{prefix}.weight"], index[f"{prefix}.bias"]
        shape = (layer.out_features, layer.in_features)
        if tuple(layout.shapes[i]) != shape or tuple(layout.shapes[j]) != shape[:1]:
            return None
        slots.append(Slot(layout.offsets[i], layout.offsets[j], *shape))
    return tuple(slots)


class MLPGradient:
    """``(loss, g[P])`` of a batch's mean cross-entropy for fedflat's MLP or LogReg at a flat vector ``w[P]``
    (the module docstring's equations), without autograd."""

    def __init__(self, slots: tuple[Slot, ...], size: int, device: torch.device):
        self.slots, self.size = slots, size
        self.one = torch.ones((), device=device)  # dl/dl: what autograd.grad(loss) starts from
        self._native: Callable | None | object = UNLOADED  # (:attr:`native`, loaded on first use)
        self.flat_slots = [n for s in slots for n in (s.weight, s.bias, s.out, s.inp)]
        self._views: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}  # w's address -> views
        self._scratch: dict[int, torch.Tensor] = {}  # layer -> an aligned [out, in] for a misaligned slice of g

    @property
    def native(self) -> Callable | None:
        """The same operations in one GIL-free C++ call (:func:`fedflat.engine.native.load`; None: this method's
        Python runs), built and loaded on first use, not when the gradient is made: a runtime that never trains (the
        driver's under Ray, a Flower server's) builds nothing."""
        if self._native is UNLOADED:
            self._native = native.load()
        return self._native  # type: ignore[return-value]

    @native.setter
    def native(self, operator: Callable | None) -> None:
        self._native = operator

    @classmethod
    def of(cls, model) -> "MLPGradient | None":
        """The gradient of the :class:`fedflat.params.FlatModel` ``model``, or None where it does not apply: the
        sequential oracle may compute its cross-entropy gradient by hand where :func:`linear_stack` finds its layers
        and its flat vector holds exactly their float32 weights and biases, in order."""
        layers = linear_stack(model.module)
        if (layers is None or model.initial.dtype != torch.float32 or model.buffer_layout.size
                or model.initial.device.type != "cpu"):  # (on a GPU, cuBLAS's choices are not checked here)
            return None
        prefixes = [f"body.{2 * i}" for i in range(len(layers) - 1)] + ["head"]
        if model.layout.names != weights_and_biases(prefixes):
            return None  # (a Linear without bias, or parameters shared between layers)
        slots = layer_slots(model.layout, prefixes, layers)
        return None if slots is None else cls(slots, model.layout.size, model.initial.device)

    def takes(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether this batch is one :meth:`loss_grad` computes as autograd would (float32 inputs, int64 labels, a
        contiguous float32 ``w[P]`` on the model's device); anything else goes to autograd."""
        return (x.dtype == torch.float32 and y.dtype == torch.int64 and w.dtype == torch.float32 and w.dim() == 1
                and w.shape[0] == self.size and w.is_contiguous() and w.device == self.one.device and x.dim() >= 2)

    def parameters(self, w: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each layer's ``(W_l, W_l^T, b_l)``, views of ``w``, kept for the last two ``w`` (the sequential engine
        steps its row in place, SAM alternates ``w`` and ``w + eps``). Holding the views keeps their memory alive, so
        a ``w`` at the same address is a view of the same memory."""
        key = w.data_ptr()
        views = self._views.pop(key, None)
        if views is None:
            views = []
            for s in self.slots:
                W = w[s.weight:s.weight + s.out * s.inp].view(s.out, s.inp)
                views.append((W, W.t(), w[s.bias:s.bias + s.out]))
            if len(self._views) == 2:
                del self._views[next(iter(self._views))]
        self._views[key] = views
        return views

    def loss_grad(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(l, dl/dw)`` of the batch ``(x[B, ...], y[B])`` at ``w[P]``: the forward pass keeping each layer's input
        ``a_{l-1}``, then ``G_l`` backwards with each layer's gradient written into its slice of ``g``; the native
        operator where it is built (the same operations, bit for bit), else in Python."""
        if w.requires_grad:
            w = w.detach()
        operator = self.native
        if operator is not None:
            return operator(w, x, y, self.flat_slots, self.size, self.one)
        return self.python_loss_grad(w, x, y)

    def python_loss_grad(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`loss_grad` in Python (where the native operator is not built, and its reference in the tests)."""
        g = torch.empty(self.size, device=w.device)
        loss, _ = self.dense_loss_grad(self.parameters(w), x.flatten(1), y, g)
        return loss, g

    def dense_loss_grad(self, params: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], a: torch.Tensor,
                        y: torch.Tensor, g: torch.Tensor, input_grad: bool = False,
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(l, dl/da_0)``: the layers' forward pass from their input ``a_0 = a[B, in]``, then ``G_l`` backwards with
        each layer's gradient written into its slice of ``g``; ``dl/da_0 = G_1 W_1`` (autograd's ``mm_mat1_backward``
        of the first ``addmm``) with ``input_grad``, for layers that follow others (the CNN's, :mod:`convnet
        <fedflat.engine.gradients.convnet>`), else None.

        In bfloat16 (``a`` and ``params`` cast, as ``torch.autocast`` casts a linear layer's operands), the layers run
        in bfloat16, the logits are cast to float32 for the loss as :class:`~fedflat.engine.gradients.forward.Forward`
        does, ``G_L`` back to bfloat16, and each gradient is cast to float32 into ``g``: autocast's operations."""
        inputs = [a]
        for _, Wt, b in params[:-1]:
            inputs.append(torch.relu(torch.addmm(b, inputs[-1], Wt)))  # nn.Linear's addmm(b, a, W^T), then ReLU
        _, Wt, b = params[-1]
        log_p = torch._log_softmax(torch.addmm(b, inputs[-1], Wt).float(), 1, False)  # (.float(): none in float32)
        loss, total_weight = torch.ops.aten.nll_loss_forward(log_p, y, None, MEAN, IGNORE_INDEX)
        G = torch.ops.aten.nll_loss_backward(self.one, log_p, y, None, MEAN, IGNORE_INDEX, total_weight)
        G = torch.ops.aten._log_softmax_backward_data(G, log_p, 1, torch.float32).to(a.dtype)  # G_L = (p - onehot) / B
        for l in range(len(self.slots) - 1, -1, -1):
            s = self.slots[l]
            bias = g.as_strided((1, s.out), (s.out, 1), s.bias)
            weight = g.as_strided((s.out, s.inp), (s.inp, 1), s.weight)
            if a.dtype == torch.float32:
                torch.sum(G, 0, keepdim=True, out=bias)  # dl/db_l
                self._weight_gradient(l, G, inputs[l], weight)
            else:  # (in the layer's dtype, then cast, as autograd's ToCopyBackward)
                bias.copy_(torch.sum(G, 0, keepdim=True))
                weight.copy_(torch.mm(G.t(), inputs[l]))
            if l:
                G = torch.ops.aten.threshold_backward(G.mm(params[l][0]), inputs[l], 0)  # G_{l-1}
        return loss, G.mm(params[0][0]) if input_grad else None

    def _weight_gradient(self, l: int, G: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> None:
        """``out <- G^T a`` (``dl/dW_l``), as autograd's ``mm`` rounds it into a fresh, aligned tensor."""
        if out.data_ptr() % ALIGNMENT == 0:
            torch.mm(G.t(), a, out=out)
            return
        scratch = self._scratch.get(l)
        if scratch is None:
            scratch = self._scratch[l] = torch.empty(out.shape, device=out.device)
        out.copy_(torch.mm(G.t(), a, out=scratch) if scratch.data_ptr() % ALIGNMENT == 0 else torch.mm(G.t(), a))


class HandMLP(Accelerated):
    """The data loss's gradient by :class:`MLPGradient` (its C++ operator where built)."""

    def __init__(self, hand: MLPGradient, inner: Backend):
        super().__init__(inner)
        self.hand = hand

    @property
    def gradient(self) -> str:
        """``native`` (the hand-derived gradient as one C++ operator) or ``python`` (the same in Python: the operator
        is off or could not be built)."""
        return "native" if self.hand.native is not None else "python"

    def data_pass(self, w, x, y):
        if self.hand.takes(w, x, y):
            return self.hand.loss_grad(w, x, y)
        return self.inner.data_pass(w, x, y)
