"""The package as a user installs it: every config shipped in the wheel and sdist and found by name, the metadata,
and (slow) a wheel installed into a fresh virtual environment running from an empty folder."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import venv
import zipfile
from pathlib import Path

import pytest
import yaml

from fedflat.cli import main
from fedflat.config import config_file, file_kind, load_config, packaged_configs, packaged_names
from fedflat.core import ConfigError
from fedflat.engine import native
from fedflat.experiments.sweep import load_sweep
from fedflat.experiments.tune import load_study
from test_data import make_idx_dataset

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.relative_to(packaged_configs()).as_posix() for p in packaged_configs().rglob("*.yaml"))
# what a build copies: the source tree without the environment, run outputs and caches
NOT_SOURCE = shutil.ignore_patterns(".venv", ".git", "runs", "build", "dist", "*.egg-info", "__pycache__",
                                    ".pytest_cache", ".ruff_cache", "_build", "site")


def test_the_repository_configs_are_the_shipped_ones():
    """One copy: configs/ at the repository root is the package's folder, so its paths (README, docs, make demo)
    and the shipped names are the same files."""
    assert (REPO / "configs").resolve() == packaged_configs().resolve()
    assert {"quickstart.yaml", "demo_sweep.yaml", "fmnist_mlp.yaml", "comparison_fmnist.yaml", "tune_fmnist.yaml",
            "papers/fedwmsam_table1_fmnist.yaml"} <= set(SHIPPED)


def test_a_shipped_config_is_found_by_name_from_any_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    shipped = packaged_configs() / "fmnist_mlp.yaml"
    for name in ("fmnist_mlp", "fmnist_mlp.yaml", "configs/fmnist_mlp.yaml"):
        assert config_file(name) == shipped
        assert load_config(name, ["rounds=7"]) == load_config(shipped, ["rounds=7"])
    assert len(load_sweep("papers/fedwmsam_table1_fmnist", variant="small").cells()) == 28
    assert load_sweep("configs/demo_sweep.yaml").source == packaged_configs() / "demo_sweep.yaml"
    assert "fedavg" in load_study("tune_fmnist", variant="small").methods
    # a file of that name here comes first (a copy made to edit is run, not the shipped original)
    (tmp_path / "fmnist_mlp.yaml").write_text("rounds: 3\n")
    assert config_file("fmnist_mlp") == Path("fmnist_mlp.yaml")
    assert load_config("fmnist_mlp").rounds == 3


def test_unknown_names_and_wrong_commands_say_what_to_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"'fmnist_mpl' not found.*did you mean 'fmnist_mlp'.*fedflat list --configs"):
        load_config("fmnist_mpl")
    with pytest.raises(ConfigError, match=r"sweep file 'papers/nope' not found"):
        load_sweep("papers/nope")
    with pytest.raises(ConfigError, match=r"config file '\.' is a folder, not a file"):  # (issue 32: not "not found")
        load_config(".")
    with pytest.raises(ConfigError, match=r"^demo_sweep is a sweep file, not one run's config: `fedflat sweep "
                                          r"demo_sweep` runs it$"):
        load_config("demo_sweep")
    with pytest.raises(ConfigError, match=r"^tune_fmnist is a tune file, not a sweep file: `fedflat tune tune_fmnist`"):
        load_sweep("tune_fmnist")
    with pytest.raises(ConfigError, match=r"^fmnist_mlp is one run's config, not a tune file: `fedflat run"):
        load_study("fmnist_mlp")


def test_a_sweep_base_may_name_a_shipped_config(tmp_path):
    sweep = tmp_path / "mine.yaml"
    sweep.write_text(yaml.safe_dump({"base": "fmnist_mlp", "grid": {"seed": [0, 1]}}))
    cells = load_sweep(sweep).cells()
    assert [c.config.seed for c in cells] == [0, 1]
    assert cells[0].config.model_dump() == load_config("fmnist_mlp", ["seed=0"]).model_dump()
    sweep.write_text(yaml.safe_dump({"base": "fmnist_mpl"}))
    with pytest.raises(ConfigError, match="base config 'fmnist_mpl' not found.*fedflat list --configs"):
        load_sweep(sweep)


def test_list_configs_names_every_shipped_file_with_its_command(capsys):
    assert main(["list", "--configs"]) == 0
    out = capsys.readouterr().out.split("shipped configs", 1)[1]
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")}
    assert sorted(rows) == packaged_names() == [name.removesuffix(".yaml") for name in SHIPPED]
    assert rows["fmnist_mlp"].split()[1] == "run"
    assert rows["tune_fmnist"].split()[1] == "tune,"
    assert ("variants: short, evidence, protocol, weak, gpu-pack, small, fidelity, fidelity-control"
            in rows["papers/fedwmsam_table1_fmnist"])
    assert "Table 1, Fashion-MNIST columns" in out  # the file's first comment line, under its name


def test_copy_writes_a_shipped_config_out_and_never_overwrites_unasked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    shipped = packaged_configs() / "papers" / "fedscam_table1_fmnist.yaml"
    assert main(["copy", "papers/fedscam_table1_fmnist"]) == 0
    copy = tmp_path / "fedscam_table1_fmnist.yaml"
    assert copy.read_bytes() == shipped.read_bytes()  # comments and all
    assert "fedflat sweep fedscam_table1_fmnist.yaml" in capsys.readouterr().out
    copy.write_text("# mine\n")
    assert main(["copy", "papers/fedscam_table1_fmnist"]) == 2
    assert "exists: name another destination, or add --force" in capsys.readouterr().err
    assert copy.read_text() == "# mine\n"
    assert main(["copy", "papers/fedscam_table1_fmnist", "--force"]) == 0
    assert copy.read_bytes() == shipped.read_bytes()
    (tmp_path / "edit").mkdir()
    assert main(["copy", "quickstart", "edit"]) == 0 and (tmp_path / "edit" / "quickstart.yaml").is_file()
    assert main(["copy", "quikstart"]) == 2
    assert "no shipped config 'quikstart' (did you mean 'quickstart'?)" in capsys.readouterr().err


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_still_loads_once_copied_out(name, tmp_path, monkeypatch, capsys):
    """A copy in an empty folder is complete: nothing in it points at a file beside the original."""
    monkeypatch.chdir(tmp_path)
    assert main(["copy", name.removesuffix(".yaml"), "copy.yaml"]) == 0
    kind = file_kind(yaml.safe_load(Path("copy.yaml").read_text()))
    if kind == "run":
        load_config("copy.yaml")
    elif kind == "sweep":
        assert load_sweep("copy.yaml").cells()
    else:
        assert load_study("copy.yaml").trial_cells()


# --- the built distributions ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dists(tmp_path_factory) -> tuple[Path, Path]:
    """The sdist, and the wheel built from it (``python -m build``), of a copy of the source tree."""
    tmp = tmp_path_factory.mktemp("dist")
    source = tmp / "source"
    shutil.copytree(REPO, source, symlinks=True, ignore=NOT_SOURCE)
    subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp / "dist"), str(source)],
                   check=True, capture_output=True, timeout=300)
    (sdist,), (wheel,) = (tmp / "dist").glob("*.tar.gz"), (tmp / "dist").glob("*.whl")
    return sdist, wheel


def test_wheel_and_sdist_carry_every_config_the_license_and_the_typing_marker(dists):
    sdist, wheel = dists
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = whl.read(f"{dist_info}/METADATA").decode()
    assert {n for n in names if n.startswith("fedflat/configs/")} == {f"fedflat/configs/{c}" for c in SHIPPED}
    assert "fedflat/py.typed" in names and f"{dist_info}/licenses/LICENSE" in names
    assert "fedflat/engine/native/mlp_gradient.cpp" in names  # the native operator is built from it on first use
    assert not any(n.startswith(("tests/", "docs/", "configs/")) for n in names)
    assert "License-Expression: MIT" in metadata and "Classifier: Typing :: Typed" in metadata
    assert "Classifier: Intended Audience :: Science/Research" in metadata
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {f"fedflat/configs/{c}" for c in SHIPPED} <= members
    assert {"LICENSE", "README.md", "pyproject.toml", "fedflat/py.typed", "tests/test_package.py",
            "docs/experiments.md", "fedflat/engine/native/mlp_gradient.cpp"} <= members
    assert "configs" not in members  # the repository's link is not shipped twice


# --- a fresh install ------------------------------------------------------------------------------------------

def _run(args: list, cwd: Path, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, args))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.slow
def test_the_wheel_in_a_fresh_environment_runs_shipped_configs_by_name_from_an_empty_folder(dists, tmp_path):
    """The wheel installed (with the CPU torch the Makefile pins) into a new virtual environment outside the
    repository, without its packages: from an empty folder the quickstart, a shipped paper config's small variant
    by name, ``fedflat run fmnist_mlp`` and the Python API run. Fashion-MNIST is a small file set in the official
    IDX format (data.root), so the test needs no download."""
    _, wheel = dists
    env_dir, work, data = tmp_path / "env", tmp_path / "empty", tmp_path / "data"
    venv.create(env_dir, with_pip=True, clear=True)
    bin_dir = env_dir / "bin"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", PIP_DISABLE_PIP_VERSION_CHECK="1")
    _run([bin_dir / "python", "-m", "pip", "install", "-q", "torch==2.13.0"], tmp_path, env, timeout=600)
    _run([bin_dir / "python", "-m", "pip", "install", "-q", wheel], tmp_path, env, timeout=600)
    work.mkdir()
    make_idx_dataset(data / "fashion-mnist", seed=0, gz=False, n_train=20000, n_test=500)
    fedflat = bin_dir / "fedflat"

    where = _run([bin_dir / "python", "-c", "import fedflat; print(fedflat.__file__)"], work, env).stdout.strip()
    assert Path(where).is_relative_to(env_dir), f"fedflat imported from {where}, not the fresh environment"

    out = _run([fedflat, "run", "rounds=4", "--no-progress"], work, env).stdout
    run_dir = work / out.split("run folder: ", 1)[1].split()[0]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    # the quickstart's MLP took the native gradient, built from the wheel's source for this environment's torch
    status = _run([bin_dir / "python", "-m", "fedflat.engine.native"], work, env).stdout
    assert ("loaded from" in status) == (native.compiler() is not None), status

    assert "papers/fedscam_table1_fmnist" in _run([fedflat, "list", "--configs"], work, env).stdout
    out = _run([fedflat, "sweep", "papers/fedscam_table1_fmnist", "--variant", "small", f"data.root={data}",
                "--no-progress"], work, env).stdout
    assert "cells: 6 completed" in out
    sweep = json.loads((work / "runs/sweeps/fedscam_table1_fmnist-small/sweep.json").read_text())
    assert sorted(c["name"] for c in sweep["cells"]) == sorted(
        f"{m}__seed0" for m in ("fedscam", "fedlesam", "fednolowe", "fedwmsam", "fedlw", "fedlwsam"))

    out = _run([fedflat, "run", "fmnist_mlp", "rounds=2", f"data.root={data}", "--no-progress"], work, env).stdout
    assert "status: completed" in out and "fedwmsam on fmnist: 2 rounds" in out

    api = ("import fedflat\n"
           "h = fedflat.run('fmnist_mlp', overrides=['rounds=2', 'algo=fedsam', 'data.root=" + str(data) + "'],"
           " save=False, progress=False)\n"
           "print(h.summary['status'], h.summary['rounds'], len(h.column('test_acc')))\n")
    assert _run([bin_dir / "python", "-c", api], work, env).stdout.split() == ["completed", "2", "1"]

    _run([fedflat, "copy", "tune_fmnist"], work, env)
    assert "fedavg:" in _run([fedflat, "tune", "tune_fmnist.yaml", "--variant", "small", "--dry-run"], work,
                             env).stdout


def test_reproducing_md_reports_the_folder_each_sweep_writes():
    """Issue 59: docs/reproducing.md said to report runs/sweeps/FILE after `--variant small`, which writes
    runs/sweeps/FILE-small. Every `fedflat report runs/sweeps/...` there names the folder of the sweep command
    before it (FILE standing for each shipped paper sweep with that variant)."""
    import re

    from fedflat.config import file_kind, packaged_config, read_yaml_file

    text = (Path(__file__).resolve().parents[1] / "docs" / "reproducing.md").read_text()
    sweep, checked = None, 0
    for line in text.splitlines():
        found = re.search(r"^    fedflat sweep configs/(\S+)\.yaml(?:.*--variant ([\w-]+))?", line)
        if found:  # (a command line of a code block; one sweeping into another folder needs its own report line)
            assert sweep is None or sweep == found.groups(), f"no report line for the sweep before: {line}"
            sweep = found.groups()
        report = re.search(r"fedflat report (runs/sweeps/\S+)", line)
        if report and sweep is not None:
            name, variant = sweep
            files = ([n for n in packaged_names() if n.startswith("papers/") and file_kind(
                read_yaml_file(packaged_config(n))) == "sweep" and (variant is None or variant in
                (read_yaml_file(packaged_config(n)).get("variants") or {}))] if name == "papers/FILE" else [name])
            assert files, line
            for file in files:
                expected = report.group(1).replace("FILE", file.removeprefix("papers/"))
                assert str(load_sweep(file, variant=variant).out) == expected, (line, file)
                checked += 1
            sweep = None
    assert checked > 20
