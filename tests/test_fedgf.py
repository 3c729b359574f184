"""FedGF: the interpolated perturbation, the server's global perturbation and drift-adaptive weight c, and its
reduction to FedSAM."""
from __future__ import annotations

import pytest
import torch

import fedflat
from fedflat.algorithms import build_algorithm
from fedflat.algorithms.fedgf import GLOBAL_PERTURBATION, SEEN, WEIGHT, WINDOW, flatness_weight
from fedflat.core import ClientContext, normalize_rows
from fedflat.engine.runtime import make_cohort
from fedflat.engine.simulation import Simulation


def test_a_threshold_never_exceeded_is_fedsam_bit_for_bit(tiny):
    gf = fedflat.run(tiny("algo=fedgf", "algo.rho=0.05", "algo.threshold=1e9", "rounds=3"), save=False,
                     progress=False)
    sam = fedflat.run(tiny("algo=fedsam", "algo.rho=0.05", "rounds=3"), save=False, progress=False)
    assert torch.equal(gf.final_parameters, sam.final_parameters)
    assert [m["gf_c"] for m in gf.metrics] == [0.0, 0.0, 0.0]


def test_the_weight_is_the_share_of_the_last_w_rounds_above_the_threshold():
    window, seen = torch.zeros(3, dtype=torch.float64), 0
    cs = []
    for divergence in (0.5, 0.1, 0.5, 0.5, 0.1, 0.1, 0.1):
        window, c = flatness_weight(window, seen, divergence, threshold=0.3)
        seen += 1
        cs.append(c)
    assert cs == pytest.approx([1, 1 / 2, 2 / 3, 2 / 3, 2 / 3, 1 / 3, 0])


def test_server_builds_the_global_perturbation_and_c_from_the_round(tiny):
    sim = Simulation(tiny("algo=fedgf", "algo.rho=0.05", "algo.rho_g=0.2", "algo.threshold=0", "rounds=2"))
    w0 = sim.server.w.clone()
    opened = sim.server.begin_round(0)
    result = sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state)
    divergence = (result.upload["model"] - w0).norm(dim=1).mean()
    sim.server.finish_round(opened, result)
    step = w0 - sim.server.w
    torch.testing.assert_close(sim.server.state[GLOBAL_PERTURBATION], 0.2 * step / step.norm())
    state = sim.server.state
    assert float(state[WEIGHT]) == 1.0 and int(state[SEEN]) == 1 and float(state[WINDOW][0]) == 1.0
    assert sim.server.last_round.log["gf_divergence"] == pytest.approx(float(divergence))


def test_the_client_perturbation_interpolates_global_and_local(tiny):
    sim = Simulation(tiny("algo=fedgf", "algo.rho=0.05", "rounds=2"))
    sim.run_round(0)
    opened = sim.server.begin_round(1)
    broadcast = opened.broadcast
    broadcast.server[WEIGHT] = torch.tensor(0.3, device=sim.device)  # any c in (0, 1)
    ctx = ClientContext.of(broadcast, sim.settings, sim.oracle, sim.batches)
    cohort = make_cohort(opened.task, broadcast, sim.server.load_state, sim.device)
    W = broadcast.w + 0.01 * torch.randn(cohort.size, broadcast.w.numel(),
                                         generator=torch.Generator().manual_seed(0)).to(sim.device)
    picks = [s[0] for s in sim.batches.schedules(1, cohort.ids.tolist(), cohort.steps.tolist())]
    batch = sim.batches.batch(picks, None)
    eps = sim.algorithm.parts["perturbation"].perturb(ctx, cohort, 0, W, batch)
    _, g = sim.oracle.loss_grad(W, batch)
    target = broadcast.w + broadcast.server[GLOBAL_PERTURBATION]  # w~_g
    expected = 0.3 * (target - W) + 0.7 * normalize_rows(g, 0.05)
    torch.testing.assert_close(eps, expected)


def test_fedgf_declares_its_traffic_and_backprops():
    algo = build_algorithm({"name": "fedgf"})
    assert algo.backprops_per_step == 2 and algo.parts["perturbation"].sends == (GLOBAL_PERTURBATION, WEIGHT)
