"""Every technique from one export: SPMD, pipelines and overlap priced against each
other, and the cheapest kept.

A compile with ``CompileOptions.pipeline`` auto or ``CompileOptions.overlap`` needs the
model's graph at more than one batch: the global batch (the SPMD plan), the global
batch over each micro-batch count (:func:`hapd.compiler.pipeline_search.micro_batch_counts`:
the pipeline search) and half the global batch (one duplica of overlap). A
:class:`GraphSet` holds them; :func:`graphs_of_program` derives them from one program
exported with a symbolic batch (:mod:`hapd.compiler.shapes`), and a static program gives
only its own batch, each missing graph with the reason. :func:`compile_techniques`
searches each technique whose graphs are there and returns the cheapest's plan:

- ``spmd``: the SPMD plan of the global batch;
- ``pipeline``: that plan with its ``pipeline`` chosen (the pipeline search over the
  micro-batch graphs, :mod:`hapd.compiler.pipeline_search`), compared as that search
  compares (both with their ops' dispatch);
- ``overlap``: the plan of one duplica's graph searched with overlap (its ``overlap``
  set, its graph id the half batch's), as ``hapd.parallelize`` runs it.

The plan says which won (``technique``) and what each was predicted at
(``estimate.techniques``); its key lists every graph priced (``key.graphs``), so a
cache keyed on it covers every input of the search (``docs/formats.md``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import msgpack

from hapd.compiler.lower import GraphIR
from hapd.compiler.options import CompileOptions
from hapd.compiler.pipeline_search import micro_batch_counts
from hapd.compiler.pipeline_cost import graph_batch
from hapd.compiler.plan import Plan
from hapd.errors import GraphError, HapdError, OptionsError
from hapd.util import gc_paused

TECHNIQUES = ("spmd", "pipeline", "overlap")
"""The techniques a compile can pick, in the order they are reported."""


@dataclass(frozen=True, kw_only=True)
class GraphSet:
    """The graphs of one model a technique search prices."""

    full: GraphIR
    """The global batch's graph (the SPMD plan's)."""
    micro: Mapping[int, GraphIR] = field(default_factory=dict)
    """Micro-batch count (> 1) → the graph of one micro-batch."""
    half: GraphIR | None = None
    """One duplica's graph (half the global batch), for overlap."""
    missing: Mapping[str, str] = field(default_factory=dict)
    """Technique → why (some of) its graphs are not here."""

    @property
    def batch(self) -> int:
        return graph_batch(self.full.doc)

    def key(self) -> dict[str, Any]:
        """The ids of every graph, what a plan's ``key.graphs`` records."""
        return {"full": self.full.graph_id,
                "micro": {str(m): g.graph_id for m, g in sorted(self.micro.items())},
                "half": self.half.graph_id if self.half is not None else None,
                "missing": dict(sorted(self.missing.items()))}

    def to_bytes(self) -> bytes:
        """msgpack of the graphs' bytes (the daemon caches a lowered ``.pt2`` so)."""
        return msgpack.packb({"full": self.full.data, "micro": {str(m): g.data for m, g in self.micro.items()},
                              "half": self.half.data if self.half is not None else None,
                              "missing": dict(self.missing)}, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> GraphSet:
        doc = msgpack.unpackb(data, raw=False)
        return cls(full=GraphIR(doc["full"]), micro={int(m): GraphIR(g) for m, g in doc["micro"].items()},
                   half=GraphIR(doc["half"]) if doc.get("half") is not None else None,
                   missing=dict(doc.get("missing") or {}))


def needs_other_batches(options: CompileOptions) -> bool:
    """Whether a compile with ``options`` prices graphs at other batches than the
    global one (pipelines or overlap in the space)."""
    return options.pipeline == "auto" or options.overlap


def graph_set(at: Callable[[int], GraphIR], full: GraphIR, options: CompileOptions, *,
              unavailable: str | None = None) -> GraphSet:
    """The graphs ``options`` price, the global batch's being ``full`` and the others
    ``at(batch)``; ``unavailable``: there are no others, and why."""
    batch = graph_batch(full.doc)
    micro: dict[int, GraphIR] = {}
    half = None
    missing: dict[str, str] = {}
    if options.pipeline == "auto":
        counts = [m for m in micro_batch_counts(batch) if m > 1]
        if unavailable is not None:
            missing["pipeline"] = f"only 1 micro-batch priced: {unavailable}"
        elif not counts:
            missing["pipeline"] = f"only 1 micro-batch priced: no micro-batch count divides the batch {batch}"
        else:
            micro = {m: at(batch // m) for m in counts}
    if options.overlap:
        if unavailable is not None:
            missing["overlap"] = unavailable
        elif batch % 2:
            missing["overlap"] = f"overlap cuts the batch in two halves; batch {batch} is odd"
        else:
            half = micro[2] if 2 in micro else at(batch // 2)
    return GraphSet(full=full, micro=micro, half=half, missing=missing)


@gc_paused()
def graphs_of_program(program: Any, options: CompileOptions, *, name: str | None = None,
                      batch_dims: Mapping[str, int | None] | None = None) -> GraphSet:
    """The :class:`GraphSet` of an exported program (an ``ExportedProgram``; see
    :func:`hapd.compiler.lower.load_exported` for a ``.pt2``): every graph from the one
    program when its batch is symbolic, else the global batch's alone, the others
    missing with the reason the program is static."""
    from hapd.compiler.shapes import batch_info, is_symbolic, lower_at

    info = batch_info(program)
    if is_symbolic(program):
        size = info.size if info is not None else 0
        if not size:
            raise GraphError("the program's batch is symbolic and its example batch unknown (export it with hapd.export)")
        full = lower_at(program, size, name=name, batch_dims=batch_dims)
        return graph_set(lambda b: lower_at(program, b, name=name, batch_dims=batch_dims), full, options)
    from hapd.compiler.lower import lower

    full = lower(program, name=name, batch_dims=batch_dims)
    why = info.reason if info is not None and info.reason else "exported static"
    return graph_set(lambda b: full, full, options,
                     unavailable=f"the program was exported at a static batch ({why}): "
                                 "export it with a symbolic batch (hapd export) for the other batches")


@gc_paused()
def compile_techniques(graphs: GraphSet, profile: Any, options: CompileOptions | None = None) -> Plan:
    """The cheapest technique's plan for ``graphs`` on ``profile`` (see the module
    docstring); ``options.pipeline`` auto and ``options.overlap`` put pipelines and
    overlap in the space."""
    from hapd.compiler import driver
    from hapd.profile.schema import load_profile

    options = options or CompileOptions()
    if options.overlap and options.ratios is not None:
        raise OptionsError("overlap with fixed ratios over a technique search", field="ratios")
    profile = load_profile(profile)
    spmd_options = dataclasses.replace(options, overlap=False)
    spmd = dict(driver.compile(graphs.full, profile, spmd_options,
                               micro_graphs=list(graphs.micro.values()) if options.pipeline == "auto" else ()).doc)
    priced: dict[str, dict[str, Any]] = {"spmd": {"per_iteration": spmd["estimate"]["per_iteration"]}}
    stats = {"spmd_seconds": spmd["stats"]["seconds"]}
    dispatch = 0.0
    found = spmd.get("pipeline")
    if options.pipeline != "auto":
        priced["pipeline"] = {"per_iteration": None, "reason": "not searched (options.pipeline off)"}
    elif found is None:
        reason = (spmd["stats"].get("pipeline") or {}).get("reason") or "no pipeline found"
        priced["pipeline"] = {"per_iteration": None, "reason": reason}
    else:
        dispatch = found["spmd_only_per_iteration"] - spmd["estimate"]["per_iteration"]
        priced["pipeline"] = {"per_iteration": found["per_iteration"], "micro_batches": found["micro_batches"]}
        if "pipeline" in graphs.missing:
            priced["pipeline"]["note"] = graphs.missing["pipeline"]
    if options.pipeline == "auto":
        stats["pipeline_seconds"] = spmd["stats"]["pipeline"]["seconds"]
    duplica: dict[str, Any] | None = None
    if not options.overlap:
        priced["overlap"] = {"per_iteration": None, "reason": "not searched (options.overlap off)"}
    elif graphs.half is None:
        priced["overlap"] = {"per_iteration": None, "reason": graphs.missing.get("overlap", "no half-batch graph")}
    else:
        overlap_options = dataclasses.replace(options, pipeline="off", overlap=True)
        try:
            duplica = dict(driver.compile(graphs.half, profile, overlap_options).doc)
            priced["overlap"] = {"per_iteration": duplica["estimate"]["per_iteration"]}
            stats["overlap_seconds"] = duplica["stats"]["seconds"]
        except HapdError as exc:
            priced["overlap"] = {"per_iteration": None, "reason": f"{type(exc).__name__}: {exc}"}
    winner = _cheapest(priced, dispatch)
    doc = duplica if winner == "overlap" and duplica is not None else spmd
    if winner != "pipeline" and doc.get("pipeline"):
        doc["pipeline"] = {**doc["pipeline"], "chosen": False}
    if winner == "overlap" and spmd.get("pipeline") is not None:
        doc["pipeline"] = {**spmd["pipeline"], "chosen": False}
        doc["stats"] = {**doc["stats"], "pipeline": spmd["stats"]["pipeline"]}
    doc["key"] = {**doc["key"], "options": options.key(), "graphs": graphs.key()}
    doc["technique"] = winner
    doc["estimate"] = {**doc["estimate"], "techniques": priced}
    doc["stats"] = {**doc["stats"], "techniques": {**stats, "seconds": sum(stats.values())}}
    return Plan(doc)


def _cheapest(priced: Mapping[str, Mapping[str, Any]], dispatch: float) -> str:
    """The technique of least predicted seconds per iteration; a pipeline's prediction
    includes its ops' dispatch (the profile's ``op_seconds``), so the others are
    compared with the SPMD plan's dispatch (``dispatch``) added; ties go to the
    simpler (SPMD, then overlap)."""
    def cost(name: str) -> float:
        seconds = priced[name].get("per_iteration")
        if seconds is None:
            return float("inf")
        return seconds if name == "pipeline" else seconds + dispatch
    return min(("spmd", "overlap", "pipeline"), key=lambda name: (cost(name), ("spmd", "overlap", "pipeline").index(name)))


def technique_of(doc: Mapping[str, Any]) -> str:
    """The technique a plan document runs: its ``technique``, else (a plan written
    before it was recorded) ``overlap`` for duplicas, ``pipeline`` for a chosen
    pipeline, ``spmd`` otherwise."""
    found = doc.get("technique")
    if found in TECHNIQUES:
        return str(found)
    if doc.get("overlap") or int(doc.get("duplicas", 1)) > 1:
        return "overlap"
    pipeline = doc.get("pipeline")
    if pipeline and pipeline.get("chosen"):
        return "pipeline"
    return "spmd"


__all__ = ["GraphSet", "TECHNIQUES", "compile_techniques", "graph_set", "graphs_of_program", "needs_other_batches",
           "technique_of"]
