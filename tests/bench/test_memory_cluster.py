"""The memory-cluster benchmark's pieces that need no cgroups: the sweep's model sizes,
how a job's end is read (trains, OOM by rank, no plan, error), the reserve and the
reserved profile, the table, and bench/in_cgroup.py's per-rank cgroup lists. Nothing
here builds a cluster (that needs root: ``bench/memory_cluster.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

import _bench
from hapd.profile.schema import estimated_profile, load_profile

ROOT = Path(__file__).resolve().parents[2]
MiB, GiB = 2**20, 2**30


@pytest.fixture(scope="module")
def bench():
    return _bench.load("memory_cluster")


def test_sizes_are_widths_with_64_wide_heads(bench):
    assert bench.model_config(1024) == {"hidden": 1024, "ffn": 2688, "heads": 16, "seq": 32}
    assert bench.parse_sizes("1024, 512,512") == [512, 1024]
    assert bench.param_count(1024) > bench.param_count(512) > 0
    for text in ("", "abc", "100", "0"):
        with pytest.raises(ValueError):
            bench.parse_sizes(text)


def test_a_job_is_read_as_trains_oom_no_plan_or_error(bench):
    assert bench.classify(0, {"mean_s": 1.0}, [], "") == ("trains", "")
    status, message = bench.classify(1, None, [2, 3], "")
    assert status == "OOM" and "ranks 2, 3" in message
    fit = ("worker: rank 0: PlanError: rank 0 could not get a plan: SynthesisError: the model does not fit in "
           "device memory: device 2 (cpu) has 598 MiB and needs 612 MiB\nChildFailedError: worker.py FAILED")
    assert bench.classify(1, None, [], fit) == ("no plan", "the model does not fit in device memory: device 2 "
                                                            "(cpu) has 598 MiB and needs 612 MiB")
    crash = "[rank1]: RuntimeError: Connection closed by peer\ntorch...ChildFailedError: \nend"
    assert bench.classify(1, None, [], crash) == ("error", "[rank1]: RuntimeError: Connection closed by peer")
    # the OOM counter decides, whatever else the output says
    assert bench.classify(-9, None, [0], crash)[0] == "OOM"


def _run(bench, **kw):
    base = dict(system="hapd", hidden=512, params=16_700_000, status="trains", mean_s=0.9,
                peaks=[500 * MiB, 500 * MiB, 440 * MiB, 450 * MiB],
                predicted=[118 * MiB, 116 * MiB, 50 * MiB, 49 * MiB])
    return bench.RunResult(**{**base, **kw})


def test_the_reserve_is_the_largest_unpredicted_bytes_plus_a_margin(bench):
    assert bench.reserve_from(_run(bench), 32 * MiB) == (450 - 49 + 32) * MiB
    with pytest.raises(RuntimeError, match="did not train"):
        bench.reserve_from(_run(bench, status="OOM", predicted=None), 0)


def test_the_reserved_profile_is_the_measured_one_less_the_reserve(bench, tmp_path):
    measured = json.loads(estimated_profile(4, flops=[3e10, 3e10, 1e10, 1e10], memory=GiB, name="m").to_json())
    measured["devices"][0]["memory"] = 2 * GiB
    doc = bench.reserved_profile(measured, 400 * MiB)
    assert [d["memory"] for d in doc["devices"]] == [2 * GiB - 400 * MiB] + [GiB - 400 * MiB] * 3
    assert measured["devices"][1]["memory"] == GiB  # untouched
    path = tmp_path / "reserved.json"
    path.write_text(json.dumps(doc))
    assert load_profile(path).devices[3].memory == GiB - 400 * MiB
    with pytest.raises(RuntimeError, match="less than"):
        bench.reserved_profile(measured, GiB)


def test_the_table_names_each_systems_largest_model(bench):
    rows = [_run(bench), _run(bench, system="ddp", mean_s=1.7, predicted=None),
            _run(bench, system="fsdp", mean_s=1.9, predicted=None),
            _run(bench, hidden=768, params=34_600_000, mean_s=0.8),
            _run(bench, system="ddp", hidden=768, params=34_600_000, status="OOM", mean_s=None, oom_ranks=[2, 3]),
            _run(bench, system="fsdp", hidden=768, params=34_600_000, mean_s=4.1, predicted=None),
            _run(bench, hidden=1024, params=58_000_000, status="no plan", mean_s=None)]
    results = {"sweep": [asdict(r) for r in rows], "reserve": 400 * MiB, "limits": [2 * GiB] * 2 + [GiB] * 2}
    table = bench.format_table(results)
    assert "OOM (rank 2,3)" in table and "no plan" in table and "trains 800 ms" in table
    assert "largest model  hapd: 34.6M parameters (width 768)" in table
    assert "largest model   ddp: 16.7M parameters (width 512)" in table
    assert "largest model  fsdp: 34.6M parameters (width 768)" in table
    assert "518/500/2048" in bench.format_memory(results)  # 118 predicted + 400 reserve / 500 measured / limit


def test_in_cgroup_lists_one_or_more_groups_per_rank():
    in_cgroup = _bench.load("in_cgroup")
    spec = "/cg/cpu/r0,/cg/memory/r0:/cg/cpu/r1"
    assert in_cgroup.rank_groups(spec, 0) == [Path("/cg/cpu/r0"), Path("/cg/memory/r0")]
    assert in_cgroup.rank_groups(spec, 1) == [Path("/cg/cpu/r1")]
    assert in_cgroup.rank_groups(spec, 2) == [] and in_cgroup.rank_groups("", 0) == []


def test_in_cgroup_joins_the_ranks_groups_then_runs_the_script(tmp_path):
    """Fake cgroup folders: the rank writes its pid into each of its own, none of another
    rank's, before the script runs."""
    groups = [tmp_path / name for name in ("cpu0", "mem0", "cpu1")]
    for g in groups:
        g.mkdir()
    script = tmp_path / "script.py"
    script.write_text("import os, sys\nprint('ran', sys.argv[1:], os.getpid())\n")
    env = {**os.environ, "RANK": "0", "HAPD_RANK_CGROUPS": f"{groups[0]},{groups[1]}:{groups[2]}"}
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "in_cgroup.py"), str(script), "--x"], env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    word, args, pid = done.stdout.split(" ", 2)
    assert word == "ran" and "--x" in args
    assert [(g / "cgroup.procs").read_text().strip() if (g / "cgroup.procs").exists() else None for g in groups] \
        == [pid.strip(), pid.strip(), None]


def test_without_root_or_cgroups_it_says_why(bench, tmp_path):
    why = bench.available(tmp_path / "cpu", tmp_path / "memory")
    assert why is not None and ("root" in why or "controller" in why)


def test_the_timing_is_hapds_speed_up_over_each_baseline(bench):
    runs = {"hapd": _run(bench, mean_s=1.0), "fsdp": _run(bench, system="fsdp", mean_s=4.0),
            "fsdp-cp": _run(bench, system="fsdp-cp", status="OOM", mean_s=None, oom_ranks=[2])}
    timing = bench.timing_summary(1024, 5, runs)
    assert timing["ms"] == {"hapd": 1000.0, "fsdp": 4000.0, "fsdp-cp": None}
    assert timing["speedup"] == {"fsdp": 4.0} and timing["iterations"] == 5


def test_main_without_root_exits_0_and_says_why(bench, monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(bench.os, "geteuid", lambda: 1000)
    assert bench.main(["--out", str(tmp_path / "out.json")]) == 0
    assert "memory_cluster: skipped: needs root" in capsys.readouterr().out
    assert not (tmp_path / "out.json").exists()
    assert bench.main(["--sizes", "100"]) == 2  # a bad width is an error, root or not
