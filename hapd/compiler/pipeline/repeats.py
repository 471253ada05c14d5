"""Repeated blocks: price a deep model's pipeline stages on a graph that keeps a few
periods of each run of identical blocks.

The pipeline search (:mod:`hapd.compiler.pipeline.stage_search`) prices every group of hosts by
searching the micro-batch graph and summing the program's steps per **unit** (a block
with the ops between it and its neighbours). A transformer's units are mostly the same
unit over and over: the same ops on the same shapes, wired the same way to the units
before, each with its own parameters. Searching all of them costs a search that grows
with depth for an answer that repeats.

**Runs.** Unit ``v`` *repeats* unit ``u`` when their op nodes, in order, have the same
op, arguments, output shapes and dtypes and attributes (names and block labels aside),
and every input of each pair is wired alike: to the same node (an input, a parameter
several units read, an op both read), to a parameter, buffer or constant only that
unit reads with the same shape, dtype and ``requires_grad``, or to ops at the same
place of units ``v − u`` apart (the same position, or the same distance from the unit's
end where the two units differ in length: the first block's unit also holds the
embedding) with the same op and results. A **run** of period ``p`` is a sequence of
units each of which repeats the unit ``p`` before it (``p = 1`` for a transformer;
layers that alternate two kinds of block, or blocks whose sub-modules are units of
their own, have longer periods, up to :data:`MAX_PERIOD`).

**The reduced graph.** Of a run of more than :data:`KEPT` whole periods, the first
``KEPT`` periods stay and the later ones are dropped. A unit may be dropped only when
no unit but those of its period and the next reads its ops, and it reads no parameter
another unit reads. Every reference of a kept op to a dropped op is rewired to the op
at the same place in the last kept period (the units after a run read its outputs
instead of the last dropped period's: the same shapes), and the parameters only
dropped ops read are dropped with them. Units before and after the runs (the
embedding, the head and the loss) stay as they are.

**Pricing.** The search runs on the reduced graph. In the program it finds, the last
``c`` kept periods of a run form a **cycle** when they hand the next period the
tensors it reads in the layouts they were handed them in (the fewest such ``c``;
:meth:`Run.cycle`): the dropped periods can then repeat them, and the program stands
for a program of the whole graph. Each program is *weighed* before the sharding-ratio
LP and the comparison with data parallelism price it: the cycle's steps count for the
dropped periods too (their cost rows multiplied by ``1 + dropped/c``, which the LP,
whose rows that are multiples of each other share one variable, and every cost, a sum
over steps of each row's maximum over devices, read as that many copies), so the LP
weighs the blocks as the whole graph does. A dropped unit costs the mean of the cycle's
units at its place. A program without a cycle (the reduced graph's search laid out the
last kept period differently from the one before, leaning on the different units after
it) stands for none of the whole graph: that group is searched on the whole graph.

The search of the whole graph lays out identical periods alike, up to where its own
front width bounds it, so the two agree: ``tests/compiler/test_pipeline_repeats.py`` checks the
unit costs of the benchmark transformers against the whole graph's search
(``bench/pipeline_search.py`` the zoo's and the paper ViT's). Where they differ, each
is a program of the whole graph and either may be the cheaper. Searching a 96-layer
model costs what a 5-layer one does.

A graph without a run of more than ``KEPT`` periods has no reduction
(:func:`reduce_graph` answers ``None``), and is priced whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Sequence

from hapd.ir.lower import GraphIR, canonical_bytes

KEPT = 3
"""Periods kept of each run: the first (whose input may come from a different unit),
and two whose input comes from an identical period, so that a cycle may alternate two
layouts (tensor-parallel layers in pairs)."""
MAX_PERIOD = 8
"""The longest period of a run looked for, in units."""

_OWN_KINDS = ("parameter", "buffer", "constant")
"""Kinds of source node a unit may have its own of (an input is the graph's)."""
_COMPARED_APART = ("name", "block", "inputs", "outputs")
"""Node fields two units' ops do not compare as they are: names and block labels
differ between identical units; inputs and outputs are compared by :class:`_Units`."""


@dataclass(frozen=True, kw_only=True)
class Run:
    """A run of the whole graph: its kept periods, its dropped ones, and the tensors
    each period hands the next."""

    kept: tuple[tuple[int, ...], ...]
    """The units of each kept period, in order."""
    dropped: tuple[tuple[int, ...], ...]
    """The units of each dropped period."""
    exits: tuple[tuple[str, ...], ...]
    """``exits[k]``: the tensors the period after kept period ``k − 1`` reads from it
    (``exits[0]``: from the units before the run; ``exits[-1]``: from the last kept
    period, which the first dropped one would read)."""

    def cycle(self, layouts: Mapping[str, Any]) -> int:
        """The fewest last kept periods that hand on the tensors in the layouts they
        took them in (``layouts``: tensor → the layout a program computes it in), which
        the dropped periods repeat: then every period of the run can be laid out as
        they are. 0 when none does."""
        last = [layouts.get(t) for t in self.exits[-1]]
        for c in range(1, len(self.kept) + 1):
            if [layouts.get(t) for t in self.exits[-1 - c]] == last:
                return c
        return 0


@dataclass(frozen=True, kw_only=True)
class Reduction:
    """A graph with the repeated units of its runs dropped, and how its programs and
    unit costs stand for the whole graph's."""

    ir: GraphIR
    """The reduced graph."""
    units: int
    """Units of the whole graph."""
    runs: tuple[Run, ...]
    """Its runs with dropped periods."""
    unit_of: Mapping[str, int]
    """Op node name of the reduced graph → its unit in the whole graph."""
    ops: Mapping[int, tuple[str, ...]]
    """Kept unit of a run → its op node names."""

    @property
    def kept(self) -> int:
        """Units of the reduced graph."""
        return self.units - sum(len(period) for run in self.runs for period in run.dropped)

    def cycles(self, program: Mapping[str, Any]) -> tuple[int, ...] | None:
        """Per run, the kept periods the dropped ones repeat in ``program`` (a program
        of the reduced graph: :meth:`Run.cycle`), or ``None`` when one of them has none
        (the program then stands for no program of the whole graph)."""
        layouts = {out["tensor"]: out["layout"] for step in program["steps"] for out in step["outputs"]}
        cycles = tuple(run.cycle(layouts) for run in self.runs)
        return None if 0 in cycles else cycles

    def weigh(self, program: dict[str, Any]) -> dict[str, Any]:
        """The reduced graph's ``program`` priced as the whole graph's it stands for:
        the cost rows (compute, communication, gradient sync) and FLOPs of each step of
        the periods the dropped ones repeat (:meth:`cycles`; the last kept period when
        there are none) multiplied by the units it stands for, its own included."""
        weight = self._weights(self.cycles(program) or (1,) * len(self.runs))
        return {**program, "steps": [_scaled(step, weight[step["node"]]) if step["node"] in weight else step
                                     for step in program["steps"]]}

    def spread(self, values: Sequence[float], cycles: Sequence[int]) -> tuple[float, ...]:
        """Per-unit ``values`` of a program weighed with ``cycles`` (zero for the
        dropped units) for every unit: a repeated unit's own share, and a dropped
        unit's the mean of the units it repeats."""
        out = list(values)
        for run, c in zip(self.runs, cycles):
            shares = 1 + len(run.dropped) / c
            for period in run.kept[-c:]:
                for u in period:
                    out[u] = values[u] / shares
            for period in run.dropped:
                for offset, u in enumerate(period):
                    out[u] = sum(out[kept[offset]] for kept in run.kept[-c:]) / c
        return tuple(out)

    def _weights(self, cycles: Sequence[int]) -> dict[str, float]:
        weight: dict[str, float] = {}
        for run, c in zip(self.runs, cycles):
            shares = 1 + len(run.dropped) / c
            for period in run.kept[-c:]:
                for u in period:
                    weight.update((name, shares) for name in self.ops[u])
        return weight


def reduce_graph(doc: Mapping[str, Any], unit_of: Mapping[str, int], units: int) -> Reduction | None:
    """The reduced graph of the lowered graph ``doc`` whose op nodes are in the units
    ``unit_of`` (op node name → unit, ``units`` of them, in program order: what
    :func:`hapd.compiler.pipeline.stage_cost.graph_units` finds), or ``None`` when it has no run
    of more than :data:`KEPT` periods."""
    if doc.get("mutations"):
        return None  # the pipeline search does not cut such programs
    graph = _Units(doc["nodes"], unit_of, units)
    runs: list[tuple[int, int, int]] = []  # (first unit, period, whole periods)
    start = 0
    while start < units:
        period, periods = _longest_run(graph, start)
        if periods <= KEPT:
            start += 1
            continue
        runs.append((start, period, periods))
        start += periods * period
    if not runs:
        return None
    return _reduced(doc, graph, [_run(graph, *run) for run in runs])


def _run(graph: "_Units", start: int, period: int, periods: int) -> Run:
    """The run of ``periods`` periods of ``period`` units from unit ``start``."""
    spans = [tuple(range(start + k * period, start + (k + 1) * period)) for k in range(periods)]
    kept = spans[:KEPT]
    # the inputs by which the last kept period reads the one before it: those where the
    # two last kept periods read different nodes, the one before them each
    chain: list[tuple[int, int, int, int]] = []  # (offset, op position, input slot, node read)
    for offset, (u, v) in enumerate(zip(kept[-2], kept[-1])):
        for q, (i, j) in enumerate(zip(graph.ops[u], graph.ops[v])):
            for slot, (x, y) in enumerate(zip(graph.nodes[i].get("inputs", []), graph.nodes[j].get("inputs", []))):
                if int(x[0]) != int(y[0]) and graph.where.get(int(y[0]), (-1, 0))[0] in kept[-2]:
                    chain.append((offset, q, slot, int(y[0])))

    def read(k: int) -> tuple[str, ...]:
        """The tensors kept period ``k`` reads through the chain's inputs."""
        names = []
        for offset, q, slot, _ in chain:
            ref = graph.nodes[graph.ops[kept[k][offset]][q]]["inputs"][slot]
            names.append(graph.nodes[int(ref[0])]["outputs"][int(ref[1])]["name"])
        return tuple(names)

    def handed_on() -> tuple[str, ...]:
        """The tensors the period after the last kept one would read from it."""
        names = []
        for offset, q, slot, node in chain:
            w, position = graph.where[node]
            k = int(graph.nodes[graph.ops[kept[-1][offset]][q]]["inputs"][slot][1])
            names.append(graph.nodes[graph.ops[w + period][position]]["outputs"][k]["name"])
        return tuple(names)

    exits = tuple(read(k) for k in range(KEPT)) + (handed_on(),)
    return Run(kept=tuple(kept), dropped=tuple(spans[KEPT:]), exits=exits)


def _longest_run(graph: "_Units", start: int) -> tuple[int, int]:
    """(period, whole periods) of the run from unit ``start`` that drops the most
    units (the shortest period of those that drop as many), counting only the periods
    up to the first one that may not be dropped. A multiple of a period that drops
    units is not tried: it keeps more of the same run."""
    best = (1, KEPT)
    for period in range(1, MAX_PERIOD + 1):
        if best[1] > KEPT and period % best[0] == 0:
            continue
        end = start
        while end + period < graph.count and graph.repeats(end, end + period):
            end += 1
        periods = (end + period - start) // period
        droppable = KEPT
        while droppable < periods and all(graph.droppable(u, start + droppable * period, period)
                                          for u in range(start + droppable * period, start + (droppable + 1) * period)):
            droppable += 1
        dropped = (droppable - KEPT) * period
        if dropped > (best[1] - KEPT) * best[0]:
            best = (period, droppable)
    return best


class _Units:
    """The op nodes of a graph by unit, who reads what, and whether a unit repeats
    another (the module docstring's rules)."""

    def __init__(self, nodes: Sequence[Mapping[str, Any]], unit_of: Mapping[str, int], count: int):
        self.nodes = nodes
        self.count = count
        self.ops: list[list[int]] = [[] for _ in range(count)]
        for i, node in enumerate(nodes):
            if node.get("kind") == "op":
                self.ops[unit_of[node["name"]]].append(i)
        self.where = {i: (u, q) for u, members in enumerate(self.ops) for q, i in enumerate(members)}
        self.readers: dict[int, set[int]] = {}
        for i, node in enumerate(nodes):
            if node.get("kind") == "op":
                for ref in node.get("inputs", []):
                    self.readers.setdefault(int(ref[0]), set()).add(self.where[i][0])
        self._repeats: dict[tuple[int, int], bool] = {}

    @cached_property
    def bodies(self) -> dict[int, str]:
        """Op node index → its fields that identical units share, as a string."""
        return {i: json.dumps([{k: v for k, v in self.nodes[i].items() if k not in _COMPARED_APART},
                               [[o["dtype"], o["shape"]] for o in self.nodes[i]["outputs"]]], sort_keys=True)
                for members in self.ops for i in members}

    def repeats(self, u: int, v: int) -> bool:
        """Whether unit ``v`` repeats unit ``u``."""
        if (u, v) not in self._repeats:
            self._repeats[(u, v)] = self._compare(u, v)
        return self._repeats[(u, v)]

    def _compare(self, u: int, v: int) -> bool:
        if len(self.ops[u]) != len(self.ops[v]):
            return False
        for i, j in zip(self.ops[u], self.ops[v]):
            if self.bodies[i] != self.bodies[j]:
                return False
            a, b = self.nodes[i].get("inputs", []), self.nodes[j].get("inputs", [])
            if len(a) != len(b) or any(int(x[1]) != int(y[1]) or not self._alike(int(x[0]), int(y[0]), u, v)
                                       for x, y in zip(a, b)):
                return False
        return True

    def _alike(self, x: int, y: int, u: int, v: int) -> bool:
        """Whether input node ``x`` of unit ``u`` is wired as ``y`` of unit ``v``."""
        if x == y:
            return True
        a, b = self.nodes[x], self.nodes[y]
        if x in self.where and y in self.where:
            (wx, qx), (wy, qy) = self.where[x], self.where[y]
            same_place = qx == qy or len(self.ops[wx]) - qx == len(self.ops[wy]) - qy
            return wy - wx == v - u and same_place and self.bodies[x] == self.bodies[y]
        if a.get("kind") == b.get("kind") and a.get("kind") in _OWN_KINDS:
            return (self.readers.get(x) == {u} and self.readers.get(y) == {v}
                    and _source_meta(a) == _source_meta(b))
        return False

    def droppable(self, u: int, period_start: int, period: int) -> bool:
        """Whether unit ``u`` of the period from ``period_start`` may be dropped: only
        units of its period and the next read its ops, and it reads no parameter another
        unit reads (whose gradient the whole graph's program and the reduced one's would
        gather differently)."""
        window = set(range(period_start, period_start + 2 * period))
        if any(not self.readers.get(i, set()) <= window for i in self.ops[u]):
            return False
        return not any(self.nodes[int(ref[0])].get("kind") == "parameter" and self.readers.get(int(ref[0])) != {u}
                       for i in self.ops[u] for ref in self.nodes[i].get("inputs", []))


def _source_meta(node: Mapping[str, Any]) -> list[Any]:
    out = node["outputs"][0]
    return [out["dtype"], out["shape"], bool(node.get("requires_grad", True)), node.get("saved")]


def _reduced(doc: Mapping[str, Any], graph: "_Units", runs: Sequence[Run]) -> Reduction:
    """The graph without the dropped periods of ``runs``."""
    nodes, ops = doc["nodes"], graph.ops
    twin: dict[int, int] = {}  # dropped op → the op at its place in the last kept period
    for run in runs:
        for period in run.dropped:
            for u, rep in zip(period, run.kept[-1]):
                twin.update(zip(ops[u], ops[rep]))
    read_by_kept: set[int] = set()
    for i, node in enumerate(nodes):
        if node.get("kind") == "op" and i not in twin:
            read_by_kept |= {twin.get(int(ref[0]), int(ref[0])) for ref in node.get("inputs", [])}
    keep = [i for i, node in enumerate(nodes)
            if i not in twin and (node.get("kind") == "op" or i in read_by_kept or i not in graph.readers)]
    index = {old: new for new, old in enumerate(keep)}

    def ref(r: Sequence[Any]) -> list[Any]:
        return [index[twin.get(int(r[0]), int(r[0]))], *r[1:]]

    out_nodes = [{**nodes[i], "inputs": [ref(r) for r in nodes[i]["inputs"]]} if "inputs" in nodes[i] else nodes[i]
                 for i in keep]
    out = {**doc, "nodes": out_nodes}
    if doc.get("loss") is not None:
        out["loss"] = ref(doc["loss"])
    unit_of = {nodes[i]["name"]: u for u, members in enumerate(ops) for i in members if i not in twin}
    kept_ops = {u: tuple(nodes[i]["name"] for i in ops[u]) for run in runs for period in run.kept for u in period}
    return Reduction(ir=GraphIR(canonical_bytes(out)), units=len(ops), runs=tuple(runs), unit_of=unit_of, ops=kept_ops)


def _scaled(step: Mapping[str, Any], weight: float) -> dict[str, Any]:
    """``step`` standing for ``weight`` steps like it: its cost rows and FLOPs times ``weight``."""

    def row(r: Mapping[str, Sequence[float]]) -> dict[str, Any]:
        return {**r, "constant": [weight * v for v in r["constant"]], "coef": [weight * v for v in r["coef"]]}

    return {
        **step,
        "flops": weight * step.get("flops", 0.0),
        "comp": row(step["comp"]),
        "comm": row(step["comm"]),
        "sources": [{**source, "cost": row(source["cost"])} for source in step["sources"]],
        "comms": [{**comm, "cost": row(comm["cost"])} for comm in step["comms"]],
    }


__all__ = ["KEPT", "MAX_PERIOD", "Reduction", "Run", "reduce_graph"]
