"""GLUE-style text classification from local files (fedflat/data/glue.py), on tiny folders made by tests/hf_folders.py:
every layout gives the same arrays, the arrays are what the tokenizer gives, the cache, the errors, and a run."""
from __future__ import annotations

import csv
import os

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
torch = pytest.importorskip("torch")

import fedflat  # noqa: E402
from fedflat.data import DatasetError, DatasetNotFoundError, load_dataset, partition  # noqa: E402
from fedflat.data import glue as glue_module  # noqa: E402
from hf_folders import GLUE_TASKS, HUB_CLASSES, glue_rows, tiny_glue, tiny_tokenizer  # noqa: E402

FAMILIES = ("roberta", "bert")


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict:
    """Both families' tiny tokenizers, made once for the module."""
    root = tmp_path_factory.mktemp("tokenizers")
    return {family: tiny_tokenizer(root / family, family) for family in FAMILIES}


def load(root, tokenizer, task="sst2", **options):
    return load_dataset("glue", root=root, task=task, tokenizer=str(tokenizer), **options)


def hf(tokenizer):
    return transformers.AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("task", ["cola", "sst2", "mrpc", "qqp", "mnli", "qnli", "rte", "wnli"])
def test_every_layout_gives_the_same_arrays(tmp_path, tokenizers, family, task):
    """The hub's parquet files, GLUE's original tsv files (CoLA's without a header, label names for QNLI, RTE
    and MNLI), plain csv and JSON lines files of the same rows read to the same arrays, in the hub's label ids."""
    loaded = {}
    for layout in ("parquet", "tsv", "csv", "jsonl"):
        tiny_glue(tmp_path / layout, task, layout, train=30, validation=12)
        loaded[layout] = load(tmp_path / layout, tokenizers[family], task, max_length=24)
    first = loaded["parquet"]
    k = 3 if family == "bert" else 2  # BERT's tokenizer makes token type ids, RoBERTa's does not
    assert first.x_train.shape == (30, k, 24) and first.x_test.shape == (12, k, 24)
    assert first.x_train.dtype == torch.int64 and first.num_classes == len(HUB_CLASSES[task])
    assert first.y_train.tolist() == [r["label"] for r in glue_rows(task, 30)]
    assert first.y_test.tolist() == [r["label"] for r in glue_rows(task, 12, seed=1)]
    for other in ("tsv", "csv", "jsonl"):
        assert torch.equal(loaded[other].x_train, first.x_train) and torch.equal(loaded[other].y_train, first.y_train)
        assert torch.equal(loaded[other].x_test, first.x_test) and torch.equal(loaded[other].y_test, first.y_test)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("task, max_length", [("sst2", 32), ("qnli", 32), ("qnli", 10)])
def test_rows_are_what_the_tokenizer_gives(tmp_path, tokenizers, family, task, max_length):
    """x[:, 0], x[:, 1] (and x[:, 2]) are the tokenizer's own input ids, attention mask (and token type ids) of the
    row, the pair joined by the tokenizer; max_length=10 cuts the pairs (longest first, as the tokenizer does)."""
    tiny_glue(tmp_path, task, "parquet", train=8, validation=4)
    data = load(tmp_path, tokenizers[family], task, max_length=max_length)
    tokenizer = hf(tokenizers[family])
    for i, row in enumerate(glue_rows(task, 8)):
        texts = [row[c] for c in GLUE_TASKS[task][0]]
        expected = tokenizer(*texts, padding="max_length", truncation=True, max_length=max_length)
        assert data.x_train[i, 0].tolist() == expected["input_ids"]
        assert data.x_train[i, 1].tolist() == expected["attention_mask"]
        if family == "bert":
            assert data.x_train[i, 2].tolist() == expected["token_type_ids"]
            assert (data.x_train[i, 2] == 1).any() == (len(texts) == 2)  # the second text's tokens are type 1
        unpadded = tokenizer(*texts)["input_ids"]
        assert (len(unpadded) > max_length) == (int(data.x_train[i, 1].sum()) == max_length < len(unpadded))
    if max_length == 10:  # every pair is longer than 10 tokens: all were cut
        assert bool((data.x_train[:, 1] == 1).all())


def test_fedswa_columns_and_a_saved_dataset_dict(tmp_path, tokenizers):
    """FedSWA's text1/text2/label columns and a DatasetDict.save_to_disk folder read like the hub's files."""
    tiny_glue(tmp_path / "hub", "rte", "parquet", train=20, validation=10)
    hub = load(tmp_path / "hub", tokenizers["roberta"], "rte", max_length=20)
    for split, seed, count in (("train", 0, 20), ("validation", 1, 10)):
        with open(tmp_path / f"{split}.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["text1", "text2", "label"])
            writer.writerows([r["sentence1"], r["sentence2"], r["label"]] for r in glue_rows("rte", count, seed))
    fedswa = load(tmp_path, tokenizers["roberta"], "rte", max_length=20)  # the root itself holds the files
    assert torch.equal(fedswa.x_train, hub.x_train) and torch.equal(fedswa.y_test, hub.y_test)
    parts = {split: datasets.load_dataset("parquet", data_files=str(next((tmp_path / "hub/rte").glob(f"{split}-*"))),
                                          split="train", cache_dir=str(tmp_path / "hf-cache"))
             for split in ("train", "validation")}
    datasets.DatasetDict(parts).save_to_disk(str(tmp_path / "saved" / "glue" / "rte"))
    saved = load(tmp_path / "saved", tokenizers["roberta"], "rte", max_length=20)
    assert torch.equal(saved.x_train, hub.x_train) and torch.equal(saved.y_test, hub.y_test)


def test_other_text_files_with_their_own_columns(tmp_path, tokenizers):
    """A non-GLUE folder: text_columns and label_column name its columns; string labels become the sorted class
    names, or label_names' order; a TSV file with a header is read too."""
    folder = tmp_path / "reviews"
    folder.mkdir()
    rows = {"train": [("a great film", "good"), ("a dull film", "bad"), ("lovely music", "good"),
                      ("weak jokes", "bad"), ("so so", "meh")],
            "test": [("great music", "good"), ("dull jokes", "bad")]}
    for split, items in rows.items():
        (folder / f"{split}.tsv").write_text("review\tstars\n" + "".join(f"{t}\t{s}\n" for t, s in items))
    data = load(tmp_path, tokenizers["bert"], "reviews", text_columns=["review"], label_column="stars", max_length=8)
    assert data.num_classes == 3 and data.y_train.tolist() == [1, 0, 1, 0, 2] and data.y_test.tolist() == [1, 0]
    named = load(tmp_path, tokenizers["bert"], "reviews", text_columns=["review"], label_column="stars",
                 max_length=8, label_names=["meh", "bad", "good"])
    assert named.y_train.tolist() == [2, 1, 2, 1, 0] and torch.equal(named.x_train, data.x_train)
    ids = hf(tokenizers["bert"])("a great film", padding="max_length", max_length=8)["input_ids"]
    assert data.x_train[0, 0].tolist() == ids


def test_the_encoding_is_cached_and_read_again_when_a_file_changes(tmp_path, tokenizers, monkeypatch):
    folder = tiny_glue(tmp_path, "sst2", "tsv", train=20, validation=8)
    first = load(tmp_path, tokenizers["roberta"], max_length=16)
    assert len(list((folder / ".fedflat-cache").glob("glue-sst2-*.npz"))) == 1
    monkeypatch.setattr(glue_module, "read_split", lambda *a: pytest.fail("the cache was not used"))
    monkeypatch.setattr(glue_module, "load_tokenizer", lambda *a: pytest.fail("the cache was not used"))
    again = load(tmp_path, tokenizers["roberta"], max_length=16)
    assert torch.equal(again.x_train, first.x_train) and torch.equal(again.y_test, first.y_test)
    assert again.files == first.files == (str(folder / "train.tsv"), str(folder / "dev.tsv"))
    monkeypatch.undo()
    with open(folder / "train.tsv", "a") as f:
        f.write("a great new film\t1\n")
    grown = load(tmp_path, tokenizers["roberta"], max_length=16)
    assert len(grown.y_train) == 21 and torch.equal(grown.x_train[:20], first.x_train)
    load(tmp_path, tokenizers["bert"], max_length=16)  # another tokenizer, another max_length: other caches
    load(tmp_path, tokenizers["roberta"], max_length=12)
    assert len(list((folder / ".fedflat-cache").glob("glue-sst2-*.npz"))) == 4


def test_a_changed_tokenizer_file_is_tokenized_again(tmp_path, tokenizers):
    tiny_glue(tmp_path / "data", "sst2", "csv", train=10, validation=4)
    tokenizer = tiny_tokenizer(tmp_path / "tok", "roberta")
    load(tmp_path / "data", tokenizer, max_length=16)
    config = tokenizer / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"model_max_length": 512', '"model_max_length": 256'))
    load(tmp_path / "data", tokenizer, max_length=16)
    assert len(list((tmp_path / "data/sst2/.fedflat-cache").glob("*.npz"))) == 2


def test_errors_name_the_problem(tmp_path, tokenizers):
    tok = tokenizers["roberta"]
    with pytest.raises(ValueError, match="stsb .*regression"):
        load(tmp_path, tok, "stsb")
    with pytest.raises(ValueError, match="not a GLUE task .*text_columns"):
        load(tmp_path, tok, "imdb")
    with pytest.raises(ValueError, match="set data.options.tokenizer"):
        load_dataset("glue", root=tmp_path, task="sst2")
    with pytest.raises(ValueError, match="text_columns must name one or two"):
        load(tmp_path, tok, "imdb", text_columns=["a", "b", "c"])
    with pytest.raises(DatasetNotFoundError, match=r"(?s)'sst2' not found.*glue/sst2.*SST-2.*nyu-mll/glue"):
        load(tmp_path, tok)
    folder = tiny_glue(tmp_path, "sst2", "csv", train=10, validation=4)
    with pytest.raises(DatasetError, match="tokenizer folder .*nowhere does not exist"):
        load(tmp_path, tmp_path / "nowhere")
    with pytest.raises(DatasetError, match="holds no tokenizer files"):
        load(tmp_path, folder)
    (folder / "validation.csv").rename(folder / "test.csv")
    with pytest.raises(DatasetError, match="has train.csv but no evaluation split: add the validation or dev"):
        load(tmp_path, tok)
    (folder / "test.csv").rename(folder / "validation.csv")
    with pytest.raises(DatasetError, match=r"train.csv: no text column 'review' \(its columns: sentence, "
                                           r"label, idx\); name it with data.options.text_columns"):
        load(tmp_path, tok, text_columns=["review"])
    (folder / "validation.csv").write_text("sentence,label,idx\na fine film,1,0\na film,-1,1\n")
    with pytest.raises(DatasetError, match=r"validation.csv: row 2 has label -1, not one of the 2 classes "
                                           r"\['negative', 'positive'\].*hidden test labels"):
        load(tmp_path, tok)
    (folder / "validation.csv").write_text("sentence,label,idx\na fine film,positive,0\na film,great,1\n")
    with pytest.raises(DatasetError, match="row 2 has label 'great'"):
        load(tmp_path, tok)
    (folder / "validation.csv").unlink()
    (folder / "validation.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DatasetError, match="validation.parquet: the datasets library cannot read it"):
        load(tmp_path, tok)
    assert not list(folder.glob(".fedflat-cache/*"))  # no failed load left a cache


def test_glue_tsv_rows_missing_fields_are_skipped(tmp_path, tokenizers, caplog):
    """As the GLUE loaders do: QQP's training file has rows with a missing question."""
    folder = tiny_glue(tmp_path, "qqp", "tsv", train=10, validation=4)
    with open(folder / "train.tsv", "a") as f:
        f.write("99\t1\t2\ta lone question\n")
    data = load(tmp_path, tokenizers["roberta"], "qqp", max_length=16)
    assert len(data.y_train) == 10 and "1 of 11 rows have fewer fields" in caplog.text


def test_dirichlet_partition_splits_it_by_label(tmp_path, tokenizers):
    tiny_glue(tmp_path, "mnli", "parquet", train=90, validation=9)
    data = load(tmp_path, tokenizers["bert"], "mnli", max_length=16)
    parts = partition(data.y_train.numpy(), num_clients=3, scheme="dirichlet", seed=0, alpha=0.3)
    assert sorted(np.concatenate(parts).tolist()) == list(range(90))
    shares = [np.bincount(data.y_train.numpy()[p], minlength=3) / len(p) for p in parts]
    assert max(abs(s - 1 / 3).max() for s in shares) > 0.15  # skewed: not every client holds a third of each class


class BagOfTokens(torch.nn.Module):
    """The sum of the embeddings of a row's tokens (x[:, 0], weighted by the mask x[:, 1]), then a linear layer."""

    def __init__(self, vocab_size: int, num_classes: int, dim: int = 16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, dim)
        torch.nn.init.normal_(self.embed.weight, std=0.1)
        self.out = torch.nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out((self.embed(x[:, 0]) * x[:, 1].unsqueeze(-1).float()).sum(1))


def test_a_run_trains_on_a_glue_task(tmp_path, tokenizers):
    """Two rounds of FedAvg on the tiny SST-2 (labels follow words), split by Dirichlet label skew: above chance."""
    tiny_glue(tmp_path, "sst2", "parquet", train=400, validation=60)
    vocab = len(hf(tokenizers["roberta"]))
    tree = {"seed": 0, "rounds": 2, "threads": 1,
            "data": {"name": "glue", "root": str(tmp_path), "num_clients": 4,
                     "options": {"task": "sst2", "tokenizer": str(tokenizers["roberta"]), "max_length": 64},
                     "partition": {"scheme": "dirichlet", "alpha": 1.0, "min_size": 10}},
            "algo": {"name": "fedavg"}, "sampling": {"clients_per_round": 4},
            "train": {"local_epochs": 2, "batch_size": 8, "lr": 0.3}}
    torch.manual_seed(0)
    history = fedflat.run(tree, model_fn=lambda: BagOfTokens(vocab, 2), save=False, progress=False)
    assert history.summary["rounds"] == 2
    # Chance is 0.5 (30 rows of each class); seeds 0, 1 and 2 reached 0.97, 0.90 and 0.97 on this task.
    assert history.summary["final_test_acc"] >= 0.8
