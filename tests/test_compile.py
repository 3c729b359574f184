"""``compile: true`` (fedflat/engine/gradients/compiled.py): a client's data pass compiled by ``torch.compile``
trains the models the eager pass trains, to the rounding of another order of operations; where no pass of one
client can be compiled the run is refused saying what to change.

The GPU tests are skipped where torch sees no CUDA GPU (CI); ``pytest --device cuda`` runs them on one.
"""
from __future__ import annotations

import os

import pytest
import torch

import fedflat
from fedflat.core import ConfigError
from fedflat.engine.gradients import Compiled
from fedflat.engine.runtime import engine_choice
from fedflat.engine.simulation import Simulation
from tests.conftest import BATCH_NORM_CNN

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _final(tiny, *overrides: str) -> torch.Tensor:
    return fedflat.run(tiny(*overrides), save=False, progress=False).final_parameters


@pytest.mark.parametrize("name", ["fedavg", "fedsam"])
def test_compiled_run_equals_eager_run_to_float32_rounding(tiny, name):
    """Three rounds of the tiny problem (its clients' short last batches: a second shape, then a dynamic batch
    dimension). Inductor reorders and fuses the same float32 operations: each differs by a few units of float32
    rounding (~1e-7 relative) and a few dozen SGD steps of lr 0.1 keep that within 1e-5 relative."""
    common = (f"algo={name}", "device=cpu")
    eager = _final(tiny, *common)
    run = fedflat.run(tiny(*common, "compile=true"), save=False, progress=False)
    torch.testing.assert_close(run.final_parameters, eager, rtol=1e-5, atol=1e-6)
    assert run.summary["gradient"] == "compiled"
    initial = Simulation(tiny(*common)).server.w
    assert (eager - initial).abs().max() > 100 * 1e-5 * eager.abs().max()  # trained far beyond the tolerance


def test_compile_wraps_the_sequential_pass_in_place_of_the_hand_gradient(tiny):
    sim = Simulation(tiny("device=cpu", "compile=true", "engine=sequential"))
    assert isinstance(sim.runtime.oracle.backend, Compiled)
    assert sim.runtime.oracle.gradient == "compiled"


@pytest.mark.parametrize("overrides, reason", [
    (("engine=vectorized",), "vectorized engine's vmap is not compiled: set engine: sequential or streams"),
    (BATCH_NORM_CNN, "buffers, dropout or batch statistics.*set compile: false"),
    (("privacy.level=instance", "privacy.noise_multiplier=1.0", "privacy.clip=1.0"),
     "DP-SGD's per-example gradients.*set compile: false"),
])
def test_compile_where_no_client_pass_compiles_is_refused_saying_what_to_change(tiny, overrides, reason):
    with pytest.raises(ConfigError, match=reason):
        Simulation(tiny("device=cpu", "compile=true", *overrides))


def test_auto_engine_with_compile_never_takes_the_vectorized_engine():
    cuda = torch.device("cuda")
    assert engine_choice("auto", cuda, 1e6)[0] == "vectorized"
    engine, why = engine_choice("auto", cuda, 1e6, compiled=True)
    assert engine == "sequential" and "compile=true" in why
    assert engine_choice("auto", cuda, 1e6, cuda_graphs=True, compiled=True)[0] == "streams"


@needs_gpu
@pytest.mark.parametrize("engine", ["sequential", "streams"])
def test_compiled_graphed_cnn_equals_the_eager_sequential_run(tiny, engine):
    """A CNN on CIFAR-shaped images in float32 (TF32 off), compiled and replayed from CUDA graphs, on one stream or
    on the clients' lanes: the eager sequential run's models to float32 rounding of the fused kernels' orders."""
    common = ("algo=fedsam", "device=cuda", "model=cnn", "data.options.shape=[3,32,32]", "rounds=2")
    eager = _final(tiny, *common, "engine=sequential")
    compiled = _final(tiny, *common, f"engine={engine}", "compile=true", "cuda_graphs=true")
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def test_a_compiler_failure_is_one_line_saying_to_set_compile_false(tiny, monkeypatch):
    """No working C++ compiler for Inductor's CPU code (here: one that always fails, and no cached code to fall back
    on): a ConfigError naming the cause and what to set, not torch's traceback."""
    import torch._dynamo
    import torch._inductor.config as inductor

    monkeypatch.setattr(inductor.cpp, "cxx", (None, "/bin/false"))
    monkeypatch.setattr(inductor, "fx_graph_cache", False)
    monkeypatch.setattr(inductor, "autotune_local_cache", False)
    torch._dynamo.reset()
    try:
        refused = r"torch.compile could not compile.*C\+\+ compiler.*set compile: false"
        with pytest.raises(ConfigError, match=refused):
            Simulation(tiny("device=cpu", "compile=true", "rounds=1")).run_round(0)
    finally:
        torch._dynamo.reset()  # (no failed compile left for the next test)


def test_a_forced_dispatch_level_compiles_into_a_cache_of_its_own(monkeypatch):
    """Inductor keys its generated C++ by the graph, not by ATen's dispatch level: under ``ATEN_CPU_CAPABILITY`` a
    compiled run takes a cache folder of that level's own (code generated for AVX-512 did not compile at the default
    level), unless the user named one."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from fedflat.engine.gradients.compiled import level_cache

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    for before in (None, default_cache_dir()):  # unset, or torch's default (importing torch._dynamo sets it)
        if before is None:
            monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
        else:
            monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", before)
        level_cache()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.path.join(default_cache_dir(), "aten-default")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/somewhere/else")
    level_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/somewhere/else"
