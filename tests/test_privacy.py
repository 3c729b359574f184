"""Client-level differential privacy and compressed uploads (the upload path, fedflat.core.upload).

Every privacy claim is checked against dp-accounting's own computation or against a distribution, never against
fedflat's own code: the accountant's epsilon against dp-accounting's API called here, the calibrated noise against
its target, the noise's spread against the chi-square distribution, QSGD against its paper's unbiasedness and
variance bound, DP-FedSAM's round against a hand computation.
"""
from __future__ import annotations

import copy
import math
from dataclasses import replace

import dp_accounting as dpa
import numpy as np
import pytest
import torch
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant
from scipy.stats import chi2

import fedflat
from fedflat.algorithms import build_algorithm
from fedflat.algorithms.compression import qsgd_levels, top_k
from fedflat.core import SERVER, ConfigError, RoundContext, TrainSettings, torch_stream
from fedflat.core.upload import release_norms
from fedflat.engine.simulation import Simulation
from fedflat.experiments.resume import resume
from fedflat.privacy import CLIP, GaussianMechanism, GaussianParams, Mechanism, calibrate, epsilon, secure_normal

from agreement import assert_identical, bitwise, trajectory
from conftest import tiny_tree
from test_sam_family import FULL_BATCH, STEPS, Hand, _sampled

DP = ("privacy.clip=0.5", "privacy.noise_multiplier=1.0")


def test_privacy_is_one_package_whose_torch_modules_load_on_first_use():
    """fedflat.privacy's surface: every name it exports resolves; the `dp` stage the methods register and the config's
    `privacy` section are the package's; importing it (the config does) loads no torch until a torch name is read."""
    import subprocess
    import sys

    import fedflat.privacy as privacy
    from fedflat.config import Config, PrivacyConfig
    from fedflat.core import STAGES

    assert all(getattr(privacy, name) is not None for name in privacy.__all__)
    assert STAGES["dp"] is privacy.GaussianMechanism and PrivacyConfig is privacy.PrivacyConfig
    assert Config.model_fields["privacy"].annotation == PrivacyConfig | None
    code = ("import sys, fedflat.privacy as p; p.PrivacyLedger; print('torch' in sys.modules); p.GaussianMechanism; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]


# -- the accountant, against dp-accounting's own API -----------------------------------------------------------------
@pytest.mark.parametrize("q_clients, z, rounds", [(10, 1.1, 30), (25, 0.8, 7)])
def test_epsilon_equals_dp_accountings_rdp_for_poisson_sampling(q_clients, z, rounds):
    delta = 1e-3
    accountant = RdpAccountant()  # add/remove-one: one client's clipped update moves the sum by C
    accountant.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q_clients / 100, dpa.GaussianDpEvent(z)),
                                               rounds))
    ours = epsilon(Mechanism("poisson", 100, q_clients, z), rounds, delta)
    assert ours == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)


def test_epsilon_equals_dp_accountings_rdp_for_fixed_size_sampling():
    """K of N without replacement, replace-one adjacency: one client's update replaced moves the sum by up to 2C, so
    the Gaussian's multiplier relative to that sensitivity is z / 2."""
    delta, z, rounds = 1e-2, 1.5, 20
    accountant = RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dpa.SelfComposedDpEvent(
        dpa.SampledWithoutReplacementDpEvent(50, 5, dpa.GaussianDpEvent(z / 2)), rounds))
    ours = epsilon(Mechanism("fixed", 50, 5, z), rounds, delta)
    assert ours == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)


def test_epsilon_equals_dp_accountings_pld_for_poisson_sampling():
    delta, z, rounds = 1e-3, 1.0, 10
    accountant = PLDAccountant()
    accountant.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(z)), rounds))
    ours = epsilon(Mechanism("poisson", 100, 10, z, accountant="pld"), rounds, delta)
    assert ours == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)
    assert ours < epsilon(Mechanism("poisson", 100, 10, z), rounds, delta)  # PLD is the tighter accountant


def test_local_dp_spends_a_gaussian_mechanism_per_participation():
    delta, z = 1e-3, 3.0
    accountant = RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dpa.SelfComposedDpEvent(dpa.GaussianDpEvent(z / 2), 4))
    assert epsilon(Mechanism("fixed", 10, 2, z, mode="local"), 4, delta) == pytest.approx(
        accountant.get_epsilon(delta), rel=1e-12)


def exact_gaussian_epsilon(multiplier: float, delta: float) -> float:
    """The Gaussian mechanism's exact epsilon at ``delta`` for noise std ``multiplier`` times the sensitivity, from
    Balle & Wang (ICML 2018, Theorem 8): delta(eps) = Phi(-eps s + 1/(2s)) - e^eps Phi(-eps s - 1/(2s)), solved for
    eps (delta decreases in eps)."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    s = multiplier
    def excess(eps: float) -> float:
        return norm.cdf(-eps * s + 1 / (2 * s)) - math.exp(eps) * norm.cdf(-eps * s - 1 / (2 * s)) - delta
    return brentq(excess, 0.0, 500.0, xtol=1e-13)


@pytest.mark.parametrize("z, releases, delta", [(3.0, 6, 0.05), (1.2, 1, 1e-5), (5.0, 40, 1e-3)])
def test_local_dp_with_pld_is_one_exact_gaussian_as_dp_accounting_computes_it(z, releases, delta):
    """A client's ``n`` releases under local DP, each N(0, z^2 C^2) on a release of sensitivity 2C (replace-one),
    compose exactly into one Gaussian of multiplier z / (2 sqrt(n)). PLD's epsilon is dp-accounting's PLD of that
    event (replace-one, whose pair N(-1, s^2), N(1, s^2) holds the factor 2: Gaussian(z); or add/remove-one with
    Gaussian(z / 2)), and the exact one: dp-accounting's analytic Gaussian and Balle & Wang's formula. (The audit's
    case, z = 3, 6 releases, delta 0.05: 3.342, where counting the 2C twice gave 9.905 and RDP gives 4.160.)"""
    from dp_accounting import gaussian_mechanism

    ours = epsilon(Mechanism("fixed", 10, 2, z, mode="local", accountant="pld"), releases, delta)
    replace_one = PLDAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    replace_one.compose(dpa.GaussianDpEvent(z), releases)
    add_remove = PLDAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    add_remove.compose(dpa.GaussianDpEvent(z / 2), releases)
    assert ours == pytest.approx(replace_one.get_epsilon(delta), rel=1e-12)
    assert ours == pytest.approx(add_remove.get_epsilon(delta), rel=1e-9)
    # dp-accounting's PLD rounds each privacy loss up to its 1e-4 grid (pessimistic): epsilon is the exact one or
    # above it by at most about one grid step; the analytic values agree with each other to their 1e-12 searches
    exact = exact_gaussian_epsilon(z / (2 * math.sqrt(releases)), delta)
    assert gaussian_mechanism.get_epsilon_gaussian(z / (2 * math.sqrt(releases)), delta) == pytest.approx(exact,
                                                                                                          abs=1e-9)
    assert exact - 1e-9 <= ours <= exact + 2e-4
    assert ours < epsilon(Mechanism("fixed", 10, 2, z, mode="local"), releases, delta)  # RDP: a looser bound
    if (z, releases, delta) == (3.0, 6, 0.05):
        assert round(ours, 3) == 3.342


def test_local_dp_pld_calibration_is_the_exact_gaussians_noise():
    """``target_epsilon`` under local DP and PLD: the calibrated z is the exact Gaussian's (dp-accounting's
    ``get_sigma_gaussian``, times 2 sqrt(n)) to the search's 1e-4 in z, and spends at most the target and within
    1% of it by Balle & Wang's formula."""
    from dp_accounting import gaussian_mechanism

    releases, delta, target = 6, 0.05, 4.0
    z = calibrate(Mechanism("fixed", 10, 2, 1.0, mode="local", accountant="pld"), releases, delta, target)
    exact = gaussian_mechanism.get_sigma_gaussian(target, delta) * 2 * math.sqrt(releases)
    assert z == pytest.approx(exact, abs=2e-3)  # Brent's 1e-4 in z, on PLD's grid a hair above the exact epsilon
    assert target * 0.99 <= exact_gaussian_epsilon(z / (2 * math.sqrt(releases)), delta) <= target


def test_a_pld_calibration_beyond_its_grid_is_refused_in_seconds_saying_what_to_change():
    """One round at target epsilon 100 needs z near 0.08, where one PLD evaluation takes a grid of millions of
    points (the search ran past 7 minutes without a word): refused after RDP's calibration (seconds), naming the
    accountant and the target; local DP likewise, its bound on the one Gaussian of all releases."""
    import time

    start = time.monotonic()
    with pytest.raises(ValueError, match=r"target_epsilon=100 over 1 round.*privacy.accountant=rdp.*target_epsilon"):
        calibrate(Mechanism("poisson", 100, 10, 1.0, accountant="pld"), 1, 1e-2, 100.0)
    with pytest.raises(ValueError, match=r"over 4 release\(s\) of one client.*z below 1"):
        calibrate(Mechanism("fixed", 10, 2, 1.0, mode="local", accountant="pld"), 4, 1e-2, 60.0)
    assert time.monotonic() - start < 120  # RDP's calibrations: about 2 s each on an idle core


def test_dp_sgd_with_pld_is_refused_saying_why():
    """DP-SGD samples each step's batch without replacement; dp-accounting's PLD accountant has no event for it,
    so a config asking for it is refused (it was silently accounted with RDP)."""
    from fedflat.privacy import PrivacyConfig

    with pytest.raises(ValueError, match="without replacement.*privacy.accountant=rdp"):
        PrivacyConfig(level="instance", noise_multiplier=1.0, accountant="pld")
    with pytest.raises(ValueError, match="without replacement"):
        Mechanism("fixed", 6, 3, 1.0, accountant="pld", level="instance", dataset_size=20, batch_size=5).fresh()


def test_local_dp_calibrates_to_its_most_sampled_clients_releases(tiny):
    """Local DP spends per release and the run reports its most-sampled client: z is calibrated to that client's
    releases in the run's own sampling (counted here from the clients the server samples), so the run ends at its
    target, within 1%, with less noise than calibrating to every round would add; its epsilon is dp-accounting's
    RDP of Gaussian(z / 2) composed that many times."""
    rounds, target, delta = 10, 4.0, 1 / 6
    cfg = tiny("privacy.mode=local", "privacy.clip=0.5", f"privacy.target_epsilon={target}", f"rounds={rounds}",
               "sampling.clients_per_round=2")
    sim = Simulation(cfg)
    counts = torch.zeros(6, dtype=torch.long)
    for t in range(rounds):
        counts[sim.server.sample_clients(t)] += 1
    most = int(counts.max())
    assert most < rounds
    history = fedflat.run(cfg, save=False, progress=False)
    z = history.config["privacy"]["noise_multiplier"]
    accountant = RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
    accountant.compose(dpa.GaussianDpEvent(z / 2), most)
    assert history.summary["epsilon"] == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)
    assert target * 0.99 <= history.summary["epsilon"] <= target
    assert z < calibrate(Mechanism("fixed", 6, 2, 1.0, mode="local"), rounds, delta, target)


@pytest.mark.slow  # dp-accounting's calibration: a Brent search over z, ~20 RDP curves each
def test_the_calibrated_noise_spends_at_most_the_target_and_within_one_percent():
    mechanism = Mechanism("poisson", 200, 20, 1.0)
    for target in (2.0, 8.0):
        z = calibrate(mechanism, 40, 1 / 200, target)
        spent = epsilon(replace(mechanism, noise_multiplier=z), 40, 1 / 200)
        assert target * 0.99 <= spent <= target


@pytest.mark.slow  # a PLD calibration: a dozen PLD compositions, ~10 s each on a busy core
def test_pld_calibration_spends_at_most_the_target_within_one_percent_in_little_memory():
    """PLD's target: dp-accounting's own PLD accountant, called here on the calibrated z, spends at most the target
    and within 1% of it; the search allocates at most 300 MB (tracemalloc sees NumPy's buffers; a bracket starting
    at z = 1e-3 asked for tens of GiB)."""
    import tracemalloc

    mechanism, rounds, delta, target = Mechanism("poisson", 100, 10, 1.0, accountant="pld"), 5, 1e-2, 2.0
    tracemalloc.start()
    try:
        z = calibrate.__wrapped__(mechanism, rounds, delta, target)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    accountant = PLDAccountant()
    accountant.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(z)), rounds))
    spent = accountant.get_epsilon(delta)
    assert target * 0.99 <= spent <= target
    assert peak < 300e6, f"the PLD calibration allocated {peak / 1e6:.0f} MB"


def test_unconverged_rdp_orders_are_said_where_they_make_epsilon_conservative(caplog):
    """dp-accounting's fractional-order series does not converge below order ~1.7 at q = 0.1: where the best order
    left is the smallest (large epsilon) a warning names the orders and the tighter accountant; where the best
    order is above them, nothing. The epsilon itself stays dp-accounting's."""
    import logging

    from fedflat.privacy import unconverged_orders

    large = Mechanism("poisson", 100, 10, 0.5)
    assert unconverged_orders(large)[:3] == (1.1, 1.2, 1.3)
    with caplog.at_level(logging.WARNING, logger="fedflat.privacy.accounting"):
        eps = epsilon(large, 50, 1e-3)
    accountant = RdpAccountant()
    accountant.compose(dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.1, dpa.GaussianDpEvent(0.5)), 50))
    assert eps == pytest.approx(accountant.get_epsilon(1e-3), rel=1e-12)
    said = [r.getMessage() for r in caplog.records if r.name == "fedflat.privacy.accounting"]
    assert len(said) == 1 and "does not converge at orders 1.1, 1.2" in said[0] and "accountant=pld" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fedflat.privacy.accounting"):
        epsilon(Mechanism("poisson", 100, 10, 1.5), 50, 1e-3)  # best order well above 1.7
    assert not [r for r in caplog.records if r.name == "fedflat.privacy.accounting"]


@pytest.mark.slow  # a calibration, then the run
def test_a_run_calibrates_to_its_target_and_records_epsilon_every_round(tiny):
    cfg = tiny("sampling.participation=bernoulli", "privacy.clip=0.5", "privacy.target_epsilon=6", "rounds=4")
    history = fedflat.run(cfg, save=False, progress=False)
    z = history.config["privacy"]["noise_multiplier"]
    mechanism = Mechanism("poisson", 6, 3, z)
    assert [m["epsilon"] for m in history.metrics] == pytest.approx(
        [epsilon(mechanism, t, 1 / 6) for t in (1, 2, 3, 4)], rel=1e-12)
    assert 6 * 0.99 <= history.summary["epsilon"] <= 6
    assert history.summary["privacy"]["sampling"].startswith("Poisson sampling")


def test_a_run_that_reaches_its_budget_ends_with_budget_spent_and_is_a_finished_sweep_cell(tiny, tmp_path):
    """z given, target_epsilon the budget: a run asked for 4 rounds stops before the third, whose epsilon would
    exceed what two rounds spend."""
    budget = epsilon(Mechanism("poisson", 6, 3, 1.0), 2, 1 / 6)
    cfg = tiny("sampling.participation=bernoulli", *DP, f"privacy.target_epsilon={budget!r}", "rounds=4")
    history = fedflat.run(cfg, out=tmp_path, progress=False)
    assert history.summary["status"] == "budget spent"
    assert history.summary["rounds"] == 2 and history.summary["epsilon"] == budget
    assert "round 3 would reach epsilon" in history.summary["reason"]
    from fedflat.experiments.rundir import FINISHED
    assert "budget spent" in FINISHED


# -- the mechanism -----------------------------------------------------------------------------------------------------
def _round_context(P: int, K: int, C: float, round: int = 0, seed: int = 0) -> RoundContext:
    settings = TrainSettings(weight_decay=0.0, clip=None, batch_size=1, global_lr=1.0, num_clients=K, seed=seed)
    return RoundContext(round=round, lr=0.1, w=torch.zeros(P), sampled=torch.arange(K),
                        num_samples=torch.ones(K, dtype=torch.long), steps=torch.ones(K, dtype=torch.long),
                        server={CLIP: torch.tensor(C, dtype=torch.float64)}, settings=settings)


def test_every_clipped_release_has_norm_at_most_c():
    """Random releases of every scale, two entries each (the model's and a method's own): after the clip, each
    client's joint norm is at most C up to float32 rounding of the scaled entries (relative 2^-23)."""
    stage = GaussianMechanism(GaussianParams(clip=0.7, noise_multiplier=0.0))
    generator = torch.Generator().manual_seed(0)

    class Rows:
        ids = torch.arange(8)
        upload: dict = {}
    for trial in range(200):
        scale = 10 ** torch.empty(8, 1).uniform_(-3, 3, generator=generator)
        release = {"model": torch.randn(8, 50, generator=generator) * scale,
                   "scaffold.dc": torch.randn(8, 50, generator=generator) * scale}
        ctx = type("Ctx", (), {"server": {CLIP: torch.tensor(0.7, dtype=torch.float64)}})()
        clipped = stage.client(ctx, Rows(), release)
        norms, before = release_norms(clipped), release_norms(release)
        assert (norms <= 0.7 * (1 + 2 ** -23)).all()
        small = before <= 0.7
        assert torch.equal(clipped["model"][small], release["model"][small])  # within the bound: untouched


def test_central_noise_has_std_z_c_by_the_chi_square_distribution():
    """The server's noise on a zero release of K clients: m * (released mean) is N(0, (z C)^2) per entry; the sum of
    squares over n draws divided by (z C)^2 is chi-square with n degrees of freedom, checked between its 1e-6 and
    1 - 1e-6 quantiles (a correct sampler fails with probability 2e-6)."""
    z, C, K, P, m = 1.3, 0.4, 4, 5000, 4.0
    stage = GaussianMechanism(GaussianParams(clip=C, noise_multiplier=z, expected_clients=m))
    draws = []
    for round in range(20):
        released = stage.server(_round_context(P, K, C, round), {"model": torch.zeros(K, P)})
        assert torch.equal(released["model"][0], released["model"][-1])  # every row is the one private mean
        draws.append(released["model"][0].double() * m)
    statistic = (torch.cat(draws).square().sum() / (z * C) ** 2).item()
    n = 20 * P
    assert chi2.ppf(1e-6, n) <= statistic <= chi2.isf(1e-6, n)


def test_the_central_mean_is_computed_once_and_every_row_is_it():
    """The server releases (sum_i x_i + N(0, z^2 C^2 I)) / m once: every row of every entry is that one tensor (a
    view, no K copies), equal to the formula with the same noise, and the model the method reads is w + it, added
    once (fedflat.core.upload.upload_of)."""
    from fedflat.core.upload import upload_of
    from fedflat.privacy.stage import gaussian_like

    z, C, K, P, m = 0.8, 0.5, 5, 40, 4.0
    stage = GaussianMechanism(GaussianParams(clip=C, noise_multiplier=z, expected_clients=m))
    generator = torch.Generator().manual_seed(1)
    release = {"model": torch.randn(K, P, generator=generator), "scaffold.dc": torch.randn(K, 3, generator=generator)}
    ctx = _round_context(P, K, C, round=2, seed=5)
    released = stage.server(ctx, release)
    noise = gaussian_like(release, z * C, torch_stream(5, 2, SERVER, "privacy", torch.device("cpu")))
    for name, rows in released.items():
        assert rows.stride(0) == 0 and rows.shape == release[name].shape  # one row seen K times
        assert torch.equal(rows[0], (release[name].sum(0) + noise[name]) / m)
    w = torch.randn(P, generator=generator)
    model = upload_of(released, w, {})["model"]
    assert model.stride(0) == 0 and torch.equal(model[3], w + released["model"][0])
    assert torch.equal(model, w + released["model"].contiguous())  # the K-fold sum's numbers, computed once


def test_secure_noise_is_standard_normal_and_not_reproducible():
    a, b = secure_normal((200_000,), torch.float64, "cpu"), secure_normal((200_000,), torch.float64, "cpu")
    assert not torch.equal(a, b)
    statistic = a.square().sum().item()
    assert chi2.ppf(1e-6, a.numel()) <= statistic <= chi2.isf(1e-6, a.numel())
    assert abs(a.mean().item()) <= 5.4 / math.sqrt(a.numel())  # |N(0, 1/n)| beyond 5.4 sigma: p < 1e-7


def test_a_secure_run_differs_from_a_keyed_one_and_from_itself(tiny):
    keyed = fedflat.run(tiny(*DP), save=False, progress=False).final_parameters
    secure = [fedflat.run(tiny(*DP, "privacy.noise=secure"), save=False, progress=False).final_parameters
              for _ in range(2)]
    assert not torch.equal(keyed, secure[0]) and not torch.equal(secure[0], secure[1])


def test_a_method_that_reads_each_upload_is_refused_under_central_dp_naming_what_it_reads(tiny):
    with pytest.raises(ConfigError, match=r"correction 'wmsam': computes each client's variate c_i"):
        tiny("algo=fedwmsam", *DP)
    with pytest.raises(ConfigError, match=r"aggregation 'fedawa'"):
        tiny("algo=fedawa", *DP)
    assert tiny("algo=fedwmsam", *DP, "privacy.mode=local").privacy.mode == "local"


def test_bad_privacy_settings_say_what_to_do(tiny):
    with pytest.raises(ConfigError, match="set noise_multiplier"):
        tiny("privacy.clip=1.0")
    with pytest.raises(ConfigError, match="compress under privacy.mode=central"):
        tiny(*DP, "privacy.mode=local", "compression.name=topk")
    with pytest.raises(ConfigError, match="sampling.participation=bernoulli"):
        tiny(*DP, "privacy.accountant=pld")
    with pytest.raises(ConfigError, match="buffers"):
        Simulation(tiny(*DP, "model=cnn", "model.norm=batch", "data.options.shape=[1,8,8]", "model.padding=2"))


# -- DP-FedSAM by hand -------------------------------------------------------------------------------------------------
def test_dpfedsam_round_by_hand(tiny):
    """Local ASAM steps (eps = rho |w| (|w| g) / || |w| g ||), each update clipped to C, N(0, z^2 C^2) on the sum from
    the server's keyed stream, the sum over m = K: the engine's two rounds against this computation."""
    rho, C, z = 0.3, 0.05, 0.7
    sim = Simulation(tiny(*FULL_BATCH, "algo=dpfedsam", f"algo.rho={rho}", f"privacy.clip={C}",
                          f"privacy.noise_multiplier={z}"))
    hand, K = Hand(sim), sim.cfg.sampling.clients_per_round
    w = sim.server.w.clone()
    for t in range(2):
        lr = sim.server.lr_at(t)

        def asam(k, wk, i):
            scaled = wk.abs() * hand.grad(wk, i)
            return rho * wk.abs() * scaled / (scaled.norm() + 1e-12)
        deltas = torch.stack([hand.local(w, i, lr, perturb=lambda k, wk, i=i: asam(k, wk, i)) - w
                              for i in _sampled(sim, t)])
        clipped = deltas * torch.clamp(C / deltas.double().norm(dim=1), max=1.0).float()[:, None]
        noise = torch.randn(w.numel(), generator=torch_stream(sim.cfg.seed, t, SERVER, "privacy", sim.device),
                            device=sim.device) * (z * C)  # the server's stream on the run's device, as the engine draws
        w = w + (clipped.sum(0) + noise) / K
    for t in range(2):
        sim.run_round(t)
    torch.testing.assert_close(sim.server.w, w, rtol=2e-5, atol=2e-6)
    assert STEPS == 3


# -- compression ------------------------------------------------------------------------------------------------------
def test_top_k_keeps_exactly_the_k_largest_entries():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(5, 300, generator=generator)
    index = top_k(x, 17)
    for row in range(5):
        expected = set(np.argsort(-np.abs(x[row].numpy()))[:17].tolist())
        assert set(index[row].tolist()) == expected


def test_topk_uploads_k_values_and_indices_and_the_server_rebuilds_the_sparse_update(tiny):
    sim = Simulation(tiny("compression.name=topk", "compression.ratio=0.1"))
    P = sim.num_parameters
    k = math.ceil(0.1 * P)
    result = sim.run_round(0)
    assert result.up_bytes == 8 * k + 4  # float32 values, int32 indices, the training loss
    dense = Simulation(tiny()).run_round(0)
    assert dense.up_bytes == 4 * P + 4


def test_error_feedback_keeps_what_was_not_sent(tiny):
    """With a ratio of 1 nothing is left out: error feedback's residual is zero and the run is FedAvg's."""
    plain = fedflat.run(tiny(), save=False, progress=False).final_parameters
    full = fedflat.run(tiny("compression.name=topk", "compression.ratio=1.0", "compression.error_feedback=true"),
                       save=False, progress=False).final_parameters
    torch.testing.assert_close(full, plain, rtol=0, atol=1e-6)


def test_qsgd_is_unbiased_with_the_variance_its_paper_bounds():
    """Alistarh et al. 2017, Lemma 3.1: E[Q(x)] = x and E||Q(x) - x||^2 <= min(P/s^2, sqrt(P)/s) ||x||^2. Each entry of
    Q(x) lies in an interval of width ||x|| / s, so over R draws its mean is within ||x|| / s * sqrt(ln(2P/1e-6) / 2R)
    of E[Q(x)] for every entry with probability 1 - 1e-6 (Hoeffding, union bound); the exact variance of stochastic
    rounding, sum_j (||x||/s)^2 p_j (1 - p_j), is within the bound."""
    P, s, R = 400, 4, 4000
    x = torch.randn(1, P, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    n = x.norm().item()
    total = torch.zeros(P, dtype=torch.float64)
    errors = []
    for r in range(R):
        norm, levels = qsgd_levels(x, s, [torch_stream(0, r, 0, "qsgd")])
        q = norm[0] * levels[0].double() / s
        total += q
        errors.append((q - x[0]).square().sum().item())
    assert (total / R - x[0]).abs().max().item() <= n / s * math.sqrt(math.log(2 * P / 1e-6) / (2 * R))
    p = s * x[0].abs() / n - (s * x[0].abs() / n).floor()
    exact = ((n / s) ** 2 * p * (1 - p)).sum().item()
    assert exact <= min(P / s ** 2, math.sqrt(P) / s) * n ** 2
    width = P * (n / s) ** 2  # one draw's squared error lies in [0, P (||x||/s)^2]
    assert abs(np.mean(errors) - exact) <= width * math.sqrt(math.log(2 / 1e-6) / (2 * R))


def test_qsgd_sends_a_norm_and_int8_levels(tiny):
    sim = Simulation(tiny("compression.name=qsgd", "compression.levels=8"))
    assert sim.run_round(0).up_bytes == sim.num_parameters + 4 + 4  # levels, the norm, the training loss


# -- every engine and executor, resume -----------------------------------------------------------------------------
STAGED = [(*DP,), (*DP, "privacy.mode=local"), (*DP, "privacy.adaptive=true", "privacy.count_noise=1.0"),
          ("compression.name=topk", "compression.ratio=0.2", "compression.error_feedback=true"),
          ("compression.name=qsgd",), ("algo=dpfedsam-topk",)]


@pytest.mark.parametrize("options", STAGED, ids=lambda o: "-".join(x.split("=")[-1] for x in o))
def test_threads_give_the_local_executors_numbers(tiny, options):
    options = bitwise(*options)  # on CUDA the sequential engine: the bits of the vectorized one depend on the chunk
    local = Simulation(tiny(*options, "algo=scaffold" if "algo=dpfedsam-topk" not in options else "rounds=3"))
    threads = Simulation(tiny(*options, *(("algo=scaffold",) if "algo=dpfedsam-topk" not in options else ()),
                              "executor=threads", "executor.workers=2"))
    assert trajectory(local, 3) == trajectory(threads, 3)
    assert_identical(local, threads)


@pytest.mark.parametrize("options", [DP, ("compression.name=qsgd",)], ids=["dp", "qsgd"])
def test_the_vectorized_engine_gives_the_sequential_engines_numbers(tiny, options):
    """The clip's norms, the noise's streams and QSGD's draws are per client: the same on a chunk of one or six (the
    local steps themselves agree to rounding, as for every method)."""
    sequential = fedflat.run(tiny(*options, "engine=sequential"), save=False, progress=False)
    vectorized = fedflat.run(tiny(*options, "engine=vectorized"), save=False, progress=False)
    torch.testing.assert_close(vectorized.final_parameters, sequential.final_parameters, rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # a local Ray: ~20 s
def test_ray_gives_the_local_executors_numbers_under_dp(tiny):
    cfg = tiny(*DP, "privacy.adaptive=true", "privacy.count_noise=1.0")
    ours = fedflat.run(cfg, save=False, progress=False)
    theirs = fedflat.run(cfg, overrides=["executor=ray", "executor.workers=2", "executor.cpus_per_worker=0.5"],
                         save=False, progress=False)
    assert torch.equal(ours.final_parameters, theirs.final_parameters)
    assert [m["epsilon"] for m in ours.metrics] == [m["epsilon"] for m in theirs.metrics]


@pytest.mark.slow  # a Flower simulation: ~30 s
def test_a_flower_simulation_gives_the_same_numbers_under_dp_and_compression(tiny, tmp_path):
    from fedflat.flower import simulate

    cfg = tiny(*DP, "compression.name=topk", "compression.ratio=0.3")
    ours = fedflat.run(cfg, save=False, progress=False)
    theirs = simulate(cfg, supernodes=3, out=tmp_path, progress=False)
    assert torch.equal(ours.final_parameters, theirs.final_parameters)
    assert theirs.summary["epsilon"] == ours.summary["epsilon"]


def test_a_resumed_dp_run_equals_an_uninterrupted_one_epsilon_included(tmp_path):
    """Stopped after round 2 of 4 (checkpoints every round), then resumed: the same model, the same epsilons, the same
    error-feedback residuals and adaptive clip, as a run never stopped."""
    tree = tiny_tree(rounds=4, checkpoint_every=1, privacy={"mode": "central", "clip": 0.5, "noise_multiplier": 1.0,
                                                           "adaptive": True, "count_noise": 1.0},
                     compression={"name": "topk", "ratio": 0.3, "error_feedback": True})
    whole = fedflat.run(copy.deepcopy(tree), out=tmp_path / "whole", progress=False)
    half = fedflat.run(copy.deepcopy(tree), overrides=["rounds=2"], out=tmp_path / "half", progress=False)
    resumed = resume(half.run_dir, overrides=["rounds=4"], progress=False)
    assert torch.equal(resumed.final_parameters, whole.final_parameters)
    assert [m["epsilon"] for m in resumed.metrics] == [m["epsilon"] for m in whole.metrics]
    assert [m["dp_clip"] for m in resumed.metrics] == [m["dp_clip"] for m in whole.metrics]


def test_without_the_path_every_method_builds_no_stage():
    assert build_algorithm({"name": "fedsam"}).path.stages == ()


def test_an_upload_that_cannot_be_decoded_leaves_its_client_out(tiny, caplog):
    """A node that sends top-k indices beyond the model, or QSGD levels beyond s, does not crash the server: the
    round goes on without that client, named in a warning. (A wrong dtype is a node's whole reply, refused when the
    reply is read: fedflat.flower.protocol.)"""
    from fedflat.algorithms.compression import INDEX, LEVELS

    for options, entry, value in ((("compression.name=topk", "compression.ratio=0.2"), INDEX, 10 ** 6),
                                  (("compression.name=qsgd", "compression.levels=16"), LEVELS, 127)):
        sim = Simulation(tiny(*options))
        opened = sim.server.begin_round(0)
        result = sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state)
        first = int(result.ids[0])
        rows = result.upload[entry].clone()
        rows[0] = value
        result.upload[entry] = rows
        round = sim.server.finish_round(opened, result)
        assert list(round.rejected) == [str(first)] and round.clients == len(result.ids) - 1
        assert f"the upload of client {first} is rejected: its upload cannot be decoded" in caplog.text


# -- instance-level DP: DP-SGD on each client ---------------------------------------------------------------------------
INSTANCE = ("privacy.level=instance", "privacy.clip=0.8", "privacy.noise_multiplier=1.2")


def test_dp_sgd_rounds_by_hand(tiny):
    """Two rounds of FedAvg whose clients take DP-SGD steps: each step's batch drawn on its own (B of n without
    replacement), every example's gradient by autograd one at a time, clipped to C, summed, N(0, z^2 C^2) from the
    client's stream added, divided by B; the engine against this computation."""
    from fedflat.engine.client import independent_schedule

    B, C, z = 4, 0.8, 1.2
    sim = Simulation(tiny(*INSTANCE, "rounds=2", f"train.batch_size={B}", "train.local_steps=3", "train.clip=null",
                          "train.weight_decay=0.01"))
    hand, w = Hand(sim), sim.server.w.clone()
    for t in range(2):
        lr, finals = sim.server.lr_at(t), []
        for i in _sampled(sim, t):
            picks = independent_schedule(sim.client_indices[i].cpu(), 3, B, torch_stream(0, t, i, "batches"))
            noise, wi = torch_stream(0, t, i, "dpsgd", sim.device), w.clone()  # drawn on the run's device
            for idx in picks:
                x, y = sim.dataset.x_train[idx], sim.dataset.y_train[idx]
                G = torch.stack([hand.grad_on(wi, x[j:j + 1], y[j:j + 1]) for j in range(len(idx))])
                clipped = G * torch.clamp(C / G.double().norm(dim=1), max=1.0).float()[:, None]
                g = (clipped.sum(0) + torch.randn(w.numel(), generator=noise, device=w.device) * (z * C)) / len(idx)
                wi = wi - lr * (g + hand.wd * wi)
            finals.append(wi)
        w = torch.stack(finals).mean(0)
    for t in range(2):
        sim.run_round(t)
    torch.testing.assert_close(sim.server.w, w, rtol=2e-5, atol=2e-6)


def test_dp_sgd_epsilon_equals_dp_accountings_for_the_worst_client(tiny):
    """The run's bound: the smallest client's sampling rate B / n_min, the most local steps any client took, one
    Gaussian of multiplier z / (2 sqrt(g)) a step (g noised gradients of the batch: SAM's 2; replace-one)."""
    for algo, g in (("fedavg", 1), ("fedsam", 2)):
        history = fedflat.run(tiny(*INSTANCE, f"algo={algo}", "train.batch_size=3"), save=False, progress=False)
        sim = Simulation(tiny(*INSTANCE, f"algo={algo}", "train.batch_size=3"))
        steps = torch.zeros(6, dtype=torch.long, device=sim.device)  # indexed by the run's sampled ids
        for t in range(3):
            ctx = sim.server.new_context(t)
            steps[ctx.sampled] += ctx.steps
        n_min, delta = int(sim.num_samples.min()), 1 / int(sim.num_samples.sum())
        accountant = RdpAccountant(neighboring_relation=dpa.NeighboringRelation.REPLACE_ONE)
        accountant.compose(dpa.SelfComposedDpEvent(dpa.SampledWithoutReplacementDpEvent(
            n_min, 3, dpa.GaussianDpEvent(1.2 / (2 * math.sqrt(g)))), int(steps.max())))
        assert history.summary["epsilon"] == pytest.approx(accountant.get_epsilon(delta), rel=1e-12)


def test_dp_sgd_engines_agree_and_methods_it_cannot_account_are_refused(tiny):
    sequential = fedflat.run(tiny(*INSTANCE, "algo=fedsam", "engine=sequential"), save=False, progress=False)
    vectorized = fedflat.run(tiny(*INSTANCE, "algo=fedsam", "engine=vectorized"), save=False, progress=False)
    torch.testing.assert_close(vectorized.final_parameters, sequential.final_parameters, rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="perturbation 'scam': its scores take gradients of pilot batches"):
        tiny(*INSTANCE, "algo=fedscam")
    with pytest.raises(ConfigError, match="dropout"):
        Simulation(tiny(*INSTANCE, "model=cnn", "model.dropout=0.3", "data.options.shape=[1,8,8]", "model.padding=2"))


@pytest.mark.slow  # a child process killed mid-run, then two runs of 8 rounds
def test_a_dp_run_killed_mid_run_resumes_to_the_uninterrupted_run_epsilon_included(tiny, tmp_path):
    """SIGKILL while round 3's checkpoint is written (central DP with an adaptive clip, top-k with error feedback):
    the resumed run's model, epsilons, clips and residuals equal a run never killed."""
    from fedflat.files import read_jsonl
    from test_resume import _sigkill_child_when, _tmp_checkpoint

    options = ("privacy.clip=0.5", "privacy.noise_multiplier=1.0", "privacy.adaptive=true", "privacy.count_noise=1.0",
               "compression.name=topk", "compression.ratio=0.3", "compression.error_feedback=true")
    folder = tmp_path / "killed"

    def third_write_started() -> bool:
        lines = read_jsonl(folder / "metrics.jsonl") if folder.exists() else []
        return len(lines) >= 3 and _tmp_checkpoint(folder)

    _sigkill_child_when(folder, 0.4, third_write_started, poll=0.02, overrides=options)
    resumed = resume(folder, progress=False)
    full = fedflat.run(tiny("rounds=8", "checkpoint_every=1", *options), run_dir=tmp_path / "full", progress=False)
    assert torch.equal(resumed.final_parameters, full.final_parameters)
    written = [read_jsonl(f / "metrics.jsonl") for f in (folder, tmp_path / "full")]
    for key in ("epsilon", "dp_clip", "dp_unclipped", "up_bytes"):
        assert [m[key] for m in written[0]] == [m[key] for m in written[1]], key


@pytest.mark.slow  # one round of every recipe
def test_every_recipe_runs_under_dp_or_is_refused_saying_what_it_reads(tiny):
    """One `privacy:` section: a round of every built-in recipe under central DP, or its refusal naming what central
    DP would hide from it; under local DP every recipe runs."""
    from conftest import model_for
    from fedflat.algorithms import RECIPES

    for name in sorted(RECIPES):
        if RECIPES[name].personalization == "fedbn":  # BatchNorm statistics: refused under DP, tested above
            continue
        try:
            sim = Simulation(tiny(f"algo={name}", *model_for(name), *DP))
        except ConfigError as err:
            assert "privacy.mode=central releases only the noised sum" in str(err) and "individual" not in str(err)
            sim = Simulation(tiny(f"algo={name}", *model_for(name), *DP, "privacy.mode=local"))
        assert math.isfinite(sim.run_round(0).log["epsilon"]), name


def test_a_flower_app_under_dp_draws_its_noise_from_the_secure_source(tiny, tmp_path):
    """`fedflat flower-app` of a DP config: the app's config says privacy.noise=secure, and its nodes then draw every
    noise from the OS's CSPRNG (two clients' runs of the same round differ; tested above for the mechanism)."""
    import tomllib

    pytest.importorskip("flwr")

    from fedflat.config import read_yaml
    from fedflat.flower import write_app
    from fedflat.flower.apps import CONFIG_KEY

    folder = write_app(tiny(*DP), tmp_path / "app", insecure=True)
    config = tomllib.loads((folder / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert read_yaml(config[CONFIG_KEY])["privacy"]["noise"] == "secure"


def test_reports_have_an_epsilon_column_for_private_runs(tiny, tmp_path):
    from fedflat.experiments.report import report

    fedflat.run(tiny(*DP, "rounds=2"), out=tmp_path / "private", progress=False)
    fedflat.run(tiny("rounds=2"), out=tmp_path / "plain", progress=False)
    private = report([tmp_path / "private"])
    assert "| epsilon |" in private.splitlines()[0]
    spent = epsilon(Mechanism("fixed", 6, 3, 1.0), 2, 1 / 6)
    assert f"| {spent:.3g} |" in private
    assert "epsilon" not in report([tmp_path / "plain"])
    assert "epsilon" in report([tmp_path / "private"], fmt="csv").splitlines()[0]


def test_the_servers_norm_check_reads_the_clipped_update_that_travelled(tiny):
    """With an upload path the model entry on the wire is Delta_i already: the server's `validation.max_norm` bounds
    it as sent (clipped to C = 0.5 here), so a bound just above C rejects nobody."""
    history = fedflat.run(tiny("privacy.clip=0.5", "privacy.mode=local",
                               "validation.max_norm=0.5001", "privacy.noise_multiplier=0.0"), save=False, progress=False)
    assert history.summary["status"] == "completed" and "rejected_clients" not in history.summary


def test_a_compressed_payload_is_decoded_once_a_round_under_the_norm_check(tiny, monkeypatch):
    """validation.max_norm reads the decoded release; the aggregation takes that release (the kept rows of it) instead
    of decoding the payload again: one decode a round, with or without the check, the same model where the bound
    rejects nobody, and the kept rows' release where it rejects some."""
    from fedflat.algorithms.compression import TopK

    calls = []
    decode = TopK.decode
    monkeypatch.setattr(TopK, "decode", lambda self, ctx, payload, size: calls.append(1) or decode(self, ctx, payload,
                                                                                                      size))
    compressed = ("compression.name=topk", "compression.ratio=0.5", "rounds=3")
    checked = fedflat.run(tiny(*compressed, "validation.max_norm=1e9"), save=False, progress=False)
    assert len(calls) == 3
    calls.clear()
    plain = fedflat.run(tiny(*compressed), save=False, progress=False)
    assert len(calls) == 3 and torch.equal(checked.final_parameters, plain.final_parameters)
    calls.clear()
    bound = fedflat.run(tiny(*compressed, "validation.max_norm=0.15"), save=False, progress=False)
    assert len(calls) == 3 and bound.summary.get("rejected_clients")  # some rows left out of the decoded release
