"""ResNet-18/34/50, CIFAR ResNet-20 and WRN-28-4 with GroupNorm (or BatchNorm), as used in federated-learning
benchmarks.

He et al., *Deep Residual Learning for Image Recognition* (CVPR 2016), with
BasicBlocks ``[2, 2, 2, 2]`` (ResNet-18) or ``[3, 4, 6, 3]`` (ResNet-34) and
widths 64-128-256-512. Following Hsieh et al. (*The Non-IID Data Quagmire*,
ICML 2020), FL-Simulator (woodenchild95/FL-Simulator) and the FedSAM/FedSpeed/
FedSMOO papers, every BatchNorm is replaced by ``GroupNorm(groups, C)`` with
``groups=2`` so the model has no running statistics (no buffers). ``norm="batch"``
builds He et al.'s BatchNorm layout instead (its running statistics are federated
as buffers; FedBN keeps them on each client), ``norm="none"`` no normalization.

Stems:

* ``stem="cifar"`` (default): 3x3 conv, stride 1, no max-pool (the usual CIFAR
  adaptation, keeps resolution for 32x32 inputs);
* ``stem="imagenet"``: 7x7 stride-2 conv + 3x3 stride-2 max-pool, i.e. the
  torchvision layout that FL-Simulator applies unchanged to CIFAR.

Parameter counts (3 input channels, 10 classes):

=====================  ============  ==============
model                  stem="cifar"  stem="imagenet"
=====================  ============  ==============
resnet18               11,173,962    11,181,642
resnet34               21,282,122    21,289,802
resnet50 (1000 cl.)    -             25,557,032 (torchvision's count)
resnet20               272,474       -
wrn28_4 (100 classes)  5,872,180     -
=====================  ============  ==============

Initialisation follows torchvision: Kaiming-normal (fan_out, ReLU) convolutions,
norm weight 1 / bias 0, default ``nn.Linear`` init for the classifier.
``features`` returns the 512-d globally average-pooled representation.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .base import FedModel, check_common, check_image_shape, check_norm, check_positive_int, norm_layer

WIDTHS = (64, 128, 256, 512)
CIFAR_WIDTHS = (16, 32, 64)  # He et al.'s CIFAR ResNets (§4.2)
STEMS = ("cifar", "imagenet")


def conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    """3x3 convolution with padding 1 and no bias (followed by a norm layer)."""
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 conv-norm layers with an identity or 1x1-conv-norm projection shortcut."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, groups: int, norm: str = "group") -> None:
        super().__init__()
        self.conv1 = conv3x3(in_ch, out_ch, stride)
        self.norm1 = norm_layer(norm, out_ch, groups)
        self.conv2 = conv3x3(out_ch, out_ch)
        self.norm2 = norm_layer(norm, out_ch, groups)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                norm_layer(norm, out_ch, groups),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


def make_stem(in_ch: int, width: int, stem: str, groups: int, norm: str = "group") -> nn.Sequential:
    """The input stem: CIFAR-style 3x3/s1 conv, or ImageNet-style 7x7/s2 conv + max-pool."""
    if stem == "cifar":
        return nn.Sequential(conv3x3(in_ch, width), norm_layer(norm, width, groups), nn.ReLU())
    return nn.Sequential(
        nn.Conv2d(in_ch, width, 7, stride=2, padding=3, bias=False),
        norm_layer(norm, width, groups), nn.ReLU(),
        nn.MaxPool2d(3, stride=2, padding=1),
    )


def init_weights(model: nn.Module) -> None:
    """torchvision's initialisation: Kaiming-normal (fan_out, ReLU) convolutions, norms weight 1 / bias 0."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.GroupNorm, nn.BatchNorm2d)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class Bottleneck(nn.Module):
    """1x1 (width) - 3x3 (width, the stride here as torchvision's ResNet v1.5) - 1x1 (4 width) conv-norm
    layers, with an identity or 1x1-conv-norm projection shortcut."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int, groups: int, norm: str = "group") -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.norm1 = norm_layer(norm, width, groups)
        self.conv2 = conv3x3(width, width, stride)
        self.norm2 = norm_layer(norm, width, groups)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.norm3 = norm_layer(norm, out_ch, groups)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                          norm_layer(norm, out_ch, groups))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.norm1(self.conv1(x)))
        out = self.relu(self.norm2(self.conv2(out)))
        return self.relu(self.norm3(self.conv3(out)) + self.shortcut(x))


class ResNet(FedModel):
    """ResNet with GroupNorm (``norm``: or BatchNorm, or none); ``blocks`` gives blocks per stage of ``widths``
    channels (the first stage at stride 1, every later one halving the resolution); ``block``: BasicBlock or
    Bottleneck."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, blocks: Sequence[int],
                 stem: str = "cifar", groups: int = 2, widths: Sequence[int] = WIDTHS,
                 block: type[nn.Module] = BasicBlock, norm: str = "group") -> None:
        super().__init__(input_shape, num_classes)
        self.stem = make_stem(self.input_shape[0], widths[0], stem, groups, norm)
        expansion = getattr(block, "expansion", 1)
        stages: list[nn.Module] = []
        in_ch = widths[0]
        for i, (width, n) in enumerate(zip(widths, blocks)):
            layers = [block(in_ch if j == 0 else width * expansion, width,
                            1 if (i == 0 or j > 0) else 2, groups, norm) for j in range(n)]
            stages.append(nn.Sequential(*layers))
            in_ch = width * expansion
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = widths[-1] * expansion
        self.head = nn.Linear(self.feature_dim, self.num_classes)
        init_weights(self)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.stages(self.stem(x))).flatten(1)


def _check(name: str, input_shape: Sequence[int], num_classes: int, groups: int,
           widths: Sequence[int], norm: str = "group") -> tuple[tuple[int, ...], int]:
    shape = check_common(input_shape, num_classes)
    check_image_shape(name, shape)
    groups = check_positive_int(f"{name} groups", groups)
    if check_norm(name, norm) == "group" and any(w % groups for w in widths):
        raise ValueError(f"{name} groups={groups} must divide every width {tuple(widths)}")
    return shape, groups


def _resnet(name: str, blocks: Sequence[int], input_shape: Sequence[int], num_classes: int,
            stem: str, groups: int, widths: Sequence[int] = WIDTHS, block: type[nn.Module] = BasicBlock,
            norm: str = "group") -> ResNet:
    """Validate options and build a ResNet."""
    shape, groups = _check(name, input_shape, num_classes, groups, widths, norm)
    if stem not in STEMS:
        raise ValueError(f"{name} stem must be one of {STEMS}, got {stem!r}")
    return ResNet(shape, num_classes, blocks, stem, groups, widths, block, norm)


def resnet18(input_shape: Sequence[int], num_classes: int, stem: str = "cifar",
             groups: int = 2, norm: str = "group") -> ResNet:
    """ResNet-18 (BasicBlocks [2, 2, 2, 2]) with GroupNorm(groups), or ``norm`` batch | none."""
    return _resnet("resnet18", (2, 2, 2, 2), input_shape, num_classes, stem, groups, norm=norm)


def resnet34(input_shape: Sequence[int], num_classes: int, stem: str = "cifar",
             groups: int = 2, norm: str = "group") -> ResNet:
    """ResNet-34 (BasicBlocks [3, 4, 6, 3]) with GroupNorm(groups), or ``norm`` batch | none."""
    return _resnet("resnet34", (3, 4, 6, 3), input_shape, num_classes, stem, groups, norm=norm)


def resnet50(input_shape: Sequence[int], num_classes: int, stem: str = "imagenet", groups: int = 2,
             norm: str = "group") -> ResNet:
    """ResNet-50 (Bottlenecks [3, 4, 6, 3], torchvision's v1.5 layout) with GroupNorm(groups), or ``norm``
    batch | none; the ImageNet stem by default (FedWMSAM's OfficeHome table: 224 x 224 inputs)."""
    return _resnet("resnet50", (3, 4, 6, 3), input_shape, num_classes, stem, groups, WIDTHS, Bottleneck, norm)


def resnet20(input_shape: Sequence[int], num_classes: int, groups: int = 2, norm: str = "group") -> ResNet:
    """He et al.'s CIFAR ResNet-20 (§4.2: 3 stages of 3 BasicBlocks, 16-32-64 channels) with GroupNorm(groups), or
    ``norm`` batch (He et al.'s) | none; shortcuts that change shape are 1x1 convolutions (option B; option A's
    zero padding has no parameters)."""
    return _resnet("resnet20", (3, 3, 3), input_shape, num_classes, "cifar", groups, CIFAR_WIDTHS, norm=norm)


class WideBlock(nn.Module):
    """Zagoruyko & Komodakis' pre-activation wide block: norm-ReLU-conv3x3-norm-ReLU-conv3x3, plus the
    input (or a 1x1 convolution of the pre-activated input when the shape changes)."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, groups: int, norm: str = "group") -> None:
        super().__init__()
        self.norm1 = norm_layer(norm, in_ch, groups)
        self.conv1 = conv3x3(in_ch, out_ch, stride)
        self.norm2 = norm_layer(norm, out_ch, groups)
        self.conv2 = conv3x3(out_ch, out_ch)
        self.relu = nn.ReLU()
        self.shortcut = (nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False)
                         if stride != 1 or in_ch != out_ch else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = self.relu(self.norm1(x))
        out = self.conv2(self.relu(self.norm2(self.conv1(pre))))
        return out + (x if self.shortcut is None else self.shortcut(pre))


class WideResNet(FedModel):
    """WRN-depth-k (Zagoruyko & Komodakis, BMVC 2016): a 3x3 conv of 16, three stages of ``(depth - 4) / 6``
    wide blocks of 16k, 32k, 64k channels, norm-ReLU, global pooling, linear; GroupNorm for BatchNorm (``norm``:
    or BatchNorm as published, or none)."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, depth: int, k: int, groups: int,
                 norm: str = "group") -> None:
        super().__init__(input_shape, num_classes)
        n = (depth - 4) // 6
        widths = (16 * k, 32 * k, 64 * k)
        self.stem = conv3x3(self.input_shape[0], 16)
        stages, in_ch = [], 16
        for i, width in enumerate(widths):
            stages.append(nn.Sequential(*[WideBlock(in_ch if j == 0 else width, width, 2 if (i > 0 and j == 0) else 1,
                                                    groups, norm) for j in range(n)]))
            in_ch = width
        self.stages = nn.Sequential(*stages)
        self.norm = norm_layer(norm, widths[-1], groups)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.feature_dim = widths[-1]
        self.head = nn.Linear(self.feature_dim, self.num_classes)
        init_weights(self)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(torch.relu(self.norm(self.stages(self.stem(x))))).flatten(1)


def wrn28_4(input_shape: Sequence[int], num_classes: int, groups: int = 2, norm: str = "group") -> WideResNet:
    """WRN-28-4 (FedVSSAM's CIFAR-100 backbone, seed 000 Table 1) with GroupNorm(groups), or ``norm``
    batch | none."""
    shape, groups = _check("wrn28_4", input_shape, num_classes, groups, (16, 64, 128, 256), norm)
    return WideResNet(shape, num_classes, 28, 4, groups, norm)
