"""The ``fedflat`` command line."""
from __future__ import annotations

import argparse
import signal
import sys
import traceback
from pathlib import Path

from fedflat.cliutil import (Parser, accuracy_text, add_loggers_option, evaluated_on, loggers_override,
                             print_run_folder, split_config_and_overrides)
from fedflat.config import (file_kind, packaged_config, packaged_configs, packaged_name, packaged_names, read_yaml,
                            suggest)
from fedflat._version import __version__
from fedflat.core import ConfigError, ContractError
from fedflat.experiments.rundir import SUCCEEDED, RunFolderBusy, interruption, is_disk_full


def cmd_run(args: argparse.Namespace) -> int:
    from fedflat.api import run
    from fedflat.core.registry import display_label

    config, overrides = split_config_and_overrides(args.items)
    if args.data_dir:
        overrides = [f"data.root={args.data_dir}", *overrides]
    overrides = [*overrides, *loggers_override(args.loggers)]
    history = run(config, overrides=overrides, out=args.out, progress=not args.no_progress, announce=True)
    s = history.summary
    print_run_folder(history.run_dir, announced=True)
    print(f"status: {s['status']}" + (f" ({s['reason']})" if s.get("reason") else ""))
    if s.get(f"final_{evaluated_on(s)}_acc") is not None:
        print(f"{display_label(s['algorithm'])} on {s['dataset']}: {s['rounds']} rounds, {accuracy_text(s)}, "
              f"{s['train_seconds'] / max(s['rounds'], 1):.3f} s/round training, {s['wall_seconds']:.1f} s in all")
    return 0 if s["status"] in SUCCEEDED else 3


def cmd_list(args: argparse.Namespace) -> int:
    from fedflat import plugins
    from fedflat.algorithms import PARTS, RECIPES
    from fedflat.data import DATASETS, PARTITIONS
    from fedflat.models import MODELS

    plugins.load(plugins.resolve(args.plugin))  # and every plugin installed through the entry-point group

    def table(title: str, rows: list[tuple[str, str]]) -> None:
        print(f"{title}:")
        width = max(len(n) for n, _ in rows)
        for name, text in rows:
            print(f"  {name:<{width}}  {text}")

    if not args.configs:  # `list --configs` is asked for the configs: they are not printed after 76 other lines
        table("algorithms", [(n, f"{r.summary} [{r.source}]") for n, r in sorted(RECIPES.items())])
        table("datasets", [(n, d) for n, (_, d) in sorted(DATASETS.items())])
        table("models", [(n, d) for n, (_, d) in sorted(MODELS.items())])
        table("partitions", [(n, d) for n, (_, d) in sorted(PARTITIONS.items())])
        for title, rows in upload_stages():
            table(title, rows)
    if args.grids:
        table("tuning grids (`fedflat tune`)", [(n, ", ".join(f"{k} {list(v)}" for k, v in r.tunable.items())
                                                or "(nothing of its own)") for n, r in sorted(RECIPES.items())])
    if args.parts:
        for role, parts in PARTS.items():
            table(f"{role} parts", [(n, c.summary) for n, c in sorted(parts.items())])
    if args.configs:
        table("shipped configs (`fedflat run|sweep|tune NAME`; `fedflat copy NAME` writes one out to edit)",
              [(name, shipped_summary(name)) for name in packaged_names()])
    return 0


# The upload path's kinds of stage (fedflat.core.upload.STAGE_ORDER), as a user names them: the title of their
# table in `fedflat list` and the config key that picks one.
STAGE_KINDS = {"attack": ("attacks", "attack.name"), "compress": ("compressors", "compression.name"),
               "clip": ("DP mechanisms", "privacy"), "robust": ("robust rules", "robust.name")}


def upload_stages() -> list[tuple[str, list[tuple[str, str]]]]:
    """The registered stages of the upload path (:data:`fedflat.core.STAGES`, a plugin's too), one table per kind in
    the path's order: ``(title, [(name, "summary [source]")])``."""
    from fedflat.core import STAGE_ORDER, STAGES

    tables = []
    for kind in sorted({cls.kind for cls in STAGES.values()}, key=lambda k: STAGE_ORDER.get(k, 99)):
        title, key = STAGE_KINDS.get(kind, (f"{kind} stages", kind))
        rows = [(name, cls.summary + (f" [{cls.source}]" if cls.source else ""))
                for name, cls in sorted(STAGES.items()) if cls.kind == kind]
        tables.append((f"upload stage: {title} (`{key}`)", rows))
    return tables


def shipped_summary(name: str) -> str:
    """``sweep, variants: small, ...`` of a shipped config, and its first comment line below."""
    text = packaged_configs().joinpath(f"{name}.yaml").read_text()
    spec = read_yaml(text) or {}
    variants = list(spec.get("variants") or {})
    first = next((line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#")), "")
    return file_kind(spec) + (f", variants: {', '.join(variants)}" if variants else "") + f"\n      {first}"


def cmd_copy(args: argparse.Namespace) -> int:
    from fedflat.files import atomic_write_text

    source = packaged_config(args.name)
    if source is None:
        raise ConfigError(f"no shipped config '{args.name}'{suggest(args.name, packaged_names())}; "
                          "`fedflat list --configs` lists them")
    dest = Path(args.dest or source.name)
    if dest.is_dir():
        dest = dest / source.name
    if dest.exists() and not args.force:
        raise FileExistsError(f"{dest} exists: name another destination, or add --force to replace it")
    text = source.read_text()
    atomic_write_text(dest, text)
    command = file_kind(read_yaml(text))
    print(f"{dest}: a copy of the shipped {packaged_name(source)}; edit it, then: fedflat {command} {dest}")
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    import numpy as np

    from fedflat.api import as_config
    from fedflat.data import client_split, label_counts, load_dataset, plot_partition, split_name

    config, overrides = split_config_and_overrides(args.items)
    if args.data_dir:
        overrides = [f"data.root={args.data_dir}", *overrides]
    cfg = as_config(config, overrides)
    data = load_dataset(cfg.data.name, root=cfg.data.root, download=cfg.data.download, **cfg.data.options)
    labels = data.y_train.numpy()
    parts = client_split(labels, cfg.data.num_clients, cfg.data.partition, cfg.seed, data.name,
                         owners=data.owners)
    counts = label_counts(labels, parts, data.num_classes)
    print(f"{cfg.data.name}: {len(labels)} training samples, {cfg.data.num_clients} clients, "
          f"partition {cfg.data.partition}, seed {cfg.seed}")
    header = "client  samples  classes  " + " ".join(f"{c:>5}" for c in range(data.num_classes))
    print(header)
    for i, row in enumerate(counts):
        print(f"{i:>6}  {row.sum():>7}  {np.count_nonzero(row):>7}  " + " ".join(f"{v:>5}" for v in row))
    png = Path(args.png or f"partition-{cfg.data.name}-{split_name(cfg.data.partition)}-n{cfg.data.num_clients}"
                           f"-s{cfg.seed}.png")
    plot_partition(counts, png)
    print(f"heatmap: {png}")
    return 0


# Modules that add their own subcommands through ``register(subparsers)`` (benchmarks, experiments,
# diagnostics); each owns its command next to the code it drives.
EXTENSIONS = ("fedflat.bench", "fedflat.experiments.commands", "fedflat.metrics.commands", "fedflat.flower.commands")


def _register_extensions(sub) -> None:
    import importlib
    import importlib.util

    for name in EXTENSIONS:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name).register(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="fedflat", description="Federated sharpness-aware minimization, side by side.")
    parser.add_argument("--version", action="version", version=f"fedflat {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    p = sub.add_parser("run", help="run one experiment: a config file or a shipped config's name (none: quickstart)")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    p.add_argument("--out", default=None, help="parent folder of the run folder (default: config 'out', runs/)")
    p.add_argument("--data-dir", default=None, help="folder searched first for dataset files (data.root)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_loggers_option(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("list", help="available algorithms, datasets, models, partitions and upload stages (attacks, "
                                    "compressors, DP mechanisms, robust rules)")
    p.add_argument("--parts", action="store_true", help="also list the parts recipes are made of")
    p.add_argument("--grids", action="store_true", help="also list each recipe's tuning grid (fedflat tune)")
    p.add_argument("--configs", action="store_true",
                   help="list the shipped configs, sweeps and tune files, by the name that runs them (instead of "
                        "the algorithms, datasets, models and partitions)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="also list what this plugin registers (a module, .py file or package folder; repeatable)")
    p.set_defaults(func=cmd_list)

    p = sub.add_parser("copy", help="write a shipped config out to edit (`fedflat list --configs` names them)")
    p.add_argument("name", help="a shipped config's name, e.g. fmnist_mlp or papers/fedwmsam_table1_fmnist")
    p.add_argument("dest", nargs="?", default=None, help="file or folder to write (default: NAME's file name here)")
    p.add_argument("--force", action="store_true", help="replace an existing file")
    p.set_defaults(func=cmd_copy)

    p = sub.add_parser("partition", help="per-client sample and class counts of a split, and a heatmap PNG")
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]")
    p.add_argument("--png", default=None, help="where to write the heatmap")
    p.add_argument("--data-dir", default=None, help="folder searched first for dataset files (data.root)")
    p.set_defaults(func=cmd_partition)
    _register_extensions(sub)
    return parser


def _terminate(signum, _frame) -> None:
    """SIGTERM (``kill``, ``timeout``, a scheduler's preemption) stops a run as Ctrl-C does: status, reason and
    a checkpoint of the last complete round are written before the process ends."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with ``key=value`` overrides accepted after the options too (argparse alone takes a
    command's positional list only before them: ``fedflat sweep FILE --variant v rounds=500``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    takes = next((name for name in ("overrides", "items") if isinstance(getattr(args, name, None), list)), None)
    stray = [token for token in extra if token.startswith("-") or "=" not in token]
    if extra and (takes is None or stray):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        getattr(args, takes).extend(extra)
    return args


def raised_in(err: BaseException) -> str:
    """`` (at FILE:LINE in HOOK)``, the innermost frame of ``err``'s traceback outside fedflat (a plugin's hook), or
    ``""``."""
    package = str(Path(__file__).resolve().parent)
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not str(Path(f.filename).resolve()).startswith(package)]
    return f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})" if frames else ""


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, FileExistsError, RunFolderBusy, ConnectionError) as err:
        print(f"fedflat: {err}", file=sys.stderr)
        return 2
    except ContractError as err:  # a part broke the contract: the rule, and the line of the part's code that did
        print(f"fedflat: {err}{raised_in(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        folder = getattr(err, "run_dir", None)
        where = (f"; {folder} records status 'failed' with its last checkpoint: `fedflat resume {folder}` "
                 "continues it") if folder else ""
        print(f"fedflat: interrupted ({interruption(err)}){where}", file=sys.stderr)
        return 128 + (signal.SIGTERM if interruption(err) == "SIGTERM" else signal.SIGINT)  # a shell's 143 / 130
    except OSError as err:
        if is_disk_full(err):
            print(f"fedflat: {err}", file=sys.stderr)
            return 3
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
