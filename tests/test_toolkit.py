"""The researcher's everyday toolkit, smaller items (issue 47.8): version, listing, memmap statistics, MLflow's
store, the API reference."""
from __future__ import annotations

import pytest

import fedflat
from fedflat.cli import main


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedflat {fedflat.__version__}"


def test_list_configs_prints_only_the_configs(capsys):
    assert main(["list", "--configs"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("shipped configs")
    assert "algorithms:" not in out and "datasets:" not in out and "partitions:" not in out
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("algorithms:") and "shipped configs" not in out
