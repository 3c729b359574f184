"""Low-rank adapters (LoRA, AdaLoRA) on any module, by Hugging Face's ``peft``: the config's ``adapter`` section.

LoRA (Hu et al., ICLR 2022) keeps a pretrained weight ``W0`` frozen and learns ``W0 + (alpha / r) B A`` with
``A [r, d_in]`` and ``B [d_out, r]`` (``B = 0`` at the start) on the target modules; the classifier head, which a new
task replaces, is trained whole (peft's ``modules_to_save``). fedflat federates what is trained — the adapters and the
head, the flat vector ``w`` every part of a method perturbs, corrects and aggregates — and leaves the frozen base in
the module, loaded once per process and never sent (:class:`fedflat.params.FlatModel` takes the parameters that
``requires_grad``). FedSWA's and FedNSAM's codes (``main_FedSWA.py``, ``new_llm.py``) are the defaults: ``r`` 8,
``alpha = 2r``, dropout 0.05, no bias, ``attn.qkv``/``attn.proj`` on a ViT and ``query/key/value/dense`` on RoBERTa.

Options beyond plain LoRA:

- ``freeze_a: true`` — FFA-LoRA (Sun et al., ICLR 2024): ``A`` stays at its random initialization (drawn from the
  run's seed, the same in every process) and only ``B`` (and the head) is trained and sent: the update of a client
  is then linear in what it sends, which is what makes the mean of the clients' adapters exact and DP's noise smaller;
- ``method: adalora`` — AdaLoRA's SVD form ``P diag(E) Q`` (Zhang et al., ICLR 2023) at rank ``init_r`` (``2r``, as
  FedSWA's code). As in FedSWA's and FedNSAM's codes, which compute the loss from the logits themselves, neither the
  orthogonality penalty (added by peft only to a model-computed loss) nor the rank budget schedule
  (``update_and_allocate``, never called there) runs: the adapter keeps its ``init_r`` ranks;
- ``init: FOLDER`` — start from a peft adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``),
  e.g. a run's ``adapter/``: its settings define the adapter.

FedSA-LoRA (Guo et al., ICLR 2025: ``A`` shared, ``B`` kept by each client) is a personalization part
(``algo.personalization=fedsa``, :mod:`fedflat.algorithms.fedsa`).
"""
from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from fedflat.core import ConfigError

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # peft's own file names
HEAD_NAMES = ("head", "classifier", "score", "fc")  # a classifier's usual module names, tried in this order
ADAPTED_TYPES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding)  # what LoRA adapts (peft's layers)


class AdapterSettings(Protocol):
    """What fedflat reads of the config's ``adapter`` section (:class:`fedflat.config.AdapterConfig`)."""

    method: str
    r: int
    alpha: float | None
    dropout: float
    target_modules: list[str] | None
    bias: str
    modules_to_save: list[str] | None
    freeze_a: bool
    init_r: int | None
    init: str | None


def lora_alpha(cfg: AdapterSettings) -> float:
    """``lora_alpha``: the given one, else ``2r`` (FedSWA's and FedNSAM's codes)."""
    return cfg.alpha if cfg.alpha is not None else 2.0 * cfg.r


def default_targets(module: nn.Module) -> list[str] | None:
    """The adapted modules of FedSWA's and FedNSAM's codes for the model's family: ``attn.qkv``, ``attn.proj`` on
    a ViT or Swin with timm's names (fedflat's ``vit``, timm's models); ``query``, ``key``, ``value``, ``dense`` on a
    BERT-style encoder (RoBERTa, BERT, ViT of transformers); None where fedflat knows no default."""
    names = {name.rpartition(".")[2] for name, _ in module.named_modules()}
    if {"qkv", "proj"} <= names and any(n.endswith("attn.qkv") for n, _ in module.named_modules()):
        return ["attn.qkv", "attn.proj"]
    if {"query", "key", "value"} <= names:
        return ["query", "key", "value", "dense"]
    return None


def module_patterns(module: nn.Module) -> list[str]:
    """The names of the module's adaptable layers (Linear, Conv, Embedding), block indices as ``*``, each once:
    what an error lists (``blocks.*.attn.qkv``, not twelve lines of it)."""
    seen: dict[str, None] = {}
    for name, child in module.named_modules():
        if isinstance(child, ADAPTED_TYPES) and name:
            seen[re.sub(r"\.\d+(?=\.|$)", ".*", name)] = None
    return list(seen)


def _matches(name: str, target: str) -> bool:
    """peft's rule for a string target: the whole name, or its end after a dot."""
    return name == target or name.endswith("." + target)


def check_targets(module: nn.Module, targets: list[str], rank: int) -> None:
    """Every target names at least one adaptable layer, and ``rank`` fits each layer it names (``r <= min(d_in,
    d_out)``); otherwise one line naming the target and the module's layers."""
    layers = [(name, child) for name, child in module.named_modules() if isinstance(child, ADAPTED_TYPES)]
    for target in targets:
        hit = [(name, child) for name, child in layers if _matches(name, target)]
        if not hit:
            shown = module_patterns(module)
            raise ConfigError(f"adapter.target_modules: {target!r} matches no Linear, Conv or Embedding layer of "
                              f"{type(module).__name__}; its layers are: {', '.join(shown[:40])}"
                              + (f" and {len(shown) - 40} more" if len(shown) > 40 else ""))
        for name, child in hit:
            dims = _dims(child)
            if rank > min(dims):
                raise ConfigError(f"adapter.r={rank} is larger than layer {name!r} allows ({type(child).__name__} "
                                  f"{dims[0]} -> {dims[1]}: a rank of at most {min(dims)}); lower adapter.r or leave "
                                  "that layer out of adapter.target_modules")


def _dims(layer: nn.Module) -> tuple[int, int]:
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    if isinstance(layer, nn.Embedding):
        return layer.num_embeddings, layer.embedding_dim
    return layer.in_channels * int(torch.tensor(layer.kernel_size).prod()), layer.out_channels


def head_modules(module: nn.Module) -> list[str]:
    """The classifier head trained whole by default: the first of ``head``, ``classifier``, ``score``, ``fc`` that
    is a direct child of the module (or of a Hugging Face model it wraps); none where there is none."""
    children = dict(module.named_children())
    for name in HEAD_NAMES:
        if name in children:
            return [name]
    return []


def peft_config(cfg: AdapterSettings, module: nn.Module, task_type: str | None = None):
    """peft's ``LoraConfig`` / ``AdaLoraConfig`` of ``cfg`` for ``module`` (its default targets and head filled in,
    checked against the module's layers)."""
    from peft import AdaLoraConfig, LoraConfig

    targets = cfg.target_modules if cfg.target_modules is not None else default_targets(module)
    if not targets:
        raise ConfigError(f"adapter.target_modules: fedflat knows no default for {type(module).__name__}; name the "
                          f"layers to adapt, e.g. adapter.target_modules=[{', '.join(module_patterns(module)[:2])}] "
                          f"(its layers: {', '.join(module_patterns(module)[:40])})")
    init_r = cfg.init_r if cfg.init_r is not None else 2 * cfg.r
    check_targets(module, targets, init_r if cfg.method == "adalora" else cfg.r)
    saved = cfg.modules_to_save if cfg.modules_to_save is not None else (
        [] if task_type == "SEQ_CLS" else head_modules(module))  # (peft adds a SEQ_CLS model's classifier itself)
    common = dict(lora_alpha=lora_alpha(cfg), lora_dropout=cfg.dropout, target_modules=targets, bias=cfg.bias,
                  modules_to_save=saved or None, task_type=task_type)
    if cfg.method == "adalora":
        # total_step only satisfies AdaLoraConfig's check: the budget schedule never runs (the module docstring)
        return AdaLoraConfig(target_r=cfg.r, init_r=init_r, total_step=1, **common)
    return LoraConfig(r=cfg.r, **common)


def attach(module: nn.Module, cfg: AdapterSettings, task_type: str | None = None) -> nn.Module:
    """``module`` with ``cfg``'s adapters (peft's ``get_peft_model``, or ``PeftModel.from_pretrained`` for
    ``cfg.init``): a ``PeftModel`` whose trainable parameters are the adapters and the head; ``freeze_a`` freezes
    every ``lora_A``."""
    from peft import PeftModel, get_peft_model

    for p in module.parameters():
        p.requires_grad_(False)
    if cfg.init is not None:
        folder = adapter_folder(cfg.init)
        try:
            adapted = PeftModel.from_pretrained(module, str(folder), is_trainable=True)
        except Exception as err:  # noqa: BLE001 - peft's errors (missing keys, wrong shapes): one line, the folder
            raise ConfigError(f"adapter.init: {folder} does not fit this model ({type(err).__name__}: "
                              f"{str(err).splitlines()[0][:300]})") from None
    else:
        adapted = get_peft_model(module, peft_config(cfg, module, task_type))
    if cfg.freeze_a:
        for name, p in adapted.named_parameters():
            if ".lora_A." in name:
                p.requires_grad_(False)
    return adapted


def adapt(module: nn.Module, cfg: AdapterSettings) -> nn.Module:
    """``module`` with ``cfg``'s adapters (:func:`attach`); a Hugging Face :class:`~fedflat.models.hub.Classifier`
    keeps its wrapper and adapts the transformers model inside, with peft's task type (so the adapter saved loads
    onto ``AutoModelFor...Classification.from_pretrained(folder)``)."""
    from .hub import TASK_TYPES, Classifier

    if isinstance(module, Classifier):
        module.model = attach(module.model, cfg, TASK_TYPES[module.kind])
        return module
    return attach(module, cfg)


def adapter_folder(path: str | Path) -> Path:
    """A peft adapter folder, checked: its two files are there; else one line naming what is missing."""
    folder = Path(path).expanduser()
    missing = [f for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if not (folder / f).is_file()]
    if missing:
        raise ConfigError(f"adapter.init: {folder} is not a peft adapter folder ({', '.join(missing)} missing); give "
                          "a folder PeftModel.save_pretrained wrote, e.g. a fedflat run's adapter/")
    return folder


def adapted(module: nn.Module):
    """The ``PeftModel`` inside ``module`` (itself, or the one a Hugging Face wrapper holds), or None."""
    from peft import PeftModel

    for child in (module, *module.children()):
        if isinstance(child, PeftModel):
            return child
    return None


def save_adapter(module: nn.Module, folder: str | Path) -> Path:
    """Writes the adapters of ``module`` (an ordinary module at the trained weights:
    :meth:`fedflat.params.FlatModel.materialized`) by peft's own ``save_pretrained`` into ``folder``:
    ``adapter_config.json`` and ``adapter_model.safetensors``, which ``PeftModel.from_pretrained(base, folder)``
    loads. The folder is written beside it and renamed into place: it is whole or absent."""
    model = adapted(module)
    if model is None:
        raise ValueError("this model has no peft adapters to save")
    folder = Path(folder)
    staging = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging))
    (staging / "README.md").unlink(missing_ok=True)  # (peft's model-card template: nothing of the run in it)
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    return folder


def merge_adapters(module: nn.Module) -> nn.Module:
    """``module`` (an ordinary module at the trained weights) with its adapters merged into the base, ``W0 + (alpha
    / r) B A`` (peft's ``merge_and_unload``): the plain model a deployment serves, with no peft layer left. The
    base's tensors change in place: merge a module built for it (``fedflat evaluate --merged`` builds its own)."""
    model = adapted(module)
    if model is None:
        raise ValueError("this model has no peft adapters to merge")
    merged = model.merge_and_unload()
    if model is module:
        return merged
    for name, child in module.named_children():
        if child is model:
            setattr(module, name, merged)
    return module


def frozen_hash(module: nn.Module) -> str | None:
    """A digest of the module's frozen parameters (names, shapes, dtypes, bytes): the pretrained base every process
    must hold the same, and FFA-LoRA's seeded ``A``. None where nothing is frozen."""
    digest = hashlib.blake2b(digest_size=16)
    frozen = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]
    if not frozen:
        return None
    for name, p in frozen:
        digest.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy())  # (its buffer: no copy of the base)
    return digest.hexdigest()


def frozen_count(module: nn.Module) -> int:
    """The number of frozen parameter entries of ``module`` (its base under adapters), shared ones once."""
    return sum(p.numel() for p in module.parameters() if not p.requires_grad)
