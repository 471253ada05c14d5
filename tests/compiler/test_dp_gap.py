"""A plan costlier than data parallelism says why: ``Plan.explain``, ``hapd compile``
and the plan document name what ruled data parallelism out and the ops that forced it
(:mod:`hapd.compiler.dp_gap`)."""

from __future__ import annotations

import torch
from click.testing import CliRunner
from torch import nn

import hapd
from hapd.cli import main
from hapd.compiler.options import CompileOptions


@torch.library.custom_op("hapdtest::gate", mutates_args=())
def gate(x: torch.Tensor) -> torch.Tensor:
    """An op hapd has no sharding rule for (a user's custom kernel)."""
    return x * torch.sigmoid(x)


@gate.register_fake
def _(x):
    return torch.empty_like(x)


def _gate_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    s = torch.sigmoid(x)
    return grad * (s + x * s * (1 - s))


def _gate_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


gate.register_autograd(_gate_backward, setup_context=_gate_setup)


class _Gated(nn.Module):
    """Two wide linears around an op without sharding rules, on a large batch."""

    def __init__(self, opaque: bool):
        super().__init__()
        self.opaque = opaque
        self.a, self.b = nn.Linear(256, 1024), nn.Linear(1024, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.ops.hapdtest.gate(h) if self.opaque else h * torch.sigmoid(h)
        return self.b(h).pow(2).sum()


def _graph(opaque: bool) -> hapd.GraphIR:
    torch.manual_seed(0)
    return hapd.lower(hapd.export(_Gated(opaque), (torch.randn(4096, 256),), name="gated"))


def test_a_plan_that_loses_to_data_parallelism_names_the_op_that_forced_it(tmp_path) -> None:
    plan = hapd.compile(_graph(opaque=True), "paper-8")
    gap = plan.doc["dp_gap"]
    assert gap is not None and gap["plan"] > gap["dp_cp"]
    assert plan.estimate["per_iteration"] > plan.doc["baselines"]["dp_cp"]
    assert [f["op"] for f in gap["forcing"]] == ["hapdtest.gate"]
    assert gap["steps"] and gap["steps"] == sorted(gap["steps"], key=lambda s: -s["extra"])
    report = plan.explain()
    assert "costlier than data parallelism" in report
    assert "hapdtest.gate has no sharding rules" in report
    # the compile's output says it too
    path = plan.save(tmp_path / "gated.hplan")
    graph_path = _graph(opaque=True).save(tmp_path / "gated.hapg")
    out = CliRunner().invoke(main, ["compile", str(graph_path), "--profile", "paper-8", "--out", str(path)],
                             catch_exceptions=False).output
    assert "costlier than data parallelism" in out and "hapdtest.gate" in out


def test_a_plan_as_cheap_as_data_parallelism_has_no_gap() -> None:
    plan = hapd.compile(_graph(opaque=False), "paper-8")
    assert plan.doc["dp_gap"] is None
    assert plan.estimate["per_iteration"] <= plan.doc["baselines"]["dp_cp"] * (1 + 1e-6)
    assert "costlier than data parallelism" not in plan.explain()


def test_forced_rules_are_named_as_the_cause() -> None:
    graph = _graph(opaque=False)
    force = {n["name"]: "replicated" for n in graph.doc["nodes"] if n.get("op") == "aten.linear"}
    plan = hapd.compile(graph, "paper-8", CompileOptions(force=force))
    gap = plan.doc["dp_gap"]
    assert gap is not None
    assert any("force 2 node(s)" in cause for cause in gap["causes"])
    assert {s["node"] for s in gap["steps"][:2]} == set(force)
