"""executor=threads: a round's clients on threads of this process, with exactly the local executor's numbers.

Each thread has its own runtime (model, parts, oracle) over the driver's data; clients are pure functions of what
they are given and results are reduced in ascending client-id order, so every recipe, engine and model (buffers,
dropout) must agree with ``executor=local`` bit for bit, whatever the number of threads. On CUDA that holds for the
sequential engine, which these tests pin there (agreement.bitwise); the vectorized engine's rows may depend on the
chunk's size in the last bits (a batched product's rounding is the BLAS's: cuBLAS's does, MKL's may on another CPU),
so its threads agree with its local run to float32 rounding on every device
(test_threads_on_the_vectorized_engine_give_its_local_numbers).
"""
from __future__ import annotations

import pytest
import torch
from agreement import assert_close_runs, assert_identical, bitwise, float32_bound, trajectory
from conftest import BN_DROPOUT_CNN, model_for, tiny_config, tiny_tree
from test_buffers import StochasticDepth

import fedflat
from fedflat.algorithms import RECIPES
from fedflat.core import ConfigError
from fedflat.engine.runtime import ThreadExecutor
from fedflat.engine.simulation import Simulation, UserInputs

UNEQUAL = ("rounds=2", "train.batch_size=7", "train.local_epochs=2", "threads=1", "sampling.clients_per_round=4")


def _agree(*overrides: str, workers: tuple[int, ...] = (2, 3), **user) -> None:
    overrides = bitwise(*overrides)
    local = Simulation(tiny_config(*overrides), UserInputs(**user))
    expected = trajectory(local, 2)
    for n in workers:
        sim = Simulation(tiny_config(*overrides, "executor=threads", f"executor.workers={n}"), UserInputs(**user))
        assert isinstance(sim.executor, ThreadExecutor) and len(sim.executor.runtimes) == n
        # rows rounded by the chunk's size: agreement.py
        if sim.report.engine == "vectorized":
            assert_close_runs(expected, trajectory(sim, 2), local, sim, float32_bound(local, 2))
            continue
        assert trajectory(sim, 2) == expected, f"{n} threads"
        assert_identical(local, sim)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_threads_give_exactly_the_local_numbers_for_every_recipe(name):
    _agree(f"algo={name}", *UNEQUAL, *model_for(name))


@pytest.mark.parametrize("name", ["fedavg", "fedsam", "fedbn"])
def test_threads_train_a_batch_norm_dropout_cnn_exactly_as_locally(name):
    """Each thread's model is built again and trains each client from the broadcast buffers with the client's own
    dropout stream (no global generator): the local numbers, bit for bit."""
    _agree(f"algo={name}", *UNEQUAL, *BN_DROPOUT_CNN, workers=(2,))


def test_threads_on_the_vectorized_engine_give_its_local_numbers():
    """A thread's chunk holds other clients than the local run's (padded or not): its products are batched over
    another count of clients, which the BLAS may round a row by (cuBLAS does; MKL's batched gemm is the CPU's
    business), so the runs agree to float32 rounding over the run's steps (agreement.float32_bound)."""
    _agree("algo=fedsam", *UNEQUAL, "engine=vectorized", workers=(2,))


def test_a_users_model_fn_is_built_once_per_thread_without_moving_the_drivers_streams():
    calls = []

    def model_fn():
        calls.append(1)
        return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    local = fedflat.run(tiny_tree(), overrides=list(bitwise(*UNEQUAL)), model_fn=model_fn, save=False, progress=False)
    calls.clear()
    threaded = fedflat.run(tiny_tree(), overrides=[*bitwise(*UNEQUAL), "executor=threads", "executor.workers=3"],
                           model_fn=model_fn, save=False, progress=False)
    assert len(calls) == 3  # the driver's model and two more threads'
    assert torch.equal(local.final_parameters, threaded.final_parameters)


def test_a_model_drawing_from_the_global_generator_is_refused_with_what_to_use():
    with pytest.raises(ConfigError, match=r"executor=threads: model StochasticDepth draws random numbers \(bernoulli\) "
                                          r"from PyTorch's global generator.*use executor=local or executor=ray"):
        Simulation(tiny_config("executor=threads"), UserInputs(model_fn=StochasticDepth))


def test_an_error_in_a_thread_reaches_the_driver_and_the_run_keeps_its_state():
    """A client that fails on its thread raises in the driver (its own exception, not a hang), and nothing of the
    round is committed: the global model is the one before the round."""
    sim = Simulation(tiny_config(*UNEQUAL, "executor=threads"))
    sim.run_round(0)
    before = sim.server.w.clone()
    runtime = sim.executor.runtimes[1]

    def broken(*args, **kwargs):
        raise FloatingPointError("client exploded")

    runtime.fit_into = broken  # (what a thread runs: its clients' rows go into the round's result)
    with pytest.raises(FloatingPointError, match="client exploded"):
        sim.run_round(1)
    assert torch.equal(sim.server.w, before)


def test_a_round_after_an_interrupted_one_waits_for_its_abandoned_clients():
    """An interrupt leaves the round's threads running (they are not killable); the next round must not start a
    runtime they still use."""
    import threading
    import time

    sim = Simulation(tiny_config(*UNEQUAL, "executor=threads"))
    finished = threading.Event()

    def abandoned_client():
        time.sleep(0.3)
        finished.set()

    leftover = threading.Thread(target=abandoned_client, daemon=True)
    leftover.start()
    sim.executor.threads = [leftover]  # as an interrupted round leaves them
    started_while = []
    runtime = sim.executor.runtimes[0]
    plain = runtime.fit_into
    runtime.fit_into = lambda *args: started_while.append(finished.is_set()) or plain(*args)
    sim.run_round(0)
    assert started_while == [True]


def test_threads_auto_gives_each_thread_its_share_of_the_cores(monkeypatch):
    """``threads: auto`` on a large step: each of the two thread workers gets half of the (four) cores, as Ray
    workers get theirs, not all four each."""
    from fedflat.engine import cores

    monkeypatch.setattr(cores, "available_cores", lambda: 4)
    monkeypatch.setattr(cores, "SMALL_STEP_FLOPS", 0.0)  # the tiny MLP's step counts as large
    with cores.torch_threads(None):  # the run sets the process's threads: restore them after
        sim = Simulation(tiny_config("executor=threads", "executor.workers=2", "threads=auto"))
        assert sim.report.threads == 2 and torch.get_num_threads() == 2
        assert sim.thread_counts() == {"server": 2, "clients": 2}
        assert Simulation(tiny_config("threads=auto")).report.threads == 4  # the local executor: every core


def test_thread_workers_hold_no_second_copy_of_a_frozen_base(tmp_path, monkeypatch):
    """A thread's module is built on the meta device and given the driver's tensors: its frozen parameters and
    non-persistent buffers are the driver's own objects (a RoBERTa's position ids, the base under LoRA), its trained
    parameters start from the driver's initial values in storage of their own; the run is the local one bit for
    bit. No thread builds a tensor of its own (every build of the worker's module runs on the meta device)."""
    import json

    from fedflat.bench.workloads import ROBERTA

    folder = tmp_path / "roberta"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**ROBERTA, "hidden_size": 16, "num_hidden_layers": 1,
                                                    "num_attention_heads": 2, "intermediate_size": 32,
                                                    "vocab_size": 50, "max_position_embeddings": 12}))
    overrides = bitwise(*UNEQUAL, "model=hf", f"model.path={folder}", "model.random_weights=true",
                        "data.options.shape=[8]", "data.options.tokens=50", "adapter.r=2")
    local = Simulation(tiny_config(*overrides))
    devices = recording_builds(monkeypatch)
    sim = Simulation(tiny_config(*overrides, "executor=threads", "executor.workers=3"))
    assert devices == ["meta"] * 2  # the two threads besides the driver, each built on the meta device
    driver, *workers = (r.model for r in sim.executor.runtimes)
    frozen = dict(driver.module.named_parameters())
    constants = {n: b for n, b in driver.module.named_buffers() if "position_ids" in n or "token_type_ids" in n}
    assert frozen and constants and all(not p.requires_grad for p in frozen.values())
    for worker in workers:
        assert {n: id(p) for n, p in worker.module.named_parameters()} == {n: id(p) for n, p in frozen.items()}
        theirs = dict(worker.module.named_buffers())
        assert all(theirs[n] is b for n, b in constants.items())
        assert torch.equal(worker.initial, driver.initial) and worker.initial.data_ptr() != driver.initial.data_ptr()
    assert trajectory(sim, 2) == trajectory(local, 2)


def recording_builds(monkeypatch) -> list[str]:
    """The default device of every worker's build of its module from now on (``meta`` inside the meta device)."""
    from fedflat.engine import runtime

    devices, build = [], runtime.worker_module

    def recorded(spec, read_weights):
        devices.append(torch.empty(0).device.type)
        return build(spec, read_weights)

    monkeypatch.setattr(runtime, "worker_module", recorded)
    return devices


def test_a_model_fn_the_meta_device_cannot_build_shares_the_base_after_a_whole_build(monkeypatch):
    """A model_fn that computes with its tensors while it builds (here: reads a weight's value) cannot run on the
    meta device: its thread worker builds it whole and is then given the driver's frozen tensors the same way."""
    def model_fn():
        body = torch.nn.Linear(16, 8).requires_grad_(False)
        assert body.weight.abs().max().item() > 0  # (a meta tensor has no value: this raises there)
        return torch.nn.Sequential(torch.nn.Flatten(), body, torch.nn.Tanh(), torch.nn.Linear(8, 3))

    devices = recording_builds(monkeypatch)
    sim = Simulation(tiny_config(*bitwise(*UNEQUAL), "executor=threads", "executor.workers=2"),
                     UserInputs(model_fn=model_fn))
    assert devices == ["meta", "cpu"]  # the meta build refused, then the whole one
    driver, worker = (r.model.module for r in sim.executor.runtimes)
    assert dict(driver.named_parameters()).keys() == {"1.weight", "1.bias"}
    theirs = dict(worker.named_parameters())
    assert all(theirs[n] is p for n, p in driver.named_parameters())
