"""``hapd check``: does the distributed program compute what the model computes?

:func:`check` compiles the program for one device with the core, builds the rank
program (:func:`hapd.spmd.rewrite.distribute`, world 1: no process group needed) and
runs one training step of it and of the eager ``program.module()`` (its dropouts drawn
with hapd's counter-based generator, as the rank program draws them) on the program's
example inputs (float inputs perturbed with a seeded generator, integer ones kept). It
compares the loss, the gradient of every parameter, and every buffer after the step
(batch norm's running statistics), and reports the worst errors. A one-device plan
runs every op of the lowered graph through the same replay, adapters and write-back as
a real plan, so an op the lowering dropped, a write it lost, or an adapter that changes
values shows up here without a cluster.

Errors are measured against the size of the reference tensor: a tensor matches when
``max|got − expected| ≤ atol + rtol · max|expected|``.

It lives in the runtime's room (it runs the rank program); the compiler's room below
may not import the runtime.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram

from hapd.compiler.driver import compile as compile_plan
from hapd.ir.lower import load_exported, lower
from hapd.ir.normalize import buffer_mutations, normalize
from hapd.errors import ExportError
from hapd.profile.schema import estimated_profile
from hapd.spmd.random.random_ops import COUNTER_RNG, counter_reference
from hapd.spmd.rewrite import distribute

DEFAULT_RTOL = 1e-5
"""Relative tolerance (float32 arithmetic on the same ops in another grouping)."""
DEFAULT_ATOL = 1e-7
"""Absolute tolerance, for tensors whose reference is (nearly) zero."""
DEFAULT_SEED = 0
"""Seed of the input perturbation and of the random ops of both runs."""


@dataclass(frozen=True)
class Difference:
    """How one tensor of the distributed step differs from the eager one."""

    name: str
    """``loss``, ``grad <parameter fqn>`` or ``buffer <buffer fqn>``."""
    max_abs: float
    """Largest absolute difference (``inf`` when shapes or presence differ)."""
    scale: float
    """Largest absolute value of the reference."""
    ok: bool
    """Within tolerance."""
    note: str = ""
    """Why the tensors cannot be compared element by element, when they cannot."""

    @property
    def relative(self) -> float:
        """``max_abs / scale`` (``max_abs`` itself for a zero reference)."""
        return self.max_abs / self.scale if self.scale > 0 else self.max_abs

    def line(self) -> str:
        """One readable line."""
        status = "ok  " if self.ok else "FAIL"
        extra = f"  ({self.note})" if self.note else ""
        return f"{status} {self.name:<56} rel {self.relative:.3e}  abs {self.max_abs:.3e}{extra}"


@dataclass(frozen=True)
class CheckReport:
    """The comparison of one distributed training step with the eager one."""

    differences: tuple[Difference, ...]
    """Every compared tensor: the loss, then gradients, then buffers."""
    rtol: float
    atol: float
    loss: float
    """The eager loss."""

    @property
    def ok(self) -> bool:
        """Every tensor within tolerance."""
        return all(d.ok for d in self.differences)

    @property
    def failures(self) -> tuple[Difference, ...]:
        return tuple(d for d in self.differences if not d.ok)

    def worst(self, count: int = 5) -> list[Difference]:
        """The ``count`` largest relative errors, failures first."""
        return sorted(self.differences, key=lambda d: (d.ok, -d.relative))[:count]

    def format(self, count: int = 5) -> str:
        """A summary for a person: verdict, then the worst tensors."""
        verdict = "equal" if self.ok else f"DIFFERENT ({len(self.failures)} tensors)"
        head = (
            f"1-rank distributed step vs eager: {verdict} within rtol {self.rtol:g}, atol {self.atol:g}; "
            f"{len(self.differences)} tensors compared, loss {self.loss:.6g}"
        )
        return "\n".join([head, "worst:", *(f"  {d.line()}" for d in self.worst(count))])


def check(
    program: ExportedProgram | str | Path,
    *,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    plan: Any = None,
    inputs: Sequence[Tensor] | None = None,
    perturb: bool = True,
    seed: int = DEFAULT_SEED,
) -> CheckReport:
    """One training step of the 1-rank distributed program against eager
    ``program.module()``.

    ``program``: an exported program or a ``.pt2`` path. ``plan``: a one-device plan to
    use (default: compile one for an estimated one-device profile). ``inputs``: the full
    batch (default: the program's example inputs, float ones perturbed with ``seed``).
    """
    if not isinstance(program, ExportedProgram):
        program, _ = load_exported(program)
    inputs = tuple(inputs) if inputs is not None else example_inputs(program, perturb=perturb, seed=seed)
    normalized = normalize(program)
    if plan is None:
        plan = _one_device_plan(lower(normalized))
    distributed = _distributed_step(normalized, plan, inputs, seed)
    eager = _eager_step(program, inputs, seed)
    return _compare(eager, distributed, rtol=rtol, atol=atol)


def example_inputs(program: ExportedProgram, *, perturb: bool = True, seed: int = DEFAULT_SEED) -> tuple[Tensor, ...]:
    """The program's example inputs; float ones moved by seeded noise of their own
    scale (so that a check does not rest on one special batch), others kept."""
    stored = program.example_inputs
    if stored is None:
        raise ExportError("the program carries no example inputs; pass inputs= to check it")
    args, kwargs = stored
    if kwargs:
        raise ExportError(f"the program's example inputs have keywords ({', '.join(kwargs)}); hapd passes inputs by position")
    generator = torch.Generator().manual_seed(seed)
    out = []
    for value in args:
        if not isinstance(value, Tensor):
            raise ExportError(f"example input {value!r} is not a tensor")
        value = value.detach().clone()
        if perturb and value.is_floating_point() and value.numel():
            scale = float(value.abs().max()) or 1.0
            noise = torch.randn(value.shape, generator=generator, dtype=value.dtype)
            value = value + 0.1 * scale * noise.to(value.device)
        out.append(value)
    return tuple(out)


def _one_device_plan(ir: Any) -> Any:
    """A plan for one estimated device (every op runs, nothing is communicated)."""
    return compile_plan(ir, estimated_profile(1, name="check"))


@dataclass(frozen=True)
class _Step:
    """What one training step produced."""

    loss: Tensor
    grads: dict[Any, Tensor | None]
    """Gradient by parameter name (eager: by the tuple of a tied parameter's names)."""
    buffers: dict[str, Tensor]


def _distributed_step(program: ExportedProgram, plan: Any, inputs: tuple[Tensor, ...], seed: int) -> _Step:
    """One forward and backward of the rank-0 program of a one-device plan."""
    module = distribute(program, plan, rank=0, world=1, seed=seed, rng=COUNTER_RNG)
    torch.manual_seed(seed)
    loss = module(*module.shard_inputs(*inputs))
    loss.backward()
    grads = {fqn: module.get_parameter(fqn).grad for fqn in module.hapd_params}
    buffers = {target: module.get_buffer(target).detach().clone() for target, _ in buffer_mutations(program)}
    return _Step(loss.detach(), grads, buffers)


def _eager_step(program: ExportedProgram, inputs: tuple[Tensor, ...], seed: int) -> _Step:
    """One forward and backward of ``program.module()`` (a copy: its buffers are the
    program's own tensors, and a step updates them), its dropouts drawn with hapd's
    generator and ``seed`` (:func:`hapd.spmd.random.random_ops.counter_reference`)."""
    module: nn.Module = counter_reference(program, seed)
    torch.manual_seed(seed)
    loss = module(*inputs)
    loss.backward()
    grads = {names: p.grad for names, p in _aliased(module.named_parameters(remove_duplicate=False))}
    buffers = {name: b.detach().clone() for name, b in module.named_buffers()}
    return _Step(loss.detach(), grads, buffers)


def _aliased(named: Any) -> list[tuple[tuple[str, ...], Tensor]]:
    """Each tensor once with all its names (tied weights: ``shared.weight`` and
    ``lm_head.weight``; the exported program keeps one of them)."""
    by_id: dict[int, tuple[list[str], Tensor]] = {}
    for name, tensor in named:
        by_id.setdefault(id(tensor), ([], tensor))[0].append(name)
    return [(tuple(names), tensor) for names, tensor in by_id.values()]


def _compare(eager: _Step, distributed: _Step, *, rtol: float, atol: float) -> CheckReport:
    """Loss, then every eager parameter's gradient, then every buffer the distributed
    program updates and every eager buffer that changed."""
    diffs = [_difference("loss", distributed.loss, eager.loss, rtol, atol)]
    for names, expected in eager.grads.items():
        name = next((n for n in names if n in distributed.grads), names[0])
        diffs.append(_difference(f"grad {name}", distributed.grads.get(name), expected, rtol, atol, missing_is_zero=True))
    for name, got in distributed.buffers.items():
        diffs.append(_difference(f"buffer {name}", got, eager.buffers.get(name), rtol, atol))
    return CheckReport(tuple(diffs), rtol, atol, float(eager.loss))


def _difference(
    name: str,
    got: Tensor | None,
    expected: Tensor | None,
    rtol: float,
    atol: float,
    *,
    missing_is_zero: bool = False,
) -> Difference:
    """Compare two tensors; an absent one is zero where ``missing_is_zero`` (an unused
    parameter has no gradient in either run) and a failure otherwise."""
    if missing_is_zero:
        if got is None and expected is None:
            return Difference(name, 0.0, 0.0, True)
        if got is None:
            got = torch.zeros_like(expected)
        elif expected is None:
            expected = torch.zeros_like(got)
    if got is None or expected is None:
        which = "the distributed step" if got is None else "the eager step"
        return Difference(name, float("inf"), 0.0, False, note=f"absent from {which}")
    if got.shape != expected.shape:
        return Difference(name, float("inf"), 0.0, False, note=f"shape {list(got.shape)} vs {list(expected.shape)}")
    a = got.detach().to(torch.float64).cpu()
    b = expected.detach().to(torch.float64).cpu()
    max_abs = float((a - b).abs().max()) if a.numel() else 0.0
    scale = float(b.abs().max()) if b.numel() else 0.0
    ok = bool(max_abs <= atol + rtol * scale)
    return Difference(name, max_abs, scale, ok)
