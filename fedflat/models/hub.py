"""Pretrained models from local files, nothing downloaded: a Hugging Face ``transformers`` folder (``model=hf``) or a
timm architecture with a local weights file (``model=timm``).

``model: {name: hf, path: FOLDER}`` reads ``FOLDER/config.json`` and its weights (``model.safetensors`` or
``pytorch_model.bin``, sharded or not) with ``AutoModelForSequenceClassification`` (text: RoBERTa, BERT, ...) or
``AutoModelForImageClassification`` (images: ViT, Swin, DeiT, ...) and ``local_files_only``; the classifier is
replaced when the data's number of classes differs from the folder's. ``random_weights: true`` builds the
architecture from ``config.json`` alone, with weights drawn from the run's seed (benchmarks, tests). The folder's
tokenizer is what a text dataset reads it with (``data.options.tokenizer``, default the model's folder).

The module a run trains (:class:`Classifier`) takes one tensor, as every fedflat model does: token ids as int64
``[B, K, L]`` — ``x[:, 0]`` the ``input_ids``, ``x[:, 1]`` the ``attention_mask``, ``x[:, 2]`` the
``token_type_ids`` where ``K = 3`` (:mod:`fedflat.data.glue` makes them), or ``[B, L]`` ids alone, every token
attended (the ``synthetic`` dataset's ``tokens``: benchmarks) — or pixels ``[B, C, H, W]``; it returns the
logits, and ``features(x)`` the classifier's input (its first token for a sequence head).

``model: {name: timm, arch: NAME, weights: FILE}`` builds timm's ``NAME`` with the weights of ``FILE`` (timm's own
loader, through ``pretrained_cfg_overlay``: its head dropped where the classes differ). timm needs torchvision,
which must match the installed torch: ``pip install timm`` where it does (docs/models.md).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, Sequence

import torch
from torch import nn

from fedflat.core import ConfigError

from .base import FedModel, check_common

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
TASK_TYPES = {"text": "SEQ_CLS", "image": None}  # peft's task type of each kind (SEQ_CLS saves the classifier)


def _transformers():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local folder only: never a request to the hub
    try:
        import transformers
    except ImportError:
        raise ConfigError("model=hf needs Hugging Face transformers: pip install 'fedflat[lora]'") from None
    transformers.logging.set_verbosity_error()  # (its notices of a replaced head: the run's report says it)
    return transformers


def hf_folder(path: str | Path | None, random_weights: bool) -> Path:
    """The model folder, checked: its ``config.json`` and (unless ``random_weights``) its weights are there."""
    if not path:
        raise ConfigError("model=hf: give model.path, a local folder of a Hugging Face model (config.json and its "
                          "weights); fedflat downloads nothing")
    folder = Path(path).expanduser()
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model.path: {folder / 'config.json'} not found: give the folder save_pretrained wrote "
                          "(fedflat downloads nothing)")
    if not random_weights and not any((folder / f).is_file() for f in WEIGHT_FILES):
        raise ConfigError(f"model.path: {folder} has no weights ({' or '.join(WEIGHT_FILES[::2])}); copy them "
                          "there, or set model.random_weights=true to train the architecture from scratch")
    return folder


def model_kind(config) -> Literal["text", "image"]:
    """Whether a transformers config is an image model's (it names channels and an image size) or a text one's."""
    return "image" if hasattr(config, "image_size") and hasattr(config, "num_channels") else "text"


class Classifier(FedModel):
    """A Hugging Face classifier as fedflat trains it: one input tensor in, logits out (the module docstring)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, model: nn.Module, kind: str) -> None:
        super().__init__(input_shape, num_classes)
        self.model, self.kind = model, kind
        self.input_dtype = torch.long if kind == "text" else torch.float32
        self.feature_dim = int(getattr(model.config, "hidden_size", 0))

    def inputs(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.kind == "image":
            return {"pixel_values": x}
        x = x.long()
        if x.dim() == 2:  # ids alone: every token attended
            return {"input_ids": x}
        named = {"input_ids": x[:, 0], "attention_mask": x[:, 1]}
        if x.shape[1] > 2:
            named["token_type_ids"] = x[:, 2]
        return named

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**self.inputs(x)).logits

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The classifier's input (a sequence head's first token): the representation the head reads."""
        head = _head_of(self.model)
        seen: list[torch.Tensor] = []
        handle = head.register_forward_pre_hook(lambda _, args: seen.append(args[0]))
        try:
            self.forward(x)
        finally:
            handle.remove()
        rep = seen[0]
        return rep[:, 0] if rep.dim() == 3 else rep.flatten(1)


def _head_of(model: nn.Module) -> nn.Module:
    for name in ("classifier", "score", "head"):
        found = [m for n, m in model.named_modules() if n.rpartition(".")[2] == name]
        if found:
            return found[0]
    raise ValueError(f"{type(model).__name__} has no classifier module (classifier, score, head)")


def hf(input_shape: Sequence[int], num_classes: int, path: str | None = None,
       task: Literal["auto", "text", "image"] = "auto", attention: Literal["eager", "sdpa"] = "eager",
       random_weights: bool = False) -> Classifier:
    """A Hugging Face classification model from the local folder ``path`` (the module docstring). ``attention``:
    transformers' ``attn_implementation``. ``eager`` (the default) draws attention dropout through
    ``nn.Dropout``, from each client's keyed stream, so every engine and executor gives the same numbers; ``sdpa``
    (fused attention, faster on a GPU) draws it inside one kernel from the global generator, which only the
    sequential engine on one executor thread seeds per client."""
    shape = check_common(input_shape, num_classes)
    transformers = _transformers()
    folder = hf_folder(path, random_weights)
    config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    kind = model_kind(config) if task == "auto" else task
    auto = (transformers.AutoModelForImageClassification if kind == "image"
            else transformers.AutoModelForSequenceClassification)
    options = {"num_labels": num_classes, "attn_implementation": attention}
    try:
        if random_weights:
            config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True, **options)
            model = auto.from_config(config, attn_implementation=attention)
        else:
            model = auto.from_pretrained(folder, local_files_only=True, ignore_mismatched_sizes=True, **options)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"model.path: {folder} cannot be read as a {kind} classification model "
                          f"({str(err).splitlines()[0][:300]})") from None
    return Classifier(shape, num_classes, model, kind)


def timm(input_shape: Sequence[int], num_classes: int, arch: str | None = None, weights: str | None = None,
         img_size: int | None = None) -> nn.Module:
    """timm's ``arch`` with the weights of the local file ``weights`` (none: timm's initialization, from the run's
    seed) for ``[C, H, W]`` inputs (``img_size`` defaults to ``H``)."""
    shape = check_common(input_shape, num_classes)
    if not arch:
        raise ConfigError("model=timm: give model.arch, a timm model name (timm.list_models())")
    try:
        import timm as timm_lib
    except Exception as err:  # noqa: BLE001 - ImportError, or torchvision failing to load beside this torch
        raise ConfigError(f"model=timm needs timm and a torchvision that matches this torch ({type(err).__name__}: "
                          f"{str(err).splitlines()[0][:200]}); fedflat's own vit loads timm ViT weights without "
                          "timm (model=vit model.pretrained=FILE)") from None
    overlay = {}
    if weights:
        file = Path(weights).expanduser()
        if not file.is_file():
            raise ConfigError(f"model.weights: {file} not found (fedflat downloads no weights: give a local file)")
        overlay = {"pretrained_cfg_overlay": {"file": str(file)}}
    transformer = arch.startswith(("vit", "deit", "swin", "beit", "eva"))  # (their constructors take img_size)
    size = img_size or (shape[1] if transformer and len(shape) == 3 else None)
    return timm_lib.create_model(arch, pretrained=bool(weights), num_classes=num_classes,
                                 **({"img_size": size} if size else {}), **overlay)
