"""FedSAM (Caldarola et al., ECCV 2022; Qu et al., ICML 2022): local SAM steps, FedAvg server."""
from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from fedflat.core import (NORM_EPS, RHO_GRID, ClientContext, Cohort, PartParams, Perturbation, Recipe, normalize_rows,
                          register_recipe, row_norm, shared)
from fedflat.core.part import point_sum
from fedflat.core.vectors import NOT_RUN, kernel, run_kernel

WARMUP_START = 0.001  # the radius a warm-up starts from (FedGloSS's scripts)


def scale_rows_(X: torch.Tensor, radius: float | torch.Tensor) -> torch.Tensor:
    r""":func:`~fedflat.core.normalize_rows` in place, bit for bit: :math:`(\mathrm{radius}\, X) / (\lVert X \rVert + 10^{-12})`, the norm of the
    ``X`` given, the product and the quotient each rounded as the out-of-place expression rounds them (two passes over
    ``X``, no fresh tensor). For a tensor the caller made in this call."""
    norm = row_norm(X) + NORM_EPS
    return X.mul_(radius).div_(norm)


def warmed_up(rho, round: int, warmup_rounds: int):
    """``rho`` (a float or a tensor of radii) after a linear warm-up from 0.001 over ``warmup_rounds`` rounds
    (0: none), as FedGloSS's scripts warm up both radii over a fifth of the rounds."""
    if warmup_rounds == 0 or round >= warmup_rounds:
        return rho
    return WARMUP_START + (rho - WARMUP_START) * round / warmup_rounds


class SAMParams(PartParams):
    rho: float = Field(0.01, ge=0, description="SAM radius")
    warmup_rounds: int = shared(0, ge=0, description="rounds over which the radius grows linearly from 0.001 (0: off; "
                                                     "FedGloSS warms its server radius up over the same rounds)")


class LocalSAM(Perturbation):
    r"""Local SAM ascent step (Foret et al., ICLR 2021): :math:`\epsilon = \rho\, u / (\lVert u \rVert + 10^{-12})` with
    :math:`u = g(w)` on the step's batch and ONE L2 norm over all parameters.

    Subclasses change the ascent direction ``u`` (:meth:`ascent`) or the radius (:meth:`radius`); one whose
    :meth:`ascent` returns a tensor made in its call sets ``fresh_ascent``, and ``u`` is then scaled in place.
    """

    name = "sam"
    summary = "local SAM: eps = rho g(w)/||g(w)|| on the step's batch (one extra backprop)"
    Params = SAMParams
    extra_backprops = 1
    fresh_ascent: ClassVar[bool] = False  # ascent returns a tensor made in its call (perturb may overwrite it)

    def ascent(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The ascent direction ``u`` from the plain gradient ``g(w)``."""
        return grad

    def radius(self, ctx: ClientContext, cohort: Cohort) -> float | torch.Tensor:
        """``rho`` (a float, or ``[C, 1]`` per-client radii)."""
        return self.p.rho

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch) -> torch.Tensor | None:
        if self.p.rho == 0:
            return None
        u, radius = self.ascent_and_radius(ctx, cohort, k, W, batch)
        # the oracle's fresh gradient (this class's own ascent) or a fresh ascent: scaled in place, the same bits
        if self.fresh_ascent or type(self).ascent is LocalSAM.ascent:
            return scale_rows_(u, radius)
        return normalize_rows(u, radius)

    def ascent_and_radius(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor,
                          batch) -> tuple[torch.Tensor, float | torch.Tensor]:
        """The step's ascent ``u`` (from the oracle's ``g(w)`` on the batch) and the radius after the warm-up."""
        _, grad = ctx.oracle.loss_grad(W, batch)
        radius = warmed_up(self.radius(ctx, cohort), ctx.round, self.p.warmup_rounds)
        return self.ascent(ctx, cohort, k, W, grad), radius

    fuses_point = True  # perturbed_point: the scale and the sum in one pass after ATen's norm

    def perturbed_point(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch,
                        out: torch.Tensor) -> torch.Tensor | None:
        """``W + eps`` into ``out``: where this class's :meth:`perturb` runs, ATen's norm ``d = ||u|| + 1e-12`` and
        the native ``sam_point`` (``fedflat/engine/native/vector_ops.cpp``: ``W + (u rho) / d`` in one pass over the
        vector where the torch expressions take three, each operation rounded once as ATen's are on every dispatch
        level: the same bits); else :meth:`perturb` and the sum."""
        if kernel("sam_point") is None or own_class(self).perturb is not LocalSAM.perturb or W.device.type != "cpu":
            return super().perturbed_point(ctx, cohort, k, W, batch, out)
        if self.p.rho == 0:
            return None
        u, radius = self.ascent_and_radius(ctx, cohort, k, W, batch)
        radii = radius.reshape(-1) if isinstance(radius, torch.Tensor) else None
        if radii is None or radii.dtype == u.dtype:  # (else the torch product rounds in the radii's dtype)
            scalar = 0.0 if radii is not None else float(radius)
            if run_kernel("sam_point", W.device, u, row_norm(u) + NORM_EPS, scalar, radii, W, out) is not NOT_RUN:
                return out
        return point_sum(W, normalize_rows(u, radius), out)


def own_class(part: Perturbation) -> type:
    """The part's own class (the contract's checks wrap it in a subclass of theirs)."""
    return getattr(type(part), "__unwatched__", type(part))


register_recipe(Recipe(
    name="fedsam", display="FedSAM", summary="local SAM steps, FedAvg server",
    source="Caldarola et al., ECCV 2022; Qu et al., ICML 2022",
    perturbation="sam", defaults={"rho": 0.01},
    tunable={"algo.rho": RHO_GRID}))
