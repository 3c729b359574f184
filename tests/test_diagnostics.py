"""Flatness diagnostics against problems with known answers, and their plumbing on tiny runs."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from conftest import model_for, tiny_tree
from torch import nn

import fedflat
from fedflat.algorithms import PARTS, RECIPES
from fedflat.cli import main as cli_main
from fedflat.config import load_config
from fedflat.core import ParamLayout
from fedflat.engine.simulation import Simulation
from fedflat.metrics import analyze, open_run
from fedflat.metrics.analysis import Target
from fedflat.metrics.flatness import flatness_incompatibility, perturbation_drift
from fedflat.metrics.landscape import filter_normalized_direction
from fedflat.metrics.objective import DataObjective
from fedflat.metrics.plots import DPI, FIGSIZE, png_size
from fedflat.metrics.sharpness import sam_sharpness, top_hessian_eigenvalue
from fedflat.metrics.spectra import band_variance
from fedflat.metrics.tracking import direction_tracking, reference_gradient
from fedflat.models.mlp import LogReg
from fedflat.params import FlatModel


class Quadratic:
    """``F(w) = 1/2 w^T A w + b^T w`` with the objective protocol of the diagnostics."""

    def __init__(self, A: torch.Tensor, b: torch.Tensor):
        self.A, self.b = A, b

    def loss(self, w: torch.Tensor) -> float:
        return (0.5 * w @ self.A @ w + self.b @ w).item()

    def grad(self, w: torch.Tensor) -> torch.Tensor:
        return self.A @ w + self.b

    def hvp(self, w: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.A @ v


def _spectrum_matrix(eigenvalues: list[float], seed: int = 0) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(len(eigenvalues), len(eigenvalues), generator=torch.Generator().manual_seed(seed),
                                       dtype=torch.float64))
    return q @ torch.diag(torch.tensor(eigenvalues, dtype=torch.float64)) @ q.T


def test_power_iteration_recovers_the_top_eigenvalue_of_a_known_spectrum():
    A = _spectrum_matrix([5.0, 2.0, 1.0, 0.5, -0.3, 0.1])
    found = top_hessian_eigenvalue(lambda v: A @ v, 6, torch.Generator().manual_seed(1), iters=500, tol=1e-12,
                                   dtype=torch.float64)
    assert found["top_eigenvalue"] == pytest.approx(5.0, rel=1e-8)
    assert found["converged"]


def _logreg_problem(n: int = 40, d: int = 3, k: int = 3):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, k, (n,), generator=g)
    model = FlatModel(LogReg((d,), k))
    w = torch.randn(model.layout.size, generator=g)
    return model, x, y, w


def _logreg_hessian(W: np.ndarray, b: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Hessian of the mean softmax cross-entropy written out by hand, in the flat order [W row-major, b]:
    ``H = mean_j (diag(p_j) - p_j p_j^T) (x) xt_j xt_j^T`` with ``xt = [x, 1]``."""
    K, D = W.shape
    logits = X @ W.T + b
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    H = np.zeros((K * (D + 1), K * (D + 1)))
    for pj, xj in zip(p, X):
        xt = np.append(xj, 1.0)
        H += np.kron(np.diag(pj) - np.outer(pj, pj), np.outer(xt, xt))
    H /= len(X)
    order = [k * (D + 1) + d for k in range(K) for d in range(D)] + [k * (D + 1) + D for k in range(K)]
    return H[np.ix_(order, order)]


def test_hessian_vector_products_and_top_eigenvalue_match_the_hand_derived_logistic_hessian():
    model, x, y, w = _logreg_problem()
    objective = DataObjective(model, x, y, chunk=16)  # chunking must not change the result
    W, b = w[:9].view(3, 3).numpy(), w[9:].numpy()
    H = _logreg_hessian(W.astype(np.float64), b.astype(np.float64), x.numpy().astype(np.float64), y.numpy())
    v = torch.randn(w.numel(), generator=torch.Generator().manual_seed(0))
    np.testing.assert_allclose(objective.hvp(w, v).numpy(), H @ v.numpy(), rtol=1e-4, atol=1e-6)
    found = top_hessian_eigenvalue(lambda u: objective.hvp(w, u), w.numel(), torch.Generator().manual_seed(2),
                                   iters=300, tol=1e-7)
    assert found["top_eigenvalue"] == pytest.approx(np.linalg.eigvalsh(H).max(), rel=1e-3)


def test_sam_sharpness_of_a_quadratic_equals_its_closed_form():
    """``F(w + rho g/||g||) - F(w) = rho ||g|| + rho^2/2 g^T A g / ||g||^2`` for ``F = w^T A w/2 + b^T w``."""
    A = _spectrum_matrix([3.0, 1.0, 0.2, 0.05])
    b = torch.tensor([0.3, -0.2, 0.5, 0.1], dtype=torch.float64)
    w = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    rho = 0.1
    g = A @ w + b
    expected = rho * g.norm() + 0.5 * rho ** 2 * (g @ A @ g) / (g @ g)
    assert sam_sharpness(Quadratic(A, b), w, rho)["sharpness"] == pytest.approx(expected.item(), rel=1e-10)


def test_multi_step_sharpness_of_a_linear_function_is_the_exact_maximum():
    """For ``F = b^T w`` the maximum over the ball is ``rho ||b||`` and projected ascent must stay on it."""
    b = torch.tensor([3.0, -4.0], dtype=torch.float64)
    found = sam_sharpness(Quadratic(torch.zeros(2, 2, dtype=torch.float64), b), torch.zeros(2, dtype=torch.float64),
                          0.2, steps=5)
    assert found["sharpness"] == pytest.approx(1.0, rel=1e-10)


def _two_layer_layout() -> ParamLayout:
    return ParamLayout.of(nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 12)))  # tensors of 128, 8, 96, 12 entries


def _signals(layout: ParamLayout, amplitude_low: torch.Tensor, amplitude_high: torch.Tensor) -> torch.Tensor:
    """Rows ``a_c cos(2 pi n/len) + h_c cos(2 pi (len/2 - 1) n/len)`` in every tensor of the layout."""
    rows = []
    for a, h in zip(amplitude_low.tolist(), amplitude_high.tolist()):
        parts = []
        for numel in layout.numels:
            n = torch.arange(numel, dtype=torch.float64)
            parts.append(a * torch.cos(2 * math.pi * n / numel) + h * torch.cos(2 * math.pi * (numel // 2 - 1) * n / numel))
        rows.append(torch.cat(parts))
    return torch.stack(rows)


@pytest.mark.parametrize("disagree", ["low", "high"])
def test_spectral_variance_lands_in_the_band_where_clients_disagree(disagree):
    layout = _two_layer_layout()
    varying, shared = torch.tensor([1.0, -0.5, 2.0, 0.3]), torch.full((4,), 1.5)
    eps = _signals(layout, varying, shared) if disagree == "low" else _signals(layout, shared, varying)
    found = band_variance(eps, layout, bands=4, min_bins=32)
    assert set(found["layers"]) == {"0.weight", "1.weight"}  # the 5- and 7-bin biases are left out
    variance = torch.tensor(found["variance"])
    band = 0 if disagree == "low" else 3
    assert variance[band] > 0
    others = torch.cat([variance[:band], variance[band + 1:]])
    assert others.abs().max() < 1e-20 * variance[band] + 1e-24
    # Orthonormal rFFT: one bin of amplitude a has |E|^2 = a^2 n/4, so the layer's band mean is computable.
    amplitudes = varying.double()
    per_bin_var = lambda n: ((amplitudes - amplitudes.mean()) ** 2).mean().item() * n / 4
    bins = {128: 65, 96: 49}
    expected = np.mean([per_bin_var(n) / len([m for m in range(bins[n]) if (4 * m) // bins[n] == band]) for n in bins])
    assert variance[band].item() == pytest.approx(expected, rel=1e-6)  # float32 amplitudes


def test_perturbation_drift_is_zero_for_aligned_and_one_for_opposite_perturbations():
    g = torch.tensor([1.0, 2.0, -2.0])
    aligned = perturbation_drift(torch.stack([0.1 * g, 3 * g]), g)
    assert aligned["perturbation_drift"] == pytest.approx(0.0, abs=1e-7)
    assert aligned["cosine_distance"] == pytest.approx(0.0, abs=1e-7)
    opposite = perturbation_drift(-g[None], g)
    assert opposite["perturbation_drift"] == pytest.approx(1.0)
    assert opposite["cosine_distance"] == pytest.approx(2.0)


def test_filter_normalized_directions_match_filter_norms_and_skip_biases():
    module = nn.Sequential(nn.Conv2d(2, 4, 3), nn.Linear(5, 3))
    layout = ParamLayout.of(module)
    w = layout.flatten(module)
    d = filter_normalized_direction(w, layout, torch.Generator().manual_seed(0))
    for wv, dv, shape in zip(layout.views(w), layout.views(d), layout.shapes):
        if len(shape) == 1:
            assert not dv.any()
        else:
            torch.testing.assert_close(dv.reshape(shape[0], -1).norm(dim=1), wv.reshape(shape[0], -1).norm(dim=1))


def _sim(*overrides: str) -> Simulation:
    return Simulation(load_config(None, list(overrides), base=tiny_tree()))


def test_flatness_incompatibility_vanishes_when_all_clients_hold_the_same_data():
    sim = _sim("algo=fedsam", "algo.rho=0.1")
    sim.run_round(0)
    options = dict(clients=None, client_samples=None, samples=None)
    heterogeneous = flatness_incompatibility(sim, 1, **options)
    everything = torch.arange(sim.dataset.y_train.shape[0])
    sim.client_indices = [everything.clone() for _ in sim.client_indices]
    identical = flatness_incompatibility(sim, 1, **options)
    assert identical["available"] and len(identical["local_proxies"]) == sim.cfg.data.num_clients
    assert identical["incompatibility"] < 1e-12 and identical["variance"] < 1e-12
    assert identical["gradient_dissimilarity"] < 1e-12
    assert identical["local_proxies"][0] == pytest.approx(identical["global_proxy"], rel=1e-5)
    assert heterogeneous["incompatibility"] > 1e-6 and heterogeneous["gradient_dissimilarity"] > 1e-4


def test_direction_tracking_error_is_zero_for_the_reference_gradient_and_unavailable_without_a_direction(monkeypatch):
    sim = _sim("algo=fedsam")
    missing = direction_tracking(sim, 0)
    assert not missing["available"] and "no global direction" in missing["reason"]
    reference, _ = reference_gradient(sim, sim.server.w, batches=2, batch_size=50)
    sim.server.state["reference"] = reference
    server = sim.algorithm.parts["server"]
    monkeypatch.setattr(PARTS[server.role][server.name], "global_direction", ("reference", 1.0))  # its class
    exact = direction_tracking(sim, 0, batches=2, batch_size=50)
    assert exact["available"] and exact["squared_error"] == 0.0 and exact["cosine"] == pytest.approx(1.0)
    sim.server.state["reference"] = 2 * reference
    doubled = direction_tracking(sim, 0, batches=2, batch_size=50)
    assert doubled["relative_error"] == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("algo", sorted(RECIPES))
def test_every_algorithm_gets_an_answer_or_a_reason(algo):
    """Each probe-based diagnostic runs on every method of the library, before and after a round,
    without changing the run's server or client state."""
    sim = _sim(f"algo={algo}", *model_for(algo))
    options = fedflat.config.DiagnosticsConfig(clients=3, client_samples=20, samples=60, bands=2,
                                               reference_batches=1, reference_batch_size=30)
    for rounds in (0, 1):
        if rounds:
            sim.run_round(0)
        state = sim.server.state_dict()
        backprops = sim.oracle.backprops
        for kind in ("flatness", "drift", "tracking", "spectra"):
            result = analyze(kind, Target(sim, rounds), options)["result"]
            assert result["available"] or result["reason"]
        torch.testing.assert_close(sim.server.state_dict(), state, rtol=0, atol=0)
        assert sim.oracle.backprops == backprops


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished 3-round FedSAM run folder."""
    cfg = load_config(None, ["algo=fedsam", "algo.rho=0.1"], base=tiny_tree())
    return fedflat.run(cfg, out=tmp_path_factory.mktemp("runs"), progress=False).run_dir


@pytest.mark.parametrize("kind,pngs", [
    ("landscape", ["landscape_contour.png", "landscape_surface.png", "interpolation.png"]),
    ("tsne", ["tsne.png"]),
    ("pca", ["pca_perturbations.png", "pca_parameters.png"]),
    ("spectra", ["spectra.png"]),
])
def test_analyze_commands_write_json_and_images_of_the_expected_size(tiny_run, kind, pngs, capsys):
    options = ["--resolution", "5", "--tsne-samples", "40", "--bands", "4", "--samples", "all"]
    assert cli_main(["analyze", kind, str(tiny_run), *options]) == 0
    folder = tiny_run / "diagnostics"
    doc = json.loads((folder / f"{kind}.json").read_text())
    assert doc["kind"] == kind and doc["round"] == 3 and doc["schema"] == 1
    for name in pngs:
        assert name in doc["files"]
        assert png_size(folder / name) == (int(FIGSIZE[0] * DPI), int(FIGSIZE[1] * DPI))
    assert f"{kind} of FedSAM at round 3" in capsys.readouterr().out  # (the display name, as tables)


def test_a_pca_plot_says_why_it_shows_fewer_clients_than_were_probed(tmp_path):
    """FedLESAM's perturbation at step 0 is zero for a client that has not trained before (its memory is the
    global model): after one round of 3 of 6 clients, 3 of the 6 probed have one, and the plot of 10 probed
    clients showed 2 points without a word (issue 32)."""
    cfg = load_config(None, ["algo=fedlesam", "rounds=1"], base=tiny_tree())
    target = open_run(fedflat.run(cfg, out=tmp_path, progress=False).run_dir)
    options = target.sim.cfg.diagnostics.model_copy(update={"clients": 6, "samples": 50})
    result = analyze("pca", target, options)["result"]
    shown = len(result["perturbations"]["runs"][0]["clients"])
    assert 2 <= shown < 6 and result["perturbations"]["note"].startswith(f"{shown} of 6 probed clients shown: the "
                                                                         "others' perturbation is zero")
    assert result["parameters"]["note"] is None  # every probed client has parameters


def test_landscape_is_seeded_and_centred_on_the_global_model(tiny_run):
    target = open_run(tiny_run)
    options = target.sim.cfg.diagnostics.model_copy(update={"resolution": 5, "samples": 50})
    first, second = (analyze("landscape", target, options)["result"] for _ in range(2))
    assert first == second
    centre = first["loss"][2][2]
    assert centre == pytest.approx(first["center_loss"], abs=1e-6)
    interp = first["interpolation"]
    assert interp["loss"][interp["alphas"].index(1.0)] == pytest.approx(centre, abs=1e-6)


def test_recording_during_training_leaves_training_unchanged(tmp_path):
    plain = fedflat.run(load_config(None, ["algo=fedsam"], base=tiny_tree()), save=False, progress=False)
    cfg = load_config(None, ["algo=fedsam", "diagnostics.every=1", "diagnostics.kinds=[sharpness,flatness,drift,pca]",
                             "diagnostics.hessian_iters=3", "diagnostics.samples=60", "diagnostics.clients=3"],
                      base=tiny_tree())
    recorded = fedflat.run(cfg, out=tmp_path, progress=False)
    torch.testing.assert_close(recorded.final_parameters, plain.final_parameters, rtol=0, atol=0)
    assert [m["train_loss"] for m in recorded.metrics] == [m["train_loss"] for m in plain.metrics]
    assert recorded.metrics[-1]["backprops_per_step"] == plain.metrics[-1]["backprops_per_step"]
    lines = [json.loads(line) for line in (recorded.run_dir / "diagnostics" / "flatness.jsonl").read_text().splitlines()]
    assert [d["round"] for d in lines] == [1, 2, 3]
    last = recorded.metrics[-1]
    assert last["flatness_incompatibility"] == lines[-1]["result"]["incompatibility"]
    assert {"sharpness", "hessian_top", "perturbation_drift", "diagnostics_seconds"} <= set(last)


def test_unknown_layer_and_unknown_kind_are_clear_errors(tiny_run):
    target = open_run(tiny_run)
    with pytest.raises(ValueError, match="unknown layer 'nope'; parameter tensors: body.0.weight"):
        analyze("pca", target, target.sim.cfg.diagnostics.model_copy(update={"layer": "nope"}))
    with pytest.raises(ValueError, match="unknown diagnostic 'curvature'"):
        analyze("curvature", target)


def test_probe_diagnostics_agree_between_engines():
    """The method's perturbations come from the run's oracle: sequential and vmap engines must agree."""
    results = {}
    for engine in ("sequential", "vectorized"):
        sim = _sim("algo=fedlesam" if "fedlesam" in RECIPES else "algo=fedsam", f"engine={engine}",
                   "sampling.clients_per_round=6")
        sim.run_round(0)
        results[engine] = flatness_incompatibility(sim, 1, clients=None, client_samples=None, samples=None)
    seq, vec = results["sequential"], results["vectorized"]
    assert seq["available"] and seq["clients"] == vec["clients"]
    np.testing.assert_allclose(vec["local_proxies"], seq["local_proxies"], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("algo", ["fedcm", "fedavgm", "fedacg", "fedadam", "fedvssam", "fedwmsam", "fedlesam"])
def test_global_directions_are_in_gradient_sign(algo):
    """After a few rounds every method's global direction points along the IID reference gradient
    (positive cosine): the convention of ``Part.global_direction``, whatever the method stores."""
    sim = _sim(f"algo={algo}", "data.partition=iid")
    for t in range(3):
        sim.run_round(t)
    result = direction_tracking(sim, 3, batches=2, batch_size=50)
    assert result["available"] and result["cosine"] > 0.2  # before the sign fix, fedadam/avgm/acg gave < -0.2


def test_diagnostics_rounds_are_evaluated_whatever_eval_every_is(tmp_path):
    """diagnostics.every=2 with eval.every=3 over 6 rounds: rounds 2 and 4 get metrics lines too, carrying
    their headlines (they used to be recorded in diagnostics/ only and silently missing from metrics)."""
    cfg = load_config(None, ["algo=fedsam", "rounds=6", "eval.every=3", "diagnostics.every=2",
                             "diagnostics.kinds=[drift]"], base=tiny_tree())
    hist = fedflat.run(cfg, out=tmp_path, progress=False)
    assert [m["round"] for m in hist.metrics] == [2, 3, 4, 6]
    assert [("perturbation_drift" in m) for m in hist.metrics] == [True, False, True, True]
