"""The round loop, FedAvg and FedSAM against hand computations and their special cases."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fedflat
from fedflat.data import Dataset
from fedflat.engine.simulation import Simulation, UserInputs


def timing_free(metrics: list[dict]) -> list[dict]:
    """Metrics without wall-clock fields, which differ between identical runs."""
    return [{k: v for k, v in m.items() if "seconds" not in k} for m in metrics]


def softmax_regression_grad(W: np.ndarray, b: np.ndarray, X: np.ndarray, y: np.ndarray):
    """Gradient of the mean cross-entropy of ``softmax(X W^T + b)``, written out by hand."""
    logits = X @ W.T + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1.0
    return p.T @ X / len(y), p.mean(0)


def _linear_problem():
    rng = np.random.default_rng(3)
    X = rng.normal(size=(8, 3)).astype(np.float32)
    y = np.array([0, 1, 1, 0, 1, 0, 0, 1])
    data = Dataset("toy", torch.tensor(X).view(8, 3), torch.tensor(y), torch.tensor(X), torch.tensor(y), 2)
    return X, y, data


def _one_client_config(algo: dict, **train) -> dict:
    return {"rounds": 1, "data": {"name": "synthetic", "num_clients": 1, "partition": {"scheme": "iid"}},
            "model": {"name": "logreg"}, "algo": algo, "sampling": {"clients_per_round": 1},
            "train": {"local_steps": 1, "batch_size": 8, "lr": 0.5, "weight_decay": 0.01, "clip": None, **train}}


@pytest.mark.parametrize("rho", [0.0, 0.3])
def test_one_sam_step_equals_hand_computation(rho):
    """w+ = w - lr (g(w + rho g/||g||) + wd w) with ONE L2 norm over all parameters, same batch."""
    X, y, data = _linear_problem()
    hist = fedflat.run(_one_client_config({"name": "fedsam", "rho": rho}), dataset=data, save=False, progress=False)
    sim_w0 = Simulation(fedflat.load_config(None, base=_one_client_config({"name": "fedsam", "rho": rho})),
                        UserInputs(dataset=data)).server.w.cpu().numpy()
    W, b = sim_w0[:6].reshape(2, 3), sim_w0[6:]
    gW, gb = softmax_regression_grad(W, b, X, y)
    norm = np.sqrt((gW ** 2).sum() + (gb ** 2).sum())
    eW, eb = rho * gW / (norm + 1e-12), rho * gb / (norm + 1e-12)
    hW, hb = softmax_regression_grad(W + eW, b + eb, X, y)
    expected = np.concatenate([(W - 0.5 * (hW + 0.01 * W)).ravel(), b - 0.5 * (hb + 0.01 * b)])
    np.testing.assert_allclose(hist.final_parameters.numpy(), expected, rtol=1e-5, atol=1e-6)


def test_fedsam_with_zero_radius_equals_fedavg(tiny):
    avg = fedflat.run(tiny(), save=False, progress=False)
    sam = fedflat.run(tiny("algo=fedsam", "algo.rho=0.0"), save=False, progress=False)
    torch.testing.assert_close(sam.final_parameters, avg.final_parameters, rtol=0, atol=0)
    assert timing_free(sam.metrics) == timing_free(avg.metrics)


def test_full_batch_local_step_equals_centralized_gradient_step(tiny):
    """FedAvg, full participation, one full-batch local step, sample weights, eta_g = 1:
    w^{t+1} = w^t - lr (grad F(w^t) + wd w^t) with F the mean loss over all training samples."""
    cfg = tiny("rounds=1", "train.local_steps=1", "train.batch_size=1000", "train.clip=null",
               "sampling.clients_per_round=6", "algo.weighting=samples")
    sim = Simulation(cfg)
    w0 = sim.server.w.clone()
    sim.run_round(0)
    used = torch.cat(sim.client_indices)
    x, y = sim.dataset.x_train[used], sim.dataset.y_train[used]
    leaf = w0.clone().requires_grad_(True)
    loss = torch.nn.functional.cross_entropy(sim.model(leaf, x), y)
    (grad,) = torch.autograd.grad(loss, leaf)
    expected = w0 - cfg.train.lr * (grad + cfg.train.weight_decay * w0)
    torch.testing.assert_close(sim.server.w, expected, rtol=1e-5, atol=1e-6)


def test_fedavg_round_with_iid_data_averages_local_sgd(tiny):
    """One FedAvg round: the mean of each sampled client's own local gradient descent, by hand."""
    cfg = tiny("rounds=1", "data.partition=iid", "train.local_steps=3", "train.batch_size=1000")
    sim = Simulation(cfg)
    w0 = sim.server.w.clone()
    sampled = sim.server.sample_clients(0)
    finals = []
    for i in sampled.tolist():
        w = w0.clone()
        x, y = sim.dataset.x_train[sim.client_indices[i]], sim.dataset.y_train[sim.client_indices[i]]
        for _ in range(3):
            leaf = w.clone().requires_grad_(True)
            (g,) = torch.autograd.grad(torch.nn.functional.cross_entropy(sim.model(leaf, x), y), leaf)
            d = g + cfg.train.weight_decay * w
            d = d * min(1.0, cfg.train.clip / (d.norm().item() + 1e-6))
            w = w - cfg.train.lr * d
        finals.append(w)
    sim.run_round(0)
    torch.testing.assert_close(sim.server.w, torch.stack(finals).mean(0), rtol=1e-5, atol=1e-6)


def test_iid_fedavg_learns_and_runs_are_reproducible(tiny):
    cfg = tiny("rounds=10", "data.partition=iid")
    first = fedflat.run(cfg, save=False, progress=False)
    second = fedflat.run(cfg, save=False, progress=False)
    assert first.summary["final_test_acc"] > 0.8  # 3 classes: chance is 1/3
    assert timing_free(first.metrics) == timing_free(second.metrics)
    torch.testing.assert_close(first.final_parameters, second.final_parameters, rtol=0, atol=0)


def test_bernoulli_participation_samples_about_k_clients(tiny):
    sim = Simulation(tiny("sampling.participation=bernoulli", "data.num_clients=6"))
    sizes = [len(sim.server.sample_clients(t)) for t in range(200)]
    assert min(sizes) >= 1 and abs(np.mean(sizes) - 3) < 0.3
    assert len(set(map(len, [sim.server.sample_clients(t) for t in range(20)]))) > 1


def test_user_dataset_and_model_factory():
    """A user's own tensors and nn.Module factory go through the Python API unchanged."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=g)
    y = (x[:, 0] > 0).long()
    data = Dataset("mine", x[:150], y[:150], x[150:], y[150:], 2)

    def tiny_net() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(5, 2))

    cfg = {"rounds": 15, "data": {"num_clients": 5, "partition": {"scheme": "iid"}},
           "sampling": {"clients_per_round": 5}, "train": {"local_epochs": 1, "batch_size": 10}}
    hist = fedflat.run(cfg, dataset=data, model_fn=tiny_net, save=False, progress=False)
    assert hist.final_parameters.numel() == 12
    assert hist.summary["final_test_acc"] > 0.9
