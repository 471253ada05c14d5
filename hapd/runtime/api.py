"""The public training API: :func:`parallelize` a model, train it with any optimizer.

    import hapd, torch
    module = hapd.parallelize(model, example_batch)        # collective: every rank calls it
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    for batch in hapd.loader(dataset, module):             # this rank's samples only
        optimizer.zero_grad(set_to_none=True)
        module(*batch).backward()                          # this rank's part of the loss
        module.clip_grad_norm_(1.0)
        optimizer.step()
    torch.save(module.full_state_dict(), "model.pt")       # the single-device names and shapes

The model's ``forward`` returns the scalar loss of a batch (the labels among its inputs),
as for :func:`hapd.export`. :func:`parallelize` exports it for ``example_inputs`` (the
global batch of a training step), gets a plan (:func:`obtain_plan`: a given plan, the
daemon at ``$HAPD_DAEMON``, or a compile on rank 0; every other rank receives its bytes)
and returns this rank's :class:`ParallelModule`. With one process and no process group
it runs the plan for one device.

**Eval and other batch sizes.** ``module.eval()`` forwards are the model's eval forward
(dropout is the identity, batch norm uses its running statistics), and a global batch of
another size (the short last batch of an epoch, a validation batch) runs as one, with the
same parameters: on first need the module exports the model again for that mode and
batch shape, gets a plan for it through :func:`obtain_plan` (the daemon's cache when
there is one) that holds every parameter as the training plan does — every op the two
graphs share is forced to the training plan's rule, at its ratios
(:func:`aligned_force`), and the layouts are checked — and distributes it on the
training program's parameter objects, buffers and gradient sync
(:func:`hapd.runtime.rewrite.distribute` with ``shared=``), so the optimizer, its
state and the gradients are the same objects whichever program runs. These programs
are kept per (mode, batch shapes); building one is collective (every rank gets there
together, as SPMD code does). A forward runs the program of the current mode for the
global batch the inputs were cut from: :meth:`ParallelModule.shard_inputs` and
:func:`hapd.loader` say which. ::

    module.eval()
    with torch.no_grad():
        loss = module.global_loss(module(*module.shard_inputs(*val_batch)))   # the single-device eval loss
    module.train()                                                             # back to the training program

:func:`obtain_plan` is also how ``worker.py`` gets its plan, so both say where a plan
came from and how long it took (``plan: daemon cache hit, 2 ms``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hapd.compiler.driver import CompileOptions
from hapd.compiler.lower import GraphIR
from hapd.compiler.plan import Plan
from hapd.errors import HapdError, OptionsError, PlanError, UnsupportedOpError
from hapd.profile.schema import Profile, estimated_profile, load_profile
from hapd.runtime.layout import IDENTITY, gather_dim
from hapd.runtime.rank import RankModule
from hapd.runtime.rewrite import distribute, global_loss
from hapd.runtime.held import Held, whole
from hapd.runtime.weights import Weights, WeightSource, rank_piece, weight_source

DAEMON_PING_S = 2.0
"""How long rank 0 waits for the daemon to answer a ping before compiling itself."""

DAEMON_COMPILE_S = 600.0
"""How long rank 0 waits for the daemon's plan."""

MODE_DEPENDENT_OPS = frozenset({
    "aten.native_dropout.default", "aten.dropout.default", "aten.feature_dropout.default",
    "aten.alpha_dropout.default", "aten.feature_alpha_dropout.default",
    "aten._native_batch_norm_legit_functional.default", "aten._native_batch_norm_legit.default",
    "aten.native_batch_norm.default", "aten.batch_norm.default", "aten._batch_norm_with_update_functional.default",
    "aten._batch_norm_with_update.default", "aten.rrelu_with_noise.default",
})
"""Ops that compute differently in ``eval()`` mode: the exported (training-mode) graph
cannot stand for the model's eval forward where they occur (the model is exported again
in eval mode)."""

SAME_OP_IN_EVAL = {
    "aten._native_batch_norm_legit_functional": "aten.batch_norm",
    "aten._native_batch_norm_legit_no_training": "aten.batch_norm",
    "aten._native_batch_norm_legit": "aten.batch_norm",
    "aten.native_batch_norm": "aten.batch_norm",
}
"""Graph ops that are one op of the model in training and in eval mode (batch norm
with batch statistics and with running ones), for :func:`aligned_force`."""

EVAL_RULE = {"data-parallel-synced": "data-parallel"}
"""A training-mode rule -> the rule of the same op in eval mode that holds its operands
alike (batch norm's batch split with synchronized statistics -> the batch split on
running statistics)."""

Shapes = tuple[tuple[int, ...], ...]
"""The shapes of a global batch's inputs, in forward order."""


# --------------------------------------------------------------------------------------
# The plan: given, from the daemon, or compiled on rank 0
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanSource:
    """A plan, where it came from and how long getting it took (on rank 0)."""

    plan: Plan
    origin: str
    """``"daemon cache hit"``, ``"daemon LP-only re-plan"``, ``"compiled by the daemon"``,
    ``"compiled on rank 0"`` (with the reason the daemon was not used, if one was
    named), ``"file PATH"`` or ``"given"``."""
    seconds: float

    def describe(self) -> str:
        """``plan: daemon cache hit, 2 ms``."""
        return f"plan: {self.origin}, {_format_duration(self.seconds)}"


def _format_duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


_DAEMON_ORIGIN = {"hit": "daemon cache hit", "lp-only": "daemon LP-only re-plan", "miss": "compiled by the daemon"}


def daemon_key_path() -> Path:
    """The key file to sign daemon requests with: ``$HAPD_KEY_FILE`` (a daemon sets it
    for the ranks it launches: its own key, wherever its state lies), else
    ``$HAPD_HOME/key``."""
    from hapd.serve.keys import default_key_path

    return default_key_path()


def plan_from_daemon(graph: GraphIR, profile: Profile, options: CompileOptions, *,
                     address: str | None = None) -> tuple[bytes, str]:
    """``(plan bytes, origin)`` from the daemon at ``address`` (default
    ``$HAPD_DAEMON``): a cache hit, an LP-only re-plan of a cached program, or a compile
    there. Raises :class:`~hapd.errors.HapdError` when there is no daemon, it does not
    answer, or it refuses."""
    import json

    from hapd.serve.client import Client

    address = address or os.environ.get("HAPD_DAEMON")
    if not address:
        raise HapdError("HAPD_DAEMON is not set")
    profile_doc = json.loads(profile.to_json())
    with Client(address, daemon_key_path(), DAEMON_PING_S) as client:
        client.ping()
        data, cache = client.compile(graph.data, "hapg", profile=profile_doc, options=options.key(),
                                     timeout_s=DAEMON_COMPILE_S)
    return bytes(data), _DAEMON_ORIGIN.get(cache, f"daemon ({cache})")


def _plan_on_rank_zero(graph: GraphIR, profile: Profile, options: CompileOptions, use_daemon: bool) -> tuple[bytes, str]:
    """Rank 0's plan bytes: from the daemon when one answers, else compiled here."""
    from hapd.compiler.driver import compile as compile_plan

    why = ""
    if use_daemon and os.environ.get("HAPD_DAEMON"):
        try:
            return plan_from_daemon(graph, profile, options)
        except HapdError as exc:
            why = f" (daemon at {os.environ['HAPD_DAEMON']}: {type(exc).__name__}: {str(exc)[:200]})"
    return compile_plan(graph, profile, options).to_bytes(), f"compiled on rank 0{why}"


def _src_rank(group: Any) -> int:
    """The global rank of the group's rank 0."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def obtain_plan(graph: GraphIR, *, world: int, rank: int, profile: Profile | str | Path | Mapping | None = None,
                options: CompileOptions | Mapping[str, Any] | None = None, plan: Plan | str | Path | bytes | None = None,
                group: Any = None, use_daemon: bool = True) -> PlanSource:
    """The job's plan for ``graph``; collective when ``world > 1`` (every rank calls it).

    ``plan`` (a :class:`Plan`, its bytes or a ``.hplan`` path) is used as is. Otherwise
    rank 0 asks the daemon at ``$HAPD_DAEMON`` (``use_daemon``) and compiles itself when
    none answers, for ``profile`` (default: an estimated homogeneous profile of
    ``world`` devices) and ``options``; the bytes are broadcast to every rank, so ranks
    never synthesize on their own. Every rank checks the plan is for ``graph`` and
    ``world``; :class:`~hapd.errors.PlanError` otherwise, and on every rank when rank 0
    failed to get one.
    """
    start = time.perf_counter()
    if plan is not None:
        found, origin = _given_plan(plan)
        source = PlanSource(found, origin, time.perf_counter() - start)
    else:
        box: list[Any] = [None, None, "", 0.0]  # bytes, error, origin, seconds
        if rank == 0:
            try:
                data, origin = _plan_on_rank_zero(graph, job_profile(profile, world), compile_options(options), use_daemon)
                box = [data, None, origin, time.perf_counter() - start]
            except HapdError as exc:
                box = [None, f"{type(exc).__name__}: {exc}", "", 0.0]
        if world > 1:
            dist.broadcast_object_list(box, src=_src_rank(group), group=group)
        data, error, origin, seconds = box
        if error is not None:
            raise PlanError(f"rank 0 could not get a plan: {error}")
        source = PlanSource(Plan.from_bytes(data), origin, float(seconds))
    _check_plan_fits(source.plan, graph, world)
    return source


def _given_plan(plan: Plan | str | Path | bytes) -> tuple[Plan, str]:
    if isinstance(plan, Plan):
        return plan, "given"
    if isinstance(plan, (bytes, bytearray)):
        return Plan.from_bytes(bytes(plan)), "given"
    return Plan.load(plan), f"file {plan}"


def _check_plan_fits(plan: Plan, graph: GraphIR, world: int) -> None:
    if plan.key.get("graph_id") != graph.graph_id:
        raise PlanError(f"the plan was compiled for graph {str(plan.key.get('graph_id'))[:12]}…, this program is "
                        f"{graph.graph_id[:12]}… (a different model, batch size or torch version)")
    devices = int(plan.program["devices"])
    if devices != world:
        raise PlanError(f"the plan is for {devices} devices, this job has {world} ranks")


def job_profile(profile: Profile | str | Path | Mapping | None, world: int) -> Profile:
    """``profile`` loaded for ``world`` ranks, or an estimated homogeneous one."""
    if profile is None:
        return estimated_profile(world, name=f"estimated-{world}")
    return load_profile(profile, world_size=world)


def compile_options(options: CompileOptions | Mapping[str, Any] | None) -> CompileOptions:
    """``options`` as :class:`CompileOptions` (a map gives its fields)."""
    if options is None:
        return CompileOptions()
    if isinstance(options, CompileOptions):
        return options
    try:
        fields = dict(options)
        if fields.get("ratios") is not None:
            fields["ratios"] = tuple(fields["ratios"])
        return CompileOptions(**fields)
    except TypeError as exc:
        raise OptionsError(f"bad compile options: {exc}", field="options") from exc


# --------------------------------------------------------------------------------------
# parallelize
# --------------------------------------------------------------------------------------


def parallelize(model: nn.Module, example_inputs: Sequence[Tensor], *,
                profile: Profile | str | Path | Mapping | None = None, plan: Plan | str | Path | bytes | None = None,
                options: CompileOptions | Mapping[str, Any] | None = None, batch_dims: Sequence[int | None] | None = None,
                name: str | None = None, device: torch.device | str | None = None, group: Any = None,
                hosts: Any = "auto", use_daemon: bool = True, verbose: bool = True,
                weights: Weights | None = None, overlap: str = "auto") -> "ParallelModule":
    """This rank's :class:`ParallelModule` of ``model``, trained on batches shaped like
    ``example_inputs`` (the *global* batch, the same on every rank). Collective.

    Exports ``model`` (``batch_dims``: each input's batch dim, default 0), gets the plan
    (:func:`obtain_plan`: ``plan``, or the daemon's or rank 0's for ``profile`` and
    ``options``) and distributes it (:func:`hapd.distribute`). Every rank must build
    ``model`` with the same parameters (the same seed, or a loaded state dict): each
    keeps only its pieces. ``device``: where this rank's pieces live (default: the
    current CUDA device with NCCL, else where the model's parameters are). ``hosts``:
    ``"auto"`` sums replicated gradients in two levels across hosts when the ranks of
    several hosts share it (torchrun's ``GROUP_RANK``); None: one flat all-reduce.
    With ``verbose``, rank 0 prints where the plan came from and how long it took.

    Joins the job torchrun started when ``WORLD_SIZE`` is set and no process group
    exists; one process without either runs the plan for one device.

    ``weights``: where this rank reads its pieces of the parameters and buffers
    instead of ``model`` (:mod:`hapd.runtime.weights`: :func:`hapd.module_init`, a
    safetensors file, a checkpoint), one tensor at a time; needed when ``model`` is on
    the meta device (too large for one host: only its shapes are exported), whose real
    tensors (buffers built under :func:`hapd.init_on_meta`) fill in what the source lacks.

    ``overlap`` (with ``options.overlap``, the overlap-aware search): ``"auto"`` compiles
    the program for the whole batch and one duplica's program (half the batch) priced as
    two interleaved duplicas (:mod:`hapd.runtime.overlap`), and runs the cheaper;
    ``"always"`` runs the duplicas whatever the estimates say (to measure them).
    """
    _join_job_if_launched()
    if overlap not in ("auto", "always"):
        raise OptionsError(f"overlap {overlap!r} is not auto or always", field="overlap")
    weights = weight_source(weights, model)
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    example_inputs = tuple(example_inputs)
    if batch_dims is None:
        batch_dims = [0 if t.dim() > 0 else None for t in example_inputs]
    recipe = Recipe(model=model, example_inputs=example_inputs, batch_dims=tuple(batch_dims),
                    name=name or type(model).__name__, profile=profile, use_daemon=use_daemon, verbose=verbose,
                    device=_default_device(model, device), weights=weights)
    program, graph, source = _training_plan(recipe, plan, options, world=world, rank=rank, group=group,
                                            always=overlap == "always")
    if verbose and rank == 0:
        print(source.describe(), flush=True)
    host_groups = _host_groups(group, world) if hosts == "auto" else hosts
    inner = distribute(program, source.plan, rank, world=world, group=group, device=recipe.device,
                       check_graph=False, hosts=host_groups, weights=weights, batch_dims=recipe.batch_dims)
    extra = _state_outside_plan(model, inner, weights)
    recipe = dataclasses.replace(recipe, training_ops=op_nodes(graph))
    return ParallelModule(inner, source, group=group, aliases=_aliases(model, inner), extra=extra, recipe=recipe)


def _training_plan(recipe: "Recipe", plan: Plan | str | Path | bytes | None,
                   options: CompileOptions | Mapping[str, Any] | None, *, world: int, rank: int,
                   group: Any, always: bool = False) -> tuple[Any, GraphIR, PlanSource]:
    """The training program, its graph and plan. With ``options.overlap`` (and no given
    plan) both executions are compiled — the program for the whole batch, and one
    duplica's (half the batch) priced as two interleaved duplicas — and the cheaper
    estimate wins (``always``: the duplicas' whatever the estimates); the plan source's
    origin says what the other one was estimated at. A given plan for one duplica's
    graph (``overlap`` in it) runs on the program exported for half the batch."""
    opts = compile_options(options)
    if plan is not None:
        given = _given_plan(plan)[0]
        shapes = recipe.half_shapes() if given.overlap else recipe.example_shapes
        program, graph = recipe.export(True, shapes)
        return program, graph, obtain_plan(graph, world=world, rank=rank, profile=recipe.profile, options=options,
                                           plan=plan, group=group, use_daemon=recipe.use_daemon)
    if not opts.overlap:
        program, graph = recipe.export(True, recipe.example_shapes)
        return program, graph, obtain_plan(graph, world=world, rank=rank, profile=recipe.profile, options=options,
                                           group=group, use_daemon=recipe.use_daemon)
    half_program, half_graph = recipe.export(True, recipe.half_shapes())
    both = obtain_plan(half_graph, world=world, rank=rank, profile=recipe.profile, options=opts, group=group,
                       use_daemon=recipe.use_daemon)
    if always:
        return half_program, half_graph, both
    program, graph = recipe.export(True, recipe.example_shapes)
    plain = obtain_plan(graph, world=world, rank=rank, profile=recipe.profile,
                        options=dataclasses.replace(opts, overlap=False), group=group, use_daemon=recipe.use_daemon)
    plain_s, both_s = plain.plan.estimate["per_iteration"], both.plan.estimate["per_iteration"]
    if both_s < plain_s:
        chosen = dataclasses.replace(both, seconds=both.seconds + plain.seconds,
                                     origin=f"{both.origin}; overlapped {both_s * 1e3:.2f} ms beats "
                                            f"{plain_s * 1e3:.2f} ms without overlap")
        return half_program, half_graph, chosen
    chosen = dataclasses.replace(plain, seconds=both.seconds + plain.seconds,
                                 origin=f"{plain.origin}; without overlap {plain_s * 1e3:.2f} ms, "
                                        f"overlapped {both_s * 1e3:.2f} ms")
    return program, graph, chosen


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What :func:`parallelize` was given, kept to export and distribute the model again
    for another program (its eval forward, another batch size). The model is kept by
    reference: its parameters' values are never read again (a program runs on the
    training program's pieces), only its structure and forward."""

    model: nn.Module
    example_inputs: tuple[Tensor, ...]
    batch_dims: tuple[int | None, ...]
    name: str
    profile: Profile | str | Path | Mapping | None
    use_daemon: bool
    verbose: bool
    device: torch.device
    training_ops: tuple[tuple[str, str], ...] = ()
    """(node name, op) of the training graph's op nodes, in graph order."""
    weights: WeightSource | None = None
    """Where the buffers another program reads come from (a model on the meta device)."""

    @property
    def example_shapes(self) -> Shapes:
        return tuple(tuple(t.shape) for t in self.example_inputs)

    def half_shapes(self) -> Shapes:
        """The example batch's shapes with half its samples (one duplica of an
        overlapped run); :class:`PlanError` for an odd batch."""
        out = []
        for shape, d in zip(self.example_shapes, self.batch_dims):
            if d is None:
                out.append(shape)
                continue
            if shape[d] % 2:
                raise PlanError(f"overlapped execution cuts the batch in two halves; batch {shape[d]} is odd")
            out.append((*shape[:d], shape[d] // 2, *shape[d + 1:]))
        return tuple(out)

    def inputs_of(self, shapes: Shapes) -> tuple[Tensor, ...]:
        """Example inputs of these shapes: the example batch's cut or repeated along the
        batch dim where only that dim differs (real values: token ids stay ids), else
        zeros."""
        if len(shapes) != len(self.example_inputs):
            raise PlanError(f"{len(shapes)} inputs, the model takes {len(self.example_inputs)}")
        return tuple(_resized(t, list(shape), d) for t, shape, d in zip(self.example_inputs, shapes, self.batch_dims))

    def export(self, training: bool, shapes: Shapes) -> tuple[Any, GraphIR]:
        """The model exported in that mode for a global batch of ``shapes``, and its
        lowered graph (the model's own mode is left as it was)."""
        from hapd.compiler.export import export, user_input_names
        from hapd.compiler.lower import lower

        was = self.model.training
        try:
            with torch.enable_grad():  # as for training, also when asked inside torch.no_grad()
                program = export(self.model, self.inputs_of(shapes), batch_dims=self.batch_dims, training=training)
                graph = lower(program, name=self.name,
                              batch_dims=dict(zip(user_input_names(program), self.batch_dims)))
        finally:
            self.model.train(was)
        return program, graph


def _resized(example: Tensor, shape: list[int], batch_dim: int | None) -> Tensor:
    """A tensor of ``shape`` like ``example`` (see :meth:`Recipe.inputs_of`)."""
    have = list(example.shape)
    if have == shape:
        return example
    d = batch_dim
    only_batch = d is not None and len(have) == len(shape) and have[:d] + have[d + 1:] == shape[:d] + shape[d + 1:]
    if not only_batch or have[d] == 0:
        return torch.zeros(shape, dtype=example.dtype, device=example.device)
    repeats = -(-shape[d] // have[d])
    whole = torch.cat([example] * repeats, dim=d) if repeats > 1 else example
    return whole.narrow(d, 0, shape[d])


def op_nodes(graph: GraphIR) -> tuple[tuple[str, str], ...]:
    """(node name, op) of a lowered graph's op nodes, in graph order."""
    return tuple((n["name"], n["op"]) for n in graph.doc["nodes"] if n["kind"] == "op")


def aligned_force(training: Sequence[tuple[str, str]], rules: Mapping[str, str],
                  other: Sequence[tuple[str, str]]) -> dict[str, str]:
    """``CompileOptions.force`` for another graph of the model (``other``'s op nodes)
    that keeps the training plan's choices: the op nodes of the two graphs are aligned
    in graph order (the longest matching runs of ops, :class:`difflib.SequenceMatcher`;
    an eval graph lacks dropout and has batch norm on running statistics, so names
    alone shift), and each node of ``other`` aligned with a training node gets the rule
    the training plan chose for it (``rules``: node -> rule), in its eval form
    (:data:`EVAL_RULE`) where the ops differ."""
    def key(op: str) -> str:
        return SAME_OP_IN_EVAL.get(op, op)

    matcher = difflib.SequenceMatcher(None, [key(op) for _, op in training], [key(op) for _, op in other], autojunk=False)
    force: dict[str, str] = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            (name, op), (other_name, other_op) = training[block.a + k], other[block.b + k]
            rule = rules.get(name)
            if rule is not None:
                force[other_name] = rule if op == other_op else EVAL_RULE.get(rule, rule)
    return force


def _join_job_if_launched() -> None:
    """Join torchrun's job (``WORLD_SIZE`` > 1) when no process group exists yet."""
    if dist.is_initialized():
        return
    world = os.environ.get("WORLD_SIZE")
    if world and world.isdigit() and int(world) > 1:
        from hapd.runtime.training import init_distributed

        init_distributed()


def _default_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    for tensor in model.parameters():
        return tensor.device if not tensor.is_meta else torch.device("cpu")
    return torch.device("cpu")


def _host_groups(group: Any, world: int) -> Any:
    """Two-level gradient sums across hosts (torchrun's ``GROUP_RANK`` of every rank),
    or None on one host, with one rank per host, or in a sub-group."""
    if world == 1 or group is not None:
        return None
    from hapd.runtime.collectives import host_groups

    nodes: list[Any] = [None] * world
    raw = os.environ.get("GROUP_RANK", "0")
    dist.all_gather_object(nodes, int(raw) if raw.isdigit() else 0)
    return host_groups([int(n) for n in nodes])


def _aliases(model: nn.Module, inner: RankModule) -> dict[str, str]:
    """state-dict key -> the key the rank module holds it under, for keys naming the
    same tensor as another (tied weights: GPT-2's ``lm_head.weight``)."""
    held = set(inner.hapd_params) | set(inner.hapd_buffers) | set(inner.hapd_updated)
    by_tensor: dict[int, str] = {}
    state = model.state_dict(keep_vars=True)
    for key, tensor in state.items():
        if key in held:
            by_tensor.setdefault(id(tensor), key)
    return {key: by_tensor[id(t)] for key, t in state.items() if key not in held and id(t) in by_tensor}


def _state_outside_plan(model: nn.Module, inner: RankModule, weights: WeightSource | None = None) -> dict[str, Tensor]:
    """Copies of the state-dict entries no step of the plan reads (parameters the loss
    does not use): training cannot change them, and the full state dict keeps them
    (read whole from ``weights`` when there is one)."""
    held = set(inner.hapd_params) | set(inner.hapd_buffers) | set(inner.hapd_updated)
    aliases = _aliases(model, inner)
    return {k: t.detach().clone() if weights is None else rank_piece(weights, [k], t.detach(), None)
            for k, t in model.state_dict(keep_vars=True).items() if k not in held and k not in aliases}


# --------------------------------------------------------------------------------------
# The module users train
# --------------------------------------------------------------------------------------


class ParallelModule(nn.Module):
    """One rank's part of a parallelized model.

    ``forward(*local_inputs)`` returns this rank's part of the loss: the sum over ranks
    is the single-device loss (:meth:`global_loss`), and after ``backward()`` every
    parameter this rank holds has its exact gradient. :meth:`parameters` are this rank's
    pieces, for any torch optimizer and LR scheduler.

    ``inner`` is the training program for the example batch. In ``eval()`` mode, or for
    a global batch of other shapes, a forward runs another program on the same
    parameters (see the module docstring), built on first need from ``recipe``
    (without one, only ``inner`` runs).
    """

    def __init__(self, inner: RankModule, source: PlanSource, *, group: Any = None,
                 aliases: Mapping[str, str] | None = None, extra: Mapping[str, Tensor] | None = None,
                 recipe: Recipe | None = None):
        super().__init__()
        self.inner = inner
        self.plan_source = source
        self.group = group
        self.aliases = dict(aliases or {})
        self.extra = dict(extra or {})
        self._recipe = recipe
        self._mode_dependent = [(n.name, str(n.target)) for n in inner.graph.nodes
                                if n.op == "call_function" and str(n.target) in MODE_DEPENDENT_OPS]
        self._example_shapes: Shapes = recipe.example_shapes if recipe is not None else \
            tuple(tuple(s) for s in self.global_shapes())
        self._programs: dict[tuple[bool, Shapes], RankModule] = {(True, self._example_shapes): inner}
        """The programs built so far, by (training mode, global batch shapes); a plain
        dict: they hold no state of their own (``inner``'s parameters and buffers)."""
        self._cut: tuple[Shapes, tuple] | None = None
        """(global shapes, input split) of the batch the next forward's inputs were cut
        from (:meth:`shard_inputs`, :meth:`expect_batch`); None: the example batch."""

    # -- what the plan says --------------------------------------------------------------

    @property
    def plan(self) -> Plan:
        return self.plan_source.plan

    @property
    def rank(self) -> int:
        return self.inner.hapd_view.rank

    @property
    def world(self) -> int:
        return self.inner.hapd_view.world

    def input_layouts(self) -> list[tuple[str, str]]:
        """(input name, layout) of each forward argument."""
        return list(self.inner.hapd_inputs)

    def global_shapes(self) -> list[list[int]]:
        """The shape of each input of the global batch the plan was compiled for."""
        view = self.inner.hapd_view
        return [view.full_shape(n) if n in view.tensors else [] for n, _ in self.inner.hapd_inputs]

    def sample_lengths(self, batch: int | None = None) -> list[int] | None:
        """Samples of each global batch every rank reads, when every input is split
        along dim 0 with the same lengths (data-parallel inputs); None when some rank
        needs more of the batch (an input replicated or split along another dim).

        ``batch``: for a global batch of that many samples (the example batch's other
        dims), as the program of the current mode for it splits it (collective when
        that program is not built yet); default: the training program's example batch."""
        if batch is None:
            program = self.inner
            shapes = self._example_shapes
        else:
            shapes = self._batch_of(batch)
            if self.world == 1:
                return [batch]
            program = self._program(self.training, shapes)
        if self.world == 1:
            return [shapes[0][0]] if shapes and shapes[0] else None
        if getattr(program, "hapd_duplicas", 1) > 1:
            return None  # each rank reads a piece of each half
        return _sample_split(program)

    def _batch_of(self, batch: int) -> Shapes:
        """The example batch's shapes with ``batch`` samples (every input's dim 0)."""
        if not self._example_shapes or any(not s for s in self._example_shapes):
            raise PlanError("the model's inputs have no batch dim 0 to size")
        return tuple((batch, *s[1:]) for s in self._example_shapes)

    def shard_inputs(self, *global_batch: Tensor) -> tuple[Tensor, ...]:
        """This rank's pieces of the global batch, in forward order, as the program of
        the current mode for its shapes cuts it (collective when that program is not
        built yet); the next forwards run that program."""
        if len(global_batch) != len(self.inner.hapd_inputs):
            return self.inner.shard_inputs(*global_batch)  # the error naming the inputs
        shapes = tuple(tuple(t.shape) for t in global_batch)
        program = self._program(self.training, shapes)
        pieces = program.shard_inputs(*global_batch)
        self._cut = (shapes, _input_split(program))
        return pieces

    def expect_batch(self, *global_shapes: Sequence[int], lengths: Sequence[int] | None = None) -> None:
        """Say that the next forwards get this rank's pieces of a global batch of these
        shapes (what :meth:`shard_inputs` says by itself), cut along dim 0 in
        ``lengths`` samples per rank (default: as the program of the current mode for
        it cuts them); a forward whose program cuts otherwise is a
        :class:`~hapd.errors.PlanError`. :func:`hapd.loader` calls it for every batch.
        Collective when that program is not built yet."""
        shapes = tuple(tuple(int(n) for n in s) for s in global_shapes)
        program = self._program(self.training, shapes)
        split = _input_split(program) if lengths is None else tuple(("Gather(0)", tuple(lengths)) for _ in shapes)
        self._cut = (shapes, split)

    # -- the programs --------------------------------------------------------------------

    def _program(self, training: bool, shapes: Shapes) -> RankModule:
        """The program for a global batch of ``shapes`` in that mode (the training one
        stands for eval where no op computes differently), built on first need."""
        key = (training or not self._mode_dependent, shapes)
        found = self._programs.get(key)
        if found is None:
            found = self._programs[key] = self._build(*key)
        return found

    def _build(self, training: bool, shapes: Shapes) -> RankModule:
        """Export, plan and distribute the model for ``(training, shapes)`` on ``inner``'s
        parameters (collective)."""
        mode = "training" if training else "eval"
        what = f"{mode} program for batch shapes {[list(s) for s in shapes]}"
        if self._recipe is None:
            if not training:
                node, op = self._mode_dependent[0]
                raise UnsupportedOpError(
                    f"eval() forward: op {op} at node {node} computes differently in eval mode, and this module "
                    "has only the training program (make it with hapd.parallelize)", node=node)
            raise PlanError(f"no {what}: this module runs only batch shapes {[list(s) for s in self._example_shapes]} "
                            "(make it with hapd.parallelize to run others)")
        recipe = self._recipe
        program, graph = recipe.export(training, shapes)
        options = self._aligned_options(graph)
        try:
            source, module = self._distribute(program, graph, options)
        except PlanError as exc:
            fallback = self._replicated_options()
            if fallback is None or options.mode == fallback.mode:
                raise PlanError(f"{what}: no plan holds the parameters as the training plan does: {exc}") from exc
            source, module = self._distribute(program, graph, fallback)
        if recipe.verbose and self.rank == 0:
            print(f"plan ({mode}, batch shapes {[list(s) for s in shapes]}): {source.origin}, "
                  f"{_format_duration(source.seconds)}", flush=True)
        return module

    def _aligned_options(self, graph: GraphIR) -> CompileOptions:
        """The training plan's options at its ratios, with every op ``graph`` shares
        with the training graph forced to the training plan's rule."""
        rules = {step["node"]: step["rule"] for step in self.plan.program["steps"]}
        force = aligned_force(self._recipe.training_ops, rules, op_nodes(graph))
        return dataclasses.replace(compile_options(self.plan.key["options"]), force=force,
                                   ratios=tuple(self.plan.ratios), overlap=False)

    def _replicated_options(self) -> CompileOptions | None:
        """Options that hold every parameter replicated at the training plan's ratios,
        when the training plan does too (None otherwise)."""
        if any(layout != IDENTITY for layout in self.parameter_layouts().values()):
            return None
        return dataclasses.replace(compile_options(self.plan.key["options"]), mode="data_parallel", force={},
                                   ratios=tuple(self.plan.ratios), overlap=False)

    def _distribute(self, program: Any, graph: GraphIR, options: CompileOptions) -> tuple[PlanSource, RankModule]:
        recipe = self._recipe
        source = obtain_plan(graph, world=self.world, rank=self.rank, profile=recipe.profile, options=options,
                             group=self.group, use_daemon=recipe.use_daemon)
        module = distribute(program, source.plan, self.rank, world=self.world, group=self.group, device=recipe.device,
                            check_graph=False, shared=self.inner, weights=recipe.weights)
        return source, module

    # -- running -------------------------------------------------------------------------

    def forward(self, *local_inputs: Tensor) -> Tensor:
        """This rank's part of the loss of the global batch whose pieces these are, by
        the program of the current mode for that batch (the one :meth:`shard_inputs`
        or :meth:`expect_batch` named last; the example batch when neither did, and, on
        one rank, the inputs' own shapes)."""
        program = self._forward_program(local_inputs)
        expected = program.local_shapes()
        got = [list(t.shape) for t in local_inputs]
        if len(got) != len(expected) or any(e and g != e for g, e in zip(got, expected)):
            raise PlanError(f"rank {self.rank}: inputs of shapes {got}, the plan runs {expected} on this rank "
                            "(cut a batch of another size with shard_inputs, or read it with hapd.loader)")
        return program(*local_inputs)

    def _forward_program(self, local_inputs: Sequence[Tensor]) -> RankModule:
        if self.world == 1:
            return self._program(self.training, tuple(tuple(t.shape) for t in local_inputs))
        shapes, split = self._cut if self._cut is not None else (self._example_shapes, None)
        program = self._program(self.training, shapes)
        if split is not None and _input_split(program) != split:
            raise PlanError(f"rank {self.rank}: these inputs were cut for another program than the "
                            f"{'training' if self.training else 'eval'} one for batch shapes "
                            f"{[list(s) for s in shapes]}: cut the batch again (shard_inputs, or the loader) after "
                            "train() or eval()")
        return program

    def global_loss(self, local: Tensor) -> float:
        """The single-device loss from this rank's part (collective)."""
        return global_loss(local, self.group)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backwards inside accumulate gradients without communicating (DDP's
        ``no_sync``); the next backward outside it sums them over ranks. Without it,
        accumulating over micro-batches is exact too, at one gradient sum per backward."""
        with self.inner.hapd_sync.no_sync():
            yield

    # -- parameters ----------------------------------------------------------------------

    def parameter_layouts(self) -> dict[str, str]:
        """Each parameter's layout (``Identity``: replicated; ``Gather(d)``: split on d)."""
        return {name: layout for name, (_tensor, layout) in self.inner.hapd_params.items()}

    def held_tensors(self) -> list[Held]:
        """This rank's pieces (what checkpoints save and load: :mod:`hapd.runtime.held`):
        parameters and read-only buffers as the plan lays them out, updated buffers and
        state outside the plan whole; once each, in name order."""
        inner = self.inner
        out: list[Held] = []
        seen: set[int] = set()
        params = dict(inner.named_parameters(remove_duplicate=False))
        for key in sorted(inner.hapd_params):
            tensor, layout = inner.hapd_params[key]
            param = params[key]
            if id(param) not in seen:
                seen.add(id(param))
                out.append(self._placed(key, tensor, layout, param))
        for key in sorted(inner.hapd_buffers):
            tensor, layout, attr = inner.hapd_buffers[key]
            buffer = inner.get_buffer(attr)
            if id(buffer) not in seen:
                seen.add(id(buffer))
                out.append(self._placed(key, tensor, layout, buffer))
        out += [whole(key, inner.get_buffer(key)) for key in sorted(inner.hapd_updated)]
        out += [whole(key, self.extra[key]) for key in sorted(self.extra)]
        return sorted(out, key=lambda h: h.key)

    def _placed(self, key: str, tensor: str, layout: str, local: Tensor) -> Held:
        view = self.inner.hapd_view
        size = tuple(view.full_shape(tensor)) if tensor in view.tensors else tuple(local.shape)
        offsets = [0] * len(size)
        d = gather_dim(layout)
        if d is not None:
            offsets[d] = view.offset(tensor, d)[0]
        elif layout != IDENTITY:
            raise PlanError(f"{key} is held as {layout}: no piece of the whole tensor to checkpoint", node=tensor)
        return Held(key, local, tuple(offsets), size)

    def tied_names(self) -> list[list[str]]:
        """Groups of state-dict keys that name one tensor: every name of each parameter
        (several for tied weights), and each key in :attr:`aliases` with the key it
        names."""
        by_id: dict[int, list[str]] = {}
        params = dict(self.inner.named_parameters(remove_duplicate=False))
        for key in self.inner.hapd_params:
            by_id.setdefault(id(params[key]), []).append(key)
        groups = list(by_id.values())
        for key, target in self.aliases.items():  # names the rank module does not hold
            group = next((g for g in groups if target in g), None)
            if group is None:
                group = [target]
                groups.append(group)
            group.append(key)
        return groups

    def _params_by_kind(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        """(split, replicated) trainable parameters with gradients."""
        split, replicated = [], []
        for name, param in self.inner.named_parameters():
            if param.grad is None:
                continue
            layout = self.inner.hapd_params[name][1]
            if layout == IDENTITY:
                replicated.append(param)
            elif gather_dim(layout) is not None:
                split.append(param)
            else:
                raise PlanError(f"parameter {name} is held as {layout}: cannot take its norm", node=name)
        return split, replicated

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """Scale every gradient so that the norm of all of them together (the
        single-device model's, as :func:`torch.nn.utils.clip_grad_norm_`) is at most
        ``max_norm``; returns that total norm. Split parameters' pieces are summed over
        ranks, replicated ones counted once. Collective."""
        norm_type = float(norm_type)
        split, replicated = self._params_by_kind()
        device = next((p.grad.device for p in split + replicated), torch.device("cpu"))
        if math.isinf(norm_type):
            local = _max_abs(split, device)
            if self.world > 1:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
            total = torch.maximum(local, _max_abs(replicated, device))
        else:
            local = _power_sum(split, norm_type, device)
            if self.world > 1:
                dist.all_reduce(local, group=self.group)
            total = (local + _power_sum(replicated, norm_type, device)) ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in split + replicated:
            p.grad.mul_(coef.to(p.grad.dtype))
        return total

    # -- the single-device state dict ----------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Tensor]:
        """The single-device model's state dict (its keys and full shapes, on the CPU),
        gathered from every rank's pieces. Collective: every rank gets it."""
        inner = self.inner
        out: dict[str, Tensor] = {}
        params = dict(inner.named_parameters(remove_duplicate=False))  # every name of a tied one
        for key, (tensor, layout) in inner.hapd_params.items():
            out[key] = self._whole(tensor, layout, params[key].detach())
        for key, (tensor, layout, attr) in inner.hapd_buffers.items():
            out[key] = self._whole(tensor, layout, inner.get_buffer(attr))
        for key in inner.hapd_updated:
            out[key] = inner.get_buffer(key).detach().cpu().clone()
        for key, value in self.extra.items():
            out[key] = value.clone()
        for key, target in self.aliases.items():
            out[key] = out[target]
        return out

    def _whole(self, tensor: str, layout: str, local: Tensor) -> Tensor:
        d = gather_dim(layout)
        if d is not None and self.world > 1:
            from hapd.runtime.collectives import all_gather

            local = all_gather(local.contiguous(), d, self.inner.hapd_view.lengths(tensor, d), group=self.group)
        elif d is None and layout != IDENTITY:
            raise PlanError(f"tensor {tensor} is held as {layout}: no whole value to gather", node=tensor)
        return local.detach().cpu().clone()

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> None:
        """Load a single-device state dict (as :meth:`full_state_dict` gives, or the
        model's own): every rank copies its pieces. With ``strict``, missing and
        unexpected keys are a :class:`~hapd.errors.PlanError`."""
        inner = self.inner
        expected = set(inner.hapd_params) | set(inner.hapd_buffers) | set(inner.hapd_updated) | set(self.extra)
        if strict:
            missing = sorted(expected - set(state_dict))
            unexpected = sorted(set(state_dict) - expected - set(self.aliases))
            if missing or unexpected:
                raise PlanError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")
        params = dict(inner.named_parameters(remove_duplicate=False))  # every name of a tied one
        for key, (tensor, layout) in inner.hapd_params.items():
            if key in state_dict:
                self._load_piece(key, tensor, layout, state_dict[key], params[key])
        for key, (tensor, layout, attr) in inner.hapd_buffers.items():
            if key in state_dict:
                self._load_piece(key, tensor, layout, state_dict[key], inner.get_buffer(attr))
        for key in inner.hapd_updated:
            if key in state_dict:
                self._load_piece(key, key, IDENTITY, state_dict[key], inner.get_buffer(key))
        for key in self.extra:
            if key in state_dict:
                self.extra[key] = state_dict[key].detach().clone()

    def _load_piece(self, key: str, tensor: str, layout: str, value: Tensor, into: Tensor) -> None:
        view = self.inner.hapd_view
        full = view.full_shape(tensor) if tensor in view.tensors else list(into.shape)
        if list(value.shape) != full:
            raise PlanError(f"load_full_state_dict: {key} has shape {list(value.shape)}, the model's is {full}", node=key)
        into.copy_(view.local_value(tensor, layout, value.detach().to(into.device)))


def _input_split(program: RankModule) -> tuple:
    """How a program cuts its inputs: (layout, per-rank lengths or None) of each."""
    view = program.hapd_view
    out = []
    for name, layout in program.hapd_inputs:
        d = gather_dim(layout)
        out.append((layout, tuple(view.lengths(name, d)) if d is not None else None))
    return tuple(out)


def _sample_split(program: RankModule) -> list[int] | None:
    """Per-rank samples of a batch when every input is split along dim 0 in the same
    lengths, else None."""
    found: list[int] | None = None
    for name, layout in program.hapd_inputs:
        if gather_dim(layout) != 0:
            return None
        lengths = program.hapd_view.lengths(name, 0)
        if found is not None and lengths != found:
            return None
        found = lengths
    return found


def _power_sum(params: Sequence[nn.Parameter], norm_type: float, device: torch.device) -> Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        total += torch.linalg.vector_norm(p.grad.detach(), norm_type).to(torch.float32) ** norm_type
    return total


def _max_abs(params: Sequence[nn.Parameter], device: torch.device) -> Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad.numel():
            total = torch.maximum(total, p.grad.detach().abs().max().to(torch.float32))
    return total


__all__ = ["MODE_DEPENDENT_OPS", "ParallelModule", "PlanSource", "Recipe", "aligned_force", "compile_options",
           "daemon_key_path", "job_profile", "obtain_plan", "op_nodes", "parallelize", "plan_from_daemon"]
