#!/usr/bin/env python3
"""Overlapped duplicas (HiDup) against the plain program on the emulated cluster.

    .venv/bin/python bench/overlap_cluster.py                       # bert_moe expert-parallel, bert tensor-parallel
    .venv/bin/python bench/overlap_cluster.py --cases bert_moe=expert-parallel --rounds 3
    .venv/bin/python bench/overlap_cluster.py --trace               # also Chrome traces of each run's last round
    .venv/bin/python bench/overlap_cluster.py --cases bert_moe=expert-parallel --extra searched-plain,overlap-plain-ratios
    .venv/bin/python bench/overlap_cluster.py --from-json bench/out/overlap_cluster.json

Needs root (network namespaces, tc, cpu cgroups v1); without it, prints why and exits 0.
Waits (polling every 30 s) while another benchmark's namespaces or cgroups exist.

The cluster is ``bench/emulated_cluster.py``'s (its cluster class and helpers): 2 hosts in
network namespaces joined by a ``tc tbf`` link at the fast rank's matmul FLOP/s / 4000
FLOP/B, 4 ranks in cpu cgroups at fast:slow 3:1 quotas (``--variant``), launched
through the launcher, profiled once. Per case (a model and the parallelism its plans are
forced into), two plans are compiled here for that profile with the same forced rules:

- **plain**: the whole global batch's graph, ``CompileOptions(force=...)``: every
  collective inside forward and backward stalls its rank;
- **overlap**: half the batch's graph (one duplica), ``CompileOptions(overlap=True,
  force=...)``: the plan runs as two interleaved duplicas, each collective in flight
  while the other duplica computes (``hapd/spmd/duplicas.py``).

Both run through the launcher as ``worker.py --plan FILE`` on the same global batch,
interleaved ABBA over ``--rounds`` (plain, overlap, overlap, plain, ...), so drift of the
shared machine falls on both. Reported per case: each plan's measured ms/iteration (mean
± std over every timed iteration of its rounds; an iteration takes as long as its
slowest rank), the measured speedup (plain / overlap) and the cost model's predicted
speedup (ratio of the plans' ``estimate.per_iteration``), and what the unforced search
picks at this link, plain and overlapped (rules and estimates). ``--extra`` runs more
plans in the same rounds, each against plain: ``searched-plain`` (the unforced plain
plan, what hapd runs without overlap) and ``overlap-plain-ratios`` (the overlap program
at the plain plan's ratios: how much the overlap LP's ratios matter).

Where the time goes: each rank runs ``worker.py`` through this script's ``rank``
subcommand, which times, per training step, the forward and backward passes and the
time the main thread spends blocked in the plan's collectives
(:meth:`hapd.spmd.collectives.Pending.wait`: exposed communication, forward and
backward) and in the gradient sum's final wait (:class:`hapd.spmd.gradsync.GradSync`);
the rest is computation (with the collectives' own send/receive copies). Before the
cases, a probe (this script's ``probe`` subcommand on the 4 ranks) answers whether Gloo
moves a collective while the rank's main thread computes inside its cpu quota (Gloo's
threads share the rank's cgroup): an all-to-all alone, matmuls alone, and both at once.
Writes ``bench/out/overlap_cluster.json`` and each plan's ``hapd explain`` beside it.
A pooled mean that lost failed rounds says how many it pools; a target whose plain or
overlap runs all failed reads ``MISS (run failed: …)``, and a failed run makes the
script exit 1 (``--from-json`` too, re-printing such a run).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import _abrun as ab  # noqa: E402
from bench._abrun import OUT, ms, pooled, save  # noqa: E402

SCRIPT = str(Path(__file__).resolve().relative_to(ROOT))
DEFAULT_CASES = "bert_moe=expert-parallel,bert=tensor-parallel"
SPEEDUP_TARGET = {"expert-parallel": 1.2}
"""Parallelism → the measured overlap speedup the benchmark checks (BERT-MoE's)."""
SYSTEMS = ("plain", "overlap")
EXTRA_SYSTEMS = {
    "searched-plain": "the unforced search's plain plan (what hapd runs without overlap)",
    "overlap-plain-ratios": "the forced overlap program at the plain plan's ratios",
}
"""Plans ``--extra`` also runs, each against ``plain``."""
TP_COLUMN = ("attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.fc1.weight")
TP_ROW = ("attn.out.weight", "mlp.fc2.weight")
"""Megatron's pairs in the benchmark transformers: the attention projections and the
FFN's first linear column-parallel, the attention output and the FFN's second linear
row-parallel (one all-reduce after each pair, forward and backward)."""
log = ab.logger("overlap")


# ----------------------------------------------------------------------------- forced rules


def _parameter_targets(doc: Mapping[str, Any], node: Mapping[str, Any]) -> list[str]:
    nodes = doc["nodes"]
    return [nodes[ref[0]]["target"] for ref in node["inputs"] if nodes[ref[0]]["kind"] == "parameter"]


def expert_parallel(doc: Mapping[str, Any]) -> dict[str, str]:
    """Every einsum over a parameter (BERT-MoE's stacked expert weights ``w1``, ``w2``)
    → ``expert-parallel``; the rest is searched."""
    return {n["name"]: "expert-parallel" for n in doc["nodes"]
            if n.get("op") == "aten.einsum" and _parameter_targets(doc, n)}


def tensor_parallel(doc: Mapping[str, Any]) -> dict[str, str]:
    """Megatron's tensor parallelism: :data:`TP_COLUMN` linears column-parallel,
    :data:`TP_ROW` linears row-parallel; the rest (attention, the head) is searched."""
    out = {}
    for n in doc["nodes"]:
        if n.get("op") != "aten.linear":
            continue
        weight = next(iter(_parameter_targets(doc, n)), "")
        if weight.endswith(TP_COLUMN):
            out[n["name"]] = "column-parallel"
        elif weight.endswith(TP_ROW):
            out[n["name"]] = "row-parallel"
    return out


FORCES: dict[str, Callable[[Mapping[str, Any]], dict[str, str]]] = {
    "expert-parallel": expert_parallel, "tensor-parallel": tensor_parallel}


def parse_cases(text: str) -> dict[str, str]:
    """``--cases``: ``MODEL=PARALLELISM,...`` → {model: parallelism}."""
    from hapd.models import NAMES

    cases = {}
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        model, _, how = item.partition("=")
        model, how = model.strip(), how.strip()
        if model not in NAMES:
            raise ValueError(f"--cases {item!r}: unknown model {model!r}; choose from {', '.join(NAMES)}")
        if how not in FORCES:
            raise ValueError(f"--cases {item!r}: parallelism {how!r} is not one of {', '.join(FORCES)}")
        cases[model] = how
    if not cases:
        raise ValueError("--cases is empty")
    return cases


# ----------------------------------------------------------------------------- plans


def rule_counts(plan) -> dict[str, int]:
    """How many steps of the plan run each rule."""
    return dict(collections.Counter(s["rule"] for s in plan.program["steps"]))


def not_forced(plan, force: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """(node, forced rule, rule run) of each forced node the plan runs otherwise."""
    ran = {s["node"]: s["rule"] for s in plan.program["steps"]}
    return sorted((node, rule, str(ran.get(node))) for node, rule in force.items() if ran.get(node) != rule)


def plan_record(plan, path: Path | None) -> dict[str, Any]:
    estimate = plan.estimate
    return {"path": str(path) if path else None, "estimate_s": estimate["per_iteration"],
            "compute": estimate.get("compute"), "communication": estimate.get("communication"),
            "overlap": estimate.get("overlap"), "ratios": plan.ratios, "rules": rule_counts(plan)}


def compile_plans(model: str, how: str, size: str, batch: int, profile: Path, work: Path,
                  searched: bool = True, extra: Sequence[str] = ()) -> dict[str, Any]:
    """The case's forced plain and overlap plans, with ``searched`` what the unforced
    search picks, plain and overlapped, and the ``extra`` systems' plans
    (:data:`EXTRA_SYSTEMS`); each saved under ``work``, explained under ``bench/out`` and
    described by :func:`plan_record` with its compile seconds."""
    import torch

    import hapd
    from hapd import models
    from hapd.compiler.options import CompileOptions
    from hapd.profile.schema import load_profile
    from hapd.train.programs import Recipe

    prof = load_profile(profile)
    torch.manual_seed(0)
    net, config = models.build(model, size)
    recipe = Recipe(model=net, example_inputs=tuple(models.get(model).example_inputs(config, batch)),
                    batch_dims=tuple(models.get(model).batch_dims), name=model, profile=prof, use_daemon=False,
                    verbose=False, device=torch.device("cpu"))
    graphs = {False: recipe.export(True, recipe.example_shapes)[1], True: recipe.export(True, recipe.half_shapes())[1]}
    out: dict[str, Any] = {}
    kinds = [("plain", False, True), ("overlap", True, True)]
    if searched or "searched-plain" in extra:
        kinds += [("searched-plain", False, False), ("searched-overlap", True, False)]
    if "overlap-plain-ratios" in extra:
        kinds += [("overlap-plain-ratios", True, True)]
    plans: dict[str, Any] = {}
    for name, overlapped, forced in kinds:
        graph = graphs[overlapped]
        force = FORCES[how](graph.doc) if forced else {}
        ratios = tuple(plans["plain"].ratios) if name == "overlap-plain-ratios" else None
        t0 = time.monotonic()
        plan = hapd.compile(graph, prof, CompileOptions(overlap=overlapped, force=force, ratios=ratios))
        seconds = time.monotonic() - t0
        plans[name] = plan
        path = plan.save(work / f"{model}-{name}.hplan")
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"overlap_explain_{model}_{name}.txt").write_text(plan.explain())
        record = {**plan_record(plan, path), "compile_s": seconds, "forced": len(force)}
        missed = not_forced(plan, force)
        if missed:
            raise RuntimeError(f"{model} {name}: the plan does not run the forced rules {missed[:5]}")
        out[name] = record
        log(f"{model} {name}: predicted {record['estimate_s'] * 1e3:.0f} ms, ratios "
            f"{[round(r, 3) for r in plan.ratios]}, rules {record['rules']} ({seconds:.0f} s)")
    return out


# ----------------------------------------------------------------------------- on each rank


def rank_main(argv: Sequence[str]) -> int:
    """``overlap_cluster.py rank DIR WORKER-ARGS...``: run ``worker.py`` with a
    :class:`~_abrun.RankClock`; writes ``DIR/rank<RANK>.json``."""
    if len(argv) < 1:
        print("usage: overlap_cluster.py rank DIR WORKER-ARGS...", file=sys.stderr)
        return 2
    return ab.clocked_worker(Path(argv[0]), list(argv[1:]), ab.RankClock())


# ----------------------------------------------------------------------------- runs


PROBE_MIB = 4.0
"""Bytes each rank sends in the background-progress probe's all-to-all."""
CALIBRATE_S = 0.5
"""Seconds of matmuls that measure a rank's rate under its quota (50 CFS periods)."""


def probe_main(argv: Sequence[str]) -> int:
    """``overlap_cluster.py probe DIR [MIB]``: does a collective progress while the main
    thread computes, inside the rank's cpu cgroup? Times an async all-to-all of ``MIB``
    per rank alone (``comm``), 256² matmuls sized to take as long alone (``compute``),
    and both at once (``both``: started together, the wait after the matmuls; ``waited``:
    that wait). Perfect background progress gives ``both`` ≈ max, none gives the sum.
    Writes ``DIR/rank<RANK>.json``."""
    import torch
    import torch.distributed as dist

    from hapd.harness.training import shutdown
    from hapd.spmd.distributed import init_distributed

    out, mib = Path(argv[0]), float(argv[1]) if len(argv) > 1 else PROBE_MIB
    env = init_distributed()
    torch.set_num_threads(1)
    n = max(env.world, int(mib * 2**20 / 4) // env.world * env.world)
    send, recv, a = torch.randn(n), torch.empty(n), torch.randn(256, 256)

    def comm():
        return dist.all_to_all_single(recv, send, async_op=True)

    def compute(k: int) -> None:
        for _ in range(k):
            a @ a

    comm().wait()
    reps, clock = 3, time.perf_counter
    dist.barrier()
    t0 = clock()
    for _ in range(reps):
        comm().wait()
    comm_s = (clock() - t0) / reps
    done, t0 = 0, clock()
    while clock() - t0 < CALIBRATE_S:  # many CFS periods: the rate under the quota, not a burst's
        compute(1)
        done += 1
    k = max(1, round(comm_s / ((clock() - t0) / done)))
    alone, both, waited = [], [], []
    for _ in range(reps):
        dist.barrier()
        t0 = clock()
        compute(k)
        alone.append(clock() - t0)
        dist.barrier()
        t0 = clock()
        work = comm()
        compute(k)
        t1 = clock()
        work.wait()
        both.append(clock() - t0)
        waited.append(clock() - t1)
    compute_s = statistics.fmean(alone)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{env.rank}.json").write_text(json.dumps(
        {"rank": env.rank, "mib": mib, "comm_s": comm_s, "compute_s": compute_s, "matmuls": k,
         "both_s": statistics.fmean(both), "waited_s": statistics.fmean(waited)}))
    shutdown(env, wait=True)
    return 0


def hidden_fraction(p: Mapping[str, float]) -> float:
    """Of the shorter of comm and compute, the share hidden when both run at once
    (1: ``both`` = the sum minus it, perfect overlap; 0: serial)."""
    return (p["comm_s"] + p["compute_s"] - p["both_s"]) / min(p["comm_s"], p["compute_s"])


def run_probe(runner, ns: argparse.Namespace) -> list[dict[str, float]]:
    """:func:`probe_main` on the 4 ranks through the launcher; each rank's record."""
    out = runner.work / "probe"
    done = runner.launch([SCRIPT, "probe", str(out), str(PROBE_MIB)], None, timeout=ns.run_timeout)
    if done.returncode != 0:
        log(f"probe failed (exit {done.returncode}): {done.stderr[-400:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"), key=lambda p: int(p.stem[4:]))]
    for r in ranks:
        r["hidden"] = hidden_fraction(r)
    return ranks


def format_probe(ranks: Sequence[Mapping[str, float]]) -> str:
    lines = [f"{'rank':>4} {'comm ms':>8} {'compute ms':>10} {'both ms':>8} {'waited ms':>9} {'hidden':>7}"]
    for r in ranks:
        lines.append(f"{r['rank']:>4} {ms(r['comm_s']):>8} {ms(r['compute_s']):>10} {ms(r['both_s']):>8} "
                     f"{ms(r['waited_s']):>9} {r['hidden']:>7.0%}")
    return "\n".join(lines)


def step_breakdown(waits: Path, warmup: int, iterations: int) -> list[dict[str, float]]:
    """Per rank (rank order): mean seconds per timed step of forward, backward, waited
    in each, grad sync and the computation left (:func:`_abrun.mean_steps`)."""
    out = ab.mean_steps(waits, warmup, iterations, ("forward", "backward", "wait_forward", "wait_backward", "grad_sync"))
    for mean in out:
        mean["compute"] = (mean["forward"] + mean["backward"] - mean["wait_forward"] - mean["wait_backward"]
                           - mean["grad_sync"])
    return out


def run_plan(runner, model: str, system: str, plan: Path, ns: argparse.Namespace, tag: str,
             trace: Path | None) -> dict[str, Any]:
    """One ``worker.py --plan`` job through the launcher (:func:`_abrun.launch`): its job
    times per timed iteration, mean ± std, loss, the worker's estimate and each rank's
    :func:`step_breakdown`."""
    waits = runner.work / f"waits-{tag}"
    args = [SCRIPT, "rank", str(waits), "--model", model, "--size", ns.size, "--batch", str(ns.batch),
            "--iterations", str(ns.iterations), "--warmup", str(ns.warmup), "--plan", str(plan)]
    if trace is not None:
        args += ["--trace", str(trace)]
    row, done, summary = ab.launch(runner, model, system, args, waits, tag, ns.run_timeout)
    if summary is None:
        row["error"] = (done.stderr or done.stdout)[-800:]
        return row
    return ab.timed_row(row, summary, waits, step_breakdown, overlap=summary.get("overlap"))


def summarize(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per case: each system's pooled ms/iteration, measured and predicted
    speedups, per-round speedups."""
    rows = []
    for model, case in results.get("cases", {}).items():
        runs = case.get("runs", [])
        row: dict[str, Any] = {"model": model, "parallelism": case["parallelism"], "batch": case["batch"]}
        ran = list(dict.fromkeys([*SYSTEMS, *(r["system"] for r in runs)]))
        for system in ran:
            mine = [r for r in runs if r["system"] == system]
            mean, std, n = pooled(mine)
            failed = [r for r in mine if r.get("error")]
            row[system] = {"mean_s": mean, "std_s": std, "iterations": n,
                           "estimate_s": (case.get("plans", {}).get(system) or {}).get("estimate_s"),
                           "rounds": len(mine), "failed": len(failed),
                           "why": error_line(failed[-1]["error"]) if failed else None}
        plain, over = row["plain"], row["overlap"]
        if plain["mean_s"] and over["mean_s"]:
            row["speedup"] = plain["mean_s"] / over["mean_s"]
        if plain["estimate_s"] and over["estimate_s"]:
            row["predicted_speedup"] = plain["estimate_s"] / over["estimate_s"]
        row["extra"] = {}
        for system in ran[len(SYSTEMS):]:
            mine = row[system]
            row["extra"][system] = {
                "speedup": plain["mean_s"] / mine["mean_s"] if plain["mean_s"] and mine["mean_s"] else None,
                "predicted_speedup": (plain["estimate_s"] / mine["estimate_s"]
                                      if plain["estimate_s"] and mine["estimate_s"] else None)}
        row["round_speedups"] = ab.round_speedups(runs, "plain", "overlap")
        rows.append(row)
    return rows


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = (f"{'model':>9} {'parallelism':>15} {'plain ms':>14} {'overlap ms':>14} {'speedup':>8} {'predicted':>9} "
            f"{'pred plain':>10} {'pred overlap':>12}  per round")
    out = [head, "-" * len(head)]
    for r in rows:
        p, o = r["plain"], r["overlap"]
        cell = lambda s: f"{ms(s['mean_s'])} ± {ms(s['std_s'])}" if s["mean_s"] else "FAILED"  # noqa: E731
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
        pred = f"{r['predicted_speedup']:.2f}x" if r.get("predicted_speedup") else "-"
        rounds = ", ".join(f"{s:.2f}x" for s in r.get("round_speedups", []))
        out.append(f"{r['model']:>9} {r['parallelism']:>15} {cell(p):>14} {cell(o):>14} {speed:>8} {pred:>9} "
                   f"{ms(p['estimate_s']):>10} {ms(o['estimate_s']):>12}  {rounds}")
        for system, vs in r.get("extra", {}).items():
            ratio = lambda x: f"{x:.2f}x" if x else "-"  # noqa: E731
            out.append(f"{'':>9} {system:>15} {'':>14} {cell(r[system]):>14} {ratio(vs['speedup']):>8} "
                       f"{ratio(vs['predicted_speedup']):>9} {'':>10} {ms(r[system]['estimate_s']):>12}  "
                       f"(plain / this)")
    return "\n".join(out)


def format_breakdown(results: Mapping[str, Any]) -> str:
    """Per case and system, each rank's mean ms per step (last round's run)."""
    lines = [f"{'model':>9} {'system':>20} {'rank':>4} {'forward':>8} {'backward':>8} {'waited fwd':>10} "
             f"{'waited bwd':>10} {'grad sum':>8} {'compute':>8}"]
    for model, case in results.get("cases", {}).items():
        for system in dict.fromkeys(r["system"] for r in case.get("runs", [])):
            runs = [r for r in case.get("runs", []) if r["system"] == system and r.get("breakdown")]
            if not runs:
                continue
            for b in runs[-1]["breakdown"]:
                lines.append(f"{model:>9} {system:>20} {b['rank']:>4} {ms(b['forward']):>8} {ms(b['backward']):>8} "
                             f"{ms(b['wait_forward']):>10} {ms(b['wait_backward']):>10} {ms(b['grad_sync']):>8} "
                             f"{ms(b['compute']):>8}")
    return "\n".join(lines)


def format_searched(results: Mapping[str, Any]) -> str:
    lines = []
    for model, case in results.get("cases", {}).items():
        plans = case.get("plans", {})
        for name in ("searched-plain", "searched-overlap"):
            p = plans.get(name)
            if p:
                lines.append(f"{model} {name}: predicted {ms(p['estimate_s'])} ms, rules {p['rules']}")
    return "\n".join(lines)


def error_line(error: str) -> str:
    """A failed run's error in one line: its output's last (a traceback's names the error)."""
    return (error.strip().splitlines() or [""])[-1][-200:]


def systems_of(row: Mapping[str, Any]) -> list[str]:
    """The systems a :func:`summarize` row pooled: plain, overlap and the extras."""
    return [*SYSTEMS, *row.get("extra", {})]


def pool_note(row: Mapping[str, Any], system: str) -> str | None:
    """What a system's pooled mean leaves out: ``SYSTEM: mean of K of N rounds (F failed:
    ERROR)``; None when no round failed."""
    cell = row[system]
    if not cell.get("failed"):
        return None
    return (f"{system}: mean of {cell['rounds'] - cell['failed']} of {cell['rounds']} rounds ({cell['failed']} "
            f"failed: {cell['why']})")


def format_pools(rows: Sequence[Mapping[str, Any]]) -> str:
    """Per case, every system some of whose rounds failed: :func:`pool_note`."""
    return "\n".join(f"{r['model']} {note}" for r in rows for s in systems_of(r) if (note := pool_note(r, s)))


def targets(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """Every case's target: MET or MISS, saying which pooled mean lost failed rounds, or
    ``MISS (run failed: …)`` when every round of plain or overlap failed."""
    lines = []
    for r in rows:
        goal = SPEEDUP_TARGET.get(r["parallelism"])
        if goal is None:
            continue
        predicted = f"predicted {r.get('predicted_speedup', float('nan')):.2f}x"
        lost = next((s for s in SYSTEMS if r[s]["failed"] and not r[s]["mean_s"]), None)
        if lost is not None:
            lines.append(f"MISS (run failed: {lost}: {r[lost]['why']}) {r['model']} {r['parallelism']}: overlap "
                         f"against the plain program (target ≥{goal}x; {predicted})")
        elif r.get("speedup"):
            notes = "".join(f"; {note}" for s in SYSTEMS if (note := pool_note(r, s)))
            lines.append(f"{'MET ' if r['speedup'] >= goal else 'MISS'} {r['model']} {r['parallelism']}: overlap "
                         f"{r['speedup']:.2f}x the plain program (target ≥{goal}x; {predicted}{notes})")
    return lines


def exit_status(rows: Sequence[Mapping[str, Any]]) -> int:
    """The bench's exit code: 1 when a run of any case and system failed, else 0."""
    return 1 if any(r[s]["failed"] for r in rows for s in systems_of(r)) else 0


def failure_line(results: Mapping[str, Any]) -> str:
    """How many runs failed, which, and the exit code that says so."""
    runs = [(model, r) for model, case in results.get("cases", {}).items() for r in case.get("runs", [])]
    failed = [f"{model} {r['system']} round {r.get('round')}" for model, r in runs if r.get("error")]
    return f"{len(failed)} of {len(runs)} run(s) failed ({', '.join(failed)}): exit 1"


def report(results: dict[str, Any], out: Path | None) -> int:
    """Print the table, the targets, the breakdown, the probe and the unforced search;
    save the JSON to ``out``; the exit code (:func:`exit_status`, said in the last line)."""
    rows = summarize(results)
    results["table"] = rows
    results["targets"] = targets(rows)
    print()
    print(f"Overlapped duplicas on the emulated cluster ({results.get('variant')}): link "
          f"{results.get('rate_mbit', 0):.1f} Mbit/s, {results.get('iterations')} iterations "
          f"({results.get('warmup')} warm-up) × {results.get('rounds')} round(s) per plan")
    print(format_table(rows))
    pools = format_pools(rows)
    if pools:
        print(pools)
    print()
    print("\n".join(results["targets"]))
    print()
    print("ms per step on each rank (last round): waited = blocked on collectives; compute = the rest")
    print(format_breakdown(results))
    if results.get("probe"):
        print()
        print(f"background progress: an all-to-all of {PROBE_MIB:g} MiB per rank while the main thread computes")
        print(format_probe(results["probe"]))
    searched = format_searched(results)
    if searched:
        print()
        print("unforced search at this link:")
        print(searched)
    if out is not None:
        save(results, out)
    if exit_status(rows):
        print()
        print(failure_line(results))
    return exit_status(rows)


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=DEFAULT_CASES,
                   help=f"MODEL=PARALLELISM,... with PARALLELISM one of {', '.join(FORCES)} (default: {DEFAULT_CASES})")
    ab.add_cluster_flags(p)
    p.add_argument("--batch", type=int, default=64, help="global batch (even: each duplica has half) (default 64)")
    p.add_argument("--size", default="small", choices=("tiny", "small", "paper"))
    p.add_argument("--iterations", type=int, default=15, help="iterations per run, warm-up included (default 15)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2, help="runs of each plan, interleaved ABBA (default 2)")
    p.add_argument("--no-searched", action="store_true", help="do not compile the unforced plans")
    p.add_argument("--extra", default="", help="also run these plans against plain: " +
                   "; ".join(f"{k}: {v}" for k, v in EXTRA_SYSTEMS.items()))
    p.add_argument("--no-probe", action="store_true", help="skip the background-progress probe")
    ab.add_run_flags(p, "plan", OUT / "overlap_cluster.json")
    ns = p.parse_args(argv)
    ns.extra = [x.strip() for x in ns.extra.split(",") if x.strip()]
    unknown = [x for x in ns.extra if x not in EXTRA_SYSTEMS]
    if unknown:
        p.error(f"--extra {','.join(unknown)}: choose from {', '.join(EXTRA_SYSTEMS)}")
    if ns.batch < 2 or ns.batch % 2:
        p.error(f"--batch {ns.batch}: must be even (two duplicas of half the batch)")
    if ns.rounds < 1 or not 0 <= ns.warmup < ns.iterations:
        p.error("need --rounds ≥ 1 and 0 ≤ --warmup < --iterations")
    return ns


def measure(session, rate: float, ns: argparse.Namespace, cases: Mapping[str, str], fast: float, slow: float,
            results: dict[str, Any]) -> None:
    """The cluster up and profiled, the probe, then per case its plans compiled and run;
    the report."""
    prof_path = ab.start_and_profile(session, rate, fast, slow, ns, results, log)
    if not ns.no_probe:
        results["probe"] = run_probe(session.runner, ns)
        log("background progress probe:\n" + format_probe(results["probe"]))
    for model, how in cases.items():
        case: dict[str, Any] = {"parallelism": how, "batch": ns.batch, "runs": []}
        results["cases"][model] = case
        case["plans"] = compile_plans(model, how, ns.size, ns.batch, prof_path, session.work,
                                      searched=not ns.no_searched, extra=ns.extra)
        save(results, ns.out)
        run_case(session.runner, model, case, ns, results)
    report(results, ns.out)


def run_case(runner, model: str, case: dict[str, Any], ns: argparse.Namespace, results: dict[str, Any]) -> None:
    """The case's plain and overlap plans (and ``--extra``'s) on the same global batch,
    interleaved ABBA over ``--rounds``."""

    def run(system: str, rnd: int) -> dict[str, Any]:
        return run_plan(runner, model, system, Path(case["plans"][system]["path"]), ns, f"{model}-{system}-r{rnd}",
                        ab.trace_path("overlap", model, system, ns, rnd))

    ab.interleaved((*SYSTEMS, *ns.extra), ns.rounds, case["runs"], run, lambda: save(results, ns.out), log)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rank"]:
        return rank_main(argv[1:])
    if argv[:1] == ["probe"]:
        return probe_main(argv[1:])
    ns = parse_args(argv)
    if ns.from_json is not None:
        return report(json.loads(ns.from_json.read_text()), None)
    try:
        cases = parse_cases(ns.cases)
        fast, slow = ab.emulated.parse_variant(ns.variant, ns.cores)
    except ValueError as e:
        print(f"overlap_cluster: {e}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"variant": ns.variant, "quotas": [fast, fast, slow, slow], "batch": ns.batch,
                               "size": ns.size, "iterations": ns.iterations, "warmup": ns.warmup, "rounds": ns.rounds,
                               "period_us": ab.emulated.PERIOD_US, "cases": {}}
    code = ab.run_on_cluster("overlap", ns, fast, results, log,
                             lambda session, rate: measure(session, rate, ns, cases, fast, slow, results))
    return code or exit_status(summarize(results))


if __name__ == "__main__":
    sys.exit(main())
