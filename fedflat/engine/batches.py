"""Local batch schedules, indexed from device tensors (no DataLoader)."""
from __future__ import annotations

from math import ceil

import torch

from fedflat.engine.oracle import Batch


def local_steps(num_samples: int, batch_size: int, local_epochs: int, fixed_steps: int | None) -> int:
    """``E_i = local_epochs * ceil(n_i / B)``, or the fixed ``local_steps``."""
    if fixed_steps is not None:
        return fixed_steps
    return local_epochs * ceil(num_samples / batch_size)


def local_schedule(indices: torch.Tensor, steps: int, batch_size: int, generator: torch.Generator) -> list[torch.Tensor]:
    """The client's batches for ``steps`` local steps: a fresh permutation every epoch, the last
    batch of an epoch possibly smaller (no samples dropped), as the reference simulators do."""
    n = indices.shape[0]
    batches: list[torch.Tensor] = []
    while len(batches) < steps:
        order = torch.randperm(n, generator=generator, device=generator.device).to(indices.device)
        batches.extend(indices[order].split(batch_size))
    return batches[:steps]


def stack_batches(x: torch.Tensor, y: torch.Tensor, picks: list[torch.Tensor], batch_size: int) -> Batch:
    """A cohort's step batch ``[C, B, ...]``; rows shorter than ``B`` are padded and masked by weight."""
    if len(picks) == 1:
        idx = picks[0]
        return Batch(x[idx].unsqueeze(0), y[idx].unsqueeze(0))
    lengths = [p.shape[0] for p in picks]
    if min(lengths) == max(lengths):
        idx = torch.stack(picks)
        return Batch(x[idx], y[idx])
    width = max(lengths)
    idx = torch.stack([torch.cat([p, p[:1].expand(width - p.shape[0])]) for p in picks])
    weight = torch.zeros(idx.shape, device=x.device)
    for row, n in enumerate(lengths):
        weight[row, :n] = 1.0
    return Batch(x[idx], y[idx], weight)
