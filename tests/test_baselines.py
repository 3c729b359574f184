"""The FL baselines the federated-SAM papers' codes run (issue 56): FedNova, FedDC, FedNTD, MOON, against hand
computations of their equations (docs/algorithms.md), their special cases, and their authors' update rules.

The hand computations re-implement each method in float64 NumPy on the softmax regression of test_classical.py
(4 clients of unequal sizes, 2 sampled per round, ``E_i`` from 1 to 3 mini-batch steps, decaying ``eta_l^t``,
coupled weight decay), drawing the same clients and batches as the engine.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from test_classical import TRAIN, _toy_config, _toy_data, softmax_regression

import fedflat
from fedflat.algorithms import AlgorithmError
from fedflat.config import load_config
from fedflat.core import LocalOptimizer, TrainSettings
from fedflat.engine.batches import local_steps
from fedflat.engine.simulation import Simulation

TOL = {"rtol": 1e-4, "atol": 1e-5}  # float32 engine against float64 NumPy over three rounds of a few steps


def _simulation(algo: dict, engine: str = "sequential", **train) -> Simulation:
    config = load_config(None, base=_toy_config(algo, engine, **train))
    return Simulation(config, dataset=_toy_data())


def _rounds(sim: Simulation):
    """Yields, per round, ``(t, lr, ids, n_i, E_i, schedules)`` as the engine draws them."""
    for t in range(sim.cfg.rounds):
        lr = TRAIN["lr"] * TRAIN["lr_decay"] ** t
        ids = sim.sample_clients(t).tolist()
        n = np.array([len(sim.client_indices[i]) for i in ids], dtype=float)
        steps = [local_steps(int(ni), TRAIN["batch_size"], TRAIN["local_epochs"], None) for ni in n]
        yield t, lr, ids, n, steps, sim.batches.schedules(t, ids, steps)


def _data(sim: Simulation):
    return (sim.dataset.x_train.double().cpu().numpy(), sim.dataset.y_train.cpu().numpy(),
            sim.dataset.num_classes)


def _run(sim: Simulation) -> np.ndarray:
    for t in range(sim.cfg.rounds):
        sim.run_round(t)
    return sim.w.cpu().numpy()


# ---------------------------------------------------------------------------------------------
# FedNova
# ---------------------------------------------------------------------------------------------

def fednova_reference(sim: Simulation) -> np.ndarray:
    """FedNova eq. (7) with plain local SGD: ``w <- w + tau_eff sum_i p_i Delta_i / tau_i``, ``p_i = n_i / sum n``."""
    X, y, classes = _data(sim)
    w = sim.w.double().cpu().numpy().copy()
    for t, lr, ids, n, steps, schedules in _rounds(sim):
        deltas = []
        for batches in schedules:
            wk = w.copy()
            for idx in batches:
                idx = idx.cpu().numpy()
                g = softmax_regression(wk, X[idx], y[idx], classes)[1]
                wk = wk - lr * (g + TRAIN["weight_decay"] * wk)
            deltas.append(wk - w)
        p, tau = n / n.sum(), np.array(steps, dtype=float)
        assert len(set(steps)) > 1 or t < 2  # unequal step counts, where normalization matters
        w = w + (p @ tau) * ((p / tau) @ np.stack(deltas))
    return w


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_fednova_three_rounds_equal_hand_computation(engine):
    sim = _simulation({"name": "fednova"}, engine)
    expected = fednova_reference(_simulation({"name": "fednova"}, engine))
    np.testing.assert_allclose(_run(sim), expected, **TOL)


def test_fednova_differs_from_fedavg_where_step_counts_differ():
    """The premise of the reduction below: on the toy problem (E_i from 1 to 3) FedNova moves off FedAvg."""
    nova = _run(_simulation({"name": "fednova"}))
    avg = _run(_simulation({"name": "fedavg", "weighting": "samples"}))
    assert np.abs(nova - avg).max() > 1e-3


def test_fednova_with_equal_step_counts_is_fedavg_with_the_same_weights(tiny):
    """``E_i = E`` for every client (train.local_steps): tau_eff / tau_i = 1, so FedNova is FedAvg, weights alike."""
    for weighting in ("samples", "uniform"):
        nova = fedflat.run(tiny("algo=fednova", f"algo.weighting={weighting}", "train.local_steps=3"),
                           save=False, progress=False)
        avg = fedflat.run(tiny("algo=fedavg", f"algo.weighting={weighting}", "train.local_steps=3"),
                          save=False, progress=False)
        torch.testing.assert_close(nova.final_parameters, avg.final_parameters, rtol=1e-6, atol=1e-7)


def _settings(**optimizer) -> TrainSettings:
    return TrainSettings(weight_decay=0.0, clip=None, batch_size=1, global_lr=1.0, num_clients=2, seed=0,
                         optimizer=LocalOptimizer(**optimizer))


def test_fednova_normalizer_with_momentum_is_the_sum_of_the_step_coefficients():
    """Eq. (11): under heavy-ball momentum ``rho`` step ``k``'s gradient enters the update with weight
    ``sum_{j<tau-k} rho^j``; ``||a||_1`` is their sum, as the authors' optimizer accumulates it
    (``local_counter = rho local_counter + 1; vec += local_counter``)."""
    from fedflat.algorithms.fednova import normalizer
    rho, steps = 0.9, torch.tensor([1, 2, 5])
    counted = []
    for tau in steps.tolist():
        counter = vec = 0.0
        for _ in range(tau):
            counter = counter * rho + 1
            vec += counter
        counted.append(vec)
    torch.testing.assert_close(normalizer(steps, _settings(momentum=rho)), torch.tensor(counted, dtype=torch.float64))
    torch.testing.assert_close(normalizer(steps, _settings()), steps.double())
    with pytest.raises(AlgorithmError, match="heavy-ball momentum"):
        normalizer(steps, _settings(name="adam"))


class FedSOLNovaServer:
    """Conformance fixture: Lee-Gihun/FedSOL ``algorithms/fednova/Server.py``'s ``_nova_aggregation`` (commit of
    2024, MIT licence), transcribed unmodified below; ``local_a`` is its ``_init_nova_dependencies``' ``a_i``, the
    local step count ``tau_i`` under plain SGD (``rho = 0``)."""

    def __init__(self, local_a):
        self.local_a = local_a

    @torch.no_grad()
    def _nova_aggregation(self, dg_weights, local_weights, client_sizes):
        """Average locally trained model parameters"""
        import copy
        sampled_datasize = sum(list(client_sizes.values()))
        p_i = copy.deepcopy(client_sizes)

        for idx in local_weights.keys():
            p_i[idx] /= sampled_datasize

        c_1, c_2 = 0.0, 0.0

        for idx in local_weights.keys():
            c_1 += p_i[idx] * self.local_a[idx]
            c_2 += p_i[idx] / self.local_a[idx]

        c = 1.0 - c_1 * c_2

        ag_weights = copy.deepcopy(dg_weights)

        for k in ag_weights.keys():
            ag_weights[k] = ag_weights[k] * c

        for k in ag_weights.keys():
            for idx in local_weights.keys():
                ag_weights[k] += (
                    local_weights[idx][k] * c_1 * p_i[idx] / self.local_a[idx]
                )

        return ag_weights


def test_fednova_conforms_to_fedsol_aggregation():
    """One round of fedflat's FedNova against FedSOL's server on the same client models (float64 there)."""
    sim = _simulation({"name": "fednova"})
    for t in range(2):
        w_t = sim.w.double().clone()
        opened = sim.begin_round(t)
        result = sim.executor.fit(opened.broadcast, opened.task, sim.load_state)
        sim.finish_round(opened, result)
        ids = result.ids.tolist()
        steps = dict(zip(ids, opened.ctx.steps.tolist()))
        assert len(set(steps.values())) > 1  # the normalization matters this round
        sizes = {i: len(sim.client_indices[i]) for i in ids}
        local = {i: {"w": result.upload["model"][r].double()} for r, i in enumerate(ids)}
        theirs = FedSOLNovaServer(steps)._nova_aggregation({"w": w_t}, local, sizes)["w"]
        torch.testing.assert_close(sim.w.double(), theirs, rtol=1e-6, atol=1e-6)
