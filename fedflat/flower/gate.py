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
  authentication, checked again by the SuperLink, with the key's registration and the timestamp's age).

Everything else gets ``403`` (another path) or ``401`` (not a roster key), never reaches Flower, and is written to
the gate's standard error (method, path, peer address, why).
"""
from __future__ import annotations

import base64
import ipaddress
import re
import ssl
import sys
from pathlib import Path

from fedflat.core import ConfigError

FLEET_PREFIX = "/v1/fleet/"
PUBLIC_KEY_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER = "flwr-public-key", "flwr-signature", "flwr-timestamp"
# (hop-by-hop headers, and the ones the forwarding connection sets itself)
NOT_FORWARDED = {"host", "connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                 "upgrade", "content-length"}
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


def gate_app(superlink: str, ca_certfile: str | Path, roster: dict[int, bytes], timeout_s: float = 3600.0):
    """The gate as an ASGI app: ``POST /v1/fleet/...`` requests signed by a roster key are forwarded to the
    SuperLink at ``superlink`` (``HOST:PORT``, TLS verified against ``ca_certfile``); anything else is refused."""
    import httpx
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response

    require_loopback(superlink)
    roster_keys = set(roster.values())
    if not roster_keys:
        raise ConfigError("the gate needs the federation's roster: `fedflat flower-keys DIR --nodes N` writes it")
    client = httpx.AsyncClient(base_url=f"https://{superlink}", verify=ssl.create_default_context(
        cafile=str(ca_certfile)), timeout=httpx.Timeout(timeout_s, connect=30.0))

    def refuse(request, status: int, why: str):
        peer = f"{request.client.host}:{request.client.port}" if request.client else "?"
        # the path as sent (percent-encoded, non-ASCII escaped): a decoded `%0a` would forge lines in this record
        sent = (request.scope.get("raw_path") or request.url.path.encode()).decode("ascii", "backslashreplace")
        print(f"refused {request.method} {sent} from {peer} ({status}): {why.split(': ', 1)[1]}",
              end="", file=sys.stderr, flush=True)  # (the operator's record of who knocked)
        return PlainTextResponse(why, status_code=status)

    async def forward(request):
        if request.method != "POST" or not is_fleet_path(request.url.path, request.scope.get("raw_path", b"")):
            return refuse(request, 403, REFUSED_PATH)
        if not signed_by_roster(request.headers, roster_keys):
            return refuse(request, 401, REFUSED_KEY)
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in NOT_FORWARDED]
        try:
            answer = await client.post(request.url.path, content=await request.body(), headers=headers)  # (no query)
        except httpx.TransportError as err:
            return PlainTextResponse(f"fedflat flower-gate: the SuperLink at {superlink} does not answer ({err})\n",
                                     status_code=502)  # (Flower's SuperNode retries on 502)
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
        response = await forward(Request(scope, receive))
        await response(scope, receive, send)

    return app


def serve_gate(keys: str | Path, host: str, port: int, superlink: str = "127.0.0.1:9093") -> None:
    """Runs the gate on ``host:port`` with the TLS certificate, CA and roster of a ``fedflat flower-keys`` folder
    until interrupted (``server.crt`` must name ``host``: ``fedflat flower-keys --host HOST``)."""
    import uvicorn

    from fedflat.flower.keys import ROSTER, read_roster, roster_of

    keys = Path(keys)
    for name in ("ca.crt", "server.crt", "server.key"):
        if not (keys / name).is_file():
            raise ConfigError(f"{keys / name} does not exist: make the deployment's keys with `fedflat flower-keys "
                              f"{keys} --nodes N --host {host}`")
    roster = read_roster(roster_of(keys), str(keys / ROSTER))
    app = gate_app(superlink, keys / "ca.crt", roster)
    uvicorn.run(app, host=host, port=port, ssl_certfile=str(keys / "server.crt"),
                ssl_keyfile=str(keys / "server.key"), log_level="warning", access_log=False)
