"""DBpedia-14 (Zhang, Zhao & LeCun, NeurIPS 2015: ``dbpedia_csv``) as token ids for ``textcnn``.

The official folder holds ``train.csv`` (560,000 rows) and ``test.csv`` (70,000), each row
``class (1-14), title, abstract``, and ``classes.txt``. FedVSSAM's setting (seed 000, App. C.3) is the
default: a class-balanced subset of 10,000 training and 1,000 test documents per class, a vocabulary of
30,000 built from the **training subset only** (0 = padding, 1 = unknown, then the most frequent words),
and documents of 128 tokens (title then abstract; cut or padded with 0).

Tokenizing 150,000 documents takes a while, so the encoded arrays are cached (``.npz``, written to a
temporary file and renamed: a failed or interrupted load leaves no cache) beside the data, or in
fedflat's cache when that folder is read-only; the cache is keyed by the options and the files' sizes
and modification times, so a changed file is read again.
"""
from __future__ import annotations

import csv
import hashlib
import os
import re
from collections import Counter
from pathlib import Path

import numpy as np

from .dataset import Dataset, DatasetError
from .sources import DatasetNotFoundError, base_dirs, cache_home, not_found

PAD, UNKNOWN = 0, 1
DBPEDIA_CLASSES = 14
_WORD = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


def tokenize(text: str) -> list[str]:
    """Lower-cased words and numbers (``"Rome's"`` -> ``["rome's"]``); punctuation is dropped."""
    return _WORD.findall(text.lower())


def build_vocabulary(documents: list[list[str]], size: int) -> dict[str, int]:
    """The ``size - 2`` most frequent tokens of ``documents`` (ties by the token), numbered from 2."""
    counts = Counter(token for doc in documents for token in doc)
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: size - 2]
    return {token: i + 2 for i, (token, _) in enumerate(ranked)}


def encode(documents: list[list[str]], vocabulary: dict[str, int], length: int) -> np.ndarray:
    """``[N, length]`` int64 ids: known tokens by the vocabulary, others :data:`UNKNOWN`, padded with :data:`PAD`."""
    out = np.full((len(documents), length), PAD, dtype=np.int64)
    for row, doc in enumerate(documents):
        ids = [vocabulary.get(token, UNKNOWN) for token in doc[:length]]
        out[row, :len(ids)] = ids
    return out


def read_dbpedia_csv(path: Path) -> tuple[np.ndarray, list[str]]:
    """Labels (0-based) and texts (title, then abstract) of a ``dbpedia_csv`` file; a malformed row is a
    :class:`DatasetError` naming the file and line."""
    labels, texts = [], []
    try:
        with open(path, newline="", encoding="utf-8") as f:
            for line, row in enumerate(csv.reader(f), start=1):
                if len(row) != 3 or not row[0].strip().isdigit() or not 1 <= int(row[0]) <= DBPEDIA_CLASSES:
                    raise DatasetError(f"{path}, line {line}: expected 'class (1-{DBPEDIA_CLASSES}), title, abstract', "
                                       f"got {row[:3]!r}; replace the file with the official dbpedia_csv")
                labels.append(int(row[0]) - 1)
                texts.append(f"{row[1]} {row[2]}")
    except (UnicodeDecodeError, csv.Error) as err:
        raise DatasetError(f"{path}: not a readable CSV file ({err}); replace it with the official dbpedia_csv") from None
    return np.asarray(labels, dtype=np.int64), texts


def balanced_subset(labels: np.ndarray, per_class: int | None, rng: np.random.Generator) -> np.ndarray:
    """Sorted indices of up to ``per_class`` random documents of every class (all of them: None)."""
    if per_class is None:
        return np.arange(len(labels))
    picks = [rng.permutation(np.flatnonzero(labels == k))[:per_class] for k in np.unique(labels)]
    return np.sort(np.concatenate(picks))


def find_dbpedia(root: str | Path | None) -> Path:
    """The folder with ``train.csv`` and ``test.csv`` (``<base>/dbpedia_csv``, ``<base>/dbpedia`` or ``<base>``)."""
    searched = []
    for base in base_dirs(root):
        for folder in (base / "dbpedia_csv", base / "dbpedia", base):
            searched.append(folder)
            if (folder / "train.csv").is_file() and (folder / "test.csv").is_file():
                return folder
    raise not_found("DBpedia-14 ('dbpedia') not found: no folder with train.csv and test.csv", searched,
                    "extract the official dbpedia_csv.tar.gz (Zhang et al., 2015; also on Hugging Face as "
                    "fancyzhx/dbpedia_14) into one of these folders (data.root or $FEDFLAT_DATA)")


def cache_file(folder: Path, name: str, options: dict, files: list[Path]) -> Path:
    """The ``.npz`` file that caches what is derived from ``files`` with ``options``: in ``cache_home(folder)``,
    keyed by the options and the files' sizes and modification times (a changed file is read again)."""
    stamp = [options] + [(p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    key = hashlib.sha256(repr(stamp).encode()).hexdigest()[:16]
    return cache_home(folder, name) / f"{name}-{key}.npz"


def write_cache(cache: Path, arrays: dict[str, np.ndarray]) -> None:
    """Write ``arrays`` to ``cache`` atomically: a file of this process's own, renamed when complete (an interrupted
    or concurrent load leaves no partial cache)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_name(f"{cache.stem}.{os.getpid()}.partial.npz")
    try:
        np.savez(partial, **arrays)
        os.replace(partial, cache)
    finally:
        partial.unlink(missing_ok=True)


def load_dbpedia(root: str | Path | None = None, download: bool = False, *, per_class_train: int | None = 10000,
                 per_class_test: int | None = 1000, vocab_size: int = 30000, length: int = 128,
                 seed: int = 0) -> Dataset:
    """DBpedia-14 as ``[N, length]`` token ids, 14 classes, in FedVSSAM's setting by default (see the module)."""
    if download:
        raise DatasetNotFoundError("DBpedia-14 has no official checksummed download fedflat can fetch: extract "
                                   "dbpedia_csv.tar.gz yourself and set data.root (data.download=false)", [])
    if vocab_size < 3 or length < 1:
        raise ValueError(f"dbpedia: vocab_size must be >= 3 and length >= 1, got {vocab_size} and {length}")
    folder = find_dbpedia(root)
    options = dict(per_class_train=per_class_train, per_class_test=per_class_test, vocab_size=vocab_size,
                   length=length, seed=seed)
    cache = cache_file(folder, "dbpedia", options, [folder / "train.csv", folder / "test.csv"])
    if cache.is_file():
        with np.load(cache) as arrays:
            return Dataset("dbpedia", arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"],
                           DBPEDIA_CLASSES, source=str(folder))
    rng = np.random.default_rng(seed)
    splits = {}
    for split, per_class in (("train", per_class_train), ("test", per_class_test)):
        labels, texts = read_dbpedia_csv(folder / f"{split}.csv")
        keep = balanced_subset(labels, per_class, rng)
        splits[split] = (labels[keep], [tokenize(texts[i]) for i in keep])
    vocabulary = build_vocabulary(splits["train"][1], vocab_size)  # from the training documents only
    arrays = {"x_train": encode(splits["train"][1], vocabulary, length), "y_train": splits["train"][0],
              "x_test": encode(splits["test"][1], vocabulary, length), "y_test": splits["test"][0]}
    write_cache(cache, arrays)
    return Dataset("dbpedia", arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"],
                   DBPEDIA_CLASSES, source=str(folder))
