"""The gate's limits and checks (fedflat/flower/gate.py, admission.py, fleet.py), after an attacker's tries on a
deployment made as docs/flower.md says: access control held, availability and some limits broke. In process here;
against real gate processes, a SuperLink and SuperNodes on 127.0.0.1 (or network namespaces) in the `deploy` tests at
the end of this file."""
from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature  # noqa: E402

from fedflat.core import ConfigError  # noqa: E402
from fedflat.flower.gate import BACKLOG, GateLimits, Signatures, forwarded_headers, gate_app  # noqa: E402
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
                              "1000000", "--idle-timeout", "1", "--signature-window", "30",
                              "--max-header-bytes", "8192"])
    assert gate_limits(args) == GateLimits(8192, 2.5, 1000000, 64, 8, 1.0, 30.0)
    for bad, says in [(dict(max_connections=0), "--max-connections 0: a limit of the gate is positive"),
                      (dict(header_timeout=-1.0), "--header-timeout -1.0: a limit of the gate is positive"),
                      (dict(max_connections=8), "--max-connections-per-address 32 is above --max-connections 8"),
                      (dict(max_header_bytes=1000), "--max-header-bytes 1000: a SuperNode's request head takes")]:
        with pytest.raises(ConfigError, match=says):
            GateLimits(**bad)
    with pytest.raises(ConfigError, match=r"--max-connections 100000000 needs 100000420 open files, and this process "
                                          r"may open at most \d+ \(ulimit -Hn\)"):
        open_files(GateLimits(max_connections=100_000_000))
    assert open_files(GateLimits()) >= 512 + 420


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
        ("content-type", "application/protobuf"), ("accept", "application/protobuf"),
        ("user-agent", "python-httpx/0.28"),
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


def test_a_roster_key_has_at_most_eight_requests_in_flight(keys):
    """Each request the gate holds for a roster key holds up to --max-body-bytes of body and the SuperLink's answer:
    a key may have 8 in flight at once (a SuperNode sends at most three), the 9th is refused (429) at once, and once
    one ends another is taken; other keys are not held up."""
    from fedflat.flower.gate import IN_FLIGHT_PER_KEY
    from test_flower_door import free_port

    app = gate_app(f"127.0.0.1:{free_port()}", keys / "ca.crt", read_roster(roster_of(keys)))
    key, other = node_key(keys, 1), node_key(keys, 2)

    async def flight() -> list[int]:
        release = asyncio.Event()

        async def request(headers: dict[str, str], wait: bool) -> int:
            sent = []

            async def receive():
                if wait:
                    await release.wait()
                return {"type": "http.request", "body": b"", "more_body": False}

            async def send(message):
                sent.append(message)

            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "https", "path": "/v1/fleet/push-object", "raw_path": b"/v1/fleet/push-object",
                     "root_path": "", "query_string": b"", "client": ("10.9.9.9", 40000), "server": ("127.0.0.2", 9092),
                     "headers": [(k.encode(), v.encode()) for k, v in headers.items()]}
            await app(scope, receive, send)
            return next(m["status"] for m in sent if m["type"] == "http.response.start")

        held = [asyncio.create_task(request(signed(key), True)) for _ in range(IN_FLIGHT_PER_KEY)]
        await asyncio.sleep(0.2)
        refused = await request(signed(key), False)
        others = await request(signed(other), False)
        release.set()
        return [refused, others, *(await asyncio.gather(*held)), await request(signed(key), False)]

    assert IN_FLIGHT_PER_KEY == 8
    assert asyncio.run(flight()) == [429, 502] + [502] * 8 + [502]


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
        request = ConfirmMessageReceivedRequest(node=Node(node_id=11), run_id=run, message_object_id=mid)
        return request.SerializeToString()

    ids = {name: name * 64 for name in "abcdefgh"}  # (object ids are 64 hex digits)
    refused = gate.refusal(mine, "pull-object", pull(7, ids["b"]))
    assert "which is in no message the SuperLink delivered to it" in refused
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


# -- against real gate processes, as an attacker would (make test-deploy) -----------------------------------------
SLOW = r'''"""Slow connections to a gate, as one host opens them: SLOTS connections at once, each reopened (a second
later) as soon as it ends, until DURATION s passed or the file STOP exists; in each a TLS handshake and a request head
trickled a header a second (every third slot: a bare TCP connection that never starts TLS). Prints JSON: attempts,
connections the gate refused at once, TLS handshakes completed, the most of those open at once, the longest of those
held (s). (A bare connection's hold says nothing of the gate: one the kernel completed while the gate's accept queue
was full exists on this side only, and never hears of its end while it sends nothing.)"""
import asyncio, json, os, resource, ssl, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)  # (many sockets)
host, port, slots, duration, source, ca, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), \
    sys.argv[5], sys.argv[6], sys.argv[7]
tls = ssl.create_default_context(cafile=ca)
stats = {"attempts": 0, "refused": 0, "handshakes": 0, "most_open": 0, "longest_s": 0.0}
live = [0]
end = time.monotonic() + duration

async def slot(i):
    while time.monotonic() < end and not os.path.exists(stop):
        stats["attempts"] += 1
        began = time.monotonic()
        bare = i % 3 == 2
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(
                host, port, ssl=None if bare else tls, server_hostname=None if bare else host,
                local_addr=(source, 0) if source else None), 30)
        except (OSError, asyncio.TimeoutError):
            stats["refused"] += 1
            await asyncio.sleep(1)
            continue
        stats["handshakes"] += not bare
        live[0] += not bare
        stats["most_open"] = max(stats["most_open"], live[0])
        try:
            if not bare:
                writer.write(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: gate\r\n")
            while time.monotonic() < end:
                if not bare:
                    writer.write(b"X-Slow: 1\r\n")
                    await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(1024), 1.0) == b"":
                        break
                except asyncio.TimeoutError:
                    pass
        except OSError:
            pass
        live[0] -= not bare
        if not bare:
            stats["longest_s"] = max(stats["longest_s"], round(time.monotonic() - began, 1))
        writer.close()
        await asyncio.sleep(1)

async def main():
    await asyncio.gather(*(slot(i) for i in range(slots)))

asyncio.run(main())
print(json.dumps(stats))
'''

FILL = r'''"""A distributed flood: from each source address, PER connections that complete TLS and send a request
head just below 16 KiB, all held until the gate closes them. Prints JSON: connections open at the peak, and refused."""
import asyncio, json, ssl, sys
host, port, per, ca, sources = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5:]
tls = ssl.create_default_context(cafile=ca)
stats, live = {"peak": 0, "refused": 0}, [0]

async def one(source):
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(
            host, port, ssl=tls, server_hostname=host, local_addr=(source, 0)), 60)
    except (OSError, asyncio.TimeoutError):
        stats["refused"] += 1
        return
    live[0] += 1
    stats["peak"] = max(stats["peak"], live[0])
    try:
        writer.write(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: gate\r\nX-Pad: " + b"a" * 16000 + b"\r\n")
        await writer.drain()
        await asyncio.wait_for(reader.read(), 60)
    except (OSError, asyncio.TimeoutError):
        pass
    live[0] -= 1
    writer.close()

async def main():
    await asyncio.gather(*(one(s) for s in sources for _ in range(per)))

asyncio.run(main())
print(json.dumps(stats))
'''


def memory_kib(pid: int) -> dict[str, int]:
    """The resident memory of process ``pid`` (VmRSS) and its peak (VmHWM), in KiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in status.splitlines())
            if k in ("VmRSS", "VmHWM")}


class Gate:
    """`fedflat flower-gate` as a process of its own on ``host`` (127.0.0.2: the attackers of these tests connect from
    other loopback addresses, 127.0.0.3 and up, each a host of its own), with ``options``, started with at most
    ``files`` open files (a common `ulimit -n`: the attacker's thousands of connections would exhaust it); its
    SuperLink address is a loopback port where nothing listens unless a test starts a SuperLink there."""

    def __init__(self, root: Path, keys: Path, *options: str, host: str = "127.0.0.2", superlink: str = "",
                 prefix: tuple[str, ...] = (), files: int = 1024):
        import resource
        import subprocess
        import sys

        from test_flower_door import free_port

        def limited():
            most = min(files, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
            resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))

        self.host, self.port, self.log, self.keys = host, free_port(), root / "gate.log", keys
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [*prefix, sys.executable, "-m", "fedflat.cli", "flower-gate", "--keys", str(keys), "--host", host,
                 "--port", str(self.port), "--superlink", superlink or f"127.0.0.1:{free_port()}", *options],
                stdout=log, stderr=log, start_new_session=True, preexec_fn=limited)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def wait(self, timeout: float = 120) -> None:
        import socket

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log.read_text()
            try:
                socket.create_connection((self.host, self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"the gate did not listen within {timeout} s: {self.log.read_text()}")

    def idle_kib(self, client, key) -> int:
        """Waits for the gate to listen, sends it five requests signed by ``key`` (the first import what forwarding
        needs) and returns its resident memory then, in KiB: its idle size."""
        self.wait()
        for _ in range(5):
            assert client.post(f"https://{self.address}/v1/fleet/pull-messages", content=b"",
                               headers=signed(key)).status_code == 502
        return memory_kib(self.process.pid)["VmRSS"]

    def files(self) -> int:
        """The gate's open files now."""
        return len(list(Path(f"/proc/{self.process.pid}/fd").iterdir()))

    def close(self) -> None:
        import os
        import signal

        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(30)


@pytest.fixture
def gate_process(keys, tmp_path):
    """A gate process with its default limits, an honest node's client (127.0.0.1) and key, and the gate's idle
    memory in KiB; both ended after the test."""
    gate = Gate(tmp_path, keys)
    client = honest_client(keys)
    try:
        yield gate, client, node_key(keys, 0), gate.idle_kib(client, node_key(keys, 0))
    finally:
        client.close()
        gate.close()


def honest_client(keys: Path):
    """An httpx client that trusts the deployment's CA, as a SuperNode's does."""
    import ssl

    import httpx

    return httpx.Client(verify=ssl.create_default_context(cafile=str(keys / "ca.crt")), timeout=60)


def run_script(script: str, *args: str, timeout: float = 600, prefix: tuple[str, ...] = ()):
    import subprocess
    import sys

    return subprocess.Popen([*prefix, sys.executable, "-c", script, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def loopback_hosts() -> bool:
    """Whether this machine routes all of 127.0.0.0/8 to itself (Linux), so that a test's attackers can be hosts of
    their own (127.0.0.3, ...) beside the honest nodes (127.0.0.1)."""
    import socket
    import sys

    if not sys.platform.startswith("linux"):
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.3", 0))
            return True
        except OSError:
            return False


@pytest.mark.slow  # about a minute: a real gate process and three attacks
@pytest.mark.deploy
@pytest.mark.skipif(not loopback_hosts(), reason="needs 127.0.0.0/8 on the loopback interface (Linux)")
def test_one_host_without_a_key_cannot_grow_the_gate_nor_keep_an_honest_node_out(gate_process, keys,
                                                                                 tmp_path):
    """A real `fedflat flower-gate` process with its default limits, and one host without a key (127.0.0.3) trying
    what the attacker did: a 300 MB request head (it grew the gate from 1.0 to 4.8 GB under httptools, which caps no
    header), then 2000 slow connections (TLS, a header a second) and 1000 bare TCP ones, reopened as fast as they end,
    for 30 s (20,000 of them exhausted the gate's open files: honest signed requests were reset; the gate runs here
    with 1024, a common `ulimit -n`). Now the head is refused (400) within the first 16 MiB sent; at most 32 of the
    host's connections are open at once, none of them longer than the 10 s head timeout (plus its wait to be
    accepted); a signed request from an honest node (127.0.0.1) every half second is answered throughout (502: no
    SuperLink behind this gate) and within 5 s; the gate's open files stay within those 32, the connections it accepts
    at once before refusing them (its backlog, 256) and a few of its own, and its peak memory within 64 MiB of its idle
    size (measured: docs/security.md). Then a roster node's 400 MB body is refused (413) before it is read, whether
    declared or streamed; a connection idle for the 5 s idle timeout is closed; a 2020 signature, a replayed one, a
    push in another node's name and a pull of an object the node was never delivered are refused at the gate."""
    import json
    import socket
    import ssl

    from flwr.proto.fleet_pb2 import PushMessagesRequest
    from flwr.proto.message_pb2 import Message, Metadata, PullObjectRequest
    from flwr.proto.node_pb2 import Node

    gate, client, node, idle = gate_process
    url = f"https://{gate.address}/v1/fleet"

    # a 300 MB request head
    tls = ssl.create_default_context(cafile=str(keys / "ca.crt"))
    with tls.wrap_socket(socket.create_connection((gate.host, gate.port), source_address=("127.0.0.3", 0)),
                         server_hostname=gate.host) as head:
        head.sendall(b"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: gate\r\nX-Big: ")
        sent = 0
        try:
            while sent < 300 << 20:
                head.sendall(bytes(1 << 16))
                sent += 1 << 16
        except OSError:
            pass
        answer = head.recv(200) if sent < 300 << 20 else b""
    assert sent < 16 << 20 and answer.startswith(b"HTTP/1.1 400 "), (sent, answer)

    # thousands of slow connections from one host, an honest node asking meanwhile
    stop = tmp_path / "stop"
    slow = run_script(SLOW, gate.host, str(gate.port), "3000", "30", "127.0.0.3", str(keys / "ca.crt"), str(stop))
    answers, files, began = [], [], time.monotonic()
    while time.monotonic() - began < 30:
        t = time.monotonic()
        status = client.post(f"{url}/pull-messages", content=b"", headers=signed(node)).status_code
        answers.append((status, time.monotonic() - t))
        files.append(gate.files())
        time.sleep(0.5)
    stop.touch()
    out, err = slow.communicate(timeout=120)
    attack = json.loads(out)
    assert attack["attempts"] > 3000 and attack["refused"] > 1000, (attack, err[-2000:])
    assert attack["most_open"] <= 32 and attack["longest_s"] < 25, attack
    assert [s for s, _ in answers] == [502] * len(answers) and max(d for _, d in answers) < 5, answers
    assert max(files) < 32 + BACKLOG + 40, files

    # a roster node's 400 MB body, declared and streamed
    for content in (bytes(400 << 20), (bytes(1 << 20) for _ in range(400))):
        began = time.monotonic()
        refused = client.post(f"{url}/push-object", content=content, headers=signed(node_key(keys, 1)))
        assert refused.status_code == 413 and "beyond --max-body-bytes 16777216" in refused.text, refused.text
        assert time.monotonic() - began < 30
    del content
    peak = memory_kib(gate.process.pid)["VmHWM"]
    print(f"gate memory: idle {idle / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB "
          f"(+{(peak - idle) / 1024:.1f} MiB); attack {attack}; honest answers in at most "
          f"{max(d for _, d in answers):.2f} s; open files at most {max(files)}")
    assert peak - idle < 64 * 1024, (idle, peak)

    # an idle connection is closed after --idle-timeout
    with tls.wrap_socket(socket.create_connection((gate.host, gate.port)), server_hostname=gate.host) as kept:
        headers = "".join(f"{k}: {v}\r\n" for k, v in signed(node).items())
        kept.sendall(f"POST /v1/fleet/pull-messages HTTP/1.1\r\nHost: gate\r\nContent-Length: 0\r\n{headers}\r\n"
                     .encode())
        assert kept.recv(1000).startswith(b"HTTP/1.1 502 ")
        began = time.monotonic()
        kept.settimeout(30)
        while kept.recv(1000):
            pass
        assert 4 < time.monotonic() - began < 15

    # signatures and what a roster node's requests carry
    old = signed(node, "2020-01-01T00:00:00+00:00")
    assert client.post(f"{url}/pull-messages", content=b"", headers=old).status_code == 401
    once = signed(node)
    assert client.post(f"{url}/pull-messages", content=b"", headers=once).status_code == 502
    replayed = client.post(f"{url}/push-object", content=b"another body", headers=once)
    assert replayed.status_code == 401 and "used before (a replay)" in replayed.text
    forged = PushMessagesRequest(node=Node(node_id=11), messages_list=[
        Message(metadata=Metadata(run_id=1, src_node_id=12))]).SerializeToString()
    pushed = client.post(f"{url}/push-messages", content=forged, headers=signed(node))
    assert pushed.status_code == 403 and "whose source is node 12, not the node 11" in pushed.text
    pull = PullObjectRequest(node=Node(node_id=11), run_id=1, object_id="a" * 64).SerializeToString()
    pulled = client.post(f"{url}/pull-object", content=pull, headers=signed(node))
    assert pulled.status_code == 403 and "in no message the SuperLink delivered to it" in pulled.text
    record = gate.log.read_text()
    assert "refused a connection from 127.0.0.3: 32 connections from this address are open" in record
    assert "closed a connection from 127.0.0.3: no whole request head within 10 s (--header-timeout)" in record
    assert "closed a connection from 127.0.0.3: its request head is beyond --max-header-bytes 16384" in record
    assert len(record.splitlines()) < 100, record[-3000:]  # (one line per address and reason every 10 s)


@pytest.mark.slow  # about 40 s
@pytest.mark.deploy
@pytest.mark.skipif(not loopback_hosts(), reason="needs 127.0.0.0/8 on the loopback interface (Linux)")
def test_a_distributed_flood_fills_the_gate_to_its_connection_limit_and_no_further(gate_process, keys):
    """What the limits do not stop, measured: 24 hosts (127.0.1.1-24), each opening 32 connections that send a request
    head just below the 16 KiB cap and hold it, fill the gate's 512 connections; the rest are refused at once, and so
    is an honest node while the gate is full (a firewall's rate limits or more capacity are the answer to a
    distributed flood). The gate's peak memory stays within 0.4 MiB per connection of its idle size (TLS buffers and
    the head: measured in docs/security.md), its open files within the limit, and once the 10 s head timeout closes
    the flood the honest node is served again."""
    import json

    gate, client, node, idle = gate_process
    url = f"https://{gate.address}/v1/fleet/pull-messages"
    client.close()  # (an honest node's kept connection keeps its place: here it asks anew each time)
    flood = run_script(FILL, gate.host, str(gate.port), "32", str(keys / "ca.crt"),
                       *(f"127.0.1.{i}" for i in range(1, 25)))
    full, files = False, 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not full:
        files = max(files, gate.files())
        if files >= 512:
            try:
                with honest_client(keys) as fresh:
                    full = fresh.post(url, content=b"", headers=signed(node)).status_code != 502
            except Exception:  # noqa: BLE001 - refused while full: what this test shows
                full = True
        time.sleep(0.2)
    stats = json.loads(flood.communicate(timeout=120)[0])
    peak = memory_kib(gate.process.pid)["VmHWM"]
    print(f"distributed flood: {stats}; gate memory idle {idle / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB "
          f"(+{(peak - idle) / 1024:.0f} MiB, {(peak - idle) / 512:.0f} KiB a connection); open files {files}")
    assert full and stats["peak"] == 512 and stats["refused"] == 24 * 32 - 512, stats
    assert peak - idle < 512 * 0.4 * 1024 and files < 512 + BACKLOG + 40, (idle, peak, files)
    with honest_client(keys) as again:
        assert again.post(url, content=b"", headers=signed(node)).status_code == 502


FORGED = r'''"""A roster node's request that names an address of its choosing (X-Forwarded-For, Forwarded,
X-Real-IP): the SuperLink refuses it (node id 0 is not this key's), and its log says who asked."""
import base64, ssl, sys, httpx
from cryptography.hazmat.primitives import serialization
from flwr.supercore.date import now
from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message
key = serialization.load_ssh_private_key(open(sys.argv[3], "rb").read(), None)
stamp = now().isoformat()
headers = {"flwr-public-key": base64.b64encode(public_key_to_bytes(key.public_key())).decode(), "flwr-timestamp": stamp,
           "flwr-signature": base64.b64encode(sign_message(key, stamp.encode())).decode(),
           "content-type": "application/protobuf", "X-Forwarded-For": "6.6.6.6", "Forwarded": "for=7.7.7.7",
           "X-Real-IP": "8.8.8.8"}
answer = httpx.post(f"https://{sys.argv[1]}/v1/fleet/pull-messages", content=b"", headers=headers,
                    verify=ssl.create_default_context(cafile=sys.argv[2]), timeout=60)
print(answer.status_code)
'''


@pytest.mark.slow  # a real deployment of three SuperNodes under a flood: ~3 min on 2 busy cores
@pytest.mark.deploy
def test_an_honest_run_completes_while_one_host_keeps_thousands_of_slow_connections_going(tmp_path):
    """docs/flower.md's deployment on three machines (network namespaces this test makes; without them 127.0.0.x
    addresses of this machine): the SuperLink on its machine's 127.0.0.1, `fedflat flower-gate` with its default
    limits on the nodes' network, three registered SuperNodes, and an intruder without a key that keeps 3000 slow
    connections going (reopening each as soon as it ends) from before the operator submits the run to its end. In the
    attacker's try 20,000 such connections exhausted the gate's open files and the honest run ended `failed`
    (NoClients: no node hosts any of the sampled clients). Now at most 32 of the intruder's connections are open at
    once, the SuperNodes keep theirs (none of their connections or requests is refused), and the run completes with
    `fedflat run`'s numbers, no client left out. A roster node's request naming an address of its choosing
    (X-Forwarded-For, Forwarded, X-Real-IP) leaves the nodes' real address in the SuperLink's log, never the chosen
    one. Timeouts: tests/test_flower.py's wait_for_progress."""
    import json
    import os
    import signal
    import subprocess
    import sys

    import fedflat
    from fedflat.flower import write_app
    from test_flower import run_id_of, small, wait_for_progress
    from test_flower_door import Machines, free_port

    cfg = small("scaffold", "rounds=2", "data.num_clients=6", "sampling.clients_per_round=6")
    machines = Machines()
    keys = tmp_path / "keys"
    make_keys(keys, 3, hosts=("127.0.0.1", "localhost", machines.gate_ip))
    app = write_app(cfg, tmp_path / "app", node_keys=roster_of(keys))
    runs, link_port = tmp_path / "runs", free_port()
    path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "config.toml").write_text(
        f'[superlink]\ndefault = "here"\n\n[superlink.here]\naddress = "127.0.0.1:{link_port}"\n'
        f'root-certificates = "{keys / "ca.crt"}"\n')
    operator = {**os.environ, "FLWR_HOME": str(tmp_path / "home"), "PATH": path}
    processes: dict[str, subprocess.Popen] = {}

    def start(name: str, machine: str, *args: str) -> None:
        with open(tmp_path / f"{name}.log", "ab") as log:
            processes[name] = subprocess.Popen([*machines.on(machine), *args], cwd=tmp_path, env=operator,
                                               stdout=log, stderr=log, start_new_session=True)

    def flwr(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*machines.on("link"), "flwr", *args], env=operator, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)

    logs = [tmp_path / f"{n}.log" for n in ("superlink", "node0", "node1", "node2")]
    watched = [*logs, runs / "*" / "metrics.jsonl"]  # (not the gate's log: the flood keeps it growing)
    gate = slow = None
    stop = tmp_path / "stop"
    try:
        start("superlink", "link", "flower-superlink", "--ssl-ca-certfile", str(keys / "ca.crt"), "--ssl-certfile",
              str(keys / "server.crt"), "--ssl-keyfile", str(keys / "server.key"), "--enable-supernode-auth",
              "--host", "127.0.0.1", "--port", str(link_port), "--database", str(tmp_path / "superlink.db"))
        gate = Gate(tmp_path, keys, host=machines.gate_ip, superlink=f"127.0.0.1:{link_port}",
                    prefix=tuple(machines.on("link")))
        for p in range(3):
            wait_for_progress(lambda p=p: flwr("supernode", "register", str(keys / f"node-{p}.pub"), "here")
                              .returncode == 0 or None, logs, "the SuperLink to register a node")
        for p in range(3):
            start(f"node{p}", "nodes", "flower-supernode", "--root-certificates", str(keys / "ca.crt"),
                  "--auth-supernode-private-key", str(keys / f"node-{p}"), "--superlink", gate.address,
                  "--port", str(free_port()), "--node-config",
                  f"partition-id={p} num-partitions=3 state-dir=\"{tmp_path / 'state'}\"")
        wait_for_progress(lambda: all(b"SuperNode ID" in (tmp_path / f"node{p}.log").read_bytes() for p in range(3)),
                          logs, "the nodes to connect through the gate")
        idle = memory_kib(gate.process.pid)["VmRSS"]
        slow = subprocess.Popen([*machines.on("intruder"), sys.executable, "-c", SLOW, gate.host, str(gate.port),
                                 "3000", "1800", "" if machines.separate else "127.0.0.3", str(keys / "ca.crt"),
                                 str(stop)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        intruder = machines.intruder_ip if machines.separate else "127.0.0.3"
        wait_for_progress(lambda: f"refused a connection from {intruder}" in gate.log.read_text(), [gate.log],
                          "the flood to reach the gate's limit")
        honest = run_id_of(flwr("run", str(app), "here", "--run-config",
                                f"out=\"{runs}\" num-partitions=3 round-timeout=3600.0 wait-nodes=3600.0"))
        forged = subprocess.run([*machines.on("nodes"), sys.executable, "-c", FORGED, gate.address,
                                 str(keys / "ca.crt"), str(keys / "node-0")], capture_output=True, text=True,
                                timeout=120)
        assert forged.stdout.split() == ["401"], forged.stdout + forged.stderr  # (the SuperLink's: node id 0)
        summary = wait_for_progress(lambda: [json.loads(f.read_text()) for f in runs.glob("*/summary.json")
                                             if json.loads(f.read_text())["status"] != "running"], watched,
                                    "the honest run's end")[0]
        assert slow.poll() is None  # (the flood went on to the run's end)
        stop.touch()
        attack = json.loads(slow.communicate(timeout=120)[0])
        peak = memory_kib(gate.process.pid)["VmHWM"]
        said = flwr("log", honest, "here", "--show").stdout
    finally:
        stop.touch()
        for process in [*processes.values(), *([slow] if slow else [])]:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(30)
        if gate is not None:
            gate.close()
        machines.close()
    print(f"the flood: {attack}; gate memory idle {idle / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB")
    assert summary["status"] == "completed" and "dropped_clients" not in summary, (summary.get("reason"), said)
    assert attack["attempts"] > 3000 and attack["most_open"] <= 32, attack
    assert peak - idle < 64 * 1024, (idle, peak)
    assert f"from {machines.nodes_ip}" not in gate.log.read_text()  # (the SuperNodes' connections: none refused)
    superlink = (tmp_path / "superlink.log").read_text(errors="replace")
    assert f'{machines.nodes_ip}:0 - "POST /v1/fleet/pull-messages HTTP/1.1" 401' in superlink, superlink[-3000:]
    assert not [a for a in ("6.6.6.6", "7.7.7.7", "8.8.8.8") if a in superlink]
    ours = fedflat.run(cfg, save=False, progress=False).metrics
    theirs = [json.loads(x) for f in runs.glob("*/metrics.jsonl") for x in f.read_text().splitlines()]
    assert [(m["test_acc"], m["test_loss"]) for m in theirs] == [(m["test_acc"], m["test_loss"]) for m in ours]
