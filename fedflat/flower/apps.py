"""Flower apps for fedflat configs: the ``ServerApp`` and ``ClientApp``, a Flower simulation in this
process, and the app project ``flwr run`` takes (``fedflat flower-app``).

The apps read their fedflat config from the Flower run config (``fedflat-config``: the config's YAML, as
``fedflat flower-app`` writes it into the project's ``pyproject.toml``) unless one is given in Python.
Run-config keys: ``out`` (the server's run-folder parent), ``round-timeout`` and ``wait-nodes`` (seconds;
see :class:`~fedflat.flower.server.FedflatStrategy`), ``state-dir`` (where nodes keep their clients'
state; a node's own ``--node-config state-dir=...`` wins), ``resume`` (a run folder of an earlier
Flower run of this config to continue from its last checkpoint). Nodes need ``partition-id`` and
``num-partitions`` in their node config (Flower's simulation sets them).
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from fedflat import __version__
from fedflat.config import Config, dump_yaml, read_yaml, resolve
from fedflat.core import ConfigError
from fedflat.flower.node import DEFAULT_STATE_DIR, Node
from fedflat.flower.server import serve

CONFIG_KEY = "fedflat-config"
RUN_DEFAULTS: dict[str, Any] = {"out": "runs", "round-timeout": 600.0, "wait-nodes": 120.0, "state-dir": "",
                                "resume": ""}


def config_of(context: Context, cfg: Config | None) -> Config:
    """The fedflat config of a Flower run: ``cfg`` when given, else the run config's ``fedflat-config``."""
    if cfg is not None:
        return cfg
    from fedflat.config import as_config

    text = context.run_config.get(CONFIG_KEY)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"the Flower run config has no '{CONFIG_KEY}': write the app with `fedflat flower-app "
                          "CONFIG` (it puts the config in pyproject.toml) or pass a config to server_app/client_app")
    return as_config(read_yaml(text))


def setting(context: Context, key: str, given: Any = None) -> Any:
    """A run-config setting: ``given`` (Python) first, then the run config, then fedflat's default."""
    return given if given is not None else context.run_config.get(key, RUN_DEFAULTS[key])


def server_app(cfg: Config | None = None, *, out: str | Path | None = None, run_dir: str | Path | None = None,
               resume: str | Path | None = None, progress: bool = False, round_timeout: float | None = None,
               wait_s: float | None = None, results: dict | None = None) -> ServerApp:
    """A ``ServerApp`` that runs ``cfg`` (default: the run config's) with :func:`fedflat.flower.serve`; the
    :class:`~fedflat.api.History` lands in ``results["history"]`` when a dict is given."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        history = serve(grid, config_of(context, cfg), out=setting(context, "out", out), run_dir=run_dir,
                        resume=setting(context, "resume", resume) or None,
                        progress=progress, round_timeout=float(setting(context, "round-timeout", round_timeout)),
                        wait_s=float(setting(context, "wait-nodes", wait_s)))
        if results is not None:
            results["history"] = history

    return app


def node_partition(context: Context) -> tuple[int, int]:
    config = context.node_config
    try:
        return int(config["partition-id"]), int(config["num-partitions"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError("this SuperNode has no partition: start it with --node-config 'partition-id=P "
                          f"num-partitions=M' (node config now: {dict(config)})") from None


def state_folder(root: str | Path, cfg: Config, partition: int) -> Path:
    """Where a node keeps its clients' state for ``cfg``: one folder per config (its ``rounds`` aside, which a
    resume may extend) and partition, so a resumed run, under a new Flower run id, finds it again. A new
    run of the same config starts every client afresh (the server names no aggregated round) and the
    node deletes the files of the earlier run as it trains each client."""
    resolved = resolve(cfg)
    resolved.pop("rounds", None)
    digest = hashlib.sha256(dump_yaml(resolved).encode()).hexdigest()[:16]
    return Path(root).expanduser() / f"config-{digest}" / f"partition-{partition}"


_NODES: dict[tuple, Node] = {}  # per process: a simulation's virtual nodes share worker processes


def node_of(context: Context, cfg: Config | None, state_dir: str | Path | None) -> Node:
    """This node's clients, data and runtime (built once per process, run and partition)."""
    partition, partitions = node_partition(context)
    config = config_of(context, cfg)
    root = (context.node_config.get("state-dir") or state_dir or context.run_config.get("state-dir")
            or DEFAULT_STATE_DIR)
    folder = state_folder(root, config, partition)
    key = (context.run_id, partition, partitions, str(folder))
    if key not in _NODES:
        _NODES.clear()  # one node per process at a time: another run's data and model are released
        _NODES[key] = Node(config, partition, partitions, folder)
    return _NODES[key]


def client_app(cfg: Config | None = None, *, state_dir: str | Path | None = None) -> ClientApp:
    """A ``ClientApp`` that trains its node's sampled clients of ``cfg`` (default: the run config's), evaluates
    a personalized method's clients on their own models (the server cannot: their private entries stay here), and keeps
    their state under ``state_dir`` (default: the node config's or run config's ``state-dir``, else
    ``~/.cache/fedflat/flower``), one folder per Flower run and partition."""
    app = ClientApp()

    @app.query()
    def query(message: Message, context: Context) -> Message:
        partition, partitions = node_partition(context)
        info = ConfigRecord({"partition-id": partition, "num-partitions": partitions})
        return Message(RecordDict({"node": info}), reply_to=message)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        return Message(node_of(context, cfg, state_dir).train(message.content), reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return Message(node_of(context, cfg, state_dir).evaluate(message.content), reply_to=message)

    return app


def run_flower_simulation(server: ServerApp, client: ClientApp, supernodes: int, cpus_per_node: float = 1.0) -> None:
    """``flwr.simulation.run_simulation`` of the two apps on a local Ray instance of its own (on Linux at a
    loopback address of its own, as fedflat's Ray executor), ``supernodes`` virtual nodes."""
    from flwr.simulation import run_simulation

    from fedflat.engine.ray_executor import LOCAL_NODE_IP

    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # (as fedflat's Ray executor: CPU nodes say cpu)
    init_args: dict[str, Any] = {"address": "local", "include_dashboard": False, "logging_level": logging.WARNING}
    if LOCAL_NODE_IP:
        init_args["_node_ip_address"] = LOCAL_NODE_IP
    run_simulation(server, client, num_supernodes=supernodes,
                   backend_config={"client_resources": {"num_cpus": cpus_per_node, "num_gpus": 0.0},
                                   "init_args": init_args})


def simulate(cfg: Config, *, supernodes: int | None = None, out: str | Path | None = None,
             run_dir: str | Path | None = None, resume: str | Path | None = None, state_dir: str | Path | None = None,
             progress: bool = True, round_timeout: float | None = None, cpus_per_node: float = 1.0,
             client: ClientApp | None = None):
    """Runs ``cfg`` as a Flower simulation in this process (:func:`run_flower_simulation`): ``supernodes``
    virtual nodes (default: one per client), each holding the clients of its partition, their state under
    ``state_dir`` (default: a temporary folder, removed afterwards; a run to ``resume`` later needs a lasting
    one). Returns the server's :class:`~fedflat.api.History`. ``client`` replaces the ClientApp."""
    results: dict = {}
    states = state_dir if state_dir is not None else tempfile.mkdtemp(prefix="fedflat-flower-nodes-")
    try:
        server = server_app(cfg, out=out if out is not None else cfg.out, run_dir=run_dir, resume=resume,
                            progress=progress, round_timeout=round_timeout, results=results)
        run_flower_simulation(server, client or client_app(cfg, state_dir=states),
                              supernodes or cfg.data.num_clients, cpus_per_node)
    finally:
        if state_dir is None:
            shutil.rmtree(states, ignore_errors=True)
    if "history" not in results:
        raise RuntimeError("the Flower simulation ended without a result (see Flower's log above)")
    return results["history"]


APP_PACKAGE = "fedflat_app"
SERVER_MODULE = '''"""The ServerApp of this fedflat config (written by `fedflat flower-app`)."""
from fedflat.flower import server_app

app = server_app()
'''
CLIENT_MODULE = '''"""The ClientApp of this fedflat config (written by `fedflat flower-app`)."""
from fedflat.flower import client_app

app = client_app()
'''


def write_app(cfg: Config, folder: str | Path, *, overwrite: bool = False) -> Path:
    """Writes a Flower app project for ``cfg`` to ``folder``: ``pyproject.toml`` (the config in its run
    config) and a package with the ServerApp and ClientApp. ``flwr run FOLDER [CONNECTION]`` runs it."""
    import tomli_w

    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()) and not overwrite:
        raise FileExistsError(f"{folder} exists and is not empty: choose another --out (or --force to rewrite it)")
    resolved = resolve(cfg)
    name = re.sub(r"[^a-z0-9]+", "-", f"fedflat-{cfg.name or resolved['algo']['name']}-{resolved['data']['name']}"
                  .lower()).strip("-")
    project = {
        "build-system": {"requires": ["hatchling"], "build-backend": "hatchling.build"},
        "project": {"name": name, "version": "1.0.0", "license": "MIT",
                    "description": f"fedflat {resolved['algo']['name']} on {resolved['data']['name']} as a Flower app",
                    # fedflat is installed beside Flower on the SuperLink and every SuperNode (not from here)
                    "dependencies": []},
        "tool": {"hatch": {"build": {"targets": {"wheel": {"packages": [APP_PACKAGE]}}}},
                 "flwr": {"app": {"publisher": "fedflat",
                                  "components": {"serverapp": f"{APP_PACKAGE}.server_app:app",
                                                 "clientapp": f"{APP_PACKAGE}.client_app:app"},
                                  "config": {**RUN_DEFAULTS, CONFIG_KEY: dump_yaml(resolved)}}}},
    }
    package = folder / APP_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    header = f"# A Flower app for one fedflat config, written by fedflat {__version__} (`fedflat flower-app`).\n"
    (folder / "pyproject.toml").write_text(header + tomli_w.dumps(project, multiline_strings=True))
    (package / "__init__.py").write_text('"""fedflat as a Flower app."""\n')
    (package / "server_app.py").write_text(SERVER_MODULE)
    (package / "client_app.py").write_text(CLIENT_MODULE)
    return folder
