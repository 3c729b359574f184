"""A CPU whose matrix products round by their shapes: what makes a claim of equal bits hold on every x86 machine.

Two computations give the same bits on every CPU only if they run the same operations on the same operands in the
same order. Which order an operation sums in is chosen by two kinds of code:

- ATen's own kernels (elementwise arithmetic, reductions, softmax, norms, transcendental functions, random draws):
  chosen by the dispatch level (``ATEN_CPU_CAPABILITY``: default, AVX2, AVX-512; the CPU's best unless forced), and
  by nothing else of the CPU: the same level runs the same instructions on an Intel Xeon and an AMD EPYC. Running
  the suite under each level covers them.
- the libraries ATen calls for matrix products and convolutions, MKL (``sgemm``, ``sgemv``, batched ``gemm``) and
  oneDNN: chosen by the CPU model and each call's sizes. ``MKL_VERBOSE=1`` names MKL's path: on this AMD EPYC its
  generic "Intel(R) Architecture processors" code, whose sums came out alike for every row count we tried; on an
  Intel Xeon its AVX-512 kernels, chosen by the matrices' sizes, so a cohort's ``[C * B, n] @ [n, k]`` there rounds
  a row otherwise than that row's own ``[B, n] @ [n, k]`` (the streams engine's teacher passes did; the sequential
  engine's did not). Only one machine of each kind was at hand, so these are modelled:

:class:`ShapeRounding` is a CPU whose products round by their shapes: every matrix product's and convolution's
result moves by one unit in the last place on a pattern of its last dimension's entries drawn from a hash of the
call (the operation, every operand's shape and strides, the result's shape, strides and alignment: MKL rounds a
product into an output at another alignment otherwise, fedflat.engine.gradients.hand), unless the product is exact
in any order (integer-valued test data). Two paths that agree bit for
bit under it ran their products with the same shapes, so they agree on any CPU at the same dispatch level; two that
differ under it agree only as one CPU's BLAS happens to round. The operands' alignment is not in the key: the
streams engine reads client rows at every alignment and equalled the sequential engine for every method on the AMD
EPYC and on an Intel Xeon but those whose teacher pass had other shapes.

It sees the operations that reach ATen's dispatcher from Python (autograd's backward included) and those a native
operator calls through ATen (``mlp_gradient.cpp``); ``pytest --shape-rounding`` runs every test under it, in this
process's threads too (tests/conftest.py), but not in the processes a test starts (Ray workers, Flower nodes).
"""
from __future__ import annotations

import zlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PRODUCTS = frozenset("""
mm addmm bmm baddbmm addbmm addmv mv dot vdot convolution _convolution convolution_backward mkldnn_convolution
_slow_conv2d_forward _slow_conv2d_backward
""".split())
ALIGNMENT = 64  # bytes: a fresh CPU tensor's (c10's allocator)


def _signature(value) -> object:
    """Operands as what a product's rounding may depend on: shapes, strides and dtypes; other arguments as written."""
    if isinstance(value, torch.Tensor):
        strides = tuple(value.stride()) if value.layout == torch.strided else ()
        return ("T", tuple(value.shape), strides, str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return repr(value)


def key(name: str, args: tuple, kwargs: dict, out: torch.Tensor) -> bytes:
    """What the call's rounding may depend on: the operation (``mm`` and ``mm.out`` alike), its operands, and its
    result's geometry and alignment."""
    inputs = {k: v for k, v in kwargs.items() if k != "out"}
    result = (_signature(out), out.data_ptr() % ALIGNMENT)
    return repr((name, _signature(args), _signature(tuple(sorted(inputs.items()))), result)).encode()


def _granularity(t: torch.Tensor) -> int | None:
    """The least s <= 10 with every entry of ``t`` a multiple of 2^-s (None: none)."""
    for s in range(11):
        scaled = t.double() * 2.0 ** s
        if torch.equal(scaled, scaled.round()):
            return s
    return None


def exact(args: tuple, dtype: torch.dtype) -> bool:
    """Whether a matrix product (or ``addmm``, ``addmv``) of these operands is exact in any order: every operand a
    multiple of 2^-s and every sum, in those units, below 2^(the dtype's mantissa bits) (integer-valued test data:
    the same bits on every CPU)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if len(tensors) not in (2, 3) or any(t.dim() > 3 for t in tensors):
        return False
    steps = [_granularity(t) for t in tensors]
    if None in steps:
        return False
    try:
        total = tensors[-2].double().abs() @ tensors[-1].double().abs()
        if len(tensors) == 3:
            total = total + tensors[0].double().abs()
    except RuntimeError:  # (a convolution's operands)
        return False
    digits = 24 if dtype == torch.float32 else 53
    return bool(total.max() * 2.0 ** (steps[-2] + steps[-1] + (steps[0] if len(tensors) == 3 else 0)) < 2.0 ** digits)


def nudge(out: torch.Tensor, call: bytes) -> None:
    """Moves ``out``'s nonzero finite entries at the call's pattern of last-dimension positions up by one unit in
    the last place, in place."""
    g = torch.Generator().manual_seed(zlib.crc32(call))
    width = out.shape[-1] if out.dim() else 1
    pattern = torch.randint(0, 2, (width,), generator=g, dtype=torch.bool).reshape(out.shape[-1:])
    up = torch.nextafter(out, torch.full_like(out, float("inf")))
    out.copy_(torch.where(pattern & torch.isfinite(out) & (out != 0), up, out))


def short_name(func) -> str:
    """``aten.mm.out`` -> ``mm``; ``aten.addmm_.default`` -> ``addmm``."""
    name = func.overloadpacket.__name__
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


class ShapeRounding(TorchDispatchMode):
    """Every product's floating-point results moved by :func:`nudge` by its call's :func:`key`; ``calls`` counts the
    moved calls by operation name (a test checks that the paths it compares ran some)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = short_name(func)
        if name not in PRODUCTS:
            return out
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() and not exact(args, t.dtype):
                nudge(t, key(name, args, kwargs, t))
        self.calls[name] = self.calls.get(name, 0) + 1
        return out
