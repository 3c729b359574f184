"""A run config inherits another with ``base:`` (a file beside it or a shipped config's name) plus its edits,
deep-merged; the run folder's config.yaml is the merged config, complete without the base; sweeps' ``base`` reads
the same way."""
from __future__ import annotations

import pytest
import yaml

from fedflat.cli import main
from fedflat.config import file_kind, load_config, resolve
from fedflat.core import ConfigError
from fedflat.experiments.sweep import load_sweep
from tests.conftest import tiny_tree


def write(path, tree) -> str:
    path.write_text(yaml.safe_dump(tree))
    return str(path)


def test_a_run_config_inherits_a_shipped_one_with_its_edits_deep_merged(tmp_path):
    mine = write(tmp_path / "mine.yaml", {"base": "fmnist_mlp", "rounds": 20, "train": {"lr": 0.05}})
    assert file_kind(yaml.safe_load(open(mine))) == "run"  # not taken for a sweep file (issue 59)
    expected = load_config("fmnist_mlp", ["rounds=20", "train.lr=0.05"])
    assert resolve(load_config(mine)) == resolve(expected)
    cfg = load_config(mine)
    assert cfg.train.local_epochs == 5 and cfg.train.batch_size == 50 and cfg.train.lr == 0.05  # the base's kept
    # a section naming another method starts afresh (fmnist_mlp's rho belongs to its fedwmsam), as algo=X does
    other = write(tmp_path / "other.yaml", {"base": "mine.yaml", "algo": {"name": "fedsam", "rho": 0.1}})
    assert resolve(load_config(other)) == resolve(load_config("fmnist_mlp", ["rounds=20", "train.lr=0.05",
                                                                            "algo=fedsam", "algo.rho=0.1"]))
    assert load_config(other, ["rounds=3"]).rounds == 3  # the command line wins over both files


def test_inheritance_cycles_and_unknown_bases_are_refused_clearly(tmp_path):
    write(tmp_path / "a.yaml", {"base": "b.yaml", "rounds": 1})
    write(tmp_path / "b.yaml", {"base": "a.yaml", "seed": 1})
    with pytest.raises(ConfigError, match=r"a\.yaml: the configs inherit in a cycle \(a\.yaml -> b\.yaml -> a\.yaml\)"):
        load_config(tmp_path / "a.yaml")
    write(tmp_path / "self.yaml", {"base": "self.yaml"})
    with pytest.raises(ConfigError, match=r"cycle \(self\.yaml -> self\.yaml\)"):
        load_config(tmp_path / "self.yaml")
    write(tmp_path / "typo.yaml", {"base": "fmnist_mpl", "rounds": 1})
    with pytest.raises(ConfigError, match=r"base config 'fmnist_mpl' not found .*did you mean 'fmnist_mlp'"):
        load_config(tmp_path / "typo.yaml")
    write(tmp_path / "sweepbase.yaml", {"base": "demo_sweep", "rounds": 1})
    with pytest.raises(ConfigError, match=r"base 'demo_sweep' .* is not one run's config but sweep file"):
        load_config(tmp_path / "sweepbase.yaml")


def test_the_run_folder_holds_the_merged_config_and_reruns_without_the_base(tmp_path, capsys):
    write(tmp_path / "tiny.yaml", tiny_tree())
    child = write(tmp_path / "child.yaml", {"base": "tiny.yaml", "rounds": 1, "train": {"lr": 0.2}})
    assert main(["run", child, "--out", str(tmp_path / "runs"), "--no-progress"]) == 0
    (folder,) = (tmp_path / "runs").iterdir()
    saved = yaml.safe_load((folder / "config.yaml").read_text())
    assert "base" not in saved and saved["rounds"] == 1 and saved["train"]["lr"] == 0.2
    assert saved["train"]["batch_size"] == 10 and saved["data"]["num_clients"] == 6  # from the base
    (tmp_path / "tiny.yaml").unlink()  # the folder stands alone
    assert resolve(load_config(folder / "config.yaml")) == saved


def test_a_sweep_base_that_inherits_is_read_through(tmp_path):
    write(tmp_path / "mine.yaml", {"base": "fmnist_mlp", "rounds": 20})
    sweep = write(tmp_path / "sweep.yaml", {"base": "mine.yaml", "grid": {"seed": [0, 1]}})
    cells = load_sweep(sweep).cells()
    assert [c.config.seed for c in cells] == [0, 1]
    assert resolve(cells[1].config) == resolve(load_config("fmnist_mlp", ["rounds=20", "seed=1"]))
