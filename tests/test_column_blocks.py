"""FedWMSAM's and SCAFFOLD's round-level ``[K, P]`` work by column blocks: the personalized momenta,
SCAFFOLD's variates and their change bit for bit the whole-row expressions they replaced (elementwise operations, and ATen's
``sum(0)``, whose order its dispatch level fixes: run under each), the mean pseudo-gradient (a BLAS product) within
a sum's rounding of it, on rows longer than a block (the recipes' hash runs have shorter ones); FedAvg's mean
update and the round's drift, which make no ``[K, P]`` of updates at all."""
from __future__ import annotations

import pytest
import torch
from numerics import U32

from fedflat.algorithms import fedwmsam, scaffold
from fedflat.algorithms.fedavg import mean_update
from fedflat.algorithms.scaffold import COLUMN_BLOCK, column_blocks
from fedflat.core import MODEL, RoundContext
from fedflat.engine.server import drift_norms


def _rows(K: int, P: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g) for shape in ((K, P), (P,), (K, P), (P,)))


SIZES = [(1, 3), (3, 2 * COLUMN_BLOCK + 77), (10, 199_210), (50, 3 * COLUMN_BLOCK + 1), (10, 3 * COLUMN_BLOCK + 1),
         (7, COLUMN_BLOCK + 1), (50, 2 * COLUMN_BLOCK - 1)]


def test_the_blocks_cover_the_row_once_in_order():
    X = torch.empty(2, 3 * COLUMN_BLOCK + 5)
    covered = torch.cat([torch.arange(X.shape[1])[b] for b in column_blocks(X)])
    assert torch.equal(covered, torch.arange(X.shape[1])) and len(column_blocks(X)) == 3
    assert column_blocks(X[:, :10]) == [slice(0, None)]


@pytest.mark.parametrize("K, P", SIZES)
def test_the_personalized_momenta_are_the_whole_row_expressions_bits(K, P):
    c_i, c, _, m = _rows(K, P, K + P)
    a = torch.tensor(0.37)
    expected = torch.sub(c, c_i).mul_(a / (1 - a)).add_(m.expand(K, -1))
    assert torch.equal(fedwmsam.personalized_momentum(m.expand(K, -1), c, c_i, a), expected)


@pytest.mark.parametrize("K, P", SIZES)
def test_the_variates_and_their_change_are_the_whole_row_expressions_bits(K, P):
    c_i, c, w_final, w_start = _rows(K, P, 2 * K + P)
    steps, lr = torch.arange(K) + 3, 0.05
    drift = torch.sub(w_start, w_final).div_(steps.to(torch.float32)[:, None] * lr)
    expected = torch.sub(c_i, c).add_(drift)
    c_plus = scaffold.scaffold_client_variate(c_i, c, w_start, w_final, steps, lr)
    assert torch.equal(c_plus, expected)
    assert torch.equal(scaffold.variate_change(c_plus, c_i), (expected - c_i).sum(0))


class _Round:
    """The round context's entries the mean pseudo-gradient reads (fedflat.core.round.RoundContext's formulas)."""

    def __init__(self, K: int, P: int):
        deltas, _, _, _ = _rows(K, P, 3 * K + P)
        self.deltas, self.lr = deltas, 0.03
        self.steps = torch.arange(K) + 5
        self.weights = torch.rand(K, generator=torch.Generator().manual_seed(K)).double()
        self.weights /= self.weights.sum()
        self.settings = type("S", (), {"optimizer": type("O", (), {"plain": True})})()

    @property
    def pseudo_gradients(self) -> torch.Tensor:
        return torch.neg(self.deltas).div_(self.steps.to(self.deltas.dtype)[:, None] * self.lr)

    def aggregate(self, X: torch.Tensor) -> torch.Tensor:
        return self.weights.to(X.dtype) @ X


@pytest.mark.parametrize("K, P", SIZES)
def test_the_mean_pseudo_gradient_is_the_whole_row_expression_within_a_sums_rounding(K, P):
    """Block by block, ``weights @ G[:, b]`` is a BLAS product of another width than the whole row's, and the BLAS
    may sum a column in another order for another width (MKL picks its kernel by the CPU and the sizes): each entry
    within ``K u sum_i |p_i G_i|`` of the whole row's (a sum of K terms in any order, Higham's bound; one more u for
    the quotient before it, rounded alike in both)."""
    ctx = _Round(K, P)
    G = ctx.pseudo_gradients
    bound = (K + 1) * U32 * (ctx.weights.to(G.dtype).abs() @ G.abs())
    assert ((fedwmsam.mean_pseudo_gradient(ctx) - ctx.aggregate(G)).abs() <= bound).all()


def _context(K: int, P: int, weighting: str) -> RoundContext:
    """A round's context after its uploads: ``w^t``, every client's ``w_{i,E}`` and the aggregation's weights."""
    w_final, w, _, _ = _rows(K, P, 5 * K + P)
    settings = type("S", (), {"global_lr": 1.0})()
    ctx = RoundContext(round=0, lr=0.1, w=w, sampled=torch.arange(K), num_samples=torch.arange(K) + 7,
                       steps=torch.ones(K, dtype=torch.long), server={}, settings=settings,
                       uploads={MODEL: w_final})
    ctx.weights = torch.full((K,), 1.0 / K) if weighting == "uniform" else (ctx.num_samples / ctx.num_samples.sum())
    return ctx


@pytest.mark.parametrize("K, P", [*SIZES, (100, 1_919_234)])  # (the last: 100 clients of RoBERTa-base's LoRA)
@pytest.mark.parametrize("weighting", ["uniform", "samples"])
def test_the_mean_update_and_the_drift_make_no_deltas_and_keep_their_bits(K, P, weighting):
    """FedAvg's server step and the round's drift read Delta_i = w_{i,E} - w^t without a [K, P] of them, block by
    block and row by row: ``ctx.deltas.norm(dim=1)``'s bits, and ``ctx.aggregate(ctx.deltas)`` within a K-term sum's
    rounding (``weights @ block`` is a BLAS product of another width, which may sum a column in another order: the
    bound of the mean pseudo-gradient above; the same bits on the AMD EPYC of docs/benchmarks.md, not on a CPU that
    rounds by shape)."""
    ctx = _context(K, P, weighting)
    mean, drift = mean_update(ctx), drift_norms(ctx)
    assert not ctx.has_deltas  # (neither made the [K, P])
    D = ctx.deltas
    assert ((mean - ctx.aggregate(D)).abs() <= (K + 1) * U32 * (ctx.weights.to(D.dtype).abs() @ D.abs())).all()
    assert ctx.has_deltas
    assert torch.equal(drift, ctx.deltas.norm(dim=1))
    assert torch.equal(mean_update(ctx), ctx.aggregate(D)) and torch.equal(drift_norms(ctx), drift)  # (the cached deltas)
