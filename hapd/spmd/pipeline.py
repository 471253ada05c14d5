"""Pipeline execution: stages on device groups, 1F1B over micro-batches.

A pipeline plan cuts the program into stages (:func:`hapd.compiler.pipeline.stages.split_program`);
stage ``s`` runs on its own group of ranks (normally one host) with its own SPMD plan,
compiled for the micro-batch (global batch / ``m``) on that group. Each rank builds only
its stage's rank module (:func:`hapd.distribute` over the stage's process group), and
:class:`PipelineRank` runs one training iteration as the 1F1B schedule: ``S - 1 - s``
warm-up forwards, then one forward and one backward in turn, then the remaining
backwards.

* **Forward** of a micro-batch: this rank's pieces of the inputs the stage reads are cut
  from the micro-batch, the boundaries it reads are received, and the stage runs up to
  its boundaries (the part of the rank program that does not read the gradient
  inputs); each boundary is sent to the ranks of every stage that reads it. The last
  stage runs to the loss.
* **Backward**: the gradients of the stage's boundaries are received (summed over the
  stages that read them), the rest of the rank program runs (``Σ sum(b · g)``), and its
  backward gives the stage's parameters their exact gradients and the received
  boundaries theirs, which go back to the ranks that sent them. A stage in which
  nothing takes a gradient (its parameters frozen, no boundary read) runs no backward.
* What moves between stages is resharded point to point: every rank of the sending
  stage holds its piece of a boundary in its plan's layout (``Gather(d)`` with that
  group's lengths, ``Identity`` whole, ``Reduce`` partial sums), every rank of the
  receiving stage needs its piece in its own plan's layout, and each pair exchanges
  exactly the block they share (:func:`transfers`), uneven lengths and different split
  dims included. Sends are asynchronous (they overlap the next computation); receives
  are posted when the schedule reaches them.
* Replicated parameters' gradients are summed inside the stage's group only, once per
  iteration (the micro-batches before the last accumulate without communicating).

The loss is the sum of the micro-batches' losses, so the model's loss must be a sum
over samples (``reduction="sum"``): a mean would be averaged per micro-batch
(:class:`~hapd.errors.PlanError` naming the node otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, fx

from hapd.compiler.pipeline import stage_search as search
from hapd.compiler.driver import compile as compile_plan
from hapd.ir.export import export
from hapd.ir.lower import lower
from hapd.ir.shapes import program_batch
from hapd.compiler.options import CompileOptions
from hapd.compiler.pipeline.stage_search import PipelinePlan
from hapd.compiler.plan import Plan
from hapd.compiler.pipeline.stages import GRAD_PREFIX, Boundary, Stage, split_program
from hapd.errors import PlanError
from hapd.spmd import collectives, group_sockets
from hapd.spmd.layout import IDENTITY, REDUCE, gather_dim
from hapd.spmd.duplicas import loss_counts
from hapd.spmd.rank import RankModule
from hapd.spmd.random.random_ops import (
    COUNTER_RNG,
    STEP,
    DrawParts,
    advance_step,
    is_random,
    random_batch_dims,
    set_part,
)
from hapd.spmd.rewrite import distribute

Box = tuple[tuple[int, int], ...]
"""A block of a full tensor: (start, length) along every dim."""


# --------------------------------------------------------------------------------------
# Resharding between two groups
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Holding:
    """How the ranks of one group hold a tensor: ``layout`` and, for ``Gather(d)``, the
    per-rank lengths along ``d``."""

    layout: str
    lengths: tuple[int, ...] | None
    ranks: int

    def box(self, shape: Sequence[int], r: int) -> Box:
        """The block of the full tensor rank ``r`` of the group holds."""
        d = gather_dim(self.layout)
        out = [(0, n) for n in shape]
        if d is not None:
            assert self.lengths is not None
            out[d] = (sum(self.lengths[:r]), self.lengths[r])
        return tuple(out)


def _intersect(a: Box, b: Box) -> Box | None:
    out = []
    for (s1, n1), (s2, n2) in zip(a, b):
        lo, hi = max(s1, s2), min(s1 + n1, s2 + n2)
        if hi <= lo:
            return None
        out.append((lo, hi - lo))
    return tuple(out)


def transfers(shape: Sequence[int], src: Holding, dst: Holding) -> list[tuple[int, int, Box]]:
    """``(source rank, destination rank, block)`` of every message that gives each
    destination rank its piece: each block a ``Gather`` or ``Reduce`` source holds goes
    to every destination rank that needs part of it (``Reduce`` parts are summed by the
    receiver); a block every source holds (``Identity``) comes from one of them, spread
    over the sources by destination rank; partial sums received as partial sums go
    whole, source rank ``r`` to destination rank ``r mod n`` (summed there; ranks sent
    nothing hold zeros): the parts still add up to the tensor. Empty blocks are not
    sent."""
    if src.layout == REDUCE and dst.layout == REDUCE:
        whole = tuple((0, n) for n in shape)
        return [] if any(n == 0 for n in shape) else [(r, r % dst.ranks, whole) for r in range(src.ranks)]
    out = []
    for q in range(dst.ranks):
        need = dst.box(shape, q)
        if any(n == 0 for _, n in need):
            continue
        senders = [q % src.ranks] if src.layout == IDENTITY else range(src.ranks)
        for r in senders:
            block = _intersect(src.box(shape, r), need)
            if block is not None:
                out.append((r, q, block))
    return out


def _local(block: Box, holding_box: Box) -> tuple[slice, ...]:
    return tuple(slice(s - h, s - h + n) for (s, n), (h, _) in zip(block, holding_box))


# --------------------------------------------------------------------------------------
# One rank's stage
# --------------------------------------------------------------------------------------


@dataclass
class _Flow:
    """One boundary as this rank's stage sees it."""

    boundary: Boundary
    index: int
    """Position of the boundary among all boundaries (message tags)."""
    holding: Holding
    """How this stage's group holds it (sent: the layout the stage computes it in;
    received: the layout its plan takes it in)."""


def _micro_batch_draws(stages: Sequence[Stage], m: int, batch_dims: Sequence[int | None]) -> DrawParts:
    """Where each random op of the stages (in order) holds a micro-batch's samples: dim 0
    of batch-first tensors (:func:`~hapd.spmd.random.random_ops.random_batch_dims` at
    the micro-batch read from the first stage's inputs), so that the ``m`` micro-batches
    draw the whole batch's masks."""
    first = stages[0]
    micro = program_batch(first.program, [batch_dims[i] for i in first.user_inputs])
    return DrawParts(m, tuple(d for st in stages for d in random_batch_dims(st.program, micro)))


class PipelineRank:
    """This rank's stage of a pipeline and the 1F1B iteration (see the module docstring).

    ``stages``/``boundaries``: :func:`hapd.compiler.pipeline.stages.split_program` of the program
    exported for one micro-batch; ``plans[s]``: stage ``s``'s plan for ``groups[s]``
    (global ranks, in the group's rank order); ``micro_batches``: ``m``; ``batch_dims``:
    each user input's batch dim. Every rank of the world must construct it (it creates
    one process group per stage)."""

    def __init__(self, stages: Sequence[Stage], boundaries: dict[str, Boundary], plans: Sequence[Plan],
                 groups: Sequence[Sequence[int]], micro_batches: int, batch_dims: Sequence[int | None],
                 *, device: torch.device | str | None = None, mean_loss: bool = False,
                 draw_parts: DrawParts | None = None):
        if not (len(stages) == len(plans) == len(groups)):
            raise PlanError(f"{len(stages)} stages, {len(plans)} plans and {len(groups)} groups")
        if micro_batches < 1:
            raise PlanError(f"micro_batches must be at least 1, not {micro_batches}")
        rank = dist.get_rank()
        flat = [r for g in groups for r in g]
        if sorted(flat) != list(range(dist.get_world_size())):
            raise PlanError(f"the stage groups {[list(g) for g in groups]} do not cover ranks 0..{dist.get_world_size() - 1} once")
        self.groups = [list(g) for g in groups]
        self.plans = list(plans)
        with group_sockets.tracked():  # shut down at once when a rank leaves a broken job
            process_groups = [dist.new_group(g) for g in self.groups]  # every rank, same order
        self.s = next(i for i, g in enumerate(self.groups) if rank in g)
        self.stage = stages[self.s]
        self.stages = list(stages)
        self.m = micro_batches
        self.batch_dims = tuple(batch_dims)
        self.group = process_groups[self.s]
        self.local = self.groups[self.s].index(rank)
        plan = plans[self.s]
        if plan.overlap:
            raise PlanError("a stage's plan cannot run overlapped duplicas")
        # micro-batches draw as parts of one batch (random_ops.set_part), each its rows of the
        # whole batch's masks (draw_parts: the micro-batch program's random ops, this stage's
        # after the earlier stages'): hapd's generator even where a stage runs on one device
        before = sum(sum(map(is_random, st.program.graph.nodes)) for st in stages[:self.s])
        mine = sum(map(is_random, self.stage.program.graph.nodes))
        stage_draw = (draw_parts or _micro_batch_draws(stages, micro_batches, batch_dims)).stage(before, mine)
        self.module: RankModule = distribute(self.stage.program, plan, self.local, world=len(self.groups[self.s]),
                                             group=self.group, device=device, check_graph=False, rng=COUNTER_RNG,
                                             draw_parts=stage_draw)
        names = [n for n, _ in self.module.hapd_inputs]
        n_users, n_recv = len(self.stage.user_inputs), len(self.stage.received)
        self.user_names = names[:n_users]
        self.placeholders = [n for n in self.module.graph.nodes if n.op == "placeholder"]
        grads = self.placeholders[n_users + n_recv:]
        self.post = _depending_on(self.module.graph, set(grads))
        output = next(n for n in self.module.graph.nodes if n.op == "output")
        self.counts: list[fx.Node] = []
        """The last stage's loss divisors (a mean over counted targets; empty: a sum)."""
        if self.stage.last:
            self.counts = loss_counts(self.module, output.args[0])
            if self.counts and not mean_loss:
                raise PlanError("pipeline micro-batches add their losses; the loss is a mean over counted targets "
                                "(use reduction='sum')")
        self.count = torch.ones(())
        """After :meth:`step`, on the last stage: the targets the micro-batches' means
        counted together (1 for a sum)."""
        index = {name: i for i, name in enumerate(boundaries)}
        view = self.module.hapd_view
        self.received = [_Flow(boundaries[b], index[b], _holding(view, b, layout, len(self.groups[self.s])))
                         for b, (_, layout) in zip(self.stage.received, self.module.hapd_inputs[n_users:n_users + n_recv])]
        self.sent, self.sent_values = [], []
        for b, g in zip(self.stage.sent, grads):
            self.sent.append(_Flow(boundaries[b], index[b], _sent_holding(plan, b, len(self.groups[self.s]))))
            self.sent_values.append(_sent_value(self.module, g, self.post, b))
        self.grad_inputs = [_holding(view, n, layout, len(self.groups[self.s]))
                            for n, layout in self.module.hapd_inputs[n_users + n_recv:]]
        self.tied = _tied_groups(stages, self.groups)
        # how every other stage holds the boundaries this stage exchanges (all ranks know all plans)
        self._peer_holdings = _peer_holdings(stages, plans, self.groups)
        self.n_boundaries = len(boundaries)

    # -- messages ------------------------------------------------------------------------

    def _tag(self, flow: _Flow, mb: int, backward: bool) -> int:
        return (mb * self.n_boundaries + flow.index) * 2 + int(backward)

    def _send(self, value: Tensor, flow: _Flow, peers: int, peer_holding: Holding, mb: int, backward: bool,
              pending: list) -> None:
        """Send this rank's blocks of ``value`` (held as ``flow.holding``) to stage
        ``peers``'s ranks holding it as ``peer_holding``."""
        shape = flow.boundary.shape
        mine = flow.holding.box(shape, self.local) if not backward else _grad_holding(flow.holding).box(shape, self.local)
        src = flow.holding if not backward else _grad_holding(flow.holding)
        for r, q, block in transfers(shape, src, peer_holding):
            if r != self.local:
                continue
            piece = value.detach()[_local(block, mine)].contiguous()
            pending.append(dist.isend(piece, self.groups[peers][q], tag=self._tag(flow, mb, backward)))

    def _receive(self, flow: _Flow, peers: int, peer_holding: Holding, into: Tensor, mb: int, backward: bool) -> list:
        """Post receives of this rank's blocks from stage ``peers`` (holding it as
        ``peer_holding``) into ``into`` (held as this rank's ``flow.holding`` or, for
        gradients, the gradient input's layout); returns (work, buffer, slices, add)."""
        shape = flow.boundary.shape
        mine_holding = flow.holding if not backward else self._grad_input_holding(flow)
        mine = mine_holding.box(shape, self.local)
        posted = []
        for r, q, block in transfers(shape, peer_holding, mine_holding):
            if q != self.local:
                continue
            buf = into.new_empty([n for _, n in block])
            work = dist.irecv(buf, self.groups[peers][r], tag=self._tag(flow, mb, backward))
            posted.append((work, buf, _local(block, mine), peer_holding.layout == REDUCE))
        return posted

    def _grad_input_holding(self, flow: _Flow) -> Holding:
        return self.grad_inputs[self.sent.index(flow)]

    @staticmethod
    def _complete(posted: list, into: Tensor) -> Tensor:
        for work, buf, where, add in posted:
            work.wait()
            if add:
                into[where] += buf
            else:
                into[where] = buf
        return into

    # -- one micro-batch -----------------------------------------------------------------

    def _inputs(self, batch: Sequence[Tensor], mb: int) -> list[Tensor]:
        """This rank's pieces of micro-batch ``mb``'s inputs that the stage reads."""
        view = self.module.hapd_view
        out = []
        for name, k in zip(self.user_names, self.stage.user_inputs):
            t, d = batch[k], self.batch_dims[k]
            if d is not None:
                size = t.shape[d] // self.m
                t = t.narrow(d, mb * size, size)
            layout = dict(self.module.hapd_inputs)[name]
            out.append(view.local_value(name, layout, t))
        return out

    def _post_forward(self, mb: int) -> list[tuple[Tensor, list]]:
        """Post the receives of micro-batch ``mb``'s boundaries: (buffer, messages) each."""
        out = []
        for flow in self.received:
            into = torch.zeros(_local_shape(flow.boundary.shape, flow.holding, self.local), dtype=flow.boundary.dtype)
            peer = self._peer_holdings[(flow.boundary.name, flow.boundary.producer)]
            out.append((into, self._receive(flow, flow.boundary.producer, peer, into, mb, backward=False)))
        return out

    def _post_backward(self, mb: int) -> list[tuple[Tensor, list]]:
        """Post the receives of micro-batch ``mb``'s boundary gradients (from every stage
        that reads each boundary; summed as they arrive)."""
        out = []
        for flow, holding in zip(self.sent, self.grad_inputs):
            into = torch.zeros(_local_shape(flow.boundary.shape, holding, self.local), dtype=flow.boundary.dtype)
            posted = []
            for consumer in flow.boundary.consumers:
                peer = _grad_holding(self._peer_holdings[(flow.boundary.name, consumer)])
                posted += [(w, b, where, True) for w, b, where, _ in self._receive(flow, consumer, peer, into, mb,
                                                                                 backward=True)]
            out.append((into, posted))
        return out

    def _forward(self, batch: Sequence[Tensor], mb: int, pending: list, posted: list) -> dict:
        received = [self._complete(msgs, into).requires_grad_(True) for into, msgs in posted]
        if hasattr(self.module, STEP):
            set_part(self.module, mb)  # each micro-batch draws masks of its own
        env: dict[fx.Node, Any] = {}
        args = self._inputs(batch, mb) + received
        interp = fx.Interpreter(self.module)
        for node, value in zip(self.placeholders, args):
            env[node] = value
        for node in self.module.graph.nodes:
            if node.op in ("placeholder", "output") or node in self.post:
                continue
            env[node] = _run(interp, env, node)
        for flow, value in zip(self.sent, self.sent_values):
            for consumer in flow.boundary.consumers:
                self._send(env[value], flow, consumer, self._peer_holdings[(flow.boundary.name, consumer)], mb,
                           backward=False, pending=pending)
        return {"env": env, "received": received}

    def _backward(self, state: dict, mb: int, pending: list, sync: bool, posted: list) -> Tensor:
        env = state.pop("env")
        interp = fx.Interpreter(self.module)
        for (into, msgs), node in zip(posted, self.placeholders[len(self.placeholders) - len(self.sent):]):
            env[node] = self._complete(msgs, into)
        output = None
        for node in self.module.graph.nodes:
            if node.op == "output":
                output = env[node.args[0]]
            elif node in self.post and node.op != "placeholder":
                env[node] = _run(interp, env, node)
        assert output is not None
        # a mean over counted targets is seeded with its count: the gradient of the
        # micro-batch's sum, which step's caller divides by the whole batch's count
        seed = torch.ones_like(output)
        for count in self.counts:
            seed = seed * env[count].to(output.dtype).reshape(output.shape)
        self.module.hapd_sync.reset()
        if output.requires_grad:  # else a frozen stage that reads no boundary: nothing in it takes a gradient
            with contextlib.nullcontext() if sync else self.module.hapd_sync.no_sync():
                output.backward(seed)
        for flow, leaf in zip(self.received, state["received"]):
            grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            self._send(grad, flow, flow.boundary.producer,
                       self._peer_holdings[(flow.boundary.name, flow.boundary.producer)], mb, backward=True,
                       pending=pending)
        if not self.stage.last:
            return output.detach() * 0
        if self.counts:  # a mean's counted targets add up; a sum's divisor stays 1
            self.count = self.count + seed.detach().to(self.count.dtype)
        return output.detach() * seed.detach()

    # -- an iteration --------------------------------------------------------------------

    def schedule(self) -> list[tuple[str, int]]:
        """This stage's 1F1B order: ``("F", mb)`` and ``("B", mb)``."""
        warm = min(len(self.groups) - 1 - self.s, self.m)
        order = [("F", i) for i in range(warm)]
        for i in range(self.m - warm):
            order += [("F", warm + i), ("B", i)]
        order += [("B", i) for i in range(self.m - warm, self.m)]
        return order

    def step(self, *batch: Tensor) -> Tensor:
        """One iteration on the global batch (the same on every rank): forward and
        backward of every micro-batch; returns this rank's part of the loss (zero
        outside the last stage). Parameters then hold their exact gradients.

        For a mean over counted targets (``mean_loss``), the loss part and the
        gradients are those of the micro-batches' *sums*: divide both by the whole
        batch's count, :attr:`count` on the last stage (:meth:`batch_count` gives it
        to every rank)."""
        for k, d in enumerate(self.batch_dims):
            if d is not None and batch[k].shape[d] % self.m:
                raise PlanError(f"input {k}: batch {batch[k].shape[d]} does not split into {self.m} micro-batches")
        if hasattr(self.module, STEP):
            advance_step(self.module)  # the forwards run through an interpreter: no pre-hook
        pending: list = []
        states: dict[int, dict] = {}
        total = torch.zeros(())
        self.count = torch.zeros(()) if self.counts else torch.ones(())
        order = self.schedule()
        posted: dict[int, list] = {}

        def post(i: int) -> None:  # receives are posted one step ahead: they arrive while this rank computes
            kind, mb = order[i]
            posted[i] = self._post_forward(mb) if kind == "F" else self._post_backward(mb)

        post(0)
        for i, (kind, mb) in enumerate(order):
            if i + 1 < len(order):
                post(i + 1)
            if kind == "F":
                states[mb] = self._forward(batch, mb, pending, posted.pop(i))
            else:
                total = total + self._backward(states.pop(mb), mb, pending, mb == self.m - 1, posted.pop(i))
        for work in pending:
            work.wait()
        self._sum_tied()
        return total

    def batch_count(self) -> Tensor:
        """The last step's :attr:`count`, on every rank (a broadcast from the last
        stage's first rank). Collective."""
        count = self.count.clone().to(torch.float64)
        dist.broadcast(count, src=self.groups[-1][0])
        return count

    @torch.no_grad()
    def _sum_tied(self) -> None:
        """A parameter several stages use (tied weights) gets the sum of their
        gradients, in two levels as the compiler prices it (the profile's ``grad_sync``
        link between hosts): each stage's group first holds its whole part (replicated:
        summed inside the group already; split: its pieces gathered), the stages' first
        ranks sum it among themselves -- only they cross the link between groups, once
        each -- and each passes the sum to its group, whose ranks keep their pieces."""
        rank = dist.get_rank()
        leader = self.groups[self.s][0]
        for target, (members, leaders) in self.tied.items():
            if rank not in members:
                continue
            param = self.module.get_parameter(target)
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            tensor, layout = self.module.hapd_params[target]
            d = gather_dim(layout)
            if d is None and layout != IDENTITY:
                raise PlanError(f"tied parameter {target} is held as {layout}", node=target)
            whole = param.grad
            if d is not None:
                lengths = self.module.hapd_view.lengths(tensor, d)
                whole = collectives.all_gather(param.grad, d, lengths, group=self.group)
            total = whole.clone()
            if rank == leader:
                dist.all_reduce(total, group=leaders)
            if len(self.groups[self.s]) > 1:
                dist.broadcast(total, src=leader, group=self.group)
            if d is not None:
                start, length = self.module.hapd_view.offset(tensor, d)
                total = total.narrow(d, start, length)
            param.grad.copy_(total)

    def parameters(self):
        return self.module.parameters()

    def named_parameters(self):
        return self.module.named_parameters()


def _tied_groups(stages: Sequence[Stage], groups: Sequence[Sequence[int]]) -> dict[str, tuple[list[int], Any]]:
    """Parameter → (ranks of every stage that uses it, the process group of those
    stages' first ranks, which sum its gradient across the stages), for the parameters
    several stages use. Every rank creates every group, in the same order."""
    holders: dict[str, list[int]] = {}
    for s, stage in enumerate(stages):
        for target in stage.parameters:
            holders.setdefault(target, []).append(s)
    out = {}
    for target in sorted(t for t, h in holders.items() if len(h) > 1):
        members = sorted(r for s in holders[target] for r in groups[s])
        with group_sockets.tracked():  # shut down at once when a rank leaves a broken job
            out[target] = (members, dist.new_group(sorted(groups[s][0] for s in holders[target])))
    return out


def _run(interp: fx.Interpreter, env: dict, node: fx.Node) -> Any:
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
    return getattr(interp, node.op)(node.target, args, kwargs)


def _depending_on(graph: fx.Graph, roots: set[fx.Node]) -> set[fx.Node]:
    out = set(roots)
    for node in graph.nodes:
        if any(a in out for a in node.all_input_nodes):
            out.add(node)
    return out


def _holding(view: Any, tensor: str, layout: str, ranks: int) -> Holding:
    d = gather_dim(layout)
    return Holding(layout, tuple(view.lengths(tensor, d)) if d is not None else None, ranks)


def _grad_holding(h: Holding) -> Holding:
    """How a group holds the gradient of a tensor it holds as ``h``: an ``Identity``
    tensor's gradient is a partial sum on each rank."""
    return Holding(REDUCE, None, h.ranks) if h.layout == IDENTITY else h


def _local_shape(shape: Sequence[int], h: Holding, r: int) -> list[int]:
    return [n for _, n in h.box(shape, r)]


def _product(plan: Plan, boundary: str) -> dict:
    """The input of the stage's surrogate product ``b · grad_of_b`` that is the boundary
    ``b`` (its tensor name in the stage's plan, where re-export may have renamed it, and
    its layout there)."""
    grad = GRAD_PREFIX + boundary
    for step in plan.program["steps"]:
        names = [i["tensor"] for i in step["inputs"]]
        if step["op"] == "aten.mul.Tensor" and grad in names:
            return next(i for i in step["inputs"] if i["tensor"] != grad)
    raise PlanError(f"stage plan: no product of boundary {boundary} with its gradient input", node=boundary)


def _sent_holding(plan: Plan, boundary: str, ranks: int) -> Holding:
    entry = _product(plan, boundary)
    d = gather_dim(entry["layout"])
    return Holding(entry["layout"], tuple(plan.lengths_of(entry["tensor"], d)) if d is not None else None, ranks)


def _sent_value(module: RankModule, grad: fx.Node, post: set[fx.Node], boundary: str) -> fx.Node:
    """The rank-graph node holding this rank's piece of ``boundary`` as the surrogate
    product reads it: the operand of the first product downstream of the gradient input
    ``grad`` that does not depend on it."""
    stack, seen = [grad], set()
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and user.target is torch.ops.aten.mul.Tensor:
                other = [a for a in user.args if isinstance(a, fx.Node) and a not in post]
                if other:
                    return other[0]
            stack.append(user)
    raise PlanError(f"stage program: no product of boundary {boundary} with its gradient input", node=boundary)


def _peer_holdings(stages: Sequence[Stage], plans: Sequence[Plan], groups: Sequence[Sequence[int]]) -> dict:
    """(boundary, stage) → how that stage's group holds it: the receiving stages as
    their plans take it, the sending stage as its surrogate product reads it."""
    out = {}
    for s, (stage, plan) in enumerate(zip(stages, plans)):
        sources = {src["tensor"]: src["layout"] for step in plan.program["steps"] for src in step["sources"]
                   if src["kind"] == "input"}
        for b in stage.received:
            if b not in sources:
                raise PlanError(f"stage {s}'s plan does not read boundary {b}", node=b)
            d = gather_dim(sources[b])
            out[(b, s)] = Holding(sources[b], tuple(plan.lengths_of(b, d)) if d is not None else None, len(groups[s]))
        for b in stage.sent:
            out[(b, s)] = _sent_holding(plan, b, len(groups[s]))
    return out



# --------------------------------------------------------------------------------------
# From a model and a plan with a pipeline
# --------------------------------------------------------------------------------------


def _micro_inputs(inputs: Sequence[Tensor], batch_dims: Sequence[int | None], m: int) -> tuple[Tensor, ...]:
    out = []
    for t, d in zip(inputs, batch_dims):
        if d is None:
            out.append(t)
            continue
        if t.shape[d] % m:
            raise PlanError(f"batch {t.shape[d]} does not split into {m} micro-batches")
        out.append(t.narrow(d, 0, t.shape[d] // m))
    return tuple(out)


def compile_pipeline(model: torch.nn.Module, inputs: Sequence[Tensor], batch_dims: Sequence[int | None],
                     profile: Any, options: Any = None, *, name: str | None = None) -> Any:
    """The plan for ``model`` on the global batch ``inputs`` with pipelines in the space
    (``options.pipeline = "auto"``): the model exported at the global batch and at each
    micro-batch size the search prices (:func:`hapd.compiler.pipeline.stage_search.micro_batch_counts`).
    Runs on one process (rank 0 of a job; the caller sends the bytes to the others)."""
    options = dataclasses.replace(options or CompileOptions(), pipeline="auto")
    name = name or type(model).__name__

    def graph(m: int) -> Any:
        program = export(model, _micro_inputs(inputs, batch_dims, m), batch_dims=batch_dims)
        return lower(program, name=name)

    batch = next((t.shape[d] for t, d in zip(inputs, batch_dims) if d is not None), 1)
    counts = [m for m in search.micro_batch_counts(batch) if m > 1]
    return compile_plan(graph(1), profile, options, micro_graphs=[graph(m) for m in counts])


def build_pipeline(model: torch.nn.Module, inputs: Sequence[Tensor], batch_dims: Sequence[int | None],
                   plan: Plan, profile: Any, options: Any = None, *, device: torch.device | str | None = None,
                   mean_loss: bool = False, program: Any = None) -> PipelineRank:
    """This rank's :class:`PipelineRank` for a plan whose ``pipeline`` was chosen: the
    model's program for one micro-batch (``program``, e.g. cut from its symbolic export;
    default: the model exported for one) cut at the pipeline's cuts; rank 0 compiles
    every stage's plan for its group (``profile.subset``; ``options`` without pipelines)
    and sends them to the other ranks. Collective."""
    doc = plan.pipeline
    if doc is None:
        raise PlanError("the plan runs no pipeline")
    found = PipelinePlan.from_doc(doc)
    groups = [list(s.ranks) for s in found.stages]
    m = found.micro_batches
    if program is None:
        program = export(model, _micro_inputs(inputs, batch_dims, m), batch_dims=batch_dims)
    stages, boundaries = split_program(program, found.cuts)
    stage_options = dataclasses.replace(options or CompileOptions(), pipeline="off", overlap=False)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        box = [[compile_plan(lower(st.program, name=f"stage{st.index}"), profile.subset(g), stage_options).to_bytes()
                for st, g in zip(stages, groups)]]
    dist.broadcast_object_list(box, src=0)
    plans = [Plan.from_bytes(b) for b in box[0]]
    return PipelineRank(stages, boundaries, plans, groups, m, batch_dims, device=device, mean_loss=mean_loss)

__all__ = ["Holding", "PipelineRank", "build_pipeline", "compile_pipeline", "transfers"]
