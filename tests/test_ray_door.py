"""The Ray cluster's door (issue 54): docs/distributed.md's several-node recipe turns on Ray's token authentication
(Ray 2.52+: `RAY_AUTH_MODE=token`); whoever lacks the token runs nothing on the cluster and cannot join it."""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from conftest import tiny_config  # noqa: E402

import fedflat  # noqa: E402
from fedflat.config import dump_yaml  # noqa: E402
from fedflat.engine.ray_executor import LOCAL_NODE_IP  # noqa: E402
from fedflat.files import read_jsonl  # noqa: E402

STRANGER = '''import os, sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False, _node_ip_address=sys.argv[1].split(":")[0])

@ray.remote
def mark():
    open(sys.argv[2], "w").write("a stranger's code ran on the cluster")

ray.get(mark.remote(), timeout=120)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a `ray start` cluster and three refused drivers: ~1-2 min on 2 cores
@pytest.mark.deploy
@pytest.mark.skipif(LOCAL_NODE_IP is None, reason="a second loopback address is needed (Linux)")
def test_a_token_cluster_runs_only_drivers_and_nodes_holding_its_token(tmp_path):
    """docs/distributed.md's recipe on a loopback address: the head started with RAY_AUTH_MODE=token and a token
    file. A stranger's driver (no token, or a wrong one) that would write a marker file is refused and writes
    none; `fedflat run` without the token exits with fedflat's one line naming RAY_AUTH_MODE; a node without the
    token cannot join; `fedflat run` with the token trains and equals the local run."""
    token, wrong = tmp_path / "token", tmp_path / "wrong"
    token.write_text(secrets.token_hex(32))
    wrong.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    ray_tmp = Path(os.environ.get("RAY_TMPDIR", "/tmp"))
    recorded = ray_tmp / "ray" / "ray_current_cluster"
    before = recorded.read_text() if recorded.exists() else None
    plain = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    plain["RAY_USAGE_STATS_ENABLED"] = "0"
    holder = {**plain, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    ray_cli = str(Path(sys.executable).with_name("ray"))
    port = free_port()
    address = f"{LOCAL_NODE_IP}:{port}"
    started = []

    def ray_node(env: dict, *args: str) -> subprocess.Popen:
        started.append(subprocess.Popen([ray_cli, "start", "--block", "--disable-usage-stats",
                                         f"--node-ip-address={LOCAL_NODE_IP}", "--num-cpus=1", *args],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                        start_new_session=True))
        return started[-1]

    cfg = tiny_config("algo=fedsam", "rounds=2")
    config = tmp_path / "config.yaml"
    config.write_text(dump_yaml(cfg.model_dump()))
    run = [sys.executable, "-m", "fedflat.cli", "run", str(config), "executor=ray", "executor.workers=1",
           "executor.cpus_per_worker=1", f"executor.address={address}", f"out={tmp_path / 'runs'}", "--no-progress"]
    try:
        ray_node(holder, "--head", f"--port={port}", "--include-dashboard=false")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the head's GCS answers once it is up
            with socket.socket() as s:
                if s.connect_ex((LOCAL_NODE_IP, port)) == 0:
                    break
            time.sleep(0.5)
        cwd = Path(__file__).parents[1]
        attempts = {  # at once: each is refused after Ray's own connection retries
            "no token": subprocess.Popen([sys.executable, "-c", STRANGER, address, str(tmp_path / "marker-a")],
                                         env=plain, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
            "wrong token": subprocess.Popen([sys.executable, "-c", STRANGER, address, str(tmp_path / "marker-b")],
                                            env={**holder, "RAY_AUTH_TOKEN_PATH": str(wrong)},
                                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
            "fedflat run": subprocess.Popen(run, env=plain, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                            text=True),
        }
        stranger_node = ray_node(plain, f"--address={address}")
        said = {name: p.communicate(timeout=300)[0] for name, p in attempts.items()}
        node_said = stranger_node.communicate(timeout=300)[0]
        for name, p in attempts.items():
            assert p.returncode != 0, (name, said[name][-2000:])
        assert not list(tmp_path.glob("marker-*"))  # no code of the strangers ran
        assert "Authentication token is missing or incorrect" in said["no token"] + said["wrong token"]
        (line,) = [x for x in said["fedflat run"].splitlines() if x.startswith("fedflat: executor.address")]
        assert "RAY_AUTH_MODE=token" in line and "Traceback" not in said["fedflat run"]
        assert stranger_node.returncode != 0, node_said[-2000:]
        count = ("import ray, sys; ray.init(address=sys.argv[1], "
                 f"_node_ip_address='{LOCAL_NODE_IP}', logging_level='ERROR'); "
                 "print(len([n for n in ray.nodes() if n['Alive']]))")
        alive = subprocess.run([sys.executable, "-c", count, address],
                               env=holder, capture_output=True, text=True, timeout=300)
        assert alive.stdout.split()[-1] == "1", alive.stderr[-2000:]  # the stranger's node did not join

        done = subprocess.run(run, env=holder, cwd=cwd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    finally:
        for process in started:
            try:
                os.killpg(process.pid, signal.SIGTERM)  # `ray start --block` ends the node's processes on SIGTERM
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # (the stranger's node: it gave up, with all it started)
        if before is None:  # (`ray start --head` records its address; a later bare ray.init() would join it)
            recorded.unlink(missing_ok=True)
        else:
            recorded.write_text(before)
    (metrics,) = list((tmp_path / "runs").glob("*/metrics.jsonl"))
    theirs = read_jsonl(metrics)
    ours = fedflat.run(cfg, save=False, progress=False).metrics
    keys = ("round", "train_loss", "test_acc", "test_loss")
    assert len(theirs) == cfg.rounds and [[m.get(k) for k in keys] for m in theirs] == [[m.get(k) for k in keys]
                                                                                        for m in ours]


LOCAL_DRIVER = '''import sys, ray
from fedflat.config import ExecutorConfig
from fedflat.engine.ray_executor import connect, release

connect(ray, ExecutorConfig(name="ray"))  # fedflat's own local instance, as `fedflat run executor=ray` starts it

@ray.remote
def ours():
    return "ran"

print(ray.get(ours.remote(), timeout=120), ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.readline()
release(ray)
'''


@pytest.mark.slow  # a local Ray instance and a refused driver: ~40 s on 2 cores
@pytest.mark.deploy
@pytest.mark.skipif(LOCAL_NODE_IP is None, reason="a second loopback address is needed (Linux)")
def test_fedflats_local_ray_under_ray_auth_mode_token_refuses_a_stranger(tmp_path):
    """The local Ray instance fedflat starts announces a loopback address, but Ray 2.55's GCS listens on every
    interface (docs/distributed.md): with RAY_AUTH_MODE=token exported, Ray makes a token (in ~/.ray/auth_token) and
    the instance runs fedflat's work but refuses a driver without the token, whose function would write a marker.
    fedflat makes that file its owner's only (Ray writes it readable by every account)."""
    plain = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    plain.update(RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp_path))
    driver = subprocess.Popen([sys.executable, "-c", LOCAL_DRIVER], env={**plain, "RAY_AUTH_MODE": "token"},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=Path(__file__).parents[1])
    try:
        ran, gcs = driver.stdout.readline().split()
        assert ran == "ran" and (tmp_path / ".ray" / "auth_token").is_file()  # Ray made the token it checks
        assert (tmp_path / ".ray" / "auth_token").stat().st_mode & 0o077 == 0  # (Ray wrote it readable by all)
        stranger = subprocess.run([sys.executable, "-c", STRANGER, gcs, str(tmp_path / "marker")], env=plain,
                                  capture_output=True, text=True, timeout=300)
        assert stranger.returncode != 0 and "Authentication token is missing or incorrect" in stranger.stderr
        assert not (tmp_path / "marker").exists()
    finally:
        driver.communicate("\n", timeout=120)
    assert driver.returncode == 0, driver.stderr[-2000:]


def test_joining_a_cluster_on_a_network_address_without_token_authentication_warns(monkeypatch, caplog):
    """`executor.address` on a network address with RAY_AUTH_MODE other than token: a warning naming the risk and
    the fix; none with the token mode, none for a cluster on this machine's loopback addresses."""
    from fedflat.engine.ray_executor import warn_if_open

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with caplog.at_level("WARNING"):
        warn_if_open("10.1.2.3")
    assert "without token authentication" in caplog.text and "RAY_AUTH_MODE=token" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        warn_if_open("127.0.0.2")
        warn_if_open("localhost")
        monkeypatch.setenv("RAY_AUTH_MODE", "token")
        warn_if_open("10.1.2.3")
    assert caplog.text == ""
