"""GLUE (Wang et al., ICLR 2019) and other text classification sets from local files, tokenized by a Hugging Face
tokenizer for fine-tuning a pretrained transformer (RoBERTa-base on GLUE, as FedSWA and FedNSAM).

**The arrays.** ``x`` is int64 ``[N, K, L]``: ``x[:, 0]`` the ``input_ids``, ``x[:, 1]`` the ``attention_mask``
and, when the tokenizer makes them (BERT's does, RoBERTa's does not), ``x[:, 2]`` the ``token_type_ids`` (K = 3,
else K = 2); every row is padded (or cut) to ``L = max_length`` tokens (``padding="max_length", truncation=True``),
a sentence pair joined as the tokenizer joins pairs. ``y`` is the int64 label, in the hub's (``nyu-mll/glue``)
label ids. The test split is GLUE's validation split (its test labels are hidden; the papers report validation
accuracy), MNLI's ``validation_matched``.

**The files**, in the task's folder (``<base>/glue/<task>``, ``<base>/<task>``, ``<base>/<TASK-NAME>`` ..., for
every base of :func:`fedflat.data.sources.base_dirs`):

1. what the ``datasets`` library reads, which reads them here: files named ``train*`` and ``validation*``
   (``dev*``; MNLI ``validation_matched*``) in parquet, JSON (lines) or CSV, e.g. the hub's
   ``sst2/train-00000-of-00001.parquet``, or a folder written by ``DatasetDict.save_to_disk``;
2. GLUE's original distribution: ``SST-2/train.tsv`` and ``dev.tsv`` (MNLI ``dev_matched.tsv``), CoLA's without a
   header (source, label, original label, sentence), label names (``entailment``) where the task has them;
3. plain CSV or TSV files with a header, named as above.

Text columns are found under the hub's names, the original files' names or FedSWA's ``text1``/``text2``; other
files name theirs with ``text_columns`` and ``label_column`` (and the class names with ``label_names``).

Tokenizing takes a while, so the arrays are cached (``.npz``, written atomically: :func:`fedflat.data.text.
write_cache`) beside the data or in fedflat's cache, keyed by the tokenizer's files (their contents), the data
files' sizes and modification times, the options and the tokenizer libraries' versions.
"""
from __future__ import annotations

import contextlib
import csv
import hashlib
import logging
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from .dataset import Dataset, DatasetError
from .datasets import register_dataset
from .sources import base_dirs, not_found
from .text import cache_file, write_cache

log = logging.getLogger(__name__)

CACHE_VERSION = 1  # part of the cache key: raise it when the encoding changes
ENCODE_BATCH = 4096  # rows tokenized per call (bounds the tokenizer's intermediate lists)


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task: its text columns (the hub's names, then the original tsv's), its classes in the hub's label
    ids, the original distribution's folder and label column, and the evaluation split's name."""

    columns: tuple[str, ...]
    classes: tuple[str, ...]
    folder: str
    original: tuple[str, ...]
    label_column: str = "label"
    evaluation: str = "validation"


GLUE_TASKS: dict[str, GlueTask] = {
    "cola": GlueTask(("sentence",), ("unacceptable", "acceptable"), "CoLA", ("sentence",)),
    "sst2": GlueTask(("sentence",), ("negative", "positive"), "SST-2", ("sentence",)),
    "mrpc": GlueTask(("sentence1", "sentence2"), ("not_equivalent", "equivalent"), "MRPC",
                     ("#1 String", "#2 String"), "Quality"),
    "qqp": GlueTask(("question1", "question2"), ("not_duplicate", "duplicate"), "QQP", ("question1", "question2"),
                    "is_duplicate"),
    "mnli": GlueTask(("premise", "hypothesis"), ("entailment", "neutral", "contradiction"), "MNLI",
                     ("sentence1", "sentence2"), "gold_label", "validation_matched"),
    "qnli": GlueTask(("question", "sentence"), ("entailment", "not_entailment"), "QNLI", ("question", "sentence")),
    "rte": GlueTask(("sentence1", "sentence2"), ("entailment", "not_entailment"), "RTE", ("sentence1", "sentence2")),
    "wnli": GlueTask(("sentence1", "sentence2"), ("not_entailment", "entailment"), "WNLI", ("sentence1", "sentence2")),
}
REGRESSION = {"stsb": "STS-B"}  # a similarity score, not a class: refused
ALIASES = {g.folder.lower(): t for t, g in GLUE_TASKS.items()} | {"sts-b": "stsb"}  # GLUE's folder names
COLA_COLUMNS = ("source", "label", "original_label", "sentence")  # CoLA's tsv has no header
FEDSWA_COLUMNS = {1: (("text1", "text"),), 2: (("text1",), ("text2",))}  # by the task's number of texts
LABEL_COLUMNS = ("label", "gold_label", "Quality", "is_duplicate")

# The file formats read, in order of preference when a folder holds several: the datasets library's, then tsv.
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv", ".tsv": "tsv"}
_SPLIT = re.compile(r"(train|validation_matched|validation_mismatched|validation|dev_matched|dev_mismatched|dev|"
                    r"valid|val|test_matched|test_mismatched|test)(?=$|[-._ 0-9_])")
# Files hashed for the cache key: what transformers' tokenizers read from a folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model", "spm.model", "bpe.codes")


@dataclass(frozen=True)
class TextTask:
    """What to read: the task's name, the candidate names of each text column and of the label column, the class
    names (None: taken from the files), the evaluation splits tried in order and the folder names searched."""

    name: str
    text: tuple[tuple[str, ...], ...]
    label: tuple[str, ...]
    classes: tuple[str, ...] | None
    evaluation: tuple[str, ...]
    folders: tuple[str, ...]


def text_task(task: str, text_columns: Sequence[str] | None = None, label_column: str | None = None,
              label_names: Sequence[str] | None = None) -> TextTask:
    """The :class:`TextTask` of a GLUE ``task`` (its columns as the hub, GLUE's tsv files or FedSWA name them) or of
    another folder ``task`` whose files name their columns ``text_columns`` and ``label_column``."""
    if not isinstance(task, str) or not task:
        raise ValueError(f"glue: task must be a GLUE task ({', '.join(GLUE_TASKS)}) or the name of a folder of text "
                         f"files with text_columns set, got {task!r}")
    task = ALIASES.get(task.lower(), task)
    if task.lower() in REGRESSION:
        raise ValueError(f"glue: {task} ({REGRESSION[task.lower()]}) is a regression task (similarity scores from 0 "
                         f"to 5); fedflat trains classifiers: choose one of {', '.join(GLUE_TASKS)}")
    if text_columns is not None and (isinstance(text_columns, str) or len(text_columns) not in (1, 2)
                                     or not all(isinstance(c, str) and c for c in text_columns)):
        raise ValueError(f"glue: text_columns must name one or two columns ([sentence] or [premise, hypothesis]), "
                         f"got {text_columns!r}")
    if label_names is not None and (isinstance(label_names, str) or len(set(map(str, label_names))) < 2
                                    or len(set(map(str, label_names))) != len(label_names)):
        raise ValueError(f"glue: label_names must list two or more distinct class names, got {label_names!r}")
    glue = GLUE_TASKS.get(task.lower())
    if glue is None and text_columns is None:
        raise ValueError(f"glue: {task!r} is not a GLUE task ({', '.join(GLUE_TASKS)}); for other files set "
                         "text_columns (and label_column, default 'label') to their columns")
    classes = tuple(map(str, label_names)) if label_names is not None else (glue.classes if glue else None)
    if glue is None:
        return TextTask(task, tuple((c,) for c in text_columns), (label_column or "label",), classes,
                        ("validation", "dev", "valid", "val", "test"), (task,))
    if text_columns is not None:
        text = tuple((c,) for c in text_columns)
    else:
        text = tuple(tuple(dict.fromkeys((hub, original, *other))) for hub, original, other
                     in zip(glue.columns, glue.original, FEDSWA_COLUMNS[len(glue.columns)]))
    label = (label_column,) if label_column else tuple(dict.fromkeys((glue.label_column, *LABEL_COLUMNS)))
    evaluation = tuple(dict.fromkeys((glue.evaluation, glue.evaluation.replace("validation", "dev"), "validation",
                                      "dev")))  # MNLI: validation_matched first, then a plain validation file
    name = task.lower()
    return TextTask(name, text, label, classes, evaluation, (f"glue/{name}", f"glue/{glue.folder}",
                                                              f"glue_data/{glue.folder}", name, glue.folder))


# ----------------------------------------------------------------------------- finding the files

@dataclass(frozen=True)
class Split:
    """One split's files: their format (``parquet``, ``json``, ``csv``, ``tsv``, or ``disk``: a ``save_to_disk``
    folder, read by its split name)."""

    format: str
    files: tuple[Path, ...]
    name: str = ""


def split_of(filename: str) -> str | None:
    """The split a file's name starts with (``train-00000-of-00001.parquet`` -> ``train``), or None."""
    match = _SPLIT.match(filename.lower())
    return match.group(1) if match else None


def find_split(folder: Path, names: Sequence[str]) -> Split | None:
    """The files of the first of ``names`` that ``folder`` holds, in the first format of :data:`FORMATS` it holds
    them in (all shards: ``train-00000-of-00002``, ``train-00001-of-00002``)."""
    files = [p for p in sorted(folder.iterdir()) if p.is_file() and p.suffix.lower() in FORMATS]
    for name in names:
        for suffix, fmt in FORMATS.items():
            chosen = tuple(p for p in files if p.suffix.lower() == suffix and split_of(p.name) == name)
            if chosen:
                return Split(fmt, chosen)
    return None


def find_splits(folder: Path, task: TextTask) -> tuple[Split, Split] | None:
    """The training and evaluation splits in ``folder``, or None where it holds no training split."""
    if (folder / "dataset_dict.json").is_file():  # DatasetDict.save_to_disk
        names = [p.name for p in folder.iterdir() if (p / "dataset_info.json").is_file()]
        evaluation = next((n for n in task.evaluation if n in names), None)
        if "train" not in names or evaluation is None:
            raise DatasetError(f"{folder}: a saved DatasetDict with splits {sorted(names)}; it needs 'train' and one "
                               f"of {list(task.evaluation)}: save those splits")
        return tuple(Split("disk", tuple(sorted((folder / n).glob("*.arrow"))), n) for n in ("train", evaluation))
    train = find_split(folder, ["train"])
    if train is None:
        return None
    evaluation = find_split(folder, task.evaluation)
    if evaluation is None:
        raise DatasetError(f"{folder} has {train.files[0].name} but no evaluation split: add the "
                           f"{' or '.join(task.evaluation)} file (GLUE's test labels are hidden, so the validation "
                           "split is the test split)")
    return train, evaluation


def find_task(task: TextTask, root: str | Path | None) -> tuple[Path, tuple[Split, Split]]:
    """The first folder of the task (``<base>/glue/<task>``, ``<base>/<task>``, ``<base>/<TASK-NAME>`` ...,
    ``<base>`` itself) that holds its training split, and its splits."""
    searched: list[Path] = []
    for base in base_dirs(root):
        for folder in [base / name for name in task.folders] + [base]:
            if folder in searched:
                continue
            searched.append(folder)
            found = find_splits(folder, task) if folder.is_dir() else None
            if found is not None:
                return folder, found
    glue = GLUE_TASKS.get(task.name)
    advice = (f"save the task with the datasets library where there is network (load_dataset('nyu-mll/glue', "
              f"'{task.name}') then save_to_disk, or the hub's parquet files {task.name}/train-00000-of-00001."
              f"parquet), or extract GLUE's original {glue.folder}/ (train.tsv, dev.tsv) into one of these folders"
              if glue else "put train and validation (or test) files, parquet, json, csv or tsv, into one of these "
              "folders") + " (data.root or $FEDFLAT_DATA); fedflat downloads no GLUE data"
    raise not_found(f"{task.name!r} not found: no folder with a train file", searched, advice)


# ----------------------------------------------------------------------------- reading a split

@dataclass
class Table:
    """A split's columns by name, as lists, and the class names of its ``ClassLabel`` columns (the hub's)."""

    where: str
    columns: dict[str, list]
    class_names: dict[str, list[str]]


def read_tsv(path: Path, task: TextTask) -> Table:
    """A tab-separated file as GLUE ships it (no quoting: a ``"`` is text). The first line is the header, except in
    CoLA's files, whose four columns are :data:`COLA_COLUMNS`. Rows with fewer fields than the header are
    dropped, as the GLUE loaders do (QQP's training file has a few)."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:  # (a byte-order mark is not part of the header)
            rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    except (UnicodeDecodeError, csv.Error) as err:
        raise DatasetError(f"{path}: not a readable UTF-8 tab-separated file ({err})") from None
    if not rows:
        raise DatasetError(f"{path} is empty: it needs a header line and one row per example")
    header = rows[0]
    wanted = {name for names in task.text for name in names}
    if task.name == "cola" and len(header) == len(COLA_COLUMNS) and not wanted & set(header):
        header, body = list(COLA_COLUMNS), rows
    else:
        body = rows[1:]
    kept = [row for row in body if len(row) >= len(header)]
    if len(kept) < len(body):
        log.warning("%s: %d of %d rows have fewer fields than the header and are skipped", path,
                    len(body) - len(kept), len(body))
    return Table(str(path), {name: [row[i] for row in kept] for i, name in enumerate(header)}, {})


def read_split(split: Split, folder: Path, task: TextTask) -> Table:
    """A split's columns, read by the ``datasets`` library (parquet, json, csv, a saved DatasetDict) or by
    :func:`read_tsv`."""
    where = ", ".join(str(f) for f in split.files) if split.format != "disk" else f"{folder} ({split.name})"
    if split.format == "tsv":
        tables = [read_tsv(f, task) for f in split.files]
        if len(tables) > 1 and any(t.columns.keys() != tables[0].columns.keys() for t in tables):
            raise DatasetError(f"{where}: the files' headers differ; give every shard the same columns")
        return Table(where, {k: sum((t.columns[k] for t in tables), []) for k in tables[0].columns}, {})
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"{where}: reading {split.format} files needs the datasets library: "
                           "pip install 'fedflat[glue]'") from None
    try:
        with tempfile.TemporaryDirectory(prefix="fedflat-glue-") as scratch, _quiet(datasets):
            if split.format == "disk":
                data = datasets.load_from_disk(str(folder), keep_in_memory=True)[split.name]
            else:  # the library's own cache goes to scratch, removed: the tokenized arrays are what is kept
                data = datasets.load_dataset(split.format, data_files=[str(f) for f in split.files], split="train",
                                             cache_dir=scratch, keep_in_memory=True)
            return _table(data, where)
    except (ValueError, OSError, TypeError) as err:  # pyarrow's and pandas' errors derive from these
        raise DatasetError(f"{where}: the datasets library cannot read it ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}); check that it is a whole "
                           f"{split.format} file") from None


@contextlib.contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """The datasets library's progress bars off while fedflat reads a split (its log says what was read)."""
    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if shown:
            datasets.enable_progress_bars()


def _table(data: Any, where: str) -> Table:
    from datasets import ClassLabel
    names = {k: list(f.names) for k, f in data.features.items() if isinstance(f, ClassLabel)}
    return Table(where, {k: data[k] for k in data.column_names}, names)


def pick_column(table: Table, names: Sequence[str], what: str, option: str) -> str:
    """The first of ``names`` that ``table`` has; none is a :class:`DatasetError` listing its columns."""
    for name in names:
        if name in table.columns:
            return name
    raise DatasetError(f"{table.where}: no {what} column {' or '.join(map(repr, names))} (its columns: "
                       f"{', '.join(table.columns)}); name it with data.options.{option}")


def texts_and_labels(table: Table, task: TextTask) -> tuple[list[list[str]], list, str]:
    """The text columns (one list per text of a pair), the label column and its name in ``table``; rows missing
    any of them (an empty cell of a CSV, a null of parquet) are dropped with a warning."""
    what = ["text"] if len(task.text) == 1 else ["first text", "second text"]
    names = [pick_column(table, choices, what[i], "text_columns") for i, choices in enumerate(task.text)]
    label = pick_column(table, task.label, "label", "label_column")
    columns = [table.columns[n] for n in names] + [table.columns[label]]
    keep = [i for i in range(len(columns[0])) if all(c[i] is not None for c in columns)]
    if len(keep) < len(columns[0]):
        log.warning("%s: %d of %d rows miss a text or the label and are skipped", table.where,
                    len(columns[0]) - len(keep), len(columns[0]))
    if not keep:
        raise DatasetError(f"{table.where}: no row with its text and label: the file needs at least one example")
    return [[str(c[i]) for i in keep] for c in columns[:-1]], [columns[-1][i] for i in keep], label


def label_ids(values: list, classes: Sequence[str], where: str) -> np.ndarray:
    """``values`` as int64 ids of ``classes``: a class name, or its id (an int or a string of digits); another
    value is a :class:`DatasetError` naming the row and the classes."""
    index = {name: i for i, name in enumerate(classes)}
    out = np.empty(len(values), dtype=np.int64)
    for row, value in enumerate(values):
        text = str(value).strip()
        k = index.get(text)
        if k is None and re.fullmatch(r"-?\d+", text):
            k = int(text) if 0 <= int(text) < len(classes) else None
        if k is None:
            hidden = " (-1 marks GLUE's hidden test labels: evaluate on the validation split)" if text == "-1" else ""
            raise DatasetError(f"{where}: row {row + 1} has label {value!r}, not one of the {len(classes)} classes "
                               f"{list(classes)} or their ids 0-{len(classes) - 1}{hidden}; fix the row, or set "
                               "data.options.label_names to the dataset's classes")
        out[row] = k
    return out


def infer_classes(train: Table, values: list, label: str) -> tuple[str, ...]:
    """The classes of a non-GLUE file without ``label_names``: its ``ClassLabel`` names; for integer labels
    ``0 .. max``; else the training split's label values, sorted."""
    if label in train.class_names:
        return tuple(train.class_names[label])
    texts = {str(v).strip() for v in values}
    if all(re.fullmatch(r"\d+", t) for t in texts):
        return tuple(str(i) for i in range(max(map(int, texts)) + 1))
    return tuple(sorted(texts))


# ----------------------------------------------------------------------------- tokenizing

def tokenizer_files(folder: Path) -> list[Path]:
    """The files of ``folder`` a tokenizer is read from (:data:`TOKENIZER_FILES`); none is a :class:`DatasetError`."""
    if not folder.is_dir():
        raise DatasetError(f"glue: tokenizer folder {folder} does not exist: give the local folder of a Hugging Face "
                           "tokenizer (usually the model's own folder); fedflat downloads none: save one with "
                           "AutoTokenizer.from_pretrained(name).save_pretrained(folder) where there is network")
    files = [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if not files:
        raise DatasetError(f"glue: {folder} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:4])} ...): give "
                           "the folder a Hugging Face tokenizer was saved in (save_pretrained)")
    return files


def load_tokenizer(folder: Path) -> Any:
    """``AutoTokenizer.from_pretrained(folder, local_files_only=True)``; a failure is one :class:`DatasetError`."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DatasetError("glue: tokenizing needs the transformers library: pip install 'fedflat[glue]'") from None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise DatasetError(f"glue: transformers cannot load the tokenizer in {folder} ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''})") from None


def encode_texts(tokenizer: Any, texts: list[list[str]], max_length: int) -> np.ndarray:
    """int64 ``[N, K, max_length]``: input ids, attention mask and, when the tokenizer makes them, token type ids
    of each row (one text, or a pair as the tokenizer pairs them), padded and cut to ``max_length``."""
    blocks = []
    for lo in range(0, len(texts[0]), ENCODE_BATCH):
        batch = [column[lo:lo + ENCODE_BATCH] for column in texts]
        try:
            encoded = tokenizer(*batch, padding="max_length", truncation=True, max_length=max_length,
                                return_attention_mask=True, return_tensors="np")
        except (ValueError, TypeError) as err:
            raise DatasetError(f"glue: the tokenizer cannot encode the texts to max_length={max_length} "
                               f"({str(err).splitlines()[0]})") from None
        keys = [k for k in ("input_ids", "attention_mask", "token_type_ids") if k in encoded]
        blocks.append(np.stack([np.asarray(encoded[k], dtype=np.int64) for k in keys], axis=1))
    return np.concatenate(blocks)


def _versions() -> tuple[str, str]:
    import tokenizers
    import transformers
    return transformers.__version__, tokenizers.__version__


# ----------------------------------------------------------------------------- the loader

def load_glue(root: str | Path | None = None, download: bool = False, *, task: str = "sst2",
              tokenizer: str | None = None, max_length: int = 128, text_columns: Sequence[str] | None = None,
              label_column: str | None = None, label_names: Sequence[str] | None = None) -> Dataset:
    """A GLUE ``task`` (cola, sst2, mrpc, qqp, mnli, qnli, rte, wnli) or another text classification folder
    (``text_columns``, ``label_column``, ``label_names``) tokenized by the Hugging Face tokenizer in the folder
    ``tokenizer`` to ``max_length`` tokens (FedSWA's 128): ``x`` int64 ``[N, K, max_length]`` (see the module).
    ``root``: the folder of the task's files (searched as every dataset's, docs/data.md). ``download`` changes
    nothing: GLUE is read from local files only."""
    spec = text_task(task, text_columns, label_column, label_names)
    if tokenizer in (None, ""):
        raise ValueError("glue: set data.options.tokenizer to the local folder of the model's Hugging Face tokenizer "
                         "(with model=hf it defaults to model.path)")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"glue: max_length must be an int >= 2 (tokens per row; FedSWA uses 128), got {max_length!r}")
    folder, splits = find_task(spec, root)
    tokenizer_folder = Path(tokenizer).expanduser().resolve()
    digest = hashlib.sha256()
    for path in tokenizer_files(tokenizer_folder):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    options = dict(version=CACHE_VERSION, task=spec, max_length=max_length, tokenizer=digest.hexdigest(),
                   libraries=_versions(), splits=[(s.format, s.name, [f.name for f in s.files]) for s in splits])
    data_files = [f for s in splits for f in s.files]
    cache = cache_file(folder, f"glue-{spec.name}", options, data_files)
    name = f"glue-{spec.name}" if spec.name in GLUE_TASKS else spec.name
    if cache.is_file():
        with np.load(cache) as arrays:
            return Dataset(name, arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"],
                           len(arrays["classes"]), source=str(folder), files=tuple(map(str, data_files)))
    arrays = encode_splits(spec, folder, splits, load_tokenizer(tokenizer_folder), max_length)
    write_cache(cache, arrays)
    log.info("%s: %d training and %d test rows tokenized, cached in %s", name, len(arrays["y_train"]),
             len(arrays["y_test"]), cache)
    return Dataset(name, arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"],
                   len(arrays["classes"]), source=str(folder), files=tuple(map(str, data_files)))


def encode_splits(spec: TextTask, folder: Path, splits: tuple[Split, Split], tokenizer: Any,
                  max_length: int) -> dict[str, np.ndarray]:
    """Read both splits, turn their labels into class ids and tokenize their texts: the arrays cached."""
    tables = [read_split(split, folder, spec) for split in splits]
    (train_texts, train_labels, label), (test_texts, test_labels, _) = (texts_and_labels(t, spec) for t in tables)
    classes = spec.classes or infer_classes(tables[0], train_labels, label)
    if len(classes) < 2:
        raise DatasetError(f"{tables[0].where}: every label is {classes[0]!r}; a classifier needs two classes or "
                           "more (set data.options.label_names)")
    return {"x_train": encode_texts(tokenizer, train_texts, max_length),
            "y_train": label_ids(train_labels, classes, tables[0].where),
            "x_test": encode_texts(tokenizer, test_texts, max_length),
            "y_test": label_ids(test_labels, classes, tables[1].where),
            "classes": np.asarray(classes, dtype=str)}


register_dataset("glue", load_glue, "GLUE tasks (cola, sst2, mrpc, qqp, mnli, qnli, rte, wnli) or other text files, "
                 "tokenized by a local Hugging Face tokenizer: x int64 [N, 2|3, max_length] (ids, mask, token "
                 "types); test = the validation split; hub parquet, GLUE tsv or csv files (cached)")
