"""What must hold on a GPU: CUDA runs equal CPU runs to float tolerance, the hot loop never waits for the
device, and a CUDA out-of-memory error inside a vectorized chunk costs a retry, never a different number.

Skipped where torch sees no CUDA GPU (CI); run on a GPU with ``pytest --device cuda`` (docs/benchmarks.md),
which also runs every device-independent test there.
"""
from __future__ import annotations

import warnings

import pytest
import torch

import fedflat
from agreement import float32_bound
from fedflat.core import Batch
from fedflat.engine.simulation import Simulation

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SAM_FAMILY = ("fedavg", "fedsam", "scaffold", "fedlesam", "fedwmsam", "fedvssam", "fedscam", "fedfft", "fedsmoo",
              "fedgamma", "fedspeed", "feddyn", "mofedsam")


@pytest.mark.parametrize("name", ["fedavg", "fedsam", "scaffold", "fedlesam", "fedsmoo"])
@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_cuda_run_equals_cpu_run(tiny, name, engine):
    """Same clients, batches and random numbers on both devices: the models agree to float32 rounding."""
    runs = [fedflat.run(tiny(f"algo={name}", f"engine={engine}", f"device={d}", "rounds=3"), save=False,
                        progress=False) for d in ("cpu", "cuda")]
    torch.testing.assert_close(runs[1].final_parameters.cpu(), runs[0].final_parameters.cpu(), rtol=1e-4, atol=1e-5)


def _synchronisations(sim: Simulation, round: int) -> int:
    """Host-device synchronisations of one round's client work (``torch.cuda.set_sync_debug_mode``)."""
    ctx = sim.server.new_context(round)
    broadcast = sim.algorithm.configure(ctx)
    from fedflat.engine.runtime import RoundTask

    task = RoundTask(ctx.sampled.cpu(), ctx.num_samples.cpu(), ctx.steps.cpu())
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            sim.executor.fit(broadcast, task, sim.server.load_state)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
@pytest.mark.parametrize("name", SAM_FAMILY)
def test_no_synchronisation_per_local_step(tiny, name, engine):
    """A round with three times the local steps synchronises with the host no more often: nothing in the
    inner loop waits for the GPU (``.item()``, ``bool(tensor)``, a branch on a device value)."""
    counts = []  # 3 clients of 30 samples, batch 10: 3 steps each with 1 epoch, 9 with 3 (18 steps more)
    for epochs in (1, 3):
        cfg = tiny(f"algo={name}", f"engine={engine}", "device=cuda", f"train.local_epochs={epochs}",
                   "data.partition=iid")
        sim = Simulation(cfg)
        sim.run_round(0)  # warm-up: state known, kernels loaded
        counts.append(_synchronisations(sim, 1))
    # (one synchronisation may move between rounds: the caching allocator's growth; seen on an H100: 24 vs 23)
    assert counts[1] <= counts[0] + 1, f"{name}: {counts[0]} synchronisations with 1 epoch, {counts[1]} with 3"


def test_out_of_memory_in_a_chunk_halves_it_and_changes_nothing(tiny):
    """A real CUDA out-of-memory error (the process's memory capped) inside a chunk of every client: the
    runtime halves the chunk and retries, and the round equals the one-client-at-a-time round."""
    overrides = ("algo=fedsam", "engine=vectorized", "device=cuda", "model=resnet18", "data.num_clients=8",
                 "sampling.clients_per_round=8", "data.options.shape=[3,32,32]", "data.options.train_size=1600",
                 "train.batch_size=50", "rounds=1", "data.partition=iid")
    reference = Simulation(tiny(*overrides, "chunk_size=1"))
    reference.run_round(0)
    torch.cuda.empty_cache()
    sim = Simulation(tiny(*overrides, "chunk_size=8"))
    total = torch.cuda.get_device_properties(0).total_memory
    # Room for the model, data and about two clients' working sets (ResNet-18 at batch 50: ~1 GiB each).
    torch.cuda.set_per_process_memory_fraction(min(1.0, (torch.cuda.memory_reserved() + 3 * 2 ** 30) / total))
    try:
        sim.run_round(0)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert sim.runtime.oom_retries >= 1 and sim.runtime.oom_cap < 8
    # (grouped convolutions of different group counts sum in other orders on a GPU: the float32 bound of
    # tests/agreement.py, relative to the weights' scale for the weights near zero)
    bound = float32_bound(sim, 1)
    w = reference.server.w
    torch.testing.assert_close(sim.server.w, w, rtol=bound, atol=bound * float(w.abs().max()))


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_bf16_channels_last_gradients_are_float32_ones_rounded(tiny, engine):
    """``precision=bf16 channels_last=true`` on the GPU (tensor-core kernels): a CNN's gradient on
    CIFAR-shaped images is the float32 one up to bfloat16's rounding (on CPU the same problem gives 10%
    relative at initialization, where random labels make per-sample gradients cancel), and a FedSAM round
    trains without a host synchronisation more than float32's."""
    overrides = ("algo=fedsam", f"engine={engine}", "device=cuda", "model=cnn", "data.options.shape=[3,32,32]")
    fast, exact = Simulation(tiny(*overrides, "precision=bf16", "channels_last=true")), Simulation(tiny(*overrides))
    x = fast.dataset.features(fast.dataset.x_train[:20]).reshape(2, 10, 3, 32, 32)
    batch = Batch(x, fast.dataset.y_train[:20].reshape(2, 10))
    W = fast.server.w.expand(2, -1)
    _, g_fast = fast.oracle.loss_grad(W, batch)
    _, g_exact = exact.oracle.loss_grad(W, batch)
    gap = (g_fast - g_exact).norm() / g_exact.norm()
    assert 0 < gap < 0.25, gap
    fast.run_round(0)
    exact.run_round(0)
    assert torch.isfinite(fast.server.w).all()
    assert _synchronisations(fast, 1) <= _synchronisations(exact, 1) + 1
