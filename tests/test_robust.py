"""Robust aggregation (fedflat.algorithms.robust): each rule equals a hand computation on a tiny release, composes
with the seed methods on both engines, and is refused where the server sees only the sum."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from conftest import tiny_config, tiny_tree

import fedflat
from fedflat.algorithms.compose import build_stages
from fedflat.algorithms.robust import CENTER
from fedflat.core import ConfigError, RoundContext, TrainSettings, contract
from fedflat.experiments.resume import resume
from fedflat.testing import relative_gap, rounding_allowed

K = 5
RNG = np.random.default_rng(7)
MODEL_ROWS = RNG.normal(size=(K, 4))  # Delta_i of 5 clients
EXTRA_ROWS = RNG.normal(size=(K, 3))  # another released entry (SCAFFOLD's Delta c_i, say)
MODEL_ROWS[3] *= 40.0  # one far-off update: the rules must notice it
FULL = np.concatenate([MODEL_ROWS, EXTRA_ROWS], axis=1)  # a row as one vector (entries in sorted name order)
TOL = 1e-12  # float64 arithmetic on entries of order 1-100


def _context(server: dict | None = None, clients: int = K) -> RoundContext:
    settings = TrainSettings(weight_decay=0.0, clip=None, batch_size=1, global_lr=1.0, num_clients=clients, seed=0)
    return RoundContext(round=0, lr=0.1, w=torch.zeros(4, dtype=torch.float64), sampled=torch.arange(clients),
                        num_samples=torch.ones(clients), steps=torch.ones(clients), server=server or {},
                        settings=settings)


def _release(model=MODEL_ROWS, extra=EXTRA_ROWS) -> dict[str, torch.Tensor]:
    return {"model": torch.tensor(model), "scaffold.dc": torch.tensor(extra)}


def _serve(spec: dict, release: dict, ctx: RoundContext | None = None) -> dict[str, torch.Tensor]:
    stage = contract.checked(build_stages([spec])[0])  # also: no tensor it was given is modified in place
    return stage.server(ctx or _context(), release)


def _assert_every_row(out: dict[str, torch.Tensor], model: np.ndarray, extra: np.ndarray, rows: int = K) -> None:
    assert out["model"].shape == (rows, 4) and out["scaffold.dc"].shape == (rows, 3)
    np.testing.assert_allclose(out["model"].numpy(), np.broadcast_to(model, (rows, 4)), rtol=0, atol=TOL)
    np.testing.assert_allclose(out["scaffold.dc"].numpy(), np.broadcast_to(extra, (rows, 3)), rtol=0, atol=TOL)


def test_median_is_numpys_coordinate_median_for_odd_and_even_counts():
    _assert_every_row(_serve({"name": "median"}, _release()), np.median(MODEL_ROWS, 0), np.median(EXTRA_ROWS, 0))
    four = _release(MODEL_ROWS[:4], EXTRA_ROWS[:4])  # even: the mean of the two middle values
    _assert_every_row(_serve({"name": "median"}, four, _context(clients=4)), np.median(MODEL_ROWS[:4], 0),
                      np.median(EXTRA_ROWS[:4], 0), rows=4)


@pytest.mark.parametrize("beta", [0.0, 0.2, 0.45])
def test_trimmed_mean_drops_floor_beta_k_values_on_each_side(beta):
    b = int(np.floor(beta * K))
    trim = lambda X: np.sort(X, 0)[b:K - b].mean(0)  # noqa: E731
    _assert_every_row(_serve({"name": "trimmed_mean", "beta": beta}, _release()), trim(MODEL_ROWS), trim(EXTRA_ROWS))
    if beta == 0.0:
        np.testing.assert_allclose(trim(MODEL_ROWS), MODEL_ROWS.mean(0), atol=TOL)  # beta = 0 is the plain mean


def _krum_by_hand(f: int, m: int) -> list[int]:
    scores = []
    for i in range(K):
        d = sorted(float(np.sum((FULL[i] - FULL[j]) ** 2)) for j in range(K) if j != i)
        scores.append(sum(d[:K - f - 2]))
    return sorted(range(K), key=lambda i: (scores[i], i))[:m]


@pytest.mark.parametrize("f,m", [(1, 1), (1, 3), (0, 2)])
def test_krum_and_multi_krum_average_the_rows_of_lowest_score(f, m):
    chosen = _krum_by_hand(f, m)
    assert 3 not in chosen  # the far-off update is never selected
    _assert_every_row(_serve({"name": "krum", "f": f, "m": m}, _release()), MODEL_ROWS[chosen].mean(0),
                      EXTRA_ROWS[chosen].mean(0))


def test_norm_bounding_clips_each_release_as_one_vector_to_the_bound():
    M = 2.5
    scale = np.minimum(1.0, M / np.linalg.norm(FULL, axis=1))
    assert (scale < 1).any() and (scale == 1).any()  # some rows clipped, some not
    out = _serve({"name": "norm_bound", "bound": M}, _release())
    np.testing.assert_allclose(out["model"].numpy(), MODEL_ROWS * scale[:, None], rtol=0, atol=TOL)
    np.testing.assert_allclose(out["scaffold.dc"].numpy(), EXTRA_ROWS * scale[:, None], rtol=0, atol=TOL)


def _centered_clip_by_hand(v: np.ndarray, tau: float, iterations: int) -> np.ndarray:
    for _ in range(iterations):
        step = np.zeros_like(v)
        for x in FULL:
            step += (x - v) * min(1.0, tau / np.linalg.norm(x - v))
        v = v + step / K
    return v


@pytest.mark.parametrize("start", ["empty", "previous"])
def test_centered_clipping_iterates_from_the_previous_aggregate_and_keeps_it(start):
    tau, L = 0.8, 3
    previous = RNG.normal(size=FULL.shape[1]) if start == "previous" else None
    ctx = _context({CENTER: torch.tensor(previous) if previous is not None else torch.zeros(0, dtype=torch.float64)})
    v = _centered_clip_by_hand(previous if previous is not None else np.zeros(FULL.shape[1]), tau, L)
    out = _serve({"name": "centered_clip", "tau": tau, "iterations": L}, _release(), ctx)
    _assert_every_row(out, v[:4], v[4:])
    np.testing.assert_allclose(ctx.server[CENTER].numpy(), v, rtol=0, atol=TOL)


RULES = [("robust.name=median",), ("robust.name=trimmed_mean", "robust.beta=0.25"),
         ("robust.name=krum", "robust.f=0", "robust.m=2"), ("robust.name=norm_bound", "robust.bound=0.05"),
         ("robust.name=centered_clip", "robust.tau=0.05", "robust.iterations=2")]
RUN = ("rounds=2", "threads=1", "sampling.clients_per_round=4")


@functools.lru_cache(maxsize=None)
def _plain(method: str) -> torch.Tensor:
    return fedflat.run(tiny_config(f"algo={method}", *RUN), save=False, progress=False).final_parameters


@pytest.mark.parametrize("method,rule", [("fedsam", rule) for rule in RULES] + [("fedlesam", RULES[0]),
                                                                                ("fedlesam", RULES[4]),
                                                                                ("scaffold", RULES[2])],
                         ids=lambda x: x if isinstance(x, str) else x[0].split("=")[1])
def test_every_rule_composes_with_a_seed_method_on_both_engines(method, rule):
    """The rule changes the run (it is not a no-op on this problem), and the engines agree within float32
    rounding."""
    runs = {engine: fedflat.run(tiny_config(f"algo={method}", *RUN, *rule, f"engine={engine}"), save=False,
                                progress=False) for engine in ("sequential", "vectorized")}
    seq, vec = runs["sequential"].final_parameters, runs["vectorized"].final_parameters
    assert runs["sequential"].summary["status"] == "completed" and torch.isfinite(seq).all()
    tree = tiny_tree()
    tree["rounds"] = 2
    assert relative_gap(vec, seq) <= rounding_allowed(tree)
    assert relative_gap(seq, _plain(method)) > 100 * rounding_allowed(tree)


def test_norm_bounding_beyond_every_norm_is_the_plain_run_bit_for_bit():
    """Rows scaled by exactly 1: the method aggregates what it would without the rule."""
    plain = fedflat.run(tiny_config("algo=fedsam", *RUN), save=False, progress=False)
    bounded = fedflat.run(tiny_config("algo=fedsam", *RUN, "robust.name=norm_bound", "robust.bound=1e6"), save=False,
                          progress=False)
    assert torch.equal(bounded.final_parameters, plain.final_parameters)
    assert bounded.metrics[-1]["norm_bounded"] == 0


def test_fedavg_under_a_one_aggregate_rule_moves_by_that_aggregate():
    """Every row equals the aggregate, so FedAvg's weighted mean of the rows (global lr 1) is the aggregate:
    with krum f=0, m=K the unweighted mean of the updates, i.e. the round's plain mean under equal weights."""
    overrides = ("rounds=1", "threads=1", "sampling.clients_per_round=4", "algo=fedavg")
    krum = fedflat.run(tiny_config(*overrides, "robust.name=krum", "robust.f=0", "robust.m=4"), save=False,
                       progress=False)
    trimmed = fedflat.run(tiny_config(*overrides, "robust.name=trimmed_mean", "robust.beta=0"), save=False,
                          progress=False)
    assert relative_gap(krum.final_parameters, trimmed.final_parameters) < 1e-6  # two float32 summation orders


def test_centered_clipping_state_resumes_exactly(tmp_path):
    rule = ("robust.name=centered_clip", "robust.tau=0.05", "threads=1")
    longer = fedflat.run(tiny_config("rounds=4", *rule), save=False, progress=False)
    fedflat.run(tiny_config("rounds=2", *rule), run_dir=tmp_path / "run", progress=False)
    extended = resume(tmp_path / "run", overrides=["rounds=4"], progress=False)
    assert torch.equal(extended.final_parameters, longer.final_parameters)


def test_a_robust_rule_is_refused_under_central_dp_and_allowed_under_local_dp():
    dp = ("privacy.noise_multiplier=0.5", "privacy.clip=1.0")
    with pytest.raises(ConfigError, match="calibrated to the sensitivity of the sum"):
        tiny_config("robust.name=median", *dp)
    assert tiny_config("robust.name=median", *dp, "privacy.mode=local").robust == {"name": "median"}


def test_robust_section_errors_say_what_to_do():
    with pytest.raises(ConfigError, match="robust.name: 'topk' is not a robust rule.*allowed: bulyan, centered_clip"):
        tiny_config("robust.name=topk")
    with pytest.raises(ConfigError, match="robust=krum needs at least 5 clients per round"):
        tiny_config("robust.name=krum", "robust.f=1")
    with pytest.raises(ConfigError, match="beta"):
        tiny_config("robust.name=trimmed_mean", "robust.beta=0.5")


def _flower_bulyan(rows: list[np.ndarray], f: int) -> np.ndarray:
    """Flower's own Bulyan (flwr.server.strategy.aggregate.aggregate_bulyan over Krum) of the rows, each one
    parameter array."""
    aggregate = pytest.importorskip("flwr.server.strategy.aggregate")
    results = [([row.copy()], 1) for row in rows]
    return aggregate.aggregate_bulyan(results, f, aggregate.aggregate_krum, to_keep=0)[0]


@pytest.mark.parametrize("clients,f,seed,outliers", [(7, 1, 0, 1), (11, 2, 1, 2), (12, 2, 2, 0), (15, 3, 3, 3),
                                                     (9, 1, 4, 1), (8, 0, 5, 0)])
def test_bulyan_equals_flowers_aggregate_bulyan(clients, f, seed, outliers):
    """Released rows (the model's update and another entry, one vector per client) with ``outliers`` far-off
    rows: fedflat's Bulyan equals Flower's computation of El Mhamdi et al.'s rule on the same vectors. Both run in
    float64; Flower's distances come from ``np.linalg.norm(...)**2`` and ours from summed squares, which could only
    swap Krum's choice on a near-tie (none on these draws), and its mean is over the same values: 1e-12."""
    rng = np.random.default_rng(seed)
    model, extra = rng.normal(size=(clients, 4)), rng.normal(size=(clients, 3))
    model[:outliers] += rng.normal(scale=30.0, size=(outliers, 4))
    expected = _flower_bulyan(list(np.concatenate([model, extra], axis=1)), f)
    out = _serve({"name": "bulyan", "f": f}, _release(model, extra), _context(clients=clients))
    _assert_every_row(out, expected[:4], expected[4:], rows=clients)
    if f == 0:  # theta = beta = K: the plain mean
        np.testing.assert_allclose(expected, np.concatenate([model, extra], axis=1).mean(0), atol=TOL)


def test_bulyan_needs_4f_plus_3_clients_and_composes_with_fedsam():
    with pytest.raises(ConfigError, match="robust=bulyan needs at least 7 clients per round"):
        tiny_config("robust.name=bulyan", "robust.f=1", "sampling.clients_per_round=6")
    seven = ("algo=fedsam", "rounds=2", "threads=1", "data.num_clients=8", "sampling.clients_per_round=7")
    run = fedflat.run(tiny_config(*seven, "robust.name=bulyan", "robust.f=1"), save=False, progress=False)
    plain = fedflat.run(tiny_config(*seven), save=False, progress=False)
    assert run.summary["status"] == "completed" and run.metrics[-1]["bulyan_f"] == 1
    assert relative_gap(run.final_parameters, plain.final_parameters) > 1e-4  # the rule is not a no-op here
