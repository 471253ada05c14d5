"""Pipeline stages in the plan space: cut points, device groups, micro-batches and the
1F1B cost (HSPMD; ``CompileOptions.pipeline``).

A pipeline plan cuts the program into **stages** at block boundaries (the graph's
repeated blocks, transformer layers: the IR's ``block`` labels), runs each stage on a
**group** of whole hosts with its own SPMD plan, and streams ``m`` **micro-batches**
through the stages in the 1F1B order; what crosses a cut moves point-to-point between
the groups. The runtime cuts the exported program (:mod:`hapd.compiler.stages`) and
compiles each stage's program for its group itself, so the plan records only the
cuts, the groups and ``m`` (:class:`PipelinePlan`).

**Units and cuts.** Unit ``k`` is block ``k`` with the ops before it (unit 0: the
embedding) or after it (the last unit: the head and the loss); a cut after unit ``k``
is named by the IR name of block ``k``'s last op node, where the runtime splits.
A cut where a tensor that is not floating point crosses (it carries no gradient) is
not a candidate. Which tensors cross a cut follows the runtime's split: the results of
ops that depend on a parameter, computed before the cut and read after it
(ops that depend on no parameter run again in every stage that reads them).

**Stage costs without a compile per cut.** For each candidate group (a contiguous run
of hosts in rank order; groups of the same devices are priced once) and each ``m``,
the graph exported at the micro-batch size ``global/m`` is searched with the group's
sub-profile (:func:`hapd.compiler.driver.search_program`: the search ⇄ LP rounds and
the data-parallel candidate, without memory caps), and its steps' costs under the LP's
ratios are summed per unit. Repeated blocks are searched once: the graph searched
keeps three of each run of identical blocks (besides the embedding and the head), its
programs are weighed as the whole graph's for the LP, and the blocks dropped cost what
the kept ones they repeat do (:mod:`hapd.compiler.repeats`; a group whose program
there stands for none of the whole graph is searched on the whole graph), so a
96-layer transformer's groups cost the searches of a 5-layer one. A stage's time per
micro-batch on units ``[k0, k1)`` is then a difference of prefix sums. A step's
compute row is forward plus backward (the backward twice the forward, as the core
prices it); its collectives are split into forward and backward halves where they
carry a gradient; the gradient all-reduce of its replicated parameters (its sources'
``grad_sync`` rows) is the stage's gradient sync, once per iteration. Each op also costs the profile's
``op_seconds`` (the slowest device's) once forward and twice backward per micro-batch:
the core prices FLOPs, and 16 micro-batches run every op 16 times (the SPMD plan it
competes with gets its ops' dispatch once).

**The 1F1B critical path** of stages ``s = 0…S−1`` with per-micro-batch compute
``u_s = f_s + b_s``, point-to-point time ``c_j`` of cut ``j`` (the boundary's
activations forward and their gradients backward, ``2·Σ (α + bytes/β)`` per
micro-batch, at the profile's ``p2p`` link across hosts, else ``broadcast``'s) and
gradient sync ``y_s``::

    T = Σ_s u_s + Σ_j c_j  +  (m − 1) · P  +  max_s y_s
    P = max_s max(u_s,  c_s / 2,  (Σ_{k≥s} u_k + Σ_{j≥s} c_j) / (S − s)  if m > S − s)

The DP prices its candidates with this closed form; the plan's prediction
(``per_iteration``, ``bubble``) is the found stages' schedule simulated event by event
(:func:`simulate_one_f_one_b`, plus the syncs), which the closed form follows within a
fraction of a period. The first two terms are one micro-batch's way through every stage
and back (the pipeline's fill and drain), the third the steady state, the last the groups' gradient
all-reduces, run side by side after the last backward. The runtime sends
asynchronously and posts each receive a schedule step ahead, so transfers overlap
computation: the period ``P`` is the slowest stage's compute, the busiest link
direction (a cut's activations one way, their gradients the other), or a stage's
round trip — its micro-batch's way through every later stage and back — over the
``S − s`` micro-batches 1F1B lets stage ``s`` hold in flight (when ``m`` exceeds them;
with two stages ``(u_0 + u_1 + c)/2``: a transfer hides behind the other stage's
micro-batch). A parameter that blocks on both sides of a cut read (a tied
embedding and head) is held by both stages, and its gradient summed between their
groups once per iteration, ``α + bytes/β`` at the profile's all-reduce (or
``grad_sync``) link across hosts, added to ``T``: a constant for the tied embedding
(every cut splits it); for a parameter shared by blocks in the middle, the DP does
not see it, and it is added to the pipeline it finds. The **bubble** is the share of
the pipelined time an average stage does not compute:
``1 − m·Σ_s u_s / (S · (T − max_s y_s))``; ``(S−1)/(m+S−1)`` for equal stages without
transfers.

**The search** (:func:`best_split`): for each ``m``, a dynamic program from the last
stage backwards over (hosts left, units left) keeps the front of (suffix fill, period,
largest sync, stage count) of the stages placed so far that no other entry beats
whatever the earlier stages are; the optimum of ``T`` extends one of them:
O(H²·B²·front) for H hosts and B units. Every pipeline
uses every host and at least two stages; the pure SPMD plan (the ordinary compile of
the global batch) is the other candidate, and the cheaper wins.

A program that updates buffers (batch norm's running statistics) gets no pipeline:
the runtime's stages do not run it (:mod:`hapd.compiler.stages`).

**Memory** (with ``CompileOptions.memory_caps``, the default): a stage must fit its
group. The group's search runs without caps; its plan's memory parts are scaled to a
stage's units (:class:`UnitMemory`: parameter state by the units' share of parameter
bytes, saved activations by their share of op result bytes times the
``min(S − s, m)`` micro-batches 1F1B keeps in flight on stage ``s``, the rest whole),
and the DP drops the stages that do not fit (:data:`StageFits`). Not priced: ops
without a parameter dependency recomputed in several stages.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, Sequence

from hapd.compiler.lp import row_values
from hapd.compiler.repeats import reduce_graph
from hapd.compiler.search import search_program
from hapd.errors import GraphError, OptionsError, SynthesisError
from hapd.profile.schema import Link, Profile

if TYPE_CHECKING:
    from hapd.compiler.lower import GraphIR
    from hapd.compiler.options import CompileOptions
    from hapd.compiler.repeats import Reduction

SCHEDULE = "1f1b"
"""The one micro-batch schedule priced and run."""
DEFAULT_MICRO_BATCHES = (1, 2, 4, 8, 16)
"""Micro-batch counts a caller exports graphs for by default (:func:`micro_batch_counts`)."""

_FLOAT_DTYPES = {"float64", "float32", "float16", "bfloat16"}
_DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "none": 0,
}


# --------------------------------------------------------------------------- the graph


@dataclass(frozen=True, kw_only=True)
class Unit:
    """A block of the graph with the ops that run between it and its neighbours."""

    blocks: tuple[str, ...]
    """Its block labels (one, unless blocks' ops interleave and cannot be cut apart)."""
    last_node: str
    """IR name of its last block op: a cut after this unit splits there."""
    last_index: int
    """Index of that node in the graph."""


@dataclass(frozen=True, kw_only=True)
class GraphUnits:
    """Where a graph may be cut, and what crosses each cut."""

    units: tuple[Unit, ...]
    """The units in program order."""
    crossing: tuple[tuple[float, ...] | None, ...]
    """Per cut ``k`` (after unit ``k-1``; index 0 and ``len(units)`` unused), the bytes
    of each tensor crossing it, or ``None`` when it cannot be cut there."""
    unit_of: Mapping[str, int]
    """Op node name → its unit."""
    shared: tuple[tuple[str, int, int, float], ...] = ()
    """Trainable parameters read by several units (tied embeddings): name, first and
    last unit that read it, bytes. A cut between them puts it in two stages, whose
    gradients must then be summed across their groups once per iteration."""

    @property
    def cuts(self) -> list[int]:
        """Cut positions ``k`` (units before the cut) that may be cut."""
        return [k for k in range(1, len(self.units)) if self.crossing[k] is not None]

    def split_parameters(self, cut_positions: Sequence[int]) -> list[tuple[str, float]]:
        """The shared parameters (name, bytes) that cuts at ``cut_positions`` split."""
        return [(name, size) for name, first, last, size in self.shared
                if any(first < k <= last for k in cut_positions)]


def graph_units(doc: Mapping[str, Any]) -> GraphUnits:
    """The units of the lowered graph ``doc`` (blocks in order of their first op; blocks
    whose op ranges overlap form one unit) and the tensors crossing each cut."""
    nodes = doc["nodes"]
    spans: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        label = node.get("block")
        if node.get("kind") == "op" and label:
            span = spans.setdefault(label, [i, i])
            span[1] = i
    merged: list[tuple[list[str], int, int]] = []
    for label, (first, last) in sorted(spans.items(), key=lambda item: item[1][0]):
        if merged and first <= merged[-1][2]:
            merged[-1] = (merged[-1][0] + [label], merged[-1][1], max(merged[-1][2], last))
        else:
            merged.append(([label], first, last))
    units = tuple(Unit(blocks=tuple(b), last_node=nodes[last]["name"], last_index=last) for b, _, last in merged)
    ends = [u.last_index for u in units]
    unit_of: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if node.get("kind") == "op":
            unit_of[node["name"]] = min(bisect.bisect_left(ends, i), max(len(units) - 1, 0))
    readers: dict[int, set[int]] = {}
    for node in nodes:
        if node.get("kind") == "op":
            for ref in node.get("inputs", []):
                readers.setdefault(int(ref[0]), set()).add(unit_of[node["name"]])
    shared = tuple(
        (node["name"], min(readers[i]), max(readers[i]), _bytes(node["outputs"][0]))
        for i, node in enumerate(nodes)
        if node.get("kind") == "parameter" and node.get("requires_grad", True) and len(readers.get(i, ())) > 1
    )
    return GraphUnits(units=units, crossing=_crossing(nodes, ends), unit_of=unit_of, shared=shared)


def _crossing(nodes: Sequence[Mapping[str, Any]], ends: Sequence[int]) -> tuple[tuple[float, ...] | None, ...]:
    """Per cut after ``ends[k-1]``, the bytes of the parameter-dependent op results
    computed up to it and read after it (``None`` where one is not floating point)."""
    heavy = [False] * len(nodes)
    last_read: dict[tuple[int, int], int] = {}
    for i, node in enumerate(nodes):
        kind = node.get("kind")
        refs = [(int(r[0]), int(r[1])) for r in node.get("inputs", [])]
        if kind == "parameter":
            heavy[i] = True  # as the runtime's split counts them, trainable or not
        elif kind == "op":
            heavy[i] = any(heavy[n] for n, _ in refs)
        for ref in refs:
            last_read[ref] = max(last_read.get(ref, -1), i)
    results = sorted((ref, reader) for ref, reader in last_read.items() if heavy[ref[0]] and nodes[ref[0]].get("kind") == "op")
    out: list[tuple[float, ...] | None] = [None]
    for end in ends[:-1]:
        sizes: list[float] | None = []
        for (n, k), reader in results:
            if n > end:
                break
            if end < reader:
                meta = nodes[n]["outputs"][k]
                if meta["dtype"] not in _FLOAT_DTYPES:
                    sizes = None
                    break
                sizes.append(_bytes(meta))
        out.append(tuple(sizes) if sizes is not None else None)
    out.append(None)
    return tuple(out)


def _bytes(meta: Mapping[str, Any]) -> float:
    elements = 1
    for d in meta["shape"]:
        elements *= int(d)
    return float(elements * _DTYPE_BYTES.get(meta["dtype"], 8))


def graph_batch(doc: Mapping[str, Any]) -> int:
    """The batch size of a lowered graph: the length of its inputs' batch dims.
    :class:`GraphError` when it has no batch dim or its inputs disagree."""
    sizes = {int(n["outputs"][0]["shape"][n["batch_dim"]]) for n in doc["nodes"]
             if n.get("kind") == "input" and n.get("batch_dim") is not None}
    if len(sizes) != 1:
        raise GraphError(f"graph {doc.get('name')!r}: its inputs have batch sizes {sorted(sizes)}; "
                         "a pipeline needs one batch size to cut into micro-batches", field="batch_dim")
    return sizes.pop()


def micro_batch_counts(batch: int, candidates: Sequence[int] = DEFAULT_MICRO_BATCHES) -> list[int]:
    """The micro-batch counts of ``candidates`` that divide the global ``batch``."""
    return [m for m in candidates if m >= 1 and batch % m == 0]


# --------------------------------------------------------------------------- costs


@dataclass(frozen=True, kw_only=True)
class UnitCosts:
    """Per unit, one micro-batch's seconds on one group under its SPMD plan, and the
    gradient sync per iteration; with prefix sums."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    sync: tuple[float, ...]
    _prefix: tuple[tuple[float, ...], ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        prefix = []
        for values in (self.forward, self.backward, self.sync):
            sums = [0.0]
            for v in values:
                sums.append(sums[-1] + v)
            prefix.append(tuple(sums))
        object.__setattr__(self, "_prefix", tuple(prefix))

    def range(self, k0: int, k1: int) -> tuple[float, float, float]:
        """(forward, backward, sync) of units ``[k0, k1)``."""
        return tuple(p[k1] - p[k0] for p in self._prefix)  # type: ignore[return-value]


def unit_costs(program: Mapping[str, Any], ratios: Sequence[float], unit_of: Mapping[str, int], units: int) -> UnitCosts:
    """The steps of ``program`` under ``ratios`` summed per unit (see the module
    docstring for the forward/backward split)."""
    forward, backward, sync = [0.0] * units, [0.0] * units, [0.0] * units
    n = len(ratios)
    for step in program["steps"]:
        u = unit_of.get(step["node"])
        if u is None:
            continue
        comp = max(row_values(step["comp"], ratios), default=0.0)
        synced = [0.0] * n
        for source in step["sources"]:
            if source["grad_sync"]:
                synced = [a + b for a, b in zip(synced, row_values(source["cost"], ratios))]
        comm = max((c - s for c, s in zip(row_values(step["comm"], ratios), synced)), default=0.0)
        comm = max(comm, 0.0)
        times = [(max(row_values(c["cost"], ratios), default=0.0), bool(c["grad"])) for c in step["comms"]]
        total = sum(t for t, _ in times)
        back = 0.5 * sum(t for t, grad in times if grad) / total if total > 0 else 0.0
        forward[u] += comp / 3 + comm * (1 - back)
        backward[u] += 2 * comp / 3 + comm * back
        sync[u] += max(synced, default=0.0)
    return UnitCosts(forward=tuple(forward), backward=tuple(backward), sync=tuple(sync))


def op_counts(doc: Mapping[str, Any], unit_of: Mapping[str, int], units: int) -> list[int]:
    """Op nodes of the graph ``doc`` per unit."""
    counts = [0] * units
    for node in doc["nodes"]:
        if node.get("kind") == "op" and node["name"] in unit_of:
            counts[unit_of[node["name"]]] += 1
    return counts


def op_dispatch(profile: Profile) -> float:
    """Seconds one op costs beyond its FLOPs on the slowest of ``profile``'s devices
    (their ``op_seconds``; 0 when the profile does not give it)."""
    return max((d.op_seconds or 0.0 for d in profile.devices), default=0.0)


def with_dispatch(costs: UnitCosts, ops: Sequence[int], seconds: float) -> UnitCosts:
    """``costs`` with each unit's ops dispatched once forward and twice backward at
    ``seconds`` each: the core prices FLOPs, not how many ops carry them, and a stage
    runs every op once per micro-batch (so many small micro-batches pay it many times)."""
    if seconds <= 0:
        return costs
    return UnitCosts(forward=tuple(f + n * seconds for f, n in zip(costs.forward, ops)),
                     backward=tuple(b + 2 * n * seconds for b, n in zip(costs.backward, ops)), sync=costs.sync)


@dataclass(frozen=True, kw_only=True)
class UnitMemory:
    """A stage's peak bytes per device on one group, from the group's plan of the whole
    micro-batch graph, as the core's memory model adds its parts
    (``rustcore/core/src/memory.rs``, ``Breakdown``): the larger of the backward pass's
    bytes (parameters, optimizer state, inputs, saved activations, the largest
    collective's buffer, the transient workspace) and the optimizer step's (parameters,
    gradients, optimizer state and temporaries, inputs). The parameter parts are scaled
    by the stage's share of the parameter bytes, the saved activations by its share of
    the op results' bytes times the micro-batches it holds in flight; inputs, buffers and
    workspace count whole. An estimate by proportion, not a compile of the stage:
    repeated blocks make it close, and the whole-graph rest keeps it on the safe side."""

    parts: Mapping[str, tuple[float, ...]]
    """Per part (the plan's ``memory_parts`` names), per device, of the whole graph."""
    capacity: tuple[float, ...]
    """Per device, its memory."""
    state_share: tuple[float, ...]
    """Prefix sums over units of each unit's share of the parameter bytes."""
    activation_share: tuple[float, ...]
    """Prefix sums over units of each unit's share of the op results' bytes."""

    def peak(self, k0: int, k1: int, in_flight: int) -> list[float]:
        """Per device, the bytes of units ``[k0, k1)`` with ``in_flight`` micro-batches."""
        fs = self.state_share[k1] - self.state_share[k0]
        fa = (self.activation_share[k1] - self.activation_share[k0]) * in_flight
        out = []
        for d in range(len(self.capacity)):
            part = {name: values[d] for name, values in self.parts.items()}.get
            state = fs * (part("parameters", 0.0) + part("optimizer", 0.0))
            backward = (state + part("inputs", 0.0) + fa * part("activations", 0.0) + part("communication", 0.0)
                        + part("workspace", 0.0))
            update = (state + fs * (part("gradients", 0.0) + part("optimizer_temporaries", 0.0))
                      + part("inputs", 0.0))
            out.append(max(backward, update))
        return out

    def fits(self, k0: int, k1: int, in_flight: int) -> bool:
        return all(p <= c for p, c in zip(self.peak(k0, k1, in_flight), self.capacity))


def unit_memory(program: Mapping[str, Any], ratios: Sequence[float], doc: Mapping[str, Any], unit_of: Mapping[str, int],
                units: int, capacity: Sequence[float], *, searched: Mapping[str, Any] | None = None) -> UnitMemory:
    """:class:`UnitMemory` of ``program`` (a group's plan of the graph ``doc``, or of
    ``searched``, the graph with repeated blocks dropped that stands for it) under
    ``ratios`` on devices of ``capacity`` bytes. A program of ``searched`` has its
    parameter and activation parts scaled by how many more parameter and op result
    bytes ``doc`` has (the dropped blocks repeat the kept ones' layouts), and its
    collectives' buffer at least the gradient bucket the scaled gradients fill. A parameter
    counts in every unit that reads it (a tied embedding is held by both its stages)."""
    from hapd.compiler.ratios import part_memory

    parts = {name: tuple(values) for name, values in part_memory(dict(program), ratios).items()}
    state, acts, total_state = _unit_bytes(doc, unit_of, units)
    if searched is not None:
        _, searched_acts, searched_state = _unit_bytes(searched, {}, 0)
        scale = {"activations": sum(acts) / searched_acts[0] if searched_acts[0] > 0 else 1.0}
        for name in ("parameters", "gradients", "optimizer", "optimizer_temporaries"):
            scale[name] = total_state / searched_state if searched_state > 0 else 1.0
        parts = {name: tuple(v * scale.get(name, 1.0) for v in values) for name, values in parts.items()}
        if "communication" in parts and "gradients" in parts:  # its gradient bucket grows with the parameters
            from hapd._core import GRAD_BUCKET_BYTES

            parts["communication"] = tuple(max(c, min(g, GRAD_BUCKET_BYTES))
                                           for c, g in zip(parts["communication"], parts["gradients"]))

    def prefix(values: Sequence[float], total: float) -> tuple[float, ...]:
        out = [0.0]
        for v in values:
            out.append(out[-1] + (v / total if total > 0 else 0.0))
        return tuple(out)

    return UnitMemory(parts=parts, capacity=tuple(float(c) for c in capacity), state_share=prefix(state, total_state),
                      activation_share=prefix(acts, sum(acts)))


def _unit_bytes(doc: Mapping[str, Any], unit_of: Mapping[str, int], units: int) -> tuple[list[float], list[float], float]:
    """(parameter bytes each unit reads, op result bytes of each unit, all parameter
    bytes) of the graph ``doc``; with no units, every op counts in one."""
    nodes = doc["nodes"]
    state = [0.0] * max(units, 1)
    acts = [0.0] * max(units, 1)
    readers: dict[int, set[int]] = {}
    for node in nodes:
        if node.get("kind") == "op" and (node["name"] in unit_of or not units):
            u = unit_of.get(node["name"], 0)
            acts[u] += sum(_bytes(meta) for meta in node.get("outputs", []))
            for ref in node.get("inputs", []):
                readers.setdefault(int(ref[0]), set()).add(u)
    total_state = 0.0
    for i, node in enumerate(nodes):
        if node.get("kind") == "parameter":
            size = _bytes(node["outputs"][0])
            total_state += size
            for u in readers.get(i, ()):
                state[u] += size
    return state, acts, total_state


def p2p_link(profile: Profile) -> Link:
    """The link a boundary's activations cross between two hosts: the profile's
    ``p2p`` (measured by ``hapd profile``), else its ``broadcast`` (one message from
    one rank to the others)."""
    links = profile.collectives.get("p2p") or profile.collectives["broadcast"]
    return links["inter"]


def boundary_seconds(sizes: Sequence[float], link: Link) -> float:
    """Point-to-point seconds of one micro-batch at a cut: each crossing tensor forward
    and its gradient backward, one message each."""
    return sum(2 * (link.alpha + b / link.beta) for b in sizes)


# --------------------------------------------------------------------------- 1F1B


def one_f_one_b(stage_times: Sequence[float], boundaries: Sequence[float], syncs: Sequence[float], micro_batches: int) -> float:
    """Seconds per iteration of a 1F1B pipeline (the module docstring's ``T``): stages
    of ``stage_times`` seconds per micro-batch (forward + backward), ``boundaries[j]``
    the point-to-point seconds of one micro-batch between stages ``j`` and ``j+1``
    (activations forward and their gradients back), ``syncs`` each stage's gradient
    sync, ``micro_batches`` micro-batches."""
    if len(boundaries) != len(stage_times) - 1 or len(syncs) != len(stage_times):
        raise ValueError(f"{len(stage_times)} stages need {len(stage_times) - 1} boundaries and as many syncs")
    fill = sum(stage_times) + sum(boundaries)  # one micro-batch's way there and back
    return fill + (micro_batches - 1) * steady_period(stage_times, boundaries, micro_batches) + max(syncs)


def steady_period(stage_times: Sequence[float], boundaries: Sequence[float], micro_batches: int) -> float:
    """Seconds between two micro-batches in the steady state (the module docstring's
    ``P``): the slowest stage's compute, the busiest link direction, and each stage's
    round trip over the micro-batches it may hold in flight."""
    period, way = 0.0, 0.0
    last = len(stage_times) - 1
    for s in range(last, -1, -1):
        out = boundaries[s] if s < last else 0.0
        way += stage_times[s] + out
        period = max(period, stage_times[s], out / 2, _round_trip(way, last + 1 - s, micro_batches))
    return period


def _round_trip(way: float, stages_after: int, micro_batches: int) -> float:
    """The period a stage's round trip ``way`` (through the ``stages_after`` stages from
    it to the last and back) forces when 1F1B lets it hold only that many micro-batches
    in flight; none when every micro-batch fits in flight at once."""
    return way / stages_after if micro_batches > stages_after else 0.0


def simulate_one_f_one_b(forward: Sequence[float], backward: Sequence[float], boundaries: Sequence[float],
                         micro_batches: int) -> float:
    """Seconds from the first forward to the last backward of a 1F1B pipeline, event by
    event: stage ``s`` of ``S`` runs ``min(S − s − 1, m)`` warm-up forwards, then one
    forward and one backward in turn (``forward[s]``, ``backward[s]`` seconds per
    micro-batch), each as soon as its input is there; a cut's activations take
    ``boundaries[j] / 2`` one way and their gradients as long the other, one message at
    a time per direction, sent as the op that makes them ends (sends are asynchronous).

    What the plan predicts for the stages the DP found (:func:`one_f_one_b`'s closed
    form prices the DP's candidates; it can be off by a fraction of a period where
    unequal stages interlock, which this is not). Runs in ``O(S·m)``."""
    S, m = len(forward), micro_batches
    if len(backward) != S or len(boundaries) != S - 1:
        raise ValueError(f"{S} stages need {S} backward times and {S - 1} boundaries")
    order = []
    for s in range(S):
        warm = min(S - s - 1, m)
        ops = [(True, i) for i in range(warm)]
        for i in range(m):
            if warm + i < m:
                ops.append((True, warm + i))
            ops.append((False, i))
        order.append(ops)
    arrive: dict[tuple[bool, int, int], float] = {}
    link = {(j, d): 0.0 for j in range(S - 1) for d in (True, False)}
    clock, pos = [0.0] * S, [0] * S
    moved = True
    while moved:
        moved = False
        for s in range(S):
            while pos[s] < len(order[s]):
                is_forward, i = order[s][pos[s]]
                if is_forward:
                    ready = 0.0 if s == 0 else arrive.get((True, s, i))
                else:
                    ready = 0.0 if s == S - 1 else arrive.get((False, s, i))  # the last: after its forward
                if ready is None:
                    break
                clock[s] = max(clock[s], ready) + (forward[s] if is_forward else backward[s])
                j, peer = (s, s + 1) if is_forward else (s - 1, s - 1)
                if 0 <= j < S - 1:
                    sent = max(clock[s], link[(j, is_forward)]) + boundaries[j] / 2
                    link[(j, is_forward)] = sent
                    arrive[(is_forward, peer, i)] = sent
                pos[s] += 1
                moved = True
    return max(clock)


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
    def of(cls, hosts: int, units: int, stage: StageCost, micro_batches: int) -> "_Bound":
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
        first = _round_trip(fill, count + h, self.micro_batches) if h > 0 else 0.0
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
                        period = max(least_period, u, c / 2, _round_trip(way, most + 1, m))
                        if bound.least(h0, k0, way, period, max(least_sync, y), most + 1) >= best.cost:
                            continue  # no entry of this front can do better through this stage
                    target = None if final else fronts.setdefault((h0, k0), [])
                    for way, period, sync, count, spans in front:
                        if not fits(h0, h, k0, k, min(count + 1, m)):
                            continue
                        new_way = way + u + c
                        entry = (new_way, max(period, u, c / 2, _round_trip(new_way, count + 1, m)), max(sync, y),
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
    """The pure SPMD plan's estimate it competed with, with its ops' dispatch added as
    the stages' is (the profile's ``op_seconds``: once per op forward, twice backward)."""
    chosen: bool
    """Whether it beat the SPMD plan: the runtime runs the pipeline only then."""
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
    def from_doc(cls, doc: Mapping[str, Any]) -> "PipelinePlan":
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


def host_groups(profile: Profile) -> dict[tuple[int, int], Group]:
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
    repeated blocks were dropped (:mod:`hapd.compiler.repeats`)."""
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


def stage_table(ir: "GraphIR", profile: Profile, options: "CompileOptions", *, repeats: bool = True) -> StageTable:
    """Price the micro-batch graph ``ir`` on every group of ``profile``'s hosts: one
    search per distinct group (:func:`hapd.compiler.driver.search_program` with the
    group's sub-profile, no memory caps), its steps summed per unit. With ``repeats``
    the search runs on the graph with its repeated blocks dropped, when it has some
    (:mod:`hapd.compiler.repeats`), and each dropped block costs what the kept blocks
    it repeats do; a group whose search there fails, or finds a program that stands
    for none of the whole graph, is searched on the whole graph."""
    group_options = replace(options, pipeline="off", memory_caps=False, recompute="never", overlap=False, ratios=None)
    doc = ir.doc
    units = graph_units(doc)
    count = len(units.units)
    groups = host_groups(profile)
    batch = graph_batch(doc)
    reduction = reduce_graph(doc, units.unit_of, count) if repeats and count >= 2 and units.cuts else None
    priced_units = reduction.kept if reduction is not None else count
    costs: dict[str, UnitCosts | None] = {}
    memory: dict[str, UnitMemory] = {}
    ops = op_counts(doc, units.unit_of, count)
    searches = whole = 0
    if count >= 2 and units.cuts:
        for group in groups.values():
            if group.key in costs:
                continue
            costs[group.key] = None
            if batch < len(group.ranks):
                continue  # fewer samples than ranks
            sub = profile.subset(group.ranks, name=f"{profile.name}:{'+'.join(group.hosts)}")
            capacity = [d.memory for d in sub.devices]
            found = _reduced_costs(reduction, count, sub, group_options) if reduction is not None else None
            searched = reduction.ir.doc if found is not None and reduction is not None else None
            if found is None:
                if reduction is not None:
                    whole += 1
                try:
                    program, ratios = search_program(ir.data, sub, group_options)
                except SynthesisError:
                    continue
                found = unit_costs(program, ratios, units.unit_of, count), (program, ratios)
            searches += 1
            costs[group.key] = with_dispatch(found[0], ops, op_dispatch(sub))
            if options.memory_caps:
                program, ratios = found[1]
                memory[group.key] = unit_memory(program, ratios, doc, units.unit_of, count, capacity, searched=searched)
    link = p2p_link(profile)
    boundary = tuple(boundary_seconds(c, link) if c is not None else 0.0 for c in units.crossing)
    summed = (profile.collectives.get("grad_sync") or profile.collectives["all_reduce"])["inter"]
    return StageTable(units=units, groups=groups, costs=costs, boundary=boundary, searches=searches, sum_link=summed,
                      priced_units=priced_units, whole_searches=whole, memory=memory)


def _reduced_costs(
    reduction: "Reduction", count: int, profile: Profile, options: "CompileOptions"
) -> "tuple[UnitCosts, tuple[dict, list[float]]] | None":
    """The ``count`` units' costs on the group of ``profile`` (its sub-profile) searched
    on ``reduction``'s graph, and that program with its ratios; ``None`` when that
    search fails or its program stands for no program of the whole graph
    (:meth:`hapd.compiler.repeats.Reduction.cycles`)."""
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
    graphs: Mapping[int, "GraphIR"], profile: Profile, options: "CompileOptions", spmd_only: float,
    *, repeats: bool = True,
) -> PipelineSearch:
    """The best pipeline for ``profile`` over the micro-batch counts of ``graphs``
    (micro-batch count → the graph exported at the global batch over it), against the
    SPMD plan's ``spmd_only`` seconds per iteration; ``repeats``: groups priced on the
    graphs with their repeated blocks dropped (:func:`stage_table`)."""
    start = time.perf_counter()
    whole = graphs[min(graphs)].doc
    spmd_only += 3 * sum(1 for n in whole["nodes"] if n.get("kind") == "op") * op_dispatch(profile)
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
        table = stage_table(graphs[m], profile, options, repeats=repeats)
        priced += table.searches
        if len(table.units.units) < 2 or not table.units.cuts:
            reason = f"the graph has {len(table.units.units)} blocks and no cut between them"
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
    plan = _plan(split, m, graphs[m], table, spmd_only)
    return PipelineSearch(best=plan, seconds=seconds, groups_priced=priced, tried=tuple(tried))


def _plan(split: Split, m: int, ir: "GraphIR", table: StageTable, spmd_only: float) -> PipelinePlan:
    """The :class:`PipelinePlan` of the stages ``split`` found for ``m`` micro-batches."""
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
        chosen=split.cost < spmd_only, shared_sync=shared, shared_parameters=tuple(names),
    )


def micro_batch_graphs(full: "GraphIR", others: Sequence["GraphIR"]) -> dict[int, "GraphIR"]:
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
    "DEFAULT_MICRO_BATCHES", "GraphUnits", "Group", "PipelinePlan", "PipelineSearch", "PipelineStage",
    "SCHEDULE", "Split", "StageTable", "Unit", "UnitCosts", "best_split", "boundary_seconds",
    "graph_batch", "graph_units", "host_groups", "micro_batch_counts",
    "micro_batch_graphs", "one_f_one_b", "p2p_link", "search", "simulate_one_f_one_b", "split_cost", "stage_table",
    "steady_period", "unit_costs",
]
