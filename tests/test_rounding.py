"""tests/rounding.py's CPU whose products round by their shapes: it tells apart what it should."""
from __future__ import annotations

import torch
from rounding import ShapeRounding


def _rows(C: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(C, n, generator=torch.Generator().manual_seed(seed))


def test_it_moves_a_product_by_its_row_count_and_nothing_else():
    """Under ShapeRounding a cohort's product ``[6, n] @ [n, k]`` gives its first rows other bits than the same rows'
    ``[2, n] @ [n, k]``, by one unit in the last place at most; the same call twice gives the same bits, and so does
    ``mm`` into an aligned ``out``; an elementwise sum and a reduction are left alone (ATen's own kernels: the
    dispatch level, not the CPU model, chooses their order)."""
    X, R = _rows(6, 16, 0), _rows(16, 8, 1)
    out = torch.empty(2, 8)
    with ShapeRounding() as cpu:
        cohort, alone, again = X @ R, X[:2] @ R, X[:2] @ R
        torch.mm(X[:2], R, out=out)
        added, summed = X + 1, X.sum(-1)
    assert torch.equal(alone, again) and torch.equal(alone, out) and not torch.equal(cohort[:2], alone)
    plain = X[:2] @ R
    ulp = torch.nextafter(plain.abs(), torch.full_like(plain, float("inf"))) - plain.abs()
    assert ((alone - plain).abs() <= ulp).all() and torch.equal(added, X + 1) and torch.equal(summed, X.sum(-1))
    assert cpu.calls == {"mm": 4}


def test_it_moves_a_product_into_an_output_at_another_alignment():
    """A product written into a slice of a larger tensor 4 bytes off the 64-byte alignment of a fresh one is another
    call to it (MKL rounds it otherwise: fedflat.engine.gradients.hand)."""
    X, R = _rows(3, 16, 2), _rows(16, 8, 3)
    buffer = torch.empty(3 * 8 + 1)
    with ShapeRounding():
        fresh = X @ R
        shifted = torch.mm(X, R, out=buffer[1:].view(3, 8))
    assert not torch.equal(fresh, shifted)
