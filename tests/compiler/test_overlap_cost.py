"""Overlap-aware cost (``CompileOptions.overlap``): a program priced as two duplicas
interleaved, one computing while the other communicates (HiDup). The cost of a fixed
program by hand, the search against the plain plan, programs without collectives, the
ratio LP, the plan's record and explain, and the option itself."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

import hapd
from hapd.compiler import overlap
from hapd.ir.lower import GraphIR, lower
from hapd.compiler.lp import row_values
from hapd.compiler.options import CompileOptions
from hapd.compiler.plan import Plan
from hapd.compiler.ratios import peak_memory, program_cost, solve_ratios
from hapd.compiler.search import synthesize
from hapd.errors import OptionsError
from hapd.profile.schema import Profile, load_profile, profile_from_dict

ROOT = Path(__file__).resolve().parents[2]
PAPER8 = ROOT / "profiles" / "paper-8.json"

IN, HID = 8, 16
"""Feature sizes of :class:`UpDown`."""
FLOPS = 1.024e6
"""Matmul FLOP/s of the hand profile's devices (a linear here takes about a millisecond)."""
ALPHA = 1e-3
"""Latency of every collective of the hand profile (its bandwidth is all but infinite)."""


class UpDown(nn.Module):
    """``down(relu(up(x))).sum()``: two linears without bias."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(IN, HID, bias=False)
        self.down = nn.Linear(HID, IN, bias=False)
        if frozen:
            self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))).sum()


def _graph(batch: int, frozen: bool = False) -> GraphIR:
    torch.manual_seed(0)
    return lower(hapd.export(UpDown(frozen), (torch.randn(batch, IN),)))


def _hand_profile() -> Profile:
    """Two equal devices whose collectives each cost :data:`ALPHA`, and whose element-wise
    work is all but free."""
    link = {"inter": {"alpha": ALPHA, "beta": 1e20}}
    kinds = ("all_gather", "all_gather_grouped", "all_reduce", "all_to_all", "broadcast", "reduce_scatter",
             "reduce_scatter_grouped")
    return profile_from_dict({
        "format": "hapd.profile", "version": 1, "name": "hand-2",
        "devices": [{"rank": r, "host": f"h{r}", "model": "toy", "flops": FLOPS, "elementwise_flops": 1e24,
                     "memory": 2.0**40} for r in range(2)],
        "collectives": {kind: link for kind in kinds},
    })


EVEN = (0.5, 0.5)
"""Fixed ratios of the hand programs."""
GATHERED = {"linear": "column-parallel", "linear_1": "replicated"}
"""Rules of a program with one collective: ``up`` split by columns, ``down`` whole, so
relu's result is all-gathered before ``down`` (and its gradient reduce-scattered)."""


@pytest.fixture(scope="module")
def hand() -> Profile:
    return _hand_profile()


@pytest.fixture(scope="module")
def graph4() -> GraphIR:
    return _graph(4)


def _step(program: dict, node: str) -> dict:
    (step,) = [s for s in program["steps"] if s["node"] == node]
    return step


def test_cost_of_a_fixed_program_by_hand(hand, graph4):
    plan = hapd.compile(graph4, hand, CompileOptions(overlap=True, ratios=EVEN, force=GATHERED))
    program = plan.program
    assert [c["collective"] for c in _step(program, "linear_1")["comms"]] == ["all_gather"]
    # forward seconds of one duplica: `up` split evenly, `down` whole (relu and sum free)
    up = _step(program, "linear")["flops"] / FLOPS * 0.5
    down = _step(program, "linear_1")["flops"] / FLOPS
    # interval 0 is `up`; the all-gather (ALPHA) is the point; interval 1 is `down`:
    # A's up, then B's up under A's all-gather, A's down under B's all-gather, B's down
    forward = up + max(up, ALPHA) + max(down, ALPHA) + down
    # mirrored with twice the compute and the all-gather's dual (a reduce-scatter, ALPHA)
    backward = 2 * up + max(2 * up, ALPHA) + max(2 * down, ALPHA) + 2 * down
    # `down`'s weight is replicated: its gradient all-reduce, once for both duplicas
    grad_sync = ALPHA * (IN * HID * 4) / hapd._core.GRAD_BUCKET_BYTES
    expected = forward + backward + grad_sync
    assert plan.estimate["per_iteration"] == pytest.approx(expected, rel=1e-9)
    assert program["cost"] == pytest.approx(expected, rel=1e-9)  # the search's own price
    est = plan.estimate["overlap"]
    assert est["forward"] == pytest.approx(forward, rel=1e-9)
    assert est["backward"] == pytest.approx(backward, rel=1e-9)
    assert est["serial"] == pytest.approx(grad_sync, rel=1e-9)
    hidden = min(up, ALPHA) + min(down, ALPHA) + min(2 * up, ALPHA) + min(2 * down, ALPHA)
    assert est["hidden"] == pytest.approx(hidden, rel=1e-9)
    assert est["exposed"] == pytest.approx(4 * ALPHA - hidden, rel=1e-9)
    # the same program without overlap: one duplica, every collective stalls
    plain = hapd.compile(graph4, hand, CompileOptions(ratios=EVEN, force=GATHERED))
    assert plain.estimate["per_iteration"] == pytest.approx(3 * up + 3 * down + 2 * ALPHA + grad_sync, rel=1e-9)


def test_core_and_python_price_one_schedule(graph4):
    profile = load_profile(PAPER8)
    ratios = profile.flops_ratios()
    program = synthesize(graph4.data, profile, ratios, CompileOptions(overlap=True))
    assert program["duplicas"] == 2 and all(s["overlap"] is not None for s in program["steps"])
    assert overlap.overlap_cost(program, ratios) == pytest.approx(program["cost"], rel=1e-12)
    assert program_cost(program, ratios) == overlap.overlap_cost(program, ratios)


def test_no_collectives_costs_both_duplicas_back_to_back(hand, graph4):
    plain = hapd.compile(graph4, hand, CompileOptions(ratios=EVEN))
    both = hapd.compile(graph4, hand, CompileOptions(ratios=EVEN, overlap=True))
    for plan in (plain, both):
        assert not any(c["collective"] not in ("dynamic_slice", "mask_to_rank_zero")
                       for s in plan.program["steps"] for c in s["comms"])
    assert both.estimate["per_iteration"] == pytest.approx(2 * plain.estimate["per_iteration"], rel=1e-12)
    assert both.estimate["overlap"]["hidden"] == 0.0 and both.estimate["overlap"]["exposed"] == 0.0
    # ... which is the plain plan of the whole batch: the work is linear in the batch
    whole = hapd.compile(_graph(8), hand, CompileOptions(ratios=EVEN))
    assert both.estimate["per_iteration"] == pytest.approx(whole.estimate["per_iteration"], rel=1e-12)


def test_frozen_model_on_half_batch_costs_the_whole_batch(hand):
    """No parameter trains: no gradient all-reduce either, and nothing to overlap."""
    half = hapd.compile(_graph(4, frozen=True), hand, CompileOptions(overlap=True))
    whole = hapd.compile(_graph(8, frozen=True), hand)
    assert half.estimate["per_iteration"] == pytest.approx(whole.estimate["per_iteration"], rel=1e-9)


def test_overlap_search_is_no_dearer_than_the_plain_program(graph4):
    """On paper-8: the overlap plan of a graph costs no more than its plain plan run
    twice (the two duplicas back to back), and the overlap-aware search finds a program
    no dearer under the schedule than the plain program's."""
    profile = load_profile(PAPER8)
    plain = hapd.compile(graph4, profile)
    both = hapd.compile(graph4, profile, CompileOptions(overlap=True))
    assert both.estimate["per_iteration"] <= 2 * plain.estimate["per_iteration"] * (1 + 1e-9)
    ratios = tuple(plain.ratios)
    rules = {s["node"]: s["rule"] for s in plain.program["steps"]}
    as_plain = synthesize(graph4.data, profile, list(ratios), CompileOptions(overlap=True, force=rules))
    searched = synthesize(graph4.data, profile, list(ratios), CompileOptions(overlap=True))
    assert searched["stats"]["stop_reason"] == "optimal"
    assert searched["cost"] <= as_plain["cost"] * (1 + 1e-9)


def test_overlap_lp_is_exact_and_optimal(hand, graph4):
    program = synthesize(graph4.data, hand, list(EVEN), CompileOptions(overlap=True, force=GATHERED))
    lp = solve_ratios(program)
    assert lp.objective == pytest.approx(overlap.overlap_cost(program, lp.ratios), rel=1e-12)
    rng = random.Random(0)
    for _ in range(50):  # no nearby split of the batch is cheaper
        r0 = min(1.0, max(0.0, lp.ratios[0] + rng.uniform(-0.05, 0.05)))
        assert overlap.overlap_cost(program, (r0, 1 - r0)) >= lp.objective - 1e-12
    assert lp.objective <= overlap.overlap_cost(program, EVEN) + 1e-12


def test_both_duplicas_activations_count_in_memory(hand, graph4):
    plain = synthesize(graph4.data, hand, list(EVEN), CompileOptions(force=GATHERED))
    both = synthesize(graph4.data, hand, list(EVEN), CompileOptions(overlap=True, force=GATHERED))
    parts = plain["memory_parts"]
    extra = [a + i for a, i in zip(row_values(parts["activations"], EVEN), row_values(parts["inputs"], EVEN))]
    assert sum(extra) > 0
    expected = [p + e for p, e in zip(row_values(plain["memory"], EVEN), extra)]
    assert row_values(both["memory"], EVEN) == pytest.approx(expected)
    assert row_values(both["memory_update"], EVEN) == pytest.approx(row_values(plain["memory_update"], EVEN))
    # the plan's peak, priced at the integer lengths, counts them too
    update = row_values(both["memory_update"], EVEN)
    assert peak_memory(both, EVEN) == pytest.approx([max(b, u) for b, u in zip(expected, update)])


def test_plan_records_duplicas_and_explains_overlap(hand, graph4, tmp_path):
    plan = hapd.compile(graph4, hand, CompileOptions(overlap=True, ratios=EVEN, force=GATHERED))
    assert plan.doc["overlap"] is True and plan.doc["duplicas"] == 2
    assert plan.overlap and plan.duplicas == 2
    loaded = Plan.load(plan.save(tmp_path / "p.hplan"))
    assert loaded.overlap and loaded.duplicas == 2
    text = plan.explain()
    assert "overlap: 2 duplicas interleaved" in text
    (forward,) = [line for line in text.splitlines() if line.strip().startswith("forward:")]
    assert "1 communication points" in forward
    assert any("interval 1" in line and "linear_1" in line and "hidden" in line for line in text.splitlines())
    plain = hapd.compile(graph4, hand, CompileOptions(ratios=EVEN, force=GATHERED))
    assert plain.doc["overlap"] is False and plain.doc["duplicas"] == 1
    assert "overlap:" not in plain.explain()
    assert all(s["overlap"] is None for s in plain.program["steps"])


def test_baselines_are_for_the_global_batch(hand, graph4):
    """DP-EV and DP-CP of an overlapped plan price DDP on both duplicas' batch: the same
    as the plain plan's of the whole-batch graph."""
    both = hapd.compile(graph4, hand, CompileOptions(overlap=True))
    whole = hapd.compile(_graph(8), hand)
    for key in ("dp_ev", "dp_cp"):
        assert both.doc["baselines"][key] == pytest.approx(whole.doc["baselines"][key], rel=1e-9)


def test_option_is_validated_and_keyed():
    with pytest.raises(OptionsError, match="overlap"):
        CompileOptions(overlap="yes")
    with pytest.raises(OptionsError, match="overlap"):
        CompileOptions(overlap=1)
    assert CompileOptions().overlap is False
    assert CompileOptions(overlap=True).key()["overlap"] is True
    assert CompileOptions(overlap=True).key() != CompileOptions().key()
    assert CompileOptions(overlap=True).core()["overlap"] is True
    assert CompileOptions().core()["overlap"] is False


def test_core_rejects_a_non_boolean_overlap(graph4):
    profile = load_profile(PAPER8)
    with pytest.raises(TypeError):
        hapd._core.synthesize(graph4.data, profile.core_bytes(), profile.flops_ratios(), {"overlap": "yes"})


def test_cli_compiles_an_overlapped_plan_and_explains_it(graph4, tmp_path):
    from click.testing import CliRunner

    from hapd.cli import main

    path = graph4.save(tmp_path / "updown.hapg")
    out = tmp_path / "updown.hplan"
    result = CliRunner().invoke(main, ["compile", str(path), "-p", str(PAPER8), "-o", str(out), "--overlap"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    plan = Plan.load(out)
    assert plan.overlap and plan.key["options"]["overlap"] is True
    explained = CliRunner().invoke(main, ["explain", "--steps", str(out)], catch_exceptions=False)
    assert explained.exit_code == 0, explained.output
    assert "overlap: 2 duplicas interleaved" in explained.output


def test_an_lp_made_once_solves_under_new_caps_as_one_made_anew(hand, graph4, monkeypatch):
    """The overlapped LP of a program solved under several caps is made once, its memory
    constraints' caps changed in place: the ratios are those of the LP made anew."""
    from hapd.compiler.lp import SolvedLPs

    program = synthesize(graph4.data, hand, list(EVEN), CompileOptions(overlap=True, force=GATHERED))
    roomy = [4 * p for p in peak_memory(program, EVEN)]
    tight = [roomy[0], 0.98 * peak_memory(program, EVEN)[1]]  # device 1 short at an even split
    made = overlap.MadeLPs()
    monkeypatch.setattr(overlap, "_SOLVED", SolvedLPs())  # no answer from an earlier solve
    first = overlap.solve_overlapped(program, roomy, made=made)
    again = overlap.solve_overlapped(program, tight, made=made)
    monkeypatch.setattr(overlap, "_SOLVED", SolvedLPs())
    anew = overlap.solve_overlapped(program, tight)
    assert len(made.made) == 1 and again.ratios == anew.ratios and again.variables == anew.variables
    assert again.ratios[1] < first.ratios[1]  # the new caps bind
