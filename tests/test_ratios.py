"""Sharding lengths and the sharding-ratio LP on hand-solvable instances."""

from __future__ import annotations

import pytest

from hapd.errors import SynthesisError
from hapd.compiler.ratios import per_device, program_cost, sharding_lengths, solve_ratios


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
