"""The fused vector passes of fedflat/engine/native/vector_ops.cpp: FedWMSAM's perturbed point
(``torch.ops.fedflat.guided_point``) and the momentum mix with its norm (``mix_norm``), each with the rounding its
source defines; SAM's perturbed point from ATen's norm (``sam_point``) and the loop's ``W + eps`` (``point_sum``).

The kernels' bits are checked against an exact reference of that rounding (every float32 operation in numpy, every
fma rounded once from its exact value), on the AVX2 loops and on the scalar loops alike: the same bits on every CPU.
The torch expressions they replace round as ATen's kernels do, which depends on the dispatch level: where ATen rounds
alike (``fedwmsam.rounds_as_kernels()``, torch 2.13's AVX2 and AVX-512 levels) FedWMSAM's point and the mix equal
them bit for bit and a run with them equals a run without; elsewhere (its default level) they differ within the bound
the arithmetic gives. ``sam_point`` and ``point_sum`` round only single operations no level fuses: the torch
expressions' bits on every level."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from numerics import U32

import fedflat
from fedflat.algorithms import fedcm, fedwmsam
from fedflat.core import vectors
from fedflat.core.vectors import kernel
from fedflat.engine import native
from fedflat.testing import TINY

F32 = np.float32
TINY_EPS = F32(1e-12)


def require_kernels():
    """``(guided_point, mix_norm)``; skips where no C++ compiler can build them (they are built everywhere else)."""
    if native.compiler() is None or not native.enabled():
        pytest.skip("no C++ compiler here (or FEDFLAT_NATIVE=0): the native operators cannot be built")
    point, mix = kernel("guided_point"), kernel("mix_norm")
    assert point is not None and mix is not None, native.status()
    return point, mix


# ----------------------------------------------------------------------------- the exact reference

def round32(exact: Fraction) -> np.float32:
    """``exact`` rounded once to float32, to nearest, ties to even (the float64 detour is within one float32 step;
    the three candidates around it are compared exactly)."""
    near = F32(float(exact))
    candidates = (np.nextafter(near, F32(-np.inf)), near, np.nextafter(near, F32(np.inf)))
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact), int(v.view(np.uint32)) & 1))


def fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    return round32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def reference_norm(x: list) -> np.float32:
    """vector_ops.cpp's norm: 8 accumulators over whole runs of 8, summed left to right, then runs of 4 rounded
    products, the last 0-3 terms by fma, then sqrtf."""
    acc, j, n = [F32(0)] * 8, 0, len(x)
    while j + 8 <= n:
        for lane in range(8):
            acc[lane] = acc[lane] + x[j + lane] * x[j + lane]
        j += 8
    total = acc[0]
    for lane in range(1, 8):
        total = total + acc[lane]
    while j + 4 <= n:
        for i in range(j, j + 4):
            total = total + x[i] * x[i]
        j += 4
    for i in range(j, n):
        total = fma32(x[i], x[i], total)
    return np.sqrt(total)


def reference_point(ws, w, m, alpha: float, radius: float) -> np.ndarray:
    """One row of ``guided_point``: ``d = fma(m, alpha, ws - w)``, ``s = (1 / (||d|| + 1e-12)) radius``,
    ``w + d s``."""
    a, r = F32(alpha), F32(radius)
    d = [fma32(m[j], a, ws[j] - w[j]) for j in range(len(w))]
    s = (F32(1) / (reference_norm(d) + TINY_EPS)) * r
    return np.array([w[j] + d[j] * s for j in range(len(w))], dtype=F32)


def reference_mix(g, m, weight: float) -> tuple[np.ndarray, np.float32]:
    """One row of ``mix_norm``: lerp as ``fma(w, m - g, g)`` below weight 0.5, ``fma(w - 1, m - g, m)`` from it; and
    the result's norm."""
    w = F32(weight)
    small = abs(w) < F32(0.5)
    coeff = w if small else w - F32(1)
    out = [fma32(coeff, m[j] - g[j], g[j] if small else m[j]) for j in range(len(g))]
    return np.array(out, dtype=F32), reference_norm(out)


def reference_sam_point(u, d: np.float32, w, radius: float) -> np.ndarray:
    """One row of ``sam_point``: ``w + (u radius) / d``, the product, the quotient and the sum each rounded once."""
    r = F32(radius)
    return np.array([w[j] + (u[j] * r) / d for j in range(len(u))], dtype=F32)


def _rows(t: torch.Tensor, C: int) -> list[np.ndarray]:
    return [t.numpy()] * C if t.dim() == 1 else list(t.numpy())


def _operands(P: int, C: int, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    w_start = scale * torch.randn(P, generator=g)
    W = w_start + 0.01 * scale * torch.randn(C, P, generator=g)
    return w_start, W, 1e-3 * scale * torch.randn(C, P, generator=g)


@pytest.mark.parametrize("scalar", [False, True])
def test_the_point_kernel_rounds_as_its_source_defines(scalar):
    """Every row length from 1 to 41 (every remainder of the 8-lane runs and of the runs of 4), one and two clients,
    ``m_i`` per client and as ``[P]``, integer and fractional ``alpha``, both radius signs: the AVX2 loops and the
    scalar loops both give the exact reference's bits."""
    point, _ = require_kernels()
    for P in range(1, 42):
        C = 1 + P % 2
        w_start, W, m = _operands(P, C, P)
        for m_i, alpha, radius in ((m, 3, 0.05), (m[0], -0.37, -0.01)):
            out = torch.full_like(W, float("nan"))
            point(w_start, W, m_i, alpha, radius, out, scalar=scalar)
            for c, (ws, mi) in enumerate(zip(_rows(w_start, C), _rows(m_i, C))):
                expected = reference_point(ws, W[c].numpy(), mi, alpha, radius)
                assert np.array_equal(out[c].numpy(), expected), (P, c, alpha)


@pytest.mark.parametrize("scalar", [False, True])
def test_the_mix_kernel_rounds_as_its_source_defines(scalar):
    """``lerp`` on both sides of its 0.5 switch and the norms, every row length from 1 to 41: the reference's bits."""
    _, mix = require_kernels()
    for P in range(1, 42):
        C = 1 + P % 2
        _, g, m = _operands(P, C, 100 + P)
        for m_i, weight in ((m, 0.9), (m[0], 0.3), (m, 0.5)):
            mine = g.clone()
            norms = mix(mine, m_i, torch.tensor(weight), scalar=scalar)
            for c, mi in enumerate(_rows(m_i, C)):
                expected, norm = reference_mix(g[c].numpy(), mi, weight)
                assert np.array_equal(mine[c].numpy(), expected) and norms[c, 0].item() == norm, (P, c, weight)


@pytest.mark.parametrize("scalar", [False, True])
def test_the_sam_point_kernel_rounds_as_its_source_defines(scalar):
    """SAM's point from the ascent ``u`` and ``d``, one radius (both signs) and a radius per client, every row length
    from 1 to 41: the reference's bits, on both loops."""
    op = kernel("sam_point")
    if op is None:
        pytest.skip("the native kernels are not built here")
    for P in range(1, 42):
        C = 1 + P % 2
        _, W, u = _operands(P, C, 200 + P)
        d = torch.linalg.vector_norm(u, dim=-1) + 1e-12
        for radius, radii in ((0.03, None), (-0.03, None), (0.0, torch.tensor([0.05, 0.02][:C]))):
            out = torch.full_like(W, float("nan"))
            op(u, d, radius, radii, W, out, scalar=scalar)
            for c in range(C):
                r = radius if radii is None else float(radii[c])
                expected = reference_sam_point(u[c].numpy(), d[c].numpy(), W[c].numpy(), r)
                assert np.array_equal(out[c].numpy(), expected), (P, c, radius, radii)


@pytest.mark.parametrize("P", [1, 7, 8, 13, 16, 17, 36, 1001, 199_210])
def test_the_avx2_and_scalar_loops_give_the_same_bits(P):
    """Longer rows than the reference can afford (W1's 199,210 parameters), gradient-sized and parameter-sized
    operands, ``m_i`` per client, expanded and ``[P]``, ``w_start`` per client: both loops, the same bits (what makes
    the kernels' numbers those of any CPU, with or without AVX2)."""
    point, mix = require_kernels()
    for C, scale in ((1, 1.0), (4, 3e-4)):
        w_start, W, m = _operands(P, C, P + C, scale)
        for m_i in (m, m[:1].expand(C, -1), m[0]):
            for start in (w_start, w_start.expand(C, -1).clone()):
                outs = [torch.empty_like(W), torch.empty_like(W)]
                for out, scalar in zip(outs, (False, True)):
                    point(start, W, m_i, -0.37, 0.05, out, scalar=scalar)
                assert torch.equal(*outs), (C, m_i.shape, start.shape)
            gs = [W.clone(), W.clone()]
            norms = [mix(g, m_i, torch.tensor(0.9), scalar=scalar) for g, scalar in zip(gs, (False, True))]
            assert torch.equal(*gs) and torch.equal(*norms)
            points = [torch.empty_like(W), torch.empty_like(W)]
            for out, scalar in zip(points, (False, True)):
                kernel("sam_point")(m, m.norm(dim=-1) + 1e-12, 0.05, None, W, out, scalar=scalar)
            assert torch.equal(*points)


def point_bound(W: torch.Tensor, d: torch.Tensor, radius: float) -> torch.Tensor:
    """How far the kernel's point and the torch expression's may lie apart, per row, when ATen rounds otherwise:
    ``d``'s entries by at most one rounding each (the fma against a rounded product and a sum: ``2 u |d|``, ``u |alpha
    m|`` below that), its squared norm summed in another order (``(P + 2) u`` relative, Higham's bound for a sum of
    P nonnegative terms, and the sqrt halving it), the scale's three roundings, the product and the final sum: within
    ``u ||W + eps|| + (P + 8) u ||eps||`` normwise, ``||eps|| = |radius|``."""
    P = W.shape[-1]
    return U32 * ((W.norm(dim=-1) + abs(radius)) + (P + 8) * abs(radius))


@pytest.mark.parametrize("P", [1, 17, 1001, 199_210])
def test_the_torch_expressions_give_the_kernels_bits_where_aten_rounds_alike(P):
    """Where ``rounds_as_kernels()`` (ATen's AVX2 and AVX-512 kernels of torch 2.13) the torch expressions equal the
    kernels bit for bit; elsewhere (ATen's default level) they stay within :func:`point_bound` and the mix's norm
    within ``(P + 2) u`` relative."""
    point, mix = require_kernels()
    exact = fedwmsam.rounds_as_kernels()
    for C in (1, 3):
        w_start, W, m = _operands(P, C, 7 * P + C)
        out, expected = torch.empty_like(W), torch.empty_like(W)
        point(w_start, W, m, 5, 0.05, out)
        fedwmsam.guided_point_torch(w_start, W, m, 5, 0.05, expected)
        mine, theirs = W.clone(), W.clone()
        norms, their_norms = mix(mine, m, torch.tensor(0.9)), fedcm.mix_norm_torch(theirs, m, torch.tensor(0.9))
        if exact:
            assert torch.equal(out, expected) and torch.equal(mine, theirs) and torch.equal(norms, their_norms)
            continue
        d = torch.sub(w_start, W).add_(m, alpha=5)
        assert ((out - expected).norm(dim=-1) <= point_bound(W, d, 0.05)).all()
        # lerp at weight 0.9: fma(-0.1, m - g, m) against the rounded product, then the sum; each result rounded
        assert ((mine - theirs).abs() <= U32 * (0.1 * (m - W).abs() + 2 * theirs.abs())).all()
        assert ((norms - their_norms).abs() <= (P + 2) * U32 * their_norms).all()


def test_guided_point_takes_the_torch_expression_where_the_kernel_does_not_apply():
    """float64 rows, a non-contiguous ``W`` and a last dimension with stride 2 are not the kernel's: :func:`guided_point`
    computes them with torch operations, with the expression's value."""
    w_start, W, m = _operands(40, 2, 3)
    for ws, w, mi in ((w_start.double(), W.double(), m.double()), (w_start, W.t().contiguous().t(), m),
                      (w_start, W, torch.randn(2, 80)[:, ::2])):
        expected = w + fedwmsam.normalize_rows_(torch.sub(ws, w).add_(mi, alpha=2), 0.05)
        assert torch.equal(fedwmsam.guided_point(ws, w, mi, 2, 0.05, torch.empty_like(w)), expected)
    assert fedcm.mix_norm(W.double(), m.double(), torch.tensor(0.9)) is None  # not the kernel's: g untouched


def test_the_operator_refuses_bad_operands_in_one_line():
    point, _ = require_kernels()
    w_start, W, m = _operands(16, 2, 0)
    with pytest.raises(RuntimeError, match="float32 CPU"):
        point(w_start.double(), W, m, 1.0, 0.05, torch.empty_like(W))
    with pytest.raises(RuntimeError, match="one \\[C, P\\] shape"):
        point(w_start, W, m, 1.0, 0.05, torch.empty(3, 16))


def _final(method: dict, engine: str) -> torch.Tensor:
    return fedflat.run({**TINY, "rounds": 3, "algo": method, "device": "cpu"}, overrides=[f"engine={engine}"],
                       save=False, progress=False).final_parameters


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
@pytest.mark.parametrize("method", [{"name": "fedwmsam"}, {"name": "fedwmsam", "target": "descent", "sign": "code"},
                                    {"name": "fedwmsam", "personalized": False}])
def test_a_run_with_the_kernels_ends_where_one_without_them_does_where_aten_rounds_alike(method, engine,
                                                                                        monkeypatch):
    """Three rounds of FedWMSAM (and its ``target: descent``/``sign: code`` and unpersonalized forms), one client a
    chunk and a cohort of clients, end with the same parameters, bit for bit, with the fused point and mix (which
    ran) and with :meth:`perturb`, the local loop's sum, ``lerp_`` and the engine's norm, where ATen rounds as the
    kernels (on its default level the runs differ by the per-call bounds above, propagated through training: the
    kernels' run is the one a CPU without them would not reproduce, and the one every CPU with them does)."""
    point, mix = require_kernels()
    if not fedwmsam.rounds_as_kernels():
        pytest.skip(f"ATen rounds otherwise on {torch.backends.cpu.get_cpu_capability()}: the per-call bounds hold")
    calls: list[str] = []
    monkeypatch.setitem(vectors._kernels, "guided_point", lambda *args: calls.append("point") or point(*args))
    monkeypatch.setitem(vectors._kernels, "mix_norm", lambda *args: calls.append("mix") or mix(*args))
    with_kernels = _final(method, engine)
    assert set(calls) == {"point", "mix"}, "a fused path did not run"
    monkeypatch.setattr(fedwmsam.MomentumGuidedPerturbation, "fuses_point", False)  # the loop: perturb, then W + eps
    monkeypatch.setitem(vectors._kernels, "mix_norm", None)  # lerp_, and the engine's own norm
    calls.clear()
    assert torch.equal(with_kernels, _final(method, engine)) and not calls


def test_the_sam_point_kernel_gives_the_torch_expressions_bits_on_every_level():
    """The kernel takes ATen's norm and rounds the product, the quotient and the sum once each, as ATen's kernels do on
    every dispatch level (no fma there): the torch expressions' bits (:func:`~fedflat.algorithms.fedsam.scale_rows_`,
    the loop's sum), for SAM's plain ascent and FedVSSAM's mixed one, one radius or a radius per client, rows of every
    remainder and W1's length; under ``ATEN_CPU_CAPABILITY=default``, ``avx2`` and ``avx512`` alike."""
    from fedflat.algorithms.fedsam import scale_rows_

    op = kernel("sam_point")
    if op is None:
        pytest.skip("the native kernels are not built here")
    for P in [*range(1, 20), 199_210]:
        for C in (1, 3):
            _, W, g = _operands(P, C, P + C)
            m = 1e-3 * torch.randn(P, generator=torch.Generator().manual_seed(P))
            for u in (g, g.clone().mul_(0.6).add_(m)):
                for radius in (0.05, -0.02, torch.linspace(0.01, 0.05, C)[:, None]):
                    out = torch.empty_like(W)
                    scalar = isinstance(radius, float)
                    op(u, u.norm(dim=-1) + 1e-12, radius if scalar else 0.0, None if scalar else radius.reshape(-1),
                       W, out)
                    assert torch.equal(out, W + scale_rows_(u.clone(), radius)), (P, C, radius)


@pytest.mark.parametrize("method", [{"name": "fedsam"}, {"name": "fedvssam"}, {"name": "mofedsam"},
                                    {"name": "fedspeed", "merge": 0.5}, {"name": "fedfsa"}])
def test_a_sam_run_with_the_kernel_ends_where_one_without_it_does(method, monkeypatch):
    """Three rounds of FedSAM, FedVSSAM (its mixed ascent), MoFedSAM (the momentum mix too), FedSpeed (the plain
    gradient kept for its merge, which the kernel reads and leaves) and FedFSA (a radius per client) end with the same
    parameters, bit for bit, with the fused point (which ran) and with :meth:`perturb` and the loop's sum, on every
    dispatch level."""
    op = kernel("sam_point")
    if op is None:
        pytest.skip("the native kernels are not built here")
    calls: list[int] = []
    monkeypatch.setitem(vectors._kernels, "sam_point", lambda *args: calls.append(1) or op(*args))
    with_kernel = _final(method, "sequential")
    assert calls, "the fused point did not run"
    monkeypatch.setitem(vectors._kernels, "sam_point", None)
    calls.clear()
    assert torch.equal(with_kernel, _final(method, "sequential")) and not calls


def test_the_point_sum_kernel_is_the_torch_sum_on_both_loops():
    """``W + eps`` (one rounded sum) on rows of every remainder of the 8-lane runs and W1's length: ``torch.add``'s
    bits, on the AVX2 and the scalar loops, on every dispatch level; operands it does not take are refused before it
    writes."""
    op = kernel("point_sum")
    if op is None:
        pytest.skip("the native kernels are not built here")
    for P in [*range(1, 20), 199_210]:
        _, W, eps = _operands(P, 3, P)
        for scalar in (False, True):
            out = torch.full_like(W, float("nan"))
            op(W, eps, out, scalar=scalar)
            assert torch.equal(out, torch.add(W, eps)), (P, scalar)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(W, eps.t().contiguous().t(), torch.empty_like(W))


@pytest.mark.parametrize("method", ["fedlesam", "fedgf"])
def test_a_run_with_the_point_sum_kernel_ends_where_one_with_torchs_sum_does(method, monkeypatch):
    """Three rounds of FedLESAM (its constant ``eps``, the loop's sum) and FedGF end with the same parameters, bit for
    bit, with the native sum (which ran) and with ``torch.add``."""
    op = kernel("point_sum")
    if op is None:
        pytest.skip("the native kernels are not built here")
    calls: list[int] = []
    monkeypatch.setitem(vectors._kernels, "point_sum", lambda *args: calls.append(1) or op(*args))
    with_kernel = _final({"name": method}, "sequential")
    assert calls, "the native sum did not run"
    monkeypatch.setitem(vectors._kernels, "point_sum", None)
    calls.clear()
    assert torch.equal(with_kernel, _final({"name": method}, "sequential")) and not calls
