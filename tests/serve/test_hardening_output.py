"""Issue 31, item 4 (first half): the daemon's memory does not grow with what its jobs
print. A job's events live in a bounded tail in memory and in a spill file in its job
folder; a poll for older events is served from the file, so nothing is lost; a finished
job keeps only a small tail. A real daemon whose job prints 40 MiB grows by far less;
the event log's bounds and its drop marker are checked directly."""

from __future__ import annotations

import os
import sys
import time

import pytest
from _hardening_daemon import ServedDaemon, rss_bytes, settled_rss
from _wait import GENEROUS_S, wait_for

from hapd.serve.events import FINISHED_TAIL_EVENTS, INDEX_EVERY, SPILL_FILE, EventLog

pytestmark = pytest.mark.daemon

PRINTED_MIB = 40
"""What the job of the daemon test prints."""
LINE_CHARS = 1023
"""Characters of each of its lines (1 KiB with the newline)."""
MAX_GROWTH_MIB = 16
"""The daemon's resident memory may grow by at most this much (it held all 40 MiB before)."""

PRINTER = f"""\
import sys
import time
line = "x" * {LINE_CHARS} + "\\n"
out = sys.stdout
for i in range({PRINTED_MIB} * 1024):
    out.write(f"{{i:08d}}" + line[8:])
out.flush()
"""






def _run_job(daemon: ServedDaemon, job: str, script: str) -> list[dict]:
    """Launch ``script`` as one rank, poll its events to the end as a launcher does; the events."""
    with daemon.client(timeout_s=GENEROUS_S) as client:
        client.launch(job, "job.py", script_bytes=script.encode(), nproc=1, world_size=1, master_addr="127.0.0.1",
                      master_port=29500, cwd=str(daemon.home))
        seen: list[dict] = []
        done = False
        while not done:
            events, done = client.job_events(job, seen[-1]["seq"] if seen else 0)
            seen.extend(events)
        return seen


def _lines(events: list[dict]) -> list[str]:
    return [e["line"] for e in events if e["stream"] == "stdout"]


def test_a_job_printing_40_mib_leaves_the_daemon_s_memory_flat(tmp_path):
    expected = [f"{i:08d}" + "x" * (LINE_CHARS - 8) for i in range(PRINTED_MIB * 1024)]
    with ServedDaemon(tmp_path / "hapd") as daemon:
        _run_job(daemon, "warmup", "print('hello')\n")  # threads, imports and arenas of a first job
        wait_for(lambda: daemon.log().count("job warmup: exited") > 0, GENEROUS_S, "the first job to end")
        before = settled_rss(daemon.pid)
        events = _run_job(daemon, "printer", PRINTER)
        after = rss_bytes(daemon.pid)
        assert _lines(events) == expected
        assert events[-1]["stream"] == "exit" and events[-1]["line"] == "0"
        spill = daemon.home / "jobs" / "printer" / SPILL_FILE
        assert spill.stat().st_size > PRINTED_MIB * 2**20
        # a poll from the start after the job ended: every line again, from the spill file
        with daemon.client(timeout_s=GENEROUS_S) as client:
            again: list[dict] = []
            done = False
            while not done:
                got, done = client.job_events("printer", again[-1]["seq"] if again else 0)
                again.extend(got)
        assert _lines(again) == expected
        assert [e["seq"] for e in again] == list(range(1, len(again) + 1))
        growth = rss_bytes(daemon.pid) - before
    print(f"daemon RSS {before / 2**20:.1f} MiB before, {after / 2**20:.1f} MiB after printing "
          f"{PRINTED_MIB} MiB, {(before + growth) / 2**20:.1f} MiB after reading it all again", file=sys.stderr)
    assert after - before < MAX_GROWTH_MIB * 2**20, f"grew {(after - before) / 2**20:.1f} MiB"
    assert growth < MAX_GROWTH_MIB * 2**20, f"grew {growth / 2**20:.1f} MiB"


def _event(i: int, text: str = "") -> dict:
    return {"rank": 0, "stream": "stdout", "line": text or f"line {i}", "time": 0.0}


def test_the_tail_is_bounded_and_older_events_come_from_the_spill_file(tmp_path):
    log = EventLog(tmp_path / "job" / SPILL_FILE, rank=3, tail_events=100, tail_bytes=10_000)
    total = 5 * INDEX_EVERY + 7
    for i in range(1, total + 1):
        assert log.append(_event(i)) == i
    assert log.tail_first == total - 99  # 100 events in memory
    for after in (0, 1, INDEX_EVERY - 1, INDEX_EVERY, 3 * INDEX_EVERY + 5, total - 150, total - 100, total - 1):
        got = log.after(after, limit=50, max_bytes=1 << 20)
        assert [e["seq"] for e in got] == list(range(after + 1, min(after + 51, total + 1))), after
        assert [e["line"] for e in got] == [f"line {s}" for s in range(after + 1, min(after + 51, total + 1))]
    assert log.after(total, limit=50, max_bytes=1 << 20) == []
    # bytes bound a reply, but never below one event
    big = log.append(_event(0, "y" * 50_000))
    assert log.tail_first == big  # alone over the byte bound: the newest stays
    assert [e["seq"] for e in log.after(big - 2, limit=50, max_bytes=1000)] == [big - 1]
    assert [e["seq"] for e in log.after(big - 1, limit=50, max_bytes=1000)] == [big]
    log.finish()
    assert log.after(0, limit=2, max_bytes=1 << 20)[0]["line"] == "line 1"  # the file outlives the job's end


def test_a_forgotten_jobs_spill_file_is_removed(tmp_path):
    """A finished job's events are read from its spill file until the daemon forgets
    the job (past its kept finished jobs, or when it stops): then the file goes too."""
    path = tmp_path / "job" / SPILL_FILE
    log = EventLog(path, rank=0, tail_events=1)
    for i in range(1, 50):
        log.append(_event(i))
    log.finish()
    assert path.exists() and log.after(0, limit=1, max_bytes=1 << 20)[0]["line"] == "line 1"
    log.close()
    assert not path.exists()


def test_a_stopped_daemons_jobs_leave_no_spill(tmp_path):
    from hapd.serve.jobs import JobManager

    jobs = JobManager(jobs_dir=tmp_path / "jobs", daemon_address="tcp://127.0.0.1:1", cache_dir=tmp_path / "cache",
                      grace_s=2.0)
    job = jobs.launch({"job": "talker", "script": "t.py", "script_bytes": b"print('x' * 100)\n", "args": [], "env": {},
                       "nproc": 1, "node_rank": 0, "nnodes": 1, "rank_offset": 0, "world_size": 1,
                       "master_addr": "127.0.0.1", "master_port": 29991})
    spill = tmp_path / "jobs" / "talker" / SPILL_FILE
    wait_for(lambda: job.finished, GENEROUS_S, "the job to end")
    assert spill.exists()
    jobs.shutdown()
    assert not spill.exists()


def test_a_finished_job_keeps_a_small_tail(tmp_path):
    log = EventLog(tmp_path / SPILL_FILE, rank=0)
    for i in range(1, 3 * FINISHED_TAIL_EVENTS):
        log.append(_event(i))
    log.finish()
    assert log.seq - log.tail_first + 1 == FINISHED_TAIL_EVENTS


def test_events_that_cannot_be_spilled_stand_as_one_marker(tmp_path):
    """No spill file, or one past its bound: a poll for events older than the tail gets
    what the file holds, then one stderr event naming the range dropped and why, then the tail."""
    for log in (EventLog(None, rank=4, tail_events=10),
                EventLog(tmp_path / SPILL_FILE, rank=4, tail_events=10, max_spill_bytes=400)):
        for i in range(1, 31):
            log.append(_event(i))
        spilled = [e for e in log.after(0, limit=50, max_bytes=1 << 20) if e["stream"] == "stdout"]
        assert [e["seq"] for e in spilled] == list(range(1, len(spilled) + 1))
        marker = log.after(len(spilled), limit=50, max_bytes=1 << 20)[0]
        assert marker["stream"] == "stderr" and marker["rank"] == 4 and marker["seq"] == 20
        assert marker["line"].startswith(f"hapd: {20 - len(spilled)} output event(s) of this job ({len(spilled) + 1}..20) "
                                         "were dropped by the daemon: ")
        assert [e["seq"] for e in log.after(20, limit=50, max_bytes=1 << 20)] == list(range(21, 31))
    assert 0 < len(spilled) < 20


def test_a_job_id_used_again_gets_a_fresh_spill_file(tmp_path):
    path = tmp_path / SPILL_FILE
    old = EventLog(path, rank=0, tail_events=1)
    for i in range(1, 5):
        old.append(_event(i, "old"))
    new = EventLog(path, rank=0, tail_events=1)
    for i in range(1, 3):
        new.append(_event(i, "new"))
    old.append(_event(5, "old"))  # a late writer of the old job does not reach the new file
    old.close()
    new.finish()
    assert [e["line"] for e in new.after(0, 10, 1 << 20)] == ["new", "new"]
    assert os.path.getsize(path) < 100
