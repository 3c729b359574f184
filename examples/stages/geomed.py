"""A robust rule as a plugin: the geometric median of the clients' releases (RFA, Pillutla, Kakade and Harchaoui,
"Robust aggregation for federated learning", IEEE TSP 2022), by the smoothed Weiszfeld iteration

    v <- sum_i x_i / max(nu, ||v - x_i||)  /  sum_i 1 / max(nu, ||v - x_i||)

from the mean, ``iterations`` times (their Algorithm 3 with equal weights). It follows the contract of an upload
stage of kind ``robust`` (docs/extending.md, "Your own robust rule or attack"):

- subclass :class:`fedflat.core.upload.UploadStage` (or :class:`fedflat.algorithms.robust.RobustRule`, which sets
  the two class attributes below), with ``kind = "robust"``: its :meth:`server` runs last on the server, on the
  round's whole received release (every entry a row per answering client, ``model`` the update ``Delta_i``);
- declare ``individual`` (why it reads each client's own update): central DP and secure aggregation refuse it;
- return every row equal to the aggregate (the method's server side then reads exactly it), new tensors only;
- ``min_clients()`` if the rule needs a number of clients per round (the base class says 1).

    fedflat run examples/stages/stages.yaml
"""
from __future__ import annotations

import torch
from pydantic import Field

from fedflat.algorithms.robust import every_row, flatten, unflatten
from fedflat.core import PartParams, register_part
from fedflat.core.upload import Release, UploadStage


class GeoMedParams(PartParams):
    iterations: int = Field(3, ge=1, description="Weiszfeld iterations from the mean")
    nu: float = Field(1e-6, gt=0, description="the smoothing: distances below nu count as nu")


def geometric_median(X: torch.Tensor, iterations: int, nu: float) -> torch.Tensor:
    """The smoothed Weiszfeld iteration on the rows of ``X[K, D]`` (module docstring), in float64."""
    X = X.double()
    v = X.mean(0)
    for _ in range(iterations):
        weights = 1.0 / (X - v).norm(dim=1).clamp(min=nu)
        v = (weights[:, None] * X).sum(0) / weights.sum()
    return v


class GeoMed(UploadStage):
    """The geometric median of the releases (module docstring)."""

    name = "geomed"
    summary = "robust aggregation (plugin): the geometric median of the clients' updates (RFA, smoothed Weiszfeld)"
    kind = "robust"
    individual = "the geometric median reads every client's own update"
    Params = GeoMedParams

    def server(self, ctx, release: Release) -> Release:
        X = flatten(release)
        v = geometric_median(X, self.p.iterations, self.p.nu).to(X.dtype)
        return every_row(release, unflatten(v, release))


register_part(GeoMed)
