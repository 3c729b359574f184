"""fedflat on Flower: the client contract as Flower messages, a simulation equal to ``fedflat run``, failed
and partial replies left out, and a real SuperLink with two SuperNodes, one killed and restarted."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("flwr")

import numpy as np  # noqa: E402
from flwr.app import Array, Message  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402

import fedflat  # noqa: E402
from fedflat.api import as_config  # noqa: E402
from fedflat.core import MODEL, TRAIN_LOSS, ClientResult
from fedflat.engine.simulation import Simulation  # noqa: E402
from fedflat.flower import FedflatStrategy, client_app, simulate, write_app  # noqa: E402
from fedflat.flower.apps import run_flower_simulation  # noqa: E402
from fedflat.flower.node import ClientStates, StateLost  # noqa: E402
from fedflat.flower.protocol import BadReply, read_result, read_task, result_content, task_content  # noqa: E402

# Columns that measure time or where state lives (the server's store holds no client-kept vectors in a
# federation; Flower adds the bytes on the wire): everything else must be equal.
NOT_COMPARED = {"seconds", "eval_seconds", "train_seconds", "store", "wire_up_bytes", "wire_down_bytes"}


def small(algo: str, *extra: str):
    return as_config(None, [f"algo.name={algo}", "rounds=3", "data.num_clients=6", "sampling.clients_per_round=4",
                            "eval.every=1", "threads=1", *extra])


def assert_same_metrics(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        for key in set(a) - NOT_COMPARED:
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-7), (a["round"], key)


def reference(cfg, dropped: dict[str, list[int]]) -> tuple[list[float], torch.Tensor]:
    """fedflat's round loop in one process, leaving out the clients a federation's run dropped (by round)."""
    sim = Simulation(cfg)
    accuracy = []
    for t in range(cfg.rounds):
        opened = sim.begin_round(t)
        result = sim.executor.fit(opened.broadcast, opened.task, sim.load_state)
        keep = [r for r, c in enumerate(result.ids.tolist()) if c not in dropped.get(str(t + 1), [])]
        sim.finish_round(opened, result.rows(torch.tensor(keep, dtype=torch.long)))
        accuracy.append(sim.evaluate()[0])
    return accuracy, sim.w


# -- the protocol --------------------------------------------------------------------------------------------------
def test_a_task_and_a_result_cross_as_flower_records_bit_for_bit():
    from fedflat.core import Broadcast
    from fedflat.engine.runtime import RoundTask

    w = torch.randn(7)
    broadcast = Broadcast(3, 0.05, w, {"scaffold.c": torch.randn(7)}, torch.tensor([1, 4]),
                          {"wmsam.m": torch.randn(2, 7)})
    task = RoundTask(torch.tensor([1, 4]), torch.tensor([30, 41]), torch.tensor([8, 11]))
    job = read_task(task_content(broadcast, task, [-1, 2]))
    assert job.broadcast.round == 3 and job.broadcast.lr == 0.05 and job.state_rounds == [-1, 2]
    assert torch.equal(job.broadcast.w, w) and torch.equal(job.broadcast.server["scaffold.c"], broadcast.server["scaffold.c"])
    assert torch.equal(job.broadcast.personal["wmsam.m"], broadcast.personal["wmsam.m"])
    assert torch.equal(job.task.steps, task.steps) and torch.equal(job.task.num_samples, task.num_samples)

    result = ClientResult(torch.tensor([1, 4]), {MODEL: torch.randn(2, 7), TRAIN_LOSS: torch.rand(2)}, {}, 19)
    back = read_result(result_content(result), [1, 4], 7)
    assert torch.equal(back.upload[MODEL], result.upload[MODEL]) and back.backprops == 19


@pytest.mark.parametrize("damage, says", [
    (lambda c: c["result"].__setitem__("clients", [1]), "the reply is for clients [1]"),
    (lambda c: c["upload"].__delitem__(TRAIN_LOSS), "lacks ['train_loss']"),
    (lambda c: c.__delitem__("upload"), "no upload"),
])
def test_a_partial_reply_is_refused_whole(damage, says):
    result = ClientResult(torch.tensor([1, 4]), {MODEL: torch.randn(2, 7), TRAIN_LOSS: torch.rand(2)}, {}, 3)
    content = result_content(result)
    damage(content)
    with pytest.raises(BadReply, match=says.replace("[", r"\[").replace("]", r"\]")):
        read_result(content, [1, 4], 7)
    short = result_content(ClientResult(torch.tensor([1, 4]), {MODEL: torch.randn(2, 6), TRAIN_LOSS: torch.rand(2)},
                                        {}, 3))
    with pytest.raises(BadReply, match=r"shape \(2, 6\), expected \(2, 7\)"):
        read_result(short, [1, 4], 7)


def test_nodes_score_their_clients_own_models_and_the_server_pools_them(tmp_path):
    """Personalized evaluation across two nodes (in process): each node scores its clients from their saved heads;
    pooled, the scores equal the one-process evaluation; a reply naming a client it was not sent is refused."""
    from fedflat.core import ConfigError
    from fedflat.engine.simulation import ClientScores, pooled_accuracy
    from fedflat.flower.node import Node
    from fedflat.flower.protocol import evaluation_content, read_scores

    cfg = small("fedper", "rounds=2")
    sim = Simulation(cfg)
    for t in range(2):
        sim.run_round(t)
    nodes = [Node(cfg, p, 2, tmp_path / f"node{p}") for p in range(2)]
    ids = torch.arange(6)
    state, known = sim.load_state(ids)
    for c in range(6):  # each node holds its clients' state as training would have saved it
        if known["fedper.w_i"][c]:
            nodes[c % 2].states.save(c, 1, {"fedper.w_i": state["fedper.w_i"][c]})
    rounds = [1 if known["fedper.w_i"][c] else -1 for c in range(6)]
    scores = [read_scores(node.evaluate(evaluation_content(sim.w, node.clients, [rounds[c] for c in node.clients])),
                          node.clients) for node in nodes]
    merged = scores[1]
    for column in ("clients", "correct", "loss", "samples"):
        getattr(merged, column).extend(getattr(scores[0], column))  # node order does not matter
    assert pooled_accuracy(merged) == sim.evaluate()
    with pytest.raises(BadReply, match="not sent"):
        read_scores(nodes[0].evaluate(evaluation_content(sim.w, [0, 2], [rounds[0], rounds[2]])), [0])
    with pytest.raises(ConfigError, match="no test sample was scored"):  # e.g. no node answered
        pooled_accuracy(ClientScores([], [], [], []))


def test_a_node_continues_from_the_state_of_the_last_aggregated_round(tmp_path):
    states = ClientStates(tmp_path, 3)
    states.save(5, 0, {"c": torch.ones(3)})
    states.save(5, 2, {"c": torch.full((3,), 2.0)})  # trained in round 3, whose aggregation did not use it
    assert torch.equal(states.current(5, 0)["c"], torch.ones(3))  # rolls back to round 1's state...
    assert sorted(p.name for p in (tmp_path / "client-5").iterdir()) == ["round-0.pt"]  # ...and forgets round 3's
    states.save(5, 4, {"c": torch.zeros(3)})
    assert torch.equal(states.current(5, 4)["c"], torch.zeros(3))
    assert states.current(7, -1) == {}  # never aggregated: no state yet
    with pytest.raises(StateLost, match="client 5: its state of round 2 is not in"):
        states.current(5, 1)


def test_flower_app_writes_a_project_with_the_config_in_its_run_config(tmp_path, capsys):
    import tomli

    from fedflat.cli import main
    from fedflat.config import read_yaml, resolve

    assert main(["flower-app", "algo.name=fedlesam", "rounds=7", "-o", str(tmp_path / "app")]) == 0
    project = tomli.loads((tmp_path / "app" / "pyproject.toml").read_text())
    app = project["tool"]["flwr"]["app"]
    assert app["components"] == {"serverapp": "fedflat_app.server_app:app", "clientapp": "fedflat_app.client_app:app"}
    assert read_yaml(app["config"]["fedflat-config"]) == resolve(as_config(None, ["algo.name=fedlesam", "rounds=7"]))
    assert (tmp_path / "app" / "fedflat_app" / "client_app.py").exists()
    assert main(["flower-app", "-o", str(tmp_path / "app")]) == 2  # not over an existing project
    assert "--force" in capsys.readouterr().err


# -- Flower simulation ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("algo", ["fedavg", "scaffold", "fedlesam", "fedgmt", "fedper-sam"])
def test_a_flower_simulation_equals_fedflat_run(algo, tmp_path):
    """Three virtual SuperNodes host two clients each; SCAFFOLD's c_i and FedPer's heads live on the nodes, not the
    server, so FedPer's personalized accuracy is computed there (per client, pooled by the server)."""
    cfg = small(algo)
    ours = fedflat.run(cfg, save=False, progress=False)
    theirs = simulate(cfg, supernodes=3, out=tmp_path, progress=False)
    assert_same_metrics(ours.metrics, theirs.metrics)
    assert torch.equal(ours.final_parameters, theirs.final_parameters)
    assert theirs.summary["status"] == "completed" and "dropped_clients" not in theirs.summary
    written = [json.loads(line) for line in (theirs.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["round"] for m in written] == [1, 2, 3] and all(m["wire_up_bytes"] > 0 for m in written)


BN_DROPOUT_CNN = ("data.name=synthetic", "data.options.shape=[1,8,8]", "data.options.num_classes=3",
                  "data.options.train_size=180", "data.options.test_size=60", "model=cnn", "model.padding=2",
                  "model.norm=batch", "model.dropout=0.3")


@pytest.mark.parametrize("algo", ["fedbn", *(pytest.param(a, marks=pytest.mark.slow)
                                             for a in ("fedavg", "scaffold", "fedsam", "fedlesam", "feddyn"))])
def test_a_flower_simulation_of_a_batch_norm_dropout_cnn_equals_fedflat_run(algo, tmp_path):
    """The nodes receive the global buffers with the model, train with the clients' dropout streams and upload their
    statistics; FedBN's BatchNorm stays on the nodes, which evaluate their clients with it: the run's numbers, its
    final model and buffers (model.pt) are fedflat's in one process, bit for bit."""
    cfg = small(algo, "rounds=2", *BN_DROPOUT_CNN)
    ours = fedflat.run(cfg, save=False, progress=False)
    theirs = simulate(cfg, supernodes=3, out=tmp_path, progress=False)
    assert_same_metrics(ours.metrics, theirs.metrics)
    assert [m["test_acc"] for m in ours.metrics] == [m["test_acc"] for m in theirs.metrics]
    assert ours.state_dict.keys() == theirs.state_dict.keys()
    for key, value in ours.state_dict.items():
        assert torch.equal(value, theirs.state_dict[key]), key
    from fedflat.models import build_model

    module = build_model("cnn", (1, 8, 8), 3, padding=2, norm="batch", dropout=0.3)
    module.load_state_dict(torch.load(theirs.run_dir / "model.pt", weights_only=True), strict=True)
    if theirs.summary["evaluation"] == "global":  # the reported accuracy is model.pt's in eval mode
        data = Simulation(cfg).dataset
        with torch.no_grad():
            correct = int((module.eval()(data.x_test).argmax(1) == data.y_test).sum())
        assert theirs.summary["final_test_acc"] == correct / len(data.y_test)


def test_failed_and_partial_replies_leave_their_clients_out_and_roll_their_state_back(tmp_path):
    """Partition 1's node fails in round 2, partition 2's sends an upload without its losses in round 3 and
    partition 0's one with an entry the others lack in round 4: those rounds aggregate the other clients,
    say so, and the run equals fedflat's with them left out (their SCAFFOLD state rolled back on the nodes)."""
    cfg = small("scaffold", "rounds=4", "sampling.clients_per_round=6")
    inner = client_app(cfg, state_dir=tmp_path / "nodes")
    client = ClientApp()

    @client.query()
    def query(message: Message, context):
        return inner(message, context)

    @client.train()
    def train(message: Message, context):
        round, partition = message.content["task"]["round"], context.node_config["partition-id"]
        if (round, partition) == (1, 1):
            raise RuntimeError("this node's GPU fell off the bus")
        reply = inner(message, context)
        if (round, partition) == (2, 2):
            del reply.content["upload"][TRAIN_LOSS]
        if (round, partition) == (3, 0):
            reply.content["upload"]["extra"] = Array(np.zeros(2, dtype=np.float32))
        return reply

    history = simulate(cfg, supernodes=3, out=tmp_path / "runs", progress=False, client=client)
    assert history.summary["status"] == "completed"
    assert history.summary["dropped_clients"] == {"2": [1, 4], "3": [2, 5], "4": [0, 3]}
    assert [m["dropped"] for m in history.metrics] == [0, 2, 2, 2]
    assert [m["clients"] for m in history.metrics] == [6, 4, 4, 4]
    accuracy, w = reference(cfg, history.summary["dropped_clients"])
    assert [m["test_acc"] for m in history.metrics] == pytest.approx(accuracy, abs=0)
    assert torch.equal(history.final_parameters, w)


def test_a_flower_run_resumes_through_flower_with_the_nodes_saved_state(tmp_path):
    """Two rounds, then a new Flower run (a new run id) resuming the folder to four: equal to four rounds in
    one go. A plain `fedflat resume`, which has no nodes and so no SCAFFOLD c_i, is refused."""
    from fedflat.engine.checkpoint import CheckpointError
    from fedflat.experiments.checkpoint import resume

    cfg = small("scaffold", "rounds=2")
    first = simulate(cfg, supernodes=2, out=tmp_path / "runs", state_dir=tmp_path / "nodes", progress=False)
    with pytest.raises(CheckpointError, match="trained its clients through fedflat.flower"):
        resume(first.run_dir, overrides=["rounds=4"], progress=False)
    longer = small("scaffold", "rounds=4")
    resumed = simulate(longer, supernodes=2, resume=first.run_dir, state_dir=tmp_path / "nodes", progress=False)
    assert resumed.summary["status"] == "completed" and resumed.summary["rounds"] == 4
    assert_same_metrics(fedflat.run(longer, save=False, progress=False).metrics, resumed.metrics)


@pytest.mark.parametrize("algo", ["scaffold", "fedper"])
def test_flowers_own_strategy_loop_runs_a_fedflat_recipe(algo, tmp_path):
    """FedflatStrategy in Flower's Strategy.start loop (no fedflat run folder): the same model and accuracy,
    evaluated centrally, or for a personalized method on the nodes (Flower's federated evaluation)."""
    cfg = small(algo)
    out: dict = {}
    server = ServerApp()

    @server.main()
    def main(grid, context):
        strategy = FedflatStrategy(Simulation(cfg))
        out["result"] = strategy.start(grid, strategy.initial_arrays(), num_rounds=cfg.rounds,
                                       evaluate_fn=strategy.evaluate)

    run_flower_simulation(server, client_app(cfg, state_dir=tmp_path), supernodes=2)
    ours = fedflat.run(cfg, save=False, progress=False)
    result = out["result"]
    assert torch.equal(torch.from_numpy(result.arrays[MODEL].numpy()), ours.final_parameters)
    evaluated = result.evaluate_metrics_clientapp if algo == "fedper" else result.evaluate_metrics_serverapp
    assert evaluated[cfg.rounds]["test_acc"] == ours.final_test_acc
    assert result.train_metrics_clientapp[1]["clients"] == 4


# -- a real deployment: SuperLink, two SuperNodes, `flwr run` ----------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Deployment:
    """A SuperLink and SuperNodes in insecure mode on 127.0.0.1, each in its own process group."""

    def __init__(self, root: Path):
        self.root = root
        self.env = {**os.environ, "FLWR_HOME": str(root / "flwr-home"),
                    "PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")}
        self.port = free_port()
        self.processes: dict[str, subprocess.Popen] = {}
        (root / "flwr-home").mkdir()
        (root / "flwr-home" / "config.toml").write_text(
            f'[superlink]\ndefault = "here"\n\n[superlink.here]\naddress = "127.0.0.1:{self.port}"\ninsecure = true\n')

    def start(self, name: str, *args: str) -> None:
        with open(self.root / f"{name}.log", "ab") as log:  # the process keeps its own copy of the handle
            self.processes[name] = subprocess.Popen(args, cwd=self.root, env=self.env, stdout=log, stderr=log,
                                                    start_new_session=True)

    def superlink(self) -> None:
        self.start("superlink", "flower-superlink", "--insecure", "--port", str(self.port),
                   "--database", str(self.root / "superlink.db"))

    def supernode(self, partition: int, partitions: int) -> None:
        config = f"partition-id={partition} num-partitions={partitions} state-dir=\"{self.root / 'state'}\""
        self.start(f"node{partition}", "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                   "--port", str(free_port()), "--node-config", config)

    def kill(self, name: str) -> None:
        process = self.processes.pop(name)
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(10)

    def close(self) -> None:
        for name in list(self.processes):
            self.kill(name)


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def test_a_deployed_federation_finishes_when_a_supernode_is_killed_and_restarted(tmp_path):
    """`flwr run` of the app `fedflat flower-app` writes, on a SuperLink and two SuperNodes; after round 1
    partition 0's SuperNode is killed (SIGKILL) and started again. The run completes; the round it missed
    (if any) left its clients out; the restarted node continues its clients' SCAFFOLD state from its disk:
    the run equals fedflat's own loop with the same clients left out."""
    cfg = small("scaffold", "rounds=4", "data.num_clients=4", "sampling.clients_per_round=4")
    app = write_app(cfg, tmp_path / "app")
    runs = tmp_path / "runs"
    here = Deployment(tmp_path)
    try:
        here.superlink()
        time.sleep(3)
        here.supernode(0, 2)
        here.supernode(1, 2)
        overrides = f"out=\"{runs}\" round-timeout=20.0 wait-nodes=60.0"
        submitted = subprocess.run(["flwr", "run", str(app), "here", "--run-config", overrides], env=here.env,
                                   cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        metrics = lambda: [json.loads(x) for f in runs.glob("*/metrics.jsonl") for x in f.read_text().splitlines()]
        wait_for(lambda: len(metrics()) >= 1, 180, "round 1")
        here.kill("node0")
        here.supernode(0, 2)
        summary = wait_for(lambda: [json.loads(f.read_text()) for f in runs.glob("*/summary.json")
                                    if json.loads(f.read_text())["status"] != "running"], 300, "the run's end")[0]
    finally:
        here.close()
    assert summary["status"] == "completed", summary.get("reason")
    dropped = summary.get("dropped_clients", {})
    assert set(sum(dropped.values(), [])) <= {0, 2}  # only partition 0's clients can have been left out
    assert str(cfg.rounds) not in dropped  # the restarted node served the last round, from its saved state
    print(f"rounds that left partition 0 out while its node restarted: {sorted(dropped)}")
    accuracy, _ = reference(cfg, dropped)
    assert [m["test_acc"] for m in metrics()] == pytest.approx(accuracy, abs=0)
    assert sorted(p.name for p in (tmp_path / "state").glob("config-*/partition-*")) == ["partition-0", "partition-1"]
