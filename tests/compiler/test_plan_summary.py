"""Which plan runs, said plainly: the one line ``hapd.parallelize`` prints
(:func:`hapd.compiler.plan_summary.plan_line`) for an SPMD plan and for plans marked
pipeline or overlap (with and without the ``technique`` fields), ``hapd explain``'s
first screen and ``--steps``, and the compile's search passes with why each ran."""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from pathlib import Path

from click.testing import CliRunner

from hapd import models
from hapd.cli import main
from hapd.compiler.driver import compile as compile_plan
from hapd.ir.export import export
from hapd.ir.lower import GraphIR, lower
from hapd.compiler.options import CompileOptions
from hapd.compiler.plan import Plan
from hapd.compiler.plan_summary import plan_line, predicted_seconds, summary_lines, technique, technique_times
from hapd.profile.schema import Link, estimated_profile
from hapd.train.plan_source import PlanSource


@functools.cache
def _mlp(batch: int) -> GraphIR:
    spec = models.get("mlp")
    model, config = models.build("mlp", "tiny", hidden=256, layers=3)
    return lower(export(model, spec.example_inputs(config, batch), batch_dims=spec.batch_dims), name="mlp")


@functools.cache
def _data_parallel() -> Plan:
    return compile_plan(_mlp(8), estimated_profile(2, flops=[2e10, 1e10]), CompileOptions(mode="data_parallel"))


@functools.cache
def _pipelined() -> Plan:
    """Two hosts over a slow link: the pipeline wins (as in test_pipeline_search)."""
    profile = estimated_profile(4, flops=[2e10] * 2 + [1e10] * 2, hosts=["a"] * 2 + ["b"] * 2, alpha=1e-5, beta=1e6)
    links = {n: {"inter": l["inter"], "intra": Link(alpha=1e-6, beta=1e10)} for n, l in profile.collectives.items()}
    profile = dataclasses.replace(profile, collectives=links, name="slow-link")
    return compile_plan(_mlp(8), profile, CompileOptions(pipeline="auto"), micro_graphs=[_mlp(4)])


def test_the_line_of_an_spmd_plan() -> None:
    plan = _data_parallel()
    line = PlanSource(plan, "compiled on rank 0", 0.065).summary()
    assert "\n" not in line
    assert line.startswith("plan: SPMD (data parallel), per-rank batch ")
    lengths = plan.lengths_of("x", 0)
    assert f"per-rank batch {lengths[0]}/{lengths[1]} of 8;" in line
    est, dp_cp = plan.estimate["per_iteration"], plan.doc["baselines"]["dp_cp"]
    assert re.search(r"; [\d.]+ (µs|ms)/step predicted, ([\d.]+× (faster|slower) than|as fast as) DP-CP "
                     r"\([\d.]+ (µs|ms)\)", line), line
    assert f"{max(dp_cp / est, est / dp_cp):.2f}×" in line or abs(dp_cp / est - 1) < 5e-3
    assert line.endswith("; compiled on rank 0, 65 ms")
    assert technique(plan.doc) == "spmd" and technique_times(plan.doc) == {"spmd": est}


def test_the_line_of_a_pipeline_plan_says_what_spmd_lost() -> None:
    plan = _pipelined()
    found = plan.doc["pipeline"]
    assert found["chosen"] and plan.doc["technique"] == "pipeline"
    for doc in (plan.doc, {k: v for k, v in plan.doc.items() if k != "technique"}):  # and an older plan's fields
        assert technique(doc) == "pipeline"
    line = plan_line(plan.doc, "given", 0.001)
    assert line.startswith(f"plan: pipeline, 2 stages (ranks 0-1, ranks 2-3), global batch 8 in "
                           f"{found['micro_batches']} micro-batch")
    ratio = found["spmd_only_per_iteration"] / found["per_iteration"]
    assert "; SPMD " in line and f"({ratio:.2f}× slower)" in line
    assert predicted_seconds(plan.doc) == found["per_iteration"]
    text = "\n".join(summary_lines(plan.doc))
    assert "technique: pipeline; the others lost: SPMD" in text and "stage 1: ranks 2-3 on b" in text


def test_the_technique_fields_when_a_plan_carries_them() -> None:
    doc = copy.deepcopy(dict(_data_parallel().doc))
    won = doc["estimate"]["per_iteration"]
    doc["technique"] = "overlap"
    doc["estimate"]["techniques"] = {"spmd": {"per_iteration": won * 1.25}, "overlap": {"per_iteration": won},
                                     "pipeline": {"per_iteration": None, "reason": "one host"}}
    line = plan_line(doc)
    assert line.startswith("plan: overlap, per-rank batch ")
    assert "SPMD " in line and "(1.25× slower)" in line and "pipeline: one host" in line  # why it has no price
    doc["technique"] = "pipeline"  # a pipeline's record without its stages is not needed to name it
    assert technique(doc) == "pipeline"
    # an older overlapped plan: only the flag
    old = copy.deepcopy(dict(_data_parallel().doc))
    old.pop("technique", None)
    old["estimate"].pop("techniques", None)
    old["overlap"] = True
    assert technique(old) == "overlap" and technique_times(old) == {"overlap": won}


def test_explain_first_screen_is_a_summary_and_steps_an_option(tmp_path: Path) -> None:
    path = _data_parallel().save(tmp_path / "mlp.hplan")
    short = CliRunner().invoke(main, ["explain", str(path)], catch_exceptions=False)
    assert short.exit_code == 0, short.output
    lines = short.output.splitlines()
    assert len(lines) <= 30, short.output
    assert lines[0].startswith("plan for mlp on estimated (2 devices)")
    assert lines[1].startswith("technique: SPMD (data parallel)")
    assert "DP-EV" in lines[2] and "DP-CP" in lines[2] and lines[2].startswith("predicted per step:")
    for term in ("DP-EV / DP-CP =", "Identity", "Gather(d)", "Reduce", "sharded", "docs/explain.md"):
        assert term in short.output, term
    assert "\nsteps:" not in short.output and "--steps" in lines[-1]
    assert (Path(__file__).resolve().parents[2] / "docs" / "explain.md").is_file()
    full = CliRunner().invoke(main, ["explain", "--steps", str(path)], catch_exceptions=False)
    assert full.output.startswith(short.output.rsplit("\n", 2)[0])  # the same summary first
    for step in Plan.load(path).program["steps"]:
        assert step["node"] in full.output
    assert Plan.load(path).explain() == full.output.rstrip("\n")  # Plan.explain() is the full text


def test_each_search_pass_says_why_it_ran(tmp_path: Path) -> None:
    plain = _data_parallel().doc["stats"]["passes"]
    assert [(p["why"], p["kept"]) for p in plain] == [("the first search", True)]
    # devices too small for the program without recomputation: a second search with it
    profile = estimated_profile(2, flops=[2e10, 1e10])
    profile = dataclasses.replace(profile, devices=[dataclasses.replace(d, memory=1.7e6) for d in profile.devices])
    plan = compile_plan(_mlp(8), profile)
    passes = plan.doc["stats"]["passes"]
    assert len(passes) >= 2 and passes[0]["why"] == "the first search"
    assert any("recomputation" in p["what"] and "memory binds" in p["why"] for p in passes[1:]), passes
    assert sum(p["kept"] for p in passes) == 1
    assert f"in {len(passes)} passes: first " in plan.explain(steps=False)
    assert f"SPMD search passes: {len(passes)}" in plan.explain()
    graph = _mlp(8).save(tmp_path / "mlp.hapg")
    saved = profile.save(tmp_path / "small.json")
    done = CliRunner().invoke(main, ["compile", str(graph), "-p", str(saved)], catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert "SPMD search" in done.output and "passes," in done.output and "plan: SPMD" in done.output
    assert "memory binds" in done.output
