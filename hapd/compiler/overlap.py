"""Two duplicas interleaved (``CompileOptions.overlap``): the schedule's cost of a
program, its sharding-ratio LP, its memory, and where it hides communication.

A program searched with overlap is one duplica's (half the global batch); the runtime
(:mod:`hapd.spmd.duplicas`) runs it twice, duplicas A and B, interleaved at every
**communication point** (a collective on a batch-dependent tensor): A's collective runs
while B computes the interval before the point, then B's while A computes the interval
after it. Each step of such a program carries its ``overlap`` rows
(``rustcore/core/src/overlap.rs`` says what each holds), and each pass (forward, and
the backward mirrored) of the global batch costs

    S^A_0 + Σ_k max(S^B_{k-1}, first_k) + inner_k + max(S^A_k, last_k) + S^B_last

with ``S^A_k``/``S^B_k`` duplica A's/B's compute of interval ``k`` (ops that depend on no
input run in A only), ``first_k``/``last_k`` the first/last of the collectives at the
point's step and ``inner_k`` the exposed time of any between them. Collectives of
parameters and the replicated gradients' all-reduce run once, serially. Every time is
the slowest device's, as in the rest of the cost model. This module mirrors the core's
``Clock`` in closed form, so that the search, the LP and the plan's estimate price one
schedule.

The LP is exact for a fixed program: every term is a maximum of functions linear in the
ratios, added with a positive weight, so an epigraph variable per maximum is at its
maximum at the optimum.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import msgpack
import pulp

from hapd.compiler.lp import (
    LPResult,
    SolvedLPs,
    cap_memory,
    lp_failure,
    memory_rows,
    recap_memory,
    row_values,
    solver,
    variable,
)
from hapd.errors import SynthesisError

DUPLICAS = 2
"""Duplicas an overlapped program runs (the core's ``overlap::DUPLICAS``)."""

PASSES = ("forward", "backward")


def is_overlapped(program: Mapping[str, Any]) -> bool:
    """Whether ``program`` was searched with overlap (runs as interleaved duplicas)."""
    return int(program.get("duplicas", 1)) > 1


def _max(row: Mapping[str, Sequence[float]], ratios: Sequence[float]) -> float:
    return max(row_values(row, ratios), default=0.0)


@dataclass(kw_only=True)
class Interval:
    """One pass's computation from one communication point to the next, and the
    collectives at its point."""

    index: int
    node: str | None
    """The step at the point (``None`` for interval 0, before the first point)."""
    compute_a: float = 0.0
    """Duplica A's compute in the interval."""
    compute_b: float = 0.0
    """Duplica B's (without the steps that depend on no input)."""
    first: float = 0.0
    """The first collective at the point: A's runs under B's compute of the previous
    interval."""
    last: float = 0.0
    """The last: B's runs under A's compute of this interval."""
    inner: float = 0.0
    """The collectives between, exposed (both duplicas')."""
    hidden: float = 0.0
    """Communication time at the point that compute hides."""

    @property
    def communication(self) -> float:
        """Both duplicas' collectives at the point (0 for interval 0)."""
        return self.first + self.inner + self.last if self.node is not None else 0.0

    @property
    def exposed(self) -> float:
        """Communication time at the point that stalls compute."""
        return self.communication - self.hidden


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """An overlapped program's schedule under some ratios."""

    intervals: dict[str, list[Interval]]
    """Per pass (``forward``, ``backward``), its intervals in program order."""
    serial: float
    """Collectives run once for both duplicas, not overlapped."""

    def compute(self, pass_: str) -> float:
        """Both duplicas' compute in a pass."""
        return sum(s.compute_a + s.compute_b for s in self.intervals[pass_])

    def hidden(self, pass_: str | None = None) -> float:
        """Communication hidden under compute, in a pass or both."""
        passes = PASSES if pass_ is None else (pass_,)
        return sum(s.hidden for p in passes for s in self.intervals[p])

    def exposed(self, pass_: str | None = None) -> float:
        """Communication that stalls compute, in a pass or both."""
        passes = PASSES if pass_ is None else (pass_,)
        return sum(s.exposed for p in passes for s in self.intervals[p])

    def pass_cost(self, pass_: str) -> float:
        return self.compute(pass_) + self.exposed(pass_)

    @property
    def cost(self) -> float:
        """Seconds per iteration of the global batch (both duplicas)."""
        return self.pass_cost("forward") + self.pass_cost("backward") + self.serial


def _chain(times: Sequence[float]) -> tuple[float, float, float]:
    """(first, last, inner) of collectives of these times before one step (the core's
    ``PassTimes::chain``)."""
    if not times:
        return 0.0, 0.0, 0.0
    return times[0], times[-1], 2.0 * sum(times) - times[0] - times[-1] if len(times) > 1 else 0.0


def schedule(program: Mapping[str, Any], ratios: Sequence[float]) -> Schedule:
    """The intervals of overlapped ``program`` under ``ratios``, with how much of each
    point's communication compute hides."""
    intervals: dict[str, list[Interval]] = {p: [Interval(index=0, node=None)] for p in PASSES}
    serial = 0.0
    for step in program["steps"]:
        rows = step["overlap"]
        serial += _max(rows["serial"], ratios)
        for p in PASSES:
            compute = _max(rows[f"comp_{p}"], ratios)
            comms = [_max(c, ratios) for c in rows[f"comm_{p}"]]
            if comms:
                first, last, inner = _chain(comms)
                intervals[p].append(Interval(index=len(intervals[p]), node=step["node"], first=first, last=last, inner=inner))
            part = intervals[p][-1]
            part.compute_a += compute
            if rows["batch"]:
                part.compute_b += compute
    for p in PASSES:
        chain = intervals[p]
        for k, part in enumerate(chain):
            if k > 0:
                part.hidden = min(part.first, chain[k - 1].compute_b) + min(part.last, part.compute_a)
    return Schedule(intervals=intervals, serial=serial)


def overlap_cost(program: Mapping[str, Any], ratios: Sequence[float]) -> float:
    """Seconds per iteration of overlapped ``program`` under ``ratios``, for the global
    batch (both duplicas)."""
    return schedule(program, ratios).cost


def device_seconds(program: Mapping[str, Any], ratios: Sequence[float]) -> tuple[list[float], list[float]]:
    """Per-device compute and communication seconds of both duplicas (what each device
    spends on each, however much of it overlaps)."""
    n = len(ratios)
    compute, communication = [0.0] * n, [0.0] * n
    for step in program["steps"]:
        rows = step["overlap"]
        runs = DUPLICAS if rows["batch"] else 1
        for key in ("comp_forward", "comp_backward"):
            for d, v in enumerate(row_values(rows[key], ratios)):
                compute[d] += runs * v
        for row in rows["comm_forward"] + rows["comm_backward"]:
            for d, v in enumerate(row_values(row, ratios)):
                communication[d] += DUPLICAS * v
        for d, v in enumerate(row_values(rows["serial"], ratios)):
            communication[d] += v
    return compute, communication


def with_duplica_memory(program: dict[str, Any]) -> dict[str, Any]:
    """``program`` with its backward-pass memory counting every duplica's batch inputs and
    kept activations: the core's memory rows are one duplica's, and both duplicas run
    their forward before either runs its backward, while parameters, gradients and
    optimizer state are held once. Updates ``memory`` and, where present,
    ``memory_split``, in place."""
    extra = DUPLICAS - 1
    parts = program.get("memory_parts", {})
    row = program["memory"]
    for name in ("inputs", "activations"):
        part = parts.get(name)
        if part is not None:
            row = {
                "constant": [c + extra * v for c, v in zip(row["constant"], part["constant"])],
                "coef": [c + extra * v for c, v in zip(row["coef"], part["coef"])],
            }
    program["memory"] = row
    split = program.get("memory_split")
    if split is not None:
        backward = dict(split["backward"])
        for name in ("inputs", "activations"):
            part = split["parts"].get(name)
            if part is None:
                continue
            backward["replica"] = backward["replica"] + extra * part["replica"]
            backward["shards"] = list(backward["shards"]) + [[c, extra * b] for c, b in part["shards"]]
            backward["largest"] = list(backward["largest"]) + [[[c, extra * b] for c, b in g] for g in part["largest"]]
        program["memory_split"] = dict(split, backward=backward)
    return program


@dataclass
class _Maxima:
    """Epigraph variables of ``max_d row_d(r)`` in one LP, one per distinct row shape
    (rows that are positive multiples of each other share one, scaled)."""

    lp: pulp.LpProblem
    r: list[pulp.LpVariable]
    vars: dict[tuple, pulp.LpVariable] = field(default_factory=dict)
    seen: dict[tuple, Any] = field(default_factory=dict)
    """Each row as given → its expression: a model's repeated blocks give the same rows
    again and again (Llama-7B on 64 devices: scaling and rounding each row's 128 numbers
    anew took most of the LP's making)."""

    def of(self, row: Mapping[str, Sequence[float]]) -> Any:
        """An expression equal to the row's maximum at the LP's optimum (a number where
        the row does not depend on the ratios)."""
        raw = (tuple(row["constant"]), tuple(row["coef"]))
        found = self.seen.get(raw)
        if found is None:
            found = self.seen[raw] = self._of(*raw)
        number, (scale, var) = found
        return number if var is None else scale * var  # a fresh expression each time: pulp's add in place

    def _of(self, const: tuple[float, ...], coef: tuple[float, ...]) -> tuple[float, tuple[float, Any]]:
        """(the row's maximum, (1, None)) when it does not depend on the ratios, else
        (0, (scale, the epigraph variable of the row divided by scale))."""
        if not any(coef):
            return max(const, default=0.0), (1.0, None)
        scale = max(max(map(abs, const)), max(map(abs, coef)))
        key = tuple([round(v / scale, 9) for v in const + coef])
        var = self.vars.get(key)
        if var is None:
            i = len(self.vars)
            var = self.vars[key] = variable(self.lp, f"m_{i}")
            for d, (c, k) in enumerate(zip(const, coef)):
                self.lp += var >= c / scale + (k / scale) * self.r[d], f"m_{i}_{d}"
        return 0.0, (scale, var)


@dataclass
class MadeLPs:
    """The overlapped LPs of one program made so far, by whether they have memory caps:
    a caller solving it under several caps (:func:`hapd.compiler.ratios.solve_ratios`:
    the caps with a margin, lowered where integer lengths pass them, then whole) makes
    it once and changes only the caps (Llama-7B's duplica on paper-64: 30 LPs of 9
    programs, ~70 ms of Python each to make)."""

    made: dict[bool, tuple[pulp.LpProblem, list[pulp.LpVariable]]] = field(default_factory=dict)


def solve_overlapped(program: Mapping[str, Any], memory_caps: Sequence[float] | None,
                     digest: bytes | None = None, made: MadeLPs | None = None) -> LPResult:
    """Sharding ratios minimizing overlapped ``program``'s cost (:func:`overlap_cost`),
    under per-device memory caps when given; ``digest``: its :func:`rows_digest`, when
    the caller has it; ``made``: the LPs of this program made before, to solve again
    under these caps."""
    n = int(program["devices"])
    known = _lp_key(program, n, memory_caps, digest)
    solved = _SOLVED.get(known)
    if solved is not None:
        return LPResult(ratios=solved[0], objective=overlap_cost(program, solved[0]), variables=solved[1])
    capped = memory_caps is not None
    found = made.made.get(capped) if made is not None else None
    if found is None:
        lp, r = _overlap_lp(program, n)
        if memory_caps is not None:
            cap_memory(lp, program, r, memory_caps)
        if made is not None:
            made.made[capped] = (lp, r)
    else:
        lp, r = found
        if memory_caps is not None:
            recap_memory(lp, program, memory_caps)
    status = lp.solve(solver())
    name = pulp.LpStatus.get(status, str(status))
    if name != "Optimal":
        raise SynthesisError(lp_failure(name, dict(program), memory_caps))
    ratios = [max(0.0, float(v.value() or 0.0)) for v in r]
    total = sum(ratios)
    ratios = tuple(v / total for v in ratios)
    _SOLVED.put(known, (ratios, len(lp.variables())))
    return LPResult(ratios=ratios, objective=overlap_cost(program, ratios), variables=len(lp.variables()))


def _overlap_lp(program: Mapping[str, Any], n: int) -> tuple[pulp.LpProblem, list[pulp.LpVariable]]:
    """The LP of :func:`solve_overlapped` without memory caps, and its ratio variables."""
    lp = pulp.LpProblem("hapd_overlap_ratios", pulp.LpMinimize)
    r = [variable(lp, f"r_{d}", lowBound=0) for d in range(n)]
    maxima = _Maxima(lp, r)
    terms: list[Any] = []
    count = 0

    def at_least(*lower: Any) -> Any:
        nonlocal count
        numbers = [b for b in lower if isinstance(b, (int, float))]
        if len(numbers) == len(lower):
            return max(numbers)
        var = variable(lp, f"x_{count}")
        for i, bound in enumerate(lower):
            lp.addConstraint(var >= bound, f"x_{count}_{i}")
        count += 1
        return var

    for p in PASSES:
        chain = _pass_chain(program, p, maxima)
        terms.append(pulp.lpSum(chain[0][0]))
        for k in range(1, len(chain)):
            first, last, inner = chain[k][2]
            terms.append(at_least(pulp.lpSum(chain[k - 1][1]), first))
            terms.append(inner)
            terms.append(at_least(pulp.lpSum(chain[k][0]), last))
        terms.append(pulp.lpSum(chain[-1][1]))
    terms.extend(maxima.of(step["overlap"]["serial"]) for step in program["steps"])
    lp += pulp.lpSum(terms)
    lp += pulp.lpSum(r) == 1, "ratios_sum_to_one"
    return lp, r



def rows_digest(program: Mapping[str, Any]) -> bytes:
    """The digest of what the overlapped LP of ``program`` is made of, its caps aside
    (:func:`_lp_key`; a caller solving one program under several caps makes it once)."""
    return hashlib.sha256(msgpack.packb(
        [int(program["devices"]), PASSES, [step["overlap"] for step in program["steps"]],
         [[list(m["constant"]), list(m["coef"])] for m in memory_rows(program)]], use_bin_type=True)).digest()


def _lp_key(program: Mapping[str, Any], n: int, memory_caps: Sequence[float] | None,
            digest: bytes | None = None) -> bytes:
    """Everything the overlapped LP is made of, in order: the same key, the same LP."""
    rows = digest if digest is not None else rows_digest(program)
    caps = None if memory_caps is None else [float(c) for c in memory_caps]
    return hashlib.sha256(msgpack.packb([n, rows, caps], use_bin_type=True)).digest()


def _pass_chain(program: Mapping[str, Any], p: str, maxima: _Maxima) -> list[list[Any]]:
    """Pass ``p``'s intervals: A's compute, B's compute, and the point's (first, last, inner) communication."""
    chain: list[list[Any]] = [[[], [], None]]
    for step in program["steps"]:
        rows = step["overlap"]
        comms = [maxima.of(c) for c in rows[f"comm_{p}"]]
        if comms:
            inner = 2 * pulp.lpSum(comms) - comms[0] - comms[-1] if len(comms) > 1 else 0.0
            chain.append([[], [], (comms[0], comms[-1], inner)])
        compute = maxima.of(rows[f"comp_{p}"])
        chain[-1][0].append(compute)
        if rows["batch"]:
            chain[-1][1].append(compute)
    return chain


_SOLVED = SolvedLPs()
"""The overlapped LPs solved in this process (:class:`hapd.compiler.lp.SolvedLPs`): the
memory checks of an overlap search pose the same few again and again."""
