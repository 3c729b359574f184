"""Data adapters: a torch dataset (an image folder too), a Hugging Face dataset, a Flower Datasets partitioner's
split, and uint8 arrays memory-mapped from disk each train a run equal, bit for bit, to the same data passed as
tensors; a memory-mapped dataset trains where loading it would not fit."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import fedflat
from fedflat.api import as_config
from fedflat.data import Dataset, DatasetError, flwr_partitions, load_dataset
from fedflat.data.dataset import uint8_dataset
from fedflat.engine.simulation import Simulation, UserInputs
from fedflat.experiments.resume import metrics_equal
from tests.conftest import mapped_file

REPO = Path(__file__).resolve().parents[1]
CONFIG = {"rounds": 3, "model": {"name": "mlp", "hidden": [16]}, "data": {"num_clients": 6,
          "partition": {"scheme": "dirichlet", "alpha": 0.5, "min_size": 5}},
          "train": {"local_epochs": 1, "batch_size": 10}, "sampling": {"clients_per_round": 3}, "threads": 1}


def same_run(a: Dataset, b: Dataset, clients_a=None, clients_b=None) -> None:
    """The two datasets train the same run, bit for bit (metrics but wall-clock fields, final parameters)."""
    runs = [fedflat.run(CONFIG, dataset=d, clients=c, save=False, progress=False)
            for d, c in ((a, clients_a), (b, clients_b))]
    assert metrics_equal(runs[0].metrics, runs[1].metrics)
    assert torch.equal(runs[0].final_parameters, runs[1].final_parameters)


class Pairs(torch.utils.data.Dataset):
    """A map-style torch dataset of ``(tensor, label)`` items."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


class ImageFolder(torch.utils.data.Dataset):
    """An image folder as torchvision's ``ImageFolder`` reads one (``root/<class>/<file>``, classes sorted), its
    items ``(PIL image, class index)``: torchvision itself does not import with this CPU torch build."""

    def __init__(self, root: Path):
        self.classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.samples = [(f, k) for k, c in enumerate(self.classes) for f in sorted((root / c).iterdir())]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        with Image.open(path) as image:
            image.load()
            return image, label


def image_folder(root: Path, per_class: int, seed: int) -> Path:
    """Three classes of 8x8 PNG images, each class a different mean colour; one in palette mode, one greyscale
    (both become RGB, as for torchvision's loader)."""
    rng = np.random.default_rng(seed)
    for k, cls in enumerate(["cat", "dog", "eel"]):
        (root / cls).mkdir(parents=True)
        for i in range(per_class):
            pixels = np.clip(rng.normal(60 + 70 * k, 30, (8, 8, 3)), 0, 255).astype(np.uint8)
            image = Image.fromarray(pixels)
            image = image.convert("P") if i == 1 else image.convert("L") if i == 2 else image
            image.save(root / cls / f"{i:03d}.png")
    return root


def decoded(folder: ImageFolder) -> tuple[np.ndarray, np.ndarray]:
    """The folder's images decoded by hand: RGB, uint8 [N, 3, H, W]."""
    x = np.stack([np.asarray(Image.open(f).convert("RGB")).transpose(2, 0, 1) for f, _ in folder.samples])
    return x, np.array([k for _, k in folder.samples])


def test_from_torch_equals_the_tensors(tmp_path):
    digits = load_dataset("digits")
    tensors = Dataset("digits", digits.x_train, digits.y_train, digits.x_test, digits.y_test, 10)
    adapted = Dataset.from_torch(Pairs(digits.x_train, digits.y_train), Pairs(digits.x_test, digits.y_test),
                                 name="digits")
    assert adapted.num_classes == 10 and adapted.x_train.dtype == torch.float32
    assert torch.equal(adapted.x_train, tensors.x_train) and torch.equal(adapted.y_test, tensors.y_test)
    same_run(adapted, tensors)


def test_an_image_folder_equals_its_uint8_tensors_and_its_memory_mapped_cache(tmp_path):
    train, test = (ImageFolder(image_folder(tmp_path / s, n, seed)) for s, n, seed in (("train", 40, 0),
                                                                                      ("test", 10, 1)))
    adapted = Dataset.from_torch(train, test, name="pets")
    assert adapted.num_classes == 3 and adapted.x_train.shape == (120, 3, 8, 8) and adapted.standardize is not None
    tensors = uint8_dataset("pets", *decoded(train), *decoded(test), num_classes=3)
    assert torch.equal(adapted.x_train, tensors.x_train) and adapted.standardize == tensors.standardize
    same_run(adapted, tensors)
    cached = Dataset.from_torch(train, test, name="pets", cache=tmp_path / "cache")
    mapped = Dataset.from_memmap(tmp_path / "cache")  # a later run maps the cache without converting
    assert mapped_file(cached.x_train) == mapped_file(mapped.x_train) == str(tmp_path / "cache" / "x_train.npy")
    assert (mapped.name, mapped.num_classes, mapped.standardize) == ("pets", 3, tensors.standardize)
    same_run(mapped, tensors)


def test_bad_torch_items_name_what_to_fix(tmp_path):
    x = torch.zeros(4, 3)
    with pytest.raises(DatasetError, match=r"test\[0\] must be an \(input, label\) pair"):
        Dataset.from_torch(Pairs(x, torch.zeros(4, dtype=torch.long)), [x[0]] * 2)
    with pytest.raises(DatasetError, match="the label must be an integer class id"):
        Dataset.from_torch(Pairs(x, torch.full((4,), 0.5)), Pairs(x, torch.zeros(4)))
    images = [(Image.new("RGB", (8, 8)), 0), (Image.new("RGB", (9, 8)), 1)]
    with pytest.raises(DatasetError, match=r"train\[1\] has shape \(3, 8, 9\) but .*\[0\] has \(3, 8, 8\)"):
        Dataset.from_torch(images, images)


def hf_images(n: int, seed: int):
    import datasets

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 3, n)
    pixels = [np.clip(rng.normal(60 + 70 * k, 30, (8, 8, 3)), 0, 255).astype(np.uint8) for k in labels]
    features = datasets.Features({"img": datasets.Image(), "fine_label": datasets.ClassLabel(names=["a", "b", "c"])})
    data = datasets.Dataset.from_dict({"img": [Image.fromarray(p) for p in pixels], "fine_label": labels.tolist()},
                                      features=features)
    return data, np.stack([p.transpose(2, 0, 1) for p in pixels]), labels


def test_from_hf_images_and_tabular_columns_equal_the_tensors():
    datasets = pytest.importorskip("datasets")

    (train, x_train, y_train), (test, x_test, y_test) = hf_images(90, 0), hf_images(30, 1)
    adapted = Dataset.from_hf(train, test, features="img", label="fine_label", name="hf-images")
    assert adapted.num_classes == 3 and adapted.y_train.tolist() == y_train.tolist()  # from the ClassLabel
    same_run(adapted, uint8_dataset("hf-images", x_train, y_train, x_test, y_test, num_classes=3))

    rng = np.random.default_rng(2)
    table = {f"f{j}": rng.normal(size=120).astype(np.float32) for j in range(5)}
    labels = (table["f0"] > 0).astype(int) + (table["f1"] > 0).astype(int)
    rows = datasets.Dataset.from_dict({**{k: v.tolist() for k, v in table.items()}, "y": labels.tolist()})
    columns = list(table)
    adapted = Dataset.from_hf(rows.select(range(90)), rows.select(range(90, 120)), features=columns, label="y")
    x = np.stack([table[c] for c in columns], axis=1)
    assert adapted.x_train.dtype == torch.float32 and adapted.num_classes == 3
    same_run(adapted, Dataset("hf", x[:90], labels[:90], x[90:], labels[90:], 3))
    with pytest.raises(DatasetError, match="the train split has no column 'pixels'; its columns: img, fine_label"):
        Dataset.from_hf(train, test, features="pixels", label="fine_label")


def test_a_flower_datasets_partitioner_split_as_clients_equals_the_tensors():
    """flwr_partitions(partitioner, train) gives client i exactly the rows of partition i (as the partitioner
    loads them), and the run on it equals the run on the same arrays passed as tensors with those clients."""
    datasets = pytest.importorskip("datasets")
    DirichletPartitioner = pytest.importorskip("flwr_datasets.partitioner").DirichletPartitioner

    rng = np.random.default_rng(3)
    x = rng.normal(size=(150, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(int) + (x[:, 1] > 0.5).astype(int)
    hf = datasets.Dataset.from_dict({"x": x.tolist(), "label": y.tolist()})
    train, test = hf.select(range(120)), hf.select(range(120, 150))
    make = lambda: DirichletPartitioner(num_partitions=6, partition_by="label", alpha=1.0, seed=7,  # noqa: E731
                                        min_partition_size=5)
    clients = flwr_partitions(make(), train)
    assert sorted(np.concatenate(clients).tolist()) == list(range(120))  # every sample in exactly one partition
    partitioner = make()
    partitioner.dataset = train  # the partitions as a user loads them
    for i, client in enumerate(clients):
        part = partitioner.load_partition(i).with_format("numpy")[:]
        rows = lambda a, b: sorted(map(tuple, np.column_stack([a, b]).tolist()))  # noqa: E731
        assert rows(part["x"].astype(np.float32), part["label"]) == rows(x[client], y[client])
    data = Dataset.from_hf(train, test, features="x", label="label")
    same_run(data, Dataset("flwr", x[:120], y[:120], x[120:], y[120:], 3), clients_a=clients, clients_b=clients)


def memmap_folder(folder: Path, train: int, test: int, shape=(3, 8, 8), seed: int = 0) -> Path:
    """uint8 images written straight to ``.npy`` files on disk (never whole in memory), and their labels."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, count in (("train", train), ("test", test)):
        x = np.lib.format.open_memmap(folder / f"x_{split}.npy", mode="w+", dtype=np.uint8, shape=(count, *shape))
        labels = rng.integers(0, 3, count)
        for lo in range(0, count, 4096):
            k = labels[lo:lo + 4096, None, None, None]
            x[lo:lo + 4096] = np.clip(rng.normal(60 + 70 * k, 40, (len(k), *shape)), 0, 255).astype(np.uint8)
        x.flush()
        del x
        np.save(folder / f"y_{split}.npy", labels)
    return folder


def test_a_memory_mapped_dataset_trains_from_disk_as_in_memory(tmp_path):
    folder = memmap_folder(tmp_path / "data", 300, 60)
    mapped = Dataset.from_memmap(folder, num_classes=3)
    loaded = uint8_dataset("data", *(np.load(folder / f"{f}.npy") for f in ("x_train", "y_train", "x_test", "y_test")),
                           num_classes=3)
    assert mapped.standardize == loaded.standardize
    same_run(mapped, loaded)
    # the run trains from the file's pages: nothing copied
    sim = Simulation(as_config(CONFIG), UserInputs(dataset=mapped))
    if sim.device.type == "cpu":
        assert mapped_file(sim.dataset.x_train) == str(folder / "x_train.npy")
    else:  # a GPU run copies the pages to the device once
        assert torch.equal(sim.dataset.x_train.cpu(), torch.from_numpy(np.load(folder / "x_train.npy")))
    sim.close()
    (folder / "x_test.npy").unlink()
    with pytest.raises(DatasetError, match="no x_test.npy; a memory-mapped dataset is the four files"):
        Dataset.from_memmap(folder)


LIMITED = """
import faulthandler, json, resource, sys
from pathlib import Path
faulthandler.dump_traceback_later(240, exit=True)
import numpy as np
sys.path.insert(0, {repo!r})
import fedflat
from fedflat.data import Dataset
from tests.test_adapters import CONFIG, memmap_folder

def run(folder):
    data = Dataset.from_memmap(folder, num_classes=3)
    return fedflat.run({{**CONFIG, "rounds": 2}}, dataset=data, save=False, progress=False)

run(memmap_folder(Path({folder!r}).parent / "warm", 300, 60, shape=(3, 32, 32)))  # torch's lazy imports first

def data_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmData:"):
            return int(line.split()[1]) * 1024

limit = data_bytes() + {headroom}
resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))  # what this process may allocate: less than the data
try:
    np.load({folder!r} + "/x_train.npy")
    loaded = True
except MemoryError:
    loaded = False
print(json.dumps({{"loaded": loaded, "metrics": run({folder!r}).metrics}}))
"""


@pytest.mark.slow
def test_a_dataset_larger_than_the_memory_a_process_may_use_trains_from_disk(tmp_path):
    """A process whose allocations are capped below the training images' size (RLIMIT_DATA: a file mapped
    read-only is not counted, as pages the kernel can drop are not) cannot load them, yet trains from their
    memory map, with the numbers of the same data in memory."""
    folder = memmap_folder(tmp_path / "big", 40_000, 600, shape=(3, 32, 32))  # 123 MB of training images
    headroom = 64 * 2 ** 20
    code = LIMITED.format(repo=str(REPO), folder=str(folder), headroom=headroom)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    child = json.loads(out.stdout.splitlines()[-1])
    assert not child["loaded"]  # the images do not fit in what the process may allocate
    in_memory = uint8_dataset("big", *(np.load(folder / f"{f}.npy") for f in ("x_train", "y_train", "x_test",
                                                                              "y_test")), num_classes=3)
    expected = fedflat.run({**CONFIG, "rounds": 2}, dataset=in_memory, save=False, progress=False)
    assert metrics_equal(json.loads(json.dumps(expected.metrics)), child["metrics"])
