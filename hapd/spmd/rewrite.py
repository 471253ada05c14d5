"""Rewriting an exported program for one rank of a plan.

:func:`distribute` turns a ``torch.export`` program and a :class:`~hapd.compiler.plan.Plan`
into the fx :class:`~hapd.spmd.rank.RankModule` one rank runs. It applies these steps,
in order:

1. **check** (:func:`_check`) — the program lowers to the plan's graph id, the plan is
   for this world size, and the rank is in it;
2. **shard sources** (:func:`_shard_sources`) — every parameter, buffer and constant the
   plan uses becomes this rank's piece of it (a slice for ``Gather(d)``, the whole
   tensor for ``Identity``); the full tensor is never kept for a sharded one; a tied
   parameter is one ``nn.Parameter`` registered under each of its names;
3. **emit steps** (:func:`_emit_plan_steps`) — the plan's steps in order: the collectives
   that bring each step's inputs to the layouts its rule needs, the op itself (adapted
   where a rule needs more than the local op: :data:`hapd.spmd.adapters.ADAPTERS`),
   and collectives on its results (the loss masked to rank 0 when it was computed
   replicated); the steps of a recompute span then run under activation
   checkpointing (:mod:`hapd.spmd.checkpointed`);
4. **write back buffers** (:func:`_write_back_buffers`) — every buffer the step updates
   (batch norm's running statistics) gets its new value, which the plan holds whole
   (``Identity``) at the end, copied into the rank's full copy of it, as
   ``program.module()`` does;
5. **sync gradients** (:func:`_sync_gradients`) — replicated trainable parameters get
   their gradients summed over ranks during backward
   (:class:`hapd.spmd.gradsync.GradSync`, bucketed like DDP).

The program is first made functional with :func:`hapd.ir.normalize.normalize`,
as the lowering does, so the plan's fx node names are the names of the nodes replayed.

The module takes this rank's inputs (:meth:`~hapd.spmd.rank.RankModule.shard_inputs`
cuts them from the full batch) and returns this rank's part of the loss: the sum over
ranks is the single-device loss, and after ``backward()`` every parameter holds its
exact gradient.

A second program of the same model (its eval forward, or a batch of another size) is
distributed with ``shared=`` the first rank module: it then holds no state of its own
but runs on the first's parameter objects (the plan must hold each as the first does,
see :func:`shared_state_mismatch`), reads and updates the first's buffers, and shares its
gradient sync, so an optimizer of the first trains through either.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from hapd import _core
from hapd.ir.export import export
from hapd.ir.lower import apply_frozen_mark, load_exported, lower
from hapd.ir.normalize import buffer_mutations, normalize
from hapd.ir.op_facts import NO_EMPTY_SPLIT_OPS
from hapd.compiler.plan import Plan
from hapd.ir.shapes import batch_of, is_symbolic, program_at, program_batch
from hapd.ir.tied import aliases_of_read
from hapd.errors import PlanError
from hapd.spmd import collectives
from hapd.spmd import checkpointed as recompute
from hapd.spmd.adapters import ADAPTERS, stride_free
from hapd.spmd.gradsync import REDUCE_DTYPE, GradSync
from hapd.spmd.layout import IDENTITY, REDUCE, check_layout, gather_dim
from hapd.spmd.duplicas import overlapped
from hapd.spmd.random.random_ops import (
    PART,
    SEED,
    STEP,
    TORCH_RNG,
    DrawParts,
    apply_draw_parts,
    choose_rng,
    default_seed,
    install_step,
    random_batch_dims,
    random_streams,
)
from hapd.spmd.rank import Communicate, RankModule, RankView, set_attr
from hapd.state.weights import Weights, WeightSource, rank_piece, weight_source

_log = logging.getLogger("hapd.distribute")

# --------------------------------------------------------------------------------------
# Building the rank's graph
# --------------------------------------------------------------------------------------


def _sources_of(program: ExportedProgram) -> dict[str, tuple[str, str, Tensor | None]]:
    """placeholder name -> (kind, target, value) for parameters, buffers and constants."""
    sig = program.graph_signature
    state = program.state_dict
    constants = program.constants
    out: dict[str, tuple[str, str, Tensor | None]] = {}
    for spec in sig.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            continue
        target = spec.target
        value = state.get(target) if target in state else constants.get(target)
        out[spec.arg.name] = (spec.kind.name.lower(), target, value)
    return out


def _user_inputs(program: ExportedProgram) -> list[str]:
    return [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]


def _at_plan_batch(program: ExportedProgram, plan: Plan) -> ExportedProgram:
    """``program`` at the batch ``plan`` was compiled for, when its batch is symbolic
    (:mod:`hapd.ir.shapes`: one export serves every batch a plan may run)."""
    if not is_symbolic(program):
        return program
    batch = batch_of(program, {t["name"]: t["shape"] for t in plan.program["tensors"]})
    if batch is None:
        raise PlanError("the program's batch is symbolic and the plan names none of its inputs: it was compiled for "
                        "another program")
    return program_at(program, batch)


def _check(program: ExportedProgram, plan: Plan, rank: int, world: int, *, graph: bool) -> None:
    """Step 1: the plan fits this job (and, with ``graph``, this program)."""
    devices = int(plan.program["devices"])
    if devices != world:
        raise PlanError(f"the plan is for {devices} devices, this job has {world} ranks")
    if not 0 <= rank < world:
        raise PlanError(f"rank {rank} is not in 0..{world - 1}")
    if not graph:
        return
    graph_id = lower(program, name=plan.program.get("graph")).graph_id
    if graph_id != plan.key["graph_id"]:
        raise PlanError(
            f"the plan was compiled for graph {plan.key['graph_id'][:12]}…, this program is {graph_id[:12]}… "
            "(a different model, batch size or torch version)"
        )


class _Emitter:
    """Builds the rank's fx graph step by step (on ``shared``'s parameters and updated
    buffers when given: see :func:`distribute`)."""

    def __init__(self, program: ExportedProgram, view: RankView, group: Any, device: torch.device | None,
                 shared: RankModule | None = None):
        self.program, self.view, self.group, self.device = program, view, group, device
        self.shared = shared
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.env: dict[tuple[str, str], fx.Node] = {}
        self.fx_nodes = {n.name: n for n in program.graph.nodes}
        self.sources = _sources_of(program)
        self.aliases = aliases_of_read(program)
        """name of a parameter or buffer the graph reads -> the other names of that tensor
        (tied weights: :mod:`hapd.ir.tied`)."""
        self.mutations = buffer_mutations(program)
        self.mutated = {target for target, _ in self.mutations}
        self.whole = self.mutated | self.shared_buffers()
        """Buffers held whole at their own name and read afresh by every forward: those
        the step updates, and those ``shared`` updates."""
        self.synced: list[nn.Parameter] = []
        self.inputs: list[tuple[str, str]] = []
        self.params: dict[str, tuple[str, str]] = {}
        self.buffers: dict[str, tuple[str, str, str]] = {}
        self.weights: WeightSource | None = None
        """Where the pieces of parameters and buffers come from (None: the program's
        state dict, see :func:`distribute`)."""
        self._modules = 0
        self.seed = default_seed()
        """The seed the program's dropouts draw with (:mod:`hapd.spmd.random.random_ops`)."""
        self.streams = random_streams(program.graph)
        """Random node name -> its stream: the nodes drawn with hapd's generator (none
        when the program draws with torch's, ``rng="torch"``)."""

    # -- pieces ------------------------------------------------------------------------

    def add_module(self, prefix: str, module: nn.Module) -> str:
        self._modules += 1
        name = f"hapd_{prefix}_{self._modules}"
        self.root.add_module(name, module)
        return name

    def random_inputs(self, node: fx.Node) -> tuple[int, int, fx.Node, fx.Node]:
        """(stream, seed, step node, part node) of a dropout node: the step and part are
        read from the rank module's buffers (:func:`hapd.spmd.random.random_ops.install_step`)."""
        for name in (STEP, PART):
            if not hasattr(self.root, name):
                self.root.register_buffer(name, torch.zeros((), dtype=torch.int64, device=self.device), persistent=False)
        return self.streams[node.name], self.seed, self.graph.get_attr(STEP), self.graph.get_attr(PART)

    def shared_buffers(self) -> set[str]:
        """The buffers this program reads that ``shared`` updates (batch norm's running
        statistics, read by the eval program and updated by the training one)."""
        if self.shared is None:
            return set()
        read = {target for kind, target, _ in self.sources.values() if kind == "buffer"}
        return read & set(self.shared.hapd_updated)

    def shared_parameter(self, target: str, name: str, layout: str) -> nn.Parameter:
        """``shared``'s parameter object for ``target`` (held as this plan holds it:
        checked by :func:`shared_state_mismatch`, asserted here by its shape)."""
        param = self.shared.get_parameter(target)
        if list(param.shape) != self.view.local_shape(name, layout):
            raise PlanError(f"parameter {target}: this rank holds a piece of shape {list(param.shape)}, the plan "
                            f"needs {self.view.local_shape(name, layout)}", node=target)
        return param

    def placeholders(self, source_layouts: Mapping[str, str]) -> None:
        for name in _user_inputs(self.program):
            layout = source_layouts.get(name, IDENTITY)
            node = self.graph.placeholder(name)
            self.env[(name, layout)] = node
            self.inputs.append((name, layout))

    def source(self, src: Mapping[str, Any]) -> None:
        name, layout = src["tensor"], check_layout(src["layout"], f"source {src['tensor']}")
        if src["kind"] == "input":
            if (name, layout) not in self.env:
                raise PlanError(f"input {name} is not an input of the exported program", node=name)
            return
        if name not in self.sources:
            raise PlanError(f"source {name} is not a parameter, buffer or constant of the exported program", node=name)
        kind, target, value = self.sources[name]
        if value is None:
            raise PlanError(f"source {name} ({target}) has no value in the exported program", node=name)
        if target in self.whole:
            self.env[(name, layout)] = self.read_updated_buffer(name, layout, target)
            return
        attr = f"hapd_src.{target}" if kind != "parameter" else target
        if kind == "parameter" and self.shared is not None:
            param = self.shared_parameter(target, name, layout)
            set_attr(self.root, attr, param, parameter=True)
            for alias in (target, *self.aliases.get(target, ())):
                self.params[alias] = (name, layout)
            if src.get("grad_sync") and param.requires_grad:
                self.synced.append(param)
            self.env[(name, layout)] = self.graph.get_attr(attr)
            return
        local = self.local_value(name, layout, target, value)
        if self.device is not None:
            local = local.to(self.device)
        if kind == "parameter":
            param = nn.Parameter(local, requires_grad=value.requires_grad)
            set_attr(self.root, attr, param, parameter=True)
            for alias in (target, *self.aliases.get(target, ())):  # tied: one parameter, every name
                self.params[alias] = (name, layout)
            if src.get("grad_sync") and param.requires_grad:
                self.synced.append(param)
        else:
            set_attr(self.root, attr, local, parameter=False)
            for alias in (target, *self.aliases.get(target, ())):
                self.buffers[alias] = (name, layout, attr)
        self.env[(name, layout)] = self.graph.get_attr(attr)

    def updated_buffers(self) -> None:
        """Every buffer the step updates, whole, at its own name (``bn1.running_mean``):
        each forward reads its piece from it and writes the new value back into it. A
        buffer ``shared`` updates is ``shared``'s tensor itself."""
        by_target = {target: value for _kind, target, value in self.sources.values()}
        for target in sorted(self.whole):
            if self.shared is not None and target in self.shared.hapd_updated:
                set_attr(self.root, target, self.shared.get_buffer(target), parameter=False)
                continue
            value = by_target.get(target)
            if value is None:
                raise PlanError(f"buffer {target} is updated but has no value in the exported program", node=target)
            whole = self.local_value(target, IDENTITY, target, value)
            set_attr(self.root, target, whole.to(self.device) if self.device is not None else whole, parameter=False)

    def local_value(self, name: str, layout: str, target: str, value: Tensor) -> Tensor:
        """This rank's piece of source ``target`` (plan tensor ``name``) held in
        ``layout``: cut from the program's ``value``, or read from :attr:`weights`
        (only the piece, one tensor at a time) when there is one."""
        if self.weights is None:
            return self.view.local_value(name, layout, value.detach())
        d = gather_dim(layout)
        region = (d, *self.view.offset(name, d)) if d is not None else None
        names = [target, *self.aliases.get(target, ())]
        piece = rank_piece(self.weights, names, value.detach(), region)
        return torch.zeros_like(piece) if layout == REDUCE and self.view.rank != 0 else piece

    def read_updated_buffer(self, name: str, layout: str, target: str) -> fx.Node:
        """This rank's piece of an updated buffer, read afresh in each forward (a copy:
        the write-back must not change a tensor autograd saved)."""
        whole = self.graph.get_attr(target)
        d = gather_dim(layout)
        if d is not None:
            start, length = self.view.offset(name, d)
            piece = self.graph.call_function(torch.ops.aten.narrow.default, (whole, d, start, length))
            return self.graph.call_function(torch.ops.aten.clone.default, (piece,))
        if layout == REDUCE and self.view.rank != 0:
            return self.graph.call_function(torch.ops.aten.zeros_like.default, (whole,))
        return self.graph.call_function(torch.ops.aten.clone.default, (whole,))

    def communicate(self, comm: Mapping[str, Any]) -> None:
        tensor, src, dst = comm["tensor"], comm["from"], comm["to"]
        x = self.lookup(tensor, src)
        module = Communicate(comm["collective"], tensor, src, dst, self.view, self.group)
        target = self.add_module(f"{comm['collective']}", module)
        self.env[(tensor, dst)] = self.graph.call_module(target, (x,))

    def lookup(self, tensor: str, layout: str) -> fx.Node:
        node = self.env.get((tensor, layout))
        if node is None:
            have = [lay for (t, lay) in self.env if t == tensor]
            raise PlanError(
                f"tensor {tensor} is needed as {layout} but the program only has it as {have or 'nothing'} at that point",
                node=tensor,
            )
        return node

    # -- one step ----------------------------------------------------------------------

    def step(self, step: Mapping[str, Any]) -> None:
        """Emit one plan step (its sources are already in place: :func:`_shard_sources`)."""
        produced = {o["tensor"] for o in step["outputs"]}
        later = [c for c in step["comms"] if c["tensor"] in produced]
        for comm in step["comms"]:
            if comm["tensor"] not in produced:
                self.communicate(comm)
        node = self.fx_nodes.get(step["node"])
        if node is not None and node.target is operator.getitem:
            node = node.args[0]  # a tuple-returning op is named after its first picked result
        if node is None or node.op != "call_function":
            raise PlanError(f"step {step['node']} is not an op of the exported program", node=step["node"])
        layouts: dict[str, str] = {}
        for inp in step["inputs"]:
            lay = check_layout(inp["layout"], f"step {step['node']}")
            if layouts.setdefault(inp["tensor"], lay) != lay:
                raise PlanError(f"step {step['node']} reads {inp['tensor']} in two layouts", node=step["node"])

        def arg(n: fx.Node) -> fx.Node:
            if n.name not in layouts:
                raise PlanError(f"step {step['node']}: operand {n.name} is not among the plan's inputs", node=step["node"])
            return self.lookup(n.name, layouts[n.name])

        args = fx.node.map_arg(node.args, arg)
        kwargs = dict(fx.node.map_arg(node.kwargs, arg))
        if self.device is not None and "device" in kwargs:
            kwargs["device"] = self.device
        empty = self.empty_pieces(step) if step["op"] in NO_EMPTY_SPLIT_OPS else {}
        if empty:
            args, kwargs = self.pad_empty(empty, args, kwargs)
        adapt = ADAPTERS.get((step["op"], step["rule"]))
        if adapt is not None:
            result = adapt(self, step, node, args, kwargs)
        else:
            result = self.graph.call_function(stride_free(node.target), args, kwargs)
        if empty:
            result = self.cut_padding(step, result)
        self.bind_outputs(step, node, result)
        for comm in later:
            self.communicate(comm)

    # -- ops that reject a zero-length split dim --------------------------------------

    def empty_pieces(self, step: Mapping[str, Any]) -> dict[fx.Node, tuple[int, int]]:
        """Input nodes of ``step`` whose piece on this rank is empty along its split dim:
        node -> (split dim, rank of the tensor)."""
        out = {}
        for inp in step["inputs"]:
            d = gather_dim(inp["layout"])
            if d is not None and self.view.offset(inp["tensor"], d)[1] == 0:
                rank = len(self.view.full_shape(inp["tensor"]))
                out[self.lookup(inp["tensor"], inp["layout"])] = (d, rank)
        return out

    def pad_empty(self, empty: Mapping[fx.Node, tuple[int, int]], args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Give each empty piece one zero slice along its split dim (kernels such as
        conv2d, max_pool2d and attention reject or crash on a zero-size channel or head
        dim; a zero slice adds nothing and keeps the piece in the autograd graph)."""
        padded = {
            x: self.graph.call_function(torch.ops.aten.constant_pad_nd.default, (x, [0, 0] * (rank - 1 - d) + [0, 1], 0.0))
            for x, (d, rank) in empty.items()
        }
        swap = lambda n: padded.get(n, n)  # noqa: E731
        return fx.node.map_arg(args, swap), dict(fx.node.map_arg(kwargs, swap))

    def cut_padding(self, step: Mapping[str, Any], result: fx.Node) -> fx.Node:
        """Drop the zero slice again from the (single) output where it is empty."""
        out = step["outputs"][0]
        d = gather_dim(out["layout"])
        if d is None or self.view.offset(out["tensor"], d)[1] != 0:
            return result
        return self.graph.call_function(torch.ops.aten.narrow.default, (result, d, 0, 0))

    def bind_outputs(self, step: Mapping[str, Any], node: fx.Node, result: fx.Node) -> None:
        tuple_result = isinstance(node.meta.get("val"), (tuple, list))
        for out in step["outputs"]:
            layout = check_layout(out["layout"], f"step {step['node']}")
            if tuple_result:
                k = self.view.output_index(out["tensor"])
                self.env[(out["tensor"], layout)] = self.graph.call_function(operator.getitem, (result, k))
            else:
                self.env[(out["tensor"], layout)] = result

    def local_out_shape(self, step: Mapping[str, Any]) -> list[int]:
        out = step["outputs"][0]
        return self.view.local_shape(out["tensor"], out["layout"])


# --------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------


def _load_program(program: ExportedProgram | str | Path | nn.Module, example_inputs: Sequence[Tensor] | None) -> ExportedProgram:
    """The exported program: as given, exported from an ``nn.Module`` at ``example_inputs``,
    or loaded from a ``.pt2`` path."""
    if isinstance(program, ExportedProgram):
        apply_frozen_mark(program)  # a program hapd exported, loaded by torch.export.load
        return program
    if isinstance(program, nn.Module):
        if example_inputs is None:
            raise PlanError("distributing an nn.Module needs example_inputs (the global batch it was compiled for)")
        return export(program, tuple(example_inputs))
    return load_exported(program)[0]


def distribute(
    program: ExportedProgram | str | Path | nn.Module,
    plan: Plan | str | Path,
    rank: int | None = None,
    *,
    world: int | None = None,
    group: Any = None,
    device: torch.device | str | None = None,
    example_inputs: Sequence[Tensor] | None = None,
    check_graph: bool = True,
    hosts: collectives.HostGroups | None = None,
    bucket_bytes: int = _core.GRAD_BUCKET_BYTES,
    shared: RankModule | None = None,
    weights: Weights | None = None,
    batch_dims: Sequence[int | None] | None = None,
    seed: int | None = None,
    rng: str | None = None,
    draw_parts: DrawParts | None = None,
) -> RankModule:
    """The fx module rank ``rank`` runs for ``plan``.

    ``program``: the ``torch.export`` program the plan was compiled from (or its
    ``.pt2`` path, or the ``nn.Module`` with ``example_inputs``). ``rank``/``world``
    default to the process group's. ``device``: where parameters live (default: where
    the program's are). ``check_graph=False`` skips lowering the program again to
    compare graph ids (only when the caller just compiled the plan from it).
    ``hosts``: sum replicated gradients in two levels across hosts
    (:func:`hapd.spmd.distributed.job_host_groups`; default: one all-reduce over ``group``).
    ``bucket_bytes``: gradient bytes per all-reduce (the cost model assumes the default).

    ``shared``: the rank module of another program of the same model (its training
    program, when this is its eval forward or a batch of another size). This module
    then runs on ``shared``'s parameter objects, reads and writes ``shared``'s updated
    buffers, and sums gradients with ``shared``'s gradient sync (``hosts`` and
    ``bucket_bytes`` are ``shared``'s). The plan must hold every parameter as
    ``shared``'s does (:func:`shared_state_mismatch`): :class:`PlanError` otherwise.

    ``weights``, ``seed``, ``rng``: where the pieces of parameters and buffers come from,
    and what the program's random ops draw with (:func:`_rank_emitter`).

    A plan with ``overlap`` (compiled for one duplica: half the global batch) gives an
    :class:`hapd.spmd.duplicas.OverlappedModule` running two interleaved duplicas;
    ``batch_dims``: each input's batch dim in the global batch (default 0).

    ``draw_parts``: where this program's batch lies in the single-device batch
    (:class:`~hapd.spmd.random.random_ops.DrawParts`: a pipeline's micro-batch), so that
    its random ops draw the single-device masks of its rows; an overlap plan's two
    duplicas are placed so without it (the samples' dim of each random op read from a
    program with a symbolic batch, else dim 0 of batch-first tensors).
    """
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    loaded = _load_program(program, example_inputs)
    if draw_parts is None and plan.overlap:
        draw_parts = DrawParts(2, random_batch_dims(loaded, program_batch(loaded, batch_dims)))
    ep = normalize(_at_plan_batch(loaded, plan))
    rank, world = _rank_and_world(rank, world, group)
    _check(ep, plan, rank, world, graph=check_graph)
    em = _rank_emitter(ep, plan, rank, world, group=group, device=device, shared=shared, weights=weights,
                       seed=seed, rng=rng)
    if draw_parts is not None and em.streams:
        em.streams = {name: k + draw_parts.stream_base for name, k in em.streams.items()}
    _shard_sources(em, plan.program["steps"])
    _emit_plan_steps(em, plan.program["steps"])
    _write_back_buffers(em)
    _output_loss(em, plan.program["loss"])
    module = _seeded(_rank_module(em), em, shared)
    if draw_parts is not None and em.streams:
        _place_draws(module, draw_parts, len(em.streams))
    if shared is None:
        _sync_gradients(module, em.synced, group, bucket_bytes, hosts, reduce_dtype=plan.reduce_dtype)
    else:
        _share_gradient_sync(module, shared, em.synced)
    return _seeded(overlapped(module, batch_dims), em, shared) if plan.overlap else module


def _place_draws(module: RankModule, parts: DrawParts, streams: int) -> None:
    """Place the random ops of ``module`` in the single-device batch; where the samples'
    dims were read for another count of random ops than the program has (a program
    normalized into other ops), each part draws masks of its own, logged."""
    if len(parts.batch_dims) != streams:
        if parts.batch_dims:
            _log.warning("the samples' dims of %d random ops were given for a program with %d: each of its %d parts "
                         "draws masks of its own", len(parts.batch_dims), streams, parts.parts)
        parts = DrawParts(parts.parts, (), parts.stream_base)
    placed = apply_draw_parts(module, parts)
    if placed < streams:
        _log.info("%d of %d random ops draw masks of their own per part (samples' dim not known)", streams - placed,
                  streams)


def _rank_emitter(ep: ExportedProgram, plan: Plan, rank: int, world: int, *, group: Any,
                  device: torch.device | str | None, shared: RankModule | None, weights: Weights | None,
                  seed: int | None, rng: str | None) -> _Emitter:
    """The emitter of rank ``rank``'s module: its view of the plan, its pieces' source, its random draws.

    ``weights``: where the pieces of parameters and buffers come from instead of the
    program's state dict (:func:`hapd.state.weights.weight_source`: an initializer, a
    safetensors file, a checkpoint): each is read one tensor at a time and only this
    rank's piece is kept, so ``program`` may be exported from a model on the meta
    device; a tensor the source lacks is cut from the program's value.

    ``seed``: what the program's dropouts draw with (hapd's counter-based generator,
    :mod:`hapd.spmd.random.random_ops`; given, it must be the same on every rank; default
    ``torch.initial_seed()`` of rank 0 of ``group``, sent to the others by a collective
    when the program has dropouts). The module advances its step counter
    (:data:`~hapd.spmd.random.random_ops.STEP`) at each forward.

    ``rng``: which generator the random ops draw with
    (:data:`~hapd.spmd.random.random_ops.RNG_CHOICES`). ``"counter"``: hapd's, each rank its
    slice of the single-device draw. ``"torch"``: the program's own ops and torch's
    generator, as the eager model draws; only for a program that runs whole on one device
    (no duplicas), where there is nothing to slice. Default: ``"counter"`` everywhere, so
    one process draws the masks N ranks draw.
    """
    rng = choose_rng(rng, world=world, overlap=bool(plan.overlap))
    view = RankView(plan, rank, world)
    if shared is not None:
        mismatch = shared_state_mismatch(shared, view, _sources_of(ep))
        if mismatch is not None:
            raise PlanError(mismatch)
    em = _Emitter(ep, view, group, torch.device(device) if device is not None else None, shared)
    em.weights = weight_source(weights)
    if rng == TORCH_RNG:
        em.streams = {}  # every random op runs as the program has it
    if seed is not None:
        em.seed = int(seed)
    elif shared is not None and hasattr(shared, SEED):
        em.seed = int(getattr(shared, SEED))  # another program of one model: one generator
    elif em.streams and world > 1 and dist.is_available() and dist.is_initialized():
        em.seed = _job_seed(em.seed, group)
    return em


def _seeded(module: RankModule, em: _Emitter, shared: RankModule | None) -> RankModule:
    """``module`` holding the seed its random ops draw with, and advancing its step counter at each forward."""
    setattr(module, SEED, em.seed)
    if em.streams:
        install_step(module, shared)
    return module


def _job_seed(seed: int, group: Any) -> int:
    """Rank 0's ``seed`` on every rank of ``group`` (a collective): the ranks draw one
    mask for a dropout they hold whole, and their slices of one mask for a split one,
    also when their torch seeds differ."""
    box = [seed]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return int(box[0])


def shared_state_mismatch(shared: RankModule, view: RankView, sources: Mapping[str, tuple[str, str, Any]]) -> str | None:
    """Why a program whose plan ``view`` sees cannot run on ``shared``'s parameters, or
    None when it can: every parameter it reads must be one ``shared`` holds, in the
    same layout, split in the same lengths on every rank. ``sources``: placeholder name
    -> (kind, target, value) of the program's parameters, buffers and constants. The
    answer is the same on every rank (it depends on the plans only)."""
    theirs = shared.hapd_view
    for step in view.plan.program["steps"]:
        for src in step["sources"]:
            kind, target, _ = sources.get(src["tensor"], ("", "", None))
            if kind != "parameter":
                continue
            if target not in shared.hapd_params:
                return f"parameter {target}: this program reads it, the training plan does not hold it"
            tensor, layout = shared.hapd_params[target]
            if src["layout"] != layout:
                return f"parameter {target}: this program's plan holds it as {src['layout']}, the training plan as {layout}"
            d = gather_dim(layout)
            if d is not None and view.lengths(src["tensor"], d) != theirs.lengths(tensor, d):
                return (f"parameter {target}: this program's plan splits dim {d} in lengths "
                        f"{view.lengths(src['tensor'], d)}, the training plan in {theirs.lengths(tensor, d)}")
    return None


def _rank_and_world(rank: int | None, world: int | None, group: Any) -> tuple[int, int]:
    """``rank`` and ``world``, each defaulting to the process group's (0 and 1 without one)."""
    if rank is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
    if world is None:
        world = dist.get_world_size(group) if dist.is_initialized() else 1
    return rank, world


def _shard_sources(em: _Emitter, steps: Sequence[Mapping[str, Any]]) -> None:
    """Step 2: the program's inputs as placeholders in the layouts the plan takes them in,
    and this rank's piece of every parameter, buffer and constant the steps read."""
    input_layouts = {src["tensor"]: src["layout"] for step in steps for src in step["sources"] if src["kind"] == "input"}
    em.placeholders(input_layouts)
    em.updated_buffers()
    for step in steps:
        for src in step["sources"]:
            em.source(src)


def _emit_plan_steps(em: _Emitter, steps: Sequence[Mapping[str, Any]]) -> None:
    """Step 3: every step in plan order; the steps of a recompute span then run
    under activation checkpointing (:mod:`hapd.spmd.checkpointed`)."""
    marks = recompute.StepMarks(em.graph)
    for step in steps:
        marks.mark()
        em.step(step)
    recompute.checkpoint_recompute_spans(em.graph, em.root, steps, marks, em.add_module)


def _write_back_buffers(em: _Emitter) -> None:
    """Step 4: each updated buffer's new value (whole on every rank at the end of the
    plan) copied into the rank's buffer, without gradient."""
    for target, value in em.mutations:
        new = em.graph.call_function(torch.ops.aten.detach.default, (em.lookup(value, IDENTITY),))
        em.graph.call_function(torch.ops.aten.copy_.default, (em.graph.get_attr(target), new))


def _output_loss(em: _Emitter, loss: str) -> None:
    """The loss, held as ``Reduce``, is the rank module's output."""
    em.graph.output(em.lookup(loss, REDUCE))
    em.graph.lint()


def _rank_module(em: _Emitter) -> RankModule:
    """The emitted graph as this rank's module, with what the plan says about it."""
    module = RankModule(em.root, em.graph, class_name="RankModule")
    _register_tied(module, em)
    module.hapd_view = em.view
    module.hapd_inputs = em.inputs
    module.hapd_params = em.params
    module.hapd_buffers = em.buffers
    module.hapd_updated = [target for target, _ in em.mutations]
    return module


def _register_tied(module: RankModule, em: _Emitter) -> None:
    """Every other name of a tied parameter names the one parameter built for it (the
    module's graph reads only the name it was built under: fx keeps only what the graph
    reads)."""
    for target, aliases in em.aliases.items():
        if target in em.params:
            param = module.get_parameter(target)
            for alias in aliases:
                set_attr(module, alias, param, parameter=True)


def _sync_gradients(module: RankModule, synced: Sequence[nn.Parameter], group: Any, bucket_bytes: int,
                    hosts: collectives.HostGroups | None, *, reduce_dtype: str = "fp32") -> None:
    """Step 5: sum the gradients of ``synced`` (the replicated trainable parameters) over
    ranks during each backward of ``module``, in the plan's ``reduce_dtype``."""
    module.hapd_sync = GradSync(synced, group, bucket_bytes, hosts=hosts, reduce_dtype=REDUCE_DTYPE[reduce_dtype])
    module.register_forward_pre_hook(lambda m, _args: m.hapd_sync.reset())


def _share_gradient_sync(module: RankModule, shared: RankModule, synced: Sequence[nn.Parameter]) -> None:
    """Sum this module's gradients with ``shared``'s gradient sync (its hooks are on the
    same parameter objects); it must sum the same parameters."""
    theirs = {id(p) for bucket in shared.hapd_sync.buckets for p in bucket}
    ours = {id(p) for p in synced}
    if ours != theirs:
        names = {id(p): n for n, p in shared.named_parameters()}
        first = min(ours ^ theirs, key=lambda i: names.get(i, ""))
        this, training = ("sums", "does not") if first in ours else ("does not sum", "does")
        raise PlanError(f"parameter {names.get(first, '?')}: this program's plan {this} its gradient over ranks, "
                        f"the training plan {training}", node=names.get(first))
    module.hapd_sync = shared.hapd_sync
    module.register_forward_pre_hook(lambda m, _args: m.hapd_sync.reset())


def global_loss(local: Tensor, group: Any = None) -> float:
    """The single-device loss: the sum over ranks of their loss parts."""
    total = local.detach().clone().to(torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return float(total)
