"""Registry of model factories, name lookup and option validation."""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fedflat.core.registry import add, origin_of
from fedflat.core.round import SERVER, stream_seed

from .cnn import cnn
from .hub import hf, timm
from .lora import AdapterSettings, adapt
from .densenet import densenet121
from .lstm import lstm
from .mlp import logreg, mlp
from .pretrained import load_pretrained
from .resnet import resnet18, resnet20, resnet34, resnet50, wrn28_4
from .textcnn import textcnn
from .vit import vit

#: name -> ``(factory(input_shape, num_classes, **options), one-line description)``
MODELS: dict[str, tuple[Callable[..., nn.Module], str]] = {
    "logreg": (logreg, "Logistic regression: flatten + one Linear layer"),
    "mlp": (mlp, "FedAvg 2NN MLP: flatten, ReLU hidden layers (200, 200), Linear"),
    "cnn": (cnn, "FedAvg/FL-Simulator CNN: 2x conv5x5(64)+maxpool, FC 384-192-classes; norm none|batch|group, dropout"),
    "resnet20": (resnet20, "CIFAR ResNet-20 (3x3 BasicBlocks, 16-32-64); norm group (GroupNorm(2))|batch|none"),
    "resnet18": (resnet18, "ResNet-18 (BasicBlock); norm group (GroupNorm(2))|batch|none; stem cifar|imagenet"),
    "resnet34": (resnet34, "ResNet-34 (BasicBlock); norm group (GroupNorm(2))|batch|none; stem cifar|imagenet"),
    "resnet50": (resnet50, "ResNet-50 (Bottleneck, torchvision v1.5); norm group|batch|none; stem imagenet|cifar"),
    "wrn28_4": (wrn28_4, "Wide ResNet WRN-28-4 (pre-activation); norm group (GroupNorm(2))|batch|none"),
    "densenet121": (densenet121, "DenseNet-121 (growth 32, blocks 6-12-24-16), CIFAR stem (FedLAW's); "
                                 "norm group|batch|none"),
    "vit": (vit, "Vision Transformer with timm's parameter names: variant tiny16 (ViT-Ti/16) | base16 (ViT-B/16) | "
                 "base32 (ViT-B/32); patch, dim, depth, heads"),
    "hf": (hf, "A Hugging Face transformers classifier from a local folder (model.path): text (RoBERTa, BERT) or "
               "images (ViT, Swin); nothing downloaded"),
    "timm": (timm, "A timm architecture (model.arch) with a local weights file (model.weights); needs timm"),
    "lstm": (lstm, "LEAF's Shakespeare LSTM on int64 windows [B, L]: embed 8, 2 x LSTM 256, next symbol"),
    "textcnn": (textcnn, "Kim TextCNN on int64 tokens [B, L]: embed 128, conv 3/4/5 x100"),
}

_POSITIONAL = ("input_shape", "num_classes")


def register_model(name: str, factory: Callable[..., nn.Module], description: str) -> Callable[..., nn.Module]:
    """Makes ``factory(input_shape, num_classes, **options)`` available as ``model.name: NAME``, its keyword
    options as ``model.<option>`` (a plugin's model, docs/extending.md); a name taken by another module is an
    error naming both. ``description`` is its line in ``fedflat list``."""
    add(MODELS, "model", str(name).strip().lower(), (factory, description), origin=origin_of(factory))
    return factory


def model_options(name: str) -> dict[str, Any]:
    """Return the options accepted by model ``name`` with their default values."""
    factory, _ = MODELS[_resolve(name)]
    params = inspect.signature(factory).parameters
    return {k: p.default for k, p in params.items() if k not in _POSITIONAL}


def _resolve(name: str) -> str:
    """Normalise ``name`` and check it is registered, suggesting the closest match."""
    key = str(name).strip().lower()
    if key in MODELS:
        return key
    valid = sorted(MODELS)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.0)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"Unknown model {name!r}.{hint} Valid models: {', '.join(valid)}")


def build_model(name: str, input_shape: Sequence[int], num_classes: int,
                **options: Any) -> nn.Module:
    """Build model ``name`` for inputs ``[B, *input_shape]`` and ``num_classes`` logits.

    Raises ``ValueError`` for an unknown name (listing the valid names and the
    closest match) or an unknown option (listing the model's valid options).
    ``pretrained=PATH`` (every model) loads a local checkpoint (:mod:`fedflat.models.pretrained`).
    """
    key = _resolve(name)
    pretrained = options.pop("pretrained", None)
    valid = model_options(key)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        listed = ", ".join(valid) if valid else "(none)"
        close = difflib.get_close_matches(unknown[0], list(valid), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"Unknown option(s) {', '.join(map(repr, unknown))} for model "
                         f"{key!r}.{hint} Valid options: {listed}")
    factory, _ = MODELS[key]
    model = factory(tuple(input_shape), num_classes, **options)
    if pretrained:
        load_pretrained(model, pretrained)
    return model


def assemble(make: Callable[[], nn.Module], seed: int, adapter: AdapterSettings | None = None) -> nn.Module:
    """The run's module as every process builds it: ``make()`` and then ``adapter``'s adapters
    (:func:`fedflat.models.lora.adapt`), both drawn from the server's keyed stream ``(seed, -1, server, init)``, so
    that a randomly initialized frozen part (FFA-LoRA's ``A``, a base of random weights) is the same in the driver,
    every worker and every node; the process's own random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(stream_seed(seed, -1, SERVER, "init"))
        module = make()
        return adapt(module, adapter) if adapter is not None else module


def base_key(name: str) -> str:
    """The ``model`` option naming the files of the pretrained weights of the model called ``name``: ``path`` (hf),
    ``weights`` (timm), ``pretrained`` (every other model)."""
    return {"hf": "path", "timm": "weights"}.get(str(name).strip().lower(), "pretrained")


def without_weights(section: dict[str, Any]) -> dict[str, Any]:
    """The ``model`` section that builds the same architecture without reading its pretrained weights (they come
    from elsewhere: a broadcast, or a module of the same run in this process): ``pretrained`` and timm's ``weights``
    left out, a Hugging Face folder built from its ``config.json`` alone."""
    key = base_key(section["name"])
    if key == "path":
        return {**section, "random_weights": True}
    return {k: v for k, v in section.items() if k != key}


def count_parameters(model: nn.Module) -> int:
    """Total number of scalar parameters in ``model`` (shared tensors counted once)."""
    return sum(p.numel() for p in model.parameters())
