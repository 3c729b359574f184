"""FedWMSAM's fused vector passes (fedflat/engine/native/vector_ops.cpp): the perturbed point
(``torch.ops.fedflat.guided_point``) and the momentum mix with its norm (``mix_norm``), each the ATen expression's
bits, used only where a probe found it reproduces them; a run with them ends with the parameters of a run without
them (issue 57)."""
from __future__ import annotations

import pytest
import torch

import fedflat
from fedflat.algorithms import fedwmsam
from fedflat.engine import native
from fedflat.testing import TINY


def require_fused():
    """The checked kernel; skips where no C++ compiler can build it. On an x86 CPU with AVX2 (or AVX512) under torch
    2.13, the build whose roundings vector_ops.cpp describes, the probe must accept it (so the test can fail)."""
    if native.compiler() is None or not native.enabled():
        pytest.skip("no C++ compiler here (or FEDFLAT_NATIVE=0): the native operators cannot be built")
    assert native.operator("guided_point") is not None, native.status()
    fused = fedwmsam.fused_guided_point()
    if fused is None and not (torch.__version__.startswith("2.13")
                              and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")):
        pytest.skip(f"torch {torch.__version__} on {torch.backends.cpu.get_cpu_capability()} rounds otherwise: "
                    "FedWMSAM runs the ATen expression")
    assert fused is not None, "the kernel did not reproduce the ATen expression on the probe"
    return fused


def _operands(P: int, C: int, seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    w_start = scale * torch.randn(P, generator=g)
    W = w_start + 0.01 * scale * torch.randn(C, P, generator=g)
    return w_start, W, 1e-3 * scale * torch.randn(C, P, generator=g)


@pytest.mark.parametrize("P", [1, 3, 7, 8, 12, 15, 16, 17, 29, 36, 63, 1001, 199_210])
def test_the_kernel_gives_the_aten_expressions_bits(P):
    """Beyond the probe's operands: other seeds and scales (gradient-sized and parameter-sized), every remainder class
    of the row length, one and four clients, ``m_i`` per client, as an expanded row and as ``[P]``, ``w_start`` as
    ``[P]`` and per client, ``alpha = k`` and ``-k eta_l``, both radius signs: the point equals the ATen expression's
    (the local loop's ``W + eps`` after :meth:`perturb`) bit for bit."""
    fused = require_fused()
    for C, scale in ((1, 1.0), (4, 3e-4)):
        w_start, W, m = _operands(P, C, P + C, scale)
        for m_i in (m, m[:1].expand(C, -1), m[0]):
            for start in (w_start, w_start.expand(C, -1).clone()):
                for alpha, radius in ((5, 0.05), (-0.37, -0.01)):
                    expected = W + fedwmsam.normalize_rows_(torch.sub(start, W).add_(m_i, alpha=alpha), radius)
                    out = torch.full_like(W, float("nan"))
                    fused[0](start, W, m_i, alpha, radius, fused[1], out)
                    assert torch.equal(out, expected), (C, m_i.shape, start.shape, alpha)


def test_guided_point_takes_the_torch_expression_where_the_kernel_does_not_apply():
    """float64 rows, a non-contiguous ``W`` and a last dimension with stride 2 are not the kernel's: :func:`guided_point`
    computes them with torch operations, with the expression's value."""
    w_start, W, m = _operands(40, 2, 3)
    for ws, w, mi in ((w_start.double(), W.double(), m.double()), (w_start, W.t().contiguous().t(), m),
                      (w_start, W, torch.randn(2, 80)[:, ::2])):
        expected = w + fedwmsam.normalize_rows_(torch.sub(ws, w).add_(mi, alpha=2), 0.05)
        assert torch.equal(fedwmsam.guided_point(ws, w, mi, 2, 0.05, torch.empty_like(w)), expected)


def test_the_operator_refuses_bad_operands_in_one_line():
    require_fused()
    op = native.operator("guided_point")
    w_start, W, m = _operands(16, 2, 0)
    with pytest.raises(RuntimeError, match="lanes"):
        op(w_start, W, m, 1.0, 0.05, 4, torch.empty_like(W))
    with pytest.raises(RuntimeError, match="float32 CPU"):
        op(w_start.double(), W, m, 1.0, 0.05, 8, torch.empty_like(W))
    with pytest.raises(RuntimeError, match="one \\[C, P\\] shape"):
        op(w_start, W, m, 1.0, 0.05, 8, torch.empty(3, 16))


def require_mix():
    require_fused()
    fused = fedwmsam.fused_mix_norm()
    assert fused is not None, "the mix kernel did not reproduce lerp_ and vector_norm on the probe"
    return fused


@pytest.mark.parametrize("P", [1, 5, 8, 13, 16, 17, 36, 1001, 199_210])
def test_the_mix_kernel_gives_lerp_and_the_norms_bits(P):
    """``g.lerp_(m_i, w)`` in place and ``vector_norm`` of the result, for weights on both sides of lerp's 0.5 switch,
    one and three clients, ``m_i`` per client, expanded and ``[P]``: bit for bit."""
    op, lanes = require_mix()
    for C in (1, 3):
        _, g, m = _operands(P, C, 7 * P + C)
        for m_i in (m, m[:1].expand(C, -1), m[0]):
            for w in (0.9, 0.5, 0.49, 0.1, 1.0):
                weight = torch.tensor(w)
                expected = g.clone()
                norms = fedwmsam.mix_norm_torch(expected, m_i, weight)
                mine = g.clone()
                assert torch.equal(op(mine, m_i, weight, lanes), norms) and torch.equal(mine, expected), (C, w)
    assert fedwmsam.mix_norm(g.double(), m.double(), torch.tensor(0.9)) is None  # not the kernel's: g untouched


def _final(method: dict, engine: str) -> torch.Tensor:
    return fedflat.run({**TINY, "rounds": 3, "algo": method, "device": "cpu"}, overrides=[f"engine={engine}"],
                       save=False, progress=False).final_parameters


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
@pytest.mark.parametrize("method", [{"name": "fedwmsam"}, {"name": "fedwmsam", "target": "descent", "sign": "code"},
                                    {"name": "fedwmsam", "personalized": False}])
def test_a_run_with_the_kernel_ends_where_one_without_it_does(method, engine, monkeypatch):
    """Three rounds of FedWMSAM (and its ``target: descent``/``sign: code`` and unpersonalized forms), one client a
    chunk and a cohort of clients, end with the same parameters, bit for bit, with the fused point and mix (which
    ran) and with :meth:`perturb`, the local loop's sum, ``lerp_`` and the engine's norm, the path before them."""
    (point, lanes), (mix, mix_lanes), calls = require_fused(), require_mix(), []
    monkeypatch.setitem(fedwmsam._fused, "op", (lambda *args: calls.append("point") or point(*args), lanes))
    monkeypatch.setitem(fedwmsam._fused, "mix", (lambda *args: calls.append("mix") or mix(*args), mix_lanes))
    with_kernel = _final(method, engine)
    assert set(calls) == {"point", "mix"}, "a fused path did not run"
    monkeypatch.setattr(fedwmsam.MomentumGuidedPerturbation, "fuses_point", False)  # the loop: perturb, then W + eps
    monkeypatch.setitem(fedwmsam._fused, "mix", None)  # lerp_, and the engine's own norm
    calls.clear()
    assert torch.equal(with_kernel, _final(method, engine)) and not calls
