"""The FL baselines the federated-SAM papers' codes run (issue 56): FedNova, FedDC, FedNTD, MOON, against hand
computations of their equations (docs/algorithms.md), their special cases, and their authors' update rules.

The hand computations re-implement each method in float64 NumPy on the softmax regression of test_classical.py
(4 clients of unequal sizes, 2 sampled per round, ``E_i`` from 1 to 3 mini-batch steps, decaying ``eta_l^t``,
coupled weight decay), drawing the same clients and batches as the engine.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_classical import TRAIN, _toy_config, _toy_data, softmax_regression

import fedflat
from fedflat.algorithms import AlgorithmError
from fedflat.config import load_config
from fedflat.core import LocalOptimizer, TrainSettings
from fedflat.engine.client import local_steps
from fedflat.engine.simulation import Simulation, UserInputs

TOL = {"rtol": 1e-4, "atol": 1e-5}  # float32 engine against float64 NumPy over three rounds of a few steps


def _simulation(algo: dict, engine: str = "sequential", **train) -> Simulation:
    config = load_config(None, base=_toy_config(algo, engine, **train))
    return Simulation(config, UserInputs(dataset=_toy_data()))


def _rounds(sim: Simulation):
    """Yields, per round, ``(t, lr, ids, n_i, E_i, schedules)`` as the engine draws them."""
    for t in range(sim.cfg.rounds):
        lr = TRAIN["lr"] * TRAIN["lr_decay"] ** t
        ids = sim.server.sample_clients(t).tolist()
        n = np.array([len(sim.client_indices[i]) for i in ids], dtype=float)
        steps = [local_steps(int(ni), TRAIN["batch_size"], TRAIN["local_epochs"], None) for ni in n]
        yield t, lr, ids, n, steps, sim.batches.schedules(t, ids, steps)


def _data(sim: Simulation):
    return (sim.dataset.x_train.double().cpu().numpy(), sim.dataset.y_train.cpu().numpy(),
            sim.dataset.num_classes)


def local_deltas(w: np.ndarray, schedules, lr: float, grad) -> list[np.ndarray]:
    """Each client's ``Delta_i = w_K - w``: local SGD from ``w`` over its batches (index tensors), each step
    ``w_k <- w_k - lr (grad(w_k, idx) + weight_decay w_k)``."""
    deltas = []
    for batches in schedules:
        wk = w.copy()
        for idx in batches:
            wk = wk - lr * (grad(wk, idx.cpu().numpy()) + TRAIN["weight_decay"] * wk)
        deltas.append(wk - w)
    return deltas


def _run(sim: Simulation) -> np.ndarray:
    for t in range(sim.cfg.rounds):
        sim.run_round(t)
    return sim.server.w.cpu().numpy()


# ---------------------------------------------------------------------------------------------
# FedNova
# ---------------------------------------------------------------------------------------------

def fednova_reference(sim: Simulation) -> np.ndarray:
    """FedNova eq. (7) with plain local SGD: ``w <- w + tau_eff sum_i p_i Delta_i / tau_i``, ``p_i = n_i / sum n``."""
    X, y, classes = _data(sim)
    w = sim.server.w.double().cpu().numpy().copy()
    for t, lr, ids, n, steps, schedules in _rounds(sim):
        deltas = local_deltas(w, schedules, lr, lambda wk, idx: softmax_regression(wk, X[idx], y[idx], classes)[1])
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
        w_t = sim.server.w.double().clone()
        opened = sim.server.begin_round(t)
        result = sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state)
        sim.server.finish_round(opened, result)
        ids = result.ids.tolist()
        steps = dict(zip(ids, opened.ctx.steps.tolist()))
        assert len(set(steps.values())) > 1  # the normalization matters this round
        sizes = {i: len(sim.client_indices[i]) for i in ids}
        local = {i: {"w": result.upload["model"][r].double()} for r, i in enumerate(ids)}
        theirs = FedSOLNovaServer(steps)._nova_aggregation({"w": w_t}, local, sizes)["w"]
        torch.testing.assert_close(sim.server.w.double(), theirs, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# FedDC
# ---------------------------------------------------------------------------------------------

def feddc_reference(sim: Simulation, alpha: float) -> dict:
    """FedDC from its equations (fedflat/algorithms/feddc.py, ``s_i = 1``): the local direction
    ``g + alpha (theta + h_i - w) + g_glob - g_i`` (then weight decay), ``h_i += Delta_i``,
    ``g_i <- g_i - g_glob - Delta_i / (E_i eta_l)``, ``g_glob += (1/N) sum (g_i^+ - g_i)``,
    ``hbar += (1/N) sum Delta_i``, ``w <- w + mean Delta_i + hbar``."""
    X, y, classes = _data(sim)
    N = sim.cfg.data.num_clients
    w = sim.server.w.double().cpu().numpy().copy()
    zero = np.zeros_like(w)
    g, hbar, h_i, g_i = zero.copy(), zero.copy(), {}, {}
    for t, lr, ids, n, steps, schedules in _rounds(sim):
        deltas, dg = [], zero.copy()
        for i, E, batches in zip(ids, steps, schedules):
            hi, gi = h_i.get(i, zero), g_i.get(i, zero)
            wk = w.copy()
            for idx in batches:
                idx = idx.cpu().numpy()
                grad = softmax_regression(wk, X[idx], y[idx], classes)[1]
                wk = wk - lr * (grad + alpha * (wk + hi - w) + g - gi + TRAIN["weight_decay"] * wk)
            delta = wk - w
            h_i[i] = hi + delta
            g_i[i] = gi - g - delta / (E * lr)
            dg += g_i[i] - gi
            deltas.append(delta)
        g = g + dg / N
        hbar = hbar + np.sum(deltas, 0) / N
        w = w + np.mean(deltas, 0) + hbar
    return {"w": w, "g": g, "hbar": hbar, "h_i": h_i, "g_i": g_i}


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_feddc_three_rounds_equal_hand_computation(engine):
    algo = {"name": "feddc", "alpha": 0.3}
    sim = _simulation(algo, engine)
    expected = feddc_reference(_simulation(algo, engine), 0.3)
    np.testing.assert_allclose(_run(sim), expected["w"], **TOL)
    np.testing.assert_allclose(sim.server.state["feddc.g"].cpu().numpy(), expected["g"], **TOL)
    np.testing.assert_allclose(sim.server.state["feddc.hbar"].cpu().numpy(), expected["hbar"], **TOL)
    for key, ref in (("feddc.h_i", "h_i"), ("feddc.g_i", "g_i")):
        ids = sorted(expected[ref])
        values, present = sim.server.store.get(key, torch.tensor(ids))
        assert present.all()
        np.testing.assert_allclose(values.cpu().numpy(), np.stack([expected[ref][i] for i in ids]), **TOL)


def test_feddc_without_penalty_is_scaffold_plus_the_mean_drift():
    """alpha = 0: the local direction and variates are SCAFFOLD's (option II), so after one round ``g = c`` and the
    model is SCAFFOLD's plus ``hbar = (1/N) sum_S Delta_i``, the drift the server adds."""
    dc, sc = _simulation({"name": "feddc", "alpha": 0.0}), _simulation({"name": "scaffold"})
    w0 = dc.server.w.clone()
    dc.run_round(0)
    sc.run_round(0)
    torch.testing.assert_close(dc.server.state["feddc.g"], sc.server.state["scaffold.c"], rtol=1e-6, atol=1e-7)
    hbar = dc.server.state["feddc.hbar"]
    assert hbar.abs().max() > 1e-3
    torch.testing.assert_close(dc.server.w, sc.server.w + hbar, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(hbar * dc.cfg.data.num_clients, (sc.server.w - w0) * sc.cfg.sampling.clients_per_round,
                               rtol=1e-5, atol=1e-6)


class _TensorDataset(torch.utils.data.Dataset):
    """The FedDC code's ``Dataset(trn_x, trn_y, train=True, dataset_name=...)`` over tensors (no image files)."""

    def __init__(self, data_x, data_y, train=False, dataset_name=""):
        self.x, self.y = torch.as_tensor(data_x, dtype=torch.float32), torch.as_tensor(data_y)

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def _feddc_code() -> dict:
    from pathlib import Path
    namespace = {"np": np, "torch": torch, "data": torch.utils.data, "device": torch.device("cpu"), "max_norm": 10,
                 "Dataset": _TensorDataset}
    path = Path(__file__).parent / "authors" / "feddc_train_model.py"
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace


def test_feddc_conforms_to_the_authors_code():
    """Three rounds of fedflat's FedDC (``algo.size_scaled=true``, the code's ``weight_list``) against the authors'
    ``train_model_FedDC`` (transcribed unmodified, tests/authors/) and the bookkeeping of their ``train_FedDC`` loop
    (below, line by line): 4 clients of unequal sizes, full participation, 2 full-batch steps a round (so the code's
    shuffling does not matter and its ``n_minibatch`` is every client's ``E_i``), a constant rate (the code's
    variate divides by the initial one), weight decay, clip 10 on the loss gradient as the code clips."""
    alpha, lr, epochs = 0.3, 0.4, 2
    base = _toy_config({"name": "feddc", "alpha": alpha, "size_scaled": True}, "sequential", batch_size=16,
                       local_epochs=epochs, lr_decay=1.0, lr=lr, clip=10.0)
    base["sampling"] = {"clients_per_round": 4}
    sim = Simulation(load_config(None, base=base), UserInputs(dataset=_toy_data()))
    code = _feddc_code()
    # (the authors' code runs on the CPU: fedflat's run on any device, its numbers compared there)
    X, Y = sim.dataset.x_train.cpu().numpy(), sim.dataset.y_train.cpu().numpy()
    clnt_x = [X[ix.cpu().numpy()] for ix in sim.client_indices]
    clnt_y = [Y[ix.cpu().numpy()] for ix in sim.client_indices]
    n_clnt, n_par = len(clnt_y), sim.server.w.numel()
    assert len({len(c) for c in clnt_y}) > 1  # unequal sizes: the code's weight_list matters
    model_func = lambda: torch.nn.Linear(X.shape[1], sim.dataset.num_classes)  # fedflat's logreg: weight, then bias
    weight_list = np.asarray([len(clnt_y[i]) for i in range(n_clnt)])
    weight_list = weight_list / np.sum(weight_list) * n_clnt
    parameter_drifts = np.zeros((n_clnt, n_par)).astype('float32')
    cld_mdl_param = sim.server.w.cpu().numpy().copy()
    clnt_params_list = np.ones(n_clnt).astype('float32').reshape(-1, 1) * cld_mdl_param.reshape(1, -1)
    state_gadient_diffs = np.zeros((n_clnt + 1, n_par)).astype('float32')
    n_minibatch = epochs
    for t in range(3):
        selected_clnts = np.arange(n_clnt)
        global_mdl = torch.tensor(cld_mdl_param, dtype=torch.float32)
        delta_g_sum = np.zeros(n_par)
        for clnt in selected_clnts:  # the code's loop body (utils_methods_FedDC.py, train_FedDC)
            model = model_func()
            torch.nn.utils.vector_to_parameters(global_mdl.clone(), model.parameters())
            local_update_last = state_gadient_diffs[clnt]
            global_update_last = state_gadient_diffs[-1] / weight_list[clnt]
            alpha_i = alpha / weight_list[clnt]
            hist_i = torch.tensor(parameter_drifts[clnt], dtype=torch.float32)
            trained = code["train_model_FedDC"](model, model_func, alpha_i, local_update_last, global_update_last,
                                                global_mdl, hist_i, clnt_x[clnt], clnt_y[clnt], lr, 16, epochs,
                                                1000, 0.01, "toy", 1, 1)
            curr_model_par = code["get_mdl_params"]([trained], n_par)[0]
            delta_param_curr = curr_model_par - cld_mdl_param
            parameter_drifts[clnt] += delta_param_curr
            beta = 1 / n_minibatch / lr
            state_g = local_update_last - global_update_last + beta * (-delta_param_curr)
            delta_g_cur = (state_g - state_gadient_diffs[clnt]) * weight_list[clnt]
            delta_g_sum += delta_g_cur
            state_gadient_diffs[clnt] = state_g
            clnt_params_list[clnt] = curr_model_par
        avg_mdl_param_sel = np.mean(clnt_params_list[selected_clnts], axis=0)
        delta_g_cur = 1 / n_clnt * delta_g_sum
        state_gadient_diffs[-1] += delta_g_cur
        cld_mdl_param = avg_mdl_param_sel + np.mean(parameter_drifts, axis=0)

        sim.run_round(t)
        np.testing.assert_allclose(sim.server.w.cpu().numpy(), cld_mdl_param, rtol=1e-5, atol=2e-6)
        np.testing.assert_allclose(sim.server.state["feddc.g"].cpu().numpy(), state_gadient_diffs[-1], rtol=1e-5,
                                   atol=2e-6)


# ---------------------------------------------------------------------------------------------
# FedNTD
# ---------------------------------------------------------------------------------------------

def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def ntd_gradient(w: np.ndarray, teacher: np.ndarray, X: np.ndarray, y: np.ndarray, classes: int, beta: float,
                 tau: float) -> np.ndarray:
    """Gradient of FedNTD's ``CE + beta tau^2 (1/B) sum_b KL(q~_b || p~_b)`` for the softmax regression, by hand:
    with respect to sample ``b``'s logits, ``(softmax(z_b) - e_y) / B`` plus ``beta tau (p~_b - q~_b) / B`` on its
    not-true classes (``d KL / d z = (p~ - q~) / tau``)."""
    d = X.shape[1]
    B = len(y)

    def logits(v):
        return X @ v[: classes * d].reshape(classes, d).T + v[classes * d:]
    z, zt = logits(w), logits(teacher)
    G = _softmax(z)
    G[np.arange(B), y] -= 1.0
    for b in range(B):
        nt = [k for k in range(classes) if k != y[b]]
        G[b, nt] += beta * tau * (_softmax(z[b, nt] / tau) - _softmax(zt[b, nt] / tau))
    G /= B
    return np.concatenate([(G.T @ X).ravel(), G.sum(0)])


def fedntd_reference(sim: Simulation, beta: float, tau: float) -> np.ndarray:
    X, y, classes = _data(sim)
    w = sim.server.w.double().cpu().numpy().copy()
    for t, lr, ids, n, steps, schedules in _rounds(sim):
        deltas = local_deltas(w, schedules, lr, lambda wk, idx: ntd_gradient(wk, w, X[idx], y[idx], classes, beta, tau))
        w = w + np.mean(deltas, 0)
    return w


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_fedntd_three_rounds_equal_hand_computation(engine):
    algo = {"name": "fedntd", "beta": 2.0, "tau": 1.5}
    sim = _simulation(algo, engine)
    expected = fedntd_reference(_simulation(algo, engine), 2.0, 1.5)
    np.testing.assert_allclose(_run(sim), expected, **TOL)
    assert np.abs(expected - fedntd_reference(_simulation(algo, engine), 0.0, 1.5)).max() > 1e-3  # the term matters


@pytest.mark.parametrize("base", [(), ("algo=fedsam", "algo.rho=0.1")], ids=["fedavg", "fedsam"])
def test_fedntd_with_beta_zero_is_its_base_method(tiny, base):
    """beta = 0: no distillation term, the base run bit for bit (FedAvg, or FedSAM under ``correction=ntd``)."""
    plain = fedflat.run(tiny(*base), save=False, progress=False)
    ntd = (("algo=fedntd",) if not base else (*base, "algo.correction=ntd")) + ("algo.beta=0",)
    other = fedflat.run(tiny(*ntd), save=False, progress=False)
    assert torch.equal(other.final_parameters, plain.final_parameters)
    moved = fedflat.run(tiny(*ntd[:-1], "algo.beta=1"), save=False, progress=False)
    assert not torch.equal(moved.final_parameters, plain.final_parameters)


def test_fedntd_loss_conforms_to_the_authors_criterion():
    """fedflat's objective (fedflat.engine.client.distilled_objective, not_true) against FedSOL's ``NTD_Loss``
    (transcribed unmodified, tests/authors/fedsol_ntd.py): value and gradient in the logits, 10 classes, tau 3."""
    from authors.fedsol_ntd import NTD_Loss

    from fedflat.engine.gradients import distilled_objective
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 10, generator=gen, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(7, 10, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 10, (7,), generator=gen)
    theirs = NTD_Loss(num_classes=10, tau=3.0, beta=0.7)(logits, y, teacher)
    ours, ce = distilled_objective(logits, y, torch.log_softmax(teacher / 3.0, -1), 0.7, 3.0, not_true=True)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.autograd.grad(ours, logits)[0], torch.autograd.grad(theirs, logits)[0],
                               rtol=1e-12, atol=1e-12)
    assert float((ours - ce).detach()) > 1e-3


def test_fedntd_equals_the_authors_round_on_the_conformance_problem():
    """Three rounds of FedSOL's FedNTD as its code runs them, on scripts/conformance.py's problem of unequal clients:
    ``ClientTrainer.train`` (algorithms/fedntd/ClientTrainer.py: the global model kept as the teacher, ``NTD_Loss``
    of the logits and the teacher's, one SGD step a batch; ``NTD_Loss`` transcribed unmodified, tests/authors/) over
    full-batch steps, and ``BaseServer._aggregation`` (algorithms/BaseServer.py:164-176), the average weighted by the
    clients' samples, against ``fedntd`` with ``algo.weighting=samples``: equal to float32 rounding. Uniform weights,
    the conformance table's setting before, are not."""
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from authors.fedsol_ntd import NTD_Loss
    from conformance import CLASSES, LR, LR_DECAY, STEPS, WD, code_rounds, fedflat_run, problem, sample_weights

    beta, tau = 1.0, 3.0
    x, y, model_fn = problem()
    criterion = NTD_Loss(num_classes=CLASSES, tau=tau, beta=beta)

    def train(model, server, data, targets, t):  # ClientTrainer.train, the teacher kept as _keep_global does
        dg_model = copy.deepcopy(server)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR * LR_DECAY ** t, weight_decay=WD)
        for _ in range(STEPS):
            optimizer.zero_grad()
            with torch.no_grad():
                dg_logits = dg_model(data)
            criterion(model(data), targets, dg_logits).backward()
            optimizer.step()
    theirs = code_rounds(x, y, model_fn, train, sample_weights())
    options = ["algo=fedntd", f"algo.beta={beta}", f"algo.tau={tau}"]
    ours = fedflat_run([*options, "algo.weighting=samples"], x, y, model_fn, None, "loss")
    for a, b in zip(theirs, ours):
        torch.testing.assert_close(b, a, rtol=0, atol=5e-7)  # entries of order 0.16: float32 rounding
    uniform = fedflat_run(options, x, y, model_fn, None, "loss")
    assert (uniform[-1] - theirs[-1]).abs().max() > 1e-4


def test_fedntd_refuses_a_second_distillation_term():
    with pytest.raises(AlgorithmError, match="each add a distillation term"):
        fedflat.algorithms.build_algorithm({"name": "fedgmt", "correction": "ntd"})


# ---------------------------------------------------------------------------------------------
# MOON
# ---------------------------------------------------------------------------------------------

HIDDEN = 5


def _moon_loss(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor, classes: int, w_glob: torch.Tensor,
               w_prev: torch.Tensor | None, mu: float, T: float) -> torch.Tensor:
    """MOON's objective written out for the 3-5-3 ReLU MLP (flat as fedflat's: W1, b1, W2, b2), float64:
    ``CE + mu mean_b -log(e^{cos(z, z_g)/T} / (e^{cos(z, z_g)/T} + e^{cos(z, z_p)/T}))``, no term without ``w_prev``."""
    d = X.shape[1]

    def forward(v):
        W1, b1 = v[: HIDDEN * d].reshape(HIDDEN, d), v[HIDDEN * d: HIDDEN * d + HIDDEN]
        rest = v[HIDDEN * d + HIDDEN:]
        W2, b2 = rest[: classes * HIDDEN].reshape(classes, HIDDEN), rest[classes * HIDDEN:]
        z = torch.relu(X @ W1.T + b1)
        return z @ W2.T + b2, z

    logits, z = forward(w)
    ce = -torch.log_softmax(logits, 1)[torch.arange(len(y)), y].mean()
    if w_prev is None:
        return ce

    def cos(a, b):
        return (a * b).sum(1) / torch.clamp(a.norm(dim=1) * b.norm(dim=1), min=1e-8)
    with torch.no_grad():
        zg, zp = forward(w_glob)[1], forward(w_prev)[1]
    pos, neg = torch.exp(cos(z, zg) / T), torch.exp(cos(z, zp) / T)
    return ce + mu * (-torch.log(pos / (pos + neg))).mean()


def moon_reference(sim: Simulation, mu: float, T: float) -> tuple[torch.Tensor, dict]:
    X = sim.dataset.x_train.double()
    y = sim.dataset.y_train
    classes = sim.dataset.num_classes
    w = sim.server.w.double().clone()
    previous: dict[int, torch.Tensor] = {}
    for t, lr, ids, n, steps, schedules in _rounds(sim):
        finals = []
        for i, batches in zip(ids, schedules):
            wk = w.clone()
            for idx in batches:
                v = wk.clone().requires_grad_(True)
                loss = _moon_loss(v, X[idx], y[idx], classes, w, previous.get(i), mu, T)
                g = torch.autograd.grad(loss, v)[0]
                wk = wk - lr * (g + TRAIN["weight_decay"] * wk)
            finals.append(wk)
        for i, wf in zip(ids, finals):
            previous[i] = wf
        w = torch.stack(finals).mean(0)
    return w, previous


def _moon_simulation(engine: str, **algo) -> Simulation:
    base = _toy_config({"name": "moon", **algo}, engine)
    base["model"] = {"name": "mlp", "hidden": [HIDDEN]}
    return Simulation(load_config(None, base=base), UserInputs(dataset=_toy_data()))


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_moon_three_rounds_equal_hand_computation(engine):
    """Clients sampled twice meet their previous local model; first participations have no contrastive term."""
    sim = _moon_simulation(engine, mu=3.0, temperature=0.5)
    expected, previous = moon_reference(_moon_simulation(engine), 3.0, 0.5)
    _run(sim)
    torch.testing.assert_close(sim.server.w.double(), expected, rtol=1e-4, atol=1e-5)
    ids = sorted(previous)
    values, present = sim.server.store.get("moon.w_prev", torch.tensor(ids))
    assert present.all()
    torch.testing.assert_close(values.double(), torch.stack([previous[i] for i in ids]), rtol=1e-4, atol=1e-5)
    no_term, _ = moon_reference(_moon_simulation(engine), 0.0, 0.5)
    assert (expected - no_term).abs().max() > 1e-4  # the term moved the model


@pytest.mark.parametrize("base", [(), ("algo=fedsam", "algo.rho=0.1")], ids=["fedavg", "fedsam"])
def test_moon_with_mu_zero_is_its_base_method(tiny, base):
    plain = fedflat.run(tiny(*base), save=False, progress=False)
    moon = (("algo=moon",) if not base else (*base, "algo.correction=moon")) + ("algo.mu=0",)
    assert torch.equal(fedflat.run(tiny(*moon), save=False, progress=False).final_parameters, plain.final_parameters)
    moved = fedflat.run(tiny(*moon[:-1], "algo.mu=1"), save=False, progress=False)
    assert not torch.equal(moved.final_parameters, plain.final_parameters)


def test_moon_loss_conforms_to_the_authors_criterion():
    """fedflat's objective (fedflat.engine.client.contrastive_objective) against FedSOL's ``ModelContrastiveLoss``
    (transcribed unmodified, tests/authors/fedsol_moon.py): value, and gradient in the logits and the representation."""
    from authors.fedsol_moon import ModelContrastiveLoss

    from fedflat.engine.gradients import contrastive_objective
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    z = torch.randn(6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    zp, zg = torch.randn(6, 8, generator=gen, dtype=torch.float64), torch.randn(6, 8, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 4, (6,), generator=gen)
    theirs = ModelContrastiveLoss(rho=0.7, tau=0.5)(logits, y, z, zp, zg)
    ours, _ = contrastive_objective(logits, z, y, zg, zp, torch.tensor(1.0, dtype=torch.float64), 0.7, 0.5)
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)
    for mine, their in zip(torch.autograd.grad(ours, (logits, z)), torch.autograd.grad(theirs, (logits, z))):
        torch.testing.assert_close(mine, their, rtol=1e-12, atol=1e-12)


def test_moon_refuses_a_model_with_batch_statistics(tiny):
    with pytest.raises(ValueError, match="batch statistics"):
        fedflat.run(tiny("algo=moon", "model.name=cnn", "model.padding=2", "model.norm=batch", "rounds=1"), save=False, progress=False)


# ---------------------------------------------------------------------------------------------
# FedBABU
# ---------------------------------------------------------------------------------------------

def _mlp_simulation(algo: dict, engine: str = "sequential") -> Simulation:
    base = _toy_config(algo, engine)
    base["model"] = {"name": "mlp", "hidden": [HIDDEN]}
    return Simulation(load_config(None, base=base), UserInputs(dataset=_toy_data()))


def _mlp_grad(w: torch.Tensor, X: torch.Tensor, y: torch.Tensor, classes: int) -> torch.Tensor:
    v = w.clone().requires_grad_(True)
    return torch.autograd.grad(_moon_loss(v, X, y, classes, w, None, 0.0, 1.0), v)[0]


def fedbabu_reference(sim: Simulation, finetune_epochs: int) -> tuple[torch.Tensor, dict]:
    """FedBABU by its rules: local SGD on the body only (the head, the last Linear, never moves nor decays), the
    mean of the models; each sampled client fine-tunes ``w^t`` (all entries, plain SGD with weight decay) for
    ``finetune_epochs`` epochs of the batches of its stream ``finetune``."""
    X, y, classes = sim.dataset.x_train.double(), sim.dataset.y_train, sim.dataset.num_classes
    w = sim.server.w.double().clone()
    head = torch.zeros_like(w, dtype=torch.bool)
    head[-(classes * HIDDEN + classes):] = True
    wd, personal = TRAIN["weight_decay"], {}
    for t, lr, ids, n, steps, schedules in _rounds(sim):
        finals = []
        for i, ni, batches in zip(ids, n, schedules):
            wk = w.clone()
            for idx in batches:
                d = _mlp_grad(wk, X[idx], y[idx], classes) + wd * wk
                wk = wk - lr * d.masked_fill(head, 0.0)
            finals.append(wk)
            v = w.clone()
            for idx in sim.batches.extra(t, i, finetune_epochs * -(-int(ni) // TRAIN["batch_size"]), "finetune"):
                v = v - lr * (_mlp_grad(v, X[idx], y[idx], classes) + wd * v)
            personal[i] = v
        w = torch.stack(finals).mean(0)
    return w, personal


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_fedbabu_three_rounds_equal_hand_computation(engine):
    sim = _mlp_simulation({"name": "fedbabu", "finetune_epochs": 2}, engine)
    w0 = sim.server.w.clone()
    expected, personal = fedbabu_reference(_mlp_simulation({"name": "fedbabu"}, engine), 2)
    _run(sim)
    torch.testing.assert_close(sim.server.w.double(), expected, rtol=1e-4, atol=1e-5)
    head = 3 * HIDDEN + 3
    w = sim.server.w
    assert torch.equal(w[-head:], w0[-head:]) and not torch.equal(w[:-head], w0[:-head])  # head frozen
    ids = sorted(personal)
    values, present = sim.server.store.get("babu.w_i", torch.tensor(ids))
    assert present.all()
    torch.testing.assert_close(values.double(), torch.stack([personal[i] for i in ids]), rtol=1e-4, atol=1e-5)


def test_fedbabu_evaluates_each_clients_fine_tuned_model(tiny):
    """The personalized accuracy is that of the clients' fine-tuned models: with no fine-tuning they are ``w^t`` of
    their last round, and more fine-tuning changes what is evaluated, not the federated model."""
    runs = {e: fedflat.run(tiny("algo=fedbabu", f"algo.finetune_epochs={e}"), save=False, progress=False)
            for e in (0, 3)}
    assert torch.equal(runs[0].final_parameters, runs[3].final_parameters)
    assert runs[0].metrics[-1]["test_loss"] != runs[3].metrics[-1]["test_loss"]


# ---------------------------------------------------------------------------------------------
# Per-FedAvg
# ---------------------------------------------------------------------------------------------

def perfedavg_reference(sim: Simulation, alpha: float, variant: str, delta: float = 1e-3) -> tuple[np.ndarray, dict]:
    """Per-FedAvg's Algorithm 1 on the softmax regression in float64: at step ``k`` the inner batch ``D`` and (HF)
    ``D''`` are step ``k`` of the client's streams ``perfedavg.inner`` / ``perfedavg.hessian``; ``w <- w - beta (d +
    wd w)`` with ``d = g(w - alpha g(w; D); D')`` (FO) minus ``alpha (g(w + delta d; D'') - g(w - delta d; D'')) /
    (2 delta)`` (HF); the personalized model is ``w^t - alpha (g(w^t; D_a) + wd w^t)`` on the stream
    ``perfedavg.adapt``."""
    X, y, classes = _data(sim)
    wd = TRAIN["weight_decay"]
    w = sim.server.w.double().cpu().numpy().copy()
    personal = {}

    def grad(v, idx):
        idx = idx.cpu().numpy()
        return softmax_regression(v, X[idx], y[idx], classes)[1]
    for t, lr, ids, n, steps, schedules in _rounds(sim):
        finals = []
        for i, E, batches in zip(ids, steps, schedules):
            inner = sim.batches.extra(t, i, E, "perfedavg.inner")
            hessian = sim.batches.extra(t, i, E, "perfedavg.hessian")
            wk = w.copy()
            for k, idx in enumerate(batches):
                d = grad(wk - alpha * grad(wk, inner[k]), idx)
                if variant == "hf":
                    d = d - alpha * (grad(wk + delta * d, hessian[k]) - grad(wk - delta * d, hessian[k])) / (2 * delta)
                wk = wk - lr * (d + wd * wk)
            finals.append(wk)
            adapt = sim.batches.extra(t, i, 1, "perfedavg.adapt")[0]
            personal[i] = w - alpha * (grad(w, adapt) + wd * w)
        w = np.mean(finals, 0)
    return w, personal


@pytest.mark.parametrize("name, engine", [("perfedavg", "sequential"), ("perfedavg", "vectorized"),
                                          ("perfedavg-hf", "sequential")])
def test_perfedavg_three_rounds_equal_hand_computation(name, engine):
    """The HF tolerance: its finite difference divides float32 gradient differences by 2 delta = 0.2."""
    algo = {"name": name, "alpha": 0.3, **({"delta": 0.1} if name.endswith("hf") else {})}
    sim = _simulation(algo, engine)
    variant = "hf" if name.endswith("hf") else "fo"
    expected, personal = perfedavg_reference(_simulation(algo, engine), 0.3, variant, 0.1)
    tol = TOL if variant == "fo" else {"rtol": 1e-4, "atol": 5e-5}
    np.testing.assert_allclose(_run(sim), expected, **tol)
    ids = sorted(personal)
    values, present = sim.server.store.get("perfedavg.w_i", torch.tensor(ids))
    assert present.all()
    np.testing.assert_allclose(values.cpu().numpy(), np.stack([personal[i] for i in ids]), **tol)
    other, _ = perfedavg_reference(_simulation(algo, engine), 0.3, "hf" if variant == "fo" else "fo", 0.1)
    assert np.abs(expected - other).max() > 1e-3  # the two variants differ here


def test_perfedavg_with_alpha_zero_trains_fedavgs_model(tiny):
    """alpha = 0: no inner step (``eps = 0``), so the federated model is FedAvg's; the personalized models are
    ``w^t`` itself."""
    avg = fedflat.run(tiny(), save=False, progress=False)
    for name in ("perfedavg", "perfedavg-hf"):
        per = fedflat.run(tiny(f"algo={name}", "algo.alpha=0"), save=False, progress=False)
        torch.testing.assert_close(per.final_parameters, avg.final_parameters, rtol=1e-6, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# FedALA
# ---------------------------------------------------------------------------------------------

ALA = {"eta": 2.0, "rand_percent": 60.0, "ala_tensors": 2, "threshold": 1e-3, "num_pre_loss": 2, "ala_max_epochs": 4}


def fedala_reference(sim: Simulation, p: dict) -> tuple[torch.Tensor, dict]:
    """FedALA by its rules (PFLlib's ``ALA.adaptive_local_aggregation``) in float64 on the 3-5-3 MLP: the head (the
    last two tensors) adapted, the body set to ``w^t``; ``W`` learned batch by batch over the batches of the stream
    ``ala``; the start phase (a client's first ALA) repeats epochs until the std of the last ``num_pre_loss`` epochs'
    last losses is below ``threshold`` or ``ala_max_epochs``; local SGD; the sample-weighted mean."""
    X, y, classes = sim.dataset.x_train.double(), sim.dataset.y_train, sim.dataset.num_classes
    w = sim.server.w.double().clone()
    head = torch.zeros_like(w, dtype=torch.bool)
    head[-(classes * HIDDEN + classes):] = True
    theta_i, W_i, personal, ran = {}, {}, {}, set()
    for t, lr, ids, n, steps, schedules in _rounds(sim):
        finals = []
        for i, ni, batches in zip(ids, n, schedules):
            start = w.clone()
            if i in theta_i:
                theta = torch.where(head, theta_i[i], w)
                weights = W_i.get(i, torch.ones_like(w))
                count = math.ceil(p["rand_percent"] / 100 * int(ni) / TRAIN["batch_size"])
                ala_batches = sim.batches.extra(t, i, count, "ala")
                losses = []
                for epoch in range(p["ala_max_epochs"]):
                    for idx in ala_batches:
                        v = (theta + (w - theta) * weights).requires_grad_(True)
                        loss = _moon_loss(v, X[idx], y[idx], classes, w, None, 0.0, 1.0)
                        g = torch.autograd.grad(loss, v)[0]
                        weights = torch.where(head, torch.clamp(weights - p["eta"] * g * (w - theta), 0, 1), weights)
                    losses.append(loss.item())
                    if i in ran:
                        break
                    if len(losses) > p["num_pre_loss"] and np.std(losses[-p["num_pre_loss"]:]) < p["threshold"]:
                        break
                ran.add(i)
                W_i[i] = weights
                start = theta + (w - theta) * weights
            wk = start.clone()
            for idx in batches:
                wk = wk - lr * (_mlp_grad(wk, X[idx], y[idx], classes) + TRAIN["weight_decay"] * wk)
            theta_i[i], personal[i] = wk, start
            finals.append(wk)
        pw = torch.tensor(n / n.sum(), dtype=torch.float64, device=w.device)
        w = pw @ torch.stack(finals)
    return w, personal


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_fedala_three_rounds_equal_hand_computation(engine):
    """Rounds of 2 of 4 clients, so clients meet ALA's start phase and later phases; both engines."""
    algo = {"name": "fedala", **ALA}
    base = _toy_config(algo, engine)
    base["model"], base["rounds"] = {"name": "mlp", "hidden": [HIDDEN]}, 4
    sim = Simulation(load_config(None, base=base), UserInputs(dataset=_toy_data()))
    expected, personal = fedala_reference(Simulation(load_config(None, base=base), UserInputs(dataset=_toy_data())),
                                          ALA)
    _run(sim)
    torch.testing.assert_close(sim.server.w.double(), expected, rtol=1e-4, atol=1e-5)
    ids = sorted(personal)
    values, present = sim.server.store.get("ala.w_i", torch.tensor(ids))
    assert present.all()
    torch.testing.assert_close(values.double(), torch.stack([personal[i] for i in ids]), rtol=1e-4, atol=1e-5)
    plain, _ = fedala_reference(Simulation(load_config(None, base=base), UserInputs(dataset=_toy_data())),
                                {**ALA, "eta": 0.0})
    assert (expected - plain).abs().max() > 1e-4  # the learned weights moved the start models


def test_fedala_with_eta_zero_is_fedavg(tiny):
    """eta = 0: the weights stay 1, so every client starts from ``theta_i + (w - theta_i) = w^t`` (up to rounding)."""
    avg = fedflat.run(tiny("algo=fedavg", "algo.weighting=samples"), save=False, progress=False)
    ala = fedflat.run(tiny("algo=fedala", "algo.eta=0", "algo.ala_max_epochs=1"), save=False, progress=False)
    torch.testing.assert_close(ala.final_parameters, avg.final_parameters, rtol=1e-5, atol=1e-6)
