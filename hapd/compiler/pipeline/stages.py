"""Cutting a program into pipeline stages.

A pipeline plan runs the model's program as stages, each on its own group of devices
with its own SPMD plan; what crosses a cut moves point-to-point. :func:`split_program`
cuts an exported (training) program after given nodes into one exported program per
stage, each an ordinary hapd program that the existing compile and rewrite handle:

* **What a stage computes.** The ops that depend on a trainable parameter ("heavy"
  ops) are assigned to stages by position: stage ``s`` runs those after cut ``s-1``
  and up to cut ``s`` (node names of the normalized program, the IR's node names).
  Ops that depend on no trainable parameter (masks, positions, label shifts: computed
  from the inputs, buffers and constants alone) run in every stage that reads them —
  each stage reads the user inputs it needs from the batch, so nothing of that kind
  crosses a cut.
* **What crosses a cut.** A heavy op's result read by a later stage is a *boundary*:
  an input of every stage that reads it, sent by the stage that computes it.
* **The loss of a stage that is not the last.** Stage ``s`` returns
  ``Σ_i sum(b_i · g_i)`` over its boundaries ``b_i``, where ``g_i`` is an extra input:
  the gradient of the whole loss with respect to ``b_i``, which the later stages
  compute. Its gradient with respect to every parameter of the stage is then exactly
  the whole loss's, so the stage trains like any hapd program (and the forward part,
  which does not read ``g``, runs before ``g`` is known: :mod:`hapd.spmd.pipeline`).
  The last stage returns the model's loss.

Boundaries must be floating-point tensors (they carry a gradient); a program that
updates buffers (batch norm's running statistics) is refused — both with an
:class:`~hapd.errors.PlanError` naming the node.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from hapd.ir.normalize import normalize
from hapd.errors import PlanError

GRAD_PREFIX = "grad_of_"
"""Names of the gradient inputs of a stage that is not the last: ``grad_of_<boundary>``."""


@dataclass(frozen=True)
class Boundary:
    """A tensor that crosses cuts: computed by stage ``producer``, read by ``consumers``."""

    name: str
    producer: int
    consumers: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Stage:
    """One stage's program and how it connects to the others."""

    index: int
    program: ExportedProgram
    user_inputs: list[int]
    """Indices (into the whole program's user inputs) of the inputs this stage reads, in
    its forward order (they come first)."""
    received: list[str]
    """Boundaries this stage reads, in its forward order (after the user inputs)."""
    sent: list[str]
    """Boundaries this stage computes for later stages, in order; a stage that is not
    the last takes their gradients (``grad_of_<name>``) as its last inputs."""
    parameters: list[str] = field(default_factory=list)
    """Targets (state-dict names) of the parameters the stage holds."""

    @property
    def last(self) -> bool:
        return not self.sent


def _kinds(program: ExportedProgram) -> dict[str, tuple[InputKind, str | None]]:
    return {spec.arg.name: (spec.kind, spec.target) for spec in program.graph_signature.input_specs}


def split_program(program: ExportedProgram, cuts: Sequence[str]) -> tuple[list[Stage], dict[str, Boundary]]:
    """``program`` cut after each node of ``cuts`` (in program order) into
    ``len(cuts) + 1`` stage programs; see the module docstring."""
    ep = normalize(program)
    kinds = _kinds(ep)
    state = {**dict(ep.named_parameters()), **dict(ep.named_buffers()), **dict(ep.constants)}
    _refuse_buffer_updates(ep)
    nodes = list(ep.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    cut_positions = _cut_positions(nodes, position, cuts)
    heavy = _heavy_nodes(nodes, kinds)

    def stage_of(node: fx.Node) -> int:
        return sum(position[node] > c for c in cut_positions)

    (output,) = [n for n in nodes if n.op == "output"]
    loss_node = output.args[0][0]
    n_stages = len(cuts) + 1
    if stage_of(loss_node) != n_stages - 1:
        raise PlanError(f"pipeline cut {cuts[-1]!r} is after the loss")

    # the ops each stage runs: its heavy ops and the light ones they read
    owned: list[list[fx.Node]] = [[] for _ in range(n_stages)]
    for node in nodes:
        if node.op == "call_function" and node in heavy:
            owned[stage_of(node)].append(node)
    boundaries = _boundaries(owned, loss_node, heavy, stage_of)
    user_names = [spec.arg.name for spec in ep.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    stages = []
    for s in range(n_stages):
        stages.append(_stage(ep, s, owned[s], loss_node if s == n_stages - 1 else None, boundaries, heavy,
                             stage_of, user_names, kinds, state))
    return stages, boundaries


def _refuse_buffer_updates(ep: ExportedProgram) -> None:
    """:class:`PlanError` naming the first buffer the program updates (pipeline stages do not)."""
    if any(spec.kind == OutputKind.BUFFER_MUTATION for spec in ep.graph_signature.output_specs):
        target = next(s.target for s in ep.graph_signature.output_specs if s.kind == OutputKind.BUFFER_MUTATION)
        raise PlanError(f"pipeline stages: the program updates buffer {target} (running statistics) from the batch; "
                        "stages that update buffers are not supported", node=target)


def _cut_positions(nodes: list[fx.Node], position: dict[fx.Node, int], cuts: Sequence[str]) -> list[int]:
    """The positions of the cut nodes in the program, which must exist and be in program order."""
    by_name = {n.name: n for n in nodes}
    cut_positions = []
    for name in cuts:
        if name not in by_name:
            raise PlanError(f"pipeline cut {name!r}: no such node in the program", node=name)
        cut_positions.append(position[by_name[name]])
    if cut_positions != sorted(set(cut_positions)):
        raise PlanError(f"pipeline cuts {list(cuts)} are not in program order")
    return cut_positions


def _heavy_nodes(nodes: list[fx.Node], kinds: dict[str, tuple[InputKind, str | None]]) -> set[fx.Node]:
    """The trainable parameters and the ops that depend on one."""
    heavy: set[fx.Node] = set()
    for node in nodes:
        if node.op == "placeholder":
            if kinds[node.name][0] == InputKind.PARAMETER:
                heavy.add(node)
        elif node.op == "call_function" and any(a in heavy for a in node.all_input_nodes):
            heavy.add(node)
    return heavy


def _boundaries(owned: list[list[fx.Node]], loss_node: fx.Node, heavy: set[fx.Node],
                stage_of: Callable[[fx.Node], int]) -> dict[str, Boundary]:
    """The heavy results that later stages read, by name; each must be a floating-point tensor."""
    n_stages = len(owned)
    boundaries: dict[str, Boundary] = {}
    consumers: dict[fx.Node, set[int]] = {}
    for s in range(n_stages):
        for node in owned[s] + ([loss_node] if s == n_stages - 1 else []):
            for arg in node.all_input_nodes:
                if arg.op == "call_function" and arg in heavy and stage_of(arg) != s:
                    consumers.setdefault(arg, set()).add(s)
    for node, readers in consumers.items():
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or not val.is_floating_point():
            raise PlanError(f"pipeline cut: {node.name} ({node.target}) crosses a cut but is not a floating-point "
                            "tensor (no gradient can flow back through it); cut elsewhere", node=node.name)
        boundaries[node.name] = Boundary(node.name, stage_of(node), tuple(sorted(readers)), tuple(val.shape), val.dtype)
    return boundaries


def _stage(ep: ExportedProgram, s: int, owned: list[fx.Node], loss: fx.Node | None, boundaries: dict[str, Boundary],
           heavy: set[fx.Node], stage_of: Any, user_names: list[str], kinds: dict, state: dict) -> Stage:
    """Stage ``s``'s exported program (see :func:`split_program`)."""
    graph = fx.Graph()
    root = nn.Module()
    env: dict[fx.Node, fx.Node] = {}
    received = [b.name for b in boundaries.values() if s in b.consumers]
    sent = [b.name for b in boundaries.values() if b.producer == s]
    wanted = _wanted(s, owned, loss, boundaries, heavy, stage_of)
    order = [n for n in ep.graph.nodes if n in wanted]
    users = [n for n in order if n.op == "placeholder" and kinds[n.name][0] == InputKind.USER_INPUT]
    needed_users = [user_names.index(node.name) for node in users]
    for node in users:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for name in received:
        env[_node(ep, name)] = graph.placeholder(name)
    grads = {name: graph.placeholder(GRAD_PREFIX + name) for name in sent}
    parameters = _copy_nodes(graph, root, env, order, kinds, state)
    if loss is not None:
        graph.output(env[loss])
    else:
        graph.output(_boundary_loss(graph, [env[_node(ep, name)] for name in sent], [grads[name] for name in sent]))
    graph.lint()
    module = fx.GraphModule(root, graph)
    examples = [_example(n.meta["val"]) for n in users]
    examples += [torch.zeros(boundaries[name].shape, dtype=boundaries[name].dtype) for name in received]
    examples += [torch.zeros(boundaries[name].shape, dtype=boundaries[name].dtype) for name in sent]
    program = torch.export.export(module, tuple(examples), strict=False)
    return Stage(s, program, needed_users, received, sent, parameters)


def _wanted(s: int, owned: list[fx.Node], loss: fx.Node | None, boundaries: dict[str, Boundary],
            heavy: set[fx.Node], stage_of: Any) -> set[fx.Node]:
    """The nodes stage ``s`` evaluates: its heavy ops, and the light nodes they read."""
    wanted: set[fx.Node] = set()
    stack = list(owned) + ([loss] if loss is not None else [])
    while stack:
        node = stack.pop()
        if node in wanted:
            continue
        wanted.add(node)
        for arg in node.all_input_nodes:
            if arg.name in boundaries and stage_of(arg) != s:
                continue
            if arg.op == "call_function" and arg in heavy and stage_of(arg) != s:
                continue
            stack.append(arg)
    return wanted


def _copy_nodes(graph: fx.Graph, root: nn.Module, env: dict[fx.Node, fx.Node], order: list[fx.Node],
                kinds: dict, state: dict) -> list[str]:
    """Copy ``order``'s nodes into ``graph`` (state as attributes of ``root``); the parameters' targets."""
    parameters: list[str] = []
    for node in order:
        if node.op == "placeholder":
            kind, target = kinds[node.name]
            if kind == InputKind.USER_INPUT:
                continue
            _register(root, target, state[target], parameter=kind == InputKind.PARAMETER)
            if kind == InputKind.PARAMETER:
                parameters.append(target)
            env[node] = graph.get_attr(target)
            continue
        env[node] = graph.node_copy(node, lambda n: env[n])
    return parameters


def _boundary_loss(graph: fx.Graph, sent: list[fx.Node], grads: list[fx.Node]) -> fx.Node:
    """``Σ_i sum(b_i · g_i)`` over the sent boundaries and their gradient inputs."""
    terms = [graph.call_function(torch.ops.aten.sum.default,
                                 (graph.call_function(torch.ops.aten.mul.Tensor, (b, g)),))
             for b, g in zip(sent, grads)]
    total = terms[0]
    for term in terms[1:]:
        total = graph.call_function(torch.ops.aten.add.Tensor, (total, term))
    return total


def _node(ep: ExportedProgram, name: str) -> fx.Node:
    return next(n for n in ep.graph.nodes if n.name == name)


def _example(val: Any) -> torch.Tensor:
    """A real tensor shaped like a node's example value (zeros: ids stay in range)."""
    return torch.zeros(val.shape, dtype=val.dtype)


def _register(root: nn.Module, target: str, value: torch.Tensor, *, parameter: bool) -> None:
    """``value`` at the dotted ``target`` of ``root`` (a parameter or a buffer)."""
    *path, leaf = target.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    if hasattr(module, leaf):
        return
    if parameter:
        module.register_parameter(leaf, value if isinstance(value, nn.Parameter) else nn.Parameter(value))
    else:
        module.register_buffer(leaf, value)


__all__ = ["Boundary", "GRAD_PREFIX", "Stage", "split_program"]
