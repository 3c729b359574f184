"""DBpedia-14 from small files in the official ``dbpedia_csv`` format (written here): balanced subsets,
a vocabulary from the training split only, the cache, bad files, and textcnn trained on it."""
from __future__ import annotations

import csv

import numpy as np
import pytest

import fedflat
from fedflat.data import DatasetError, DatasetNotFoundError, load_dataset
from fedflat.data import text as text_module
from fedflat.data.text import UNKNOWN, encode, tokenize

CLASSES = ["Company", "EducationalInstitution", "Artist", "Athlete", "OfficeHolder", "MeanOfTransportation",
           "Building", "NaturalPlace", "Village", "Animal", "Plant", "Album", "Film", "WrittenWork"]


def dbpedia(root, train_per_class=6, test_per_class=2):
    folder = root / "dbpedia_csv"
    folder.mkdir(parents=True)
    (folder / "classes.txt").write_text("\n".join(CLASSES) + "\n")
    for split, n in (("train", train_per_class), ("test", test_per_class)):
        with open(folder / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f, quoting=csv.QUOTE_ALL)
            for k, name in enumerate(CLASSES):
                for i in range(n):
                    extra = " zyzzyva" if split == "test" else ""  # a word only the test split has
                    writer.writerow([k + 1, f"{name} {i}", f"The {name.lower()} number {i}, a {name}.{extra}"])
    return folder


def test_balanced_subset_vocabulary_from_training_only_and_fixed_length(tmp_path):
    dbpedia(tmp_path)
    data = load_dataset("dbpedia", root=tmp_path, per_class_train=4, per_class_test=2, vocab_size=50, length=12)
    assert data.x_train.shape == (14 * 4, 12) and data.x_test.shape == (14 * 2, 12) and data.num_classes == 14
    assert np.bincount(data.y_train.numpy()).tolist() == [4] * 14
    assert int(data.x_train.max()) < 50 and (data.x_train[:, -1] == 0).any()  # short documents are padded with 0
    # "zyzzyva" occurs only in test documents: it is unknown to the training vocabulary
    assert (data.x_test == UNKNOWN).any() and not (data.x_train == UNKNOWN).any()


def test_tokenize_and_encode_cut_and_pad():
    assert tokenize("Rome's Colosseum, 80 AD!") == ["rome's", "colosseum", "80", "ad"]
    out = encode([["a", "b", "c"], ["b"]], {"a": 2, "b": 3}, 2)
    assert out.tolist() == [[2, 3], [3, 0]]
    assert encode([["c"]], {"a": 2}, 3).tolist() == [[UNKNOWN, 0, 0]]


def test_the_encoding_is_cached_and_read_again_when_a_file_changes(tmp_path, monkeypatch):
    folder = dbpedia(tmp_path)
    first = load_dataset("dbpedia", root=tmp_path, per_class_train=3, per_class_test=1)
    assert len(list((folder / ".fedflat-cache").glob("dbpedia-*.npz"))) == 1
    monkeypatch.setattr(text_module, "read_dbpedia_csv", lambda path: pytest.fail("the cache was not used"))
    again = load_dataset("dbpedia", root=tmp_path, per_class_train=3, per_class_test=1)
    assert np.array_equal(first.x_train.numpy(), again.x_train.numpy())
    monkeypatch.undo()
    with open(folder / "train.csv", "a") as f:
        f.write('"1","Acme","A company that makes everything."\n')
    load_dataset("dbpedia", root=tmp_path, per_class_train=3, per_class_test=1)
    assert len(list((folder / ".fedflat-cache").glob("dbpedia-*.npz"))) == 2


def test_bad_or_missing_files_name_the_problem_and_cache_nothing(tmp_path):
    with pytest.raises(DatasetNotFoundError, match="dbpedia_csv.tar.gz"):
        load_dataset("dbpedia", root=tmp_path)
    folder = dbpedia(tmp_path)
    with open(folder / "train.csv", "a") as f:
        f.write('"15","Nowhere","A fifteenth class."\n')
    with pytest.raises(DatasetError, match=r"train.csv, line 85: expected 'class \(1-14\)"):
        load_dataset("dbpedia", root=tmp_path)
    assert not list(folder.glob(".fedflat-cache/*"))


def test_textcnn_trains_on_dbpedia(tmp_path):
    dbpedia(tmp_path)
    hist = fedflat.run(None, overrides=["data=dbpedia", f"data.root={tmp_path}",
                                        "data.options={per_class_train: 6, per_class_test: 2, vocab_size: 60, length: 16}",
                                        "model=textcnn", "model.vocab_size=60", "model.embed_dim=8",
                                        "model.num_filters=4", "data.num_clients=4", "sampling.clients_per_round=2",
                                        "data.partition=iid", "rounds=2", "threads=1"], save=False, progress=False)
    assert hist.summary["rounds"] == 2 and np.isfinite(hist.metrics[-1]["test_loss"])
