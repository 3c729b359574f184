"""Secure aggregation with Flower's SecAgg+ (fedflat/flower/secagg.py): the round from the unmasked mean equals the
plain round within the quantization bound of SecAgg+'s parameters, a node dropping out mid-protocol still gives a
round, and recipes that need each client's own upload are refused with their reason.

The fast tests run Flower's own components in this process: fedflat's ClientApp with Flower's ``secaggplus_mod``,
the server's Flower ``SecAggPlusWorkflow``, Flower's messages and records; :class:`LoopbackGrid` stands in for the
SuperLink's transport only (each message handed to its node's ClientApp, as a SuperNode would). The slow test runs
the whole thing as a Flower simulation (``fedflat flower-sim``)."""
from __future__ import annotations

import copy
import itertools
import logging
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("flwr")

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from fedflat.api import as_config  # noqa: E402
from fedflat.core import ConfigError, NoClients  # noqa: E402
from fedflat.engine.simulation import Simulation  # noqa: E402
from fedflat.flower import FedflatStrategy, client_app  # noqa: E402
from fedflat.flower.secagg import node_vector  # noqa: E402
from fedflat.testing import TINY  # noqa: E402

C, Q, N = 4.0, 2 ** 22, 6  # clipping_range, quantization_range, clients
SECURE = [f"secure_aggregation.clipping_range={C}", f"secure_aggregation.quantization_range={Q}"]


def small(algo: str, *extra: str):
    """The tests' tiny problem (fedflat.testing.TINY), every client sampled."""
    return as_config(TINY, [f"algo={algo}", "rounds=2", f"data.num_clients={N}", f"sampling.clients_per_round={N}",
                            "threads=1", *extra])


@pytest.fixture(autouse=True)
def a_run(monkeypatch):
    """Flower's messages carry the run they belong to and the node that sends them (a ServerApp's, set by Flower when
    it runs one; the server is node 0)."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 7)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


RUNS = itertools.count(1000)


class LoopbackGrid:
    """Flower's grid reduced to its transport: every message goes to its node's ClientApp (fedflat's, with Flower's
    SecAgg+ mod) in this process, with the node's own Context kept across messages as a SuperNode keeps it. A node
    named in ``drop`` answers nothing from that SecAgg+ stage on (it went offline), as Flower's SuperLink reports a
    node that does not answer within the timeout; an exception in a ClientApp is an error reply, as Flower's."""

    def __init__(self, app, partitions: int, drop: dict[int, str] | None = None):
        self.app, self.drop, self.gone = app, dict(drop or {}), set()
        run = next(RUNS)  # (a run's nodes share one Simulation per process: fedflat.flower.apps.node_of)
        self.contexts = {100 + p: Context(run_id=run, node_id=100 + p, state=RecordDict(), run_config={},
                                          node_config={"partition-id": p, "num-partitions": partitions})
                         for p in range(partitions)}
        self.stages: list[str] = []
        self.errors: list[str] = []

    def get_nodes(self):
        return [SimpleNamespace(node_id=n, public_key=b"", last_activated_at="t0") for n in self.contexts
                if n not in self.gone]

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for message in messages:
            node = message.metadata.dst_node_id
            configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
            stage = configs[Key.STAGE] if configs is not None else None
            if stage is not None:
                self.stages.append(stage)
            if stage is not None and self.drop.get(node) == stage:
                self.gone.add(node)
            if node in self.gone:
                continue
            TaskIdentity.node_id = node  # (the node's runtime says who replies)
            try:
                replies.append(self.app(copy.deepcopy(message), self.contexts[node]))  # (a node gets its own copy)
            except Exception as err:  # (Flower's runtime sends the ClientApp's exception back as an error reply)
                self.errors.append(f"{type(err).__name__}: {err}")
                replies.append(Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=message))
            finally:
                TaskIdentity.node_id = 0
        return replies


def secure_round(cfg, tmp_path, drop: dict[int, str] | None = None, partitions: int = 3, wrap=None):
    """One round of ``cfg`` under SecAgg+ through :class:`LoopbackGrid`: the server's simulation after it. ``wrap``
    (app -> app) replaces the nodes' ClientApp by one around it (an attacker's)."""
    app = client_app(cfg, state_dir=tmp_path / "nodes")
    grid = LoopbackGrid(wrap(app) if wrap else app, partitions, drop)
    sim = Simulation(cfg)
    strategy = FedflatStrategy(sim, round_timeout=30.0, wait_s=5.0, query_timeout=5.0, insecure=True)
    strategy.round_driver(grid)(0)
    return sim, grid


def plain_round(cfg, leave_out: tuple[int, ...] = ()):
    """The same round in one process, without secure aggregation, leaving out the clients of ``leave_out``."""
    sim = Simulation(cfg.model_copy(update={"secure_aggregation": None}))
    sim.w_before = sim.server.w.clone()
    opened = sim.server.begin_round(0)
    result = sim.executor.fit(opened.broadcast, opened.task, sim.server.load_state)
    keep = [r for r, c in enumerate(result.ids.tolist()) if c not in leave_out]
    sim.server.finish_round(opened, result.rows(torch.tensor(keep, dtype=torch.long)))
    return sim


def quantization_bound(nodes: int, clients: list[int], w: torch.Tensor, Q: int = Q) -> float:
    """The largest difference, per parameter, between the model after a SecAgg+ round and after the plain round.

    Node ``n`` holds ``C_n`` of the round's ``K`` answering clients and sends ``m_n``, its clients' mean update (each
    value within ``[-c, c]``: nothing is clipped), with weight ``C_n`` of ``max_weight = N``. Flower's mod quantizes
    the weight to ``d_n = q_n / Q``, ``|q_n - C_n Q / N| <= 1/2``, and ``d_n m_n`` stochastically to the grid of step
    ``2c / Q``: an error ``e_n``, ``|e_n| < 2c / Q``. The workflow returns ``(sum_n d_n m_n + e_n) / D``,
    ``D = sum_n d_n``. Against the exact mean ``sum_n C_n m_n / K`` (weights ``r_n = C_n / N``):

    - rounding: ``|sum_n e_n| / D < 2 c n / (Q D)``;
    - weights: ``sum_n (d_n / D - r_n / R) m_n`` with ``R = sum r_n``; writing ``d_n = r_n + delta_n``,
      ``sum_n |d_n / D - r_n / R| <= (sum |delta_n| + |D - R|) / D <= n / (Q D)``, times ``max |m_n| <= c``.

    So ``|mean - exact| < 3 c n / (Q D)``. The model's float32 arithmetic adds, on either side, at most a few
    roundings of ``|w|`` (``w^t + Delta`` and the server's step: ``4 eps_32 |w|`` each side)."""
    D = sum(round(k * Q / N) / Q for k in clients)
    return 3 * C * nodes / (Q * D) + 8 * torch.finfo(torch.float32).eps * float(w.abs().max())


def clients_per_node(partitions: int, answered: list[int]) -> list[int]:
    return [sum(1 for c in answered if c % partitions == p) for p in range(partitions)
            if any(c % partitions == p for c in answered)]


@pytest.mark.parametrize("algo, levels, extra", [
    ("fedavg", Q, ()), ("fedavg", 2 ** 12, ()), ("fedsam", Q, ()), ("fedlesam", Q, ()), ("scaffold", Q, ()),
    ("feddyn", Q, ()),
    ("fedavg", Q, ("privacy.mode=local", "privacy.noise_multiplier=0.1"))])  # (an upload path: Delta_i travels)
def test_a_secure_round_equals_the_plain_round_within_the_quantization_bound(algo, levels, extra, tmp_path):
    """(The error is about 40 % of the bound at both quantization ranges here: the bound is not loose.)"""
    cfg = small(algo, *SECURE, f"secure_aggregation.quantization_range={levels}", *extra)
    secure, grid = secure_round(cfg, tmp_path)
    plain = plain_round(cfg)
    assert grid.stages == [Stage.SETUP] * 3 + [Stage.SHARE_KEYS] * 3 + [Stage.COLLECT_MASKED_VECTORS] * 3 + \
        [Stage.UNMASK] * 3  # Flower's four stages, every node in each
    bound = quantization_bound(3, clients_per_node(3, list(range(N))), plain.server.w, levels)
    assert (secure.server.w - plain.server.w).abs().max().item() <= bound
    for name, value in plain.server.state.items():  # SCAFFOLD's c: (1/N) sum_i Delta c_i from K times the mean
        if value.is_floating_point() and value.numel() == plain.server.w.numel():
            assert (secure.server.state[name] - value).abs().max().item() <= bound, name
    assert secure.server.last_round.clients == N and not secure.server.last_round.dropped
    # the round moved the model by several bounds: a wrong weight or a lost node would show
    assert (plain.server.w - plain.w_before).abs().max() > 5 * bound


def test_a_node_dropping_out_mid_protocol_within_the_threshold_still_gives_a_round(tmp_path):
    """Node 101 (partition 1: clients 1 and 4) goes offline after sharing its keys, before its masked vector: Flower's
    unmask stage removes its pairwise masks from the others' shares, and the round is the plain round without its
    clients."""
    cfg = small("fedavg", *SECURE, "secure_aggregation.num_shares=1.0", "secure_aggregation.reconstruction_threshold=2")
    secure, grid = secure_round(cfg, tmp_path, drop={101: Stage.COLLECT_MASKED_VECTORS})
    plain = plain_round(cfg, leave_out=(1, 4))
    assert grid.stages.count(Stage.UNMASK) == 2
    assert secure.server.last_round.dropped == [1, 4] and secure.server.last_round.clients == 4
    bound = quantization_bound(2, clients_per_node(3, [0, 2, 3, 5]), plain.server.w)
    assert (secure.server.w - plain.server.w).abs().max().item() <= bound


def test_too_many_dropouts_for_the_threshold_end_the_round_with_the_reason(tmp_path):
    cfg = small("fedavg", *SECURE, "secure_aggregation.reconstruction_threshold=3")
    with pytest.raises(NoClients, match="SecAgg\\+ halted"):
        secure_round(cfg, tmp_path, drop={101: Stage.SHARE_KEYS})


def test_a_node_of_a_secure_run_refuses_a_plain_train_message(tmp_path):
    from fedflat.flower.protocol import task_content

    cfg = small("fedavg", *SECURE)
    sim = Simulation(cfg)
    opened = sim.server.begin_round(0)
    ids = torch.tensor([0, 3])
    task = opened.task.rows(torch.tensor([0, 3]))
    message = Message(task_content(opened.broadcast.for_clients(ids), task, [-1, -1]), dst_node_id=100,
                      message_type="train")
    grid = LoopbackGrid(client_app(cfg, state_dir=tmp_path), 3)
    (reply,) = grid.send_and_receive([message])
    assert reply.has_error() and "only through Flower's SecAgg+" in reply.error.reason


def test_values_beyond_the_clipping_range_are_counted_and_logged(tmp_path, caplog):
    """A clipping range below the training loss (about ln 3 here): the nodes say how many values the clip changed,
    the server logs it and the round's log holds the count."""
    cfg = small("fedavg", "secure_aggregation.clipping_range=0.05")
    with caplog.at_level(logging.WARNING, logger="fedflat.flower"):
        secure, _ = secure_round(cfg, tmp_path)
    assert secure.server.last_round.log["secagg_clipped"] >= 3  # every node's mean loss at least
    assert "clipped" in caplog.text and "clipping_range" in caplog.text


def test_a_nodes_vector_is_its_clients_mean_update():
    w = torch.tensor([1.0, -2.0])
    upload = {"model": torch.tensor([[1.5, -2.0], [0.5, -1.0]]), "train_loss": torch.tensor([1.0, 3.0])}
    means, P = node_vector(upload, [1.0, 1.0], w)
    assert P == 2.0
    assert means["model"].tolist() == [0.0, 0.5] and means["train_loss"].tolist() == [2.0]


@pytest.mark.parametrize("extra, says", [
    (["algo=fedawa"], "aggregation 'fedawa': optimizes each client's weight on its own update"),
    (["algo=fedscam"], "weighs each client by its own heterogeneity and alignment scores"),
    (["algo=fedwmsam"], "computes each client's variate c_i from its own update"),
    (["robust.name=median"], "upload 'median'"),
    (["algo.weighting=samples"], "algo.weighting=samples with secure_aggregation"),
    (["compression.name=topk"], "compression (topk) with secure_aggregation"),
    (["privacy.noise_multiplier=1.0"], "privacy.mode=central with secure_aggregation"),
    (["validation.max_norm=10"], "validation.max_norm with secure_aggregation"),
    (["sampling.clients_per_round=6", "secure_aggregation.quantization_range=1073741824"], "overflow modulus_range"),
])
def test_what_secagg_cannot_give_is_refused_with_the_reason(extra, says):
    with pytest.raises(ConfigError, match=says.replace("(", "\\(").replace(")", "\\)")):
        as_config(None, ["data.num_clients=6", "sampling.clients_per_round=3", *SECURE, *extra])


def test_a_plugin_part_that_needs_individual_uploads_is_refused_the_same_way(tmp_path):
    plugin = tmp_path / "myagg.py"
    plugin.write_text('''
import torch
from fedflat.core import Aggregation, register_part

@register_part
class Loudest(Aggregation):
    name = "loudest"
    summary = "all weight on the largest update"
    individual = "puts all weight on the client with the largest update"

    def weights(self, ctx):
        w = torch.zeros(ctx.K, dtype=ctx.w.dtype)
        w[ctx.deltas.norm(dim=1).argmax()] = 1.0
        return w
''')
    with pytest.raises(ConfigError, match="aggregation 'loudest': puts all weight on the client with the largest"):
        as_config(None, [f"plugins=[{plugin}]", "algo.aggregation=loudest", *SECURE])


def test_secure_aggregation_outside_flower_says_where_it_runs():
    import fedflat

    with pytest.raises(ConfigError, match="fedflat flower-sim"):
        fedflat.run(None, overrides=["rounds=1", *SECURE], save=False, progress=False)


@pytest.mark.slow  # a Flower simulation (Ray) of three nodes: ~30 s on 2 cores
def test_a_flower_simulation_under_secagg_trains_as_the_plain_one_within_the_bound(tmp_path):
    from fedflat.flower import simulate

    cfg = small("fedsam", *SECURE, "rounds=1")
    secure = simulate(cfg, supernodes=3, out=tmp_path / "secure", progress=False)
    plain = simulate(cfg.model_copy(update={"secure_aggregation": None}), supernodes=3, out=tmp_path / "plain",
                     progress=False)
    ours, theirs = (torch.load(h.run_dir / "model.pt", weights_only=True) for h in (secure, plain))
    for name in theirs:
        bound = quantization_bound(3, clients_per_node(3, list(range(N))), theirs[name])
        assert (ours[name] - theirs[name]).abs().max().item() <= bound, name
    assert secure.summary["status"] == "completed"


def test_flower_app_carries_the_secure_aggregation_section_to_its_apps(tmp_path):
    """`fedflat flower-app` writes the section into the run config, which the ServerApp and every ClientApp read:
    the nodes mask their uploads and refuse plain train messages in a deployment as in a simulation."""
    import tomllib

    from fedflat.config import read_yaml
    from fedflat.flower import write_app

    cfg = small("fedsam", "secure_aggregation={}", "secure_aggregation.clipping_range=2.0")
    folder = write_app(cfg, tmp_path / "app", insecure=True)
    project = tomllib.loads((folder / "pyproject.toml").read_text())
    carried = as_config(read_yaml(project["tool"]["flwr"]["app"]["config"]["fedflat-config"]))
    assert carried.secure_aggregation == cfg.secure_aggregation
    assert carried.secure_aggregation.clipping_range == 2.0


@pytest.mark.slow  # a real deployment: a SuperLink, three SuperNodes and `flwr run`, ~2-4 min on 2 cores
@pytest.mark.deploy
def test_a_deployed_federation_under_secagg_trains_as_fedflat_run_within_the_bound(tmp_path):
    """docs/flower.md's commands with `secure_aggregation`: a SuperLink and three SuperNodes on 127.0.0.1 (insecure
    transport: TLS and node keys are tests/test_flower.py's; SecAgg+ is independent of them), the app of
    `fedflat flower-app`, `flwr run`. Each message runs in a fresh ClientApp process, so the protocol's state lives
    in the node's Flower context between its four stages. One round: the model equals `fedflat run`'s (which a
    plain deployment equals exactly) within the quantization bound. Timeouts: tests/test_flower.py's
    :func:`wait_for_progress` (a stalled deployment fails, a slow one does not)."""
    import json

    import fedflat
    from fedflat.flower import write_app
    from test_flower import Deployment, wait_for_progress

    cfg = small("fedsam", *SECURE, "rounds=1")
    app = write_app(cfg, tmp_path / "app", insecure=True)
    runs = tmp_path / "runs"
    here = Deployment(tmp_path)
    watched = [tmp_path / "superlink.log", *(tmp_path / f"node{p}.log" for p in range(3)), runs / "*" / "metrics.jsonl"]
    try:
        here.superlink()
        for p in range(3):
            here.up(f"node{p}", p, 3)
        submitted = here.flwr("run", str(app), "here", "--run-config",
                              f"out=\"{runs}\" round-timeout=3600.0 wait-nodes=3600.0")
        assert submitted.returncode == 0, submitted.stdout + submitted.stderr
        summary = wait_for_progress(lambda: [json.loads(f.read_text()) for f in runs.glob("*/summary.json")
                                             if json.loads(f.read_text())["status"] != "running"], watched,
                                    "the run's end")[0]
    finally:
        here.close()
    assert summary["status"] == "completed" and "dropped_clients" not in summary, summary.get("reason")
    (folder,) = runs.glob("*/summary.json")
    ours = torch.load(folder.parent / "model.pt", weights_only=True)
    plain = fedflat.run(cfg.model_copy(update={"secure_aggregation": None}), save=False, progress=False)
    theirs = plain.state_dict
    for name in theirs:
        bound = quantization_bound(3, clients_per_node(3, list(range(N))), theirs[name])
        assert (ours[name] - theirs[name]).abs().max().item() <= bound, name


def test_a_model_with_buffers_is_refused_under_secagg():
    cfg = small("fedavg", *SECURE, "model=cnn", "model.norm=batch", "model.padding=2")
    with pytest.raises(ConfigError, match="this model has buffers .*model.norm=group"):
        FedflatStrategy(Simulation(cfg))


def test_a_node_whose_update_is_not_finite_leaves_the_round_and_flower_recovers_the_sum(tmp_path, monkeypatch):
    """Quantized, a NaN would add garbage to the sum that nobody sees: the node refuses to send it (an error reply
    at the masked-vector stage), and Flower's unmask stage treats it as a dropout."""
    from fedflat.flower.node import Node

    fit = Node.fit

    def broken_on_partition_1(self, content):
        job, result = fit(self, content)
        if self.partition == 1:
            result.upload["model"][0, 0] = float("nan")
        return job, result

    monkeypatch.setattr(Node, "fit", broken_on_partition_1)
    cfg = small("fedavg", *SECURE)
    secure, grid = secure_round(cfg, tmp_path)
    assert any("hold NaN or infinite values" in e for e in grid.errors)
    plain = plain_round(cfg, leave_out=(1, 4))
    assert secure.server.last_round.dropped == [1, 4]
    assert (secure.server.w - plain.server.w).abs().max().item() <= quantization_bound(2, [2, 2], plain.server.w)


def test_flowers_own_strategy_loop_is_refused_under_secagg():
    cfg = small("fedavg", *SECURE)
    with pytest.raises(ConfigError, match="Strategy.start loop sends plain train messages"):
        FedflatStrategy(Simulation(cfg)).configure_train(1, None, None, None)


# -- a node whose clear text is inconsistent (issue 54: it raised BadReply out of the secure round, the run failed) --
def named_other_clients(result):
    result.ids = torch.tensor([0, 3])  # partition 0's clients, not its own (1, 4)


def added_an_entry(result):
    result.upload["extra"] = torch.zeros(len(result.ids), 3)


def claimed_backprops(result):
    result.backprops = 10 ** 15  # (its clients' local steps take a few dozen)


def forged_masked_vector(app):
    """Node 101's masked vector with its model's array (after the weight's) replaced by one of shape [1] (its clear
    text honest): Flower adds the nodes' vectors element-wise, so it would broadcast into every value of the sum."""
    import numpy as np
    from flwr.compat.common.parameter import ndarray_to_bytes

    def attacker(message, context):
        configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
        stage = configs.get(Key.STAGE) if configs is not None else None  # (before the mod reads the message)
        reply = app(message, context)
        if message.metadata.dst_node_id == 101 and stage == Stage.COLLECT_MASKED_VECTORS:
            vectors = list(reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS])
            vectors[1] = ndarray_to_bytes(np.array([12345], dtype=np.int64))
            reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS] = vectors
        return reply
    return attacker


@pytest.mark.parametrize("fit_attack, wrap, says", [
    (named_other_clients, None, "it answered for clients [0, 3], it was sent [1, 4]"),
    (added_an_entry, None, "its upload has entries [('extra', (3,), 'float32'), ('model', "),
    (claimed_backprops, None, f"it claims {10 ** 15} backward passes, more than the "),
    (None, forged_masked_vector, "its masked vector holds a int64 array of shape [1], expected ["),
])
def test_an_inconsistent_node_is_left_out_and_flower_recovers_the_sum_without_it(fit_attack, wrap, says, tmp_path,
                                                                                  monkeypatch, caplog):
    """Node 101 (partition 1: clients 1 and 4), a modified ClientApp, says in the clear what it was not sent, or sends
    a masked vector of another layout: its reply is held back before Flower adds it, Flower's unmask stage treats it as
    a dropout, and the round is the plain round without its clients (within the quantization bound), the node named."""
    from fedflat.flower.node import Node

    if fit_attack is not None:
        fit = Node.fit

        def attacker(self, content):
            job, result = fit(self, content)
            if self.partition == 1:
                fit_attack(result)
            return job, result

        monkeypatch.setattr(Node, "fit", attacker)
    cfg = small("fedavg", *SECURE, "secure_aggregation.num_shares=1.0", "secure_aggregation.reconstruction_threshold=2")
    with caplog.at_level(logging.WARNING, logger="fedflat.flower"):
        secure, grid = secure_round(cfg, tmp_path, wrap=wrap)
    said = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("round 1: node 101's clients [1, 4] left out: ") and says in said[0]
    assert grid.stages.count(Stage.UNMASK) == 2  # (the two consistent nodes reveal the shares)
    plain = plain_round(cfg, leave_out=(1, 4))
    assert secure.server.last_round.dropped == [1, 4] and secure.server.last_round.clients == 4
    bound = quantization_bound(2, clients_per_node(3, [0, 2, 3, 5]), plain.server.w)
    assert (secure.server.w - plain.server.w).abs().max().item() <= bound
    assert (plain.server.w - plain.w_before).abs().max() > 5 * bound  # (leaving out the wrong node would show)


def test_too_many_inconsistent_nodes_for_the_threshold_end_the_run_saying_so(tmp_path, monkeypatch):
    from fedflat.flower.node import Node

    fit = Node.fit

    def attacker(self, content):
        job, result = fit(self, content)
        if self.partition == 1:
            named_other_clients(result)
        return job, result

    monkeypatch.setattr(Node, "fit", attacker)
    cfg = small("fedavg", *SECURE, "secure_aggregation.reconstruction_threshold=3")
    with pytest.raises(NoClients, match=r"SecAgg\+ halted .*node 101 left out: it answered for clients \[0, 3\]"):
        secure_round(cfg, tmp_path)


def test_a_node_whose_key_shares_are_malformed_ends_the_round_saying_which_and_why(tmp_path):
    """Node 101 answers SecAgg+'s share-keys stage with one destination more than ciphertexts, a node id outside the
    round: Flower's workflow zips them strictly and indexes by id, so the reply raised inside it (a ValueError, the
    run ended with Flower's traceback). Held back now, the node is a dropout at that stage; Flower's unmask stage then
    needs shares of its keys that nobody received and halts the round, and the run ends saying which node and why."""
    def malformed(app):
        def attacker(message, context):
            configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
            stage = configs.get(Key.STAGE) if configs is not None else None
            reply = app(message, context)
            if message.metadata.dst_node_id == 101 and stage == Stage.SHARE_KEYS:
                said = reply.content.config_records[RECORD_KEY_CONFIGS]
                said[Key.DESTINATION_LIST] = [*said[Key.DESTINATION_LIST], 999]
            return reply
        return attacker

    cfg = small("fedavg", *SECURE, "secure_aggregation.num_shares=1.0", "secure_aggregation.reconstruction_threshold=2")
    with pytest.raises(NoClients, match=r"SecAgg\+ halted .*node 101 left out: its reply to SecAgg\+'s share_keys "
                                        r"stage is not of the protocol's form"):
        secure_round(cfg, tmp_path, wrap=malformed)
