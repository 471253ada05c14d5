"""Overlapped execution (:mod:`hapd.spmd.duplicas`): a plan compiled for half the
global batch, run as two interleaved duplicas, trains exactly as the single-device
model on the whole batch — loss, every gradient, and the loss after each of 3 Adam
steps — on 2 and 4 Gloo ranks with uneven ratios, under plans forced into tensor
parallelism (every linear column- and row-parallel in turn) and, for the mixture of
experts, expert parallelism: plans with collectives inside forward and backward, which
is what the duplicas overlap. Also: the interleaved graph really puts the other
duplica's computation between each collective's start and finish, and the programs
whose halves would not add up to the whole batch are refused, naming the node.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _exact import TOL, Spec, _tensor_parallel, _zoo, make_cases, run_cases, worst
from torch import nn

import hapd
from hapd.compiler.options import CompileOptions
from hapd.errors import PlanError
from hapd.profile.schema import estimated_profile
from hapd.spmd import collectives
from hapd.spmd.duplicas import StartExchange, overlapped, split_batch

RATIOS = {2: (0.75, 0.25), 4: (0.4, 0.3, 0.2, 0.1)}
ADAM_STEPS = 3
MODELS = ["mixtral"]
"""Its forced plan has both: attention linears column-/row-parallel, experts expert-parallel."""


def _forced(doc: dict[str, Any]) -> dict[str, str]:
    """Linears column-/row-parallel in turn, expert einsums expert-parallel, and the
    loss split over the batch (a mean's divisor is then counted over both halves)."""
    losses = {n["name"]: "sharded-mean" for n in doc["nodes"] if n.get("op") == "aten.cross_entropy_loss"}
    return {**_tensor_parallel(doc), **losses}


def _without_aux_loss(model: str) -> Any:
    """The zoo's model without the router's auxiliary loss: overlapped duplicas add the
    two halves' losses, and that loss over the whole batch is not the sum of the
    halves' (hapd refuses such a plan, naming the loss's ``add``)."""
    build = _zoo(model)

    def built() -> Any:
        module, inputs = build()
        module.model.config.output_router_logits = False
        return module, inputs

    return built


SPECS = [Spec(f"{model}/overlap", _without_aux_loss(model), "auto", _forced, frozenset(), True) for model in MODELS]


@pytest.fixture(scope="module")
def results() -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    references: dict = {}
    for world, ratios in RATIOS.items():
        for r in run_cases(make_cases(SPECS, ratios, ADAM_STEPS, references), world):
            out.setdefault(f"{r['case']}@{world}", []).append(r)
    return out


@pytest.mark.parametrize("world", sorted(RATIOS))
@pytest.mark.parametrize("model", MODELS)
def test_overlapped_duplicas_train_exactly(model, world, results) -> None:
    ranks = results[f"{model}/overlap@{world}"]
    assert len(ranks) == world
    for r in ranks:
        assert r["not_forced"] == [], r["not_forced"]
        assert worst(r) <= TOL, r


# --------------------------------------------------------------------------------------
# The interleaved graph, and what overlapped execution refuses
# --------------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, mean: bool = False, norm: bool = False):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4)
        self.norm = nn.BatchNorm1d(16) if norm else nn.Identity()
        self.reduction = "mean" if mean else "sum"

    def forward(self, x, y):
        h = torch.relu(self.norm(self.a(x)))
        return nn.functional.cross_entropy(self.c(torch.relu(self.b(h))), y, reduction=self.reduction)


def _mlp_half_batch(**kw):
    torch.manual_seed(0)
    return MLP(**kw), (torch.randn(4, 8), torch.randint(0, 4, (4,)))


def _linears(rules):
    return lambda doc: {n["name"]: r for n, r in zip([n for n in doc["nodes"] if n.get("op") == "aten.linear"], rules)}


CASES = {
    # name: (model kwargs, force, error or None)
    "tensor-parallel": ({}, _linears(["column-parallel", "row-parallel", "data-parallel"]), None),
    "batch-norm": ({"norm": True}, None, "statistics over the whole batch|updated from the whole batch"),
    "replicated-mean": ({"mean": True}, lambda doc: {n["name"]: "replicated" for n in doc["nodes"]
                                                     if n.get("op") == "aten.cross_entropy_loss"},
                        "neither a sum over samples nor a mean over counted targets"),
}


def _build_on_rank(rank: int, world: int) -> dict[str, Any]:
    from hapd.spmd.rewrite import distribute

    out: dict[str, Any] = {}
    for name, (kw, force, _error) in CASES.items():
        module, half = _mlp_half_batch(**kw)
        program = hapd.export(module, half)
        ir = hapd.lower(program, name="mlp")
        plan = hapd.compile(ir, estimated_profile(2), CompileOptions(ratios=(0.6, 0.4), force=force(ir.doc) if force else {}))
        single = distribute(program, plan, rank, check_graph=False)
        try:
            both = overlapped(single)
        except PlanError as exc:
            out[name] = ("error", str(exc))
            continue
        out[name] = ("built", _schedule(both), [s["rule"] for s in plan.program["steps"] if s["op"] == "aten.linear"])
    return out


def _schedule(module) -> list[str]:
    """The overlapped graph's collectives and computation in order: ``start:a``,
    ``finish:b``, ``op:a`` (an op of duplica a), ``op:`` (shared by both)."""
    starts = {}
    out = []
    for node in module.graph.nodes:
        if node.op == "call_module" and isinstance(module.get_submodule(node.target), StartExchange):
            dup = node.args[0].name.rsplit("_", 1)[-1]
            starts[node] = dup
            out.append(f"start:{dup}")
        elif node.op == "call_function" and node.target is collectives.finish_exchange:
            pair = node.args[0].args[0]
            out.append(f"finish:{starts[pair]}")
        elif node.op in ("call_function", "call_module") and node.target is not operator.getitem:
            suffix = node.name.rsplit("_", 1)[-1]
            out.append(f"op:{suffix if suffix in ('a', 'b') else ''}")
    return out


@pytest.fixture(scope="module")
def built() -> list[dict[str, Any]]:
    return run_ranks(2, _build_on_rank, timeout=300)


def test_other_duplica_computes_while_a_collective_is_in_flight(built) -> None:
    for rank in built:
        kind, schedule, rules = rank["tensor-parallel"]
        assert kind == "built"
        assert "column-parallel" in rules and "row-parallel" in rules
        starts = [i for i, e in enumerate(schedule) if e.startswith("start:")]
        assert starts, schedule
        overlapped_points = 0
        for i in starts:
            dup = schedule[i].split(":")[1]
            other = "b" if dup == "a" else "a"
            j = schedule.index(f"finish:{dup}", i)
            between = schedule[i + 1:j]
            assert f"op:{dup}" not in between, (i, schedule)
            overlapped_points += f"op:{other}" in between
        # every point but the first duplica's first (nothing of b is ready yet) and the
        # second's last (a is done) hides the other duplica's work
        assert overlapped_points >= len(starts) - 2, schedule


@pytest.mark.parametrize("name", [n for n, (_, _, error) in CASES.items() if error])
def test_programs_whose_halves_do_not_add_up_are_refused(name, built) -> None:
    error = CASES[name][2]
    for rank in built:
        kind, message = rank[name][:2]
        assert kind == "error", rank[name]
        assert re.search(error, message), message
def test_split_batch_cuts_first_and_last_rows() -> None:
    x, y = torch.arange(12).view(6, 2), torch.arange(6)
    (xa, ya), (xb, yb) = split_batch((x, y), (0, 0))
    assert xa.tolist() == x[:3].tolist() and xb.tolist() == x[3:].tolist() and yb.tolist() == [3, 4, 5]
    (sa,), (sb,) = split_batch((torch.tensor(2.0),), (None,))
    assert float(sa) == float(sb) == 2.0
    with pytest.raises(PlanError, match="odd"):
        split_batch((torch.zeros(5, 2),), (0,))
