"""FedFFT's per-tensor high-pass filter (seed 004 eq. 5-7) and the ablation filters of its Table 3."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fedflat
from fedflat.algorithms import build_algorithm
from fedflat.core import Cohort, ParamLayout
from fedflat.core.vectors import kernel


def _layout() -> ParamLayout:
    """Tensors of odd and even lengths: 35, 7, 24, 4, 1."""
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(6, 4), nn.Linear(1, 1, bias=False))
    return ParamLayout.of(model)


def _setup(filter_name: str, C: int = 2, **params):
    layout = _layout()
    algo = build_algorithm({"name": "fedsam", "filter": filter_name, **params})
    ctx = SimpleNamespace(settings=SimpleNamespace(layout=layout, seed=3), round=4, w_start=torch.zeros(layout.size))
    cohort = Cohort(ids=torch.arange(C) + 1, num_samples=torch.ones(C), steps=torch.ones(C),
                    active=torch.ones(C, dtype=torch.bool))
    eps = torch.randn(C, layout.size, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    filt = algo.parts["filter"]
    filt.begin(ctx, cohort)
    return layout, filt, ctx, cohort, eps


@pytest.mark.parametrize("C", [1, 2])  # one client's row goes through scipy's FFT on CPU, a cohort's through torch's
@pytest.mark.parametrize("r", [0.0, 0.2, 0.5])
def test_fft_filter_removes_exactly_the_lowest_coefficients_per_tensor(r, C):
    layout, filt, ctx, cohort, eps = _setup("fft", C=C, r=r)
    out = filt.apply(ctx, cohort, eps)
    assert out.shape == eps.shape
    for seg_in, seg_out in zip(layout.segments(eps), layout.segments(out)):
        n = seg_in.shape[-1]
        V_in, V_out = torch.fft.rfft(seg_in, dim=-1), torch.fft.rfft(seg_out, dim=-1)
        cut = int(r * V_in.shape[-1])
        assert torch.allclose(V_out[:, :cut], torch.zeros_like(V_out[:, :cut]), atol=1e-10)
        torch.testing.assert_close(V_out[:, cut:], V_in[:, cut:])
        if cut == 0:
            torch.testing.assert_close(seg_out, seg_in, rtol=0, atol=0)
        else:  # the DC term is among the removed: every filtered tensor has zero mean
            assert torch.allclose(seg_out.mean(-1), torch.zeros(C, dtype=eps.dtype), atol=1e-12)
            assert n >= 2


def test_fft_filter_matches_hand_computed_example():
    """A length-8 constant-plus-cosine signal: removing the 2 lowest of 5 rFFT bins leaves the cos(2 pi 2 k/8) term."""
    layout = ParamLayout.of(nn.Linear(8, 1, bias=False))
    k = torch.arange(8, dtype=torch.float64)
    signal = 3.0 + torch.cos(2 * torch.pi * k / 8) + 0.5 * torch.cos(2 * torch.pi * 2 * k / 8)
    algo = build_algorithm({"name": "fedfft", "r": 0.4})  # floor(0.4 * 5) = 2 bins: DC and frequency 1
    ctx = SimpleNamespace(settings=SimpleNamespace(layout=layout))
    out = algo.parts["filter"].apply(ctx, None, signal[None])
    torch.testing.assert_close(out[0], 0.5 * torch.cos(2 * torch.pi * 2 * k / 8))


def test_high_frequency_filter_removes_the_top_of_the_spectrum():
    layout, filt, ctx, cohort, eps = _setup("high", r=0.4)
    out = filt.apply(ctx, cohort, eps)
    for seg_in, seg_out in zip(layout.segments(eps), layout.segments(out)):
        V_in, V_out = torch.fft.rfft(seg_in, dim=-1), torch.fft.rfft(seg_out, dim=-1)
        F = V_in.shape[-1]
        keep = F - int(0.4 * F)
        torch.testing.assert_close(V_out[:, :keep], V_in[:, :keep])
        assert torch.allclose(V_out[:, keep:].abs(), torch.zeros(1, dtype=eps.dtype), atol=1e-10)


def test_random_filter_removes_a_seeded_subset_of_the_given_size():
    layout, filt, ctx, cohort, eps = _setup("random", r=0.5)
    out = filt.apply(ctx, cohort, eps)
    removed_sets = []
    for seg_in, seg_out in zip(layout.segments(eps), layout.segments(out)):
        V_in, V_out = torch.fft.rfft(seg_in, dim=-1), torch.fft.rfft(seg_out, dim=-1)
        gone = (V_out.abs() < 1e-10) & (V_in.abs() > 1e-10)
        F = V_in.shape[-1]
        assert gone.sum(-1).tolist() == [int(0.5 * F)] * 2
        torch.testing.assert_close(V_out[~gone], V_in[~gone])
        removed_sets.append(gone)
    # the two clients draw different subsets; the same (seed, round, client) draws the same one again
    assert any(not torch.equal(g[0], g[1]) for g in removed_sets)
    _, filt2, ctx2, cohort2, _ = _setup("random", r=0.5)
    torch.testing.assert_close(filt2.apply(ctx2, cohort2, eps), out, rtol=0, atol=0)


def test_l2_filter_projects_onto_the_radius():
    _, filt, ctx, cohort, eps = _setup("l2", filter={"name": "l2", "rho": 0.5})
    small = 0.1 * eps / eps.norm(dim=1, keepdim=True)
    out = filt.apply(ctx, cohort, torch.cat([eps[:1], small[1:]]))
    assert out[0].norm().item() == pytest.approx(0.5)
    torch.testing.assert_close(out[0], 0.5 * eps[0] / eps[0].norm())
    torch.testing.assert_close(out[1], small[1], rtol=0, atol=0)


def test_clip_filter_clips_coordinates_at_three_medians():
    _, filt, ctx, cohort, eps = _setup("clip")
    eps = eps.clone()
    eps[0, 3] = 100.0
    eps[1, 5] = -100.0
    out = filt.apply(ctx, cohort, eps)
    threshold = 3 * eps.abs().median(dim=1, keepdim=True).values
    assert (out.abs() <= threshold + 1e-12).all()
    inside = eps.abs() <= threshold
    torch.testing.assert_close(out[inside], eps[inside], rtol=0, atol=0)
    assert out[0, 3] == threshold[0, 0] and out[1, 5] == -threshold[1, 0]


def test_fedfft_with_zero_ratio_is_fedsam(tiny):
    fft = fedflat.run(tiny("algo=fedfft", "algo.r=0", "algo.rho=0.1"), save=False, progress=False)
    sam = fedflat.run(tiny("algo=fedsam", "algo.rho=0.1"), save=False, progress=False)
    torch.testing.assert_close(fft.final_parameters, sam.final_parameters, rtol=0, atol=0)


@pytest.mark.parametrize("algo", ["fedfft", "fedfft-s", "fedfft-d"])
def test_fedfft_variants_filter_and_agree_across_engines(tiny, algo):
    """r = 0.1 removes coefficients from the MLP's 128-long first weight; engines give the same model."""
    seq = fedflat.run(tiny(f"algo={algo}", "algo.r=0.1", "engine=sequential"), save=False, progress=False)
    vec = fedflat.run(tiny(f"algo={algo}", "algo.r=0.1", "engine=vectorized"), save=False, progress=False)
    unfiltered = fedflat.run(tiny(f"algo={algo}", "algo.r=0"), save=False, progress=False)
    torch.testing.assert_close(seq.final_parameters, vec.final_parameters, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(seq.final_parameters, unfiltered.final_parameters)


def test_random_filter_runs_in_both_engines_identically(tiny):
    seq = fedflat.run(tiny("algo=fedfft", "algo.filter=random", "algo.r=0.3"), save=False, progress=False)
    vec = fedflat.run(tiny("algo=fedfft", "algo.filter=random", "algo.r=0.3", "engine=vectorized"),
                      save=False, progress=False)
    torch.testing.assert_close(seq.final_parameters, vec.final_parameters, rtol=1e-4, atol=1e-5)


def test_gradient_filter_leaves_the_perturbation_and_filters_the_gradient():
    """Seed 004 §E.6: the same per-tensor low-frequency removal, on the raw gradient instead of eps."""
    layout, grad_filter, ctx, cohort, g = _setup("fft_grad", r=0.3)
    _, eps_filter, _, _, _ = _setup("fft", r=0.3)
    assert (grad_filter.acts_on, eps_filter.acts_on) == ("gradient", "perturbation")  # the engine applies each there
    torch.testing.assert_close(grad_filter.apply(ctx, cohort, g), eps_filter.apply(ctx, cohort, g), rtol=0, atol=0)


def test_feddyn_gradfilter_is_feddyn_at_zero_ratio_and_agrees_across_engines(tiny):
    dyn = fedflat.run(tiny("algo=feddyn"), save=False, progress=False)
    zero = fedflat.run(tiny("algo=feddyn-gradfilter", "algo.r=0"), save=False, progress=False)
    torch.testing.assert_close(zero.final_parameters, dyn.final_parameters, rtol=0, atol=0)
    seq = fedflat.run(tiny("algo=feddyn-gradfilter", "algo.r=0.1", "engine=sequential"), save=False, progress=False)
    vec = fedflat.run(tiny("algo=feddyn-gradfilter", "algo.r=0.1", "engine=vectorized"), save=False, progress=False)
    torch.testing.assert_close(seq.final_parameters, vec.final_parameters, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(seq.final_parameters, dyn.final_parameters)


def _fft_error_bound(x: torch.Tensor) -> float:
    """A float32 FFT pair's normwise error bound, ``5 u log2(n) ||x||_2`` (u = 2^-24; each of the ``log2 n``
    butterfly levels of the forward and the inverse transform adds at most a few u ||x||, Higham, Accuracy and
    Stability of Numerical Algorithms, §24.1)."""
    import math
    return 5 * 2.0 ** -24 * math.log2(x.numel()) * float(x.double().norm())


@pytest.mark.parametrize("n", [156_800, 40_000, 2 ** 15])  # the W1 MLP's two weights, a power of two
def test_four_step_band_removal_is_the_full_transform_within_fft_rounding(n):
    """Removing the band with the pruned four-step transform and with the two full transforms (the filter's
    earlier form) lands within the FFT rounding bound of the float64 result, and of each other."""
    import numpy as np
    from fedflat.algorithms.fedfft import band_mask, four_step_plan, masked_spectrum, remove_low_band

    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    F = n // 2 + 1
    removed = int(0.01 * F)
    plan = four_step_plan(n, removed)
    assert plan is not None and plan[0] * plan[1] == n and plan[0] >= 2 * removed - 1
    V = np.fft.rfft(x.double().numpy())
    V[:removed] = 0
    exact = torch.from_numpy(np.fft.irfft(V, n=n))
    new = remove_low_band(x, removed, plan)
    old = masked_spectrum(x, band_mask(F, removed, "low", "cpu"))
    bound = _fft_error_bound(x)
    assert new.dtype == old.dtype == torch.float32
    assert float((new.double() - exact).norm()) <= bound and float((old.double() - exact).norm()) <= bound
    assert float((new - old).double().norm()) <= 2 * bound
    assert float((new.double() - exact).norm()) > 0  # float32 arithmetic: the check has something to bound


@pytest.mark.parametrize("n, r", [(200, 0.01), (2000, 0.01), (2000, 0.2), (16, 1.0), (17, 1.0), (4096, 0.005)])
def test_short_tensors_band_removed_directly_is_the_exact_band_within_float32_rounding(n, r):
    """The direct form of a short tensor (two float64 products, rounded to float32 once) is the float64 filter's
    result rounded to float32, up to one rounding of each entry and the float64 sums' error (far below float32's),
    hence within the full float32 transforms' bound of it too; with ``r = 1`` (every coefficient removed, the
    Nyquist one of an even length included) it leaves zero."""
    import numpy as np
    from fedflat.algorithms.fedfft import remove_low_band_directly

    x = torch.randn(1, n, generator=torch.Generator().manual_seed(n))
    removed = int(r * (n // 2 + 1))
    V = np.fft.rfft(x[0].double().numpy())
    V[:removed] = 0
    exact = torch.from_numpy(np.fft.irfft(V, n=n))
    out = remove_low_band_directly(x, removed, torch.full((n,), float("nan")))
    assert out.dtype == torch.float32
    scale = float(x.double().abs().max())
    assert float((out.double() - exact).abs().max()) <= 2.0 ** -24 * float(exact.abs().max()) + 1e-12 * scale * n
    assert float((out.double() - exact).norm()) <= _fft_error_bound(x)


@pytest.mark.parametrize("n, removed", [(156_800, 784), (40_000, 200), (2 ** 15, 163), (98 * 16, 7), (3072, 90)])
def test_the_native_band_removal_gives_the_same_bits_on_its_avx2_and_scalar_loops_within_fft_rounding(n, removed):
    """The native kernel (fedflat/engine/native/low_band.cpp) on its AVX2 loops and on its scalar ones: the same bits
    (every column the same operations, 8 a vector or one by one), within the FFT bound of the float64 band removal
    like scipy's transforms; a last block of fewer than 8 columns (98 = 12 x 8 + 2) and a radix 3 included."""
    import numpy as np
    from fedflat.algorithms import fedfft
    from fedflat.engine import native

    op = kernel("remove_low_band")
    if op is None:
        pytest.skip(f"the native kernels are not built here: {native.status()}")
    plan = fedfft.four_step_plan(n, removed)
    x = torch.randn(n, generator=torch.Generator().manual_seed(removed))
    outs = [torch.full((n,), float("nan")) for _ in range(2)]
    for out, scalar in zip(outs, (False, True)):
        op(x, plan[0], removed, out, scalar=scalar)
    V = np.fft.rfft(x.double().numpy())
    V[:removed] = 0
    exact = torch.from_numpy(np.fft.irfft(V, n=n))
    assert torch.equal(*outs) and float((outs[0].double() - exact).norm()) <= _fft_error_bound(x)


def test_the_native_band_removal_refuses_what_it_does_not_take():
    op = kernel("remove_low_band")
    if op is None:
        pytest.skip("the native kernels are not built here")
    with pytest.raises(RuntimeError, match="even and divide"):
        op(torch.zeros(99), 9, 2, torch.zeros(99))
    with pytest.raises(RuntimeError, match="no prime factor above 5"):
        op(torch.zeros(14 * 3), 14, 2, torch.zeros(14 * 3))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        op(torch.zeros(32, dtype=torch.float64), 8, 2, torch.zeros(32))


def test_four_step_plan_falls_back_to_the_full_transforms():
    from fedflat.algorithms.fedfft import four_step_plan
    assert four_step_plan(65_537, 327) is None  # prime: no divisor
    assert four_step_plan(156_800, 0) is None  # nothing removed


def test_fft_filter_on_a_long_tensor_uses_the_four_step_form_within_rounding(monkeypatch):
    """The filter of one CPU row of the W1 MLP's layout: the four-step form against the full transforms."""
    import fedflat.algorithms.fedfft as fft
    layout = ParamLayout.of(nn.Sequential(nn.Linear(784, 200), nn.Linear(200, 200), nn.Linear(200, 10)))
    filt = build_algorithm({"name": "fedfft"}).parts["filter"]
    ctx = SimpleNamespace(settings=SimpleNamespace(layout=layout))
    eps = torch.randn(1, layout.size, generator=torch.Generator().manual_seed(1))
    new = filt.apply(ctx, None, eps)
    monkeypatch.setattr(fft, "FOUR_STEP_MIN", 10 ** 9)
    monkeypatch.setattr(fft, "DIRECT_MAX", 0)
    old = filt.apply(ctx, None, eps)
    for a, b, s in zip(layout.segments(new[0]), layout.segments(old[0]), layout.segments(eps[0])):
        assert float((a - b).double().norm()) <= 2 * _fft_error_bound(s)
        assert not torch.equal(a, b) or s.numel() == 10  # every tensor but the untouched bias took another form
    assert torch.equal(new[0, -10:], eps[0, -10:])  # the 10-entry bias: nothing removed (floor(0.01 * 6) = 0)


@pytest.mark.slow
def test_fedfft_runs_with_the_four_step_form_agree_to_float32_rounding(monkeypatch):
    """Three rounds of FedFFT on an MLP whose 784 x 200 weight takes the four-step form: its final parameters are no
    further from the run whose filter computes in float64 (rounded to float32 once) than the earlier form's (the full
    float32 transforms) are, up to a factor 3: both differ from it by float32 rounding of the filter, amplified alike
    by the same steps. The earlier form's own distance is float32-sized (relative 1e-4 at most)."""
    import fedflat.algorithms.fedfft as fft
    tree = {"seed": 0, "rounds": 3,
            "data": {"name": "synthetic", "num_clients": 4, "partition": {"scheme": "iid"},
                     "options": {"shape": [1, 28, 28], "num_classes": 10, "train_size": 600, "test_size": 100}},
            "model": {"name": "mlp", "hidden": [200]}, "algo": {"name": "fedfft"},
            "train": {"local_epochs": 1, "batch_size": 50, "lr": 0.1}, "sampling": {"clients_per_round": 2}}

    def final() -> torch.Tensor:
        return fedflat.run(tree, save=False, progress=False).final_parameters.double()

    new = final()
    monkeypatch.setattr(fft, "FOUR_STEP_MIN", 10 ** 12)
    monkeypatch.setattr(fft, "DIRECT_MAX", 0)
    old = final()
    full = fft.masked_spectrum
    monkeypatch.setattr(fft, "masked_spectrum", lambda seg, mask: full(seg.double(), mask).float())
    exact = final()
    assert not torch.equal(new, old)
    assert float((old - exact).norm()) <= 1e-4 * float(exact.norm())
    assert float((new - exact).norm()) <= 3 * float((old - exact).norm())
