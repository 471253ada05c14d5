"""The layout vocabulary: how a rank holds a tensor of the plan.

A plan holds every tensor in one of three layouts, spelled as the core spells them:

- ``Identity`` (:data:`IDENTITY`) — whole on every rank;
- ``Gather(d)`` (:func:`gather`) — split along dim ``d``, each rank holding its
  sharding ratio's rows (uneven lengths: the plan's ``lengths_of``);
- ``Reduce`` (:data:`REDUCE`) — a partial sum: the whole value is the sum of every
  rank's.
"""

from __future__ import annotations

import re

from hapd.errors import PlanError

IDENTITY = "Identity"
"""Whole on every rank."""
REDUCE = "Reduce"
"""A partial sum on every rank: the whole value is their sum."""

_GATHER = re.compile(r"Gather\((\d+)\)")


def gather(dim: int) -> str:
    """``"Gather(d)"``: split along ``dim``."""
    return f"Gather({dim})"


def gather_dim(layout: str) -> int | None:
    """``d`` for ``"Gather(d)"``, ``None`` for ``Identity`` and ``Reduce``."""
    m = _GATHER.fullmatch(layout)
    return int(m.group(1)) if m else None


def check_layout(layout: str, where: str) -> str:
    """``layout`` when it is one of the three; :class:`~hapd.errors.PlanError` naming
    ``where`` otherwise."""
    if layout not in (IDENTITY, REDUCE) and gather_dim(layout) is None:
        raise PlanError(f"{where}: unknown layout {layout!r}")
    return layout


__all__ = ["IDENTITY", "REDUCE", "check_layout", "gather", "gather_dim"]
