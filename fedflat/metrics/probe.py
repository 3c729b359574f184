"""The method's own perturbation at the global model, for any recipe, without touching the run's state.

Flatness incompatibility, perturbation drift and the perturbation spectra need each client's search
direction as the method computes it (local gradient for FedSAM, the mixed direction for FedVSSAM, the
estimated global direction for FedLESAM, a filtered one for FedFFT, ...). Rather than re-implementing each
method, :func:`method_perturbations` calls the run's own perturbation and filter parts at step ``k = 0``
from the global model, on the client side of the contract: from the broadcast the server would send and
the clients' own state rows, neither of which a client can change, so the run is left untouched.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import torch

from fedflat.core import Batch, Broadcast, ClientContext, RoundContext, normalize_rows
from fedflat.engine.client import local_steps
from fedflat.engine.client import own_buffers
from fedflat.engine.runtime import RoundTask, make_cohort
from fedflat.metrics.objective import DataObjective


@contextmanager
def sandbox(sim) -> Iterator[None]:
    """Restores the oracle's backprop counter afterwards, so diagnostics do not count as training compute."""
    backprops = sim.oracle.backprops
    try:
        yield
    finally:
        sim.oracle.backprops = backprops


def probe_round(sim, round: int, clients: torch.Tensor) -> tuple[ClientContext, Broadcast, RoundTask]:
    """The client side of round ``round`` for ``clients``: the broadcast the server would send (computed
    on a copy of the server state), its client context, and the clients' task."""
    device = sim.device
    clients = clients.to(device)
    n = sim.num_samples[clients]
    t = sim.cfg.train
    steps = torch.tensor([local_steps(int(ni), t.batch_size, t.local_epochs, t.local_steps) for ni in n.tolist()],
                         device=device)
    held, held_known = sim.server.load_state(clients, sim.algorithm.held_keys())
    ctx = RoundContext(round=round, lr=sim.server.lr_at(round), w=sim.server.w, sampled=clients, num_samples=n,
                       steps=steps, server={k: v.clone() for k, v in sim.server.state.items()}, settings=sim.settings,
                       held=held, held_known=held_known)
    broadcast = sim.server.configure(ctx)
    return (ClientContext.of(broadcast, sim.settings, sim.oracle, sim.batches), broadcast,
            RoundTask(clients.cpu(), n.cpu(), steps.cpu()))


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
    M, w = len(clients), sim.server.w
    eps = torch.zeros(M, w.numel(), device=w.device, dtype=w.dtype)
    if direction == "sam":
        for row, objective in enumerate(objectives):
            eps[row] = normalize_rows(objective.grad(w)[None], rho)[0]
        return Perturbations(clients, eps, eps.norm(dim=1) > 0, f"local SAM, rho={rho}")
    parts = sim.algorithm.parts
    with sandbox(sim):
        ctx, broadcast, task = probe_round(sim, round, clients)
        for row, objective in enumerate(objectives):
            cohort = make_cohort(task.rows(torch.tensor([row])), broadcast, sim.server.load_state, sim.device)
            start = None if ctx.buffers is None else own_buffers(ctx.buffers, sim.private_buffers, cohort.state,
                                                                  cohort.known, 1)
            with sim.oracle.clients(cohort.ids.tolist(), round, sim.cfg.seed, start) as session:
                sim.algorithm.begin(ctx, cohort)
                if session is not None:
                    session.step(None)
                batch = Batch(objective.x.unsqueeze(0), objective.y.unsqueeze(0))
                e = parts["perturbation"].perturb(ctx, cohort, 0, w[None].clone(), batch)
            if e is not None and parts["filter"].acts_on == "perturbation":
                eps[row] = parts["filter"].apply(ctx, cohort, e)[0]
    names = f"perturbation '{parts['perturbation'].name}'" + (
        f" + filter '{parts['filter'].name}'" if parts["filter"].name != "none" else "")
    return Perturbations(clients, eps, eps.norm(dim=1) > 1e-12, f"{sim.algorithm.name}: {names} at step 0")
