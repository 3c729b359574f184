"""Tiny-ImageNet-200 from a small folder (and zip) in the official layout, JPEGs written here with Pillow:
labels by wnids.txt, the validation split as test, the uint8 decode cache, bad files."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import fedflat
from fedflat.data import DatasetError, DatasetNotFoundError, load_dataset
from fedflat.data import images as images_module
from tests.conftest import mapped_file

WNIDS = ["n01443537", "n01629819", "n01641577"]


def tiny_imagenet(root, per_class=2):
    folder = root / "tiny-imagenet-200"
    (folder / "val" / "images").mkdir(parents=True)
    (folder / "wnids.txt").write_text("\n".join(WNIDS) + "\n")
    rng = np.random.default_rng(0)
    lines = []
    for k, wnid in enumerate(WNIDS):
        (folder / "train" / wnid / "images").mkdir(parents=True)
        for i in range(per_class):
            pixels = np.full((64, 64, 3), 40 * k + 10 * i, dtype=np.uint8)
            Image.fromarray(pixels).save(folder / "train" / wnid / "images" / f"{wnid}_{i}.JPEG", quality=100)
        name = f"val_{k}.JPEG"
        Image.fromarray(rng.integers(0, 255, (64, 64), dtype=np.uint8), mode="L").save(folder / "val" / "images" / name)
        lines.append(f"{name}\t{wnid}\t0\t0\t63\t63")
    (folder / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return folder


def test_layout_labels_and_the_uint8_cache(tmp_path, monkeypatch):
    folder = tiny_imagenet(tmp_path)
    data = load_dataset("tinyimagenet", root=tmp_path)
    assert data.x_train.shape == (6, 3, 64, 64) and data.x_test.shape == (3, 3, 64, 64) and data.num_classes == 3
    assert data.y_train.tolist() == [0, 0, 1, 1, 2, 2] and data.y_test.tolist() == [0, 1, 2]
    assert data.augmentation == "cifar"
    cached = sorted(p.name for p in (folder / ".fedflat-cache").iterdir())
    assert len(cached) == 4 and all(n.endswith(".npy") and "partial" not in n for n in cached)
    raw = np.load(folder / ".fedflat-cache" / next(n for n in cached if n.startswith("train") and "moments" not in n),
                  mmap_mode="r")
    assert raw.dtype == np.uint8 and abs(int(raw[2].mean()) - 40) <= 2  # class 1, image 0: grey level 40
    # kept uint8 (a quarter of float32's memory), standardized per batch with the training split's statistics
    assert data.x_train.dtype == torch.uint8 and data.standardize is not None
    assert mapped_file(data.x_train).startswith(str(folder / ".fedflat-cache" / "train-"))  # paged, not loaded
    assert mapped_file(data.x_test).startswith(str(folder / ".fedflat-cache" / "val-"))
    pixels = torch.from_numpy(np.asarray(raw, dtype=np.float32)) / 255
    inputs = data.features(data.x_train)
    assert torch.allclose(inputs, (pixels - pixels.mean((0, 2, 3), keepdim=True)) / pixels.std((0, 2, 3), keepdim=True),
                          atol=1e-5)
    monkeypatch.setattr(images_module, "decode", lambda files, out: pytest.fail("decoded again"))
    again = load_dataset("tinyimagenet", root=tmp_path)
    assert np.array_equal(again.x_train.numpy(), data.x_train.numpy())


def test_the_official_zip_is_extracted_once(tmp_path):
    source = tiny_imagenet(tmp_path / "made")
    archive_dir = tmp_path / "data"
    archive_dir.mkdir()
    shutil.make_archive(str(archive_dir / "tiny-imagenet-200"), "zip", source.parent, "tiny-imagenet-200")
    data = load_dataset("tinyimagenet", root=archive_dir)
    assert data.x_train.shape[0] == 6 and (archive_dir / "tiny-imagenet-200" / "wnids.txt").is_file()
    assert not list(archive_dir.glob(".*partial*"))


def test_a_corrupt_image_names_the_file_and_caches_nothing(tmp_path):
    folder = tiny_imagenet(tmp_path)
    bad = folder / "train" / WNIDS[1] / "images" / f"{WNIDS[1]}_1.JPEG"
    bad.write_bytes(b"not a jpeg")
    with pytest.raises(DatasetError, match=f"{bad.name}: not a readable image"):
        load_dataset("tinyimagenet", root=tmp_path)
    assert not list((folder / ".fedflat-cache").glob("*"))
    (tmp_path / "elsewhere").mkdir()  # a folder without the files (one that does not exist: tests/test_faults.py)
    with pytest.raises(DatasetNotFoundError, match="tiny-imagenet-200.zip"):
        load_dataset("tinyimagenet", root=tmp_path / "elsewhere")


def test_a_resnet_trains_on_it(tmp_path):
    tiny_imagenet(tmp_path, per_class=4)
    hist = fedflat.run(None, overrides=["data=tinyimagenet", f"data.root={tmp_path}", "model=cnn",
                                        "data.num_clients=3", "sampling.clients_per_round=2", "data.partition=iid",
                                        "rounds=1", "threads=1", "train.batch_size=4"], save=False, progress=False)
    assert np.isfinite(hist.metrics[-1]["test_loss"])
