"""The emulated-cluster benchmark's arithmetic: variants, model lists, the table's
speed-ups, fraction of ideal and cost-model error, and the targets it prints. Nothing
here builds a cluster (that needs root and half an hour: ``bench/emulated_cluster.py``)."""

from __future__ import annotations

import pytest

import _bench


@pytest.fixture(scope="module")
def bench():
    return _bench.load("emulated_cluster")


def _run(system: str, mean: float, estimate: float | None = None) -> dict:
    row = {"system": system, "mean_s": mean, "std_s": mean / 20}
    if estimate is not None:
        row["estimate_s"] = estimate
    return row


def _results(hapd: float, ev: float, cp: float, estimate: float, variant: str = "3:1") -> dict:
    """One variant, one model of 100 GFLOP per iteration on devices summing to 50 GFLOP/s
    (ideal: 2 s per iteration)."""
    devices = [{"flops": 20e9}, {"flops": 20e9}, {"flops": 5e9}, {"flops": 5e9}]
    return {"variants": {variant: {"profile_devices": devices, "models": {"bert": {
        "flops": 100e9, "runs": [_run("hapd", hapd, estimate), _run("ddp-ev", ev), _run("ddp-cp", cp)]}}}}}


def test_variants_scale_to_the_machines_two_cores(bench):
    assert bench.parse_variant("3:1") == pytest.approx((0.75, 0.25))
    assert bench.parse_variant("1:1") == pytest.approx((0.5, 0.5))
    fast, slow = bench.parse_variant("2:1")
    assert 2 * fast + 2 * slow == pytest.approx(2.0) and fast == pytest.approx(2 * slow)
    assert bench.parse_variant("3:1", 1.6) == pytest.approx((0.6, 0.2))  # headroom left on the machine
    for cores in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="cores"):
            bench.parse_variant("3:1", cores)


@pytest.mark.parametrize("text", ["3", "3:x", "0:1", "3:-1", "1:2:3", "inf:1"])
def test_a_bad_variant_is_named(bench, text):
    with pytest.raises(ValueError, match="variant"):
        bench.parse_variant(text)


def test_models_all_and_unknown(bench):
    from hapd.models import MODELS, ZOO_MODELS

    assert bench.model_names("all") == list(MODELS)
    assert bench.model_names("zoo") == list(ZOO_MODELS)
    assert bench.model_names(" bert, vit ") == ["bert", "vit"]
    assert bench.model_names("zoo.gpt2,zoo.resnet18") == ["zoo.gpt2", "zoo.resnet18"]
    assert bench.default_batch("zoo.resnet18", "small") == 128
    with pytest.raises(ValueError, match="unknown.*nope"):
        bench.model_names("bert,nope")


def test_summary_speedups_ideal_and_error(bench):
    rows = bench.summarize(_results(hapd=4.0, ev=8.0, cp=5.0, estimate=4.4))
    hapd = next(r for r in rows if r["system"] == "hapd")
    assert hapd["speedup_vs_ev"] == pytest.approx(2.0)
    assert hapd["speedup_vs_cp"] == pytest.approx(1.25)
    assert hapd["fraction_of_ideal"] == pytest.approx(0.5)  # 2 s ideal / 4 s measured
    assert hapd["rel_error"] == pytest.approx(0.1)
    ev = next(r for r in rows if r["system"] == "ddp-ev")
    assert ev["fraction_of_ideal"] == pytest.approx(0.25) and "speedup_vs_ev" not in ev


def test_targets_report_met_and_missed(bench):
    lines = bench.targets(bench.summarize(_results(hapd=4.0, ev=8.0, cp=4.4, estimate=4.8)))
    text = "\n".join(lines)
    assert "MET  3:1 bert: hapd 2.00x EV" in text
    assert "MISS 3:1 bert: hapd 1.10x CP" in text
    assert "MISS 3:1 bert: hapd at 50% of ideal" in text
    assert "MISS cost-model median |relative error| 20.0%" in text


def test_homogeneous_control_compares_with_ddp(bench):
    lines = bench.targets(bench.summarize(_results(hapd=2.2, ev=2.0, cp=2.0, estimate=2.2, variant="1:1")))
    assert any(line.startswith("MISS 1:1 bert: hapd/DDP time 1.10") for line in lines)
    lines = bench.targets(bench.summarize(_results(hapd=2.0, ev=2.05, cp=2.0, estimate=2.0, variant="1:1")))
    assert any(line.startswith("MET  1:1 bert: hapd/DDP time 0.98") for line in lines)


def test_a_failed_run_is_a_table_row_not_a_crash(bench):
    results = _results(hapd=4.0, ev=8.0, cp=5.0, estimate=4.4)
    runs = results["variants"]["3:1"]["models"]["bert"]["runs"]
    runs[2] = {"system": "ddp-cp", "error": "rank 3 exited 1\nTraceback: boom"}
    rows = bench.summarize(results)
    hapd = next(r for r in rows if r["system"] == "hapd")
    assert "speedup_vs_cp" not in hapd and hapd["speedup_vs_ev"] == pytest.approx(2.0)
    table = bench.format_table(rows)
    assert "ddp-cp  FAILED: Traceback: boom" in table and len(table.splitlines()) == 2 + 3


def test_a_saved_run_is_reprinted_and_bad_arguments_exit_2(tmp_path):
    out = _bench.reprint("emulated_cluster", _results(hapd=4.0, ev=8.0, cp=5.0, estimate=4.4), tmp_path,
                         bad=((["--variants", "3:x"], "not FAST:SLOW"), (["--models", "nope"], "unknown")))
    assert "MET  3:1 bert: hapd 2.00x EV" in out and "1.25x" in out


def _failed(results: dict, system: str, error: str = "rank 3 exited 1\nTraceback: boom", variant: str = "3:1") -> dict:
    runs = results["variants"][variant]["models"]["bert"]["runs"]
    runs[[r["system"] for r in runs].index(system)] = {"system": system, "error": error}
    return results


def test_a_failed_baseline_is_a_missed_target_with_its_reason_and_exit_1(bench):
    rows = bench.summarize(_failed(_results(hapd=4.0, ev=8.0, cp=5.0, estimate=4.4), "ddp-cp"))
    lines = bench.targets(rows)
    assert "MET  3:1 bert: hapd 2.00x EV (target ≥1.6x)" in lines
    assert "MISS (run failed: ddp-cp: Traceback: boom) 3:1 bert: hapd vs CP (target ≥1.2x)" in lines
    assert not any(line.startswith("MET ") and "CP" in line for line in lines)
    assert bench.exit_status(rows) == 1
    assert bench.exit_status(bench.summarize(_results(hapd=4.0, ev=8.0, cp=5.0, estimate=4.4))) == 0


def test_a_failed_hapd_run_misses_every_target_it_has(bench):
    rows = bench.summarize(_failed(_results(hapd=4.0, ev=8.0, cp=5.0, estimate=4.4), "hapd"))
    lines = bench.targets(rows)
    assert len(lines) == 4 and all(line.startswith("MISS (run failed: hapd: Traceback: boom) ") for line in lines)
    assert [line.split(") ", 1)[1] for line in lines] == [
        "3:1 bert: hapd vs EV (target ≥1.6x)", "3:1 bert: hapd vs CP (target ≥1.2x)",
        "3:1 bert: hapd of ideal (target ≥80%)",
        "cost-model median |relative error| - over 0 hapd run(s), 1 failed (target ≤10%)"]
    assert bench.exit_status(rows) == 1
    rows = bench.summarize(_failed(_results(hapd=2.0, ev=2.05, cp=2.0, estimate=2.0, variant="1:1"), "ddp-ev",
                                   variant="1:1"))
    assert "MISS (run failed: ddp-ev: Traceback: boom) 1:1 bert: hapd/DDP time (target ≤1.05)" in bench.targets(rows)


def test_a_saved_failed_run_is_reprinted_with_its_misses_and_exits_1(tmp_path):
    import json
    import subprocess
    import sys

    saved = tmp_path / "run.json"
    saved.write_text(json.dumps(_failed(_results(hapd=4.0, ev=8.0, cp=5.0, estimate=4.4), "ddp-cp")))
    done = subprocess.run([sys.executable, str(_bench.BENCH / "emulated_cluster.py"), "--from-json", str(saved)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "MISS (run failed: ddp-cp: Traceback: boom) 3:1 bert: hapd vs CP" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1] == "1 of 3 run(s) failed (3:1 bert ddp-cp): exit 1"


def test_the_bound_is_ideal_compute_or_the_plans_gradient_exchange(bench):
    """hapd's share of the bound: the larger of the ideal step (2 s here) and its plan's
    gradient sum over the link (2 machines: each sends the synced bytes once)."""
    program = {"steps": [{"sources": [
        {"tensor": "w", "layout": "Identity", "grad_sync": True, "bytes": 400e6},
        {"tensor": "w", "layout": "Identity", "grad_sync": True, "bytes": 400e6},  # read twice, summed once
        {"tensor": "e", "layout": "Gather(0)", "grad_sync": False, "bytes": 800e6},
        {"tensor": "x", "layout": "Gather(0)", "grad_sync": False, "bytes": 1e6}]}]}
    assert bench.synced_bytes(program) == 400e6
    assert bench.exchange_floor(400e6, 800.0) == pytest.approx(4.0)  # 400 MB over 100 MB/s, half each way
    for rate, bound in ((800.0, 4.0), (8000.0, 2.0)):
        results = _results(hapd=5.0, ev=9.0, cp=7.0, estimate=5.0)
        results["rate_mbit"] = rate
        results["variants"]["3:1"]["models"]["bert"]["estimate"] = {"synced_bytes": 400e6}
        row = next(r for r in bench.summarize(results) if r["system"] == "hapd")
        assert row["bound_s"] == pytest.approx(bound) and row["fraction_of_bound"] == pytest.approx(bound / 5.0)
        assert any("of the bound" in line for line in bench.targets(bench.summarize(results)))


def test_the_achieved_rate_bound_scales_one_fast_ranks_model_rate_by_quota(bench):
    """A diagnosis beside the bound: the model's rate on one fast rank alone (10 GFLOP/s at
    0.75 core) scaled to each rank's quota (0.75, 0.75, 0.25, 0.25: 10+10+3.33+3.33 GFLOP/s),
    its FLOPs over that or the plan's gradient exchange, whichever is longer."""
    assert bench.achieved_rate(10e9, 0.75, [0.75, 0.75, 0.25, 0.25]) == pytest.approx(80e9 / 3)
    assert bench.achieved_rate(float("nan"), 0.75, [0.75]) != bench.achieved_rate(float("nan"), 0.75, [0.75])
    assert bench.achieved_bound(100e9, 80e9 / 3, 1.0) == pytest.approx(3.75)
    assert bench.achieved_bound(100e9, 80e9 / 3, 5.0) == pytest.approx(5.0)
    for rate, bound in ((800.0, 4.0), (8000.0, 3.75)):
        results = _results(hapd=5.0, ev=9.0, cp=7.0, estimate=5.0)
        results.update(rate_mbit=rate, fast_quota=0.75, model_rate={"bert": 10e9})
        results["variants"]["3:1"]["quotas"] = [0.75, 0.75, 0.25, 0.25]
        results["variants"]["3:1"]["models"]["bert"]["estimate"] = {"synced_bytes": 400e6}
        rows = bench.summarize(results)
        row = next(r for r in rows if r["system"] == "hapd")
        assert row["achieved_bound_s"] == pytest.approx(bound)
        assert row["fraction_of_achieved_bound"] == pytest.approx(bound / 5.0)
        assert row["bound_s"] == pytest.approx(max(2.0, 4.0 if rate == 800.0 else 0.4))  # the target's bound as before
        # a diagnosis line, never a target line
        assert not any("achieved-rate" in line for line in bench.targets(rows))
        line = next(line for line in bench.diagnosis(results) if "achieved-rate bound" in line)
        assert line.startswith("diagnosis (not a target) 3:1 bert:") and f"{bound / 5.0:.0%}" in line


def test_no_achieved_rate_bound_without_the_model_rate(bench):
    results = _results(hapd=5.0, ev=9.0, cp=7.0, estimate=5.0)
    results.update(rate_mbit=8000.0, fast_quota=0.75, model_rate={"bert": float("nan")})
    results["variants"]["3:1"]["quotas"] = [0.75, 0.75, 0.25, 0.25]
    results["variants"]["3:1"]["models"]["bert"]["estimate"] = {"synced_bytes": 400e6}
    row = next(r for r in bench.summarize(results) if r["system"] == "hapd")
    assert "fraction_of_achieved_bound" not in row and row["fraction_of_bound"] == pytest.approx(2.0 / 5.0)
    assert not any("achieved-rate" in line for line in bench.diagnosis(results))
