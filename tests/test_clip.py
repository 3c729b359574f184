"""Every row clip of fedflat is fedflat.core.vectors.clip_factors, with the rule its use needs: the exact rule
(DP's clip, DP-SGD's, norm bounding, centered clipping) and torch's clip_grad_norm_ (train.clip, a personal model's
step), checked against torch's own function."""
from __future__ import annotations

import pytest
import torch

from fedflat.core.vectors import CLIP_GRAD_EPS, clip_factors, clip_rows


def test_the_exact_rule_bounds_every_row_and_leaves_short_and_zero_rows_alone():
    rows = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [1e-310, 0.0]], dtype=torch.float64)
    factors = clip_factors(rows.norm(dim=1), 2.0)
    assert factors.tolist() == [2.0 / 5.0, 1.0, 1.0, 1.0]  # 0 / 0 never formed: 2 / 0 is inf, clamped to 1
    assert (rows * factors[:, None]).norm(dim=1).max() <= 2.0


@pytest.mark.parametrize("max_norm", [0.5, 3.7, 1e-3])
def test_the_clip_grad_rule_is_torchs_clip_grad_norm(max_norm):
    """Each row clipped by clip_rows equals torch.nn.utils.clip_grad_norm_ on that row alone, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    D = torch.randn(6, 40, generator=generator) * torch.logspace(-4, 1, 6)[:, None]
    ours = clip_rows(D, max_norm)
    for c in range(D.shape[0]):
        grad = torch.nn.Parameter(torch.zeros(40))
        grad.grad = D[c].clone()
        torch.nn.utils.clip_grad_norm_([grad], max_norm)
        assert torch.equal(ours[c], grad.grad), c
    norms = torch.linalg.vector_norm(D, dim=-1, keepdim=True)
    assert torch.equal(clip_factors(norms, max_norm, CLIP_GRAD_EPS), (max_norm / (norms + 1e-6)).clamp(max=1.0))
