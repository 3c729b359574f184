"""Dataset readers, search order, loaders, the registry, and batched CIFAR augmentation."""

from __future__ import annotations

import gzip
import io
import os
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

import fedflat.data.sources as sources
from fedflat.data import (AUGMENTATIONS, DATASETS, Dataset, DatasetNotFoundError, apply_augmentation,
                          cifar_augment, crop_flip, load_dataset)
from fedflat.data.readers import extract_tar_safely, read_cifar_batch, read_idx

DEBIAN_FMNIST = Path("/usr/share/datasets/fashion-mnist")
IDX_CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int8): 0x09, np.dtype(">i2"): 0x0B,
             np.dtype(">i4"): 0x0C, np.dtype(">f4"): 0x0D, np.dtype(">f8"): 0x0E}


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    """No user data folders: $FEDFLAT_DATA unset, the cache inside tmp_path."""
    monkeypatch.delenv("FEDFLAT_DATA", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


# ----------------------------------------------------------------------------- file makers

def write_idx(path: Path, array: np.ndarray, gz: bool) -> Path:
    """Write ``array`` as an IDX file (big-endian), gzipped if ``gz``."""
    array = np.asarray(array)
    big = array.astype(array.dtype.newbyteorder(">")) if array.dtype.itemsize > 1 else array
    header = bytes([0, 0, IDX_CODES[big.dtype], array.ndim]) + np.array(array.shape, ">u4").tobytes()
    payload = header + big.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(payload) if gz else payload)
    return path


def make_idx_dataset(folder: Path, seed: int, gz: bool = True, n_train: int = 30, n_test: int = 12,
                     dotted: bool = False) -> dict[str, np.ndarray]:
    """Write a tiny MNIST-format dataset into ``folder``; returns the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
              "train-labels-idx1-ubyte": rng.integers(0, 10, n_train, dtype=np.uint8),
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
              "t10k-labels-idx1-ubyte": rng.integers(0, 10, n_test, dtype=np.uint8)}
    for stem, array in arrays.items():
        name = stem.replace("-idx", ".idx") if dotted else stem
        write_idx(folder / (name + (".gz" if gz else "")), array, gz)
    return arrays


def cifar_batch_bytes(images: np.ndarray, labels: np.ndarray, label_key: bytes) -> bytes:
    """A CIFAR python batch as the official pickles hold it (bytes keys, flat uint8 rows)."""
    batch = {b"data": images.reshape(len(images), -1), label_key: labels.tolist(), b"batch_label": b"test"}
    if label_key == b"fine_labels":
        batch[b"coarse_labels"] = (labels // 5).tolist()
    return pickle.dumps(batch, protocol=2)


def make_cifar(base: Path, name: str = "cifar10", seed: int = 0, per_batch: int = 4,
               archive: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Write a tiny CIFAR-10/100 in the official layout (folder, or tar.gz if ``archive``)."""
    rng = np.random.default_rng(seed)
    top, members, key, classes = (("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"],
                                   b"labels", 10) if name == "cifar10" else
                                  ("cifar-100-python", ["train", "test"], b"fine_labels", 100))
    files, xs, ys = {}, [], []
    for member in members:
        x = rng.integers(0, 256, (per_batch, 3, 32, 32), dtype=np.uint8)
        y = rng.integers(0, classes, per_batch)
        files[f"{top}/{member}"] = cifar_batch_bytes(x, y, key)
        xs.append(x), ys.append(y)
    base.mkdir(parents=True, exist_ok=True)
    if archive:
        tar_name = "cifar-10-python.tar.gz" if name == "cifar10" else "cifar-100-python.tar.gz"
        with tarfile.open(base / tar_name, "w:gz") as tar:
            for member, data in files.items():
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    else:
        for member, data in files.items():
            (base / member).parent.mkdir(parents=True, exist_ok=True)
            (base / member).write_bytes(data)
    return np.concatenate(xs[:-1]), np.concatenate(ys[:-1]), xs[-1], ys[-1]


def denormalize_check(x: torch.Tensor, raw: np.ndarray, scale: float) -> None:
    """``x`` equals ``raw / scale`` standardized per channel with the train statistics."""
    ref = torch.from_numpy(raw).float() / scale
    dims = [0] + list(range(2, ref.dim()))
    mean, std = ref.mean(dims, keepdim=True), ref.std(dims, keepdim=True)
    torch.testing.assert_close(x, (ref - mean) / std, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- IDX

@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8, ">i2", ">i4", ">f4", ">f8"])
def test_read_idx_round_trips(tmp_path, gz, dtype):
    values = (np.arange(2 * 3 * 5) - 7).reshape(2, 3, 5)
    array = (np.abs(values) if dtype == np.uint8 else values).astype(dtype)
    out = read_idx(write_idx(tmp_path / "a", array, gz))
    np.testing.assert_array_equal(out, array)
    assert out.shape == (2, 3, 5) and out.dtype.isnative and out.flags.writeable


def test_read_idx_rejects_bad_files(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x12\x34\x08\x01\x00\x00\x00\x02ab")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    truncated = write_idx(tmp_path / "t", np.zeros((4, 4), np.uint8), gz=False)
    truncated.write_bytes(truncated.read_bytes()[:-3])
    with pytest.raises(ValueError, match=r"shape \(4, 4\) \(16 bytes\) but the file holds 13"):
        read_idx(truncated)


@pytest.mark.parametrize("gz,dotted", [(True, False), (False, False), (False, True)])
def test_mnist_from_root(tmp_path, gz, dotted):
    arrays = make_idx_dataset(tmp_path / "root", seed=0, gz=gz, dotted=dotted)
    data = load_dataset("mnist", root=str(tmp_path / "root"))
    assert data.name == "mnist" and data.num_classes == 10 and data.augmentation is None
    assert data.x_train.shape == (30, 1, 28, 28) and data.x_test.shape == (12, 1, 28, 28)
    assert data.x_train.dtype == torch.float32 and data.y_train.dtype == torch.int64
    np.testing.assert_array_equal(data.y_train.numpy(), arrays["train-labels-idx1-ubyte"])
    np.testing.assert_array_equal(data.y_test.numpy(), arrays["t10k-labels-idx1-ubyte"])
    denormalize_check(data.x_train, arrays["train-images-idx3-ubyte"][:, None], 255.0)


def test_test_split_uses_train_statistics(tmp_path):
    arrays = make_idx_dataset(tmp_path, seed=1)
    data = load_dataset("mnist", root=tmp_path)
    train = arrays["train-images-idx3-ubyte"].astype(np.float64) / 255
    expected = (arrays["t10k-images-idx3-ubyte"] / 255 - train.mean()) / train.std(ddof=1)
    np.testing.assert_allclose(data.x_test[:, 0].numpy(), expected, rtol=1e-4, atol=1e-4)


def test_search_order_root_before_env_before_cache(tmp_path, monkeypatch):
    root_labels = make_idx_dataset(tmp_path / "root" / "mnist", seed=1)["train-labels-idx1-ubyte"]
    env_labels = make_idx_dataset(tmp_path / "env", seed=2)["train-labels-idx1-ubyte"]
    cache_labels = make_idx_dataset(tmp_path / "xdg-cache" / "fedflat" / "data" / "MNIST" / "raw",
                                    seed=3)["train-labels-idx1-ubyte"]
    monkeypatch.setenv("FEDFLAT_DATA", str(tmp_path / "env"))
    assert np.array_equal(load_dataset("mnist", root=tmp_path / "root").y_train.numpy(), root_labels)
    assert np.array_equal(load_dataset("mnist").y_train.numpy(), env_labels)
    # a root without the files falls through to $FEDFLAT_DATA
    (tmp_path / "empty").mkdir()
    assert np.array_equal(load_dataset("mnist", root=tmp_path / "empty").y_train.numpy(), env_labels)
    monkeypatch.delenv("FEDFLAT_DATA")
    assert np.array_equal(load_dataset("mnist").y_train.numpy(), cache_labels)


def test_fmnist_subfolder_names(tmp_path):
    labels = make_idx_dataset(tmp_path / "fashion-mnist", seed=4)["train-labels-idx1-ubyte"]
    data = load_dataset("fmnist", root=tmp_path)
    assert np.array_equal(data.y_train.numpy(), labels) and data.source == str(tmp_path / "fashion-mnist")


def test_incomplete_folder_is_not_used(tmp_path):
    make_idx_dataset(tmp_path / "root", seed=0)
    (tmp_path / "root" / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DatasetNotFoundError):
        load_dataset("mnist", root=tmp_path / "root")


def test_images_and_labels_must_agree(tmp_path):
    make_idx_dataset(tmp_path, seed=0)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(31, np.uint8), gz=True)
    with pytest.raises(ValueError, match=r"mnist train files .*images \(30, 28, 28\) do not match labels \(31,\)"):
        load_dataset("mnist", root=tmp_path)


def test_missing_dataset_lists_every_place_searched(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDFLAT_DATA", str(tmp_path / "env"))
    (tmp_path / "root").mkdir()
    with pytest.raises(FileNotFoundError) as info:
        load_dataset("mnist", root=tmp_path / "root")
    err = info.value
    assert isinstance(err, DatasetNotFoundError)
    cache = tmp_path / "xdg-cache" / "fedflat" / "data"
    expected = [tmp_path / "root", tmp_path / "root" / "mnist", tmp_path / "env", tmp_path / "env" / "mnist",
                cache, cache / "mnist", cache / "MNIST" / "raw"]
    for place in expected:
        assert f"  - {place}\n" in str(err) + "\n", place
        assert place in err.searched
    text = str(err)
    assert text.index(str(tmp_path / "root")) < text.index(str(tmp_path / "env")) < text.index(str(cache))
    assert "download=True" in text and "data.download=true" in text
    assert "train-images-idx3-ubyte.gz" in text


def test_missing_fmnist_suggests_apt_and_lists_system_folder(tmp_path, monkeypatch):
    monkeypatch.setitem(sources.SYSTEM_DIRS, "fmnist", (tmp_path / "usr-share" / "fashion-mnist",))
    with pytest.raises(DatasetNotFoundError) as info:
        load_dataset("fmnist")
    text = str(info.value)
    assert "apt-get install dataset-fashion-mnist" in text
    assert str(tmp_path / "usr-share" / "fashion-mnist") in text
    assert "(root and $FEDFLAT_DATA not set)" in text


@pytest.mark.skipif(not DEBIAN_FMNIST.is_dir(), reason="Debian's dataset-fashion-mnist is not installed")
def test_fmnist_from_debian_files():
    data = load_dataset("fmnist")
    assert data.source == str(DEBIAN_FMNIST)
    assert len(data.y_train) == 60000 and len(data.y_test) == 10000
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10
    assert np.array_equal(np.bincount(data.y_train.numpy()), np.full(10, 6000))
    assert abs(data.x_train.mean().item()) < 1e-3 and abs(data.x_train.std().item() - 1) < 1e-3


# ----------------------------------------------------------------------------- CIFAR

@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_from_folder(tmp_path, name):
    x_train, y_train, x_test, y_test = make_cifar(tmp_path / name, name)
    data = load_dataset(name, root=tmp_path)
    assert data.num_classes == (10 if name == "cifar10" else 100) and data.augmentation == "cifar"
    assert data.input_shape == (3, 32, 32) and len(data.y_train) == len(x_train)
    np.testing.assert_array_equal(data.y_train.numpy(), y_train)  # fine labels for CIFAR-100
    np.testing.assert_array_equal(data.y_test.numpy(), y_test)
    denormalize_check(data.x_train, x_train, 255.0)
    per_channel_mean = data.x_train.mean(dim=(0, 2, 3))
    torch.testing.assert_close(per_channel_mean, torch.zeros(3), atol=1e-5, rtol=0)


def test_cifar_from_archive_extracts_next_to_it(tmp_path):
    x_train, y_train, _, y_test = make_cifar(tmp_path, "cifar10", archive=True, seed=3)
    assert not (tmp_path / "cifar-10-batches-py").exists()
    data = load_dataset("cifar10", root=tmp_path)
    np.testing.assert_array_equal(data.y_train.numpy(), y_train)
    np.testing.assert_array_equal(data.y_test.numpy(), y_test)
    assert (tmp_path / "cifar-10-batches-py" / "data_batch_5").is_file()
    assert data.source == str(tmp_path / "cifar-10-batches-py")
    assert not list(tmp_path.rglob("*.part"))


def test_cifar_archive_in_read_only_folder_is_read_directly(tmp_path, monkeypatch):
    _, y_train, _, _ = make_cifar(tmp_path / "cifar100", "cifar100", archive=True, seed=4)
    monkeypatch.setattr("fedflat.data.datasets._writable", lambda folder: False)
    data = load_dataset("cifar100", root=tmp_path)
    np.testing.assert_array_equal(data.y_train.numpy(), y_train)
    assert data.source.endswith("cifar-100-python.tar.gz")
    assert not (tmp_path / "cifar100" / "cifar-100-python").exists()


def test_cifar_pickle_with_code_is_refused():
    class Exploit:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    with pytest.raises(pickle.UnpicklingError, match="refusing to load"):
        read_cifar_batch(io.BytesIO(pickle.dumps({b"data": Exploit(), b"labels": []})), b"labels")


@pytest.mark.parametrize("member", ["../evil.txt", "/tmp/evil-fedflat-test.txt", "link"])
def test_unsafe_tar_members_are_refused(tmp_path, member):
    archive = tmp_path / "a.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        ok = tarfile.TarInfo("fine.txt")
        ok.size = 2
        tar.addfile(ok, io.BytesIO(b"ok"))
        bad = tarfile.TarInfo(member)
        if member == "link":
            bad.type, bad.linkname = tarfile.SYMTYPE, "/etc/passwd"
        else:
            bad.size = 4
        tar.addfile(bad, io.BytesIO(b"evil") if member != "link" else None)
    dest = tmp_path / "out"
    with pytest.raises(ValueError, match="unsafe member"):
        extract_tar_safely(archive, dest)
    assert not (dest / "fine.txt").exists() and not (tmp_path / "evil.txt").exists()


# ----------------------------------------------------------------------------- digits, synthetic, registry

def test_digits_shapes_split_and_determinism():
    data = load_dataset("digits")
    assert data.input_shape == (1, 8, 8) and data.num_classes == 10
    assert len(data.y_train) == 1438 and len(data.y_test) == 359
    totals = np.bincount(np.concatenate([data.y_train.numpy(), data.y_test.numpy()]))
    np.testing.assert_array_equal(np.bincount(data.y_test.numpy()), np.round(0.2 * totals).astype(int))
    again = load_dataset("digits")
    assert torch.equal(data.x_train, again.x_train) and torch.equal(data.y_test, again.y_test)
    assert abs(data.x_train.mean().item()) < 1e-5 and abs(data.x_train.std().item() - 1) < 1e-4


def test_synthetic_options_are_honored():
    data = load_dataset("synthetic", shape=[3, 5, 7], num_classes=4, train_size=101, test_size=9)
    assert data.input_shape == (3, 5, 7) and data.num_classes == 4
    assert data.x_train.shape == (101, 3, 5, 7) and data.x_test.shape == (9, 3, 5, 7)
    assert sorted(np.bincount(data.y_train.numpy()).tolist()) == [25, 25, 25, 26]
    flat = load_dataset("synthetic", shape=(20,), train_size=50, test_size=5)
    assert flat.x_train.shape == (50, 20) and flat.num_classes == 10


def test_synthetic_is_deterministic_per_seed():
    a = load_dataset("synthetic", shape=(8,), train_size=64, test_size=16, seed=3)
    b = load_dataset("synthetic", shape=(8,), train_size=64, test_size=16, seed=3)
    c = load_dataset("synthetic", shape=(8,), train_size=64, test_size=16, seed=4)
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    assert not torch.equal(a.x_train, c.x_train)


def test_synthetic_is_learnable():
    data = load_dataset("synthetic", shape=(1, 6, 6), train_size=2000, test_size=500, seed=0)
    x_train, x_test = data.x_train.flatten(1), data.x_test.flatten(1)
    means = torch.stack([x_train[data.y_train == k].mean(0) for k in range(10)])
    accuracy = (torch.cdist(x_test, means).argmin(1) == data.y_test).float().mean().item()
    assert accuracy > 0.9
    noisy = load_dataset("synthetic", shape=(1, 6, 6), train_size=2000, test_size=500, noise=20.0)
    means = torch.stack([noisy.x_train.flatten(1)[noisy.y_train == k].mean(0) for k in range(10)])
    assert (torch.cdist(noisy.x_test.flatten(1), means).argmin(1) == noisy.y_test).float().mean() < accuracy


@pytest.mark.parametrize("name,options,message", [
    ("synthetic", {"size": 3}, r"dataset 'synthetic': unknown option\(s\) size; valid options: shape, num_classes, "
                               r"train_size, test_size, seed, noise"),
    ("digits", {"shape": (1, 8, 8)}, r"dataset 'digits': unknown option\(s\) shape; valid options: classes$"),
    ("mnist", {"train_size": 10}, r"unknown option\(s\) train_size"),
    ("synthetic", {"shape": (0, 3)}, r"shape must be a non-empty sequence of positive ints"),
    ("synthetic", {"num_classes": 1}, r"num_classes must be an int >= 2"),
    ("synthetic", {"noise": -1.0}, r"noise must be >= 0"),
    ("imagenet", {}, r"unknown dataset 'imagenet'; available: digits, mnist, fmnist, cifar10, cifar100, tinyimagenet, officehome, domainnet, femnist, shakespeare, dbpedia, synthetic"),
])
def test_bad_dataset_options(name, options, message):
    with pytest.raises(ValueError, match=message):
        load_dataset(name, **options)


def test_registry_and_dataset_helpers():
    assert set(DATASETS) == {"digits", "mnist", "fmnist", "cifar10", "cifar100", "tinyimagenet", "officehome", "domainnet", "femnist", "shakespeare", "dbpedia", "glue", "synthetic"}
    assert all(callable(loader) and description for loader, description in DATASETS.values())
    data = load_dataset("synthetic", shape=(2, 3), train_size=10, test_size=4)
    assert isinstance(data, Dataset) and data.input_shape == (2, 3)
    moved = data.to("cpu")
    assert moved is not data and torch.equal(moved.x_train, data.x_train) and moved.num_classes == 10
    assert "train=10" in repr(data)


# ----------------------------------------------------------------------------- augmentation

def crop_reference(x: torch.Tensor, row: int, col: int, flip: bool, padding: int = 4) -> torch.Tensor:
    """One sample's crop/flip, written the slow obvious way."""
    padded = torch.nn.functional.pad(x, (padding,) * 4)
    crop = padded[:, row:row + x.shape[1], col:col + x.shape[2]]
    return crop.flip(-1) if flip else crop


def test_crop_flip_zero_shift_and_flip():
    x = torch.randn(5, 3, 32, 32)
    center = torch.full((5, 2), 4)
    assert torch.equal(crop_flip(x, center, torch.zeros(5, dtype=torch.bool)), x)
    assert torch.equal(crop_flip(x, center, torch.ones(5, dtype=torch.bool)), torch.flip(x, dims=[-1]))
    corner = crop_flip(x, torch.zeros(5, 2, dtype=torch.long), torch.zeros(5, dtype=torch.bool))
    assert torch.equal(corner[..., 4:, 4:], x[..., :-4, :-4])
    assert torch.all(corner[..., :4, :] == 0) and torch.all(corner[..., :, :4] == 0)


def test_crop_flip_matches_per_sample_reference():
    x = torch.randn(16, 3, 12, 10)
    offsets = torch.randint(0, 9, (16, 2), generator=torch.Generator().manual_seed(1))
    flips = torch.rand(16, generator=torch.Generator().manual_seed(2)) < 0.5
    out = crop_flip(x, offsets, flips)
    for i in range(16):
        assert torch.equal(out[i], crop_reference(x[i], int(offsets[i, 0]), int(offsets[i, 1]), bool(flips[i])))


def test_cifar_augment_shape_and_determinism():
    x = torch.randn(64, 3, 32, 32)
    a = cifar_augment(x, torch.Generator().manual_seed(0))
    b = cifar_augment(x, torch.Generator().manual_seed(0))
    c = cifar_augment(x, torch.Generator().manual_seed(1))
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, b) and not torch.equal(a, c)
    generator = torch.Generator().manual_seed(0)
    first, second = cifar_augment(x, generator), cifar_augment(x, generator)
    assert torch.equal(first, a) and not torch.equal(first, second)  # the state advances


def test_cifar_augment_values_come_from_the_padded_image():
    x = torch.randn(24, 2, 32, 32)
    out = cifar_augment(x, torch.Generator().manual_seed(5))
    seen = set()
    for i in range(len(x)):
        matches = [(r, c, f) for r in range(9) for c in range(9) for f in (False, True)
                   if torch.equal(out[i], crop_reference(x[i], r, c, f))]
        assert len(matches) == 1, f"sample {i} is not a pad-4 crop/flip of its input"
        seen.add(matches[0])
    assert len({m[2] for m in seen}) == 2 and len({m[:2] for m in seen}) > 10


def test_apply_augmentation():
    x = torch.randn(3, 3, 32, 32)
    assert apply_augmentation(None, x, torch.Generator()) is x
    assert torch.equal(apply_augmentation("cifar", x, torch.Generator().manual_seed(0)),
                       cifar_augment(x, torch.Generator().manual_seed(0)))
    assert set(AUGMENTATIONS) == {"cifar", "flip"}
    with pytest.raises(ValueError, match="unknown augmentation 'mixup'"):
        apply_augmentation("mixup", x, torch.Generator())
