"""FedFFT's per-tensor high-pass filter (seed 004 eq. 5-7) and the ablation filters of its Table 3."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

import fedflat
from fedflat.algorithms import build_algorithm
from fedflat.core import Cohort, ParamLayout


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
