"""Random streams keyed by (seed, round, client, purpose).

Every random draw of a run comes from its own generator, derived from the experiment seed and the
coordinates of the draw, never from a global generator whose position depends on what ran before.
Results therefore do not depend on the engine, the chunk size or the order in which clients train,
and a resumed run draws exactly what an uninterrupted one would.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

SERVER = -1  # the client coordinate of server-side draws (client sampling, model init)


def _purpose_id(purpose: str) -> int:
    return zlib.crc32(purpose.encode())


def stream_seed(seed: int, round: int, client: int, purpose: str) -> int:
    """A 63-bit seed that depends on all four coordinates (NumPy's SeedSequence hashing)."""
    entropy = [seed, round + 1, client + 2, _purpose_id(purpose)]
    return int(np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0] >> np.uint64(1))


def torch_stream(seed: int, round: int, client: int, purpose: str, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` for one (seed, round, client, purpose) stream."""
    generator = torch.Generator(device=device)
    generator.manual_seed(stream_seed(seed, round, client, purpose))
    return generator


def numpy_stream(seed: int, round: int, client: int, purpose: str) -> np.random.Generator:
    """A NumPy ``Generator`` for one (seed, round, client, purpose) stream."""
    return np.random.default_rng(stream_seed(seed, round, client, purpose))
