"""A plain multi-layer perceptron classifier: the smallest benchmark model."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ._common import check_positive, check_probability, seeded_generator, sum_cross_entropy


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Sizes of :class:`MLP`."""

    in_features: int
    """Width of the input vector ``x``."""
    hidden: int
    """Width of every hidden layer."""
    layers: int
    """Number of hidden ``Linear -> GELU`` layers (the classifier adds one more Linear)."""
    classes: int
    """Number of output classes."""
    dropout: float = 0.0
    """Dropout probability after each hidden activation."""

    def __post_init__(self) -> None:
        check_positive(in_features=self.in_features, hidden=self.hidden, layers=self.layers,
                       classes=self.classes)
        check_probability(dropout=self.dropout)

    @classmethod
    def tiny(cls) -> MLPConfig:
        """A ~7k-parameter MLP for tests."""
        return cls(in_features=32, hidden=64, layers=2, classes=10)

    @classmethod
    def small(cls) -> MLPConfig:
        """A ~3.4M-parameter MLP, 4 hidden layers of 1024."""
        return cls(in_features=256, hidden=1024, layers=4, classes=10)

    @classmethod
    def paper(cls) -> MLPConfig:
        """A ~126M-parameter MLP (not a HAP paper model; sized like its smallest benchmarks)."""
        return cls(in_features=1024, hidden=4096, layers=8, classes=1000, dropout=0.1)

    def param_count(self) -> int:
        """Exact number of parameters of the model this config builds."""
        first = self.in_features * self.hidden + self.hidden
        rest = (self.layers - 1) * (self.hidden * self.hidden + self.hidden)
        head = self.hidden * self.classes + self.classes
        return first + rest + head


class MLP(nn.Module):
    """``[Linear -> GELU -> Dropout] * layers -> Linear``, trained with summed cross-entropy."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        blocks: list[nn.Module] = []
        width = config.in_features
        for _ in range(config.layers):
            blocks += [nn.Linear(width, config.hidden), nn.GELU(), nn.Dropout(config.dropout)]
            width = config.hidden
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(width, config.classes)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """Loss for inputs ``x`` ``[B, in_features]`` float and labels ``y`` ``[B]`` int64."""
        return sum_cross_entropy(self.head(self.body(x)), y)


def example_inputs(config: MLPConfig, batch: int) -> tuple[Tensor, Tensor]:
    """Deterministic ``(x, y)`` for a batch of ``batch`` samples."""
    gen = seeded_generator()
    x = torch.randn(batch, config.in_features, generator=gen)
    y = torch.randint(0, config.classes, (batch,), generator=gen, dtype=torch.int64)
    return x, y
