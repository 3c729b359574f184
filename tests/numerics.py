"""Tolerances that follow from the arithmetic, not from one CPU.

Two computations of the same quantity that sum in different orders (a loop against ``vmap``'s grouped
convolutions, AVX-512 against AVX2 kernels, one thread against two) differ by rounding: at most a number of
units of rounding ``u`` of the values' scale, where the number grows with the reduction lengths and the
conditioning of the computation. A tolerance is therefore written as a multiple of ``u`` of the dtype and
relative to the scale of what is compared, with the multiple argued where it is used.
"""
from __future__ import annotations

import torch

U32 = 2.0 ** -24  # unit roundoff of float32: one rounded operation's relative error is at most this
U64 = 2.0 ** -53  # ... of float64


def assert_close_normwise(actual: torch.Tensor, expected: torch.Tensor, rel: float, what: str = "") -> None:
    """``||actual - expected|| <= rel * ||expected||`` (L2 norms over the whole tensor): a relative error of the
    tensor as one vector, which, unlike an elementwise bound, does not fail on an entry that is zero up to
    cancellation."""
    gap = (actual.detach().double() - expected.detach().double()).norm().item()
    allowed = rel * expected.detach().double().norm().item()
    assert gap <= allowed, f"{what}: ||difference|| {gap:.3e}, allowed {allowed:.3e} (relative {rel:.1e})"
