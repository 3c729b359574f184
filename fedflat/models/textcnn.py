"""TextCNN for sentence/document classification (e.g. DBpedia-14).

Kim, *Convolutional Neural Networks for Sentence Classification* (EMNLP 2014):
token embedding -> parallel 1-D convolutions with several kernel sizes ->
ReLU -> max-over-time pooling -> concatenation -> linear classifier.

Inputs are ``int64`` token ids of shape ``[B, L]`` (so ``input_shape=(L,)``);
``L`` must be at least ``max(kernel_sizes)``. Float tensors holding integral
ids are cast to ``long`` in ``features``. Defaults: ``embed_dim=128``,
kernel sizes (3, 4, 5) with 100 filters each, so ``features`` is 300-d.
With ``vocab_size=30000`` and 14 classes this is 3,998,114 parameters
(3,840,000 of them in the embedding).

Token id ``padding_idx`` (default 0) has an all-zero embedding that receives no
gradient, as in ``nn.Embedding``; pass ``padding_idx=None`` to disable.
Kim's model uses dropout 0.5 before the classifier; here ``dropout`` defaults
to 0, as in fedflat's other models (with ``dropout > 0`` each client draws its masks
from its own keyed stream, on both engines: docs/models.md).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .base import FedModel, check_common, check_positive_int


class TextCNN(FedModel):
    """Embedding -> conv1d(k) for k in kernel_sizes -> ReLU -> max over time -> Linear."""

    input_dtype = torch.long

    def __init__(self, input_shape: Sequence[int], num_classes: int, vocab_size: int = 30000,
                 embed_dim: int = 128, kernel_sizes: Sequence[int] = (3, 4, 5),
                 num_filters: int = 100, padding_idx: int | None = 0,
                 dropout: float = 0.0) -> None:
        super().__init__(input_shape, num_classes)
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=padding_idx)
        self.convs = nn.ModuleList(nn.Conv1d(embed_dim, num_filters, k) for k in kernel_sizes)
        self.relu = nn.ReLU()
        self.feature_dim = num_filters * len(kernel_sizes)
        linear = nn.Linear(self.feature_dim, self.num_classes)
        self.head = nn.Sequential(nn.Dropout(dropout), linear) if dropout > 0 else linear

    def features(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_floating_point():  # token ids stored in a float tensor (exact below 2**24)
            x = x.long()
        emb = self.embedding(x).transpose(1, 2)  # [B, embed_dim, L]
        pooled = [self.relu(conv(emb)).amax(dim=2) for conv in self.convs]
        return torch.cat(pooled, dim=1)


def textcnn(input_shape: Sequence[int], num_classes: int, vocab_size: int = 30000,
            embed_dim: int = 128, kernel_sizes: Sequence[int] = (3, 4, 5),
            num_filters: int = 100, padding_idx: int | None = 0,
            dropout: float = 0.0) -> TextCNN:
    """Build Kim's TextCNN for int64 token inputs of shape ``(L,)``."""
    shape = check_common(input_shape, num_classes)
    if len(shape) != 1:
        raise ValueError(f"textcnn expects input_shape (L,), got {shape}")
    vocab_size = check_positive_int("textcnn vocab_size", vocab_size)
    embed_dim = check_positive_int("textcnn embed_dim", embed_dim)
    num_filters = check_positive_int("textcnn num_filters", num_filters)
    if isinstance(kernel_sizes, (int, str)) or not kernel_sizes:
        raise ValueError(f"textcnn kernel_sizes must be a non-empty sequence, got {kernel_sizes!r}")
    kernels = tuple(check_positive_int("textcnn kernel_sizes", k) for k in kernel_sizes)
    if max(kernels) > shape[0]:
        raise ValueError(f"textcnn sequence length {shape[0]} < largest kernel {max(kernels)}")
    if padding_idx is not None and not 0 <= padding_idx < vocab_size:
        raise ValueError(f"textcnn padding_idx must be in [0, {vocab_size}) or None, "
                         f"got {padding_idx!r}")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"textcnn dropout must be in [0, 1), got {dropout!r}")
    return TextCNN(shape, num_classes, vocab_size, embed_dim, kernels, num_filters,
                   padding_idx, float(dropout))
