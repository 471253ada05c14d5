"""The elastic-cluster benchmark's pure parts: the seeded fault schedule, the quotas,
the parsing of rank output, the loss, sample and throughput comparisons, the chain of
checkpoint restarts that redoes an elastic run, and the tables. Nothing here builds a
cluster (that needs root: ``bench/elastic_cluster.py``)."""

from __future__ import annotations

import json

import pytest

import _bench


@pytest.fixture(scope="module")
def bench():
    return _bench.load("elastic_cluster")


def test_fault_schedule_is_seeded_ordered_and_covers_every_kind(bench):
    a = bench.fault_schedule(33, 10, 60)
    assert a == bench.fault_schedule(33, 10, 60)
    assert a != bench.fault_schedule(34, 10, 60)
    steps = [f.step for f in a]
    assert steps == sorted(steps) and len(set(steps)) == 10 and 4 <= steps[0] and steps[-1] <= 58
    assert {f.kind for f in a} == set(bench.FAULT_KINDS)
    assert all(f.seconds > 0 for f in a if f.kind != "rank") and all(f.seconds == 0 for f in a if f.kind == "rank")
    assert bench.fault_schedule(1, 0, 10) == []
    with pytest.raises(ValueError, match="do not fit"):
        bench.fault_schedule(1, 10, 12)


def test_quotas_keep_the_host_speeds_and_fill_the_cores(bench):
    q = bench.rank_quotas((3, 2, 1), 2, 2.0)
    assert q == pytest.approx([0.5, 1 / 3, 1 / 6]) and 2 * sum(q) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="positive"):
        bench.rank_quotas((3, 0, 1))


def _line(rank: int, value: dict) -> str:
    return f"[rank {rank}] {json.dumps(value)}"


def test_parse_keeps_the_last_generation_of_a_step(bench):
    out = "\n".join([
        _line(0, {"step": 1, "loss": 2.0, "world": 6, "gen": 0, "t": 10.0}),
        _line(0, {"samples": 1, "gen": 0, "rank": 0, "idx": [3, 4]}),
        _line(1, {"samples": 1, "gen": 0, "rank": 1, "idx": [5]}),
        _line(0, {"hapd": "elastic", "event": "step", "step": 1}),
        _line(0, {"step": 1, "loss": 2.5, "world": 4, "gen": 1, "t": 20.0}),
        _line(0, {"samples": 1, "gen": 1, "rank": 0, "idx": [5, 4, 3]}),
        "hapd launcher: something else",
        _line(0, {"final": "abc", "step": 1}),
    ])
    p = bench.parse_lines(out)
    assert p["losses"] == {1: (2.5, 4, 1, 20.0)} and p["final"] == "abc" and len(p["events"]) == 1
    assert bench.step_samples(p["samples"]) == {1: [3, 4, 5]}


def test_samples_skipped_and_repeated_are_counted(bench):
    ref = {1: [1, 2], 2: [3, 4]}
    assert bench.compare_samples({1: [2, 1], 2: [3, 4]}, ref) == {"skipped": 0, "repeated": 0, "steps_differ": 0}
    assert bench.compare_samples({1: [1, 2], 2: [1, 4]}, ref) == {"skipped": 1, "repeated": 1, "steps_differ": 1}


def test_losses_within_the_tolerance(bench):
    ref = {1: (1.0,), 2: (2.0,), 3: (3.0,)}
    ok = bench.compare_losses({1: (1.0,), 2: (2.0 + 1e-6,), 3: (3.0,)}, ref)
    assert ok["ok"] and ok["max_rel"] == pytest.approx(5e-7)
    bad = bench.compare_losses({1: (1.1,), 2: (2.0,)}, ref)
    assert not bad["ok"] and bad["over"] == [1] and bad["missing"] == [3]


def test_throughput_over_the_last_steps(bench):
    losses = {s: (0.0, 6, 0, 100.0 + 0.5 * s) for s in range(1, 11)}
    assert bench.throughput(losses, 4) == pytest.approx(2.0)
    assert bench.throughput(losses, 10) is None


def test_chain_redoes_generations_from_their_resume_steps(bench):
    gens = [
        {"hosts": ["a", "b", "c"], "first_step": {"step": 1}, "resumed": None},
        {"hosts": ["a", "b"], "first_step": {"step": 18}, "resumed": {"step": 17}},
        {"hosts": ["a", "b"], "first_step": None, "resumed": {"step": 25}},  # failed before its first step
        {"hosts": ["a", "b"], "first_step": {"step": 26}, "resumed": {"step": 25}},
        {"hosts": ["a", "b", "c"], "first_step": {"step": 41}, "resumed": {"step": 40}},
    ]
    assert bench.chain_segments(gens, 60) == [
        {"hosts": ["a", "b", "c"], "start": 0, "end": 17},
        {"hosts": ["a", "b"], "start": 17, "end": 40},
        {"hosts": ["a", "b", "c"], "start": 40, "end": 60},
    ]


def test_chain_goes_back_with_a_restart_that_resumed_before_the_last_generation(bench):
    """The survivors switched in place at step 225 and trained a step; the next
    generation, restarted, loaded the snapshot of step 215: the chain runs the hosts of
    step 214 to 215 only, then the restart's from 215."""
    gens = [
        {"hosts": ["a", "b", "c"], "first_step": {"step": 1}, "resumed": None},
        {"hosts": ["a", "b"], "first_step": {"step": 201}, "resumed": {"step": 200}},
        {"hosts": ["a", "c"], "first_step": {"step": 226}, "resumed": {"step": 225}},
        {"hosts": ["a", "c"], "first_step": None, "resumed": {"step": 226}},  # never trained
        {"hosts": ["b", "c"], "first_step": {"step": 216}, "resumed": {"step": 215}},
    ]
    assert bench.chain_segments(gens, 300) == [
        {"hosts": ["a", "b", "c"], "start": 0, "end": 200},
        {"hosts": ["a", "b"], "start": 200, "end": 215},
        {"hosts": ["b", "c"], "start": 215, "end": 300},
    ]
    again = [gens[0], {"hosts": ["a", "b"], "first_step": {"step": 1}, "resumed": {"step": 0}}]
    assert bench.chain_segments(again, 60) == [{"hosts": ["a", "b"], "start": 0, "end": 60}]  # began again


def test_tables_print_every_scenario(bench):
    rec = {"total_s": 9.5, "detection_s": 1.0, "replan_s": 0.2, "restart_s": 7.0, "load_s": 0.3, "resumed_step": 19,
           "steps_lost": 1, "generation": 1, "lost": ["h2"], "source": "snapshot", "plan": "cache"}
    chk = {"losses": {"max_rel": 0.0}, "digest_equal": True, "samples": {"skipped": 0, "repeated": 0},
           "segments": [{}, {}]}
    results = {
        "kill": {"steps": 60, "kill_at": 20, "runs": [{"every": 0, "code": 0, "kill_to_first_step_s": 10.1,
                                                       "recovery": [rec], "check": chk, "leftover": 0}]},
        "join": {"steps": 60, "join_at": 40, "last": 10, "code": 0, "worlds_after_join": [6],
                 "steps_per_s_after_join": 1.9, "steps_per_s_fresh": 2.0, "ratio": 0.95, "check": chk},
        "faults": {"injected": [{"index": 0, "kind": "link", "host": "h1", "step": 5}], "recoveries": [rec],
                   "code": 0, "faults_seen": 1, "joins": 1, "generations": 3, "all_recovered": True, "leftover": 0,
                   "check": chk},
        "snapshot": {"steps": 40, "last": 20, "rounds": 1, "median": {"-1": 2.0, "1": 1.5, "0": 1.9, "off": 2.1},
                     "paired": {"-1": [1.0], "1": [0.75], "0": [0.95], "off": [1.05]},
                     "ratio_to_none": {"-1": 1.0, "1": 0.75, "0": 0.95, "off": 1.05},
                     "steps_per_s": {"-1": [2.0], "1": [1.5], "0": [1.9], "off": [2.1]},
                     "replica_cost": 0.0476, "replica_bytes": [[4096, 0]]},
        "replan": {"model": "bert tiny", "batch": 64, "profiles": {"paper-8": {"full_s": 0.5, "full_path": "miss",
                   "subsets": [{"without": "p100-7", "devices": 7, "first_s": 0.05, "first_path": "lp-only",
                                "hit_s": 0.002, "hit_path": "hit"}]}}},
    }
    text = "\n".join(bench.tables(results))
    for needle in ("1. host kill", "2. host join", "3. random faults", "4. snapshot cost", "5. re-plan", "lp-only",
                   "0.75", "p100-7", "none, no replicas", "cost 4.8% of the steps/s without them", "snapshot"):
        assert needle in text
    assert bench.format_table("t", ["a", "b"], [[None, 1.23456]]).splitlines()[-1].split() == ["-", "1.23"]


def test_the_faults_run_aims_only_at_the_generations_hosts(bench):
    """A generation's hosts come from the launcher's line (a host with killed ranks is
    named HOST#N); no fault is aimed at a joining host's ranks or a dropped host's."""
    line = ("hapd launcher: generation 3 on 3 host(s) (10.0.0.2, 10.0.0.3#1, 10.0.0.5), 4 ranks: resumed at step 9 "
            "from survivors' memory")
    assert bench.placed_hosts(line) == {"10.0.0.2", "10.0.0.3", "10.0.0.5"}
    assert bench.placed_hosts("hapd launcher: host(s) 10.0.0.4 ready to join: their ranks start now") is None
    switched = ("hapd launcher: job j-g0: switched in place to generation 2: 5 ranks on 3 host(s) (10.0.0.2 ranks "
                "0-1, 10.0.0.4 ranks 2-2, 10.0.0.3 ranks 3-4); MASTER_ADDR=10.0.0.2 MASTER_PORT=1")
    assert bench.placed_hosts(switched) == {"10.0.0.2", "10.0.0.3", "10.0.0.4"}  # a join's generation says only this
    assert bench.joining_hosts(switched, {"10.0.0.3"}) == set()


def test_the_faults_run_waits_for_hosts_preparing_to_join(bench):
    """A host prepares to join from the launcher's "their ranks start now" until a
    generation places it or it does not join; the next fault waits meanwhile."""
    start = "hapd launcher: host(s) 10.0.0.3, 10.0.0.4 ready to join: their ranks start now, the others train on"
    preparing = bench.joining_hosts(start, set())
    assert preparing == {"10.0.0.3", "10.0.0.4"}
    assert bench.joining_hosts("hapd launcher: host(s) 10.0.0.3 ready to join: pausing the job at the next step "
                               "boundary", preparing) == preparing
    placed = bench.joining_hosts("hapd launcher: generation 3 on 3 host(s) (10.0.0.2, 10.0.0.3#1, 10.0.0.5), 4 ranks",
                                 preparing)
    assert placed == {"10.0.0.4"}
    assert bench.joining_hosts("hapd launcher: joining host 10.0.0.4 stopped answering (DaemonDown): it does not "
                               "join", placed) == set()
    assert bench.joining_hosts("hapd launcher: could not start the ranks of joining host 10.0.0.4: refused",
                               placed) == set()


def test_a_resumes_state_source_is_named_in_a_word(bench):
    memory = "survivors' memory, step 8, moved 0.02 MB in 0.00 s (0.00 MB of it between ranks)"
    assert bench.state_source(memory) == "memory"
    assert bench.state_source(memory[:-1] + ", 0.10 MB from replicas of lost ranks' pieces)") == "memory+replicas"
    assert bench.state_source("snapshot of step 9 (world 6) (fallback: keys w not held by any survivor)") == "snapshot"
    assert bench.state_source(None) == "-" and bench.state_source("none") == "none"
