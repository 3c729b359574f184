"""``fedflat flower-app`` (a Flower app project for a config), ``fedflat flower-sim`` (a Flower simulation),
``fedflat flower-keys`` (the keys of a secure deployment) and ``fedflat flower-gate`` (its door for SuperNodes)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedflat.cliutil import print_outcome, split_config_and_overrides
from fedflat.core import ConfigError
from fedflat.flower import require_flower


def _config(items: list[str]):
    from fedflat.config import as_config

    return as_config(*split_config_and_overrides(items))


def cmd_flower_app(args: argparse.Namespace) -> int:
    require_flower()
    from fedflat.flower.apps import write_app
    from fedflat.flower.keys import roster_of

    cfg = _config(args.items)
    if args.keys and args.insecure:
        raise ConfigError("--keys and --insecure exclude each other: a deployment with node keys is not insecure")
    roster = roster_of(args.keys) if args.keys else ""
    folder = write_app(cfg, args.out, overwrite=args.force, node_keys=roster, insecure=args.insecure)
    print(f"Flower app: {folder}")
    print(f"  simulation:  flwr run {folder} --stream        (Flower's local SuperLink; `flwr ls`: the runs' "
          "status; docs/flower.md)")
    if args.keys:
        print(f"  deployment:  flwr run {folder} CONNECTION      (on the SuperLink's machine; TLS and SuperNode "
              f"authentication with the keys of {args.keys}: `fedflat flower-keys` printed the commands; partition "
              "P's clients go only to the node holding node-P)")
    elif args.insecure:
        print("WARNING: --insecure: in a deployment any SuperNode that reaches the SuperLink may claim a partition "
              "and be sent the model; use it only on a trusted test network (docs/flower.md)", file=sys.stderr)
        print(f"  deployment:  flwr run {folder} CONNECTION      (SuperNodes started with --node-config "
              f"'partition-id=P num-partitions=M', M <= {cfg.data.num_clients})")
    else:
        print("  deployment:  needs the nodes' keys: `fedflat flower-keys KEYS --nodes M`, then this command with "
              "--keys KEYS (a deployment of this app refuses to start: docs/flower.md)")
    return 0


def cmd_flower_keys(args: argparse.Namespace) -> int:
    from fedflat.flower.keys import make_keys

    hosts = tuple(dict.fromkeys(["127.0.0.1", "localhost", *args.host]))
    files = make_keys(args.folder, args.nodes, hosts=hosts, days=args.days, overwrite=args.force)
    print(deployment_guide(Path(args.folder), args.nodes, hosts))
    return 0 if files else 1


def deployment_guide(keys: Path, nodes: int, hosts: tuple[str, ...]) -> str:
    """Where each file of ``fedflat flower-keys`` goes: the commands of a secure deployment whose SuperLink the
    nodes reach at ``hosts[-1]`` (the last ``--host``; 127.0.0.1 without one). The SuperLink listens on 127.0.0.1
    only: its Control API has no authentication in Flower 1.41, so only the operator, with a shell on its machine,
    reaches it; the nodes reach it through ``fedflat flower-gate`` (:mod:`fedflat.flower.gate`)."""
    from fedflat.flower.keys import ROSTER

    k = keys.resolve()
    public = hosts[-1]
    node_lines = "\n".join(
        f"  flower-supernode --root-certificates {k}/ca.crt --auth-supernode-private-key {k}/node-{p} \\\n"
        f"      --superlink {public}:9092 --node-config 'partition-id={p} num-partitions={nodes} "
        f"state-dir=\"~/fedflat/state\"'"
        for p in range(nodes))
    registers = "\n".join(f"  flwr supernode register {k}/node-{p}.pub here" for p in range(nodes))
    names = ", ".join(hosts)
    return f"""Keys of a secure Flower deployment in {k} (development CA; the server certificate names {names}):
  ca.crt              the CA: to the SuperLink (--ssl-ca-certfile), the gate, every SuperNode (--root-certificates)
                      and the flwr CLI (root-certificates); ca.key signs, keep it off the machines of the federation
  server.crt/.key     the SuperLink's and the gate's TLS certificate and key (--ssl-certfile, --ssl-keyfile)
  node-P / node-P.pub partition P's SuperNode key pair: node-P stays on that node (--auth-supernode-private-key),
                      node-P.pub is registered with the SuperLink (flwr supernode register)
  {ROSTER:<20}the roster (partition, public key): `fedflat flower-app CONFIG -o APP --keys {k}`, and the gate
On the SuperLink's machine (the operator's shell; nothing there listens beyond 127.0.0.1 but the gate):
  mkdir -p ~/fedflat
  flower-superlink --ssl-ca-certfile {k}/ca.crt --ssl-certfile {k}/server.crt --ssl-keyfile {k}/server.key \\
      --enable-supernode-auth --host 127.0.0.1 --port 9093 --database ~/fedflat/superlink.db
  fedflat flower-gate --keys {k} --host {public} --port 9092 --superlink 127.0.0.1:9093
  flwr CLI connection ($FLWR_HOME/config.toml, default ~/.flwr):
    [superlink.here]
    address = "127.0.0.1:9093"
    root-certificates = "{k}/ca.crt"
{registers}
SuperNodes (each on its own machine, with ca.crt and its own node-P only):
{node_lines}
Then, on the SuperLink's machine: flwr run APP here --run-config 'num-partitions={nodes}'"""


def gate_limits(args: argparse.Namespace):
    """The :class:`~fedflat.flower.limits.GateLimits` of ``fedflat flower-gate``'s options."""
    from fedflat.flower.limits import GateLimits

    return GateLimits(**{name: getattr(args, name) for name in GATE_LIMITS})


def cmd_flower_gate(args: argparse.Namespace) -> int:
    require_flower()
    from fedflat.flower.gate import require_loopback, serve_gate

    require_loopback(args.superlink)
    limits = gate_limits(args)
    print(f"fedflat flower-gate on {args.host}:{args.port}: SuperNodes of the roster in {args.keys} reach the "
          f"SuperLink at {args.superlink}; nothing else passes ("
          + ", ".join(f"--{name.replace('_', '-')} {getattr(limits, name)}" for name in GATE_LIMITS) + ")",
          flush=True)
    serve_gate(args.keys, args.host, args.port, args.superlink, limits)
    return 0


# fedflat flower-gate's limits: option (a GateLimits field), type, what it bounds (docs/flower.md, "The gate's limits")
GATE_LIMITS = {
    "max_header_bytes": (int, "bytes of a request's line and headers (a SuperNode sends about 1.5 KiB)"),
    "header_timeout": (float, "seconds from a connection's opening (TLS included) or a request's first byte to its "
                              "whole head; also the longest pause within a body"),
    "max_body_bytes": (int, "bytes of a request's body (Flower sends arrays in 5 MiB chunks)"),
    "max_connections": (int, "open connections overall"),
    "max_connections_per_address": (int, "open connections from one address (an IPv6 /64): SuperNodes behind one NAT "
                                         "share it"),
    "idle_timeout": (float, "seconds a connection may wait between a response and its next request"),
    "signature_window": (float, "seconds a SuperNode's signature is accepted after its timestamp"),
}


def cmd_flower_sim(args: argparse.Namespace) -> int:
    require_flower()
    from fedflat.flower.apps import simulate

    cfg = _config(args.items)
    history = simulate(cfg, supernodes=args.supernodes, out=args.out, progress=not args.no_progress,
                       cpus_per_node=args.cpus_per_node)
    return print_outcome(history, f" on {history.summary['dataset']} (Flower simulation)",
                         announced=not args.no_progress)


def register(sub) -> None:
    p = sub.add_parser("flower-app", help="write a Flower app project for a config (then `flwr run` it)")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    p.add_argument("-o", "--out", required=True, help="folder of the app project")
    p.add_argument("--force", action="store_true", help="rewrite a folder that is not empty")
    p.add_argument("--keys", default=None, metavar="DIR",
                   help="the deployment's keys (`fedflat flower-keys DIR`): each partition only to its node's key")
    p.add_argument("--insecure", action="store_true",
                   help="a deployment without node keys: any node may claim a partition (trusted test networks)")
    p.set_defaults(func=cmd_flower_app)

    p = sub.add_parser("flower-keys", help="make a development CA, TLS certificate and SuperNode keys for a deployment")
    p.add_argument("folder", metavar="DIR", help="folder for the keys (new or empty)")
    p.add_argument("--nodes", type=int, required=True, help="SuperNodes (one key pair per partition 0..N-1)")
    p.add_argument("--host", action="append", default=[],
                   help="the name or address the SuperNodes reach the SuperLink's gate at, for its certificate "
                        "(127.0.0.1, localhost always)")
    p.add_argument("--days", type=int, default=365, help="days the certificates are valid")
    p.add_argument("--force", action="store_true", help="replace the keys in a folder that is not empty")
    p.set_defaults(func=cmd_flower_keys)

    p = sub.add_parser("flower-gate", help="the SuperLink's door for SuperNodes: forwards only their signed Fleet "
                                           "API requests to a SuperLink on 127.0.0.1")
    p.add_argument("--keys", required=True, metavar="DIR", help="the deployment's keys (`fedflat flower-keys DIR`)")
    p.add_argument("--host", required=True, help="the address the SuperNodes reach (this machine's, on their network)")
    p.add_argument("--port", type=int, default=9092, help="the gate's port (default 9092)")
    p.add_argument("--superlink", default="127.0.0.1:9093",
                   help="the SuperLink's address, a loopback one (flower-superlink --host 127.0.0.1 --port 9093)")
    from fedflat.flower.limits import GateLimits

    for name, (kind, what) in GATE_LIMITS.items():
        default = getattr(GateLimits(), name)
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=default, help=f"{what} (default {default})")
    p.set_defaults(func=cmd_flower_gate)

    p = sub.add_parser("flower-sim", help="run a config as a Flower simulation in this process")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    p.add_argument("--supernodes", type=int, default=None, help="virtual SuperNodes (default: one per client)")
    p.add_argument("--cpus-per-node", type=float, default=1.0, help="CPUs Ray reserves per virtual node")
    p.add_argument("--out", default=None, help="parent folder of the run folder (default: config 'out', runs/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_flower_sim)
