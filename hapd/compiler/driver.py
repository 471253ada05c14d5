"""The compile driver: graph + profile → plan.

Alternates the core's search with the sharding-ratio LP (HAP §6, without its defects):
start from FLOP/s-proportional ratios, search the cheapest program under the current
ratios, solve the LP for that program, and repeat while the cost strictly improves.
Each program is kept with the ratios it was optimized for. The data-parallel baselines
(DP-EV: even split, DP-CP: FLOP/s-proportional split) are priced by the same cost model.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

import msgpack

from hapd import __version__
from hapd.errors import OptionsError, SynthesisError
from hapd.compiler.plan import PLAN_FORMAT, PLAN_VERSION, Plan, estimate, split_lengths
from hapd.profile.schema import Profile, load_profile
from hapd.compiler.ratios import program_cost, solve_ratios


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """Options of one compile; part of the plan cache key."""

    mode: str = "auto"
    """``"auto"``: search every rule; ``"data_parallel"``: only the batch-split program
    (replicated parameters, gradients all-reduced), with LP-optimized ratios."""
    zero: bool = False
    """Allow ZeRO-style parameters (stored split on dim 0, all-gathered on use)."""
    memory_caps: bool = False
    """Constrain the LP by each device's memory (the memory model counts parameters,
    gradients, Adam state and saved activations; it overestimates activations, so it
    is off by default)."""
    max_rounds: int = 4
    """Most search ⇄ LP rounds."""
    max_states: int = 2_000_000
    """State budget of one search."""
    front_width: int = 24
    """Undominated states kept per program position (larger: slower, closer to proven optimal)."""
    max_seconds: float | None = None
    """Time budget of one search."""
    force: Mapping[str, str] = field(default_factory=dict)
    """Restrict ops (by fx node name) to one rule (by name)."""
    ratios: tuple[float, ...] | None = None
    """Use these sharding ratios instead of optimizing them."""

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "data_parallel"):
            raise OptionsError(f"mode {self.mode!r} is not auto or data_parallel", field="mode")
        if self.max_rounds < 1:
            raise OptionsError(f"max_rounds {self.max_rounds} must be ≥ 1", field="max_rounds")
        if self.max_states < 1:
            raise OptionsError(f"max_states {self.max_states} must be ≥ 1", field="max_states")
        if self.front_width < 1:
            raise OptionsError(f"front_width {self.front_width} must be ≥ 1", field="front_width")
        if self.ratios is not None and (any(r < 0 for r in self.ratios) or abs(sum(self.ratios) - 1) > 1e-6):
            raise OptionsError(f"ratios {list(self.ratios)} must be ≥ 0 and sum to 1", field="ratios")

    def key(self) -> dict[str, Any]:
        out = asdict(self)
        out["force"] = dict(sorted(self.force.items()))
        out["ratios"] = list(self.ratios) if self.ratios is not None else None
        return out

    def core(self, mode: str = "auto") -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": mode,
            "zero": self.zero,
            "max_states": self.max_states,
            "front_width": self.front_width,
            "force": dict(self.force) if mode == "auto" else {},
        }
        if self.max_seconds is not None:
            out["max_seconds"] = float(self.max_seconds)
        return out


def _graph_bytes(graph: Any) -> bytes:
    from hapd.compiler.lower import GraphIR, lower

    if isinstance(graph, GraphIR):
        return graph.data
    if isinstance(graph, (bytes, bytearray)):
        return bytes(graph)
    if isinstance(graph, (str, Path)):
        path = Path(graph)
        return lower(path).data if path.suffix == ".pt2" else GraphIR.load(path).data
    return lower(graph).data  # an ExportedProgram


def synthesize(graph: bytes, profile: Profile, ratios: list[float], options: CompileOptions, mode: str = "auto") -> dict:
    """One search of the core under fixed ratios; the program as a dict."""
    from hapd import _core

    raw = _core.synthesize(graph, profile.core_bytes(), list(ratios), options.core(mode))
    return msgpack.unpackb(raw, raw=False, strict_map_key=False)


@dataclass(frozen=True, kw_only=True)
class _Searched:
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


@dataclass(frozen=True, kw_only=True)
class _Baselines:
    """The data-parallel baselines, priced by the same cost model."""

    dp_ev: float
    """Cost of the data-parallel program under an even split."""
    dp_cp: float
    """Cost of the data-parallel program under the FLOP/s-proportional split."""
    dp_program: dict
    """The data-parallel program searched under the FLOP/s-proportional split."""
    flops: list[float]
    """The FLOP/s-proportional split."""


def _search_rounds(data: bytes, profile: Profile, options: CompileOptions, caps: list[float] | None) -> _Searched:
    """Alternate the search and the ratio LP while the cost strictly improves
    (one search only when ``options.ratios`` fixes the ratios)."""
    ratios = list(options.ratios) if options.ratios is not None else profile.flops_ratios()
    rounds, expanded, history = 0, 0, []
    best: tuple[dict, list[float], float] | None = None
    while rounds < options.max_rounds:
        rounds += 1
        program = synthesize(data, profile, ratios, options, options.mode)
        expanded += program["stats"]["expanded"]
        if options.ratios is not None:
            best = (program, ratios, program_cost(program, ratios))
            break
        lp = solve_ratios(program, caps)
        cost = lp.objective
        history.append(cost)
        if best is not None and cost >= best[2] * (1 - 1e-9):
            break
        best = (program, list(lp.ratios), cost)
        ratios = list(lp.ratios)
    assert best is not None
    program, ratios, cost = best
    return _Searched(program=program, ratios=ratios, cost=cost, rounds=rounds, expanded=expanded, history=history)


def _baselines(data: bytes, profile: Profile, options: CompileOptions) -> _Baselines:
    """Price the data-parallel program under the even (DP-EV) and FLOP/s-proportional
    (DP-CP) splits."""
    even = [1.0 / profile.world] * profile.world
    dp_ev = program_cost(synthesize(data, profile, even, options, "data_parallel"), even)
    flops = profile.flops_ratios()
    dp_program = synthesize(data, profile, flops, options, "data_parallel")
    dp_cp = program_cost(dp_program, flops)
    return _Baselines(dp_ev=dp_ev, dp_cp=dp_cp, dp_program=dp_program, flops=flops)


def _prefer_data_parallel(
    searched: _Searched, baselines: _Baselines, options: CompileOptions, caps: list[float] | None
) -> tuple[dict, list[float], str]:
    """The program to keep, its ratios, and where it came from (``"search"`` or
    ``"data_parallel"``).

    A search bounded by its front width may miss the data-parallel program, which is
    always in its space: keep whichever is cheaper, with the LP's ratios or the
    FLOP/s-proportional ones (compared by the cost model, not the LP's objective,
    which the solver only meets to its tolerance). Only for a free ``auto`` compile."""
    if options.ratios is not None or options.force or options.mode != "auto":
        return searched.program, searched.ratios, "search"
    program, ratios, chosen_from = searched.program, searched.ratios, "search"
    best_cost = program_cost(program, ratios)
    dp_program = baselines.dp_program
    dp_splits = [] if caps else [baselines.flops]  # with memory caps only the LP's split is known to fit
    try:
        dp_splits.append(list(solve_ratios(dp_program, caps).ratios))
    except SynthesisError:
        pass  # no data-parallel split fits
    for split in dp_splits:
        cost = program_cost(dp_program, split)
        if cost < best_cost:
            program, ratios, best_cost, chosen_from = dp_program, split, cost, "data_parallel"
    return program, ratios, chosen_from


def _plan_document(
    data: bytes,
    profile: Profile,
    options: CompileOptions,
    searched: _Searched,
    baselines: _Baselines,
    chosen: tuple[dict, list[float], str],
    *,
    seconds: float,
    synthesis_seconds: float,
) -> dict:
    """The plan document: its cache key, the chosen program with its ratios and split
    lengths, the estimate, the baselines and the compile's statistics."""
    from hapd import _core
    from hapd.compiler.lower import GraphIR

    program, ratios, chosen_from = chosen
    summary = _core.load_graph(data)
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
        "ratios": ratios,
        "lengths": split_lengths(program, ratios),
        "estimate": estimate(program, ratios),
        "baselines": {"dp_ev": baselines.dp_ev, "dp_cp": baselines.dp_cp},
        "opaque_ops": [op for op, _ in summary["opaque_ops"]],
        "stats": {
            "seconds": seconds,
            "synthesis_seconds": synthesis_seconds,
            "search_seconds": program["stats"]["seconds"],
            "expanded": searched.expanded,
            "lp_rounds": searched.rounds,
            "lp_costs": searched.history,
            "stop_reason": program["stats"]["stop_reason"],
            "chosen_from": chosen_from,
        },
    }


def compile(graph: Any, profile: Any, options: CompileOptions | None = None) -> Plan:  # noqa: A001 - hapd.compile is the public name
    """Compile ``graph`` (GraphIR, .hapg/.pt2 path, bytes or ExportedProgram) for
    ``profile`` (Profile or path) into a :class:`Plan`."""
    options = options or CompileOptions()
    profile = load_profile(profile)
    data = _graph_bytes(graph)
    start = time.perf_counter()
    caps = [d.memory for d in profile.devices] if options.memory_caps else None
    searched = _search_rounds(data, profile, options, caps)
    synthesis_seconds = time.perf_counter() - start
    baselines = _baselines(data, profile, options)
    chosen = _prefer_data_parallel(searched, baselines, options, caps)
    seconds = time.perf_counter() - start
    doc = _plan_document(
        data, profile, options, searched, baselines, chosen, seconds=seconds, synthesis_seconds=synthesis_seconds
    )
    return Plan(doc)
