"""The small CNN used throughout the federated-learning literature for CIFAR.

Architecture of the "CNN" in McMahan et al. (FedAvg, AISTATS 2017; after the
TensorFlow CIFAR-10 tutorial model) as implemented in FL-Simulator
(woodenchild95/FL-Simulator) and the FedSAM/FedSpeed/FedSMOO line of work::

    conv(C_in, 64, 5) - ReLU - maxpool(2)
    conv(64, 64, 5)   - ReLU - maxpool(2)
    flatten - fc(·, 384) - ReLU - fc(384, 192) - ReLU - fc(192, num_classes)

``features`` returns the 192-d output of the second fully-connected layer.

Convolutions use no padding by default (``padding=0``), exactly as in the
reference. The flattened size is computed from ``input_shape``:

* 3x32x32 (CIFAR-10, 10 classes): 64*5*5 = 1600 -> **797,962** parameters
  (4,864 + 102,464 + 614,784 + 73,920 + 1,930);
* 1x28x28 (Fashion-MNIST, 10 classes): 64*4*4 = 1024 -> 573,578 parameters.

With ``padding=0`` inputs need H, W >= 16; ``padding=2`` ("same" convolutions)
accepts anything >= 4x4 (e.g. 12x12 -> 64*3*3).

Variants (the reference has neither): ``norm="batch"`` (or ``"group"``: GroupNorm(2, 64)) normalizes each
convolution's output before its ReLU, the common CIFAR BatchNorm CNN; ``dropout=p`` drops the outputs of both
hidden fully-connected layers after their ReLU in training.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .base import FedModel, check_common, check_image_shape, check_norm, norm_layer

KERNEL = 5
CHANNELS = 64


def _out_side(side: int, padding: int) -> int:
    """Spatial size after one conv(5, padding) + maxpool(2) stage."""
    return (side + 2 * padding - KERNEL + 1) // 2


def _min_side(padding: int) -> int:
    """Smallest H (or W) leaving at least a 1x1 map after both stages."""
    side = 1
    while _out_side(_out_side(side, padding), padding) < 1:
        side += 1
    return side


class CNN(FedModel):
    """FedAvg / FL-Simulator CNN: two 5x5 conv layers and three FC layers."""

    def __init__(self, input_shape: Sequence[int], num_classes: int,
                 padding: int = 0, norm: str = "none", dropout: float = 0.0) -> None:
        super().__init__(input_shape, num_classes)
        c, h, w = self.input_shape
        for _ in range(2):
            h, w = _out_side(h, padding), _out_side(w, padding)

        def stage(in_ch: int) -> list[nn.Module]:
            conv = [nn.Conv2d(in_ch, CHANNELS, KERNEL, padding=padding)]
            return conv + ([norm_layer(norm, CHANNELS)] if norm != "none" else []) + [nn.ReLU(), nn.MaxPool2d(2)]

        def hidden(in_features: int, out_features: int) -> list[nn.Module]:
            return [nn.Linear(in_features, out_features), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])

        self.conv = nn.Sequential(*stage(c), *stage(CHANNELS))
        self.fc = nn.Sequential(*hidden(CHANNELS * h * w, 384), *hidden(384, 192))
        self.feature_dim = 192
        self.head = nn.Linear(192, self.num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.conv(x).flatten(1))


def cnn(input_shape: Sequence[int], num_classes: int, padding: int = 0, norm: str = "none",
        dropout: float = 0.0) -> CNN:
    """Build the FedAvg/FL-Simulator CNN for ``(C, H, W)`` inputs.

    ``padding`` is the zero padding of both 5x5 convolutions (0 as in the
    reference; 2 keeps the spatial size, allowing inputs down to 4x4); ``norm`` (none as in the reference, batch
    or group) normalizes each convolution's output; ``dropout`` is the drop probability after both hidden
    fully-connected layers (0: none, as in the reference).
    """
    shape = check_common(input_shape, num_classes)
    _, h, w = check_image_shape("cnn", shape)
    if isinstance(padding, bool) or not isinstance(padding, int) or not 0 <= padding <= 2:
        raise ValueError(f"cnn padding must be 0, 1 or 2, got {padding!r}")
    check_norm("cnn", norm)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"cnn dropout must be a probability in [0, 1), got {dropout!r}")
    minimum = _min_side(padding)
    if min(h, w) < minimum:
        raise ValueError(f"cnn with padding={padding} needs H, W >= {minimum}, got {shape} "
                         "(use padding=2 for smaller images)")
    return CNN(shape, num_classes, padding, norm, float(dropout))
