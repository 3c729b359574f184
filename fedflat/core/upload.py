"""The upload path: what a client does to its update before it leaves, and what the server does with the round's
updates before the method's server side reads them (pfl-research's postprocessor chain; Flower's mods on a
deployment).

A client's **release** is what its upload says about its data: its update ``Delta_i = w_{i,E} - w^t`` under the
name ``model``, and every other entry its parts upload (SCAFFOLD's ``Delta c_i``, FedSMOO's dual, ...), rows
``[C, ...]``. Two entries are not part of it: the training loss (a diagnostic the simulation reports) and a model's
buffers (a method with buffers is refused where that matters, e.g. under differential privacy).

An :class:`UploadStage` is a part of role ``upload``: it declares its server state, the entries it ``sends`` and
the vectors each client ``keeps`` (error feedback's residual) exactly as the method's parts do, so fedflat creates,
ships, stores and checkpoints them. Its hooks, in the order the config lists the stages (checked by
:func:`fedflat.algorithms.compose.order_problem`: an order that makes no sense is refused with its reason):

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
        """The release as this stage leaves it (rows of the chunk's clients ``cohort.ids``)."""
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


def release_of(upload: dict[str, torch.Tensor], w: torch.Tensor) -> Release:
    """The release of an ``upload`` whose model rows started from ``w``: ``Delta_i`` for the model, the other
    released entries as they are (:data:`NOT_RELEASED` left out)."""
    return {name: (rows - w if name == MODEL else rows) for name, rows in upload.items() if name not in NOT_RELEASED}


def upload_of(release: Release, w: torch.Tensor, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The upload the method's server side reads: the ``release`` with the model back at ``w + Delta_i``, plus the
    entries the path leaves as they are (``kept``: the training loss, the buffers)."""
    return {**kept, **{name: (moved(w, rows) if name == MODEL else rows) for name, rows in release.items()}}


def one_row(rows: torch.Tensor) -> bool:
    """Whether ``rows[K, ...]`` is one row seen ``K`` times (a broadcast view, stride 0: central DP's noised mean, a
    robust rule's aggregate: :func:`repeated`)."""
    return rows.shape[0] > 1 and rows.stride(0) == 0


def repeated(value: torch.Tensor, rows: int) -> torch.Tensor:
    """``value[...]`` as ``rows`` rows, one tensor seen ``rows`` times (a view: the value is computed once)."""
    return value.expand(rows, *value.shape)


def moved(w: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``w + rows``, computed once for a release that is one row seen ``K`` times (:func:`one_row`): the same numbers,
    without ``K`` copies of one sum."""
    return repeated(w + rows[0], rows.shape[0]) if one_row(rows) else w + rows


def release_norms(release: Release) -> torch.Tensor:
    """``||(Delta_i, extra_i)||``: each client's release as one vector, its L2 norm ``[C]`` (what a clip bounds)."""
    squares = [rows.reshape(rows.shape[0], -1).double().square().sum(1) for rows in release.values()]
    return torch.stack(squares).sum(0).sqrt()


def scale_release(release: Release, scale: torch.Tensor) -> Release:
    """Every row ``i`` of every entry times ``scale[i]``."""
    return {name: rows * scale.to(rows.dtype).reshape(-1, *([1] * (rows.dim() - 1))) for name, rows in release.items()}
