"""The server side of a Flower federation: a Flower ``Strategy`` that runs a fedflat recipe's server.

:class:`FedflatStrategy` drives fedflat's server, the same :class:`~fedflat.engine.server.Server` an executor's
run drives (``sim.server`` of a :class:`~fedflat.engine.simulation.Simulation` whose clients never train in this
process: the global model, the server state and the vectors the server holds per client), with fedflat's keyed
client sampling (not Flower's unseeded ``sample_nodes``), the aggregation in ascending client-id order whatever order
replies arrive in, and central evaluation. Its Flower methods
are the two halves of a round: ``configure_train`` (sample, broadcast, one message per node that hosts
sampled clients) and ``aggregate_train`` (check every reply whole, aggregate the clients that answered). A
personalized method (FedPer) is evaluated on the nodes, where its clients' private entries are:
``configure_evaluate`` and ``aggregate_evaluate``.

:func:`serve` runs it the way ``fedflat run`` runs a config: a run folder with metrics, checkpoints,
summary and final model, progress bar, diagnostics. Flower's own ``Strategy.start`` loop works too.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable

import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import Strategy

from fedflat.config import Config
from fedflat.core import MODEL, ClientResult, ConfigError, NoClients, merge_results
from fedflat.engine.simulation import ClientScores, OpenRound, RoundResult, Simulation, pooled_accuracy
from fedflat.flower.protocol import (EVALUATE, BadReply, UploadLayout, array_record, error_line, evaluation_content,
                                     most_backprops, read_result, read_scores, reply_content, task_content,
                                     upload_layout, wire_bytes, with_buffers)

log = logging.getLogger("fedflat.flower")

QUERY = "query"  # Flower message type of the discovery message: which partition a node holds
SIMULATION_HINT = ("in a Flower simulation (`flwr run APP` on the local SuperLink) its ClientApps did not start: the "
                   "run's log says why (`flwr log RUN_ID`)")
DEPLOYMENT_HINT = ("in this deployment no SuperNode of the federation is connected to the SuperLink: each SuperNode's "
                   "log says why it cannot connect, and `fedflat flower-gate`'s standard error names every connection "
                   "and request it refused, with the limit or check that refused it (docs/flower.md)")


def partition_of(client: int, partitions: int) -> int:
    """The partition (node) that hosts fedflat client ``client``: ``client mod num-partitions``."""
    return client % partitions


class Federation:
    """Which Flower node hosts which fedflat client, learned by asking each node once (a ``query`` message),
    and bound to the node's public key (the one it authenticates with; a key of its own per start without
    SuperNode authentication).

    A partition belongs to the first online node that claims it, and with a roster (``node-keys``, written by
    ``fedflat flower-app --keys``) only to the node whose key the roster names. With a roster a node is known by its
    key before anything it says is read: a node whose key the roster does not list is left out without being asked
    (nothing is sent to it), and a listed node's claim must be its own partition, of the operator's
    ``num-partitions`` (``partitions``: the run config's ``num-partitions``) or, without one, of the
    ``num-partitions`` the first node accepted (with a roster, an enrolled one) claimed.
    Whatever is wrong about a node (a stranger's key, a failed or malformed query, another's partition, another
    num-partitions) leaves that node out for the run, named in a warning with the reason, and never ends the run; a
    node that is merely slow, to a query or a task, is asked again in the next round.
    A restarted node comes back (under a new node id without authentication, after its old one went offline) and
    takes over its partition."""

    def __init__(self, query_timeout: float, roster: dict[int, bytes] | None = None, partitions: int | None = None):
        self.query_timeout = query_timeout
        self.roster = dict(roster or {})  # partition -> the public key of the node that may hold it
        self.partition: dict[int, int] = {}  # node id -> partition
        self.partitions = partitions
        self.operators = partitions is not None  # num-partitions set by the operator, not by a node's claim
        self.silent: dict[int, str] = {}  # node id -> why it was left out
        self.online: set[int] = set()
        self.keys: dict[int, bytes] = {}  # node id -> its public key
        self.started: dict[int, str] = {}  # node id -> when it last connected (a restart changes it)
        self.simulation = False  # whether the grid is Flower's simulation (:func:`simulated`), not a deployment

    def leave_out(self, node: int, why: str) -> None:
        """Stops using ``node`` for the rest of the run (its query failed or it claimed another's partition)."""
        self.silent[node] = why
        self.partition.pop(node, None)

    def absence(self, wait_s: float) -> str:
        """Why no node hosts a client: the end of the error that stops the run."""
        hint = SIMULATION_HINT if self.simulation else DEPLOYMENT_HINT
        if not self.online:
            return (f"no Flower node is connected (waited {wait_s:.0f} s): start SuperNodes with --node-config "
                    f"'partition-id=P num-partitions=M'; {hint}")
        if not self.partition:
            why = "; ".join(f"node {n}: {reason}" for n, reason in sorted(self.silent.items())) or "none answered"
            return f"every node was left out ({why})" + (f": {SIMULATION_HINT}" if self.simulation else "")
        return (f"no node online holds their partitions (nodes online hold {sorted(set(self.partition.values()))} "
                f"of {self.partitions}; waited {wait_s:.0f} s for the others)")

    def host(self, client: int) -> int | None:
        """The node that hosts ``client`` now, or None."""
        if self.partitions is None:
            return None
        wanted = partition_of(client, self.partitions)
        nodes = [n for n, p in self.partition.items() if p == wanted]
        return nodes[-1] if nodes else None

    def by_host(self, grid, clients: list[int], wait_s: float) -> dict[int, list[int]]:
        """Each online node's share of ``clients`` as positions in it, after :meth:`refresh`; a client whose
        partition has no node online is in no share."""
        self.refresh(grid, clients, wait_s)
        shares: dict[int, list[int]] = {}
        for row, client in enumerate(clients):
            node = self.host(client)
            if node is not None:
                shares.setdefault(node, []).append(row)
        return shares

    def look(self, grid) -> dict[int, tuple[bytes, str]]:
        """The online nodes: their public key and when they last connected (a node id where Flower has no key)."""
        self.simulation = simulated(grid)
        nodes = {int(info.node_id): (bytes(info.public_key) or f"node-{info.node_id}".encode(),
                                     str(info.last_activated_at)) for info in grid.get_nodes()}
        self.online = set(nodes)
        for node in [n for n in self.partition if n not in nodes or nodes[n][1] != self.started.get(n)]:
            del self.partition[node]  # gone, or restarted (then asked again)
        for node in [n for n in self.silent if n in nodes and nodes[n][1] != self.started.get(n)]:
            del self.silent[node]  # restarted (with authentication, under its node id): a fresh start
        for node, (key, started) in nodes.items():
            self.keys[node], self.started[node] = key, started
        return nodes

    def refresh(self, grid, clients: list[int], wait_s: float) -> None:
        """Learns the partitions of new nodes until every client in ``clients`` has a host, or ``wait_s`` passed.
        A node that does not answer its query in time is asked again on the next call."""
        deadline = time.monotonic() + wait_s
        slow: set[int] = set()
        while True:
            self.look(grid)
            new = [n for n in sorted(self.online - set(self.partition) - set(self.silent) - slow) if self.known(n)]
            if new:
                slow |= self._ask(grid, new)
            if all(self.host(c) is not None for c in clients) or time.monotonic() >= deadline:
                return
            time.sleep(0.2)

    def _ask(self, grid, nodes: list[int]) -> set[int]:
        """Asks ``nodes`` for their partition; returns those that did not answer in time."""
        replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(
            [Message(RecordDict(), dst_node_id=n, message_type=QUERY) for n in nodes], timeout=self.query_timeout)}
        slow = set()
        for node in nodes:
            reply = replies.get(node)
            if reply is None:
                log.warning("node %s did not answer fedflat's query in %.0f s: asked again later", node,
                            self.query_timeout)
                slow.add(node)
                continue
            try:
                partition, partitions = claimed_partition(reply)
            except BadReply as err:
                log.warning("node %s left out: %s", node, err)
                self.leave_out(node, str(err))
                continue
            if self.partitions is not None and partitions != self.partitions:
                why = (f"it claims partition {partition} of num-partitions={partitions}, the federation has "
                       f"{self.partitions} ("
                       + ("the run config's num-partitions)" if self.operators else
                          f"its first {'enrolled ' if self.roster else ''}node said so)"))
                log.warning("node %s left out: %s", node, why)
                self.leave_out(node, why)
                continue
            refused = self.refusal(node, partition)
            if refused and self.roster:
                log.warning("node %s left out: %s", node, refused)
                self.leave_out(node, refused)
                continue
            if refused:  # (its holder may be a node that died: it goes offline within Flower's heartbeat)
                log.warning("node %s not used for now: %s", node, refused)
                slow.add(node)
                continue
            self.partitions = partitions
            self.partition.pop(node, None)
            self.partition[node] = partition
        return slow

    def known(self, node: int) -> bool:
        """Whether ``node`` may be asked for its partition: without a roster any node; with one, a node whose key the
        roster lists (a stranger is left out here, before anything is sent to it or read from it)."""
        if not self.roster or self.keys.get(node) in self.roster.values():
            return True
        why = (f"its public key {fingerprint(self.keys.get(node, b''))} is not in node-keys: a node the operator did "
               "not enrol (nothing was sent to it)")
        log.warning("node %s left out: %s", node, why)
        self.leave_out(node, why)
        return False

    def refusal(self, node: int, partition: int) -> str:
        """Why ``node`` may not hold ``partition`` ('' when it may): the roster names another key, or another
        online node holds it."""
        if self.roster:
            if partition not in self.roster:
                return f"it claims partition {partition}, which node-keys does not list"
            if self.roster[partition] != self.keys.get(node):
                return (f"it claims partition {partition}, but its public key is not the one node-keys names for it "
                        f"({fingerprint(self.keys.get(node, b''))} is not {fingerprint(self.roster[partition])})")
            return ""
        holders = [n for n, p in self.partition.items() if p == partition and n != node and n in self.online]
        if holders:
            return (f"it claims partition {partition}, which node {holders[0]} (key "
                    f"{fingerprint(self.keys.get(holders[0], b''))}) holds: a partition has one node")
        return ""


def fingerprint(key: bytes) -> str:
    """A public key's short name in messages: ``SHA256:`` and the first 16 hex digits of its digest."""
    return "SHA256:" + hashlib.sha256(key).hexdigest()[:16]


def claimed_partition(reply) -> tuple[int, int]:
    """The partition a node's query reply claims, or a :class:`BadReply` (an error, or a malformed claim)."""
    if reply.has_error():
        raise BadReply(f"its query failed: {error_line(reply.error.reason)}")
    try:
        info = reply.content["node"]
        partition, partitions = int(info["partition-id"]), int(info["num-partitions"])
    except Exception as err:  # whatever a node sends: never the server's crash
        raise BadReply(f"its answer to fedflat's query is not a partition ({type(err).__name__}: {err})") from None
    if not 0 <= partition < partitions:
        raise BadReply(f"it claims partition {partition} of {partitions}")
    return partition, partitions


def exchange(grid, messages: list, timeout: float, federation: Federation, poll_s: float = 0.5) -> list:
    """``grid.send_and_receive`` that stops waiting for a node as soon as it cannot answer: it went offline
    (Flower's heartbeat: an error reply), or it restarted (it connected again since the message went out: the
    message died with the old process). Otherwise it waits up to ``timeout`` seconds."""
    online = federation.look(grid)  # (before the push: a node that restarts later cannot have them)
    nodes = [m.metadata.dst_node_id for m in messages]
    before = {node: online[node][1] if node in online else None for node in nodes}
    pending = dict(zip(grid.push_messages(messages), nodes))
    deadline, replies, last_look = time.monotonic() + timeout, [], time.monotonic()
    while pending and time.monotonic() < deadline:
        for reply in grid.pull_messages(list(pending)):
            pending.pop(reply.metadata.reply_to_message_id, None)
            replies.append(reply)
        if pending and time.monotonic() - last_look >= 5 * poll_s:
            last_look, nodes = time.monotonic(), federation.look(grid)
            for mid, node in list(pending.items()):
                if node in nodes and nodes[node][1] != before[node]:
                    log.warning("node %s connected again since its message was sent: it will not answer it", node)
                    del pending[mid]
        if pending:
            time.sleep(poll_s)
    return replies


def simulated(grid) -> bool:
    """Whether ``grid`` is Flower's simulation (virtual nodes in this process), not a deployment."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


def first_replies(replies: Iterable, expected: dict[int, list[int]]) -> dict[int, Any]:
    """The first reply of every node in ``expected`` (a node answers once; replies from other nodes are ignored)."""
    first: dict[int, Any] = {}
    for reply in replies:
        node = reply.metadata.src_node_id
        if node in expected and node not in first:
            first[node] = reply
    return first


class FedflatStrategy(Strategy):
    """A Flower strategy running a fedflat recipe's server (see the module docstring).

    ``round_timeout``: seconds a round waits for the nodes' replies; ``wait_s``: seconds a round waits for
    a node of every partition with sampled clients to be online (a restarted node). Clients whose node is
    missing, failed, timed out or sent an incomplete reply are left out of the round's aggregation, and
    its metrics line says how many (``dropped``; the summary names them).
    """

    def __init__(self, sim: Simulation, round_timeout: float = 600.0, wait_s: float = 120.0,
                 query_timeout: float = 60.0, roster: dict[int, bytes] | None = None, insecure: bool = False,
                 partitions: int | None = None):
        if sim.cfg.executor.name != "local":
            raise ConfigError("a Flower federation trains its clients on the SuperNodes: remove executor.name="
                              f"{sim.cfg.executor.name} from the config")
        if sim.cfg.secure_aggregation is not None and sim.model.buffer_layout.size:
            raise ConfigError("secure_aggregation: this model has buffers (BatchNorm statistics), whose counts and "
                              "variances SecAgg+'s clipping range does not hold; use a model without them (e.g. "
                              "model.norm=group)")
        self.sim, self.round_timeout, self.wait_s = sim, round_timeout, wait_s
        self.server = sim.server  # the run's Server: the nodes train in place of the executor
        self.federation = Federation(query_timeout, roster, partitions)
        self.insecure, self.checked = insecure, False
        self.opened: OpenRound | None = None
        self.layout: UploadLayout | None = None  # what a client's upload holds this round (upload_layout)
        self.sent: dict[int, list[int]] = {}  # node -> the clients of its message this round
        self.evaluating: dict[int, list[int]] = {}  # node -> the clients of its evaluate message
        self.wire_down = 0

    # -- Flower's Strategy --------------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays, config, grid) -> list:
        """Round ``server_round`` (1-based): samples with fedflat's keyed stream, builds the broadcast once,
        and sends each node hosting sampled clients their share (the model, the shared server entries, the
        clients' personal rows and task). ``arrays`` and ``config`` are Flower's; fedflat's server state is
        the authority."""
        if self.sim.cfg.secure_aggregation is not None:
            raise ConfigError("secure_aggregation: Flower's Strategy.start loop sends plain train messages, which the "
                              "nodes refuse; run the config with fedflat.flower.serve (its ServerApp, fedflat "
                              "flower-app, flower-sim), whose rounds run Flower's SecAgg+ workflow")
        self.check_deployment(grid)
        opened = self.server.begin_round(server_round - 1)
        by_node = self.federation.by_host(grid, opened.task.ids.tolist(), self.wait_s)
        if not by_node:
            raise NoClients(f"round {server_round}: no node hosts any of the {len(opened.task.ids)} sampled clients: "
                            + self.federation.absence(self.wait_s))
        messages, self.sent = [], {}
        for node, rows in by_node.items():
            task = opened.task.rows(torch.tensor(rows, dtype=torch.long))
            state_rounds = self.server.aggregated_round[task.ids].tolist()
            content = task_content(opened.broadcast.for_clients(task.ids), task, state_rounds,
                                   self.sim.report.base_hash)
            messages.append(Message(content, dst_node_id=node, message_type="train"))
            self.sent[node] = task.ids.tolist()
        self.opened, self.layout = opened, upload_layout(self.sim, opened)
        self.wire_down = sum(wire_bytes(m.content) for m in messages)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable) -> tuple[Any, Any]:
        """Checks every reply whole and aggregates the clients that answered, in ascending id order; returns
        the new global model and the round's metrics as Flower records."""
        result, wire_up = self.collect(replies)
        round = self.server.finish_round(self.opened, result)
        round.log.update(wire_down_bytes=float(self.wire_down), wire_up_bytes=float(wire_up))
        if self.federation.silent:  # (named, with their reasons, in the warnings that left them out)
            round.log["nodes_left_out"] = float(len(self.federation.silent))
        self.opened = None
        metrics = {"train_loss": round.train_loss, "drift": round.drift, "clients": round.clients,
                   "dropped": len(round.dropped), **round.log}
        return self.global_arrays(), MetricRecord(metrics)

    def collect(self, replies: Iterable) -> tuple[ClientResult, int]:
        """The result of every node whose reply is whole and what the server expects (:func:`read_result`: this
        round's, the clients it was sent, the layout the method uploads); the others are logged and their clients
        left out. Also the bytes of the arrays that came back."""
        results, wire, problems = {}, {}, {}
        answered = first_replies(replies, self.sent)
        for node, reply in answered.items():
            try:
                most = most_backprops(self.sim, self.opened, self.layout, self.sent[node])
                results[node] = read_result(reply_content(reply), self.sent[node], self.layout, self.opened.ctx.round,
                                            most)
                wire[node] = wire_bytes(reply.content)
            except BadReply as err:
                problems[node] = str(err)
                self._left_out(node, err)
        wire_up = sum(wire[n] for n in results)
        for node in set(self.sent) - set(answered):
            log.warning("round %d: node %s did not answer (within %.0f s, or it went offline or restarted): its "
                        "clients %s left out; it is asked again next round", self.opened.ctx.round + 1, node,
                        self.round_timeout, self.sent[node])
            problems[node] = "no answer"
        if not results:  # the run stops: say why (nodes that failed alike, once)
            nodes_by_why: dict[str, list[int]] = {}
            for node, why in sorted(problems.items()):
                nodes_by_why.setdefault(why, []).append(node)
            raise NoClients(f"round {self.opened.ctx.round + 1}: no node's reply could be used: " + "; ".join(
                f"node{'s' if len(n) > 1 else ''} {', '.join(map(str, n))}: {why}" for why, n in nodes_by_why.items()))
        return merge_results(list(results.values())), wire_up

    def _left_out(self, node: int, why) -> None:
        log.warning("round %d: node %s's clients %s left out: %s", self.opened.ctx.round + 1, node, self.sent[node],
                    why)

    def check_deployment(self, grid) -> None:
        """A deployment (real SuperNodes, not Flower's simulation) needs the roster of its nodes' keys
        (``node-keys``), unless the app was written ``--insecure``: otherwise any node that reaches the SuperLink
        could claim a partition and be sent the model."""
        if self.checked:
            return
        self.checked = True
        if simulated(grid):
            return
        if self.insecure:
            log.warning("INSECURE: this app has no node-keys: any SuperNode that reaches the SuperLink may claim a "
                        "partition (write the app with `fedflat flower-app ... --keys DIR`: docs/flower.md)")
        elif not self.federation.roster:
            raise ConfigError("this app has no node-keys, so any SuperNode could claim a partition: write it with "
                              "`fedflat flower-app CONFIG -o APP --keys DIR` (keys from `fedflat flower-keys DIR "
                              "--nodes N`; docs/flower.md), or with --insecure for a trusted test network")

    def configure_evaluate(self, server_round: int, arrays, config, grid) -> list:
        """A personalized method: one ``evaluate`` message per node, for all its clients (the global model and the
        round of each client's current state). Otherwise none: fedflat evaluates the global model centrally
        (:meth:`evaluate`)."""
        if not self.sim.personalized:
            return []
        clients = list(range(self.sim.cfg.data.num_clients))
        # positions in range(N) are the client ids
        by_node = self.federation.by_host(grid, clients, self.wait_s)
        hosted = {c for ids in by_node.values() for c in ids}
        for client in clients:
            if client not in hosted:
                log.warning("evaluation: client %d has no node online: left out", client)
        self.evaluating = by_node
        return [Message(evaluation_content(self.server.w, ids, self.server.aggregated_round[ids].tolist(), self.buffers()),
                        dst_node_id=node, message_type=EVALUATE) for node, ids in by_node.items()]

    def collect_scores(self, replies: Iterable) -> ClientScores:
        """The clients' scores from every node whose reply is whole; the others are logged and left out."""
        scores = ClientScores([], [], [], [])
        answered = first_replies(replies, self.evaluating)
        for node, reply in answered.items():
            try:
                mine = read_scores(reply_content(reply), self.evaluating[node])
            except BadReply as err:
                log.warning("evaluation: node %s's clients %s left out: %s", node, self.evaluating[node], err)
                continue
            for column in ("clients", "correct", "loss", "samples"):
                getattr(scores, column).extend(getattr(mine, column))
        for node in set(self.evaluating) - set(answered):
            log.warning("evaluation: node %s did not answer: its clients %s left out", node, self.evaluating[node])
        return scores

    def aggregate_evaluate(self, server_round: int, replies: Iterable):
        """A personalized method's accuracy and loss, pooled over the clients the nodes scored."""
        if not self.sim.personalized:
            return None
        acc, loss = pooled_accuracy(self.collect_scores(replies))
        return MetricRecord({f"{self.sim.heldout}_acc": acc, f"{self.sim.heldout}_loss": loss})

    def summary(self) -> None:
        cfg = self.sim.cfg
        log.info("fedflat %s on %s: %d clients, %d per round, %d parameters", self.sim.algorithm.label,
                 cfg.data.name, cfg.data.num_clients, cfg.sampling.clients_per_round, self.sim.num_parameters)

    def initial_arrays(self):
        """The global model fedflat starts from (seeded as ``fedflat run``'s), for Flower's ``start``."""
        return self.global_arrays()

    def global_arrays(self):
        """The global model as Flower arrays: its parameters and, for a model that has any, its buffers."""
        return array_record(with_buffers({MODEL: self.server.w}, self.buffers()))

    def buffers(self) -> torch.Tensor | None:
        return self.server.buffers if self.sim.model.buffer_layout.size else None

    def evaluate(self, server_round: int, arrays):
        """Central evaluation of fedflat's global model (Flower's ``evaluate_fn``); None for a personalized method,
        which its nodes evaluate (:meth:`configure_evaluate`)."""
        if self.sim.personalized:
            return None
        acc, loss = self.sim.evaluate()
        return MetricRecord({f"{self.sim.heldout}_acc": acc, f"{self.sim.heldout}_loss": loss})

    # -- fedflat's round loop -----------------------------------------------------------------------------------
    def round_driver(self, grid) -> Callable[[int], RoundResult]:
        """Round ``t`` through the grid, for fedflat's run loop (:func:`fedflat.run`'s ``driver``)."""
        def train_round(t: int) -> RoundResult:
            messages = self.configure_train(t + 1, None, ConfigRecord(), grid)
            replies = exchange(grid, messages, self.round_timeout, self.federation) if messages else []
            self.aggregate_train(t + 1, replies)
            return self.server.last_round

        def evaluate_on_nodes(w: torch.Tensor) -> ClientScores:
            messages = self.configure_evaluate(0, None, ConfigRecord(), grid)
            return self.collect_scores(exchange(grid, messages, self.round_timeout, self.federation)
                                       if messages else [])

        if self.sim.personalized:  # the run loop's evaluations go to the nodes
            self.sim.personal_evaluation = evaluate_on_nodes
        if self.sim.cfg.secure_aggregation is not None:  # the uploads travel under Flower's SecAgg+
            from fedflat.flower.secagg import secure_round

            return lambda t: secure_round(self, grid, t)
        return train_round


def serve(grid, cfg: Config, *, out: str | Path | None = None, run_dir: str | Path | None = None,
          resume: str | Path | None = None, progress: bool = False, round_timeout: float = 600.0,
          wait_s: float = 120.0, roster: dict[int, bytes] | None = None, insecure: bool = False,
          model_fn: Callable[[], Any] | None = None, partitions: int | None = None):
    """Runs ``cfg`` on the federation behind ``grid`` as ``fedflat run`` runs it in one process, and returns
    its :class:`~fedflat.api.History` (run folder, metrics, checkpoints, summary). ``resume`` continues
    the run folder it names from its last checkpoint on the same nodes, whose saved client states the
    checkpoint's per-client rounds select (``rounds`` of ``cfg`` may extend it). ``roster``: partition -> the
    public key of the node that may hold it (:func:`fedflat.flower.keys.read_roster`); a deployment without one
    needs ``insecure``. ``model_fn`` replaces the configured model, as in :func:`fedflat.run` (the nodes' ClientApp
    needs the same one). ``partitions``: the federation's num-partitions as the operator sets it (a node claiming
    another is left out); None: the first accepted node's claim."""
    from fedflat.api import run
    from fedflat.experiments.resume import resume as resume_run

    def driver(sim: Simulation) -> Callable[[int], RoundResult]:
        # (a node learns its partition within wait_s too: a simulation whose ClientApps never start fails then)
        strategy = FedflatStrategy(sim, round_timeout=round_timeout, wait_s=wait_s, query_timeout=min(60.0, wait_s),
                                   roster=roster, insecure=insecure, partitions=partitions)
        strategy.summary()
        return strategy.round_driver(grid)

    if resume:
        history = resume_run(resume, config=cfg, progress=progress, driver=driver, model_fn=model_fn)
    else:
        history = run(cfg, out=out, run_dir=run_dir, progress=progress, announce=progress, driver=driver,
                      model_fn=model_fn)
    if history.summary.get("dropped_clients"):
        log.warning("run %s: %s", history.summary["status"], history.summary.get("reason"))
    return history
