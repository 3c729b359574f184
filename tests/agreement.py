"""What executors must agree on, exactly: every number a round produces and everything a run keeps."""
from __future__ import annotations

import math
import os

import pytest
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
    assert torch.equal(local.server.w, other.server.w) and torch.equal(local.server.buffers, other.server.buffers)
    assert local.server.state.keys() == other.server.state.keys()
    for key in local.server.state:
        assert torch.equal(local.server.state[key], other.server.state[key]), key
    for name in local.server.store.names():
        ids = torch.arange(local.cfg.data.num_clients)
        assert torch.equal(local.server.store.get(name, ids)[0], other.server.store.get(name, ids)[0]), name


def on_cuda() -> bool:
    """Whether a config that names no device runs on a GPU (``pytest --device cuda``)."""
    from fedflat.config import DEVICE_ENV
    from fedflat.engine.simulation import resolve_device

    return resolve_device(os.environ.get(DEVICE_ENV, "cpu")).type == "cuda"


def bitwise(*overrides: str) -> tuple[str, ...]:
    """``overrides``, with ``engine=sequential`` on CUDA where they name no engine: the engine whose numbers do not
    depend on which clients share a chunk, so that a claim of equal bits across executors holds on every device.

    ``engine: auto`` is the vectorized engine on a GPU for small steps (runtime.resolve_engine), and there a client's
    row is not a function of that row alone: cuBLAS picks its batched-GEMM kernel, and with it the order in which each
    dot product is summed, by the batch count, so a thread's chunk of 2 clients rounds its rows otherwise than the
    local run's chunk of 4 (float32 rounding: :func:`assert_close_runs`). On a CPU ``auto`` is the sequential engine
    already, so nothing changes there (a test that names the vectorized engine compares its chunks within
    :func:`float32_bound`: MKL's batched products are the CPU's business too)."""
    if not on_cuda() or any(o.startswith("engine=") for o in overrides):
        return overrides
    return (*overrides, "engine=sequential")


def float32_bound(sim: Simulation, rounds: int, widest: int = 0) -> float:
    """The relative difference two runs of ``sim``'s config may show when their products sum in other orders (the
    vectorized engine on CUDA in chunks of other sizes): one float32 dot product of K terms summed in another order
    differs by at most K * 2^-24 of the sum of its terms' magnitudes, and each gradient of the run's S local steps
    (of every round, SAM's two included) carries one such error into the weights: S * K * 2^-24, with K the widest
    sum of the model (the largest fan-in of its layers, and the batch size a weight's gradient sums over) or a part's
    ``widest`` sum when longer (FedSCAM's projection sums over every parameter)."""
    steps = 0
    for _ in range(rounds):
        steps += sim.cfg.train.local_epochs * math.ceil(int(sim.num_samples.max()) / sim.cfg.train.batch_size)
    widths = [v[0].numel() for v in sim.model.layout.views(sim.model.initial) if v.dim() > 1]  # fan-ins
    K = max([*widths, sim.cfg.train.batch_size, widest])
    return 2 * steps * K * 2.0 ** -24  # 2: up to two gradients a step (SAM)


def assert_close_runs(expected: list, other: list, local: Simulation, sim: Simulation, rel: float) -> None:
    """:func:`trajectory` and :func:`assert_identical`, every float within ``rel`` relative (a test accuracy within
    one test sample, whose prediction such a difference may flip), every count and key equal."""
    def close(a, b, where):
        if isinstance(a, dict):
            assert a.keys() == b.keys(), where
            for k in a:
                close(a[k], b[k], f"{where}.{k}")
        elif isinstance(a, (tuple, list)):
            assert len(a) == len(b), where
            for k, (x, y) in enumerate(zip(a, b)):
                close(x, y, f"{where}[{k}]")
        elif isinstance(a, float):
            assert b == pytest.approx(a, rel=rel, abs=rel), where
        else:
            assert a == b, where

    assert len(expected) == len(other)
    for t, (mine, theirs) in enumerate(zip(expected, other)):
        *numbers, (accuracy, loss) = mine
        *their_numbers, (their_accuracy, their_loss) = theirs
        close(numbers, their_numbers, f"round {t}")
        close(loss, their_loss, f"round {t} test loss")
        assert abs(accuracy - their_accuracy) <= 1.0 / local.dataset.y_test.numel() + 1e-12, f"round {t} accuracy"
    scale = local.server.w.abs().max().item()
    torch.testing.assert_close(sim.server.w, local.server.w, rtol=0, atol=rel * scale)
    torch.testing.assert_close(sim.server.buffers, local.server.buffers, rtol=rel, atol=rel * scale)
    assert local.server.state.keys() == sim.server.state.keys()
