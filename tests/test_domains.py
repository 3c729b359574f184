"""OfficeHome and DomainNet from small folders in the official layouts (images written here with Pillow), the
leave-one-domain-out split, the ``domain`` partition, and uint8 storage standardized per batch."""
from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fedflat
from fedflat.data import Dataset, DatasetError, DatasetNotFoundError, load_dataset, partition
from fedflat.data.domains import DOMAINNET_DOMAINS, OFFICEHOME_DOMAINS
from tests.conftest import mapped_file

CLASSES = ["Bike", "Calculator", "Mug"]


def write_image(path, grey: int, size=(20, 14), suffix_mode="RGB"):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((size[1], size[0], 3), grey, dtype=np.uint8), mode=suffix_mode).save(path)


def officehome(root, per_class=2):
    """``OfficeHomeDataset_10072016/<Domain>/<Class>/NNNNN.jpg``; grey level = 10 * domain + 60 * class."""
    folder = root / "OfficeHomeDataset_10072016"
    for d, name in enumerate(OFFICEHOME_DOMAINS.values()):
        for k, cls in enumerate(CLASSES):
            for i in range(per_class):
                write_image(folder / name / cls / f"{i:05d}.{'png' if i % 2 else 'jpg'}", 10 * d + 60 * k)
    return folder


def domainnet(root, per_list=3):
    """``<domain>/<class>/*.jpg`` with ``<domain>_train.txt`` / ``_test.txt``; grey = 20 * domain + label."""
    folder = root / "domainnet"
    for d, domain in enumerate(DOMAINNET_DOMAINS):
        for which in ("train", "test"):
            lines = []
            for i in range(per_list):
                label = i % 3
                rel = f"{domain}/c{label}/{domain}_{which}_{i}.jpg"
                write_image(folder / rel, 20 * d + label)
                lines.append(f"{rel} {label}")
            (folder / f"{domain}_{which}.txt").write_text("\n".join(lines) + "\n")
    return folder


def greys(data: Dataset, split: str) -> np.ndarray:
    return getattr(data, f"x_{split}").numpy()[:, 0, 0, 0].astype(int)


def test_officehome_leave_one_domain_out(tmp_path):
    folder = officehome(tmp_path)
    data = load_dataset("officehome", root=tmp_path, test_domain="clipart", size=16)
    assert data.x_train.dtype == torch.uint8 and data.x_train.shape == (18, 3, 16, 16) and data.num_classes == 3
    assert data.owner_names == ["art", "product", "real_world"] and data.augmentation == "flip"
    # the test set is exactly clipart (domain 1), the training set the other three, each image with its class
    assert sorted(set(abs(greys(data, "test") - 10 - 60 * data.y_test.numpy()))) == [0]
    domain_of = np.array([0, 2, 3])[data.owners]
    assert np.abs(greys(data, "train") - 10 * domain_of - 60 * data.y_train.numpy()).max() <= 1  # (JPEG)
    # paged from the cache, not held in memory: the training domains joined into one cached file
    joined = mapped_file(data.x_train)
    assert Path(joined).name.startswith("train-art-product-real_world-16-") and mapped_file(data.x_test)
    assert np.array_equal(np.load(joined), np.concatenate([np.load(f) for f in sorted(
        (folder / ".fedflat-cache").glob("*-16-*.npy")) if f.name.split("-")[0] in ("art", "product", "real_world")
        and "moments" not in f.name]))
    # another target domain reuses the per-domain decode cache (and joins its training domains)
    cached = set((folder / ".fedflat-cache").iterdir())
    other = load_dataset("officehome", root=tmp_path, test_domain="art", size=16)
    added = set((folder / ".fedflat-cache").iterdir()) - cached
    assert [p.name.startswith("train-clipart-product-real_world-16-") for p in added] == [True]
    assert other.owner_names == ["clipart", "product", "real_world"]
    with pytest.raises(DatasetError, match="test_domain must be one of art, clipart, product, real_world"):
        load_dataset("officehome", root=tmp_path, test_domain="sketch", size=16)


def test_officehome_zip_and_missing(tmp_path):
    source = officehome(tmp_path / "made", per_class=1)
    archive_dir = tmp_path / "data"
    archive_dir.mkdir()
    shutil.make_archive(str(archive_dir / source.name), "zip", source.parent, source.name)
    data = load_dataset("officehome", root=archive_dir, size=16)
    assert data.x_train.shape[0] == 9 and not list(archive_dir.glob(".*partial*"))
    (tmp_path / "elsewhere").mkdir()  # a folder without the files (one that does not exist: tests/test_faults.py)
    with pytest.raises(DatasetNotFoundError, match="OfficeHomeDataset_10072016.zip"):
        load_dataset("officehome", root=tmp_path / "elsewhere", size=16)


def test_domainnet_official_lists(tmp_path):
    domainnet(tmp_path)
    data = load_dataset("domainnet", root=tmp_path, test_domain="painting", size=16)
    assert data.x_train.shape == (15, 3, 16, 16) and data.x_test.shape == (3, 3, 16, 16) and data.num_classes == 3
    assert data.owner_names == ["clipart", "infograph", "quickdraw", "real", "sketch"]
    assert np.abs(greys(data, "test") - 40 - data.y_test.numpy()).max() <= 1  # painting (domain 2) test list
    every = load_dataset("domainnet", root=tmp_path, test_domain="painting", size=16, split="all")
    assert every.x_train.shape[0] == 30 and every.x_test.shape[0] == 6


def test_domainnet_bad_files_name_the_file_and_cache_nothing(tmp_path):
    folder = domainnet(tmp_path)
    (folder / "sketch_train.txt").write_text("sketch/c0/x.jpg zero\n")
    with pytest.raises(DatasetError, match=r"sketch_train.txt, line 1: expected"):
        load_dataset("domainnet", root=tmp_path, size=16)
    (folder / "sketch_train.txt").write_text("sketch/c0/missing.jpg 0\n")
    with pytest.raises(DatasetError, match="missing.jpg: not a readable image"):
        load_dataset("domainnet", root=tmp_path, size=16)
    assert not [p for p in (folder / ".fedflat-cache").iterdir() if "sketch" in p.name or "partial" in p.name]


def test_domain_partition():
    owners = np.repeat([0, 1, 2], [10, 7, 5])
    labels = np.zeros(22, dtype=np.int64)
    parts = partition(labels, 6, "domain", seed=3, per_domain=2, owners=owners)
    assert [sorted(set(owners[p])) for p in parts] == [[0], [0], [1], [1], [2], [2]]
    assert [len(p) for p in parts] == [5, 5, 4, 3, 3, 2] and len(np.unique(np.concatenate(parts))) == 22
    sampled = partition(labels, 3, "domain", seed=3, fraction=0.5, owners=owners)
    assert [len(p) for p in sampled] == [5, 4, 2]  # round(0.5 * n_d): 5, 3.5 -> 4, 2.5 -> 2
    with pytest.raises(ValueError, match="set data.num_clients=3"):
        partition(labels, 4, "domain", seed=3, owners=owners)
    with pytest.raises(ValueError, match="no domains"):
        partition(labels, 3, "domain", seed=3)


@pytest.mark.parametrize("engine", ["sequential", "vectorized"])
def test_uint8_storage_trains_exactly_as_its_float_features(tmp_path, engine):
    """A run on uint8 pixels standardized per batch equals the run on the same inputs stored as float32 (the
    vectorized engine's chunk budget ran the model on raw uint8 pixels: found on a GPU, where engine=auto is it)."""
    officehome(tmp_path)
    data = load_dataset("officehome", root=tmp_path, test_domain="product", size=16)
    floats = Dataset("officehome", data.features(data.x_train), data.y_train, data.features(data.x_test),
                     data.y_test, data.num_classes, augmentation="flip", owners=data.owners,
                     owner_names=data.owner_names)
    args = dict(overrides=["model=cnn", "data.num_clients=6", "data.partition={scheme: domain, per_domain: 2}",
                           "sampling.clients_per_round=3", "rounds=2", "threads=1", "train.batch_size=4",
                           f"engine={engine}"],
                save=False, progress=False)
    runs = [fedflat.run(None, dataset=d, **args) for d in (data, floats)]
    if runs[0].summary["device"] == "cuda":  # the GPU standardizes each batch, the floats were made on the CPU: one
        # rounding per pixel apart, carried through 2 rounds (the tolerance of test_cuda_run_equals_cpu_run)
        torch.testing.assert_close(runs[0].final_parameters, runs[1].final_parameters, rtol=1e-4, atol=1e-5)
        return
    assert runs[0].metrics[-1]["test_loss"] == runs[1].metrics[-1]["test_loss"]
    assert torch.equal(runs[0].final_parameters, runs[1].final_parameters)


def test_uint8_needs_its_standardization():
    x = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    with pytest.raises(DatasetError, match="uint8 pixels need standardize"):
        Dataset("d", x, torch.zeros(4, dtype=torch.long), x, torch.zeros(4, dtype=torch.long), 2)


def test_synthetic_domains_shift_every_domain_and_hold_one_out():
    plain = load_dataset("synthetic", shape=[2, 4, 4], num_classes=3, train_size=60, test_size=30)
    data = load_dataset("synthetic", shape=[2, 4, 4], num_classes=3, train_size=60, test_size=30, domains=3)
    assert data.owners.tolist() == [j % 3 for j in range(60)] and data.owner_names == ["domain0", "domain1", "domain2"]
    assert torch.equal(data.y_train, plain.y_train)  # the class draws are the plain data's; styles come after
    # noise 0: a sample is its class pattern plus its domain's style, so (class k, domain 1) - (class k, domain 0)
    # is the same style difference for every class, and the unseen test domain differs from every training one
    clean = load_dataset("synthetic", shape=[2, 4, 4], num_classes=3, train_size=60, test_size=30, domains=3,
                         noise=0.0)
    x, y, d = clean.x_train, clean.y_train.numpy(), clean.owners
    first = lambda k, dom: x[np.flatnonzero((y == k) & (d == dom))[0]]  # noqa: E731
    diffs = [first(k, 1) - first(k, 0) for k in range(3)]
    assert diffs[0].abs().max() > 0.05 and all(torch.allclose(diffs[0], e, atol=1e-5) for e in diffs[1:])
    test_first = clean.x_test[np.flatnonzero(clean.y_test.numpy() == 0)[0]]
    assert all((test_first - first(0, dom)).abs().max() > 0.05 for dom in range(3))
    parts = partition(data.y_train.numpy(), 3, "domain", seed=0, owners=data.owners)
    assert [sorted(set(data.owners[p])) for p in parts] == [[0], [1], [2]]


def test_synthetic_tokens_are_class_conditional_ids():
    data = load_dataset("synthetic", shape=[40], num_classes=2, train_size=400, test_size=40, tokens=20, seed=1)
    assert data.x_train.dtype == torch.int64 and int(data.x_train.min()) >= 0 and int(data.x_train.max()) < 20
    counts = [torch.bincount(data.x_train[data.y_train == k].flatten(), minlength=20).float() for k in (0, 1)]
    assert (counts[0] / counts[0].sum() - counts[1] / counts[1].sum()).abs().sum() > 0.3  # distinct distributions
    with pytest.raises(ValueError, match="tokens must be an int >= 0"):
        load_dataset("synthetic", tokens=-1)
