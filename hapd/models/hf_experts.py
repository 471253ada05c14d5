"""A dense experts implementation for transformers' mixture-of-experts layers, which
``torch.export`` turns into static-shape ATen ops that hapd can split by expert.

Not needed for transformers' default experts (``grouped_mm``): :func:`hapd.export`
traces those as one ``hapd.routed_experts`` op with the routed FLOPs, which a plan
splits by tokens or by experts (:mod:`hapd.ir.experts`). This implementation, at
``E / k`` times the expert FLOPs, stays for experiments that want the experts as
einsums.

transformers 5.23 stores the experts of Mixtral, Qwen2-MoE and their relatives as 3-D
weights (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and lets the config pick
the function that runs them (``config._experts_implementation``, registered in
``transformers.integrations.moe.ExpertsInterface``). None of the built-in ones suits a
static SPMD plan: ``"eager"`` loops over the experts that received tokens (``nonzero``:
a data-dependent shape, which ``torch.export`` rejects); ``"grouped_mm"`` (the default)
sorts the tokens by expert and calls a Python custom op (``transformers
.grouped_mm_fallback``) with data-dependent group offsets; ``"batched_mm"`` copies each
token's expert weights (``gate_up_proj[expert_ids]``, ``[T·k, 2I, H]``), so splitting the
experts saves memory but no compute.

:func:`dense_experts_forward` (registered as :data:`NAME` by :func:`register`) runs
every expert on every token and weights the results by the router's dense weights
(zero for the experts a token was not routed to)::

    routing[t, e] = Σ_k top_k_weights[t, k] · [top_k_index[t, k] = e]
    h[e, t]       = act(x[t] · gate[e]ᵀ) * (x[t] · up[e]ᵀ)
    y[t]          = Σ_e routing[t, e] · (h[e, t] · down[e]ᵀ)

This is the same function as the model's own (every token-expert pair the router picked
contributes its weighted output; the others are multiplied by zero, and their gradients
are zero too), at ``E / k`` times the expert FLOPs, with no token dropped. The expert
products are einsums over the expert letter ``e``, so a plan can split the experts
across ranks (expert parallelism: each rank holds and runs its experts, the tokens are
gathered to every rank and the partial outputs summed back into the token split) or
split the tokens with the weights replicated (data parallelism), whichever costs less.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from hapd.errors import ExportError

NAME = "hapd_dense"
"""The name :func:`register` gives the implementation (``config._experts_implementation``)."""


def _check_supported(experts: Any) -> None:
    """The layout :func:`dense_experts_forward` implements: concatenated ``[gate; up]``
    weights stored ``[E, out, in]``, no biases, no norm after each expert."""
    flags = {
        "has_gate": (getattr(experts, "has_gate", True), True),
        "has_bias": (getattr(experts, "has_bias", False), False),
        "is_transposed": (getattr(experts, "is_transposed", False), False),
        "is_concatenated": (getattr(experts, "is_concatenated", True), True),
        "has_post_expert_norm": (getattr(experts, "has_post_expert_norm", False), False),
        "_is_expert_parallel": (getattr(experts, "_is_expert_parallel", False), False),
    }
    wrong = {name: got for name, (got, want) in flags.items() if bool(got) != want}
    if wrong:
        raise ExportError(f"{type(experts).__name__}: the {NAME!r} experts implementation supports only "
                          f"gated, concatenated, untransposed experts without bias or post-norm; this one has {wrong}")


def dense_experts_forward(experts: Any, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """transformers' experts forward (``hidden_states [T, H]``, ``top_k_index [T, k]``,
    ``top_k_weights [T, k]`` → ``[T, H]``), every expert on every token, weighted densely."""
    _check_supported(experts)
    n_experts = experts.gate_up_proj.shape[0]
    dtype = experts.gate_up_proj.dtype
    chosen = F.one_hot(top_k_index, n_experts).to(top_k_weights.dtype)  # [T, k, E]
    routing = torch.einsum("tk,tke->te", top_k_weights, chosen).to(dtype)  # [T, E]
    gate_up = torch.einsum("th,eih->eti", hidden_states.to(dtype), experts.gate_up_proj)  # [E, T, 2I]
    h = experts._apply_gate(gate_up)  # noqa: SLF001 - transformers' own gating of [gate; up]: [E, T, I]
    out = torch.einsum("eti,ehi->eth", h, experts.down_proj)  # [E, T, H]
    return torch.einsum("eth,te->th", out, routing).to(hidden_states.dtype)


def register() -> str:
    """Register :func:`dense_experts_forward` with transformers under :data:`NAME` (for
    every model, as transformers' own implementations are) and return the name to set
    as ``config._experts_implementation``."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(NAME, dense_experts_forward)
    return NAME


__all__ = ["NAME", "dense_experts_forward", "register"]
