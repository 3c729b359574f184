"""The run's structure (issue 46, items 1 and 2): one Server every transport drives, the method resolved once, short
functions in the engine.

- a run builds its method once in the driver (counted at :func:`fedflat.algorithms.compose._check_composition`,
  which every build passes once), and resolving or re-validating a loaded config builds nothing;
- driving :class:`fedflat.engine.server.Server` by hand (what the Flower strategy does) is ``run_round`` bit for bit;
- no function of ``fedflat/engine`` is longer than 40 lines and ``Simulation.__init__`` under 25.
"""
from __future__ import annotations

import ast
import csv
import inspect
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

import fedflat
import fedflat.algorithms.compose as compose
from fedflat.algorithms import build_algorithm
from fedflat.algorithms.fedavg import Average
from fedflat.cli import main
from fedflat.core import PARTS, Correction, register_part
from fedflat.config import AlgoSpec, ConfigError, SamplingConfig, as_config, resolve, validate
from fedflat.engine.checkpoint import read_checkpoint
from fedflat.engine.server import Server
from fedflat.engine.simulation import Simulation
from fedflat.experiments.callbacks import Callback
from fedflat.experiments.resume import metrics_equal, resume
from fedflat.files import read_jsonl
from conftest import tiny_tree

ENGINE = Path(fedflat.__file__).parent / "engine"
LONGEST = 40  # lines of a function in fedflat/engine, its def and docstring included


@pytest.fixture
def builds(monkeypatch) -> list[str]:
    """The names of the methods built from now on, one entry per build in this process."""
    built: list[str] = []
    check = compose._check_composition

    def counted(parts):
        built.append(next(iter(parts.values())).name)
        return check(parts)

    monkeypatch.setattr(compose, "_check_composition", counted)
    return built


def test_a_run_builds_its_method_once_and_resolving_the_config_builds_nothing(builds):
    cfg = as_config(tiny_tree(algo={"name": "fedsam", "rho": 0.1}, rounds=1))
    assert len(builds) == 1  # the load: validated and resolved
    assert as_config(cfg) == cfg and resolve(cfg)["algo"]["perturbation"]["rho"] == 0.1
    assert len(builds) == 1
    fedflat.run(cfg, save=False, progress=False)
    fedflat.run(cfg, clients=[list(range(i, 180, 6)) for i in range(6)], save=False, progress=False)
    assert len(builds) == 1  # the driver's runs take the load's parts, with their own upload stages


class Counted(Correction):
    """A plugin's correction (plain SGD) that counts its constructions."""

    name = "counted"
    summary = "test only"
    made: list[int] = []

    def __init__(self, params=None):
        super().__init__(params)
        Counted.made.append(1)


@pytest.fixture
def counted():
    register_part(Counted)
    Counted.made.clear()
    yield tiny_tree(algo={"name": "fedavg", "correction": "counted"}, rounds=1)
    PARTS["correction"].pop("counted", None)


@pytest.mark.parametrize("given", ["dict", "yaml", "cli"])
def test_a_run_from_a_dict_a_yaml_file_or_the_cli_constructs_the_method_once(counted, given, tmp_path):
    """Issue 46: the driver builds the method once, however the config comes (the load's build is the run's)."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(counted))
    if given == "dict":
        fedflat.run(counted, save=False, progress=False)
    elif given == "yaml":
        fedflat.run(str(path), overrides=["train.lr=0.05"], save=False, progress=False)
    else:
        assert main(["run", str(path), "--out", str(tmp_path / "runs"), "--no-progress"]) == 0
    assert len(Counted.made) == 1


def test_each_thread_worker_builds_the_method_once_from_the_same_spec(builds):
    cfg = as_config(tiny_tree(executor={"name": "threads", "workers": 3}, rounds=1))
    builds.clear()
    sim = Simulation(cfg)
    try:
        sim.run_round(0)
        assert len(builds) == 2  # one per other thread worker (the first runs the driver's, built at the load)
        assert {r.algorithm.resolved()["name"] for r in sim.executor.runtimes} == {"fedavg"}
    finally:
        sim.close()


def test_the_spec_reads_as_its_section_and_resolves_as_the_method_it_builds():
    cfg = as_config(tiny_tree(algo={"name": "fedsam", "rho": 0.2}))
    assert isinstance(cfg.algo, AlgoSpec)
    assert cfg.algo == {"name": "fedsam", "rho": 0.2} and dict(cfg.algo) == {"name": "fedsam", "rho": 0.2}
    assert cfg.algo["name"] == "fedsam" and cfg.algo.get("filter") is None
    assert cfg.model_dump()["algo"] == dict(cfg.algo)
    assert cfg.algo.resolved() == build_algorithm(dict(cfg.algo)).resolved()


def test_a_config_whose_upload_path_changed_is_checked_again():
    """The resolution kept in the spec does not stand in for the checks that depend on the rest of the config."""
    cfg = as_config(tiny_tree(robust={"name": "krum", "f": 1}, sampling={"clients_per_round": 6}))
    with pytest.raises(ConfigError, match="robust=krum needs at least 5 clients per round"):
        validate(cfg.model_copy(update={"sampling": SamplingConfig(clients_per_round=3)}))


def test_driving_the_server_by_hand_is_run_round_bit_for_bit():
    """The Flower strategy's protocol (begin_round, its own training, finish_round) on the same Server."""
    cfg = as_config(tiny_tree(algo={"name": "scaffold"}))
    by_round, by_hand = Simulation(cfg), Simulation(cfg)
    server = by_hand.server
    assert isinstance(server, Server) and by_hand.server.w is server.w and by_hand.server.state is server.state
    for t in range(2):
        by_round.run_round(t)
        opened = server.begin_round(t)
        server.finish_round(opened, by_hand.runtime.fit(opened.broadcast, opened.task, server.load_state))
    assert torch.equal(by_round.server.w, server.w) and by_round.server.state.keys() == server.state.keys()
    assert all(torch.equal(by_round.server.state[k], server.state[k]) for k in server.state)
    assert server.store.count() == by_round.server.store.count() > 0


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_no_function_of_the_engine_is_longer_than_40_lines():
    long = [f"{p.name}:{name} ({lines} lines)" for p in sorted(ENGINE.glob("*.py")) for name, lines in _functions(p)
            if lines > LONGEST]
    assert not long, "split these: " + ", ".join(long)


def test_the_simulation_is_composed_in_under_25_lines():
    source = textwrap.dedent(inspect.getsource(Simulation.__init__))
    assert source.count("\n") < 25, source


class LoggingAverage(Average):
    """A plugin's server (FedAvg's step) that logs a value every round: the round and ``||w^{t+1}||``."""

    name = "logging_avg"
    summary = "test only"

    def step(self, ctx):
        w_new = super().step(ctx)
        ctx.log["logged_round"] = float(ctx.round)
        ctx.log["w_norm"] = float(w_new.norm())
        return w_new


@pytest.fixture
def logging_server():
    register_part(LoggingAverage)
    yield tiny_tree(algo={"name": "fedavg", "server": "logging_avg"}, rounds=7, eval={"every": 3})
    PARTS["server"].pop("logging_avg", None)


def test_a_value_a_server_hook_logs_is_recorded_for_every_round(logging_server, tmp_path):
    """Evaluated every 3 rounds, the line of every round holds its logged value (rounds 1, 2, 4, 5 without the
    evaluation's keys), equal to what a run evaluated every round logs; a run whose parts log nothing keeps
    its evaluated lines only."""
    seen: list[int] = []

    class Told(Callback):
        def on_log(self, run, round, metrics):
            seen.append(round)

    sparse = fedflat.run({**logging_server, "loggers": ["csv"]}, out=tmp_path, progress=False, callbacks=[Told()])
    lines = read_jsonl(sparse.run_dir / "metrics.jsonl")
    assert lines == sparse.metrics and [m["round"] for m in lines] == list(range(1, 8))
    with open(sparse.run_dir / "metrics.csv") as fh:  # the loggers record the same lines
        assert [int(row["round"]) for row in csv.DictReader(fh)] == list(range(1, 8))
    assert [m["logged_round"] for m in lines] == list(range(7)) and seen == [1, 2, 4, 5]
    assert [m["round"] for m in lines if "test_acc" in m] == [3, 6, 7]
    every = fedflat.run({**logging_server, "eval": {"every": 1}}, save=False, progress=False)
    assert [m["w_norm"] for m in lines] == [m["w_norm"] for m in every.metrics]
    silent = fedflat.run({**logging_server, "algo": {"name": "fedavg"}}, save=False, progress=False)
    assert [m["round"] for m in silent.metrics] == [3, 6, 7]


def test_a_resumed_run_neither_loses_nor_repeats_the_logged_lines(logging_server, tmp_path, monkeypatch):
    """Ctrl-C right after round 5 (not evaluated) is committed: its line is written with its account, the
    checkpoint carries it, and the resume ends equal to a run never interrupted."""
    full = fedflat.run(logging_server, save=False, progress=False)
    original, fired = Simulation.run_round, []

    def interrupted(self, t):
        out = original(self, t)
        if t == 4 and not fired:
            fired.append(t)
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(Simulation, "run_round", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fedflat.run({**logging_server, "checkpoint_every": 2}, out=tmp_path, progress=False)
    monkeypatch.undo()
    (folder,) = list(tmp_path.iterdir())
    assert read_checkpoint(folder)["round"] == 5
    assert [m["round"] for m in read_jsonl(folder / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    resumed = resume(folder, progress=False)
    assert metrics_equal(resumed.metrics, full.metrics) and metrics_equal(read_jsonl(folder / "metrics.jsonl"),
                                                                           full.metrics)
    assert torch.equal(resumed.final_parameters, full.final_parameters)
