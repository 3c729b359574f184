"""The SuperLink's door to the network (``fedflat flower-gate``): SuperNodes in, the control plane not.

Flower 1.41's SuperLink serves its Fleet API (SuperNodes), its Control API (``flwr run``, ``flwr ls``, ``flwr log``,
``flwr stop``, ``flwr supernode register``) and its Runtime API (the ServerApp's process claims the run and talks to
the nodes) on one HTTP port, and the open-source release authenticates only the Fleet API (SuperNode keys): account
authentication of the Control API (OIDC) is Flower Enterprise's, and the Runtime API's SuperExec secret applies to
``--isolation process`` only. Whoever reaches that port with the public ``ca.crt`` may register a key, submit an app
that then runs on the SuperLink and every node, list the runs and read their logs, or claim a pending run's
ServerApp task (docs/security.md).

So the SuperLink listens on ``127.0.0.1`` (its default ``--host``), where only a shell on its machine reaches it
(the operator: ``flwr`` there), and the gate listens on the address the nodes reach. It serves TLS with the
SuperLink's certificate and forwards to the SuperLink only

- ``POST /v1/fleet/NAME`` (what a SuperNode sends: ``flwr.supernode.fleet_http_client``; exactly that shape, no
  ``..``, no encoded characters, no query),
- signed by a key of the roster (``node-keys.txt`` of ``fedflat flower-keys``): the ``flwr-public-key`` header is
  one of the roster's keys and ``flwr-signature`` its signature of ``flwr-timestamp`` (Flower's SuperNode
  authentication, checked again by the SuperLink, with the key's registration), a timestamp within the gate's
  window (:attr:`~fedflat.flower.limits.GateLimits.signature_window`) and a signature not used before
  (:class:`Signatures`: Flower signs the timestamp only, so a signature seen twice is a replay),
- whose body is within the gate's limits and, for the requests Flower does not check fully, carries what the signer
  may send (:mod:`fedflat.flower.fleet`),

with only the headers Flower's SuperNode sends (:func:`forwarded_headers`: no ``X-Forwarded-For`` or ``Forwarded``
of the node's choosing reaches the SuperLink's log; the gate names the node's real address instead). Everything
else gets ``403`` (another path, or a request the signer may not make), ``401`` (not a fresh signature of a roster
key), ``413``/``408`` (a body beyond the limits), never reaches Flower, and is written to the gate's standard error
(method, path, peer address, why). How many connections, how large and how slow a request may be:
:mod:`fedflat.flower.admission`.
"""
from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import re
import ssl
import sys
import time
from pathlib import Path

from fedflat.core import ConfigError
from fedflat.flower.limits import GateLimits

FLEET_PREFIX = "/v1/fleet/"
PUBLIC_KEY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER = "flwr-public-key", "flwr-signature", "flwr-timestamp"
AHEAD_S = 5.0  # seconds a signature's timestamp may be ahead of the gate's clock (Flower's SYSTEM_TIME_TOLERANCE)
# what a SuperNode's request carries that the SuperLink reads: Flower's own headers (flwr-*, x-flwr-*) and these
FORWARDED = ("content-type", "accept", "accept-encoding", "user-agent")
# (hop-by-hop headers of the SuperLink's answers, and the ones the gate's connection sets itself)
NOT_FORWARDED = {"host", "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                 "upgrade", "content-length"}
UPSTREAM_CONNECTIONS = 100  # the gate's connections to the SuperLink (httpx's pool)
# requests of one roster key the gate holds at once (a SuperNode sends at most three: its main loop's, with two threads
# pushing or pulling objects, and its heartbeat's); each holds a body of at most --max-body-bytes and an answer
IN_FLIGHT_PER_KEY = 8
# connections asyncio accepts at once before the gate's admission closes those beyond its limits (also the listen
# backlog): each holds an open file for that moment
BACKLOG = 256
SPARE_FILES = 64  # open files besides the connections: the keys, the logs, Python's own
REFUSED_PATH = ("fedflat flower-gate: only SuperNodes' Fleet API requests pass here; the Control API (flwr run, ls, "
                "log, stop, supernode register) is served on the SuperLink's machine only (docs/flower.md)\n")
REFUSED_KEY = "fedflat flower-gate: not signed by a SuperNode key of this federation's roster (node-keys.txt)\n"


FLEET_PATH = re.compile(r"/v1/fleet/[a-z]+(-[a-z]+)*")


def is_fleet_path(path: str, raw_path: bytes = b"") -> bool:
    """Whether a request's path is one of the Fleet API's endpoints, ``/v1/fleet/NAME``, exactly: decoded and as
    sent. A prefix test would pass ``/v1/fleet/../control/start-run`` (or ``%2e%2e``), which the forwarding client
    normalizes into a Control API path."""
    sent = raw_path.decode("latin-1")
    return bool(FLEET_PATH.fullmatch(path)) and (not raw_path or bool(FLEET_PATH.fullmatch(sent)))


def signed_by_roster(headers, roster_keys: set[bytes]) -> bool:
    """Whether a request carries Flower's SuperNode authentication by one of ``roster_keys`` (PEM
    SubjectPublicKeyInfo): the public-key header names a roster key, whose signature of the timestamp header
    verifies (ECDSA, as ``flwr.supercore.primitives.asymmetric.sign_message`` makes it)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    try:
        public = base64.b64decode(headers[PUBLIC_KEY_HEADER], validate=True)
        signature = base64.b64decode(headers[SIGNATURE_HEADER], validate=True)
        timestamp = headers[TIMESTAMP_HEADER].encode("ascii")
        if public not in roster_keys:
            return False
        key = load_pem_public_key(public)
        if not isinstance(key, ec.EllipticCurvePublicKey):
            return False
        key.verify(signature, timestamp, ec.ECDSA(hashes.SHA256()))
        return True
    except (KeyError, ValueError, TypeError, UnicodeError, InvalidSignature):
        return False


class Signatures:
    """The SuperNode signatures the gate accepts (:func:`signed_by_roster`), of a timestamp at most ``window`` seconds
    old (and :data:`AHEAD_S` ahead), each once: Flower signs only the timestamp, not the request, so within Flower's own
    window (300 s) the same headers could carry another body. Every honest request is signed anew (ECDSA's random
    nonce), so a signature seen twice is a replay; it is known by its key, timestamp and ``r`` (:func:`replay_mark`),
    which ECDSA's malleability (``s`` to ``n - s``) and another DER or base64 spelling leave as they are. The marks
    are kept until their timestamp leaves the window: at most what the gate verifies in ``window + AHEAD_S``
    seconds, 32 bytes each."""

    def __init__(self, roster_keys: set[bytes], window: float):
        self.roster_keys, self.window = roster_keys, window
        self.seen: dict[bytes, float] = {}  # replay_mark of a signature -> when (time.time) it leaves the window
        self.pruned = 0.0  # when the marks were last pruned

    def refusal(self, headers, now: float | None = None) -> str:
        """Why the request with ``headers`` is not signed as the gate requires ('' when it is; it is then recorded)."""
        now = time.time() if now is None else now
        signed = signed_at(headers.get(TIMESTAMP_HEADER, ""))
        if signed is None:
            return REFUSED_KEY
        if not now - self.window <= signed <= now + AHEAD_S:
            return (f"fedflat flower-gate: its signature's timestamp {headers[TIMESTAMP_HEADER][:40]!r} is not "
                    f"within the last {self.window:g} s (--signature-window; a node's clock must be right within "
                    f"{AHEAD_S:g} s)\n")
        if not signed_by_roster(headers, self.roster_keys):
            return REFUSED_KEY
        mark = replay_mark(headers)
        self._forget(now)
        if mark in self.seen:
            return "fedflat flower-gate: its signature was used before (a replay)\n"
        self.seen[mark] = signed + self.window
        return ""

    def _forget(self, now: float) -> None:
        """Drops the marks whose timestamp has left the window (a replay of one is refused by its age), at most once a
        second, once there are more than 1024."""
        if len(self.seen) > 1024 and abs(now - self.pruned) >= 1.0:
            self.seen, self.pruned = {d: until for d, until in self.seen.items() if until >= now}, now


def replay_mark(headers) -> bytes:
    """What tells one signature of a key's from another (the request's headers verified by :func:`signed_by_roster`):
    SHA-256 of the public key, the timestamp and the signature's ``r``, the part of an ECDSA signature that its
    malleability and its encodings cannot change."""
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

    r, _ = decode_dss_signature(base64.b64decode(headers[SIGNATURE_HEADER], validate=True))
    return hashlib.sha256(b"\0".join([base64.b64decode(headers[PUBLIC_KEY_HEADER], validate=True),
                                      headers[TIMESTAMP_HEADER].encode("ascii"), str(r).encode()])).digest()


def signed_at(timestamp: str) -> float | None:
    """The POSIX time of a ``flwr-timestamp`` (ISO 8601 with its UTC offset, as Flower writes it), or None."""
    try:
        when = datetime.datetime.fromisoformat(timestamp)
        return when.timestamp() if when.tzinfo is not None else None
    except (ValueError, TypeError, OverflowError):
        return None


def forwarded_headers(headers, peer: str) -> list[tuple[str, str]]:
    """The headers of a node's request the SuperLink is given: Flower's own (``flwr-*``, ``x-flwr-*``) and
    :data:`FORWARDED`, nothing else (no ``X-Forwarded-For``, ``Forwarded`` or ``X-Real-IP`` a node chose), and
    ``X-Forwarded-For`` set to the node's address ``peer``, which the SuperLink's uvicorn trusts from 127.0.0.1 and
    writes in its log."""
    kept = [(k, v) for k, v in headers if k.lower() in FORWARDED or k.lower().startswith(("flwr-", "x-flwr-"))]
    return kept + [("x-forwarded-for", peer)]


def require_loopback(superlink: str) -> tuple[str, int]:
    """``HOST:PORT`` of the SuperLink behind the gate, which must be a loopback address: elsewhere its Control API
    is open to whoever reaches that address, gate or not."""
    host, _, port = superlink.rpartition(":")
    host = host.strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
        number = int(port)
    except ValueError:
        loopback, number = False, 0
    if not loopback or not 0 < number < 65536:
        raise ConfigError(f"--superlink {superlink}: the SuperLink behind the gate listens on a loopback address "
                          "(flower-superlink --host 127.0.0.1 --port 9093, then --superlink 127.0.0.1:9093): its "
                          "Control API has no authentication, so no other machine may reach it")
    return host, number


def gate_app(superlink: str, ca_certfile: str | Path, roster: dict[int, bytes], limits: GateLimits = GateLimits(),
             timeout_s: float = 3600.0):
    """The gate as an ASGI app: ``POST /v1/fleet/...`` requests freshly signed by a roster key, within ``limits``, are
    forwarded to the SuperLink at ``superlink`` (``HOST:PORT``, TLS verified against ``ca_certfile``); anything else
    is refused, and the connection closed."""
    import httpx
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response

    from fedflat.flower.admission import BodyRefused, Record, read_body
    from fedflat.flower.fleet import Deliveries

    require_loopback(superlink)
    roster_keys = set(roster.values())
    if not roster_keys:
        raise ConfigError("the gate needs the federation's roster: `fedflat flower-keys DIR --nodes N` writes it")
    signatures, deliveries, record = Signatures(roster_keys, limits.signature_window), Deliveries(), Record()
    client = httpx.AsyncClient(base_url=f"https://{superlink}", verify=ssl.create_default_context(
        cafile=str(ca_certfile)), timeout=httpx.Timeout(timeout_s, connect=30.0),
        limits=httpx.Limits(max_connections=UPSTREAM_CONNECTIONS))

    def refuse(request, status: int, why: str):
        host = request.client.host if request.client else "?"
        # the path as sent (percent-encoded, non-ASCII escaped): a decoded `%0a` would forge lines in this record
        sent = (request.scope.get("raw_path") or request.url.path.encode())[:200].decode("ascii", "backslashreplace")
        record.write(host, f"{status} {request.method} {sent}", f"refused {request.method} {sent} from "
                     f"{host}:{request.client.port if request.client else '?'} ({status}): {why.split(': ', 1)[1]}"
                     .rstrip("\n"))  # (the operator's record of who knocked)
        return PlainTextResponse(why, status_code=status, headers={"connection": "close"})

    in_flight: dict[bytes, int] = {}  # roster key -> its requests the gate holds now (answers being sent included)

    def admitted(request):
        """``(None, the signer's key)`` for a Fleet API request freshly signed by a roster key whose key has room for
        it, else ``(the refusal, None)``."""
        if request.method != "POST" or not is_fleet_path(request.url.path, request.scope.get("raw_path", b"")):
            return refuse(request, 403, REFUSED_PATH), None
        why = signatures.refusal(request.headers)
        if why:
            return refuse(request, 401, why), None
        key = base64.b64decode(request.headers[PUBLIC_KEY_HEADER])
        if in_flight.get(key, 0) >= IN_FLIGHT_PER_KEY:
            return refuse(request, 429, f"fedflat flower-gate: {IN_FLIGHT_PER_KEY} requests of this SuperNode's key "
                                        "are in flight already\n"), None
        return None, key

    async def forward(request, send) -> None:
        refusal, key = admitted(request)
        if refusal is not None:
            return await refusal(request.scope, request.receive, send)
        in_flight[key] = in_flight.get(key, 0) + 1
        try:
            response = await signed(request, key)
            await response(request.scope, request.receive, send)  # (a node that does not read holds its place)
        finally:
            in_flight[key] -= 1

    async def signed(request, key: bytes):
        """A request signed by roster ``key``, forwarded when its body is within the limits and Flower's checks."""
        try:
            body = await read_body(request.receive, request.headers.get("content-length"), limits)
        except BodyRefused as refused:
            return refuse(request, refused.status, f"fedflat flower-gate: {refused}\n")
        name = request.url.path.removeprefix(FLEET_PREFIX)
        why = deliveries.refusal(key, name, body)
        if why:
            return refuse(request, 403, f"fedflat flower-gate: {why}\n")
        headers = forwarded_headers(request.headers.items(), request.client.host if request.client else "")
        try:
            answer = await client.post(request.url.path, content=body, headers=headers)  # (no query)
        except httpx.TransportError as err:
            return PlainTextResponse(f"fedflat flower-gate: the SuperLink at {superlink} does not answer ({err})\n",
                                     status_code=502)  # (Flower's SuperNode retries on 502)
        if name == "pull-messages" and answer.status_code == 200:
            deliveries.record(key, answer.content)
        return Response(answer.content, status_code=answer.status_code,
                        headers={k: v for k, v in answer.headers.items() if k.lower() not in NOT_FORWARDED
                                 and k.lower() not in ("content-encoding", "date", "server")})

    async def app(scope, receive, send) -> None:  # every path, every method: no router between a request and forward
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return  # (no websockets)
        await forward(Request(scope, receive), send)

    return app


def open_files(limits: GateLimits) -> int:
    """Raises this process's limit of open files (``RLIMIT_NOFILE``, soft) to what ``limits`` need: every connection
    the gate admits, those accepted at once before it refuses them (:data:`BACKLOG`), its pool to the SuperLink and a
    few more; a :class:`ConfigError` when the hard limit is lower. Returns the limit now in force."""
    import resource

    need = limits.max_connections + BACKLOG + UPSTREAM_CONNECTIONS + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        raise ConfigError(f"--max-connections {limits.max_connections} needs {need} open files, and this process may "
                          f"open at most {hard} (ulimit -Hn): lower --max-connections, or raise the limit")
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        soft = need
    return soft


def serve_gate(keys: str | Path, host: str, port: int, superlink: str = "127.0.0.1:9093",
               limits: GateLimits = GateLimits()) -> None:
    """Runs the gate on ``host:port`` with the TLS certificate, CA and roster of a ``fedflat flower-keys`` folder
    until interrupted (``server.crt`` must name ``host``: ``fedflat flower-keys --host HOST``), within ``limits``:
    uvicorn's h11 protocol with its header cap and idle timeout, and the gate's admission
    (:func:`~fedflat.flower.admission.admission_protocol`)."""
    import uvicorn

    from fedflat.flower.admission import Record, admission_protocol
    from fedflat.flower.keys import ROSTER, read_roster, roster_of

    keys = Path(keys)
    for name in ("ca.crt", "server.crt", "server.key"):
        if not (keys / name).is_file():
            raise ConfigError(f"{keys / name} does not exist: make the deployment's keys with `fedflat flower-keys "
                              f"{keys} --nodes N --host {host}`")
    roster = read_roster(roster_of(keys), str(keys / ROSTER))
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(str(keys / "server.crt"), str(keys / "server.key"))
    open_files(limits)
    app = gate_app(superlink, keys / "ca.crt", roster, limits)
    # (asyncio's own loop: uvloop hands an accepted connection's first bytes to the protocol before start_tls can
    # take them, however early its reading is paused)
    config = uvicorn.Config(app, host=host, port=port, http=admission_protocol(limits, tls, Record()), ws="none",
                            loop="asyncio", backlog=BACKLOG, lifespan="on", access_log=False,
                            log_level="error",  # (refusals: the gate's own record, at most a line per host and reason)
                            h11_max_incomplete_event_size=limits.max_header_bytes,
                            timeout_keep_alive=limits.idle_timeout)  # type: ignore[arg-type]  (a float is fine)
    uvicorn.Server(config).run()
