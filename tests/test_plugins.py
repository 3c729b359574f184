"""A researcher's own method as a plugin: the worked example (examples/fedasam/, a folder of its own, not inside
fedflat/) runs from the CLI, in a sweep's worker processes, on Ray workers and on Flower nodes with the same numbers;
bad plugins are clear errors; installed plugins load through the entry-point group; check_part checks a part."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import fedflat
from conftest import tiny_tree
from fedflat.config import load_config
from fedflat.core import Correction, Direction, PluginError
from fedflat.experiments.sweep import load_sweep, run_sweep

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fedasam" / "fedasam.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def example_config(tmp_path: Path, **extra) -> Path:
    """The tiny problem with FedASAM, the plugin named by its path relative to the config's folder."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "fedasam.py").write_text(EXAMPLE.read_text())  # "your own folder": a copy beside the config
    tree = {**tiny_tree(rounds=2, threads=1), "plugins": ["fedasam.py"], "algo": {"name": "myfedasam", "rho": 0.3},
            **extra}
    path = tmp_path / "fedasam.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedflat.cli", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=240)


def final_model(run_dir: Path) -> torch.Tensor:
    state = torch.load(run_dir / "model.pt", weights_only=True)
    return torch.cat([v.reshape(-1) for v in state.values()])


@pytest.mark.slow  # ~24 s (moved from make test: its 10 minutes)
def test_the_example_runs_from_the_cli_and_a_sweep_with_workers_with_the_same_numbers(tmp_path):
    """The config's plugins: reach the CLI's process and a sweep's two spawned workers; every run equals the one
    in this process, bit for bit, and the run folder's config.yaml (the plugin's path made absolute) resumes."""
    config = example_config(tmp_path / "mine")
    ours = fedflat.run(config, save=False, progress=False)
    assert ours.summary["algorithm"] == "myfedasam" and ours.summary["backprops_per_step"] == 2
    done = cli("run", str(config), "--out", str(tmp_path / "runs"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    (run_dir,) = list((tmp_path / "runs").iterdir())
    assert torch.equal(final_model(run_dir), ours.final_parameters)
    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert recorded["plugins"] == [str(tmp_path / "mine" / "fedasam.py")]
    assert recorded["algo"]["perturbation"] == {"name": "myasam", "rho": 0.3, "eta": 0.01}
    longer = cli("resume", str(run_dir), "rounds=3", cwd=tmp_path)  # from another folder: the path is absolute
    assert longer.returncode == 0, longer.stderr
    assert torch.equal(final_model(run_dir), fedflat.run(config, overrides=["rounds=3"], save=False,
                                                          progress=False).final_parameters)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": str(config), "out": str(tmp_path / "sweep"),
                                     "grid": {"algo.rho": [0.3, 0.1]}}))
    result = run_sweep(load_sweep(sweep), workers=2, progress=False)
    assert [c["status"] for c in result.cells] == ["completed", "completed"]
    for cell, rho in zip(result.cells, (0.3, 0.1)):
        alone = fedflat.run(config, overrides=[f"algo.rho={rho}"], save=False, progress=False)
        assert torch.equal(final_model(tmp_path / "sweep" / cell["name"]), alone.final_parameters)


@pytest.mark.slow  # Ray and a Flower simulation: ~28 s (moved from make test: its 10 minutes)
def test_the_example_on_ray_workers_and_flower_nodes_equals_the_local_run(tmp_path):
    """executor=ray (two workers that start as fresh interpreters) and a Flower simulation of two SuperNodes build the
    plugin's method from the config they receive: the same model, bit for bit."""
    pytest.importorskip("ray")
    pytest.importorskip("flwr")
    from fedflat.flower.apps import simulate

    cfg = load_config(example_config(tmp_path), ["engine=sequential"])
    local = fedflat.run(cfg, save=False, progress=False)
    on_ray = fedflat.run(cfg, overrides=["executor=ray", "executor.workers=2"], save=False, progress=False)
    assert torch.equal(on_ray.final_parameters, local.final_parameters)
    on_flower = simulate(cfg, supernodes=2, out=tmp_path / "flower", progress=False)
    assert torch.equal(on_flower.final_parameters, local.final_parameters)


def test_list_shows_a_plugins_parts_and_recipes(tmp_path):
    done = cli("list", "--parts", "--plugin", str(EXAMPLE), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "myfedasam" in done.stdout and "ASAM: eps = rho T^2 g/||T g||" in done.stdout


def test_a_plugin_that_fails_to_import_or_is_missing_is_an_error_naming_it(tmp_path):
    (tmp_path / "broken.py").write_text("from fedflat.core import Feild\n")
    with pytest.raises(PluginError, match=r"plugin '.*broken.py' failed to import: ImportError: cannot import name "
                                          r"'Feild'"):
        load_config(None, [f"plugins=[{tmp_path / 'broken.py'}]"])
    with pytest.raises(PluginError, match=r"plugin 'nowhere.py': no such file or folder"):
        load_config(None, ["plugins=[nowhere.py]"])
    with pytest.raises(PluginError, match=r"plugin 'no_such_module_here' failed to import: ModuleNotFoundError"):
        load_config(None, ["plugins=[no_such_module_here]"])
    done = cli("run", "--help", cwd=tmp_path)  # and a CLI error is one line, not a traceback
    assert done.returncode == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**tiny_tree(), "plugins": ["broken.py"]}))
    failed = cli("run", str(bad), cwd=tmp_path)
    assert failed.returncode != 0 and "failed to import" in failed.stderr and "Traceback" not in failed.stderr


def test_a_plugin_that_registers_nothing_says_so_and_the_install_hint_follows_only_a_missing_module(tmp_path):
    (tmp_path / "empty_plugin.py").write_text("from fedflat.core import Correction\n\n\nclass Mine(Correction):\n"
                                              "    name = 'mine'\n")  # defined, never registered
    with pytest.raises(PluginError, match=r"^plugin '.*empty_plugin.py' registered nothing: a plugin registers, when "
                                          r"imported, its parts and recipes \(fedflat.core.register_part"):
        load_config(None, [f"plugins=[{tmp_path / 'empty_plugin.py'}]"])
    (tmp_path / "typo_plugin.py").write_text("def f(:\n")
    with pytest.raises(PluginError, match=r"failed to import: SyntaxError: .*typo_plugin.py, line 1\)$") as raised:
        load_config(None, [f"plugins=[{tmp_path / 'typo_plugin.py'}]"])
    assert "installed" not in str(raised.value) and "PYTHONPATH" not in str(raised.value)
    (tmp_path / "needs_dep.py").write_text("import no_such_dependency_here\n")
    with pytest.raises(PluginError, match=r"ModuleNotFoundError: .*no_such_dependency_here.*is it installed, or on "
                                          r"PYTHONPATH"):
        load_config(None, [f"plugins=[{tmp_path / 'needs_dep.py'}]"])


def test_validating_a_config_imports_no_plugin_and_edits_no_environment(tmp_path):
    """fedflat.config.validate reads the registries as they stand: a config naming a plugin this process has not
    imported leaves sys.path, PYTHONPATH and sys.modules as they were, and its unknown model says the plugin is not
    imported; load_config (reading the config for a run) imports it, and the same tree then validates."""
    from fedflat.config import validate

    folder = tmp_path / "lab"
    folder.mkdir()
    (folder / "validation_probe_models.py").write_text(
        "import math\n\nfrom torch import nn\n\nfrom fedflat.models import register_model\n\n\n"
        "def linear(input_shape, num_classes):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))\n\n\n"
        "register_model('validation_probe_linear', linear, 'a linear model (test plugin)')\n")
    plugin = str(folder / "validation_probe_models.py")
    tree = {**tiny_tree(), "plugins": [plugin], "model": {"name": "validation_probe_linear"}}
    path, environ = list(sys.path), dict(os.environ)
    with pytest.raises(fedflat.ConfigError, match=r"model.name: unknown name 'validation_probe_linear'.*plugins "
                                                  r".*validation_probe_models.py are not imported in this process"):
        validate(tree)
    assert sys.path == path and dict(os.environ) == environ and "validation_probe_models" not in sys.modules
    assert load_config(None, [], base=tree).model["name"] == "validation_probe_linear"
    assert "validation_probe_models" in sys.modules
    assert validate(tree).model["name"] == "validation_probe_linear"  # now in the registry: valid, still no import


def test_an_unknown_part_or_recipe_says_how_a_plugins_names_arrive():
    from fedflat.algorithms import AlgorithmError, build_algorithm

    with pytest.raises(AlgorithmError, match=r"unknown correction 'mine'.*name it in the config's `plugins:`"):
        build_algorithm({"name": "fedavg", "correction": "mine"})
    with pytest.raises(AlgorithmError, match=r"unknown algorithm 'mine'.*name it in the config's `plugins:`"):
        build_algorithm({"name": "mine"})


def test_a_plugin_that_registers_a_taken_name_is_an_error_naming_both(tmp_path):
    (tmp_path / "clash.py").write_text("from fedflat.core import Recipe, register_recipe\n"
                                       "register_recipe(Recipe(name='fedsam', summary='mine', source='me'))\n")
    with pytest.raises(PluginError, match=r"recipe 'fedsam' is registered twice: by module fedflat.algorithms.fedsam "
                                          r"and by module clash; rename one of them"):
        load_config(None, [f"plugins=[{tmp_path / 'clash.py'}]"])
    (tmp_path / "clash_part.py").write_text(
        "from fedflat.core import Correction, register_part\n"
        "class Mine(Correction):\n    name = 'scaffold'\nregister_part(Mine)\n")
    with pytest.raises(PluginError, match=r"correction 'scaffold' is registered twice: by "
                                          r"fedflat.algorithms.scaffold.Scaffold and by clash_part.Mine"):
        load_config(None, [f"plugins=[{tmp_path / 'clash_part.py'}]"])


def test_an_installed_plugin_loads_through_the_entry_point_group(tmp_path):
    """A distribution on the path with an entry point in ``fedflat.plugins`` (what `pip install` of a package with
    ``[project.entry-points."fedflat.plugins"]`` leaves) is loaded by every fedflat process, named nowhere."""
    site = tmp_path / "site"
    (site / "labmethods").mkdir(parents=True)
    (site / "labmethods" / "__init__.py").write_text(EXAMPLE.read_text().replace('name="myfedasam"', 'name="labasam"')
                                                     .replace('name = "myasam"', 'name = "labasam"'))
    info = site / "labmethods-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: labmethods\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedflat.plugins]\nlabmethods = labmethods\n")
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(site), ENV.get("PYTHONPATH", "")])}
    listed = subprocess.run([sys.executable, "-m", "fedflat.cli", "list"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert "labasam" in listed.stdout


def test_check_part_passes_the_example_and_names_what_a_broken_part_breaks():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        from fedasam import AdaptiveSAM
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    from fedflat.testing import check_part

    report = check_part(AdaptiveSAM, recipe="myfedasam")
    assert report["contract"] == "kept" and report["engines"]["relative_difference"] < report["engines"]["allowed"]
    assert report["composed"] == "scaffold[perturbation=myasam]"
    assert report["checkpoint"] == "resumed after round 2: bit for bit"

    class Forgetful(Correction):
        """Keeps a count in a dict on self (assigning self.rounds would be refused), not in declared state: a
        resumed run does not know it."""

        name = "forgetful"
        summary = "test only"

        def __init__(self, params=None):
            super().__init__(params)
            self.seen = {"rounds": 0}

        def after_step(self, ctx, w_new):
            self.seen["rounds"] += 1

        def direction(self, ctx, cohort, k, W, grad):
            return Direction(grad * (1 + 0.1 * self.seen["rounds"]), ctx.settings.weight_decay)

    with pytest.raises(AssertionError, match="resumed after round 2, the run ends elsewhere"):
        check_part(Forgetful)


def test_the_example_is_tuned_and_reported_like_a_built_in_method(tmp_path):
    """`fedflat tune` searches the plugin recipe's own grid (its `tunable`) with the same budget as fedflat's
    methods, and `fedflat report` groups its runs under its name."""
    from fedflat.experiments.report import find_runs, group_runs
    from fedflat.experiments.tune import load_study, run_study

    config = example_config(tmp_path / "mine")
    study_file = tmp_path / "tune.yaml"
    study_file.write_text(yaml.safe_dump({
        "base": str(config), "out": str(tmp_path / "tune"),
        "methods": {"myfedasam": {"algo": "myfedasam"}, "fedavg": {"algo": "fedavg"}},
        "search": {"budget": 2, "validation": 0.2, "seeds": [0]}, "final": {"seeds": [0]}}))
    study = load_study(study_file)
    assert study.methods["myfedasam"].space == {"algo.rho": [0.1, 0.5, 1.0]}
    result = run_study(study, progress=False)
    assert result.methods["myfedasam"]["selected"]["algo.rho"] in (0.1, 0.5, 1.0)
    methods = {g.method.split(" ")[0] for g in group_runs(find_runs([tmp_path / "tune" / "final"]))}
    assert methods == {"MyFedASAM", "FedAvg"}  # (the display names: a plugin may give its own)


def test_a_flower_app_carries_the_configs_path_plugins(tmp_path):
    """`fedflat flower-app` copies a path plugin into the app's package and names it there, so a SuperLink or
    SuperNode that has the app (and fedflat) but not the user's folder builds the method: here a fresh process
    with only the app folder on its path reads the app's config and trains a round."""
    pytest.importorskip("flwr")
    import tomli

    from fedflat.flower.apps import write_app

    cfg = load_config(example_config(tmp_path / "mine"))
    app = write_app(cfg, tmp_path / "app")
    assert (app / "fedflat_app" / "plugins" / "fedasam.py").read_text() == EXAMPLE.read_text()
    text = tomli.loads((app / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]["fedflat-config"]
    assert yaml.safe_load(text)["plugins"] == ["fedflat_app.plugins.fedasam"]
    node = ("import sys, yaml, tomli, fedflat\n"
            "from fedflat.config import as_config\n"
            f"text = tomli.loads(open({str(app / 'pyproject.toml')!r}).read())['tool']['flwr']['app']['config']"
            "['fedflat-config']\n"
            "h = fedflat.run(as_config(yaml.safe_load(text), ['rounds=1']), save=False, progress=False)\n"
            "print(h.summary['algorithm'])\n")
    done = subprocess.run([sys.executable, "-c", node], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**ENV, "PYTHONPATH": str(app)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "myfedasam"


def test_list_shows_every_upload_stage_by_kind_with_its_source_a_plugins_too(tmp_path):
    """Issue 59: robust rules, attacks, compressors and DP mechanisms were found only in the docs. `fedflat list`
    reads them from the registry (fedflat.core.STAGES): every registered stage under its kind's table, with its
    summary and source, a plugin's new robust rule included."""
    from fedflat.algorithms import RECIPES  # noqa: F401 - registers the built-in stages
    from fedflat.core import STAGES

    (tmp_path / "my_rule.py").write_text(
        "from fedflat.algorithms.robust import RobustRule\nfrom fedflat.core import register_part\n\n\n"
        "@register_part\nclass Keep(RobustRule):\n    name = 'keep_all'\n"
        "    summary = 'robust aggregation: nothing removed (a plugin)'\n    source = 'Nobody et al., 2026'\n")
    done = cli("list", "--plugin", str(tmp_path / "my_rule.py"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    titles = {"attack": "upload stage: attacks (`attack.name`):", "compress": "upload stage: compressors "
              "(`compression.name`):", "clip": "upload stage: DP mechanisms (`privacy`):",
              "robust": "upload stage: robust rules (`robust.name`):"}
    sections = {}
    for block in done.stdout.split("\nupload stage: ")[1:]:
        title, *rows = ("upload stage: " + block).splitlines()
        sections[title] = {row.split()[0]: row for row in rows if row.startswith("  ")}
    assert set(sections) == set(titles.values())
    built_in = {n: c for n, c in STAGES.items() if c.__module__.startswith("fedflat.")}  # (tests register others)
    for name, cls in built_in.items():
        row = sections[titles[cls.kind]][name]
        assert cls.summary in row and cls.source and f"[{cls.source}]" in row, name
    assert sections[titles["robust"]]["keep_all"].endswith("nothing removed (a plugin) [Nobody et al., 2026]")
    assert not {"attack", "compress", "clip", "robust"} - {cls.kind for cls in STAGES.values()}
