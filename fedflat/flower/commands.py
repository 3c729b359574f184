"""``fedflat flower-app`` (a Flower app project for a config) and ``fedflat flower-sim`` (a Flower simulation)."""
from __future__ import annotations

import argparse

from fedflat.cliutil import print_outcome, split_config_and_overrides
from fedflat.flower import require_flower


def _config(items: list[str]):
    from fedflat.config import as_config

    return as_config(*split_config_and_overrides(items))


def cmd_flower_app(args: argparse.Namespace) -> int:
    require_flower()
    from fedflat.flower.apps import write_app

    cfg = _config(args.items)
    folder = write_app(cfg, args.out, overwrite=args.force)
    print(f"Flower app: {folder}")
    print(f"  simulation:  flwr run {folder} --stream        (Flower's local SuperLink; `flwr ls`: the runs' "
          "status; docs/flower.md)")
    print(f"  deployment:  flwr run {folder} CONNECTION      (SuperNodes started with --node-config "
          f"'partition-id=P num-partitions=M', M <= {cfg.data.num_clients})")
    return 0


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
    p.set_defaults(func=cmd_flower_app)

    p = sub.add_parser("flower-sim", help="run a config as a Flower simulation in this process")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    p.add_argument("--supernodes", type=int, default=None, help="virtual SuperNodes (default: one per client)")
    p.add_argument("--cpus-per-node", type=float, default=1.0, help="CPUs Ray reserves per virtual node")
    p.add_argument("--out", default=None, help="parent folder of the run folder (default: config 'out', runs/)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_flower_sim)
