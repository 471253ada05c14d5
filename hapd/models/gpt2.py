"""GPT-2-style pre-LN decoder with learned positions and a tied LM head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import LMConfig, SelfAttention, lm_inputs, sum_cross_entropy


@dataclass(frozen=True, kw_only=True)
class GPT2Config(LMConfig):
    """Sizes of :class:`GPT2` (``seq`` rows of learned positions; ``ffn`` is 4 * hidden in
    GPT-2). ``tiny`` has ~30k parameters, ``small`` ~4.2M (GPT-2's dropout 0.1)."""

    @classmethod
    def paper(cls) -> GPT2Config:
        """GPT-2 small (Radford et al. 2019): 12 x 768, seq 1024 (~124M parameters)."""
        return cls(vocab=50257, seq=1024, hidden=768, heads=12, layers=12, ffn=3072,
                   dropout=0.1, attention_dropout=0.1)

    def param_count(self) -> int:
        """Exact number of parameters of the model this config builds (head is tied)."""
        h, f = self.hidden, self.ffn
        block = 4 * (h * h + h) + h * f + f + f * h + h + 2 * 2 * h
        return (self.vocab + self.seq) * h + self.layers * block + 2 * h


class GPT2Block(nn.Module):
    """``x += Attn(LN(x))``; ``x += MLP(LN(x))`` with a tanh-GELU MLP."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        c = config
        self.norm1 = nn.LayerNorm(c.hidden)
        self.attn = SelfAttention(c.hidden, c.heads, causal=True,
                                  attention_dropout=c.attention_dropout)
        self.drop1 = nn.Dropout(c.dropout)
        self.norm2 = nn.LayerNorm(c.hidden)
        self.mlp = nn.Sequential(nn.Linear(c.hidden, c.ffn), nn.GELU(approximate="tanh"),
                                 nn.Linear(c.ffn, c.hidden))
        self.drop2 = nn.Dropout(c.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """Apply both pre-LN residual sub-layers to ``x`` ``[B, S, hidden]``."""
        x = x + self.drop1(self.attn(self.norm1(x)))
        return x + self.drop2(self.mlp(self.norm2(x)))


class GPT2(nn.Module):
    """Token + position embeddings, pre-LN blocks, final LN, LM head tied to the embedding."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.tokens = nn.Embedding(config.vocab, config.hidden)
        self.positions = nn.Embedding(config.seq, config.hidden)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(GPT2Block(config) for _ in range(config.layers))
        self.norm = nn.LayerNorm(config.hidden)
        self.apply(_init_weights)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """Loss for tokens ``x`` ``[B, S]`` int64 and next tokens ``y`` ``[B, S]`` int64."""
        seq = x.shape[1]
        if seq > self.config.seq:
            raise ValueError(f"sequence length {seq} exceeds config seq {self.config.seq}")
        pos = torch.arange(seq, device=x.device)
        h = self.drop(self.tokens(x) + self.positions(pos))
        for block in self.blocks:
            h = block(h)
        logits = F.linear(self.norm(h), self.tokens.weight)  # tied head
        return sum_cross_entropy(logits, y)


def _init_weights(module: nn.Module) -> None:
    """GPT-2 initialization: N(0, 0.02) weights, zero biases."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


example_inputs = lm_inputs
"""Deterministic ``(x, y)`` token batches of length ``config.seq``; ``y`` is ``x`` shifted."""
