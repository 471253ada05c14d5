"""The blocks activation recomputation can work on, read from a lowered graph.

Lowering labels every op with the repeated block of the model it runs in (the IR's
``block``: ``layers.3``, from the exported program's module stack, see
:func:`hapd.ir.lower.module_block`). A compile may have the backward pass
recompute some of them (``CompileOptions.recompute``): their activations are not kept
but rebuilt from the block's input, one block at a time (the core prices it:
``rustcore/core/src/recompute.rs``; the runtime runs each under
``torch.utils.checkpoint``: :mod:`hapd.spmd.checkpointed`). This module lists the
blocks a graph has, the ones that would save the most memory first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "none": 0,
}
"""Bytes per element by IR dtype name (others: 8, as the core counts them)."""


@dataclass(frozen=True, kw_only=True)
class Block:
    """One repeated block of a lowered graph."""

    label: str
    """The IR's ``block`` label (``layers.3``)."""
    first: int
    """Index of its first op in the graph (program order)."""
    kept_bytes: float
    """Bytes its ops' backward keeps (the traced ``saved`` results and ``saved_bytes``):
    about what recomputing it frees, less its input."""


def graph_blocks(doc: Mapping[str, Any]) -> list[Block]:
    """The blocks of the lowered graph ``doc`` with an op that leads to the loss or a
    buffer update (the core rejects recomputing any other), the one whose backward keeps
    the most bytes first, ties in program order."""
    nodes = doc["nodes"]
    needed = _needed(nodes, [doc["loss"], *(m["value"] for m in doc.get("mutations", []))])
    blocks: dict[str, Block] = {}
    for i, node in enumerate(nodes):
        label = node.get("block")
        if not label or node.get("kind") != "op" or not needed[i]:
            continue
        kept = float(node.get("saved_bytes") or 0.0)
        kept += sum(_bytes(node["outputs"][k]) for k in node.get("saved", []) if 0 <= k < len(node["outputs"]))
        seen = blocks.get(label)
        blocks[label] = Block(label=label, first=seen.first if seen else i, kept_bytes=kept + (seen.kept_bytes if seen else 0.0))
    return sorted(blocks.values(), key=lambda b: (-b.kept_bytes, b.first))


OPTIMIZER_COPIES = 3.0
"""A trainable parameter and Adam's two moments (``rustcore/core/src/memory.rs``:
``OPTIMIZER_STATES``), each held at least once among the devices."""


def memory_floor(doc: Mapping[str, Any], duplicas: int = 1) -> float:
    """The fewest bytes any program of the lowered graph ``doc`` holds, summed over all
    its devices, while its backward pass runs without recomputation: what the core's
    memory model counts at that moment, each tensor once (a shard's pieces sum to the
    tensor; a replica counts once per device, more): every trainable parameter with
    Adam's two moments, every frozen parameter, the batch inputs, and every op result
    the backward keeps (the traced ``saved`` results; views are never flagged, their
    base is) with the bytes ops keep inside them (``saved_bytes``). Devices whose
    memory sums to less hold no program of the graph, at any memory price or ZeRO
    split. With ``duplicas`` (overlap: two duplicas of the graph's batch each), the
    inputs and kept activations count once per duplica (both run their forward before
    either runs its backward, :func:`hapd.compiler.overlap.with_duplica_memory`). 0 for
    a graph lowered without traced saved tensors (the core then counts more, not less)."""
    if not doc.get("saved_traced"):
        return 0.0
    held, per_duplica = 0.0, 0.0
    for node in doc["nodes"]:
        kind, outputs = node.get("kind"), node.get("outputs") or []
        if kind == "parameter":
            held += sum(_bytes(o) for o in outputs) * (OPTIMIZER_COPIES if node.get("requires_grad") else 1.0)
        elif kind == "input":
            per_duplica += sum(_bytes(o) for o in outputs)
        elif kind == "op":
            per_duplica += float(node.get("saved_bytes") or 0.0)
            per_duplica += sum(_bytes(outputs[k]) for k in node.get("saved", []) if 0 <= k < len(outputs))
    return held + duplicas * per_duplica


def _needed(nodes: Sequence[Mapping[str, Any]], effects: Sequence[Sequence[int]]) -> list[bool]:
    """Per node, whether an effect (the loss, a buffer's new value) depends on it."""
    needed = [False] * len(nodes)
    for ref in effects:
        needed[int(ref[0])] = True
    for i in range(len(nodes) - 1, -1, -1):
        if needed[i]:
            for ref in nodes[i].get("inputs", []):
                needed[int(ref[0])] = True
    return needed


def _bytes(meta: Mapping[str, Any]) -> float:
    elements = 1
    for d in meta["shape"]:
        elements *= int(d)
    return float(elements * _DTYPE_BYTES.get(meta["dtype"], 8))
