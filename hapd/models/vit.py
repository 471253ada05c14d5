"""Vision Transformer on CIFAR-10-shaped images, post-LN with a ReLU FFN as in HAP."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._common import (ImageConfig, check_divisible, check_positive, check_transformer, labelled_images,
                      post_ln_dense_layer, post_ln_params, sum_cross_entropy)


@dataclass(frozen=True, kw_only=True)
class ViTConfig(ImageConfig):
    """Sizes of :class:`ViT`."""

    hidden: int
    """Model width (token embedding size)."""
    heads: int
    """Attention heads; must divide ``hidden``."""
    layers: int
    """Number of post-LN encoder layers."""
    ffn: int
    """Inner width of each feed-forward network (4 * hidden in the paper)."""
    patch: int = 4
    """Side of each square patch; must divide ``image_size``."""
    dropout: float = 0.0
    """Dropout after the embeddings, each sub-layer and inside the FFN."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities (the ``dropout_p`` of sdpa)."""

    def __post_init__(self) -> None:
        check_transformer(hidden=self.hidden, heads=self.heads, layers=self.layers, ffn=self.ffn,
                          dropout=self.dropout, attention_dropout=self.attention_dropout)
        check_positive(image_size=self.image_size, patch=self.patch,
                       in_channels=self.in_channels, classes=self.classes)
        check_divisible("image_size", self.image_size, "patch", self.patch)

    @classmethod
    def tiny(cls) -> ViTConfig:
        """2 layers, width 32, 4 heads (~30k parameters)."""
        return cls(hidden=32, heads=4, layers=2, ffn=128)

    @classmethod
    def small(cls) -> ViTConfig:
        """4 layers, width 256, 4 heads (~3.2M parameters), ViT's dropout 0.1."""
        return cls(hidden=256, heads=4, layers=4, ffn=1024, dropout=0.1, attention_dropout=0.1)

    @classmethod
    def paper(cls) -> ViTConfig:
        """ViT-Base on 32x32 images with 4x4 patches (~85M parameters)."""
        return cls(hidden=768, heads=12, layers=12, ffn=3072, dropout=0.1, attention_dropout=0.1)

    def patches(self) -> int:
        """Number of patches per image (the sequence length without the cls token)."""
        return (self.image_size // self.patch) ** 2

    def param_count(self) -> int:
        """Exact number of parameters of the model this config builds."""
        h = self.hidden
        embed = self.in_channels * self.patch * self.patch * h + h + h + (self.patches() + 1) * h
        head = h * self.classes + self.classes
        return embed + self.layers * post_ln_params(hidden=h, ffn=self.ffn) + head


class ViT(nn.Module):
    """Patch embedding + cls token + learned positions, post-LN encoder, linear head on cls."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden
        self.patch_embed = nn.Conv2d(config.in_channels, h, kernel_size=config.patch,
                                     stride=config.patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, h))
        self.pos_embed = nn.Parameter(torch.zeros(1, config.patches() + 1, h))
        self.reset_parameters()
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            post_ln_dense_layer(hidden=h, heads=config.heads, ffn=config.ffn,
                                dropout=config.dropout,
                                attention_dropout=config.attention_dropout, causal=False)
            for _ in range(config.layers))
        self.head = nn.Linear(h, config.classes)

    def reset_parameters(self) -> None:
        """Initialize the model's own parameters (class token, position table):
        N(0, 0.02); its children initialize theirs (``hapd.module_init`` calls each)."""
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """Loss for images ``x`` ``[B, C, H, W]`` float and labels ``y`` ``[B]`` int64."""
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)  # [B, patches, hidden]
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        h = self.drop(torch.cat((cls, tokens), dim=1) + self.pos_embed)
        for layer in self.layers:
            h = layer(h)
        return sum_cross_entropy(self.head(h[:, 0]), y)


example_inputs = labelled_images
"""Deterministic ``(x, y)``: random images and labels."""
