"""VGG19 for CIFAR-10-shaped images (3x32x32), as benchmarked in the HAP paper."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._common import (ImageConfig, check_divisible, check_positive, check_probability, labelled_images,
                      sum_cross_entropy)

POOL = "M"
"""Marker for a 2x2 max-pool in a VGG layer pattern."""

VGG19_PATTERN: tuple[int | str, ...] = (
    1, 1, POOL, 2, 2, POOL, 4, 4, 4, 4, POOL, 8, 8, 8, 8, POOL, 8, 8, 8, 8, POOL)
"""VGG19's 16 conv layers and 5 pools, as multiples of the base width (64 in the paper)."""

POOLS = sum(1 for item in VGG19_PATTERN if item == POOL)
"""Number of 2x2 max-pools; the image side shrinks by ``2 ** POOLS``."""


@dataclass(frozen=True, kw_only=True)
class VGG19Config(ImageConfig):
    """Sizes of :class:`VGG19`; ``image_size`` must be a multiple of 32."""

    width: int
    """Channels of the first conv block; later blocks use 2x, 4x and 8x this (paper: 64)."""
    hidden: int
    """Width of the two hidden classifier layers (paper: 4096)."""
    dropout: float = 0.0
    """Dropout probability in the classifier."""

    def __post_init__(self) -> None:
        check_positive(width=self.width, hidden=self.hidden, image_size=self.image_size,
                       in_channels=self.in_channels, classes=self.classes)
        check_divisible("image_size", self.image_size, "2**pools", 2 ** POOLS)
        check_probability(dropout=self.dropout)

    @classmethod
    def tiny(cls) -> VGG19Config:
        """VGG19 with channels divided by 16 and a 64-wide classifier (~86k parameters)."""
        return cls(width=4, hidden=64)

    @classmethod
    def small(cls) -> VGG19Config:
        """VGG19 with channels divided by 4 and a 512-wide classifier (~1.6M parameters)."""
        return cls(width=16, hidden=512)

    @classmethod
    def paper(cls) -> VGG19Config:
        """VGG19 on CIFAR-10 with the standard 4096-wide classifier (~39M parameters)."""
        return cls(width=64, hidden=4096, dropout=0.1)

    def channels(self) -> tuple[int | str, ...]:
        """The layer pattern in channels, with :data:`POOL` markers."""
        return tuple(item if item == POOL else int(item) * self.width for item in VGG19_PATTERN)

    def features(self) -> int:
        """Length of the flattened feature map that enters the classifier."""
        side = self.image_size // 2 ** POOLS
        return 8 * self.width * side * side

    def param_count(self) -> int:
        """Exact number of parameters of the model this config builds."""
        total, cin = 0, self.in_channels
        for item in self.channels():
            if item != POOL:
                total += cin * int(item) * 9 + int(item)
                cin = int(item)
        h = self.hidden
        return total + self.features() * h + h + h * h + h + h * self.classes + self.classes


class VGG19(nn.Module):
    """16 ``conv3x3 -> ReLU`` layers with 5 max-pools, then a 3-layer classifier."""

    def __init__(self, config: VGG19Config) -> None:
        super().__init__()
        self.config = config
        layers: list[nn.Module] = []
        cin = config.in_channels
        for item in config.channels():
            if item == POOL:
                layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                layers += [nn.Conv2d(cin, int(item), kernel_size=3, padding=1), nn.ReLU()]
                cin = int(item)
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(
            nn.Linear(config.features(), config.hidden), nn.ReLU(), nn.Dropout(config.dropout),
            nn.Linear(config.hidden, config.hidden), nn.ReLU(), nn.Dropout(config.dropout),
            nn.Linear(config.hidden, config.classes))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """Loss for images ``x`` ``[B, C, H, W]`` float and labels ``y`` ``[B]`` int64."""
        features = torch.flatten(self.features(x), 1)
        return sum_cross_entropy(self.classifier(features), y)


example_inputs = labelled_images
"""Deterministic ``(x, y)``: random images and labels."""
