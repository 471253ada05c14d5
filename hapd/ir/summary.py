"""What ``hapd inspect`` prints: a graph IR summary computed by the core."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hapd import _core
from hapd.ir.lower import GraphIR, lower


def inspect_graph(source: GraphIR | bytes | str | Path) -> dict[str, Any]:
    """Validate a graph with the core and return its summary (ops by count,
    parameters, buffers, inputs, opaque ops, forward FLOPs of all ops and of the
    opaque ones as the cost model prices them, graph id)."""
    ir = _as_ir(source)
    summary = _core.load_graph(ir.data)
    summary["graph_id"] = ir.graph_id
    return summary


def _as_ir(source: GraphIR | bytes | str | Path) -> GraphIR:
    if isinstance(source, GraphIR):
        return source
    if isinstance(source, bytes):
        return GraphIR(source)
    path = Path(source)
    if path.suffix == ".pt2":
        return lower(path)
    return GraphIR.load(path)


def format_summary(summary: dict[str, Any]) -> str:
    """A readable multi-line rendering of :func:`inspect_graph`'s result."""
    lines = [
        f"graph {summary['name']}  id {summary['graph_id'][:16]}  {summary['nodes']} nodes",
        "inputs:",
        *(f"  {name:<24} {list(shape)!s:<20} batch dim {dim}" for name, shape, dim in summary["inputs"]),
        f"parameters: {len(summary['parameters'])} tensors, {summary['parameter_elements']:,} elements",
        *(
            f"  {name:<40} {list(shape)!s:<16}{'' if trains else ' (frozen)'}"
            for name, shape, trains in summary["parameters"]
        ),
    ]
    if summary["buffers"]:
        lines.append(f"buffers: {len(summary['buffers'])}")
        lines += [f"  {name:<40} {list(shape)}" for name, shape in summary["buffers"]]
    lines.append(_flops_line(summary))
    lines.append("ops:")
    lines += [f"  {count:>5}  {op}" for op, count in sorted(summary["ops"], key=lambda oc: (-oc[1], oc[0]))]
    opaque = summary["opaque_ops"]
    if opaque:
        lines.append("opaque ops (no sharding rules; they run replicated):")
        lines += [f"  {count:>5}  {op}" for op, count in opaque]
    else:
        lines.append("opaque ops: none")
    routed = dict(summary["ops"]).get("hapd.routed_experts", 0)
    if routed:
        lines.append(f"transformers' grouped_mm experts: {routed} layers traced as hapd.routed_experts, the same values "
                     "(hapd.ir.experts), priced at the routed FLOPs assuming balanced routing")
    experts = summary.get("expert_parallel", [])
    if experts:
        lines.append(f"expert parallelism possible on {len(experts)} ops (stacked expert weights): {', '.join(experts)}")
    return "\n".join(lines)


def _flops_line(summary: dict[str, Any]) -> str:
    """Forward FLOPs of the graph and the part opaque ops account for, as the cost
    model prices them."""
    total, opaque = summary["flops"], summary["opaque_flops"]
    share = opaque / total if total > 0 else 0.0
    return f"forward FLOPs: {_fmt_flops(total)} (opaque ops: {_fmt_flops(opaque)}, {share:.1%})"


def _fmt_flops(flops: float) -> str:
    """``1.23 GFLOP``-style rendering of a FLOP count."""
    for scale, unit in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}FLOP"
    return f"{flops:.0f} FLOP"
