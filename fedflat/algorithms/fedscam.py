r"""FedSCAM (seed 003, Algorithm 1): heterogeneity-adaptive SAM radius and alignment-aware aggregation.

Per selected client, before local training (at the received model :math:`w^t`):

- heterogeneity :math:`h_i` = mean of :math:`\lVert g(w^t) \rVert` over :math:`B = 3` batches;
- pilot direction = the one-step SAM update :math:`-g(w^t + \rho_{pilot}\, g / \lVert g \rVert)` on one batch (the first of those
  :math:`B`; one more backprop) at the pilot radius :math:`\rho_{pilot} = 0.5\, \rho_{max} / (1 + \alpha_\rho h_i)` (§2.2),
  summary :math:`s_i = P_d(\mathrm{normalize}(\text{pilot}))` with a fixed seeded Gaussian random projection :math:`P_d` (:math:`d = 256`);
- alignment :math:`c_i = \cos(s_i, u_{t-1})` (0 at :math:`t = 0`, where :math:`u` is still zero);
- :math:`h_{adj} = h_i \max(0, 1 - \kappa c_i)`, radius :math:`\rho_i = \rho_{max} / (1 + \alpha_\rho h_{adj})`; local SAM with :math:`\rho_i`.

After training: :math:`z_i = P_d(\mathrm{normalize}(\Delta_i))`; optional clustered dampening (k-means with ``clusters``
clusters on :math:`z`; inside a cluster, for every pair with negative cosine, the smaller-norm update's weight is
multiplied by ``dampening`` = :math:`\lambda`); then

.. math::

    S_i \propto \frac{n_i}{1 + \gamma h_{adj}} \max(0, 1 + \beta c_i),

    w^{t+1} = w^t + \eta_g \frac{\sum_i S_i \Delta_i}{\sum_j S_j},

    u_t = P_d\big(\mathrm{normalize}(w^{t+1} - w^t)\big) .

Variants: ``fedscam`` (both), ``fedscam-wa`` (local SGD, FedSCAM weights), ``fedscam-sam`` (adaptive
radius, uniform weights); ``fedlwsam`` is local SAM with FedLW's loss-based weights.
The pilot is a one-step update direction (one of the two options Algorithm 1 names), not the raw gradient:
:math:`u` summarizes an update :math:`w^{t+1} - w^t`, so only an update-direction pilot gives :math:`c_i > 0` to the
clients that agree with the global progress, as the paper intends. It is a SAM step at the pilot radius the
paper's implementation sets (§2.2); FedSCAM-WA, without SAM, takes the plain step :math:`-g`. ``algo.pilot=update``
takes :math:`-g(w^t)` for every variant (fedflat's rule before the pilot radius, one backprop less);
``algo.pilot=gradient`` takes :math:`+g`, which flips the sign of every :math:`c_i`.
``P_d`` (``algo.projection``): the paper asks for a "random projection" of the summaries (Algorithm 1, §5: "random
projection with d in {256, 512}") and uses them only through cosines and k-means, which any Johnson-Lindenstrauss
map keeps in expectation; the spec names a Gaussian one. ``gaussian``: :math:`R X / \sqrt{d}`, ``R[d, P]`` seeded standard
normals (one matmul with a cached matrix on small models; beyond 2^24 entries its blocks are drawn again or kept,
and each summary reads all of ``R``: on the CNN of the W2 bench 205 M entries a client). ``countsketch``: each
coordinate ``j`` added, with a seeded random sign ``s_j``, to one seeded random bucket ``b_j`` of the ``d`` (Charikar
et al. 2002; :math:`\mathbb{E} \langle S x, S y \rangle = \langle x, y \rangle`, and for vectors without dominant coordinates the same
:math:`(\lVert x \rVert^2 \lVert y \rVert^2 + \langle x, y \rangle^2)/d` variance as the Gaussian's), two passes over ``X`` whatever ``d``. ``auto`` (default): the Gaussian
where ``R`` is a cached matrix of at most 2^24 entries (``P d``), the count sketch above.
The scores are computed on the client, once per round, by whichever FedSCAM part begins first and shared
through the channel (``scam.scores``); the aggregation part uploads :math:`h_{adj}` and :math:`c_i` (two scalars), the radius part
uploads :math:`\rho_i` (logged as the round's mean radius, seed 003 Fig. 1). The direction memory :math:`u`
(:math:`d` numbers) lives on the server and goes down with the model.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from fedflat.algorithms.fedsam import LocalSAM
from fedflat.core import (RHO_GRID, SERVER, Aggregation, ClientContext, Cohort, PartParams, Recipe, RoundContext, Slot,
                          init, numpy_stream, register_recipe, row_norm, shared, torch_stream)

DIRECTION_MEMORY = "scam.u"  # server state, broadcast: u_{t-1}, the projected direction of the last global update
MEMORY_INIT = init.vector("summary_dim")  # u_{-1} = 0; one init, so both FedSCAM parts declare the same entry
SCORES = Slot("scam.scores", "{h, c, h_adj} of the chunk's clients, from the radius part's pilot when it runs")
ALIGNMENT, ADJUSTED_HETEROGENEITY, RADIUS = "scam.c", "scam.h_adj", "scam.radius"  # uploads, [K]
_COLUMNS = 4096  # the projection is generated in column blocks of this width, each from its own stream
_CACHE_LIMIT = 1 << 24  # projections up to this many entries are kept in memory as one matrix
# Larger ones up to this many entries (256 MiB in float32) keep their blocks: drawing them again costs a
# FedSCAM round a second per summary on the MLP (P d = 51 M normals), most of its overhead over FedSAM.
_BLOCK_CACHE_LIMIT = 1 << 26


def _projection_blocks(seed: int, P: int, d: int, columns: int):
    """Column blocks ``(start, R_b[d, width])`` of the fixed Gaussian projection; block ``b`` is drawn from
    the stream (seed, ``"scam_projection/b"``), so ``R`` does not depend on how it is traversed."""
    for b, start in enumerate(range(0, P, columns)):
        g = torch_stream(seed, -1, SERVER, f"scam_projection/{b}")
        yield start, torch.randn(d, min(columns, P - start), generator=g)


@lru_cache(maxsize=4)
def _projection_matrix(seed: int, P: int, d: int, device: str) -> torch.Tensor:
    return torch.cat([R for _, R in _projection_blocks(seed, P, d, _COLUMNS)], dim=1).to(device)


@lru_cache(maxsize=1)
def _cached_blocks(seed: int, P: int, d: int, device: str, columns: int) -> tuple[tuple[int, torch.Tensor], ...]:
    return tuple((start, R.to(device)) for start, R in _projection_blocks(seed, P, d, columns))


def random_projection(X: torch.Tensor, d: int, seed: int) -> torch.Tensor:
    r""":math:`P_d X = R X / \sqrt{d}` row by row, ``R[d, P]`` a fixed Gaussian matrix drawn from ``seed``
    (generated block by block, so the largest models never hold all of ``R``)."""
    P = X.shape[-1]
    if P * d <= _CACHE_LIMIT:
        R = _projection_matrix(seed, P, d, str(X.device))
        return X @ R.T / d ** 0.5
    out = torch.zeros(*X.shape[:-1], d, device=X.device, dtype=X.dtype)
    blocks = (_cached_blocks(seed, P, d, str(X.device), _COLUMNS) if P * d <= _BLOCK_CACHE_LIMIT
              else _projection_blocks(seed, P, d, _COLUMNS))
    for start, R in blocks:
        out += X[..., start:start + R.shape[1]] @ R.to(X.device, X.dtype).T
    return out / d ** 0.5


@lru_cache(maxsize=4)
def _sketch(seed: int, P: int, d: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The count sketch's buckets ``b[P]`` (in ``[0, d)``) and signs ``s[P]`` (``±1``), from the stream (seed,
    ``"scam_sketch"``)."""
    g = torch_stream(seed, -1, SERVER, "scam_sketch")
    buckets = torch.randint(d, (P,), generator=g)
    signs = torch.randint(2, (P,), generator=g).mul_(2).sub_(1).to(torch.float32)
    return buckets.to(device), signs.to(device)


def count_sketch(X: torch.Tensor, d: int, seed: int) -> torch.Tensor:
    r""":math:`S X` row by row: :math:`(S x)_k = \sum_{j:\, b_j = k} s_j x_j` (:func:`_sketch`), :math:`\mathbb{E} \langle S x, S y \rangle = \langle x, y \rangle`."""
    buckets, signs = _sketch(seed, X.shape[-1], d, str(X.device))
    out = torch.zeros(*X.shape[:-1], d, device=X.device, dtype=X.dtype)
    return out.index_add_(-1, buckets, X * signs.to(X.dtype))


Projection = Literal["auto", "gaussian", "countsketch"]


def projection_of(kind: Projection, P: int, d: int) -> str:
    """``auto``: ``gaussian`` where its matrix is cached (``P d`` at most 2^24), ``countsketch`` above."""
    if kind != "auto":
        return kind
    return "gaussian" if P * d <= _CACHE_LIMIT else "countsketch"


def summarize(X: torch.Tensor, d: int, seed: int, projection: Projection = "gaussian") -> torch.Tensor:
    """``P_d(normalize(X))`` row by row, ``P_d`` the Gaussian projection or the count sketch (``projection``)."""
    unit = X / (row_norm(X) + 1e-12)
    if projection_of(projection, X.shape[-1], d) == "countsketch":
        return count_sketch(unit, d, seed)
    return random_projection(unit, d, seed)


def cosine(X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``cos(X_i, y)`` per row; 0 when either vector is zero."""
    return (X @ y) / (row_norm(X).squeeze(-1) * y.norm() + 1e-12)


class ScoreParams(PartParams):
    """The client scores' hyperparameters, one value for FedSCAM's radius and its weights (they share the scores)."""

    kappa: float = shared(1.0, ge=0, description="heterogeneity-alignment coupling: h_adj = h max(0, 1 - kappa c)")
    pilot_batches: int = shared(3, ge=1, description="B: batches whose mean gradient norm is h_i")
    summary_dim: int = shared(256, ge=1, description="d: dimension of the random-projection summaries")
    pilot: Literal["sam", "update", "gradient"] = shared(
        "sam", description="pilot direction: the one-step SAM update at the pilot radius 0.5 rho_max/(1 + alpha_rho "
                           "h_i) (sam; the plain update where no SAM radius exists), -g (update) or +g (gradient)")
    projection: Projection = shared(
        "auto", description="P_d of the summaries: gaussian (R X/sqrt(d), R seeded normals), countsketch (a seeded "
                            "random sign and bucket per coordinate: two passes over X), auto (gaussian where R is a "
                            "cached matrix, P d <= 2^24; countsketch above)")


def client_scores(ctx: ClientContext, cohort: Cohort, p: ScoreParams, rho_max: float = 0.0,
                  alpha_rho: float = 0.0) -> dict[str, torch.Tensor]:
    """``{h, c, h_adj}`` of the chunk's clients, at the received model; the radius part gives its ``rho_max`` and
    ``alpha_rho`` for the pilot radius, the weights alone a plain pilot (no radius).

    Costs ``B`` backprops per client and round at the received model, and one more for the SAM pilot.
    """
    W0 = ctx.w_start.expand(cohort.size, -1)
    extra = [ctx.batches.extra(ctx.round, i, p.pilot_batches, "scam_heterogeneity") for i in cohort.ids.tolist()]
    norms = []
    for b in range(p.pilot_batches):
        batch = ctx.batches.batch([picks[b] for picks in extra], None)
        _, grad = ctx.oracle.loss_grad(W0, batch)
        norms.append(row_norm(grad).squeeze(-1))
        if b == 0:
            first, first_grad = batch, grad
    h = torch.stack(norms).mean(0)
    pilot = pilot_direction(ctx, p.pilot, W0, first, first_grad, h, rho_max, alpha_rho)
    c = cosine(summarize(pilot, p.summary_dim, ctx.settings.seed, p.projection), ctx.server[DIRECTION_MEMORY])
    return {"h": h, "c": c, "h_adj": h * (1 - p.kappa * c).clamp(min=0)}


def pilot_direction(ctx: ClientContext, kind: str, W0: torch.Tensor, batch, grad: torch.Tensor, h: torch.Tensor,
                    rho_max: float, alpha_rho: float) -> torch.Tensor:
    r"""The pilot :math:`v_i` on the first batch (Algorithm 1, "Pilot direction"): ``sam``, the one-step SAM update
    :math:`-g(w^t + \rho_{pilot}\, g / \lVert g \rVert)` at the pilot radius :math:`\rho_{pilot} = 0.5\, \rho_{max} / (1 + \alpha_\rho h_i)`
    (§2.2: "a conservative per-client initialization before full client-wise modulation"), or :math:`-g` where
    the method has no SAM radius (FedSCAM-WA); ``update``, :math:`-g`; ``gradient``, :math:`+g`."""
    if kind == "gradient":
        return grad
    if kind == "sam" and rho_max > 0:
        rho_pilot = 0.5 * rho_max / (1 + alpha_rho * h)
        _, grad = ctx.oracle.loss_grad(W0 + grad * (rho_pilot[:, None] / (row_norm(grad) + 1e-12)), batch)
    return -grad


def remember_direction(ctx: RoundContext, w_new: torch.Tensor, p: ScoreParams) -> None:
    r""":math:`u_t = P_d(\mathrm{normalize}(w^{t+1} - w^t))`. Both FedSCAM parts keep :math:`u` (either runs alone); with both, the
    second write is the same value (the summary is a deterministic function of the update)."""
    ctx.server[DIRECTION_MEMORY] = summarize((w_new - ctx.w)[None], p.summary_dim, ctx.settings.seed, p.projection)[0]


class RadiusParams(ScoreParams):
    rho_max: float = Field(0.05, ge=0, description="largest SAM radius")
    alpha_rho: float = Field(1.0, ge=0, description="radius scale: rho_i = rho_max / (1 + alpha_rho h_adj)")


class AdaptiveRadiusSAM(LocalSAM):
    r"""Local SAM with the client radius :math:`\rho_i = \rho_{max} / (1 + \alpha_\rho h_{adj})`."""

    name = "scam"
    summary = "FedSCAM: SAM with radius rho_max/(1 + alpha_rho h_adj), h_adj from pilot gradient norms and alignment"
    beyond_batch = "its scores take gradients of pilot batches beside the local steps'"
    Params = RadiusParams
    server_state = {DIRECTION_MEMORY: MEMORY_INIT}
    sends = (DIRECTION_MEMORY,)
    provides = frozenset({SCORES})

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        scores = client_scores(ctx, cohort, self.p, self.p.rho_max, self.p.alpha_rho)
        cohort.shared.put(SCORES, scores)
        radius = self.p.rho_max / (1 + self.p.alpha_rho * scores["h_adj"])
        cohort.own(self)[RADIUS] = radius[:, None]
        cohort.upload[RADIUS] = radius

    def radius(self, ctx: ClientContext, cohort: Cohort) -> torch.Tensor:
        return cohort.own(self)[RADIUS]

    def perturb(self, ctx: ClientContext, cohort: Cohort, k: int, W: torch.Tensor, batch) -> torch.Tensor | None:
        if self.p.rho_max == 0:
            return None
        _, grad = ctx.oracle.loss_grad(W, batch)
        return grad.mul_(self.radius(ctx, cohort) / (row_norm(grad) + 1e-12))  # (the oracle's fresh tensor)

    def finish(self, ctx: RoundContext) -> None:
        ctx.log["scam_radius"] = float(ctx.uploads[RADIUS].mean())

    def after_step(self, ctx: RoundContext, w_new: torch.Tensor) -> None:
        remember_direction(ctx, w_new, self.p)


def kmeans(Z: torch.Tensor, k: int, rng: np.random.Generator, iters: int = 50) -> torch.Tensor:
    """Cluster labels of the rows of ``Z`` (k-means++ seeding from ``rng``, then Lloyd's iterations)."""
    n = Z.shape[0]
    if n <= k:
        return torch.arange(n)
    Zc = Z.double().cpu()
    centers = [Zc[rng.integers(n)]]
    for _ in range(1, k):
        dist = torch.cdist(Zc, torch.stack(centers)).min(1).values ** 2
        probs = (dist / dist.sum()).numpy() if dist.sum() > 0 else np.full(n, 1.0 / n)
        centers.append(Zc[rng.choice(n, p=probs)])
    C = torch.stack(centers)
    labels = torch.cdist(Zc, C).argmin(1)
    for _ in range(iters):
        C = torch.stack([Zc[labels == j].mean(0) if (labels == j).any() else C[j] for j in range(k)])
        new = torch.cdist(Zc, C).argmin(1)
        if torch.equal(new, labels):
            break
        labels = new
    return labels


def conflict_dampening(Z: torch.Tensor, update_norms: torch.Tensor, labels: torch.Tensor, lam: float) -> torch.Tensor:
    """Weight factors: inside each cluster, each pair with negative cosine multiplies the smaller-norm
    update's factor by ``lam``."""
    cos = (Z @ Z.T) / (row_norm(Z) * row_norm(Z).T + 1e-12)
    factor = torch.ones(Z.shape[0], dtype=Z.dtype, device=Z.device)
    for i in range(Z.shape[0]):
        for j in range(i + 1, Z.shape[0]):
            if labels[i] == labels[j] and cos[i, j] < 0:
                factor[i if update_norms[i] < update_norms[j] else j] *= lam
    return factor


class WeightParams(ScoreParams):
    gamma: float = Field(1.0, ge=0, description="heterogeneity penalty of the weights")
    beta: float = Field(0.8, ge=0, description="alignment boost of the weights")
    clustering: bool = Field(False, description="clustered conflict dampening")
    clusters: int = Field(2, ge=1, description="K of the k-means on the update summaries")
    dampening: float = Field(0.5, gt=0, le=1, description="lambda: weight factor of the smaller conflicting update")


class AlignmentWeights(Aggregation):
    r""":math:`S_i \propto \frac{n_i}{1 + \gamma h_{adj}} \max(0, 1 + \beta c_i)` (times the optional dampening
    factors)."""

    name = "scam"
    summary = "FedSCAM: p_i ∝ n_i/(1 + gamma h_adj) * max(0, 1 + beta c_i), optional clustered conflict dampening"
    individual = "weighs each client by its own heterogeneity and alignment scores"
    beyond_batch = "its scores take gradients of pilot batches beside the local steps'"
    Params = WeightParams
    server_state = {DIRECTION_MEMORY: MEMORY_INIT}
    sends = (DIRECTION_MEMORY,)

    def begin(self, ctx: ClientContext, cohort: Cohort) -> None:
        """The scores of the radius part when the method has it (computed once, with its pilot radius), else
        this part's own."""
        scores = cohort.shared[SCORES] if SCORES in cohort.shared else client_scores(ctx, cohort, self.p)
        cohort.upload[ADJUSTED_HETEROGENEITY] = scores["h_adj"]
        cohort.upload[ALIGNMENT] = scores["c"]

    def weights(self, ctx: RoundContext) -> torch.Tensor:
        S = (ctx.num_samples.to(ctx.w.dtype) / (1 + self.p.gamma * ctx.uploads[ADJUSTED_HETEROGENEITY])
             * (1 + self.p.beta * ctx.uploads[ALIGNMENT]).clamp(min=0))
        if self.p.clustering:
            deltas = ctx.deltas
            Z = summarize(deltas, self.p.summary_dim, ctx.settings.seed, self.p.projection)
            labels = kmeans(Z, self.p.clusters, numpy_stream(ctx.settings.seed, ctx.round, SERVER, "scam_kmeans"))
            S = S * conflict_dampening(Z, row_norm(deltas).squeeze(-1), labels, self.p.dampening)
        if S.sum() <= 0:  # every client anti-aligned beyond -1/beta: fall back to sample weights
            S = ctx.num_samples.to(ctx.w.dtype)
        return S / S.sum()

    def after_step(self, ctx: RoundContext, w_new: torch.Tensor) -> None:
        remember_direction(ctx, w_new, self.p)


_SOURCE = "seed 003 (FedSCAM), Algorithm 1"
SCAM_GRID = {"algo.rho_max": (0.01, 0.05, 0.1)}  # seed 003 §5.1.1
register_recipe(Recipe(
    name="fedscam", display="FedSCAM",
    summary="heterogeneity-adaptive SAM radius + alignment-aware weights (algo.clustering: dampening)",
    source=_SOURCE, perturbation="scam", aggregation="scam",
    tunable=SCAM_GRID))
register_recipe(Recipe(
    name="fedscam-wa", display="FedSCAM-WA",
    summary="FedSCAM's weights on local SGD (no SAM)", source=_SOURCE + ", Table 2 (WA)",
    aggregation="scam"))
register_recipe(Recipe(
    name="fedscam-sam", display="FedSCAM-SAM",
    summary="FedSCAM's adaptive SAM radius with uniform weights", source=_SOURCE + ", Table 2 (SAM)",
    perturbation="scam",
    tunable=SCAM_GRID))
register_recipe(Recipe(
    name="fedlwsam", display="FedLW-SAM", summary="local SAM with FedLW's loss-based weights p_i ∝ n_i / F_i",
    source="seed 003 (FedSCAM), Table 2 baseline", perturbation="sam", aggregation="fedlw", defaults={"rho": 0.05},
    tunable={"algo.rho": RHO_GRID}))
