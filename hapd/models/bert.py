"""BERT-Base-sized *causal* language model, as benchmarked in the HAP paper.

Follows the PyTorch ``word_language_model`` transformer that HAP used: scaled
token embedding, fixed sinusoidal positions, post-LN layers with a ReLU FFN,
causal attention and an untied output projection.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from ._common import LMConfig, lm_inputs, post_ln_dense_layer, post_ln_params, sinusoidal_positions, sum_cross_entropy


@dataclass(frozen=True, kw_only=True)
class BertConfig(LMConfig):
    """Sizes of :class:`BertLM` (paper vocabulary: 33280, WikiText-2's 33278 rounded up to
    a multiple of 8); ``seq`` rows of sinusoidal positions, so ``hidden`` must be even
    (sin/cos pairs). ``tiny`` has ~34k parameters, ``small`` ~5.3M."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.hidden % 2:
            raise ValueError(f"hidden {self.hidden} must be even for sinusoidal positions")

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


example_inputs = lm_inputs
"""Deterministic ``(x, y)`` token batches of length ``config.seq``; ``y`` is ``x`` shifted."""

