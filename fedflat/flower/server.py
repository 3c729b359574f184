"""The server side of a Flower federation: a Flower ``Strategy`` that runs a fedflat recipe's server.

:class:`FedflatStrategy` keeps fedflat's server: the global model, the server state and the vectors the
server holds per client (a :class:`~fedflat.engine.simulation.Simulation` whose clients never train in
this process), fedflat's keyed client sampling (not Flower's unseeded ``sample_nodes``), the aggregation
in ascending client-id order whatever order replies arrive in, and central evaluation. Its Flower methods
are the two halves of a round: ``configure_train`` (sample, broadcast, one message per node that hosts
sampled clients) and ``aggregate_train`` (check every reply whole, aggregate the clients that answered). A
personalized method (FedPer) is evaluated on the nodes, where its clients' private entries are:
``configure_evaluate`` and ``aggregate_evaluate``.

:func:`serve` runs it the way ``fedflat run`` runs a config: a run folder with metrics, checkpoints,
summary and final model, progress bar, diagnostics. Flower's own ``Strategy.start`` loop works too.
"""
from __future__ import annotations

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
from fedflat.flower.protocol import (EVALUATE, BadReply, array_record, evaluation_content, read_result, read_scores,
                                     reply_content, task_content, wire_bytes, with_buffers)

log = logging.getLogger("fedflat.flower")

QUERY = "query"  # Flower message type of the discovery message: which partition a node holds
LOG_HINT = ("in a Flower simulation (`flwr run APP` on the local SuperLink) its ClientApps did not start: the "
            "run's log says why (`flwr log RUN_ID`)")


def partition_of(client: int, partitions: int) -> int:
    """The partition (node) that hosts fedflat client ``client``: ``client mod num-partitions``."""
    return client % partitions


class Federation:
    """Which Flower node hosts which fedflat client, learned by asking each node once (a ``query`` message).

    A node that does not answer (a query or a round's task) is left out for the rest of the run; a node
    restarted after a failure comes back under a new node id and is asked again."""

    def __init__(self, query_timeout: float):
        self.query_timeout = query_timeout
        self.partition: dict[int, int] = {}  # node id -> partition
        self.partitions: int | None = None
        self.silent: dict[int, str] = {}  # node id -> why it was left out
        self.online: set[int] = set()

    def leave_out(self, node: int, why: str) -> None:
        """Stops using ``node`` for the rest of the run (it failed to answer)."""
        self.silent[node] = why
        self.partition.pop(node, None)

    def absence(self, wait_s: float) -> str:
        """Why no node hosts a client: the end of the error that stops the run."""
        if not self.online:
            return (f"no Flower node is connected (waited {wait_s:.0f} s): start SuperNodes with --node-config "
                    f"'partition-id=P num-partitions=M', or {LOG_HINT}")
        if not self.partition:
            why = "; ".join(f"node {n}: {reason}" for n, reason in sorted(self.silent.items())) or "none answered"
            return f"every node was left out ({why}): {LOG_HINT}"
        return (f"no node online holds their partitions (nodes online hold {sorted(set(self.partition.values()))} "
                f"of {self.partitions}; waited {wait_s:.0f} s for the others)")

    def host(self, client: int) -> int | None:
        """The node that hosts ``client`` now (the newest one of its partition), or None."""
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

    def refresh(self, grid, clients: list[int], wait_s: float) -> None:
        """Learns the partitions of new nodes until every client in ``clients`` has a host, or ``wait_s`` passed."""
        deadline = time.monotonic() + wait_s
        while True:
            online = self.online = set(grid.get_node_ids())
            for node in [n for n in self.partition if n not in online]:
                del self.partition[node]
            new = sorted(online - set(self.partition) - set(self.silent))
            if new:
                self._ask(grid, new)
            if all(self.host(c) is not None for c in clients) or time.monotonic() >= deadline:
                return
            time.sleep(0.2)

    def _ask(self, grid, nodes: list[int]) -> None:
        replies = {r.metadata.src_node_id: r for r in grid.send_and_receive(
            [Message(RecordDict(), dst_node_id=n, message_type=QUERY) for n in nodes], timeout=self.query_timeout)}
        for node in nodes:
            reply = replies.get(node)
            if reply is None or reply.has_error() or not reply.has_content():
                why = (f"its query failed: {reply.error.reason}" if reply is not None and reply.has_error() else
                       f"no answer to fedflat's query in {self.query_timeout:.0f} s")
                log.warning("node %s left out: %s", node, why)
                self.leave_out(node, why)
                continue
            info = reply.content["node"]
            partition, partitions = int(info["partition-id"]), int(info["num-partitions"])
            if self.partitions is not None and partitions != self.partitions:
                raise ConfigError(f"node {node} has num-partitions={partitions}, other nodes {self.partitions}: "
                                  "every node of a federation needs the same num-partitions")
            self.partitions = partitions
            self.partition.pop(node, None)
            self.partition[node] = partition  # last in: the newest node of its partition


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
                 query_timeout: float = 60.0):
        if sim.cfg.executor.name != "local":
            raise ConfigError("a Flower federation trains its clients on the SuperNodes: remove executor.name="
                              f"{sim.cfg.executor.name} from the config")
        self.sim, self.round_timeout, self.wait_s = sim, round_timeout, wait_s
        self.federation = Federation(query_timeout)
        self.opened: OpenRound | None = None
        self.sent: dict[int, list[int]] = {}  # node -> the clients of its message this round
        self.evaluating: dict[int, list[int]] = {}  # node -> the clients of its evaluate message
        self.wire_down = 0

    # -- Flower's Strategy --------------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays, config, grid) -> list:
        """Round ``server_round`` (1-based): samples with fedflat's keyed stream, builds the broadcast once,
        and sends each node hosting sampled clients their share (the model, the shared server entries, the
        clients' personal rows and task). ``arrays`` and ``config`` are Flower's; fedflat's server state is
        the authority."""
        opened = self.sim.begin_round(server_round - 1)
        by_node = self.federation.by_host(grid, opened.task.ids.tolist(), self.wait_s)
        if not by_node:
            raise NoClients(f"round {server_round}: no node hosts any of the {len(opened.task.ids)} sampled clients: "
                            + self.federation.absence(self.wait_s))
        messages, self.sent = [], {}
        for node, rows in by_node.items():
            task = opened.task.rows(torch.tensor(rows, dtype=torch.long))
            state_rounds = self.sim.aggregated_round[task.ids].tolist()
            content = task_content(opened.broadcast.for_clients(task.ids), task, state_rounds)
            messages.append(Message(content, dst_node_id=node, message_type="train"))
            self.sent[node] = task.ids.tolist()
        self.opened = opened
        self.wire_down = sum(wire_bytes(m.content) for m in messages)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable) -> tuple[Any, Any]:
        """Checks every reply whole and aggregates the clients that answered, in ascending id order; returns
        the new global model and the round's metrics as Flower records."""
        result, wire_up = self.collect(replies)
        round = self.sim.finish_round(self.opened, result)
        round.log.update(wire_down_bytes=float(self.wire_down), wire_up_bytes=float(wire_up))
        self.opened = None
        metrics = {"train_loss": round.train_loss, "drift": round.drift, "clients": round.clients,
                   "dropped": len(round.dropped), **round.log}
        return self.global_arrays(), MetricRecord(metrics)

    def collect(self, replies: Iterable) -> tuple[ClientResult, int]:
        """The result of every node whose reply is whole (:func:`read_result`); the others are logged and their
        clients left out. Also the bytes of the arrays that came back."""
        results, wire, problems = {}, {}, {}
        size = self.sim.num_parameters
        answered = first_replies(replies, self.sent)
        for node, reply in answered.items():
            try:
                results[node] = read_result(reply_content(reply), self.sent[node], size,
                                            self.sim.algorithm.wire_entries())
                wire[node] = wire_bytes(reply.content)
            except BadReply as err:
                problems[node] = str(err)
                self._left_out(node, err)
        # every node runs the same method: an upload whose entries differ from the others' is incomplete
        shapes = [frozenset(r.upload) for r in results.values()]
        usual = max(set(shapes), key=lambda k: (shapes.count(k), len(k)), default=None)
        for node in [n for n, r in results.items() if frozenset(r.upload) != usual]:
            self._left_out(node, f"its upload has entries {sorted(results.pop(node).upload)}, the other nodes' "
                                 f"{sorted(usual)}")
        wire_up = sum(wire[n] for n in results)
        for node in set(self.sent) - set(answered):
            log.warning("round %d: node %s did not answer in %.0f s: its clients %s left out", self.opened.ctx.round
                        + 1, node, self.round_timeout, self.sent[node])
            problems[node] = f"no answer in {self.round_timeout:.0f} s"
            self.federation.leave_out(node, problems[node])
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
        return [Message(evaluation_content(self.sim.w, ids, self.sim.aggregated_round[ids].tolist(), self.buffers()),
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
        return array_record(with_buffers({MODEL: self.sim.w}, self.buffers()))

    def buffers(self) -> torch.Tensor | None:
        return self.sim.buffers if self.sim.model.buffer_layout.size else None

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
            replies = grid.send_and_receive(messages, timeout=self.round_timeout) if messages else []
            self.aggregate_train(t + 1, replies)
            return self.sim.last_round

        def evaluate_on_nodes(w: torch.Tensor) -> ClientScores:
            messages = self.configure_evaluate(0, None, ConfigRecord(), grid)
            return self.collect_scores(grid.send_and_receive(messages, timeout=self.round_timeout) if messages else [])

        if self.sim.personalized:  # the run loop's evaluations go to the nodes
            self.sim.personal_evaluation = evaluate_on_nodes
        return train_round


def serve(grid, cfg: Config, *, out: str | Path | None = None, run_dir: str | Path | None = None,
          resume: str | Path | None = None, progress: bool = False, round_timeout: float = 600.0,
          wait_s: float = 120.0, model_fn: Callable[[], Any] | None = None):
    """Runs ``cfg`` on the federation behind ``grid`` as ``fedflat run`` runs it in one process, and returns
    its :class:`~fedflat.api.History` (run folder, metrics, checkpoints, summary). ``resume`` continues
    the run folder it names from its last checkpoint on the same nodes, whose saved client states the
    checkpoint's per-client rounds select (``rounds`` of ``cfg`` may extend it). ``model_fn`` replaces the
    configured model, as in :func:`fedflat.run` (the nodes' ClientApp needs the same one)."""
    from fedflat.api import run
    from fedflat.experiments.checkpoint import resume as resume_run

    def driver(sim: Simulation) -> Callable[[int], RoundResult]:
        # (a node learns its partition within wait_s too: a simulation whose ClientApps never start fails then)
        strategy = FedflatStrategy(sim, round_timeout=round_timeout, wait_s=wait_s, query_timeout=min(60.0, wait_s))
        strategy.summary()
        return strategy.round_driver(grid)

    if resume:
        return resume_run(resume, config=cfg, progress=progress, driver=driver, model_fn=model_fn)
    return run(cfg, out=out, run_dir=run_dir, progress=progress, announce=progress, driver=driver, model_fn=model_fn)
