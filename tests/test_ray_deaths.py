"""A Ray worker's death is recorded in the run's files (issue 44.8), not only in Ray's own log line."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

ray = pytest.importorskip("ray")

import fedflat  # noqa: E402
from fedflat.engine.ray_executor import LOCAL_NODE_IP  # noqa: E402
from fedflat.experiments import runner  # noqa: E402

from conftest import tiny_config  # noqa: E402


@pytest.mark.slow  # a Ray instance and its workers
def test_a_dead_worker_is_recorded_in_the_summary_and_said(tmp_path, monkeypatch, capfd):
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address=LOCAL_NODE_IP,
             logging_level="ERROR", log_to_driver=False)
    try:
        cfg = tiny_config("rounds=3", "threads=1", "engine=sequential", "sampling.clients_per_round=4")
        local = fedflat.run(cfg, save=False, progress=False)
        original = runner.Runner._round

        def kill_worker_0_before_round_2(self, t, bar):
            if t == 1:
                os.kill(self.sim.executor.pids()[0], signal.SIGKILL)
            original(self, t, bar)

        monkeypatch.setattr(runner.Runner, "_round", kill_worker_0_before_round_2)
        hist = fedflat.run(cfg, overrides=["executor=ray", "executor.workers=2", "executor.max_restarts=1",
                                           "executor.cpus_per_worker=0.5"], run_dir=tmp_path / "run", progress=False)
    finally:
        ray.shutdown()
    assert hist.summary["status"] == "completed" and torch.equal(hist.final_parameters, local.final_parameters)
    death, = json.loads((tmp_path / "run" / "summary.json").read_text())["worker_deaths"]
    assert death["round"] == 2 and death["worker"] == 0 and death["clients"] > 0 and death["restarted"]
    assert death["error"].startswith("ActorDiedError") or "Actor" in death["error"]
    assert (f"Ray worker 0 died in round 2 ({death['error']}); its {death['clients']} clients trained again on "
            f"worker {death['redone_on']}") in capfd.readouterr().err
