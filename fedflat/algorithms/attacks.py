r"""Simulated malicious clients: attacks to measure a method and a robust rule against, deterministic and keyed.

A fraction of the federation's :math:`N` clients is malicious: :math:`\mathrm{round}(\mathrm{fraction} \cdot N)` of them (at least one when
``fraction > 0``), drawn once per run from the keyed stream ``(seed, -1, SERVER, "attackers")``
(:func:`attackers`), so every engine, executor and Flower node agrees on who they are without being told. A
malicious client trains as the method says, on its own data, and then:

- ``label_flip``: trains on flipped labels, :math:`y \to C - 1 - y` on every sample of its batches (a data attack);
- ``sign_flip``: uploads :math:`-\mathrm{scale}\, \Delta_i` in place of its update :math:`\Delta_i`;
- ``gaussian``: uploads :math:`\mathcal{N}(0, \mathrm{std}^2 I)` in place of :math:`\Delta_i`, drawn from its stream
  ``(seed, t, i, "attack")``;
- ``backdoor`` (Bagdasaryan et al., AISTATS 2020, "How to backdoor federated learning"): a pixel trigger, a
  ``trigger_size`` square set to ``trigger_value`` in the bottom-right corner of the model's inputs, is stamped on
  the first :math:`\lceil \mathrm{poison\_fraction} \cdot n_b \rceil` samples of each of its batches (:math:`n_b` real samples; batches are
  shuffled, so these are a random subset), labelled ``target``; its update is then boosted,
  :math:`\Delta_i \leftarrow \mathrm{boost}\, \Delta_i` (model replacement: ``boost`` about :math:`N / \eta` replaces the global model by the
  backdoored one; 1 is plain data poisoning). The run's metrics then hold ``backdoor_acc``: the fraction of test
  samples not of the ``target`` class that the global model classifies as ``target`` once the trigger is stamped;
- ``alie`` ("A Little Is Enough", Baruch, Baruch and Goldberg, NeurIPS 2019): the malicious clients of a round
  collude and all upload :math:`\mu - z_{max} \sigma`, with :math:`\mu` and :math:`\sigma` the coordinate-wise mean and standard
  deviation of the round's benign updates and, for :math:`n` clients of which :math:`f` malicious, :math:`s = \lfloor n/2 + 1 \rfloor - f`
  and :math:`z_{max} = \Phi^{-1}\big((n - s) / n\big)` (the paper's formula; ``z`` overrides it). With the attackers
  a majority of the round's clients (:math:`f > n / 2`), the paper's :math:`s` is 0 or below and its :math:`z_{max}`
  infinite or undefined: fedflat clamps :math:`s` to 1, so :math:`z = \Phi^{-1}\big((n - 1) / n\big)` (1.38 for
  :math:`n = 12`);
- ``ipm`` (inner-product manipulation, Xie, Koyejo and Gupta, UAI 2020, "Fall of empires"): the malicious clients
  all upload :math:`-\epsilon \mu`, :math:`\mu` the mean of the round's benign updates.

The colluding attacks (``alie``, ``ipm``) are the papers' omniscient attackers: they know every benign update of
the round, so they act in the attack's *server* hook (:meth:`ColludingAttack.server`), which runs first among the
server stages and sees the round's whole received release (client hooks see one chunk of clients at a time, one
client on the sequential engine). Their rows therefore skip the client-side stages (compression, a DP clip and
local noise): they are refused with ``privacy`` and ``compression`` (fedflat.config).

Upload attacks are stages of the upload path (:mod:`fedflat.core.upload`, kind ``attack``: first on the client,
before compression or a DP clip) that change only the malicious clients' rows, and only ``Delta_i`` (a method's
other entries travel as they are). Data attacks (:class:`DataAttack`) define :meth:`DataAttack.poison`, which the
engine calls on every step's batch (:class:`fedflat.engine.client.LocalLoop`) and which changes only the malicious
clients' rows.
"""
from __future__ import annotations

import functools
import math
from dataclasses import replace
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import Field

from fedflat.core import (MODEL, SERVER, Batch, ClientContext, Cohort, ConfigError, PartParams, RoundContext,
                          STAGES, numpy_stream, torch_stream)
from fedflat.core.upload import Release, UploadStage


def attackers(seed: int, num_clients: int, fraction: float) -> np.ndarray:
    """The malicious clients of a run, ascending: ``round(fraction N)`` of the ``N`` (at least one for a positive
    ``fraction``), drawn without replacement from the stream ``(seed, -1, SERVER, "attackers")``."""
    return np.array(_attackers(seed, num_clients, fraction), dtype=np.int64)


@functools.lru_cache(maxsize=64)
def _attackers(seed: int, num_clients: int, fraction: float) -> tuple[int, ...]:
    count = min(num_clients, max(1, math.floor(fraction * num_clients + 0.5))) if fraction > 0 else 0
    rng = numpy_stream(seed, -1, SERVER, "attackers")
    return tuple(sorted(rng.choice(num_clients, count, replace=False).tolist()))


def is_malicious(settings: Any, ids: torch.Tensor, fraction: float) -> torch.Tensor:
    """``[C]``: whether each client of ``ids`` is one of the run's malicious clients, :func:`attackers` of
    ``settings.seed``, ``settings.num_clients`` and ``fraction`` (the public way for a plugin attack to learn who
    they are: a ``ClientContext`` and a ``RoundContext`` both carry ``settings``)."""
    bad = torch.tensor(_attackers(settings.seed, settings.num_clients, fraction), dtype=torch.long)
    return torch.isin(ids.cpu(), bad).to(ids.device)


class AttackParams(PartParams):
    fraction: float = Field(0.2, ge=0, le=1, description="the fraction of the federation's clients that is malicious")


class Attack(UploadStage):
    """Base of the attacks: which rows of a chunk are malicious clients'; the server logs how many took part."""

    kind = "attack"
    Params = AttackParams
    forges: ClassVar[bool] = False  # its rows are forged on the server side (ColludingAttack), skipping the clients'
    # compression and DP clip: fedflat.config refuses it with either

    def malicious(self, settings: Any, ids: torch.Tensor) -> torch.Tensor:
        """``[C]``: whether each client of ``ids`` is malicious (:func:`attackers` of the run's seed and ``N``)."""
        return is_malicious(settings, ids, self.p.fraction)

    def server(self, ctx: RoundContext, release: Release) -> Release:
        ctx.log["attackers"] = float(self.malicious(ctx.settings, ctx.sampled).sum())
        return release


class DataAttack(Attack):
    """Base of the data attacks: :meth:`poison`, which the engine calls on every step's batch (the local loop picks the
    stages that are data attacks, ``isinstance``), changes only the malicious clients' rows."""

    def poison(self, ctx: ClientContext, cohort: Cohort, batch: Batch) -> Batch:
        """The step's ``batch`` as the chunk's clients train on it (rows ``cohort.ids``)."""
        raise NotImplementedError


def rows_where(mask: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """``new`` in the rows ``mask[C]`` marks, ``old`` elsewhere."""
    return torch.where(mask.reshape(-1, *([1] * (old.dim() - 1))), new, old)


class SignFlipParams(AttackParams):
    scale: float = Field(1.0, gt=0, description="the malicious upload is -scale Delta_i")


class SignFlip(Attack):
    r"""The malicious clients upload :math:`-\mathrm{scale}\, \Delta_i` (module docstring)."""

    name = "sign_flip"
    source = "Li et al., AAAI 2019 (RSA's sign-flipping attack)"
    summary = "attack: malicious clients upload their update with its sign flipped, -scale Delta_i"
    Params = SignFlipParams

    def client(self, ctx: ClientContext, cohort: Cohort, release: Release) -> Release:
        delta = release[MODEL]
        return {**release, MODEL: rows_where(self.malicious(ctx.settings, cohort.ids), -self.p.scale * delta, delta)}


class GaussianParams(AttackParams):
    std: float = Field(1.0, gt=0, description="s: the malicious upload is N(0, s^2 I)")


class GaussianUpdate(Attack):
    """The malicious clients upload Gaussian noise in place of their update (module docstring)."""

    name = "gaussian"
    source = "Blanchard et al., NeurIPS 2017 (the Gaussian Byzantine worker)"
    summary = "attack: malicious clients upload N(0, s^2 I) in place of their update"
    Params = GaussianParams

    def client(self, ctx: ClientContext, cohort: Cohort, release: Release) -> Release:
        delta = release[MODEL]
        bad = self.malicious(ctx.settings, cohort.ids)
        seed, device = ctx.settings.seed, delta.device
        noise = torch.stack([torch.randn(delta.shape[1:], dtype=delta.dtype, device=device,
                                         generator=torch_stream(seed, ctx.round, i, "attack", device))
                             if flag else torch.zeros_like(delta[0])
                             for i, flag in zip(cohort.ids.tolist(), bad.tolist())])
        return {**release, MODEL: rows_where(bad, noise * self.p.std, delta)}


class LabelFlipParams(AttackParams):
    num_classes: int | None = Field(None, ge=2, description="C, the dataset's classes (fedflat sets it from the data)")


class LabelFlip(DataAttack):
    """The malicious clients train on labels ``C - 1 - y`` (module docstring)."""

    name = "label_flip"
    source = "Karimireddy, He and Jaggi, ICML 2021 (its LF attack)"
    summary = "attack: malicious clients train on flipped labels y -> C - 1 - y"
    Params = LabelFlipParams

    def poison(self, ctx: ClientContext, cohort: Cohort, batch: Batch) -> Batch:
        bad = self.malicious(ctx.settings, cohort.ids).to(batch.y.device)
        return replace(batch, y=rows_where(bad, self.p.num_classes - 1 - batch.y, batch.y))


class BackdoorParams(AttackParams):
    target: int = Field(0, ge=0, description="the label the trigger should make the model predict")
    poison_fraction: float = Field(0.5, gt=0, le=1, description="the fraction of each malicious batch's samples "
                                                               "stamped with the trigger and labelled target")
    boost: float = Field(1.0, gt=0, description="the malicious update is boost Delta_i (model replacement: about "
                                                "N / global lr; 1: data poisoning only)")
    trigger_size: int = Field(3, ge=1, description="the side of the trigger's square, in pixels")
    trigger_value: float = Field(3.0, description="the trigger's pixels, in the model's input units (after "
                                                  "standardization: 3 is three standard deviations)")
    num_classes: int | None = Field(None, ge=2, description="C, the dataset's classes (fedflat sets it from the data)")


class Backdoor(DataAttack):
    """Pixel-trigger backdoor with a boosted update: model replacement (module docstring)."""

    name = "backdoor"
    source = "Bagdasaryan et al., AISTATS 2020"
    summary = "attack: a pixel-trigger backdoor on malicious clients' data, their update boosted (model replacement)"
    Params = BackdoorParams

    def trigger(self, x: torch.Tensor) -> torch.Tensor:
        """``x[..., H, W]`` with the trigger stamped: its bottom-right ``trigger_size`` square set to the value."""
        s = self.p.trigger_size
        stamped = x.clone()
        stamped[..., -s:, -s:] = self.p.trigger_value
        return stamped

    def poison(self, ctx: ClientContext, cohort: Cohort, batch: Batch) -> Batch:
        bad = self.malicious(ctx.settings, cohort.ids).to(batch.y.device)
        C, B = batch.y.shape
        real = (torch.full((C,), B, device=batch.y.device) if batch.weight is None
                else (batch.weight > 0).sum(1))
        limit = torch.ceil(self.p.poison_fraction * real.double()).long()
        stamp = bad[:, None] & (torch.arange(B, device=batch.y.device)[None, :] < limit[:, None])
        x = torch.where(stamp.reshape(C, B, *([1] * (batch.x.dim() - 2))), self.trigger(batch.x), batch.x)
        return replace(batch, x=x, y=torch.where(stamp, torch.full_like(batch.y, self.p.target), batch.y))

    def client(self, ctx: ClientContext, cohort: Cohort, release: Release) -> Release:
        if self.p.boost == 1.0:
            return release
        delta = release[MODEL]
        return {**release, MODEL: rows_where(self.malicious(ctx.settings, cohort.ids), self.p.boost * delta, delta)}


class ColludingAttack(Attack):
    """Base of the colluding attacks: in the server hook, the malicious rows of the round's release replaced by
    :meth:`forge` of the benign rows' updates (module docstring)."""

    forges = True

    def forge(self, benign: torch.Tensor, n: int, f: int) -> torch.Tensor:
        """The one update every malicious client uploads, from the benign updates ``benign[n - f, P]``."""
        raise NotImplementedError

    def server(self, ctx: RoundContext, release: Release) -> Release:
        release = super().server(ctx, release)
        bad = self.malicious(ctx.settings, ctx.sampled)
        delta = release[MODEL]
        n, f = delta.shape[0], int(bad.sum())
        if f == 0 or f == n:  # nobody to attack with, or no benign update to learn from: the round as it is
            return release
        forged = self.forge(delta[~bad.to(delta.device)], n, f)
        return {**release, MODEL: rows_where(bad.to(delta.device), forged.expand_as(delta), delta)}


class AlieParams(AttackParams):
    z: float | None = Field(None, description="z: the malicious upload is mu - z sigma (None: the paper's z_max of "
                                              "the round's n clients and f attackers; Phi^-1((n-1)/n) when the "
                                              "attackers are a majority)")


def alie_z(n: int, f: int) -> float:
    r"""Baruch et al.'s :math:`z_{max} = \Phi^{-1}\big((n - s) / n\big)`, :math:`s = \lfloor n / 2 + 1 \rfloor - f` the benign clients the
    attackers need on their side, clamped to at least 1: with the attackers a majority (:math:`f > n / 2`) the
    formula's :math:`s` is 0 or below (:math:`z` infinite or undefined), and
    :math:`z = \Phi^{-1}\big((n - 1) / n\big)`."""
    s = max(math.floor(n / 2 + 1) - f, 1)
    return float(torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor((n - s) / n, dtype=torch.float64)))


class Alie(ColludingAttack):
    """"A Little Is Enough" (module docstring): every malicious client uploads ``mu - z_max sigma``."""

    name = "alie"
    summary = "attack: colluding clients upload mu - z sigma of the benign updates (A Little Is Enough)"
    source = "Baruch, Baruch and Goldberg, NeurIPS 2019"
    Params = AlieParams

    def forge(self, benign: torch.Tensor, n: int, f: int) -> torch.Tensor:
        z = self.p.z if self.p.z is not None else alie_z(n, f)
        sigma = benign.std(0, correction=1) if benign.shape[0] > 1 else torch.zeros_like(benign[0])
        return benign.mean(0) - z * sigma


class IpmParams(AttackParams):
    epsilon: float = Field(0.1, gt=0, description="the malicious upload is -epsilon mu, mu the benign updates' mean")


class Ipm(ColludingAttack):
    """Inner-product manipulation (module docstring): every malicious client uploads ``-epsilon mu``."""

    name = "ipm"
    summary = "attack: colluding clients upload -epsilon times the benign updates' mean (inner-product manipulation)"
    source = "Xie, Koyejo and Gupta, UAI 2020"
    Params = IpmParams

    def forge(self, benign: torch.Tensor, n: int, f: int) -> torch.Tensor:
        return -self.p.epsilon * benign.mean(0)


def for_dataset(specs: list[dict[str, Any]], num_classes: int, input_shape: tuple[int, ...]) -> list[dict[str, Any]]:
    """The upload ``specs`` with the dataset's number of classes given to the attacks that need it, checked: a
    backdoor's target is a class, and its trigger fits inputs that are images."""
    out = []
    for spec in specs:
        cls = STAGES.get(spec.get("name"))
        if cls is None or not issubclass(cls, Attack) or "num_classes" not in cls.Params.model_fields:
            out.append(spec)
            continue
        spec = {**spec, "num_classes": num_classes}
        if cls is Backdoor:
            p = cls.Params(**spec_params(spec))
            if p.target >= num_classes:
                raise ConfigError(f"attack.target={p.target}: the data has classes 0..{num_classes - 1}")
            if len(input_shape) < 2 or min(input_shape[-2:]) < p.trigger_size:
                raise ConfigError(f"attack=backdoor stamps a {p.trigger_size}x{p.trigger_size} pixel trigger, but the "
                                  f"model's inputs have shape {tuple(input_shape)}: use image data (or a smaller "
                                  "attack.trigger_size)")
        out.append(spec)
    return out


def spec_params(spec: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in spec.items() if k != "name"}


def backdoor_of(stages: list[UploadStage]) -> Backdoor | None:
    """The run's backdoor attack among its upload ``stages`` (what ``backdoor_acc`` is measured for), or None."""
    return next((s for s in stages if isinstance(s, Backdoor)), None)
