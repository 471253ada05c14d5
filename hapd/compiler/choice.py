"""Which technique runs when several are priced: the simplest unless a more complex one
is clearly faster.

The techniques rank by what they run (:data:`ORDER`): SPMD (one program), pipeline
(stages, micro-batches, point-to-point sends between groups) and overlap (two
interleaved duplicas of a program). A cost model's estimate has an error of a few
percent, and each step up the order is more machinery to go wrong, so a technique is
chosen only when it is predicted at least ``margin`` faster than *every* simpler one
priced (``CompileOptions.technique_margin``, 2% by default): its seconds at most
``(1 - margin)`` times theirs. Of the techniques that qualify (SPMD always does) the
fastest runs, ties to the simpler. The fastest qualifying technique is faster than
every simpler one, so anything faster than the winner is more complex and short of
the margin. Nothing here imports torch or the core.
"""

from __future__ import annotations

from collections.abc import Mapping

ORDER = ("spmd", "pipeline", "overlap")
"""The techniques from simplest to most complex."""


def beats(seconds: float, simpler: float, margin: float) -> bool:
    """Whether a technique predicted at ``seconds`` is clearly faster than a simpler one
    predicted at ``simpler``: by at least ``margin`` of the simpler's time."""
    return seconds <= (1.0 - margin) * simpler


def qualifies(name: str, costs: Mapping[str, float | None], margin: float) -> bool:
    """Whether technique ``name`` (priced in ``costs``) beats every simpler technique
    priced (:func:`beats`); a technique not priced (None, or absent) never qualifies."""
    seconds = costs.get(name)
    if seconds is None:
        return False
    simpler = ORDER[: ORDER.index(name)]
    return all(costs.get(s) is None or beats(seconds, float(costs[s]), margin) for s in simpler)


def choose(costs: Mapping[str, float | None], margin: float) -> str:
    """The technique that runs: the fastest of those that qualify (:func:`qualifies`),
    ties to the simpler; ``costs`` maps each technique of :data:`ORDER` priced to its
    predicted seconds per step (None: not priced). SPMD when nothing qualifies."""
    fit = [name for name in ORDER if qualifies(name, costs, margin)]
    if not fit:
        return "spmd"
    return min(fit, key=lambda name: (float(costs[name]), ORDER.index(name)))  # type: ignore[arg-type]


__all__ = ["ORDER", "beats", "choose", "qualifies"]
