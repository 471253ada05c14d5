"""Building blocks shared by the benchmark models.

Everything here is written with plain ``torch`` ops so that
``torch.export.export`` produces clean, high-level ATen: ``aten.linear``,
``aten.layer_norm``, ``aten.scaled_dot_product_attention``,
``aten.cross_entropy_loss`` and friends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SIZES = ("tiny", "small", "paper")
"""Preset sizes every config class provides as classmethods."""

# --------------------------------------------------------------------------
# Config validation helpers (raise ValueError with the offending numbers).
# --------------------------------------------------------------------------


def check_positive(**fields: int | float) -> None:
    """Raise ``ValueError`` unless every keyword value is > 0."""
    for name, value in fields.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")


def check_at_least(name: str, value: int | float, minimum: int | float) -> None:
    """Raise ``ValueError`` unless ``value >= minimum``."""
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def check_probability(**fields: float) -> None:
    """Raise ``ValueError`` unless every keyword value lies in ``[0, 1)``."""
    for name, value in fields.items():
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {value}")


def check_divisible(name: str, value: int, by_name: str, by: int) -> None:
    """Raise ``ValueError`` unless ``value`` is a multiple of ``by``."""
    if value % by != 0:
        raise ValueError(f"{name} {value} is not divisible by {by_name} {by}")


def check_transformer(*, hidden: int, heads: int, layers: int, ffn: int,
                      dropout: float, attention_dropout: float) -> None:
    """Validate the fields every transformer config shares."""
    check_positive(hidden=hidden, heads=heads, layers=layers, ffn=ffn)
    check_divisible("hidden", hidden, "heads", heads)
    check_probability(dropout=dropout, attention_dropout=attention_dropout)


@dataclass(frozen=True, kw_only=True)
class LMConfig:
    """The sizes every transformer language model here shares (BERT, GPT-2, Llama), with
    the ``tiny`` and ``small`` presets of BERT and GPT-2; each model's config adds its
    own fields, checks and ``paper`` size."""

    vocab: int
    """Vocabulary size."""
    seq: int
    """Maximum sequence length (rows of the model's position tables)."""
    hidden: int
    """Model width."""
    heads: int
    """Attention heads; must divide ``hidden``."""
    layers: int
    """Number of layers (blocks)."""
    ffn: int
    """Inner width of each feed-forward network (4 * hidden in BERT and GPT-2)."""
    dropout: float = 0.0
    """Dropout after the embeddings and on each residual branch (and inside the FFN where
    the model has one there)."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities (the ``dropout_p`` of sdpa)."""

    def __post_init__(self) -> None:
        check_transformer(hidden=self.hidden, heads=self.heads, layers=self.layers, ffn=self.ffn,
                          dropout=self.dropout, attention_dropout=self.attention_dropout)
        check_positive(vocab=self.vocab, seq=self.seq)

    @classmethod
    def tiny(cls) -> LMConfig:
        """2 layers, width 32, vocab 128, seq 16 (~30k parameters)."""
        return cls(vocab=128, seq=16, hidden=32, heads=4, layers=2, ffn=128)

    @classmethod
    def small(cls) -> LMConfig:
        """4 layers, width 256, vocab 4096, seq 64 (~4-5M parameters): big enough that its
        matmuls run near a CPU core's peak, small enough to train on 2 cores; dropout 0.1."""
        return cls(vocab=4096, seq=64, hidden=256, heads=4, layers=4, ffn=1024, dropout=0.1, attention_dropout=0.1)


def seeded_generator(seed: int = 0) -> torch.Generator:
    """A fresh CPU generator, so example inputs never touch global RNG state."""
    return torch.Generator().manual_seed(seed)


def lm_tokens(vocab: int, batch: int, seq: int) -> tuple[Tensor, Tensor]:
    """Deterministic next-token-prediction inputs ``(x, y)``, each ``[batch, seq]`` int64.

    ``y`` is ``x`` shifted left by one position (the label of token ``t`` is
    token ``t + 1``) from one random stream of ``seq + 1`` tokens.
    """
    stream = torch.randint(0, vocab, (batch, seq + 1), generator=seeded_generator(),
                           dtype=torch.int64)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def lm_inputs(config: LMConfig, batch: int) -> tuple[Tensor, Tensor]:
    """Deterministic ``(x, y)`` token batches of length ``config.seq``; ``y`` is ``x`` shifted."""
    return lm_tokens(config.vocab, batch, config.seq)


@dataclass(frozen=True, kw_only=True)
class ImageConfig:
    """The inputs and labels of an image classifier here (VGG19, ViT): CIFAR-10's shapes
    unless set; each model's config adds its sizes and checks."""

    image_size: int = 32
    """Height and width of the square input image."""
    in_channels: int = 3
    """Channels of the input image."""
    classes: int = 10
    """Number of output classes."""


def labelled_images(config: ImageConfig, batch: int) -> tuple[Tensor, Tensor]:
    """Deterministic ``(x, y)``: random images ``[batch, C, H, W]`` and labels ``[batch]``."""
    gen = seeded_generator()
    x = torch.randn(batch, config.in_channels, config.image_size, config.image_size, generator=gen)
    y = torch.randint(0, config.classes, (batch,), generator=gen, dtype=torch.int64)
    return x, y


# --------------------------------------------------------------------------
# Losses.
# --------------------------------------------------------------------------


def sum_cross_entropy(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy with ``reduction="sum"`` over all leading dims.

    ``logits`` is ``[..., classes]`` and ``labels`` is ``[...]``; both are
    flattened so sequence models give one loss over ``B * S`` tokens.
    """
    classes = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, classes), labels.reshape(-1), reduction="sum")


# --------------------------------------------------------------------------
# Attention and transformer layers.
# --------------------------------------------------------------------------


def rotate_half(x: Tensor) -> Tensor:
    """Rotary helper: ``[x1, x2] -> [-x2, x1]`` on the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, H, S, D]`` by position; ``cos``/``sin`` are ``[S, D]``."""
    return x * cos + rotate_half(x) * sin


class SelfAttention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections and sdpa.

    Written out by hand (no ``nn.MultiheadAttention``) so the exported graph
    shows ``aten.linear`` for each projection and one
    ``aten.scaled_dot_product_attention``.
    """

    def __init__(self, hidden: int, heads: int, *, causal: bool, attention_dropout: float = 0.0,
                 bias: bool = True) -> None:
        super().__init__()
        check_divisible("hidden", hidden, "heads", heads)
        self.hidden = hidden
        self.heads = heads
        self.causal = causal
        self.attention_dropout = attention_dropout
        self.q = nn.Linear(hidden, hidden, bias=bias)
        self.k = nn.Linear(hidden, hidden, bias=bias)
        self.v = nn.Linear(hidden, hidden, bias=bias)
        self.out = nn.Linear(hidden, hidden, bias=bias)

    def _split_heads(self, x: Tensor) -> Tensor:
        """``[B, S, hidden] -> [B, H, S, hidden / H]``."""
        batch, seq, _ = x.shape
        return x.view(batch, seq, self.heads, self.hidden // self.heads).transpose(1, 2)

    def forward(self, x: Tensor, rotary: tuple[Tensor, Tensor] | None = None) -> Tensor:
        """Attend over ``x`` ``[B, S, hidden]``; ``rotary`` is optional ``(cos, sin)``."""
        batch, seq, _ = x.shape
        q = self._split_heads(self.q(x))
        k = self._split_heads(self.k(x))
        v = self._split_heads(self.v(x))
        if rotary is not None:
            cos, sin = rotary
            q = apply_rotary(q, cos, sin)
            k = apply_rotary(k, cos, sin)
        p = self.attention_dropout if self.training else 0.0
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal)
        o = o.transpose(1, 2).reshape(batch, seq, self.hidden)
        return self.out(o)


class FeedForward(nn.Module):
    """``Linear(hidden, ffn) -> activation -> Dropout -> Linear(ffn, hidden)``."""

    def __init__(self, hidden: int, ffn: int, *, activation: nn.Module, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.act = activation
        self.drop = nn.Dropout(dropout)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: Tensor) -> Tensor:
        """Apply the two-layer MLP position-wise."""
        return self.fc2(self.drop(self.act(self.fc1(x))))


class PostLNEncoderLayer(nn.Module):
    """Post-LN transformer layer, as ``nn.TransformerEncoderLayer(norm_first=False)``.

    ``x = LN(x + Dropout(Attn(x)))`` then ``x = LN(x + Dropout(FFN(x)))``.
    ``mlp`` is any ``[B, S, hidden] -> [B, S, hidden]`` module, so the same
    layer serves dense and mixture-of-experts models.
    """

    def __init__(self, attn: SelfAttention, mlp: nn.Module, *, hidden: int, dropout: float) -> None:
        super().__init__()
        self.attn = attn
        self.drop1 = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(hidden)
        self.mlp = mlp
        self.drop2 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(hidden)

    def forward(self, x: Tensor) -> Tensor:
        """Apply attention and MLP sub-layers, normalizing after each residual."""
        x = self.norm1(x + self.drop1(self.attn(x)))
        return self.norm2(x + self.drop2(self.mlp(x)))


def post_ln_dense_layer(*, hidden: int, heads: int, ffn: int, dropout: float,
                        attention_dropout: float, causal: bool) -> PostLNEncoderLayer:
    """A post-LN layer with a ReLU feed-forward network (the HAP benchmark layer)."""
    return PostLNEncoderLayer(
        SelfAttention(hidden, heads, causal=causal, attention_dropout=attention_dropout),
        FeedForward(hidden, ffn, activation=nn.ReLU(), dropout=dropout),
        hidden=hidden, dropout=dropout)


def sinusoidal_positions(seq: int, hidden: int) -> Tensor:
    """The fixed ``[seq, hidden]`` sin/cos table of "Attention Is All You Need"."""
    position = torch.arange(seq, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, hidden, 2, dtype=torch.float32) * (-math.log(10000.0) / hidden))
    table = torch.zeros(seq, hidden)
    table[:, 0::2] = torch.sin(position * div)
    table[:, 1::2] = torch.cos(position * div)
    return table


def post_ln_params(*, hidden: int, ffn: int) -> int:
    """Parameters in one dense post-LN layer: 4 projections, 2 FFN linears, 2 LNs."""
    attention = 4 * (hidden * hidden + hidden)
    mlp = hidden * ffn + ffn + ffn * hidden + hidden
    norms = 2 * 2 * hidden
    return attention + mlp + norms
