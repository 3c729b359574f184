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
