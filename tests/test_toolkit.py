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


def test_a_memory_maps_pixel_statistics_read_a_bounded_sample(tmp_path):
    """Within ``stats_bytes`` every image is read (the exact statistics of the arrays in memory); beyond, the
    statistics are those of a seeded uniform sample of ``stats_bytes // image_bytes`` images, computed by hand."""
    import numpy as np

    from fedflat.data import Dataset
    from fedflat.data.dataset import STATS_SEED, uint8_dataset
    from tests.test_adapters import memmap_folder

    folder = memmap_folder(tmp_path / "data", 300, 20, shape=(3, 4, 4))
    x = np.load(folder / "x_train.npy")
    exact = uint8_dataset("d", x, np.load(folder / "y_train.npy"), x[:2], np.zeros(2), num_classes=3).standardize
    assert Dataset.from_memmap(folder, num_classes=3).standardize == exact  # 300 * 48 bytes: all of it
    assert Dataset.from_memmap(folder, num_classes=3, stats_bytes=None).standardize == exact
    sampled = Dataset.from_memmap(folder, num_classes=3, stats_bytes=40 * 48 + 47).standardize  # 40 images
    rows = np.sort(np.random.default_rng(STATS_SEED).choice(300, size=40, replace=False))
    pixels = x[rows].astype(np.float64).transpose(1, 0, 2, 3).reshape(3, -1) / 255.0
    assert sampled.mean == pytest.approx(tuple(pixels.mean(axis=1)), rel=1e-12)
    assert sampled.std == pytest.approx(tuple(pixels.std(axis=1, ddof=1)), rel=1e-12)
    assert sampled != exact


@pytest.mark.slow  # MLflow makes a new SQLite store's tables: ~20 s
def test_a_sweeps_default_mlflow_store_is_in_the_sweeps_folder(tmp_path, monkeypatch):
    """An mlflow logger that names no store wrote a sweep's runs to mlflow.db in the working folder."""
    pytest.importorskip("mlflow")
    import yaml

    from fedflat.experiments.sweep import load_sweep, run_sweep
    from tests.conftest import tiny_tree
    from tests.test_loggers import mlflow_runs

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(tiny_tree(rounds=1, threads=1)))
    spec = {"base": str(tmp_path / "base.yaml"), "config": {"loggers": ["mlflow"]}, "out": str(tmp_path / "sweep"),
            "grid": {"seed": [0]}}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec))
    result = run_sweep(load_sweep(tmp_path / "sweep.yaml"), progress=False)
    assert [c["status"] for c in result.cells] == ["completed"]
    store = f"sqlite:///{tmp_path / 'sweep' / 'mlflow.db'}"
    assert [r.info.run_name for r in mlflow_runs(store, "sweep")] == ["seed0"]
    assert list(work.iterdir()) == []  # nothing in the working folder
    recorded = yaml.safe_load((tmp_path / "sweep" / "seed0" / "config.yaml").read_text())["loggers"]
    assert recorded[0]["tracking_uri"] == store  # a later `fedflat resume` of the cell finds the same store
    again = run_sweep(load_sweep(tmp_path / "sweep.yaml"), progress=False)  # the store is not part of the cell
    assert [c["action"] for c in again.cells] == ["skipped"]
