"""Llama-style decoder: RMSNorm, rotary positions, causal attention, SwiGLU FFN."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import LMConfig, SelfAttention, check_positive, lm_inputs, sum_cross_entropy


@dataclass(frozen=True, kw_only=True)
class LlamaConfig(LMConfig):
    """Sizes of :class:`Llama` (``seq`` rows of the rotary cos/sin tables; ``heads`` must
    divide ``hidden`` into an even head size; ``ffn``, the SwiGLU's inner width, is about
    8/3 * hidden in Llama, which itself trains without dropout)."""

    rope_theta: float = 10000.0
    """Base of the rotary frequencies."""
    norm_eps: float = 1e-6
    """Epsilon inside RMSNorm."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive(rope_theta=self.rope_theta, norm_eps=self.norm_eps)
        head_dim = self.hidden // self.heads
        if head_dim % 2:
            raise ValueError(f"head size {head_dim} (hidden {self.hidden} / heads {self.heads}) "
                             "must be even for rotary embeddings")

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """2 blocks, width 32, vocab 128, seq 16 (~33k parameters)."""
        return cls(vocab=128, seq=16, hidden=32, heads=4, layers=2, ffn=88)

    @classmethod
    def small(cls) -> LlamaConfig:
        """4 blocks, width 256, vocab 4096, seq 64 (~5.3M parameters)."""
        return cls(vocab=4096, seq=64, hidden=256, heads=4, layers=4, ffn=704)

    @classmethod
    def paper(cls) -> LlamaConfig:
        """LLaMA-7B sizes (Touvron et al. 2023): 32 x 4096, seq 2048 (~6.7B parameters)."""
        return cls(vocab=32000, seq=2048, hidden=4096, heads=32, layers=32, ffn=11008,
                   dropout=0.1, attention_dropout=0.1)

    def param_count(self) -> int:
        """Exact number of parameters of the model this config builds."""
        h = self.hidden
        block = 4 * h * h + 3 * h * self.ffn + 2 * h
        return 2 * self.vocab * h + self.layers * block + h


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dimension."""

    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))

    def reset_parameters(self) -> None:
        """The scale starts at one."""
        nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        """Normalize ``x`` by its root mean square and scale."""
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)`` without biases."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Gated feed-forward on ``x`` ``[B, S, hidden]``."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def rotary_tables(seq: int, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """``(cos, sin)``, each ``[seq, head_dim]``, in the rotate-half layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


class LlamaBlock(nn.Module):
    """``x += Attn(RMSNorm(x))`` with rotary q/k; ``x += SwiGLU(RMSNorm(x))``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        c = config
        self.attn_norm = RMSNorm(c.hidden, c.norm_eps)
        self.attn = SelfAttention(c.hidden, c.heads, causal=True,
                                  attention_dropout=c.attention_dropout, bias=False)
        self.drop1 = nn.Dropout(c.dropout)
        self.ffn_norm = RMSNorm(c.hidden, c.norm_eps)
        self.ffn = SwiGLU(c.hidden, c.ffn)
        self.drop2 = nn.Dropout(c.dropout)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Apply both residual sub-layers; ``cos``/``sin`` are ``[S, head_dim]``."""
        x = x + self.drop1(self.attn(self.attn_norm(x), rotary=(cos, sin)))
        return x + self.drop2(self.ffn(self.ffn_norm(x)))


class Llama(nn.Module):
    """Embedding, Llama blocks, final RMSNorm and an untied LM head."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        cos, sin = rotary_tables(config.seq, config.hidden // config.heads, config.rope_theta)
        self.register_buffer("rope_cos", cos)
        self.register_buffer("rope_sin", sin)
        self.blocks = nn.ModuleList(LlamaBlock(config) for _ in range(config.layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.head = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        """Loss for tokens ``x`` ``[B, S]`` int64 and next tokens ``y`` ``[B, S]`` int64."""
        seq = x.shape[1]
        if seq > self.config.seq:
            raise ValueError(f"sequence length {seq} exceeds config seq {self.config.seq}")
        cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, cos, sin)
        return sum_cross_entropy(self.head(self.norm(h)), y)


example_inputs = lm_inputs
"""Deterministic ``(x, y)`` token batches of length ``config.seq``; ``y`` is ``x`` shifted."""
