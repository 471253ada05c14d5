"""Warm rank processes (``hapd serve --standby N``): an in-place launch's rank is handed
to a process that imported torch and hapd ahead, runs its script in the launch's
environment, folder and arguments as a new process would, and is cancelled with its
job; a launch whose start-time environment differs, or a plain launch, gets a new
process; the pool fills up again once the job ended."""

from __future__ import annotations

import json
import os
import time

import pytest
from _hardening_daemon import ServedDaemon
from _wait import GENEROUS_S, wait_for

from hapd.wire.standby import fits, read_order

pytestmark = pytest.mark.daemon

REPORT = """\
import json, os, sys
print(json.dumps({"torch_before_script": "torch" in sys.modules, "pid": os.getpid(), "ppid": os.getppid(),
                  "rank": os.environ.get("RANK"), "world": os.environ.get("WORLD_SIZE"),
                  "job": os.environ.get("HAPD_JOB"), "cwd": os.getcwd(), "argv": sys.argv[1:],
                  "mine": os.environ.get("STANDBY_TEST"), "in_place": os.environ.get("HAPD_IN_PLACE"),
                  "normal_class": os.sched_getscheduler(0) == os.SCHED_OTHER}), flush=True)
"""

SLEEPER = """\
import os, time
print(os.getpid(), flush=True)
time.sleep(600)
"""


def _events(daemon: ServedDaemon, job: str, *, until_done: bool = True, until=None) -> list[dict]:
    seen: list[dict] = []
    deadline = time.monotonic() + GENEROUS_S
    with daemon.client(timeout_s=GENEROUS_S) as client:
        while time.monotonic() < deadline:
            events, done = client.job_events(job, seen[-1]["seq"] if seen else 0)
            seen.extend(events)
            if (until_done and done) or (until is not None and until(seen)):
                return seen
            time.sleep(0.05)
    raise AssertionError(f"job {job} did not end: {seen}")


def _launch(daemon: ServedDaemon, job: str, script: str, folder, **kw) -> list[int]:
    with daemon.client(timeout_s=GENEROUS_S) as client:
        return client.launch(job, "job.py", script_bytes=script.encode(), nproc=1, world_size=1,
                             master_addr="127.0.0.1", master_port=29500, cwd=str(folder), **kw)


def _report(events: list[dict]) -> dict:
    lines = [e["line"] for e in events if e["stream"] == "stdout" and e["line"].startswith("{")]
    assert lines, events
    return json.loads(lines[0])


def test_an_in_place_rank_runs_in_a_warm_process_and_a_differing_launch_in_a_new_one(tmp_path):
    folder = tmp_path / "work"
    folder.mkdir()
    with ServedDaemon(tmp_path / "hapd", "--standby", "1") as daemon:
        wait_for(lambda: "warm in" in daemon.log(), GENEROUS_S, "the standby to be warm")
        pids = _launch(daemon, "warm", REPORT, folder, in_place=True, args=["--steps", "3"], env={"STANDBY_TEST": "yes"})
        events = _events(daemon, "warm")
        got = _report(events)
        assert got["torch_before_script"] is True  # imported by the standby, before the script ran
        assert got["ppid"] == pids[0]  # under the rank's guard, as a new rank would be
        assert (got["rank"], got["world"], got["job"], got["mine"], got["in_place"]) == ("0", "1", "warm", "yes", "1")
        assert got["cwd"] == str(folder) and got["argv"] == ["--steps", "3"]
        assert got["normal_class"] is True  # out of the idle class it warmed in
        assert any("runs in a warm process" in e["line"] for e in events if e["stream"] == "stderr")
        assert events[-1]["stream"] == "exit" and events[-1]["line"] == "0"
        assert "(1 from warm standbys)" in daemon.log()
        wait_for(lambda: daemon.log().count("warm in") == 2, GENEROUS_S, "the pool to fill up again once the job ended")

        # a start-time variable the standby did not start with: a new process
        _launch(daemon, "cold", REPORT, folder, in_place=True, env={"PYTHONHASHSEED": "7"})
        assert _report(_events(daemon, "cold"))["torch_before_script"] is False
        assert "PYTHONHASHSEED differs" in daemon.log()

        # a plain (not in-place) launch never takes a standby
        _launch(daemon, "plain", REPORT, folder)
        assert _report(_events(daemon, "plain"))["torch_before_script"] is False


def test_cancelling_a_job_stops_the_rank_it_handed_to_a_standby(tmp_path):
    with ServedDaemon(tmp_path / "hapd", "--standby", "1") as daemon:
        wait_for(lambda: "warm in" in daemon.log(), GENEROUS_S, "the standby to be warm")
        _launch(daemon, "sleeper", SLEEPER, tmp_path, in_place=True)
        events = _events(daemon, "sleeper", until_done=False,
                         until=lambda seen: any(e["stream"] == "stdout" for e in seen))
        pid = int(next(e["line"] for e in events if e["stream"] == "stdout"))
        with daemon.client(timeout_s=GENEROUS_S) as client:
            client.cancel("sleeper")
        wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), GENEROUS_S, "the adopted rank to end")


def _policy(guard_pid: int) -> int:
    """The scheduling policy of the warm process under a standby's guard (waits for it to start)."""
    def child() -> int | None:
        try:
            with open(f"/proc/{guard_pid}/task/{guard_pid}/children") as f:
                kids = f.read().split()
        except OSError:
            return None
        return int(kids[0]) if kids else None

    pid = wait_for(child, GENEROUS_S, "the standby's process to start")
    wait_for(lambda: os.sched_getscheduler(pid) == os.SCHED_IDLE or None, GENEROUS_S, "its warm-up to begin")
    return os.sched_getscheduler(pid)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_the_hand_over_line_and_the_start_variables_rule():
    import io

    order = {"env": {"RANK": "0"}, "cwd": "/", "argv": ["s.py"], "runner": "in_place"}
    assert read_order(io.StringIO(json.dumps(order) + "\n")) == order
    assert read_order(io.StringIO("")) is None
    for bad in ({**order, "runner": "shell"}, {**order, "argv": []}, {**order, "env": []}, [1]):
        with pytest.raises(ValueError, match="not a hand-over"):
            read_order(io.StringIO(json.dumps(bad) + "\n"))
    assert fits({"PATH": "/a", "PYTHONUNBUFFERED": "1"}, {"PATH": "/b", "RANK": "3"}) is None
    assert "LD_PRELOAD differs" in fits({}, {"LD_PRELOAD": "x.so"})
    assert "OMP" not in (fits({"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "4"}) or "")  # applied at hand-over


def test_the_pool_warms_its_standbys_in_the_idle_scheduling_class(tmp_path):
    from hapd.serve.standby import StandbyPool

    pool = StandbyPool(2, cwd=str(tmp_path))
    try:
        pool.fill()
        wait_for(lambda: len(pool._ready) == 2, GENEROUS_S, "both standbys to start")  # noqa: SLF001 - at once
        first, second = pool._ready  # noqa: SLF001
        warming = [_policy(first.proc.pid), _policy(second.proc.pid)]  # their guards' children: the warm processes
        wait_for(lambda: pool.ready() == 2, GENEROUS_S, "both standbys to be warm")
        assert warming == [os.SCHED_IDLE, os.SCHED_IDLE]
        pids = [first.proc.pid, second.proc.pid]
    finally:
        pool.close()
    assert pool.ready() == 0
    wait_for(lambda: all(not os.path.exists(f"/proc/{p}") or _zombie(p) for p in pids), GENEROUS_S,
             "the closed pool's processes to end")


def test_a_standby_import_may_read_attributes_of_a_lazily_importing_library():
    """``MODULE:ATTR[,ATTR…]`` imports the module and reads each attribute (what loads
    a lazily importing library's model module); the daemon refuses a name that is
    neither."""
    import sys
    import types

    from hapd.elastic.standby import import_named
    from hapd.errors import OptionsError
    from hapd.serve.standby import StandbyPool, import_name_ok

    read = []

    class Lazy(types.ModuleType):  # a library whose classes are imported when first read
        def __getattr__(self, name):
            read.append(name)
            if name == "Missing":
                raise AttributeError(name)
            return object()

    sys.modules["hapd_lazy_library"] = Lazy("hapd_lazy_library")
    try:
        import_named("hapd_lazy_library")
        assert read == []
        import_named("hapd_lazy_library:ModelA, ModelB")
        assert read == ["ModelA", "ModelB"]
        with pytest.raises(AttributeError):
            import_named("hapd_lazy_library:Missing")
    finally:
        del sys.modules["hapd_lazy_library"]
    with pytest.raises(ImportError):
        import_named("hapd_no_such_module_here")
    for good in ("transformers", "transformers.models.gpt2", "transformers:GPT2LMHeadModel", "a.b:C,D"):
        assert import_name_ok(good), good
    for bad in ("", "a..b", "a:", "a:1x", ":C", "a:C,", "a b"):
        assert not import_name_ok(bad), bad
        with pytest.raises(OptionsError, match="not a module name"):
            StandbyPool(1, imports=[bad])
