"""LEAF's next-character LSTM for Shakespeare (Caldas et al., *LEAF*, 2018; FedFFT's appendix, seed 004).

Input: int64 character indices ``[B, L]`` (LEAF: 80-character windows over its 80-symbol vocabulary);
output: logits ``[B, num_classes]`` of the character that follows the window. Layers, as LEAF's reference
model: embedding of size 8, a stack of two LSTM layers of 256 units, a linear classifier on the last
hidden state.

The recurrence is written with matrix products (one fused ``[4H]`` gate projection per layer and step)
rather than ``nn.LSTM``, so the model works under ``torch.func.vmap`` (fedflat's vectorized engine);
its parameters are ``nn.LSTM``'s (``weight_ih``, ``weight_hh``, two bias vectors per layer, gates in
PyTorch's order input, forget, cell, output) and it computes the same function (tested). Parameter count,
80 symbols: 819,920 (LEAF's TensorFlow ``BasicLSTMCell`` has one bias vector per layer: 817,872).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from .base import FedModel, check_common, check_positive_int


class StackedLSTM(nn.Module):
    """``layers`` LSTM layers over ``[B, L, input_size]``; returns the last layer's final hidden state."""

    def __init__(self, input_size: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.weight_ih = nn.ParameterList()
        self.weight_hh = nn.ParameterList()
        self.bias_ih = nn.ParameterList()
        self.bias_hh = nn.ParameterList()
        bound = 1 / math.sqrt(hidden)  # nn.LSTM's initialisation
        for layer in range(layers):
            size = input_size if layer == 0 else hidden
            for params, shape in ((self.weight_ih, (4 * hidden, size)), (self.weight_hh, (4 * hidden, hidden)),
                                  (self.bias_ih, (4 * hidden,)), (self.bias_hh, (4 * hidden,))):
                params.append(nn.Parameter(torch.empty(shape).uniform_(-bound, bound)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, _ = x.shape
        seq = x
        for w_ih, w_hh, b_ih, b_hh in zip(self.weight_ih, self.weight_hh, self.bias_ih, self.bias_hh):
            h = x.new_zeros(batch, self.hidden)
            c = x.new_zeros(batch, self.hidden)
            inputs = seq @ w_ih.T + b_ih + b_hh  # the input projection of every step at once
            outputs = []
            for t in range(steps):
                i, f, g, o = (inputs[:, t] + h @ w_hh.T).chunk(4, dim=1)
                c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
                h = torch.sigmoid(o) * torch.tanh(c)
                outputs.append(h)
            seq = torch.stack(outputs, dim=1)
        return seq[:, -1]


class CharLSTM(FedModel):
    """Embedding -> stacked LSTM -> linear classifier of the next symbol."""

    input_dtype = torch.long

    def __init__(self, input_shape: Sequence[int], num_classes: int, vocab_size: int, embed_dim: int,
                 hidden: int, layers: int) -> None:
        super().__init__(input_shape, num_classes)
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = StackedLSTM(embed_dim, hidden, layers)
        self.feature_dim = hidden
        self.head = nn.Linear(hidden, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(self.embedding(x.long()))


def lstm(input_shape: Sequence[int], num_classes: int, vocab_size: int | None = None, embed_dim: int = 8,
         hidden: int = 256, layers: int = 2) -> CharLSTM:
    """LEAF's Shakespeare model: embedding 8, two LSTM layers of 256, next-symbol logits.

    ``input_shape`` is ``[L]`` (the window length); ``vocab_size`` defaults to ``num_classes`` (next-symbol
    prediction over the same vocabulary)."""
    shape = check_common(input_shape, num_classes)
    if len(shape) != 1:
        raise ValueError(f"lstm takes token windows of shape [L], got input shape {list(shape)}")
    vocab = check_positive_int("lstm vocab_size", vocab_size if vocab_size is not None else num_classes)
    return CharLSTM(shape, num_classes, vocab, check_positive_int("lstm embed_dim", embed_dim),
                    check_positive_int("lstm hidden", hidden), check_positive_int("lstm layers", layers))
