#!/usr/bin/env python3
"""hapd with pipelines against hapd without them on the emulated cluster (transformers, batch 64).

    .venv/bin/python bench/pipeline_cluster.py                          # bert, gpt2_block, vit; 8 layers
    .venv/bin/python bench/pipeline_cluster.py --models vit --layers 4 --rounds 1
    .venv/bin/python bench/pipeline_cluster.py --trace                  # Chrome traces of the last round's runs
    .venv/bin/python bench/pipeline_cluster.py --from-json bench/out/pipeline_cluster.json

Needs root (network namespaces, tc, cpu cgroups v1); without it, prints why and exits 0.
Waits (polling every 30 s) while another benchmark's namespaces or cgroups exist.

The cluster is ``bench/emulated_cluster.py``'s (its cluster class and helpers): 2 hosts in
network namespaces joined by a ``tc tbf`` link at the fast rank's matmul FLOP/s / 4000
FLOP/B, 4 ranks in cpu cgroups at fast:slow 3:1 quotas (``--variant``; host 0 fast, host 1
slow), launched through the launcher, profiled once (the profile's ``p2p`` link, one
rank's message to a rank on the other host, is what the pipeline search prices the
boundaries at; the script says when a profile lacks it). Per model (``small`` size,
``--layers`` layers, global batch 64), through the launcher, interleaved ABBA over
``--rounds`` (round 0: spmd, pipeline[, forced]; round 1: [forced, ]pipeline, spmd; ...):

- **spmd**: ``worker.py --profile P``, hapd without pipelines;
- **pipeline**: ``worker.py --profile P --pipeline auto``: rank 0 compiles with pipelines
  in the plan space and every rank trains its stage when a pipeline is predicted faster
  (else this is the SPMD plan again);
- **forced** (only when the search keeps the SPMD plan; ``--no-forced`` skips it): the
  same compile with its best pipeline run anyway (this script's ``rank`` hook marks it
  chosen), so the cost model's "no" is checked against a measurement.

The worker's rank 0 records what its ``--pipeline auto`` compile predicted (this script's
``rank`` hook): the SPMD plan's and the best pipeline's times, the pipeline (stages,
micro-batches, bubble) or why none, and ``hapd explain``
(``bench/out/pipeline_explain_<model>_<system>.txt``).

Reported per model: each system's ms/iteration (mean ± std over every timed iteration of
its rounds; an iteration takes as long as its slowest rank), the speed-up (spmd /
pipeline), the predicted times (``estimate_s``) and the cost model's error, and the
fraction of ideal as ``emulated_cluster.py`` defines it (model FLOPs / Σ profiled device
FLOP/s / measured time) before (spmd) and after (pipeline). Where the time goes: every
rank runs ``worker.py`` through this script's ``rank`` subcommand, which times per step
the forward and backward passes; for a pipeline rank the time blocked receiving
activations (forward) and gradients (backward) from the other stage (1F1B's bubble and
the point-to-point transfers), the group's gradient sum and the rest of the step (posting
receives, waiting for the last sends, tied parameters' sum); for an SPMD rank the time
blocked in the plan's collectives and the gradient sum. Next to it, each stage's
predicted compute and the rest of its predicted iteration (``--trace``: Chrome traces
too). Writes ``bench/out/pipeline_cluster.json``. A pooled mean that lost failed rounds
says how many it pools; the targets read ``MISS (run failed: …)`` when every round of a
model's spmd or pipeline runs failed, and a failed run makes the script exit 1
(``--from-json`` too, re-printing such a run).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import _abrun as ab  # noqa: E402
from bench._abrun import OUT, ms, pooled, save  # noqa: E402

SCRIPT = str(Path(__file__).resolve().relative_to(ROOT))
DEFAULT_MODELS = "bert,gpt2_block,vit"
DEFAULT_LAYERS = 8
"""Layers of every model by default: the ``small`` width (256) with 8 layers keeps an
iteration at 1.5-2.5 s on the emulated cluster and the LM head (a quarter of BERT's and
GPT-2's FLOPs at 4 layers) a smaller share of the last stage, which the slow host runs;
at 4 layers the search keeps the SPMD plans (docs/emulated_cluster.md, "Pipelines")."""
SYSTEMS = ("spmd", "pipeline")
FORCED = "forced"
SPEEDUP_TARGET = 1.3
"""Pipeline / SPMD speed-up the benchmark checks, on at least :data:`TARGET_MODELS` models."""
TARGET_MODELS = 2
ERROR_TARGET = 0.10
"""Median |relative error| of the cost model over the runs hapd chose."""
log = ab.logger("pipeline")


# ----------------------------------------------------------------------------- on each rank


class RankClock(ab.RankClock):
    """:class:`_abrun.RankClock` with a pipeline rank's parts too (see the module
    docstring): ``recv_forward`` and ``recv_backward``, blocked receiving from the other
    stage, and ``tied``, the tied parameters' sum."""

    def install(self) -> None:
        """Wrap the pipeline rank's step, forward, backward, receives and tied sum, and
        what :meth:`_abrun.RankClock.install` wraps."""
        from hapd.spmd.pipeline import PipelineRank

        PipelineRank.step = self.timed(PipelineRank.step, "step", new_step=True)
        PipelineRank._forward = self.timed(PipelineRank._forward, "forward", phase="forward")
        PipelineRank._backward = self.timed(PipelineRank._backward, "backward", phase="backward")
        PipelineRank._complete = staticmethod(self.timed(PipelineRank._complete, "recv_{phase}"))
        PipelineRank._sum_tied = self.timed(PipelineRank._sum_tied, "tied")
        super().install()


def plan_record(plan) -> dict[str, Any]:
    """What a ``--pipeline auto`` compile predicted: the SPMD plan's estimate (per
    iteration, and per device its compute and communication), the best pipeline found
    (chosen or not) with its estimate, or why none, and the micro-batch counts tried."""
    searched = plan.doc["stats"].get("pipeline") or {}
    found = plan.doc.get("pipeline")
    estimate = plan.estimate
    return {"spmd_estimate_s": found["spmd_only_per_iteration"] if found else estimate["per_iteration"],
            "spmd_compute": list(estimate.get("compute") or []),
            "spmd_communication": list(estimate.get("communication") or []),
            "pipeline": json.loads(json.dumps(found)) if found else None,
            "pipeline_estimate_s": found["per_iteration"] if found else None,
            "chosen": bool(found and found.get("chosen")), "reason": searched.get("reason", ""),
            "tried": searched.get("tried", []), "search_s": searched.get("seconds")}


def record_plan(out: Path, force: bool) -> None:
    """Wrap ``worker.py --pipeline auto``'s compile: rank 0 writes ``out/plan.json``
    (:func:`plan_record`) and ``out/explain.txt`` (``hapd explain``); with ``force``
    every rank then runs the best pipeline the compile found even when the SPMD plan
    was predicted faster (the plan's pipeline marked chosen)."""
    from hapd.compiler.plan import Plan
    from hapd.harness import worker

    compiled = worker.pipeline_plan

    def recorded(args, ns, env, model, full, profile):
        plan = compiled(args, ns, env, model, full, profile)
        if env.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "plan.json").write_text(json.dumps(plan_record(plan)))
            (out / "explain.txt").write_text(plan.explain())
        found = plan.doc.get("pipeline")
        if force and found and not found.get("chosen"):
            plan = Plan({**plan.doc, "pipeline": {**found, "chosen": True}})
        return plan

    worker.pipeline_plan = recorded


def rank_main(argv: Sequence[str]) -> int:
    """``pipeline_cluster.py rank DIR [--force] WORKER-ARGS...``: run ``worker.py`` with
    a :class:`RankClock` and :func:`record_plan`; writes ``DIR/rank<RANK>.json``."""
    if len(argv) < 1:
        print("usage: pipeline_cluster.py rank DIR [--force] WORKER-ARGS...", file=sys.stderr)
        return 2
    out, args = Path(argv[0]), list(argv[1:])
    force = args[:1] == ["--force"]
    if force:
        args = args[1:]
    record_plan(out, force)
    return ab.clocked_worker(out, args, RankClock())


def step_breakdown(waits: Path, warmup: int, iterations: int) -> list[dict[str, float]]:
    """Per rank (rank order): mean seconds per timed step of each part the
    :class:`RankClock` recorded, ``compute`` (forward + backward without the waits) and
    ``other`` (the step without forward and backward)."""
    keys = ("step", "forward", "backward", "recv_forward", "recv_backward", "wait_forward", "wait_backward",
            "grad_sync", "tied")
    out = ab.mean_steps(waits, warmup, iterations, keys)
    for mean in out:
        waited = sum(mean[k] for k in ("recv_forward", "recv_backward", "wait_forward", "wait_backward", "grad_sync"))
        mean["compute"] = mean["forward"] + mean["backward"] - waited
        mean["other"] = mean["step"] - mean["forward"] - mean["backward"]
    return out


# ----------------------------------------------------------------------------- plans


def wants_forced(case: Mapping[str, Any], ns: argparse.Namespace) -> bool:
    """Whether to run the best pipeline anyway: the compile found one and kept the SPMD plan."""
    plan = case.get("plan") or {}
    return not ns.no_forced and bool(plan.get("pipeline")) and not plan.get("chosen")


def describe_pipeline(found: Mapping[str, Any] | None) -> str:
    if not found:
        return "none"
    stages = " | ".join(f"ranks {','.join(map(str, s['ranks']))}: {s['block_count']} blocks" for s in found["stages"])
    return f"{len(found['stages'])} stages ({stages}), m={found['micro_batches']}, bubble {found['bubble']:.0%}"


def stage_prediction(found: Mapping[str, Any]) -> list[dict[str, float]]:
    """Per stage of a pipeline plan: predicted compute per iteration (micro-batches ×
    forward + backward), gradient sync, boundary seconds and idle (the rest of the
    predicted iteration)."""
    m, total = found["micro_batches"], found["per_iteration"]
    out = []
    for s in found["stages"]:
        compute = m * (s["forward"] + s["backward"])
        out.append({"stage": s["index"], "ranks": list(s["ranks"]), "compute": compute, "sync": s["sync"],
                    "boundary": s["boundary_seconds"], "idle": total - compute - s["sync"]})
    return out


# ----------------------------------------------------------------------------- compute at small batches

PER_RANK_BATCHES = (2, 4, 8, 16, 24)
"""Per-rank batches whose compute rate is measured: a 16-, 8- or 4-micro-batch pipeline
gives each rank of a 2-rank stage 2, 4 or 8 samples of the global 64; the SPMD plan gives
a fast rank about 24."""


def sample_seconds(group: Path, model: str, size: str, layers: int, batches: Sequence[int]) -> dict[int, float]:
    """Seconds per sample of forward + backward of ``model`` in one process in the cpu
    cgroup ``group`` (1 thread, eager PyTorch) at each per-rank batch of ``batches``: how
    much slower a rank computes on a pipeline's small micro-batches than on the SPMD
    plan's share (the cost model prices compute at the profile's FLOP/s at any batch)."""
    try:
        steps = ab.emulated.step_seconds(group, model, size, layers, batches, 1.5, min_steps=3, timeout=600)
    except RuntimeError as e:
        log(f"compute-rate probe failed: {e}")
        return {}
    return {b: t / b for b, t in steps.items()}


def format_rates(results: Mapping[str, Any]) -> str:
    """Per model, ms per sample on one fast rank at each per-rank batch, and how many
    times the largest batch's rate that is."""
    lines = []
    for model, case in results.get("models", {}).items():
        rates = {int(b): t for b, t in (case.get("sample_s") or {}).items()}
        if not rates:
            continue
        best = rates[max(rates)]
        lines.append(f"{model}: " + ", ".join(f"batch {b}: {t * 1e3:.1f} ms/sample ({t / best:.2f}x)"
                                              for b, t in sorted(rates.items())))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- runs


def run_system(runner, model: str, system: str, ns: argparse.Namespace, profile: Path, tag: str,
               trace: Path | None) -> dict[str, Any]:
    """One ``worker.py`` job through the launcher (``--pipeline auto`` unless ``spmd``;
    forced: the best pipeline even when not chosen), one retry when it fails before every
    rank reported: job seconds per timed iteration, mean ± std, the worker's estimates,
    its pipeline and each rank's :func:`step_breakdown`."""
    waits = runner.work / f"waits-{tag}"
    args = [SCRIPT, "rank", str(waits)]
    if system == FORCED:
        args.append("--force")
    args += ["--model", model, "--size", ns.size, "--batch", str(ns.batch), "--layers", str(ns.layers),
             "--iterations", str(ns.iterations), "--warmup", str(ns.warmup), "--profile", str(profile)]
    if system != "spmd":
        args += ["--pipeline", "auto"]
    if trace is not None:
        args += ["--trace", str(trace)]
    row, done, summary = ab.launch(runner, model, system, args, waits, tag, ns.run_timeout)
    if (waits / "plan.json").exists():
        row["plan"] = json.loads((waits / "plan.json").read_text())
        OUT.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(waits / "explain.txt", OUT / f"pipeline_explain_{model}_{system}.txt")
    if summary is None:
        row["error"] = error_line(done.stderr or done.stdout)
        return row
    return ab.timed_row(row, summary, waits, step_breakdown, spmd_estimate_s=summary.get("spmd_estimate_s"),
                        pipeline=summary.get("pipeline"))


def error_line(text: str) -> str:
    """The line of a failed job's output that names the error (``...Error: ...``), else
    its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"\b\w*(Error|Exception): ", line)]
    return (named or lines or [""])[-1][-400:]


def summarize(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per model: each system's pooled ms/iteration, its estimate and the cost
    model's error, fraction of ideal, measured and predicted speed-ups, per round."""
    total_flops = sum(d["flops"] for d in results.get("profile", {}).get("devices", []))
    rows = []
    for model, case in results.get("models", {}).items():
        runs, plan = case.get("runs", []), case.get("plan") or {}
        row: dict[str, Any] = {"model": model, "layers": case["layers"], "batch": case["batch"],
                               "chosen": plan.get("chosen"), "found": describe_pipeline(plan.get("pipeline")),
                               "reason": plan.get("reason", "")}
        for system in (*SYSTEMS, FORCED):
            mine = [r for r in runs if r["system"] == system]
            if not mine:
                continue
            mean, std, n = pooled(mine)
            estimate = next((r["estimate_s"] for r in mine if r.get("estimate_s")), None)
            failed = [r for r in mine if r.get("error")]
            cell: dict[str, Any] = {"mean_s": mean, "std_s": std, "iterations": n, "estimate_s": estimate,
                                    "rounds": len(mine), "failed": len(failed),
                                    "why": failed[-1]["error"] if failed else None,
                                    "ran_pipeline": any(r.get("pipeline") for r in mine)}
            if mean and estimate:
                cell["rel_error"] = (estimate - mean) / mean
            if mean and total_flops and case.get("flops"):
                cell["fraction_of_ideal"] = case["flops"] / total_flops / mean
            row[system] = cell
        spmd, pipe = row.get("spmd", {}), row.get("pipeline", {})
        if spmd.get("mean_s") and pipe.get("mean_s"):
            row["speedup"] = spmd["mean_s"] / pipe["mean_s"]
        forced = row.get(FORCED, {})
        if spmd.get("mean_s") and forced.get("mean_s"):
            row["forced_speedup"] = spmd["mean_s"] / forced["mean_s"]
        if plan.get("spmd_estimate_s") and plan.get("pipeline_estimate_s"):
            row["predicted_speedup"] = plan["spmd_estimate_s"] / plan["pipeline_estimate_s"]
        row["round_speedups"] = ab.round_speedups(runs, "spmd", "pipeline")
        rows.append(row)
    return rows


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = (f"{'model':>10} {'L':>2} {'spmd ms':>12} {'pipeline ms':>12} {'speedup':>7} {'pred':>6} "
            f"{'pred spmd':>9} {'err':>6} {'pred pipe':>9} {'err':>6} {'ideal before':>12} {'after':>6}  "
            f"forced pipeline ms (speedup, pred, err)")
    out = [head, "-" * len(head)]
    for r in rows:
        s, p, f = r.get("spmd", {}), r.get("pipeline", {}), r.get(FORCED, {})
        cell = lambda c: f"{ms(c['mean_s'])} ± {ms(c['std_s'])}" if c.get("mean_s") else "FAILED"  # noqa: E731
        pct = lambda c, k, fmt: fmt.format(c[k]) if c.get(k) is not None else "-"  # noqa: E731
        forced = "-"
        if f:
            forced = (f"{cell(f)} ({pct(r, 'forced_speedup', '{:.2f}x')}, {ms(f.get('estimate_s'))}, "
                      f"{pct(f, 'rel_error', '{:+.0%}')})")
        out.append(f"{r['model']:>10} {r['layers']:>2} {cell(s):>12} {cell(p):>12} {pct(r, 'speedup', '{:.2f}x'):>7} "
                   f"{pct(r, 'predicted_speedup', '{:.2f}x'):>6} {ms(s.get('estimate_s')):>9} "
                   f"{pct(s, 'rel_error', '{:+.0%}'):>6} {ms(p.get('estimate_s')):>9} {pct(p, 'rel_error', '{:+.0%}'):>6} "
                   f"{pct(s, 'fraction_of_ideal', '{:.0%}'):>12} {pct(p, 'fraction_of_ideal', '{:.0%}'):>6}  {forced}")
    return "\n".join(out)


def format_failures(results: Mapping[str, Any]) -> str:
    """The error line of every failed run."""
    return "\n".join(f"FAILED {model} {r['system']} round {r['round']}: {r['error']}"
                     for model, case in results.get("models", {}).items() for r in case.get("runs", [])
                     if r.get("error"))


def format_plans(results: Mapping[str, Any]) -> str:
    """Per model, what the worker's ``--pipeline auto`` compile predicted: both
    estimates, the best pipeline (chosen or not) and each micro-batch count's best."""
    lines = []
    for model, case in results.get("models", {}).items():
        plan = case.get("plan") or {}
        if not plan:
            continue
        verdict = "chosen" if plan.get("chosen") else f"not chosen{': ' + plan['reason'] if plan.get('reason') else ''}"
        tried = ", ".join(f"m={t['micro_batches']}: {ms(t['per_iteration'])} ms" for t in plan.get("tried", []))
        lines.append(f"{model}: SPMD predicted {ms(plan['spmd_estimate_s'])} ms (slowest device: compute "
                     f"{ms(max(plan['spmd_compute'], default=None))} ms, communication "
                     f"{ms(max(plan['spmd_communication'], default=None))} ms); best pipeline "
                     f"{ms(plan.get('pipeline_estimate_s'))} ms ({verdict}): {describe_pipeline(plan.get('pipeline'))}; "
                     f"tried {tried or 'nothing'}")
    return "\n".join(lines)


def format_stages(results: Mapping[str, Any]) -> str:
    """Per model whose pipeline ran, each stage's predicted compute (micro-batches ×
    forward + backward) and the rest of the predicted iteration (idle: fill, drain,
    point-to-point, gradient sync) against the measured compute and waits (step minus
    compute) of its ranks, last round's run."""
    lines = [f"{'model':>10} {'system':>8} {'stage':>5} {'ranks':>5} {'blocks':>6} {'pred compute':>12} "
             f"{'measured':>8} {'pred rest':>9} {'measured':>8} {'p2p/mb':>6}"]
    for model, case in results.get("models", {}).items():
        found = (case.get("plan") or {}).get("pipeline")
        runs = [r for r in case.get("runs", []) if r.get("pipeline") and r.get("breakdown")]
        if not found or not runs:
            continue
        run = runs[-1]
        by_rank = {b["rank"]: b for b in run["breakdown"]}
        for st, pred in zip(found["stages"], stage_prediction(found)):
            mine = [by_rank[r] for r in st["ranks"] if r in by_rank]
            if not mine:
                continue
            compute = statistics.fmean(b["compute"] for b in mine)
            rest = statistics.fmean(b["step"] - b["compute"] for b in mine)
            lines.append(f"{model:>10} {run['system']:>8} {st['index']:>5} {','.join(map(str, st['ranks'])):>5} "
                         f"{st['block_count']:>6} {ms(pred['compute']):>12} {ms(compute):>8} "
                         f"{ms(pred['idle'] + pred['sync']):>9} {ms(rest):>8} {ms(pred['boundary']):>6}")
    return "\n".join(lines)


def format_breakdown(results: Mapping[str, Any]) -> str:
    """Per model and system, each rank's mean ms per step (last round's run)."""
    lines = [f"{'model':>10} {'system':>8} {'rank':>4} {'step':>6} {'compute':>7} {'recv act':>8} {'recv grad':>9} "
             f"{'coll fwd':>8} {'coll bwd':>8} {'grad sum':>8} {'other':>6}"]
    for model, case in results.get("models", {}).items():
        for system in (*SYSTEMS, FORCED):
            runs = [r for r in case.get("runs", []) if r["system"] == system and r.get("breakdown")]
            if not runs:
                continue
            for b in runs[-1]["breakdown"]:
                lines.append(f"{model:>10} {system:>8} {b['rank']:>4} {ms(b['step']):>6} {ms(b['compute']):>7} "
                             f"{ms(b['recv_forward']):>8} {ms(b['recv_backward']):>9} {ms(b['wait_forward']):>8} "
                             f"{ms(b['wait_backward']):>8} {ms(b['grad_sync']):>8} {ms(b['other']):>6}")
    return "\n".join(lines)


def run_failed(rows: Sequence[Mapping[str, Any]]) -> tuple[str, int]:
    """``MISS (run failed: MODEL SYSTEM: ERROR)`` for the first spmd or pipeline system
    every round of which failed ("" when none did), and how many such systems there are."""
    lost = [(r["model"], s, r[s]["why"]) for r in rows for s in SYSTEMS
            if r.get(s, {}).get("failed") and not r[s].get("mean_s")]
    return (f"MISS (run failed: {lost[0][0]} {lost[0][1]}: {lost[0][2][-200:]})" if lost else ""), len(lost)


def pool_notes(rows: Sequence[Mapping[str, Any]]) -> str:
    """What the spmd and pipeline pooled means leave out: `` (MODEL SYSTEM: mean of K of N
    rounds (F failed: ERROR); ...)`` for each that lost failed rounds but not all; ""
    when none did."""
    notes = [f"{r['model']} {s}: mean of {c['rounds'] - c['failed']} of {c['rounds']} rounds ({c['failed']} failed: "
             f"{c['why'][-200:]})" for r in rows for s in SYSTEMS if (c := r.get(s, {})).get("failed") and c["mean_s"]]
    return f" ({'; '.join(notes)})" if notes else ""


def targets(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Both targets: MET or MISS, saying which pooled means lost failed rounds, or
    ``MISS (run failed: …)`` when every round of a model's spmd or pipeline runs failed."""
    lines = []
    failed, lost = run_failed(rows)
    notes = pool_notes(rows)
    won = [r for r in rows if (r.get("speedup") or 0) >= SPEEDUP_TARGET]
    speedups = ", ".join(f"{r['model']} {r['speedup']:.2f}x" for r in rows if r.get("speedup"))
    verdict = failed or ("MET " if len(won) >= TARGET_MODELS else "MISS")
    lines.append(f"{verdict} hapd with pipelines ≥{SPEEDUP_TARGET}x hapd without on ≥{TARGET_MODELS} models: "
                 f"{speedups or 'no runs'}{notes}")
    errors = [abs(r[s]["rel_error"]) for r in rows for s in SYSTEMS if r.get(s, {}).get("rel_error") is not None]
    if failed:
        med = f"{statistics.median(errors):.1%}" if errors else "-"
        lines.append(f"{failed} cost-model median |relative error| {med} over {len(errors)} plan(s) run, {lost} "
                     f"failed (target ≤{ERROR_TARGET:.0%}){notes}")
    elif errors:
        med = statistics.median(errors)
        lines.append(f"{'MET ' if med <= ERROR_TARGET else 'MISS'} cost-model median |relative error| {med:.1%} over "
                     f"{len(errors)} plan(s) run (target ≤{ERROR_TARGET:.0%}){notes}")
    forced = [abs(r[FORCED]["rel_error"]) for r in rows if r.get(FORCED, {}).get("rel_error") is not None]
    if forced:
        lines.append(f"     forced pipelines (not chosen): |relative error| "
                     + ", ".join(f"{r['model']} {r[FORCED]['rel_error']:+.0%}" for r in rows
                                 if r.get(FORCED, {}).get("rel_error") is not None))
    return lines


def exit_status(rows: Sequence[Mapping[str, Any]]) -> int:
    """The bench's exit code: 1 when a run of any model and system failed, else 0."""
    return 1 if any(r.get(s, {}).get("failed") for r in rows for s in (*SYSTEMS, FORCED)) else 0


def failure_line(results: Mapping[str, Any]) -> str:
    """How many runs failed, which, and the exit code that says so."""
    runs = [(model, r) for model, case in results.get("models", {}).items() for r in case.get("runs", [])]
    failed = [f"{model} {r['system']} round {r.get('round')}" for model, r in runs if r.get("error")]
    return f"{len(failed)} of {len(runs)} run(s) failed ({', '.join(failed)}): exit 1"


def link_lines(profile: Mapping[str, Any], rate_mbit: float | None) -> list[str]:
    """The profile's inter-host links next to the tbf rate."""
    lines = []
    colls = profile.get("collectives", {})
    if rate_mbit:
        lines.append(f"tbf rate {rate_mbit:.1f} Mbit/s = {rate_mbit / 8:.1f} MB/s per direction")
    for name in ("p2p", "broadcast", "grad_sync", "all_reduce"):
        link = (colls.get(name) or {}).get("inter")
        if link:
            lines.append(f"{name:>10} inter: α {link['alpha'] * 1e3:.2f} ms, β {link['beta'] / 1e6:.2f} MB/s")
        elif name == "p2p":
            lines.append("       p2p: NOT MEASURED (the pipeline search prices boundaries at broadcast's link)")
    return lines


def report(results: dict[str, Any], out: Path | None) -> int:
    """Print the table, the failures, the targets, the search, the stages and the
    breakdown; save the JSON to ``out``; the exit code (:func:`exit_status`, said in the
    last line)."""
    rows = summarize(results)
    results["table"] = rows
    results["targets"] = targets(rows)
    print()
    quotas = results.get("quotas") or []
    print(f"Pipelines on the emulated cluster ({results.get('variant')}, quotas {'/'.join(f'{q:.2f}' for q in quotas)} "
          f"= {sum(quotas):.2f} cores, commit {results.get('commit')}): link {results.get('rate_mbit', 0):.1f} Mbit/s, "
          f"global batch {results.get('batch')}, {results.get('iterations')} iterations ({results.get('warmup')} "
          f"warm-up) × {results.get('rounds')} round(s) per system")
    print("\n".join(link_lines(results.get("profile", {}), results.get("rate_mbit"))))
    print(format_table(rows))
    failures = format_failures(results)
    if failures:
        print(failures)
    print()
    print("\n".join(results["targets"]))
    print()
    print("what the search found:")
    print(format_plans(results))
    print()
    print("per stage, predicted against measured (ms per iteration; rest = the iteration without compute; "
          "p2p/mb = predicted point-to-point seconds per micro-batch, both ways):")
    print(format_stages(results))
    print()
    rates = format_rates(results)
    if rates:
        print("one fast rank alone (eager, no communication), forward + backward per sample by per-rank batch:")
        print(rates)
        print()
    print("ms per step on each rank (last round): recv = blocked receiving from the other stage; coll = blocked in "
          "collectives; compute = forward + backward without the waits; other = step without forward and backward")
    print(format_breakdown(results))
    if out is not None:
        save(results, out)
    if exit_status(rows):
        print()
        print(failure_line(results))
    return exit_status(rows)


# ----------------------------------------------------------------------------- main


def model_list(text: str) -> list[str]:
    from hapd.models import NAMES

    names = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in NAMES]
    if unknown or not names:
        raise ValueError(f"--models {text!r}: unknown {unknown or 'empty'}; choose from {', '.join(NAMES)}")
    return names


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=DEFAULT_MODELS, help=f"comma-separated models (default: {DEFAULT_MODELS})")
    p.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help=f"layers of every model (default {DEFAULT_LAYERS})")
    ab.add_cluster_flags(p)
    p.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    p.add_argument("--size", default="small", choices=("tiny", "small", "paper"))
    p.add_argument("--iterations", type=int, default=14, help="iterations per run, warm-up included (default 14)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="runs of each system, interleaved ABBA (default 2)")
    p.add_argument("--no-forced", action="store_true", help="do not run the best pipeline when it is not chosen")
    ab.add_run_flags(p, "system", OUT / "pipeline_cluster.json")
    ns = p.parse_args(argv)
    if ns.rounds < 1 or not 0 <= ns.warmup < ns.iterations or ns.layers < 2 or ns.batch < 4:
        p.error("need --rounds ≥ 1, 0 ≤ --warmup < --iterations, --layers ≥ 2 and --batch ≥ 4")
    return ns


def _commit() -> str | None:
    """The checkout's commit (the code every rank runs), ``+`` when files differ from it."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        return None
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "hapd", "rustcore"], cwd=ROOT).returncode != 0
    return head.stdout.strip() + ("+" if dirty else "")


def measure(session, rate: float, ns: argparse.Namespace, names: Sequence[str], fast: float, slow: float,
            results: dict[str, Any]) -> None:
    """Each model's compute rate on one fast rank, the cluster up and profiled, then per
    model its systems run; the report."""
    results["commit"] = _commit()  # when the run starts: the checkout may change while it waits for others
    for model in names:
        results["models"][model] = {"layers": ns.layers, "batch": ns.batch, "runs": [], "plan": None,
                                    "flops": ab.emulated.model_flops(model, ns.size, ns.batch, ns.layers),
                                    "sample_s": sample_seconds(session.groups[0], model, ns.size, ns.layers,
                                                               PER_RANK_BATCHES)}
    log("one fast rank alone, forward + backward per sample:\n" + format_rates(results))
    prof_path = ab.start_and_profile(session, rate, fast, slow, ns, results, log)
    for line in link_lines(results["profile"], rate):
        log(line)
    for model in names:
        run_model(session.runner, model, results["models"][model], ns, prof_path, results)
    report(results, ns.out)


def run_model(runner, model: str, case: dict[str, Any], ns: argparse.Namespace, profile: Path,
              results: dict[str, Any]) -> None:
    """The model's systems interleaved ABBA over ``--rounds`` (round 0: spmd, pipeline[,
    forced]; round 1 reversed); the plan the first pipeline run compiled is the case's."""

    def run(system: str, rnd: int) -> dict[str, Any] | None:
        if system == FORCED and not wants_forced(case, ns):
            return None
        row = run_system(runner, model, system, ns, profile, f"{model}-{system}-r{rnd}",
                         ab.trace_path("pipeline", model, system, ns, rnd))
        if system == "pipeline" and case["plan"] is None and row.get("plan"):
            case["plan"] = row["plan"]
            log(format_plans({"models": {model: case}}))
        return row

    ab.interleaved([*SYSTEMS, FORCED], ns.rounds, case["runs"], run, lambda: save(results, ns.out), log,
                   shown=("pipeline",))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rank"]:
        return rank_main(argv[1:])
    ns = parse_args(argv)
    if ns.from_json is not None:
        return report(json.loads(ns.from_json.read_text()), None)
    try:
        names = model_list(ns.models)
        fast, slow = ab.emulated.parse_variant(ns.variant, ns.cores)
    except ValueError as e:
        print(f"pipeline_cluster: {e}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"variant": ns.variant, "quotas": [fast, fast, slow, slow], "batch": ns.batch,
                               "size": ns.size, "layers": ns.layers, "iterations": ns.iterations, "warmup": ns.warmup,
                               "rounds": ns.rounds, "period_us": ab.emulated.PERIOD_US, "commit": None, "models": {}}
    code = ab.run_on_cluster("pipeline", ns, fast, results, log,
                             lambda session, rate: measure(session, rate, ns, names, fast, slow, results))
    return code or exit_status(summarize(results))


if __name__ == "__main__":
    sys.exit(main())
