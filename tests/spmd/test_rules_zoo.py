"""Rules for what real models use, run: each case compiles a model (a zoo model or a
tiny module built around one op) with uneven ratios on 2 Gloo ranks, forcing the rule
under test where one is named, and checks that the loss and every gradient equal the
single-device ones and that the plan ran the rule (the harness of ``tests/_exact.py``).

Covered: rank programs that do not assume single-device strides (torchvision's ViT,
whose ``nn.MultiheadAttention`` views permuted tensors), ``addmm`` (GPT-2's Conv1D) by
rows and ``baddbmm`` split every way (the bias added once for partial sums), ``linear`` on a
partial-sum input, batch norm split by channels, group norm by batch, the generic
element-wise rules of ops torch tags pointwise, indexing along a dim it does not index,
and ``hapd inspect`` still naming what has no rule. The zoo models' searched plans and
``addmm`` column- and row-parallel are in ``test_zoo.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from _exact import Spec, _all, _merge, _ops, _seeded, fill_zero_parameters, rule_tests
from torch import Tensor, nn

import hapd

BATCH = 8


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
    return fill_zero_parameters(module), inputs


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


def _tagged(doc: dict[str, Any]) -> list[str]:
    """Names of nodes whose op gets only the generic element-wise rules."""
    return [n["name"] for n in doc["nodes"] if "pointwise" in n.get("tags", ()) and n["op"] in GENERIC_OPS]


GENERIC_OPS = {"aten.where.self", "aten.abs", "aten.log1p", "aten.masked_fill.Scalar", "aten.ne.Scalar",
               "aten.bitwise_and.Tensor", "aten.cos", "aten.sin", "aten.minimum", "aten.clamp"}
"""Ops of :class:`Pointwise` with no hand-written family."""


SPECS = [
    Spec("vit/data-parallel", _vit, "data_parallel", None, frozenset({("aten.conv2d", "data-parallel")})),
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
    Spec("norms/synced", _seeded(ConvNorms, lambda: torch.randn(BATCH, 3, 6, 6)), "auto",
         _merge(_all("aten._native_batch_norm_legit_functional", "data-parallel-synced"),
                _all("aten.conv2d", "data-parallel"), _all("aten.group_norm", "data-parallel")),
         frozenset({("aten._native_batch_norm_legit_functional", "data-parallel-synced")})),
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


# the fixture ``results`` and the tests test_loss_and_gradients_match_single_device and
# test_plans_run_the_rules_under_test, for SPECS
results, test_loss_and_gradients_match_single_device, test_plans_run_the_rules_under_test = rule_tests(SPECS)


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
