"""The pipeline search: the stages, groups of hosts and micro-batch count of the best
pipeline for a profile (``CompileOptions.pipeline`` auto), priced by
:mod:`hapd.compiler.pipeline.stage_cost` — the table of stage costs on every group (one SPMD
search per distinct group, :func:`hapd.compiler.search.search_program`), the dynamic
program over cuts and groups, and the plan it records (:class:`PipelinePlan`).
``docs/pipelines.md`` describes the design."""

from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Collection, Mapping, Sequence

from hapd.ir.lower import GraphIR
from hapd.compiler.choice import beats
from hapd.compiler.options import CompileOptions
from hapd.compiler.pipeline.stage_cost import (
    GraphUnits,
    UnitCosts,
    UnitMemory,
    boundary_seconds,
    graph_batch,
    graph_unit_bytes,
    graph_units,
    accumulation_seconds,
    counter_draws,
    graph_kernels,
    one_f_one_b,
    op_dispatch,
    op_kernels,
    p2p_link,
    round_trip,
    simulate_one_f_one_b,
    unit_costs,
    unit_memory,
    unit_parameter_elements,
    with_dispatch,
)
from hapd.compiler.pipeline.repeats import Reduction, reduce_graph
from hapd.compiler.search import search_program
from hapd.errors import GraphError, OptionsError, SynthesisError
from hapd.profile.schema import Link, Profile


SCHEDULE = "1f1b"
"""The one micro-batch schedule priced and run."""
DEFAULT_MICRO_BATCHES = (1, 2, 4, 8, 16)
"""Micro-batch counts a caller exports graphs for by default (:func:`micro_batch_counts`)."""


def micro_batch_counts(batch: int, candidates: Sequence[int] = DEFAULT_MICRO_BATCHES) -> list[int]:
    """The micro-batch counts of ``candidates`` that divide the global ``batch``."""
    return [m for m in candidates if m >= 1 and batch % m == 0]


# --------------------------------------------------------------------------- the DP


Span = tuple[int, int, int, int]
"""A stage: hosts ``[h0, h1)`` and units ``[k0, k1)``."""

StageCost = Callable[[int, int, int, int], "tuple[float, float] | None"]
"""(h0, h1, k0, k1) → (seconds per micro-batch, gradient sync), or ``None`` when that
group cannot run those units."""

StageFits = Callable[[int, int, int, int, int], bool]
"""(h0, h1, k0, k1, in_flight) → whether that group holds those units with
``in_flight`` micro-batches' activations at once (1F1B's stage ``s`` of ``S`` holds
up to ``min(S − s, m)``)."""


@dataclass(frozen=True, kw_only=True)
class Split:
    """The best stages of one micro-batch count."""

    cost: float
    """Seconds per iteration (:func:`one_f_one_b`)."""
    spans: tuple[Span, ...]


def split_cost(spans: Sequence[Span], stage: StageCost, boundary: Sequence[float], micro_batches: int) -> float | None:
    """:func:`one_f_one_b` of the stages ``spans`` (``None`` if one cannot run)."""
    costs = [stage(*span) for span in spans]
    if any(c is None for c in costs):
        return None
    return one_f_one_b([c[0] for c in costs], [boundary[span[3]] for span in spans[:-1]],  # type: ignore[index]
                       [c[1] for c in costs], micro_batches)  # type: ignore[index]


def best_split(
    hosts: int, units: int, cuts: Collection[int], stage: StageCost, boundary: Sequence[float], micro_batches: int,
    fits: StageFits | None = None,
) -> Split | None:
    """The cheapest pipeline of at least two stages over all ``hosts`` and ``units``,
    cut only at ``cuts`` (positions ``k``: units before the cut), with ``boundary[k]``
    the point-to-point seconds of cut ``k``; ``None`` when none exists (one host, no
    cut, no group that runs). ``stage`` must be additive over units (a stage's compute
    and sync are the sums of its units', as prefix sums give them); ``fits`` (default:
    every stage fits) rejects stages that would not fit their group's memory.

    The period depends on every stage's suffix (its round trip through the later
    stages), so the DP runs from the last stage backwards over (hosts left, units left),
    keeping of the partial pipelines that reach a state (their suffix fill, period,
    largest sync and stage count, :data:`_Entry`) those no other one beats whatever
    the earlier stages are (:func:`_insert`): the optimum extends one of them.
    Entries that cannot beat the best pipeline known are dropped (:class:`_Bound`):
    first a pass that keeps one entry per state gives a good pipeline, then the exact
    pass prunes against it."""
    bound = _Bound.of(hosts, units, stage, micro_batches)
    ok = fits or (lambda h0, h1, k0, k1, n: True)
    greedy = _split_pass(hosts, units, cuts, stage, boundary, micro_batches, bound, None, ok, exact=False)
    exact = _split_pass(hosts, units, cuts, stage, boundary, micro_batches, bound, greedy, ok, exact=True)
    return exact or greedy


@dataclass(frozen=True)
class _Bound:
    """A lower bound on what the units ``…k`` still cost on the hosts ``…h``: each unit
    on its fastest group there (``rest[h][k]``, the fill it adds at least), one of at
    most ``h`` stages runs at least its share (the slowest stage's least), and the first
    stage's round trip is at least the whole fill over the most stages there can be."""

    rest: tuple[tuple[float, ...], ...]
    micro_batches: int

    @classmethod
    def of(cls, hosts: int, units: int, stage: StageCost, micro_batches: int) -> _Bound:
        inf = float("inf")
        fastest = [[inf] * units for _ in range(hosts + 1)]  # fastest[h][j]: unit j on a group within hosts …h
        for h1 in range(1, hosts + 1):
            for h0 in range(h1):
                for j in range(units):
                    cost = stage(h0, h1, j, j + 1) if not (h0 == 0 and h1 == hosts) else None
                    if cost is not None:
                        fastest[h1][j] = min(fastest[h1][j], cost[0])
            fastest[h1] = [min(a, b) for a, b in zip(fastest[h1], fastest[h1 - 1])]
        rest = []
        for h in range(hosts + 1):
            sums = [0.0] * (units + 1)
            for j in range(units):
                sums[j + 1] = sums[j] + fastest[h][j]
            rest.append(tuple(sums))
        return cls(rest=tuple(rest), micro_batches=micro_batches)

    def least(self, h: int, k: int, way: float, period: float, sync: float, count: int) -> float:
        """The least final cost of a partial pipeline at (h, k) with these terms."""
        rest = self.rest[h][k]
        fill = way + rest
        share = rest / h if h > 0 else 0.0
        first = round_trip(fill, count + h, self.micro_batches) if h > 0 else 0.0
        return fill + (self.micro_batches - 1) * max(period, share, first) + sync


_Entry = tuple[float, float, float, int, tuple[Span, ...]]
"""(suffix fill, its period, largest sync, stage count, the stages) of a partial
pipeline of the last stages."""


def _split_pass(
    hosts: int, units: int, cuts: Collection[int], stage: StageCost, boundary: Sequence[float], m: int,
    bound: _Bound, known: Split | None, fits: StageFits, *, exact: bool,
) -> Split | None:
    """One pass of :func:`best_split`'s DP, from the last stage backwards: ``exact``
    keeps each state's front, else only its entry of least partial cost; both drop
    entries whose least final cost is no better than the best pipeline found so far
    (``known`` to start with)."""
    ends = [*sorted(set(cuts), reverse=True), 0]
    fronts: dict[tuple[int, int], list[_Entry]] = {(hosts, units): [(0.0, 0.0, 0.0, 0, ())]}
    best = known
    for h in range(hosts, 0, -1):
        for k in [units, *ends[:-1]]:
            front = fronts.pop((h, k), None)
            if not front:
                continue
            c = boundary[k] if k < units else 0.0
            least_way = min(e[0] for e in front)
            least_period = min(e[1] for e in front)
            least_sync = min(e[2] for e in front)
            most = max(e[3] for e in front)
            for h0 in range(h - 1, -1, -1):
                final = h0 == 0
                if final and h == hosts:
                    continue  # one stage: the SPMD plan's
                for k0 in ([0] if final else ends[:-1]):
                    if k0 >= k:
                        continue
                    cost = stage(h0, h, k0, k)
                    if cost is None:
                        continue
                    u, y = cost
                    if not final and best is not None:
                        way = least_way + u + c
                        period = max(least_period, u, c / 2, round_trip(way, most + 1, m))
                        if bound.least(h0, k0, way, period, max(least_sync, y), most + 1) >= best.cost:
                            continue  # no entry of this front can do better through this stage
                    target = None if final else fronts.setdefault((h0, k0), [])
                    for way, period, sync, count, spans in front:
                        if not fits(h0, h, k0, k, min(count + 1, m)):
                            continue
                        new_way = way + u + c
                        entry = (new_way, max(period, u, c / 2, round_trip(new_way, count + 1, m)), max(sync, y),
                                 count + 1, ((h0, h, k0, k), *spans))
                        if final:
                            total = _partial(entry, m)
                            if best is None or total < best.cost:
                                best = Split(cost=total, spans=entry[4])
                            continue
                        if best is not None and bound.least(h0, k0, *entry[:4]) >= best.cost:
                            continue
                        if exact:
                            _insert(target, entry, m)
                        elif not target or _partial(entry, m) < _partial(target[0], m):
                            target[:] = [entry]
    return best


def _partial(entry: _Entry, m: int) -> float:
    return entry[0] + (m - 1) * entry[1] + entry[2]


def _insert(front: list[_Entry], entry: _Entry, m: int) -> None:
    """Add ``entry`` to a front unless an entry there is no worse, and drop those it is
    no worse than. ``e`` ends no worse than ``f`` whatever stages come before both when
    it has at least as many stages (its round trips span no fewer periods) and
    ``gap + (m−1)·((period_e − period_f)⁺ + gap⁺/(count_f + 1)) + (sync_e − sync_f)⁺ ≤ 0``
    with ``gap = fill_e − fill_f``: the earlier stages add the same to both fills, and
    raise each later max term by at most the gap over the round trip's stage count
    (the last term only while ``m`` exceeds ``count_f + 1``). Written out: this loop is
    the DP's hot spot."""
    a, b, c, n = entry[0], entry[1], entry[2], min(entry[3], m)
    w = m - 1
    later_entry = 1.0 / (entry[3] + 1) if m > entry[3] + 1 else 0.0
    for x, y, z, count, _ in front:
        if min(count, m) >= n:
            gap = x - a
            if gap + w * ((y - b if y > b else 0.0) + (gap * later_entry if gap > 0 else 0.0)) + (z - c if z > c else 0.0) <= 0.0:
                return
    keep = []
    for e in front:
        if min(e[3], m) <= n:
            gap = a - e[0]
            later = (gap / (e[3] + 1) if gap > 0 else 0.0) if m > e[3] + 1 else 0.0
            if gap + w * ((b - e[1] if b > e[1] else 0.0) + later) + (c - e[2] if c > e[2] else 0.0) <= 0.0:
                continue
        keep.append(e)
    keep.append(entry)
    front[:] = keep


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, kw_only=True)
class PipelineStage:
    """One stage of a pipeline plan."""

    index: int
    hosts: tuple[str, ...]
    """The hosts of its group."""
    ranks: tuple[int, ...]
    """The global ranks of its group, in rank order."""
    blocks: tuple[str, str]
    """The first and last block it runs (the ops before the first block run in stage
    0, those after the last in the last stage)."""
    block_count: int
    """How many blocks it runs."""
    last_node: str | None
    """IR name of its last block op, where the program is cut after it (``None`` for the
    last stage)."""
    forward: float
    """Predicted forward seconds of one micro-batch."""
    backward: float
    """Predicted backward seconds of one micro-batch."""
    sync: float
    """Predicted seconds of its gradient all-reduce within its group, once per iteration."""
    boundary_bytes: float
    """Bytes it sends the next stage per micro-batch (activations; their gradients come
    back the same size); 0 for the last stage."""
    boundary_seconds: float
    """Point-to-point seconds per micro-batch to the next stage, both ways."""


@dataclass(frozen=True, kw_only=True)
class PipelinePlan:
    """A pipeline: stages on groups, micro-batches, the 1F1B schedule and its
    prediction; the ``pipeline`` map of a plan document (``docs/formats.md``)."""

    stages: tuple[PipelineStage, ...]
    micro_batches: int
    micro_batch_size: int
    """The global batch over ``micro_batches``."""
    micro_batch_graph_id: str
    """The graph of one micro-batch that the stage costs were priced on."""
    per_iteration: float
    """Predicted seconds per iteration: the stages' 1F1B schedule simulated
    (:func:`simulate_one_f_one_b`), the largest gradient sync and ``shared_sync``."""
    bubble: float
    """Predicted share of the pipelined time an average stage does not compute."""
    spmd_only_per_iteration: float
    """The pure SPMD plan's estimate it competed with, with its ops' kernels' dispatch
    added once as the stages' is per micro-batch (the profile's ``op_seconds`` a kernel,
    :func:`~hapd.compiler.pipeline.stage_cost.op_kernels`)."""
    chosen: bool
    """Whether it runs: predicted ``CompileOptions.technique_margin`` faster than the SPMD
    plan (:mod:`hapd.compiler.choice`), and after a technique search not beaten by overlap."""
    shared_sync: float = 0.0
    """Predicted seconds per iteration of summing the gradients of parameters that
    several stages read (a tied embedding and head), between their groups; in
    ``per_iteration``."""
    shared_parameters: tuple[str, ...] = ()
    """Those parameters (IR names)."""
    schedule: str = SCHEDULE

    def to_doc(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["shared_parameters"] = list(doc["shared_parameters"])
        for stage in doc["stages"]:
            stage["hosts"], stage["ranks"], stage["blocks"] = list(stage["hosts"]), list(stage["ranks"]), list(stage["blocks"])
        doc["stages"] = list(doc["stages"])
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> PipelinePlan:
        stages = tuple(
            PipelineStage(**{**s, "hosts": tuple(s["hosts"]), "ranks": tuple(s["ranks"]), "blocks": tuple(s["blocks"])})
            for s in doc["stages"]
        )
        return cls(**{**doc, "stages": stages, "shared_parameters": tuple(doc.get("shared_parameters", ()))})

    @property
    def cuts(self) -> list[str]:
        """The IR node names the program is cut after, in order."""
        return [s.last_node for s in self.stages if s.last_node is not None]


@dataclass(frozen=True, kw_only=True)
class PipelineSearch:
    """What the pipeline search found: the best pipeline (``None`` when none exists)
    and its statistics."""

    best: PipelinePlan | None
    seconds: float
    """Seconds the search took (pricing the groups included)."""
    groups_priced: int
    """Searches run: distinct groups × micro-batch counts."""
    tried: tuple[dict[str, Any], ...]
    """Per micro-batch count: ``micro_batches``, ``per_iteration`` (``None``: no
    pipeline), ``stages``."""
    reason: str = ""
    """Why there is no pipeline, when there is none."""

    def stats(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "groups_priced": self.groups_priced, "tried": list(self.tried),
                "reason": self.reason}


# --------------------------------------------------------------------------- search


@dataclass(frozen=True)
class Group:
    """A contiguous run of hosts of the profile: a stage's devices."""

    hosts: tuple[str, ...]
    ranks: tuple[int, ...]
    """Their global ranks, in rank order."""
    key: str
    """Equal for groups of the same devices (host names aside): priced once."""


def stage_groups(profile: Profile) -> dict[tuple[int, int], Group]:
    """Every group ``[h0, h1)`` of the profile's hosts (in rank order) a stage may run
    on: all but the whole cluster (whose plan is the SPMD plan)."""
    hosts = profile.hosts
    out = {}
    for h0 in range(len(hosts)):
        for h1 in range(h0 + 1, len(hosts) + 1):
            if h0 == 0 and h1 == len(hosts):
                continue
            names = tuple(hosts[h0:h1])
            ranks = tuple(r for h in names for r in profile.ranks_of(h))
            canon = profile.subset(ranks, name="group", hosts={h: f"h{i}" for i, h in enumerate(names)})
            key = hashlib.sha256(json.dumps(canon.canonical(), sort_keys=True).encode()).hexdigest()
            out[(h0, h1)] = Group(hosts=names, ranks=ranks, key=key)
    return out


@dataclass(frozen=True, kw_only=True)
class StageTable:
    """Stage costs of one micro-batch graph on every group: what :func:`best_split`
    reads."""

    units: GraphUnits
    groups: Mapping[tuple[int, int], Group]
    costs: Mapping[str, UnitCosts | None]
    """Group key → its units' costs (``None``: the group cannot run the graph)."""
    boundary: tuple[float, ...]
    """Per cut position, point-to-point seconds of one micro-batch (0 where no cut)."""
    searches: int
    """Searches run to price the groups."""
    sum_link: Link | None = None
    """The link a shared parameter's gradient is summed over between two groups."""
    priced_units: int = 0
    """Units of the graph the groups were searched on: fewer than the graph's when its
    repeated blocks were dropped (:mod:`hapd.compiler.pipeline.repeats`)."""
    whole_searches: int = 0
    """Of the searches, those run on the whole graph although it has repeated blocks
    (the reduced graph's program stood for none of the whole graph's)."""
    memory: Mapping[str, UnitMemory] = field(default_factory=dict)
    """Group key → its stages' memory estimate; a group without one is not checked
    (memory caps off)."""

    @property
    def hosts(self) -> int:
        return max((h1 for _, h1 in self.groups), default=1)

    def range(self, h0: int, h1: int, k0: int, k1: int) -> tuple[float, float, float] | None:
        """(forward, backward, sync) of units ``[k0, k1)`` on group ``[h0, h1)``."""
        table = self.costs[self.groups[(h0, h1)].key]
        return None if table is None else table.range(k0, k1)

    def stage(self, h0: int, h1: int, k0: int, k1: int) -> tuple[float, float] | None:
        """A :data:`StageCost`."""
        found = self.range(h0, h1, k0, k1)
        return None if found is None else (found[0] + found[1], found[2])

    def fits(self, h0: int, h1: int, k0: int, k1: int, in_flight: int) -> bool:
        """A :data:`StageFits`: whether group ``[h0, h1)`` holds units ``[k0, k1)`` with
        ``in_flight`` micro-batches (:class:`UnitMemory`)."""
        memory = self.memory.get(self.groups[(h0, h1)].key)
        return memory is None or memory.fits(k0, k1, in_flight)

    def best(self, micro_batches: int) -> Split | None:
        return best_split(self.hosts, len(self.units.units), self.units.cuts, self.stage, self.boundary, micro_batches,
                          self.fits if self.memory else None)

    def simulated(self, spans: Sequence[Span], micro_batches: int) -> tuple[float, float]:
        """(seconds per iteration, bubble) of the stages ``spans``: their 1F1B schedule
        simulated (:func:`simulate_one_f_one_b`), the largest gradient sync and the shared
        parameters' sum; the bubble is the share of the pipelined time an average stage
        does not compute."""
        parts = [self.range(*span) for span in spans]
        if any(p is None for p in parts):
            raise ValueError("a stage of these spans cannot run on its group")
        forward = [p[0] for p in parts]  # type: ignore[index]
        backward = [p[1] for p in parts]  # type: ignore[index]
        pipelined = simulate_one_f_one_b(forward, backward, [self.boundary[span[3]] for span in spans[:-1]],
                                         micro_batches)
        busy = micro_batches * (sum(forward) + sum(backward)) / len(spans)
        bubble = max(0.0, 1.0 - busy / pipelined) if pipelined > 0 else 0.0
        total = pipelined + max(p[2] for p in parts) + self.shared_sync(spans)[0]  # type: ignore[index]
        return total, bubble

    def shared_sync(self, spans: Sequence[Span]) -> tuple[float, list[str]]:
        """Seconds per iteration of summing the gradients of the shared parameters the
        stages ``spans`` split (each an all-reduce of its bytes between hosts), and their
        names."""
        split = self.units.split_parameters([span[3] for span in spans[:-1]])
        link = self.sum_link
        seconds = sum(link.alpha + size / link.beta for _, size in split) if link is not None else 0.0
        return seconds, [name for name, _ in split]


def stage_table(ir: GraphIR, profile: Profile, options: CompileOptions, *, repeats: bool = True,
                micro_batches: int | None = None) -> StageTable:
    """Price the micro-batch graph ``ir`` on every group of ``profile``'s hosts: one
    search per distinct group (:func:`hapd.compiler.driver.search_program` with the
    group's sub-profile, no memory caps), its steps summed per unit, with what each
    micro-batch costs beyond its FLOPs (:func:`~hapd.compiler.pipeline.stage_cost.with_dispatch`:
    its kernels' dispatch and, ``micro_batches`` being ``m``, its gradient
    accumulation; none without ``m``). With ``repeats``
    the search runs on the graph with its repeated blocks dropped, when it has some
    (:mod:`hapd.compiler.pipeline.repeats`), and each dropped block costs what the kept blocks
    it repeats do; a group whose search there fails, or finds a program that stands
    for none of the whole graph, is searched on the whole graph."""
    group_options = replace(options, pipeline="off", memory_caps=False, recompute="never", overlap=False, ratios=None)
    doc = ir.doc
    units = graph_units(doc)
    count = len(units.units)
    groups = stage_groups(profile)
    batch = graph_batch(doc)
    reduction = reduce_graph(doc, units.unit_of, count) if repeats and count >= 2 and units.cuts else None
    priced_units = reduction.kept if reduction is not None else count
    costs: dict[str, UnitCosts | None] = {}
    memory: dict[str, UnitMemory] = {}
    kernels = {draws: op_kernels(doc, units.unit_of, count, counter_draws=draws) for draws in (False, True)}
    elements = unit_parameter_elements(doc, units.unit_of, count)
    searches = whole = 0
    reduced_doc = reduction.ir.doc if reduction is not None and options.memory_caps else None
    bytes_of = _unit_bytes(doc, reduced_doc, units, count) if options.memory_caps else {}

    def price(group: Group) -> tuple[UnitCosts | None, UnitMemory | None, int, int]:
        """(its units' costs, their memory, searches run, whole-graph searches)."""
        if batch < len(group.ranks):
            return None, None, 0, 0  # fewer samples than ranks
        sub = profile.subset(group.ranks, name=f"{profile.name}:{'+'.join(group.hosts)}")
        capacity = [d.memory for d in sub.devices]
        found = _reduced_costs(reduction, count, sub, group_options) if reduction is not None else None
        searched = reduced_doc if found is not None else None
        wholes = 0
        if found is None:
            if reduction is not None:
                wholes = 1
            try:
                program, ratios = search_program(ir.data, sub, group_options)
            except SynthesisError:
                return None, None, 0, wholes
            found = unit_costs(program, ratios, units.unit_of, count), (program, ratios)
        held = None
        if options.memory_caps:
            program, ratios = found[1]
            held = unit_memory(program, ratios, doc, units.unit_of, count, capacity, searched=searched,
                               unit_bytes=bytes_of[searched is not None])
        accumulate = accumulation_seconds(elements, sub, micro_batches or 1)
        return with_dispatch(found[0], kernels[counter_draws(sub)], op_dispatch(sub), accumulate), held, 1, wholes

    if count >= 2 and units.cuts:
        distinct = list({group.key: group for group in groups.values()}.values())
        for group, (cost, held, searched_here, whole_here) in zip(distinct, _each(price, distinct)):
            costs[group.key] = cost
            if held is not None:
                memory[group.key] = held
            searches += searched_here
            whole += whole_here
    link = p2p_link(profile)
    boundary = tuple(boundary_seconds(c, link) if c is not None else 0.0 for c in units.crossing)
    summed = (profile.collectives.get("grad_sync") or profile.collectives["all_reduce"])["inter"]
    return StageTable(units=units, groups=groups, costs=costs, boundary=boundary, searches=searches, sum_link=summed,
                      priced_units=priced_units, whole_searches=whole, memory=memory)


def _unit_bytes(doc: Mapping[str, Any], reduced_doc: Mapping[str, Any] | None, units: GraphUnits,
                count: int) -> dict[bool, Any]:
    """What unit_memory reads of the graphs, by whether the reduced one was searched (nothing for one unit)."""
    bytes_of: dict[bool, Any] = {}
    if count >= 2 and units.cuts:
        bytes_of[False] = graph_unit_bytes(doc, units.unit_of, count)
        if reduced_doc is not None:
            bytes_of[True] = (bytes_of[False][0], graph_unit_bytes(reduced_doc, {}, 0)[0])
    return bytes_of


SEARCH_THREADS = max(1, min(4, os.cpu_count() or 1))
"""Threads pricing a micro-batch graph's groups at once (:func:`stage_table`): each
group's search is independent, and the core's search and the LP's solver process run
without Python's lock, so a second thread computes while one waits."""


def _each(price: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
    """``[price(item) for item in items]``, on :data:`SEARCH_THREADS` threads (the
    results in the order of ``items``, whatever order they finish in)."""
    if SEARCH_THREADS < 2 or len(items) < 2:
        return [price(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(SEARCH_THREADS, len(items)), thread_name_prefix="hapd-stage") as pool:
        return list(pool.map(price, items))


def _reduced_costs(
    reduction: Reduction, count: int, profile: Profile, options: CompileOptions
) -> tuple[UnitCosts, tuple[dict, list[float]]] | None:
    """The ``count`` units' costs on the group of ``profile`` (its sub-profile) searched
    on ``reduction``'s graph, and that program with its ratios; ``None`` when that
    search fails or its program stands for no program of the whole graph
    (:meth:`hapd.compiler.pipeline.repeats.Reduction.cycles`)."""
    try:
        program, ratios = search_program(reduction.ir.data, profile, options, weigh=reduction.weigh)
    except (GraphError, SynthesisError):
        return None
    cycles = reduction.cycles(program)
    if cycles is None:
        return None
    kept = unit_costs(program, ratios, reduction.unit_of, count)
    return UnitCosts(forward=reduction.spread(kept.forward, cycles), backward=reduction.spread(kept.backward, cycles),
                     sync=reduction.spread(kept.sync, cycles)), (program, ratios)


def search(
    graphs: Mapping[int, GraphIR], profile: Profile, options: CompileOptions, spmd_only: float,
    *, repeats: bool = True,
) -> PipelineSearch:
    """The best pipeline for ``profile`` over the micro-batch counts of ``graphs``
    (micro-batch count → the graph exported at the global batch over it), against the
    SPMD plan's ``spmd_only`` seconds per iteration; ``repeats``: groups priced on the
    graphs with their repeated blocks dropped (:func:`stage_table`)."""
    start = time.perf_counter()
    whole = graphs[min(graphs)].doc
    spmd_only += graph_kernels(whole, counter_draws=counter_draws(profile)) * op_dispatch(profile)
    updated = [m["target"] for ir in graphs.values() for m in ir.doc.get("mutations", [])]
    if updated:
        return PipelineSearch(best=None, seconds=0.0, groups_priced=0, tried=(),
                              reason=f"the program updates buffers ({updated[0]}, …): stages do not run such programs")
    if len(profile.hosts) < 2:
        return PipelineSearch(best=None, seconds=0.0, groups_priced=0, tried=(),
                              reason=f"one host ({profile.hosts[0]}): no groups of hosts to cut stages over")
    best: tuple[Split, int, StageTable] | None = None
    tried: list[dict[str, Any]] = []
    priced = 0
    reason = "no group of hosts can run a stage"
    for m in sorted(graphs):
        table = stage_table(graphs[m], profile, options, repeats=repeats, micro_batches=m)
        priced += table.searches
        if len(table.units.units) < 2 or not table.units.cuts:
            reason = f"the graph has {len(table.units.units)} blocks and no cut between them"
            continue  # nothing priced: no stage to cut
        found = table.best(m)
        if found is None and table.memory and replace(table, memory={}).best(m) is not None:
            reason = (f"no pipeline's stages fit their groups' memory (1F1B holds up to {m} micro-batches' "
                      "activations on the first stage)")
        if found is not None:
            found = replace(found, cost=table.simulated(found.spans, m)[0])
        tried.append({"micro_batches": m, "per_iteration": found.cost if found else None,
                      "stages": len(found.spans) if found else 0, "units": len(table.units.units),
                      "priced_units": table.priced_units, "whole_searches": table.whole_searches})
        if found is not None and (best is None or found.cost < best[0].cost):
            best = (found, m, table)
    seconds = time.perf_counter() - start
    if best is None:
        return PipelineSearch(best=None, seconds=seconds, groups_priced=priced, tried=tuple(tried), reason=reason)
    split, m, table = best
    plan = _plan(split, m, graphs[m], table, spmd_only, options.technique_margin)
    return PipelineSearch(best=plan, seconds=seconds, groups_priced=priced, tried=tuple(tried))


def _plan(split: Split, m: int, ir: GraphIR, table: StageTable, spmd_only: float, margin: float) -> PipelinePlan:
    """The :class:`PipelinePlan` of the stages ``split`` found for ``m`` micro-batches,
    chosen when it is predicted ``margin`` faster than the SPMD plan
    (:func:`hapd.compiler.choice.beats`: the simpler technique keeps a tie)."""
    units = table.units.units
    stages = []
    for s, (h0, h1, k0, k1) in enumerate(split.spans):
        found = table.range(h0, h1, k0, k1)
        assert found is not None
        f, b, y = found
        group = table.groups[(h0, h1)]
        cut = k1 < len(units)
        stages.append(PipelineStage(
            index=s, hosts=group.hosts, ranks=group.ranks,
            blocks=(units[k0].blocks[0], units[k1 - 1].blocks[-1]),
            block_count=sum(len(u.blocks) for u in units[k0:k1]),
            last_node=units[k1 - 1].last_node if cut else None,
            forward=f, backward=b, sync=y,
            boundary_bytes=float(sum(table.units.crossing[k1] or ())) if cut else 0.0,
            boundary_seconds=table.boundary[k1] if cut else 0.0,
        ))
    shared, names = table.shared_sync(split.spans)
    per_iteration, bubble = table.simulated(split.spans, m)
    return PipelinePlan(
        stages=tuple(stages), micro_batches=m, micro_batch_size=graph_batch(ir.doc), micro_batch_graph_id=ir.graph_id,
        per_iteration=per_iteration, bubble=bubble, spmd_only_per_iteration=spmd_only,
        chosen=beats(split.cost, spmd_only, margin), shared_sync=shared, shared_parameters=tuple(names),
    )


def micro_batch_graphs(full: GraphIR, others: Sequence[GraphIR]) -> dict[int, GraphIR]:
    """Micro-batch count → graph: ``full`` (the global batch) at 1 and each of ``others``
    (the same model exported at a smaller batch) at the count its batch divides the
    global batch into. :class:`OptionsError` for a graph of another model or a batch
    that does not divide the global one."""
    batch = graph_batch(full.doc)
    out = {1: full}
    for ir in others:
        micro = graph_batch(ir.doc)
        if micro <= 0 or batch % micro != 0:
            raise OptionsError(f"micro-batch graph {ir.doc.get('name')!r} has batch {micro}, which does not divide "
                               f"the global batch {batch}", field="micro_graphs")
        if ir.doc.get("name") != full.doc.get("name"):
            raise OptionsError(f"micro-batch graph {ir.doc.get('name')!r} is not of {full.doc.get('name')!r}",
                               field="micro_graphs")
        out[batch // micro] = ir
    return out


__all__ = [
    "DEFAULT_MICRO_BATCHES", "Group", "PipelinePlan", "PipelineSearch", "PipelineStage", "SCHEDULE", "Split", "StageTable",
    "best_split", "micro_batch_counts", "micro_batch_graphs", "search", "split_cost", "stage_groups", "stage_table",
]
