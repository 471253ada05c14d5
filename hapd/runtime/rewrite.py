"""Rewriting an exported program for one rank of a plan.

:func:`distribute` turns a ``torch.export`` program and a :class:`~hapd.compiler.plan.Plan` into
the fx :class:`RankModule` one rank runs. It applies these steps, in order:

1. **check** — the program lowers to the plan's graph id, the plan is for this world
   size, and the rank is in it;
2. **shard sources** — every parameter, buffer and constant the plan uses becomes this
   rank's piece of it (a slice for ``Gather(d)``, the whole tensor for ``Identity``);
   the full tensor is never kept for a sharded one;
3. **emit steps** — the plan's steps in order: each step's sources, the collectives
   that bring its inputs to the layouts its rule needs, the op itself (adapted where a
   rule needs more than the local op: see ``_ADAPT``), and collectives on its results
   (the loss masked to rank 0 when it was computed replicated);
4. **sync gradients** — replicated trainable parameters get their gradients summed
   over ranks during backward (:class:`GradSync`, bucketed like DDP).

The module takes this rank's inputs (:meth:`RankModule.shard_inputs` cuts them from
the full batch) and returns this rank's part of the loss: the sum over ranks is the
single-device loss, and after ``backward()`` every parameter holds its exact gradient.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, fx, nn
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from hapd import _core

from hapd.runtime import collectives
from hapd.errors import PlanError
from hapd.compiler.plan import Plan

IDENTITY, REDUCE = "Identity", "Reduce"
_GATHER = re.compile(r"Gather\((\d+)\)")


def gather_dim(layout: str) -> int | None:
    """``d`` for ``"Gather(d)"``, ``None`` for ``Identity`` and ``Reduce``."""
    m = _GATHER.fullmatch(layout)
    return int(m.group(1)) if m else None


def _check_layout(layout: str, where: str) -> str:
    if layout not in (IDENTITY, REDUCE) and gather_dim(layout) is None:
        raise PlanError(f"{where}: unknown layout {layout!r}")
    return layout


# --------------------------------------------------------------------------------------
# What the plan says about this rank
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankView:
    """The plan seen from one rank: lengths and local shapes of tensors."""

    plan: Plan
    rank: int
    world: int

    def lengths(self, tensor: str, dim: int) -> list[int]:
        lengths = self.plan.lengths_of(tensor, dim)
        if len(lengths) != self.world:
            raise PlanError(f"tensor {tensor} dim {dim}: {len(lengths)} lengths for {self.world} ranks", node=tensor)
        return lengths

    def offset(self, tensor: str, dim: int) -> tuple[int, int]:
        """(start, length) of this rank's slice of ``tensor`` along ``dim``."""
        lengths = self.lengths(tensor, dim)
        return sum(lengths[: self.rank]), lengths[self.rank]

    def full_shape(self, tensor: str) -> list[int]:
        return list(self.tensors[tensor]["shape"])

    def local_shape(self, tensor: str, layout: str) -> list[int]:
        shape = self.full_shape(tensor)
        d = gather_dim(layout)
        if d is not None:
            shape[d] = self.offset(tensor, d)[1]
        return shape

    def output_index(self, tensor: str) -> int:
        return int(self.tensors[tensor]["output"])

    def dtype(self, tensor: str) -> str:
        return str(self.tensors[tensor]["dtype"])

    @cached_property
    def tensors(self) -> Mapping[str, Mapping[str, Any]]:
        """The plan's tensors by name."""
        return {t["name"]: t for t in self.plan.program["tensors"]}

    def local_value(self, tensor: str, layout: str, value: Tensor) -> Tensor:
        """This rank's piece of the full ``value`` of ``tensor`` held in ``layout``
        (a fresh tensor that shares no storage with ``value``)."""
        d = gather_dim(layout)
        if d is not None:
            start, length = self.offset(tensor, d)
            return value.narrow(d, start, length).clone()
        if layout == REDUCE:
            return value.clone() if self.rank == 0 else torch.zeros_like(value)
        return value.clone()


# --------------------------------------------------------------------------------------
# Modules the rewritten graph calls (fx code can call modules with state; the state here
# is the collective's dims, lengths and process group)
# --------------------------------------------------------------------------------------


class Communicate(nn.Module):
    """One collective of the plan on one tensor: ``from_layout → to_layout``."""

    def __init__(self, kind: str, tensor: str, src: str, dst: str, view: RankView, group: Any):
        super().__init__()
        self.kind, self.tensor, self.src, self.dst = kind, tensor, src, dst
        self.group = group
        self.rank = view.rank
        i, j = gather_dim(src), gather_dim(dst)
        self.src_dim, self.dst_dim = i, j
        self.src_lengths = view.lengths(tensor, i) if i is not None else None
        self.dst_lengths = view.lengths(tensor, j) if j is not None else None
        expected = {
            "all_gather": (i is not None and dst == IDENTITY),
            "all_gather_grouped": (i is not None and dst == IDENTITY),
            "reduce_scatter": (src == REDUCE and j is not None),
            "reduce_scatter_grouped": (src == REDUCE and j is not None),
            "all_reduce": (src == REDUCE and dst == IDENTITY),
            "all_to_all": (i is not None and j is not None and i != j),
            "dynamic_slice": (src == IDENTITY and j is not None),
            "mask_to_rank_zero": (src == IDENTITY and dst == REDUCE),
        }
        if not expected.get(kind, False):
            raise PlanError(f"tensor {tensor}: collective {kind!r} cannot turn {src} into {dst}", node=tensor)

    def forward(self, x: Tensor) -> Tensor:
        kind, group = self.kind, self.group
        if kind in ("all_gather", "all_gather_grouped"):
            return collectives.all_gather(x, self.src_dim, self.src_lengths, grouped=kind.endswith("grouped"), group=group)
        if kind in ("reduce_scatter", "reduce_scatter_grouped"):
            return collectives.reduce_scatter(
                x, self.dst_dim, self.dst_lengths, grouped=kind.endswith("grouped"), group=group
            )
        if kind == "all_reduce":
            return collectives.all_reduce(x, group=group)
        if kind == "all_to_all":
            return collectives.all_to_all(
                x, self.src_dim, self.dst_dim, self.src_lengths, self.dst_lengths, group=group
            )
        if kind == "dynamic_slice":
            return collectives.dynamic_slice(x, self.dst_dim, self.dst_lengths, group=group)
        return collectives.mask_to_rank_zero(x, group=group)

    def extra_repr(self) -> str:
        return f"{self.kind}: {self.tensor} {self.src} -> {self.dst}"


class VocabParallelEmbedding(nn.Module):
    """``embedding`` with this rank holding vocabulary rows ``[start, start+length)``:
    ids outside it give zero rows, so the sum over ranks is the full lookup."""

    def __init__(self, start: int, length: int):
        super().__init__()
        self.start, self.length = start, length

    def forward(self, weight: Tensor, indices: Tensor, padding_idx: int = -1) -> Tensor:
        local = indices - self.start
        inside = (local >= 0) & (local < self.length)
        if self.length == 0:
            return weight.new_zeros((*indices.shape, weight.shape[-1])) + weight.sum() * 0
        pad = padding_idx - self.start if 0 <= padding_idx - self.start < self.length else -1
        rows = torch.ops.aten.embedding.default(weight, local.clamp(0, self.length - 1), pad)
        return rows * inside.unsqueeze(-1).to(rows.dtype)

    def extra_repr(self) -> str:
        return f"rows [{self.start}, {self.start + self.length})"


class GlobalSum(nn.Module):
    """The sum over ranks of a local count (no gradient): the divisor of a sharded mean
    loss, whose element count depends on the labels."""

    def __init__(self, group: Any):
        super().__init__()
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        total = x.detach().clone()
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(total, group=self.group)
        return total


# --------------------------------------------------------------------------------------
# Gradient sync of replicated parameters
# --------------------------------------------------------------------------------------


class GradSync:
    """Sums the gradients of replicated trainable parameters over ranks during backward.

    Parameters are packed into buckets of about ``bucket_bytes`` in reverse order of
    first use (roughly the order backward produces their gradients); a bucket's
    all-reduce starts as soon as all its gradients exist and every earlier bucket has
    started, so all ranks issue the same collectives in the same order (as DDP does).
    The core's cost model charges this sync per bucket of the same size
    (``hapd._core.GRAD_BUCKET_BYTES``). When the last bucket has started, the sums are
    waited for and written back, so the gradients are complete when ``backward()``
    returns.

    With ``hosts`` (several ranks on each of several hosts) a bucket is summed in two
    levels (:func:`hapd.runtime.collectives.two_level_sum_`), pipelined: as soon as it is ready
    it is reduced onto the host's leader, where a helper thread waits for that reduce,
    all-reduces the bucket among the leaders and broadcasts it back, while backward goes
    on producing the next buckets. Only the leaders' all-reduce crosses hosts.
    """

    def __init__(self, params: Sequence[nn.Parameter], group: Any, bucket_bytes: int = _core.GRAD_BUCKET_BYTES,
                 hosts: collectives.HostGroups | None = None):
        self.group = group
        self.hosts = hosts
        self._relay: _LeaderRelay | None = None
        self.buckets: list[list[nn.Parameter]] = []
        size = bucket_bytes + 1
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            if size + nbytes > bucket_bytes or self.buckets[-1][0].dtype != p.dtype:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes
        self._bucket_of = {id(p): b for b, bucket in enumerate(self.buckets) for p in bucket}
        self._handles: list[tuple[Any, Tensor, list[nn.Parameter]]] = []
        self._ready: list[int] = [0] * len(self.buckets)
        self._next = 0
        self.active = dist.is_initialized() and dist.get_world_size(group) > 1
        if self.active:
            for p in params:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def reset(self) -> None:
        """Start a new backward pass; an incomplete previous one is an error."""
        if self._next not in (0, len(self.buckets)) or any(self._ready[self._next :]):
            missing = [n for bucket in self.buckets[self._next :] for n in bucket if n.grad is None]
            raise PlanError(
                f"gradient sync of the previous backward did not finish: {len(missing)} replicated "
                "parameter(s) received no gradient"
            )
        self._ready = [0] * len(self.buckets)
        self._next = 0
        self._handles = []
        self._relay = None

    def _on_grad(self, param: nn.Parameter) -> None:
        b = self._bucket_of[id(param)]
        self._ready[b] += 1
        while self._next < len(self.buckets) and self._ready[self._next] == len(self.buckets[self._next]):
            self._launch(self.buckets[self._next])
            self._next += 1
        if self._next == len(self.buckets):
            self._finish()

    def _launch(self, bucket: list[nn.Parameter]) -> None:
        flat = torch.cat([p.grad.reshape(-1) for p in bucket])
        hosts = self.hosts
        if hosts is None:
            handle = dist.all_reduce(flat, group=self.group, async_op=True)
        elif hosts.leaders is None:  # not a leader: send this host's part, await the sum
            dist.reduce(flat, dst=hosts.leader, group=hosts.local, async_op=True)
            handle = dist.broadcast(flat, src=hosts.leader, group=hosts.local_back, async_op=True)
        else:
            if self._relay is None:
                self._relay = _LeaderRelay(hosts)
            handle = self._relay.submit(dist.reduce(flat, dst=hosts.leader, group=hosts.local, async_op=True), flat)
        self._handles.append((handle, flat, bucket))

    def _finish(self) -> None:
        if self._relay is not None:
            self._relay.close()  # re-raises what failed in the helper thread
            self._relay = None
        for handle, flat, bucket in self._handles:
            handle.wait()
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        self._handles = []


class _Done:
    """A handle whose work is already waited for."""

    def wait(self) -> bool:
        return True


class _LeaderRelay:
    """A host leader's helper thread for one backward pass: for each bucket, in order,
    wait for its reduce onto this rank, all-reduce it among the leaders, broadcast it to
    the host. Collectives are issued on the leaders' and the broadcast group only, each
    in bucket order, so every rank sees them in the same order."""

    def __init__(self, hosts: collectives.HostGroups):
        import queue
        import threading

        self.hosts = hosts
        self.todo: queue.SimpleQueue = queue.SimpleQueue()
        self.sent: list[Any] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="hapd-grad-relay", daemon=True)
        self.thread.start()

    def submit(self, reduce: Any, flat: Tensor) -> _Done:
        self.todo.put((reduce, flat))
        return _Done()

    def _run(self) -> None:
        while (item := self.todo.get()) is not None:
            if self.error is not None:
                continue  # drain: the failure is reported by close()
            reduce, flat = item
            try:
                reduce.wait()
                dist.all_reduce(flat, group=self.hosts.leaders)
                self.sent.append(dist.broadcast(flat, src=self.hosts.leader, group=self.hosts.local_back,
                                                async_op=True))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                self.error = exc

    def close(self) -> None:
        self.todo.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        for handle in self.sent:
            handle.wait()


# --------------------------------------------------------------------------------------
# The rank's module
# --------------------------------------------------------------------------------------


class RankModule(fx.GraphModule):
    """One rank's program: ``forward(*local_inputs) -> this rank's loss part``."""

    hapd_view: RankView
    hapd_inputs: list[tuple[str, str]]
    """(input name, layout) of each forward argument."""
    hapd_params: dict[str, tuple[str, str]]
    """parameter name (as in the original model) -> (plan tensor, layout)."""
    hapd_sync: GradSync

    def shard_inputs(self, *full: Tensor) -> tuple[Tensor, ...]:
        """This rank's pieces of the full (global-batch) inputs, in forward order."""
        if len(full) != len(self.hapd_inputs):
            raise PlanError(f"expected {len(self.hapd_inputs)} inputs ({', '.join(n for n, _ in self.hapd_inputs)}), got {len(full)}")
        out = []
        for (name, layout), value in zip(self.hapd_inputs, full):
            expected = self.hapd_view.full_shape(name) if name in self.hapd_view.tensors else list(value.shape)
            if list(value.shape) != expected:
                raise PlanError(f"input {name}: shape {list(value.shape)}, the plan was compiled for {expected}", node=name)
            d = gather_dim(layout)
            if d is None:
                out.append(value)
            else:
                start, length = self.hapd_view.offset(name, d)
                out.append(value.narrow(d, start, length))
        return tuple(out)

    def local_shapes(self) -> list[list[int]]:
        """The shape of each input this rank's forward takes."""
        view = self.hapd_view
        return [view.local_shape(n, layout) if n in view.tensors else [] for n, layout in self.hapd_inputs]


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


def _set_attr(root: nn.Module, target: str, value: Tensor, *, parameter: bool) -> None:
    """Register ``value`` at the dotted path ``target`` under ``root``."""
    *path, leaf = target.split(".")
    module = root
    for part in path:
        child = getattr(module, part, None) if part in module._modules else None  # noqa: SLF001 - nn.Module's own registry
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if parameter:
        module.register_parameter(leaf, value if isinstance(value, nn.Parameter) else nn.Parameter(value))
    else:
        module.register_buffer(leaf, value)


def _check(program: ExportedProgram, plan: Plan, rank: int, world: int, *, graph: bool) -> None:
    """The plan fits this job (and, with ``graph``, this program)."""
    from hapd.compiler.lower import lower

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
    """Builds the rank's fx graph step by step."""

    def __init__(self, program: ExportedProgram, view: RankView, group: Any, device: torch.device | None):
        self.program, self.view, self.group, self.device = program, view, group, device
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.env: dict[tuple[str, str], fx.Node] = {}
        self.fx_nodes = {n.name: n for n in program.graph.nodes}
        self.sources = _sources_of(program)
        self.synced: list[nn.Parameter] = []
        self.inputs: list[tuple[str, str]] = []
        self.params: dict[str, tuple[str, str]] = {}
        self._modules = 0

    # -- pieces ------------------------------------------------------------------------

    def add_module(self, prefix: str, module: nn.Module) -> str:
        self._modules += 1
        name = f"hapd_{prefix}_{self._modules}"
        self.root.add_module(name, module)
        return name

    def placeholders(self, source_layouts: Mapping[str, str]) -> None:
        for name in _user_inputs(self.program):
            layout = source_layouts.get(name, IDENTITY)
            node = self.graph.placeholder(name)
            self.env[(name, layout)] = node
            self.inputs.append((name, layout))

    def source(self, src: Mapping[str, Any]) -> None:
        name, layout = src["tensor"], _check_layout(src["layout"], f"source {src['tensor']}")
        if src["kind"] == "input":
            if (name, layout) not in self.env:
                raise PlanError(f"input {name} is not an input of the exported program", node=name)
            return
        if name not in self.sources:
            raise PlanError(f"source {name} is not a parameter, buffer or constant of the exported program", node=name)
        kind, target, value = self.sources[name]
        if value is None:
            raise PlanError(f"source {name} ({target}) has no value in the exported program", node=name)
        local = self.view.local_value(name, layout, value.detach())
        if self.device is not None:
            local = local.to(self.device)
        attr = f"hapd_src.{target}" if kind != "parameter" else target
        if kind == "parameter":
            param = nn.Parameter(local, requires_grad=value.requires_grad)
            _set_attr(self.root, attr, param, parameter=True)
            self.params[target] = (name, layout)
            if src.get("grad_sync") and param.requires_grad:
                self.synced.append(param)
        else:
            _set_attr(self.root, attr, local, parameter=False)
        self.env[(name, layout)] = self.graph.get_attr(attr)

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
        for src in step["sources"]:
            self.source(src)
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
            lay = _check_layout(inp["layout"], f"step {step['node']}")
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
        empty = self.empty_pieces(step) if step["op"] in _NO_EMPTY_SPLITS else {}
        if empty:
            args, kwargs = self.pad_empty(empty, args, kwargs)
        adapt = _ADAPT.get((step["op"], step["rule"]))
        if adapt is not None:
            result = adapt(self, step, node, args, kwargs)
        else:
            result = self.graph.call_function(node.target, args, kwargs)
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
            layout = _check_layout(out["layout"], f"step {step['node']}")
            if tuple_result:
                k = self.view.output_index(out["tensor"])
                self.env[(out["tensor"], layout)] = self.graph.call_function(operator.getitem, (result, k))
            else:
                self.env[(out["tensor"], layout)] = result

    def local_out_shape(self, step: Mapping[str, Any]) -> list[int]:
        out = step["outputs"][0]
        return self.view.local_shape(out["tensor"], out["layout"])


# --------------------------------------------------------------------------------------
# Ops whose rule needs more than running the op on the local pieces
# --------------------------------------------------------------------------------------

Adapter = Callable[[_Emitter, Mapping[str, Any], fx.Node, tuple, dict], fx.Node]


def _with_local_size(arg_index: int) -> Adapter:
    """Views/reshapes/expands: the size argument becomes the local output shape."""

    def adapt(em: _Emitter, step, node, args, kwargs):
        args = list(args)
        args[arg_index] = em.local_out_shape(step)
        return em.graph.call_function(node.target, tuple(args), kwargs)

    return adapt


def _bias_on_rank_zero(bias_index: int) -> Adapter:
    """Row-parallel linear/conv: the partial sums add the bias once, on rank 0. Other
    ranks add ``0 · bias``, which keeps the bias in their graph: every rank then gets a
    (zero) gradient for it and joins its gradient all-reduce."""

    def adapt(em: _Emitter, step, node, args, kwargs):
        args, kwargs = list(args), dict(kwargs)
        if em.view.rank != 0:
            if len(args) > bias_index and args[bias_index] is not None:
                args[bias_index] = em.graph.call_function(torch.ops.aten.mul.Tensor, (args[bias_index], 0.0))
            elif kwargs.get("bias") is not None:
                kwargs["bias"] = em.graph.call_function(torch.ops.aten.mul.Tensor, (kwargs["bias"], 0.0))
        return em.graph.call_function(node.target, tuple(args), kwargs)

    return adapt


def _vocab_parallel(em: _Emitter, step, node, args, kwargs):
    weight_name = step["inputs"][0]["tensor"]
    start, length = em.view.offset(weight_name, 0)
    padding = args[2] if len(args) > 2 else kwargs.get("padding_idx", -1)
    target = em.add_module("vocab_parallel_embedding", VocabParallelEmbedding(start, length))
    return em.graph.call_module(target, (args[0], args[1], padding))


def _sharded_mean(em: _Emitter, step, node, args, kwargs):
    """mean over a split dim: the local sum over the full element count (a partial sum;
    a zero-length piece gives 0, not NaN)."""
    x_name = step["inputs"][0]["tensor"]
    full = em.view.full_shape(x_name)
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if node.target is torch.ops.aten.mean.default or dims in (None, []):
        count = math.prod(full)
        summed = em.graph.call_function(torch.ops.aten.sum.default, (args[0],), {k: v for k, v in kwargs.items() if k == "dtype"})
    else:
        count = math.prod(full[d % len(full)] for d in dims)
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        extra = {"dtype": kwargs["dtype"]} if "dtype" in kwargs else {}
        summed = em.graph.call_function(torch.ops.aten.sum.dim_IntList, (args[0], list(dims), keepdim), extra)
    return em.graph.call_function(torch.ops.aten.div.Tensor, (summed, float(count)))


def _sharded_mean_loss(em: _Emitter, step, node, args, kwargs):
    """cross_entropy/nll with mean reduction on a split batch: the local sum over the
    global divisor (the count, or class weight, of the counted targets over all ranks,
    all-reduced since ignore_index makes it data-dependent)."""
    defaults = [None, None, None, 1, -100]
    names = ["self", "target", "weight", "reduction", "ignore_index"]
    kwargs = dict(kwargs)
    args = list(args) + [kwargs.pop(n, d) for n, d in zip(names[len(args) :], defaults[len(args) :])]
    weight, ignore = args[2], args[4]
    args[3] = 2  # sum; divided below
    summed = em.graph.call_function(node.target, tuple(args), kwargs)
    target_name = step["inputs"][1]["tensor"]
    g = em.graph
    if not em.view.dtype(target_name).startswith("int"):
        # class probabilities: the divisor is the number of samples
        full = em.view.full_shape(target_name)
        return g.call_function(torch.ops.aten.div.Tensor, (summed, float(full[0] * math.prod(full[2:]))))
    target = args[1]
    counted = g.call_function(torch.ops.aten.ne.Scalar, (target, ignore))
    if weight is None:
        local = g.call_function(torch.ops.aten.sum.default, (counted,))
    else:
        safe = g.call_function(torch.ops.aten.clamp_min.default, (target, 0))
        picked = g.call_function(torch.ops.aten.index.Tensor, (weight, [safe]))
        local = g.call_function(torch.ops.aten.sum.default, (g.call_function(torch.ops.aten.mul.Tensor, (picked, counted)),))
    total = g.call_module(em.add_module("global_count", GlobalSum(em.group)), (local,))
    return g.call_function(torch.ops.aten.div.Tensor, (summed, total))


_NO_EMPTY_SPLITS = frozenset({"aten.conv2d", "aten.max_pool2d", "aten.scaled_dot_product_attention"})
"""Ops whose kernels reject (or crash on) a zero-length split dim: an empty piece is
padded with one zero slice and the output cut back (see ``_Emitter.pad_empty``)."""

_ADAPT: dict[tuple[str, str], Adapter] = {
    **{(op, "sharded"): _with_local_size(1) for op in ("aten.view", "aten.reshape", "aten._unsafe_view", "aten.expand")},
    ("aten.linear", "row-parallel"): _bias_on_rank_zero(2),
    ("aten.conv2d", "row-parallel"): _bias_on_rank_zero(2),
    ("aten.embedding", "vocab-parallel"): _vocab_parallel,
    ("aten.mean", "sharded-mean"): _sharded_mean,
    ("aten.mean.dim", "sharded-mean"): _sharded_mean,
    ("aten.cross_entropy_loss", "sharded-mean"): _sharded_mean_loss,
    ("aten.nll_loss", "sharded-mean"): _sharded_mean_loss,
}


# --------------------------------------------------------------------------------------
# The entry point
# --------------------------------------------------------------------------------------


def _load_program(program: ExportedProgram | str | Path | nn.Module, example_inputs: Sequence[Tensor] | None) -> ExportedProgram:
    if isinstance(program, ExportedProgram):
        return program
    if isinstance(program, nn.Module):
        if example_inputs is None:
            raise PlanError("distributing an nn.Module needs example_inputs (the global batch it was compiled for)")
        from hapd.compiler.export import export

        return export(program, tuple(example_inputs))
    from hapd.compiler.lower import load_exported

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
) -> RankModule:
    """The fx module rank ``rank`` runs for ``plan``.

    ``program``: the ``torch.export`` program the plan was compiled from (or its
    ``.pt2`` path, or the ``nn.Module`` with ``example_inputs``). ``rank``/``world``
    default to the process group's. ``device``: where parameters live (default: where
    the program's are). ``check_graph=False`` skips lowering the program again to
    compare graph ids (only when the caller just compiled the plan from it).
    ``hosts``: sum replicated gradients in two levels across hosts
    (:func:`hapd.runtime.training.host_groups`; default: one all-reduce over ``group``).
    ``bucket_bytes``: gradient bytes per all-reduce (the cost model assumes the default).
    """
    ep = _load_program(program, example_inputs)
    if not isinstance(plan, Plan):
        plan = Plan.load(plan)
    if rank is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
    if world is None:
        world = dist.get_world_size(group) if dist.is_initialized() else 1
    _check(ep, plan, rank, world, graph=check_graph)
    view = RankView(plan, rank, world)
    em = _Emitter(ep, view, group, torch.device(device) if device is not None else None)

    source_layouts = {
        src["tensor"]: src["layout"] for step in plan.program["steps"] for src in step["sources"] if src["kind"] == "input"
    }
    em.placeholders(source_layouts)
    for step in plan.program["steps"]:
        em.step(step)
    loss = plan.program["loss"]
    em.graph.output(em.lookup(loss, REDUCE))
    em.graph.lint()

    module = RankModule(em.root, em.graph, class_name="RankModule")
    module.hapd_view = view
    module.hapd_inputs = em.inputs
    module.hapd_params = em.params
    module.hapd_sync = GradSync(em.synced, group, bucket_bytes, hosts=hosts)
    module.register_forward_pre_hook(lambda m, _args: m.hapd_sync.reset())
    return module


def global_loss(local: Tensor, group: Any = None) -> float:
    """The single-device loss: the sum over ranks of their loss parts."""
    total = local.detach().clone().to(torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(total, group=group)
    return float(total)
