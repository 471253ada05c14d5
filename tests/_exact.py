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
``test_moe.py``, ``test_zoo.py`` (the zoo on 2 and 4 ranks), ``test_dropout.py``,
``test_overlap.py``, ``test_recompute.py``, ``test_tied.py`` (which also compares every
parameter after the Adam steps) and ``test_distribute.py`` (with its own profiles and
plans). Its :func:`grad_errors` is the suite's one gradient comparison (the other
exactness tests use it too); :func:`tensor_error` and :func:`relative_norm` compare other
tensors.

What "exact" means: the loss within ``TOL`` (1e-5) relative, and every gradient tensor
within ``TOL`` of its own largest value or 1e-7 of the model's largest gradient ``G``,
``‖got − expected‖∞ ≤ 1e-5 · max(‖expected‖∞, 1e-2 · G)`` (:func:`grad_errors`).
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
"""Tolerance of every comparison: of the loss relative to itself, of a gradient as
:func:`grad_errors` measures it (fp32 sums in another grouping)."""
RATIOS = (0.6, 0.4)
"""Default sharding ratios: 2 ranks, uneven."""
LR = 1e-3
"""Adam's learning rate in the runs with steps."""
EPS = 1e-8
"""Adam's epsilon in the runs with steps (torch's default)."""

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


EXPERT_WEIGHTS = ("gate_up_proj", "down_proj")
"""Names that end a stacked expert-weight parameter (transformers' MoE models)."""
DENSE_OPS = ("aten.linear", "aten.addmm", "aten.conv2d")
"""Ops the forced tensor-parallel plans split column-parallel and row-parallel in turn."""
TENSOR_PARALLEL = ("column-parallel", "row-parallel")


def _expert_einsums(doc: dict[str, Any]) -> dict[str, str]:
    """Every einsum with a stacked expert-weight parameter operand (hapd's dense experts)
    and every ``hapd.routed_experts`` (transformers' default experts) → ``expert-parallel``."""
    nodes = doc["nodes"]

    def expert_weight(ref: list[int]) -> bool:
        source = nodes[ref[0]]
        return source["kind"] == "parameter" and source["target"].endswith(EXPERT_WEIGHTS)

    return {n["name"]: "expert-parallel" for n in nodes
            if (n.get("op") == "aten.einsum" and any(expert_weight(r) for r in n["inputs"]))
            or n.get("op") == "hapd.routed_experts"}


def _tensor_parallel(doc: dict[str, Any]) -> dict[str, str]:
    """Linears, ``addmm`` and convolutions column-parallel and row-parallel in turn
    (graph order), and every einsum over stacked expert weights expert-parallel."""
    dense = [n["name"] for n in doc["nodes"] if n.get("op") in DENSE_OPS]
    return {**{node: TENSOR_PARALLEL[i % 2] for i, node in enumerate(dense)}, **_expert_einsums(doc)}


def _zoo(name: str, batch: int = 8) -> Build:
    """A builder of the zoo's ``name`` (:data:`hapd.models.zoo.ZOO`) at ``batch``."""

    def build() -> tuple[nn.Module, tuple[Tensor, ...]]:
        from hapd.models.zoo import ZOO

        return ZOO[name](batch=batch)

    return build


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
    params: bool = False  # also compare every parameter after the Adam steps


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
    params: dict[str, Tensor]  # the parameters after the Adam steps, by every name
    adam: tuple[float, float]  # Adam's (lr, eps) in the steps


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
    params: dict[str, Tensor] | None = None  # with these, every parameter after the steps is compared too
    adam: tuple[float, float] = (LR, EPS)  # Adam's (lr, eps) in the steps


def adam_steps(module: nn.Module, forward: Callable[[], Tensor], value: Callable[[Tensor], float], steps: int,
               adam: tuple[float, float], first: Callable[[], Any]) -> tuple[list[float], Any]:
    """The loss ``forward()`` gives and its gradients, then ``steps`` Adam steps of
    ``module``'s parameters (``adam``: lr, eps): ``value`` of the loss before each step
    and after the last, and what ``first()`` makes of the first gradients."""
    optimizer = torch.optim.Adam(module.parameters(), lr=adam[0], eps=adam[1])
    losses: list[float] = []
    made = None
    for step in range(steps + 1):
        optimizer.zero_grad()
        loss = forward()
        losses.append(value(loss))
        if step == steps and step > 0:
            break
        loss.backward()
        if step == 0:
            made = first()
        if step < steps:
            optimizer.step()
    return losses, made


def update(loss: Tensor, optimizer: torch.optim.Optimizer, scaler: Any = None) -> None:
    """One training step's end: ``loss``'s backward (scaled by ``scaler``, a grad scaler,
    when given), the optimizer's step (through the scaler, which skips it on an inf),
    the gradients zeroed."""
    (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad()


def single_device(program: Any, inputs: tuple[Tensor, ...], steps: int = 0, *, lr: float = LR,
                  eps: float = EPS) -> tuple[tuple[float, ...], dict[str, Tensor], dict[str, Tensor]]:
    """A copy of ``program.module()`` run on one device: the loss and gradients (by every
    name), then ``steps`` Adam steps (``lr``, ``eps``) and the loss after each; returns
    ``(losses, first gradients, parameters after the steps)``."""
    # a copy (the steps must not change the program's weights), its dropouts drawn with
    # hapd's generator and the seed the ranks draw with (torch.manual_seed(0): _run_cases)
    single = counter_reference(program, seed=0)
    losses, grads = adam_steps(
        single, lambda: single(*inputs), lambda loss: float(loss.detach()), steps, (lr, eps),
        lambda: {n: p.grad.detach().clone() for n, p in single.named_parameters(remove_duplicate=False)
                 if p.grad is not None})
    params = {n: p.detach().clone() for n, p in single.named_parameters(remove_duplicate=False)}
    return tuple(losses), grads, params


def reference(build: Build, name: str, steps: int = 0, *, lr: float = LR, eps: float = EPS) -> Reference:
    """Export and lower ``build()``'s model, and run it on one device
    (:func:`single_device`)."""
    module, inputs = build()
    program = hapd.export(module, inputs)
    ir = hapd.lower(program, name=name)
    losses, grads, params = single_device(program, inputs, steps, lr=lr, eps=eps)
    return Reference(program, save_normal_form(program), ir, inputs, losses, grads, params, (lr, eps))


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
    return Case(spec.name, saved, plan.to_bytes(), ref.inputs, ref.losses, ref.grads, spec.expect, force, spec.overlap,
                ref.params if spec.params else None, ref.adam)


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


def tensor_error(got: Tensor, expected: Tensor, floor: float = 0.0) -> float:
    """``‖got − expected‖∞ / max(‖expected‖∞, floor, 1e-12)``: the largest difference
    relative to this tensor's own largest value (0 for empty tensors). ``floor`` (an
    absolute value) is for tensors that may be zero in exact arithmetic; see
    :func:`grad_errors` for the one the gradient comparison uses."""
    if not expected.numel():
        return 0.0
    diff = float((got.detach() - expected).abs().max())
    return diff / max(float(expected.abs().max()), floor, 1e-12)


def relative_norm(got: Tensor, expected: Tensor) -> float:
    """``‖got - expected‖ / ‖expected‖`` (2-norms, the denominator at least 1e-30)."""
    return float((got - expected).norm() / expected.norm().clamp_min(1e-30))


GRAD_FLOOR = 1e-2
"""The floor of :func:`grad_errors`' denominator, as a fraction of the model's largest
gradient ``G``: at ``TOL`` it is an absolute bound of 1e-7 · G, fp32's epsilon (1.2e-7)
times ``G``."""


def grad_errors(expected: dict[str, Tensor], got: dict[str, Tensor | None],
                scale: dict[str, Tensor] | None = None) -> dict[str, float]:
    """The suite's one gradient comparison: for every name in ``got``,
    ``‖got − expected‖∞ / max(‖expected‖∞, GRAD_FLOOR · G)`` (:func:`tensor_error`),
    ``expected`` the single-device gradient (or the piece of it that ``got`` holds), ``G``
    the largest |gradient| of the whole model (``scale``: the model's full gradients,
    default ``expected``). A missing ``expected`` or a ``None`` in ``got`` is zero.

    ``error ≤ TOL`` (1e-5) thus means ``‖got − expected‖∞ ≤ max(1e-5 · ‖expected‖∞,
    1e-7 · G)``: within 1e-5 of the tensor's own largest value, and absolutely within
    1e-7 · G for a tensor smaller than 1e-2 · G. The absolute part is fp32 rounding: a
    rank sums the same terms in another order, each sum off by ~1e-7 of the terms summed,
    and where they cancel (a gradient that is zero in exact arithmetic: an attention key
    bias, since softmax ignores a shift of every score) the result is that rounding alone
    — up to 1.3e-8 · G on the benchmark models (``test_distribute``), 7e-12 · G on the zoo,
    while its own size is 1e-12 to 3e-8 · G — so no tolerance relative to the tensor
    itself can hold it. Measured per tensor (``‖got − expected‖∞ / ‖expected‖∞``) every
    other gradient piece of the zoo and the benchmark models is within 4.2e-6, except one
    rank's piece of VGG's ``features.10.bias`` under tensor parallelism on 4 ranks (8.7e-5:
    channels whose sums cancel to 4e-10 · G, off by 1.6e-13 · G). The floor's price: a
    tensor below 1e-4 · G is held to 1e-7 · G, looser than 1e-3 of itself (VGG's first
    layers, 5e-9 · G, measure 9.2e-6 per tensor but are checked only to 1e-7 · G)."""
    scale = expected if scale is None else scale
    largest = max((float(t.abs().max()) for t in scale.values() if t.numel()), default=0.0)
    floor = GRAD_FLOOR * largest
    errors = {}
    for name, have in got.items():
        want = expected.get(name)
        if want is None:
            want = torch.zeros_like(have)
        if have is None:
            have = torch.zeros_like(want)
        errors[name] = tensor_error(have, want, floor)
    return errors


def _pieces(module: Any, full: dict[str, Tensor]) -> dict[str, Tensor]:
    """This rank's piece of every parameter's value in ``full`` (a name missing there:
    zeros), by every name of the rank module's parameters."""
    named = dict(module.named_parameters(remove_duplicate=False))
    pieces = {}
    for fqn, (tensor, layout) in module.hapd_params.items():
        value = full.get(fqn)
        if value is None:  # no gradient: zero
            value = torch.zeros(module.hapd_view.full_shape(tensor), dtype=named[fqn].dtype)
        pieces[fqn] = module.hapd_view.local_value(tensor, layout, value)
    return pieces


PARAM_FLOOR = 1e-2
"""The absolute floor of :func:`param_errors`, as a fraction of the model's largest parameter."""


def param_errors(module: Any, expected: dict[str, Tensor]) -> dict[str, float]:
    """:func:`tensor_error` of this rank's piece of every parameter against the
    single-device parameters ``expected`` (after the same Adam steps), by every name,
    with the floor ``PARAM_FLOOR ×`` the model's largest parameter."""
    named = dict(module.named_parameters(remove_duplicate=False))
    floor = PARAM_FLOOR * max(float(t.abs().max()) for t in expected.values() if t.numel())
    return {fqn: tensor_error(named[fqn].detach(), want, floor) for fqn, want in _pieces(module, expected).items()}


def _grad_errors(module: Any, case: Case) -> dict[str, float]:
    """:func:`grad_errors` of this rank's gradient pieces against the case's first ones."""
    named = dict(module.named_parameters(remove_duplicate=False))
    return grad_errors(_pieces(module, case.grads), {n: named[n].grad for n in module.hapd_params}, scale=case.grads)


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


Extra = Callable[[Any, Any], dict[str, Any]]
"""What a test adds to a rank's result, from the trained rank module and its plan."""


def _run_case(rank: int, case: Case, loaded: dict[bytes, Any] | None = None, extra: Extra | None = None) -> dict[str, Any]:
    """One case on this rank: the loss and gradients, then the Adam steps the reference
    took (``case.adam``, on this rank's parameters) and the global loss after each;
    with ``case.params``, every parameter after the steps; ``extra(module, plan)``'s
    entries added."""
    from hapd.compiler.plan import Plan
    from hapd.spmd.rewrite import global_loss

    plan = Plan.from_bytes(case.plan)
    module = distribute_saved(case.program, plan, rank, {} if loaded is None else loaded)
    if case.overlap != plan.overlap:
        raise AssertionError(f"{case.name}: the plan's overlap is {plan.overlap}")
    local_inputs = module.shard_inputs(*case.inputs)
    losses, grad_errors = adam_steps(module, lambda: module(*local_inputs), global_loss, len(case.losses) - 1,
                                     case.adam, lambda: _grad_errors(module, case))
    loss_errors = [abs(got - want) / max(abs(want), 1e-12) for got, want in zip(losses, case.losses)]
    rules = {(s["op"], s["rule"]) for s in plan.program["steps"]}
    ran = {s["node"]: s["rule"] for s in plan.program["steps"]}
    result = {
        "case": case.name,
        "loss_error": loss_errors[0],
        "adam_error": max(loss_errors[1:], default=0.0),
        "loss_errors": loss_errors,  # the first loss, then after each Adam step
        "worst_grad": max(grad_errors.items(), key=lambda kv: kv[1]),
        "missing_params": sorted(set(case.grads) - set(grad_errors)),  # gradients no rank parameter has
        "missing": sorted(case.expect - rules),
        "not_forced": sorted((node, rule, str(ran.get(node))) for node, rule in case.forced.items()
                             if ran.get(node) != rule),
    }
    if case.params is not None:
        errors = param_errors(module, case.params)
        result["worst_param"] = max(errors.items(), key=lambda kv: kv[1])
    if extra is not None:
        result.update(extra(module, plan))
    return result


def _run_cases(rank: int, world: int, cases: list[Case], extra: Extra | None = None) -> list[dict[str, Any]]:
    """Every case on this rank (:func:`_run_case`), after ``torch.manual_seed(0)``, each
    program loaded once."""
    torch.manual_seed(0)
    loaded: dict[bytes, Any] = {}
    return [_run_case(rank, case, loaded, extra) for case in cases]


# --------------------------------------------------------------------------------------
# The parent: run and assert
# --------------------------------------------------------------------------------------


def run_cases(cases: list[Case], world: int, run: Any = None, *, extra: Extra | None = None) -> list[dict[str, Any]]:
    """Every case on ``world`` Gloo ranks in one call (each rank runs ``run(rank,
    world, cases)``, default :func:`_run_cases` with ``extra``): one result per rank and
    case, rank 0's first."""
    per_rank = run_ranks(world, run or _run_cases, cases, *([] if extra is None else [extra]), timeout=600)
    return [r for rank_results in per_rank for r in rank_results]


def run_specs(specs: list[Spec], run: Any = None, *, ratios: Sequence[float] = RATIOS,
              steps: int = 0, extra: Extra | None = None) -> list[dict[str, Any]]:
    """Every spec's case on ``len(ratios)`` Gloo ranks with ``ratios`` (see
    :func:`run_cases`), with ``steps`` Adam steps after the first gradients."""
    return run_cases(make_cases(specs, ratios, steps), len(ratios), run, extra=extra)


def worst(result: dict[str, Any]) -> float:
    """A result's largest relative error: loss, any gradient, loss after any Adam step
    (and any parameter after them, where compared)."""
    return max(result["loss_error"], result["worst_grad"][1], result["adam_error"],
               result.get("worst_param", ("", 0.0))[1])


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


def rule_tests(specs: list[Spec]) -> tuple[Callable[..., Any], ...]:
    """A module of rule cases' fixture and tests, to bind at its top level as
    ``results, test_loss_and_gradients_match_single_device,
    test_plans_run_the_rules_under_test``: ``specs`` run once (:func:`run_specs`), then
    :func:`assert_exact` and :func:`assert_rules_ran` of the results."""
    import pytest

    @pytest.fixture(scope="module")
    def results() -> list[dict[str, Any]]:
        return run_specs(specs)

    @pytest.mark.distributed
    def test_loss_and_gradients_match_single_device(results: list[dict[str, Any]]) -> None:
        assert_exact(results, specs)

    @pytest.mark.distributed
    def test_plans_run_the_rules_under_test(results: list[dict[str, Any]]) -> None:
        assert_rules_ran(results)

    return results, test_loss_and_gradients_match_single_device, test_plans_run_the_rules_under_test
