"""Activation recomputation at run time: a plan's recompute spans run under
``torch.utils.checkpoint``.

A plan compiled with recomputation (``CompileOptions.recompute``) marks each step of a
recomputed block with its recompute span (``step["recompute_span"]``: a run of consecutive steps of
one block, ``rustcore/core/src/recompute.rs``). The per-rank rewrite emits every step
into one fx graph, noting where each step's nodes begin (:class:`StepMarks`); then
:func:`checkpoint_recompute_spans` moves each span's nodes into a graph module of its own
and calls it as ``torch.utils.checkpoint.checkpoint(body, *inputs,
use_reentrant=False)``. The forward keeps only the span's inputs (the previous
block's output, the parameters it reads); the backward runs the span's forward
again, then its backward. A collective inside a span runs again too, in the same
order on every rank (every rank runs the same program), so the ranks stay matched.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from typing import Any, Callable

from torch import fx, nn
from torch.utils.checkpoint import checkpoint


class Checkpointed(nn.Module):
    """One recompute span: ``body`` (its nodes as a graph module returning the
    values the rest of the program reads) run under non-reentrant activation
    checkpointing."""

    def __init__(self, body: fx.GraphModule, span: int):
        super().__init__()
        self.body = body
        self.span = span

    def forward(self, *inputs: Any) -> Any:
        return checkpoint(self.body, *inputs, use_reentrant=False)

    def extra_repr(self) -> str:
        return f"recompute span {self.span}"


class StepMarks:
    """Where each emitted step's nodes begin in the rank's graph (nodes are appended in
    step order, so a step's nodes run up to where the next one's begin)."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.starts: list[int] = []

    def mark(self) -> None:
        """Call before emitting each step."""
        self.starts.append(len(self.graph.nodes))

    def spans(self) -> list[tuple[int, int]]:
        """(first, end) node positions of every step marked, once all are emitted."""
        ends = [*self.starts[1:], len(self.graph.nodes)]
        return list(zip(self.starts, ends))


def checkpoint_recompute_spans(
    graph: fx.Graph,
    root: nn.Module,
    steps: Sequence[Mapping[str, Any]],
    marks: StepMarks,
    add_module: Callable[[str, nn.Module], str],
) -> int:
    """Run every recompute span of the plan's ``steps`` (emitted into ``graph``,
    ``marks`` says where) under activation checkpointing; ``root`` holds the modules
    the graph calls, ``add_module(prefix, module)`` registers one and returns its
    name. Returns how many spans were checkpointed."""
    nodes = list(graph.nodes)
    ranges = marks.spans()
    members_of: dict[int, list[int]] = {}
    for i, step in enumerate(steps):
        if step.get("recompute_span") is not None:
            members_of.setdefault(int(step["recompute_span"]), []).append(i)
    for span, members in sorted(members_of.items()):
        body = [n for i in members for n in nodes[ranges[i][0] : ranges[i][1]] if n.op not in ("get_attr", "placeholder")]
        if body:
            _checkpoint(graph, root, body, span, add_module)
    return len(members_of)


def _checkpoint(
    graph: fx.Graph, root: nn.Module, body: list[fx.Node], span: int, add_module: Callable[[str, nn.Module], str]
) -> None:
    """Replace ``body`` (nodes of ``graph`` in program order) by one call of a
    :class:`Checkpointed` module that computes them and returns those read after."""
    inside = set(body)
    inputs: list[fx.Node] = []
    for node in body:
        for arg in node.all_input_nodes:
            if arg not in inside and arg not in inputs:
                inputs.append(arg)
    outputs = [node for node in body if any(user not in inside for user in node.users)]

    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for arg in inputs:
        env[arg] = sub.placeholder(f"in_{arg.name}")
    for node in body:
        env[node] = sub.node_copy(node, lambda n: env[n])
    sub.output(tuple(env[n] for n in outputs))
    module = Checkpointed(fx.GraphModule(root, sub, class_name="RecomputeSpan"), span)
    target = add_module("recompute_span", module)

    after = body[-1].next
    with graph.inserting_before(after):
        call = graph.call_module(target, tuple(inputs))
        results = [graph.call_function(operator.getitem, (call, k)) for k in range(len(outputs))]
    for node, result in zip(outputs, results):
        node.replace_all_uses_with(result, delete_user_cb=lambda user: user not in inside)
    for node in reversed(body):
        graph.erase_node(node)
