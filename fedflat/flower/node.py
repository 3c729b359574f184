"""The client side of a Flower federation: a SuperNode's clients, their data and the state they keep.

A node hosts the fedflat clients of its partition (Flower's ``partition-id`` and ``num-partitions`` node
config: client ``i`` lives on partition ``i mod num-partitions``), loads the configured dataset and split
as ``fedflat run`` would, and trains its sampled clients with fedflat's client runtime
(:func:`fedflat.engine.client.fit`): the same code, batches and random streams as in one process.

The state a method's clients keep (SCAFFOLD's ``c_i``, FedDyn's ``h_i``) never leaves the node. It is
saved on the node's disk after every round, one file per client and round, so a node that is killed and
restarted continues with it. A client's state of round ``t`` becomes current only if the server
aggregated its round-``t`` upload: every task names the last such round per client, and the node
continues from that round's file and deletes the others (a reply lost on the way rolls back).
"""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

import torch

from fedflat.algorithms import renamed_state
from fedflat.config import Config
from fedflat.core import ClientResult, ConfigError
from fedflat.engine.runtime import RoundTask, check_base, rows_loader
from fedflat.engine.simulation import Simulation
from fedflat.flower.protocol import NodeTask, read_evaluation, read_task, result_content, scores_content

DEFAULT_STATE_DIR = Path.home() / ".cache" / "fedflat" / "flower"


class StateLost(RuntimeError):
    """A client's saved state of the round the server names is gone from the node's disk."""


class ClientStates:
    """The state vectors a node's clients keep, on disk: ``client-<i>/round-<t>.pt``, written atomically.
    ``widths``: names whose vectors are not ``size`` float32 entries (a client's own buffers)."""

    def __init__(self, folder: Path, size: int, widths: dict[str, tuple[int, torch.dtype]] | None = None):
        self.folder, self.size, self.widths = Path(folder), size, dict(widths or {})

    def zeros(self, name: str) -> torch.Tensor:
        """The vector ``name`` of a client that has none yet."""
        size, dtype = self.widths.get(name, (self.size, torch.float32))
        return torch.zeros(size, dtype=dtype)

    def _files(self, client: int) -> dict[int, Path]:
        folder = self.folder / f"client-{client}"
        if not folder.is_dir():
            return {}
        return {int(m.group(1)): p for p in folder.iterdir() if (m := re.fullmatch(r"round-(\d+)\.pt", p.name))}

    def current(self, client: int, round: int) -> dict[str, torch.Tensor]:
        """The client's state as of ``round`` (its last aggregated round; -1: none yet, an empty dict). Files
        of every other round are deleted: earlier ones are superseded, later ones were never aggregated."""
        files = self._files(client)
        for r, path in files.items():
            if r != round:
                path.unlink(missing_ok=True)
        if round < 0:
            return {}
        if round not in files:
            raise StateLost(f"client {client}: its state of round {round + 1} is not in {self.folder} (the node's "
                            "state folder was removed or changed): the client cannot continue")
        from fedflat.engine.checkpoint import safe_load

        return renamed_state(safe_load(files[round], f"state of client {client}", "remove the node's state folder "
                                       "(its clients then start afresh)"))

    def save(self, client: int, round: int, state: dict[str, torch.Tensor]) -> None:
        folder = self.folder / f"client-{client}"
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".round-", suffix=".tmp")
        os.close(fd)
        try:
            torch.save({k: v.detach().cpu().clone() for k, v in state.items()}, tmp)
            os.replace(tmp, folder / f"round-{round}.pt")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def rows(self, ids: list[int], rounds: list[int], names: list[str]
             ) -> tuple[list[dict[str, torch.Tensor]], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Every client's current state, and the ``[C, P]`` rows and ``known[C]`` flags the runtime reads."""
        states = [self.current(c, r) for c, r in zip(ids, rounds)]
        rows = {n: torch.stack([s[n] if n in s else self.zeros(n) for s in states]) for n in names}
        known = {n: torch.tensor([n in s for s in states]) for n in names}
        return states, rows, known


class Node:
    """One SuperNode's share of a federation (see the module docstring)."""

    def __init__(self, cfg: Config, partition: int, partitions: int, state_dir: Path, sim: Simulation | None = None):
        """``sim``: the config's :class:`Simulation` (data, split, model and client runtime; its server side
        idles), shared by the nodes a process hosts; built here when not given."""
        if not 0 <= partition < partitions:
            raise ConfigError(f"node config: partition-id={partition} is not in 0..num-partitions-1 ({partitions})")
        self.sim = sim if sim is not None else Simulation(cfg)
        self.partition, self.partitions = partition, partitions
        self.clients = [i for i in range(cfg.data.num_clients) if i % partitions == partition]
        try:  # a node that cannot keep its clients' state says so before it trains any of them
            Path(state_dir).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConfigError(f"this node cannot keep its clients' state in {err.filename or state_dir}: "
                              f"{err.strerror or err} "
                              "(set state-dir, in the node config or the run config, to a writable folder)") from None
        self.states = ClientStates(state_dir, self.sim.num_parameters, self.sim.server.store.widths)

    def check_clients(self, ids: list[int]) -> None:
        foreign = sorted(set(ids) - set(self.clients))
        if foreign:
            raise ConfigError(f"clients {foreign} are not on this node (partition {self.partition} of "
                              f"{self.partitions})")

    def check(self, task: RoundTask) -> None:
        """The server's task fits this node: its clients live here, with the sample counts the server expects."""
        self.check_clients(task.ids.tolist())
        here = self.sim.num_samples.cpu()[task.ids]
        if not torch.equal(here, task.num_samples):
            raise ConfigError(f"this node's split differs from the server's: clients {task.ids.tolist()} hold "
                              f"{here.tolist()} samples here, {task.num_samples.tolist()} on the server (every node "
                              "needs the same dataset, data.partition and seed)")

    def train(self, content):
        """Trains the task's clients from their current state, saves their new state, returns the reply content."""
        job, result = self.fit(content)
        return result_content(result, job.broadcast.round)

    def fit(self, content) -> tuple[NodeTask, ClientResult]:
        """The task in ``content`` and its clients' result, trained from their current state; their new state saved."""
        job = read_task(content)
        self.check(job.task)
        check_base(self.sim.report.base_hash, job.base)
        ids = job.task.ids.tolist()
        names = self.sim.server.client_state_keys
        states, rows, known = self.states.rows(ids, job.state_rounds, names)
        result = self.sim.runtime.fit(job.broadcast, job.task, rows_loader(job.task.ids, rows, known)).to("cpu")
        for row, (client, before) in enumerate(zip(ids, states)):
            # parts that wrote no new value of a vector this round leave the client's previous one
            self.states.save(client, job.broadcast.round, {**before, **{k: v[row] for k, v in result.state.items()}})
        return job, result

    def evaluate(self, content):
        """A personalized evaluation: scores the named clients' own models (the server's global model with their
        private entries, from their current state) on their test shares; the reply content."""
        w, buffers, ids, rounds = read_evaluation(content)
        self.check_clients(ids)
        round_of = dict(zip(ids, rounds))

        def load_state(chunk: torch.Tensor, names: list[str]):
            chunk_ids = chunk.tolist()
            _, rows, known = self.states.rows(chunk_ids, [round_of[c] for c in chunk_ids], names)
            return rows, known

        return scores_content(self.sim.personal_scores(w, ids, load_state, buffers))
