"""Honest costs (issue 15): FLOPs from torch's counter in the graph IR, opaque ops priced
at them, the replicated FLOP share of a plan, and the data-parallel baselines priced as
DDP runs them (every op that reads the batch split, only the gradient all-reduce)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import hapd
from hapd.ir.lower import GraphIR, lower
from hapd.compiler.options import CompileOptions
from hapd.compiler.ratios import program_cost
from hapd.compiler.search import ddp_cost, flat_all_reduce, synthesize
from hapd.ir.summary import format_summary, inspect_graph
from hapd.profile.schema import load_profile

ROOT = Path(__file__).resolve().parents[2]
PAPER8 = ROOT / "profiles" / "paper-8.json"

B, IN, OUT = 4, 8, 16
"""Batch, in and out features of the matrix products."""
HEADS, SEQ, HEAD_DIM = 2, 5, 8
"""Attention operand sizes."""
C_IN, C_OUT, SIDE, KERNEL = 3, 4, 6, 3
"""Convolution sizes (no padding, stride 1)."""

LINEAR = 2 * B * IN * OUT
ADDMM = 2 * B * IN * OUT
MM = 2 * B * IN * OUT
CONV = 2 * (B * C_OUT * (SIDE - KERNEL + 1) ** 2) * (C_IN * KERNEL * KERNEL)
SDPA = 2 * (2 * B * HEADS * SEQ * SEQ * HEAD_DIM)  # q·kᵀ and attention·v
"""Analytic forward FLOPs (2 per multiply-add) of each op of :class:`DenseOps`."""


class DenseOps(nn.Module):
    """One op each of the kinds torch's FLOP counter counts, and ``aten.mm``, which no
    rule family of the core covers (an opaque op that is a matrix product)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(IN, OUT)
        self.conv = nn.Conv2d(C_IN, C_OUT, KERNEL)
        self.weight = nn.Parameter(torch.randn(IN, OUT))
        self.bias = nn.Parameter(torch.randn(OUT))

    def forward(self, x: torch.Tensor, images: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        a = self.linear(x)
        b = torch.addmm(self.bias, x, self.weight)
        c = self.conv(images)
        d = nn.functional.scaled_dot_product_attention(q, q, q)
        e = torch.mm(x, self.weight)
        return a.sum() + b.sum() + c.sum() + d.sum() + e.sum()


@pytest.fixture(scope="module")
def dense_graph() -> bytes:
    torch.manual_seed(0)
    inputs = (torch.randn(B, IN), torch.randn(B, C_IN, SIDE, SIDE), torch.randn(B, HEADS, SEQ, HEAD_DIM))
    return lower(hapd.export(DenseOps(), inputs)).data


@pytest.fixture(scope="module")
def dense_plan(dense_graph):
    return hapd.compile(dense_graph, str(PAPER8))


def _op_node(doc: dict, op: str) -> dict:
    (node,) = [n for n in doc["nodes"] if n["kind"] == "op" and n["op"] == op]
    return node


@pytest.mark.parametrize(
    ("op", "flops"),
    [
        ("aten.linear", LINEAR),
        ("aten.addmm", ADDMM),
        ("aten.conv2d", CONV),
        ("aten.scaled_dot_product_attention", SDPA),
        ("aten.mm", MM),
    ],
)
def test_lowering_records_torchs_flop_count(dense_graph, op, flops):
    assert _op_node(GraphIR(dense_graph).doc, op)["flops"] == float(flops)


def test_only_ops_torch_counts_carry_flops(dense_graph):
    doc = GraphIR(dense_graph).doc
    counted = {n["op"] for n in doc["nodes"] if "flops" in n}
    assert counted == {"aten.linear", "aten.addmm", "aten.conv2d", "aten.scaled_dot_product_attention", "aten.mm"}
    assert any(n["op"].startswith("aten.sum") for n in doc["nodes"])  # counted as nothing, so left out


def test_an_opaque_matrix_product_is_priced_at_torchs_count(dense_plan):
    assert "aten.mm" in dense_plan.doc["opaque_ops"]
    (step,) = [s for s in dense_plan.program["steps"] if s["op"] == "aten.mm"]
    assert step["flops"] == float(MM)  # not its B·OUT result elements
    assert step["work"] == "full" and step["rule"] == "replicated"


def test_a_family_op_is_priced_at_least_at_torchs_count(dense_plan):
    steps = {s["op"]: s for s in dense_plan.program["steps"]}
    assert steps["aten.conv2d"]["flops"] >= CONV
    assert steps["aten.scaled_dot_product_attention"]["flops"] >= SDPA
    assert steps["aten.addmm"]["flops"] >= ADDMM


def test_inspect_shows_total_and_opaque_flops(dense_graph):
    summary = inspect_graph(dense_graph)
    assert summary["opaque_flops"] == float(MM)
    assert summary["flops"] >= LINEAR + ADDMM + CONV + SDPA + MM
    text = format_summary(summary)
    assert f"(opaque ops: 1.02 kFLOP, {MM / summary['flops']:.1%})" in text


def test_data_parallel_plan_runs_no_flops_replicated(fixture_bytes):
    plan = hapd.compile(fixture_bytes["mlp"], str(PAPER8), CompileOptions(mode="data_parallel"))
    assert all(s["work"] != "full" or s["flops"] == 0 for s in plan.program["steps"])
    assert plan.estimate["replicated_flop_share"] == 0.0
    assert "replicated FLOPs: 0.0%" in plan.explain()


def test_a_forced_replicated_op_has_a_replicated_flop_share(fixture_bytes):
    mlp = hapd.compile(fixture_bytes["mlp"], str(PAPER8))
    linear = next(s for s in mlp.program["steps"] if s["op"] == "aten.linear")
    plan = hapd.compile(fixture_bytes["mlp"], str(PAPER8), CompileOptions(force={linear["node"]: "replicated"}))
    total = sum(s["flops"] for s in plan.program["steps"])
    share = plan.estimate["replicated_flop_share"]
    assert share >= linear["flops"] / total > 0
    assert f"replicated FLOPs: {share:.1%}" in plan.explain()


def test_ddp_baseline_splits_what_the_data_parallel_program_replicates(dense_graph, dense_plan):
    profile = load_profile(PAPER8)
    ratios = profile.flops_ratios()
    dp_program = synthesize(dense_graph, profile, ratios, CompileOptions(), "data_parallel")
    replicated_price = program_cost(dp_program, ratios)  # how the baseline was priced before
    dp_cp = dense_plan.doc["baselines"]["dp_cp"]
    flat = flat_all_reduce(profile)
    assert flat is not None
    assert dp_cp == pytest.approx(ddp_cost(dp_program, ratios, 1, flat))  # DDP's flat all-reduce per bucket
    assert ddp_cost(dp_program, ratios) < replicated_price  # the same sync, the replicated ops split
    even = [1 / profile.world] * profile.world
    assert dense_plan.doc["baselines"]["dp_ev"] == pytest.approx(ddp_cost(dp_program, even, 1, flat))


def _row(constant: list[float], coef: list[float]) -> dict:
    return {"constant": constant, "coef": coef}


def test_ddp_cost_splits_batch_work_and_adds_the_gradient_all_reduce():
    """A replicated op on the batch is split by the ratios, an op on parameters alone
    runs whole, and the gradient all-reduce is paid once per parameter."""
    zero = _row([0.0, 0.0], [0.0, 0.0])
    program = {
        "steps": [
            {
                "inputs": [{"tensor": "x", "layout": "Gather(0)"}],
                "outputs": [{"tensor": "h", "layout": "Identity"}],
                "sources": [{"tensor": "x", "kind": "input", "layout": "Gather(0)", "grad_sync": False, "cost": zero}],
                "comp": _row([4.0, 8.0], [0.0, 0.0]),
            },
            {
                "inputs": [{"tensor": "w", "layout": "Identity"}],
                "outputs": [{"tensor": "wt", "layout": "Identity"}],
                "sources": [
                    {
                        "tensor": "w",
                        "kind": "parameter",
                        "layout": "Identity",
                        "grad_sync": True,
                        "cost": _row([0.5, 0.5], [0.0, 0.0]),
                    }
                ],
                "comp": _row([1.0, 2.0], [0.0, 0.0]),
            },
            {
                "inputs": [{"tensor": "h", "layout": "Gather(0)"}, {"tensor": "wt", "layout": "Identity"}],
                "outputs": [{"tensor": "y", "layout": "Gather(0)"}],
                "sources": [],
                "comp": _row([0.0, 0.0], [6.0, 12.0]),
            },
        ]
    }
    ratios = [0.75, 0.25]
    # step 1: max(4·0.75, 8·0.25); step 2 whole: max(1, 2); step 3: max(6·0.75, 12·0.25); all-reduce 0.5
    assert ddp_cost(program, ratios) == pytest.approx(3.0 + 2.0 + 4.5 + 0.5)
    # the all-reduce overlaps backward (2/3 of the 9.5 s of compute) by the program's share
    assert ddp_cost({**program, "sync_overlap": 0.6}, ratios) == pytest.approx(3.0 + 2.0 + 4.5 + 0.5 - 0.6 * 0.5)
    # a sync longer than backward: w's gradient exists once backward has run steps 3 and 2
    # (2/3 of 4.5 + 2 s), so only the 2/3 of step 1's 3 s after it can hide its sum
    program["steps"][1]["sources"][0]["cost"] = _row([20.0, 20.0], [0.0, 0.0])
    assert ddp_cost({**program, "sync_overlap": 0.6}, ratios) == pytest.approx(9.5 + 20.0 - 0.6 * (2 / 3) * 3.0)


def test_profile_sync_overlap_reaches_the_plan(dense_graph):
    """A profile whose devices measured ``sync_overlap`` gives every program its
    smallest share; the plan's estimate hides that much of the gradient sync behind
    backward and explain says so. Without it the same program prices serially."""
    from dataclasses import replace

    from hapd.compiler.ratios import HAPD_BUCKETS, backward_steps, hidden_sync, serial_cost, sync_seconds, synced_gradients
    from hapd.compiler.sync_timeline import BucketSizes, hideable

    profile = load_profile(PAPER8)
    shares = [0.9, 0.5] + [0.7] * (profile.world - 2)
    measured = replace(profile, devices=tuple(replace(d, sync_overlap=s) for d, s in zip(profile.devices, shares)))
    ratios = profile.flops_ratios()
    program = synthesize(dense_graph, measured, ratios, CompileOptions(), "data_parallel")
    assert program["sync_overlap"] == 0.5
    assert sync_seconds(program, ratios) > 0
    assert program_cost(program, ratios) == pytest.approx(serial_cost(program, ratios) - hidden_sync(program, ratios))
    # this model's gradients fill one bucket, whose sum starts when backward has produced
    # its last gradient: nothing hides (the buckets' timeline, hapd.compiler.sync_timeline)
    synced = synced_gradients(program, ratios)
    assert sum(g.nbytes for g in synced) <= HAPD_BUCKETS.rest
    assert hidden_sync(program, ratios) == 0.0
    apart = BucketSizes(rest=min(g.nbytes for g in synced))  # a bucket per gradient: the later ones hide
    assert 0.0 < hideable(backward_steps(program, ratios), synced, apart) <= sync_seconds(program, ratios)
    assert synthesize(dense_graph, profile, ratios, CompileOptions(), "data_parallel")["sync_overlap"] == 0.0
    partial = replace(measured, devices=(replace(measured.devices[0], sync_overlap=None), *measured.devices[1:]))
    assert synthesize(dense_graph, partial, ratios, CompileOptions(), "data_parallel")["sync_overlap"] == 0.0
    plan = hapd.compile(dense_graph, measured)
    sync = plan.estimate["gradient_sync"]
    assert sync["share"] == 0.5 and 0 <= sync["hidden"] <= 0.5 * sync["seconds"] + 1e-12
    assert plan.estimate["per_iteration"] == pytest.approx(program_cost(plan.program, plan.ratios))
    assert "hidden behind the backward pass" in plan.explain()
    assert "gradient_sync" not in hapd.compile(dense_graph, profile).estimate


def test_a_plan_dearer_than_ddp_only_by_ddps_buckets_does_not_widen_the_search():
    """DDP's price (its 25 MiB buckets over a flat all-reduce) can be under every program
    hapd runs: the search widens only for a plan dearer than DDP's program with hapd's
    own sync (``dp_cp_own``), which is in its space, and dp_gap names the buckets."""
    from hapd.compiler.dp_gap import dp_gap
    from hapd.compiler.search import Baselines, _wider_front

    step = {"node": "linear", "op": "aten.linear", "rule": "data-parallel", "inputs": [], "outputs": [],
            "sources": [], "comp": _row([0.0, 0.0], [1.0, 1.0]), "comm": _row([0.5, 0.5], [0.0, 0.0])}
    program = {"devices": 2, "steps": [step], "sync_overlap": 0.0}
    ratios = [0.5, 0.5]
    cost = program_cost(program, ratios)
    options = CompileOptions()
    chosen = (program, ratios, "search")
    by_buckets = Baselines(dp_ev=cost, dp_cp=0.9 * cost, dp_program=program, flops=ratios, dp_cp_own=cost)
    assert _wider_front(options, chosen, by_buckets, 0.0) is None
    gap = dp_gap(program, ratios, program, 0.9 * cost, ratios, options, dp_fits=True, opaque=set(), dp_cp_own=cost)
    assert gap is not None and "larger buckets" in gap["causes"][0]
    lost = Baselines(dp_ev=cost, dp_cp=0.9 * cost, dp_program=program, flops=ratios, dp_cp_own=0.95 * cost)
    wider = _wider_front(options, chosen, lost, 0.0)
    assert wider is not None and wider.front_width > options.front_width
