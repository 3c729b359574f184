"""Flatness incompatibility (seed 000, Definition 1 eq. 5 and App. C.5 eq. 20) and perturbation drift
(seed 002, Section 4.1 and Fig. 2 left), both at the global model ``w^t`` for a fixed seeded subset of clients.

The equations of seed 000 were lost in extraction; from its text, for a radius ``rho``:

* local rho-flatness proxy of client ``i`` along its own search direction ``eps_i`` (``||eps_i|| = rho``):
  ``S_i(w) = F_i(w + eps_i) - F_i(w)``; FedVSSAM's direction is eq. (14)'s mixed ``alpha g_i + (1-alpha) v``,
  FedSAM's the local gradient — here always the run's own perturbation part (see :mod:`.probe`);
* global proxy along the global gradient: ``S(w) = F(w + rho g/||g||) - F(w)``;
* flatness incompatibility, "the inter-device dispersion of local flatness proxies":
  ``FI = (1/M) sum_i (S_i - S)^2`` (eq. 5, about the global proxy) and the plain variance
  ``(1/M) sum_i (S_i - mean_j S_j)^2`` (eq. 20 over the fixed evaluation subset) — both are reported.

Also reported: the data-heterogeneity term of eq. (6), ``(1/M) sum_i ||grad F_i(w) - grad F(w)||^2``.

Perturbation drift (seed 002): ``PD = (1/2M) sum_i ||eps_i/||eps_i|| - eps_g/||eps_g||||`` in ``[0, 1]``
with ``eps_g = rho grad F / ||grad F||`` the global perturbation, and the mean cosine distance
``1 - cos(eps_i, eps_g)``. Seed 002 averages PD over local steps; here it is measured at the global model.
"""
from __future__ import annotations

from typing import Any

import torch

from fedflat.metrics.objective import client_objective, global_objective, seeded_clients
from fedflat.metrics.probe import Perturbations, method_perturbations


def flatness_proxy(objective, w: torch.Tensor, eps: torch.Tensor, base: float | None = None) -> float:
    """``F(w + eps) - F(w)``."""
    return objective.loss(w + eps) - (objective.loss(w) if base is None else base)


def dispersion(local: torch.Tensor, reference: float) -> dict[str, float]:
    """Eq. (5)/(20): mean squared deviation of the local proxies from the global one, and their variance."""
    return {"incompatibility": (local - reference).pow(2).mean().item(),
            "variance": (local - local.mean()).pow(2).mean().item()}


def perturbation_drift(eps: torch.Tensor, eps_global: torch.Tensor) -> dict[str, float]:
    """Seed 002's PD (unit perturbations, in [0, 1]) and the mean cosine distance to the global perturbation."""
    unit = eps / (eps.norm(dim=1, keepdim=True) + 1e-12)
    unit_g = eps_global / (eps_global.norm() + 1e-12)
    cos = unit @ unit_g
    return {"perturbation_drift": 0.5 * (unit - unit_g).norm(dim=1).mean().item(),
            "cosine_distance": (1 - cos).mean().item(), "cosine_distances": (1 - cos).tolist()}


def probe(sim, round: int, *, clients: int | None = 10, client_samples: int | None = 500,
          samples: int | None = 1000, direction: str = "method", rho: float = 0.05) -> dict[str, Any]:
    """Per-client perturbations, flatness proxies and gradients at ``w^t``: everything flatness
    incompatibility and perturbation drift are computed from."""
    ids = seeded_clients(sim, clients)
    objectives = [client_objective(sim, int(i), client_samples) for i in ids]
    perturbations = method_perturbations(sim, round, ids, objectives, direction, rho)
    return {"ids": ids, "objectives": objectives, "perturbations": perturbations,
            "global": global_objective(sim, samples)}


def _unavailable(sim, perturbations: Perturbations, what: str) -> dict[str, Any]:
    return {"available": False, "direction": perturbations.direction,
            "reason": f"{sim.algorithm.name} has no perturbation at the global model for any probed client "
                      f"({perturbations.direction} gives none), so {what} is undefined; "
                      "use direction=sam for the local SAM perturbation instead"}


def _selected(probed: dict[str, Any]) -> tuple[list[int], dict[str, Any]]:
    """Rows of the clients with a perturbation (FedLESAM has none before a client's first participation)."""
    pert = probed["perturbations"]
    rows = pert.available.nonzero().flatten().tolist()
    missing = [int(probed["ids"][r]) for r in range(len(pert.available)) if r not in rows]
    return rows, {"direction": pert.direction, "clients": [int(probed["ids"][r]) for r in rows],
                  "clients_without_perturbation": missing}


def flatness_incompatibility(sim, round: int, probed: dict[str, Any] | None = None, **options) -> dict[str, Any]:
    """Eq. (5)/(20) at ``w^t`` over a fixed seeded subset of clients (see the module docstring)."""
    probed = probed or probe(sim, round, **options)
    w, pert, objective = sim.server.w, probed["perturbations"], probed["global"]
    rows, header = _selected(probed)
    if not rows:
        return _unavailable(sim, pert, "flatness incompatibility")
    objectives = [probed["objectives"][r] for r in rows]
    local = torch.tensor([flatness_proxy(obj, w, pert.eps[r]) for obj, r in zip(objectives, rows)],
                         dtype=torch.float64)
    radius = pert.eps[rows].norm(dim=1).mean().item()
    g = objective.grad(w)
    global_proxy = flatness_proxy(objective, w, radius * g / (g.norm() + 1e-12))
    gaps = torch.stack([obj.grad(w) - g for obj in objectives])
    return {"available": True, **header,
            **dispersion(local, global_proxy), "std": local.std(unbiased=False).item(),
            "local_proxies": local.tolist(), "mean_local_proxy": local.mean().item(),
            "global_proxy": global_proxy, "radius": radius,
            # proxies grow like rho ||g||: divide by rho^2 to compare methods of different radii
            "normalized_incompatibility": (local - global_proxy).pow(2).mean().item() / radius ** 2,
            "gradient_dissimilarity": gaps.pow(2).sum(dim=1).mean().item()}


def perturbation_drift_at(sim, round: int, probed: dict[str, Any] | None = None, **options) -> dict[str, Any]:
    """Seed 002's perturbation drift at ``w^t`` for the method's own perturbations."""
    probed = probed or probe(sim, round, **options)
    pert = probed["perturbations"]
    rows, header = _selected(probed)
    if not rows:
        return _unavailable(sim, pert, "perturbation drift")
    g = probed["global"].grad(sim.server.w)
    return {"available": True, **header, **perturbation_drift(pert.eps[rows], g)}
