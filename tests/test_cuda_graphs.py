"""``cuda_graphs: true`` (fedflat/engine/graphs.py): a run replaying its passes from CUDA graphs trains the same
models as the eager run, without host synchronisations in its local steps; off a GPU it is refused.

The GPU tests are skipped where torch sees no CUDA GPU (CI); ``pytest --device cuda`` runs them on one.
"""
from __future__ import annotations

import pytest
import torch

import fedflat
from fedflat.core import ConfigError
from fedflat.engine.simulation import Simulation

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_cuda_graphs_off_a_gpu_are_refused_saying_what_to_change(tiny):
    with pytest.raises(ConfigError, match="cuda_graphs=true records CUDA graphs and needs a CUDA device.*"
                                          "set device=cuda or cuda_graphs=false"):
        Simulation(tiny("device=cpu", "cuda_graphs=true"))


@needs_gpu
@pytest.mark.parametrize("name", ["fedavg", "fedsam", "scaffold", "fedlesam"])
@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_graphed_run_equals_eager_run(tiny, name, engine):
    """The same kernels replayed: the final models agree with the eager run's to float32 rounding (a replay may
    differ from eager only where cuBLAS picks another algorithm under capture), and the passes were replayed.
    The tiny problem's clients have short last batches: several shapes, several graphs (sequential), padded
    batches (vectorized)."""
    common = (f"algo={name}", f"engine={engine}", "device=cuda", "rounds=3", "train.local_epochs=2")
    eager = Simulation(tiny(*common))
    graphed = Simulation(tiny(*common, "cuda_graphs=true"))
    for t in range(3):
        eager.run_round(t)
        graphed.run_round(t)
    oracle = graphed.runtime.oracle
    assert oracle.backend.replays > 0
    torch.testing.assert_close(graphed.server.w, eager.server.w, rtol=1e-5, atol=1e-6)


@needs_gpu
def test_graphed_cnn_in_bf16_and_channels_last_equals_eager(tiny):
    """A CNN on CIFAR-shaped images under autocast (its cast cache off in a capture) and channels-last input."""
    common = ("algo=fedsam", "device=cuda", "model=cnn", "data.options.shape=[3,32,32]", "precision=bf16",
              "channels_last=true", "rounds=2")
    runs = [fedflat.run(tiny(*common, f"cuda_graphs={on}"), save=False, progress=False) for on in ("false", "true")]
    torch.testing.assert_close(runs[1].final_parameters, runs[0].final_parameters, rtol=1e-4, atol=1e-5)


@needs_gpu
def test_graphed_local_steps_never_wait_for_the_gpu(tiny):
    """Three times the local steps, no more host synchronisations (the replays and copies are asynchronous)."""
    from tests.test_cuda import _synchronisations

    counts = []
    for epochs in (1, 3):
        sim = Simulation(tiny("algo=fedsam", "device=cuda", "cuda_graphs=true", f"train.local_epochs={epochs}",
                              "data.partition=iid"))
        sim.run_round(0)  # warm-up: the graphs captured
        counts.append(_synchronisations(sim, 1))
    assert counts[1] <= counts[0] + 1, counts


@needs_gpu
@pytest.mark.parametrize("graphs", ["false", "true"])
@pytest.mark.parametrize("name", ["fedavg", "fedsam"])
def test_streams_engine_on_cuda_lanes_equals_the_sequential_engine(tiny, name, graphs):
    """engine=streams on a GPU: each client's pass on a CUDA stream of its own (a graph each under cuda_graphs), the
    lanes side by side; the clients' passes are the sequential engine's kernels, so the models agree to the float32
    rounding of the cohort's row reductions (norms of C rows at once)."""
    common = (f"algo={name}", "device=cuda", "rounds=3", "train.local_epochs=2", "data.partition=iid",
              f"cuda_graphs={graphs}")
    sequential = Simulation(tiny(*common, "engine=sequential"))
    streams = Simulation(tiny(*common, "engine=streams"))
    for t in range(3):
        sequential.run_round(t)
        streams.run_round(t)
    lanes = streams.runtime.oracle.backend.lanes
    assert len({id(s) for s in lanes.streams}) == len(lanes.streams) == 3  # a stream per client of the cohort
    assert (lanes.replays > 0) == (graphs == "true")
    torch.testing.assert_close(streams.server.w, sequential.server.w, rtol=1e-5, atol=1e-6)
