"""Representations: t-SNE of the global model's penultimate-layer features on a seeded test subset
(seed 000 App. C.4, seed 001 Fig. 5), and PCA of clients' perturbations and of clients' locally trained
parameters for one layer (seed 004 Fig. 4a and 4c).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedflat.metrics.objective import client_objective, seeded_clients, seeded_subset


@torch.no_grad()
def penultimate_features(sim, w: torch.Tensor | None = None, samples: int | None = 3000,
                         chunk: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """``(features[n, D], labels[n])`` of ``FlatModel.features`` at ``w`` on a seeded test subset."""
    w = sim.server.w if w is None else w
    data = sim.dataset
    idx = seeded_subset(data.y_test.shape[0], samples, sim.cfg.seed, -1, "diagnostics/test").to(data.y_test.device)
    x, y = data.features(data.x_test[idx]), data.y_test[idx]
    feats = torch.cat([sim.model.features(w, x[lo:lo + chunk], sim.server.buffers).flatten(1)
                       for lo in range(0, len(idx), chunk)])
    return feats.cpu().numpy(), y.cpu().numpy()


def tsne_embedding(features: np.ndarray, seed: int, perplexity: float = 30.0) -> np.ndarray:
    """A seeded 2-D t-SNE embedding (scikit-learn, PCA initialization)."""
    from sklearn.manifold import TSNE
    from threadpoolctl import threadpool_limits

    perplexity = min(perplexity, max(1.0, (features.shape[0] - 1) / 3))
    tsne = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed % (2 ** 32))
    # OpenMP threads beyond torch's share spin against each other on a busy machine (40x slower measured)
    with threadpool_limits(limits=torch.get_num_threads()):
        return tsne.fit_transform(features.astype(np.float64))


def pca_2d(X: np.ndarray) -> tuple[np.ndarray, list[float]]:
    """Projection of the rows of ``X`` on their first two principal components and the explained
    variance ratios (SVD of the centred rows; signs fixed so the largest loading is positive)."""
    centred = X - X.mean(axis=0, keepdims=True)
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    k = min(2, vt.shape[0])
    signs = np.sign(vt[np.arange(k), np.abs(vt[:k]).argmax(axis=1)])
    components = vt[:k] * signs[:, None]
    coords = centred @ components.T
    if k < 2:
        coords = np.pad(coords, ((0, 0), (0, 2 - k)))
    total = (s ** 2).sum()
    return coords, [float(v) for v in (s[:k] ** 2 / total if total > 0 else np.zeros(k))]


def layer_slice(sim, layer: str | None) -> tuple[str, slice]:
    """The flat-vector slice of a named parameter tensor (default: the first one)."""
    layout = sim.model.layout
    name = layout.names[0] if layer is None else layer
    if name not in layout.names:
        raise ValueError(f"unknown layer '{name}'; parameter tensors: {', '.join(layout.names)}")
    j = layout.names.index(name)
    return name, slice(layout.offsets[j], layout.offsets[j] + layout.numels[j])


def client_parameters(sim, round: int, clients: torch.Tensor) -> torch.Tensor:
    """Clients' models ``w_{i,E}`` after one round of the method's local training from ``w^t``, in a sandbox
    (the run's server state, client store and backprop count are unchanged)."""
    from fedflat.engine.client import fit
    from fedflat.engine.runtime import make_cohort
    from fedflat.metrics.probe import probe_round, sandbox

    with sandbox(sim):
        ctx, broadcast, task = probe_round(sim, round, clients)
        cohorts = [make_cohort(task.rows(torch.tensor([row])), broadcast, sim.server.load_state, sim.device)
                   for row in range(len(task))]
        finals = [fit(sim.algorithm, ctx, cohort).upload["model"] for cohort in cohorts]
    return torch.cat(finals)


def client_layer_vectors(sim, round: int, *, what: str, layer: str | None = None, clients: int | None = 20,
                         client_samples: int | None = 500, direction: str = "method",
                         rho: float = 0.05) -> dict[str, Any]:
    """One layer of each probed client's perturbation (``what="perturbations"``) or locally trained
    parameters (``what="parameters"``), as rows of a matrix."""
    from fedflat.metrics.probe import method_perturbations

    name, cut = layer_slice(sim, layer)
    ids = seeded_clients(sim, clients)
    if what == "perturbations":
        objectives = [client_objective(sim, int(i), client_samples) for i in ids]
        pert = method_perturbations(sim, round, ids, objectives, direction, rho)
        rows = pert.available.nonzero().flatten().cpu()
        return {"layer": name, "clients": ids[rows].tolist(), "probed": len(ids), "direction": pert.direction,
                "vectors": pert.eps[rows][:, cut].cpu().numpy()}
    if what == "parameters":
        W = client_parameters(sim, round, ids)
        return {"layer": name, "clients": ids.tolist(), "probed": len(ids), "vectors": W[:, cut].cpu().numpy()}
    raise ValueError(f"what must be 'perturbations' or 'parameters', got {what!r}")
