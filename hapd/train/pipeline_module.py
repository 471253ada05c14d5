"""The module users train when a pipeline won: :class:`PipelineModule`, one rank's
stage of a pipelined model, with :class:`~hapd.train.parallel_module.ParallelModule`'s
surface (:func:`hapd.parallelize` returns it when the plan's technique is a pipeline).

**A step runs at the forward.** A pipeline interleaves the micro-batches' forwards and
backwards (1F1B, :class:`~hapd.spmd.pipeline.PipelineRank`), so the forward cannot
return a loss whose graph the backward walks later. ``module(*batch)`` runs the whole
schedule on the global batch and keeps the gradients aside; it returns this rank's part
of the loss (the last stage's ranks hold it, the others hold zero: :meth:`global_loss`
sums them), and ``loss.backward()`` adds the kept gradients, times the gradient that
reaches the loss, to the parameters' ``.grad``. So ``(loss / 2).backward()`` for
accumulation, a loss never backpropagated and ``zero_grad`` behave as for any module.

**The loss of the global batch.** A sum over samples is the micro-batches' sum. A mean
over counted targets (cross-entropy's ``mean``, labels ignored or not) is exact too:
each micro-batch's backward is seeded with its count, which makes the gradient of its
*sum*, and the kept gradients and the loss are divided by the whole batch's count (the
last stage broadcasts it) — the single-device mean, however the targets fall.

Every rank reads the whole global batch (:meth:`sample_lengths` is None, so
:func:`hapd.loader` hands every rank every batch, and :meth:`shard_inputs` returns it):
each stage cuts the micro-batches and its ranks' pieces of the inputs it reads.

Checkpoints: every rank holds its stage's pieces (:meth:`held_tensors`); a parameter
several stages hold (tied weights) is written by the first of them only. A checkpoint
written under a pipeline loads under any SPMD plan and world size, and the reverse.

Not run under a pipeline: ``eval()`` forwards and global batches of other shapes
(a :class:`~hapd.errors.PlanError` says so; parallelize with ``options={"pipeline":
"off"}`` for a module that runs them).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hapd.errors import PlanError
from hapd.train import telemetry
from hapd.state.held import Held
from hapd.train.precision import plan_autocast
from hapd.train.parallel_module import ParallelModule, PlannedModule, check_tensors, clip_grads, max_abs, power_sum
from hapd.spmd.pipeline import PipelineRank, build_pipeline
from hapd.train.plan_source import PlanSource
from hapd.train.programs import Recipe, keyword_names


class _KeptGradients(torch.autograd.Function):
    """The loss of a step that already ran its backward: its backward adds the kept
    gradients, times the gradient reaching the loss, to the parameters."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, loss: Tensor, module: "PipelineModule") -> Tensor:  # noqa: ARG004
        ctx.module = module
        ctx.kept = module._kept
        module._kept = None
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, None]:
        if ctx.kept is None:
            raise PlanError("this loss was backpropagated already: a pipeline step's gradients are added once")
        ctx.module._add(ctx.kept, grad.detach())
        ctx.kept = None
        return None, None, None


class PipelineModule(PlannedModule):
    """One rank's stage of a pipelined model (see the module docstring).

    ``pipe``: this rank's :class:`PipelineRank`; ``source``: where the plan (the one with
    the pipeline) came from; ``stage_source``: the stage's own SPMD plan; ``sizes``:
    every state-dict key of the whole model (the first name of a tied tensor) and its
    shape; ``owners``: the stage that writes each key to checkpoints."""

    def __init__(self, pipe: PipelineRank, source: PlanSource, stage_source: PlanSource, *,
                 sizes: Mapping[str, tuple[int, ...]], owners: Mapping[str, int],
                 aliases: Mapping[str, str] | None = None, extra: Mapping[str, Tensor] | None = None,
                 example_shapes: Sequence[Sequence[int]] = ()):
        super().__init__(source, group=None, aliases=aliases, extra=extra)
        self.pipe = pipe
        # the stage as an SPMD module of its group: its pieces, layouts and state dict
        self.stage = ParallelModule(pipe.module, stage_source, group=pipe.group)
        self._sizes = {k: tuple(v) for k, v in sizes.items()}
        self._owners = dict(owners)
        self._example_shapes = tuple(tuple(int(n) for n in s) for s in example_shapes)
        self._kept: list[Tensor | None] | None = None
        self._telemetry = telemetry.for_module(self, instead_of=self.stage)
        """Times each training step for the launcher, progress and logs (:mod:`hapd.train.telemetry`)."""

    # -- what the plan says --------------------------------------------------------------

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world(self) -> int:
        return dist.get_world_size()

    @property
    def stage_index(self) -> int:
        return self.pipe.s

    def global_shapes(self) -> list[list[int]]:
        return [list(s) for s in self._example_shapes]

    def sample_lengths(self, batch: int | None = None) -> list[int] | None:
        """None: every rank reads every global batch whole (each stage cuts its part)."""
        if batch is not None and self._example_shapes and batch != self._example_shapes[0][0]:
            raise PlanError(f"a pipeline runs only its global batch of {self._example_shapes[0][0]} samples, "
                            f"not {batch} (pass drop_last=True to the loader)")
        return None

    def shard_inputs(self, *global_batch: Tensor, **global_dict: Tensor) -> tuple[Tensor, ...] | dict[str, Tensor]:
        """The global batch itself: every stage reads the micro-batches of it it needs."""
        if global_dict:
            self.shard_inputs(*self._positional(global_batch, global_dict, "shard_inputs"))
            return dict(global_dict)
        check_tensors(global_batch, "shard_inputs")
        self._check_shapes(global_batch)
        return tuple(global_batch)

    def expect_batch(self, *global_shapes: Sequence[int], lengths: Sequence[int] | None = None) -> None:
        self._check_shapes(global_shapes)

    def _check_shapes(self, batch: Sequence[Any]) -> None:
        shapes = tuple(tuple(int(n) for n in (t.shape if isinstance(t, Tensor) else t)) for t in batch)
        if self._example_shapes and shapes != self._example_shapes:
            raise PlanError(f"a pipeline runs the global batch of shapes {[list(s) for s in self._example_shapes]}, "
                            f"not {[list(s) for s in shapes]}")

    # -- running -------------------------------------------------------------------------

    def forward(self, *global_batch: Tensor, **global_dict: Tensor) -> Tensor:
        """Runs the pipeline's schedule on the global batch; returns this rank's part of
        the loss, whose ``backward()`` adds the step's gradients (module docstring).
        ``module(**batch)`` for a module made from a dict batch."""
        global_batch = self._positional(global_batch, global_dict, "forward")
        return self._telemetry.forward(self, self._step, global_batch)

    def _step(self, *global_batch: Tensor) -> Tensor:
        check_tensors(global_batch, "forward")
        if not self.training:
            raise PlanError("eval() forward: a pipeline runs only training steps (parallelize with "
                            "options={'pipeline': 'off'} for a module that evaluates)")
        self._check_shapes(global_batch)
        params = [p for p in self.stage.parameters()]
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            with plan_autocast(self.plan.precision, global_batch, self.__dict__.setdefault("_precision_said", set())):
                total = self.pipe.step(*global_batch)
        finally:
            fresh = [p.grad for p in params]
            for p, g in zip(params, before):
                p.grad = g
        count = self.pipe.batch_count()
        scale = 1.0 / float(count)
        self._kept = [None if g is None else g.mul_(scale) for g in fresh]
        loss = (total.to(torch.float64) * scale).to(total.dtype)
        anchor = torch.zeros((), requires_grad=True)
        return _KeptGradients.apply(anchor, loss, self)

    @torch.no_grad()
    def _add(self, kept: list[Tensor | None], grad: Tensor) -> None:
        for p, g in zip(self.stage.parameters(), kept):
            if g is None:
                continue
            g = g if bool(grad == 1) else g * grad.to(g.dtype)
            p.grad = g if p.grad is None else p.grad.add_(g)

    def global_loss(self, local: Tensor) -> float:
        """The single-device loss from this rank's part (collective)."""
        total = local.detach().clone().to(torch.float64)
        dist.all_reduce(total)
        return float(total)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulating is exact without it; a pipeline sums each step's gradients in
        its stages' groups as the step runs, inside or outside this context."""
        yield

    # -- parameters ----------------------------------------------------------------------

    def parameter_layouts(self) -> dict[str, str]:
        return self.stage.parameter_layouts()

    def state_sizes(self) -> dict[str, tuple[int, ...]]:
        """Every state-dict key of the whole model (tied tensors under their first
        name) and its full shape."""
        return dict(self._sizes)

    def held_tensors(self) -> list[Held]:
        """This rank's stage's pieces (and the state no stage reads), each marked as
        written here or by an earlier stage that holds it too."""
        out = []
        for h in self.stage.held_tensors():
            owner = self._owners.get(h.key, self.pipe.s)
            out.append(h if owner == self.pipe.s else Held(h.key, h.local, h.offsets, h.size, writes=False))
        for key in sorted(self.extra):
            tensor = self.extra[key]
            out.append(Held(key, tensor, (0,) * tensor.dim(), tuple(tensor.shape), writes=self.rank == 0))
        return sorted(out, key=lambda h: h.key)

    def tied_names(self) -> list[list[str]]:
        return self._with_aliases([list(g) for g in self.stage.tied_names()])

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False) -> Tensor:
        """As :meth:`ParallelModule.clip_grad_norm_`, over every stage: a tensor several
        stages hold is counted once. Collective."""
        norm_type = float(norm_type)
        split, replicated = self.stage.params_by_kind()
        names = {id(p): n for n, p in self.stage.inner.named_parameters()}

        def mine(p: Tensor) -> bool:  # a tensor several stages hold: the first of them counts it
            return self._owners.get(names[id(p)], self.pipe.s) == self.pipe.s

        split = [p for p in split if mine(p)]
        # replicated parameters: counted by the stage group's first rank only
        replicated = [p for p in replicated if mine(p)] if self.pipe.local == 0 else []
        device = next((p.grad.device for p in self.stage.parameters() if p.grad is not None), torch.device("cpu"))
        if math.isinf(norm_type):
            total = max_abs(split + replicated, device)
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        else:
            total = power_sum(split + replicated, norm_type, device)
            dist.all_reduce(total)
            total = total ** (1.0 / norm_type)
        return clip_grads(self.stage.parameters(), total, max_norm, norm_type, error_if_nonfinite)

    # -- the single-device state dict ----------------------------------------------------

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, Tensor]:
        """The single-device model's state dict, gathered from every stage. Collective."""
        mine = self.stage.full_state_dict()  # collective in the stage's group
        mine = {k: v for k, v in mine.items() if self._owners.get(k, self.pipe.s) == self.pipe.s} \
            if self.pipe.local == 0 else {}
        parts: list[Any] = [None] * self.world
        dist.all_gather_object(parts, mine)
        out: dict[str, Tensor] = {}
        for part in parts:
            out.update(part)
        for key, value in self.extra.items():
            out[key] = value.detach().cpu().clone()
        for key, target in self.aliases.items():
            out[key] = out[target]
        return dict(sorted(out.items()))

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> None:
        """Load a single-device state dict: every rank copies its stage's pieces."""
        if strict:
            missing = sorted(set(self._sizes) - set(state_dict))
            unexpected = sorted(set(state_dict) - set(self._sizes) - set(self.aliases))
            if missing or unexpected:
                raise PlanError(f"load_full_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")
        self.stage.load_full_state_dict(state_dict, strict=False)
        for key in self.extra:
            if key in state_dict:
                self.extra[key] = state_dict[key].detach().clone()



def build_pipeline_module(recipe: Recipe, source: PlanSource, profile: Any, options: Any, *,
                          weights: Any = None) -> PipelineModule:
    """This rank's :class:`PipelineModule` of ``recipe``'s model for a plan whose
    pipeline won (collective): the micro-batch's program cut from the model's one
    export, its stages as :func:`~hapd.spmd.pipeline.build_pipeline` builds them
    (rank 0 compiles every stage's plan), and what checkpoints need of the whole model."""
    if weights is not None:
        raise PlanError("a pipeline reads its stages' weights from the model: parallelize a model on the meta device "
                        "with options={'pipeline': 'off'}")
    model, example_inputs = recipe.model, recipe.example_inputs
    m = int(source.plan.pipeline["micro_batches"])
    program = recipe.export_at(True, recipe.batch // m)[0]
    pipe = build_pipeline(model, example_inputs, recipe.batch_dims, source.plan, profile, options,
                          device=recipe.device, mean_loss=True, program=program)
    module = pipe.module
    mine = {**{k: tuple(module.hapd_view.full_shape(t)) if t in module.hapd_view.tensors else
               tuple(module.get_parameter(k).shape) for k, (t, _) in module.hapd_params.items()},
            **{k: tuple(module.hapd_view.full_shape(t)) if t in module.hapd_view.tensors else
               tuple(module.get_buffer(a).shape) for k, (t, _, a) in module.hapd_buffers.items()},
            **{k: tuple(module.get_buffer(k).shape) for k in module.hapd_updated}}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (pipe.s, mine))
    sizes: dict[str, tuple[int, ...]] = {}
    owners: dict[str, int] = {}
    for stage, held in sorted(everyone, key=lambda e: e[0]):
        for key, size in held.items():
            sizes.setdefault(key, size)
            owners.setdefault(key, stage)
    state = model.state_dict(keep_vars=True)
    by_tensor: dict[int, str] = {}
    for key, tensor in state.items():
        if key in sizes:
            by_tensor.setdefault(id(tensor), key)
    aliases = {k: by_tensor[id(t)] for k, t in state.items() if k not in sizes and id(t) in by_tensor}
    extra = {k: t.detach().clone() for k, t in state.items() if k not in sizes and k not in aliases}
    sizes.update({k: tuple(t.shape) for k, t in extra.items()})
    stage_source = PlanSource(pipe.plans[pipe.s], f"stage {pipe.s} of the pipeline", 0.0)
    shapes = [tuple(t.shape) for t in example_inputs]
    module = PipelineModule(pipe, source, stage_source, sizes=sizes, owners=owners, aliases=aliases, extra=extra,
                            example_shapes=shapes)
    module.keywords = keyword_names(recipe.model)  # a dict batch: module(**batch)
    return module


__all__ = ["PipelineModule", "build_pipeline_module"]
