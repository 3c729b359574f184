"""LEAF's FEMNIST and Shakespeare from small files in LEAF's JSON format (written here), the natural split,
and the LSTM trained on them end to end."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import fedflat
from fedflat.core import ConfigError
from fedflat.data import DatasetError, DatasetNotFoundError, load_dataset
from fedflat.data.leaf import LEAF_LETTERS

TEXT = "To be, or not to be, that is the question: Whether 'tis nobler in the mind to suffer The slings"


def _write(folder, users: dict[str, tuple[list, list]], files: int = 1) -> None:
    """LEAF's layout: ``folder`` holds JSON files, each with some of the users."""
    folder.mkdir(parents=True, exist_ok=True)
    names = list(users)
    for f in range(files):
        mine = names[f::files]
        doc = {"users": mine, "num_samples": [len(users[u][1]) for u in mine],
               "user_data": {u: {"x": users[u][0], "y": users[u][1]} for u in mine}}
        (folder / f"all_data_{f}_niid_0_keep_0_{'train' if 'train' in folder.name else 'test'}_9.json").write_text(
            json.dumps(doc))


def femnist(root, rng=np.random.default_rng(0), writers=(5, 3, 8)) -> None:
    for split, scale in (("train", 1), ("test", 1)):
        users = {f"f{w:04d}_{i}": (rng.random((n * scale, 784)).round(3).tolist(),
                                   rng.integers(0, 62, n * scale).tolist())
                 for i, (w, n) in enumerate(zip((1, 7, 42), writers))}
        _write(root / "femnist" / "data" / split, users, files=2 if split == "train" else 1)


def shakespeare(root, roles=(("HAMLET", 12), ("OPHELIA", 5), ("KING", 7))) -> None:
    for split in ("train", "test"):
        users = {}
        for role, n in roles:
            starts = range(n)
            users[f"THE_TRAGEDY_OF_HAMLET_{role}"] = ([TEXT[s:s + 80] for s in starts], [TEXT[s + 80] for s in starts])
        _write(root / "shakespeare" / "data" / split, users)


def test_femnist_reader_keeps_every_writer_as_a_client(tmp_path):
    femnist(tmp_path)
    data = load_dataset("femnist", root=tmp_path)
    assert data.x_train.shape == (16, 1, 28, 28) and data.num_classes == 62 and data.y_test.shape == (16,)
    assert data.owner_names == ["f0001_0", "f0042_2", "f0007_1"]  # file order: users 0, 2 in file 0; 1 in file 1
    assert np.bincount(data.owners).tolist() == [5, 8, 3]
    hist = fedflat.run(None, overrides=["data=femnist", f"data.root={tmp_path}", "data.num_clients=3",
                                        "data.partition=natural", "model=cnn", "rounds=1", "threads=1",
                                        "sampling.clients_per_round=3", "train.batch_size=4"],
                       save=False, progress=False)
    assert np.isfinite(hist.metrics[-1]["test_acc"])


def test_natural_split_is_one_client_per_owner_and_fraction_samples_owners(tmp_path):
    from fedflat.config import load_config
    from fedflat.engine.simulation import Simulation

    femnist(tmp_path)
    base = ["data=femnist", f"data.root={tmp_path}", "model=cnn", "sampling.clients_per_round=1", "threads=1"]
    sim = Simulation(load_config(None, [*base, "data.num_clients=3", "data.partition=natural"]))
    owners = sim.dataset.owners
    assert [sorted(set(owners[ix].tolist())) for ix in sim.client_indices_np] == [[0], [1], [2]]
    assert sorted(np.concatenate(sim.client_indices_np).tolist()) == list(range(16))
    two = Simulation(load_config(None, [*base, "data.num_clients=2", "data.partition={scheme: natural, fraction: 0.7}"]))
    assert len(two.client_indices_np) == 2 and all(len(set(owners[ix].tolist())) == 1 for ix in two.client_indices_np)
    with pytest.raises(ConfigError, match="set data.num_clients=3"):
        Simulation(load_config(None, [*base, "data.num_clients=5", "data.partition=natural"]))
    with pytest.raises(ConfigError, match="no natural owners"):
        Simulation(load_config(None, ["data.partition=natural", "data.num_clients=3", "sampling.clients_per_round=1"]))


def test_shakespeare_windows_train_the_lstm(tmp_path):
    shakespeare(tmp_path)
    data = load_dataset("shakespeare", root=tmp_path)
    assert data.x_train.dtype == torch.int64 and data.x_train.shape == (24, 80) and data.num_classes == 80
    assert "".join(LEAF_LETTERS[i] for i in data.x_train[0].tolist()) == TEXT[:80]
    assert LEAF_LETTERS[int(data.y_train[0])] == TEXT[80]
    hist = fedflat.run(None, overrides=["data=shakespeare", f"data.root={tmp_path}", "data.num_clients=3",
                                        "data.partition=natural", "model=lstm", "model.hidden=16", "rounds=2",
                                        "threads=1", "sampling.clients_per_round=2", "train.batch_size=4",
                                        "engine=vectorized"], save=False, progress=False)
    assert hist.summary["rounds"] == 2 and np.isfinite(hist.metrics[-1]["test_loss"])


def test_missing_and_corrupt_leaf_files_say_what_to_do(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="LEAF's scripts build it"):
        load_dataset("femnist", root=tmp_path)
    with pytest.raises(DatasetNotFoundError, match="cannot be downloaded"):
        load_dataset("shakespeare", root=tmp_path, download=True)
    shakespeare(tmp_path)
    broken = next((tmp_path / "shakespeare" / "data" / "train").glob("*.json"))
    broken.write_text(broken.read_text()[:-40])
    with pytest.raises(DatasetError, match=f"{broken.name}: not a readable LEAF JSON file"):
        load_dataset("shakespeare", root=tmp_path)
    broken.write_text(json.dumps({"users": ["A"], "user_data": {"A": {"x": [TEXT[:80] + "\u00e9"], "y": ["a"]}}}))
    with pytest.raises(DatasetError, match="not in LEAF's Shakespeare vocabulary"):
        load_dataset("shakespeare", root=tmp_path)
