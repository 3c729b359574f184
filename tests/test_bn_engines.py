"""The engines agree on BatchNorm models (issue 47.6): the vectorized engine computes each client's batch statistics,
running statistics and gradients as the sequential engine does, to float rounding, step by step and over 5 rounds.

What a long run at a large learning rate shows beyond that (docs/models.md, "The vectorized engine") is the
training's sensitivity to rounding, which a one-ulp change of the initial model shows on one engine alone."""
from __future__ import annotations

from math import ceil

import pytest
import torch
from conftest import BATCH_NORM_CNN

import fedflat
from fedflat.core import Batch
from fedflat.engine.client import stack_batches
from fedflat.engine.compute import ComputeOptions
from fedflat.engine.client import Oracle
from fedflat.engine.simulation import Simulation
from fedflat.testing import ROUNDINGS_PER_STEP, U32


def _one_step(sim: Simulation, vectorized: bool, W: torch.Tensor, batch: Batch):
    oracle = Oracle(sim.model, ComputeOptions(engine="vectorized" if vectorized else "sequential"), sim.report.traits)
    start = sim.model.initial_buffers.expand(W.shape[0], -1).clone()
    with oracle.clients(list(range(W.shape[0])), 0, 0, start) as session:
        session.step(None)
        loss, grad = oracle.loss_grad(W, batch)
        return loss, grad, session.buffers.clone()


@pytest.mark.slow  # ~10 s on 2 busy cores (the CNN's vmap)
def test_one_step_of_a_batch_norm_cnn_gives_the_same_statistics_and_gradients(tiny):
    """Four clients, two with a short (padded) batch: every client's running mean and variance (momentum 0.1,
    unbiased variance), its loss and its gradient agree between the engines to a few float32 roundings."""
    sim = Simulation(tiny(*BATCH_NORM_CNN))
    gen = torch.Generator().manual_seed(0)
    picks = [torch.randperm(60, generator=gen)[:n] for n in (10, 10, 6, 3)]
    batch = stack_batches(sim.dataset.x_train, sim.dataset.y_train, picks, 10)
    W = sim.model.initial + 0.05 * torch.randn(4, sim.model.initial.numel(), generator=gen)
    (l0, g0, b0), (l1, g1, b1) = (_one_step(sim, v, W, batch) for v in (False, True))
    bound = ROUNDINGS_PER_STEP * U32
    assert (b1 - b0).abs().max() <= bound * b0.abs().max()
    assert (g1 - g0).abs().max() <= bound * g0.abs().max()
    torch.testing.assert_close(l1, l0, rtol=bound, atol=0)
    assert not torch.equal(b0, sim.model.initial_buffers.expand(4, -1).double())  # the statistics did move
    # each client's statistics are those of its own samples: the padded clients differ from the full ones
    assert not torch.equal(b0[2], b0[0]) and not torch.equal(b0[3], b0[2])


@pytest.mark.slow  # ~10 s
def test_a_batch_norm_cnn_trains_alike_on_both_engines_over_five_rounds(tiny):
    """Five rounds of clients with unequal step counts and short last batches: the final models agree to float32
    rounding of the steps taken (fedflat.testing's bound), and so do the evaluations and the federated buffers."""
    overrides = ("rounds=5", "train.batch_size=7", "train.local_epochs=2", *BATCH_NORM_CNN)
    runs = {e: fedflat.run(tiny(*overrides, f"engine={e}"), save=False, progress=False)
            for e in ("sequential", "vectorized")}
    seq, vec = runs["sequential"], runs["vectorized"]
    steps = 5 * 2 * ceil(180 / 7)  # rounds x epochs x batches of the largest possible client (all 180 samples)
    w = seq.final_parameters
    assert (vec.final_parameters - w).norm() <= ROUNDINGS_PER_STEP * U32 * steps * w.norm()
    for a, b in zip(seq.metrics, vec.metrics, strict=True):
        assert abs(a["test_loss"] - b["test_loss"]) <= ROUNDINGS_PER_STEP * U32 * steps * a["test_loss"]
    for name, tensor in seq.state_dict.items():
        if tensor.is_floating_point():
            bound = ROUNDINGS_PER_STEP * U32 * steps * max(1.0, tensor.abs().max().item())
            assert (vec.state_dict[name] - tensor).abs().max() <= bound, name
