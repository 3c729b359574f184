"""executor=ray: a real local Ray (no mock), the same numbers as the local executor, and faults that cost a redo.

One Ray instance (2 CPUs, loopback only) serves the module; a pool of three long-lived workers is reused
across recipes (each executor gives them a new runtime), so every recipe is checked with 1, 2 and 3 workers
in seconds. Runs use one torch thread everywhere, so local and Ray runs compute every client bit for bit
alike and must agree EXACTLY.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ray = pytest.importorskip("ray")

from agreement import assert_identical, trajectory  # noqa: E402
from conftest import BN_DROPOUT_CNN, model_for, tiny_config, tiny_tree  # noqa: E402

import fedflat  # noqa: E402
from fedflat.algorithms import RECIPES  # noqa: E402
from fedflat.config import ExecutorConfig, dump_yaml
from fedflat.core import ConfigError
from fedflat.data.dataset import uint8_dataset  # noqa: E402
from fedflat.engine.checkpoint import read_checkpoint
from fedflat.engine.ray_executor import LOCAL_NODE_IP, RayExecutor, longest_first, worker_class  # noqa: E402
from fedflat.engine.simulation import Simulation, UserInputs  # noqa: E402
from fedflat.experiments.resume import metrics_equal, resume  # noqa: E402
from fedflat.files import read_jsonl  # noqa: E402

UNEQUAL = ("rounds=2", "train.batch_size=7", "train.local_epochs=2", "threads=1", "engine=sequential",
           "sampling.clients_per_round=4")


@pytest.fixture(scope="module")
def ray_session():
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address=LOCAL_NODE_IP, logging_level="ERROR",
             log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def pool(ray_session):
    """Three long-lived workers (a fifth of a CPU each: the other tests' workers still fit the 2-CPU instance)."""
    actors = [worker_class(ray).options(num_cpus=0.2).remote() for _ in range(3)]
    yield actors
    for actor in actors:
        ray.kill(actor)


# an adapter recipe's workers each import peft and transformers first (a minute or more on two shared cores): those
# run with `make test-slow`; the fast suite's adapter runs are tests/test_lora.py's, local and on threads
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if RECIPES[n].adapter else n
                                  for n in sorted(RECIPES)])
def test_ray_workers_give_exactly_the_local_numbers_for_every_recipe(pool, name):
    cfg = tiny_config(f"algo={name}", *UNEQUAL, *model_for(name))
    local = Simulation(cfg)
    expected = trajectory(local, 2)
    for workers in (1, 2, 3):
        sim = Simulation(cfg)
        sim.executor = RayExecutor(sim.worker_spec(), sim.worker_data(), ExecutorConfig(name="ray", workers=workers),
                                   actors=pool[:workers])
        assert trajectory(sim, 2) == expected, f"{workers} workers"
        assert_identical(local, sim)
        sim.close()




@pytest.mark.parametrize("name", ["fedavg", *(pytest.param(a, marks=pytest.mark.slow)  # fedbn: also every recipe's
                                             for a in ("fedbn", "scaffold", "fedsam", "fedlesam", "feddyn"))])
def test_ray_workers_train_a_batch_norm_dropout_cnn_exactly_as_locally(pool, name):
    """Workers rebuild the CNN, train each client from the broadcast buffers with its dropout stream, and return its
    statistics (FedBN: its own BatchNorm, kept in the driver's store): the local numbers, bit for bit."""
    cfg = tiny_config(f"algo={name}", *UNEQUAL, *BN_DROPOUT_CNN)
    local = Simulation(cfg)
    expected = trajectory(local, 2)
    sim = Simulation(cfg)
    sim.executor = RayExecutor(sim.worker_spec(), sim.worker_data(), ExecutorConfig(name="ray", workers=2),
                               actors=pool[:2])
    assert trajectory(sim, 2) == expected
    assert_identical(local, sim)
    assert not torch.equal(sim.server.buffers, sim.model.initial_buffers) or name == "fedbn"
    sim.close()


def test_uint8_pixels_on_ray_workers_give_the_local_numbers(pool):
    """Workers get the uint8 pixels with their standardization and flip augmentation: the local numbers exactly."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 256, (180, 1, 4, 4), dtype=np.uint8), rng.integers(0, 3, 180)
    data = uint8_dataset("pixels", x, y, x[:60], y[:60], 3, augmentation="flip")
    cfg = tiny_config(*UNEQUAL)
    local = Simulation(cfg, UserInputs(dataset=data))
    expected = trajectory(local, 2)
    sim = Simulation(cfg, UserInputs(dataset=data))
    sim.executor = RayExecutor(sim.worker_spec(), sim.worker_data(), ExecutorConfig(name="ray", workers=2),
                               actors=pool[:2])
    assert trajectory(sim, 2) == expected
    assert_identical(local, sim)
    sim.close()


def test_longest_first_balances_known_step_counts():
    steps = torch.tensor([2, 18, 4, 9, 9, 3])
    plan = longest_first(steps, [0, 1])
    assert sorted(torch.cat(list(plan.values())).tolist()) == list(range(6))
    load = {w: int(steps[rows].sum()) for w, rows in plan.items()}
    # by hand: 18 -> w0; 9 -> w1; 9 -> w1 (9 < 18); 4 -> w0 (tie 18/18: lower index); 3 -> w1 (18 < 22); 2 -> w1
    assert load == {0: 22, 1: 23}
    assert plan[0].tolist() == [1, 2] and plan[1].tolist() == [0, 3, 4, 5]


def test_tensors_cross_the_object_store_as_arrays_and_come_back_exactly():
    """What a worker receives and returns travels as NumPy arrays (bfloat16, which NumPy has not, as a tensor):
    every value, dtype and shape comes back, as copies on the worker and as read-only views on the driver."""
    from fedflat.core import Broadcast, ClientResult
    from fedflat.engine.ray_executor import from_wire, to_wire

    broadcast = Broadcast(3, 0.1, torch.randn(7), {"a": torch.tensor(0.25), "c": torch.randn(7)}, None,
                          {"m_i": torch.randn(2, 7)}, torch.randn(4, dtype=torch.float64))
    result = ClientResult(torch.tensor([4, 1]), {"model": torch.randn(2, 7), "keep": torch.tensor([True, False]),
                                                  "low": torch.randn(2, 3).bfloat16()}, {"n": torch.arange(2)}, 5)
    wire = to_wire((broadcast, result))
    assert isinstance(wire[0].w, np.ndarray) and isinstance(wire[1].upload["low"], torch.Tensor)
    for copy in (True, False):
        got_broadcast, got_result = from_wire(wire, copy=copy)
        assert got_broadcast.round == 3 and got_broadcast.lr == 0.1 and got_broadcast.ids is None
        for a, b in [(got_broadcast.w, broadcast.w), (got_broadcast.buffers, broadcast.buffers),
                     *((got_broadcast.server[k], broadcast.server[k]) for k in broadcast.server),
                     (got_broadcast.personal["m_i"], broadcast.personal["m_i"]), (got_result.ids, result.ids),
                     *((got_result.upload[k], result.upload[k]) for k in result.upload),
                     (got_result.state["n"], result.state["n"])]:
            assert a.dtype == b.dtype and torch.equal(a, b)
        assert got_result.backprops == 5
    sent = broadcast.w.clone()
    received = from_wire(wire, copy=True)[0].w
    received += 1  # a worker's inputs are its own: writing them leaves what was sent intact
    assert torch.equal(torch.from_numpy(wire[0].w), sent) and torch.equal(broadcast.w, sent)


def test_fedflat_run_with_executor_ray(ray_session, tmp_path):
    """The whole API path: `executor=ray` in the config, a run folder, metrics equal to the local run's."""
    cfg = tiny_config("algo=scaffold", *UNEQUAL, "rounds=3")
    local = fedflat.run(cfg, run_dir=tmp_path / "local", progress=False)
    remote = fedflat.run(cfg, overrides=["executor=ray", "executor.workers=2", "executor.cpus_per_worker=0.5"],
                         run_dir=tmp_path / "ray", progress=False)
    assert remote.summary["status"] == "completed"
    assert torch.equal(local.final_parameters, remote.final_parameters)
    assert metrics_equal(read_jsonl(tmp_path / "local" / "metrics.jsonl"), read_jsonl(tmp_path / "ray" / "metrics.jsonl"))
    assert "name: ray" in (tmp_path / "ray" / "config.yaml").read_text()  # the run folder says where it ran
    assert ray.is_initialized()  # a Ray the caller started is left running


# A plugin part that keeps a worker busy: the plain perturbation (none), whose clients wait ``seconds`` before their
# local steps of round 0, so a test can kill a worker mid-round (workers import the config's plugins)
PAUSING_PLUGIN = """
import time

from fedflat.algorithms.fedavg import NoPerturbation
from fedflat.core import PartParams, register_part


class PauseParams(PartParams):
    seconds: float = 0.0


@register_part
class Pausing(NoPerturbation):
    name = "pausing"
    summary = "none, each client of round 0 waiting `seconds` first"
    Params = PauseParams

    def begin(self, ctx, cohort):
        if ctx.round == 0:
            time.sleep(self.p.seconds)
"""


def test_a_worker_killed_mid_round_costs_a_redo_never_a_wrong_number(ray_session, tmp_path):
    (tmp_path / "pausing.py").write_text(PAUSING_PLUGIN)
    cfg = tiny_config("algo=scaffold", *UNEQUAL, "rounds=3", f"plugins=[{tmp_path / 'pausing.py'}]",
                      "algo.perturbation=pausing")
    expected = trajectory(Simulation(cfg), 3)
    sim = Simulation(cfg)
    spec = sim.worker_spec(algo={**sim.worker_spec().algo, "perturbation": {"name": "pausing", "seconds": 1.5}})
    executor = sim.executor = RayExecutor(spec, sim.worker_data(),
                                          ExecutorConfig(name="ray", workers=2, max_restarts=1, cpus_per_worker=0.5))
    victim = executor.pids()[0]
    killer = threading.Timer(0.5, os.kill, (victim, signal.SIGKILL))  # round 0 is under way: its clients wait 1.5 s
    killer.start()
    try:
        got = trajectory(sim, 3)
        pids = executor.pids()
    finally:
        killer.cancel()
        sim.close()
    assert got == expected
    assert executor.failures == [1, 0] and executor.redone_clients > 0
    assert victim not in pids and len(pids) == 2  # the dead worker was replaced by a fresh one


def test_no_worker_left_fails_the_run_with_its_checkpoint_and_resume_finishes_it(ray_session, tmp_path):
    cfg = tiny_config("algo=feddyn", *UNEQUAL, "rounds=4", "checkpoint_every=1")
    full = fedflat.run(cfg, run_dir=tmp_path / "full", progress=False)
    from fedflat.experiments import runner

    original = runner.Runner._round

    def kill_workers_before_round_3(self, t, bar):
        if t == 2:
            for pid in self.sim.executor.pids():
                os.kill(pid, signal.SIGKILL)
        original(self, t, bar)

    folder = tmp_path / "killed"
    runner.Runner._round = kill_workers_before_round_3
    try:
        with pytest.raises(Exception, match="Ray workers died"):
            fedflat.run(cfg, overrides=["executor=ray", "executor.workers=2", "executor.max_restarts=0",
                                        "executor.cpus_per_worker=0.5"], run_dir=folder, progress=False)
    finally:
        runner.Runner._round = original
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["status"] == "failed" and "Ray workers died" in summary["reason"]
    assert read_checkpoint(folder)["round"] == 2 and len(read_jsonl(folder / "metrics.jsonl")) == 2
    resumed = resume(folder, progress=False)  # a fresh set of workers
    assert resumed.summary["status"] == "completed"
    assert torch.equal(resumed.final_parameters, full.final_parameters)
    assert metrics_equal(read_jsonl(folder / "metrics.jsonl"), read_jsonl(tmp_path / "full" / "metrics.jsonl"))


def test_more_workers_than_the_cluster_holds_is_a_clear_error(ray_session):
    with pytest.raises(ConfigError, match=r"executor.workers=5 need 5 CPUs .* the Ray cluster has 2 CPUs and 0 GPUs \("):
        Simulation(tiny_config("executor=ray", "executor.workers=5", "executor.cpus_per_worker=1"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_node(*args: str) -> subprocess.Popen:
    ray_cli = Path(sys.executable).with_name("ray")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.Popen([str(ray_cli), "start", "--block", "--disable-usage-stats", f"--node-ip-address={LOCAL_NODE_IP}",
                             "--num-cpus=1", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)


def _stop(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGTERM)  # `ray start --block` ends the node's processes on SIGTERM
        process.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(process.pid, signal.SIGKILL)


@pytest.mark.slow  # a `ray start` cluster: ~31 s (moved from make test: its 10 minutes)
@pytest.mark.skipif(LOCAL_NODE_IP is None, reason="a second loopback address is needed (Linux)")
def test_a_cluster_started_by_ray_start_runs_a_driver_that_connects_by_address(tmp_path):
    """Two Ray nodes on this machine (`ray start --head`, `ray start --address`), each with one CPU; a driver
    process joins them by address, one worker lands on each node, and the numbers equal the local run's."""
    port = _free_port()
    recorded = Path(os.environ.get("RAY_TMPDIR", "/tmp")) / "ray" / "ray_current_cluster"
    before = recorded.read_text() if recorded.exists() else None
    head = _ray_node("--head", f"--port={port}", "--include-dashboard=false")
    node = None
    try:
        address = f"{LOCAL_NODE_IP}:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the head's GCS answers once it is up
            with socket.socket() as s:
                if s.connect_ex((LOCAL_NODE_IP, port)) == 0:
                    break
            time.sleep(0.5)
        node = _ray_node(f"--address={address}")
        cfg = tiny_config("algo=fedsam", *UNEQUAL, "rounds=2")
        local = fedflat.run(cfg, save=False, progress=False)
        script = (  # waits until both nodes have joined, then lets fedflat join the cluster by its address
            "import sys, time, torch, ray, fedflat\n"
            "from fedflat.config import load_config\n"
            "deadline, alive = time.monotonic() + 60, 0\n"
            "while alive < 2 and time.monotonic() < deadline:\n"
            "    ray.init(address=sys.argv[2], logging_level='ERROR', log_to_driver=False)\n"
            "    alive = len([n for n in ray.nodes() if n['Alive']])\n"
            "    ray.shutdown()\n"
            "    time.sleep(0.5)\n"
            "print('nodes', alive)\n"
            "hist = fedflat.run(load_config(sys.argv[1]), overrides=['executor=ray', 'executor.workers=2',\n"
            "                   'executor.cpus_per_worker=1', f'executor.address={sys.argv[2]}'], save=False, progress=False)\n"
            "print('ray left running:', ray.is_initialized())\n"
            "torch.save(hist.final_parameters, sys.argv[3])\n")
        config = tmp_path / "config.yaml"
        config.write_text(dump_yaml(cfg.model_dump()))
        out = subprocess.run([sys.executable, "-c", script, str(config), address, str(tmp_path / "w.pt")],
                             capture_output=True, text=True, timeout=180, cwd=Path(__file__).parents[1])
        assert out.returncode == 0, out.stderr[-3000:]
        # one CPU per node and one per worker: the two workers ran on different nodes; fedflat left the cluster up
        assert "nodes 2" in out.stdout and "ray left running: False" in out.stdout
        assert torch.equal(torch.load(tmp_path / "w.pt"), local.final_parameters)
    finally:
        if node is not None:
            _stop(node)
        _stop(head)
        # `ray start --head` records its address there and its end leaves it: every later `ray.init()` on this
        # machine without an address would join the dead instance (Flower's simulation did; issue 32)
        if before is None:
            recorded.unlink(missing_ok=True)
        else:
            recorded.write_text(before)


def test_bench_races_local_and_ray_executors(ray_session):
    from fedflat.bench import bench, executor_overrides

    report = bench(["tiny"], ["fedavg"], ["sequential"], rounds=1, warmup=0, threads=1,
                   progress=lambda msg: None, executors=("local", "threads:2", "ray:1"))
    rows = {r["engine"]: r for r in report["results"]}
    assert set(rows) == {"sequential", "sequential@threads:2", "sequential@ray:1"}
    assert rows["sequential@ray:1"]["executor"] == "ray:1" and rows["sequential@ray:1"]["startup_seconds"] > 0
    assert rows["sequential@ray:1"]["vs_fedavg"] == 1.0  # compared with FedAvg on the same executor
    with pytest.raises(ValueError, match="unknown executor 'dask': use local, threads:N or ray:N"):
        executor_overrides("dask")


@pytest.mark.slow  # two Ray executors: ~31 s (moved from make test: its 10 minutes)
def test_executors_sharing_the_ray_fedflat_started_close_it_after_the_last(tmp_path):
    """Two executors on the Ray instance fedflat started itself (as a bench racing ray:1 and ray:2 does):
    closing the first must not pull Ray from under the second, and the last one shuts Ray down."""
    script = (
        "import os, ray\n"
        "from fedflat.bench import WORKLOADS, bench, executor_overrides\n"
        "from fedflat.config import load_config\n"
        "from fedflat.engine.simulation import Simulation\n"
        "sim = Simulation(load_config(None, executor_overrides('ray:2'), base=WORKLOADS['tiny'].tree))\n"
        "print('nice', [os.getpriority(os.PRIO_PROCESS, pid) for pid in sim.executor.pids()])\n"
        "sim.close()\n"
        "report = bench(['tiny'], ['fedavg'], ['sequential'], rounds=1, warmup=0, threads=1,\n"
        "               progress=lambda m: None, executors=('ray:1', 'ray:2'))\n"
        "print(sorted(r['engine'] for r in report['results'] if 'error' not in r), ray.is_initialized())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                         cwd=Path(__file__).parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "['sequential@ray:1', 'sequential@ray:2'] False" in out.stdout
    # the workers of the Ray fedflat starts train at normal priority (Ray's default, nice 15, starves them
    # behind any other job on a shared machine)
    assert f"nice {[os.getpriority(os.PRIO_PROCESS, 0)] * 2}" in out.stdout


def _session(sid: int) -> list[str]:
    """The command lines of the live processes of session ``sid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(stat.with_name("cmdline").read_text().replace("\0", " ").strip())
        except (OSError, IndexError):
            pass  # gone meanwhile
    return found


@pytest.mark.slow  # a Ray instance of its own: ~20 s on 2 cores
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="the watchdog follows /proc (Linux)")
def test_a_killed_driver_leaves_no_ray_process_behind(tmp_path):
    """A driver killed by SIGKILL mid-run: Ray kills the GCS and raylet it started with it, but the raylet's
    agents (ray::DashboardAgent, ray::RuntimeEnvAgent) waited 60 s on the dead GCS before they exited (issue 32);
    fedflat's watchdog (fedflat/engine/reaper.py) ends them: nothing of the driver's session is left in 10 s."""
    code = ("import fedflat; fedflat.run(None, overrides=['rounds=100000', 'executor=ray', 'executor.workers=1', "
            f"'threads=1'], out={str(tmp_path)!r}, progress=False)")
    driver = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, cwd=Path(__file__).parents[1])
    try:
        deadline = time.monotonic() + 120
        while not any(f.stat().st_size for f in tmp_path.glob("*/metrics.jsonl")) and time.monotonic() < deadline:
            assert driver.poll() is None, "the driver ended before its first round"
            time.sleep(0.2)
        assert any("ray::DashboardAgent" in cmd for cmd in _session(driver.pid))  # (what this test is about)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 10
        while _session(driver.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _session(driver.pid) == []
    finally:
        try:
            os.killpg(driver.pid, signal.SIGKILL)  # whatever is left of the driver's group
        except ProcessLookupError:
            pass


def test_a_sweep_on_ray_equals_the_serial_sweep_and_keeps_skip_and_resume(ray_session, tmp_path):
    import yaml

    from fedflat.experiments.sweep import RayCells, load_sweep, run_sweep

    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_tree()))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "base.yaml", "overrides": ["rounds=2", "threads=1"],
                                    "grid": {"seed": [0, 1], "algo": ["fedavg", "scaffold"]}}))
    on_ray = run_sweep(load_sweep(path, out=tmp_path / "ray"), progress=False, ray=RayCells(cpus=0.5))
    serial = run_sweep(load_sweep(path, out=tmp_path / "serial"), progress=False)
    assert [c["status"] for c in on_ray.cells] == ["completed"] * 4
    for cell in serial.cells:
        a = read_jsonl(tmp_path / "ray" / cell["name"] / "metrics.jsonl")
        b = read_jsonl(tmp_path / "serial" / cell["name"] / "metrics.jsonl")
        assert metrics_equal(a, b), cell["name"]
    again = run_sweep(load_sweep(path, out=tmp_path / "ray"), progress=False, ray=RayCells(cpus=0.5))
    assert [c["action"] for c in again.cells] == ["skipped"] * 4


def test_a_worker_builds_its_model_without_the_pretrained_file(tiny):
    """model.pretrained is read once, by the driver: the broadcast carries the weights, so a worker (perhaps on
    a node without the file) builds its runtime from the spec alone."""
    from fedflat.engine.ray_executor import build_runtime

    sim = Simulation(tiny())
    spec = sim.worker_spec(model={**sim.cfg.model, "pretrained": "/nowhere/weights.pt"})
    assert build_runtime(spec, sim.worker_data()).model.layout.size == sim.num_parameters


@pytest.mark.slow  # Ray: a few seconds once its workers are up
def test_ray_workers_train_with_a_custom_loss_metrics_and_kept_optimizer_state(pool):
    """A ``loss_fn`` (a lambda: pickled by value into the workers), ``eval.metrics`` and Adam state kept per client
    (client state in the driver's store, sent with each task): the local numbers, bit for bit."""
    cfg = tiny_config(*UNEQUAL, "train.optimizer=adam", "train.optimizer_state=client", "train.lr=0.01",
                      "eval.metrics=[f1,auroc]")

    def brier(logits, y):
        one_hot = (y[:, None] == torch.arange(logits.shape[-1])).to(logits)
        return (logits.softmax(-1) - one_hot).pow(2).sum(-1)

    local = Simulation(cfg, UserInputs(loss_fn=brier))
    expected = trajectory(local, 2)
    sim = Simulation(cfg, UserInputs(loss_fn=brier))
    sim.executor = RayExecutor(sim.worker_spec(), sim.worker_data(), ExecutorConfig(name="ray", workers=2),
                               actors=pool[:2])
    assert trajectory(sim, 2) == expected
    assert sim.eval_metrics == local.eval_metrics and set(sim.eval_metrics) == {"f1", "auroc"}
    assert_identical(local, sim)
    assert "optim.exp_avg" in sim.server.store.names()
    plain = Simulation(tiny_config(*UNEQUAL, "train.optimizer=adam", "train.optimizer_state=client", "train.lr=0.01"))
    assert trajectory(plain, 2) != expected  # the loss is Brier's, not cross-entropy
    sim.close()
