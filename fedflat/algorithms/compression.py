r"""Compressed uploads: top-k sparsification (with error feedback as an option) and QSGD's stochastic quantization,
stages of the upload path (:mod:`fedflat.core.upload`) that change what travels, counted at their encoded size.

Both act on the model update :math:`\Delta_i` (the release's ``model`` entry); a method's other entries travel as they
are. With error feedback (Stich et al., NeurIPS 2018; Karimireddy et al., ICML 2019) a client keeps what it did not
send, :math:`e_i`, and compresses :math:`\Delta_i + e_i` next time: :math:`e_i \leftarrow (\Delta_i + e_i) - Q(\Delta_i + e_i)`.

- **Top-k** keeps the :math:`k = \lceil \mathrm{ratio} \cdot P \rceil` entries of largest magnitude (ties to the lower index) and sends their
  values (float32) and indices (int32): :math:`8k` bytes a client instead of :math:`4P`.
- **QSGD** (Alistarh et al., NeurIPS 2017) sends :math:`\lVert x \rVert` and, per entry, :math:`\mathrm{sign}(x_j)\, \xi_j` with :math:`\xi_j` in
  :math:`\{0, \dots, s\}` drawn so that :math:`\mathbb{E}[\xi_j] = s \lvert x_j \rvert / \lVert x \rVert` (stochastic rounding): the estimate
  :math:`\lVert x \rVert\, \mathrm{sign}(x_j)\, \xi_j / s` is unbiased, with
  :math:`\mathbb{E} \lVert Q(x) - x \rVert^2 \le \min(P / s^2, \sqrt{P} / s) \lVert x \rVert^2` (their
  Lemma 3.1). Levels travel as int8 (:math:`s \le 127`): :math:`P + 4` bytes a client.

Under differential privacy the client compresses first and clips after (``fedflat.config`` puts the compression stage
before the clip when both are on), so the clipped release, sparse or quantized, is what the mechanism's sensitivity
bounds; local noise is dense, so compression is refused with ``privacy.mode: local``.
"""
from __future__ import annotations

import math

import torch
from pydantic import Field

from fedflat.core import MODEL, ClientContext, Cohort, PartParams, RoundContext, torch_stream
from fedflat.core.upload import Release, UploadStage

TOPK_RESIDUAL = "topk.e"  # client state: error feedback's residual e_i
QSGD_RESIDUAL = "qsgd.e"
VALUES, INDEX, NORM, LEVELS = f"{MODEL}/values", f"{MODEL}/index", f"{MODEL}/norm", f"{MODEL}/levels"


class TopKParams(PartParams):
    ratio: float = Field(0.01, gt=0, le=1, description="k / P, the fraction of the update's entries sent")
    error_feedback: bool = Field(False, description="keep what was not sent and add it to the next update")


def top_k(x: torch.Tensor, k: int) -> torch.Tensor:
    """The indices ``[C, k]`` of each row's ``k`` entries of largest magnitude, ascending (a stable sort: ties go to
    the lower index, so the choice does not depend on the kernel)."""
    order = torch.sort(x.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    return order.sort(dim=1).values


def with_residual(cohort: Cohort, delta: torch.Tensor, name: str) -> torch.Tensor:
    r""":math:`\Delta_i + e_i`, error feedback's input, with the residuals ``name`` the clients keep
    (:math:`e_i = 0` before a client's first participation)."""
    return delta + torch.where(cohort.known[name].to(delta.device)[:, None], cohort.state[name].to(delta), 0.0)


class TopK(UploadStage):
    """Top-k sparsification of the model update (module docstring)."""

    name = "topk"
    source = "Aji and Heafield, EMNLP 2017; error feedback: Stich et al., NeurIPS 2018"
    kind = "compress"
    encodes = True
    summary = "top-k sparsification of the model update (values + int32 indices), error feedback as an option"
    Params = TopKParams
    keeps = (TOPK_RESIDUAL,)
    wire = (VALUES, INDEX)

    def kept(self) -> tuple[str, ...]:
        return self.keeps if self.p.error_feedback else ()

    def k(self, size: int) -> int:
        return max(1, math.ceil(self.p.ratio * size))

    def client(self, ctx: ClientContext, cohort: Cohort, release: Release) -> Release:
        x = with_residual(cohort, release[MODEL], TOPK_RESIDUAL) if self.p.error_feedback else release[MODEL]
        index = top_k(x, self.k(x.shape[1]))
        sparse = torch.zeros_like(x).scatter_(1, index, x.gather(1, index))
        cohort.own(self)[INDEX] = index
        if self.p.error_feedback:
            cohort.new_state[TOPK_RESIDUAL] = x - sparse
        return {**release, MODEL: sparse}

    def encode(self, ctx: ClientContext, cohort: Cohort, release: Release) -> dict[str, torch.Tensor]:
        index = cohort.own(self)[INDEX]
        rest = {k: v for k, v in release.items() if k != MODEL}
        return {**rest, VALUES: release[MODEL].gather(1, index), INDEX: index.to(torch.int32)}

    def malformed(self, payload: dict[str, torch.Tensor], size: int) -> torch.Tensor:
        """Rows whose values are not ``k`` floats or whose indices are not ``k`` int32 in ``[0, P)``."""
        values, index = payload[VALUES], payload[INDEX]
        k = self.k(size)
        if (values.dim() != 2 or index.dim() != 2 or values.shape[1] != k or index.shape[1] != k
                or not values.is_floating_point() or index.dtype != torch.int32):
            return torch.ones(values.shape[0], dtype=torch.bool)
        return ((index < 0) | (index >= size)).any(1).cpu()

    def decode(self, ctx: RoundContext, payload: dict[str, torch.Tensor], size: int) -> Release:
        values, index = payload[VALUES], payload[INDEX].long()
        dense = torch.zeros(values.shape[0], size, dtype=values.dtype, device=values.device)
        rest = {k: v for k, v in payload.items() if k not in (VALUES, INDEX)}
        return {**rest, MODEL: dense.scatter_(1, index, values)}


class QSGDParams(PartParams):
    levels: int = Field(16, ge=1, le=127, description="s, the quantization levels per sign (int8 on the wire)")
    error_feedback: bool = Field(False, description="keep the quantization error and add it to the next update")


def qsgd_levels(x: torch.Tensor, s: int, generators: list[torch.Generator]) -> tuple[torch.Tensor, torch.Tensor]:
    r"""QSGD's :math:`(\lVert x_i \rVert, \mathrm{sign}(x_{ij})\, \xi_{ij})` for each row (Alistarh et al. 2017, Eq. (4)): :math:`\xi = l + 1` with
    probability :math:`s \lvert x \rvert / \lVert x \rVert - l`, else :math:`l` (:math:`l` the floor), one uniform per entry from the row's stream."""
    norm = x.norm(dim=1)
    u = torch.stack([torch.rand(x.shape[1], generator=g, dtype=torch.float64, device=x.device) for g in generators])
    ratio = s * x.abs().double() / norm.double().clamp(min=1e-300)[:, None]
    floor = ratio.floor()
    xi = floor + (u < ratio - floor).double()
    return norm, (torch.sign(x).double() * xi).to(torch.int8)


class QSGD(UploadStage):
    """QSGD's unbiased stochastic quantization of the model update (module docstring)."""

    name = "qsgd"
    source = "Alistarh et al., NeurIPS 2017"
    kind = "compress"
    encodes = True
    summary = "QSGD stochastic quantization of the model update (norm + int8 levels), error feedback as an option"
    Params = QSGDParams
    keeps = (QSGD_RESIDUAL,)
    wire = (NORM, LEVELS)

    def kept(self) -> tuple[str, ...]:
        return self.keeps if self.p.error_feedback else ()

    def client(self, ctx: ClientContext, cohort: Cohort, release: Release) -> Release:
        x = with_residual(cohort, release[MODEL], QSGD_RESIDUAL) if self.p.error_feedback else release[MODEL]
        generators = [torch_stream(ctx.settings.seed, ctx.round, int(i), "qsgd", x.device) for i in cohort.ids.tolist()]
        norm, levels = qsgd_levels(x, self.p.levels, generators)
        q = (norm[:, None] * levels.to(x.dtype) / self.p.levels).to(x.dtype)
        cohort.own(self)[LEVELS] = levels
        if self.p.error_feedback:
            cohort.new_state[QSGD_RESIDUAL] = x - q
        return {**release, MODEL: q}

    def encode(self, ctx: ClientContext, cohort: Cohort, release: Release) -> dict[str, torch.Tensor]:
        """The norm that reproduces the (possibly clipped since) rows from the levels: ``r = s <y, l> / <l, l>``."""
        levels = cohort.own(self)[LEVELS]
        y, l = release[MODEL].double(), levels.double()
        norm = self.p.levels * (y * l).sum(1) / (l * l).sum(1).clamp(min=1)
        rest = {k: v for k, v in release.items() if k != MODEL}
        return {**rest, NORM: norm.to(release[MODEL].dtype), LEVELS: levels}

    def malformed(self, payload: dict[str, torch.Tensor], size: int) -> torch.Tensor:
        """Rows whose norm is not one float or whose levels are not ``P`` int8 in ``[-s, s]``."""
        norm, levels = payload[NORM], payload[LEVELS]
        if norm.dim() != 1 or not norm.is_floating_point() or levels.dtype != torch.int8 or levels.shape[1:] != (size,):
            return torch.ones(norm.shape[0], dtype=torch.bool)
        return (levels.abs() > self.p.levels).any(1).cpu()

    def decode(self, ctx: RoundContext, payload: dict[str, torch.Tensor], size: int) -> Release:
        norm, levels = payload[NORM], payload[LEVELS]
        rest = {k: v for k, v in payload.items() if k not in (NORM, LEVELS)}
        return {**rest, MODEL: norm[:, None] * levels.to(norm.dtype) / self.p.levels}
