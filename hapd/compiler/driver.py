"""The compile driver: graph + profile → plan.

A compile reads the graph (lowering a ``.pt2`` program), runs the SPMD search — the
core's search alternating with the sharding-ratio LP, against the data-parallel
baselines (:mod:`hapd.compiler.search`) — writes the plan document of the program it
keeps, and with ``CompileOptions.pipeline`` auto adds the best pipeline
(:mod:`hapd.compiler.pipeline.stage_search`).
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from torch.export import ExportedProgram

from hapd import __version__, _core
from hapd.compiler.pipeline import stage_search as pipeline_search
from hapd.compiler.pipeline.stage_cost import graph_batch
from hapd.compiler.choice import ORDER, choose
from hapd.compiler.dp_gap import dp_gap
from hapd.ir.derive import graphs_at
from hapd.ir.lower import GraphIR, load_exported, lower
from hapd.compiler.options import CompileOptions
from hapd.compiler.overlap import is_overlapped
from hapd.compiler.plan import PLAN_FORMAT, PLAN_VERSION, Plan, estimate, split_lengths
from hapd.compiler.plan_summary import format_seconds, technique
from hapd.compiler.ratios import peak_memory, program_cost
from hapd.compiler.search import SpmdSearch, dp_fits, search_spmd
from hapd.ir.shapes import batch_info, is_symbolic
from hapd.compiler.techniques import GraphSet, graph_set, graphs_of_program, kept_graph_source, needs_other_batches
from hapd.errors import GraphError, HapdError, OptionsError
from hapd.compiler.precision import autocast_graph
from hapd.profile.precision import device_speed, for_precision, resolve_precision
from hapd.profile.schema import Profile, load_profile
from hapd.util import gc_paused


def compile(  # noqa: A001 - hapd.compile is the public name
    graph: Any, profile: Any, options: CompileOptions | None = None, micro_graphs: Sequence[Any] = ()
) -> Plan:
    """Compile ``graph`` (GraphIR, .hapg/.pt2 path, bytes, ExportedProgram or
    :class:`~hapd.compiler.techniques.GraphSet`) for ``profile`` (Profile or path) into a
    :class:`Plan`.

    A program exported with a symbolic batch (``hapd export``; :mod:`hapd.ir.shapes`)
    with ``options.pipeline`` auto or ``options.overlap`` is compiled with every technique
    in the space from that one program (:func:`compile_techniques`:
    SPMD at the global batch, pipelines over the micro-batch graphs derived from it,
    overlap on the half-batch graph; the simplest wins unless a more complex one is
    predicted ``options.technique_margin`` faster, :mod:`hapd.compiler.choice`;
    ``Plan.technique`` says which),
    and so is a static program with both (the graphs it cannot give are reported not
    priced, with the reason). A single graph compiles as before: with ``options.overlap``
    it is one duplica's graph (half the global batch); with ``options.pipeline`` auto,
    ``micro_graphs`` are the same model exported at smaller batches (the global batch
    over each micro-batch count to price; the global batch itself is always priced).

    The cyclic garbage collector is paused while it runs (:func:`hapd.util.gc_paused`)."""
    with gc_paused():
        return _compile(graph, profile, options, micro_graphs)


def _compile(graph: Any, profile: Any, options: CompileOptions | None, micro_graphs: Sequence[Any]) -> Plan:
    options = options or CompileOptions()
    if micro_graphs and options.pipeline != "auto":
        raise OptionsError("micro-batch graphs are for pipeline auto", field="micro_graphs")
    if isinstance(graph, GraphSet):
        return compile_techniques(graph, profile, options)
    if needs_other_batches(options) and not micro_graphs and _is_pt2(graph):
        kept = kept_graph_source(graph)  # the graphs hapd.export kept in the file: no load, no lowering
        if kept is not None:
            return _compile_at(*kept, profile, options)
    program = _program(graph) if needs_other_batches(options) and not micro_graphs else None
    if program is not None:
        exported, name, batch_dims = program
        if is_symbolic(exported):
            return _compile_program(exported, profile, options, name=name, batch_dims=batch_dims)
        if options.pipeline == "auto" and options.overlap:
            graphs = graphs_of_program(exported, options, name=name, batch_dims=batch_dims)
            return compile_techniques(graphs, profile, options)
        graph = exported if name is None else _graph_bytes_of(exported, name, batch_dims)
    if options.pipeline == "auto" and options.overlap:
        raise OptionsError("pipeline auto with overlap prices graphs at several batches: give the program exported "
                           "with a symbolic batch (hapd export), not one graph", field="pipeline")
    searched = _spmd_plan(graph, profile, options)
    if options.pipeline == "auto":
        searched.add_pipeline(micro_graphs, options)
    _add_technique(searched.doc)
    return Plan(searched.doc)


@dataclasses.dataclass(frozen=True)
class _SpmdPlan:
    """The SPMD plan document of one graph, with what its pipeline search needs."""

    doc: dict
    data: bytes
    """The graph searched (its bytes as given, before autocast)."""
    priced: Profile
    """The profile at the plan's precision."""

    def add_pipeline(self, micro_graphs: Sequence[Any], options: CompileOptions) -> None:
        _add_pipeline(self.doc, self.data, micro_graphs, self.priced, options,
                      program_cost(self.doc["program"], self.doc["ratios"]))


def _spmd_plan(graph: Any, profile: Any, options: CompileOptions) -> _SpmdPlan:
    """The SPMD search of one graph and its plan document (no pipeline, no technique)."""
    profile = load_profile(profile)
    precision = resolve_precision(options.precision, profile)
    priced = for_precision(profile, precision)
    data = _graph_bytes(graph)
    _core.load_graph(data)  # a malformed graph is a GraphValidationError naming the field, before any search
    start = time.perf_counter()
    found = search_spmd(autocast_graph(data, precision), priced, options)
    doc = _plan_document(data, priced, options, found, seconds=time.perf_counter() - start)
    doc["key"]["profile_id"] = profile.profile_id
    doc["precision"] = precision_record(profile, options, precision)
    return _SpmdPlan(doc, data, priced)


def precision_record(profile: Profile, options: CompileOptions, precision: str) -> dict[str, Any]:
    """What a plan records of its precision: the one it runs (``precision``), what was
    asked (``auto`` resolves), the gradient reduction's dtype, and each device's matmul
    rate it was priced at with where the rate comes from."""
    rates = []
    for d in profile.devices:
        speed, source = device_speed(d, precision)
        rates.append({"rank": d.rank, "model": d.model, "flops": speed, "source": source})
    return {"precision": precision, "requested": options.precision, "reduce_dtype": options.reduce_dtype,
            "rates": rates}


@gc_paused()
def compile_techniques(graphs: GraphSet, profile: Any, options: CompileOptions | None = None) -> Plan:
    """The plan of the technique that runs for ``graphs`` on ``profile``: SPMD, unless a
    pipeline or overlap is predicted ``options.technique_margin`` faster than every
    simpler technique (:mod:`hapd.compiler.choice`); an overlap plan that hides no
    communication is not priced. ``options.pipeline`` auto and ``options.overlap`` put
    pipelines and overlap in the space. Every technique's plan trains the same global
    batch, ``graphs.full``'s (``global_batch``): a pipeline's micro-batches and overlap's
    two duplicas are shares of it."""
    return _techniques(graphs.full, lambda on_half: graphs, profile, options)


def _compile_program(program: ExportedProgram, profile: Any, options: CompileOptions, *, name: str | None,
                     batch_dims: Mapping[str, int | None] | None) -> Plan:
    """:func:`compile_techniques` of a program exported with a symbolic batch
    (:func:`_compile_at`)."""
    info = batch_info(program)
    size = info.size if info is not None else 0
    if not size:
        raise GraphError("the program's batch is symbolic and its example batch unknown (export it with hapd.export)")
    at = graphs_at(program, size, name=name, batch_dims=batch_dims)
    return _compile_at(at(size), at, profile, options)


def _compile_at(full: GraphIR, at: Callable[[int], GraphIR], profile: Any, options: CompileOptions) -> Plan:
    """:func:`compile_techniques` of the graph ``full`` at the global batch and the
    others ``at`` gives, derived while the searches run: the SPMD search starts on a
    thread at once; the half batch's graph is made next, and overlap's duplica search
    starts on another; the micro-batch graphs are made meanwhile (lowering is Python,
    the searches mostly the core's, which runs without Python's lock)."""
    size = graph_batch(full.doc)

    def derive(on_half: Callable[[GraphIR], None]) -> GraphSet:
        if options.overlap and size % 2 == 0:
            on_half(at(size // 2))
        return graph_set(at, full, options)

    return _techniques(full, derive, profile, options)


def _techniques(full: GraphIR, derive: Callable[[Callable[[GraphIR], None]], GraphSet], profile: Any,
                options: CompileOptions | None) -> Plan:
    """:func:`compile_techniques` of ``full`` and the graphs ``derive`` gives (it
    calls its argument with the half batch's graph as soon as it has it)."""
    options = options or CompileOptions()
    if options.overlap and options.ratios is not None:
        raise OptionsError("overlap with fixed ratios over a technique search", field="ratios")
    profile = load_profile(profile)
    spmd_options = dataclasses.replace(options, overlap=False)
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="hapd-technique") as pool:
        # the SPMD search and overlap's duplica search each run on a thread of their own
        # while the other graphs are derived and the pipeline search runs: the core's
        # searches and the LP solver's processes run without Python's lock, so the
        # techniques' searches and the lowering share the cores
        spmd_future = pool.submit(_spmd_plan, full, profile, spmd_options)
        overlapped: list[Future] = []

        def on_half(half: GraphIR) -> None:
            if options.overlap and not overlapped:
                overlapped.append(pool.submit(_overlap_duplica, half, profile, options))

        try:
            derive_start = time.perf_counter()
            graphs = derive(on_half)
            derive_seconds = time.perf_counter() - derive_start
            if options.overlap and not overlapped and graphs.half is not None:
                on_half(graphs.half)
            searched = spmd_future.result()
            if options.pipeline == "auto":
                searched.add_pipeline(list(graphs.micro.values()), spmd_options)
        finally:
            for future in (spmd_future, *overlapped):
                future.cancel()
        _add_technique(searched.doc)
        spmd = dict(searched.doc)
        duplica_or_error = overlapped[0].result() if overlapped and graphs.half is not None else None
    priced: dict[str, dict[str, Any]] = {"spmd": {"per_iteration": spmd["estimate"]["per_iteration"]}}
    stats = {"derive_seconds": derive_seconds, "spmd_seconds": spmd["stats"]["seconds"]}
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
    elif isinstance(duplica_or_error, HapdError):
        priced["overlap"] = {"per_iteration": None, "reason": f"{type(duplica_or_error).__name__}: {duplica_or_error}"}
    elif duplica_or_error is not None:
        duplica = duplica_or_error
        priced["overlap"] = _overlap_priced(duplica["estimate"])
        stats["overlap_seconds"] = duplica["stats"]["seconds"]
    winner = _winner(priced, dispatch, options.technique_margin)
    doc = duplica if winner == "overlap" and duplica is not None else spmd
    if winner == "overlap" and "pipeline" in spmd:  # what the pipeline search found, or why nothing
        doc["pipeline"] = spmd["pipeline"]
        doc["stats"] = {**doc["stats"], "pipeline": spmd["stats"]["pipeline"]}
    if doc.get("pipeline"):
        doc["pipeline"] = {**doc["pipeline"], "chosen": winner == "pipeline"}
    doc["key"] = {**doc["key"], "options": options.key(), "graphs": graphs.key()}
    doc["technique"] = winner
    doc["global_batch"] = graphs.batch
    doc["estimate"] = {**doc["estimate"], "techniques": priced}
    doc["stats"] = {**doc["stats"], "techniques": {**stats, "seconds": sum(stats.values())}}
    return Plan(doc)


def _overlap_duplica(half: GraphIR, profile: Profile, options: CompileOptions) -> dict[str, Any] | HapdError:
    """The plan document of one overlap duplica (the half-batch graph searched for two
    interleaved duplicas), or the error that says why there is none."""
    try:
        return dict(compile(half, profile, dataclasses.replace(options, pipeline="off", overlap=True)).doc)
    except HapdError as exc:
        return exc


def _overlap_priced(estimate: Mapping[str, Any]) -> dict[str, Any]:
    """Overlap's entry in ``estimate.techniques``: its predicted seconds, or none when
    its schedule hides no communication under compute: two half-batch duplicas that
    hide nothing run what one SPMD program does, with more to go wrong, so such a plan
    is not an overlap plan (never chosen; ``reason`` says why, ``predicted`` keeps its
    seconds)."""
    seconds = float(estimate["per_iteration"])
    hidden = float((estimate.get("overlap") or {}).get("hidden", 0.0))
    if hidden > 0:
        return {"per_iteration": seconds}
    return {"per_iteration": None, "predicted": seconds,
            "reason": f"hides no communication under compute (predicted {format_seconds(seconds)}): "
                      "not an overlap plan"}


def _winner(priced: Mapping[str, Mapping[str, Any]], dispatch: float, margin: float) -> str:
    """The technique that runs (:func:`hapd.compiler.choice.choose`: the simplest unless a
    more complex one is predicted ``margin`` faster than every simpler one). A
    pipeline's prediction includes its ops' dispatch (the profile's ``op_seconds``), so
    the others are compared with the SPMD plan's dispatch (``dispatch``) added."""
    costs: dict[str, float | None] = {}
    for name in ORDER:
        seconds = (priced.get(name) or {}).get("per_iteration")
        costs[name] = None if seconds is None else float(seconds) + (0.0 if name == "pipeline" else dispatch)
    return choose(costs, margin)


def _add_technique(doc: dict) -> None:
    """The technique the plan runs and what was priced: its own estimate, and the
    pipeline's when one was searched (a single graph prices no other technique)."""
    runs = technique(doc)
    doc["technique"] = runs
    own = "overlap" if runs == "overlap" else "spmd"
    priced: dict[str, Any] = {own: {"per_iteration": doc["estimate"]["per_iteration"]}}
    if "pipeline" in doc:
        found = doc["pipeline"]
        priced["pipeline"] = ({"per_iteration": found["per_iteration"], "micro_batches": found["micro_batches"]}
                              if found is not None else
                              {"per_iteration": None, "reason": doc["stats"]["pipeline"].get("reason") or "none found"})
    doc["estimate"]["techniques"] = priced


def _program(graph: Any) -> tuple[Any, str | None, dict | None] | None:
    """(program, stored name, stored batch dims) of an ExportedProgram or a ``.pt2``
    path; ``None`` for a graph."""
    if isinstance(graph, ExportedProgram):
        return graph, None, None
    if isinstance(graph, (str, Path)) and Path(graph).suffix == ".pt2":
        program, stored = load_exported(graph)
        return program, stored.get("name"), stored.get("batch_dims")
    return None


def _is_pt2(graph: Any) -> bool:
    return isinstance(graph, (str, Path)) and Path(graph).suffix == ".pt2"


def _graph_bytes_of(program: Any, name: str | None, batch_dims: dict | None) -> bytes:
    return lower(program, name=name, batch_dims=batch_dims).data


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
        "global_batch": _global_batch(data, int(program.get("duplicas", 1))),
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
                         dp_fits=fits, opaque=set(opaque), dp_cp_own=baselines.dp_cp_own),
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


def _global_batch(data: bytes, duplicas: int) -> int | None:
    """The global batch a plan of graph ``data`` trains: the graph's batch, times the
    duplicas when it is one duplica's (an overlap plan's graph is half the global batch).
    None for a graph without one batch dim (nothing to split by samples)."""
    try:
        return graph_batch(GraphIR(data).doc) * duplicas
    except GraphError:
        return None


def _add_pipeline(doc: dict, data: bytes, micro_graphs: Sequence[Any], profile: Profile, options: CompileOptions,
                  spmd_only: float) -> None:
    """The pipeline search (:mod:`hapd.compiler.pipeline.stage_search`) against the SPMD plan's
    ``spmd_only`` seconds: the best pipeline as the plan's ``pipeline`` (``chosen`` when
    it is cheaper) and the search's statistics."""
    graphs = pipeline_search.micro_batch_graphs(GraphIR(data), [GraphIR(_graph_bytes(g)) for g in micro_graphs])
    found = pipeline_search.search(graphs, profile, options, spmd_only)
    doc["pipeline"] = found.best.to_doc() if found.best is not None else None
    doc["stats"]["pipeline"] = found.stats()
