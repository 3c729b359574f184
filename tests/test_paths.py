"""Every path fedflat derives from a user's values stays inside the output folder (issue 44.6): a sweep option
named ``..`` made its cell folder one level above the sweep, and put ``error.txt`` and ``.lock`` there."""
from __future__ import annotations

import pytest
import yaml

from fedflat.cli import main
from fedflat.core import ConfigError
from fedflat.experiments.sweep import Cell, folder_name, load_sweep

from conftest import tiny_tree


def _sweep(tmp_path, grid) -> str:
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_tree(rounds=1, threads=1)))
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": "base.yaml", "out": str(tmp_path / "out"), "grid": grid}))
    return str(path)


@pytest.mark.parametrize("name", ["..", ".", "/", "../..", "./."])
def test_a_sweep_option_named_like_a_path_is_refused_before_anything_is_written(tmp_path, capsys, name):
    path = _sweep(tmp_path, {"method": {name: {"train.lr": 0.1}, "plain": {"train.lr": 0.2}}})
    assert main(["sweep", path, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "is empty after cleaning" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.yaml", "sweep.yaml"]


def test_option_names_and_values_become_folder_names_inside_the_sweep(tmp_path):
    path = _sweep(tmp_path, {"method": {"../up": {"train.lr": 0.1}, ".lock": {"train.lr": 0.2}},
                             "name": ["..", "a/../../b"]})
    sweep = load_sweep(path)
    for cell in sweep.cells():
        folder = (sweep.out / cell.name).resolve()
        assert folder.parent == sweep.out.resolve() and not cell.name.startswith("."), cell.name
    assert [c.name for c in sweep.cells()] == ["up__name..", "up__namea-..-..-b", "lock__name..",
                                                "lock__namea-..-..-b"]


def test_folder_names_are_one_component():
    assert folder_name("..") == folder_name(".") == folder_name("/") == ""
    assert folder_name("../x") == "x" and folder_name("a/b") == "a-b" and folder_name(".lock") == "lock"
    assert folder_name("fedsam rho=0.05") == "fedsam-rho=0.05"


@pytest.mark.parametrize("name", ["..", ".", "", "../x", "a/b", ".lock"])
def test_a_cell_whose_name_would_leave_the_sweep_folder_is_refused(name):
    """Tune names its cells after the methods of its file: the same check stands before any folder."""
    with pytest.raises(ConfigError, match="not a folder name inside the sweep folder"):
        Cell(name=name, options={}, overrides=[])
