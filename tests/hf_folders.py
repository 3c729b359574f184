"""Tiny Hugging Face artefacts made on the spot, with random weights and nothing downloaded.

Each function writes, in a folder it is given, what a user's local copy of a hub model or data set looks like, small
enough to make in well under a second and deterministic (same call, same files):

- ``tiny_tokenizer``: a real tokenizer trained by the ``tokenizers`` library on ``CORPUS`` (byte-level BPE for the
  ``roberta`` family, WordPiece for ``bert``), saved by transformers' ``save_pretrained``;
- ``tiny_text_model``: a ``RobertaForSequenceClassification`` / ``BertForSequenceClassification`` from a small
  config, saved (safetensors) with its tokenizer in the same folder;
- ``tiny_image_model``: a ``ViTForImageClassification`` from a small config;
- ``tiny_glue``: a small GLUE-style data folder (the hub's parquet files, GLUE's original tsv files or plain csv
  files with a header) whose labels follow words, so a model can learn them.

Everything loads back with transformers' Auto classes and ``local_files_only=True``.
"""
from __future__ import annotations

import csv
import json
import random
from pathlib import Path

#: A small English corpus (a few hundred words): the tokenizers' training text and the sentences of ``tiny_glue``.
CORPUS = [
    "the film was a warm and funny story about a family by the sea",
    "a slow and grey picture that never finds its voice",
    "the actors give fine performances in a clever script",
    "the plot is thin and the jokes fall flat in every scene",
    "a moving tale of friendship told with grace and humour",
    "the music is loud but the story is empty and tired",
    "she walked to the market in the morning to buy fresh bread",
    "the old man read the newspaper while the children played outside",
    "rain fell over the city for three days and the river rose",
    "the team won the match after a long and hard season",
    "he wrote a letter to his sister who lives in a small town",
    "the museum opened a new hall for paintings from the north",
    "where did the students go after the lecture ended",
    "what is the name of the river that runs through the valley",
    "who wrote the book about the history of the island",
    "when does the train to the capital leave the station",
    "how many people live in the village near the mountain",
    "why did the company close the factory last winter",
    "the cat slept on the warm stone near the garden wall",
    "a group of birds flew south before the first snow",
    "the teacher explained the lesson with simple examples",
    "the doctor said the patient would recover within a week",
    "our neighbours planted apple trees and roses in spring",
    "the bridge was built of iron and opened to traffic in autumn",
    "the scientists measured the temperature of the ocean every night",
    "a small boat carried the travellers across the quiet lake",
    "the restaurant serves soup, fish and bread at noon",
    "they played music in the square until late in the evening",
    "the library keeps old maps of the coast and the harbour",
    "the farmer sold milk, eggs and cheese at the weekly fair",
]

#: Words whose presence sets a sentence's label in ``tiny_glue`` (class c's words are ``LABEL_WORDS[c]``).
LABEL_WORDS = [
    ["bad", "boring", "awful", "dull", "weak", "sad"],
    ["good", "great", "lovely", "bright", "superb", "happy"],
    ["maybe", "perhaps", "possibly", "unclear", "unsure", "likely"],
]

ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
BERT_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

#: GLUE tasks: (hub column names, number of classes, original-distribution folder name, original tsv columns,
#: original label names or None where the tsv holds the hub's integer labels).
GLUE_TASKS = {
    "cola": (["sentence"], 2, "CoLA", None, None),
    "sst2": (["sentence"], 2, "SST-2", ["sentence", "label"], None),
    "mrpc": (["sentence1", "sentence2"], 2, "MRPC",
             ["Quality", "#1 ID", "#2 ID", "#1 String", "#2 String"], None),
    "qqp": (["question1", "question2"], 2, "QQP",
            ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"], None),
    "mnli": (["premise", "hypothesis"], 3, "MNLI",
             ["index", "promptID", "pairID", "genre", "sentence1_binary_parse", "sentence2_binary_parse",
              "sentence1_parse", "sentence2_parse", "sentence1", "sentence2", "label1", "gold_label"],
             ["entailment", "neutral", "contradiction"]),
    "qnli": (["question", "sentence"], 2, "QNLI", ["index", "question", "sentence", "label"],
             ["entailment", "not_entailment"]),
    "rte": (["sentence1", "sentence2"], 2, "RTE", ["index", "sentence1", "sentence2", "label"],
            ["entailment", "not_entailment"]),
    "wnli": (["sentence1", "sentence2"], 2, "WNLI", ["index", "sentence1", "sentence2", "label"], None),
}

#: The hub's class names (its ``ClassLabel`` features), in label id order.
HUB_CLASSES = {"cola": ["unacceptable", "acceptable"], "sst2": ["negative", "positive"],
               "mrpc": ["not_equivalent", "equivalent"], "qqp": ["not_duplicate", "duplicate"],
               "mnli": ["entailment", "neutral", "contradiction"], "qnli": ["entailment", "not_entailment"],
               "rte": ["entailment", "not_entailment"], "wnli": ["not_entailment", "entailment"]}


def _training_text() -> list[str]:
    """``CORPUS`` and the label words, these often enough that byte-level BPE learns each as one token."""
    return CORPUS + [" ".join(words) for words in LABEL_WORDS] * 8


def _wordpiece_vocab() -> dict[str, int]:
    """A WordPiece vocabulary of ``_training_text``: the special tokens, every character as a word start and as a
    ``##`` continuation (so an unseen word splits into pieces), then every word, as BERT's normalizer (lower case)
    and pre-tokenizer split them. Made from the counts rather than by ``WordPieceTrainer``, whose ties between
    equally frequent pairs fall in hash order and so give another vocabulary in each process."""
    from tokenizers import normalizers, pre_tokenizers
    normalizer, splitter = normalizers.BertNormalizer(lowercase=True), pre_tokenizers.BertPreTokenizer()
    words = sorted({word for line in _training_text()
                    for word, _ in splitter.pre_tokenize_str(normalizer.normalize_str(line))})
    characters = sorted(set("".join(words)))
    tokens = BERT_SPECIALS + characters + [f"##{c}" for c in characters] + [w for w in words if len(w) > 1]
    return {token: i for i, token in enumerate(tokens)}


def tiny_tokenizer(folder, family: str = "roberta", model_max_length: int = 512) -> Path:
    """Train a tokenizer on ``CORPUS`` and save it in ``folder`` as transformers' ``RobertaTokenizerFast``
    (byte-level BPE trained by ``tokenizers``, ``<s> </s> <pad> <unk> <mask>``) or ``BertTokenizerFast``
    (lower-cased WordPiece over ``_wordpiece_vocab``, ``[CLS] [SEP] [PAD] [UNK] [MASK]``; it makes
    ``token_type_ids``); ``model_max_length``: the longest input its model takes. Returns the folder."""
    from transformers import BertTokenizerFast, RobertaTokenizerFast

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if family == "roberta":
        from tokenizers import ByteLevelBPETokenizer
        bpe = ByteLevelBPETokenizer()
        bpe.train_from_iterator(_training_text(), vocab_size=400, min_frequency=1,
                                special_tokens=ROBERTA_SPECIALS, show_progress=False)
        model = json.loads(bpe._tokenizer.to_str())["model"]
        merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        tokenizer = RobertaTokenizerFast(vocab=model["vocab"], merges=merges, model_max_length=model_max_length)
    elif family == "bert":
        tokenizer = BertTokenizerFast(vocab=_wordpiece_vocab(), model_max_length=model_max_length)
    else:
        raise ValueError(f"tiny_tokenizer: family {family!r} is not 'roberta' or 'bert'")
    tokenizer.save_pretrained(folder)
    return folder


def tiny_text_model(folder, family: str = "roberta", num_labels: int = 2, hidden: int = 32, layers: int = 2,
                    heads: int = 2, intermediate: int = 64, max_positions: int = 72) -> Path:
    """Save, in ``folder``, a ``RobertaForSequenceClassification`` or ``BertForSequenceClassification`` with
    random weights (seed 0) from a small config, and ``tiny_tokenizer(folder, family, max_positions)`` beside it;
    the config's vocabulary size is the tokenizer's. Returns the folder."""
    import torch
    from transformers import (AutoTokenizer, BertConfig, BertForSequenceClassification, RobertaConfig,
                              RobertaForSequenceClassification)

    folder = tiny_tokenizer(folder, family, model_max_length=max_positions)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    shape = dict(vocab_size=len(tokenizer), hidden_size=hidden, num_hidden_layers=layers,
                 num_attention_heads=heads, intermediate_size=intermediate, num_labels=num_labels,
                 pad_token_id=tokenizer.pad_token_id)
    if family == "roberta":
        # RoBERTa's positions start after the padding index, hence the two extra rows (as roberta-base's 514).
        config = RobertaConfig(max_position_embeddings=max_positions + 2, bos_token_id=tokenizer.bos_token_id,
                               eos_token_id=tokenizer.eos_token_id, **shape)
        cls = RobertaForSequenceClassification
    else:
        config = BertConfig(max_position_embeddings=max_positions, **shape)
        cls = BertForSequenceClassification
    torch.manual_seed(0)
    cls(config).save_pretrained(folder, safe_serialization=True)
    return folder


def tiny_image_model(folder, num_labels: int = 3, image_size: int = 16, patch: int = 4, hidden: int = 32,
                     layers: int = 2) -> Path:
    """Save, in ``folder``, a ``ViTForImageClassification`` with random weights (seed 0) from a small config
    (``image_size`` x ``image_size`` RGB images, ``patch`` x ``patch`` patches). Returns the folder."""
    import torch
    from transformers import ViTConfig, ViTForImageClassification

    folder = Path(folder)
    config = ViTConfig(image_size=image_size, patch_size=patch, num_channels=3, hidden_size=hidden,
                       num_hidden_layers=layers, num_attention_heads=2, intermediate_size=2 * hidden,
                       num_labels=num_labels)
    torch.manual_seed(0)
    ViTForImageClassification(config).save_pretrained(folder, safe_serialization=True)
    return folder


def glue_rows(task: str, count: int, seed: int = 0) -> list[dict]:
    """``count`` rows of ``task`` in the hub's columns (``idx`` and the integer ``label``): each text is a corpus
    sentence with words of its label's class inserted (in the pair's second text for a pair task), so the label
    can be learned from the words."""
    columns, num_classes, *_ = GLUE_TASKS[task]
    rng = random.Random(f"{task}/{seed}")
    rows = []
    for idx in range(count):
        label = idx % num_classes
        row = {}
        for i, column in enumerate(columns):
            words = rng.choice(CORPUS).split()
            if i == len(columns) - 1:
                for word in rng.sample(LABEL_WORDS[label], 2):
                    words.insert(rng.randrange(len(words) + 1), word)
            row[column] = " ".join(words)
        rows.append({**row, "label": label, "idx": idx})
    rng.shuffle(rows)
    return rows


def tiny_glue(folder, task: str = "sst2", layout: str = "parquet", train: int = 96, validation: int = 48,
              seed: int = 0) -> Path:
    """Write a small GLUE ``task`` in ``folder`` and return the task's folder:

    - ``parquet``: the hub's ``nyu-mll/glue`` files, ``<folder>/<task>/train-00000-of-00001.parquet`` and
      ``validation-00000-of-00001.parquet`` (MNLI: ``validation_matched-...``), hub columns and ``ClassLabel``
      features, written by the ``datasets`` library;
    - ``tsv``: GLUE's original distribution, ``<folder>/<TASK-NAME>/train.tsv`` and ``dev.tsv`` (MNLI:
      ``dev_matched.tsv``) in the original columns: CoLA without a header, QNLI/RTE/MNLI with label names;
    - ``csv``: plain ``<folder>/<task>/train.csv`` and ``validation.csv`` with a header of hub columns;
    - ``jsonl``: ``<folder>/<task>/train.jsonl`` and ``validation.jsonl``, one JSON object (hub columns) a line.
    """
    if task not in GLUE_TASKS:
        raise ValueError(f"tiny_glue: task {task!r} is not one of {sorted(GLUE_TASKS)}")
    _, _, name, tsv_columns, label_names = GLUE_TASKS[task]
    splits = {"train": glue_rows(task, train, seed), "validation": glue_rows(task, validation, seed + 1)}
    if layout == "parquet":
        import datasets
        out = Path(folder) / task
        out.mkdir(parents=True, exist_ok=True)
        features = datasets.Features({**{c: datasets.Value("string") for c in GLUE_TASKS[task][0]},
                                      "label": datasets.ClassLabel(names=HUB_CLASSES[task]),
                                      "idx": datasets.Value("int32")})
        for split, rows in splits.items():
            split = "validation_matched" if task == "mnli" and split == "validation" else split
            datasets.Dataset.from_list(rows, features=features).to_parquet(out / f"{split}-00000-of-00001.parquet")
    elif layout == "jsonl":
        out = Path(folder) / task
        out.mkdir(parents=True, exist_ok=True)
        for split, rows in splits.items():
            (out / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    elif layout == "csv":
        out = Path(folder) / task
        out.mkdir(parents=True, exist_ok=True)
        for split, rows in splits.items():
            with open(out / f"{split}.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                writer.writeheader()
                writer.writerows(rows)
    elif layout == "tsv":
        out = Path(folder) / name
        out.mkdir(parents=True, exist_ok=True)
        for split, rows in splits.items():
            file = "train.tsv" if split == "train" else ("dev_matched.tsv" if task == "mnli" else "dev.tsv")
            with open(out / file, "w") as f:
                if tsv_columns is not None:
                    f.write("\t".join(tsv_columns) + "\n")
                for row in rows:
                    f.write("\t".join(_tsv_fields(task, row, tsv_columns, label_names)) + "\n")
    else:
        raise ValueError(f"tiny_glue: layout {layout!r} is not 'parquet', 'tsv', 'csv' or 'jsonl'")
    return out


def _tsv_fields(task: str, row: dict, columns: list[str] | None, label_names: list[str] | None) -> list[str]:
    """One row in GLUE's original tsv columns (texts under their original names, ids made up)."""
    label = label_names[row["label"]] if label_names else str(row["label"])
    if columns is None:  # CoLA: source, label, original label, sentence; no header
        return ["gj04", label, "" if row["label"] else "*", row["sentence"]]
    texts = list(row.values())[:len(GLUE_TASKS[task][0])]
    by_name = {"sentence": texts[0], "label": label, "Quality": label, "is_duplicate": label, "gold_label": label,
               "label1": label, "#1 String": texts[0], "#2 String": texts[-1], "question1": texts[0],
               "question2": texts[-1], "question": texts[0], "sentence1": texts[0], "sentence2": texts[-1]}
    if task == "qnli":
        by_name["sentence"] = texts[1]
    return [by_name.get(column, str(row["idx"])) for column in columns]
