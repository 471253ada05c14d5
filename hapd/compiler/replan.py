"""Re-planning a cached program for another cluster profile ("lp-only").

When a graph was compiled for profile A and is now asked for profile B with the same
compiler version and options, the daemon reuses A's *program* instead of searching
again: every op is forced to the rule A's plan chose for it (``CompileOptions.force``,
by fx node name), and the compile driver runs with that restriction for B. The core
then only re-costs that fixed program with B's device speeds and collective costs
(and, where several collectives realise the same layout change, re-picks the cheapest
for B), and the sharding-ratio LP is re-solved for B; the DP-EV/DP-CP baselines are
priced for B as usual. The plan is the same as a full compile's whenever the best
rule choice does not depend on the profile; it can be slower than the full search
would find when it does — ``hapd compile`` (or a cache under a new options key) gives
the full search.

The plan records ``stats.path = "lp-only"`` and ``stats.replanned_from`` (A's profile
id); its cache key is B's, with the caller's options.

A technique search's plan (:class:`~hapd.compiler.techniques.GraphSet`: SPMD priced
against pipelines and overlap) is re-planned the same way when the cached plan runs
SPMD (:func:`relp_graphs`): its program on the global batch's graph, the LP re-solved
for B, and the other techniques not priced again (the plan says so). An elastic job
that lost a host gets its plan so in a fraction of a search. A cached pipeline or
overlap plan is not re-planned: its stages or duplicas are chosen for A's devices,
and B gets a full search.
"""

from __future__ import annotations

import dataclasses
import time

from hapd.compiler.driver import compile as compile_plan
from hapd.compiler.options import CompileOptions
from hapd.compiler.plan import Plan
from hapd.compiler.techniques import GraphSet
from hapd.errors import PlanError
from hapd.profile.schema import Profile


def forced_rules(plan: Plan) -> dict[str, str]:
    """``{fx node name: rule}`` for every step of the plan's program."""
    try:
        return {str(step["node"]): str(step["rule"]) for step in plan.program["steps"]}
    except (KeyError, TypeError) as exc:
        raise PlanError(f"the cached plan has no readable program steps ({exc})") from exc


def relp_plan(graph: bytes, old: Plan, profile: Profile, options: CompileOptions) -> Plan:
    """``old``'s program re-costed for ``profile`` with the LP re-solved (see the module
    docstring). Raises a :class:`~hapd.errors.HapdError` when the program does not fit
    the new profile (the caller then compiles from scratch)."""
    start = time.perf_counter()
    forced = {**forced_rules(old), **dict(options.force)}
    plan = compile_plan(graph, profile, dataclasses.replace(options, force=forced))
    doc = dict(plan.doc)
    doc["key"] = {**doc["key"], "options": options.key()}
    doc["stats"] = {
        **doc["stats"],
        "path": "lp-only",
        "replanned_from": old.key.get("profile_id"),
        "seconds": time.perf_counter() - start,
    }
    return Plan(doc)


def relp_graphs(graphs: GraphSet, old: Plan, profile: Profile, options: CompileOptions) -> Plan:
    """An SPMD technique-search plan ``old`` re-planned for ``profile`` (the module
    docstring): its program re-costed on ``graphs.full`` with the LP re-solved; keyed as
    the technique search of ``graphs`` with ``options``. :class:`PlanError` when ``old``
    runs another technique (the caller then searches)."""
    if old.technique != "spmd":
        raise PlanError(f"the cached plan runs {old.technique}, chosen for its devices: only an SPMD program is "
                        "re-planned by its LP")
    start = time.perf_counter()
    plan = relp_plan(graphs.full.data, old, profile, dataclasses.replace(options, pipeline="off", overlap=False))
    doc = dict(plan.doc)
    why = f"not priced again: LP-only re-plan of the SPMD program cached for profile {str(old.key.get('profile_id'))[:12]}"
    doc["key"] = {**doc["key"], "options": options.key(), "graphs": graphs.key()}
    doc["technique"] = "spmd"
    doc["estimate"] = {**doc["estimate"], "techniques": {
        "spmd": {"per_iteration": doc["estimate"]["per_iteration"]},
        **{name: {"per_iteration": None, "reason": why} for name in ("pipeline", "overlap")}}}
    doc.pop("pipeline", None)
    doc["stats"] = {**doc["stats"], "seconds": time.perf_counter() - start}
    return Plan(doc)
