"""Model zoo for fedflat: vmap-friendly classifiers with a ``features`` method.

Use :func:`build_model` to construct a model by name::

    model = build_model("resnet18", (3, 32, 32), 10, stem="imagenet")

Every model maps ``[B, *input_shape]`` to logits ``[B, num_classes]``, exposes
``features(x) -> [B, D]`` with ``forward(x) == head(features(x))``, and by default
has no buffers and no dropout (GroupNorm in the ResNet family and DenseNet); their
``norm: group | batch | none`` option (and the CNN's ``norm`` and ``dropout``)
builds the BatchNorm and dropout variants, whose statistics fedflat federates
(docs/models.md). ``model.input_dtype`` is ``torch.long`` for ``textcnn`` (token
ids) and ``torch.float32`` otherwise.
"""

from __future__ import annotations

from .base import FedModel
from .lora import AdapterSettings, frozen_hash, save_adapter
from .registry import (MODELS, assemble, base_key, build_model, count_parameters, model_options, register_model,
                       without_weights)

__all__ = ["build_model", "MODELS", "count_parameters", "model_options", "FedModel", "register_model", "assemble",
           "AdapterSettings", "base_key", "frozen_hash", "save_adapter", "without_weights"]
