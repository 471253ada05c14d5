"""The pipeline cost model: where a graph may be cut into stages (units and what crosses
each cut), what a unit costs and holds on a group of hosts under its SPMD plan, the
point-to-point link between groups, and the 1F1B schedule's time in closed form and
simulated. ``docs/pipelines.md`` derives it; :mod:`hapd.compiler.pipeline.stage_search`
searches with it."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from hapd._core import GRAD_BUCKET_BYTES
from hapd.compiler.lp import row_values
from hapd.compiler.ratios import part_memory
from hapd.errors import GraphError
from hapd.profile.schema import Link, Profile


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
    """The steps of ``program`` under ``ratios`` summed per unit (``docs/pipelines.md``
    says how a step splits into forward and backward)."""
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
        if units and node.get("kind") == "op" and node["name"] in unit_of:  # a graph without blocks has no unit
            counts[unit_of[node["name"]]] += 1
    return counts


COST_MODEL_REVISION = "pipeline-2"
"""Revision of the pipeline pricing: part of the plan cache's key
(:class:`hapd.serve.cache.CacheKey`), so a plan priced by an older model is not served
for the same graph and profile. ``pipeline-2``: random ops' draws dispatched kernel by
kernel and the micro-batches' gradient accumulation (:func:`op_kernels`,
:func:`accumulation_seconds`)."""

OP_KERNELS = (1, 2)
"""Kernels an op dispatches forward and backward, as :func:`hapd.profiler.measure.op_seconds`
counts them: the profile's ``op_seconds`` is a third of one probe op's forward and backward."""
DROPOUT_OPS = frozenset({"aten.native_dropout", "aten.dropout", "aten.bernoulli", "aten.bernoulli.p",
                         "aten.rand_like", "aten.randn_like"})
"""IR ops the runtime draws with hapd's counter-based generator (``hapd.spmd.random.random_ops``:
its dropouts and other random ops), besides an attention with ``dropout_p > 0``."""
ATTENTION_OP = "aten.scaled_dot_product_attention"


def _draw_kind(node: Mapping[str, Any]) -> str | None:
    """``"dropout"`` for an op the runtime draws as a dropout, ``"attention"`` for an
    attention with dropout (drawn and run as the math attention), else ``None``."""
    op = node.get("op")
    if op in DROPOUT_OPS:
        return "dropout"
    if op == ATTENTION_OP:
        for arg in node.get("args", ()):
            if arg.get("name") == "dropout_p":
                value = arg.get("value", {}).get("f", 0.0)
                return "attention" if value and float(value) > 0.0 else None
    return None


DRAW_KERNELS: Mapping[str, tuple[int, int, int]] = {"dropout": (56, 5, 6), "attention": (75, 5, 27)}
"""Kernels the runtime dispatches for one random op where it draws with hapd's
counter-based generator in torch ops (devices without its fused kernels: a CPU), by
kind: (forward for a 0-dim draw, forward per dim of the drawn tensor, backward).
``"dropout"`` is :class:`hapd.spmd.random.random_ops.CounterDropout`, ``"attention"``
:class:`hapd.spmd.random.random_ops.CounterAttention` (the math attention and the
draw of its probabilities' mask). Counted on the runtime's own modules under a dispatch
counter (each aten call the dispatcher runs): a draw is SplitMix64 in ~15 int64 ops,
its index and key arithmetic a few per dim, ~70 kernels a 3-dim dropout and ~120 a
4-dim attention, where a plain op dispatches 3. The compiler sits below the runtime and
does not import it: ``tests/compiler/test_pipeline_search.py`` counts the runtime's
kernels again and fails when they no longer match. A draw of up to
``counter_rng.CHUNK`` elements: each further chunk adds its passes, which its FLOPs
(the core's ``FLOPS_PER_ELEMENT``) already price."""


def draw_kernels(kind: str, rank: int) -> tuple[int, int]:
    """Kernels (forward, backward) of one random op of ``kind`` (:data:`DRAW_KERNELS`)
    drawing a tensor of ``rank`` dims (an attention: its query's)."""
    base, per_dim, backward = DRAW_KERNELS[kind]
    return base + per_dim * rank, backward


PARAMETER_KERNELS = (1, 1)
"""Dispatches a trainable parameter a unit reads costs forward and backward per
micro-batch as the runtime runs a stage: the interpreter fetches it (a ``get_attr``
node) and autograd accumulates its gradient (an ``AccumulateGrad`` node, beyond the
add :func:`accumulation_seconds` prices). Measured on a third of a core: ~12 µs and
~30 µs a parameter, the profile's ``op_seconds`` there 17 µs."""


def op_kernels(doc: Mapping[str, Any], unit_of: Mapping[str, int], units: int, *,
               counter_draws: bool = True) -> tuple[list[int], list[int]]:
    """Per unit, the kernels its ops dispatch forward and backward per micro-batch:
    :data:`OP_KERNELS` an op, and with ``counter_draws`` (devices that draw in torch ops,
    see :func:`draw_kernels`) a random op's counted draw; and :data:`PARAMETER_KERNELS`
    for each trainable parameter it reads. The profile's ``op_seconds`` prices each:
    measured, a stage on a third of a CPU core pays ~15 µs a kernel, and a counter
    dropout's ~70 kernels (1.0 ms there, a plain op's 0.13 ms) are most of what a
    micro-batch costs beyond its FLOPs."""
    forward, backward = [0] * units, [0] * units
    readers: dict[int, set[int]] = {}
    for node in doc["nodes"]:
        if not units or node.get("kind") != "op" or node["name"] not in unit_of:
            continue  # a graph without blocks has no unit
        u = unit_of[node["name"]]
        kind = _draw_kind(node) if counter_draws else None
        f, b = draw_kernels(kind, len(node["outputs"][0]["shape"])) if kind else OP_KERNELS
        forward[u] += f
        backward[u] += b
        for ref in node.get("inputs", []):
            readers.setdefault(int(ref[0]), set()).add(u)
    for i, node in enumerate(doc["nodes"]):
        if node.get("kind") == "parameter" and node.get("requires_grad", True):
            for u in readers.get(i, ()):
                forward[u] += PARAMETER_KERNELS[0]
                backward[u] += PARAMETER_KERNELS[1]
    return forward, backward


def graph_kernels(doc: Mapping[str, Any], *, counter_draws: bool = True) -> int:
    """Kernels (forward and backward) the ops of the whole graph ``doc`` dispatch once
    (:func:`op_kernels` over one unit holding every op)."""
    f, b = op_kernels(doc, {n["name"]: 0 for n in doc["nodes"] if n.get("kind") == "op"}, 1,
                      counter_draws=counter_draws)
    return f[0] + b[0]


def counter_draws(profile: Profile) -> bool:
    """Whether ``profile``'s devices draw random ops in torch ops (no device runs hapd's
    fused kernels, ``fused_attention``: a CPU), so a draw dispatches :func:`draw_kernels`."""
    return not any(d.fused_attention for d in profile.devices)


def op_dispatch(profile: Profile) -> float:
    """Seconds one kernel costs beyond its FLOPs on the slowest of ``profile``'s devices
    (their ``op_seconds``; 0 when the profile does not give it)."""
    return max((d.op_seconds or 0.0 for d in profile.devices), default=0.0)


def unit_parameter_elements(doc: Mapping[str, Any], unit_of: Mapping[str, int], units: int) -> list[float]:
    """Per unit, the elements of the trainable parameters its ops read (a parameter
    read by several units counts in each: each stage holding it accumulates its
    gradient)."""
    readers: dict[int, set[int]] = {}
    for node in doc["nodes"]:
        if units and node.get("kind") == "op" and node["name"] in unit_of:
            for ref in node.get("inputs", []):
                readers.setdefault(int(ref[0]), set()).add(unit_of[node["name"]])
    out = [0.0] * units
    for i, node in enumerate(doc["nodes"]):
        if node.get("kind") == "parameter" and node.get("requires_grad", True):
            elements = 1.0
            for d in node["outputs"][0]["shape"]:
                elements *= int(d)
            for u in readers.get(i, ()):
                out[u] += elements
    return out


def accumulation_seconds(elements: Sequence[float], profile: Profile, micro_batches: int) -> list[float]:
    """Per unit, seconds per micro-batch of adding its parameters' gradients into the
    gradients accumulated so far: every micro-batch's backward after the first does
    (autograd's ``AccumulateGrad``, one add an element, at the slowest device's
    ``elementwise_flops``), ``(m − 1)/m`` of them a micro-batch; the SPMD plan, one
    backward a step, adds none. The whole parameter on each device (a stage's plan
    replicates its parameters; one that splits them adds less). 0 without
    ``elementwise_flops``."""
    rates = [d.elementwise_flops for d in profile.devices if d.elementwise_flops]
    if not rates or micro_batches < 2:
        return [0.0] * len(elements)
    share = (micro_batches - 1) / micro_batches
    return [share * e / min(rates) for e in elements]


def with_dispatch(costs: UnitCosts, kernels: tuple[Sequence[int], Sequence[int]], seconds: float,
                  accumulate: Sequence[float] = ()) -> UnitCosts:
    """``costs`` with each unit's kernels (:func:`op_kernels`: forward, backward)
    dispatched at ``seconds`` each, and ``accumulate`` (:func:`accumulation_seconds`)
    added to its backward: the core prices FLOPs, not how many kernels carry them, and
    a stage runs every op once per micro-batch (so many small micro-batches pay it many
    times), accumulating its gradients each time."""
    forward, backward = kernels
    extra = list(accumulate) or [0.0] * len(costs.backward)
    if seconds <= 0 and not any(extra):
        return costs
    return UnitCosts(forward=tuple(f + n * seconds for f, n in zip(costs.forward, forward)),
                     backward=tuple(b + n * seconds + a for b, n, a in zip(costs.backward, backward, extra)),
                     sync=costs.sync)


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
                units: int, capacity: Sequence[float], *, searched: Mapping[str, Any] | None = None,
                unit_bytes: tuple[tuple[list[float], list[float], float], tuple[list[float], list[float], float] | None]
                | None = None) -> UnitMemory:
    """:class:`UnitMemory` of ``program`` (a group's plan of the graph ``doc``, or of
    ``searched``, the graph with repeated blocks dropped that stands for it) under
    ``ratios`` on devices of ``capacity`` bytes. A program of ``searched`` has its
    parameter and activation parts scaled by how many more parameter and op result
    bytes ``doc`` has (the dropped blocks repeat the kept ones' layouts), and its
    collectives' buffer at least the gradient bucket the scaled gradients fill. A parameter
    counts in every unit that reads it (a tied embedding is held by both its stages).
    ``unit_bytes``: :func:`graph_unit_bytes` of ``doc`` and ``searched``, where the caller
    prices several programs of the same graphs (they depend on the graphs alone)."""
    parts = {name: tuple(values) for name, values in part_memory(dict(program), ratios).items()}
    whole_bytes, searched_bytes = unit_bytes or graph_unit_bytes(doc, unit_of, units, searched)
    state, acts, total_state = whole_bytes
    if searched is not None:
        assert searched_bytes is not None
        _, searched_acts, searched_state = searched_bytes
        scale = {"activations": sum(acts) / searched_acts[0] if searched_acts[0] > 0 else 1.0}
        for name in ("parameters", "gradients", "optimizer", "optimizer_temporaries"):
            scale[name] = total_state / searched_state if searched_state > 0 else 1.0
        parts = {name: tuple(v * scale.get(name, 1.0) for v in values) for name, values in parts.items()}
        if "communication" in parts and "gradients" in parts:  # its gradient bucket grows with the parameters
            parts["communication"] = tuple(max(c, min(g, GRAD_BUCKET_BYTES))
                                           for c, g in zip(parts["communication"], parts["gradients"]))

    def prefix(values: Sequence[float], total: float) -> tuple[float, ...]:
        out = [0.0]
        for v in values:
            out.append(out[-1] + (v / total if total > 0 else 0.0))
        return tuple(out)

    return UnitMemory(parts=parts, capacity=tuple(float(c) for c in capacity), state_share=prefix(state, total_state),
                      activation_share=prefix(acts, sum(acts)))


def graph_unit_bytes(
    doc: Mapping[str, Any], unit_of: Mapping[str, int], units: int, searched: Mapping[str, Any] | None = None
) -> tuple[tuple[list[float], list[float], float], tuple[list[float], list[float], float] | None]:
    """What :func:`unit_memory` reads of the graphs: :func:`_unit_bytes` of ``doc`` per
    unit, and of ``searched`` (the graph with repeated blocks dropped) as one unit."""
    return _unit_bytes(doc, unit_of, units), (_unit_bytes(searched, {}, 0) if searched is not None else None)


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
    """Seconds per iteration of a 1F1B pipeline (``T`` in ``docs/pipelines.md``): stages
    of ``stage_times`` seconds per micro-batch (forward + backward), ``boundaries[j]``
    the point-to-point seconds of one micro-batch between stages ``j`` and ``j+1``
    (activations forward and their gradients back), ``syncs`` each stage's gradient
    sync, ``micro_batches`` micro-batches."""
    if len(boundaries) != len(stage_times) - 1 or len(syncs) != len(stage_times):
        raise ValueError(f"{len(stage_times)} stages need {len(stage_times) - 1} boundaries and as many syncs")
    fill = sum(stage_times) + sum(boundaries)  # one micro-batch's way there and back
    return fill + (micro_batches - 1) * steady_period(stage_times, boundaries, micro_batches) + max(syncs)


def steady_period(stage_times: Sequence[float], boundaries: Sequence[float], micro_batches: int) -> float:
    """Seconds between two micro-batches in the steady state (``P`` in
    ``docs/pipelines.md``): the slowest stage's compute, the busiest link direction, and each stage's
    round trip over the micro-batches it may hold in flight."""
    period, way = 0.0, 0.0
    last = len(stage_times) - 1
    for s in range(last, -1, -1):
        out = boundaries[s] if s < last else 0.0
        way += stage_times[s] + out
        period = max(period, stage_times[s], out / 2, round_trip(way, last + 1 - s, micro_batches))
    return period


def round_trip(way: float, stages_after: int, micro_batches: int) -> float:
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


__all__ = [
    "COST_MODEL_REVISION", "DRAW_KERNELS", "GraphUnits", "Unit", "UnitCosts", "UnitMemory", "accumulation_seconds", "boundary_seconds",
    "counter_draws", "draw_kernels", "graph_batch", "graph_kernels", "graph_units", "one_f_one_b", "op_counts",
    "op_dispatch", "op_kernels", "PARAMETER_KERNELS", "p2p_link", "round_trip", "simulate_one_f_one_b", "steady_period", "unit_costs",
    "unit_memory", "unit_parameter_elements", "with_dispatch",
]
