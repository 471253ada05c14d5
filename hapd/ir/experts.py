"""transformers' routed experts as one op, ``hapd.routed_experts``, that a plan can split
by tokens or by experts.

transformers runs the experts of Mixtral, Qwen2-MoE and their relatives through the
function its config names (``config._experts_implementation``, registered in
``transformers.integrations.moe.ExpertsInterface``); the default, ``"grouped_mm"``
(``grouped_mm_experts_forward``), sorts the ``S = T·k`` (token, expert) pairs by expert
(``aten.sort``), gathers each pair's token (``hidden[perm // k]``: ``floor_divide`` and
``index``), counts tokens per expert (``histc``), runs two grouped matrix products with
data-dependent group offsets (``transformers.grouped_mm_fallback``, a Python custom op,
or ``torch._grouped_mm``), weights the rows, restores the pair order (``inv_perm[perm] =
arange``: ``index_put``) and sums each token's ``k`` rows. Exported as shipped, those ops
have no sharding rule: a plan runs them replicated (62% of a tiny Mixtral's FLOPs).

**Why one op, not rules per op.** The region from the sort to the final sum is
*token-local*: each token's output row is the sum of its ``k`` experts' weighted rows,
so running the region on a subset of the tokens gives exactly those tokens' rows; and it
is *expert-additive*: running it with only some experts (the others' pairs contributing
zero) gives a partial sum whose sum over a partition of the experts is the whole. Neither
fact is visible op by op — a sort of the local tokens is not a piece of the global sort,
and group offsets are not a layout — so the core sees the region as one op with the
rules that follow from those two facts (``rustcore/core/src/rules/experts.rs``):

- ``data-parallel``: tokens (and their router outputs) split, expert weights replicated;
- ``expert-parallel``: the expert weights split on their expert dim (uneven by the
  plan's ratios), tokens and router outputs replicated; each rank runs the pairs routed
  to its experts (the others sort to the tail as a sentinel, as transformers' own expert
  parallelism does, and cost no product) and the ranks' outputs are partial sums;
  The tokens reach the experts' ranks by the all-gather their layout change implies
  and the partial sums come back by a reduce-scatter (or all-reduce): about ``2·T·H``
  elements through each rank, against ``2·T·k·H·(n−1)/n`` for an all-to-all of the
  routed pairs — the same order for top-2 routing, with no capacity to size (an
  all-to-all's buffers are sized by the routing, which varies by step and would need a
  capacity factor or a data-dependent shape); the cost model prices these collectives
  like any other layout change;
- no tensor parallelism inside the experts: ``gate_up_proj [E, 2I, H]`` holds ``[gate;
  up]`` concatenated on dim 1, so a contiguous slice of dim 1 (the only split a layout
  describes) is not a slice of ``I``.

**How the op gets there.** :func:`captured` (which :func:`hapd.export` enters around
``torch.export``) registers, for the duration of the export, :func:`_captured_forward`
as transformers' ``"grouped_mm"`` experts function: an experts module of the supported
layout (gated, concatenated ``[gate; up]``, untransposed, no bias, no post-expert norm,
transformers' default gating of an activation from ``ACT2FN``) is traced as one call of
``hapd.routed_experts``; any other keeps transformers' function (exact, replicated) and
the reason is logged. The op's kernel, on the whole set of experts, *is* transformers'
``grouped_mm_experts_forward`` (called on the same weights), so the exported program
computes what the model computes, bit for bit; its backward recomputes that forward
under autograd and differentiates it (the region's activations are not kept between
forward and backward: the backward costs one more forward of the experts, which the
cost model, pricing a backward at twice the forward, does not count).

**Cost.** The op's FLOPs are the routed ones, ``2·T·k·(2I·H + I·H)`` plus the gating and
weighting, assuming the router spreads the pairs evenly over the experts: under
``expert-parallel`` a rank's work is its share of the experts. Routing varies by step;
a skewed step makes the rank holding the popular experts slower than priced, never
wrong: no pair is dropped and every rank computes every pair routed to its experts.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

_log = logging.getLogger(__name__)

OP = "hapd.routed_experts"
"""The op's name in the graph IR."""
IMPLEMENTATION = "grouped_mm"
"""The transformers experts implementation :func:`captured` traces as :data:`OP`."""


# --------------------------------------------------------------------------------------
# The op
# --------------------------------------------------------------------------------------


def _activation(name: str) -> Any:
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class _Experts:
    """What transformers' ``grouped_mm_experts_forward`` reads of an experts module."""

    has_gate = True
    has_bias = False
    is_transposed = False
    has_post_expert_norm = False
    _is_expert_parallel = False

    def __init__(self, gate_up_proj: Tensor, down_proj: Tensor, activation: str):
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.num_experts = gate_up_proj.shape[0]
        self.act_fn = _activation(activation)

    def _apply_gate(self, gate_up_out: Tensor) -> Tensor:
        from transformers.integrations.moe import _default_apply_gate

        return _default_apply_gate(self, gate_up_out)


def _local_experts_forward(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor,
                           down_proj: Tensor, activation: str, first_expert: int) -> Tensor:
    """The experts' output over the pairs routed to experts ``[first_expert, first_expert
    + E_local)`` (``E_local = gate_up_proj.shape[0]``): transformers' grouped forward
    with the other pairs sorted to the tail as a sentinel and contributing zero rows."""
    from transformers.integrations.moe import _grouped_linear

    local = gate_up_proj.shape[0]
    num_top_k, num_tokens, hidden_dim = top_k_index.shape[-1], hidden.shape[0], hidden.shape[-1]
    expert_ids = top_k_index.reshape(-1) - first_expert
    inside = (expert_ids >= 0) & (expert_ids < local)
    expert_ids = torch.where(inside, expert_ids, torch.full_like(expert_ids, local))
    expert_ids_g, perm = torch.sort(expert_ids)
    kept = (expert_ids_g < local).unsqueeze(-1)
    selected = hidden[perm // num_top_k]
    weights_g = top_k_weights.reshape(-1)[perm]
    if local == 0:
        out = selected.new_zeros(selected.shape[0], hidden_dim) * weights_g.unsqueeze(-1)
    else:
        offsets = torch.cumsum(torch.bincount(expert_ids_g, minlength=local + 1)[:local], dim=0, dtype=torch.int32)
        selected = selected.masked_fill(~kept, 0.0)
        proj = _grouped_linear(selected, gate_up_proj, offsets).masked_fill(~kept, 0.0)
        gate, up = proj.chunk(2, dim=-1)
        proj = _activation(activation)(gate) * up
        proj = _grouped_linear(proj, down_proj, offsets).masked_fill(~kept, 0.0)
        out = proj * weights_g.unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    return out[inv_perm].view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden.dtype)


def experts_forward(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor,
                    down_proj: Tensor, activation: str, first_expert: int, num_experts: int) -> Tensor:
    """The op's function (differentiable when its inputs are): on all ``num_experts``
    experts, transformers' own ``grouped_mm_experts_forward``; on a range of them, the
    partial sum of :func:`_local_experts_forward`."""
    if first_expert == 0 and gate_up_proj.shape[0] == num_experts:
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(_Experts(gate_up_proj, down_proj, activation), hidden, top_k_index,
                                          top_k_weights)
    return _local_experts_forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation,
                                  first_expert)


@torch.library.custom_op("hapd::routed_experts", mutates_args=())
def routed_experts(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor,
                   down_proj: Tensor, activation: str, first_expert: int, num_experts: int) -> Tensor:
    """transformers' routed experts (``hidden [T, H]``, ``top_k_index [T, k]``,
    ``top_k_weights [T, k]``, ``gate_up_proj [E_local, 2I, H]``, ``down_proj [E_local,
    H, I]`` → ``[T, H]``) on experts ``[first_expert, first_expert + E_local)`` of
    ``num_experts``: the whole output when they are all of them, else a partial sum."""
    with torch.no_grad():
        return experts_forward(hidden, top_k_index, top_k_weights, gate_up_proj, down_proj, activation,
                               first_expert, num_experts)


@routed_experts.register_fake
def _fake(hidden: Tensor, top_k_index: Tensor, top_k_weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
          activation: str, first_expert: int, num_experts: int) -> Tensor:
    torch._check(hidden.dim() == 2 and top_k_index.dim() == 2 and gate_up_proj.dim() == 3 and down_proj.dim() == 3)
    return hidden.new_empty(hidden.shape)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.activation, ctx.first_expert, ctx.num_experts = inputs[5:8]


def _backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
    """The forward recomputed under autograd and differentiated."""
    saved = ctx.saved_tensors
    wanted = [i for i in (0, 2, 3, 4) if ctx.needs_input_grad[i]]
    grads: list[Tensor | None] = [None] * 8
    if not wanted:
        return tuple(grads)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(i in wanted) for i, t in enumerate(saved)]
        out = experts_forward(*leaves, ctx.activation, ctx.first_expert, ctx.num_experts)
        got = torch.autograd.grad(out, [leaves[i] for i in wanted], grad, allow_unused=True)
    for i, g in zip(wanted, got):
        grads[i] = g if g is not None else torch.zeros_like(saved[i])
    return tuple(grads)


routed_experts.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------
# Capture at export
# --------------------------------------------------------------------------------------


def unsupported(experts: Any) -> str | None:
    """Why an experts module cannot run as :data:`OP` (None when it can)."""
    flags = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True,
             "has_post_expert_norm": False, "_is_expert_parallel": False}
    wrong = {f: getattr(experts, f, None) for f, want in flags.items() if getattr(experts, f, None) is not want}
    if wrong:
        return f"its layout flags {wrong} (supported: {flags})"
    from transformers.integrations.moe import _default_apply_gate

    if getattr(type(experts), "_apply_gate", None) is not _default_apply_gate:
        return "it gates with its own _apply_gate"
    act = getattr(getattr(experts, "config", None), "hidden_act", None)
    if not isinstance(act, str):
        return "its config names no hidden_act"
    try:
        same = type(_activation(act)) is type(experts.act_fn)
    except (KeyError, AttributeError):
        same = False
    if not same:
        return f"its act_fn is not ACT2FN[{act!r}]"
    for name, rank in (("gate_up_proj", 3), ("down_proj", 3), ("num_experts", None)):
        if not hasattr(experts, name) or (rank is not None and getattr(experts, name).dim() != rank):
            return f"it has no {name}" + ("" if rank is None else f" of rank {rank}")
    return None


def _captured_forward(original: Any) -> Any:
    def forward(self: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        reason = unsupported(self)
        if reason is not None:
            _log.warning("%s: transformers' %r experts run as its own ops (replicated in a plan): %s",
                         type(self).__name__, IMPLEMENTATION, reason)
            return original(self, hidden_states, top_k_index, top_k_weights)
        return torch.ops.hapd.routed_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                                             self.down_proj, self.config.hidden_act, 0, int(self.num_experts))

    forward.__name__ = forward.__qualname__ = "hapd_routed_experts_forward"
    return forward


@contextlib.contextmanager
def captured() -> Iterator[None]:
    """While entered, transformers' ``"grouped_mm"`` experts of a supported layout run as
    one call of :data:`OP` (the same values: see the module docstring). Without
    transformers, nothing changes."""
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    mapping = moe.ExpertsInterface._global_mapping  # noqa: SLF001 - transformers' registry of experts functions
    original = mapping.get(IMPLEMENTATION)
    if original is None:
        yield
        return
    mapping[IMPLEMENTATION] = _captured_forward(original)
    try:
        yield
    finally:
        mapping[IMPLEMENTATION] = original


__all__ = ["IMPLEMENTATION", "OP", "captured", "experts_forward", "routed_experts", "unsupported"]
