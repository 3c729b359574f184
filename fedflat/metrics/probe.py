"""The method's own perturbation at the global model, for any recipe, without touching the run's state.

Flatness incompatibility, perturbation drift and the perturbation spectra need each client's search
direction as the method computes it (local gradient for FedSAM, the mixed direction for FedVSSAM, the
estimated global direction for FedLESAM, a filtered one for FedFFT, ...). Rather than re-implementing each
method, :func:`method_perturbations` calls the run's own perturbation and filter parts at step ``k = 0``
from the global model, in a sandboxed :class:`RoundContext`: the server state is a copy and client state
is read through a copy-on-write overlay, so the run (and a training run recording diagnostics) is unchanged.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from fedflat.algorithms import Cohort, RoundContext, normalize_rows
from fedflat.engine.batches import local_steps
from fedflat.engine.oracle import Batch
from fedflat.metrics.objective import DataObjective


class OverlayStore:
    """A copy-on-write view of a :class:`ClientStore`: reads see the store, writes stay in the overlay."""

    def __init__(self, base):
        self.base = base
        self.size, self.device, self.dtype = base.size, base.device, base.dtype
        self._written: dict[str, dict[int, torch.Tensor]] = {}

    def get(self, name: str, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, present = self.base.get(name, ids)  # fresh tensors: in-place edits never reach the store
        for row, key in enumerate(ids.tolist()):
            if key in self._written.get(name, {}):
                values[row] = self._written[name][key]
                present[row] = True
        return values, present

    def put(self, name: str, ids: torch.Tensor, values: torch.Tensor) -> None:
        slot = self._written.setdefault(name, {})
        for row, key in enumerate(ids.tolist()):
            slot[key] = values[row].detach().clone()

    def names(self) -> list[str]:
        return sorted(set(self.base.names()) | set(self._written))

    def count(self, name: str | None = None) -> int:
        names = [name] if name is not None else self.names()
        total = 0
        for n in names:
            keys = list(self._written.get(n, {}))
            fresh = int((~self.base.get(n, torch.tensor(keys, dtype=torch.long))[1]).sum()) if keys else 0
            total += (self.base.count(n) if n in self.base.names() else 0) + fresh
        return total

    def __getattr__(self, attr: str):  # read-only statistics (memory_bytes, spilled, ...) of the real store
        return getattr(self.base, attr)


@contextmanager
def sandbox(sim) -> Iterator[None]:
    """Restores the oracle's backprop counter afterwards, so diagnostics do not count as training compute."""
    backprops = sim.oracle.backprops
    try:
        yield
    finally:
        sim.oracle.backprops = backprops


def probe_context(sim, round: int, clients: torch.Tensor) -> RoundContext:
    """A round-``round`` context for ``clients`` whose server state and client store are private copies."""
    device = sim.device
    clients = clients.to(device)
    n = sim.num_samples[clients]
    t = sim.cfg.train
    steps = torch.tensor([local_steps(int(ni), t.batch_size, t.local_epochs, t.local_steps) for ni in n.tolist()],
                         device=device)
    ctx = RoundContext(round=round, lr=sim.lr_at(round), w=sim.w, sampled=clients, num_samples=n, steps=steps,
                       server={k: v.clone() for k, v in sim.server.items()}, store=OverlayStore(sim.store),
                       oracle=sim.oracle, settings=sim.settings, batches=sim.batches)
    ctx.w_start = sim.algorithm.parts["server"].broadcast(ctx)
    ctx.w_final = torch.empty(len(clients), sim.num_parameters, device=device)
    ctx.train_loss = torch.empty(len(clients), device=device)
    return ctx


@dataclass
class Perturbations:
    """``eps[M, P]`` of the clients ``clients[M]`` at the global model; ``available[M]`` is False where the
    method gives no (or a zero) perturbation there; ``direction`` says what was used."""

    clients: torch.Tensor
    eps: torch.Tensor
    available: torch.Tensor
    direction: str


def method_perturbations(sim, round: int, clients: torch.Tensor, objectives: list[DataObjective],
                         direction: str = "method", rho: float = 0.05) -> Perturbations:
    """Each client's perturbation at ``w^t`` on its objective's samples (one batch of them).

    ``direction="method"``: the run's perturbation part at local step 0 followed by its filter part, one
    client per cohort as the sequential engine runs them. ``direction="sam"``: plain local SAM,
    ``eps_i = rho grad F_i(w) / ||grad F_i(w)||``, whatever the method.
    """
    if direction not in ("method", "sam"):
        raise ValueError(f"direction must be 'method' or 'sam', got {direction!r}")
    M, w = len(clients), sim.w
    eps = torch.zeros(M, w.numel(), device=w.device, dtype=w.dtype)
    if direction == "sam":
        for row, objective in enumerate(objectives):
            eps[row] = normalize_rows(objective.grad(w)[None], rho)[0]
        return Perturbations(clients, eps, eps.norm(dim=1) > 0, f"local SAM, rho={rho}")
    parts = sim.algorithm.parts
    with sandbox(sim):
        ctx = probe_context(sim, round, clients)
        for row, objective in enumerate(objectives):
            rows = slice(row, row + 1)
            cohort = Cohort(ids=ctx.sampled[rows], num_samples=ctx.num_samples[rows], steps=ctx.steps[rows],
                            rows=rows, active=torch.ones(1, dtype=torch.bool, device=w.device))
            for part in sim.algorithm.ordered:
                part.begin(ctx, cohort)
            batch = Batch(objective.x.unsqueeze(0), objective.y.unsqueeze(0))
            e = parts["perturbation"].perturb(ctx, cohort, 0, w[None].clone(), batch)
            if e is not None:
                eps[row] = parts["filter"].apply(ctx, cohort, e)[0]
    names = f"perturbation '{parts['perturbation'].name}'" + (
        f" + filter '{parts['filter'].name}'" if parts["filter"].name != "none" else "")
    return Perturbations(clients, eps, eps.norm(dim=1) > 1e-12, f"{sim.algorithm.name}: {names} at step 0")
