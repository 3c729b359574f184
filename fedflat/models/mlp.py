"""Fully-connected models: the FedAvg-style MLP and multinomial logistic regression.

* ``MLP``: "2NN" of McMahan et al., *Communication-Efficient Learning of Deep
  Networks from Decentralized Data* (AISTATS 2017): flatten, two hidden ReLU
  layers of 200 units, linear classifier. For a 1x28x28 input and 10 classes
  (MNIST / Fashion-MNIST) this is 784-200-200-10 with 199,210 parameters.
* ``LogReg``: flatten + a single ``nn.Linear`` (convex baseline, and handy for
  tests with hand-computed gradients). ``features`` is the flattened input.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .base import FedModel, check_common, check_positive_int, flat_size


class MLP(FedModel):
    """Flatten -> [Linear -> ReLU] * len(hidden) -> Linear(num_classes)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int,
                 hidden: Sequence[int] = (200, 200)) -> None:
        super().__init__(input_shape, num_classes)
        sizes = [flat_size(self.input_shape)] + list(hidden)
        layers: list[nn.Module] = []
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.feature_dim = sizes[-1]
        self.head = nn.Linear(self.feature_dim, self.num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x.flatten(1))


class LogReg(FedModel):
    """Multinomial logistic regression: flatten -> Linear(num_classes)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int) -> None:
        super().__init__(input_shape, num_classes)
        self.feature_dim = flat_size(self.input_shape)
        self.head = nn.Linear(self.feature_dim, self.num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


def mlp(input_shape: Sequence[int], num_classes: int,
        hidden: Sequence[int] = (200, 200)) -> MLP:
    """Build the FedAvg "2NN" MLP; ``hidden`` lists the hidden-layer widths."""
    shape = check_common(input_shape, num_classes)
    if isinstance(hidden, (int, str)):
        raise ValueError(f"hidden must be a sequence of widths, got {hidden!r}")
    widths = tuple(check_positive_int("hidden widths", h) for h in hidden)
    if not widths:  # (it built a linear model without a word)
        raise ValueError("hidden=[] leaves the MLP no hidden layer: for a linear model use model=logreg "
                         "(multinomial logistic regression)")
    return MLP(shape, num_classes, widths)


def logreg(input_shape: Sequence[int], num_classes: int) -> LogReg:
    """Build a linear (logistic-regression) classifier on the flattened input."""
    return LogReg(check_common(input_shape, num_classes), num_classes)
