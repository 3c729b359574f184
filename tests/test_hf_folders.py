"""The tiny Hugging Face fixtures (tests/hf_folders.py) load back with transformers' Auto classes, offline."""
from __future__ import annotations

import os

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_folders import (CORPUS, GLUE_TASKS, LABEL_WORDS, glue_rows, tiny_glue, tiny_image_model,  # noqa: E402
                        tiny_text_model, tiny_tokenizer)

SPECIALS = {"roberta": ("<s>", "</s>", "<pad>", "<unk>", "<mask>"),
            "bert": ("[CLS]", "[SEP]", "[PAD]", "[UNK]", "[MASK]")}


@pytest.mark.parametrize("family", ["roberta", "bert"])
def test_tokenizer_loads_and_is_deterministic(tmp_path, family):
    from transformers import AutoTokenizer
    a = AutoTokenizer.from_pretrained(tiny_tokenizer(tmp_path / "a", family), local_files_only=True)
    b = AutoTokenizer.from_pretrained(tiny_tokenizer(tmp_path / "b", family), local_files_only=True)
    assert (a.cls_token, a.sep_token, a.pad_token, a.unk_token, a.mask_token) == SPECIALS[family]
    assert a.get_vocab() == b.get_vocab()
    pair = a(CORPUS[0], CORPUS[1])
    assert pair == b(CORPUS[0], CORPUS[1])
    assert ("token_type_ids" in pair) == (family == "bert")
    # A corpus word is known to the vocabulary: it decodes back to the text it came from, without unknown tokens.
    assert a.unk_token_id not in pair["input_ids"]
    assert a.decode(a(CORPUS[2])["input_ids"], skip_special_tokens=True).strip() == CORPUS[2]


@pytest.mark.parametrize("family", ["roberta", "bert"])
def test_text_model_loads_with_its_tokenizer(tmp_path, family):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    folder = tiny_text_model(tmp_path, family, num_labels=3, hidden=16, layers=1)
    assert (folder / "model.safetensors").is_file()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True)
    assert type(model).__name__ == f"{family.capitalize()}ForSequenceClassification"
    assert model.config.vocab_size == len(tokenizer) and model.config.num_labels == 3
    assert tokenizer.model_max_length == 72  # the longest input the model's positions allow
    batch = tokenizer([CORPUS[0], CORPUS[1]], padding="max_length", max_length=72, truncation=True,
                      return_tensors="pt")
    assert model(**batch).logits.shape == (2, 3)
    # Fixed seed: a second folder holds the same weights.
    again = AutoModelForSequenceClassification.from_pretrained(
        tiny_text_model(tmp_path / "again", family, num_labels=3, hidden=16, layers=1), local_files_only=True)
    assert all(torch.equal(p, q) for p, q in zip(model.state_dict().values(), again.state_dict().values()))


def test_image_model_loads(tmp_path):
    from transformers import AutoModelForImageClassification
    model = AutoModelForImageClassification.from_pretrained(tiny_image_model(tmp_path, num_labels=3),
                                                            local_files_only=True)
    assert type(model).__name__ == "ViTForImageClassification"
    assert model(torch.zeros(2, 3, 16, 16)).logits.shape == (2, 3)


def test_glue_rows_labels_follow_words():
    for task, (columns, num_classes, *_) in GLUE_TASKS.items():
        rows = glue_rows(task, 30)
        assert rows == glue_rows(task, 30) and rows != glue_rows(task, 30, seed=1)
        assert sorted({r["label"] for r in rows}) == list(range(num_classes))
        for row in rows:
            words = set(row[columns[-1]].split())
            assert [c for c in range(num_classes) if words & set(LABEL_WORDS[c])] == [row["label"]]


@pytest.mark.parametrize("layout, files", [
    ("parquet", {"sst2/train-00000-of-00001.parquet", "sst2/validation-00000-of-00001.parquet"}),
    ("tsv", {"SST-2/train.tsv", "SST-2/dev.tsv"}),
    ("csv", {"sst2/train.csv", "sst2/validation.csv"})])
def test_glue_layouts(tmp_path, layout, files):
    folder = tiny_glue(tmp_path, "sst2", layout, train=20, validation=10)
    assert {str(p.relative_to(tmp_path)) for p in folder.iterdir()} == files
    assert tiny_glue(tmp_path / "again", "sst2", layout, train=20, validation=10).name == folder.name
    for name in files:
        assert (tmp_path / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def test_glue_parquet_loads_with_datasets(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = tiny_glue(tmp_path, "mnli", "parquet", train=12, validation=6)
    splits = datasets.load_dataset("parquet", data_files={
        "train": str(folder / "train-00000-of-00001.parquet"),
        "validation_matched": str(folder / "validation_matched-00000-of-00001.parquet")})
    assert splits["train"].num_rows == 12 and splits["validation_matched"].num_rows == 6
    assert splits["train"].column_names == ["premise", "hypothesis", "label", "idx"]
