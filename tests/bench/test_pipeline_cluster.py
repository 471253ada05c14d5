"""The pipeline benchmark's pieces that need no cluster: its per-rank clock, the summary (speed-ups pooled over rounds,
errors, fraction of ideal, targets), re-printing a saved run, and its rank hook on 2
real Gloo ranks (the plan recorded, the best pipeline run although the search kept the
SPMD plan). The cluster run itself needs root and a quarter of an hour:
``bench/pipeline_cluster.py``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import _bench
from hapd.profile.schema import Link, estimated_profile

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return _bench.load("pipeline_cluster")


def _pipeline(u: list[float], c: list[float], sync: list[float], m: int, per_iteration: float = 1.0) -> dict:
    """A plan's ``pipeline`` map: stages of forward + backward ``u`` (split 1:2), cuts
    of both-ways transfers ``c``, gradient syncs ``sync``, ``m`` micro-batches."""
    stages = [{"index": s, "ranks": [2 * s, 2 * s + 1], "block_count": 1, "forward": t / 3, "backward": 2 * t / 3,
               "sync": y, "boundary_seconds": c[s] if s < len(c) else 0.0} for s, (t, y) in enumerate(zip(u, sync))]
    return {"stages": stages, "micro_batches": m, "per_iteration": per_iteration, "bubble": 0.1,
            "spmd_only_per_iteration": 2 * per_iteration, "chosen": True}


def test_the_clock_files_waits_under_the_phase_they_happen_in(bench):
    clock = bench.RankClock()

    def receive(seconds: float) -> float:
        return seconds

    timed_receive = clock.timed(receive, "recv_{phase}")

    def forward() -> None:
        timed_receive(0.0)

    step = clock.timed(lambda: (clock.timed(forward, "forward", phase="forward")(),
                                clock.timed(lambda: timed_receive(0.0), "backward", phase="backward")()),
                       "step", new_step=True)
    step()
    step()
    assert len(clock.steps) == 2
    assert set(clock.steps[0]) == {"step", "forward", "backward", "recv_forward", "recv_backward"}
    assert clock.phase is None
    assert clock.steps[0]["step"] >= clock.steps[0]["forward"] >= clock.steps[0]["recv_forward"] >= 0


def test_a_failed_runs_error_line_names_the_error(bench):
    text = "[rank 2] noise\n[rank 1] worker: rank 1: PlanError: tied parameters must be replicated\n[rank 2] more noise\n"
    assert bench.error_line(text) == "[rank 1] worker: rank 1: PlanError: tied parameters must be replicated"
    assert bench.error_line("only\nlines\n") == "lines"


def test_the_breakdown_averages_timed_steps(bench, tmp_path):
    steps = [{"step": 9.0, "forward": 9.0}] + [
        {"step": 1.0, "forward": 0.4, "backward": 0.5, "recv_forward": 0.1, "recv_backward": 0.2, "grad_sync": 0.05}] * 2
    (tmp_path / "rank1.json").write_text(json.dumps({"steps": steps}))
    (tmp_path / "rank0.json").write_text(json.dumps({"steps": steps}))
    (tmp_path / "plan.json").write_text("{}")  # not a rank's file
    rows = bench.step_breakdown(tmp_path, warmup=1, iterations=3)
    assert [r["rank"] for r in rows] == [0, 1]
    assert rows[0]["compute"] == pytest.approx(0.9 - 0.35) and rows[0]["other"] == pytest.approx(0.1)


def _results(spmd: list[list[float]], pipeline: list[list[float]], forced: list[list[float]] | None = None,
             chosen: bool = True) -> dict:
    """One model (vit): per round, each system's job seconds per timed iteration; the
    pipeline runs ran a pipeline when ``chosen``, else the SPMD plan (and ``forced`` the
    pipeline)."""
    found = {**_pipeline([0.05, 0.05], [0.02], [0.01, 0.01], 16, per_iteration=1.6), "chosen": chosen}
    plan = {"spmd_estimate_s": 2.0, "pipeline_estimate_s": 1.6, "pipeline": found, "chosen": chosen,
            "spmd_compute": [1.0], "spmd_communication": [1.0], "tried": [], "reason": ""}
    runs = []
    for rnd in range(len(spmd)):
        for system, times in (("spmd", spmd[rnd]), ("pipeline", pipeline[rnd])) + (
                (("forced", forced[rnd]),) if forced else ()):
            ran = system == "forced" or (system == "pipeline" and chosen)
            runs.append({"system": system, "round": rnd, "job_s": times, "mean_s": sum(times) / len(times),
                         "estimate_s": 1.6 if ran else 2.0, "pipeline": {"micro_batches": 16} if ran else None})
    profile = {"devices": [{"flops": 1e9}] * 4, "collectives": {}}
    return {"variant": "3:1", "batch": 64, "rounds": len(spmd), "profile": profile,
            "models": {"vit": {"layers": 8, "batch": 64, "flops": 4e9, "plan": plan, "runs": runs}}}


def test_speedups_pool_every_round_and_the_targets_are_checked(bench):
    (row,) = bench.summarize(_results(spmd=[[2.0, 2.2], [2.0, 1.8]], pipeline=[[1.5, 1.5], [1.4, 1.6]]))
    assert row["spmd"]["mean_s"] == pytest.approx(2.0) and row["pipeline"]["mean_s"] == pytest.approx(1.5)
    assert row["spmd"]["iterations"] == 4 and row["speedup"] == pytest.approx(2.0 / 1.5)
    assert row["predicted_speedup"] == pytest.approx(2.0 / 1.6)
    assert row["pipeline"]["rel_error"] == pytest.approx(0.1 / 1.5)
    assert row["spmd"]["fraction_of_ideal"] == pytest.approx(4e9 / 4e9 / 2.0)
    assert row["round_speedups"] == pytest.approx([2.1 / 1.5, 1.9 / 1.5])
    lines = bench.targets([row])
    assert lines[0].startswith("MISS") and "vit 1.33x" in lines[0]  # one model of the two the target needs
    assert bench.targets([row, {**row, "model": "bert"}])[0].startswith("MET ")
    assert lines[1].startswith("MET  cost-model median")


def test_a_forced_pipeline_is_reported_beside_the_spmd_plan(bench):
    (row,) = bench.summarize(_results(spmd=[[2.0]], pipeline=[[2.0]], forced=[[1.0]], chosen=False))
    assert row["speedup"] == pytest.approx(1.0) and row["forced_speedup"] == pytest.approx(2.0)
    assert row["forced"]["rel_error"] == pytest.approx((1.6 - 1.0) / 1.0)  # its plan predicted 1.6 s
    assert "forced pipelines" in bench.targets([row])[-1]
    assert bench.wants_forced({"plan": {"pipeline": {}, "chosen": False}}, _Args(no_forced=False)) is False
    assert bench.wants_forced({"plan": {"pipeline": {"stages": []}, "chosen": False}}, _Args(no_forced=False))
    assert not bench.wants_forced({"plan": {"pipeline": {"stages": []}, "chosen": False}}, _Args(no_forced=True))


@dataclasses.dataclass
class _Args:
    no_forced: bool


def test_a_failed_run_leaves_no_speedup_and_misses_the_targets(bench):
    results = _results(spmd=[[2.0]], pipeline=[[1.5]])
    results["models"]["vit"]["runs"][1] = {"system": "pipeline", "round": 0, "error": "PlanError: boom"}
    (row,) = bench.summarize(results)
    assert "speedup" not in row and row["pipeline"]["failed"] == 1
    assert "FAILED" in bench.format_table([row])
    assert "FAILED vit pipeline round 0: PlanError: boom" in bench.format_failures(results)
    assert bench.targets([row]) == [
        "MISS (run failed: vit pipeline: PlanError: boom) hapd with pipelines ≥1.3x hapd without on ≥2 models: "
        "no runs",
        "MISS (run failed: vit pipeline: PlanError: boom) cost-model median |relative error| 0.0% over 1 plan(s) run, "
        "1 failed (target ≤10%)"]
    assert bench.exit_status([row]) == 1
    assert bench.exit_status(bench.summarize(_results(spmd=[[2.0]], pipeline=[[1.5]]))) == 0


def test_a_failed_round_is_counted_beside_the_pooled_mean(bench):
    results = _results(spmd=[[2.0], [2.0]], pipeline=[[1.5], [1.5]])
    results["models"]["vit"]["runs"][3] = {"system": "pipeline", "round": 1, "error": "PlanError: boom"}
    (row,) = bench.summarize(results)
    assert row["speedup"] == pytest.approx(2.0 / 1.5) and row["pipeline"]["rounds"] == 2
    lines = bench.targets([row, {**row, "model": "bert"}])
    assert lines[0] == ("MET  hapd with pipelines ≥1.3x hapd without on ≥2 models: vit 1.33x, bert 1.33x "
                        "(vit pipeline: mean of 1 of 2 rounds (1 failed: PlanError: boom); bert pipeline: mean of 1 "
                        "of 2 rounds (1 failed: PlanError: boom))")
    assert lines[1].startswith("MET  cost-model median") and lines[1].endswith(
        "(vit pipeline: mean of 1 of 2 rounds (1 failed: PlanError: boom); bert pipeline: mean of 1 of 2 rounds "
        "(1 failed: PlanError: boom))")
    assert bench.exit_status([row]) == 1


def test_a_saved_failed_run_is_reprinted_with_its_misses_and_exits_1(tmp_path):
    results = _results(spmd=[[2.0]], pipeline=[[1.5]])
    results["models"]["vit"]["runs"][1] = {"system": "pipeline", "round": 0, "error": "PlanError: boom"}
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(results))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "pipeline_cluster.py"), "--from-json", str(saved)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "MISS (run failed: vit pipeline: PlanError: boom) hapd with pipelines" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1] == "1 of 2 run(s) failed (vit pipeline round 0): exit 1"


def test_a_saved_run_is_reprinted_and_bad_arguments_exit_2(tmp_path):
    out = _bench.reprint("pipeline_cluster", _results(spmd=[[2.0, 2.0]], pipeline=[[1.5, 1.5]]), tmp_path,
                         bad=((["--models", "nope"], "unknown"), (["--variant", "3:x"], "not FAST:SLOW"),
                              (["--layers", "1"], "--layers")))
    assert "1.33x" in out and "per stage, predicted against measured" in out


def _two_hosts_fast_link(path: Path) -> Path:
    """Two hosts of one rank each and a fast link: the SPMD plan beats every pipeline."""
    profile = estimated_profile(2, flops=[2e10, 1e10], hosts=["a", "b"], alpha=1e-5, beta=1e10)
    links = {n: {"inter": link["inter"], "intra": Link(alpha=1e-6, beta=1e10)} for n, link in profile.collectives.items()}
    return dataclasses.replace(profile, collectives=links, name="two-hosts-fast").save(path)


@pytest.mark.distributed
def test_the_rank_hook_records_the_plan_and_forces_its_pipeline(tmp_path):
    """``pipeline_cluster.py rank DIR --force`` on 2 Gloo ranks: rank 0 records that the
    search kept the SPMD plan, every rank runs the pipeline anyway, and each rank's
    steps are timed with their waits on the other stage."""
    profile = _two_hosts_fast_link(tmp_path / "fast.json")
    summary_path, waits = tmp_path / "summary.json", tmp_path / "waits"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "bench" / "pipeline_cluster.py"), "rank", str(waits), "--force", "--model", "bert", "--batch", "8",
           "--iterations", "3", "--warmup", "1", "--profile", str(profile), "--pipeline", "auto",
           "--json", str(summary_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = json.loads((waits / "plan.json").read_text())
    assert plan["chosen"] is False and plan["pipeline"]["stages"]
    assert plan["pipeline_estimate_s"] > plan["spmd_estimate_s"]
    summary = json.loads(summary_path.read_text())
    assert summary["pipeline"]["stages"] == [[0], [1]]
    assert summary["estimate_s"] == pytest.approx(plan["pipeline_estimate_s"])
    assert (waits / "explain.txt").stat().st_size > 0
    for rank, wait in ((0, "recv_backward"), (1, "recv_forward")):
        steps = json.loads((waits / f"rank{rank}.json").read_text())["steps"]
        assert len(steps) == 3 and all(s["step"] >= s["forward"] > 0 and wait in s for s in steps)
