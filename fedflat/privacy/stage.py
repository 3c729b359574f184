r"""Client-level differential privacy: the Gaussian mechanism on each client's release (DP-FedAvg, McMahan et al.,
ICLR 2018), with a fixed or an adaptive clip (Andrew et al., NeurIPS 2021).

Each client's release :math:`x_i = (\Delta_i, \mathrm{extra}_i)` (:mod:`fedflat.core.upload`) is clipped to :math:`C`,
:math:`x_i \leftarrow x_i \min(1, C / \lVert x_i \rVert)`, and Gaussian noise of standard deviation :math:`z C` is added:

- ``mode: central`` (DP-FedAvg): to the sum, by the server, which releases :math:`\big(\sum_i x_i + \mathcal{N}(0, z^2 C^2 I)\big) / m`
  with :math:`m` the *expected* number of clients per round (:math:`K` for fixed-size sampling, :math:`q N` for Poisson
  sampling; never the realized count, which would leak). The mean is computed once, and every row the method's
  server side reads is that one tensor (a broadcast view; ``w^t`` plus it, once, for the model:
  :func:`fedflat.core.upload.moved`), so whatever it computes from the uploads is post-processing of the mechanism's
  output. (Its aggregation weights still act on those rows: they sum to one, so it reads the mean up to the last bits,
  which a shortcut around them would move.) A method
  that needs each client's own upload (:attr:`fedflat.core.Part.individual`) is refused
  (:func:`fedflat.privacy.config.check_upload_path`).
- ``mode: local``: by each client to its own clipped release, so that what leaves the client is private by itself.

Adaptive clipping (Andrew et al. 2021, Algorithm 1 with the geometric update): each client also reports
:math:`b_i = \mathbb{1}[\lVert x_i \rVert \le C]`; the server releases :math:`\tilde{b} = \big(\sum_i b_i + \mathcal{N}(0, \sigma_b^2)\big) / m` and sets
:math:`C \leftarrow C \exp\big(-\eta_C (\tilde{b} - \gamma)\big)`, so :math:`C` tracks the :math:`\gamma` quantile of the update norms. The pair of
mechanisms (update noise :math:`z_\Delta`, count noise :math:`\sigma_b`) is as private as one Gaussian mechanism of
multiplier :math:`z` when :math:`z_\Delta = \big(z^{-2} - (2 \sigma_b)^{-2}\big)^{-1/2}` (their Theorem 1): ``noise_multiplier`` is that
:math:`z`, the one the accountant composes.

Noise comes from the keyed streams (a reproducible simulation), or with ``secure: true`` from the operating
system's cryptographically secure source (:func:`secure_normal`), which a deployment must use.
"""
from __future__ import annotations

import math
import os
from typing import Literal

import numpy as np
import torch
from pydantic import Field, model_validator

from fedflat.core import SERVER, ClientContext, Cohort, PartParams, RoundContext, clip_factors, init, torch_stream
from fedflat.core.upload import Release, UploadStage, release_norms, scale_release

CLIP = "dp.clip"  # server state, broadcast: the round's clip C (fixed, or adapted by the server)
UNCLIPPED = "dp.unclipped"  # side entry of adaptive clipping: b_i = 1[||x_i|| <= C]


# -- the Gaussian mechanism's noise: N(0, std^2) draws shaped like a clipped release -----------------------------------
def secure_normal(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A tensor of ``shape``, ``dtype`` and ``device`` of standard normal draws from the operating system's
    cryptographically secure source (``os.urandom``), by the Box-Muller transform of two uniforms of 53 random bits
    each."""
    n = math.prod(shape)
    words = np.frombuffer(os.urandom(16 * ((n + 1) // 2)), dtype=np.uint64).reshape(2, -1)
    u1 = ((words[0] >> np.uint64(11)).astype(np.float64) + 1.0) / 2.0 ** 53  # (0, 1]: log(u1) is finite
    u2 = (words[1] >> np.uint64(11)).astype(np.float64) / 2.0 ** 53
    radius = np.sqrt(-2.0 * np.log(u1))
    z = np.concatenate([radius * np.cos(2 * np.pi * u2), radius * np.sin(2 * np.pi * u2)])[:n]
    return torch.from_numpy(z).reshape(shape).to(dtype=dtype, device=device)


def gaussian_like(release: Release, std: float, generator: torch.Generator | None) -> Release:
    r""":math:`\mathcal{N}(0, \mathrm{std}^2)` draws shaped like each entry of ``release`` (one row), in the entries' sorted order; from
    ``generator``, or from :func:`secure_normal` when it is None."""
    noise = {}
    for name in sorted(release):
        rows = release[name]
        shape = tuple(rows.shape[1:])
        draw = (torch.randn(shape, generator=generator, dtype=rows.dtype, device=rows.device) if generator is not None
                else secure_normal(shape, rows.dtype, rows.device))
        noise[name] = draw * std
    return noise


class GaussianParams(PartParams):
    mode: Literal["central", "local"] = Field("central", description="who adds the noise: the server to the sum "
                                                                      "(central) or each client (local)")
    clip: float = Field(1.0, gt=0, description="C, the L2 bound of a client's release (the first C when adaptive)")
    noise_multiplier: float = Field(1.0, ge=0, description="z: noise std z C (central: on the sum)")
    expected_clients: float = Field(1.0, gt=0, description="m, the expected number of clients per round: the "
                                                            "central mean's denominator (K, or q N for Poisson)")
    adaptive: bool = Field(False, description="adapt C to the `quantile` of the update norms (Andrew et al. 2021)")
    quantile: float = Field(0.5, gt=0, lt=1, description="gamma, the target fraction of unclipped updates")
    clip_lr: float = Field(0.2, gt=0, description="eta_C of the geometric update C <- C exp(-eta_C (b~ - gamma))")
    count_noise: float | None = Field(None, gt=0, description="sigma_b, the std of the noise on the count of "
                                                               "unclipped updates (default m / 20, the paper's)")
    secure: bool = Field(False, description="draw noise from the OS's secure source, not the keyed streams")

    @model_validator(mode="after")
    def _adaptive_is_central(self) -> "GaussianParams":
        if self.adaptive and self.mode != "central":
            raise ValueError("adaptive clipping noises the count of unclipped updates at the server: use mode=central")
        if self.adaptive and self.noise_multiplier > 0 and 2 * self.sigma_b <= self.noise_multiplier:
            raise ValueError(f"adaptive clipping: the count's noise sigma_b={self.sigma_b:g} must exceed z/2="
                             f"{self.noise_multiplier / 2:g} (Andrew et al. 2021, Theorem 1); raise count_noise")
        return self

    @property
    def sigma_b(self) -> float:
        return self.count_noise if self.count_noise is not None else self.expected_clients / 20

    @property
    def update_noise(self) -> float:
        r""":math:`z_\Delta`: the update's own noise multiplier (:math:`z` itself with a fixed clip)."""
        z = self.noise_multiplier
        if not self.adaptive or z == 0:
            return z
        return (z ** -2 - (2 * self.sigma_b) ** -2) ** -0.5


class GaussianMechanism(UploadStage):
    r"""Clip each client's release to ``C`` and add Gaussian noise, centrally or locally (module docstring):
    :math:`x_i \leftarrow x_i \min(1, C / \lVert x_i \rVert)`, then the server releases
    :math:`\big(\sum_i x_i + \mathcal{N}(0, z^2 C^2 I)\big) / m` (central), or each client adds
    :math:`\mathcal{N}(0, z^2 C^2 I)` to its own :math:`x_i` (local)."""

    name = "dp"
    source = "McMahan et al., ICLR 2018 (DP-FedAvg); adaptive clip: Andrew et al., NeurIPS 2021"
    kind = "clip"
    summary = "client-level DP: clip each release to C, Gaussian noise z C on the sum (central) or per client (local)"
    Params = GaussianParams
    server_state = {CLIP: init.scalar("clip", dtype=torch.float64)}
    sends = (CLIP,)
    side = (UNCLIPPED,)

    def _generator(self, seed: int, round: int, client: int, device: torch.device) -> torch.Generator | None:
        return None if self.p.secure else torch_stream(seed, round, client, "privacy", device)

    def client(self, ctx: ClientContext, cohort: Cohort, release: Release) -> Release:
        C = ctx.server[CLIP].double()
        norms = release_norms(release)
        clipped = scale_release(release, clip_factors(norms, C))
        if self.p.adaptive:
            cohort.upload[UNCLIPPED] = (norms <= C).to(torch.float32)
        if self.p.mode != "local" or self.p.update_noise == 0:
            return clipped
        std = self.p.update_noise * float(C)
        rows = [gaussian_like({k: v[c:c + 1] for k, v in clipped.items()}, std,
                              self._generator(ctx.settings.seed, ctx.round, int(i), next(iter(clipped.values())).device))
                for c, i in enumerate(cohort.ids.tolist())]
        return {name: clipped[name] + torch.stack([r[name] for r in rows]) for name in clipped}

    def server(self, ctx: RoundContext, release: Release) -> Release:
        C = float(ctx.server[CLIP])
        ctx.log["dp_clip"] = C
        if self.p.adaptive:
            self._adapt(ctx, C)
        if self.p.mode != "central":
            return release
        generator = self._generator(ctx.settings.seed, ctx.round, SERVER, ctx.w.device)
        noise = gaussian_like(release, self.p.update_noise * C, generator)
        m = self.p.expected_clients  # the noised mean, once: every row the method reads is this one tensor
        return {name: ((rows.sum(0) + noise[name]) / m).expand(rows.shape) for name, rows in release.items()}

    def _adapt(self, ctx: RoundContext, C: float) -> None:
        r""":math:`C \leftarrow C \exp\big(-\eta_C (\tilde{b} - \gamma)\big)` from the noised fraction of unclipped releases :math:`\tilde{b}`."""
        generator = self._generator(ctx.settings.seed, ctx.round, SERVER, torch.device("cpu"))
        count = ctx.uploads[UNCLIPPED].double().sum().cpu()
        draw = (torch.randn((), generator=generator, dtype=torch.float64) if generator is not None
                else secure_normal((), torch.float64, "cpu"))
        fraction = float(count + self.p.sigma_b * draw) / self.p.expected_clients
        ctx.server[CLIP] = torch.tensor(C * math.exp(-self.p.clip_lr * (fraction - self.p.quantile)),
                                        dtype=torch.float64, device=ctx.server[CLIP].device)
        ctx.log["dp_unclipped"] = fraction
