"""Flat parameter vectors and the row-wise helpers parts compute with.

Every algorithm in fedflat works on a model's parameters as ONE flat vector ``w`` of length ``P``
(or a stack ``W`` of shape ``[C, P]``, one row per client). Norms such as the SAM radius
``||eps||`` are then single L2 norms over all parameters, client state is a flat tensor, and
aggregation is one weighted sum. :class:`ParamLayout` knows where each named tensor lives inside
the vector (per-tensor filters such as FedFFT's work through it).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Callable

import torch
from torch import nn

NORM_EPS = 1e-12
CLIP_GRAD_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: max_norm / (||g|| + 1e-6)
# float32's unit roundoff u = 2^-24: clip_scale's arithmetic rounds max_norm and 1e-6 to float32, then n + 1e-6, its
# reciprocal and the product (Tensor.__rtruediv__ is reciprocal() * other), so its result is at least
# max_norm (1 - u)^3 / ((n + 1e-6)(1 + u)^2) > max_norm (1 - 5u) / (n + 1e-6): a row with n + 1e-6 <= max_norm (1 - 8u)
# gets a scale >= 1, clamped to exactly 1
SURELY_UNCLIPPED = 1 - 8 * 2.0 ** -24

_kernel_sources: list[Callable[[str], Callable | None]] = []  # (fedflat.engine.native's operator lookup, once imported)
_kernels: dict[str, Callable | None] = {}  # name: the operator or None, looked up once a source is installed


def provide_kernels(source: Callable[[str], Callable | None]) -> None:
    """Installs where :func:`kernel` finds compiled operators: ``source(name)`` gives one or None
    (:mod:`fedflat.engine.native` installs its own when imported; fedflat.core imports nothing of the engine)."""
    _kernel_sources[:] = [source]
    _kernels.clear()


def kernel(name: str) -> Callable | None:
    """The compiled operator ``name`` (``torch.ops.fedflat.<name>``, built on first use), or None where there is none
    (no compiler, ``FEDFLAT_NATIVE=0``, or no engine imported): a part's fused form of its own torch expression, with
    the rounding its source defines (the same on every CPU; ATen's may differ by dispatch level). Looked up once a
    process (the parts ask at every step)."""
    if not _kernel_sources:
        return None
    if name not in _kernels:
        _kernels[name] = _kernel_sources[0](name)
    return _kernels[name]


NOT_RUN = object()  # what run_kernel returns where the native operator did not run


def run_kernel(name: str, device: torch.device, *operands: Any) -> Any:
    """The native operator ``name`` (:func:`kernel`) applied to ``operands`` where it is built, ``device`` is the CPU
    and it takes them (each checks its operands before it writes anything, raising RuntimeError): its result, else
    :data:`NOT_RUN`, where the caller's torch expression computes the same thing instead."""
    op = kernel(name)
    if op is None or device.type != "cpu":
        return NOT_RUN
    try:
        return op(*operands)
    except RuntimeError:  # operands the kernel does not take: nothing was written
        return NOT_RUN


def row_norm(X: torch.Tensor) -> torch.Tensor:
    """One L2 norm per row of ``X[C, P]`` over all parameters, shape ``[C, 1]`` (the kernel ``Tensor.norm`` reaches,
    called directly: without its Python, which costs a local step on W1's MLP more than the reduction)."""
    return torch.linalg.vector_norm(X, dim=-1, keepdim=True)


def normalize_rows(X: torch.Tensor, radius: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``radius * X / (||X|| + 1e-12)`` row by row (the SAM ascent step of the spec)."""
    return radius * X / (row_norm(X) + NORM_EPS)


def normalize_rows_(X: torch.Tensor, radius: float | torch.Tensor = 1.0) -> torch.Tensor:
    """:func:`normalize_rows` in place, for a part's own fresh tensor: ``X <- X (radius / (||X|| + 1e-12))``, one
    pass over ``X`` after its norm (the value of :func:`normalize_rows` up to the last bit)."""
    return X.mul_(radius / (row_norm(X) + NORM_EPS))


def clip_factors(norms: torch.Tensor, bound: float | torch.Tensor, offset: float = 0.0) -> torch.Tensor:
    """``min(1, bound / (||x_i|| + offset))`` from the rows' ``norms``: the factor that clips each row to L2 norm
    ``bound``, every row clip of fedflat. The ``offset`` is its rule, kept per use because each moves numbers:

    - 0, the exact rule (a row of norm 0 keeps factor 1): the DP clip, DP-SGD's per-example clip, norm bounding and
      centered clipping, whose guarantees (a sensitivity, a bound) need ``||x_i|| min(1, C / ||x_i||) <= C``;
    - :data:`CLIP_GRAD_EPS`, ``torch.nn.utils.clip_grad_norm_``'s: ``train.clip`` on the local direction and a
      personal model's step (Ditto, APFL), as the methods' public code clips with torch;
    - :data:`NORM_EPS`, :func:`normalize_rows`'s: FedFFT's L2 ablation filter (``rho = 0`` on a zero row gives 0, not
      ``0 / 0``)."""
    return (bound / (norms + offset if offset else norms)).clamp(max=1.0)


def clip_scale(D: torch.Tensor, max_norm: float, norms: torch.Tensor | None = None) -> torch.Tensor | None:
    """``min(1, max_norm / (||D_c|| + 1e-6))`` per row of ``D[C, P]``, ``[C, 1]`` (``clip_grad_norm_``'s rule,
    :func:`clip_factors`), or None where no row is clipped (every scale exactly 1; checked only on CPU, where a GPU
    would synchronise).

    On CPU a cohort whose largest norm is below ``max_norm`` by the float32 bound of :data:`SURELY_UNCLIPPED`
    skips the scale's five small tensor operations (the common case: about half the cost of the clip at W1's
    step, docs/benchmarks.md); only near the bound is the scale computed and compared with 1, so the
    decision and every scale are the full arithmetic's bit for bit. ``norms``: the rows' norms where the caller has
    them already (a :class:`~fedflat.core.MeasuredDirection`'s, the same bits)."""
    if norms is None:
        norms = row_norm(D)
    if D.device.type == "cpu" and norms.numel() and float(norms.max()) + CLIP_GRAD_EPS <= max_norm * SURELY_UNCLIPPED:
        return None
    scale = clip_factors(norms, max_norm, CLIP_GRAD_EPS)
    return None if unclipped(scale) else scale


def unclipped(scale: torch.Tensor | None) -> bool:
    """Whether no row is clipped (``None``: :func:`clip_scale` found none), checked only on CPU (on a GPU the check
    would cost a synchronisation)."""
    return scale is None or (scale.device.type == "cpu" and bool((scale == 1.0).all()))


def clip_rows(D: torch.Tensor, max_norm: float | None) -> torch.Tensor:
    """Each row of ``D[C, P]`` clipped to L2 norm ``max_norm`` by ``clip_grad_norm_``'s rule (:func:`clip_scale`;
    None: ``D`` as it is): ``train.clip_scope=step``, a personal model's step."""
    if max_norm is None:
        return D
    scale = clip_scale(D, max_norm)
    if scale is None:  # D * 1.0 is D bit for bit: skip the full-size multiply
        return D
    return D * scale


def all_finite(x: torch.Tensor) -> bool:
    """Whether every entry of ``x`` is finite, in one reading pass (``aminmax`` propagates NaN; no mask of ``x``'s
    size); an integer or empty tensor is."""
    if not x.numel() or not x.is_floating_point():
        return True
    low, high = torch.aminmax(x)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def non_finite_rows(rows: torch.Tensor) -> torch.Tensor:
    """``[C]``: whether each row of ``rows[C, ...]`` holds a NaN or an infinity (one pass, :func:`all_finite`, when
    all are finite)."""
    if all_finite(rows):
        return torch.zeros(rows.shape[0], dtype=torch.bool, device=rows.device)
    return ~torch.isfinite(rows.reshape(rows.shape[0], -1)).all(1)


class Packed:
    """Tensors packed one after another in a flat vector: ``names``, ``shapes`` and ``offsets`` (the parameters'
    :class:`ParamLayout`, the buffers' :class:`BufferLayout`)."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(prod(s) for s in self.shapes)

    @property
    def size(self) -> int:
        """The number of scalar entries (``P`` of the parameters, ``Q`` of the buffers)."""
        return sum(self.numels)

    def mask(self, owners: tuple[str, ...] | frozenset[str]) -> torch.Tensor:
        """Boolean ``[size]``: the entries of the tensors whose module (the name up to its last dot) is in
        ``owners``."""
        mask = torch.zeros(self.size, dtype=torch.bool)
        for name, offset, numel in zip(self.names, self.offsets, self.numels):
            if name.rpartition(".")[0] in owners:
                mask[offset:offset + numel] = True
        return mask


@dataclass(frozen=True)
class ParamLayout(Packed):
    """Names, shapes and offsets of a model's parameters inside a flat vector."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, model: nn.Module) -> "ParamLayout":
        """The layout of ``model``'s trainable parameters (``requires_grad``), in ``named_parameters`` order: a frozen
        parameter (a pretrained base under adapters) is the module's own, never in ``w``."""
        names, shapes, offsets, offset = [], [], [], 0
        for name, p in trainable_parameters(model):
            names.append(name)
            shapes.append(p.shape)
            offsets.append(offset)
            offset += p.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets))

    def segments(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-tensor slices ``[..., numel_j]`` of ``flat[..., P]`` (views, no copy)."""
        return [flat[..., o:o + n] for o, n in zip(self.offsets, self.numels)]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-tensor views ``[..., *shape_j]`` of ``flat[..., P]``."""
        lead = flat.shape[:-1]
        return [seg.view(*lead, *shape) for seg, shape in zip(self.segments(flat), self.shapes)]

    def flatten(self, model: nn.Module) -> torch.Tensor:
        """The model's current trainable parameters as one detached flat vector."""
        return torch.cat([p.detach().reshape(-1) for _, p in trainable_parameters(model)])


@dataclass(frozen=True)
class BufferLayout(Packed):
    """Names, shapes, dtypes and offsets of a model's persistent buffers (BatchNorm's running statistics and
    ``num_batches_tracked``, any registered buffer) inside one flat float64 vector ``b[Q]``.

    Buffers are federated state beside the parameters: the broadcast, the clients' uploads, the client store and
    the checkpoints carry them as ``b``. float64 holds every float32 / float16 / bfloat16 value and every integer
    below ``2^53`` exactly, so ``b`` round-trips each buffer bit for bit in its own dtype (:meth:`tensors`)."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]

    @classmethod
    def of(cls, model: nn.Module) -> "BufferLayout":
        """The persistent buffers of ``model`` (those its ``state_dict`` holds), in ``named_buffers`` order."""
        names, shapes, dtypes, offsets, offset = [], [], [], [], 0
        for name, buffer in persistent_buffers(model):
            names.append(name)
            shapes.append(buffer.shape)
            dtypes.append(buffer.dtype)
            offsets.append(offset)
            offset += buffer.numel()
        return cls(tuple(names), tuple(shapes), tuple(dtypes), tuple(offsets))

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers in their own dtypes: what a deployment sends (communication accounting)."""
        return sum(n * torch.empty(0, dtype=d).element_size() for n, d in zip(self.numels, self.dtypes))

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``b[..., Q]`` of per-buffer tensors ``[..., *shape_j]`` (a leading client dimension or none)."""
        if not tensors:
            return torch.zeros(0, dtype=torch.float64)
        lead = tensors[0].shape[:tensors[0].dim() - len(self.shapes[0])]
        return torch.cat([t.reshape(*lead, -1).to(torch.float64) for t in tensors], dim=-1)

    def tensors(self, b: torch.Tensor) -> list[torch.Tensor]:
        """Fresh per-buffer tensors ``[..., *shape_j]`` in their own dtypes from ``b[..., Q]``."""
        lead = b.shape[:-1]
        return [b[..., o:o + n].reshape(tuple(lead) + tuple(s)).to(d)
                for o, n, s, d in zip(self.offsets, self.numels, self.shapes, self.dtypes)]

    def flatten(self, model: nn.Module) -> torch.Tensor:
        """The model's current buffers as ``b[Q]``."""
        return self.pack([buffer.detach() for _, buffer in persistent_buffers(model)])

    def average(self, b: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``b + sum_i p_i (b_i - b)`` over the clients' buffers ``rows[K, Q]`` with the round's aggregation weights
        ``p[K]``, computed in float64 and rounded to each buffer's dtype: floating buffers to nearest, integer ones
        (``num_batches_tracked``) to the nearest integer (half to even). Entries every client left at ``b`` (FedBN's
        private ones, uploaded as broadcast) stay ``b`` exactly."""
        mean = b + weights.to(torch.float64) @ (rows.to(torch.float64) - b)
        for o, n, d in zip(self.offsets, self.numels, self.dtypes):
            if not d.is_floating_point:  # an integer count: to the nearest integer, which the cast keeps exactly
                mean[o:o + n] = mean[o:o + n].round()
        return self.pack(self.tensors(mean))


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter of ``model`` that ``requires_grad`` (shared ones once, as
    ``named_parameters``): what fedflat federates; the others are a frozen base every process holds once."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every buffer ``model.state_dict()`` holds (shared buffers once, as ``named_buffers``)."""
    out = []
    for name, buffer in model.named_buffers():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if attr not in owner._non_persistent_buffers_set:
            out.append((name, buffer))
    return out
