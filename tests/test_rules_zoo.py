"""Rules for what real models use, run: each case compiles a model (a zoo model or a
tiny module built around one op) with uneven ratios on 2 Gloo ranks, forcing the rule
under test where one is named, and checks that the loss and every gradient equal the
single-device ones and that the plan ran the rule.

Covered: rank programs that do not assume single-device strides (torchvision's ViT,
whose ``nn.MultiheadAttention`` views permuted tensors), ``addmm`` (GPT-2's Conv1D)
and ``baddbmm`` split every way (the bias added once for partial sums), ``linear`` on a
partial-sum input, batch norm split by channels, group norm by batch, the generic
element-wise rules of ops torch tags pointwise, indexing along a dim it does not index,
and ``hapd inspect`` still naming what has no rule.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from _dist import run_ranks
from torch import Tensor, nn

import hapd
from hapd.compiler.driver import CompileOptions
from hapd.profile.schema import estimated_profile

BATCH = 8
RATIOS = (0.6, 0.4)
TOL = 1e-5

Force = Callable[[dict[str, Any]], dict[str, str]]
"""The forced rules of a case, from its lowered graph's document."""


# --------------------------------------------------------------------------------------
# Tiny modules, one op family each (forward returns the loss)
# --------------------------------------------------------------------------------------


class Baddbmm(nn.Module):
    """``baddbmm(bias, x, w)`` on a batch of matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(BATCH, 6, 5))
        self.bias = nn.Parameter(torch.randn(1, 4, 5))

    def forward(self, x: Tensor) -> Tensor:
        return (torch.baddbmm(self.bias, x, self.w) ** 2).sum()


class PartialLinear(nn.Module):
    """A linear whose input is a partial sum (the previous linear row-parallel)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 10), nn.Linear(10, 6)

    def forward(self, x: Tensor) -> Tensor:
        return (self.b(self.a(x)) ** 2).sum()


class ConvNorms(nn.Module):
    """conv → batch norm (training) → relu → conv → group norm → hardswish."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.bn = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
        self.c2, self.gn = nn.Conv2d(6, 8, 3, padding=1), nn.GroupNorm(2, 8)

    def forward(self, x: Tensor) -> Tensor:
        y = torch.relu(self.bn(self.c1(x)))
        return nn.functional.hardswish(self.gn(self.c2(y))).sum()


class Pointwise(nn.Module):
    """Element-wise ops without hand-written rules (torch tags them pointwise)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        h = self.lin(x)
        h = torch.where(mask, h, h.abs().log1p())
        h = h.masked_fill(h.ne(0.5) & mask, 0.25) * torch.cos(h) + torch.sin(h).pow(2)
        return torch.minimum(h, h.clamp(-1.0, 1.0)).sum()


class Indexing(nn.Module):
    """``gather`` along the features with the batch split, ``index_select`` of rows, and
    ``table[ids]``."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(20, 6))
        self.lin = nn.Linear(6, 5)

    def forward(self, ids: Tensor, pick: Tensor) -> Tensor:
        rows = self.table[ids]  # [B, S, 6]
        h = self.lin(rows)  # [B, S, 5]
        picked = torch.gather(h, 2, pick)  # [B, S, 1]
        kept = torch.index_select(h, 1, torch.tensor([0, 2]))  # [B, 2, 5]
        return (picked ** 2).sum() + kept.sum()


def _indexing_inputs() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 20, (BATCH, 3), generator=g), torch.randint(0, 5, (BATCH, 3, 1), generator=g)


def _vit() -> tuple[nn.Module, tuple[Tensor, ...]]:
    """The zoo's ViT with its zero-initialized head given random weights (with a zero
    head every gradient but the head's is zero, and comparing them would prove little)."""
    from hapd.models.zoo import vit

    module, inputs = vit(batch=BATCH)
    torch.manual_seed(2)
    for p in module.parameters():
        if not p.detach().any():
            nn.init.normal_(p, std=0.2)
    return module, inputs


def _gpt2() -> tuple[nn.Module, tuple[Tensor, ...]]:
    """The zoo's GPT-2 with its output projection untied from the token embedding (tied
    parameters are not what these cases test)."""
    from hapd.models.zoo import gpt2

    module, inputs = gpt2(batch=BATCH)
    head = module.model.lm_head
    head.weight = nn.Parameter(head.weight.detach().clone())
    return module, inputs


# --------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------


def _ops(doc: dict[str, Any], op: str) -> list[str]:
    return [n["name"] for n in doc["nodes"] if n.get("op") == op]


def _tagged(doc: dict[str, Any]) -> list[str]:
    """Names of nodes whose op gets only the generic element-wise rules."""
    return [n["name"] for n in doc["nodes"] if "pointwise" in n.get("tags", ()) and n["op"] in GENERIC_OPS]


GENERIC_OPS = {"aten.where.self", "aten.abs", "aten.log1p", "aten.masked_fill.Scalar", "aten.ne.Scalar",
               "aten.bitwise_and.Tensor", "aten.cos", "aten.sin", "aten.minimum", "aten.clamp"}
"""Ops of :class:`Pointwise` with no hand-written family."""


def _alternate(op: str, rules: tuple[str, ...]) -> Force:
    return lambda doc: {n: rules[i % len(rules)] for i, n in enumerate(_ops(doc, op))}


def _all(op: str, rule: str) -> Force:
    return lambda doc: {n: rule for n in _ops(doc, op)}


def _merge(*forces: Force) -> Force:
    return lambda doc: {k: v for f in forces for k, v in f(doc).items()}


class Spec(NamedTuple):
    name: str
    build: Callable[[], tuple[nn.Module, tuple[Tensor, ...]]]
    mode: str
    force: Force | None
    expect: frozenset  # (op, rule) pairs the plan must run


def _seeded(cls: type[nn.Module], *inputs: Callable[[], Any]) -> Callable[[], tuple[nn.Module, tuple[Tensor, ...]]]:
    def build() -> tuple[nn.Module, tuple[Tensor, ...]]:
        torch.manual_seed(0)
        module = cls()
        return module, tuple(make() for make in inputs)

    return build


SPECS = [
    Spec("vit/auto", _vit, "auto", None, frozenset()),
    Spec("vit/data-parallel", _vit, "data_parallel", None, frozenset({("aten.conv2d", "data-parallel")})),
    Spec("gpt2/addmm", _gpt2, "auto", _alternate("aten.addmm", ("column-parallel", "row-parallel")),
         frozenset({("aten.addmm", "column-parallel"), ("aten.addmm", "row-parallel")})),
    Spec("gpt2/addmm-rows", _gpt2, "auto", _all("aten.addmm", "data-parallel"),
         frozenset({("aten.addmm", "data-parallel")})),
    Spec("baddbmm/row-parallel", _seeded(Baddbmm, lambda: torch.randn(BATCH, 4, 6)), "auto",
         _all("aten.baddbmm", "row-parallel"), frozenset({("aten.baddbmm", "row-parallel")})),
    Spec("baddbmm/column-parallel", _seeded(Baddbmm, lambda: torch.randn(BATCH, 4, 6)), "auto",
         _all("aten.baddbmm", "column-parallel"), frozenset({("aten.baddbmm", "column-parallel")})),
    Spec("linear/partial", _seeded(PartialLinear, lambda: torch.randn(BATCH, 12)), "auto",
         lambda doc: dict(zip(_ops(doc, "aten.linear"), ("row-parallel", "partial"))),
         frozenset({("aten.linear", "partial")})),
    Spec("norms", _seeded(ConvNorms, lambda: torch.randn(BATCH, 3, 6, 6)), "auto",
         _merge(_all("aten._native_batch_norm_legit_functional", "sharded"),
                _all("aten.native_group_norm", "data-parallel"), _all("aten.group_norm", "data-parallel")),
         frozenset({("aten._native_batch_norm_legit_functional", "sharded"), ("aten.group_norm", "data-parallel"),
                    ("aten.hardswish", "sharded")})),
    Spec("pointwise", _seeded(Pointwise, lambda: torch.randn(BATCH, 8), lambda: torch.rand(BATCH, 8) > 0.5), "auto",
         lambda doc: {n: "sharded" for n in _tagged(doc)},
         frozenset({(op, "sharded") for op in ("aten.where.self", "aten.cos", "aten.masked_fill.Scalar",
                                                "aten.minimum", "aten.__and__.Tensor")})),
    Spec("indexing", lambda: (_seeded(Indexing)()[0], _indexing_inputs()), "auto",
         _merge(_all("aten.gather", "sharded"), _all("aten.index.Tensor", "data-parallel"),
                _all("aten.index_select", "sharded")),
         frozenset({("aten.gather", "sharded"), ("aten.index.Tensor", "data-parallel"),
                    ("aten.index_select", "sharded")})),
]


class Case(NamedTuple):
    name: str
    program: bytes  # torch.export.save bytes
    plan: bytes
    inputs: tuple[Tensor, ...]
    loss: float
    grads: dict[str, Tensor]
    expect: frozenset


def _case(spec: Spec) -> Case:
    module, inputs = spec.build()
    program = hapd.export(module, inputs)
    reference = program.module()
    loss = reference(*inputs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in reference.named_parameters() if p.grad is not None}
    ir = hapd.lower(program, name=spec.name.split("/")[0])
    force = spec.force(ir.doc) if spec.force else {}
    profile = estimated_profile(2, flops=[2e10, 1e10])
    plan = hapd.compile(ir, profile, CompileOptions(ratios=RATIOS, mode=spec.mode, force=force))
    buf = io.BytesIO()
    torch.export.save(program, buf)
    return Case(spec.name, buf.getvalue(), plan.to_bytes(), inputs, float(loss.detach()), grads, spec.expect)


def _run_case(rank: int, case: Case) -> dict[str, Any]:
    from hapd.compiler.normalize import normalize
    from hapd.compiler.plan import Plan
    from hapd.runtime.rewrite import distribute, global_loss

    plan = Plan.from_bytes(case.plan)
    module = distribute(normalize(torch.export.load(io.BytesIO(case.program))), plan, rank)
    local = module(*module.shard_inputs(*case.inputs))
    local.backward()
    loss = global_loss(local)
    # a gradient that is zero in exact arithmetic is rounding noise in both runs: it is
    # compared against a hundredth of the model's largest gradient
    floor = 1e-2 * max(float(g.abs().max()) for g in case.grads.values() if g.numel())
    errors = {}
    for fqn, param in module.named_parameters():
        tensor, layout = module.hapd_params[fqn]
        full = case.grads.get(fqn, torch.zeros(module.hapd_view.full_shape(tensor)))  # no gradient: zero
        expected = module.hapd_view.local_value(tensor, layout, full)
        got = param.grad if param.grad is not None else torch.zeros_like(param)
        errors[fqn] = float((got - expected).abs().max()) / max(float(expected.abs().max()), floor)
    rules = {(s["op"], s["rule"]) for s in plan.program["steps"]}
    return {
        "case": case.name,
        "loss_error": abs(loss - case.loss) / max(abs(case.loss), 1e-12),
        "worst_grad": max(errors.items(), key=lambda kv: kv[1]),
        "missing": sorted(case.expect - rules),
    }


def _run_cases(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    return [_run_case(rank, case) for case in cases]


def run_specs(specs: list[Spec], run: Any = None) -> list[dict[str, Any]]:
    """Every spec's case on 2 Gloo ranks (each rank runs ``run(rank, world, cases)``,
    default :func:`_run_cases`): one result per rank and case."""
    cases = [_case(spec) for spec in specs]
    per_rank = run_ranks(2, run or _run_cases, cases, timeout=600)
    return [r for rank_results in per_rank for r in rank_results]


def assert_exact(results: list[dict[str, Any]], specs: list[Spec]) -> None:
    """Every case ran and its loss and every gradient equal the single-device run."""
    bad = [f"{r['case']}: loss {r['loss_error']:.2e}, worst grad {r['worst_grad'][0]} {r['worst_grad'][1]:.2e}"
           for r in results if r["loss_error"] > TOL or r["worst_grad"][1] > TOL]
    print(f"\n{len(results)} rank-cases: worst loss error {max(r['loss_error'] for r in results):.1e}, "
          f"worst gradient error {max(r['worst_grad'][1] for r in results):.1e}")
    assert not bad, "\n".join(bad)
    assert {r["case"] for r in results} == {s.name for s in specs}


def assert_rules_ran(results: list[dict[str, Any]]) -> None:
    """Every case's plan ran the rules the case is about."""
    bad = [f"{r['case']}: never ran {r['missing']}" for r in results if r["missing"]]
    assert not bad, "\n".join(bad)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_specs(SPECS)


@pytest.mark.distributed
def test_loss_and_gradients_match_single_device(results) -> None:
    assert_exact(results, SPECS)


@pytest.mark.distributed
def test_plans_run_the_rules_under_test(results) -> None:
    assert_rules_ran(results)


# --------------------------------------------------------------------------------------
# Lowering records torch's tags; inspect names what has no rule
# --------------------------------------------------------------------------------------


def test_lowering_records_pointwise_tags() -> None:
    torch.manual_seed(0)
    module = Pointwise()
    ir = hapd.lower(hapd.export(module, (torch.randn(4, 8), torch.rand(4, 8) > 0.5)), name="pointwise")
    tags = {n["op"]: n.get("tags") for n in ir.doc["nodes"] if n["kind"] == "op"}
    assert tags["aten.where.self"] == ["pointwise"] and tags["aten.cos"] == ["pointwise"]
    assert tags["aten.linear"] is None  # no tag the core reads: the key is left out
    assert hapd.inspect_graph(ir.data)["opaque_ops"] == []


class Determinant(nn.Module):
    """A linear, then ``linalg_det`` (no family and no pointwise tag)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return torch.linalg.det(self.lin(x)).sum()


def test_inspect_names_ops_without_rules() -> None:
    summary = hapd.inspect_graph(hapd.lower(hapd.export(Determinant(), (torch.randn(3, 4, 4),)), name="det").data)
    assert summary["opaque_ops"] == [("aten.linalg_det", 1)]
    module, inputs = _gpt2()
    summary = hapd.inspect_graph(hapd.lower(hapd.export(module, inputs), name="gpt2").data)
    opaque = {op for op, _ in summary["opaque_ops"]}
    assert not opaque & {"aten.addmm", "aten.ne.Scalar", "aten.eq.Tensor", "aten.le.Tensor", "aten.new_ones",
                         "aten.arange", "aten.index.Tensor", "aten.__and__.Tensor", "aten.pad", "aten.diff"}
