"""Global sharpness: the SAM sharpness ``max_{||delta|| <= rho} F(w + delta) - F(w)`` and the top
Hessian eigenvalue of the global training objective (seed 002, Fig. 2 right; seed 000, Section 2.2).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from fedflat.core import SERVER, torch_stream
from fedflat.metrics.objective import FIXED, Objective, global_objective


def sam_sharpness(objective: Objective, w: torch.Tensor, rho: float, steps: int = 1) -> dict[str, float]:
    """``F(w + delta) - F(w)`` with ``delta`` from ``steps`` normalized ascent steps projected onto the
    ball ``||delta|| <= rho``; ``steps = 1`` is SAM's first-order solution ``delta = rho g / ||g||``
    (Foret et al. 2021, eq. 2), the inner maximum to first order."""
    if rho <= 0 or steps < 1:
        raise ValueError(f"sharpness needs rho > 0 and steps >= 1 (got rho={rho}, steps={steps})")
    base = objective.loss(w)
    g = objective.grad(w)
    delta = torch.zeros_like(w)
    for _ in range(steps):
        u = g if not delta.any() else objective.grad(w + delta)
        delta = delta + (rho / steps) * u / (u.norm() + 1e-12)
        norm = delta.norm()
        if norm > rho:
            delta = delta * (rho / norm)
    perturbed = objective.loss(w + delta)
    return {"sharpness": perturbed - base, "loss": base, "perturbed_loss": perturbed,
            "grad_norm": g.norm().item(), "rho": rho, "ascent_steps": steps}


def top_hessian_eigenvalue(hvp: Callable[[torch.Tensor], torch.Tensor], size: int, generator: torch.Generator,
                           iters: int = 20, tol: float = 1e-3, dtype: torch.dtype = torch.float32,
                           device: str | torch.device = "cpu") -> dict[str, Any]:
    """The dominant eigenvalue of a symmetric operator by power iteration on ``v <- H v / ||H v||``.

    Returns the Rayleigh quotient ``lambda = v^T H v`` (``||v|| = 1``) after convergence (relative change
    below ``tol``) or ``iters`` products, and the history of the estimates. The dominant eigenvalue is the
    largest in magnitude; near a minimum it is the largest positive one, the usual sharpness measure.
    """
    v = torch.randn(size, generator=generator, dtype=dtype, device=generator.device).to(device)
    v = v / v.norm()
    history: list[float] = []
    estimate = float("nan")
    converged = False
    for _ in range(iters):
        hv = hvp(v)
        estimate = float(v @ hv)
        history.append(estimate)
        norm = hv.norm()
        if norm == 0:
            converged = True
            break
        v = hv / norm
        if len(history) > 1 and abs(history[-1] - history[-2]) <= tol * abs(history[-1]):
            converged = True
            break
    return {"top_eigenvalue": estimate, "iterations": len(history), "converged": converged, "history": history}


def global_sharpness(sim, w: torch.Tensor | None = None, *, rho: float = 0.05, samples: int | None = 1000,
                     ascent_steps: int = 1, hessian_iters: int = 20, hessian_tol: float = 1e-3) -> dict[str, Any]:
    """SAM sharpness and top Hessian eigenvalue of the global training loss at ``w`` (default ``w^t``),
    on a seeded subset of ``samples`` training samples; ``hessian_iters = 0`` skips the eigenvalue."""
    w = sim.server.w if w is None else w
    objective = global_objective(sim, samples)
    result: dict[str, Any] = {"available": True, "samples": objective.size, **sam_sharpness(objective, w, rho, ascent_steps)}
    if hessian_iters > 0:
        generator = torch_stream(sim.cfg.seed, FIXED, SERVER, "diagnostics/hessian")
        power = top_hessian_eigenvalue(lambda v: objective.hvp(w, v), w.numel(), generator, hessian_iters,
                                       hessian_tol, w.dtype, w.device)
        result.update(hessian_top=power["top_eigenvalue"], hessian_iterations=power["iterations"],
                      hessian_converged=power["converged"], hessian_history=power["history"])
    return result
