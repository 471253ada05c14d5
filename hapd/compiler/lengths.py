"""Integer lengths under sharding ratios: how many samples, rows or units each rank
takes of a dimension the plan splits. Pure Python (no pulp, no torch), so the data
loaders and the baselines read it without loading the LP."""

from __future__ import annotations

from collections.abc import Sequence


def sharding_lengths(ratios: Sequence[float], units: int) -> list[int]:
    """Split ``units`` into integers proportional to ``ratios`` by largest remainder
    (ties go to the lower rank). Lengths sum to ``units``; zeros are allowed."""
    if units < 0:
        raise ValueError(f"cannot split {units} units")
    total = sum(ratios)
    if total <= 0:
        raise ValueError(f"ratios {list(ratios)} do not sum to a positive number")
    exact = [units * r / total for r in ratios]
    lengths = [int(e) for e in exact]
    rest = units - sum(lengths)
    order = sorted(range(len(ratios)), key=lambda d: (-(exact[d] - lengths[d]), d))
    for d in order[:rest]:
        lengths[d] += 1
    return lengths
