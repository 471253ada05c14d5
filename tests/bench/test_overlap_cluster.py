"""The overlapped-duplicas benchmark's pieces that need no cluster: the forced rules of
its cases, its speedups (measured pooled over rounds, predicted from the plans'
estimates), the target it checks, and re-printing a saved run. The cluster run itself
needs root and a quarter of an hour: ``bench/overlap_cluster.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import _bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    return _bench.load("overlap_cluster")


def _graph(name: str):
    import hapd
    from hapd import models

    net, config = models.build(name, "tiny")
    return hapd.lower(hapd.export(net, models.get(name).example_inputs(config, 4)), name=name)


def test_forced_rules_name_the_expert_einsums_and_megatron_pairs(bench):
    moe = bench.expert_parallel(_graph("bert_moe").doc)
    assert len(moe) == 2 and set(moe.values()) == {"expert-parallel"}  # w1 and w2 of the one MoE layer
    tp = bench.tensor_parallel(_graph("bert").doc)
    rules = list(tp.values())
    assert rules.count("column-parallel") == 2 * rules.count("row-parallel") > 0  # q, k, v, fc1 / out, fc2


def test_cases_are_checked(bench):
    assert bench.parse_cases("bert_moe=expert-parallel, bert=tensor-parallel") == {
        "bert_moe": "expert-parallel", "bert": "tensor-parallel"}
    for text, message in (("nope=expert-parallel", "unknown model"), ("bert=pipeline", "not one of"), ("", "empty")):
        with pytest.raises(ValueError, match=message):
            bench.parse_cases(text)


def _results(plain: list[list[float]], overlap: list[list[float]], estimates=(3.0, 2.0)) -> dict:
    """One BERT-MoE case: per round, each plan's job seconds per timed iteration."""
    runs = []
    for rnd, (p, o) in enumerate(zip(plain, overlap)):
        for system, times in (("plain", p), ("overlap", o)):
            runs.append({"system": system, "round": rnd, "job_s": times, "mean_s": sum(times) / len(times)})
    plans = {"plain": {"estimate_s": estimates[0]}, "overlap": {"estimate_s": estimates[1]}}
    return {"variant": "3:1", "rounds": len(plain),
            "cases": {"bert_moe": {"parallelism": "expert-parallel", "batch": 64, "plans": plans, "runs": runs}}}


def test_speedups_pool_every_round_and_the_target_is_checked(bench):
    results = _results(plain=[[3.0, 3.2], [2.8, 3.0]], overlap=[[2.4, 2.6], [2.0, 2.0]])
    (row,) = bench.summarize(results)
    assert row["plain"]["mean_s"] == pytest.approx(3.0) and row["overlap"]["mean_s"] == pytest.approx(2.25)
    assert row["plain"]["iterations"] == 4
    assert row["speedup"] == pytest.approx(3.0 / 2.25)
    assert row["predicted_speedup"] == pytest.approx(1.5)
    assert row["round_speedups"] == pytest.approx([3.1 / 2.5, 2.9 / 2.0])
    assert bench.targets([row])[0].startswith("MET  bert_moe")
    slow = bench.summarize(_results(plain=[[3.0]], overlap=[[2.9]]))
    assert bench.targets(slow)[0].startswith("MISS bert_moe")


def test_an_extra_plan_is_compared_with_plain(bench):
    results = _results(plain=[[3.0]], overlap=[[2.0]])
    case = results["cases"]["bert_moe"]
    case["plans"]["searched-plain"] = {"estimate_s": 2.5}
    case["runs"].append({"system": "searched-plain", "round": 0, "job_s": [2.4], "mean_s": 2.4})
    (row,) = bench.summarize(results)
    assert row["extra"]["searched-plain"] == pytest.approx({"speedup": 3.0 / 2.4, "predicted_speedup": 3.0 / 2.5})
    assert row["round_speedups"] == pytest.approx([1.5])
    assert "searched-plain" in bench.format_table([row])


def test_a_failed_run_leaves_no_speedup_and_misses_its_target(bench):
    results = _results(plain=[[3.0]], overlap=[[2.0]])
    results["cases"]["bert_moe"]["runs"][1] = {"system": "overlap", "round": 0, "error": "rank 2 exited 1\nboom"}
    (row,) = bench.summarize(results)
    assert "speedup" not in row and row["overlap"]["failed"] == 1
    assert "FAILED" in bench.format_table([row])
    assert bench.targets([row]) == ["MISS (run failed: overlap: boom) bert_moe expert-parallel: overlap against the "
                                    "plain program (target ≥1.2x; predicted 1.50x)"]
    assert bench.exit_status([row]) == 1
    assert bench.exit_status(bench.summarize(_results(plain=[[3.0]], overlap=[[2.0]]))) == 0


def test_a_failed_round_is_counted_beside_the_pooled_mean(bench):
    results = _results(plain=[[3.0], [3.0]], overlap=[[2.0], [2.0]])
    results["cases"]["bert_moe"]["runs"][3] = {"system": "overlap", "round": 1, "error": "boom"}
    (row,) = bench.summarize(results)
    assert row["speedup"] == pytest.approx(1.5) and row["overlap"]["rounds"] == 2
    (line,) = bench.targets([row])
    assert line == ("MET  bert_moe expert-parallel: overlap 1.50x the plain program (target ≥1.2x; predicted 1.50x; "
                    "overlap: mean of 1 of 2 rounds (1 failed: boom))")
    assert "bert_moe overlap: mean of 1 of 2 rounds (1 failed: boom)" in bench.format_pools([row])
    assert bench.exit_status([row]) == 1


def test_a_saved_run_is_reprinted_and_bad_arguments_exit_2(tmp_path):
    out = _bench.reprint("overlap_cluster", _results(plain=[[3.0, 3.0]], overlap=[[2.0, 2.0]]), tmp_path,
                         bad=((["--cases", "bert=x"], "not one of"), (["--variant", "3:x"], "not FAST:SLOW")))
    assert "1.50x" in out and "MET  bert_moe expert-parallel" in out


def test_a_saved_failed_run_is_reprinted_with_its_miss_and_exits_1(tmp_path):
    results = _results(plain=[[3.0]], overlap=[[2.0]])
    results["cases"]["bert_moe"]["runs"][1] = {"system": "overlap", "round": 0, "error": "boom"}
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(results))
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "overlap_cluster.py"), "--from-json", str(saved)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "MISS (run failed: overlap: boom) bert_moe expert-parallel" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1] == "1 of 2 run(s) failed (bert_moe overlap round 0): exit 1"


@pytest.mark.distributed
def test_the_rank_hook_times_each_step_and_its_waits(bench, tmp_path):
    """``overlap_cluster.py rank DIR`` on 2 Gloo ranks, BERT-MoE's duplicas: each rank's
    steps are timed, forward and backward apart, with the time blocked in the plan's
    collectives in each pass and in the gradient sum, and the breakdown reads them back."""
    waits = tmp_path / "waits"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "bench" / "overlap_cluster.py"), "rank", str(waits), "--model", "bert_moe", "--batch", "8",
           "--iterations", "3", "--warmup", "1", "--overlap", "always"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "HAPD_HOME": str(tmp_path / "home")})
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        steps = json.loads((waits / f"rank{rank}.json").read_text())["steps"]
        assert len(steps) == 3
        for s in steps:
            assert {"forward", "backward", "wait_forward", "wait_backward", "grad_sync"} <= set(s)
            assert s["step"] >= s["forward"] > 0 and s["backward"] > 0
    rows = bench.step_breakdown(waits, warmup=1, iterations=3)
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["compute"] == pytest.approx(r["forward"] + r["backward"] - r["wait_forward"] - r["wait_backward"]
                                             - r["grad_sync"])
