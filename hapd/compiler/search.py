"""The SPMD search: graph + profile → the cheapest program and its sharding ratios.

Alternates the core's search with the sharding-ratio LP (HAP §6, without its defects):
start from FLOP/s-proportional ratios, search the cheapest program under the current
ratios, solve the LP for that program, and repeat while the cost strictly improves.
Each program is kept with the ratios it was optimized for. With memory caps, a program
that does not fit is searched again with memory priced (:data:`MEMORY_PRICES`), and
activation recomputation is tried where memory binds. The data-parallel baselines
(DP-EV: even split, DP-CP: FLOP/s-proportional split) are priced as DDP runs them
(:func:`ddp_cost`), from the per-device speeds and collective costs of the same profile;
the data-parallel program and an expert-parallel one are candidates of their own, and
a search that evidently lost the better programs runs again with a wider front
(:func:`search_spmd`, what a compile runs). :func:`search_program` is how the pipeline
search prices a stage's group.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import msgpack

from hapd import _core
from hapd.ir.lower import GraphIR
from hapd.compiler.lp import row_values
from hapd.compiler.options import MAX_FRONT_WIDTH, CompileOptions
from hapd.compiler.overlap import DUPLICAS, is_overlapped, with_duplica_memory
from hapd.compiler.ratios import (
    BACKWARD_SHARE,
    least_overshoot,
    peak_memory,
    HAPD_BUCKETS,
    program_cost,
    solve_ratios,
    sync_overlap,
    synced_gradients,
)
from hapd.compiler.sync_timeline import BucketSizes, schedule
from hapd.compiler.recompute import graph_blocks, memory_floor
from hapd.errors import GraphError, SynthesisError
from hapd.profile.schema import Link, Profile
from hapd.util import format_bytes


_PASSES: contextvars.ContextVar[list[dict] | None] = contextvars.ContextVar("hapd_search_passes", default=None)
"""The search passes :func:`search_spmd` records (None outside one)."""


def _note_pass(what: str, why: str, seconds: float, cost: float | None = None, *, brief: str) -> dict | None:
    """Record one search pass of the running :func:`search_spmd` (a map in the plan's
    ``stats["passes"]``: what ran, why, ``brief``ly why, its seconds and the cost it
    found); None outside one."""
    passes = _PASSES.get()
    if passes is None:
        return None
    entry = {"what": what, "why": why, "brief": brief, "seconds": float(seconds),
             "cost": None if cost is None else float(cost), "kept": False}
    passes.append(entry)
    return entry


_SEARCHED: contextvars.ContextVar[dict[tuple, bytes] | None] = contextvars.ContextVar("hapd_searched", default=None)
"""The core's programs :func:`search_spmd` has had so far, by everything their search
read (None outside one): :func:`synthesize`."""


_STOPS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("hapd_search_stops", default=None)
"""Why each core search :func:`search_spmd` ran stopped, in order (None outside one):
:func:`_exhaustive`."""


def synthesize(
    graph: bytes,
    profile: Profile,
    ratios: list[float],
    options: CompileOptions,
    mode: str = "auto",
    memory_price: Sequence[float] | None = None,
    recompute: Sequence[str] = (),
) -> dict:
    """One search of the core under fixed ratios (with memory priced at
    ``memory_price`` seconds per byte on each device, when given, and the blocks
    ``recompute`` recomputed); the program as a dict (a fresh one each call: callers
    change it)."""
    raw = _core_search(graph, profile.core_bytes(), [float(r) for r in ratios], options.core(mode, memory_price, recompute))
    program = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    stops = _STOPS.get()
    if stops is not None:
        stops.append(str(program["stats"]["stop_reason"]))
    if is_overlapped(program):
        return with_duplica_memory(program)
    program["sync_overlap"] = profile_sync_overlap(profile)
    return program


def _core_search(graph: bytes, profile: bytes, ratios: list[float], core: dict[str, Any]) -> bytes:
    """The core's search (its program as msgpack), or within :func:`search_spmd` the
    program an identical search already gave: the search is deterministic without a
    time limit, and a compile asks for some twice (the recomputation probe's search with
    every block recomputed opens the memory-price ladder's first search too: Llama-7B's
    one duplica on paper-8, a second of the core each)."""
    memo = _SEARCHED.get()
    if memo is None or core.get("max_seconds") is not None:  # a time limit makes the answer depend on the clock
        return _core.synthesize(graph, profile, ratios, core)
    # bytes keep their hash once computed, and the graph is the same object every call
    key = (graph, profile, tuple(ratios), msgpack.packb(core, use_bin_type=True))
    raw = memo.get(key)
    if raw is None:
        raw = memo[key] = _core.synthesize(graph, profile, ratios, core)
    return raw


def profile_sync_overlap(profile: Profile) -> float:
    """η of a program for ``profile`` (:func:`hapd.compiler.ratios.hidden_sync`): the
    smallest share of a gradient sum any device hides behind its backward (every rank
    waits for the same sums), 0 when a device does not give it."""
    shares = [d.sync_overlap for d in profile.devices]
    if not shares or any(s is None for s in shares):
        return 0.0
    return min(float(s) for s in shares if s is not None)


@dataclass(frozen=True, kw_only=True)
class Searched:
    """The outcome of the search ⇄ LP rounds."""

    program: dict
    """The cheapest program found."""
    ratios: list[float]
    """The sharding ratios it was optimized for."""
    cost: float
    """Its cost under those ratios (the LP's objective, or the cost model's with fixed ratios)."""
    rounds: int
    """Search ⇄ LP rounds run."""
    expanded: int
    """States expanded over all rounds."""
    history: list[float]
    """The LP's objective after each round."""
    priced: bool = False
    """Whether the program fits only as searched with memory priced (and ZeRO allowed)."""


@dataclass(frozen=True, kw_only=True)
class Baselines:
    """The data-parallel baselines, priced as DDP runs them (:func:`ddp_cost`)."""

    dp_ev: float
    """DDP's seconds per iteration under an even split."""
    dp_cp: float
    """DDP's seconds per iteration under the FLOP/s-proportional split."""
    dp_program: dict
    """The data-parallel program searched under the FLOP/s-proportional split (what
    hapd itself runs when it chooses data parallelism: ops without a batch-split rule
    run replicated in it)."""
    flops: list[float]
    """The FLOP/s-proportional split."""
    dp_cp_own: float = 0.0
    """DP-CP's program with hapd's own gradient sync (its buckets, summed in two levels
    across hosts): the price of DDP's program in the search's space. DDP's price itself
    can be lower, its larger buckets paying fewer latencies over a flat all-reduce."""


def _search_rounds(
    data: bytes, profile: Profile, options: CompileOptions, caps: list[float] | None, recompute: Sequence[str] = ()
) -> Searched:
    """The search ⇄ LP rounds (with the blocks ``recompute`` recomputed); with memory
    ``caps``, searched again with memory priced ever higher (and ZeRO-style parameters
    allowed) until a program fits (:data:`MEMORY_PRICES`). :class:`SynthesisError`
    naming the device that falls shortest when none does."""
    if caps is None:
        return _rounds(data, profile, options, None, None, recompute)
    tried: list[dict] = []
    shortfalls: list[float] = []  # of each program searched with memory priced
    scale_cost: float | None = None
    floor = _floor(data, DUPLICAS if options.overlap else 1) if not recompute else 0.0
    for zero, scale in _price_schedule(options):
        attempt = replace(options, zero=zero)
        price = None if scale == 0 else [scale * (scale_cost or 0.0) / cap for cap in caps]
        start = time.perf_counter()
        try:
            searched = _rounds(data, profile, attempt, caps, price, recompute)
            if tried:
                _note_pass(f"search with memory priced at {scale:g}× (ZeRO-style parameters allowed)"
                           + (f", {len(recompute)} blocks recomputed" if recompute else ""),
                           _unfit_why(tried[-1], caps, profile) + "; this one fits",
                           time.perf_counter() - start, searched.cost, brief="memory priced: did not fit")
            return replace(searched, priced=bool(tried))
        except _DoesNotFit as exc:
            if tried:
                _note_pass(f"search with memory priced at {scale:g}× (ZeRO-style parameters allowed)"
                           + (f", {len(recompute)} blocks recomputed" if recompute else ""),
                           _unfit_why(tried[-1], caps, profile) + "; this one does not fit either",
                           time.perf_counter() - start, brief="memory priced: did not fit")
            tried.append(exc.program)
            if scale > 0:
                shortfalls.append(_shortfall(exc.program, caps))
            if shortfalls and shortfalls[-1] <= 0:
                # it fits at some ratios (the least overshoot's), but the LP's cheapest ratios
                # never fit at integer lengths: a higher price moves the program, not the rounding
                _note_pass("searches with memory priced higher (ZeRO-style parameters allowed)"
                           + (f", {len(recompute)} blocks recomputed" if recompute else ""),
                           f"stopped: at {scale:g}× the program fits device memory only at ratios the "
                           "sharding-ratio LP does not choose (its ratios do not fit at integer lengths)", 0.0,
                           brief="memory priced: stopped, rounding binds")
                break
            if len(shortfalls) >= 2 and shortfalls[-1] >= shortfalls[-2] * (1 - STALLED):
                _note_pass("searches with memory priced higher (ZeRO-style parameters allowed)"
                           + (f", {len(recompute)} blocks recomputed" if recompute else ""),
                           f"stopped: at {scale:g}× the program falls {format_bytes(shortfalls[-1])} short of a "
                           f"device's memory, less than {STALLED:.0%} closer than at the price before", 0.0,
                           brief="memory priced: stopped, no closer")
                break
            if scale_cost is None:
                scale_cost = max(program_cost(exc.program, profile.flops_ratios()), 1e-9)
            if len(tried) == 1 and floor > sum(caps):
                _note_pass("searches with memory priced (ZeRO-style parameters allowed)",
                           f"skipped: every program holds at least {format_bytes(floor)} over all devices while its "
                           f"backward runs (parameters with Adam's moments and kept activations, each once), the "
                           f"devices have {format_bytes(sum(caps))}", 0.0, brief="memory priced: skipped, cannot fit")
                break
    raise SynthesisError(_no_fit_message(tried, caps, profile))


STALLED = 0.05
"""A search with memory priced higher whose program comes less than this fraction of its
shortfall closer to fitting a device's memory than the one at the price before ends the
ladder: the search has stopped moving toward a fit, and four times the price will not
close the rest (Llama-7B's one duplica on paper-64: passes of 6-7 s each at 4×, 16×
and 64×, each 3.96 GiB short of a 32 GiB device's memory, none fitting)."""


def _shortfall(program: dict, caps: list[float]) -> float:
    """The most bytes ``program`` needs beyond a device's memory, under the ratios
    that make that the least (:func:`hapd.compiler.ratios.least_overshoot`)."""
    peaks = peak_memory(program, least_overshoot(program, caps))
    return max(p - c for p, c in zip(peaks, caps))


def _floor(data: bytes, duplicas: int) -> float:
    """:func:`hapd.compiler.recompute.memory_floor` of graph ``data`` (0 when it is no
    graph: the core's search says what is wrong)."""
    try:
        return memory_floor(GraphIR(data).doc, duplicas)
    except (GraphError, KeyError, TypeError, ValueError, AttributeError):
        return 0.0


def _unfit_why(program: dict, caps: list[float], profile: Profile) -> str:
    """Why the search ran again: the previous program did not fit, on which device by how much."""
    ratios = least_overshoot(program, caps)
    peaks = peak_memory(program, ratios)
    d = max(range(len(caps)), key=lambda k: peaks[k] - caps[k])
    return (f"the previous search's program did not fit device memory (device {d} needs {format_bytes(peaks[d])}, "
            f"has {format_bytes(caps[d])})")


MEMORY_PRICES = (0.0, 1.0, 4.0, 16.0, 64.0, 256.0)
"""Memory prices a compile with memory caps tries in turn, each in units of the
unpriced program's seconds per device capacity: at price 1 filling a device costs as
much time as the whole program."""


def _price_schedule(options: CompileOptions) -> list[tuple[bool, float]]:
    """(zero, price scale) of each attempt: the options' own ZeRO setting unpriced, then
    ZeRO-style parameters allowed at every price."""
    return [(options.zero, MEMORY_PRICES[0])] + [(True, p) for p in MEMORY_PRICES[1:]]


class _DoesNotFit(Exception):
    """The sharding-ratio LP found no ratios under which ``program`` fits."""

    def __init__(self, program: dict):
        super().__init__("the program does not fit in device memory")
        self.program = program


def _rounds(
    data: bytes,
    profile: Profile,
    options: CompileOptions,
    caps: list[float] | None,
    price: list[float] | None,
    recompute: Sequence[str] = (),
    weigh: Callable[[dict], dict] | None = None,
) -> Searched:
    """Alternate the search and the ratio LP while the cost strictly improves
    (one search only when ``options.ratios`` fixes the ratios); with ``weigh``, each
    program the core returns is priced as the program it stands for (see
    :func:`search_program`)."""
    ratios = list(options.ratios) if options.ratios is not None else profile.flops_ratios()
    rounds, expanded, history = 0, 0, []
    best: tuple[dict, list[float], float] | None = None
    while rounds < options.max_rounds:
        rounds += 1
        program = synthesize(data, profile, ratios, options, options.mode, price, recompute)
        if weigh is not None:
            program = weigh(program)
        expanded += program["stats"]["expanded"]
        if options.ratios is not None:
            if caps is not None and not _fits(program, ratios, caps):
                raise _DoesNotFit(program)
            best = (program, ratios, program_cost(program, ratios))
            break
        try:
            lp = solve_ratios(program, caps)
        except SynthesisError:
            if best is None and caps is not None:
                raise _DoesNotFit(program) from None
            if best is None:
                raise
            break  # this round's program does not fit; the last one that did is kept
        cost = lp.objective
        history.append(cost)
        if best is not None and cost >= best[2] * (1 - 1e-9):
            break
        best = (program, list(lp.ratios), cost)
        if list(lp.ratios) == ratios:
            break  # the next round would search these ratios again: the same program, the same LP
        ratios = list(lp.ratios)
    assert best is not None
    program, ratios, cost = best
    return Searched(program=program, ratios=ratios, cost=cost, rounds=rounds, expanded=expanded, history=history)


def _search_with_recompute(data: bytes, profile: Profile, options: CompileOptions, caps: list[float] | None) -> Searched:
    """:func:`_search_rounds` with activation recomputation as ``options.recompute``
    says: never, of every block, or (``"auto"``) only when memory binds — no program
    fits without it, or one fits only with memory priced or with ratios the memory caps
    squeeze — and then the cheapest of the program without it and the programs with
    the fewest blocks recomputed that fit unpriced (:func:`_fewest_recomputed`)."""
    try:
        doc = GraphIR(data).doc if options.recompute != "never" else {}
        blocks = [b.label for b in graph_blocks(doc)] if doc else []
    except (GraphError, KeyError, TypeError, AttributeError):  # not a graph: the core's search says what is wrong
        doc, blocks = {}, []
    if not blocks:
        return _search_rounds(data, profile, options, caps)
    if options.recompute == "always":
        return _search_rounds(data, profile, options, caps, blocks)
    if caps is None or not doc.get("saved_traced"):  # memory is free, or not modelled
        return _search_rounds(data, profile, options, caps)
    plain, failure = (None, None) if _cannot_fit_whole(doc, options, caps) else _plain_search(data, profile, options, caps)
    if plain is not None and not _memory_binds(plain, options, caps):
        return plain
    start = time.perf_counter()
    candidates = _fewest_recomputed(data, profile, options, caps, blocks)
    fewest = min((len(c.program.get("recompute") or ()) for c in candidates), default=None)
    _note_pass(f"searches with activation recomputation ({len(blocks)} blocks, bisected for the fewest that fit)",
               ("no program fit without recomputation" if plain is None else
                "memory binds: the program without recomputation fits only with memory priced or with ratios the "
                "memory caps squeeze") + (f"; the fewest that fit: {fewest} of them" if fewest is not None else
                                          "; none fits unpriced"),
               time.perf_counter() - start,
               min((program_cost(c.program, c.ratios) for c in candidates), default=None),
               brief="recomputation: memory binds")
    if plain is not None:
        candidates.append(plain)
    if not candidates:  # recomputing every block still needs memory priced, if it fits at all
        try:
            candidates.append(_search_rounds(data, profile, options, caps, blocks))
        except SynthesisError:
            if failure is None:  # skipped above: its search says by how much the closest program falls short
                plain, failure = _plain_search(data, profile, options, caps)
                if plain is not None:  # the floor is a lower bound: never, but a program that fits is the answer
                    return plain
            raise SynthesisError(f"{failure} (also with the activations of all {len(blocks)} blocks recomputed)") from None
    return min(candidates, key=lambda c: program_cost(c.program, c.ratios))


def _plain_search(data: bytes, profile: Profile, options: CompileOptions,
                  caps: list[float]) -> tuple[Searched, None] | tuple[None, SynthesisError]:
    """:func:`_search_rounds` without recomputation: its program, or why none fits."""
    try:
        return _search_rounds(data, profile, options, caps), None
    except SynthesisError as exc:
        return None, exc


def _cannot_fit_whole(doc: Mapping[str, Any], options: CompileOptions, caps: list[float]) -> bool:
    """Whether no program of the graph ``doc`` fits ``caps`` without recomputation, at
    any memory price: the bytes every program holds while its backward runs
    (:func:`hapd.compiler.recompute.memory_floor`) pass what the devices have together.
    Then the search without recomputation is skipped (noted as a pass): its memory-price
    ladder would stop there after one search of the core (Llama-7B at batch 4 on
    paper-8: about a second of its overlap duplica's compile)."""
    floor = memory_floor(doc, DUPLICAS if options.overlap else 1)
    if floor <= sum(caps):
        return False
    _note_pass("search without recomputation",
               f"skipped: every program holds at least {format_bytes(floor)} over all devices while its backward runs "
               f"without recomputation (parameters with Adam's moments and kept activations, each once), the devices "
               f"have {format_bytes(sum(caps))}", 0.0, brief="no recomputation: skipped, cannot fit")
    return True


def _memory_binds(searched: Searched, options: CompileOptions, caps: Sequence[float]) -> bool:
    """Whether memory constrained ``searched``: it fits only as searched with memory
    priced, or the ratios without memory caps would be cheaper and do not fit (cheaper
    ratios that fit are the LP solver's tolerance, not memory: a 661 KiB program on
    16 GiB devices was searched again with recomputation)."""
    if searched.priced:
        return True
    if options.ratios is not None:
        return False
    free = solve_ratios(searched.program, None)
    cheaper = free.objective < program_cost(searched.program, searched.ratios) * (1 - 1e-6)
    return cheaper and not _fits(searched.program, list(free.ratios), caps)


def _fewest_recomputed(
    data: bytes, profile: Profile, options: CompileOptions, caps: list[float], blocks: Sequence[str]
) -> list[Searched]:
    """Unpriced programs with the first ``k`` of ``blocks`` (the most memory first)
    recomputed that fit: a probe of one search ⇄ LP round with all of them, then
    bisection for the fewest that fit, whose program gets every round. Every program
    found that fits (none when recomputing every block does not fit unpriced)."""
    probe = replace(options, max_rounds=1)

    def attempt(k: int, attempt_options: CompileOptions) -> Searched | None:
        try:
            return _rounds(data, profile, attempt_options, caps, None, tuple(blocks[:k]))
        except _DoesNotFit:
            return None

    found = attempt(len(blocks), probe)
    if found is None:
        return []
    fitting = [found]
    lo, hi = 0, len(blocks)  # fewer than lo+1 blocks: not known to fit; hi blocks fit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        found = attempt(mid, probe)
        if found is None:
            lo = mid
        else:
            hi = mid
            fitting.append(found)
    if options.max_rounds > 1:
        fitting.extend(f for f in [attempt(hi, options)] if f is not None)
    return fitting


def _fits(program: dict, ratios: Sequence[float], caps: Sequence[float]) -> bool:
    """Whether ``program``'s peak under ``ratios`` fits every device's memory."""
    return all(p <= c for p, c in zip(peak_memory(program, ratios), caps))


def _no_fit_message(programs: list[dict], caps: list[float], profile: Profile) -> str:
    """Why nothing fits: of the programs tried, the one that falls shortest under the
    ratios that minimize its worst shortfall, with the device that lacks the most."""
    best: tuple[float, int, float, dict] | None = None
    for program in programs:
        ratios = least_overshoot(program, caps)
        peaks = peak_memory(program, ratios)
        d = max(range(len(caps)), key=lambda k: peaks[k] - caps[k])
        if best is None or peaks[d] - caps[d] < best[0]:
            best = (peaks[d] - caps[d], d, peaks[d], program)
    assert best is not None
    short, d, peak, _ = best
    device = profile.devices[d]
    return (
        f"the model does not fit in device memory: device {d} ({device.model} on {device.host}) has "
        f"{format_bytes(caps[d])} and needs {format_bytes(peak)}, {format_bytes(short)} short, in the best of "
        f"{len(programs)} programs tried (data parallel, tensor/expert parallel and ZeRO-style parameters); "
        f"use a smaller batch, more devices, or devices with more memory"
    )


def flat_all_reduce(profile: Profile) -> Link | None:
    """The profile's all-reduce over every rank (its ``inter`` link when the ranks span
    hosts, else ``intra``): what DDP's flat ring pays per bucket; None when the profile
    does not give one."""
    links = profile.collectives.get("all_reduce") or {}
    hosts = {d.host for d in profile.devices}
    return links.get("inter") if len(hosts) > 1 else links.get("intra") or links.get("inter")


def _baselines(data: bytes, profile: Profile, options: CompileOptions) -> Baselines:
    """DDP's time per iteration (:func:`ddp_cost`) under the even (DP-EV) and the
    FLOP/s-proportional (DP-CP) splits, read off the data-parallel program's rows."""
    even = [1.0 / profile.world] * profile.world
    flops = profile.flops_ratios()
    dp_program = synthesize(data, profile, flops, options, "data_parallel")
    duplicas = DUPLICAS if options.overlap else 1
    return Baselines(
        dp_ev=ddp_cost(dp_program, even, duplicas, flat_all_reduce(profile)),
        dp_cp=ddp_cost(dp_program, flops, duplicas, flat_all_reduce(profile)),
        dp_program=dp_program,
        flops=flops,
        dp_cp_own=ddp_cost(dp_program, flops, duplicas, buckets=HAPD_BUCKETS),
    )


def ddp_cost(program: Mapping[str, Any], ratios: Sequence[float], duplicas: int = 1,
             all_reduce: Link | None = None, buckets: BucketSizes | None = None) -> float:
    """Seconds per iteration of the step as DDP runs it with the batch split by
    ``ratios``, priced from the rows of a data-parallel ``program`` of ``1/duplicas`` of
    the batch (an overlapped compile's graph is one duplica's; DDP runs the whole batch:
    the work of every op that reads it ``duplicas`` times over, the rest once).

    DDP runs the whole model on every rank on its share of the batch: **every op that
    reads the batch** — opaque ops and ops hapd's rules cannot batch-split included —
    does fraction ``r[d]`` of its forward and backward FLOPs on device ``d``, and needs
    no collective; an op that reads only parameters and constants runs whole on every
    rank. The only communication is the gradient all-reduce of every trainable
    parameter (each parameter's rows as the core prices them), overlapping the backward
    pass as far as DDP's own buckets (:data:`DDP_BUCKETS`) let it on the backward's
    timeline (:mod:`hapd.compiler.sync_timeline`), scaled by the devices' measured
    ``sync_overlap`` as hapd's own sync is (:func:`hapd.compiler.ratios.hidden_sync`).
    With ``all_reduce`` (the profile's all-reduce over every rank, the link DDP's flat
    ring crosses) each bucket is priced as that collective; without, each gradient at
    its rows (hapd's own sync, two levels across hosts). ``buckets`` replaces DDP's (with
    hapd's, :data:`hapd.compiler.ratios.HAPD_BUCKETS`, and no ``all_reduce``: DDP's
    program as hapd would run it). As in the cost
    model, each op costs its slowest device's time and the iteration is the sum over
    ops plus the all-reduce not hidden. A step's full work on device ``d`` is ``constant[d] + coef[d]`` of its
    compute row (a replicated step has only the constant, a sharded one only the
    coefficient), so the price does not depend on which rules the program chose.
    """
    batch = batch_tensors(program)
    steps = [ddp_step_seconds(step, batch, ratios, duplicas) for step in program["steps"]]
    backward = [BACKWARD_SHARE * s for s in steps]
    packed = DDP_BUCKETS if buckets is None else buckets
    if all_reduce is None:  # each gradient's rows as the core prices hapd's sync
        sync = schedule(backward, synced_gradients(program, ratios), packed)
    else:  # DDP's flat all-reduce over every rank: a latency per bucket, the bytes at its bandwidth
        grads = synced_gradients(program, ratios, seconds_of=lambda source: float(source.get("bytes") or 0.0)
                                 / all_reduce.beta)
        sync = schedule(backward, grads, packed, latency=all_reduce.alpha)
    return sum(steps) + sync.total - sync_overlap(program) * sync.hideable


DDP_BUCKETS = BucketSizes(first=1024.0 * 1024, rest=25.0 * 1024 * 1024)
"""DDP's gradient buckets as it packs them by default: the first of 1 MiB (torch's
``_DEFAULT_FIRST_BUCKET_BYTES``), so that a sum starts early, the others of
``bucket_cap_mb`` = 25 MiB. A model of a few tens of MiB fills one or two: most of
its sync starts when backward ends."""


def loss_collectives(program: Mapping[str, Any], ratios: Sequence[float]) -> float:
    """Seconds of the collectives a data-parallel ``program`` runs beyond the gradient
    sync, Σ over steps of the slowest device's: what the single-device loss needs from
    the whole batch (a router's expert counts and probabilities, summed over every
    token, in a mixture-of-experts auxiliary loss). DDP computes such a loss on each
    rank's own tokens (another loss), so :func:`ddp_cost` leaves them out, and no exact
    program can match that price. Only a step that reads a partial sum (a tensor the
    program holds as ``Reduce``: a sum over the whole batch) counts: an all-gather of a
    split tensor (T5's position buckets) is a choice a better program avoids."""
    summed = {t["name"] for t in program.get("tensors", ()) if "Reduce" in (t.get("layouts") or ())}
    total = 0.0
    for step in program["steps"]:
        if not any(i.get("tensor") in summed for i in step.get("inputs", ())):
            continue
        comm = row_values(step["comm"], ratios)
        for source in step.get("sources", ()):
            if source.get("grad_sync"):
                comm = [c - v for c, v in zip(comm, row_values(source["cost"], ratios))]
        total += max(max(comm, default=0.0), 0.0)
    return total


def ddp_step_seconds(step: Mapping[str, Any], batch: set[str], ratios: Sequence[float], duplicas: int = 1) -> float:
    """What DDP pays for ``step``'s op (:func:`ddp_cost`): its slowest device's share of
    the work when it reads a tensor of ``batch`` (:func:`batch_tensors`), its whole work
    otherwise."""
    row = step["comp"]
    split = any(i["tensor"] in batch for i in step["inputs"])
    full = [c + k for c, k in zip(row["constant"], row["coef"])]
    return max((w * r * duplicas if split else w for w, r in zip(full, ratios)), default=0.0)


def batch_tensors(program: Mapping[str, Any]) -> set[str]:
    """Tensors that depend on a batch-split user input (in a data-parallel program the
    inputs with a batch dim are the sources held in a ``Gather`` layout)."""
    batch: set[str] = set()
    for step in program["steps"]:
        for source in step["sources"]:
            if source["kind"] == "input" and source["layout"].startswith("Gather"):
                batch.add(source["tensor"])
        if any(i["tensor"] in batch for i in step["inputs"]):
            batch.update(o["tensor"] for o in step["outputs"])
    return batch


def _prefer_data_parallel(
    searched: Searched, baselines: Baselines, options: CompileOptions, caps: list[float] | None
) -> tuple[dict, list[float], str]:
    """The program to keep, its ratios, and where it came from (``"search"`` or
    ``"data_parallel"``).

    A search bounded by its front width may miss the data-parallel program, which is
    always in its space: keep whichever is cheaper, with the LP's ratios or the
    FLOP/s-proportional ones (compared by the cost model, not the LP's objective,
    which the solver only meets to its tolerance; a tie goes to data parallelism). Only
    for a free ``auto`` compile that
    does not ask for recomputation everywhere (the data-parallel program keeps every
    activation)."""
    if options.ratios is not None or options.force or options.mode != "auto" or options.recompute == "always":
        return searched.program, searched.ratios, "search"
    program, ratios, chosen_from = searched.program, searched.ratios, "search"
    best_cost = program_cost(program, ratios)
    dp_program = baselines.dp_program
    # the FLOP/s-proportional split where it fits (with memory caps), and the LP's
    dp_splits = [baselines.flops] if caps is None or _fits(dp_program, baselines.flops, caps) else []
    try:
        dp_splits.append(list(solve_ratios(dp_program, caps).ratios))
    except SynthesisError:
        pass  # no data-parallel split fits
    for split in dp_splits:
        cost = program_cost(dp_program, split)
        # a tie goes to data parallelism: every input split along its batch dim, so each
        # rank reads only its samples (a plan as cheap that holds an input whole makes
        # every rank read the whole batch)
        if cost <= best_cost:
            program, ratios, best_cost, chosen_from = dp_program, split, cost, "data_parallel"
    return program, ratios, chosen_from


def search_program(
    data: bytes, profile: Profile, options: CompileOptions, weigh: Callable[[dict], dict] | None = None
) -> tuple[dict, list[float]]:
    """The cheapest program for ``profile`` and the ratios it was optimized for, from the
    search ⇄ LP rounds and the data-parallel candidate, without memory caps or wider
    fronts: how a pipeline stage's group is priced (:mod:`hapd.compiler.pipeline.stage_search`).
    ``weigh`` maps each program the core returns for ``data`` to the program the LP and
    the comparison with data parallelism price, and which is returned: for a graph
    with its repeated blocks dropped, its steps weighed as the whole graph's
    (:mod:`hapd.compiler.pipeline.repeats`)."""
    searched = _rounds(data, profile, options, None, None, weigh=weigh)
    baselines = _baselines(data, profile, options)
    if weigh is not None:
        baselines = replace(baselines, dp_program=weigh(baselines.dp_program))
    program, ratios, _ = _prefer_data_parallel(searched, baselines, options, None)
    return program, ratios


def dp_fits(dp_program: dict, profile: Profile) -> bool:
    """Whether some split of the batch fits data parallelism in every device's memory."""
    try:
        solve_ratios(dp_program, [float(d.memory) for d in profile.devices])
    except SynthesisError:
        return False
    return True


def _with_expert_parallel_candidate(
    data: bytes, profile: Profile, options: CompileOptions, caps: list[float] | None, searched: Searched
) -> Searched:
    """``searched``, or the search with every expert-weight op forced expert-parallel
    when that is cheaper.

    Expert parallelism pays off only over a whole mixture-of-experts block (the tokens
    all-to-all'd to their experts and back, the experts' gradients never all-reduced),
    while its first all-to-all costs at once, so a search whose front keeps the states
    cheapest so far drops it before its saving shows (Mixtral with hapd's dense experts at batch 32 on
    paper-8: data parallelism at 24 states per position, expert parallelism at 384).
    Searched as a candidate of its own, it is compared whole. Only for a free ``auto``
    compile of a graph with expert weights."""
    if options.mode != "auto" or options.force or options.ratios is not None:
        return searched
    nodes = _core.load_graph(data)["expert_parallel"]
    if not nodes:
        return searched
    forced = replace(options, force={name: _core.rule_names()["EXPERT_PARALLEL"] for name in nodes})
    what = f"search with expert parallelism forced on {len(nodes)} ops"
    why = ("the graph has stacked expert weights: expert parallelism is priced as a candidate of its own (the free "
           "search's front drops it before its saving shows)")
    start = time.perf_counter()
    try:
        candidate = _search_rounds(data, profile, forced, caps, searched.program.get("recompute", ()))
    except SynthesisError:  # it does not fit, say: the free search's program stands
        _note_pass(what, why + "; it does not fit", time.perf_counter() - start, brief="expert-parallel candidate")
        return searched
    cost = program_cost(candidate.program, candidate.ratios)
    won = cost < program_cost(searched.program, searched.ratios)
    _note_pass(what, why + ("; it is cheaper" if won else "; the free search's program is cheaper"),
               time.perf_counter() - start, cost, brief="expert-parallel candidate")
    if won:
        return replace(candidate, rounds=searched.rounds + candidate.rounds, expanded=searched.expanded + candidate.expanded)
    return searched


WIDEN_FACTOR = 4
"""How much wider each repeated search's front is."""
WIDEN_BUDGET_S = 10.0
"""A compile searches with wider fronts only within this many seconds (the wider search
gets what is left as its time limit)."""


def _wider_front(
    options: CompileOptions, chosen: tuple[dict, list[float], str], baselines: Baselines, elapsed: float
) -> CompileOptions | None:
    """Options for a search with a wider front when the search's pruning evidently lost
    the better programs, else ``None``.

    Every program DDP runs is in the search's space (with hapd's gradient sync:
    :attr:`Baselines.dp_cp_own`), so a plan that costs more than it was cut short by
    the front width: a state that holds a tensor in a layout
    that is cheap now and costly later crowded out the one that is not (T5's position
    buckets, split and all-gathered later). Only a free ``auto`` compile widens, and
    only within :data:`WIDEN_BUDGET_S`.

    A plan that costs DP-CP plus the collectives the data-parallel program needs for the
    single-device loss (:func:`loss_collectives`, which DDP's price leaves out) does not
    widen: no program in the space is cheaper for that reason alone.

    A plan that merely ties with data parallelism does not widen: that is the common
    case (data parallelism is optimal for most models on most clusters) and widening
    there would multiply every compile's time; a user who expects more sets
    ``front_width`` (Mixtral with hapd's dense experts at batch 32 on paper-8 finds expert parallelism
    at 384)."""
    program, ratios, _ = chosen
    left = WIDEN_BUDGET_S - elapsed
    # the space holds DDP's program with hapd's sync (``dp_cp_own``), not with DDP's own
    # buckets and flat all-reduce, which can price it lower than any program hapd runs
    if options.mode != "auto" or options.force or options.ratios is not None or left <= 0:
        return None
    if program.get("recompute"):  # it pays for recomputation, which DP-CP's price leaves out
        return None
    cost = program_cost(program, ratios)
    needed = loss_collectives(baselines.dp_program, baselines.flops)
    dp_cp = baselines.dp_cp_own if baselines.dp_cp_own > 0 else baselines.dp_cp
    lost = cost > dp_cp * (1 + 1e-9) and (needed <= 0.0 or cost > (dp_cp + needed) * (1 + 1e-4))
    if not lost or options.front_width * WIDEN_FACTOR > MAX_FRONT_WIDTH:
        return None
    limit = left if options.max_seconds is None else min(left, options.max_seconds)
    return replace(options, front_width=options.front_width * WIDEN_FACTOR, max_seconds=limit)


def _exhaustive(stops: Sequence[str], width: int) -> bool:
    """Whether every core search of a pass ended proven optimal (``stops``: why each
    stopped): its front of ``width`` never dropped a state, so a wider front runs the same
    searches to the same programs, and the pass is not repeated wider (noted as a pass).
    (GPT-2 124M on paper-64 once widened 28 times to the largest front width, each time to
    the same plan.)"""
    if not stops or any(stop != "optimal" for stop in stops):
        return False
    _note_pass("searches with wider fronts",
               f"skipped: the plan costs more than DP-CP, but every search with front width {width} ended proven "
               "optimal (its front dropped no state): a wider front searches the same", 0.0,
               brief="wider fronts: skipped, searches exhaustive")
    return True


@dataclass(frozen=True, kw_only=True)
class SpmdSearch:
    """What the SPMD search of a compile settled on (:func:`search_spmd`)."""

    searched: Searched
    """The search ⇄ LP rounds the kept front width ran."""
    baselines: Baselines
    """The data-parallel baselines of those options."""
    program: dict
    """The program to keep: the search's, or the data-parallel one where it is cheaper."""
    ratios: list[float]
    """The sharding ratios of ``program``."""
    chosen_from: str
    """Where ``program`` came from: ``"search"`` or ``"data_parallel"``."""
    synthesis_seconds: float
    """Seconds from the start of the search to the end of the kept front width's."""
    front_width: int
    """The front width whose search was kept."""
    passes: tuple[dict, ...] = ()
    """Every search pass in the order they ran: ``what`` ran, ``why``, its ``seconds``,
    the ``cost`` it found (seconds per step, None when nothing fit) and whether its
    program was ``kept`` (the plan's ``stats["passes"]``, ``docs/formats.md``)."""


def _widen_why(chosen: tuple[dict, list[float], str], baselines: Baselines, width: int, wider: int) -> str:
    cost = program_cost(chosen[0], chosen[1])
    return (f"the plan found with front width {width} ({cost * 1e3:.3f} ms) cost more than DP-CP "
            f"({baselines.dp_cp * 1e3:.3f} ms), whose program is in the search space: the front evidently pruned "
            f"better programs, so the search ran again {wider // width}× wider")


def search_spmd(data: bytes, profile: Profile, options: CompileOptions) -> SpmdSearch:
    """The SPMD program a compile of the graph ``data`` for ``profile`` keeps: the search
    ⇄ LP rounds with recomputation as the options say (:func:`_search_with_recompute`)
    and the expert-parallel candidate, against the data-parallel program
    (:func:`_prefer_data_parallel`), searched again with wider fronts while the search
    evidently lost the better programs (:func:`_wider_front`); the cheapest kept."""
    start = time.perf_counter()
    caps = [float(d.memory) for d in profile.devices] if options.memory_caps else None
    searching: CompileOptions | None = options
    best: tuple[float, SpmdSearch, dict] | None = None
    passes: list[dict] = []
    token = _PASSES.set(passes)
    searched_token = _SEARCHED.set({})
    stops: list[str] = []
    stops_token = _STOPS.set(stops)
    why, brief = "the first search", "first"
    try:
        while searching is not None:
            begin, first = time.perf_counter(), len(passes)
            del stops[:]
            searched = _search_with_recompute(data, profile, searching, caps)
            searched = _with_expert_parallel_candidate(data, profile, searching, caps, searched)
            synthesis_seconds = time.perf_counter() - start
            baselines = _baselines(data, profile, searching)
            chosen = _prefer_data_parallel(searched, baselines, searching, caps)
            cost = program_cost(chosen[0], chosen[1])
            inner = sum(p["seconds"] for p in passes[first:])
            main = {"what": f"search ⇄ LP rounds, front width {searching.front_width}"
                            + (", data parallelism cheaper" if chosen[2] == "data_parallel" else ""),
                    "why": why, "brief": brief, "seconds": time.perf_counter() - begin - inner, "cost": cost,
                    "kept": False}
            passes.insert(first, main)
            if best is None or cost < best[0]:
                found = SpmdSearch(searched=searched, baselines=baselines, program=chosen[0], ratios=chosen[1],
                                   chosen_from=chosen[2], synthesis_seconds=synthesis_seconds,
                                   front_width=searching.front_width)
                best = (cost, found, main)
            # a plan dearer than a data parallelism that does not fit lost nothing to the front
            dp_out = caps is not None and chosen[2] != "data_parallel" and not dp_fits(baselines.dp_program, profile)
            wider = None if dp_out else _wider_front(searching, chosen, baselines, time.perf_counter() - start)
            if wider is not None and _exhaustive(stops, searching.front_width):
                wider = None
            if wider is not None:
                why = _widen_why(chosen, baselines, searching.front_width, wider.front_width)
                brief = f"front width {wider.front_width}: the plan lost to DP-CP"
            searching = wider
    finally:
        _STOPS.reset(stops_token)
        _SEARCHED.reset(searched_token)
        _PASSES.reset(token)
    assert best is not None
    best[2]["kept"] = True
    return replace(best[1], passes=tuple(passes))
