"""Direction tracking error (seed 000, App. C.5 and Theorem 2): how far the method's global direction
(FedVSSAM's adjusted direction ``v``, FedWMSAM's momentum ``m``, FedLESAM's estimate, ...) is from the
gradient of the global objective at ``w^t``, estimated from IID batches of the whole training set.

Seed 000 uses 10 batches of 512 training samples; the reference here is the gradient on that many seeded
samples (the same samples every round), plus the coupled weight decay ``wd w`` by default because the
methods' directions are built from local directions ``g + wd w``. Reported: ``||d - g||^2`` (the MSE of
Theorem 2), ``||d - g||``, the relative error ``||d - g|| / ||g||`` and ``cos(d, g)``.
"""
from __future__ import annotations

from typing import Any

import torch

from fedflat.metrics.objective import global_objective


def tracking_error(direction: torch.Tensor, reference: torch.Tensor) -> dict[str, float]:
    """Distances between a direction ``d`` and the reference gradient ``g``."""
    gap = direction - reference
    g_norm, d_norm = reference.norm().item(), direction.norm().item()
    return {"squared_error": gap.pow(2).sum().item(), "error": gap.norm().item(),
            "relative_error": gap.norm().item() / g_norm if g_norm > 0 else float("inf"),
            "cosine": (direction @ reference).item() / (d_norm * g_norm) if d_norm * g_norm > 0 else 0.0,
            "direction_norm": d_norm, "reference_norm": g_norm}


def global_direction(sim) -> tuple[torch.Tensor | None, str]:
    """The first direction one of the method's parts declares (``Part.global_direction``: a server entry and the
    sign that makes it gradient sign), or None when no part declares one or it is still zero (before a round)."""
    for part in sim.algorithm.ordered:
        if part.global_direction is None:
            continue
        key, sign = part.global_direction
        d = sim.server.state[key]
        if bool(d.any()):
            return sign * d, f"{part.role} '{part.name}'"
    return None, ""


def reference_gradient(sim, w: torch.Tensor, batches: int = 10, batch_size: int = 512,
                       weight_decay: bool = True) -> tuple[torch.Tensor, int]:
    """``grad F(w)`` (+ ``wd w``) on ``batches * batch_size`` seeded training samples."""
    wd = sim.settings.weight_decay if weight_decay else 0.0
    objective = global_objective(sim, batches * batch_size, weight_decay=wd, purpose="diagnostics/reference")
    return objective.grad(w), objective.size


def direction_tracking(sim, round: int, *, batches: int = 10, batch_size: int = 512,
                       weight_decay: bool = True) -> dict[str, Any]:
    """Tracking error of the method's global direction at ``w^t``; unavailable for methods without one."""
    direction, source = global_direction(sim)
    if direction is None:
        return {"available": False,
                "reason": f"{sim.algorithm.name} keeps no global direction (none of its parts "
                          f"{[p.name for p in sim.algorithm.ordered]} declares a global_direction, "
                          "or it is not set yet)"}
    reference, n = reference_gradient(sim, sim.server.w, batches, batch_size, weight_decay)
    return {"available": True, "source": source, "reference_samples": n, "weight_decay_included": weight_decay,
            **tracking_error(direction.to(reference.dtype), reference)}
