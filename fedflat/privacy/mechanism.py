"""The Gaussian mechanism's noise, ``N(0, std^2)`` draws shaped like a clipped release: from the keyed streams (a
reproducible simulation) or from the operating system's cryptographically secure source (a deployment)."""
from __future__ import annotations

import math
import os

import numpy as np
import torch

from fedflat.core.upload import Release


def secure_normal(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Standard normal draws from the operating system's cryptographically secure source (``os.urandom``), by the
    Box-Muller transform of two uniforms of 53 random bits each."""
    n = math.prod(shape)
    words = np.frombuffer(os.urandom(16 * ((n + 1) // 2)), dtype=np.uint64).reshape(2, -1)
    u1 = ((words[0] >> np.uint64(11)).astype(np.float64) + 1.0) / 2.0 ** 53  # (0, 1]: log(u1) is finite
    u2 = (words[1] >> np.uint64(11)).astype(np.float64) / 2.0 ** 53
    radius = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([radius * np.cos(2 * np.pi * u2), radius * np.sin(2 * np.pi * u2)])[:n]
    return torch.from_numpy(z).reshape(shape).to(dtype=dtype, device=device)


def gaussian_like(release: Release, std: float, generator: torch.Generator | None) -> Release:
    r""":math:`\mathcal{N}(0, \mathrm{std}^2)` draws shaped like each entry of ``release`` (one row), in the entries' sorted order; from
    ``generator``, or from :func:`secure_normal` when it is None."""
    noise = {}
    for name in sorted(release):
        rows = release[name]
        shape = tuple(rows.shape[1:])
        draw = (torch.randn(shape, generator=generator, dtype=rows.dtype, device=rows.device) if generator is not None
                else secure_normal(shape, rows.dtype, rows.device))
        noise[name] = draw * std
    return noise
