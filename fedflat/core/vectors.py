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
from typing import Callable

import torch
from torch import nn

NORM_EPS = 1e-12

_kernel_sources: list[Callable[[str], Callable | None]] = []  # (fedflat.engine.native's operator lookup, once imported)


def provide_kernels(source: Callable[[str], Callable | None]) -> None:
    """Installs where :func:`kernel` finds compiled operators: ``source(name)`` gives one or None
    (:mod:`fedflat.engine.native` installs its own when imported; fedflat.core imports nothing of the engine)."""
    _kernel_sources[:] = [source]


def kernel(name: str) -> Callable | None:
    """The compiled operator ``name`` (``torch.ops.fedflat.<name>``, built on first use), or None where there is none
    (no compiler, ``FEDFLAT_NATIVE=0``, or no engine imported): a part's fused form of its own torch expression,
    which the part checks against that expression before using it."""
    return _kernel_sources[0](name) if _kernel_sources else None


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
        names, shapes, offsets, offset = [], [], [], 0
        for name, p in model.named_parameters():
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
        """The model's current parameters as one detached flat vector."""
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


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


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, buffer)`` of every buffer ``model.state_dict()`` holds (shared buffers once, as ``named_buffers``)."""
    out = []
    for name, buffer in model.named_buffers():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if attr not in owner._non_persistent_buffers_set:
            out.append((name, buffer))
    return out
