"""The hand-derived gradient of fedflat's CNN (:class:`CNNGradient`) and the backend that runs it (:class:`HandCNN`).

fedflat's ``cnn`` (McMahan et al.'s CIFAR CNN, :mod:`fedflat.models.cnn`: ``[conv 5x5 - ReLU - maxpool 2] x 2``, then
an MLP ``[Linear - ReLU] x 2`` and the head) under plain cross-entropy on the CPU skips autograd on the
sequential engine, as fedflat's MLP does (:mod:`fedflat.engine.gradients.hand`): the forward pass and the backward
formulas autograd would run, on the same operands, each layer's gradient written into its slice of ``g[P]``. For a
convolution ``z = conv(a, W) + b`` autograd's ``ConvolutionBackward0`` calls ``convolution_backward(dz, a, W, ...)``
once for ``(dl/da, dl/dW, dl/db)``, without ``dl/da`` for the first layer (the images need none); the fully
connected layers are :meth:`MLPGradient.dense_loss_grad <fedflat.engine.gradients.hand.MLPGradient.dense_loss_grad>`.

What differs from autograd is one pair of operations, by kernel only: ReLU and its 2x2 max pooling. ATen's pooling
of an NCHW float tensor walks each window element by element (2.6 ms for W2's ``[10, 64, 28, 28]`` on one core,
about as long as the convolution before it); the native ``relu_max_pool2`` (``fedflat/engine/native/conv_ops.cpp``)
selects the same maximum of ``relu(z)`` in each window (the first in row-major order, a NaN winning as in ATen) and
records where, and ``max_pool2_backward`` writes ``0 + dl/dp`` there and zeros elsewhere: ATen's
``max_pool2d_with_indices_backward`` followed by ReLU's ``threshold_backward``, value for value. Without the native
library the same selection runs as ATen's channels-last pooling (about 10x faster than the NCHW one) between two
layout copies. Loss and gradient are autograd's bit for bit either way (tests/test_cnn_gradient.py), and the
convolutions are autograd's own calls, so the rounds' numbers do not move (``scripts/param_hashes.py``).

Under ``precision: bf16`` (``dtype`` bfloat16) it runs what autograd runs under ``torch.autocast(bfloat16)``:
every operand of a convolution and a linear layer cast to bfloat16 as autocast casts it, the layers, ReLU and the
pooling in bfloat16 (the kernels take bfloat16 too), the logits cast to float32 for the loss, its gradient back to
bfloat16, and each parameter's gradient cast to float32 into ``g``: bit for bit autograd's under autocast (tested),
at oneDNN's bfloat16 rate on a CPU with AVX512_BF16 (docs/benchmarks.md, "Convolutions on one core").

It applies to a module that is fedflat's :class:`~fedflat.models.cnn.CNN` as built without ``norm`` or ``dropout``
(exact classes, no hooks), on the CPU in NCHW order, where ATen computes its convolutions with oneDNN (mkldnn) both
with and without autograd (checked for each input shape: the backend ATen selects could depend on whether a backward
pass follows); anything else keeps autograd (:meth:`CNNGradient.of`, :meth:`CNNGradient.takes`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from fedflat.engine import native
from fedflat.engine.gradients.hand import (UNLOADED, HandMLP, MLPGradient, as_built, dense_layers, layer_slots,
                                           weights_and_biases)
from fedflat.models.cnn import CNN

aten = torch.ops.aten
POOL = ([2, 2], [2, 2], [0, 0], [1, 1], False)  # nn.MaxPool2d(2)'s kernel, stride, padding, dilation, ceil_mode


@dataclass(frozen=True)
class ConvSlot:
    """One convolution: where its weight ``[out, in, k, k]`` and bias ``[out]`` live in the flat vector, and its
    geometry (stride 1, dilation 1, one group, zero padding ``padding``)."""

    weight: int
    bias: int
    shape: tuple[int, int, int, int]
    padding: tuple[int, int]


def conv_stages(module: nn.Module) -> tuple[list[nn.Conv2d], list[nn.Linear]] | None:
    """The convolutions and the fully connected layers (the head last) of ``module`` where it is fedflat's CNN as
    built with neither normalization nor dropout: ``conv`` exactly ``[Conv2d, ReLU, MaxPool2d(2)] * k`` of plain
    convolutions, ``fc`` ``[Linear, ReLU] * m``; None otherwise."""
    if not as_built(module, (CNN,)) or type(module.conv) is not nn.Sequential or type(module.fc) is not nn.Sequential:
        return None
    stages = list(module.conv)
    if not stages or len(stages) % 3:
        return None
    convs = stages[::3]
    if not all(plain_conv(c) and type(r) is nn.ReLU and halving_pool(p)
               for c, r, p in zip(stages[::3], stages[1::3], stages[2::3])):
        return None
    dense = dense_layers(list(module.fc), module.head)
    return None if dense is None else (convs, dense)


def plain_conv(conv: nn.Module) -> bool:
    """An ``nn.Conv2d`` of stride 1, dilation 1, one group, a bias and symmetric zero padding, whose kernel is wider
    than 3 (ATen then picks oneDNN for float32 on the CPU whatever the batch and threads)."""
    return (type(conv) is nn.Conv2d and conv.stride == (1, 1) and conv.dilation == (1, 1) and conv.groups == 1
            and conv.bias is not None and conv.padding_mode == "zeros" and isinstance(conv.padding, tuple)
            and conv.padding[0] == conv.padding[1] and min(conv.kernel_size) > 3)


def halving_pool(pool: nn.Module) -> bool:
    """``nn.MaxPool2d(2)``: 2x2 windows, stride 2, no padding, no dilation, floor mode."""
    size = (lambda v: v if isinstance(v, tuple) else (v, v))
    return (type(pool) is nn.MaxPool2d and size(pool.kernel_size) == (2, 2) and size(pool.stride) == (2, 2)
            and size(pool.padding) == (0, 0) and size(pool.dilation) == (1, 1) and not pool.ceil_mode
            and not pool.return_indices)


class CNNGradient:
    """``(loss, g[P])`` of a batch's mean cross-entropy for fedflat's CNN at a flat vector ``w[P]`` (the module
    docstring), without autograd."""

    def __init__(self, convs: tuple[ConvSlot, ...], dense: MLPGradient, dtype: torch.dtype = torch.float32):
        self.convs, self.dense, self.size, self.dtype = convs, dense, dense.size, dtype
        self._native: tuple[Callable, Callable] | None | object = UNLOADED
        self._mkldnn: dict[tuple[int, ...], bool] = {}  # input shape -> both convolutions on oneDNN

    @classmethod
    def of(cls, model, dtype: torch.dtype = torch.float32) -> "CNNGradient | None":
        """The gradient of the :class:`fedflat.params.FlatModel` ``model``, or None where :func:`conv_stages` does not
        find its layers, its flat vector does not hold exactly their float32 weights and biases in order, or it is
        not on the CPU. ``dtype``: the passes' (``torch.bfloat16``: ``precision: bf16``'s autocast)."""
        found = conv_stages(model.module)
        if (found is None or model.initial.dtype != torch.float32 or model.buffer_layout.size
                or model.initial.device.type != "cpu"):
            return None
        convs, dense = found
        conv_prefixes = [f"conv.{3 * i}" for i in range(len(convs))]
        dense_prefixes = [f"fc.{2 * i}" for i in range(len(dense) - 1)] + ["head"]
        layout = model.layout
        if layout.names != weights_and_biases(conv_prefixes + dense_prefixes):
            return None
        slots = layer_slots(layout, dense_prefixes, dense)
        if slots is None:
            return None
        conv_slots = []
        for i, conv in enumerate(convs):
            shape = (conv.out_channels, conv.in_channels, *conv.kernel_size)
            if tuple(layout.shapes[2 * i]) != shape:
                return None
            conv_slots.append(ConvSlot(layout.offsets[2 * i], layout.offsets[2 * i + 1], shape, conv.padding))
        return cls(tuple(conv_slots), MLPGradient(slots, layout.size, model.initial.device), dtype)

    @property
    def native(self) -> tuple[Callable, Callable] | None:
        """The native ``(relu_max_pool2, max_pool2_backward)`` (:mod:`fedflat.engine.native`), loaded on first use;
        None: ATen's channels-last pooling runs instead (the same numbers)."""
        if self._native is UNLOADED:
            ops = native.operator("relu_max_pool2"), native.operator("max_pool2_backward")
            self._native = ops if None not in ops else None
        return self._native  # type: ignore[return-value]

    @native.setter
    def native(self, ops: tuple[Callable, Callable] | None) -> None:
        self._native = ops

    def takes(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> bool:
        """Whether :meth:`loss_grad` computes this batch as autograd would: float32 images ``[B, C, H, W]``, int64
        labels, a contiguous float32 ``w[P]`` on the CPU, and ATen computing both convolutions with oneDNN with and
        without a backward pass (asked once per input shape)."""
        if not (x.dtype == torch.float32 and y.dtype == torch.int64 and w.dtype == torch.float32 and w.dim() == 1
                and w.shape[0] == self.size and w.is_contiguous() and w.device.type == "cpu" and x.dim() == 4
                and x.device.type == "cpu" and x.shape[0] > 0 and torch._C._get_mkldnn_enabled()):
            return False
        key = tuple(x.shape)
        if key not in self._mkldnn:
            self._mkldnn[key] = self._on_mkldnn(x)
        return self._mkldnn[key]

    def _on_mkldnn(self, x: torch.Tensor) -> bool:
        """Whether ATen selects oneDNN for every convolution of an input of ``x``'s shape, as a forward pass under
        autograd (its weight requiring a gradient) and as one without (``torch._C._select_conv_backend``)."""
        select = getattr(torch._C, "_select_conv_backend", None)
        if select is None:
            return False
        a = torch.empty(x.shape, dtype=self.dtype)
        for conv in self.convs:
            weight, bias = torch.empty(conv.shape, dtype=self.dtype), torch.empty(conv.shape[0], dtype=self.dtype)
            for needs_grad in (False, True):
                weight.requires_grad_(needs_grad)
                backend = select(a, weight, bias, [1, 1], list(conv.padding), [1, 1], False, [0, 0], 1, None)
                if backend != torch._C._ConvBackend.Mkldnn:
                    return False
            out = [a.shape[0], conv.shape[0], *(a.shape[d + 2] + 2 * conv.padding[d] - conv.shape[d + 2] + 1
                                                for d in (0, 1))]
            if min(out[2:]) < 2:
                return False
            a = torch.empty(out[0], out[1], out[2] // 2, out[3] // 2, dtype=self.dtype)
        return True

    def loss_grad(self, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(l, dl/dw)`` of the batch ``(x[B, C, H, W], y[B])`` at ``w[P]``: each stage's ``conv2d`` and pooled ReLU
        keeping what its backward reads, the fully connected layers' loss and gradients (their input's gradient
        included), then the stages backwards, last first, each convolution's ``convolution_backward`` as autograd
        calls it."""
        if w.requires_grad:
            w = w.detach()
        g = torch.empty(self.size, device=w.device)
        a, saved = x.to(self.dtype), []  # (.to: autocast's cast of every operand; none in float32)
        for conv in self.convs:
            W, b = (v.to(self.dtype) for v in self._conv_parameters(w, conv))
            z = torch.conv2d(a, W, b, 1, conv.padding)  # nn.Conv2d's F.conv2d(a, W, b, stride, padding)
            p, kept = self._relu_pool(z)
            saved.append((a, W, z.shape, kept))
            a = p
        dense = self.dense.parameters(w)
        if self.dtype != torch.float32:
            dense = [(W, W.t(), b.to(self.dtype)) for W, b in ((W.to(self.dtype), b) for W, _, b in dense)]
        loss, G = self.dense.dense_loss_grad(dense, a.flatten(1), y, g, input_grad=True)
        G = G.view(a.shape)
        for i in range(len(self.convs) - 1, -1, -1):
            conv, (a, W, shape, kept) = self.convs[i], saved[i]
            dz = self._relu_pool_backward(G, kept, shape)
            G, dW, db = aten.convolution_backward(dz, a, W, [conv.shape[0]], [1, 1], list(conv.padding), [1, 1],
                                                  False, [0, 0], 1, [i > 0, True, True])
            g[conv.weight:conv.weight + dW.numel()].copy_(dW.view(-1))
            g[conv.bias:conv.bias + db.numel()].copy_(db)
        return loss, g

    @staticmethod
    def _conv_parameters(w: torch.Tensor, conv: ConvSlot) -> tuple[torch.Tensor, torch.Tensor]:
        size = conv.shape[0] * conv.shape[1] * conv.shape[2] * conv.shape[3]
        return w[conv.weight:conv.weight + size].view(conv.shape), w[conv.bias:conv.bias + conv.shape[0]]

    def _relu_pool(self, z: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(maxpool2(relu(z)), what its backward reads)``: the native kernel's winners' codes, or ATen's
        channels-last ``relu(z)`` and indices."""
        ops = self.native
        if ops is not None:
            p, code = ops[0](z)
            return p, (code,)
        r = torch.relu(z).contiguous(memory_format=torch.channels_last)
        p, indices = aten.max_pool2d_with_indices(r, *POOL)
        return p.contiguous(), (r, indices)

    def _relu_pool_backward(self, G: torch.Tensor, kept: tuple[torch.Tensor, ...], shape: torch.Size) -> torch.Tensor:
        """``dl/dz`` from ``dl/dp``: ``threshold_backward(max_pool2d_with_indices_backward(G), relu(z), 0)``."""
        if len(kept) == 1:  # (the native kernel's codes)
            return self.native[1](G.contiguous(), kept[0], shape[2], shape[3])  # type: ignore[index]
        r, indices = kept
        dr = aten.max_pool2d_with_indices_backward(G.contiguous(memory_format=torch.channels_last), r, *POOL, indices)
        return aten.threshold_backward(dr, r, 0).contiguous()


class HandCNN(HandMLP):
    """The data loss's gradient by :class:`CNNGradient` (``gradient``: ``native`` with the native pooling kernels,
    ``python`` with ATen's pooling)."""


def hand_gradient_of(model, autocast: torch.dtype | None = None) -> MLPGradient | CNNGradient | None:
    """The hand-derived gradient of the :class:`fedflat.params.FlatModel` ``model`` (fedflat's MLP or LogReg, or its
    CNN), or None where none applies (``ModelTraits.hand_gradient``); ``autocast``: the CNN's passes in that dtype
    (``precision: bf16``)."""
    return MLPGradient.of(model) or CNNGradient.of(model, autocast or torch.float32)
