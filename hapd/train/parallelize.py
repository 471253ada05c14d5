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
global batch of a training step), gets a plan
(:func:`~hapd.train.plan_source.obtain_plan`: a given plan, the daemon at
``$HAPD_DAEMON``, or a compile on rank 0; every other rank receives its bytes), reads
this rank's pieces from where :func:`~hapd.state.weights.weight_source` says, and
returns this rank's :class:`~hapd.train.parallel_module.ParallelModule`. With one
process and no process group it runs the plan for one device. ``eval()`` and batches
of other sizes: see :mod:`hapd.train.parallel_module`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hapd.profile.precision import PRECISIONS
from hapd.compiler.options import CompileOptions
from hapd.ir.lower import GraphIR
from hapd.compiler.plan import Plan
from hapd.wire.switch import JOIN_HELD_ENV
from hapd.elastic import export_share
from hapd.elastic.in_place import freeze_before_first_run
from hapd.errors import HapdError, OptionsError
from hapd.profile.schema import Profile
from hapd.compiler.techniques import GraphSet
from hapd.spmd.distributed import env_int, init_distributed, job_host_groups, joining_device
from hapd.train.parallel_module import ParallelModule
from hapd.train.pipeline_module import PipelineModule, build_pipeline_module
from hapd.train.plan_source import PlanAhead, PlanSource, compile_options, given_plan, job_profile, obtain_plan
from hapd.train.programs import CARRY, Recipe, by_keyword, export_key, key_digest, op_nodes, shared_bytes, take_shared
from hapd.spmd.rank import RankModule
from hapd.spmd.random.random_ops import COUNTER_RNG, RNG_CHOICES, TORCH_RNG
from hapd.spmd.rewrite import distribute
from hapd.state.weights import Weights, WeightSource, rank_piece, weight_source


def parallelize(model: nn.Module, example_inputs: Sequence[Tensor], *,
                profile: Profile | str | Path | Mapping | None = None, plan: Plan | str | Path | bytes | None = None,
                options: CompileOptions | Mapping[str, Any] | None = None, batch_dims: Sequence[int | None] | None = None,
                name: str | None = None, device: torch.device | str | None = None, group: Any = None,
                hosts: Any = "auto", use_daemon: bool = True, verbose: bool = True,
                weights: Weights | None = None, overlap: str = "auto",
                compile: bool | Mapping[str, Any] = False,  # noqa: A002 - torch's word
                precision: str | None = None, rng: str = COUNTER_RNG) -> ParallelModule | PipelineModule:
    """This rank's :class:`ParallelModule` of ``model``, trained on batches shaped like
    ``example_inputs`` (the *global* batch, the same on every rank). Collective.

    Exports ``model`` (``batch_dims``: each input's batch dim, default 0), gets the plan
    (:func:`obtain_plan`: ``plan``, or the daemon's or rank 0's for ``profile`` and
    ``options``; without a profile, the job's devices as each rank describes its own,
    :mod:`hapd.profiler.local`) and distributes it (:func:`hapd.distribute`). Every rank must build
    ``model`` with the same parameters (the same seed, or a loaded state dict): each
    keeps only its pieces. ``device``: where this rank's pieces live (default: the
    current CUDA device with NCCL, else where the model's parameters are). ``hosts``:
    ``"auto"`` sums replicated gradients in two levels across hosts when the ranks of
    several hosts share it (torchrun's ``GROUP_RANK``); None: one flat all-reduce.
    With ``verbose``, rank 0 prints one line: the technique, the per-rank batch or
    ratios, the predicted time per step against DP-CP, where the plan came from and how
    long it took (:meth:`~hapd.train.plan_source.PlanSource.summary`).

    Joins the job torchrun started when ``WORLD_SIZE`` is set and no process group
    exists; one process without either runs the plan for one device.

    ``weights`` (a model on the meta device) and ``compile`` (``torch.compile``): see :func:`_recipe`.

    ``precision`` (fp32, bf16, fp16, auto: ``options={"precision": ...}``): priced in it,
    run under autocast to it (:mod:`hapd.train.precision`; fp16: :class:`hapd.GradScaler`).

    ``rng`` (``"counter"``, the default, or ``"torch"``): what dropout and the other
    random ops draw with. ``"counter"``: hapd's counter-based generator, each rank its
    slice of the single-device draw, on one process as on N ranks, pipelines and
    duplicas — a script run as one process and as N ranks trains the same numbers with
    dropout on (up to the order of the sums a split changes). ``"torch"``: the model's
    own random ops and torch's generator, as the eager model draws; one process only
    (several ranks would each draw a whole mask of their own).

    ``overlap`` (with ``options.overlap``, the overlap-aware search): ``"auto"`` prices
    the program for the whole batch and one duplica's program (half the batch) priced as
    two interleaved duplicas (:mod:`hapd.spmd.duplicas`), and runs the duplicas only when
    they hide communication and are predicted ``options.technique_margin`` faster
    (:mod:`hapd.compiler.choice`); ``"always"`` runs the duplicas whatever the estimates
    say (to measure them). Either way ``example_inputs`` is the global batch: each
    duplica takes half of it.
    """
    if not isinstance(model, nn.Module):
        raise OptionsError(f"parallelize takes a torch.nn.Module whose forward returns the loss, not a "
                           f"{type(model).__name__}", field="model")
    freeze_before_first_run()  # under the in-place runner: its parks collect only what is made from here on
    model, example_inputs, batch_dims, name = by_keyword(model, example_inputs, batch_dims, name)  # a dict batch
    _export_ahead(model, example_inputs, batch_dims, name=name, profile=profile, plan=plan, options=options,
                  device=device, weights=weights, compile=compile, precision=precision, overlap=overlap)
    if overlap not in ("auto", "always"):
        raise OptionsError(f"overlap {overlap!r} is not auto or always", field="overlap")
    asked = _Asked(model, example_inputs, batch_dims, name=name, profile=profile, plan=plan, options=options,
                   device=device, use_daemon=use_daemon, verbose=verbose, weights=weights, compile=compile,
                   precision=precision, rng=rng, always=overlap == "always")
    started = time.time()
    early = _prepared_before_joining(asked, group)
    joining = time.time()
    _join_job_if_launched()
    joined_s = time.time() - joining
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    _check_rng(rng, world, options, overlap)
    ready = early if early is not None and (early.rank, early.world) == (rank, world) else \
        _prepared(asked, world=world, rank=rank, group=group, device=device)
    recipe = ready.recipe
    program, graph, source = _training_plan(ready, plan, world=world, rank=rank, group=group)
    if verbose and rank == 0:
        print(source.summary(), flush=True)
    built = _build_module(recipe, source, program, graph, ready.options, world=world, rank=rank, group=group,
                          hosts=hosts)
    built.build_times = BuildTimes(started=started, join_s=joined_s, total_s=time.time() - started,
                                   prepare_s=joining - started)
    if ready.carried is not None:
        CARRY.keep(ready.carried, recipe.exported)
        if rank == 0:
            export_share.publish(key_digest(ready.carried), lambda: shared_bytes(recipe))
    return built


@dataclasses.dataclass(frozen=True)
class _Asked:
    """What :func:`parallelize` was asked for, as given (its defaults not filled in)."""

    model: nn.Module
    example_inputs: Sequence[Tensor]
    batch_dims: Sequence[int | None] | None
    name: str | None
    profile: Profile | str | Path | Mapping | None
    plan: Plan | str | Path | bytes | None
    options: CompileOptions | Mapping[str, Any] | None
    device: torch.device | str | None
    use_daemon: bool
    verbose: bool
    weights: Weights | None
    compile: bool | Mapping[str, Any]  # noqa: A003 - torch's word
    precision: str | None
    rng: str
    always: bool
    """``overlap="always"``: the duplicas of half the batch, whatever the estimates."""


@dataclasses.dataclass(frozen=True)
class _PlanRequest:
    """What the plan is asked for: ``graph`` (one graph, or every batch a technique search
    prices), and the program and graph the job runs — None when the plan chooses it (a
    search that may pick overlap's half batch)."""

    graph: GraphIR | GraphSet
    runs: tuple[Any, GraphIR] | None


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """What :func:`parallelize` prepares on a rank before the plan: the recipe (its exports
    taken from the carry when a run of the script before kept them), the export key to
    keep them under, the options to search with and the plan request; for ``rank`` of
    ``world``; ``ahead``: rank 0's request, already sent (:class:`PlanAhead`)."""

    recipe: Recipe
    carried: tuple | None
    options: CompileOptions | Mapping[str, Any] | None
    request: _PlanRequest
    rank: int
    world: int
    rebound: bool = False
    """Its exports came from the carry: a run of the script again in this process (an
    in-place switch), whose plan is a re-plan or a cache hit."""
    ahead: PlanAhead | None = None


def _prepared(asked: _Asked, *, world: int, rank: int, group: Any, device: torch.device | str | None) -> _Prepared:
    """The recipe, its carried exports, the options and the plan request of ``rank`` of
    ``world`` (its exports made here when none were carried)."""
    recipe = _recipe(asked.model, asked.example_inputs, asked.batch_dims, name=asked.name, profile=asked.profile,
                     plan=asked.plan, world=world, group=group, device=device, use_daemon=asked.use_daemon,
                     verbose=asked.verbose, weights=asked.weights, compile=asked.compile)
    recipe = dataclasses.replace(recipe, rng=asked.rng)
    carried = _carried_in(recipe)
    rebound = bool(recipe.exported)
    options = _with_precision(_default_options(asked.options, recipe.profile, world), asked.precision)
    request = _plan_request(recipe, asked.plan, options, asked.always, rank)
    return _Prepared(recipe, carried, options, request, rank, world, rebound)


def _prepared_before_joining(asked: _Asked, group: Any) -> _Prepared | None:
    """A rank about to join the job torchrun started prepares what needs no other rank
    before it joins — its exports (or the ones carried from the script's last run),
    the options, the plan request. On a run of the script again in its process (an
    in-place switch) rank 0 sends that request at once, on a thread
    (:class:`~hapd.train.plan_source.PlanAhead`): the daemon's answer (the LP-only
    re-plan after a host or rank left, a cache hit) comes while the slowest survivors
    still park and start the script again, instead of after, while every rank waits for
    its broadcast. Not at a job's first launch: the daemon's full search would then run
    beside every rank's imports and export, on the same cores (on the 2-core emulated
    cluster, 2 of 6 first launches that did so lost a daemon at the job's start, its
    answer to the launcher's poll later than ``--lost-after``: the likely cause).
    None when the rank joins no job here, is a joining host's rank launched ahead (its
    place comes in the join: :func:`_export_ahead` prepares it), or the profile is the
    devices as the ranks describe them (a collective)."""
    if dist.is_initialized() or group is not None or os.environ.get(JOIN_HELD_ENV) == "1":
        return None
    if asked.profile is None and asked.plan is None:
        return None
    world, rank = env_int(os.environ, "WORLD_SIZE"), env_int(os.environ, "RANK")
    if world is None or world < 2 or rank is None:
        return None
    early = _prepared(asked, world=world, rank=rank, group=None,
                      device=asked.device if asked.device is not None else joining_device())
    if rank != 0 or asked.plan is not None or not early.rebound:
        return early
    ahead = PlanAhead(early.request.graph, job_profile(early.recipe.profile, world), compile_options(early.options),
                      asked.use_daemon)
    return dataclasses.replace(early, ahead=ahead)


def _recipe(model: nn.Module, example_inputs: Sequence[Tensor], batch_dims: Sequence[int | None] | None, *,
            name: str | None, profile: Profile | str | Path | Mapping | None, plan: Plan | str | Path | bytes | None,
            world: int, group: Any, device: torch.device | str | None, use_daemon: bool, verbose: bool,
            weights: Weights | None, compile: bool | Mapping[str, Any]) -> Recipe:  # noqa: A002 - torch's word
    """What :func:`parallelize` was given, with its defaults: batch dims, device, the job's profile.

    ``weights``: where this rank reads its pieces of the parameters and buffers
    instead of ``model`` (:mod:`hapd.state.weights`: :func:`hapd.module_init`, a
    safetensors file, a checkpoint), one tensor at a time; needed when ``model`` is on
    the meta device (too large for one host: only its shapes are exported), whose real
    tensors (buffers built under :func:`hapd.init_on_meta`) fill in what the source lacks.

    ``compile``: run each of this rank's programs under ``torch.compile`` (True: its
    defaults; a mapping: its keyword arguments, e.g. ``{"backend": "aot_eager"}``). The
    collectives run between the compiled graphs (graph breaks); the values are the
    uncompiled program's up to the compiler's rounding.
    """
    source = weight_source(weights, model)
    example_inputs = tuple(example_inputs)
    if batch_dims is None:
        batch_dims = [0 if t.dim() > 0 else None for t in example_inputs]
    device = _default_device(model, device)
    if profile is None and plan is None:
        profile = job_profile(None, world, device=device, group=group)  # the devices as they are
    return Recipe(model=model, example_inputs=example_inputs, batch_dims=tuple(batch_dims),
                  name=name or type(model).__name__, profile=profile, use_daemon=use_daemon, verbose=verbose,
                  device=device, weights=source, compile=_compile_options(compile))


def _check_rng(rng: str, world: int, options: CompileOptions | Mapping[str, Any] | None, overlap: str) -> None:
    """:class:`OptionsError` for an ``rng`` parallelize cannot run: not one of
    :data:`~hapd.spmd.random.random_ops.RNG_CHOICES`, or ``"torch"`` where the program
    runs on several ranks or as duplicas (each would draw a whole mask of its own)."""
    if rng not in RNG_CHOICES:
        raise OptionsError(f"rng must be one of {', '.join(map(repr, RNG_CHOICES))}, not {rng!r}", field="rng")
    if rng != TORCH_RNG:
        return
    if world > 1:
        raise OptionsError(f"rng='torch' draws each random op whole, but this job has {world} ranks: each would draw a "
                           "mask of its own, not its slice of one (use rng='counter', the default)", field="rng")
    if overlap == "always" or (options is not None and compile_options(options).overlap):
        raise OptionsError("rng='torch' draws each random op whole, but overlap runs the batch as two duplicas: each "
                           "would draw a mask of its own (use rng='counter', the default, or no overlap)", field="rng")


def _carried_in(recipe: Recipe) -> tuple | None:
    """The export key of a run of the script again in this process (an in-place switch), its exports taken in."""
    carried = export_key(recipe.model, recipe.example_inputs, recipe.batch_dims, recipe.name,
                         recipe.device) if CARRY.enabled else None
    if carried is not None:  # a run of the script again in this process (an in-place switch): no export
        recipe.exported.update(CARRY.take(carried, recipe.model))
    return carried


def _build_module(recipe: Recipe, source: PlanSource, program: Any, graph: GraphIR,
                  options: CompileOptions | Mapping[str, Any] | None, *, world: int, rank: int, group: Any,
                  hosts: Any) -> ParallelModule | PipelineModule:
    """The pipeline module when a pipeline won, else this rank's distributed program as a ParallelModule."""
    if pipeline_won(source.plan):
        return build_pipeline_module(recipe, source, job_profile(recipe.profile, world), compile_options(options),
                                     weights=recipe.weights)
    host_groups = job_host_groups(world, group) if hosts == "auto" else hosts
    inner = distribute(program, source.plan, rank, world=world, group=group, device=recipe.device,
                       check_graph=False, hosts=host_groups, weights=recipe.weights, batch_dims=recipe.batch_dims,
                       rng=recipe.rng)
    extra = _state_outside_plan(recipe.model, inner, recipe.weights)
    recipe = dataclasses.replace(recipe, training_ops=op_nodes(graph))
    return ParallelModule(inner, source, group=group, aliases=_aliases(recipe.model, inner), extra=extra, recipe=recipe)


@dataclasses.dataclass(frozen=True)
class BuildTimes:
    """When :func:`parallelize` ran on this rank and what it took: joining the process
    group (which waits for the job's other ranks to start), and the whole call (the
    join, the export, the plan and this rank's program). :class:`hapd.Elastic` reports
    them, so that a restart's time splits into the processes' start, the script before
    :func:`parallelize` (imports, the model) and :func:`parallelize` itself."""

    started: float
    """``time.time()`` when :func:`parallelize` was called."""
    join_s: float
    total_s: float
    prepare_s: float = 0.0
    """Before joining: the exports rebound or made, the options, the plan request."""


def _plan_request(recipe: Recipe, plan: Plan | str | Path | bytes | None,
                  options: CompileOptions | Mapping[str, Any] | None, always: bool, rank: int = 0) -> _PlanRequest:
    """What the plan is asked for (:func:`_training_plan`), exported here or carried.
    A given plan for one duplica's graph (``overlap`` in it) runs on the program
    exported for half the batch. With ``options.overlap`` or ``options.pipeline`` auto
    (and no given plan) one compile searches every technique in the options, from the
    model exported once with a symbolic batch (:meth:`Recipe.graphs`,
    :func:`hapd.compiler.driver.compile_techniques`): the plan chooses the program.
    ``always``: the duplicas of half the global batch, whatever the estimates. Only
    rank 0 asks for the plan: another ``rank`` derives only the graphs it checks the plan
    against and may run (:meth:`Recipe.graphs`'s ``priced``)."""
    opts = compile_options(options)
    if plan is not None:
        given = given_plan(plan)[0]
        program, graph = recipe.export(True, recipe.half_shapes() if given.overlap else recipe.example_shapes)
        return _PlanRequest(graph, (program, graph))
    if not opts.overlap and opts.pipeline != "auto":
        program, graph = _training_export(recipe, recipe.example_shapes)
        return _PlanRequest(graph, (program, graph))
    if not always:  # every technique in options from one export (hapd.compiler.techniques)
        return _PlanRequest(recipe.graphs(opts, priced=rank == 0), None)
    program, graph = _training_export(recipe, recipe.half_shapes())
    return _PlanRequest(graph, (program, graph))


def _training_export(recipe: Recipe, shapes: Any) -> tuple[Any, Any]:
    """The training program and graph of one batch of ``shapes``: exported at it; under
    the in-place runner (exports carried, :data:`~hapd.train.programs.CARRY`) cut from
    the one symbolic program every generation of the job holds (:meth:`Recipe.export_for`),
    whatever the options: a job switched to one host searches SPMD alone, and a static
    export there took 5 s of a switch on a third of a core — while its graph may differ
    from the cut one's (GPT-2's does), so every process of the job takes the cut one,
    the ones started for that generation too."""
    return recipe.export_for(True, shapes) if CARRY.enabled else recipe.export(True, shapes)


def _training_plan(ready: _Prepared, plan: Plan | str | Path | bytes | None, *, world: int, rank: int,
                   group: Any) -> tuple[Any, GraphIR, PlanSource]:
    """The training program, its graph and plan (:func:`obtain_plan` for the request
    :func:`_plan_request` made; rank 0's answer taken from its request sent ahead when
    there is one). After a technique search the program is the global batch's, or the
    half batch's when overlap won (``Plan.technique``), and the plan source's origin
    says what each technique was estimated at."""
    recipe, request = ready.recipe, ready.request
    source = obtain_plan(request.graph, world=world, rank=rank, profile=recipe.profile, options=ready.options,
                         plan=plan, group=group, use_daemon=recipe.use_daemon, ahead=ready.ahead)
    if request.runs is not None:
        program, graph = request.runs
        return program, graph, source
    overlap = source.plan.technique == "overlap"
    program, graph = recipe.export_at(True, recipe.batch // 2 if overlap else recipe.batch)
    return program, graph, source  # its summary line says what each technique was predicted at


def _default_options(options: CompileOptions | Mapping[str, Any] | None, profile: Any,
                     world: int) -> CompileOptions | Mapping[str, Any] | None:
    """The options to search with: the user's, else every technique — SPMD, pipelines
    and overlap — when the profile spans several hosts (a pipeline puts its stages on
    hosts, overlap hides collectives behind compute: over a slow link between hosts
    either can beat every SPMD plan)."""
    if options is not None or profile is None or world < 2:
        return options
    hosts = job_profile(profile, world).hosts
    return {"pipeline": "auto", "overlap": True} if len(set(hosts)) > 1 else None


def _with_precision(options: CompileOptions | Mapping[str, Any] | None,
                    precision: str | None) -> CompileOptions | Mapping[str, Any] | None:
    """``options`` with ``parallelize``'s ``precision``; :class:`OptionsError` when the
    options name another one."""
    if precision is None:
        return options
    if precision not in PRECISIONS:
        raise OptionsError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}", field="precision")
    given = CompileOptions.from_mapping(options)
    if given.precision not in ("fp32", precision):
        raise OptionsError(f"precision {precision!r} and options' precision {given.precision!r} disagree: give one",
                           field="precision")
    if isinstance(options, CompileOptions):
        return dataclasses.replace(options, precision=precision)
    return {**dict(options or {}), "precision": precision}


def pipeline_won(plan: Plan) -> bool:
    """Whether ``plan`` runs its pipeline instead of its SPMD program."""
    found = plan.pipeline
    return bool(found and found.get("chosen"))


def _compile_options(compile: bool | Mapping[str, Any]) -> Mapping[str, Any] | None:  # noqa: A002
    """``parallelize``'s ``compile`` as ``torch.compile`` keyword arguments (None: off)."""
    if isinstance(compile, bool):
        return {} if compile else None
    if isinstance(compile, Mapping):
        return dict(compile)
    raise OptionsError(f"compile {compile!r} is not a bool or a mapping of torch.compile arguments", field="compile")


def _export_ahead(model: nn.Module, example_inputs: Sequence[Tensor], batch_dims: Sequence[int | None] | None, *,
                  name: str | None, profile: Profile | str | Path | Mapping | None,
                  plan: Plan | str | Path | bytes | None, options: CompileOptions | Mapping[str, Any] | None,
                  device: torch.device | str | None, weights: Weights | None,
                  compile: bool | Mapping[str, Any], precision: str | None,  # noqa: A002 - torch's word
                  overlap: str) -> None:
    """A joining host's rank launched ahead of its generation
    (:data:`hapd.wire.switch.JOIN_HELD_ENV`) exports and lowers the model before it
    waits for its place, while the other ranks still train: what it exported is carried
    into this same call after the switch (:data:`~hapd.train.programs.CARRY`, as a rank
    switched in place carries its own), so the others wait only for what needs the
    process group. Its world is the one it was launched for; what a different world
    needs is exported after the switch. Nothing for any other process, or without a
    profile or plan (the devices would be described over the group)."""
    if os.environ.get(JOIN_HELD_ENV) != "1" or not CARRY.enabled or (profile is None and plan is None):
        return
    world = int(os.environ.get("WORLD_SIZE") or 1)
    recipe = _recipe(model, example_inputs, batch_dims, name=name, profile=profile, plan=plan, world=world, group=None,
                     device=device, use_daemon=False, verbose=False, weights=weights, compile=compile)
    opts = compile_options(_with_precision(_default_options(options, recipe.profile, world), precision))
    if plan is None and overlap != "always" and (opts.overlap or opts.pipeline == "auto"):
        _shared_in(recipe)
        # every graph rank 0 prices, whatever rank it joins as: a joined rank becomes rank 0 at a later switch
        # when rank 0 is lost, and deriving them there took that switch 2-4 s on a slow host (here the others
        # still train; ~1 s more of the join on a sixth of a core)
        recipe.graphs(opts, priced=True)
    else:
        _training_export(recipe, recipe.half_shapes() if overlap == "always" else recipe.example_shapes)
    CARRY.keep(export_key(recipe.model, recipe.example_inputs, recipe.batch_dims, recipe.name, recipe.device),
               recipe.exported)


def _shared_in(recipe: Recipe) -> bool:
    """A joining rank takes the program the job's rank 0 shared (:mod:`hapd.elastic.export_share`)
    instead of exporting its model, when a daemon of the job holds one of its export
    key; said on stderr either way (the launcher shows a joining host's lines)."""
    start = time.perf_counter()
    key = export_key(recipe.model, recipe.example_inputs, recipe.batch_dims, recipe.name, recipe.device)
    found = export_share.fetch(key_digest(key))
    if found is None:
        print("hapd: no program shared by the job for this model: exporting it here", file=sys.stderr, flush=True)
        return False
    data, address = found
    try:
        take_shared(recipe, data)
    except HapdError as exc:
        print(f"hapd: the program shared by the job on {address} does not fit this model ({exc}): exporting it here",
              file=sys.stderr, flush=True)
        return False
    print(f"hapd: took the job's exported program from {address} ({len(data) / 1e6:.2f} MB in "
          f"{time.perf_counter() - start:.2f} s) instead of exporting the model", file=sys.stderr, flush=True)
    return True


def _join_job_if_launched() -> None:
    """Join torchrun's job (``WORLD_SIZE`` > 1) when no process group exists yet."""
    if dist.is_initialized():
        return
    world = os.environ.get("WORLD_SIZE")
    if world and world.isdigit() and int(world) > 1:
        init_distributed()


def _default_device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if dist.is_initialized() and dist.get_backend() == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    for tensor in model.parameters():
        return tensor.device if not tensor.is_meta else torch.device("cpu")
    return torch.device("cpu")


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


__all__ = ["parallelize"]
