"""The compile driver: graph + profile → plan.

A compile reads the graph (lowering a ``.pt2`` program), runs the SPMD search — the
core's search alternating with the sharding-ratio LP, against the data-parallel
baselines (:mod:`hapd.compiler.search`) — writes the plan document of the program it
keeps, and with ``CompileOptions.pipeline`` auto adds the best pipeline
(:mod:`hapd.compiler.pipeline_search`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from hapd import __version__, _core
from hapd.compiler import pipeline_search
from hapd.compiler.dp_gap import dp_gap
from hapd.compiler.lower import GraphIR, lower
from hapd.compiler.options import CompileOptions
from hapd.compiler.overlap import is_overlapped
from hapd.compiler.plan import PLAN_FORMAT, PLAN_VERSION, Plan, estimate, split_lengths
from hapd.compiler.ratios import peak_memory, program_cost
from hapd.compiler.search import SpmdSearch, dp_fits, search_spmd
from hapd.errors import OptionsError
from hapd.profile.schema import Profile, load_profile


def compile(  # noqa: A001 - hapd.compile is the public name
    graph: Any, profile: Any, options: CompileOptions | None = None, micro_graphs: Sequence[Any] = ()
) -> Plan:
    """Compile ``graph`` (GraphIR, .hapg/.pt2 path, bytes or ExportedProgram) for
    ``profile`` (Profile or path) into a :class:`Plan`. With ``options.pipeline`` auto,
    ``micro_graphs`` are the same model exported at smaller batches (the global batch
    over each micro-batch count to price; the global batch itself is always priced)."""
    options = options or CompileOptions()
    if micro_graphs and options.pipeline != "auto":
        raise OptionsError("micro-batch graphs are for pipeline auto", field="micro_graphs")
    profile = load_profile(profile)
    data = _graph_bytes(graph)
    _core.load_graph(data)  # a malformed graph is a GraphValidationError naming the field, before any search
    start = time.perf_counter()
    found = search_spmd(data, profile, options)
    doc = _plan_document(data, profile, options, found, seconds=time.perf_counter() - start)
    if options.pipeline == "auto":
        _add_pipeline(doc, data, micro_graphs, profile, options, program_cost(found.program, found.ratios))
    return Plan(doc)


def _graph_bytes(graph: Any) -> bytes:
    if isinstance(graph, GraphIR):
        return graph.data
    if isinstance(graph, (bytes, bytearray)):
        return bytes(graph)
    if isinstance(graph, (str, Path)):
        path = Path(graph)
        return lower(path).data if path.suffix == ".pt2" else GraphIR.load(path).data
    return lower(graph).data  # an ExportedProgram


def _plan_document(data: bytes, profile: Profile, options: CompileOptions, found: SpmdSearch, *, seconds: float) -> dict:
    """The plan document: its cache key, the chosen program with its ratios and split
    lengths, the estimate, the baselines and the compile's statistics, and why it costs more than DP-CP where it does
    (:mod:`hapd.compiler.dp_gap`)."""
    program, ratios, baselines, searched = found.program, found.ratios, found.baselines, found.searched
    summary = _core.load_graph(data)
    opaque = [op for op, _ in summary["opaque_ops"]]
    fits = dp_fits(baselines.dp_program, profile)
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "key": {
            "graph_id": GraphIR(data).graph_id,
            "profile_id": profile.profile_id,
            "profile_name": profile.name,
            "compiler_version": __version__,
            "options": options.key(),
        },
        "program": program,
        "overlap": is_overlapped(program),
        "duplicas": int(program.get("duplicas", 1)),
        "ratios": ratios,
        "lengths": split_lengths(program, ratios),
        "estimate": estimate(program, ratios),
        "baselines": {
            "dp_ev": baselines.dp_ev,
            "dp_cp": baselines.dp_cp,
            "dp_memory": peak_memory(baselines.dp_program, baselines.flops),
            "dp_fits": fits,
        },
        "dp_gap": dp_gap(program, ratios, baselines.dp_program, baselines.dp_cp, baselines.flops, options,
                         dp_fits=fits, opaque=set(opaque)),
        "opaque_ops": opaque,
        "stats": {
            "seconds": seconds,
            "synthesis_seconds": found.synthesis_seconds,
            "search_seconds": program["stats"]["seconds"],
            "expanded": searched.expanded,
            "lp_rounds": searched.rounds,
            "lp_costs": searched.history,
            "stop_reason": program["stats"]["stop_reason"],
            "chosen_from": found.chosen_from,
            "front_width": found.front_width,
            "passes": [dict(p) for p in found.passes],
        },
    }


def _add_pipeline(doc: dict, data: bytes, micro_graphs: Sequence[Any], profile: Profile, options: CompileOptions,
                  spmd_only: float) -> None:
    """The pipeline search (:mod:`hapd.compiler.pipeline_search`) against the SPMD plan's
    ``spmd_only`` seconds: the best pipeline as the plan's ``pipeline`` (``chosen`` when
    it is cheaper) and the search's statistics."""
    graphs = pipeline_search.micro_batch_graphs(GraphIR(data), [GraphIR(_graph_bytes(g)) for g in micro_graphs])
    found = pipeline_search.search(graphs, profile, options, spmd_only)
    doc["pipeline"] = found.best.to_doc() if found.best is not None else None
    doc["stats"]["pipeline"] = found.stats()
