"""Vision Transformer (Dosovitskiy et al., ICLR 2021), fedflat's own, with timm's parameter names.

FedLESAM's Table 3 fine-tunes a pretrained ViT-B/32 and FedFFT's backbone table trains timm's ViT-Tiny/16 layout.
timm needs torchvision, which does not import with the CPU torch used here (and installing it may pull
another torch), so the model is written out here, small and vmap-friendly (attention as plain matrix
products, no fused kernel), with **timm's state-dict keys** (``patch_embed.proj``, ``cls_token``,
``pos_embed``, ``blocks.i.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}``, ``norm``, ``head``), so a
timm checkpoint saved with ``torch.save(model.state_dict())`` loads through ``model.pretrained=PATH``.

Variants (``variant=``): ``tiny16`` (timm's ``vit_tiny_patch16_224``: width 192, depth 12, 3 heads,
5,717,416 parameters with 1000 classes), ``base16`` (``vit_base_patch16_224``, FedSWA's and FedNSAM's ViT-B: width
768, depth 12, 12 heads, 86,567,656 parameters) and ``base32`` (``vit_base_patch32_224``: 88,224,232 parameters);
``patch``, ``dim``, ``depth`` and ``heads`` override the variant's (a small ViT for small images, e.g.
``variant=tiny16 patch=4 dim=64 depth=4 heads=4`` on 28x28). Class token, learned position embeddings, pre-norm blocks, GELU MLP of 4x width,
LayerNorm eps 1e-6, classification from the final class token, as timm's defaults.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .base import FedModel, check_common, check_image_shape

VARIANTS = {"tiny16": (16, 192, 12, 3), "base16": (16, 768, 12, 12), "base32": (32, 768, 12, 12)}  # patch, width,
# depth, heads


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        weights = torch.softmax(q @ k.transpose(-2, -1) * (dim // self.heads) ** -0.5, dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(batch, tokens, dim))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()  # (a module: FedMAN's activation penalty reads its output)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, channels: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(channels, dim, patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class VisionTransformer(FedModel):
    def __init__(self, input_shape: Sequence[int], num_classes: int, patch: int, dim: int, depth: int,
                 heads: int) -> None:
        super().__init__(input_shape, num_classes)
        channels, height, width = self.input_shape
        self.grid = (height // patch, width // patch)  # patches per column and row
        tokens = self.grid[0] * self.grid[1]
        self.patch_embed = PatchEmbed(channels, patch, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.feature_dim = dim
        self.head = nn.Linear(dim, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                nn.init.zeros_(m.bias)
        nn.init.trunc_normal_(self.cls_token, std=1e-6)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.patch_embed(x)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        x = self.blocks(torch.cat([cls, tokens], dim=1) + self.pos_embed)
        return self.norm(x)[:, 0]


def vit(input_shape: Sequence[int], num_classes: int, variant: str = "tiny16", patch: int | None = None,
        dim: int | None = None, depth: int | None = None, heads: int | None = None) -> VisionTransformer:
    """ViT ``variant`` (``tiny16``, ``base16`` or ``base32``; ``patch``, ``dim``, ``depth``, ``heads`` override its
    sizes) for ``[C, H, W]`` inputs whose sides the patch size divides."""
    if variant not in VARIANTS:
        raise ValueError(f"vit variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    shape = check_common(input_shape, num_classes)
    check_image_shape("vit", shape)
    patch, dim, depth, heads = (given if given is not None else default for given, default
                                in zip((patch, dim, depth, heads), VARIANTS[variant]))
    if dim % heads:
        raise ValueError(f"vit: dim={dim} must be a multiple of heads={heads}")
    if shape[1] % patch or shape[2] % patch:
        raise ValueError(f"vit {variant}: the patch size {patch} must divide the input's height and width, "
                         f"got {shape[1]}x{shape[2]}")
    return VisionTransformer(shape, num_classes, patch, dim, depth, heads)
