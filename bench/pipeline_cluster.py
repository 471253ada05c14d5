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
too). Writes ``bench/out/pipeline_cluster.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
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
POLL_S = 30


def _load_emulated():
    name = "hapd_bench_emulated_cluster"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "emulated_cluster.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def log(msg: str) -> None:
    print(f"[pipeline {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


# ----------------------------------------------------------------------------- on each rank


class RankClock:
    """Per training step of this rank, seconds spent in each part (see the module
    docstring): ``step``, ``forward``, ``backward``, ``recv_forward``,
    ``recv_backward``, ``tied`` (pipeline ranks), ``wait_forward``, ``wait_backward``
    (SPMD ranks' collectives) and ``grad_sync`` (both)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.phase: str | None = None

    def add(self, key: str, seconds: float) -> None:
        if self.steps:
            step = self.steps[-1]
            step[key] = step.get(key, 0.0) + seconds

    def timed(self, fn, key: str, phase: str | None = None, new_step: bool = False):
        """``fn`` wrapped: its seconds added to ``key`` (``{phase}`` in ``key`` is the
        phase it runs in); with ``phase``, the phase while it runs; with ``new_step``, a
        new step record first."""
        clock = self

        def wrapper(*args, **kwargs):
            if new_step:
                clock.steps.append({})
            outer = clock.phase
            if phase is not None:
                clock.phase = phase
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.add(key.format(phase=outer or clock.phase), time.perf_counter() - t0)
                clock.phase = outer

        return wrapper

    def install(self) -> None:
        """Wrap the pipeline rank's step, forward, backward, receives and tied sum, the
        SPMD step's forward and backward, the collectives' wait and the gradient sum."""
        from hapd.runtime import collectives, gradsync, worker
        from hapd.runtime.pipeline import PipelineRank

        clock = self
        PipelineRank.step = self.timed(PipelineRank.step, "step", new_step=True)
        PipelineRank._forward = self.timed(PipelineRank._forward, "forward", phase="forward")
        PipelineRank._backward = self.timed(PipelineRank._backward, "backward", phase="backward")
        PipelineRank._complete = staticmethod(self.timed(PipelineRank._complete, "recv_{phase}"))
        PipelineRank._sum_tied = self.timed(PipelineRank._sum_tied, "tied")
        gradsync.GradSync._finish = self.timed(gradsync.GradSync._finish, "grad_sync")
        collectives.Pending.wait = self.timed(collectives.Pending.wait, "wait_{phase}")

        def plan_step(step):
            clock.steps.append({})
            t0 = time.perf_counter()
            clock.phase = "forward"
            loss = step.module(*step.inputs)
            t1 = time.perf_counter()
            clock.phase = "backward"
            loss.backward()
            t2 = time.perf_counter()
            clock.phase = None
            clock.add("forward", t1 - t0)
            clock.add("backward", t2 - t1)
            clock.add("step", t2 - t0)
            step.last_loss = loss.detach()
            return step.last_loss

        worker.PlanStep.__call__ = plan_step


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
    from hapd.runtime import worker

    compiled = worker._pipeline_plan

    def recorded(args, ns, env, model, full):
        plan = compiled(args, ns, env, model, full)
        if env.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "plan.json").write_text(json.dumps(plan_record(plan)))
            (out / "explain.txt").write_text(plan.explain())
        found = plan.doc.get("pipeline")
        if force and found and not found.get("chosen"):
            plan = Plan({**plan.doc, "pipeline": {**found, "chosen": True}})
        return plan

    worker._pipeline_plan = recorded


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
    clock = RankClock()
    clock.install()
    from hapd.runtime import worker

    code = worker.main(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"steps": clock.steps}))
    return code


def step_breakdown(waits: Path, warmup: int, iterations: int) -> list[dict[str, float]]:
    """Per rank (rank order): mean seconds per timed step of each part the
    :class:`RankClock` recorded, ``compute`` (forward + backward without the waits) and
    ``other`` (the step without forward and backward)."""
    out = []
    keys = ("step", "forward", "backward", "recv_forward", "recv_backward", "wait_forward", "wait_backward",
            "grad_sync", "tied")
    for path in sorted(waits.glob("rank*.json"), key=lambda p: int(p.stem[4:])):
        steps = json.loads(path.read_text())["steps"][warmup:iterations]
        if not steps:
            continue
        mean = {k: statistics.fmean(s.get(k, 0.0) for s in steps) for k in keys}
        waited = sum(mean[k] for k in ("recv_forward", "recv_backward", "wait_forward", "wait_backward", "grad_sync"))
        mean["compute"] = mean["forward"] + mean["backward"] - waited
        mean["other"] = mean["step"] - mean["forward"] - mean["backward"]
        out.append({"rank": int(path.stem[4:]), **mean})
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
    code = (
        "import os, sys, time, torch\n"
        f"open('{group}/cgroup.procs', 'w').write(str(os.getpid()))\n"
        "torch.set_num_threads(1)\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from hapd import models\n"
        f"net, cfg = models.build({model!r}, {size!r}, layers={layers})\n"
        f"for b in {list(batches)!r}:\n"
        f"    x = models.get({model!r}).example_inputs(cfg, b)\n"
        "    def step():\n"
        "        out = net(*x); (out if out.dim() == 0 else out.float().sum()).backward()\n"
        "    for _ in range(2): step()\n"
        "    n = 0; t0 = time.perf_counter()\n"
        "    while time.perf_counter() - t0 < 1.5 or n < 3: step(); n += 1\n"
        "    print(b, (time.perf_counter() - t0) / n / b, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        log(f"compute-rate probe failed: {done.stderr[-500:]}")
        return {}
    return {int(b): float(t) for b, t in (line.split() for line in done.stdout.strip().splitlines())}


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
    args = [str(Path(__file__).resolve().relative_to(ROOT)), "rank", str(waits)]
    if system == FORCED:
        args.append("--force")
    args += ["--model", model, "--size", ns.size, "--batch", str(ns.batch), "--layers", str(ns.layers),
             "--iterations", str(ns.iterations), "--warmup", str(ns.warmup), "--profile", str(profile)]
    if system != "spmd":
        args += ["--pipeline", "auto"]
    if trace is not None:
        args += ["--trace", str(trace)]
    report = runner.work / f"{tag}.json"
    for attempt in (1, 2):  # a rank now and then aborts in Gloo's teardown
        shutil.rmtree(waits, ignore_errors=True)
        report.unlink(missing_ok=True)
        t0 = time.monotonic()
        done = runner.launch(args, report, timeout=ns.run_timeout)
        data = json.loads(report.read_text()) if report.exists() else {}
        summary = data.get("summary") or {}
        complete = not data.get("missing_ranks") and summary.get("mean_s")
        if complete:
            break
    row: dict[str, Any] = {"model": model, "system": system, "exit_code": done.returncode, "attempt": attempt,
                           "wall_s": time.monotonic() - t0}
    if (waits / "plan.json").exists():
        row["plan"] = json.loads((waits / "plan.json").read_text())
        OUT.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(waits / "explain.txt", OUT / f"pipeline_explain_{model}_{system}.txt")
    if not complete:
        row["error"] = error_line(done.stderr or done.stdout)
        return row
    ranks = summary["ranks"]
    count = min(len(r["iteration_s"]) for r in ranks)
    row["job_s"] = [max(r["iteration_s"][i] for r in ranks) for i in range(summary["warmup"], count)]
    row.update(mean_s=summary["mean_s"], std_s=summary["std_s"], loss=summary.get("loss"),
               estimate_s=summary.get("estimate_s"), spmd_estimate_s=summary.get("spmd_estimate_s"),
               pipeline=summary.get("pipeline"), per_rank_mean_s=[r["mean_s"] for r in ranks],
               breakdown=step_breakdown(waits, summary["warmup"], count))
    return row


def error_line(text: str) -> str:
    """The line of a failed job's output that names the error (``...Error: ...``), else
    its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"\b\w*(Error|Exception): ", line)]
    return (named or lines or [""])[-1][-400:]


def pooled(rows: Sequence[Mapping[str, Any]]) -> tuple[float | None, float | None, int]:
    """Mean and (population) std of every timed iteration of ``rows``, and their count."""
    times = [t for r in rows for t in r.get("job_s", [])]
    if not times:
        return None, None, 0
    return statistics.fmean(times), statistics.pstdev(times), len(times)


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
            cell: dict[str, Any] = {"mean_s": mean, "std_s": std, "iterations": n, "estimate_s": estimate,
                                    "failed": sum(1 for r in mine if r.get("error")),
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
        by_round: dict[int, dict[str, float]] = {}
        for r in runs:
            if r.get("mean_s"):
                by_round.setdefault(r["round"], {})[r["system"]] = r["mean_s"]
        row["round_speedups"] = [v["spmd"] / v["pipeline"] for _, v in sorted(by_round.items())
                                 if "spmd" in v and "pipeline" in v]
        rows.append(row)
    return rows


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = (f"{'model':>10} {'L':>2} {'spmd ms':>12} {'pipeline ms':>12} {'speedup':>7} {'pred':>6} "
            f"{'pred spmd':>9} {'err':>6} {'pred pipe':>9} {'err':>6} {'ideal before':>12} {'after':>6}  "
            f"forced pipeline ms (speedup, pred, err)")
    out = [head, "-" * len(head)]
    for r in rows:
        s, p, f = r.get("spmd", {}), r.get("pipeline", {}), r.get(FORCED, {})
        cell = lambda c: f"{_ms(c['mean_s'])} ± {_ms(c['std_s'])}" if c.get("mean_s") else "FAILED"  # noqa: E731
        pct = lambda c, k, fmt: fmt.format(c[k]) if c.get(k) is not None else "-"  # noqa: E731
        forced = "-"
        if f:
            forced = (f"{cell(f)} ({pct(r, 'forced_speedup', '{:.2f}x')}, {_ms(f.get('estimate_s'))}, "
                      f"{pct(f, 'rel_error', '{:+.0%}')})")
        out.append(f"{r['model']:>10} {r['layers']:>2} {cell(s):>12} {cell(p):>12} {pct(r, 'speedup', '{:.2f}x'):>7} "
                   f"{pct(r, 'predicted_speedup', '{:.2f}x'):>6} {_ms(s.get('estimate_s')):>9} "
                   f"{pct(s, 'rel_error', '{:+.0%}'):>6} {_ms(p.get('estimate_s')):>9} {pct(p, 'rel_error', '{:+.0%}'):>6} "
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
        tried = ", ".join(f"m={t['micro_batches']}: {_ms(t['per_iteration'])} ms" for t in plan.get("tried", []))
        lines.append(f"{model}: SPMD predicted {_ms(plan['spmd_estimate_s'])} ms (slowest device: compute "
                     f"{_ms(max(plan['spmd_compute'], default=None))} ms, communication "
                     f"{_ms(max(plan['spmd_communication'], default=None))} ms); best pipeline "
                     f"{_ms(plan.get('pipeline_estimate_s'))} ms ({verdict}): {describe_pipeline(plan.get('pipeline'))}; "
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
                         f"{st['block_count']:>6} {_ms(pred['compute']):>12} {_ms(compute):>8} "
                         f"{_ms(pred['idle'] + pred['sync']):>9} {_ms(rest):>8} {_ms(pred['boundary']):>6}")
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
                lines.append(f"{model:>10} {system:>8} {b['rank']:>4} {_ms(b['step']):>6} {_ms(b['compute']):>7} "
                             f"{_ms(b['recv_forward']):>8} {_ms(b['recv_backward']):>9} {_ms(b['wait_forward']):>8} "
                             f"{_ms(b['wait_backward']):>8} {_ms(b['grad_sync']):>8} {_ms(b['other']):>6}")
    return "\n".join(lines)


def targets(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = []
    won = [r for r in rows if (r.get("speedup") or 0) >= SPEEDUP_TARGET]
    speedups = ", ".join(f"{r['model']} {r['speedup']:.2f}x" for r in rows if r.get("speedup"))
    lines.append(f"{'MET ' if len(won) >= TARGET_MODELS else 'MISS'} hapd with pipelines ≥{SPEEDUP_TARGET}x hapd "
                 f"without on ≥{TARGET_MODELS} models: {speedups or 'no runs'}")
    errors = [abs(r[s]["rel_error"]) for r in rows for s in SYSTEMS if r.get(s, {}).get("rel_error") is not None]
    if errors:
        med = statistics.median(errors)
        lines.append(f"{'MET ' if med <= ERROR_TARGET else 'MISS'} cost-model median |relative error| {med:.1%} over "
                     f"{len(errors)} plan(s) run (target ≤{ERROR_TARGET:.0%})")
    forced = [abs(r[FORCED]["rel_error"]) for r in rows if r.get(FORCED, {}).get("rel_error") is not None]
    if forced:
        lines.append(f"     forced pipelines (not chosen): |relative error| "
                     + ", ".join(f"{r['model']} {r[FORCED]['rel_error']:+.0%}" for r in rows
                                 if r.get(FORCED, {}).get("rel_error") is not None))
    return lines


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


def report(results: dict[str, Any], out: Path | None) -> None:
    rows = summarize(results)
    results["table"] = rows
    results["targets"] = targets(rows)
    print()
    print(f"Pipelines on the emulated cluster ({results.get('variant')}, commit {results.get('commit')}): link {results.get('rate_mbit', 0):.1f} Mbit/s, "
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
        _save(results, out)


def _save(results: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    slim = json.loads(json.dumps(results, default=str))
    slim.get("profile", {}).pop("device_detail", None)
    path.write_text(json.dumps(slim, indent=1) + "\n")


# ----------------------------------------------------------------------------- main


def others_active() -> list[str]:
    """Other benchmarks' network namespaces and cpu cgroups (names starting ``hapd``)."""
    emulated = _load_emulated()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    found = [line.split()[0] for line in listed.stdout.splitlines() if line.startswith("hapd")]
    if emulated.CG_ROOT.exists():
        found += [p.name for p in emulated.CG_ROOT.iterdir() if p.is_dir() and p.name.startswith("hapd")]
    return found


def wait_for_others(limit_s: float) -> bool:
    """Poll until no other benchmark's namespaces or cgroups exist; False after ``limit_s``."""
    t0 = time.monotonic()
    while busy := others_active():
        if time.monotonic() - t0 > limit_s:
            log(f"still in use after {limit_s:.0f} s: {', '.join(busy)}")
            return False
        log(f"another benchmark is running ({', '.join(busy)}): waiting {POLL_S} s")
        time.sleep(POLL_S)
    return True


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
    p.add_argument("--variant", default="3:1", help="fast:slow cpu quota ratio (default 3:1)")
    p.add_argument("--rate-mbit", type=float, default=None, help="link rate (default: fast rank FLOP/s / 4000 FLOP/B)")
    p.add_argument("--batch", type=int, default=64, help="global batch (default 64)")
    p.add_argument("--size", default="small", choices=("tiny", "small", "paper"))
    p.add_argument("--iterations", type=int, default=14, help="iterations per run, warm-up included (default 14)")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2, help="runs of each system, interleaved ABBA (default 2)")
    p.add_argument("--no-forced", action="store_true", help="do not run the best pipeline when it is not chosen")
    p.add_argument("--trace", action="store_true", help="Chrome traces of each system's last run, into bench/out")
    p.add_argument("--full-profile", action="store_true", help="the profiler's full sizes/repeats (default quick)")
    p.add_argument("--wait-others", type=float, default=3 * 3600, help="seconds to wait for another benchmark")
    p.add_argument("--run-timeout", type=float, default=1200)
    p.add_argument("--keep", action="store_true", help="skip teardown (debugging)")
    p.add_argument("--out", type=Path, default=OUT / "pipeline_cluster.json")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, help="run nothing: re-print a saved results JSON")
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


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rank"]:
        return rank_main(argv[1:])
    ns = parse_args(argv)
    if ns.from_json is not None:
        report(json.loads(ns.from_json.read_text()), None)
        return 0
    emulated = _load_emulated()
    try:
        names = model_list(ns.models)
        fast, slow = emulated.parse_variant(ns.variant)
    except ValueError as e:
        print(f"pipeline_cluster: {e}", file=sys.stderr)
        return 2
    why = emulated.available()
    if why:
        print(f"pipeline_cluster: skipped: {why}")
        return 0
    signal.signal(signal.SIGTERM, emulated._on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if not wait_for_others(ns.wait_others):
        print("pipeline_cluster: skipped: another benchmark's cluster is still up")
        return 0
    work = Path(tempfile.mkdtemp(prefix="hapd-pipeline-"))
    cluster = None
    results: dict[str, Any] = {"variant": ns.variant, "quotas": [fast, fast, slow, slow], "batch": ns.batch,
                               "size": ns.size, "layers": ns.layers, "iterations": ns.iterations, "warmup": ns.warmup,
                               "rounds": ns.rounds, "period_us": emulated.PERIOD_US, "commit": _commit(), "models": {}}
    try:
        os.environ.setdefault("HAPD_HOME", str(work / "home"))
        groups = emulated.setup_cgroups([fast] * 4)
        rank_flops = emulated.measure_rank_flops(groups[0])
        rate = ns.rate_mbit or rank_flops / emulated.FLOP_PER_BYTE * 8 / 1e6
        results.update(fast_rank_flops=rank_flops, rate_mbit=rate)
        log(f"fast rank ({fast:.2f} core): {rank_flops / 1e9:.1f} GFLOP/s matmul -> link {rate:.1f} Mbit/s")
        for model in names:
            results["models"][model] = {"layers": ns.layers, "batch": ns.batch, "runs": [], "plan": None,
                                        "flops": emulated.model_flops(model, ns.size, ns.batch, ns.layers),
                                        "sample_s": sample_seconds(groups[0], model, ns.size, ns.layers,
                                                                   PER_RANK_BATCHES)}
        log("one fast rank alone, forward + backward per sample:\n" + format_rates(results))
        cluster = emulated.make_cluster_class()(work)
        cluster.create()
        cluster.shape(rate)
        cluster.start()
        hostfile = work / "hosts.txt"
        hostfile.write_text(cluster.host_lines(slots=[emulated.RANKS_PER_HOST] * 2, gpus=["fast", "slow"]))
        runner = emulated.Runner(cluster, work, hostfile, groups, ns.verbose)
        emulated.setup_cgroups([fast, fast, slow, slow])
        prof_path = work / "profile.json"
        t0 = time.monotonic()
        prof = runner.profile(prof_path, quick=not ns.full_profile)
        results["profile"] = prof
        log(f"profiled in {time.monotonic() - t0:.0f} s: FLOP/s " +
            ", ".join(f"{d['flops'] / 1e9:.1f}G" for d in prof["devices"]))
        for line in link_lines(prof, rate):
            log(line)
        for model in names:
            case = results["models"][model]
            for rnd in range(ns.rounds):
                order = [*SYSTEMS, FORCED] if rnd % 2 == 0 else [FORCED, *SYSTEMS[::-1]]
                for system in order:
                    if system == FORCED and not wants_forced(case, ns):
                        continue
                    last = rnd == ns.rounds - 1
                    trace = OUT / f"pipeline_trace_{model}_{system}.json" if ns.trace and last else None
                    row = run_system(runner, model, system, ns, prof_path, f"{model}-{system}-r{rnd}", trace)
                    row["round"] = rnd
                    case["runs"].append(row)
                    if system == "pipeline" and case["plan"] is None and row.get("plan"):
                        case["plan"] = row["plan"]
                        log(format_plans({"models": {model: case}}))
                    log(f"{model} {system} round {rnd}: " + (
                        f"{_ms(row['mean_s'])} ± {_ms(row['std_s'])} ms (predicted {_ms(row.get('estimate_s'))} ms, "
                        f"pipeline {row.get('pipeline')}, loss {row.get('loss')})"
                        if "error" not in row else f"FAILED {row['error']}"))
                    _save(results, ns.out)
        report(results, ns.out)
        return 0
    except KeyboardInterrupt:
        log("interrupted: tearing down")
        _save(results, ns.out)
        return 130
    finally:
        if ns.keep:
            log(f"--keep: leaving the cluster, cgroups and {work}")
        else:
            if cluster is not None:
                cluster.close()
            emulated.teardown_cgroups()
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
