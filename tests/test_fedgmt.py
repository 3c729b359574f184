"""FedGMT: the trajectory distillation's gradient against the reference codes' KLDivLoss formula, the EMA of the
global models, the ADMM duals on client and server by hand, and its traffic."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fedflat
from fedflat.algorithms import build_algorithm
from fedflat.algorithms.feddyn import CLIENT_DUAL, SERVER_DUAL
from fedflat.algorithms.fedgmt import TRAJECTORY
from fedflat.core import Batch, Distillation
from fedflat.engine.compute import ComputeOptions
from fedflat.engine.client import Oracle
from fedflat.engine.simulation import Simulation


def _reference(model, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor, teacher: torch.Tensor, gamma: float,
               tau: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The public codes' loss, ``CE + gamma tau^2 KLDivLoss(batchmean)(log_softmax(z/tau), softmax(z_e/tau))``, and
    its gradient by autograd on the flat vector."""
    w = w.detach().clone().requires_grad_(True)
    logits = model(w, x)
    with torch.no_grad():
        target = torch.softmax(model(teacher, x) / tau, dim=1)
    kl = torch.nn.KLDivLoss(reduction="batchmean")(F.log_softmax(logits / tau, dim=1), target)
    loss = F.cross_entropy(logits, y) + gamma * tau ** 2 * kl
    return F.cross_entropy(logits, y).detach(), torch.autograd.grad(loss, w)[0]


@pytest.mark.parametrize("vectorized", [False, True])
def test_the_distilled_gradient_is_the_reference_codes_loss_gradient(tiny, vectorized):
    sim = Simulation(tiny("algo=fedgmt"))
    oracle = Oracle(sim.model, ComputeOptions(engine="vectorized" if vectorized else "sequential"))
    P = sim.server.w.numel()
    gen = torch.Generator().manual_seed(1)
    W = sim.server.w + 0.3 * torch.randn(2, P, generator=gen).to(sim.device)  # CPU draws, on the run's device
    teacher = sim.server.w + 0.3 * torch.randn(P, generator=gen).to(sim.device)
    x, y = sim.dataset.x_train[:10].reshape(2, 5, 1, 4, 4), sim.dataset.y_train[:10].reshape(2, 5)
    distill = Distillation(teacher, weight=0.7, temperature=3.0)
    loss, grad = oracle.loss_grad(W, Batch(x, y), distill)
    for c in range(2):
        ce, g = _reference(sim.model, W[c], x[c], y[c], teacher, 0.7, 3.0)
        torch.testing.assert_close(loss[c], ce)  # the reported loss is the data loss
        torch.testing.assert_close(grad[c], g)
    # a padded row (weight 0) changes nothing
    pad = Batch(torch.cat([x, x[:, :1]], 1), torch.cat([y, y[:, :1]], 1),
                torch.cat([torch.ones(2, 5), torch.zeros(2, 1)], 1).to(sim.device))
    torch.testing.assert_close(oracle.loss_grad(W, pad, distill)[1], grad)
    # at the teacher the KL term is flat: the gradient is the plain loss gradient
    at_teacher = teacher.expand(2, -1).clone()
    torch.testing.assert_close(oracle.loss_grad(at_teacher, Batch(x, y), distill)[1],
                               oracle.loss_grad(at_teacher, Batch(x, y))[1])
    assert oracle.backprops == 4 * 2


def test_first_round_without_distillation_is_fedavg_plus_the_mean_dual(tiny):
    """Round 1, gamma = 0: clients have no dual yet, so they train as FedAvg's; the server adds
    -h/alpha = (1/N) sum_S Delta_i (K = 3 of N = 6 sampled: half the mean update) and moves the trajectory."""
    gmt = Simulation(tiny("algo=fedgmt", "algo.gamma=0", "rounds=1"))
    avg = Simulation(tiny("algo=fedavg", "rounds=1"))
    w0 = gmt.server.w.clone()
    gmt.run_round(0)
    avg.run_round(0)
    mean_delta = avg.server.w - w0
    torch.testing.assert_close(gmt.server.w, w0 + 1.5 * mean_delta)
    torch.testing.assert_close(-gmt.server.state[SERVER_DUAL] / 0.01, 0.5 * mean_delta)
    torch.testing.assert_close(gmt.server.state[TRAJECTORY], 0.95 * w0 + 0.05 * gmt.server.w)


def test_client_duals_sum_their_updates_and_shift_the_local_direction(tiny):
    sim = Simulation(tiny("algo=fedgmt", "algo.alpha=0.25", "rounds=3", "sampling.clients_per_round=4"))
    updates = {c: torch.zeros_like(sim.server.w) for c in range(6)}
    server_dual = torch.zeros_like(sim.server.w)
    for t in range(3):
        opened = sim.server.begin_round(t)
        result = sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state)
        for row, c in enumerate(result.ids.tolist()):
            updates[c] = updates[c] + result.upload["model"][row] - opened.broadcast.w
            server_dual = server_dual + (result.upload["model"][row] - opened.broadcast.w) / 6
        sim.server.finish_round(opened, result)
    state, known = sim.server.load_state(torch.arange(6))
    for c in range(6):
        if known[CLIENT_DUAL][c]:
            torch.testing.assert_close(-state[CLIENT_DUAL][c] / 0.25, updates[c])  # lambda_i = -h_i / alpha
    torch.testing.assert_close(-sim.server.state[SERVER_DUAL] / 0.25, server_dual)
    correction = sim.algorithm.parts["correction"]
    grad, h = torch.randn(2, 5), torch.randn(2, 5)

    class _Cohort:
        state = {CLIENT_DUAL: h}

    class _Context:
        settings = sim.settings
    loss, decay = correction.direction(_Context(), _Cohort(), 0, None, grad.clone())
    torch.testing.assert_close(loss, grad - h)  # no proximal term: the decay is the weight decay alone
    assert decay == sim.settings.weight_decay


def test_distillation_pulls_toward_the_trajectory(tiny):
    """The same run with the KL term weighted up ends closer to its trajectory (the term's purpose)."""
    gaps = []
    for gamma in ("0", "5"):
        sim = Simulation(tiny("algo=fedgmt", f"algo.gamma={gamma}", "algo.ema=0.5", "rounds=4"))
        for t in range(4):
            opened = sim.server.begin_round(t)
            result = sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state)
            gap = float((result.upload["model"] - sim.server.state[TRAJECTORY]).norm(dim=1).mean())  # to e^t
            sim.server.finish_round(opened, result)
        gaps.append(gap)
    plain, distilled = gaps
    assert distilled < 0.9 * plain


def test_one_backprop_per_step_and_no_trajectory_sent_without_distillation(tiny):
    """(Its traffic with the default gamma is checked with every method's in test_classical.)"""
    history = fedflat.run(tiny("algo=fedgmt", "algo.gamma=0", "rounds=1"), save=False, progress=False)
    assert history.metrics[0]["down_vectors"] == 1
    assert history.summary["backprops_per_step"] == 1


def test_bad_fedgmt_hyperparameters_are_clear_errors():
    from fedflat.algorithms import AlgorithmError
    with pytest.raises(AlgorithmError, match="algo.perturbation.ema"):
        build_algorithm({"name": "fedgmt", "ema": 1.0})
    with pytest.raises(AlgorithmError, match="algo.correction.alpha: Input should be greater than 0"):
        build_algorithm({"name": "fedgmt", "alpha": 0})
