"""BERT causal LM whose odd layers use a GShard-style top-2 mixture of experts.

The gating is written with exportable tensor ops only (softmax, topk,
one_hot, cumsum, comparisons): no data-dependent Python control flow and no
``.item()``.  Expert compute is four einsums over 3-D expert weights, so a
sharder can split the expert dimension ``e`` across devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._common import PostLNEncoderLayer, SelfAttention, check_at_least, check_positive, lm_inputs
from .bert import BertConfig, BertLM


def moe_capacity(seq: int, n_experts: int, capacity_factor: float) -> int:
    """Tokens each expert accepts per sequence: ``ceil(seq / n_experts * capacity_factor)``."""
    return math.ceil(seq / n_experts * capacity_factor)


@dataclass(frozen=True, kw_only=True)
class BertMoEConfig(BertConfig):
    """Sizes of :class:`BertMoE`: a :class:`BertConfig` plus the expert settings."""

    n_experts: int
    """Experts per MoE layer (paper: 2 * world size = 16)."""
    capacity_factor: float = 2.5
    """Slack in each expert's buffer: capacity is ``ceil(seq / n_experts * capacity_factor)``."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_at_least("layers", self.layers, 2)
        check_at_least("n_experts", self.n_experts, 2)
        check_positive(capacity_factor=self.capacity_factor)

    @classmethod
    def tiny(cls) -> BertMoEConfig:
        """2 layers (the second is MoE with 4 experts), width 32 (~58k parameters)."""
        return cls(vocab=128, seq=16, hidden=32, heads=4, layers=2, ffn=128, n_experts=4)

    @classmethod
    def small(cls) -> BertMoEConfig:
        """4 layers (2 MoE with 4 experts), width 256, vocab 4096, seq 64 (~8.4M parameters),
        BERT's dropout 0.1."""
        return cls(vocab=4096, seq=64, hidden=256, heads=4, layers=4, ffn=1024, dropout=0.1, attention_dropout=0.1,
                   n_experts=4)

    @classmethod
    def paper(cls) -> BertMoEConfig:
        """BERT-Base sizes with 16 experts in every other layer (~560M parameters)."""
        return cls(vocab=33280, seq=128, hidden=768, heads=12, layers=12, ffn=3072,
                   dropout=0.1, attention_dropout=0.1, n_experts=16)

    def moe_layers(self) -> int:
        """Number of MoE layers (those with an odd index)."""
        return self.layers // 2

    def capacity(self) -> int:
        """Expert capacity ``C`` at the configured sequence length."""
        return moe_capacity(self.seq, self.n_experts, self.capacity_factor)

    def param_count(self) -> int:
        """Exact number of parameters of the model this config builds."""
        h, f, e = self.hidden, self.ffn, self.n_experts
        dense_ffn = h * f + f + f * h + h
        experts = h * e + 2 * e * h * f
        return super().param_count() + self.moe_layers() * (experts - dense_ffn)


def top2_gating(logits: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
    """GShard top-2 routing of ``logits`` ``[B, S, E]`` into per-sequence expert buffers.

    Returns ``(dispatch, combine)``, each ``[B, S, E, C]``: ``dispatch`` is 1.0
    where token ``s`` sits in slot ``c`` of expert ``e``; ``combine`` holds the
    renormalized gate weight there.  First choices claim slots before second
    choices; tokens past an expert's capacity are dropped for that expert.
    """
    n_experts = logits.shape[-1]
    probs = torch.softmax(logits, dim=-1)
    _, top = torch.topk(probs, k=2, dim=-1)  # [B, S, 2]
    mask1 = F.one_hot(top[..., 0], n_experts)  # [B, S, E] int64
    mask2 = F.one_hot(top[..., 1], n_experts)
    # Slot of each token in its expert's buffer, counted along the sequence.
    loc1 = torch.cumsum(mask1, dim=1) - 1
    loc2 = torch.cumsum(mask2, dim=1) - 1 + mask1.sum(dim=1, keepdim=True)
    keep1 = mask1 * (loc1 < capacity)  # [B, S, E] int64, 0 where over capacity
    keep2 = mask2 * (loc2 < capacity)
    # Slot index per token (0 for dropped tokens, which keep zeroes out below).
    slot1 = F.one_hot((loc1 * keep1).sum(dim=-1), capacity).to(probs.dtype)  # [B, S, C]
    slot2 = F.one_hot((loc2 * keep2).sum(dim=-1), capacity).to(probs.dtype)
    keep1, keep2 = keep1.to(probs.dtype), keep2.to(probs.dtype)
    gate1 = (probs * keep1).sum(dim=-1)  # [B, S]
    gate2 = (probs * keep2).sum(dim=-1)
    denom = (gate1 + gate2).clamp_min(torch.finfo(probs.dtype).eps)
    dispatch1 = keep1.unsqueeze(-1) * slot1.unsqueeze(-2)  # [B, S, E, C]
    dispatch2 = keep2.unsqueeze(-1) * slot2.unsqueeze(-2)
    combine = ((gate1 / denom)[..., None, None] * dispatch1
               + (gate2 / denom)[..., None, None] * dispatch2)
    return dispatch1 + dispatch2, combine


class Top2MoE(nn.Module):
    """Top-2 mixture of ReLU experts: ``w1 [E, hidden, ffn]``, ``w2 [E, ffn, hidden]``."""

    def __init__(self, *, hidden: int, ffn: int, n_experts: int, capacity_factor: float,
                 dropout: float) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.capacity_factor = capacity_factor
        self.gate = nn.Linear(hidden, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, ffn))
        self.w2 = nn.Parameter(torch.empty(n_experts, ffn, hidden))
        self.reset_parameters()
        self.drop = nn.Dropout(dropout)

    def reset_parameters(self) -> None:
        """Initialize the experts' weights: U(±1/sqrt(fan_in)) (the gate is a child)."""
        nn.init.uniform_(self.w1, -1 / math.sqrt(self.w1.shape[1]), 1 / math.sqrt(self.w1.shape[1]))
        nn.init.uniform_(self.w2, -1 / math.sqrt(self.w2.shape[1]), 1 / math.sqrt(self.w2.shape[1]))

    def forward(self, x: Tensor) -> Tensor:
        """Route ``x`` ``[B, S, hidden]`` through the experts and combine their outputs."""
        capacity = moe_capacity(x.shape[1], self.n_experts, self.capacity_factor)
        dispatch, combine = top2_gating(self.gate(x), capacity)
        expert_in = torch.einsum("bsd,bsec->becd", x, dispatch)
        h = self.drop(torch.relu(torch.einsum("edh,becd->bech", self.w1, expert_in)))
        expert_out = torch.einsum("ehd,bech->becd", self.w2, h)
        return torch.einsum("becd,bsec->bsd", expert_out, combine)


class BertMoE(BertLM):
    """:class:`BertLM` whose odd-index layers replace the FFN with :class:`Top2MoE`."""

    config: BertMoEConfig

    def build_layer(self, index: int) -> nn.Module:
        """Dense post-LN layer at even ``index``, MoE post-LN layer at odd ``index``."""
        if index % 2 == 0:
            return super().build_layer(index)
        c = self.config
        return PostLNEncoderLayer(
            SelfAttention(c.hidden, c.heads, causal=True, attention_dropout=c.attention_dropout),
            Top2MoE(hidden=c.hidden, ffn=c.ffn, n_experts=c.n_experts,
                    capacity_factor=c.capacity_factor, dropout=c.dropout),
            hidden=c.hidden, dropout=c.dropout)


example_inputs = lm_inputs
"""Deterministic ``(x, y)`` token batches of length ``config.seq``; ``y`` is ``x`` shifted."""
