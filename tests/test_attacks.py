"""Attacks (fedflat.algorithms.attacks) and the server's upload checks (fedflat.engine.server): who the
attackers are, each attack's effect by hand, reproducibility on every executor, the backdoor's metric, and
uploads with NaN or beyond the norm bound rejected (or failing the run) with the client named."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from agreement import assert_identical, bitwise, trajectory
from conftest import tiny_config, tiny_tree

import fedflat
from fedflat.algorithms.attacks import Attack, attackers, rows_where
from fedflat.algorithms.compose import build_stages
from fedflat.core import (MODEL, SERVER, Batch, ClientContext, Cohort, ConfigError, TrainSettings, contract,
                          numpy_stream, register_part, torch_stream)
from fedflat.engine.simulation import Simulation
from fedflat.engine.server import UploadRejected
from fedflat.models import build_model
from fedflat.testing import relative_gap, rounding_allowed

N, SEED = 10, 3
SETTINGS = TrainSettings(weight_decay=0.0, clip=None, batch_size=4, global_lr=1.0, num_clients=N, seed=SEED)


class NaNUpload(Attack):
    """A malicious client whose update is all NaN (what a broken or hostile node may send)."""

    name = "test_nan"
    summary = "test attack: NaN updates"

    def client(self, ctx, cohort, release):
        delta = release[MODEL]
        return {**release, MODEL: rows_where(self.malicious(ctx.settings, cohort.ids), torch.full_like(delta, math.nan),
                                             delta)}


register_part(NaNUpload)


def test_attackers_are_round_fraction_n_clients_drawn_from_the_keyed_stream():
    chosen = attackers(SEED, N, 0.25)
    by_hand = np.sort(numpy_stream(SEED, -1, SERVER, "attackers").choice(N, 3, replace=False))  # round(2.5) = 3
    assert np.array_equal(chosen, by_hand) and len(set(chosen.tolist())) == 3
    assert len(attackers(SEED, N, 0.01)) == 1 and len(attackers(SEED, N, 0.0)) == 0
    assert len(attackers(SEED, N, 1.0)) == N
    assert not np.array_equal(attackers(SEED + 1, 100, 0.1), attackers(SEED, 100, 0.1))


def _client(stage_spec: dict):
    stage = contract.checked(build_stages([stage_spec])[0])  # also: nothing it was given is modified in place
    ctx = ClientContext(round=2, lr=0.1, w_start=torch.zeros(5), server={}, settings=SETTINGS, oracle=None,
                        batches=None)
    ids = torch.arange(N)
    cohort = Cohort(ids=ids, num_samples=torch.full((N,), 8), steps=torch.ones(N, dtype=torch.long),
                    active=torch.ones(N, dtype=torch.bool))
    bad = torch.isin(ids, torch.as_tensor(attackers(SEED, N, stage_spec["fraction"])))
    assert 0 < int(bad.sum()) < N
    return stage, ctx, cohort, bad


RELEASE = {"model": torch.randn(N, 5, generator=torch.Generator().manual_seed(0)),
           "scaffold.dc": torch.randn(N, 5, generator=torch.Generator().manual_seed(1))}


def test_sign_flip_uploads_minus_scale_delta_on_malicious_rows_only():
    stage, ctx, cohort, bad = _client({"name": "sign_flip", "fraction": 0.3, "scale": 2.5})
    out = stage.client(ctx, cohort, RELEASE)
    assert torch.equal(out["model"][bad], -2.5 * RELEASE["model"][bad])
    assert torch.equal(out["model"][~bad], RELEASE["model"][~bad])
    assert torch.equal(out["scaffold.dc"], RELEASE["scaffold.dc"])  # the method's other entries travel as they are


def test_gaussian_uploads_noise_from_each_malicious_clients_own_stream():
    stage, ctx, cohort, bad = _client({"name": "gaussian", "fraction": 0.3, "std": 0.5})
    out = stage.client(ctx, cohort, RELEASE)
    for i in bad.nonzero().flatten().tolist():
        draw = torch.randn(5, generator=torch_stream(SEED, 2, i, "attack"))
        assert torch.equal(out["model"][i], draw * 0.5)
    assert torch.equal(out["model"][~bad], RELEASE["model"][~bad])


def test_label_flip_maps_y_to_c_minus_1_minus_y_in_malicious_rows():
    stage, ctx, cohort, bad = _client({"name": "label_flip", "fraction": 0.3, "num_classes": 4})
    y = torch.randint(0, 4, (N, 6), generator=torch.Generator().manual_seed(2))
    batch = Batch(torch.randn(N, 6, 1, 3, 3), y)
    out = stage.poison(ctx, cohort, batch)
    assert torch.equal(out.y[bad], 3 - y[bad]) and torch.equal(out.y[~bad], y[~bad])
    assert torch.equal(out.x, batch.x)


def test_backdoor_stamps_the_trigger_on_the_first_ceil_q_n_real_samples_and_boosts_the_update():
    spec = {"name": "backdoor", "fraction": 0.3, "num_classes": 4, "target": 1, "poison_fraction": 0.5, "boost": 4.0,
            "trigger_size": 2, "trigger_value": 9.0}
    stage, ctx, cohort, bad = _client(spec)
    x = torch.randn(N, 4, 1, 3, 3, generator=torch.Generator().manual_seed(3))
    y = torch.zeros(N, 4, dtype=torch.long) + 2
    weight = torch.ones(N, 4)
    weight[:, 3] = 0  # every client has 3 real samples (the 4th is padding): ceil(0.5 * 3) = 2 are stamped
    out = stage.poison(ctx, cohort, Batch(x, y, weight))
    for c in range(N):
        for j in range(4):
            stamped = bool(bad[c]) and j < 2
            expected = x[c, j].clone()
            if stamped:
                expected[:, 1:, 1:] = 9.0  # the bottom-right 2x2 corner
            assert torch.equal(out.x[c, j], expected) and int(out.y[c, j]) == (1 if stamped else 2), (c, j)
    boosted = stage.client(ctx, cohort, RELEASE)
    assert torch.equal(boosted["model"][bad], 4.0 * RELEASE["model"][bad])
    assert torch.equal(boosted["model"][~bad], RELEASE["model"][~bad])


ATTACKED = ("threads=1", "rounds=2", "sampling.clients_per_round=4", "train.batch_size=7")


def _server(stage_spec: dict, sampled: torch.Tensor):
    from fedflat.core import RoundContext

    stage = contract.checked(build_stages([stage_spec])[0])
    ctx = RoundContext(round=2, lr=0.1, w=torch.zeros(5), sampled=sampled, num_samples=torch.ones(len(sampled)),
                       steps=torch.ones(len(sampled)), server={}, settings=SETTINGS)
    bad = np.isin(sampled.numpy(), attackers(SEED, N, stage_spec["fraction"]))
    return stage, ctx, bad


@pytest.mark.parametrize("sampled", [list(range(N)), [0, 2, 3, 5, 6, 8, 9]], ids=["all", "seven"])
def test_alie_uploads_benign_mean_minus_z_max_benign_std_on_every_malicious_row(sampled):
    """Baruch et al.: n clients, f malicious, s = floor(n/2 + 1) - f, z_max = Phi^-1((n - s)/n) (SciPy's normal
    quantile here); mu and sigma per coordinate over the benign rows (sample std, ddof 1), by NumPy in float64."""
    from scipy.stats import norm

    sampled = torch.tensor(sampled)
    stage, ctx, bad = _server({"name": "alie", "fraction": 0.3}, sampled)
    n, f = len(sampled), int(bad.sum())
    assert 0 < f < n
    release = {name: rows[sampled].double() for name, rows in RELEASE.items()}
    out = stage.server(ctx, release)
    benign = release["model"].numpy()[~bad]
    z = norm.ppf((n - (math.floor(n / 2 + 1) - f)) / n)
    forged = benign.mean(0) - z * benign.std(0, ddof=1)
    np.testing.assert_allclose(out["model"].numpy()[bad], np.broadcast_to(forged, (f, 5)), rtol=0, atol=1e-12)
    assert torch.equal(out["model"][~torch.tensor(bad)], release["model"][~torch.tensor(bad)])
    assert torch.equal(out["scaffold.dc"], release["scaffold.dc"])
    assert ctx.log["attackers"] == f
    fixed, ctx, _ = _server({"name": "alie", "fraction": 0.3, "z": 1.5}, sampled)  # z given: used as it is
    np.testing.assert_allclose(fixed.server(ctx, release)["model"].numpy()[bad][0],
                               benign.mean(0) - 1.5 * benign.std(0, ddof=1), rtol=0, atol=1e-12)


@pytest.mark.parametrize("n, f", [(12, 7), (12, 11), (5, 3)])
def test_alie_with_a_malicious_majority_clamps_s_to_one(n, f):
    """f > n/2: the paper's s = floor(n/2 + 1) - f is 0 or below (z_max infinite or undefined); fedflat takes
    s = 1, z = Phi^-1((n - 1)/n) (SciPy's quantile), the z of f = floor(n/2) attackers."""
    from scipy.stats import norm

    from fedflat.algorithms.attacks import alie_z

    assert math.floor(n / 2 + 1) - f <= 0
    assert alie_z(n, f) == pytest.approx(norm.ppf((n - 1) / n), abs=1e-12) == alie_z(n, n // 2)


def test_ipm_uploads_minus_epsilon_times_the_benign_mean_on_every_malicious_row():
    stage, ctx, bad = _server({"name": "ipm", "fraction": 0.3, "epsilon": 0.5}, torch.arange(N))
    release = {name: rows.double() for name, rows in RELEASE.items()}
    out = stage.server(ctx, release)
    forged = -0.5 * release["model"].numpy()[~bad].mean(0)
    np.testing.assert_allclose(out["model"].numpy()[bad], np.broadcast_to(forged, (int(bad.sum()), 5)), rtol=0,
                               atol=1e-15)
    assert torch.equal(out["model"][~torch.tensor(bad)], release["model"][~torch.tensor(bad)])


@pytest.mark.parametrize("attack", ["alie", "ipm"])
def test_colluding_attacks_run_alike_on_threads_and_are_refused_with_dp_or_compression(attack):
    spec = bitwise(f"attack.name={attack}", "attack.fraction=0.34")  # (on CUDA the sequential engine: see bitwise)
    local = Simulation(tiny_config(*ATTACKED, *spec))
    expected = trajectory(local, 2)
    assert any(log["attackers"] > 0 for *_, log, _ in expected)
    threads = Simulation(tiny_config(*ATTACKED, *spec, "executor=threads", "executor.workers=2"))
    assert trajectory(threads, 2) == expected
    plain = fedflat.run(tiny_config(*ATTACKED, *bitwise()), save=False, progress=False).final_parameters
    assert relative_gap(local.server.w.cpu(), plain) > 1e-4  # the attack changed the run (final_parameters: on the CPU)
    with pytest.raises(ConfigError, match=f"attack={attack} forges the malicious uploads"):
        tiny_config(*spec, "privacy.noise_multiplier=1.0", "privacy.clip=1.0", "privacy.mode=local")
    with pytest.raises(ConfigError, match=f"attack={attack} forges"):
        tiny_config(*spec, "compression.name=topk", "compression.ratio=0.5")


@pytest.mark.parametrize("attack", [("attack.name=gaussian", "attack.fraction=0.34"),
                                    ("attack.name=backdoor", "attack.fraction=0.34", "attack.trigger_size=2",
                                     "attack.boost=3")], ids=["gaussian", "backdoor"])
def test_an_attacked_run_is_reproducible_and_threads_give_the_local_numbers_exactly(attack):
    attack = bitwise(*attack)  # on CUDA the sequential engine: the bits of the vectorized one depend on the chunk
    local = Simulation(tiny_config(*ATTACKED, *attack))
    expected = trajectory(local, 2)
    assert any(log["attackers"] > 0 for *_, log, _ in expected)  # the attack took part
    again = Simulation(tiny_config(*ATTACKED, *attack))
    assert trajectory(again, 2) == expected
    assert_identical(local, again)
    threads = Simulation(tiny_config(*ATTACKED, *attack, "executor=threads", "executor.workers=2"))
    assert trajectory(threads, 2) == expected
    assert_identical(local, threads)


@pytest.mark.parametrize("attack", [("attack.name=label_flip",), ("attack.name=backdoor", "attack.trigger_size=2")],
                         ids=["label_flip", "backdoor"])
def test_data_attacks_give_the_same_run_on_both_engines(attack):
    """The poison hook changes only the malicious rows of a vectorized cohort's batch: the engines agree within
    float32 rounding."""
    runs = [fedflat.run(tiny_config(*ATTACKED, *attack, "attack.fraction=0.34", f"engine={engine}"), save=False,
                        progress=False).final_parameters for engine in ("sequential", "vectorized")]
    tree = tiny_tree()
    tree["rounds"], tree["train"]["batch_size"] = 2, 7
    assert relative_gap(runs[1], runs[0]) <= rounding_allowed(tree)


@pytest.mark.slow
def test_ray_workers_choose_the_same_attackers_and_give_the_local_numbers():
    attack = ("attack.name=label_flip", "attack.fraction=0.34")
    local = Simulation(tiny_config(*ATTACKED, *attack))
    expected = trajectory(local, 2)
    ray = Simulation(tiny_config(*ATTACKED, *attack, "executor=ray", "executor.workers=2",
                                 "executor.cpus_per_worker=1"))
    try:
        assert trajectory(ray, 2) == expected
        assert_identical(local, ray)
    finally:
        ray.close()


BACKDOOR = ("threads=1", "rounds=4", "data.options.shape=[1,8,8]", "sampling.clients_per_round=6",
            "attack.name=backdoor", "attack.trigger_size=2", "attack.target=0", "attack.boost=3")


def _backdoor_acc(*overrides: str) -> float:
    return fedflat.run(tiny_config(*BACKDOOR, *overrides), save=False, progress=False).metrics[-1]["backdoor_acc"]


def test_a_backdoored_fedavg_learns_the_trigger_and_median_aggregation_resists_it():
    """On the tiny problem (8x8 inputs, 2 of 6 clients malicious every round): without attackers the trigger
    means nothing to the model, with them FedAvg predicts the target on nearly every triggered sample, and the
    coordinate-wise median keeps the backdoor's success low."""
    assert _backdoor_acc("attack.fraction=0") <= 0.1
    assert _backdoor_acc("attack.fraction=0.34") >= 0.9
    assert _backdoor_acc("attack.fraction=0.34", "robust.name=median") <= 0.3


def test_backdoor_accuracy_is_the_triggered_non_target_samples_classified_as_the_target():
    sim = Simulation(tiny_config(*ATTACKED, "data.options.shape=[1,8,8]", "attack.name=backdoor",
                                 "attack.fraction=0.34", "attack.target=2", "attack.trigger_size=3"))
    sim.run_round(0)
    data = sim.dataset
    module = build_model("mlp", data.input_shape, data.num_classes, hidden=[8])  # a fresh module, not the engine's
    module.load_state_dict(sim.server.model_state())
    module.eval()
    keep = data.y_test != 2
    x = data.features(data.x_test[keep]).cpu().clone()  # the fresh module's device, whatever the run's
    x[..., -3:, -3:] = 3.0  # the default trigger value, in the model's input units
    with torch.no_grad():
        by_hand = float((module(x).argmax(1) == 2).double().mean())
    assert sim.backdoor_accuracy() == pytest.approx(by_hand, abs=0.5 / int(keep.sum()))


def test_attack_section_errors_say_what_to_do():
    with pytest.raises(ConfigError, match="attack.name: 'median' is not an attack.*allowed: alie, backdoor"):
        tiny_config("attack.name=median")
    with pytest.raises(ConfigError, match="attack.name is missing: name one of alie, backdoor"):
        tiny_config("attack.fraction=0.1")
    with pytest.raises(ConfigError, match="attack.target=3: the data has classes 0..2"):
        fedflat.run(tiny_config("attack.name=backdoor", "attack.target=3", "attack.trigger_size=2"), save=False,
                    progress=False)
    with pytest.raises(ConfigError, match="use image data"):
        fedflat.run(tiny_config("attack.name=backdoor", "attack.trigger_size=5"), save=False, progress=False)  # 4x4


def _rejections_expected(cfg, rounds: int) -> dict[str, dict[str, str]]:
    sim = Simulation(cfg)
    bad = set(attackers(cfg.seed, cfg.data.num_clients, cfg.attack["fraction"]).tolist())
    out = {}
    for t in range(rounds):
        hit = sorted(set(sim.server.sample_clients(t).tolist()) & bad)
        if hit:
            out[str(t + 1)] = hit
    return out


CHECKED = ("threads=1", "rounds=4", "sampling.clients_per_round=3", "attack.fraction=0.2")


def test_a_nan_upload_is_rejected_naming_the_client_and_the_round_goes_on(caplog):
    cfg = tiny_config(*CHECKED, "attack.name=test_nan")
    expected = _rejections_expected(cfg, 4)
    assert expected, "the attacker is sampled in some round of this test"
    history = fedflat.run(cfg, save=False, progress=False)
    assert history.summary["status"] == "completed" and torch.isfinite(history.final_parameters).all()
    rejected = history.summary["rejected_clients"]
    assert {t: sorted(int(c) for c in r) for t, r in rejected.items()} == expected
    assert all("NaN or Inf in its 'model'" in why for r in rejected.values() for why in r.values())
    for line in history.metrics:  # the round aggregated the others
        assert line["clients"] == 3 - len(expected.get(str(line["round"]), []))
    t, clients = next(iter(expected.items()))
    assert f"round {t}: the upload of client {clients[0]} is rejected: NaN" in caplog.text


def test_an_update_beyond_validation_max_norm_is_rejected():
    cfg = tiny_config(*CHECKED, "attack.name=sign_flip", "attack.scale=1e5", "validation.max_norm=1000")
    expected = _rejections_expected(cfg, 4)
    history = fedflat.run(cfg, save=False, progress=False)
    rejected = history.summary["rejected_clients"]
    assert {t: sorted(int(c) for c in r) for t, r in rejected.items()} == expected
    assert all("exceeds validation.max_norm=1000" in why for r in rejected.values() for why in r.values())
    unattacked = fedflat.run(tiny_config(*CHECKED[:-1], "validation.max_norm=1000"), save=False, progress=False)
    assert "rejected_clients" not in unattacked.summary  # honest updates are well within the bound


def test_a_compressed_upload_is_checked_on_its_decoded_update():
    """Top-k travels as values and indices: the norm bound applies to the update they decode to."""
    cfg = tiny_config(*CHECKED, "compression.name=topk", "compression.ratio=0.5", "attack.name=sign_flip",
                      "attack.scale=1e5", "validation.max_norm=1000")
    history = fedflat.run(cfg, save=False, progress=False)
    rejected = history.summary["rejected_clients"]
    assert {t: sorted(int(c) for c in r) for t, r in rejected.items()} == _rejections_expected(cfg, 4)


def test_validation_invalid_fail_stops_the_run_naming_the_client(tmp_path):
    cfg = tiny_config(*CHECKED, "attack.name=test_nan", "validation.invalid=fail")
    t, clients = next(iter(_rejections_expected(cfg, 4).items()))
    with pytest.raises(UploadRejected, match=f"round {t}: client {clients[0]}: NaN or Inf in its 'model'"):
        fedflat.run(cfg, run_dir=tmp_path / "run", progress=False)
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"status": "failed"' in summary and f"client {clients[0]}" in summary


def test_every_upload_non_finite_is_still_a_diverged_run():
    history = fedflat.run(tiny_config(*CHECKED, "attack.name=test_nan", "attack.fraction=1"), save=False,
                          progress=False)
    assert history.summary["status"] == "diverged" and "non-finite" in history.summary["reason"]
