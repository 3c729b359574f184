r"""Robust aggregation: server-side stages of the upload path (:mod:`fedflat.core.upload`, kind ``robust``) that
bound what a few malicious clients can do to the round's aggregate.

Each rule reads the round's received release, one row per answering client: :math:`x_i = (\Delta_i, \mathrm{extra}_i)`, the
model update and every other entry the method uploads (SCAFFOLD's :math:`\Delta c_i`, ...), and treats the clients
alike (the rules are unweighted):

- **coordinate-wise median**: :math:`x = \mathrm{median}_i\, x_i` in every coordinate (the mean of the two middle values for an
  even count, as ``numpy.median``; Yin et al., ICML 2018);
- **trimmed mean** (Yin et al. 2018): in every coordinate the :math:`b = \lfloor \beta K \rfloor` largest and :math:`b` smallest
  values are dropped and the rest averaged;
- **Krum / multi-Krum** (Blanchard et al., NeurIPS 2017): with :math:`f` assumed attackers, client :math:`i`'s score is
  :math:`s(i) = \sum_{j \in N_i} \lVert x_i - x_j \rVert^2` over its :math:`K - f - 2` nearest other clients :math:`N_i`; Krum takes the
  row of the lowest score, multi-Krum the mean of the :math:`m` rows of the lowest scores;
- **Bulyan** (El Mhamdi, Guerraoui and Rouault, ICML 2018, "The hidden vulnerability of distributed learning in
  Byzantium"), with :math:`f` assumed attackers and :math:`K \ge 4f + 3`: Krum applied recursively selects
  :math:`\theta = K - 2f` rows (each time Krum's row of the remaining set :math:`R`, its score over the :math:`\lvert R \rvert - f - 2`
  nearest others of :math:`R`, then removed from :math:`R`); then in every coordinate the :math:`\beta = \theta - 2f` selected
  values closest to the selected rows' coordinate-wise median are averaged;
- **norm bounding** (Sun et al. 2019, "Can you really backdoor federated learning?"): every row clipped to the
  bound :math:`M`, :math:`x_i \leftarrow x_i \min(1, M / \lVert x_i \rVert)`;
- **centered clipping** (Karimireddy, He and Jaggi, ICML 2021): from the previous round's aggregate :math:`v_0` (server
  state, zero before the first round), :math:`L` iterations of
  :math:`v \leftarrow v + \frac{1}{K} \sum_i (x_i - v) \min\big(1, \tau / \lVert x_i - v \rVert\big)`.

A rule that gives one aggregate (median, trimmed mean, Krum, Bulyan, centered clipping) returns every row equal to it, as
central differential privacy does, so whatever the method's server side computes from the rows (a weighted mean,
FedAvg's :math:`\sum_i p_i x_i`) reads exactly the robust aggregate; norm bounding returns the clipped rows, which the
method then aggregates as usual. Norms and distances are over the whole release, as one vector per client.

A rule needs each client's own update (:attr:`~fedflat.core.Part.individual`): it is refused with central
differential privacy, whose noise is calibrated to the sensitivity of the sum (fedflat.config), and with secure
aggregation, which shows the server only the sum.
"""
from __future__ import annotations

import math

import torch
from pydantic import Field

from fedflat.core import PartParams, RoundContext, clip_factors, init, release_norms, scale_release
from fedflat.core.upload import Release, UploadStage

CENTER = "cclip.v"  # server state of centered clipping: the previous round's aggregate, the release's entries flat
INDIVIDUAL = ("a robust rule reads every client's own update, where central DP's noise is calibrated to the "
              "sensitivity of the sum and secure aggregation shows only the sum")


def every_row(release: Release, aggregate: dict[str, torch.Tensor]) -> Release:
    """Each entry of ``release`` with all its rows equal to ``aggregate[name]`` (one row, the robust aggregate,
    computed once and seen ``K`` times, a broadcast view: :func:`fedflat.core.upload.moved`)."""
    return {name: aggregate[name].to(rows.dtype).reshape(rows.shape[1:]).expand(rows.shape)
            for name, rows in release.items()}


def rows_of(release: Release) -> int:
    return next(iter(release.values())).shape[0]


class RobustRule(UploadStage):
    """Base of the robust rules: server side only, refused where the server sees only the sum."""

    kind = "robust"
    individual = INDIVIDUAL


class Median(RobustRule):
    """Coordinate-wise median of the clients' releases (module docstring)."""

    name = "median"
    source = "Yin et al., ICML 2018"
    summary = "robust aggregation: the coordinate-wise median of the clients' updates"

    def server(self, ctx: RoundContext, release: Release) -> Release:
        return every_row(release, {name: coordinate_median(rows) for name, rows in release.items()})


def coordinate_median(rows: torch.Tensor) -> torch.Tensor:
    """``median_i x_i`` per coordinate of ``rows[K, ...]``, the mean of the two middle values for an even ``K``
    (``numpy.median``; ``torch.median`` would give the lower one)."""
    K = rows.shape[0]
    ordered = rows.sort(dim=0).values
    if K % 2:
        return ordered[K // 2]
    return (ordered[K // 2 - 1] + ordered[K // 2]) / 2


class TrimmedMeanParams(PartParams):
    beta: float = Field(0.1, ge=0, lt=0.5, description="the fraction of values dropped on each side of every "
                                                       "coordinate: b = floor(beta K) largest and smallest")


class TrimmedMean(RobustRule):
    """Coordinate-wise beta-trimmed mean (module docstring)."""

    name = "trimmed_mean"
    source = "Yin et al., ICML 2018"
    summary = "robust aggregation: coordinate-wise mean without the beta K largest and smallest values"
    Params = TrimmedMeanParams

    def server(self, ctx: RoundContext, release: Release) -> Release:
        K = rows_of(release)
        b = math.floor(self.p.beta * K)
        ctx.log["trimmed"] = float(b)
        return every_row(release, {name: rows.sort(dim=0).values[b:K - b].mean(0)
                                   for name, rows in release.items()})


class KrumParams(PartParams):
    f: int = Field(1, ge=0, description="the number of attackers Krum assumes among a round's clients")
    m: int = Field(1, ge=1, description="the rows averaged: 1 is Krum, more is multi-Krum")


def squared_distances(release: Release) -> torch.Tensor:
    r""":math:`\lVert x_i - x_j \rVert^2` over the whole release, ``[K, K]`` (float64 sums)."""
    K = rows_of(release)
    D = torch.zeros(K, K, dtype=torch.float64, device=next(iter(release.values())).device)
    for rows in release.values():
        flat = rows.reshape(K, -1)
        for i in range(K):
            D[i] += (flat - flat[i]).double().square().sum(1)
    return D


def krum_scores(D: torch.Tensor, f: int) -> torch.Tensor:
    """Blanchard et al.'s ``s(i)``: the sum of the ``K - f - 2`` smallest ``D[i, j]``, ``j != i`` (at least one)."""
    K = D.shape[0]
    nearest = max(K - f - 2, 1)
    others = D.masked_fill(torch.eye(K, dtype=torch.bool, device=D.device), float("inf"))
    return others.sort(dim=1).values[:, :nearest].sum(1)


class Krum(RobustRule):
    """Krum and multi-Krum (module docstring)."""

    name = "krum"
    source = "Blanchard et al., NeurIPS 2017"
    summary = "robust aggregation: Krum / multi-Krum, the mean of the m updates closest to their neighbours"
    Params = KrumParams

    def min_clients(self) -> int:
        return max(2 * self.p.f + 3, self.p.m)  # Blanchard et al.: 2 f + 2 < K

    def server(self, ctx: RoundContext, release: Release) -> Release:
        K = rows_of(release)
        scores = krum_scores(squared_distances(release), self.p.f)
        chosen = torch.sort(scores, stable=True).indices[:min(self.p.m, K)]
        ctx.log["krum_selected"] = float(chosen.numel())
        return every_row(release, {name: rows[chosen].mean(0) for name, rows in release.items()})


class BulyanParams(PartParams):
    f: int = Field(1, ge=0, description="the number of attackers Bulyan assumes among a round's clients (K >= 4f + 3)")


def bulyan_selection(D: torch.Tensor, f: int) -> list[int]:
    r"""El Mhamdi et al.'s selection: :math:`\theta = K - 2f` rows, each Krum's choice (lowest score, the first on ties)
    among the rows not yet selected, its score over the :math:`\lvert R \rvert - f - 2` nearest of the remaining :math:`R`."""
    remaining = list(range(D.shape[0]))
    chosen = []
    for _ in range(D.shape[0] - 2 * f):
        index = torch.tensor(remaining, device=D.device)
        scores = krum_scores(D[index][:, index], f)
        best = remaining[int(torch.argmin(scores))]
        chosen.append(best)
        remaining.remove(best)
    return chosen


def closest_to_median(rows: torch.Tensor, beta: int) -> torch.Tensor:
    r"""Per coordinate of ``rows[theta, ...]``, the mean of the :math:`\beta` values closest to the coordinate-wise median
    (Bulyan's second step)."""
    distance = (rows - coordinate_median(rows)).abs()
    nearest = distance.argsort(dim=0, stable=True)[:beta]
    return rows.gather(0, nearest).mean(0)


class Bulyan(RobustRule):
    """Bulyan: recursive Krum, then the coordinate-wise mean around the median (module docstring)."""

    name = "bulyan"
    summary = "robust aggregation: Bulyan, Krum's selection then a coordinate-wise trimmed mean around the median"
    source = "El Mhamdi, Guerraoui and Rouault, ICML 2018"
    Params = BulyanParams

    def min_clients(self) -> int:
        return 4 * self.p.f + 3  # El Mhamdi et al.: n >= 4 f + 3

    def server(self, ctx: RoundContext, release: Release) -> Release:
        K, f = rows_of(release), self.p.f
        if K < 4 * f + 3:  # a round with fewer answering clients than the rule is defined for (dropouts)
            f = max((K - 3) // 4, 0)
        chosen = torch.tensor(bulyan_selection(squared_distances(release), f))
        beta = len(chosen) - 2 * f
        ctx.log["bulyan_f"] = float(f)
        return every_row(release, {name: closest_to_median(rows[chosen.to(rows.device)], beta)
                                   for name, rows in release.items()})


class NormBoundParams(PartParams):
    bound: float = Field(1.0, gt=0, description="M: every client's release is clipped to L2 norm M")


class NormBound(RobustRule):
    """Norm bounding (module docstring): the rows clipped, aggregated by the method as usual."""

    name = "norm_bound"
    source = "Sun et al., arXiv 1911.07963, 2019"
    summary = "robust aggregation: every client's update clipped to the norm bound M (Sun et al. 2019)"
    Params = NormBoundParams

    def server(self, ctx: RoundContext, release: Release) -> Release:
        norms = release_norms(release)
        ctx.log["norm_bounded"] = float((norms > self.p.bound).sum())
        return scale_release(release, clip_factors(norms, self.p.bound))


class CenteredClipParams(PartParams):
    tau: float = Field(1.0, gt=0, description="the clipping radius around the center")
    iterations: int = Field(1, ge=1, description="L, the clipping iterations per round")


def flatten(release: Release) -> torch.Tensor:
    """The release as one row per client, ``[K, D]``, its entries in sorted name order."""
    K = rows_of(release)
    return torch.cat([release[name].reshape(K, -1) for name in sorted(release)], dim=1)


def unflatten(v: torch.Tensor, release: Release) -> dict[str, torch.Tensor]:
    """The one row ``v[D]`` of :func:`flatten` back as ``release``'s entries (one row each)."""
    out, start = {}, 0
    for name in sorted(release):
        shape = release[name].shape[1:]
        size = math.prod(shape)
        out[name] = v[start:start + size].reshape(shape)
        start += size
    return out


def centered_clip(X: torch.Tensor, v: torch.Tensor, tau: float, iterations: int) -> torch.Tensor:
    r"""Karimireddy et al.'s :math:`v \leftarrow v + \frac{1}{K} \sum_i (x_i - v) \min\big(1, \tau / \lVert x_i - v \rVert\big)`, ``iterations`` times."""
    for _ in range(iterations):
        diff = X - v
        scale = clip_factors(diff.double().norm(dim=1), tau).to(X.dtype)
        v = v + (diff * scale[:, None]).mean(0)
    return v


class CenteredClip(RobustRule):
    """Centered clipping from the previous round's aggregate (module docstring)."""

    name = "centered_clip"
    source = "Karimireddy, He and Jaggi, ICML 2021"
    summary = "robust aggregation: centered clipping around the previous aggregate (Karimireddy et al. 2021)"
    Params = CenteredClipParams
    server_state = {CENTER: init.vector(0)}  # empty before round 0: the first round starts from zero

    def server(self, ctx: RoundContext, release: Release) -> Release:
        X = flatten(release)
        previous = ctx.server[CENTER]
        v0 = previous.to(X) if previous.numel() == X.shape[1] else torch.zeros_like(X[0])
        v = centered_clip(X, v0, self.p.tau, self.p.iterations)
        ctx.server[CENTER] = v.clone()
        return every_row(release, unflatten(v, release))
