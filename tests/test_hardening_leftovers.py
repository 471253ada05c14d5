"""Issue 17, item 7: leftovers are bounded.

- a launcher's private daemon removes its ``$TMPDIR/hapd-launcher-*`` state folder when it
  stops because its launcher was killed, and the next launcher removes any such folder
  whose launcher and daemon are gone;
- a daemon's job folders (shipped scripts) are pruned when it starts and whenever a job
  ends: the newest ones younger than the age bound are kept, and always those of
  unfinished jobs.

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
from _jobs import job_processes
from _wait import GENEROUS_S, wait_for

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parent.parent

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
                                 "--profile", "paper-8"], stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT)
    try:
        wait_for(lambda: (home / "daemon.json").exists() or proc.poll() is not None, GENEROUS_S, "the daemon to start")
        assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()
        assert _folders(jobs_dir) == ["recent"]
    finally:
        proc.terminate()
        proc.wait(GENEROUS_S)
