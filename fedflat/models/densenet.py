"""DenseNet-121 for CIFAR inputs with GroupNorm: FedFFT's backbone table (seed 004, Table 2; §C.2: "DenseNet-fedlaw
(Li et al., 2023) implementation with GN").

Huang et al., *Densely Connected Convolutional Networks* (CVPR 2017), in the CIFAR layout of FedLAW's code
(Li et al., ICML 2023) that seed 004 names: a 3x3 stem convolution of ``2 k`` channels (no stride, no pooling),
four dense blocks of ``[6, 12, 24, 16]`` bottleneck layers with growth rate ``k = 32`` (each norm-ReLU-conv1x1 to
``4 k``, norm-ReLU-conv3x3 to ``k``, its output concatenated before its input), transitions norm-ReLU-conv1x1
halving the channels and a 2x2 average pool, a final norm-ReLU, global average pooling and a linear classifier.
Every BatchNorm is a ``GroupNorm(groups, C)`` (no running statistics); the channel counts (64 + 32 j) are all
even, so the default ``groups=2`` divides them, as in fedflat's ResNets. ``norm="batch"`` keeps Huang et al.'s
BatchNorm (statistics federated as buffers), ``norm="none"`` drops the normalization.

6,956,298 parameters for 10 classes (GroupNorm has BatchNorm's two affine parameters per channel, so the count is
FedLAW's BatchNorm model's).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from .base import FedModel, check_common, check_image_shape, check_norm, check_positive_int, norm_layer
from .resnet import init_weights

BLOCKS_121 = (6, 12, 24, 16)


class DenseLayer(nn.Module):
    """The bottleneck layer: ``cat([conv3x3(relu(norm(conv1x1(relu(norm(x)))))), x])``."""

    def __init__(self, in_ch: int, growth: int, groups: int, norm: str = "group") -> None:
        super().__init__()
        self.norm1 = norm_layer(norm, in_ch, groups)
        self.conv1 = nn.Conv2d(in_ch, 4 * growth, 1, bias=False)
        self.norm2 = norm_layer(norm, 4 * growth, groups)
        self.conv2 = nn.Conv2d(4 * growth, growth, 3, padding=1, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.conv1(self.relu(self.norm1(x)))
        out = self.conv2(self.relu(self.norm2(out)))
        return torch.cat([out, x], 1)


class Transition(nn.Module):
    """norm-ReLU-conv1x1 to ``out_ch`` channels, then a 2x2 average pool."""

    def __init__(self, in_ch: int, out_ch: int, groups: int, norm: str = "group") -> None:
        super().__init__()
        self.norm = norm_layer(norm, in_ch, groups)
        self.conv = nn.Conv2d(in_ch, out_ch, 1, bias=False)
        self.relu = nn.ReLU()
        self.pool = nn.AvgPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.conv(self.relu(self.norm(x))))


class DenseNet(FedModel):
    """A CIFAR DenseNet: ``blocks`` bottleneck layers per dense block, growth rate ``growth``, transitions keeping
    ``floor(reduction * C)`` channels; global average pooling before the classifier."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, blocks: Sequence[int], growth: int,
                 reduction: float, groups: int, norm: str = "group") -> None:
        super().__init__(input_shape, num_classes)
        channels = 2 * growth
        self.stem = nn.Conv2d(self.input_shape[0], channels, 3, padding=1, bias=False)
        stages: list[nn.Module] = []
        for i, n in enumerate(blocks):
            stages += [DenseLayer(channels + j * growth, growth, groups, norm) for j in range(n)]
            channels += n * growth
            if i < len(blocks) - 1:
                out_ch = int(math.floor(channels * reduction))
                stages.append(Transition(channels, out_ch, groups, norm))
                channels = out_ch
        self.stages = nn.Sequential(*stages)
        self.norm = norm_layer(norm, channels, groups)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = channels
        self.head = nn.Linear(channels, self.num_classes)
        init_weights(self)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.norm(self.stages(self.stem(x))))).flatten(1)


def densenet121(input_shape: Sequence[int], num_classes: int, groups: int = 2, norm: str = "group") -> DenseNet:
    """DenseNet-121 (dense blocks [6, 12, 24, 16], growth 32, compression 0.5), CIFAR stem, GroupNorm(groups), or
    ``norm`` batch | none."""
    shape = check_common(input_shape, num_classes)
    check_image_shape("densenet121", shape)
    groups = check_positive_int("densenet121 groups", groups)
    if check_norm("densenet121", norm) == "group" and 32 % groups:
        raise ValueError(f"densenet121 groups={groups} must divide 32 (every width is a multiple of 32)")
    return DenseNet(shape, num_classes, BLOCKS_121, growth=32, reduction=0.5, groups=groups, norm=norm)
