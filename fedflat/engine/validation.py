"""The server's checks of what it receives, before the upload path's stages (docs/security.md).

Every answering client's upload is checked on every executor (in process, threads, Ray, Flower nodes): an entry
with a NaN or an infinity, or (``validation.max_norm``) a release ``x_i = (Delta_i, extra_i)`` whose L2 norm is
beyond the bound, is invalid. With ``validation.invalid: reject`` (the default) the client's upload and new state
are dropped and the round aggregates the others, as if it had not been sampled; a warning names the client and
the reason, and the run's summary keeps them (``rejected_clients``). With ``invalid: fail`` the run stops.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fedflat.algorithms import Algorithm
from fedflat.config import ValidationConfig
from fedflat.core import ClientResult, ConfigError, Diverged, Release, RoundContext, non_finite_rows, release_norms

logger = logging.getLogger(__name__)


class UploadRejected(ConfigError):
    """An invalid upload under ``validation.invalid: fail``, or a round whose every upload was invalid."""


def upload_problems(algorithm: Algorithm, ctx: RoundContext, result: ClientResult,
                    check: ValidationConfig) -> tuple[dict[int, str], Decoded | None]:
    """``{client: reason}`` for every invalid upload of ``result`` (module docstring), and the release of the
    decodable rows where ``validation.max_norm`` needed it decoded (else None)."""
    problems: dict[int, str] = {}
    decoded = None
    ids = result.ids.tolist()
    malformed = algorithm.malformed(result.upload, ctx.w.numel()).cpu()
    for row in malformed.nonzero().flatten().tolist():
        problems[ids[row]] = f"its upload cannot be decoded by {algorithm.encoder!r} (indices or levels out of range)"
    for name in sorted(result.upload):
        for row in non_finite_rows(result.upload[name]).nonzero().flatten().tolist():
            problems.setdefault(ids[row], f"NaN or Inf in its '{name}'")
    if check.max_norm is not None:
        decodable = (~malformed).nonzero().flatten()
        upload = {k: v[decodable.to(v.device)] for k, v in result.upload.items()}
        decoded = Decoded(decodable.tolist(), algorithm.received_release(ctx, upload))
        norms = release_norms(decoded.release).tolist()
        for client, norm in zip(result.ids[decodable].tolist(), norms):
            if norm > check.max_norm and client not in problems:
                problems[client] = f"its update's norm {norm:.4g} exceeds validation.max_norm={check.max_norm:g}"
    return problems, decoded


def checked(algorithm: Algorithm, ctx: RoundContext, result: ClientResult,
            check: ValidationConfig) -> tuple[RoundContext, ClientResult, dict[int, str], Release | None]:
    """The round's context and result without the invalid uploads, ``{client: reason}`` of those rejected
    (``invalid: fail`` raises :class:`UploadRejected` instead), and the kept rows' release where the checks decoded
    it (``validation.max_norm``: :meth:`Algorithm.aggregate` then does not decode the payload again), else None."""
    problems, decoded = upload_problems(algorithm, ctx, result, check)
    if not problems:
        return ctx, result, {}, decoded.release if decoded is not None else None  # every row decodable: all of them
    said = "; ".join(f"client {c}: {why}" for c, why in sorted(problems.items()))
    where = f"round {ctx.round + 1}"
    if check.invalid == "fail":
        raise UploadRejected(f"{where}: {said} (validation.invalid=fail stops the run; invalid=reject would "
                             "aggregate the round without it)")
    if len(problems) == len(result.ids) and all(why.startswith("NaN") for why in problems.values()):
        raise Diverged(f"{where}: non-finite local loss or model from every client (try a smaller train.lr or algo "
                       "radius)")
    if len(problems) == len(result.ids):
        raise UploadRejected(f"{where}: every upload was rejected ({said}); if the clients are honest, lower train.lr "
                             "(or the method's radius) or raise validation.max_norm")
    for client, why in sorted(problems.items()):
        logger.warning("%s: the upload of client %d is rejected: %s", where, client, why)
    kept = [row for row, c in enumerate(result.ids.tolist()) if c not in problems]
    result = result.rows(torch.tensor(kept, dtype=torch.long))
    release = decoded.rows(kept) if decoded is not None else None
    return ctx.answered(result.ids.to(ctx.sampled.device)), result, problems, release


@dataclass
class Decoded:
    """The release the checks decoded, of the result's rows :attr:`rows_of` (those the encoder could decode), in
    order."""

    rows_of: list[int]
    release: Release

    def rows(self, rows: list[int]) -> Release:
        """The release of the result's ``rows`` (each one of :attr:`rows_of`)."""
        where = {row: i for i, row in enumerate(self.rows_of)}
        index = torch.tensor([where[row] for row in rows], dtype=torch.long)
        return {name: v[index.to(v.device)] for name, v in self.release.items()}
