"""FedFFT (seed 004): a high-pass rFFT filter on the local SAM perturbation, and its ablation filters.

Per parameter tensor ``l`` (seed 004 eq. 5-7): flatten the perturbation to ``v_l``, ``V = rFFT(v_l)``,
zero ``V[m]`` for ``m < floor(r len(V))`` (the lowest frequencies, DC included), and
``eps_l = reshape(iRFFT(V, n = len(v_l)))``; no renormalisation. The ablations of seed 004 Table 3
(``high``, ``random``, ``l2``, ``clip``) are filters too, so any of them goes on any perturbation.

Recipes: ``fedfft`` = FedSAM + filter, ``fedfft-s`` = FedGAMMA (SCAFFOLD) + filter,
``fedfft-d`` = FedDyn + SAM + filter; ``feddyn-gradfilter`` (§E.6) = FedDyn with the filter on the raw gradient
(``fft_grad``), the paper's evidence that the gain comes from filtering perturbations.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable

import torch
from pydantic import Field

from fedflat.core import (NORM_EPS, AlgorithmError, ClientContext, Cohort, Filter, PartParams, Recipe, clip_factors,
                          register_recipe, row_norm, torch_stream)
from fedflat.core.vectors import kernel


class SpectrumParams(PartParams):
    r: float = Field(0.01, ge=0, le=1, description="fraction of each tensor's rFFT coefficients removed")


def _layout_segments(ctx: ClientContext, eps: torch.Tensor) -> list[torch.Tensor]:
    layout = ctx.settings.layout
    if layout is None:
        raise AlgorithmError("spectral filters work per parameter tensor and need settings.layout "
                             "(the Simulation provides it)")
    return layout.segments(eps)


def masked_spectrum(seg: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``iRFFT(mask * rFFT(seg), n = len(seg))`` along the last axis (rows ``[..., n]``, mask ``[F]`` or ``[C, F]``).

    One row on the CPU goes through scipy's pocketfft, which caches its plans: torch's CPU FFT (MKL) plans
    every call, which for one row of a layer's size costs more than the transform (for the 784x200 weight
    6.1 vs 3.6 ms per filter, docs/benchmarks.md), while over a cohort's rows the plan is shared and MKL is
    the faster. Elsewhere (a cohort, a GPU's cuFFT) ``torch.fft``. Both transform each row on its own."""
    n = seg.shape[-1]
    if seg.device.type == "cpu" and seg.numel() == n:
        import scipy.fft  # here: a GPU-only install needs no scipy

        V = scipy.fft.rfft(seg.numpy(), axis=-1)
        V *= mask.numpy()
        return torch.from_numpy(scipy.fft.irfft(V, n=n, axis=-1))
    V = torch.fft.rfft(seg, dim=-1)
    return torch.fft.irfft(V * mask.to(V.real.dtype), n=n, dim=-1)


FOUR_STEP_MIN = 1 << 14  # tensors from this length on: the low band removed by the pruned four-step transform
DIRECT_MAX = 1 << 16  # shorter tensors with removed * n up to this: the band computed directly (low_band_basis)


def _smooth(n: int) -> bool:
    """Whether ``n`` has no prime factor above 5 (pocketfft's fastest radices)."""
    for p in (2, 3, 5):
        while n % p == 0:
            n //= p
    return n == 1


@lru_cache(maxsize=64)
def four_step_plan(n: int, removed: int) -> tuple[int, int, Any, Any] | None:
    """``(n2, n1, T, S)`` for :func:`remove_low_band` of a length-``n`` tensor: ``n = n2 n1`` with ``n2`` a divisor of
    ``n`` at least ``2 removed - 1`` (so the removed band's ``removed`` frequencies and their negatives do not alias
    in a length-``n2`` transform) and ``n1 >= 8``: the smallest one with no prime factor above 5 where one is at most
    twice the smallest divisor (for W1's 784 x 200 weight 1600 = 2^6 5^2 rather than 1568 = 2^5 7^2: its transforms
    take about a quarter less time), else the smallest; and the twiddles ``T[k, b] = exp(-2 pi i k b / n)``, ``k <
    removed``, ``b < n1`` (computed in float64, rounded once to complex64), and the inverse's ``S = conj(T) / n1``
    (the length-``n2`` inverse divides by ``n2`` only); None where ``n`` has no such divisor (the full transforms
    then)."""
    import numpy as np

    if removed < 1:
        return None
    divisors = [d for d in range(max(2 * removed - 1, 2), n // 8 + 1) if n % d == 0]
    if not divisors:
        return None
    n2 = next((d for d in divisors if d <= 2 * divisors[0] and _smooth(d)), divisors[0])
    n1 = n // n2
    k, b = np.arange(removed)[:, None], np.arange(n1)[None, :]
    T = np.exp(-2j * np.pi * ((k * b) % n) / n)
    return n2, n1, T.astype(np.complex64), (T.conj() / n1).astype(np.complex64)


def remove_low_band(seg: torch.Tensor, removed: int, plan: tuple[int, int, Any, Any],
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``x - iRFFT(V[:removed], n)`` of one tensor ``x`` (``V = rFFT(x)``): seed 004 eq. 6's ``iRFFT(mask V)`` up to
    float32 rounding, computing only the removed band. With ``n = n2 n1`` and ``X[a, b] = x[a n1 + b]``
    (four-step, Cooley-Tukey): ``V_k = sum_b T[k, b] rFFT_a(X)[k, b]`` for ``k < removed`` (``n1`` transforms of length
    ``n2``, along the columns; the sums over ``b`` as one batched product), and the band's signal ``L[a n1 + b] =
    iRFFT_a(V_k conj(T[k, b]) / n1)[a]`` (``n1`` inverse ones). Length-``n2`` transforms stay in cache where the full
    length-``n`` ones do not; on the W1 MLP's 784 x 200 weight (n = 156,800, 784 frequencies removed, n2 = 1600) the
    filter costs about a quarter of the two full transforms (docs/benchmarks.md). Where the native kernel is built
    (``kernel("remove_low_band")``) the four steps run as one call, the column transforms 8 columns to a vector and
    the twiddles ``T`` made from two small tables (reading ``T`` and ``S``, 1.2 MB for that weight, cost more in the
    local loop than the transforms): about half scipy's time in the loop. Every form's error is within FFT rounding,
    ``O(u log n) ||x||`` (tests/test_fft.py). ``out``: a contiguous float32 tensor of ``n`` entries to write the
    result into."""
    if out is None:
        out = torch.empty(seg.numel(), dtype=seg.dtype)
    _remove_low_band(seg.numpy().reshape(-1), removed, plan, out.numpy())
    return out


def _remove_low_band(x: Any, removed: int, plan: tuple[int, int, Any, Any], out: Any) -> None:
    """:func:`remove_low_band` on numpy vectors (``x`` and ``out`` contiguous float32 of ``n`` entries): the native
    kernel where it is built and ``n2 / 2`` has no prime factor above 5, else scipy's pocketfft transforms."""
    import numpy as np
    import scipy.fft

    n2, n1, T, S = plan
    op = kernel("remove_low_band")  # (fedflat/engine/native/low_band.cpp: the same bits on every CPU)
    if op is not None and n2 % 2 == 0 and _smooth(n2 // 2):
        op(torch.from_numpy(x), n2, removed, torch.from_numpy(out))
        return
    X = x.reshape(n2, n1)
    V = np.matmul(scipy.fft.rfft(X, axis=0)[:removed, None, :], T[:, :, None]).reshape(removed)
    Y = np.empty((n2 // 2 + 1, n1), dtype=np.complex64)
    Y[removed:] = 0  # (a row or two: n2 is near 2 removed)
    torch.mul(torch.from_numpy(V[:, None]), torch.from_numpy(S), out=torch.from_numpy(Y[:removed]))  # (numpy's: 2x)
    np.subtract(X, scipy.fft.irfft(Y, n=n2, axis=0, overwrite_x=True), out=out.reshape(n2, n1))


@lru_cache(maxsize=64)
def low_band_basis(n: int, removed: int) -> tuple[Any, Any]:
    """``(E, B)`` in float64 for :func:`remove_low_band_directly`: ``E = [cos; -sin](2 pi k j / n)``, ``[2 removed, n]``,
    so that ``E x`` is the real and imaginary parts of ``V_k = rFFT(x)_k``, ``k < removed``; and ``B``, ``[2 removed,
    n]``, the inverse's rows ``w_k cos(2 pi k j / n) / n`` and ``-w_k sin(2 pi k j / n) / n`` with ``w_k = 1`` for
    ``k = 0`` and ``k = n / 2`` and 2 otherwise (the negative frequencies of a real signal)."""
    import numpy as np

    k = np.arange(removed)[:, None]
    angle = 2 * np.pi * ((k * np.arange(n)[None, :]) % n) / n
    cos, sin = np.cos(angle), np.sin(angle)
    w = np.full((removed, 1), 2.0)
    w[0] = 1.0
    if n % 2 == 0 and removed > n // 2:
        w[n // 2] = 1.0
    return np.concatenate([cos, -sin]), np.concatenate([w * cos, -w * sin]) / n


def remove_low_band_directly(seg: torch.Tensor, removed: int, out: torch.Tensor) -> torch.Tensor:
    """``x - iRFFT(V[:removed], n)`` of a short tensor (``removed n`` up to :data:`DIRECT_MAX`) as two float64
    products with :func:`low_band_basis`, rounded to float32 once: for a few removed frequencies of a short tensor
    (W1's biases lose only their mean, its 200 x 10 weight 10 frequencies) two small products cost less than the
    two transforms' calls, and the float64 sums are closer to the exact band than float32 transforms
    (tests/test_fft.py). ``out``: a contiguous float32 CPU tensor of ``n`` entries (a row's slice) to write into."""
    _remove_low_band_directly(seg.numpy().reshape(-1), removed, out.numpy())
    return out


def _remove_low_band_directly(x: Any, removed: int, out: Any) -> None:
    """:func:`remove_low_band_directly` on numpy vectors."""
    import numpy as np

    E, B = low_band_basis(x.shape[-1], removed)
    x = x.astype(np.float64)
    np.subtract(x, (E @ x) @ B, out=out, casting="same_kind")


@lru_cache(maxsize=16)
def low_band_program(numels: tuple[int, ...], r: float, four_step_min: int,
                     direct_max: int) -> tuple[tuple[int, int, int, Any], ...]:
    """How :class:`LowFrequencyFilter` filters one CPU row of a layout with tensors of ``numels`` entries, made once:
    per tensor ``(offset, n, removed, plan)``, ``plan`` a :func:`four_step_plan`, ``"direct"``
    (:func:`remove_low_band_directly`), ``"full"`` (:func:`masked_spectrum`) or None (nothing removed: copied)."""
    program, offset = [], 0
    for n in numels:
        removed = int(r * (n // 2 + 1))
        plan = four_step_plan(n, removed) if n >= four_step_min else None
        if plan is None and removed:
            plan = "direct" if removed * n <= direct_max and n < four_step_min else "full"
        program.append((offset, n, removed, plan))
        offset += n
    return tuple(program)


@lru_cache(maxsize=64)
def band_mask(F: int, removed: int, band: str, device: str) -> torch.Tensor:
    """The boolean mask over ``F`` rFFT coefficients that keeps all but the ``removed`` lowest (``band="low"``) or
    highest (``"high"``) ones; made once per tensor size and device, not at every step (a cached tensor: read only)."""
    index = torch.arange(F, device=device)
    return index >= removed if band == "low" else index < F - removed


def spectral_filter(eps: torch.Tensor, segments: list[torch.Tensor],
                    keep: Callable[[int, int], torch.Tensor | None]) -> torch.Tensor:
    """Applies a coefficient mask per tensor: ``iRFFT(mask * rFFT(v_l), n = len(v_l))``.

    ``keep(j, F)`` is the boolean mask over the ``F`` rFFT coefficients of segment ``j`` (shape
    ``[F]`` or ``[C, F]``), or None where it keeps everything: such segments are copied untouched, so
    the rest of the spectrum (and of the vector) is exactly unchanged. (None is decided on the host from
    the number of removed coefficients, so no step waits for the GPU to inspect a mask.)
    """
    out = eps.clone()
    offset = 0
    for j, seg in enumerate(segments):
        n = seg.shape[-1]
        mask = keep(j, n // 2 + 1)
        if mask is not None:
            out[..., offset:offset + n] = masked_spectrum(seg, mask)
        offset += n
    return out


class LowFrequencyFilter(Filter):
    r"""FedFFT's filter (seed 004 eq. 6): zero :math:`V[m]` for :math:`m < \lfloor r \cdot \mathrm{len}(V) \rfloor` per
    tensor, :math:`V = \mathrm{rfft}(v)`."""

    name = "fft"
    summary = "FedFFT: zero the lowest floor(r*len) rFFT coefficients of each tensor's perturbation (r=0.01)"
    Params = SpectrumParams

    def apply(self, ctx: ClientContext, cohort: Cohort, eps: torch.Tensor) -> torch.Tensor:
        def keep(_: int, F: int) -> torch.Tensor | None:
            removed = int(self.p.r * F)
            return band_mask(F, removed, "low", str(eps.device)) if removed else None
        if eps.device.type != "cpu" or eps.dtype != torch.float32 or eps.shape[:-1].numel() != 1:
            return spectral_filter(eps, _layout_segments(ctx, eps), keep)
        layout = ctx.settings.layout
        if layout is None:
            _layout_segments(ctx, eps)  # (its error)
        # one CPU row, on numpy views of it: the long tensors' band removed by the four-step form, the short ones'
        # directly, each written into its slice of out
        out = torch.empty_like(eps)
        x, y = eps.contiguous().numpy().reshape(-1), out.numpy().reshape(-1)
        for offset, n, removed, plan in low_band_program(layout.numels, self.p.r, FOUR_STEP_MIN, DIRECT_MAX):
            seg, row = x[offset:offset + n], y[offset:offset + n]
            if plan is None:
                row[:] = seg
            elif plan == "direct":
                _remove_low_band_directly(seg, removed, row)
            elif plan == "full":
                row[:] = masked_spectrum(torch.from_numpy(seg), keep(0, n // 2 + 1)).numpy()
            else:
                _remove_low_band(seg, removed, plan, row)
        return out


class GradientLowFrequencyFilter(LowFrequencyFilter):
    """Seed 004 §E.6 (Table 13): FedFFT's filter on the raw local gradient, the perturbation left alone."""

    name = "fft_grad"
    summary = "seed 004 E.6: FedFFT's low-frequency removal on the raw gradient instead of the perturbation"
    acts_on = "gradient"


class HighFrequencyFilter(Filter):
    """Ablation (seed 004 Table 3): zero the HIGHEST ``floor(r len(V))`` coefficients per tensor."""

    name = "high"
    summary = "ablation: zero the highest floor(r*len) rFFT coefficients of each tensor"
    Params = SpectrumParams

    def apply(self, ctx: ClientContext, cohort: Cohort, eps: torch.Tensor) -> torch.Tensor:
        def keep(_: int, F: int) -> torch.Tensor | None:
            removed = int(self.p.r * F)
            return band_mask(F, removed, "high", str(eps.device)) if removed else None
        return spectral_filter(eps, _layout_segments(ctx, eps), keep)


class RandomFrequencyFilter(Filter):
    """Ablation (seed 004 Table 3): zero ``floor(r len(V))`` coefficients chosen at random per tensor.

    The removed set is drawn once per client and round from the stream (seed, round, client,
    ``"fft_random"``), so it does not depend on the engine or chunking; it is the same for every
    local step of the round.
    """

    name = "random"
    summary = "ablation: zero a seeded random floor(r*len) subset of each tensor's rFFT coefficients"
    Params = SpectrumParams

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        layout = ctx.settings.layout
        if layout is None:
            raise AlgorithmError("filter 'random' needs settings.layout (the Simulation provides it)")
        masks = []
        for client in cohort.ids.tolist():
            g = torch_stream(ctx.settings.seed, ctx.round, client, "fft_random")
            rows = []
            for n in layout.numels:
                F = n // 2 + 1
                keep = torch.ones(F, dtype=torch.bool)
                keep[torch.randperm(F, generator=g)[:int(self.p.r * F)]] = False
                rows.append(keep)
            masks.append(torch.cat(rows))
        cohort.own(self)["keep"] = torch.stack(masks).to(ctx.w_start.device)

    def apply(self, ctx: ClientContext, cohort: Cohort, eps: torch.Tensor) -> torch.Tensor:
        keep_all = cohort.own(self)["keep"]
        bounds = [0]
        for n in ctx.settings.layout.numels:
            bounds.append(bounds[-1] + n // 2 + 1)

        def keep(j: int, F: int) -> torch.Tensor | None:
            return keep_all[:, bounds[j]:bounds[j + 1]] if int(self.p.r * F) else None
        return spectral_filter(eps, _layout_segments(ctx, eps), keep)


class L2Params(PartParams):
    rho: float = Field(0.1, ge=0, description="the radius perturbations are projected back to")


class L2Filter(Filter):
    r"""Ablation (seed 004 Table 3): project :math:`\epsilon` back onto the ball of radius :math:`\rho` when its norm
    exceeds it, :math:`\epsilon \min(1, \rho / \lVert \epsilon \rVert)`. :math:`\rho` is the perturbation's own radius (shared hyperparameter), so on a plain SAM
    perturbation (norm exactly :math:`\rho`) this is the identity; it bites after other filters or on
    perturbations whose norm is not :math:`\rho`."""

    name = "l2"
    summary = "ablation: eps * min(1, rho/||eps||) (project to the SAM radius)"
    Params = L2Params

    def apply(self, ctx: ClientContext, cohort: Cohort, eps: torch.Tensor) -> torch.Tensor:
        return eps * clip_factors(row_norm(eps), self.p.rho, NORM_EPS)


class ClipParams(PartParams):
    clip_factor: float = Field(3.0, gt=0, description="clip |eps_j| at clip_factor * median |eps|")


class CoordinateClipFilter(Filter):
    """Ablation (seed 004 Table 3): clip every coordinate to ``c * median_j |eps_j|`` (per client, c = 3)."""

    name = "clip"
    summary = "ablation: clip each |eps_j| to c * median |eps| (c = clip_factor = 3)"
    Params = ClipParams

    def apply(self, ctx: ClientContext, cohort: Cohort, eps: torch.Tensor) -> torch.Tensor:
        threshold = self.p.clip_factor * eps.abs().median(dim=-1, keepdim=True).values
        return torch.maximum(torch.minimum(eps, threshold), -threshold)


register_recipe(Recipe(
    name="feddyn-gradfilter", display="FedDyn-GradFilter",
    summary="FedDyn with FedFFT's filter on the raw gradient (no SAM)",
    source="seed 004 (FedFFT), §E.6, Table 13", filter="fft_grad", correction="dyn", server="dyn",
    defaults={"alpha": 0.1, "r": 0.01}, tunable={"algo.alpha": (0.1, 0.01, 0.001)}))
FFT_GRID = {"algo.rho": (0.05, 0.1, 0.15, 0.2)}  # seed 004 §E.3, the radius sensitivity study (r stays 0.01)
register_recipe(Recipe(
    name="fedfft", display="FedFFT", summary="FedSAM with the low-frequency perturbation components removed per tensor",
    source="seed 004 (FedFFT), Algorithm 1, eq. 5-7",
    perturbation="sam", filter="fft", defaults={"rho": 0.1, "r": 0.01},
    tunable=FFT_GRID))
register_recipe(Recipe(
    name="fedfft-s", display="FedFFT-S", summary="FedGAMMA (SAM on SCAFFOLD) with the FedFFT filter",
    source="seed 004 (FedFFT), Table 1 '-S'",
    perturbation="sam", filter="fft", correction="scaffold", defaults={"rho": 0.1, "r": 0.01},
    tunable=FFT_GRID))
register_recipe(Recipe(
    name="fedfft-d", display="FedFFT-D", summary="SAM on FedDyn with the FedFFT filter",
    source="seed 004 (FedFFT), Table 1 '-D'",
    perturbation="sam", filter="fft", correction="dyn", server="dyn", defaults={"rho": 0.1, "r": 0.01},
    tunable=FFT_GRID))
