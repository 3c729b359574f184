"""A CPU whose kernels round by each call's shapes: what makes a claim of equal bits hold on every machine.

Two computations give the same bits on every CPU only if they run the same operations on the same operands in the
same order. Elementwise arithmetic (``+ - * /``, ``sqrt``, data movement) is rounded by IEEE 754 the same everywhere;
an operation that sums (a matrix product, a reduction, a softmax, a norm) or evaluates a transcendental function
rounds as the machine's kernel does, and that kernel is chosen by the CPU: ATen's build for the dispatch level
(``ATEN_CPU_CAPABILITY``: default, AVX2, AVX-512), and MKL's and oneDNN's blocking for the CPU model and the call's
shapes (``MKL_VERBOSE=1`` names the path: on this AMD EPYC MKL's ``sgemm`` takes its generic "Intel(R) Architecture
processors" code, on an Intel Xeon its AVX-512 kernels, chosen by the matrices' sizes). So a cohort's
``[C * B, n]`` product in place of each client's ``[B, n]`` may give every row the same bits here and other bits
there.

:class:`ShapeRounding` is such a CPU, here: every rounding operation's result moves by one unit in the last place
on a pattern of its last dimension's entries drawn from a hash of the call (the operation, its operands' shapes,
strides and dtypes, its other arguments). Two paths that agree bit for bit under it ran the same rounding operations
with the same shapes, so they agree on any CPU; two that differ under it agree only as one CPU happens to round.

What a call's key holds is what its rounding can depend on (:func:`lead`):

- products and convolutions (MKL, oneDNN: kernels chosen by the CPU model and the sizes): every operand's shape and
  strides;
- ATen's own reductions, whose code does not look at the CPU model (only at the dispatch level, fixed for a
  process): one over the last, contiguous dimension computes each row by one loop over its length, so only the last
  dimension counts; one that keeps the first dimension reduces each leading slice alike, so all but the first count
  (tests/test_rounding.py checks both premises on the dispatch level it runs under);
- elementwise transcendental functions (an entry of the vector loop's body and one of its scalar remainder may round
  otherwise: ``sigmoid`` does on AVX2, so an entry's bits depend on its place in the whole tensor) and every other
  reduction (over the first dimension, or a whole tensor): every operand's shape and strides.

It sees the operations that reach ATen's dispatcher from Python, autograd's backward included, and those a native
operator calls through ATen (``mlp_gradient.cpp``); what a native operator computes in its own C++
(``vector_ops.cpp``) is not moved: its rounding is its own, the same on every CPU.
"""
from __future__ import annotations

import zlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PRODUCTS = frozenset("""
mm addmm bmm baddbmm addbmm addmv mv dot vdot convolution _convolution convolution_backward mkldnn_convolution
""".split())
TRANSCENDENTAL = frozenset("""
exp log log1p expm1 log2 log10 exp2 tanh sigmoid pow sin cos tan erf erfc gelu gelu_backward softplus
softplus_backward silu silu_backward elu elu_backward mish mish_backward log_sigmoid_forward log_sigmoid_backward
atan atan2 asin acos sinh cosh lgamma digamma
""".split())
REDUCTIONS = frozenset("""
sum mean nansum prod norm linalg_vector_norm cumsum cumprod logsumexp var std var_mean std_mean _softmax _log_softmax
_softmax_backward_data _log_softmax_backward_data nll_loss_forward nll_loss2d_forward mse_loss binary_cross_entropy
binary_cross_entropy_with_logits huber_loss smooth_l1_loss native_batch_norm native_batch_norm_backward
_native_batch_norm_legit _native_batch_norm_legit_no_training native_group_norm native_group_norm_backward
native_layer_norm native_layer_norm_backward _cdist_forward _cdist_backward
""".split())
ROUNDED = PRODUCTS | TRANSCENDENTAL | REDUCTIONS


def _signature(value, lead: int = 0) -> object:
    """Operands as what their rounding may depend on: shapes, strides and dtypes without the first ``lead``
    dimensions; other arguments as written."""
    if isinstance(value, torch.Tensor):
        strides = tuple(value.stride()) if value.layout == torch.strided else ()
        return ("T", tuple(value.shape)[lead:], strides[lead:], str(value.dtype))
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v, lead) for v in value)
    return repr(value)


def _reduced(name: str, args: tuple, kwargs: dict) -> tuple[torch.Tensor, list[int]] | None:
    """A reduction's input and the dimensions it reduces (None: not a reduction over named dimensions)."""
    if name not in REDUCTIONS or not args:
        return None
    if name == "linalg_vector_norm":
        x, dim = args[0], args[2] if len(args) > 2 else kwargs.get("dim")
    elif name.endswith("_backward_data"):
        x, dim = args[1], args[2]
    else:
        x, dim = args[0], args[1] if len(args) > 1 else kwargs.get("dim")
    if not isinstance(x, torch.Tensor) or x.dim() == 0 or isinstance(dim, bool):
        return None
    if not isinstance(dim, (int, list, tuple)) or (isinstance(dim, (list, tuple)) and not dim):
        return None
    return x, sorted(d % x.dim() for d in (dim if isinstance(dim, (list, tuple)) else [dim]))


def lead(name: str, args: tuple, kwargs: dict) -> int:
    """How many leading dimensions the call's rounding does not depend on (the module docstring's list)."""
    reduced = _reduced(name, args, kwargs)
    if reduced is None:
        return 0
    x, dims = reduced
    if dims == [x.dim() - 1] and x.stride(-1) == 1:
        return x.dim() - 1
    return 1 if 0 not in dims else 0


def key(func, name: str, args: tuple, kwargs: dict) -> bytes:
    """What the call's rounding may depend on, as bytes to hash."""
    n = lead(name, args, kwargs)
    return repr((str(func), _signature(args, n), _signature(tuple(sorted(kwargs.items())), n))).encode()


def nudge(out: torch.Tensor, call: bytes) -> None:
    """Moves ``out``'s nonzero finite entries at the call's pattern of last-dimension positions up by one unit in
    the last place, in place."""
    g = torch.Generator().manual_seed(zlib.crc32(call))
    width = out.shape[-1] if out.dim() else 1
    pattern = torch.randint(0, 2, (width,), generator=g, dtype=torch.bool).reshape(out.shape[-1:])
    up = torch.nextafter(out, torch.full_like(out, float("inf")))
    out.copy_(torch.where(pattern & torch.isfinite(out) & (out != 0), up, out))


def short_name(func) -> str:
    """``aten.add_.Tensor`` -> ``add``; ``aten._softmax.default`` -> ``_softmax``."""
    name = func.overloadpacket.__name__
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


class ShapeRounding(TorchDispatchMode):
    """Every :data:`ROUNDED` operation's floating-point results moved by :func:`nudge` by its call's :func:`key`;
    ``calls`` counts the moved calls by operation name (a test checks that the paths it compares ran some)."""

    def __init__(self):
        super().__init__()
        self.calls: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = short_name(func)
        if name not in ROUNDED:
            return out
        call = key(func, name, args, kwargs)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel():
                nudge(t, call)
        self.calls[name] = self.calls.get(name, 0) + 1
        return out
