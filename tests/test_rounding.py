"""tests/rounding.py's CPU that rounds by shape: its premises about ATen's kernels, and that it tells apart what it
should.

The premises are properties of ATen's code, which chooses a kernel by the dispatch level and not by the CPU model:
run under each level (``ATEN_CPU_CAPABILITY=default``, ``avx2``, ``avx512``) they cover every x86 CPU."""
from __future__ import annotations

import pytest
import torch
from rounding import ShapeRounding, lead

ROW_LENGTHS = [*range(1, 40), 63, 64, 65, 163, 1000, 4099]


def _rows(C: int, n: int, seed: int) -> torch.Tensor:
    return torch.randn(C, n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("op", [lambda x: torch.log_softmax(x, -1), lambda x: torch.softmax(x, -1),
                                lambda x: torch.logsumexp(x, -1, keepdim=True),
                                lambda x: torch.linalg.vector_norm(x, dim=-1, keepdim=True),
                                lambda x: x.sum(-1, keepdim=True), lambda x: x.mean(-1, keepdim=True)])
def test_the_row_wise_kernels_round_a_row_alike_in_any_count_of_rows(op):
    """A reduction over the last dimension gives each row of ``[C, n]`` the bits of that row alone, ``[1, n]``, on
    this dispatch level (every remainder of the vector loops)."""
    for n in ROW_LENGTHS:
        for C in (2, 3, 7):
            X = _rows(C, n, 31 * n + C)
            whole = op(X)
            for c in range(C):
                assert torch.equal(whole[c:c + 1], op(X[c:c + 1].clone())), (n, C, c)


def test_a_reduction_that_keeps_the_first_dimension_reduces_each_slice_alike():
    """A norm or sum over an inner dimension of ``[C, a, b]`` views inside ``[C, P]`` rows (a layer's weights in
    every client's flat vector, FedSOL's per-tensor normalization) gives each client's slice the bits of that
    client alone."""
    for a, b in ((8, 16), (3, 8), (200, 784), (5, 1)):
        P = a * b + 13
        for C in (2, 5):
            X = _rows(C, P, a + b + C)
            views = X[:, 7:7 + a * b].view(C, a, b)
            for op in (lambda v: torch.linalg.vector_norm(v, dim=1, keepdim=True), lambda v: v.sum(1),
                       lambda v: v.mean((1, 2))):
                whole = op(views)
                for c in range(C):
                    assert torch.equal(whole[c:c + 1], op(views[c:c + 1])), (a, b, C, c)


def test_lead_says_which_dimensions_a_calls_rounding_may_not_depend_on():
    aten = torch.ops.aten
    X = torch.randn(4, 5, 6)
    assert lead("mm", (X[0], X[0].t()), {}) == 0  # a product: every shape counts
    assert lead("exp", (X,), {}) == 0  # an entry's place in the vector loop counts (sigmoid's does on AVX2)
    assert lead("linalg_vector_norm", (X, 2, [-1], True), {}) == 2
    assert lead("linalg_vector_norm", (X, 2, [1], True), {}) == 1
    assert lead("sum", (X, [0]), {}) == 0
    assert lead("_log_softmax_backward_data", (X, X, 2, torch.float32), {}) == 2
    assert lead("linalg_vector_norm", (X.transpose(1, 2), 2, [-1], True), {}) == 1  # last dim not contiguous
    assert aten.mm  # (the names are aten's overload packets')


def test_it_moves_a_product_by_its_row_count_and_nothing_else():
    """Under ShapeRounding a cohort's product ``[6, n] @ [n, k]`` gives its first rows other bits than the same rows'
    ``[2, n] @ [n, k]``, by one unit in the last place at most; the same call twice gives the same bits; an
    elementwise sum is left alone."""
    X, R = _rows(6, 16, 0), _rows(16, 8, 1)
    with ShapeRounding() as cpu:
        cohort, alone, again = X @ R, X[:2] @ R, X[:2] @ R
        added = X + 1
    assert torch.equal(alone, again) and not torch.equal(cohort[:2], alone)
    plain = X[:2] @ R
    ulp = torch.nextafter(plain.abs(), torch.full_like(plain, float("inf"))) - plain.abs()
    assert ((alone - plain).abs() <= ulp).all() and torch.equal(added, X + 1)
    assert cpu.calls == {"mm": 3}
