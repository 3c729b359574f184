"""The federation's door (issue 54): only the operator submits, enrols, lists and reads; a stranger's app runs nowhere.

Flower 1.41 serves the Control API (flwr run/ls/log/stop, supernode register) on the SuperLink's one port, beside the
Fleet API the nodes need, with no authentication in its open-source release. docs/flower.md's deployment therefore
keeps the SuperLink on 127.0.0.1 and lets the nodes in through `fedflat flower-gate` (fedflat/flower/gate.py), which
forwards only Fleet API requests signed by a roster key. These tests try that door as an intruder would.
"""
from __future__ import annotations

import base64
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr")

from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from flwr.supercore.primitives.asymmetric import public_key_to_bytes, sign_message  # noqa: E402

import fedflat  # noqa: E402
from fedflat.core import ConfigError  # noqa: E402
from fedflat.flower import write_app  # noqa: E402
from fedflat.flower.gate import FLEET_PREFIX, gate_app, require_loopback, signed_by_roster  # noqa: E402
from fedflat.flower.keys import make_keys, read_roster, roster_of  # noqa: E402


def flower_headers(key: ec.EllipticCurvePrivateKey, timestamp: str | None = None) -> dict[str, str]:
    """The headers Flower's SuperNode signs its Fleet requests with (flwr.supernode.node_auth_http_interceptor), by
    default of the current time, as Flower's own ``now().isoformat()`` writes it."""
    from flwr.supercore.date import now

    timestamp = now().isoformat() if timestamp is None else timestamp
    return {"flwr-public-key": base64.b64encode(public_key_to_bytes(key.public_key())).decode(),
            "flwr-timestamp": timestamp,
            "flwr-signature": base64.b64encode(sign_message(key, timestamp.encode())).decode()}


def asgi_post(app, raw_path: bytes, headers: dict[str, str], method: str = "POST") -> int:
    """The status the ASGI ``app`` answers a ``method`` request of ``raw_path`` with, sent as is (an HTTP client
    would normalize ``..`` away before sending: an attacker's need not)."""
    import asyncio
    from urllib.parse import unquote

    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "https",
             "path": unquote(raw_path.decode()), "raw_path": raw_path, "root_path": "", "query_string": b"",
             "headers": [(k.encode(), v.encode()) for k, v in headers.items()], "client": ("10.9.9.9", 40000),
             "server": ("127.0.0.2", 9092)}
    asyncio.run(app(scope, receive, send))
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


def test_the_gate_lets_only_roster_signed_fleet_requests_through(tmp_path, capsys):
    """In process: a Control or Runtime API path is refused (403) whoever asks, and so is a Fleet prefix with a way
    out (`/v1/fleet/../control/start-run`: the first version forwarded it, and its HTTP client normalized it into
    the Control API path); a Fleet request is refused (401) unless Flower's own signing function signed its
    timestamp with a roster key; the SuperLink behind the gate must be on a loopback address."""
    from cryptography.hazmat.primitives import serialization

    keys = tmp_path / "keys"
    make_keys(keys, 2)
    roster = read_roster(roster_of(keys))
    node = serialization.load_ssh_private_key((keys / "node-1").read_bytes(), None)
    stranger = ec.generate_private_key(ec.SECP384R1())
    good = flower_headers(node)
    assert signed_by_roster(good, set(roster.values()))
    assert not signed_by_roster(flower_headers(stranger), set(roster.values()))
    assert not signed_by_roster({**good, "flwr-timestamp": "2026-11-27T12:00:01+00:00"}, set(roster.values()))
    forged = {**flower_headers(stranger), "flwr-public-key": good["flwr-public-key"]}  # a roster key, not its owner
    assert not signed_by_roster(forged, set(roster.values()))
    assert not signed_by_roster({}, set(roster.values()))

    app = gate_app(f"127.0.0.1:{free_port()}", keys / "ca.crt", roster)
    for path in (b"/v1/control/start-run", b"/v1/control/register-node", b"/v1/control/list-runs",
                 b"/v1/control/stream-logs", b"/v1/runtime/acquire-task", b"/v1/runtime/push-messages", b"/"):
        assert asgi_post(app, path, good) == 403, path
    assert asgi_post(app, FLEET_PREFIX.encode() + b"pull-messages", good, method="GET") == 403  # only POST
    for headers in ({}, flower_headers(stranger), forged):
        assert asgi_post(app, FLEET_PREFIX.encode() + b"register-node", headers) == 401
    # a roster node's request whose path is a Fleet prefix followed by a way out (the forwarding client normalizes
    # `..`): refused, not forwarded; an exact Fleet path is forwarded (502: no SuperLink listens behind this gate)
    for raw in (b"/v1/fleet/../control/start-run", b"/v1/fleet/%2e%2e/control/start-run",
                b"/v1/fleet/%2E%2E/control/list-runs", b"/v1/fleet/pull-messages/../../control/stream-logs",
                b"/v1/fleet//control/start-run",
                b"/v1/fleet/./../runtime/acquire-task", b"/v1/fleet/Pull-Messages", b"/v1/fleet/"):
        assert asgi_post(app, raw, good) == 403, raw
    assert asgi_post(app, b"/v1/fleet/pull-messages", flower_headers(node)) == 502
    assert asgi_post(app, b"/v1/fleet/pull-messages", flower_headers(stranger)) == 401
    capsys.readouterr()
    forging = b"/v1/control/x%0arefused POST /v1/control/start-run from 10.0.0.1:1 (403): forged"
    assert asgi_post(app, forging, {}) == 403
    record = capsys.readouterr().err  # one line per refusal: a path cannot forge lines in the gate's record
    assert record.count("\n") == 1 and "/v1/control/x%0arefused" in record, record
    for superlink in ("0.0.0.0:9093", "10.1.2.3:9093", "superlink.lan:9093", "127.0.0.1"):
        with pytest.raises(ConfigError, match="loopback address"):
            require_loopback(superlink)
    assert require_loopback("127.0.0.1:9093") == ("127.0.0.1", 9093)


# -- the intruder, against a real deployment -----------------------------------------------------------------------
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Machines:
    """Three "machines" as network namespaces this test makes: the SuperLink's ('link'), the SuperNodes' ('nodes')
    and the intruder's ('intruder'), each joined to the SuperLink's by a veth pair, with addresses inside them only
    (the intruder routes to the SuperLink's machine, which is all it can reach); removed at the end. Without the
    rights to make namespaces (not root, no `ip`), all three are this machine: the SuperLink on 127.0.0.1, the gate
    on 127.0.0.2."""

    def __init__(self):
        self.tag = secrets.token_hex(3)
        self.namespaces: dict[str, str] = {}
        self.gate_ip, self.nodes_ip, self.intruder_ip = "127.0.0.2", "127.0.0.1", "127.0.0.1"
        if os.geteuid() == 0 and shutil.which("ip") and shutil.which("ss") and sys.platform.startswith("linux"):
            try:
                self._make(1 + secrets.randbelow(250))
            except subprocess.CalledProcessError:
                self.close()
                self.namespaces = {}
                self.gate_ip, self.nodes_ip, self.intruder_ip = "127.0.0.2", "127.0.0.1", "127.0.0.1"

    def _make(self, octet: int) -> None:
        net = f"10.213.{octet}"
        for machine in ("link", "nodes", "intruder"):
            self._ip("netns", "add", f"ff-{machine}-{self.tag}")
            self.namespaces[machine] = f"ff-{machine}-{self.tag}"
            self._ip("-n", self.namespaces[machine], "link", "set", "lo", "up")
        link = self.namespaces["link"]
        for other, ends, (here, there) in (("nodes", "ab", (f"{net}.1", f"{net}.2")),
                                           ("intruder", "cd", (f"{net}.5", f"{net}.6"))):
            a, b = f"ff{ends[0]}{self.tag}", f"ff{ends[1]}{self.tag}"
            self._ip("link", "add", a, "netns", link, "type", "veth", "peer", "name", b,
                     "netns", self.namespaces[other])
            for ns, dev, address in ((link, a, here), (self.namespaces[other], b, there)):
                self._ip("-n", ns, "addr", "add", f"{address}/30", "dev", dev)
                self._ip("-n", ns, "link", "set", dev, "up")
            self._ip("-n", self.namespaces[other], "route", "add", "default", "via", here)
        self.gate_ip, self.nodes_ip, self.intruder_ip = f"{net}.1", f"{net}.2", f"{net}.6"

    @staticmethod
    def _ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    @property
    def separate(self) -> bool:
        return bool(self.namespaces)

    def on(self, machine: str) -> list[str]:
        """The command prefix that runs a command on ``machine`` ('link', 'nodes' or 'intruder')."""
        return ["ip", "netns", "exec", self.namespaces[machine]] if self.namespaces else []

    def listening(self, machine: str) -> set[str]:
        """The TCP addresses ``ADDRESS:PORT`` something listens on, on ``machine``."""
        out = subprocess.run([*self.on(machine), "ss", "-Hltn"], check=True, capture_output=True, text=True,
                             timeout=30).stdout
        return {line.split()[3] for line in out.splitlines() if line.strip()}

    def close(self) -> None:
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)  # (their veth ends go too)


PROBE = '''import socket, sys
for address in sys.argv[1:]:
    host, port = address.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(10)
        print(address, s.connect_ex((host, int(port))))
'''


INTRUDER_APP = '''"""A stranger's Flower app: it marks every machine it runs on."""
import os
import time
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

server = ServerApp()
client = ClientApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    markers = Path(str(context.run_config["markers"]))
    (markers / f"superlink-{os.getpid()}").write_text("a stranger's ServerApp ran on the SuperLink\\n")
    nodes, deadline = [], time.monotonic() + 300
    while len(nodes) < int(context.run_config["nodes"]) and time.monotonic() < deadline:
        nodes = list(grid.get_node_ids())
        time.sleep(1)
    list(grid.send_and_receive([Message(RecordDict(), dst_node_id=n, message_type="query") for n in nodes],
                               timeout=300))


@client.query()
def query(message: Message, context: Context) -> Message:
    markers = Path(str(context.run_config["markers"]))
    (markers / f"node-{context.node_id}").write_text(f"a stranger's ClientApp ran on {dict(context.node_config)}\\n")
    return Message(RecordDict({"loot": ConfigRecord({"seen": str(dict(context.node_config))})}), reply_to=message)
'''


RAW_REQUESTS = '''import ssl, sys, httpx
tls = ssl.create_default_context(cafile=sys.argv[2])
for path in ("/v1/runtime/acquire-task", "/v1/runtime/get-nodes", "/v1/control/list-nodes"):
    print(httpx.post(f"https://{sys.argv[1]}{path}", content=b"", verify=tls, timeout=60).status_code)
'''


def intruder_app(folder: Path, markers: Path, nodes: int) -> Path:
    (folder / "intruder_app").mkdir(parents=True)
    (folder / "intruder_app" / "__init__.py").write_text("")
    (folder / "intruder_app" / "apps.py").write_text(INTRUDER_APP)
    (folder / "pyproject.toml").write_text(f'''[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "intruder"
version = "1.0.0"
dependencies = []

[tool.hatch.build.targets.wheel]
packages = ["intruder_app"]

[tool.flwr.app]
publisher = "stranger"

[tool.flwr.app.components]
serverapp = "intruder_app.apps:server"
clientapp = "intruder_app.apps:client"

[tool.flwr.app.config]
markers = "{markers}"
nodes = {nodes}
''')
    return folder


@pytest.mark.slow  # a real deployment and a second run: ~2-3 min on 2 cores
@pytest.mark.deploy
def test_an_intruder_with_a_fresh_key_and_ca_crt_is_refused_everything_and_the_honest_run_completes(tmp_path):
    """docs/flower.md's deployment on three machines (network namespaces this test makes): the SuperLink on its
    machine's 127.0.0.1 and `fedflat flower-gate` on the address the nodes reach; two registered SuperNodes on a
    second machine; an intruder on a third, with a fresh key and only `ca.crt`, trying what issue 54 did: `flwr
    supernode register` of its key, `flwr run` of an app that writes a marker file wherever it runs, `flwr ls`,
    `flwr log` and `flwr stop` of the honest run, raw Runtime API requests, a SuperNode of its own, the SuperLink's
    port and the nodes' ports directly. All are refused (and nothing but the gate listens beyond 127.0.0.1), no
    marker file is written, and the honest run completes with `fedflat run`'s numbers. Then the operator submits
    the same app from the SuperLink's machine: it does write its markers there and on both nodes (the refusal kept
    them out, not the app). Timeouts: none measures this machine's speed (tests/test_flower.py's wait_for_progress)."""
    from test_flower import run_id_of, small, wait_for_progress

    cfg = small("scaffold", "rounds=2", "data.num_clients=4", "sampling.clients_per_round=4")
    machines = Machines()
    keys, strangers = tmp_path / "keys", tmp_path / "strangers"
    make_keys(keys, 2, hosts=("127.0.0.1", "localhost", machines.gate_ip))
    make_keys(strangers, 1)  # the intruder's fresh key (strangers/node-0) and nothing else of its own
    app = write_app(cfg, tmp_path / "app", node_keys=roster_of(keys))
    markers = tmp_path / "markers"
    markers.mkdir()
    stranger_app = intruder_app(tmp_path / "intruder-app", markers, nodes=2)
    runs = tmp_path / "runs"
    link_port, gate_port = free_port(), free_port()
    path = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    processes: dict[str, subprocess.Popen] = {}

    def home(name: str, address: str) -> dict:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.toml").write_text(
            f'[superlink]\ndefault = "here"\n\n[superlink.here]\naddress = "{address}"\n'
            f'root-certificates = "{keys / "ca.crt"}"\n')
        return {**os.environ, "FLWR_HOME": str(tmp_path / name), "PATH": path}

    operator = home("operator", f"127.0.0.1:{link_port}")
    intruder = home("intruder", f"{machines.gate_ip}:{gate_port}")
    direct = home("intruder-direct", f"{machines.gate_ip}:{link_port}")  # the SuperLink's own port, from elsewhere

    def start(name: str, machine: str, *args: str) -> subprocess.Popen:
        with open(tmp_path / f"{name}.log", "ab") as log:
            processes[name] = subprocess.Popen([*machines.on(machine), *args], cwd=tmp_path, env=operator,
                                               stdout=log, stderr=log, start_new_session=True)
        return processes[name]

    def flwr(env: dict, machine: str, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*machines.on(machine), "flwr", *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)

    node_ports: list[int] = []

    def supernode(name: str, key: Path, partition: int, *extra: str, machine: str = "nodes") -> subprocess.Popen:
        node_ports.append(free_port())
        return start(name, machine, "flower-supernode", "--root-certificates", str(keys / "ca.crt"),
                     "--auth-supernode-private-key", str(key), "--superlink", f"{machines.gate_ip}:{gate_port}",
                     "--port", str(node_ports[-1]), *extra, "--node-config",
                     f"partition-id={partition} num-partitions=2 state-dir=\"{tmp_path / 'state'}\"")

    logs = [tmp_path / f"{n}.log" for n in ("superlink", "gate", "node0", "node1")]
    watched = [*logs, runs / "*" / "metrics.jsonl"]
    try:
        start("superlink", "link", "flower-superlink", "--ssl-ca-certfile", str(keys / "ca.crt"), "--ssl-certfile",
              str(keys / "server.crt"), "--ssl-keyfile", str(keys / "server.key"), "--enable-supernode-auth",
              "--host", "127.0.0.1", "--port", str(link_port), "--database", str(tmp_path / "superlink.db"))
        start("gate", "link", sys.executable, "-m", "fedflat.cli", "flower-gate", "--keys", str(keys),
              "--host", machines.gate_ip, "--port", str(gate_port), "--superlink", f"127.0.0.1:{link_port}")
        for p in range(2):  # the operator enrols the nodes, from the SuperLink's machine
            public = str(keys / f"node-{p}.pub")
            wait_for_progress(lambda public=public: flwr(operator, "link", "supernode", "register", public,
                                                         "here").returncode == 0 or None,
                              logs, "the SuperLink to register a node")
        for p in range(2):
            supernode(f"node{p}", keys / f"node-{p}", p)
        wait_for_progress(lambda: all(b"SuperNode ID" in (tmp_path / f"node{p}.log").read_bytes() for p in range(2)),
                          logs, "the nodes to connect through the gate")

        # the intruder: a fresh key, ca.crt, the address the nodes use
        attempts = {
            "register": flwr(intruder, "intruder", "supernode", "register", str(strangers / "node-0.pub"), "here"),
            "run": flwr(intruder, "intruder", "run", str(stranger_app), "here"),
            "ls": flwr(intruder, "intruder", "ls", "here"),
        }
        submitted = flwr(operator, "link", "run", str(app), "here", "--run-config",
                         f"out=\"{runs}\" round-timeout=3600.0 wait-nodes=3600.0")
        honest = run_id_of(submitted)
        attempts["log"] = flwr(intruder, "intruder", "log", honest, "here", "--show")
        attempts["stop"] = flwr(intruder, "intruder", "stop", honest, "here")
        attempts["ls-run"] = flwr(intruder, "intruder", "ls", "--run-id", honest, "here")
        if machines.separate:  # the SuperLink's own port is not reachable from the other machine at all
            attempts["direct-run"] = flwr(direct, "intruder", "run", str(stranger_app), "here")
            attempts["direct-register"] = flwr(direct, "intruder", "supernode", "register",
                                               str(strangers / "node-0.pub"), "here")
        raw = subprocess.run([*machines.on("intruder"), sys.executable, "-c", RAW_REQUESTS,
                              f"{machines.gate_ip}:{gate_port}", str(keys / "ca.crt")],
                             capture_output=True, text=True, timeout=120)
        assert raw.stdout.split() == ["403"] * 3, raw.stdout + raw.stderr  # a pending run's task is not the caller's
        if machines.separate:  # nothing but the gate listens beyond a machine's 127.0.0.1; the intruder reaches no more
            assert {a for a in machines.listening("link") if not a.startswith("127.0.0.1:")} == {
                f"{machines.gate_ip}:{gate_port}"}, machines.listening("link")
            assert all(a.startswith("127.0.0.1:") for a in machines.listening("nodes")), machines.listening("nodes")
            probe = subprocess.run([*machines.on("intruder"), sys.executable, "-c", PROBE,
                                    f"{machines.gate_ip}:{link_port}",
                                    *(f"{machines.nodes_ip}:{port}" for port in node_ports)],
                                   capture_output=True, text=True, timeout=120)
            assert [line.split()[1] != "0" for line in probe.stdout.splitlines()] == [True] * 3, probe.stdout
        stranger_node = supernode("stranger-node", strangers / "node-0", 1, "--max-retries", "3",
                                  "--max-wait-time", "60", machine="intruder")
        wait_for_progress(lambda: stranger_node.poll() is not None, [tmp_path / "stranger-node.log"],
                          "the stranger's SuperNode to give up")
        summary = wait_for_progress(lambda: [json.loads(f.read_text()) for f in runs.glob("*/summary.json")
                                             if json.loads(f.read_text())["status"] != "running"], watched,
                                    "the honest run's end")[0]
        server_log = [line.strip() for line in flwr(operator, "link", "log", honest, "here", "--show").stdout
                      .splitlines() if len(line.strip()) > 30]
        assert server_log  # (what the intruder must not read)
        for name, attempt in attempts.items():
            said = attempt.stdout + attempt.stderr
            assert attempt.returncode != 0, (name, said)
            assert not [line for line in server_log if line in said], (name, said)
        assert "SuperNode ID" not in (tmp_path / "stranger-node.log").read_text(errors="replace")
        knocked = (tmp_path / "gate.log").read_text()
        assert f"refused POST /v1/fleet/activate-node from {machines.intruder_ip}" in knocked, knocked
        assert f"refused POST /v1/control/start-run from {machines.intruder_ip}" in knocked, knocked
        assert sorted(markers.iterdir()) == []  # no code of the stranger ran anywhere
        listed = json.loads(flwr(operator, "link", "ls", "--format", "json").stdout)["runs"]
        assert [r["run-id"] for r in listed] == [honest]  # the operator sees one run: the intruder started none

        # the operator (a shell on the SuperLink's machine) may: the same app then runs everywhere
        control = run_id_of(flwr(operator, "link", "run", str(stranger_app), "here"))
        wait_for_progress(lambda: len(list(markers.iterdir())) >= 3, logs, "the operator's run of the app")
        assert control != honest
    finally:
        for name, process in processes.items():
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait(30)
        machines.close()
    assert summary["status"] == "completed" and "dropped_clients" not in summary, summary.get("reason")
    assert sorted(p.name.split("-")[0] for p in markers.iterdir()) == ["node", "node", "superlink"]
    ours = fedflat.run(cfg, save=False, progress=False).metrics
    theirs = [json.loads(x) for f in runs.glob("*/metrics.jsonl") for x in f.read_text().splitlines()]
    assert [(m["test_acc"], m["test_loss"]) for m in theirs] == [(m["test_acc"], m["test_loss"]) for m in ours]
