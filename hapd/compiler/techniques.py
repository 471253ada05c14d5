"""Every technique from one export: SPMD, pipelines and overlap priced against each
other, and the cheapest kept.

A compile with ``CompileOptions.pipeline`` auto or ``CompileOptions.overlap`` needs the
model's graph at more than one batch: the global batch (the SPMD plan), the global
batch over each micro-batch count (:func:`hapd.compiler.pipeline.stage_search.micro_batch_counts`:
the pipeline search) and half the global batch (one duplica of overlap). A
:class:`GraphSet` holds them; :func:`graphs_of_program` derives them from one program
exported with a symbolic batch (:mod:`hapd.ir.shapes`), and a static program gives
only its own batch, each missing graph with the reason. :func:`hapd.compiler.driver.compile_techniques`
searches each technique whose graphs are there and returns the cheapest's plan:

- ``spmd``: the SPMD plan of the global batch;
- ``pipeline``: that plan with its ``pipeline`` chosen (the pipeline search over the
  micro-batch graphs, :mod:`hapd.compiler.pipeline.stage_search`), compared as that search
  compares (both with their ops' dispatch);
- ``overlap``: the plan of one duplica's graph searched with overlap (its ``overlap``
  set, its graph id the half batch's), as ``hapd.parallelize`` runs it.

The plan says which won (``technique``) and what each was predicted at
(``estimate.techniques``); its key lists every graph priced (``key.graphs``), so a
cache keyed on it covers every input of the search (``docs/formats.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import msgpack

from hapd.ir.kept import read_kept
from hapd.ir.lower import GraphIR, load_exported, lower, lower_at
from hapd.compiler.options import CompileOptions
from hapd.compiler.pipeline.stage_search import micro_batch_counts
from hapd.compiler.pipeline.stage_cost import graph_batch
from hapd.ir.derive import graphs_at
from hapd.ir.shapes import batch_info, is_symbolic
from hapd.errors import GraphError
from hapd.util import gc_paused

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
    :func:`hapd.ir.lower.load_exported` for a ``.pt2``): every graph from the one
    program when its batch is symbolic, else the global batch's alone, the others
    missing with the reason the program is static."""
    info = batch_info(program)
    if is_symbolic(program):
        size = info.size if info is not None else 0
        if not size:
            raise GraphError("the program's batch is symbolic and its example batch unknown (export it with hapd.export)")
        full = lower_at(program, size, name=name, batch_dims=batch_dims)
        return graph_set(graphs_at(program, size, name=name, batch_dims=batch_dims), full, options)
    full = lower(program, name=name, batch_dims=batch_dims)
    why = info.reason if info is not None and info.reason else "exported static"
    return graph_set(lambda b: full, full, options,
                     unavailable=f"the program was exported at a static batch ({why}): "
                                 "export it with a symbolic batch (hapd export) for the other batches")


def kept_graph_source(path: str | Path) -> tuple[GraphIR, Callable[[int], GraphIR]] | None:
    """(the global batch's graph, the graph at any batch) of a ``.pt2`` that keeps its
    graphs (:mod:`hapd.ir.kept`: written by :func:`hapd.export` under this hapd and
    torch); a batch it does not keep is lowered from its program, loaded then. None
    when it keeps none."""
    kept = read_kept(path)
    if kept is None:
        return None
    program: list[Callable[[int], GraphIR]] = []

    def at(batch: int) -> GraphIR:
        if batch in kept.graphs:
            return kept.graphs[batch]
        if not program:
            loaded, stored = load_exported(path)
            program.append(graphs_at(loaded, kept.batch, name=stored.get("name"), batch_dims=stored.get("batch_dims")))
        return program[0](batch)

    return kept.graphs[kept.batch], at


def graphs_of_file(path: str | Path, options: CompileOptions) -> GraphSet:
    """The :class:`GraphSet` of a ``.pt2``: from the graphs it keeps, else derived
    from its program (:func:`graphs_of_program`)."""
    kept = kept_graph_source(path)
    if kept is not None:
        return graph_set(kept[1], kept[0], options)
    program, stored = load_exported(path)
    return graphs_of_program(program, options, name=stored.get("name"), batch_dims=stored.get("batch_dims"))


__all__ = ["GraphSet", "graphs_of_file", "kept_graph_source", "graph_set", "graphs_of_program", "needs_other_batches"]
