"""Sharding lengths and the sharding-ratio LP on hand-solvable instances."""

from __future__ import annotations

import pytest

from hapd.errors import SynthesisError
from hapd.compiler.lengths import sharding_lengths
from hapd.compiler.ratios import per_device, program_cost, serial_cost, solve_ratios


@pytest.mark.parametrize(
    ("ratios", "units", "expected"),
    [
        ((0.6, 0.4), 8, [5, 3]),  # 4.8, 3.2 → remainders .8, .2
        ((0.4, 0.3, 0.2, 0.1), 10, [4, 3, 2, 1]),
        ((0.5, 0.5), 3, [2, 1]),  # tie goes to the lower rank
        ((0.25, 0.25, 0.25, 0.25), 2, [1, 1, 0, 0]),  # zeros allowed, ties to lower ranks
        ((1.0, 0.0), 5, [5, 0]),
        ((0.0, 1.0), 5, [0, 5]),
        ((1 / 3, 1 / 3, 1 / 3), 7, [3, 2, 2]),
        ((0.7, 0.3), 0, [0, 0]),
        ((2.0, 1.0), 3, [2, 1]),  # unnormalized ratios
    ],
)
def test_sharding_lengths(ratios, units, expected):
    lengths = sharding_lengths(ratios, units)
    assert lengths == expected
    assert sum(lengths) == units
    assert all(v >= 0 for v in lengths)


@pytest.mark.parametrize("units", [1, 7, 64, 1000])
def test_sharding_lengths_is_close_to_exact(units):
    ratios = (0.37, 0.21, 0.29, 0.13)
    lengths = sharding_lengths(ratios, units)
    assert sum(lengths) == units
    for r, n in zip(ratios, lengths):
        assert abs(n - r * units) < 1


def test_sharding_lengths_rejects_bad_input():
    with pytest.raises(ValueError):
        sharding_lengths((0.5, 0.5), -1)
    with pytest.raises(ValueError):
        sharding_lengths((0.0, 0.0), 4)


def row(constant, coef):
    return {"constant": list(constant), "coef": list(coef)}


def program(steps, memory=None, devices=2):
    return {
        "devices": devices,
        "steps": [{"comp": comp, "comm": comm} for comp, comm in steps],
        "memory": memory or row([0.0] * devices, [0.0] * devices),
    }


ZERO = row([0.0, 0.0], [0.0, 0.0])
F0, F1 = 2.0, 1.0
SHARDED = row([0.0, 0.0], [1 / F0, 1 / F1])  # one unit of work split by the ratios


def test_lp_balances_by_speed():
    result = solve_ratios(program([(SHARDED, ZERO)]))
    assert result.ratios == pytest.approx((2 / 3, 1 / 3), abs=1e-6)
    assert result.objective == pytest.approx(1 / 3, abs=1e-6)
    assert sum(result.ratios) == pytest.approx(1.0)
    assert result.variables >= 3


def test_lp_respects_memory_caps():
    # memory: 10 bytes replicated, 100 bytes of sharded state; caps of 60 force r0 ≤ 0.5
    mem = row([10.0, 10.0], [100.0, 100.0])
    result = solve_ratios(program([(SHARDED, ZERO)], memory=mem), memory_caps=[60.0, 60.0])
    assert result.ratios == pytest.approx((0.5, 0.5), abs=1e-6)
    assert result.objective == pytest.approx(0.5, abs=1e-6)  # device 1: 0.5 / F1


def test_lp_without_caps_ignores_memory():
    mem = row([10.0, 10.0], [100.0, 100.0])
    result = solve_ratios(program([(SHARDED, ZERO)], memory=mem))
    assert result.ratios == pytest.approx((2 / 3, 1 / 3), abs=1e-6)


def test_lp_infeasible_memory_is_a_synthesis_error():
    mem = row([10.0, 10.0], [100.0, 100.0])
    with pytest.raises(SynthesisError, match="memory"):
        solve_ratios(program([(SHARDED, ZERO)], memory=mem), memory_caps=[5.0, 5.0])
    with pytest.raises(SynthesisError, match="memory"):
        solve_ratios(program([(SHARDED, ZERO)], memory=mem), memory_caps=[40.0, 40.0])


def test_one_device_takes_everything_without_starting_cbc(monkeypatch):
    """One device: ratio 1 and the program's cost at it, as the LP would give, but no
    solver process; a memory row over the cap is the LP's infeasible error."""
    from hapd.compiler import ratios

    monkeypatch.setattr(ratios, "solver", lambda: pytest.fail("one device must not start the LP solver"))
    work = row([0.5], [2.0])
    mem = row([10.0], [100.0])
    result = solve_ratios(program([(work, row([0.25], [0.0]))], memory=mem, devices=1), memory_caps=[200.0])
    assert result.ratios == (1.0,)
    assert result.objective == pytest.approx(2.5 + 0.25)
    assert solve_ratios(program([(work, row([0.0], [0.0]))], devices=1)).objective == pytest.approx(2.5)
    with pytest.raises(SynthesisError, match="does not fit in device memory"):
        solve_ratios(program([(work, row([0.0], [0.0]))], memory=mem, devices=1), memory_caps=[100.0])


def test_lp_keeps_constants():
    fixed = row([0.25, 0.1], [0.0, 0.0])  # a constant-only row: max is 0.25
    comm = row([0.05, 0.05], [0.0, 0.0])
    result = solve_ratios(program([(SHARDED, ZERO), (fixed, comm)]))
    assert result.ratios == pytest.approx((2 / 3, 1 / 3), abs=1e-6)
    assert result.objective == pytest.approx(1 / 3 + 0.25 + 0.05, abs=1e-6)


def test_lp_merges_proportional_rows_and_trades_off():
    # the same step twice (a repeated layer) and a row with a constant that favors device 1
    other = row([0.0, 0.0], [1.0, 1.0])
    result = solve_ratios(program([(SHARDED, ZERO), (SHARDED, other)]))
    assert result.objective == pytest.approx(program_cost(program([(SHARDED, ZERO), (SHARDED, other)]), result.ratios))
    # brute force over a grid: the LP is at least as good
    grid = [i / 1000 for i in range(1001)]
    best = min(program_cost(program([(SHARDED, ZERO), (SHARDED, other)]), (r, 1 - r)) for r in grid)
    assert result.objective <= best + 1e-6


def test_program_cost_by_hand():
    comp = row([1.0, 2.0], [3.0, 1.0])
    comm = row([0.5, 0.0], [0.0, 4.0])
    prog = program([(comp, comm), (ZERO, ZERO)])
    ratios = (0.25, 0.75)
    # comp: max(1 + 0.75, 2 + 0.75) = 2.75; comm: max(0.5, 3.0) = 3.0
    assert program_cost(prog, ratios) == pytest.approx(5.75)
    assert per_device(prog, ratios, "comp") == pytest.approx([1.75, 2.75])
    assert per_device(prog, ratios, "comm") == pytest.approx([0.5, 3.0])
    assert program_cost(program([]), ratios) == 0.0


def synced(comp, sync_seconds, other=None):
    """A step whose communication row is a gradient all-reduce of ``sync_seconds`` (plus
    ``other``), with the all-reduce also listed as its parameter source's cost."""
    sync = row([sync_seconds, sync_seconds], [0.0, 0.0])
    comm = row([sync_seconds + (other or ZERO)["constant"][0], sync_seconds + (other or ZERO)["constant"][1]],
               (other or ZERO)["coef"])
    return {"comp": comp, "comm": comm, "sources": [{"grad_sync": True, "cost": sync}]}


def overlapped(steps, eta):
    return {"devices": 2, "steps": steps, "memory": row([0.0, 0.0], [0.0, 0.0]), "sync_overlap": eta}


def read_last(comp, sync_seconds):
    """The compute ``comp`` and, after it, a step that reads a replicated parameter (its
    gradient all-reduce ``sync_seconds``): backward produces that gradient first, so the
    whole backward can hide its sum (the buckets' timeline, :mod:`hapd.compiler.sync_timeline`)."""
    return [{"comp": comp, "comm": ZERO}, synced(ZERO, sync_seconds)]


@pytest.mark.parametrize("eta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("sync", [0.05, 0.2, 2.0])
def test_gradient_sync_hides_behind_backward(eta, sync):
    # one unit of work split by speed: compute 1/3 at the LP's ratios, backward 2/9 of it
    prog = overlapped(read_last(SHARDED, sync), eta)
    result = solve_ratios(prog)
    assert result.ratios == pytest.approx((2 / 3, 1 / 3), abs=1e-6)
    backward = 2 / 3 * 1 / 3
    assert result.objective == pytest.approx(1 / 3 + sync - eta * min(sync, backward), abs=1e-6)
    assert program_cost(prog, result.ratios) == pytest.approx(result.objective, abs=1e-9)


def test_lp_with_overlap_is_optimal():
    lopsided = row([0.0, 0.3], [0.0, 0.0])  # a step that runs on device 1 only
    other = row([0.0, 0.0], [0.1, 0.8])  # ratio-dependent communication, never hidden
    for sync in (0.01, 5.0):
        steps = [{"comp": lopsided, "comm": other}, *read_last(SHARDED, sync)]
        for eta in (0.0, 0.5, 1.0):
            prog = overlapped(steps, eta)
            result = solve_ratios(prog)
            grid = [i / 2000 for i in range(2001)]
            best = min(program_cost(prog, (r, 1 - r)) for r in grid)
            assert result.objective <= best + 1e-6
            assert result.objective == pytest.approx(program_cost(prog, result.ratios), abs=1e-9)


def test_overlap_moves_the_split_when_backward_hides_a_long_sync():
    # device 0's communication grows with its share. Serially the LP balances compute
    # (r0/2 against r1) against it at r0 = 2/3; when the backward (2/3 of compute) hides
    # a long sync whole, compute costs only its forward third and device 0 gets nothing
    grows = row([0.0, 0.0], [0.5, 0.0])
    steps = [{"comp": ZERO, "comm": grows}, *read_last(SHARDED, 5.0)]
    serial = solve_ratios(overlapped(steps, 0.0))
    assert serial.ratios == pytest.approx((2 / 3, 1 / 3), abs=1e-6)
    assert serial.objective == pytest.approx(2 / 3 + 5.0, abs=1e-6)
    hidden = solve_ratios(overlapped(steps, 1.0))
    assert hidden.ratios == pytest.approx((0.0, 1.0), abs=1e-6)
    assert hidden.objective == pytest.approx(1 / 3 + 5.0, abs=1e-6)


def test_program_without_overlap_share_prices_serially():
    prog = overlapped([synced(SHARDED, 0.5)], 0.0)
    del prog["sync_overlap"]
    ratios = (0.5, 0.5)
    assert program_cost(prog, ratios) == pytest.approx(0.5 + 0.5)  # max(0.25, 0.5) + sync


def test_the_same_lp_is_solved_once_and_another_program_priced_at_its_ratios(monkeypatch):
    """An LP met again (the same rows, in the same order) takes the ratios CBC gave
    the first time without starting it; the objective is the asking program's cost at
    them. Other rows, or memory caps, are another LP."""
    from hapd.compiler import ratios

    slow = row([0.0, 0.0], [1 / 3.0, 1 / 1.5])  # a speed ratio no other test of this file poses
    first = solve_ratios(program([(slow, ZERO)]))
    monkeypatch.setattr(ratios, "solver", lambda: pytest.fail("the LP was solved before"))
    again = program([(slow, ZERO)], memory=row([5.0, 5.0], [8.0, 8.0]))  # memory is no row of an LP without caps
    second = solve_ratios(again)
    assert second.ratios == first.ratios
    assert second.objective == pytest.approx(program_cost(again, first.ratios))
    with pytest.raises(pytest.fail.Exception):
        solve_ratios(program([(row([0.0, 0.0], [1 / 3.0, 1 / 1.25]), ZERO)]))
    with pytest.raises(pytest.fail.Exception):
        solve_ratios(program([(slow, ZERO)]), memory_caps=[1e9, 1e9])


def test_a_gradient_backward_finishes_last_hides_nothing():
    # the parameter is read by the only step: its gradient exists when backward ends,
    # so its bucket's sum runs after it whatever η says (an embedding's, in a language model)
    prog = overlapped([synced(SHARDED, 0.2)], 1.0)
    result = solve_ratios(prog)
    assert result.ratios == pytest.approx((2 / 3, 1 / 3), abs=1e-6)
    assert result.objective == pytest.approx(1 / 3 + 0.2, abs=1e-6)
    assert program_cost(prog, result.ratios) == pytest.approx(serial_cost(prog, result.ratios))
