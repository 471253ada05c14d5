"""BERT-Base-sized *causal* language model, as benchmarked in the HAP paper.

Follows the PyTorch ``word_language_model`` transformer that HAP used: scaled
token embedding, fixed sinusoidal positions, post-LN layers with a ReLU FFN,
causal attention and an untied output projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from ._common import (check_positive, check_transformer, lm_tokens, post_ln_dense_layer,
                      post_ln_params, sinusoidal_positions, sum_cross_entropy)


@dataclass(frozen=True, kw_only=True)
class BertConfig:
    """Sizes of :class:`BertLM`."""

    vocab: int
    """Vocabulary size (paper: 33280, WikiText-2's 33278 rounded up to a multiple of 8)."""
    seq: int
    """Sequence length; the sinusoidal position table has this many rows."""
    hidden: int
    """Model width; must be even (sin/cos position pairs)."""
    heads: int
    """Attention heads; must divide ``hidden``."""
    layers: int
    """Number of post-LN encoder layers."""
    ffn: int
    """Inner width of each feed-forward network (4 * hidden in the paper)."""
    dropout: float = 0.0
    """Dropout after the embeddings, each sub-layer and inside the FFN."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities (the ``dropout_p`` of sdpa)."""

    def __post_init__(self) -> None:
        check_transformer(hidden=self.hidden, heads=self.heads, layers=self.layers, ffn=self.ffn,
                          dropout=self.dropout, attention_dropout=self.attention_dropout)
        check_positive(vocab=self.vocab, seq=self.seq)
        if self.hidden % 2:
            raise ValueError(f"hidden {self.hidden} must be even for sinusoidal positions")

    @classmethod
    def tiny(cls) -> BertConfig:
        """2 layers, width 32, vocab 128, seq 16 (~34k parameters)."""
        return cls(vocab=128, seq=16, hidden=32, heads=4, layers=2, ffn=128)

    @classmethod
    def small(cls) -> BertConfig:
        """4 layers, width 256, vocab 4096, seq 64 (~5.3M parameters): big enough that its
        matmuls run near a CPU core's peak, small enough to train on 2 cores; BERT's dropout
        0.1."""
        return cls(vocab=4096, seq=64, hidden=256, heads=4, layers=4, ffn=1024, dropout=0.1, attention_dropout=0.1)

    @classmethod
    def paper(cls) -> BertConfig:
        """BERT-Base sizes, seq 128, vocab 33280 (~136M parameters)."""
        return cls(vocab=33280, seq=128, hidden=768, heads=12, layers=12, ffn=3072,
                   dropout=0.1, attention_dropout=0.1)

    def param_count(self) -> int:
        """Exact number of parameters of the model this config builds."""
        embed = self.vocab * self.hidden
        head = self.hidden * self.vocab + self.vocab
        return embed + self.layers * post_ln_params(hidden=self.hidden, ffn=self.ffn) + head


class BertLM(nn.Module):
    """Causal post-LN transformer LM; ``forward(x, y)`` returns the summed token loss."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.register_buffer("positions", sinusoidal_positions(config.seq, config.hidden))
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(self.build_layer(i) for i in range(config.layers))
        self.head = nn.Linear(config.hidden, config.vocab)
        nn.init.uniform_(self.embed.weight, -0.1, 0.1)
        nn.init.uniform_(self.head.weight, -0.1, 0.1)
        nn.init.zeros_(self.head.bias)

    def build_layer(self, index: int) -> nn.Module:
        """Layer ``index`` of the stack: always a dense post-LN layer here."""
        del index
        c = self.config
        return post_ln_dense_layer(hidden=c.hidden, heads=c.heads, ffn=c.ffn, dropout=c.dropout,
                                   attention_dropout=c.attention_dropout, causal=True)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """Loss for tokens ``x`` ``[B, S]`` int64 and next tokens ``y`` ``[B, S]`` int64."""
        seq = x.shape[1]
        if seq > self.config.seq:
            raise ValueError(f"sequence length {seq} exceeds config seq {self.config.seq}")
        h = self.embed(x) * math.sqrt(self.config.hidden) + self.positions[:seq]
        h = self.drop(h)
        for layer in self.layers:
            h = layer(h)
        return sum_cross_entropy(self.head(h), y)


def example_inputs(config: BertConfig, batch: int) -> tuple[Tensor, Tensor]:
    """Deterministic ``(x, y)`` token batches of length ``config.seq``; ``y`` is ``x`` shifted."""
    return lm_tokens(config.vocab, batch, config.seq)

