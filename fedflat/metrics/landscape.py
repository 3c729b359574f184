"""Loss landscapes: 1-D linear interpolation between two models (Goodfellow et al. 2015) and 2-D surfaces
around the global model along filter-normalized random directions (Li et al., NeurIPS 2018), as in seed 002
Fig. 3 and seed 003 Figs. 12-14.
"""
from __future__ import annotations

from typing import Any

import torch

from fedflat.core import SERVER, ParamLayout, torch_stream
from fedflat.metrics.objective import FIXED, DataObjective


def filter_normalized_direction(w: torch.Tensor, layout: ParamLayout, generator: torch.Generator) -> torch.Tensor:
    """A Gaussian direction ``d`` rescaled filter by filter: ``d_f <- d_f ||w_f|| / ||d_f||`` for every
    filter ``f`` (slice along the output dimension) of every tensor with 2 or more dimensions; biases and
    other 1-D tensors get ``d = 0`` (Li et al. 2018, Section 4)."""
    d = torch.randn(w.numel(), generator=generator, dtype=w.dtype, device=generator.device).to(w.device)
    for w_view, d_view, shape in zip(layout.views(w), layout.views(d), layout.shapes):
        if len(shape) < 2:
            d_view.zero_()
            continue
        w_f, d_f = w_view.reshape(shape[0], -1), d_view.reshape(shape[0], -1)
        d_f.mul_(w_f.norm(dim=1, keepdim=True) / (d_f.norm(dim=1, keepdim=True) + 1e-10))
    return d


def interpolation(objective: DataObjective, w_a: torch.Tensor, w_b: torch.Tensor,
                  alphas: torch.Tensor) -> dict[str, Any]:
    """Loss and accuracy at ``(1 - alpha) w_a + alpha w_b`` for every ``alpha``."""
    losses, accuracies = [], []
    for a in alphas.tolist():
        w = (1 - a) * w_a + a * w_b
        losses.append(objective.loss(w))
        accuracies.append(objective.accuracy(w))
    return {"alphas": alphas.tolist(), "loss": losses, "accuracy": accuracies, "distance": (w_b - w_a).norm().item()}


def surface(objective: DataObjective, w: torch.Tensor, d1: torch.Tensor, d2: torch.Tensor,
            span: float = 1.0, resolution: int = 21) -> dict[str, Any]:
    """``F(w + a d1 + b d2)`` on a ``resolution x resolution`` grid of ``a, b`` in ``[-span, span]``."""
    grid = torch.linspace(-span, span, resolution, dtype=w.dtype)
    loss = [[objective.loss(w + a * d1 + b * d2) for a in grid.tolist()] for b in grid.tolist()]
    return {"coordinates": grid.tolist(), "loss": loss, "center_loss": objective.loss(w)}


def landscape_2d(sim, w: torch.Tensor | None = None, *, samples: int | None = 1000, span: float = 1.0,
                 resolution: int = 21) -> dict[str, Any]:
    """Seeded 2-D loss surface of the global training objective around ``w`` (default ``w^t``);
    ``loss[b][a]`` is at ``w + a d1 + b d2``."""
    from fedflat.metrics.objective import global_objective

    w = sim.server.w if w is None else w
    objective = global_objective(sim, samples)
    layout = sim.model.layout
    d1 = filter_normalized_direction(w, layout, torch_stream(sim.cfg.seed, FIXED, SERVER, "diagnostics/direction1"))
    d2 = filter_normalized_direction(w, layout, torch_stream(sim.cfg.seed, FIXED, SERVER, "diagnostics/direction2"))
    return {"available": True, "samples": objective.size, "span": span, "resolution": resolution,
            "direction_cosine": (d1 @ d2 / (d1.norm() * d2.norm() + 1e-12)).item(),
            **surface(objective, w, d1, d2, span, resolution)}
