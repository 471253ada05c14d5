"""The module users train: :class:`ParallelModule`, one rank's part of a parallelized
model (:func:`hapd.parallelize` builds it).

**Eval and other batch sizes.** ``module.eval()`` forwards are the model's eval forward
(dropout is the identity, batch norm uses its running statistics), and a global batch of
another size (the short last batch of an epoch, a validation batch) runs as one, with the
same parameters: on first need the module exports the model again for that mode and
batch shape (:class:`~hapd.train.programs.Recipe`), gets a plan for it through
:func:`~hapd.train.plan_source.obtain_plan` (the daemon's cache when there is one)
that holds every parameter as the training plan does — every op the two graphs share is
forced to the training plan's rule, at its ratios
(:func:`~hapd.train.programs.aligned_force`), and the layouts are checked — and
distributes it on the training program's parameter objects, buffers and gradient sync
(:func:`hapd.spmd.rewrite.distribute` with ``shared=``), so the optimizer, its
state and the gradients are the same objects whichever program runs. These programs
are kept per (mode, batch shapes); building one is collective (every rank gets there
together, as SPMD code does). A forward runs the program of the current mode for the
global batch the inputs were cut from: :meth:`ParallelModule.shard_inputs` and
:func:`hapd.loader` say which. ::

    module.eval()
    with torch.no_grad():
        loss = module.global_loss(module(*module.shard_inputs(*val_batch)))   # the single-device eval loss
    module.train()                                                             # back to the training program

Checkpoints read a ParallelModule through what it answers as
:class:`~hapd.state.held.HoldsPieces` (:meth:`ParallelModule.held_tensors`, …).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hapd.compiler.options import CompileOptions
from hapd.ir.lower import GraphIR
from hapd.ir.op_facts import MODE_DEPENDENT_OPS, overloads
from hapd.compiler.plan import Plan
from hapd.errors import OptionsError, PlanError, UnsupportedOpError
from hapd.train import telemetry
from hapd.spmd.collectives import all_gather
from hapd.state.held import Held, whole
from hapd.spmd.layout import IDENTITY, gather, gather_dim
from hapd.train.precision import plan_autocast
from hapd.train.plan_source import PlanSource, compile_options, obtain_plan
from hapd.spmd.random.random_ops import CounterDropout
from hapd.train.programs import Recipe, Shapes, aligned_force, keyword_names, op_nodes
from hapd.spmd.rank import RankModule
from hapd.spmd.rewrite import distribute, global_loss
from hapd.spmd.stepwatch import Pending, StepCheck, step_check_enabled

_MODE_DEPENDENT = overloads(MODE_DEPENDENT_OPS)


class PlannedModule(nn.Module):
    """What every module :func:`hapd.parallelize` returns holds (:class:`ParallelModule`,
    :class:`~hapd.train.pipeline_module.PipelineModule`): where its plan came from, the
    process group it runs in, the state-dict keys that name another key's tensor
    (``aliases``) and the state outside the plan (``extra``, held whole)."""

    build_times: Any = None
    """What :func:`hapd.parallelize` took on this rank
    (:class:`hapd.train.parallelize.BuildTimes`); None for a module built otherwise."""

    def __init__(self, source: PlanSource, *, group: Any, aliases: Mapping[str, str] | None,
                 extra: Mapping[str, Tensor] | None):
        super().__init__()
        self.plan_source = source
        self.group = group
        self.aliases = dict(aliases or {})
        self.extra = dict(extra or {})

    keywords: tuple[str, ...] | None = None
    """The keys of the dict batch the module was made for (``hapd.parallelize(model,
    batch_dict)``): ``module(**batch)`` passes them to the model's forward by name;
    None for a tuple batch."""

    @property
    def plan(self) -> Plan:
        return self.plan_source.plan

    def _positional(self, inputs: tuple[Any, ...], batch: Mapping[str, Any], what: str) -> tuple[Any, ...]:
        """``inputs``, or the tensors of a dict batch ``batch`` in the order the model was
        exported with (:attr:`keywords`); :class:`~hapd.errors.OptionsError` naming the
        keys missing or unknown, or a dict given to a module made for a tuple batch."""
        if not batch:
            return inputs
        keys = self.keywords or self._input_names()
        if keys is None:
            raise OptionsError(f"{what}: keyword inputs {', '.join(batch)}, but the module was made for a tuple batch: "
                               "pass the tensors in the example's order, or parallelize with a dict example batch",
                               field="inputs")
        keys = keys[len(inputs):]  # positional first, the rest by name (as a forward's arguments)
        missing = [k for k in keys if k not in batch]
        unknown = [k for k in batch if k not in keys]
        if missing or unknown:
            raise OptionsError(f"{what}: the batch's keys {', '.join(batch)} are not the example batch's "
                               f"{', '.join(keys)} (missing {missing}, unknown {unknown})", field="inputs")
        return (*inputs, *(batch[k] for k in keys))

    def _input_names(self) -> tuple[str, ...] | None:
        """The names of the forward's inputs, for a module made from a tuple batch called
        by keyword (the model's argument names, as exported); None when unknown."""
        return None

    def _with_aliases(self, groups: list[list[str]]) -> list[list[str]]:
        """``groups`` of state-dict keys naming one tensor, each key in :attr:`aliases`
        added to the group of the key it names (a group of its own when none has it)."""
        for key, target in self.aliases.items():
            group = next((g for g in groups if target in g), None)
            if group is None:
                group = [target]
                groups.append(group)
            group.append(key)
        return groups


class ParallelModule(PlannedModule):
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
        super().__init__(source, group=group, aliases=aliases, extra=extra)
        self.inner = inner
        self._recipe = recipe
        self.keywords = keyword_names(recipe.model) if recipe is not None else None
        self._mode_dependent = [(n.name, str(n.target)) for n in inner.graph.nodes
                                if n.op == "call_function" and n.target in _MODE_DEPENDENT]
        # dropouts run as hapd's counter-based draws (a recompute span's among them)
        self._mode_dependent += [(name, "aten.native_dropout") for name, m in inner.named_modules()
                                 if isinstance(m, CounterDropout)]
        self._example_shapes: Shapes = recipe.example_shapes if recipe is not None else self._program_shapes(inner)
        self._programs: dict[tuple[bool, Shapes], RankModule] = {(True, self._example_shapes): inner}
        """The programs built so far, by (training mode, global batch shapes); a plain
        dict: they hold no state of their own (``inner``'s parameters and buffers)."""
        self.program_sources: dict[tuple[bool, Shapes], PlanSource] = {}
        """Where the plan of each program built after the training one came from (a
        daemon cache hit, an LP-only re-plan, a compile), by (training mode, global
        batch shapes)."""
        self._cut: tuple[Shapes, tuple] | None = None
        """(global shapes, input split) of the batch the next forward's inputs were cut
        from (:meth:`shard_inputs`, :meth:`expect_batch`); None: the example batch."""
        self._telemetry = telemetry.for_module(self)
        """Times each training step for the launcher, progress and logs (:mod:`hapd.train.telemetry`)."""
        self._check = self._step_check()
        """Checks every forward against the other ranks' before its first collective
        (:class:`~hapd.spmd.stepwatch.StepCheck`); None on one process."""
        self._position: tuple[int, int] | None = None
        """(epoch, batch) of the batch :func:`hapd.loader` handed out for the next forward."""

    def _step_check(self) -> StepCheck | None:
        """The check of this rank's forwards against the others' (None on one rank, and
        with ``HAPD_STEP_CHECK=0``)."""
        if self.world == 1 or not dist.is_initialized() or not step_check_enabled():
            return None
        device = self._recipe.device if self._recipe is not None else next(
            (p.device for p in self.inner.parameters()), torch.device("cpu"))
        if dist.get_backend(self.group) == "nccl" and device.type != "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        return StepCheck(self.rank, self.world, self.group, device, list(self.inner.parameters()))

    def took_batch(self, epoch: int, batch: int) -> None:
        """Say that the next forward's inputs are batch ``batch`` of epoch ``epoch``
        (:func:`hapd.loader` calls it): the ranks' forwards are checked to take the
        same batch, so one that skipped or repeated a batch is named at once."""
        self._position = (int(epoch), int(batch))

    def _mode(self) -> str:
        if not self.training:
            return "eval"
        return "training" if torch.is_grad_enabled() else "training (no_grad)"

    # -- what the plan says --------------------------------------------------------------

    def _input_names(self) -> tuple[str, ...] | None:
        if getattr(self.inner, "hapd_duplicas", 1) != 1:
            return None  # two duplicas' inputs
        return tuple(name for name, _ in self.inner.hapd_inputs)

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
        """The shape of each input of the global batch the training program runs (both
        duplicas' when it runs two of half the batch)."""
        return [list(s) for s in self._example_shapes]

    @staticmethod
    def _program_shapes(inner: RankModule) -> Shapes:
        """The global batch's shapes of a program: its plan's inputs, the batch dim 0
        times its duplicas."""
        view = inner.hapd_view
        duplicas = int(getattr(inner, "hapd_duplicas", 1))
        shapes = [list(view.full_shape(n)) if n in view.tensors else [] for n, _ in inner.hapd_inputs]
        return tuple(tuple([s[0] * duplicas, *s[1:]] if s else s) for s in shapes)

    def sample_lengths(self, batch: int | None = None, *, shapes: Sequence[Sequence[int]] | None = None
                       ) -> list[int] | None:
        """Samples of each global batch every rank reads, when every input is split
        along dim 0 with the same lengths (data-parallel inputs); None when some rank
        needs more of the batch (an input replicated or split along another dim).

        ``batch``: for a global batch of that many samples (the example batch's other
        dims), as the program of the current mode for it splits it (collective when
        that program is not built yet); ``shapes``: for a global batch of these input
        shapes (other dims too, e.g. another sequence length; collective alike);
        default: the training program's example batch."""
        if shapes is not None:
            shapes = tuple(tuple(int(n) for n in s) for s in shapes)
            if self.world == 1:
                return [shapes[0][0]] if shapes and shapes[0] else None
            program = self._program(self.training, shapes)
        elif batch is None:
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

    def shard_inputs(self, *global_batch: Tensor, **global_dict: Tensor) -> tuple[Tensor, ...] | dict[str, Tensor]:
        """This rank's pieces of the global batch, in forward order, as the program of
        the current mode for its shapes cuts it (collective when that program is not
        built yet); the next forwards run that program. A dict batch
        (``shard_inputs(**batch)``) gives a dict of the pieces, for ``module(**pieces)``."""
        if global_dict:
            pieces = self.shard_inputs(*self._positional(global_batch, global_dict, "shard_inputs"))
            return dict(zip(self.keywords, pieces))
        check_tensors(global_batch, "shard_inputs")
        if len(global_batch) != len(self.inner.hapd_inputs):
            return self.inner.shard_inputs(*global_batch)  # the error naming the inputs
        shapes = tuple(tuple(t.shape) for t in global_batch)
        program = self._program(self.training, shapes)
        pieces = program.shard_inputs(*global_batch)
        self._cut = (shapes, _input_split(program))
        return _joined_halves(program, pieces)

    def expect_batch(self, *global_shapes: Sequence[int], lengths: Sequence[int] | None = None) -> None:
        """Say that the next forwards get this rank's pieces of a global batch of these
        shapes (what :meth:`shard_inputs` says by itself), cut along dim 0 in
        ``lengths`` samples per rank (default: as the program of the current mode for
        it cuts them); a forward whose program cuts otherwise is a
        :class:`~hapd.errors.PlanError`. :func:`hapd.loader` calls it for every batch.
        Collective when that program is not built yet."""
        shapes = tuple(tuple(int(n) for n in s) for s in global_shapes)
        program = self._program(self.training, shapes)
        split = _input_split(program) if lengths is None else tuple((gather(0), tuple(lengths)) for _ in shapes)
        self._cut = (shapes, split)

    # -- the programs --------------------------------------------------------------------

    def _program(self, training: bool, shapes: Shapes) -> RankModule:
        """The program for a global batch of ``shapes`` in that mode (the training one
        stands for eval where no op computes differently), built on first need."""
        key = (training or not self._mode_dependent, shapes)
        found = self._programs.get(key)
        if found is None:
            if self._check is not None:  # building is collective: only when every rank builds this one
                self._check.agree(self._check.arrival("build", self._mode(), self._position, shapes))
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
        program, graph = recipe.export_for(training, shapes)
        options = self._aligned_options(graph)
        try:
            source, module = self._distribute(program, graph, options)
        except PlanError as exc:
            fallback = self._replicated_options()
            if fallback is None or options.mode == fallback.mode:
                raise PlanError(f"{what}: no plan holds the parameters as the training plan does: {exc}") from exc
            source, module = self._distribute(program, graph, fallback)
        if recipe.verbose and self.rank == 0:
            print(source.describe(f"plan ({mode}, batch shapes {[list(s) for s in shapes]})"), flush=True)
        self.program_sources[(training, shapes)] = source
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
                            check_graph=False, shared=self.inner, weights=recipe.weights, rng=recipe.rng)
        return source, module

    # -- running -------------------------------------------------------------------------

    def forward(self, *local_inputs: Tensor, **local_dict: Tensor) -> Tensor:
        """This rank's part of the loss of the global batch whose pieces these are, by
        the program of the current mode for that batch (the one :meth:`shard_inputs`
        or :meth:`expect_batch` named last; the example batch when neither did — on one
        process as on several ranks, so a script that runs on one runs on many).
        ``module(**batch)`` for a module made from a dict batch (:attr:`keywords`)."""
        local_inputs = self._positional(local_inputs, local_dict, "forward")
        check_tensors(local_inputs, "forward")
        program = self._forward_program(local_inputs)
        local_inputs = _split_halves(program, local_inputs)
        expected = program.local_shapes()
        got = [list(t.shape) for t in local_inputs]
        names = [name for name, _ in program.hapd_inputs]
        pending = self._start_check(program, names, got, expected)
        _check_shapes(self.rank, names, got, expected)
        run = self._runner(program) if pending is None else _waiting(self._runner(program), pending)
        with plan_autocast(self.plan.precision, local_inputs, self.__dict__.setdefault("_precision_said", set())):
            return self._telemetry.forward(self, run, local_inputs)

    def _start_check(self, program: RankModule, names: Sequence[str], got: Sequence[Sequence[int]],
                     expected: Sequence[Sequence[int]]) -> Pending | None:
        """Check this forward against the other ranks' before its first collective
        (:class:`~hapd.spmd.stepwatch.StepCheck`): done here when the program's forward
        communicates or this rank's inputs do not fit; else left in flight, returned,
        for the forward to wait on once it has computed (a data-parallel forward has no
        collective: its first is the backward's gradient sum)."""
        if self._check is None:
            return None
        shapes = self._cut[0] if self._cut is not None else self._example_shapes
        position, self._position = self._position, None
        arrival = self._check.arrival("forward", self._mode(), position, shapes, names, got, expected)
        pending = self._check.start(arrival)
        if arrival.given is None and not _forward_communicates(program):
            return pending
        pending.wait()
        return None

    def _runner(self, program: RankModule) -> Callable[..., Tensor]:
        """``program``, or its ``torch.compile`` when the module compiles (made once per
        program, kept outside the module's children so parameters are not listed twice)."""
        options = self._recipe.compile if self._recipe is not None else None
        if options is None:
            return program
        compiled = self.__dict__.setdefault("_compiled", {})
        if id(program) not in compiled:
            compiled[id(program)] = torch.compile(program, **options)
        return compiled[id(program)]

    def _forward_program(self, local_inputs: Sequence[Tensor]) -> RankModule:
        # One process as on several ranks: the batch is the example batch, or the one
        # shard_inputs / expect_batch (the loader) named last; another is refused below.
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
        """This rank's pieces (what checkpoints save and load: :mod:`hapd.state.held`):
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
        return self._with_aliases(list(by_id.values()))  # names the rank module does not hold

    def params_by_kind(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
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
        split, replicated = self.params_by_kind()
        device = next((p.grad.device for p in split + replicated), torch.device("cpu"))
        if math.isinf(norm_type):
            local = max_abs(split, device)
            if self.world > 1:
                dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self.group)
            total = torch.maximum(local, max_abs(replicated, device))
        else:
            local = power_sum(split, norm_type, device)
            if self.world > 1:
                dist.all_reduce(local, group=self.group)
            total = (local + power_sum(replicated, norm_type, device)) ** (1.0 / norm_type)
        return clip_grads(split + replicated, total, max_norm, norm_type, error_if_nonfinite)

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


def check_tensors(values: Sequence[Any], what: str) -> None:
    """Every input a tensor: :class:`~hapd.errors.OptionsError` naming the first that is
    not (a list, None, a dict of a dataset's sample), not an AttributeError from inside."""
    for k, value in enumerate(values):
        if not isinstance(value, Tensor):
            raise OptionsError(f"{what}: input {k} is a {type(value).__name__}, not a tensor (pass the batch's "
                               "tensors as separate arguments, in the order of the example inputs)",
                               field=f"inputs[{k}]")


def _waiting(run: Callable[..., Tensor], pending: Pending) -> Callable[..., Tensor]:
    """``run``, then the wait for the forward's check in flight (also when ``run``
    raises: a disagreement of the ranks is then the cause, and raised instead)."""
    def forward(*inputs: Tensor) -> Tensor:
        try:
            out = run(*inputs)
        except Exception:
            pending.wait()
            raise
        pending.wait()
        return out
    return forward


def _forward_communicates(program: RankModule) -> bool:
    """Whether ``program``'s forward runs a collective: a module of it holding a process
    group or an exchange (the plan's collectives, a global sum, synced batch norm,
    duplicas' exchanges) or a call into :mod:`hapd.spmd.collectives`. Kept per program."""
    found = program.__dict__.get("_hapd_communicates")
    if found is None:
        found = any(hasattr(m, "group") or hasattr(m, "exchange") for m in program.modules() if m is not program) \
            or any(n.op == "call_function" and getattr(n.target, "__module__", "") == "hapd.spmd.collectives"
                   for n in program.graph.nodes)
        program.__dict__["_hapd_communicates"] = found
    return found


def _check_shapes(rank: int, names: Sequence[str], got: Sequence[Sequence[int]],
                  expected: Sequence[Sequence[int]]) -> None:
    """:class:`~hapd.errors.PlanError` naming the first input whose shape is not the one
    the plan runs on this rank (an empty expected shape takes any)."""
    if len(got) != len(expected):
        raise PlanError(f"rank {rank}: {len(got)} inputs given, the plan runs {len(expected)} "
                        f"({', '.join(names)})", field="inputs")
    for k, (g, e) in enumerate(zip(got, expected)):
        if e and list(g) != list(e):
            name = names[k] if k < len(names) else f"input {k}"
            raise PlanError(f"rank {rank}: input {k} ({name}): expected shape {list(e)}, given {list(g)} (the plan "
                            "runs a batch of the example's size: cut a batch of another size with shard_inputs, or "
                            "read it with hapd.loader)", field=f"inputs[{k}]")


def _joined_halves(program: RankModule, pieces: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """A duplica program's pieces of both halves (the first half's inputs, then the
    second's) as one tensor per model input, the halves joined along its batch dim: the
    forward's arguments have the model's arity whatever runs."""
    if getattr(program, "hapd_duplicas", 1) == 1:
        return tuple(pieces)
    n = len(pieces) // 2
    return tuple(a if d is None else torch.cat([a, b], dim=d)
                 for a, b, d in zip(pieces[:n], pieces[n:], program.hapd_batch_dims))


def _split_halves(program: RankModule, inputs: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """The inverse of :func:`_joined_halves` for a duplica program given one tensor per
    model input (its pieces of the two halves as the program's inputs); else ``inputs``."""
    dims = getattr(program, "hapd_batch_dims", None)
    if getattr(program, "hapd_duplicas", 1) == 1 or dims is None or len(inputs) != len(dims):
        return tuple(inputs)
    single = program.hapd_single.local_shapes()
    first, second = [], []
    for t, d, shape in zip(inputs, dims, single):
        if d is None:
            first.append(t)
            second.append(t)
            continue
        first.append(t.narrow(d, 0, shape[d]))
        second.append(t.narrow(d, shape[d], t.shape[d] - shape[d]))
    return (*first, *second)


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


def power_sum(params: Sequence[nn.Parameter], norm_type: float, device: torch.device) -> Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        total += torch.linalg.vector_norm(p.grad.detach(), norm_type).to(torch.float32) ** norm_type
    return total


def max_abs(params: Sequence[nn.Parameter], device: torch.device) -> Tensor:
    total = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        if p.grad.numel():
            total = torch.maximum(total, p.grad.detach().abs().max().to(torch.float32))
    return total


def clip_grads(params: Iterable[Tensor], total: Tensor, max_norm: float, norm_type: float,
               error_if_nonfinite: bool) -> Tensor:
    """Scale the gradients of ``params`` (those that have one) so that their norm ``total``
    becomes at most ``max_norm``, as :func:`torch.nn.utils.clip_grad_norm_`; returns
    ``total``. RuntimeError when it is not finite and ``error_if_nonfinite``."""
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        if p.grad is not None:
            p.grad.mul_(coef.to(p.grad.dtype))
    return total


__all__ = ["ParallelModule", "PlannedModule"]
