"""The exactness harness: a model compiled with uneven ratios on W Gloo ranks computes
what the single-device model computes.

A :class:`Spec` names a model (a builder returning ``(module, example_inputs)`` with a
forward that returns the loss), the plan's search mode, the rules to force (from the
lowered graph's document) and the ``(op, rule)`` pairs the plan must run. The parent
exports each model once, runs the single-device reference (``program.module()``: the
loss, every gradient by every name, and the loss after each of ``steps`` Adam steps)
and compiles a plan per spec; :func:`run_specs` then runs every case on the ranks in
one :func:`_dist.run_ranks` call, and each rank compares its piece of every gradient
and the global loss before and after the Adam steps.

Used by ``test_rules_zoo.py`` (one rule per case), ``test_rules_gaps.py``,
``test_moe.py`` and ``test_zoo.py`` (the zoo on 2 and 4 ranks).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from _dist import run_ranks
from torch import Tensor, nn

import hapd
from hapd.compiler.options import CompileOptions
from hapd.profile.schema import estimated_profile
from hapd.spmd.random.random_ops import counter_reference

TOL = 1e-5
"""Relative tolerance of every comparison (fp32 sums in another grouping)."""
RATIOS = (0.6, 0.4)
"""Default sharding ratios: 2 ranks, uneven."""
LR = 1e-3
"""Adam's learning rate in the runs with steps."""

Force = Callable[[dict[str, Any]], dict[str, str]]
"""The forced rules of a case, from its lowered graph's document."""
Build = Callable[[], tuple[nn.Module, tuple[Tensor, ...]]]
"""A model and its example inputs (the forward returns the loss)."""


# --------------------------------------------------------------------------------------
# Forcing rules
# --------------------------------------------------------------------------------------


def _ops(doc: dict[str, Any], op: str) -> list[str]:
    """Names of the lowered graph's nodes of ``op``, in graph order."""
    return [n["name"] for n in doc["nodes"] if n.get("op") == op]


def _alternate(op: str, rules: tuple[str, ...]) -> Force:
    """The nodes of ``op`` in graph order given ``rules`` in turn."""
    return lambda doc: {n: rules[i % len(rules)] for i, n in enumerate(_ops(doc, op))}


def _all(op: str, rule: str) -> Force:
    """Every node of ``op`` given ``rule``."""
    return lambda doc: {n: rule for n in _ops(doc, op)}


def _merge(*forces: Force) -> Force:
    """The union of several forces (a later one wins on a node both name)."""
    return lambda doc: {k: v for f in forces for k, v in f(doc).items()}


def _seeded(cls: type[nn.Module], *inputs: Callable[[], Any]) -> Build:
    """A builder of ``cls()`` under seed 0 with the inputs ``inputs`` make."""

    def build() -> tuple[nn.Module, tuple[Tensor, ...]]:
        torch.manual_seed(0)
        module = cls()
        return module, tuple(make() for make in inputs)

    return build


def fill_zero_parameters(module: nn.Module, seed: int = 2) -> nn.Module:
    """``module`` with every all-zero parameter drawn from N(0, 0.2²) under ``seed``
    (torchvision's ViT zero-initializes its head, and with a zero head every gradient
    but the head's is zero: comparing them would prove little)."""
    torch.manual_seed(seed)
    for p in module.parameters():
        if not p.detach().any():
            nn.init.normal_(p, std=0.2)
    return module


class Spec(NamedTuple):
    name: str
    build: Build
    mode: str
    force: Force | None
    expect: frozenset  # (op, rule) pairs the plan must run
    overlap: bool = False  # compiled with overlap: a plan for half the batch, run as two duplicas


# --------------------------------------------------------------------------------------
# The parent: export, reference, compile
# --------------------------------------------------------------------------------------


class Reference(NamedTuple):
    """A model exported once and run on one device."""

    program: Any  # torch.export.ExportedProgram
    saved: bytes  # its normal form, saved (save_normal_form)
    ir: Any  # hapd.ir.lower.GraphIR
    inputs: tuple[Tensor, ...]
    losses: tuple[float, ...]  # the first loss, then the loss after each Adam step
    grads: dict[str, Tensor]  # the first gradients, by every name (tied ones included)


class Case(NamedTuple):
    name: str
    program: bytes  # the normal form, saved (save_normal_form)
    plan: bytes
    inputs: tuple[Tensor, ...]
    losses: tuple[float, ...]
    grads: dict[str, Tensor]
    expect: frozenset
    forced: dict[str, str]  # node -> the rule forced on it
    overlap: bool = False  # program and plan are for half the batch, run as two duplicas


def reference(build: Build, name: str, steps: int = 0) -> Reference:
    """Export and lower ``build()``'s model, and run a copy of ``program.module()``:
    the loss and gradients, then ``steps`` Adam steps (``LR``) and the loss after each."""
    module, inputs = build()
    program = hapd.export(module, inputs)
    ir = hapd.lower(program, name=name)
    # a copy (the steps must not change the program's weights), its dropouts drawn with
    # hapd's generator and the seed the ranks draw with (torch.manual_seed(0): _run_cases)
    single = counter_reference(program, seed=0)
    optimizer = torch.optim.Adam(single.parameters(), lr=LR)
    losses: list[float] = []
    grads: dict[str, Tensor] = {}
    for step in range(steps + 1):
        optimizer.zero_grad()
        loss = single(*inputs)
        losses.append(float(loss.detach()))
        if step == steps and step > 0:
            break
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in single.named_parameters(remove_duplicate=False)
                     if p.grad is not None}
        if step < steps:
            optimizer.step()
    return Reference(program, save_normal_form(program), ir, inputs, tuple(losses), grads)


def profile_flops(world: int) -> list[float]:
    """Estimated FLOP rates of ``world`` unequal devices (the first the fastest)."""
    return [1e10 * (world - r) for r in range(world)]


def make_case(spec: Spec, ratios: Sequence[float], ref: Reference) -> Case:
    """``spec`` compiled for ``len(ratios)`` estimated devices with ``ratios``."""
    world = len(ratios)
    saved, ir = ref.saved, ref.ir
    if spec.overlap:
        saved, ir = _half_batch(spec, ref)
    force = spec.force(ir.doc) if spec.force else {}
    profile = estimated_profile(world, flops=profile_flops(world))
    plan = hapd.compile(ir, profile, CompileOptions(ratios=tuple(ratios), mode=spec.mode, force=force,
                                                    overlap=spec.overlap))
    return Case(spec.name, saved, plan.to_bytes(), ref.inputs, ref.losses, ref.grads, spec.expect, force, spec.overlap)


def _half_batch(spec: Spec, ref: Reference) -> tuple[bytes, Any]:
    """The spec's model exported and lowered for the first half of its batch (dim 0):
    what one duplica of an overlapped run computes."""
    module, _ = spec.build()
    half = tuple(t.narrow(0, 0, t.shape[0] // 2) for t in ref.inputs)
    program = hapd.export(module, half)
    ir = hapd.lower(program, name=spec.name.split("/")[0])
    return save_normal_form(program), ir


def make_cases(specs: Sequence[Spec], ratios: Sequence[float], steps: int = 0,
               references: dict[Build, Reference] | None = None) -> list[Case]:
    """Every spec's case; specs with the same builder share one export and reference
    (kept in ``references`` when given, so that another world can reuse them)."""
    references = {} if references is None else references
    cases = []
    for spec in specs:
        if spec.build not in references:
            references[spec.build] = reference(spec.build, spec.name.split("/")[0], steps)
        ref = references[spec.build]
        if len(ref.losses) != steps + 1:
            raise ValueError(f"{spec.name}: its reference ran {len(ref.losses) - 1} Adam steps, not {steps}")
        cases.append(make_case(spec, ratios, ref))
    return cases


# --------------------------------------------------------------------------------------
# A rank
# --------------------------------------------------------------------------------------


def _relative(got: Tensor, expected: Tensor, floor: float) -> float:
    if not expected.numel():
        return 0.0
    return float((got - expected).abs().max()) / max(float(expected.abs().max()), floor)


def _grad_errors(module: Any, case: Case) -> dict[str, float]:
    """Relative error of this rank's piece of every parameter's gradient, by every name.
    A gradient that is zero in exact arithmetic is rounding noise in both runs: it is
    compared against a hundredth of the model's largest gradient."""
    floor = 1e-2 * max(float(g.abs().max()) for g in case.grads.values() if g.numel())
    named = dict(module.named_parameters(remove_duplicate=False))
    errors = {}
    for fqn, (tensor, layout) in module.hapd_params.items():
        full = case.grads.get(fqn)
        if full is None:  # no gradient: zero
            full = torch.zeros(module.hapd_view.full_shape(tensor), dtype=named[fqn].dtype)
        expected = module.hapd_view.local_value(tensor, layout, full)
        got = named[fqn].grad
        errors[fqn] = _relative(got if got is not None else torch.zeros_like(expected), expected, floor)
    return errors


def save_normal_form(program: Any) -> bytes:
    """``program``'s normal form (:func:`hapd.ir.normalize.normalize`: what
    lowering made of it), saved with ``torch.export.save``: what the ranks load
    (:func:`load_normal_form`).

    Why the normal form and not the program as exported: each rank would otherwise make
    every model functional again (``run_decompositions``), 0.5–3 s of CPU per model and
    rank, most of these tests' time on the ranks and none of what they check. Ranks
    that load a user's ``.pt2`` and normalize it themselves are tested where that is
    the subject (``test_worker.py``, ``test_api.py``, the save/load tests of
    ``test_lowering.py``)."""
    from hapd.ir.normalize import normalize

    buf = io.BytesIO()
    torch.export.save(normalize(program), buf)
    return buf.getvalue()


def load_normal_form(saved: bytes) -> Any:
    """The program :func:`save_normal_form` saved, known as normalized again: the
    passes after functionalization run once more (on the normal form they change
    nothing, and :func:`distribute_saved` checks it: its graph id must be the plan's)."""
    import logging

    from hapd.ir.normalize import normalize

    quiet = logging.getLogger("torch.export.pt2_archive._package")  # an empty tensor's load is logged
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():  # torch reads weights from a read-only buffer and says so
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            program = torch.export.load(io.BytesIO(saved))
    finally:
        quiet.setLevel(level)
    return normalize(program, functional=True)


class _Loaded:
    """A program loaded on a rank, and its graph id once a plan was checked against it."""

    def __init__(self, program: Any):
        self.program = program
        self.graph_id: str | None = None


def _loaded(saved: bytes, loaded: dict[bytes, _Loaded]) -> _Loaded:
    """The normalized program ``saved`` holds, loaded once per rank (the cases of one
    model share it: ``distribute`` builds a new graph and copies every piece it keeps)."""
    if saved not in loaded:
        loaded[saved] = _Loaded(load_normal_form(saved))
    return loaded[saved]


def _load(saved: bytes, loaded: dict[bytes, _Loaded]) -> Any:
    """The program of :func:`_loaded`."""
    return _loaded(saved, loaded).program


def distribute_saved(saved: bytes, plan: Any, rank: int, loaded: dict[bytes, _Loaded], **kwargs: Any) -> Any:
    """``distribute`` of the normal form ``saved`` holds (:func:`_loaded`) for ``plan``.

    ``distribute`` checks that a plan is for its program by lowering the program again
    and comparing graph ids; here that runs once per program and rank, and each further
    plan of the program is compared with that id, since lowering the same program again
    per plan would only repeat it."""
    from hapd.ir.lower import lower
    from hapd.spmd.rewrite import distribute

    entry = _loaded(saved, loaded)
    if entry.graph_id is None:
        entry.graph_id = lower(entry.program, name=plan.program.get("graph")).graph_id
    if entry.graph_id != plan.key["graph_id"]:
        raise AssertionError(f"the plan is for graph {plan.key['graph_id'][:12]}…, the loaded program is {entry.graph_id[:12]}…")
    return distribute(entry.program, plan, rank, check_graph=False, **kwargs)


def _run_case(rank: int, case: Case, loaded: dict[bytes, Any] | None = None) -> dict[str, Any]:
    """One case on this rank: the loss and gradients, then the Adam steps the reference
    took (``LR``, on this rank's parameters) and the global loss after each."""
    from hapd.compiler.plan import Plan
    from hapd.spmd.rewrite import global_loss

    plan = Plan.from_bytes(case.plan)
    module = distribute_saved(case.program, plan, rank, {} if loaded is None else loaded)
    if case.overlap != plan.overlap:
        raise AssertionError(f"{case.name}: the plan's overlap is {plan.overlap}")
    local_inputs = module.shard_inputs(*case.inputs)
    steps = len(case.losses) - 1
    optimizer = torch.optim.Adam(module.parameters(), lr=LR)
    losses: list[float] = []
    grad_errors: dict[str, float] = {}
    for step in range(steps + 1):
        optimizer.zero_grad()
        local = module(*local_inputs)
        losses.append(global_loss(local))
        if step == steps and step > 0:
            break
        local.backward()
        if step == 0:
            grad_errors = _grad_errors(module, case)
        if step < steps:
            optimizer.step()
    loss_errors = [abs(got - want) / max(abs(want), 1e-12) for got, want in zip(losses, case.losses)]
    rules = {(s["op"], s["rule"]) for s in plan.program["steps"]}
    ran = {s["node"]: s["rule"] for s in plan.program["steps"]}
    return {
        "case": case.name,
        "loss_error": loss_errors[0],
        "adam_error": max(loss_errors[1:], default=0.0),
        "worst_grad": max(grad_errors.items(), key=lambda kv: kv[1]),
        "missing": sorted(case.expect - rules),
        "not_forced": sorted((node, rule, str(ran.get(node))) for node, rule in case.forced.items()
                             if ran.get(node) != rule),
    }


def _run_cases(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    loaded: dict[bytes, Any] = {}
    return [_run_case(rank, case, loaded) for case in cases]


# --------------------------------------------------------------------------------------
# The parent: run and assert
# --------------------------------------------------------------------------------------


def run_cases(cases: list[Case], world: int, run: Any = None) -> list[dict[str, Any]]:
    """Every case on ``world`` Gloo ranks in one call (each rank runs ``run(rank,
    world, cases)``, default :func:`_run_cases`): one result per rank and case."""
    per_rank = run_ranks(world, run or _run_cases, cases, timeout=600)
    return [r for rank_results in per_rank for r in rank_results]


def run_specs(specs: list[Spec], run: Any = None, *, ratios: Sequence[float] = RATIOS,
              steps: int = 0) -> list[dict[str, Any]]:
    """Every spec's case on ``len(ratios)`` Gloo ranks with ``ratios`` (see
    :func:`run_cases`), with ``steps`` Adam steps after the first gradients."""
    return run_cases(make_cases(specs, ratios, steps), len(ratios), run)


def worst(result: dict[str, Any]) -> float:
    """A result's largest relative error: loss, any gradient, loss after any Adam step."""
    return max(result["loss_error"], result["worst_grad"][1], result["adam_error"])


def assert_exact(results: list[dict[str, Any]], specs: list[Spec]) -> None:
    """Every case ran and its loss, every gradient and the loss after every Adam step
    equal the single-device run."""
    bad = [f"{r['case']}: loss {r['loss_error']:.2e}, worst grad {r['worst_grad'][0]} {r['worst_grad'][1]:.2e}, "
           f"after Adam steps {r['adam_error']:.2e}" for r in results if worst(r) > TOL]
    print(f"\n{len(results)} rank-cases: worst loss error {max(r['loss_error'] for r in results):.1e}, "
          f"worst gradient error {max(r['worst_grad'][1] for r in results):.1e}, "
          f"after Adam steps {max(r['adam_error'] for r in results):.1e}")
    assert not bad, "\n".join(bad)
    assert {r["case"] for r in results} == {s.name for s in specs}


def assert_rules_ran(results: list[dict[str, Any]]) -> None:
    """Every case's plan ran the rules the case is about, and every forced node its
    forced rule."""
    bad = [f"{r['case']}: never ran {r['missing']}" for r in results if r["missing"]]
    bad += [f"{r['case']}: (node, forced, ran) {r['not_forced']}" for r in results if r["not_forced"]]
    assert not bad, "\n".join(bad)
