"""Which results the backward pass keeps: the activations a training step holds.

Lowering records them in the graph IR (``saved`` and ``saved_bytes`` on nodes,
``saved_traced`` on the graph, ``docs/formats.md``) so that the core's memory model
counts an op result as an activation only when autograd really keeps it: a linear keeps
its input, a relu its result, an add nothing, and a view keeps the storage of the
result it views.

The program's graph runs once on **meta** tensors (nothing is allocated or computed,
so paper-size models trace in a moment) with the trainable parameters requiring
gradients, inside :func:`torch.autograd.graph.saved_tensors_hooks`. Every tensor autograd
saves is attributed by its storage to the first node whose result owns that storage
(a view shares its base's storage, so the base is what is kept); a saved storage no
node's result owns (attention's log-sum-exp, a softmax inside a composite op) is
counted in bytes on the node that was running when it was saved.

An attention is traced as the fused kernel torch runs it with on a GPU and on a CPU
(``_scaled_dot_product_efficient_attention``: it keeps its inputs, its result and the
log-sum-exp), not as the math attention ``scaled_dot_product_attention`` picks on meta
tensors, which keeps the probabilities (4 bytes a score: GPT-2 at batch 8 × 1024 would
be priced 4.8 GB more than it keeps). What the runtime's math attention keeps when
hapd's generator draws its dropout (:func:`_attention_dropout_bytes`) is recorded apart
(``counter``): it is kept where hapd's generator draws, every plan's default, one
device's too (``hapd.spmd.random.random_ops.choose_rng``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._pytree import tree_map

from hapd.ir.op_facts import ATTENTION, attention_args

_log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class SavedActivations:
    """What the backward pass of one program keeps, by fx node name."""

    outputs: dict[str, frozenset[int]] = field(default_factory=dict)
    """Node name → indices of its results whose storage the backward pass keeps."""
    internal: dict[str, float] = field(default_factory=dict)
    """Node name → bytes its backward keeps that are no node's result."""
    counter: dict[str, float] = field(default_factory=dict)
    """Node name → bytes its backward keeps beyond those when hapd's counter-based
    generator draws its dropout (an attention run as the math attention)."""


def saved_activations(program: ExportedProgram) -> SavedActivations | None:
    """The results (and inner tensors) autograd saves for backward when ``program``'s
    graph runs with its trainable parameters requiring gradients; ``None`` when the
    graph cannot run on meta tensors (an op without a meta kernel), and the core then
    counts every result that carries a gradient, as it did before tracing existed."""
    try:
        return _trace(program)
    except Exception as exc:  # an op without a meta kernel: nothing can be said
        _log.debug("saved activations not traced: %s: %s", type(exc).__name__, exc)
        return None


def _trace(program: ExportedProgram) -> SavedActivations:
    module = program.graph_module
    trainable = {
        spec.arg.name
        for spec in program.graph_signature.input_specs
        if spec.kind == InputKind.PARAMETER and _trains(program, spec.target)
    }
    args = [_meta_placeholder(node, node.name in trainable) for node in module.graph.nodes if node.op == "placeholder"]
    tracer = _Tracer(module)
    with torch.autograd.graph.saved_tensors_hooks(tracer.pack, _unpack):
        tracer.run(*args)
    return tracer.result()


def _trains(program: ExportedProgram, target: str | None) -> bool:
    param = program.state_dict.get(target) if target is not None else None
    return bool(param is not None and param.requires_grad)


def _meta_placeholder(node: fx.Node, requires_grad: bool) -> Any:
    """A meta tensor shaped like the placeholder's value (its scalar value otherwise)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return val
    t = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="meta")
    return t.requires_grad_(requires_grad and t.dtype.is_floating_point)


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _on_meta(value: Any) -> Any:
    """The meta device in place of any device an op is given."""
    return torch.device("meta") if isinstance(value, torch.device) else value


def _fused_attention(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The attention's result from ``_scaled_dot_product_efficient_attention`` (what
    autograd then saves is the fused kernel's), or None where that kernel does not take
    the call (not four dims, a meta kernel that refuses it): the caller traces the op
    itself then."""
    named = attention_args(args, kwargs)
    query, key, value, mask = named["query"], named["key"], named["value"], named["attn_mask"]
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)):
        return None
    if named["enable_gqa"] and key.shape[-3] != query.shape[-3]:
        # the kernels without grouped heads run on repeated keys and values, and keep them
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], -3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], -3)
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
        # torch turns a bool mask into an additive one for the fused kernels
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    try:
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, mask, True, 0.0, bool(named["is_causal"]), scale=named["scale"])
    except Exception as exc:  # noqa: BLE001 - a shape the fused kernel refuses: trace the op itself
        _log.debug("attention traced as torch's own op: %s: %s", type(exc).__name__, exc)
        return None
    return out[0]


def _attention_dropout_bytes(node: fx.Node, args: tuple, kwargs: dict) -> float:
    """For an attention with ``dropout_p > 0``: the bytes the runtime's math attention
    keeps beyond the fused kernel's when hapd's generator draws the dropout
    (``CounterAttention`` in ``hapd/spmd/random/random_ops.py``: the probabilities and the
    dropped probabilities in the query's dtype, the keep mask a byte each, per score); 0
    for any other node."""
    if node.target is not ATTENTION:
        return 0.0
    named = attention_args(args, kwargs)
    if not named["dropout_p"] or float(named["dropout_p"]) <= 0.0:
        return 0.0
    query, key = named["query"], named["key"]
    scores = query.numel() // max(query.shape[-1], 1) * key.shape[-2]
    return float(scores * (2 * query.element_size() + 1))


class _Tracer(fx.Interpreter):
    """Runs the graph node by node, remembering which node's result owns each storage
    and which storages autograd saves while each node runs."""

    def __init__(self, module: fx.GraphModule):
        super().__init__(module)
        self._owner: dict[StorageWeakRef, tuple[str, int]] = {}
        self._saved: dict[StorageWeakRef, tuple[str, int]] = {}  # storage → (running node, bytes)
        self._running = ""
        self._keep: list[torch.Tensor] = []  # keeps storages alive, so weak refs stay unique
        self._counter: dict[str, float] = {}  # node → bytes kept beyond when hapd's generator draws

    def run_node(self, n: fx.Node) -> Any:
        self._running = n.name
        if n.op == "call_function":
            # ops that name a device (arange, _to_copy) make meta tensors too
            args, kwargs = tree_map(_on_meta, self.fetch_args_kwargs_from_env(n))
            dropped = _attention_dropout_bytes(n, args, kwargs)
            if dropped:
                self._counter[n.name] = dropped
            out = _fused_attention(args, kwargs) if n.target is ATTENTION else None
            if out is None:
                out = self.call_function(n.target, args, kwargs)
        else:
            out = super().run_node(n)
        results = out if isinstance(out, (tuple, list)) else (out,)
        for i, value in enumerate(results):
            if isinstance(value, torch.Tensor):
                self._owner.setdefault(StorageWeakRef(value.untyped_storage()), (n.name, i))
                self._keep.append(value)
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self._saved.setdefault(StorageWeakRef(storage), (self._running, int(storage.nbytes())))
        self._keep.append(t)
        return t

    def result(self) -> SavedActivations:
        outputs: dict[str, set[int]] = {}
        internal: dict[str, float] = {}
        for key, (running, nbytes) in self._saved.items():
            owner = self._owner.get(key)
            if owner is not None:
                outputs.setdefault(owner[0], set()).add(owner[1])
            else:
                internal[running] = internal.get(running, 0.0) + float(nbytes)
        return SavedActivations(outputs={k: frozenset(v) for k, v in outputs.items()}, internal=internal,
                                counter=dict(self._counter))
