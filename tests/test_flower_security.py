"""The Flower deployment's identities, in process: the keys `fedflat flower-keys` makes, a partition bound to one node
(the roster's key, else the first online claimant), a node's bad claim never the server's crash, and a round that
stops waiting for a node that went offline or restarted. (The real SuperLink and SuperNodes: tests/test_flower.py.)"""
from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr")

from cryptography import x509  # noqa: E402
from cryptography.hazmat.primitives import serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402

from fedflat.core import ConfigError  # noqa: E402
from fedflat.flower.keys import make_keys, read_roster, roster_of  # noqa: E402
from fedflat.flower.server import Federation, exchange, fingerprint  # noqa: E402


def test_flower_keys_make_a_ca_a_server_certificate_for_localhost_and_node_keys_flower_reads(tmp_path, capsys):
    from fedflat.cli import main

    assert main(["flower-keys", str(tmp_path / "keys"), "--nodes", "2", "--host", "superlink.lan"]) == 0
    guide = capsys.readouterr().out
    keys = tmp_path / "keys"
    assert f"--ssl-ca-certfile {keys}/ca.crt --ssl-certfile {keys}/server.crt --ssl-keyfile {keys}/server.key" in guide
    assert f"--auth-supernode-private-key {keys}/node-1" in guide and "--enable-supernode-auth" in guide
    ca = x509.load_pem_x509_certificate((keys / "ca.crt").read_bytes())
    server = x509.load_pem_x509_certificate((keys / "server.crt").read_bytes())
    ca.public_key().verify(server.signature, server.tbs_certificate_bytes, ec.ECDSA(server.signature_hash_algorithm))
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert names.get_values_for_type(x509.DNSName) == ["localhost", "superlink.lan"]
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for private in ("ca.key", "server.key", "node-0", "node-1"):
        assert (keys / private).stat().st_mode & 0o077 == 0, private  # the owner's only
    roster = read_roster(roster_of(keys))
    for p in range(2):  # the roster names each node's key as the SuperLink holds it (PEM SubjectPublicKeyInfo)
        node = serialization.load_ssh_private_key((keys / f"node-{p}").read_bytes(), None)
        assert isinstance(node, ec.EllipticCurvePrivateKey) and node.curve.name == "secp384r1"
        assert roster[p] == node.public_key().public_bytes(serialization.Encoding.PEM,
                                                           serialization.PublicFormat.SubjectPublicKeyInfo)
    assert main(["flower-keys", str(keys), "--nodes", "2"]) == 2  # never over existing keys
    assert "--force" in capsys.readouterr().err


def test_flower_app_takes_the_roster_or_an_explicit_insecure_with_a_warning(tmp_path, capsys):
    import tomli

    from fedflat.cli import main

    make_keys(tmp_path / "keys", 2)
    assert main(["flower-app", "rounds=2", "-o", str(tmp_path / "secure"), "--keys", str(tmp_path / "keys")]) == 0
    config = tomli.loads((tmp_path / "secure" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert read_roster(config["node-keys"]) == read_roster(roster_of(tmp_path / "keys")) and not config["insecure"]
    assert main(["flower-app", "rounds=2", "-o", str(tmp_path / "open"), "--insecure"]) == 0
    assert "WARNING: --insecure" in capsys.readouterr().err
    assert tomli.loads((tmp_path / "open" / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]["insecure"]
    assert main(["flower-app", "-o", str(tmp_path / "none"), "--keys", str(tmp_path / "nowhere")]) == 2
    assert "fedflat flower-keys" in capsys.readouterr().err


@pytest.mark.parametrize("line, says", [("0 ssh-rsa AAAA", "line 1: not 'PARTITION-ID PUBLIC-KEY'"),
                                        ("zero", "line 1: not 'PARTITION-ID PUBLIC-KEY'")])
def test_a_bad_roster_line_is_a_clear_error(line, says):
    with pytest.raises(ConfigError, match=says):
        read_roster(line)


# -- a federation's nodes, on a grid that plays Flower's -----------------------------------------------------------
@pytest.fixture(autouse=True)
def messages_outside_a_run(monkeypatch):
    """Flower's Message needs a running ServerApp's run id: the server's queries here are plain addressed records."""
    monkeypatch.setattr("fedflat.flower.server.Message", lambda content, dst_node_id, message_type: message(dst_node_id))


class Grid:
    """Flower's grid as the server sees it: online nodes with their public key and connection time, and what each
    answers to fedflat's query (a partition claim, or any record: a node can send anything)."""

    def __init__(self):
        self.nodes: dict[int, dict] = {}
        self.outbox: dict[str, int] = {}
        self.answers: dict[str, object] = {}
        self.pushed = 0
        self.asked: list[int] = []

    def add(self, node: int, key: bytes, claim, started: str = "t0") -> None:
        self.nodes[node] = {"key": key, "claim": claim, "started": started}

    def get_nodes(self):
        return [SimpleNamespace(node_id=n, public_key=v["key"], last_activated_at=v["started"])
                for n, v in self.nodes.items()]

    def reply(self, node: int, content=None, error: str | None = None):
        return SimpleNamespace(metadata=SimpleNamespace(src_node_id=node, reply_to_message_id=None),
                               has_error=lambda: error is not None, error=SimpleNamespace(reason=error),
                               has_content=lambda: content is not None, content=content)

    def send_and_receive(self, messages, timeout):
        replies = []
        for message in messages:
            self.asked.append(message.metadata.dst_node_id)
            claim = self.nodes[message.metadata.dst_node_id]["claim"]
            partition, partitions = claim if isinstance(claim, tuple) else (None, None)
            content = {"node": {"partition-id": partition, "num-partitions": partitions}} if partition is not None \
                else claim
            replies.append(self.reply(message.metadata.dst_node_id, content))
        return replies


KEY = {name: f"-----BEGIN PUBLIC KEY----- {name}".encode() for name in "ABCD"}


def test_a_partition_goes_only_to_the_node_whose_key_the_roster_names(caplog):
    """The issue-43 attack: a third node claiming partition 0 displaced the real one, and which of two claimants
    won at start was arbitrary. With a roster only the named key holds a partition, whoever asks first."""
    grid = Grid()
    grid.add(7, KEY["C"], (0, 2))  # an impostor, asked first (the smallest node id)
    grid.add(10, KEY["A"], (0, 2))
    grid.add(11, KEY["B"], (1, 2))
    grid.add(12, KEY["B"], (0, 2))  # B's key claiming A's partition
    federation = Federation(60.0, roster={0: KEY["A"], 1: KEY["B"]})
    with caplog.at_level(logging.WARNING, logger="fedflat.flower"):
        federation.refresh(grid, [0, 1, 2, 3], wait_s=0)
    assert federation.partition == {10: 0, 11: 1}
    assert set(federation.silent) == {7, 12}
    # (issue 54: a key the roster does not list is left out before its node is asked anything)
    assert f"its public key {fingerprint(KEY['C'])} is not in node-keys" in federation.silent[7]
    assert 7 not in grid.asked and "not the one node-keys names for it" in federation.silent[12]
    assert any("node 12 left out: it claims partition 0" in r.getMessage() for r in caplog.records)


def test_without_a_roster_a_partition_has_one_node_until_it_goes_offline():
    grid = Grid()
    grid.add(10, KEY["A"], (0, 2))
    grid.add(11, KEY["B"], (1, 2))
    federation = Federation(60.0)
    federation.refresh(grid, [0, 1], wait_s=0)
    grid.add(12, KEY["C"], (0, 2))  # a later claimant of a partition whose node is online
    federation.refresh(grid, [0, 1], wait_s=0)
    assert federation.host(0) == 10 and 12 not in federation.partition and 12 not in federation.silent
    del grid.nodes[10]  # partition 0's node goes offline (killed: Flower's heartbeat ends it): a restart takes over
    federation.refresh(grid, [0, 1], wait_s=0)
    assert federation.host(0) == 12


@pytest.mark.parametrize("claim, says", [
    ({"node": {"partition-id": "zero", "num-partitions": 2}}, "is not a partition (ValueError"),
    ({"node": {}}, "is not a partition (KeyError"),
    ({"other": 1}, "is not a partition (KeyError"),
    ((5, 2), "it claims partition 5 of 2"),
    ((1, 8), "it claims partition 1 of num-partitions=8, the federation has 2 (its first node said so)"),  # issue 54
])
def test_a_malformed_claim_leaves_its_node_out_and_never_crashes_the_server(claim, says):
    grid = Grid()
    grid.add(10, KEY["A"], (0, 2))
    grid.add(11, KEY["B"], claim)
    federation = Federation(60.0)
    federation.refresh(grid, [0, 2], wait_s=0)
    assert federation.partition == {10: 0} and says in federation.silent[11]


def test_a_node_that_restarts_is_asked_for_its_partition_again():
    """With SuperNode authentication a restarted node keeps its node id (its key is registered): its new
    connection time tells the server that its old process, and the messages it held, are gone."""
    grid = Grid()
    grid.add(10, KEY["A"], (0, 2))
    federation = Federation(60.0)
    federation.refresh(grid, [0], wait_s=0)
    grid.add(10, KEY["A"], (1, 2), started="t1")  # restarted, now (say) configured for partition 1
    federation.refresh(grid, [0], wait_s=0)
    assert federation.partition == {10: 1}
    grid.add(11, KEY["B"], {"garbage": 1})
    federation.refresh(grid, [0], wait_s=0)
    assert 11 in federation.silent  # left out ...
    grid.add(11, KEY["B"], (0, 2), started="t1")
    federation.refresh(grid, [0], wait_s=0)
    assert federation.partition == {10: 1, 11: 0} and not federation.silent  # ... until it restarts


class Exchange(Grid):
    """A grid whose nodes answer a task after ``answer_after`` pulls, or never (``None``)."""

    def __init__(self, answer_after: dict[int, int | None], restarts: int | None = None):
        super().__init__()
        self.answer_after, self.pulls, self.ids, self.restarts = answer_after, 0, {}, restarts

    def push_messages(self, messages):
        ids = []
        for m in messages:
            ids.append(f"m{m.metadata.dst_node_id}")
            self.ids[ids[-1]] = m.metadata.dst_node_id
        return ids

    def pull_messages(self, ids):
        self.pulls += 1
        if self.pulls == 2 and self.restarts is not None:  # it restarts after the round's message went out
            self.nodes[self.restarts]["started"] = "t1"
        out = []
        for mid in ids:
            node = self.ids[mid]
            if self.answer_after[node] is not None and self.pulls >= self.answer_after[node]:
                reply = self.reply(node, {"ok": True})
                reply.metadata.reply_to_message_id = mid
                out.append(reply)
        return out


def message(node: int):
    return SimpleNamespace(metadata=SimpleNamespace(dst_node_id=node))


def test_a_round_waits_for_a_slow_node_and_stops_waiting_for_one_that_restarted():
    grid = Exchange({10: 3, 11: None}, restarts=11)  # node 11 restarts: it never answers the round's message
    grid.add(10, KEY["A"], (0, 2))
    grid.add(11, KEY["B"], (1, 2))
    federation = Federation(60.0)
    federation.refresh(grid, [0, 1], wait_s=0)
    start = time.monotonic()
    replies = exchange(grid, [message(10), message(11)], timeout=600.0, federation=federation, poll_s=0.01)
    assert [r.metadata.src_node_id for r in replies] == [10]  # the slow one's reply came; the round did not wait
    assert time.monotonic() - start < 60  # ... for round-timeout (600 s) for the restarted one
    grid = Exchange({10: 40})  # slow, but alive: waited for
    grid.add(10, KEY["A"], (0, 1))
    replies = exchange(grid, [message(10)], timeout=600.0, federation=Federation(60.0), poll_s=0.01)
    assert [r.metadata.src_node_id for r in replies] == [10]


def test_a_deployment_without_node_keys_refuses_to_start_unless_written_insecure(caplog):
    """An app without a roster would give any node that reaches the SuperLink a partition and the model: in a
    deployment (not Flower's simulation, which has no network) it needs `--keys`, or an explicit `--insecure`."""
    from fedflat.api import as_config
    from fedflat.engine.simulation import Simulation
    from fedflat.flower import FedflatStrategy

    sim = Simulation(as_config(None, ["rounds=1", "data.num_clients=2", "sampling.clients_per_round=2", "threads=1"]))
    with pytest.raises(ConfigError, match="this app has no node-keys.*--keys DIR.*--insecure"):
        FedflatStrategy(sim).check_deployment(Grid())
    with caplog.at_level(logging.WARNING, logger="fedflat.flower"):
        FedflatStrategy(sim, insecure=True).check_deployment(Grid())
    assert "INSECURE: this app has no node-keys" in caplog.text
    FedflatStrategy(sim, roster={0: KEY["A"]}).check_deployment(Grid())  # keys: no word


def test_a_deployment_without_nodes_says_so_and_never_blames_a_simulation():
    """A deployment whose SuperNodes could not reach the SuperLink (an intruder had exhausted the gate's open files)
    ended `failed` with "in a Flower simulation ... its ClientApps did not start": wrong, it was a deployment. The
    reason now says which it is: a deployment's points at the SuperNodes' logs and the gate's record of refusals; a
    simulation's still at the run's log."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    class Simulated(InMemoryGrid):  # (Flower's simulation grid, with no node started)
        def __init__(self):
            pass

        def get_nodes(self):
            return []

    for grid, says, never in ((Grid(), "in this deployment no SuperNode of the federation is connected",
                               "Flower simulation"),
                              (Simulated(), "in a Flower simulation (`flwr run APP` on the local SuperLink) its "
                                            "ClientApps did not start", "deployment")):
        federation = Federation(60.0)
        federation.refresh(grid, [0, 1], wait_s=0)
        why = federation.absence(0)
        assert why.startswith("no Flower node is connected (waited 0 s)") and says in why and never not in why, why
    grid = Grid()
    grid.add(10, KEY["A"], {"garbage": 1})
    federation = Federation(60.0)
    federation.refresh(grid, [0], wait_s=0)
    why = federation.absence(0)
    assert why.startswith("every node was left out (node 10: its answer to fedflat's query") and "simulation" not in why
