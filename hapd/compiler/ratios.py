"""Sharding ratios: the LP over a fixed program, and integer sharding lengths.

For a program, every step costs ``max_d comp_d(r) + max_d comm_d(r)`` where each per
device time is ``constant[d] + coef[d]·r[d]`` (the core's cost rows). The LP minimizes
the sum over steps with one auxiliary variable per distinct row shape (rows that are
positive multiples of each other share it: a 24-layer model has the rows of one layer),
subject to ``Σ r = 1``, ``r ≥ 0`` and per-device memory caps. Times are unbounded
variables (no artificial [0, 1] bound), the constants are kept, and the solver status
is checked.

The memory rows are linear in the ratios, but the runtime splits each dim into integer
lengths (:func:`sharding_lengths`): a device whose ratio is 0.1 holds 0 of 4 experts,
and one whose ratio is 0.4 holds 2. A finished plan's peak (:func:`peak_memory`) is
priced at those lengths (the program's ``memory_split``), and the LP with memory caps
solves again with a device's cap lowered where rounding puts it over its capacity.

**The gradient sync overlaps the backward pass.** The runtime all-reduces replicated
gradients in buckets launched while backward still runs (:class:`hapd.spmd.gradsync.GradSync`),
so a program's time is its steps' serial sum less what of that sync hides behind the
backward's compute: ``serial − η · H``, with ``H`` what the buckets' timeline lets hide
(:mod:`hapd.compiler.sync_timeline`; at most ``min(S, B)``, ``S`` the steps' gradient
sync, ``B`` the backward's share of compute: two thirds of a training op's, the core's
forward-to-backward ratio) and ``η`` the program's ``sync_overlap`` — the smallest
share any device measured hiding (the profile's ``Device.sync_overlap``; 0 where a
device does not give it, so older profiles price serially). The search ranks programs
serially (an upper bound on this); the LP and every estimate credit the overlap. The LP
keeps its epigraph form with ``η·φ`` for ``η`` (:func:`hideable_share`):
``T ≥ serial − η·φ·S`` and ``T ≥ serial − η·φ·B`` are both linear.
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import msgpack
import pulp

from hapd import _core
from hapd.compiler.lp import LPResult, SolvedLPs, cap_memory, lp_failure, memory_rows, row_values, solver, variable
from hapd.compiler.lengths import sharding_lengths
from hapd.compiler.overlap import MadeLPs, is_overlapped, overlap_cost, rows_digest, solve_overlapped
from hapd.compiler.sync_timeline import BucketSizes, SyncedGradient, hideable
from hapd.errors import SynthesisError
from hapd.util import format_bytes


CAP_MARGIN = 1 - 1e-6
"""The share of a device's memory the LP fills where it can: the solver meets its
constraints to a tolerance, and the ratios are normalized after, so a plan that fills
the whole capacity could exceed it by a few kilobytes."""


BACKWARD_SHARE = 2.0 / 3.0
"""The backward pass's share of a training op's compute row (the core prices backward at
twice the forward)."""


def program_cost(program: Mapping[str, Any], ratios: Sequence[float]) -> float:
    """Σ over steps of max_d compute + max_d communication under ``ratios``, less the
    gradient sync hidden behind the backward pass (:func:`hidden_sync`); for a program
    searched with overlap, the two-duplica schedule's cost
    (:func:`hapd.compiler.overlap.overlap_cost`)."""
    if is_overlapped(program):
        return overlap_cost(program, ratios)
    return serial_cost(program, ratios) - hidden_sync(program, ratios)


def serial_cost(program: Mapping[str, Any], ratios: Sequence[float]) -> float:
    """Σ over steps of max_d compute + max_d communication under ``ratios``: every step
    after the one before, nothing overlapped."""
    total = 0.0
    for step in program["steps"]:
        total += max(row_values(step["comp"], ratios), default=0.0)
        total += max(row_values(step["comm"], ratios), default=0.0)
    return total


def sync_overlap(program: Mapping[str, Any]) -> float:
    """η: the share of the gradient sync that hides behind backward compute (the
    program's ``sync_overlap``, set from the profile; 0 when absent)."""
    return min(1.0, max(0.0, float(program.get("sync_overlap") or 0.0)))


def sync_seconds(program: Mapping[str, Any], ratios: Sequence[float]) -> float:
    """``S``: seconds of the gradient all-reduce of replicated parameters, Σ over steps
    of the slowest device's (part of the steps' communication rows)."""
    total = 0.0
    for step in program["steps"]:
        rows = [s["cost"] for s in step.get("sources", ()) if s.get("grad_sync")]
        if rows:
            per_device = [0.0] * len(ratios)
            for row in rows:
                per_device = [a + b for a, b in zip(per_device, row_values(row, ratios))]
            total += max(per_device, default=0.0)
    return total


def backward_seconds(program: Mapping[str, Any], ratios: Sequence[float]) -> float:
    """``B``: the backward pass's compute, :data:`BACKWARD_SHARE` of the steps' compute."""
    return BACKWARD_SHARE * sum(max(row_values(step["comp"], ratios), default=0.0) for step in program["steps"])


def hidden_sync(program: Mapping[str, Any], ratios: Sequence[float]) -> float:
    """Seconds of gradient sync the backward pass hides: ``η`` times what of the sync
    its buckets' timeline lets hide (:func:`hapd.compiler.sync_timeline.hideable`, at
    most ``min(S, B)``)."""
    eta = sync_overlap(program)
    if eta <= 0.0:
        return 0.0
    return eta * hideable_sync(program, ratios)


def hideable_sync(program: Mapping[str, Any], ratios: Sequence[float]) -> float:
    """Seconds of ``program``'s gradient sync its buckets' timeline lets hide behind the
    backward under ``ratios`` (:func:`hapd.compiler.sync_timeline.hideable`), before η."""
    return hideable(backward_steps(program, ratios), synced_gradients(program, ratios), HAPD_BUCKETS)


HAPD_BUCKETS = BucketSizes(rest=_core.GRAD_BUCKET_BYTES)
"""The runtime's gradient buckets (:class:`hapd.spmd.gradsync.GradSync`)."""


def backward_steps(program: Mapping[str, Any], ratios: Sequence[float]) -> list[float]:
    """Each step's backward seconds, forward order: :data:`BACKWARD_SHARE` of its
    slowest device's compute (they sum to :func:`backward_seconds`)."""
    return [BACKWARD_SHARE * max(row_values(step["comp"], ratios), default=0.0) for step in program["steps"]]


def synced_gradients(program: Mapping[str, Any], ratios: Sequence[float],
                     seconds_of: Any = None) -> list[SyncedGradient]:
    """The gradients the sync sums, one per parameter (a parameter read by several
    steps, a tied one, counts its rows of each and is ready after the first): the step
    that first reads it, its seconds under ``ratios`` (the slowest device's rows, or
    ``seconds_of(source)``) and its bytes."""
    found: dict[str, list] = {}
    for index, step in enumerate(program["steps"]):
        for source in step.get("sources", ()):
            if not source.get("grad_sync"):
                continue
            key = str(source.get("target") or source.get("tensor") or f"{index}.{len(found)}")
            seconds = (seconds_of(source) if seconds_of is not None
                       else max(row_values(source["cost"], ratios), default=0.0))
            entry = found.setdefault(key, [index, 0.0, float(source.get("bytes") or 0.0)])
            entry[1] += seconds
    return [SyncedGradient(first_step=i, seconds=s, nbytes=b) for i, s, b in found.values()]


def per_device(program: dict[str, Any], ratios: Sequence[float], which: str) -> list[float]:
    """Per-device sum of the ``comp`` or ``comm`` rows."""
    totals = [0.0] * len(ratios)
    for step in program["steps"]:
        for d, v in enumerate(row_values(step[which], ratios)):
            totals[d] += v
    return totals


def linear_peak_memory(program: dict[str, Any], ratios: Sequence[float]) -> list[float]:
    """Per-device peak bytes of a training step with every shard priced at its device's
    ratio: the larger of the memory rows (:func:`memory_rows`), as the LP sees it."""
    peaks = [0.0] * len(ratios)
    for row in memory_rows(program):
        peaks = [max(p, v) for p, v in zip(peaks, row_values(row, ratios))]
    return peaks


def split_shares(program: dict[str, Any], ratios: Sequence[float]) -> list[list[float]]:
    """Per split class of ``program`` (its ``splits``), the share of the class's dims
    each device holds under ``ratios``: its integer length over the class's units."""
    shares = []
    for split in program["splits"]:
        units = int(split["units"])
        shares.append([length / units for length in sharding_lengths(ratios, units)])
    return shares


def split_bytes_values(
    split: dict[str, Any], shares: Sequence[Sequence[float]], ratios: Sequence[float]
) -> list[float]:
    """Per-device bytes of one ``memory_split`` entry: its replica, plus each shard at
    its class's share (the ratio for a shard of no class), plus the largest of each
    group of shards."""

    def share(cls: int | None, d: int) -> float:
        return ratios[d] if cls is None else shares[cls][d]

    values = []
    for d in range(len(ratios)):
        total = split["replica"] + sum(b * share(cls, d) for cls, b in split["shards"])
        total += sum(max((b * share(cls, d) for cls, b in group), default=0.0) for group in split["largest"])
        values.append(total)
    return values


def peak_memory(program: dict[str, Any], ratios: Sequence[float]) -> list[float]:
    """Per-device peak bytes of a training step under ``ratios``, every split dim priced
    at the integer lengths the runtime splits it into (``memory_split``; a program from
    before it existed: :func:`linear_peak_memory`)."""
    split = program.get("memory_split")
    if split is None:
        return linear_peak_memory(program, ratios)
    shares = split_shares(program, ratios)
    backward = split_bytes_values(split["backward"], shares, ratios)
    update = split_bytes_values(split["update"], shares, ratios)
    return [max(b, u) for b, u in zip(backward, update)]


def part_memory(program: dict[str, Any], ratios: Sequence[float]) -> dict[str, list[float]]:
    """Per-device bytes of each memory part under ``ratios`` (at the integer lengths,
    as :func:`peak_memory`)."""
    split = program.get("memory_split")
    if split is None:
        return {k: row_values(row, ratios) for k, row in program.get("memory_parts", {}).items()}
    shares = split_shares(program, ratios)
    return {k: split_bytes_values(part, shares, ratios) for k, part in split["parts"].items()}


def _row_groups(program: dict[str, Any]) -> tuple[dict[tuple, tuple[list, list, float]], dict[str, float]]:
    """Group rows that are positive multiples of each other (compute rows apart from
    communication rows: the backward's share of compute hides gradient sync). Returns
    ``(which, *normalized row)`` -> (normalized constant, normalized coef, summed scale)
    and, per ``which``, the constant part of rows without a ratio term."""
    groups: dict[tuple, list] = {}
    fixed = {"comp": 0.0, "comm": 0.0}
    seen: dict[tuple, tuple[tuple | None, float]] = {}  # a row as given → (its group key, its scale)
    for step in program["steps"]:
        for which in ("comp", "comm"):
            row = step[which]
            raw = (which, tuple(row["constant"]), tuple(row["coef"]))
            found = seen.get(raw)
            if found is None:  # a model's repeated blocks give the same rows again and again: each normalized once
                const, coef = raw[1], raw[2]
                if not any(coef):
                    found = (None, max(const, default=0.0))
                else:
                    scale = max(max(map(abs, const)), max(map(abs, coef)))
                    nc = [v / scale for v in const]
                    nk = [v / scale for v in coef]
                    key = (which, *[round(v, 9) for v in nc + nk])
                    if key not in groups:
                        groups[key] = [nc, nk, 0.0]
                    found = (key, scale)
                seen[raw] = found
            key, scale = found
            if key is None:
                fixed[which] += scale
            else:
                groups[key][2] += scale
    return {k: (v[0], v[1], v[2]) for k, v in groups.items()}, fixed


def hideable_share(program: Mapping[str, Any]) -> float:
    """φ: what of ``min(S, B)`` the sync's buckets let hide on the backward's timeline
    (:func:`hapd.compiler.sync_timeline.hideable`), at speed-proportional ratios (each
    device's share inverse to its compute rows' coefficients). The LP prices the hidden
    sync as ``η·φ·min(S, B)``, linear in the ratios, where the timeline is not: φ
    depends on the order of the steps and where the gradients are first read, much less
    on the ratios. Every estimate, the LP's objective included, prices the timeline at
    the ratios found."""
    n = int(program["devices"])
    if n <= 1 or not sync_overlap(program):
        return 1.0
    work = [sum(step["comp"]["coef"][d] for step in program["steps"]) for d in range(n)]
    if any(w <= 0.0 for w in work):
        ratios = [1.0 / n] * n
    else:
        speed = [1.0 / w for w in work]
        ratios = [v / sum(speed) for v in speed]
    bound = min(sync_seconds(program, ratios), backward_seconds(program, ratios))
    if bound <= 0.0:
        return 1.0
    return min(1.0, hideable_sync(program, ratios) / bound)


def _constant_sync(program: Mapping[str, Any]) -> float | None:
    """``S`` when no gradient sync row depends on the ratios (all-reduces of replicated
    gradients never do), else None: the LP then prices the sync serially."""
    for step in program["steps"]:
        for source in step.get("sources", ()):
            if source.get("grad_sync") and any(source["cost"]["coef"]):
                return None
    return sync_seconds(program, [0.0] * int(program["devices"]))


LENGTH_ROUNDS = 8
"""Most times the LP with memory caps solves again because rounding the ratios to
integer lengths put a device over its capacity."""


def solve_ratios(program: dict[str, Any], memory_caps: Sequence[float] | None = None) -> LPResult:
    """Optimal sharding ratios for ``program`` (the core's output). With memory caps the
    LP first leaves :data:`CAP_MARGIN` of each device free, and fills it whole only
    when the program fits no other way; either way the ratios fit at their integer
    lengths (:func:`_solve_fitting`)."""
    if memory_caps is None:
        return _solve(program, None)
    rows = _Rows(program)
    try:
        return _solve_fitting(program, [cap * CAP_MARGIN for cap in memory_caps], memory_caps, rows)
    except SynthesisError:
        return _solve_fitting(program, memory_caps, memory_caps, rows)


class _Rows:
    """A program's grouped rows (:func:`_row_groups`), made on first use and kept for
    the LPs solved again under other caps."""

    def __init__(self, program: dict[str, Any]):
        self.program = program
        self._groups: tuple[dict[tuple, tuple[list, list, float]], dict[str, float]] | None = None
        self._digest: bytes | None = None
        self.overlap_lps = MadeLPs()
        """An overlapped program's LPs made so far (:class:`hapd.compiler.overlap.MadeLPs`)."""

    def groups(self) -> tuple[dict[tuple, tuple[list, list, float]], dict[str, float]]:
        if self._groups is None:
            self._groups = _row_groups(self.program)
        return self._groups

    def overlap_digest(self) -> bytes:
        """An overlapped program's :func:`hapd.compiler.overlap.rows_digest`."""
        if self._digest is None:
            self._digest = rows_digest(self.program)
        return self._digest


def _solve_fitting(program: dict[str, Any], lp_caps: Sequence[float], memory_caps: Sequence[float],
                   rows: _Rows | None = None) -> LPResult:
    """The LP under ``lp_caps`` whose ratios' peak at integer lengths (:func:`peak_memory`)
    fits ``memory_caps``. The LP prices each shard at its device's ratio; where rounding
    gives a device more (a whole expert for 0.4 of 4), the LP solves again with that
    device's cap lowered by the excess, at most :data:`LENGTH_ROUNDS` times.
    :class:`SynthesisError` when the ratios still do not fit."""
    caps = list(lp_caps)
    for _ in range(LENGTH_ROUNDS):
        result = _solve(program, caps, rows)
        over = [p - cap for p, cap in zip(peak_memory(program, result.ratios), memory_caps)]
        if all(o <= 0 for o in over):
            return result
        caps = [cap - o if o > 0 else cap for cap, o in zip(caps, over)]
    d = max(range(len(over)), key=lambda k: over[k])
    raise SynthesisError(
        f"the sharding ratios do not fit in device memory at integer lengths: device {d} is "
        f"{format_bytes(over[d])} over its {format_bytes(memory_caps[d])} after {LENGTH_ROUNDS} LP rounds"
    )


def _solve(program: dict[str, Any], memory_caps: Sequence[float] | None, rows: _Rows | None = None) -> LPResult:
    if is_overlapped(program):  # its own LP: hapd.compiler.overlap
        if rows is None:
            return solve_overlapped(program, memory_caps)
        return solve_overlapped(program, memory_caps, rows.overlap_digest(), rows.overlap_lps)
    n = int(program["devices"])
    if n == 1:  # the one device holds everything: no LP to solve (nor a CBC process to start)
        return _one_device(program, memory_caps)
    groups, fixed = (rows or _Rows(program)).groups()
    eta, sync = sync_overlap(program) * hideable_share(program), _constant_sync(program)
    known = _lp_key(n, groups, fixed, eta, sync, program, memory_caps)
    solved = _SOLVED.get(known)
    if solved is not None:
        return LPResult(ratios=solved[0], objective=program_cost(program, solved[0]), variables=solved[1])
    lp = pulp.LpProblem("hapd_sharding_ratios", pulp.LpMinimize)
    r = [variable(lp, f"r_{d}", lowBound=0) for d in range(n)]
    t = {key: variable(lp, f"t_{i}") for i, key in enumerate(groups)}
    serial = pulp.lpSum(scale * t[key] for key, (_, _, scale) in groups.items()) + sum(fixed.values())
    if eta > 0 and sync:  # T ≥ serial − η·min(S, B), as two linear rows
        total = variable(lp, "total")
        compute = pulp.lpSum(scale * t[key] for key, (_, _, scale) in groups.items() if key[0] == "comp")
        lp += total
        lp += total >= serial - eta * sync, "sync_hidden_whole"
        lp += total >= serial - eta * BACKWARD_SHARE * (compute + fixed["comp"]), "sync_hidden_by_backward"
    else:
        lp += serial
    lp += pulp.lpSum(r) == 1, "ratios_sum_to_one"
    for i, (key, (const, coef, _)) in enumerate(groups.items()):
        for d in range(n):
            lp += t[key] >= const[d] + coef[d] * r[d], f"max_{i}_{d}"
    if memory_caps is not None:
        cap_memory(lp, program, r, memory_caps)
    status = lp.solve(solver())
    name = pulp.LpStatus.get(status, str(status))
    if name != "Optimal":
        raise SynthesisError(lp_failure(name, program, memory_caps))
    ratios = tuple(max(0.0, float(v.value() or 0.0)) for v in r)
    total = sum(ratios)
    ratios = tuple(v / total for v in ratios)
    extra = 1 if eta > 0 and sync else 0
    _SOLVED.put(known, (ratios, len(r) + len(t) + extra))
    return LPResult(ratios=ratios, objective=program_cost(program, ratios), variables=len(r) + len(t) + extra)


_SOLVED = SolvedLPs()
"""The plain LPs solved in this process (:class:`hapd.compiler.lp.SolvedLPs`)."""


def _lp_key(n: int, groups: Mapping[tuple, tuple[list, list, float]], fixed: Mapping[str, float], eta: float,
            sync: float | None, program: Mapping[str, Any], memory_caps: Sequence[float] | None) -> bytes:
    """Everything :func:`_solve`'s LP is made of, in the order it is made (CBC's answer
    among equally good ratios may depend on it), hashed: equal keys are the same LP."""
    doc = [n, [[which[0], list(const), list(coef), scale] for which, (const, coef, scale) in groups.items()],
           [[k, fixed[k]] for k in sorted(fixed)], eta, sync, BACKWARD_SHARE,
           None if memory_caps is None else [list(memory_caps),
                                              [[list(m["constant"]), list(m["coef"])] for m in memory_rows(program)]]]
    return hashlib.sha256(msgpack.packb(doc, use_bin_type=True)).digest()


def _one_device(program: dict[str, Any], memory_caps: Sequence[float] | None) -> LPResult:
    """The LP's answer for one device without solving it: ratio 1, and infeasible
    (:class:`SynthesisError`, as the LP words it) when a memory row at ratio 1 passes
    the device's cap."""
    if memory_caps is not None:
        for mem in memory_rows(program):
            if mem["constant"][0] + mem["coef"][0] > memory_caps[0]:
                raise SynthesisError(lp_failure("Infeasible", program, memory_caps))
    return LPResult(ratios=(1.0,), objective=program_cost(program, (1.0,)), variables=1)


def least_overshoot(program: dict[str, Any], memory_caps: Sequence[float]) -> tuple[float, ...]:
    """The sharding ratios under which ``program``'s worst memory shortfall (peak minus
    capacity, over devices and memory rows) is smallest: where a program that fits
    nowhere comes closest, for the error that says by how much."""
    n = int(program["devices"])
    lp = pulp.LpProblem("hapd_least_overshoot", pulp.LpMinimize)
    r = [variable(lp, f"r_{d}", lowBound=0) for d in range(n)]
    worst = variable(lp, "worst")
    lp += worst
    lp += pulp.lpSum(r) == 1, "ratios_sum_to_one"
    for k, mem in enumerate(memory_rows(program)):
        for d in range(n):
            lp += mem["constant"][d] + mem["coef"][d] * r[d] - memory_caps[d] <= worst, f"short_{k}_{d}"
    status = lp.solve(solver())
    if pulp.LpStatus.get(status) != "Optimal":
        return tuple(1.0 / n for _ in range(n))
    ratios = [max(0.0, float(v.value() or 0.0)) for v in r]
    total = sum(ratios) or 1.0
    return tuple(v / total for v in ratios)
