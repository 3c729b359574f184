"""What executors must agree on, exactly: every number a round produces and everything a run keeps."""
from __future__ import annotations

import torch

from fedflat.engine.simulation import Simulation


def trajectory(sim: Simulation, rounds: int) -> list:
    """Everything a round produces that must not depend on where clients ran."""
    out = []
    for t in range(rounds):
        r = sim.run_round(t)
        out.append((r.train_loss, r.drift, r.backprops_per_step, r.store, r.up_bytes, r.down_bytes, r.log,
                    sim.evaluate()))
    return out


def assert_identical(local: Simulation, other: Simulation) -> None:
    """The global model, its buffers, the server state and every client's stored state, bit for bit."""
    assert torch.equal(local.w, other.w) and torch.equal(local.buffers, other.buffers)
    assert local.server.keys() == other.server.keys()
    for key in local.server:
        assert torch.equal(local.server[key], other.server[key]), key
    for name in local.store.names():
        ids = torch.arange(local.cfg.data.num_clients)
        assert torch.equal(local.store.get(name, ids)[0], other.store.get(name, ids)[0]), name
