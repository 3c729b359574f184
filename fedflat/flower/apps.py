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
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from torch import nn

from fedflat import __version__
from fedflat.config import Config, dump_yaml, read_yaml, resolve, validate
from fedflat.core import ConfigError
from fedflat.engine.simulation import Simulation, UserInputs
from fedflat.flower.node import DEFAULT_STATE_DIR, Node
from fedflat.flower.server import serve
from fedflat.models import base_key

CONFIG_KEY = "fedflat-config"
RUN_DEFAULTS: dict[str, Any] = {"out": "runs", "round-timeout": 600.0, "wait-nodes": 120.0, "state-dir": "",
                                "resume": "", "node-keys": "", "insecure": False, "num-partitions": 0}


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
               wait_s: float | None = None, results: dict | None = None, node_keys: str | None = None,
               insecure: bool | None = None, model_fn: Callable[[], nn.Module] | None = None) -> ServerApp:
    """A ``ServerApp`` that runs ``cfg`` (default: the run config's) with :func:`fedflat.flower.serve`; the
    :class:`~fedflat.api.History` lands in ``results["history"]`` when a dict is given. ``node_keys`` (default: the
    run config's ``node-keys``): the roster of the nodes' public keys (:mod:`fedflat.flower.keys`). ``model_fn`` (a
    zero-argument ``nn.Module`` factory, as :func:`fedflat.run` takes) replaces the configured model; the ClientApp
    needs the same one."""
    from fedflat.flower.keys import read_roster

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        history = serve(grid, config_of(context, cfg), out=setting(context, "out", out), run_dir=run_dir,
                        resume=setting(context, "resume", resume) or None,
                        progress=progress, round_timeout=float(setting(context, "round-timeout", round_timeout)),
                        wait_s=float(setting(context, "wait-nodes", wait_s)),
                        roster=read_roster(str(setting(context, "node-keys", node_keys) or "")),
                        insecure=bool(setting(context, "insecure", insecure)), model_fn=model_fn,
                        partitions=int(setting(context, "num-partitions")) or None)
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


def with_model_path(cfg: Config, path: str | None) -> Config:
    """``cfg`` with this node's own path to the model's pretrained files (node config ``model-path``: the option
    :func:`fedflat.models.base_key` names, e.g. ``model.path`` of a Hugging Face folder); the server checks that the
    base read there is its own (by digest, every round)."""
    if not path:
        return cfg
    return validate(cfg.model_copy(update={"model": {**cfg.model, base_key(cfg.model["name"]): str(path)}}))


def state_folder(root: str | Path, cfg: Config, partition: int) -> Path:
    """Where a node keeps its clients' state for ``cfg``: one folder per config (its ``rounds`` aside, which a
    resume may extend) and partition, so a resumed run, under a new Flower run id, finds it again. A new
    run of the same config starts every client afresh (the server names no aggregated round) and the
    node deletes the files of the earlier run as it trains each client."""
    resolved = resolve(cfg)
    resolved.pop("rounds", None)
    digest = hashlib.sha256(dump_yaml(resolved).encode()).hexdigest()[:16]
    return Path(root).expanduser() / f"config-{digest}" / f"partition-{partition}"


# Per process and Flower run: a simulation's virtual nodes take turns in a few worker processes, and every node of
# a run loads the same data, split and model, so they share one Simulation (building it, Fashion-MNIST's load and
# split, took most of a simulated round: docs/benchmarks.md); another run's are released.
_RUN: dict[str, Any] = {"id": None, "sim": None, "nodes": {}}


def node_of(context: Context, cfg: Config | None, state_dir: str | Path | None,
            model_fn: Callable[[], nn.Module] | None = None) -> Node:
    """This node's clients and kept state, on the run's data and runtime (built once per process and run)."""
    partition, partitions = node_partition(context)
    config = with_model_path(config_of(context, cfg), context.node_config.get("model-path"))
    root = (context.node_config.get("state-dir") or state_dir or context.run_config.get("state-dir")
            or DEFAULT_STATE_DIR)
    folder = state_folder(root, config, partition)
    if _RUN["id"] != context.run_id:
        _RUN.update(id=None, sim=None, nodes={})
        _RUN.update(id=context.run_id, sim=Simulation(config, UserInputs(model_fn=model_fn)))
    key = (partition, partitions, str(folder))
    if key not in _RUN["nodes"]:
        _RUN["nodes"][key] = Node(config, partition, partitions, folder, _RUN["sim"])
    return _RUN["nodes"][key]


def client_app(cfg: Config | None = None, *, state_dir: str | Path | None = None,
               model_fn: Callable[[], nn.Module] | None = None) -> ClientApp:
    """A ``ClientApp`` that trains its node's sampled clients of ``cfg`` (default: the run config's), evaluates
    a personalized method's clients on their own models (the server cannot: their private entries stay here), and keeps
    their state under ``state_dir`` (default: the node config's or run config's ``state-dir``, else
    ``~/.cache/fedflat/flower``), one folder per Flower run and partition. ``model_fn`` replaces the configured
    model, as in :func:`server_app`."""
    from fedflat.flower.secagg import secure_aggregation_mod, secure_reply

    app = ClientApp(mods=[secure_aggregation_mod(lambda context: config_of(context, cfg))])

    @app.query()
    def query(message: Message, context: Context) -> Message:
        partition, partitions = node_partition(context)
        info = ConfigRecord({"partition-id": partition, "num-partitions": partitions})
        return Message(RecordDict({"node": info}), reply_to=message)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        node = node_of(context, cfg, state_dir, model_fn)
        if node.sim.cfg.secure_aggregation is not None:  # (the masked-vector stage of SecAgg+: the mod masks the reply)
            return Message(secure_reply(node, message.content), reply_to=message)
        return Message(node.train(message.content), reply_to=message)

    @app.evaluate()
    def evaluate(message: Message, context: Context) -> Message:
        return Message(node_of(context, cfg, state_dir, model_fn).evaluate(message.content), reply_to=message)

    return app


def run_flower_simulation(server: ServerApp, client: ClientApp, supernodes: int, cpus_per_node: float = 1.0) -> None:
    """``flwr.simulation.run_simulation`` of the two apps, ``supernodes`` virtual nodes, on the local Ray instance
    fedflat starts as for its Ray executor (:func:`fedflat.engine.ray_executor.connect`: a loopback address of
    its own, workers at normal priority, a watchdog that ends it if this process is killed); Flower's simulation
    engine finds it running and uses it."""
    from flwr.simulation import run_simulation

    from fedflat.config import ExecutorConfig
    from fedflat.engine.ray_executor import connect, release, require_ray

    ray = require_ray()
    plain_flower_console()
    started = connect(ray, ExecutorConfig(name="ray"))
    try:
        run_simulation(server, client, num_supernodes=supernodes,
                       backend_config={"client_resources": {"num_cpus": cpus_per_node, "num_gpus": 0.0}})
    finally:
        if started:
            release(ray)  # (Flower's engine shuts Ray down when it ends; this ends the watchdog)


class _KnownDeprecation(logging.Filter):
    """Drops Flower's notice that ``run_simulation`` is deprecated: fedflat calls it on purpose (a simulation in
    this process, with its own run folder; ``flwr run`` of a ``fedflat flower-app`` project is the other way)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "`run_simulation` function is deprecated" not in record.getMessage()


def plain_flower_console() -> None:
    """Flower's console log without colour codes when it goes to a file or a pipe (a log, CI; on a terminal they
    stay) and without the notice :class:`_KnownDeprecation` drops."""
    from flwr.common.logger import update_console_handler

    update_console_handler(colored=sys.stderr.isatty())
    flower = logging.getLogger("flwr")
    if not any(isinstance(f, _KnownDeprecation) for f in flower.filters):
        flower.addFilter(_KnownDeprecation())


def own_ray_for_simulation() -> None:
    """Makes Flower's simulation engine start a Ray instance of its own in this process.

    The engine starts Ray with ``ray.init()`` and no address, and Ray then joins the instance recorded in
    ``/tmp/ray/ray_current_cluster`` by the last ``ray start`` on this machine — one long stopped, whose dead GCS
    it waits on for ever (`flwr run APP` then never trained: no node answered), or another user's.
    ``RAY_ADDRESS`` set already (``auto``, or a cluster's address, for Flower's multi-node simulation) is kept.
    The ClientApp module ``fedflat flower-app`` writes calls it; it changes nothing on a deployment's SuperNodes,
    which run no Ray."""
    os.environ.setdefault("RAY_ADDRESS", "local")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")  # (as fedflat's Ray executor: CPU nodes say cpu)


def simulate(cfg: Config, *, supernodes: int | None = None, out: str | Path | None = None,
             run_dir: str | Path | None = None, resume: str | Path | None = None, state_dir: str | Path | None = None,
             progress: bool = True, round_timeout: float | None = None, cpus_per_node: float = 1.0,
             client: ClientApp | None = None, model_fn: Callable[[], nn.Module] | None = None):
    """Runs ``cfg`` as a Flower simulation in this process (:func:`run_flower_simulation`): ``supernodes``
    virtual nodes (default: one per client), each holding the clients of its partition, their state under
    ``state_dir`` (default: a temporary folder, removed afterwards; a run to ``resume`` later needs a lasting
    one). Returns the server's :class:`~fedflat.api.History`. ``client`` replaces the ClientApp. ``model_fn`` (a
    zero-argument ``nn.Module`` factory, as :func:`fedflat.run` takes) replaces the configured model on the server
    and every node; it travels to the simulation's Ray workers pickled (by value: :func:`ship_by_value`)."""
    results: dict = {}
    states = state_dir if state_dir is not None else tempfile.mkdtemp(prefix="fedflat-flower-nodes-")
    try:
        server = server_app(cfg, out=out if out is not None else cfg.out, run_dir=run_dir, resume=resume,
                            progress=progress, round_timeout=round_timeout, results=results, model_fn=model_fn)
        ship_by_value(model_fn)
        run_flower_simulation(server, client or client_app(cfg, state_dir=states, model_fn=model_fn),
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
from fedflat.flower.apps import client_app, own_ray_for_simulation

own_ray_for_simulation()  # a Flower simulation's Ray is one of its own, never one a `ray start` left (docs/flower.md)
app = client_app()
'''


def ship_by_value(model_fn: Callable[[], nn.Module] | None) -> None:
    """Makes Ray's pickler carry ``model_fn``'s module by value, so a factory defined in a script or a notebook (a
    module the simulation's workers cannot import) reaches them; fedflat's own and installed packages' modules
    still travel by reference."""
    module = sys.modules.get(getattr(model_fn, "__module__", None) or "")
    if model_fn is None or module is None or module.__name__ == "__main__" or module.__name__.startswith("fedflat"):
        return  # (__main__ travels by value already)
    if getattr(module, "__file__", None) and "site-packages" not in str(module.__file__):
        import ray.cloudpickle

        ray.cloudpickle.register_pickle_by_value(module)


def ship_plugins(resolved: dict[str, Any], package: Path) -> None:
    """Copies the config's path plugins (a ``.py`` file, a package folder) into ``package/plugins/`` and names them
    there (``fedflat_app.plugins.fedasam``), so the app carries them to the SuperLink and every SuperNode; a plugin
    named as a module stays so (it must be installed beside fedflat where the app runs)."""
    shipped = []
    for plugin in resolved.get("plugins", []):
        source = Path(plugin)
        if not source.exists():
            shipped.append(plugin)
            continue
        target = package / "plugins"
        target.mkdir(parents=True, exist_ok=True)
        (target / "__init__.py").write_text('"""The config\'s plugins, carried by the app."""\n')
        if source.is_dir():
            shutil.copytree(source, target / source.name, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, target / source.name)
        shipped.append(f"{package.name}.plugins.{source.stem if source.is_file() else source.name}")
    if shipped:
        resolved["plugins"] = shipped


def write_app(cfg: Config, folder: str | Path, *, overwrite: bool = False, node_keys: str = "",
              insecure: bool = False) -> Path:
    """Writes a Flower app project for ``cfg`` to ``folder``: ``pyproject.toml`` (the config in its run
    config) and a package with the ServerApp, the ClientApp and the config's path plugins
    (:func:`ship_plugins`). ``flwr run FOLDER [CONNECTION]`` runs it. ``node_keys``: the roster of the deployment's
    node keys (``node-keys.txt`` of ``fedflat flower-keys``); a deployment without one needs ``insecure``. A config
    under differential privacy draws its noise from the operating system's secure source there (``privacy.noise:
    secure``): a deployment's noise must not be reproducible from the seed (docs/privacy.md)."""
    import tomli_w

    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()) and not overwrite:
        raise FileExistsError(f"{folder} exists and is not empty: choose another --out (or --force to rewrite it)")
    resolved = resolve(cfg)
    if resolved.get("privacy"):
        resolved["privacy"]["noise"] = "secure"
    ship_plugins(resolved, folder / APP_PACKAGE)
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
                                  "config": {**RUN_DEFAULTS, "node-keys": node_keys, "insecure": insecure,
                                             CONFIG_KEY: dump_yaml(resolved)}}}},
    }
    package = folder / APP_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    header = f"# A Flower app for one fedflat config, written by fedflat {__version__} (`fedflat flower-app`).\n"
    (folder / "pyproject.toml").write_text(header + tomli_w.dumps(project, multiline_strings=True))
    (package / "__init__.py").write_text('"""fedflat as a Flower app."""\n')
    (package / "server_app.py").write_text(SERVER_MODULE)
    (package / "client_app.py").write_text(CLIENT_MODULE)
    return folder
