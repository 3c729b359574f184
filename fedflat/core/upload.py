"""The upload path: what a client does to its update before it leaves, and what the server does with the round's
updates before the method's server side reads them (pfl-research's postprocessor chain; Flower's mods on a
deployment).

A client's **release** is what its upload says about its data: its update ``Delta_i = w_{i,E} - w^t`` under the
name ``model``, and every other entry its parts upload (SCAFFOLD's ``Delta c_i``, FedSMOO's dual, ...), rows
``[C, ...]``. Two entries are not part of it: the training loss (a diagnostic the simulation reports) and a model's
buffers (a method with buffers is refused where that matters, e.g. under differential privacy).

An :class:`UploadStage` is a part of role ``upload``: it declares its server state, the entries it ``sends`` and
the vectors each client ``keeps`` (error feedback's residual) exactly as the method's parts do, so fedflat creates,
ships, stores and checkpoints them. A method's :class:`UploadPath` runs its stages' hooks in the order the config
lists them (checked by :func:`fedflat.algorithms.compose.order_problem`: an order that makes no sense is refused
with its reason):

- client side, after the parts' ``end``: :meth:`UploadStage.client` transforms the release (clip, add local noise,
  sparsify, quantize); the one stage that :attr:`~UploadStage.encodes` then turns the release into what travels
  (:meth:`~UploadStage.encode`: top-k values and indices, quantized levels) and the server turns it back
  (:meth:`~UploadStage.decode`) — the communication figures count the encoded bytes;
- server side, before the aggregation: :meth:`UploadStage.server` transforms the round's received release (central
  noise on the sum, a robust rule); parts then read ``ctx.uploads`` as usual, with ``model`` the point
  ``w^t + Delta_i`` again.

A stage sees every client of a chunk at once (rows), draws its randomness from the keyed streams
(:func:`fedflat.core.round.torch_stream`, one per client, or the server's), and keeps rule 1 of the parts: it returns
new tensors, never modifying what it was given.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch

from fedflat.core.part import Part
from fedflat.core.round import BUFFERS, MODEL, TRAIN_LOSS, ClientContext, Cohort, RoundContext

Release = dict[str, torch.Tensor]  # entry name -> rows [C, ...] (client side) or [K, ...] (server side)

# The kinds of stage in the only order across kinds that means something (stages of one kind run in the order given):
# a malicious client's update first, then compression (so that the clip after it bounds what is sent, sparse or
# quantized), the clip and its noise (differential privacy), and last the server's robust rules. The path runs the
# stages in the order the config gives them; fedflat.algorithms.compose.order_problem refuses one that puts a kind
# after a kind it must precede, with the reason (:data:`MUST_PRECEDE`).
STAGE_ORDER = {"attack": 0, "compress": 10, "clip": 20, "robust": 30}
MUST_PRECEDE: dict[tuple[str, str], str] = {
    ("attack", "compress"): "the compressor sends the entries (top-k's indices, QSGD's levels) it chose from the "
                            "update before the attack, so the attack's change would be lost or garbled",
    ("attack", "clip"): "the DP clip bounds what every client sends, a malicious one's too (docs/security.md: an "
                        "attacker that skips the clip is not simulated)",
    ("compress", "clip"): "compression after the clip would change the clipped release (QSGD's rounding can raise "
                          "its norm above C), so the clip would no longer bound what is sent",
    ("attack", "robust"): "a robust rule defends against the attacks before it (a colluding attack forges its rows "
                          "in its server hook, which would run after the rule)",
    ("compress", "robust"): "a robust rule aggregates the release as the server receives it, decoded, after every "
                            "client-side stage",
    ("clip", "robust"): "central DP's noise is calibrated to the clipped releases themselves, and a robust rule is "
                        "post-processing of the released mean only after it",
}
NOT_RELEASED = (TRAIN_LOSS, BUFFERS)


class UploadStage(Part):
    """Base of the stages of the upload path (module docstring). Hooks default to doing nothing."""

    role = "upload"
    kind: ClassVar[str] = "clip"  # what it is, which says where in the path it may run (:data:`MUST_PRECEDE`)
    source: ClassVar[str] = ""  # the paper it follows (`fedflat list` shows it beside the summary)
    encodes: ClassVar[bool] = False  # it changes what travels (:meth:`encode` / :meth:`decode`)
    side: ClassVar[tuple[str, ...]] = ()  # entries it adds to the upload beside the release (adaptive clip's count)
    wire: ClassVar[tuple[str, ...]] = ()  # an encoder's entries that carry the model's update in its place

    def client(self, ctx: ClientContext, cohort: Cohort, release: Release) -> Release:
        """``release`` as this stage leaves it (rows of the chunk's clients ``cohort.ids``; ``ctx``: the round's
        client context)."""
        return release

    def encode(self, ctx: ClientContext, cohort: Cohort, release: Release) -> dict[str, torch.Tensor]:
        """What travels for ``release`` (entries named ``<entry>/<field>``, rows ``[C, ...]``)."""
        return release

    def decode(self, ctx: RoundContext, payload: dict[str, torch.Tensor], size: int) -> Release:
        """The release back from the received ``payload``; ``size`` is a model-sized entry's length ``P``."""
        return payload

    def malformed(self, payload: dict[str, torch.Tensor], size: int) -> torch.Tensor:
        """``[K]``: the rows of a received ``payload`` that :meth:`decode` cannot take (a wrong dtype or shape, an
        index out of range), so that the server leaves those clients out instead of failing (none by default)."""
        rows = next(iter(payload.values())).shape[0] if payload else 0
        return torch.zeros(rows, dtype=torch.bool)

    def server(self, ctx: RoundContext, release: Release) -> Release:
        """The round's received release as the method's server side reads it (rows of ``ctx.sampled``)."""
        return release

    def min_clients(self) -> int:
        """The fewest clients per round the stage is defined for (a robust rule's, e.g. Krum's ``2f + 3``):
        fedflat.config refuses a sampling with fewer."""
        return 1


@dataclass(frozen=True)
class UploadPath:
    """A method's upload path: its ``stages`` in the config's order, run on each chunk's release before it leaves
    (:meth:`release`) and on the round's received releases before the method's server side reads them
    (:meth:`receive`); :func:`fedflat.algorithms.compose.build_stages` makes them, in an order that makes sense and
    with at most one that changes what travels. Without stages the path is empty: clients upload their final model
    ``w_{i,E}``."""

    stages: tuple[UploadStage, ...] = ()

    @functools.cached_property
    def encoder(self) -> UploadStage | None:
        """The stage that changes what travels, or None (found once)."""
        return next((s for s in self.stages if s.encodes), None)

    def wire_entries(self) -> tuple[str, ...]:
        """The upload entries that carry the model (its update, when encoded): what a reply must hold."""
        return self.encoder.wire if self.encoder is not None else (MODEL,)

    def malformed(self, upload: dict[str, torch.Tensor], size: int) -> torch.Tensor:
        """``[K]``: the rows of a received ``upload`` the encoder cannot decode (:meth:`UploadStage.malformed`)."""
        encoder = self.encoder
        payload = {k: upload[k] for k in self.wire_entries() if k in upload}
        if encoder is None or len(payload) < len(encoder.wire):
            rows = upload[TRAIN_LOSS].shape[0] if TRAIN_LOSS in upload else 0
            return torch.full((rows,), encoder is not None, dtype=torch.bool)
        return encoder.malformed(payload, size)

    def release(self, ctx: ClientContext, cohort: Cohort) -> None:
        """The client side, after the parts' ``end``: ``cohort.upload`` becomes what travels, the release
        (``Delta_i`` and the parts' entries) through every stage's :meth:`~UploadStage.client`, then the encoder's
        :meth:`~UploadStage.encode`, beside the entries the path leaves as they are and the stages' own."""
        if not self.stages:
            return
        release = release_of(cohort.upload, ctx.w_broadcast)
        cohort.upload = {k: v for k, v in cohort.upload.items() if k in NOT_RELEASED}
        for stage in self.stages:
            release = stage.client(ctx, cohort, release)
        encoder = self.encoder
        cohort.upload.update(encoder.encode(ctx, cohort, release) if encoder is not None else release)

    def received_release(self, ctx: RoundContext, upload: dict[str, torch.Tensor]) -> Release:
        """The release a received ``upload`` carries: with stages, what travelled (``Delta_i`` already) decoded, the
        stages' side entries left out; without, the model rows as ``Delta_i`` from ``w_start``."""
        if not self.stages:
            return release_of(upload, ctx.w_start)
        side = {name for stage in self.stages for name in stage.side}
        payload = {k: v for k, v in upload.items() if k not in NOT_RELEASED and k not in side}
        encoder = self.encoder
        return encoder.decode(ctx, payload, ctx.w.numel()) if encoder is not None else payload

    def receive(self, ctx: RoundContext, upload: dict[str, torch.Tensor],
                release: Release | None = None) -> dict[str, torch.Tensor]:
        """The server side: the received ``upload`` decoded into the release (``release``: already decoded, by the
        server's checks), every stage's :meth:`~UploadStage.server` (with ``ctx.uploads`` the upload as received),
        and the upload the parts read, ``model`` at ``w_start + Delta_i`` again."""
        if not self.stages:
            return upload
        kept = {k: v for k, v in upload.items() if k in NOT_RELEASED}
        release = self.received_release(ctx, upload) if release is None else release
        ctx.uploads = upload
        for stage in self.stages:
            release = stage.server(ctx, release)
        return upload_of(release, ctx.w_start, kept)


def release_of(upload: dict[str, torch.Tensor], w: torch.Tensor) -> Release:
    """The release of an ``upload`` whose model rows started from ``w``: ``Delta_i`` for the model, the other
    released entries as they are (:data:`NOT_RELEASED` left out)."""
    return {name: (rows - w if name == MODEL else rows) for name, rows in upload.items() if name not in NOT_RELEASED}


def upload_of(release: Release, w: torch.Tensor, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The upload the method's server side reads: the ``release`` with the model back at ``w + Delta_i``, plus the
    entries the path leaves as they are (``kept``: the training loss, the buffers)."""
    return {**kept, **{name: (moved(w, rows) if name == MODEL else rows) for name, rows in release.items()}}


def moved(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``w + rows``; for a release that is one row seen ``K`` times (a broadcast view, stride 0: central DP's noised
    mean, a robust rule's aggregate), computed once and seen ``K`` times: the same numbers, without ``K`` copies of
    one sum."""
    if rows.shape[0] > 1 and rows.stride(0) == 0:
        return (w + rows[0]).expand(rows.shape)
    return w + rows


def release_norms(release: Release) -> torch.Tensor:
    """``||(Delta_i, extra_i)||``: each client's release as one vector, its L2 norm ``[C]`` (what a clip bounds)."""
    squares = [rows.reshape(rows.shape[0], -1).double().square().sum(1) for rows in release.values()]
    return torch.stack(squares).sum(0).sqrt()


def scale_release(release: Release, scale: torch.Tensor) -> Release:
    """Every row ``i`` of every entry times ``scale[i]``."""
    return {name: rows * scale.to(rows.dtype).reshape(-1, *([1] * (rows.dim() - 1))) for name, rows in release.items()}
