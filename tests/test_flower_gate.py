"""The gate's limits and checks (fedflat/flower/gate.py, admission.py, fleet.py), after an attacker's tries on a
deployment made as docs/flower.md says: access control held, availability and some limits broke. In process here;
against real gate processes, a SuperLink and SuperNodes on 127.0.0.1 (or network namespaces) in the `deploy` tests at
the end of this file."""
from __future__ import annotations

import asyncio
import base64
import time

import pytest

pytest.importorskip("flwr")

from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature  # noqa: E402

from fedflat.core import ConfigError  # noqa: E402
from fedflat.flower.gate import GateLimits, Signatures, forwarded_headers, gate_app  # noqa: E402
from fedflat.flower.keys import make_keys, read_roster, roster_of  # noqa: E402

P384_ORDER = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFC7634D81F4372DDF581A0DB248B0A77AECEC196ACCC52973


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gate") / "keys"
    make_keys(folder, 3, hosts=("127.0.0.1", "localhost", "127.0.0.2"))
    return folder


def node_key(keys, p: int) -> ec.EllipticCurvePrivateKey:
    return serialization.load_ssh_private_key((keys / f"node-{p}").read_bytes(), None)


def signed(key: ec.EllipticCurvePrivateKey, timestamp: str | None = None) -> dict[str, str]:
    from test_flower_door import flower_headers

    return flower_headers(key, timestamp)


# -- the limits a user reads and sets ------------------------------------------------------------------------------
def test_the_gates_limits_are_options_with_safe_defaults_and_a_bad_one_is_one_line():
    """`fedflat flower-gate --help` names every limit with its default; the options make the GateLimits the gate runs
    with; a limit that is not positive, a per-address limit above the overall one, a header cap below a SuperNode's
    head, or more connections than this process may open files for is a clear error before anything listens."""
    import argparse

    from fedflat.flower.commands import GATE_LIMITS, gate_limits, register
    from fedflat.flower.gate import open_files

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["flower-gate", "--keys", "k", "--host", "h"])
    assert gate_limits(args) == GateLimits() == GateLimits(16384, 10.0, 16 << 20, 512, 32, 5.0, 60.0)
    assert set(GATE_LIMITS) == set(GateLimits.__dataclass_fields__)
    args = parser.parse_args(["flower-gate", "--keys", "k", "--host", "h", "--max-connections", "64",
                              "--max-connections-per-address", "8", "--header-timeout", "2.5", "--max-body-bytes",
                              "1000000", "--idle-timeout", "1", "--signature-window", "30", "--max-header-bytes", "8192"])
    assert gate_limits(args) == GateLimits(8192, 2.5, 1000000, 64, 8, 1.0, 30.0)
    for bad, says in [(dict(max_connections=0), "--max-connections 0: a limit of the gate is positive"),
                      (dict(header_timeout=-1.0), "--header-timeout -1.0: a limit of the gate is positive"),
                      (dict(max_connections=8), "--max-connections-per-address 32 is above --max-connections 8"),
                      (dict(max_header_bytes=1000), "--max-header-bytes 1000: a SuperNode's request head takes")]:
        with pytest.raises(ConfigError, match=says):
            GateLimits(**bad)
    with pytest.raises(ConfigError, match=r"--max-connections 100000000 needs 100000164 open files, and this process "
                                          r"may open at most \d+ \(ulimit -Hn\)"):
        open_files(GateLimits(max_connections=100_000_000))
    assert open_files(GateLimits()) >= 512 + 164


# -- what reaches the SuperLink ------------------------------------------------------------------------------------
def test_only_flowers_headers_reach_the_superlink_with_the_nodes_real_address():
    """`X-Forwarded-For`, `Forwarded`, `X-Real-IP` of a node's choosing were passed on, and the SuperLink's uvicorn
    (which trusts them from 127.0.0.1, the gate) wrote that address, or any text, in its log. Only Flower's headers and
    what a SuperNode's request carries are forwarded, and `X-Forwarded-For` is the node's real address."""
    sent = [("host", "gate"), ("content-type", "application/protobuf"), ("accept", "application/protobuf"),
            ("user-agent", "python-httpx/0.28"), ("flwr-public-key", "K"), ("flwr-timestamp", "T"),
            ("flwr-signature", "S"), ("x-flwr-client", "flwr/1.41.0"), ("X-Forwarded-For", "6.6.6.6"),
            ("forwarded", "for=6.6.6.6"), ("x-real-ip", "6.6.6.6"), ("x-forwarded-proto", "http"),
            ("x-forwarded-host", "evil"), ("content-length", "5"), ("connection", "keep-alive"), ("via", "evil")]
    assert forwarded_headers(sent, "10.213.7.2") == [
        ("content-type", "application/protobuf"), ("accept", "application/protobuf"), ("user-agent", "python-httpx/0.28"),
        ("flwr-public-key", "K"), ("flwr-timestamp", "T"), ("flwr-signature", "S"), ("x-flwr-client", "flwr/1.41.0"),
        ("x-forwarded-for", "10.213.7.2")]


def test_a_signature_older_than_the_gates_window_or_used_twice_is_refused(keys):
    """A signature over a 2020 timestamp passed the gate (only the SuperLink's 300 s window stopped it), and within
    300 s the same headers could carry another body (Flower signs the timestamp only). Now the gate refuses a timestamp
    older than its window (here 60 s) or more than 5 s ahead, one without a UTC offset, and a signature it has seen,
    also when re-spelled: ECDSA's (r, n - s) is valid for the same timestamp, and so is another base64 of it."""
    roster = set(read_roster(roster_of(keys)).values())
    key = node_key(keys, 0)
    gate = Signatures(roster, window=60.0)
    now = time.time()
    from datetime import datetime, timezone

    def at(t: float) -> str:
        return datetime.fromtimestamp(t, timezone.utc).isoformat()

    for timestamp in ("2020-01-01T00:00:00+00:00", at(now - 61), at(now + 6)):
        assert "is not within the last 60 s (--signature-window" in gate.refusal(signed(key, timestamp), now)
    naive = datetime.fromtimestamp(now).isoformat()
    assert "not signed by a SuperNode key" in gate.refusal(signed(key, naive), now)
    fresh = signed(key, at(now - 1))
    assert gate.refusal(fresh, now) == ""
    assert gate.refusal(fresh, now + 10) == "fedflat flower-gate: its signature was used before (a replay)\n"
    r, s = decode_dss_signature(base64.b64decode(fresh["flwr-signature"]))
    malleated = {**fresh, "flwr-signature": base64.b64encode(encode_dss_signature(r, P384_ORDER - s)).decode()}
    key.public_key().verify(base64.b64decode(malleated["flwr-signature"]), fresh["flwr-timestamp"].encode(),
                            ec.ECDSA(hashes.SHA256()))
    assert "used before" in gate.refusal(malleated, now + 10)  # (valid, and still the same signature)
    assert gate.refusal(signed(key, fresh["flwr-timestamp"]), now + 10) == ""  # (a new signature of that time: new r)
    assert "not within the last 60 s" in gate.refusal(fresh, now + 70)  # (left the window: refused by its age)
    assert "not signed by a SuperNode key" in gate.refusal(signed(ec.generate_private_key(ec.SECP384R1())), now)
    for t in range(2000):  # (the marks of signatures that left the window are dropped)
        gate.seen[t.to_bytes(32, "big")] = now - 1
    gate.refusal(signed(key), now)
    assert len(gate.seen) < 10


# -- a body, in process --------------------------------------------------------------------------------------------
def asgi_request(app, path: bytes, headers: dict[str, str], chunks, pause: float = 0.0) -> tuple[int, bytes, int]:
    """(status, body, chunks the app read) of a POST of ``path`` whose body arrives as ``chunks`` (bytes each,
    ``pause`` seconds apart), over the ASGI ``app``."""
    sent, read = [], [0]
    chunks = list(chunks)

    async def receive():
        if pause:
            await asyncio.sleep(pause)
        read[0] += 1
        i = read[0] - 1
        if i >= len(chunks):
            await asyncio.sleep(3600)
        return {"type": "http.request", "body": chunks[i], "more_body": i + 1 < len(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "https",
             "path": path.decode(), "raw_path": path, "root_path": "", "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()], "client": ("10.9.9.9", 40000),
             "server": ("127.0.0.2", 9092)}
    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), read[0]


def test_a_body_beyond_the_cap_or_too_slow_is_refused_before_it_is_read_whole(keys, capsys):
    """A roster node's signed 400 MB body grew the gate from 99 to 901 MB and the SuperLink to 779 MB (`await
    request.body()`, unbounded). Now a declared length beyond --max-body-bytes is refused (413) before any of the body
    is read, a streamed one as soon as it passes the cap, a body that pauses longer than --header-timeout with 408;
    each refusal closes the connection and is recorded. A body within the limits is forwarded (502: no SuperLink
    listens behind this gate)."""
    from test_flower_door import free_port

    roster = read_roster(roster_of(keys))
    limits = GateLimits(max_body_bytes=1 << 20, header_timeout=0.5)
    app = gate_app(f"127.0.0.1:{free_port()}", keys / "ca.crt", roster, limits)
    key = node_key(keys, 1)
    path = b"/v1/fleet/push-object"
    status, said, read = asgi_request(app, path, {**signed(key), "content-length": str(400 << 20)}, [b"x"] * 400)
    assert (status, read) == (413, 0) and b"its body of 419430400 bytes is beyond --max-body-bytes 1048576" in said
    status, said, read = asgi_request(app, path, signed(key), [bytes(64 << 10)] * 6400)  # 400 MiB, streamed
    assert (status, read) == (413, 17) and b"its body is beyond --max-body-bytes 1048576" in said
    status, said, read = asgi_request(app, path, signed(key), [b"x"] * 3, pause=1.0)
    assert status == 408 and b"its body paused for more than 0.5 s (--header-timeout)" in said
    assert asgi_request(app, path, signed(key), [bytes(1 << 19)] * 2)[0] == 502  # (exactly the cap: forwarded)
    assert asgi_request(app, path, {**signed(key), "content-length": "abc"}, [b""])[0] == 413
    record = capsys.readouterr().err
    assert "refused POST /v1/fleet/push-object from 10.9.9.9:40000 (413): its body of 419430400 bytes" in record
    assert "(408): its body paused for more than 0.5 s" in record


# -- what a roster node's Fleet requests may carry -----------------------------------------------------------------
def pull_messages_answer(messages: dict[str, tuple[int, int, list[str]]]) -> bytes:
    """A SuperLink's PullMessagesResponse of ``messages``: id -> (run, destination node, its objects' ids)."""
    from flwr.proto.fleet_pb2 import PullMessagesResponse
    from flwr.proto.message_pb2 import Message, Metadata, ObjectTree

    response = PullMessagesResponse()
    for mid, (run, node, objects) in messages.items():
        response.messages_list.append(Message(metadata=Metadata(run_id=run, message_id=mid, dst_node_id=node)))
        response.message_object_trees.append(ObjectTree(object_id=mid, children=[
            ObjectTree(object_id=objects[0], children=[ObjectTree(object_id=o) for o in objects[1:]])]))
    return response.SerializeToString()


def test_a_roster_node_pushes_only_its_own_messages_and_pulls_only_what_it_was_delivered():
    """Flower 1.41's push_messages does not check that a message's source is the node that pushes it, and pull_object
    serves any object of a run to any node that names its id (confirm-message-received deletes any). The gate refuses
    a pushed message whose source is not the signing node, and passes a pull-object (or a confirm) only of an object
    (a message) of a message the SuperLink delivered to that key through the gate, in that run."""
    from flwr.proto.fleet_pb2 import PushMessagesRequest
    from flwr.proto.message_pb2 import (ConfirmMessageReceivedRequest, Message, Metadata, PullObjectRequest,
                                        PushObjectRequest)
    from flwr.proto.node_pb2 import Node

    from fedflat.flower.fleet import Deliveries

    gate = Deliveries(kept=2)
    mine, theirs = b"key of node 11", b"key of node 12"

    def push(node: int, *sources: int) -> bytes:
        return PushMessagesRequest(node=Node(node_id=node), messages_list=[
            Message(metadata=Metadata(run_id=7, src_node_id=s, dst_node_id=0)) for s in sources]).SerializeToString()

    assert gate.refusal(mine, "push-messages", push(11, 11)) == ""
    assert gate.refusal(mine, "push-messages", push(11, 12)) == ("it pushes a message whose source is node 12, not "
                                                                 "the node 11 that signs it")
    assert "source is node 12" in gate.refusal(mine, "push-messages", push(11, 11, 12))
    assert gate.refusal(mine, "push-messages", b"\xff\xff") == ("its body is not a push-messages request of Flower's "
                                                                "Fleet API")

    def pull(run: int, object_id: str) -> bytes:
        return PullObjectRequest(node=Node(node_id=11), run_id=run, object_id=object_id).SerializeToString()

    def confirm(run: int, mid: str) -> bytes:
        return ConfirmMessageReceivedRequest(node=Node(node_id=11), run_id=run, message_object_id=mid).SerializeToString()

    ids = {name: name * 64 for name in "abcdefgh"}  # (object ids are 64 hex digits)
    assert "which is in no message the SuperLink delivered to it" in gate.refusal(mine, "pull-object", pull(7, ids["b"]))
    gate.record(mine, pull_messages_answer({ids["a"]: (7, 11, [ids["b"], ids["c"]])}))
    gate.record(theirs, pull_messages_answer({ids["d"]: (7, 12, [ids["e"]])}))
    for object_id in (ids["a"], ids["b"], ids["c"]):
        assert gate.refusal(mine, "pull-object", pull(7, object_id)) == ""
    assert "in no message the SuperLink delivered" in gate.refusal(mine, "pull-object", pull(7, ids["e"]))  # (theirs)
    assert "of run 8" in gate.refusal(mine, "pull-object", pull(8, ids["b"]))  # (another run)
    assert gate.refusal(mine, "confirm-message-received", confirm(7, ids["a"])) == ""
    assert "did not deliver to it" in gate.refusal(mine, "confirm-message-received", confirm(7, ids["d"]))
    gate.record(mine, pull_messages_answer({ids["f"]: (7, 11, [ids["g"]])}))
    gate.record(mine, pull_messages_answer({ids["h"]: (7, 11, [ids["h"][::-1]])}))
    assert "in no message" in gate.refusal(mine, "pull-object", pull(7, ids["b"]))  # (only the last 2 are kept)
    assert gate.refusal(mine, "pull-object", pull(7, ids["g"])) == ""
    assert gate.refusal(mine, "push-object", PushObjectRequest(run_id=7).SerializeToString()) == ""  # (Flower's check)


# -- connections ---------------------------------------------------------------------------------------------------
def test_connections_count_per_address_an_ipv6_host_by_its_64_and_the_record_stays_short():
    """The ledger the gate admits connections by: at most `max_connections_per_address` from one address (an IPv6
    host is given a /64: its addresses count as one), at most `max_connections` in all; a released connection frees
    its place. The record of refusals writes one line per address and reason every 10 s, then says how many it did
    not write."""
    import io

    from fedflat.flower import admission
    from fedflat.flower.admission import Ledger, Record, address_key

    assert address_key("10.0.0.7") == "10.0.0.7" and address_key("::ffff:10.0.0.7") == "10.0.0.7"
    assert address_key("2001:db8:1:2::1") == address_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    ledger = Ledger(GateLimits(max_connections=5, max_connections_per_address=2))
    assert [ledger.admit("a") for _ in range(3)] == ["", "", "2 connections from this address are open "
                                                             "(--max-connections-per-address 2)"]
    assert [ledger.admit(x) for x in "bbc"] == ["", "", ""]
    assert ledger.admit("d") == "5 connections are open (--max-connections 5)"
    ledger.release("a")
    assert ledger.admit("d") == "" and ledger.by_address == {"a": 1, "b": 2, "c": 1, "d": 1}
    stream = io.StringIO()
    record, clock = Record(stream), [100.0]
    original = admission.time.monotonic
    admission.time.monotonic = lambda: clock[0]
    try:
        for t in (0, 1, 2, 3, 11):
            clock[0] = 100.0 + t
            record.write("a", "connections", f"refused a connection from a ({t})")
        record.write("b", "connections", "refused a connection from b")
    finally:
        admission.time.monotonic = original
    assert stream.getvalue().splitlines() == [
        "refused a connection from a (0)",
        "refused a connection from a (11) (and 3 more like it from this address in the last 11 s)",
        "refused a connection from b"]
