"""Each speed path of the local step gives what the plain path gives, bit for bit (docs/benchmarks.md, "Against the
other simulators").

The clip's shortcut (:func:`fedflat.core.vectors.clip_scale`): on CPU a cohort whose norms are below the clip by
the float32 bound :data:`~fedflat.core.vectors.SURELY_UNCLIPPED` skips computing its scales, which are then all
exactly 1; everywhere else the scales are computed as before.
"""
from __future__ import annotations

import pytest
import torch

import fedflat
from fedflat.core import vectors
from fedflat.core.vectors import SURELY_UNCLIPPED, clip_rows, clip_scale
from fedflat.engine import client
from fedflat.engine.client import add_decay
from fedflat.testing import TINY

MAX_NORMS = (10.0, 1.0, 0.1, 3.7, 1e-3)  # 0.1, 3.7, 1e-3: not representable in float32


def plain_scale(D: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_``'s rule with no shortcut: every row's scale computed."""
    return (max_norm / (D.norm(dim=-1, keepdim=True) + 1e-6)).clamp(max=1.0)


def rows_with_norms(norms: torch.Tensor, P: int = 37, seed: int = 0) -> torch.Tensor:
    """Rows ``[C, P]`` of random directions scaled to about the given norms (float32 rounding moves them a little:
    the tests take the rows' own norms, as the step does)."""
    g = torch.Generator().manual_seed(seed)
    D = torch.randn(len(norms), P, generator=g, dtype=torch.float64)
    return (D / D.norm(dim=-1, keepdim=True) * norms.double()[:, None]).float()


@pytest.mark.parametrize("max_norm", MAX_NORMS)
def test_shortcut_only_where_every_scale_is_one(max_norm):
    """The bound itself: over float32 norms densely spread across the clip's edge ``n = max_norm - 1e-6`` (+-2e-5
    relative, 40,001 of them), every norm the shortcut passes gets a computed scale of exactly 1, and the shortcut
    passes all norms up to max_norm (1 - 8u) - 1e-6 (it is not a check that never fires)."""
    edge = max_norm - 1e-6
    n = torch.linspace(edge * (1 - 2e-5), edge * (1 + 2e-5), 40001, dtype=torch.float64).float()
    computed = (max_norm / (n + 1e-6)).clamp(max=1.0)
    passed = n.double() + 1e-6 <= max_norm * SURELY_UNCLIPPED
    assert passed.any() and (~passed).any()
    assert bool((computed[passed] == 1.0).all())
    assert bool((computed < 1.0).any())  # the band holds clipped norms too


@pytest.mark.parametrize("max_norm", MAX_NORMS)
def test_clip_rows_equal_plain_near_the_bound(max_norm):
    """``clip_rows`` equals ``D * scale`` with every scale computed, bit for bit, one row at a time (the
    sequential engine's cohorts) and as whole cohorts (the vectorized engine's), for norms within float32's
    reach of the clip on both sides and far from it."""
    k = torch.arange(-64, 65, dtype=torch.float64)
    edge = max_norm - 1e-6  # where the scale crosses 1
    norms = torch.cat([edge * (1 + k * 2.0 ** -24), torch.tensor([max_norm * 0.01, max_norm * 100])])
    D = rows_with_norms(norms)
    for rows in [D[i:i + 1] for i in range(len(D))] + [D, D[:64]]:
        assert torch.equal(clip_rows(rows, max_norm), rows * plain_scale(rows, max_norm))
    small = D[-2:-1]
    assert clip_scale(small, max_norm) is None  # far below: the shortcut is taken


def test_loss_scope_and_decay_equal_plain():
    """``clip_scope: loss`` in :func:`add_decay` (``clip(L) + c W``, the one place the decay is applied) with the
    shortcut equals its arithmetic written out with every scale computed, bit for bit, clipped rows and unclipped rows alike."""
    max_norm, decay = 1.0, 1e-3
    norms = torch.tensor([0.5, 1.0 - 2.0 ** -22, 1.0, 1.0 + 2.0 ** -22, 3.0])
    L, W = rows_with_norms(norms, seed=1), rows_with_norms(torch.full((5,), 2.0), seed=2)
    for c in range(5):
        l, w = L[c:c + 1], W[c:c + 1]
        want = l * plain_scale(l, max_norm) + decay * w if plain_scale(l, max_norm).item() < 1 else l + decay * w
        assert torch.equal(add_decay(l.clone(), w, decay, max_norm, "loss"), want)


@pytest.mark.parametrize("clip_scope", ["loss", "step"])
def test_runs_with_and_without_the_shortcut_agree(monkeypatch, clip_scope):
    """Whole runs on both engines, with a clip that binds at some steps and not at others: the final parameters
    with the shortcut equal those without it (SURELY_UNCLIPPED = 0: every scale computed) bit for bit. On the CPU,
    the shortcut's only device (a GPU would synchronise to take it)."""
    tree = {**TINY, "rounds": 2, "device": "cpu", "train": {**TINY["train"], "clip": 0.9, "clip_scope": clip_scope}}
    clipped = []
    real_scale = vectors.clip_scale
    for module in (client, vectors):  # add_decay's loss-scope clip, clip_rows' step-scope one
        monkeypatch.setattr(module, "clip_scale", lambda D, m: clipped.append(real_scale(D, m)) or clipped[-1])
    for engine in ("sequential", "vectorized"):
        fast = fedflat.run(tree, overrides=[f"engine={engine}"], save=False, progress=False).final_parameters
        with monkeypatch.context() as m:
            m.setattr(vectors, "SURELY_UNCLIPPED", 0.0)
            plain = fedflat.run(tree, overrides=[f"engine={engine}"], save=False, progress=False).final_parameters
        assert torch.equal(fast, plain), engine
    assert any(s is None for s in clipped) and any(s is not None for s in clipped)  # the clip binds sometimes


def test_empty_cohort_and_non_finite_norms_take_the_full_arithmetic():
    """No rows: nothing to clip, as before; a NaN or infinite norm never passes the shortcut (``nan <= x`` is false),
    so it gets the computed scale, as before."""
    assert clip_rows(torch.zeros(0, 5), 1.0).shape == (0, 5)
    for bad in (float("nan"), float("inf")):
        D = torch.tensor([[bad, 0.0, 1.0]])
        assert clip_scale(D, 1.0) is not None
        torch.testing.assert_close(clip_rows(D, 1.0), D * plain_scale(D, 1.0), rtol=0, atol=0, equal_nan=True)
