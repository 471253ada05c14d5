"""What the sharding-ratio LPs share: the core's cost and memory rows read under some
ratios, PuLP's variables and solver, the memory-cap constraints, the result of a solve
and the error that says why one failed. The LP of a plain program is
:mod:`hapd.compiler.ratios`'s, the LP of two interleaved duplicas
:mod:`hapd.compiler.overlap`'s."""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import pulp

from hapd.errors import SynthesisError
from hapd.util import format_bytes


@dataclass(frozen=True, kw_only=True)
class LPResult:
    """The optimal ratios of one program."""

    ratios: tuple[float, ...]
    """Sharding ratio of each device (sums to 1)."""
    objective: float
    """Estimated seconds per iteration under those ratios."""
    variables: int
    """LP size: ratio + auxiliary variables."""


class SolvedLPs:
    """The ratios of LPs solved in this process, by a key of the LP (the most recent
    ``kept``): the search ⇄ LP rounds, the memory checks and the
    pipeline search's groups meet the same LP again and again (a round's program
    unchanged, the data-parallel program the search's own), and each solve starts a CBC
    process. A key must hold everything the LP is made of, in the order it is posed
    (CBC's answer among equally good ratios may depend on it)."""

    def __init__(self, kept: int = 4096):
        self.kept = kept
        self.lock = threading.Lock()
        self.entries: OrderedDict[bytes, tuple[tuple[float, ...], int]] = OrderedDict()

    def get(self, key: bytes) -> tuple[tuple[float, ...], int] | None:
        with self.lock:
            found = self.entries.get(key)
            if found is not None:
                self.entries.move_to_end(key)
            return found

    def put(self, key: bytes, value: tuple[tuple[float, ...], int]) -> None:
        with self.lock:
            self.entries[key] = value
            while len(self.entries) > self.kept:
                self.entries.popitem(last=False)


def row_values(row: Mapping[str, Sequence[float]], ratios: Sequence[float]) -> list[float]:
    """Per device ``d``, a cost or memory row of the core, ``constant[d] + coef[d]·r[d]``."""
    return [c + k * r for c, k, r in zip(row["constant"], row["coef"], ratios)]


def memory_rows(program: Mapping[str, Any]) -> list[Mapping[str, Sequence[float]]]:
    """The program's memory rows: bytes held while the backward pass runs, and during the
    optimizer step (a program from before the second row existed has only the first)."""
    return [program[key] for key in ("memory", "memory_update") if key in program]


def variable(lp: pulp.LpProblem, name: str, lowBound: float | None = None) -> pulp.LpVariable:
    """A continuous LP variable; ``LpProblem.add_variable`` where PuLP has it (PuLP ≥ 3.3
    deprecates constructing ``LpVariable`` directly)."""
    if hasattr(lp, "add_variable"):
        return lp.add_variable(name, lowBound=lowBound)
    return pulp.LpVariable(name, lowBound=lowBound)


_WARNINGS_LOCK = threading.Lock()


def solver() -> Any:
    """CBC: the system one (``COIN_CMD``) where installed, else the one bundled with PuLP
    (``PULP_CBC_CMD``, which PuLP ≥ 3.3 deprecates; its warning is PuLP's, not the
    caller's, so it is silenced here; under a lock, as the warning filters are the
    process's and the pipeline search solves on several threads)."""
    with _WARNINGS_LOCK, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        coin = pulp.COIN_CMD(msg=False)
        if coin.available():
            return coin
        return pulp.PULP_CBC_CMD(msg=False)


def cap_memory(
    lp: pulp.LpProblem, program: Mapping[str, Any], r: Sequence[pulp.LpVariable], memory_caps: Sequence[float]
) -> None:
    """Add to ``lp`` that every memory row of ``program`` (:func:`memory_rows`) stays under
    each device's cap at the ratios ``r``."""
    for k, mem in enumerate(memory_rows(program)):
        for d in range(len(r)):
            lp += mem["constant"][d] + mem["coef"][d] * r[d] <= memory_caps[d], f"memory_{k}_{d}"


def recap_memory(lp: pulp.LpProblem, program: Mapping[str, Any], memory_caps: Sequence[float]) -> None:
    """Change the caps of the memory constraints :func:`cap_memory` added to ``lp`` (for
    ``program``) to ``memory_caps``: the LP as :func:`cap_memory` would have made it with
    these (each constraint's constant is its row's constant less the cap, as PuLP
    subtracts it; names, order and coefficients unchanged, so the solver reads the same
    text)."""
    # PuLP ≥ 3.3 finds a constraint by name (and deprecates the dict); older PuLP has only the dict
    find = lp.get_constraint_by_name if hasattr(lp, "get_constraint_by_name") else lp.constraints.get
    for k, mem in enumerate(memory_rows(program)):
        for d, cap in enumerate(memory_caps):
            constraint = find(f"memory_{k}_{d}")
            if constraint is None:
                raise SynthesisError(f"the sharding-ratio LP has no memory constraint memory_{k}_{d} to cap (a bug)")
            constraint.constant = mem["constant"][d] - cap


def lp_failure(status: str, program: Mapping[str, Any], memory_caps: Sequence[float] | None) -> str:
    """Why the LP of ``program`` ended with ``status`` instead of an optimum: for an
    infeasible LP with memory caps, the device with the least to spare and what the
    replicated and the sharded state need."""
    if status == "Infeasible" and memory_caps is not None:
        mem = max(memory_rows(program), key=lambda row: sum(row["constant"]) + sum(row["coef"]))
        need = sum(mem["coef"])
        spare = [cap - c for cap, c in zip(memory_caps, mem["constant"])]
        worst = min(range(len(spare)), key=lambda d: spare[d])
        return (
            f"the sharding-ratio LP is infeasible: the program does not fit in device memory "
            f"(replicated state needs {format_bytes(mem['constant'][worst])} on device {worst}, "
            f"which has {format_bytes(memory_caps[worst])}; sharded state totals {format_bytes(need)} "
            f"over {len(spare)} devices with {format_bytes(sum(max(0.0, s) for s in spare))} to spare)"
        )
    return f"the sharding-ratio LP ended with status {status!r}"
