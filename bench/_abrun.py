"""The A/B runner hapd's emulated-cluster benches share (``bench/overlap_cluster.py``,
``bench/pipeline_cluster.py``): each compares systems (plans, or worker options) on
``bench/emulated_cluster.py``'s cluster, every system's job run ``--rounds`` times
interleaved ABBA so that drift of the shared machine falls on all of them.

What lives here is what such a bench does whatever it measures:

- its command line's cluster and run flags (:func:`add_cluster_flags`,
  :func:`add_run_flags`), progress lines (:func:`logger`) and results file (:func:`save`);
- on each rank, :class:`RankClock` and :func:`clocked_worker`: ``worker.py`` with its
  forward and backward passes and the time blocked in collectives and the gradient sum
  recorded per step, read back by :func:`mean_steps`;
- per job, :func:`launch` (one retry when a rank fails before reporting) and
  :func:`timed_row` (job seconds per timed iteration: an iteration takes as long as its
  slowest rank);
- per case, :func:`interleaved` (the ABBA rounds), :func:`pooled` and
  :func:`round_speedups`;
- per run, :func:`run_on_cluster`: skip where the machine cannot host the cluster, wait
  while another benchmark's cluster is up, measure the link rate, tear down however it
  ends; :func:`start_and_profile` brings the cluster up and profiles it.

What each bench measures (its systems, its summary and report) stays in the bench.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
POLL_S = 30
"""Seconds between looks for another benchmark's cluster."""

Log = Callable[[str], None]


def load(stem: str) -> ModuleType:
    """``bench/STEM.py`` as module ``hapd_bench_STEM`` (the bench scripts are not a
    package; tests/_bench.py loads them under the same names, so all share one copy)."""
    name = f"hapd_bench_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


emulated = load("emulated_cluster")
"""``bench/emulated_cluster.py``: the cluster, its cgroups, the launcher's runner."""


def logger(name: str) -> Log:
    """A bench's progress line printer: ``[NAME HH:MM:SS] message``."""

    def log(msg: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    return log


def ms(x: float | None) -> str:
    """Seconds as whole milliseconds; ``-`` for none."""
    return "-" if x is None else f"{x * 1e3:.0f}"


def save(results: Mapping[str, Any], path: Path) -> None:
    """The results as JSON, without the profile's per-device detail."""
    path.parent.mkdir(parents=True, exist_ok=True)
    slim = json.loads(json.dumps(results, default=str))
    slim.get("profile", {}).pop("device_detail", None)
    path.write_text(json.dumps(slim, indent=1) + "\n")


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """``--variant``, ``--cores`` and ``--rate-mbit``: the ranks' quotas and the link's rate."""
    p.add_argument("--variant", default="3:1", help="fast:slow cpu quota ratio (default 3:1)")
    p.add_argument("--cores", type=float, default=2.0,
                   help="cores the 4 ranks' quotas sum to (default 2.0: the whole machine; less leaves networking "
                        "and Gloo's threads room, as separate machines would)")
    p.add_argument("--rate-mbit", type=float, default=None, help="link rate (default: fast rank FLOP/s / 4000 FLOP/B)")


def add_run_flags(p: argparse.ArgumentParser, what: str, out: Path) -> None:
    """How a run goes and where it writes: ``--trace`` (each ``what``'s last run),
    ``--full-profile``, ``--wait-others``, ``--run-timeout``, ``--keep``, ``--out``
    (default ``out``), ``-v`` and ``--from-json``."""
    p.add_argument("--trace", action="store_true", help=f"Chrome traces of each {what}'s last run, into bench/out")
    p.add_argument("--full-profile", action="store_true", help="the profiler's full sizes/repeats (default quick)")
    p.add_argument("--wait-others", type=float, default=3 * 3600, help="seconds to wait for another benchmark")
    p.add_argument("--run-timeout", type=float, default=1200)
    p.add_argument("--keep", action="store_true", help="skip teardown (debugging)")
    p.add_argument("--out", type=Path, default=out)
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--from-json", type=Path, default=None, help="run nothing: re-print a saved results JSON")


# ----------------------------------------------------------------------------- on each rank


class RankClock:
    """Per training step of this rank, seconds spent in each part: ``step``, ``forward``
    and ``backward``; ``wait_forward`` and ``wait_backward``, blocked in the plan's
    collectives (:meth:`hapd.spmd.collectives.Pending.wait`) in either pass; and
    ``grad_sync``, the gradient sum's final wait (:class:`hapd.spmd.gradsync.GradSync`).
    A bench times more parts with :meth:`timed` in its own :meth:`install`."""

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
        """Wrap the collectives' wait, the gradient sum's finish and the SPMD worker's
        step (its forward and backward timed apart)."""
        from hapd.harness import worker
        from hapd.spmd import collectives
        from hapd.spmd import gradsync

        clock = self
        gradsync.GradSync._finish = self.timed(gradsync.GradSync._finish, "grad_sync")
        collectives.Pending.wait = self.timed(collectives.Pending.wait, "wait_{phase}")

        def pack_step(step):
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

        worker.HapdStep.__call__ = pack_step


def clocked_worker(out: Path, args: list[str], clock: RankClock) -> int:
    """``worker.py ARGS`` on this rank with ``clock`` installed; writes the steps it
    recorded to ``out/rank<RANK>.json``."""
    clock.install()
    from hapd.harness import worker

    code = worker.main(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"steps": clock.steps}))
    return code


def mean_steps(waits: Path, warmup: int, iterations: int, keys: Sequence[str]) -> list[dict[str, float]]:
    """Per rank of the :func:`clocked_worker` files in ``waits`` (rank order): its rank and
    the mean seconds per timed step (``warmup`` to ``iterations``: a trace's extra steps
    after the timed ones are left out) of each of ``keys``, 0 where a step lacks it."""
    out = []
    for path in sorted(waits.glob("rank*.json"), key=lambda p: int(p.stem[4:])):
        steps = json.loads(path.read_text())["steps"][warmup:iterations]
        if steps:
            out.append({"rank": int(path.stem[4:]), **{k: statistics.fmean(s.get(k, 0.0) for s in steps) for k in keys}})
    return out


# ----------------------------------------------------------------------------- jobs


def launch(runner, model: str, system: str, args: list[str], waits: Path, tag: str,
           timeout: float) -> tuple[dict[str, Any], subprocess.CompletedProcess, dict[str, Any] | None]:
    """One job through the launcher, its ranks' clocks written under ``waits``, launched
    once more when it fails before every rank reported: its row (model, system, exit code,
    attempt, wall seconds), the finished launcher and the job's summary (None when the
    second attempt did not complete either)."""
    report = runner.work / f"{tag}.json"
    for attempt in (1, 2):  # a rank now and then aborts in Gloo's teardown
        shutil.rmtree(waits, ignore_errors=True)
        report.unlink(missing_ok=True)
        t0 = time.monotonic()
        done = runner.launch(args, report, timeout=timeout)
        data = json.loads(report.read_text()) if report.exists() else {}
        summary = data.get("summary") or {}
        complete = not data.get("missing_ranks") and summary.get("mean_s")
        if complete:
            break
    row: dict[str, Any] = {"model": model, "system": system, "exit_code": done.returncode, "attempt": attempt,
                           "wall_s": time.monotonic() - t0}
    return row, done, summary if complete else None


def timed_row(row: dict[str, Any], summary: Mapping[str, Any], waits: Path,
              breakdown: Callable[[Path, int, int], list[dict[str, float]]], **fields: Any) -> dict[str, Any]:
    """``row`` with a complete job's timings: the job's seconds per timed iteration (as
    long as its slowest rank), mean ± std, loss, the worker's estimate, ``fields``, each
    rank's mean and ``breakdown(waits, warmup, iterations)``."""
    ranks = summary["ranks"]
    count = min(len(r["iteration_s"]) for r in ranks)
    row["job_s"] = [max(r["iteration_s"][i] for r in ranks) for i in range(summary["warmup"], count)]
    row.update(mean_s=summary["mean_s"], std_s=summary["std_s"], loss=summary.get("loss"),
               estimate_s=summary.get("estimate_s"), **fields, per_rank_mean_s=[r["mean_s"] for r in ranks],
               breakdown=breakdown(waits, summary["warmup"], count))
    return row


def trace_path(bench: str, model: str, system: str, ns: argparse.Namespace, rnd: int) -> Path | None:
    """Where ``--trace`` puts the Chrome trace of a system's last round; None otherwise."""
    return OUT / f"{bench}_trace_{model}_{system}.json" if ns.trace and rnd == ns.rounds - 1 else None


def run_line(row: Mapping[str, Any], shown: Sequence[str] = ()) -> str:
    """A finished job in a progress line: measured and predicted ms, the ``shown`` fields
    and the loss, or the error."""
    if "error" in row:
        return f"FAILED {row['error'][-400:]}"
    fields = "".join(f"{key} {row.get(key)}, " for key in shown)
    return (f"{ms(row['mean_s'])} ± {ms(row['std_s'])} ms (predicted {ms(row.get('estimate_s'))} ms, "
            f"{fields}loss {row.get('loss')})")


def interleaved(systems: Sequence[str], rounds: int, runs: list[dict[str, Any]],
                run: Callable[[str, int], dict[str, Any] | None], save_results: Callable[[], None], log: Log,
                shown: Sequence[str] = ()) -> None:
    """Each of ``systems`` run ``rounds`` times, interleaved ABBA (round 0 in order, round
    1 reversed, ...): ``run(system, round)`` is the job's row (None: not run this round);
    each row gets its round, joins ``runs``, is logged (:func:`run_line`) and saved."""
    for rnd in range(rounds):
        for system in systems if rnd % 2 == 0 else systems[::-1]:
            row = run(system, rnd)
            if row is None:
                continue
            row["round"] = rnd
            runs.append(row)
            log(f"{row['model']} {system} round {rnd}: {run_line(row, shown)}")
            save_results()


# ----------------------------------------------------------------------------- summary


def pooled(rows: Sequence[Mapping[str, Any]]) -> tuple[float | None, float | None, int]:
    """Mean and (population) std of every timed iteration of ``rows``, and their count."""
    times = [t for r in rows for t in r.get("job_s", [])]
    if not times:
        return None, None, 0
    return statistics.fmean(times), statistics.pstdev(times), len(times)


def round_speedups(runs: Sequence[Mapping[str, Any]], base: str, other: str) -> list[float]:
    """Per round in which both ran, ``base``'s mean seconds over ``other``'s."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        if r.get("mean_s"):
            by_round.setdefault(r["round"], {})[r["system"]] = r["mean_s"]
    return [v[base] / v[other] for _, v in sorted(by_round.items()) if base in v and other in v]


# ----------------------------------------------------------------------------- the run


def others_active() -> list[str]:
    """Other benchmarks' network namespaces and cpu cgroups (names starting ``hapd``)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    found = [line.split()[0] for line in listed.stdout.splitlines() if line.startswith("hapd")]
    if emulated.CG_ROOT.exists():
        found += [p.name for p in emulated.CG_ROOT.iterdir() if p.is_dir() and p.name.startswith("hapd")]
    return found


def wait_for_others(limit_s: float, log: Log) -> bool:
    """Poll until no other benchmark's namespaces or cgroups exist; False after ``limit_s``."""
    t0, seen = time.monotonic(), None
    while busy := others_active():
        if time.monotonic() - t0 > limit_s:
            log(f"still in use after {limit_s:.0f} s: {', '.join(busy)}")
            return False
        if sorted(busy) != seen:  # once per change, not every poll
            seen = sorted(busy)
            log(f"another benchmark is running ({', '.join(seen)}): polling every {POLL_S} s")
        time.sleep(POLL_S)
    return True


def run_on_cluster(bench: str, ns: argparse.Namespace, fast: float, results: dict[str, Any], log: Log,
                   measure: Callable[[Any, float], None]) -> int:
    """``bench_cluster.py``'s run, its exit code: skipped (0, saying why) where this
    machine cannot host the emulated cluster or another benchmark's stays up
    ``ns.wait_others`` seconds; else every rank's cgroup at the ``fast`` quota, the link
    rate its matmul FLOP/s sets (``ns.rate_mbit`` overrides) in ``results``, and
    ``measure(session, rate)``. Ctrl-C or SIGTERM saves the results so far (130); the
    cluster is torn down however it ends (``ns.keep``: left up)."""
    why = emulated.available()
    if why:
        print(f"{bench}_cluster: skipped: {why}")
        return 0
    emulated.stop_on_signals()
    if not wait_for_others(ns.wait_others, log):
        print(f"{bench}_cluster: skipped: another benchmark's cluster is still up")
        return 0
    session = emulated.Session(f"hapd-{bench}-", ns.verbose)

    def body() -> None:
        rank_flops, rate = session.measure_link(fast, ns.rate_mbit)
        results.update(fast_rank_flops=rank_flops, rate_mbit=rate)
        log(f"fast rank ({fast:.2f} core): {rank_flops / 1e9:.1f} GFLOP/s matmul -> link {rate:.1f} Mbit/s")
        measure(session, rate)

    return session.run(body, lambda: save(results, ns.out), ns.keep, log)


def start_and_profile(session, rate: float, fast: float, slow: float, ns: argparse.Namespace,
                      results: dict[str, Any], log: Log) -> Path:
    """The cluster up with its link at ``rate``, the ranks at their quotas (host 0
    ``fast``, host 1 ``slow``) and profiled once (``ns.full_profile``: the profiler's full
    sizes); the profile in ``results``, its path returned."""
    runner = session.start(rate)
    emulated.setup_cgroups([fast, fast, slow, slow])
    path = session.work / "profile.json"
    t0 = time.monotonic()
    prof = runner.profile(path, quick=not ns.full_profile)
    results["profile"] = prof
    log(f"profiled in {time.monotonic() - t0:.0f} s: FLOP/s " +
        ", ".join(f"{d['flops'] / 1e9:.1f}G" for d in prof["devices"]))
    return path
