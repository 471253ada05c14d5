"""Issue 17, item 7, and issue 31, item 1: leftovers are bounded.

- a launcher's private daemon removes its ``$TMPDIR/hapd-launcher-*`` state folder when it
  stops because its launcher was killed, and the next launcher removes any such folder
  whose launcher and daemon are gone;
- a daemon's job folders (shipped scripts) are pruned when it starts and whenever a job
  ends: the newest ones younger than the age bound are kept, and always those of
  unfinished jobs;
- a cancel, or a job's end, reaches every process of the job, a child a rank started in
  a session of its own included; a killed daemon's rank guards take those too; and a
  daemon that starts stops what a killed predecessor's ranks left (its record of them
  in the state folder), never a process that merely got a recorded pid again.

Every wait is for an event, bounded by a generous deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _jobs import job_processes, kill_job
from _wait import GENEROUS_S, wait_for

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parents[2]

SLEEPER = """\
import os, time
print(f"rank {os.environ['RANK']} up", flush=True)
time.sleep(300)
"""

DAY_S = 86400.0
OWNER_FILE = "launcher.json"
"""The owner file of a launcher folder (``launcher.job.OWNER_FILE``, as documented)."""


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def owned_folder(root: Path, name: str, pid: int, started: str | None, *, age_s: float = 0.0,
                 daemon_pid: int | None = None) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    if pid:
        (folder / OWNER_FILE).write_text(json.dumps({"pid": pid, "started": started}))
    if daemon_pid is not None:
        (folder / "daemon.json").write_text(json.dumps({"pid": daemon_pid, "address": "tcp://127.0.0.1:1"}))
    if age_s:
        past = time.time() - age_s
        os.utime(folder, (past, past))
    return folder


# ----------------------------------------------------------------------------- launcher folders


def test_stale_launcher_folders_are_removed_and_live_ones_kept(tmp_path):
    from launcher.job import clean_stale_launcher_dirs, process_start

    me, my_start = os.getpid(), process_start(os.getpid())
    assert my_start  # Linux: a start time from /proc
    gone = owned_folder(tmp_path, "hapd-launcher-gone", dead_pid(), "12345")
    reused = owned_folder(tmp_path, "hapd-launcher-reused", me, "1")  # the pid now names another process
    old_unowned = owned_folder(tmp_path, "hapd-launcher-older", 0, None, age_s=2 * DAY_S)
    live = owned_folder(tmp_path, "hapd-launcher-live", me, my_start)
    fresh_unowned = owned_folder(tmp_path, "hapd-launcher-fresh", 0, None)  # being made right now
    daemon_runs = owned_folder(tmp_path, "hapd-launcher-daemon", dead_pid(), "12345", daemon_pid=me)
    other = owned_folder(tmp_path, "not-a-launcher", dead_pid(), "12345")
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    (tmp_path / "hapd-launcher-link").symlink_to(target)

    removed = clean_stale_launcher_dirs(tmp_path)
    assert sorted(p.name for p in removed) == ["hapd-launcher-gone", "hapd-launcher-older", "hapd-launcher-reused"]
    assert not gone.exists() and not reused.exists() and not old_unowned.exists()
    assert live.exists() and fresh_unowned.exists() and daemon_runs.exists() and other.exists()
    assert (target / "keep.txt").exists() and (tmp_path / "hapd-launcher-link").is_symlink()


def test_a_sigkilled_launcher_s_own_daemon_leaves_no_state_folder(tmp_path):
    """No daemon answers, so the launcher starts its own in ``$TMPDIR/hapd-launcher-*``;
    SIGKILL the launcher: that daemon stops (parent-death signal), cancels the ranks and
    removes its folder. A folder an earlier launcher left is removed by this one."""
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    earlier = owned_folder(tmpdir, "hapd-launcher-earlier", dead_pid(), "12345")
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE")}
    env.update(HAPD_HOME=str(tmp_path / "home"), TMPDIR=str(tmpdir))
    job = "ownfolder"
    proc = subprocess.Popen([sys.executable, "-m", "launcher", "run", str(script), "-n", "1", "--job-id", job],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        assert "rank 0 up" in proc.stdout.readline(), proc.stderr.read() if proc.poll() is not None else ""
        [folder] = [f for f in tmpdir.glob("hapd-launcher-*") if f != earlier]
        proc.kill()
        proc.communicate()
        wait_for(lambda: not job_processes(job), GENEROUS_S, f"the processes of job {job} to end")
        wait_for(lambda: not folder.exists(), GENEROUS_S, f"{folder} to be removed")
        assert not earlier.exists()  # removed by this launcher as it started
        assert list(tmpdir.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in job_processes(job):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------- job folders


def _launch_body(job: str, script: str = "pass\n") -> dict:
    return {"job": job, "script": "job.py", "script_bytes": script.encode(), "args": [], "env": {}, "nproc": 1,
            "node_rank": 0, "nnodes": 1, "rank_offset": 0, "world_size": 1, "master_addr": "127.0.0.1", "master_port": 29500}


def _folders(jobs_dir: Path) -> list[str]:
    return sorted(p.name for p in jobs_dir.iterdir())


def test_job_folders_are_bounded_in_number_and_age(tmp_path):
    from hapd.serve.jobs import JobManager

    jobs_dir = tmp_path / "jobs"
    for i, age in enumerate([10.0, 20.0, 30.0, 40.0, 2 * 3600.0]):
        folder = jobs_dir / f"old{i}"
        folder.mkdir(parents=True)
        (folder / "job.py").write_text("pass\n")
        past = time.time() - age
        os.utime(folder, (past, past))
    jobs = JobManager(jobs_dir=jobs_dir, daemon_address="tcp://127.0.0.1:1", cache_dir=tmp_path / "cache",
                      keep_job_dirs=2, job_dir_max_age_s=3600.0, grace_s=2.0)
    try:
        assert _folders(jobs_dir) == ["old0", "old1"]  # at start: the newest two, none older than an hour
        long = jobs.launch(_launch_body("long", SLEEPER))
        for name in ("a", "b", "c"):
            job = jobs.launch(_launch_body(name))
            wait_for(lambda job=job: job.finished, GENEROUS_S, f"job {name} to end")
            wait_for(lambda name=name: name in _folders(jobs_dir) and len(_folders(jobs_dir)) <= 3, GENEROUS_S,
                     f"the folders to be pruned after job {name}")
        assert _folders(jobs_dir) == ["b", "c", "long"]  # an unfinished job's folder is never removed
        jobs.cancel("long")
        wait_for(lambda: long.finished, GENEROUS_S, "job long to end")
        wait_for(lambda: _folders(jobs_dir) == ["c", "long"], GENEROUS_S, "the folders to be pruned after job long")
    finally:
        jobs.shutdown()


def test_a_daemon_prunes_job_folders_at_start(tmp_path):
    """100 job folders 30 days old and one from now: a starting daemon keeps only the new one."""
    home = tmp_path / "daemon"
    jobs_dir = home / "jobs"
    for i in range(100):
        folder = jobs_dir / f"old{i:03d}"
        folder.mkdir(parents=True)
        (folder / "job.py").write_text("pass\n")
        past = time.time() - 30 * DAY_S
        os.utime(folder, (past, past))
    (jobs_dir / "recent").mkdir()
    with open(tmp_path / "stderr.txt", "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "hapd.cli", "serve", "--state", str(home), "--bind", "tcp://127.0.0.1:*",
                                 "--profile", "paper-8", "--no-preload"], stdout=subprocess.DEVNULL, stderr=stderr,
                                cwd=ROOT)
    try:
        wait_for(lambda: (home / "daemon.json").exists() or proc.poll() is not None, GENEROUS_S, "the daemon to start")
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
        assert _folders(jobs_dir) == ["recent"]
    finally:
        proc.terminate()
        proc.wait(GENEROUS_S)


# ----------------------------------------------------------------------------- issue 31: every descendant, and a restart

GRANDPARENT = """\
import subprocess, sys, time
code = "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('grandchild', os.getpid(), flush=True); time.sleep(300)"
child = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)  # out of the rank's group and session
time.sleep(300)
"""
"""A rank that starts a child in a session of its own, which ignores SIGTERM (and says
so, with its pid, once it does)."""


def _alive(pid: int) -> bool:
    from hapd.serve.leftovers import process_start

    return process_start(pid) is not None


def _grandchild(events: list[dict]) -> int | None:
    for e in events:
        if e["stream"] == "stdout" and e["line"].startswith("grandchild "):
            return int(e["line"].split()[1])
    return None


def test_a_cancel_reaches_a_grandchild_in_its_own_session(tmp_path):
    from hapd.serve.jobs import JobManager

    jobs = JobManager(jobs_dir=tmp_path / "jobs", daemon_address="tcp://127.0.0.1:1", cache_dir=tmp_path / "cache",
                      grace_s=1.0)
    try:
        job = jobs.launch(_launch_body("descend", GRANDPARENT))
        pid = wait_for(lambda: _grandchild(job.events_after(0)[0]), GENEROUS_S, "the grandchild to start")
        assert os.getsid(pid) == pid and len(job_processes("descend")) == 3  # guard, rank, grandchild
        assert len(list((tmp_path / "ranks").glob("*.json"))) == 1  # the running job is recorded
        jobs.cancel("descend")
        wait_for(lambda: job.finished and not _alive(pid), GENEROUS_S, "the grandchild to be killed")
        wait_for(lambda: not list((tmp_path / "ranks").glob("*.json")), GENEROUS_S, "the job's record to go")
        assert job_processes("descend") == []
    finally:
        jobs.shutdown()
        kill_job("descend")


def test_what_a_finished_job_left_running_is_stopped(tmp_path):
    """A rank that exits 0 leaving a child in its own session: the child is stopped too."""
    from hapd.serve.jobs import JobManager

    script = GRANDPARENT.rsplit("time.sleep(300)", 1)[0] + "time.sleep(1)\n"  # the rank exits once its child is up
    jobs = JobManager(jobs_dir=tmp_path / "jobs", daemon_address="tcp://127.0.0.1:1", cache_dir=tmp_path / "cache",
                      grace_s=1.0)
    try:
        job = jobs.launch(_launch_body("leaves", script))
        wait_for(lambda: job.finished, GENEROUS_S, "the rank to exit")
        pid = _grandchild(job.events_after(0)[0])
        assert job.state == "exited" and pid is not None
        wait_for(lambda: not _alive(pid), GENEROUS_S, "what the rank left to be killed")
    finally:
        jobs.shutdown()
        kill_job("leaves")


def test_a_killed_daemon_s_guards_take_grandchildren_in_their_own_session(tmp_path):
    """SIGKILL the daemon: within 5 s nothing of the job is left, the child the rank
    started in its own session included."""
    from _hardening_daemon import ServedDaemon

    daemon = ServedDaemon(tmp_path / "hapd").start()
    try:
        with daemon.client(timeout_s=GENEROUS_S) as client:
            client.launch("orphans", "gp.py", script_bytes=GRANDPARENT.encode(), nproc=2, world_size=2,
                          master_addr="127.0.0.1", master_port=29500)
            wait_for(lambda: len(job_processes("orphans")) == 6, GENEROUS_S, "2 guards, 2 ranks, 2 grandchildren")
        daemon.proc.kill()
        daemon.proc.wait()
        killed = time.monotonic()
        wait_for(lambda: not job_processes("orphans"), 5.0, "the job's processes to die with the daemon")
        assert time.monotonic() - killed < 5.0
    finally:
        daemon.stop()
        kill_job("orphans")


def test_a_restarted_daemon_stops_what_its_predecessor_left(tmp_path):
    """The daemon and the rank's guard are both SIGKILLed (nothing of theirs can clean
    up): the rank and its own-session child run on. A daemon started on the same state
    directory finds the record and kills them."""
    from _hardening_daemon import ServedDaemon

    home = tmp_path / "hapd"
    first = ServedDaemon(home).start()
    try:
        with first.client(timeout_s=GENEROUS_S) as client:
            [guard] = client.launch("left", "gp.py", script_bytes=GRANDPARENT.encode(), nproc=1, world_size=1,
                                    master_addr="127.0.0.1", master_port=29500)
            # the grandchild's line, not just its process: one that has not printed yet when
            # its pipe's readers are killed dies of the broken pipe on its first print
            wait_for(lambda: _grandchild(client.job_events("left")[0]), GENEROUS_S, "the grandchild to start")
            assert len(job_processes("left")) == 3  # guard, rank and grandchild
        os.kill(guard, signal.SIGKILL)
        first.proc.kill()
        first.proc.wait()
        time.sleep(1.0)
        left = job_processes("left")
        assert len(left) == 2, left  # the rank and the grandchild, orphans
        second = ServedDaemon(home).start()
        try:
            wait_for(lambda: not job_processes("left"), GENEROUS_S, "the new daemon to stop the leftovers")
            second.wait_log(rf"job left: killed 2 process\(es\) that daemon {first.pid} left")
            assert not list((home / "ranks").glob("*.json"))
        finally:
            second.stop()
    finally:
        first.stop()
        kill_job("left")


def test_a_record_never_kills_a_recycled_pid_or_a_live_daemon_s_ranks(tmp_path):
    """A record whose guard pid now names another process (another start time) kills
    nothing; a record of a daemon that still runs is left alone."""
    from hapd.serve.leftovers import RankRecords, process_start

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        records = tmp_path / "ranks"
        records.mkdir()
        stranger = {"job": "old", "token": "t" * 32, "daemon": {"pid": dead_pid(), "start": "1"},
                    "guards": [{"pid": bystander.pid, "start": "1"}]}  # its pid, recycled: another start time
        (records / f"{'t' * 32}.json").write_text(json.dumps(stranger))
        live = {"job": "live", "token": "u" * 32, "daemon": {"pid": bystander.pid, "start": process_start(bystander.pid)},
                "guards": [{"pid": bystander.pid, "start": process_start(bystander.pid)}]}
        (records / f"{'u' * 32}.json").write_text(json.dumps(live))
        assert RankRecords(records).stop_leftovers() == []
        assert bystander.poll() is None
        assert sorted(p.name for p in records.iterdir()) == [f"{'u' * 32}.json"]
    finally:
        bystander.kill()
        bystander.wait()
