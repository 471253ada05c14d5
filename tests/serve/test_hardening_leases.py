"""Issue 17, item 1: no orphaned ranks. A job is leased: its launcher's ``job_events``
polls renew the lease, and a daemon that hears nothing about the job for ``lease_s``
cancels its ranks. A launcher killed outright, hung up, or one that gave up on a stopped
daemon leaves nothing running past the lease, and says truthfully what it left.

Real daemons on loopback and real launcher subprocesses; every wait is for an event,
bounded by a generous deadline.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from _jobs import describe_processes, job_processes, launched
from _wait import GENEROUS_S, wait_for

from hapd.errors import OptionsError
from hapd.wire.client import Client
from hapd.serve.leftovers import MARKER_ENV, marked_processes
from hapd.serve.rank_guard import GUARD_MODULE, victims

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parents[2]

SLEEPER = """\
import os, subprocess, time
rank = int(os.environ["RANK"])
child = subprocess.Popen(["sleep", "300"])  # a grandchild: it must be stopped with its rank
print(f"rank {rank} up pid {os.getpid()} child {child.pid}", flush=True)
time.sleep(300)
"""

TEST_LEASE_S = 2.0
"""The launcher's ``--lease`` in these tests (short, so the daemon acts soon)."""
STOPPED_DAEMON_S = 3.0
"""How long the daemon is kept stopped (SIGSTOP) in the stopped-daemon test (as in the issue)."""


# ----------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def running_daemon(home: Path) -> Iterator[tuple[subprocess.Popen, str]]:
    """``hapd serve`` on a free loopback port: (process, address); stopped on the way out
    (continued first, should a test leave it stopped)."""
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "stderr.txt", "ab") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hapd.cli", "serve", "--state", str(home), "--bind", "tcp://127.0.0.1:*",
             "--profile", "paper-8", "--slots", "4", "--no-preload"], stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT)

    def address() -> str | None:
        if proc.poll() is not None:
            raise AssertionError(f"the daemon exited with {proc.returncode}: {(home / 'stderr.txt').read_text()[-3000:]}")
        try:
            info = json.loads((home / "daemon.json").read_text())
        except (OSError, ValueError):
            return None
        return info["address"] if info.get("pid") == proc.pid else None

    try:
        yield proc, wait_for(address, GENEROUS_S, "the daemon to start")
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
        proc.terminate()
        try:
            proc.wait(GENEROUS_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def launcher_env(tmp_path: Path, address: str, key: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE")}
    env.update(HAPD_HOME=str(tmp_path / "launcher-home"), HAPD_DAEMON=address, HAPD_KEY_FILE=str(key))
    return env


@contextlib.contextmanager
def launcher(tmp_path: Path, address: str, key: Path, job: str, *options: str) -> Iterator[subprocess.Popen]:
    """``python -m launcher run SLEEPER -n 2`` using the daemon at ``address`` (as
    ``$HAPD_DAEMON``); killed on the way out if still running, and so is the job."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    with launched(["run", str(script), "-n", "2", "--job-id", job, *options], launcher_env(tmp_path, address, key),
                  job) as proc:
        yield proc


def wait_ranks_up(proc: subprocess.Popen, count: int) -> None:
    """Read the launcher's stdout until ``count`` ranks said they are up."""
    seen = 0
    while seen < count:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"the launcher exited ({proc.wait()}) before {count} ranks were up: {proc.stderr.read()}")
        seen += " up pid " in line


def wait_job_gone(job: str) -> None:
    try:
        wait_for(lambda: not job_processes(job), GENEROUS_S, f"every process of job {job} to end")
    except AssertionError as e:  # say which are left: a guard, a rank, a child
        raise AssertionError(f"{e}; left: {describe_processes(job_processes(job))}") from None


def finished_status(address: str, key: Path, job: str) -> dict:
    """The job's status once its daemon reports it finished."""
    with Client(address, key) as client:
        return wait_for(lambda: (s := client.job_status(job))["state"] in ("exited", "failed", "cancelled") and s,
                        GENEROUS_S, f"job {job} to finish")


# ----------------------------------------------------------------------------- the job manager


def _manager(tmp_path: Path):
    from hapd.serve.jobs import JobManager

    return JobManager(jobs_dir=tmp_path / "jobs", daemon_address="tcp://127.0.0.1:1", cache_dir=tmp_path / "cache", grace_s=2.0)


def _launch_body(job: str, **extra) -> dict:
    return {"job": job, "script": "sleeper.py", "script_bytes": SLEEPER.encode(), "args": [], "env": {}, "nproc": 1,
            "node_rank": 0, "nnodes": 1, "rank_offset": 0, "world_size": 1, "master_addr": "127.0.0.1",
            "master_port": 29500, **extra}


def test_a_job_is_cancelled_when_its_lease_expires_and_renewed_by_polls(tmp_path):
    jobs = _manager(tmp_path)
    job = jobs.launch(_launch_body("leased", lease_s=5.0))
    try:
        assert job.spec.lease_s == 5.0
        assert jobs.expire_leases(time.monotonic() + 4.0) == []  # inside the lease
        job.renew()
        assert jobs.expire_leases(job.renewed + 4.9) == []
        assert jobs.expire_leases(job.renewed + 5.5) == ["leased"]
        wait_for(lambda: job.finished, GENEROUS_S, "the expired job to end")
        status = job.status()
        assert status["state"] == "cancelled"
        assert status["reason"].startswith("lease expired: launcher silent for 5.5 s (lease 5 s)")
        events, done = job.events_after(0)
        assert done and any(e["stream"] == "stderr" and "hapd: lease expired" in e["line"] for e in events)
        assert jobs.expire_leases(time.monotonic() + 100) == []  # once
    finally:
        jobs.shutdown()
    assert not job_processes("leased")


def test_a_launch_without_a_lease_gets_the_default_and_bad_leases_are_refused(tmp_path):
    from hapd.serve.jobs import DEFAULT_LEASE_S, LaunchSpec

    assert LaunchSpec.from_body(_launch_body("j")).lease_s == DEFAULT_LEASE_S
    for bad in (0.0, 0.5, -1.0, 1e300):
        with pytest.raises(OptionsError, match=r"lease_s .* must be in 1\.\.604800 s"):
            LaunchSpec.from_body(_launch_body("j", lease_s=bad))


def test_reasons_say_why_a_job_ended(tmp_path):
    jobs = _manager(tmp_path)
    try:
        job = jobs.launch(_launch_body("cancelme", lease_s=60.0))
        assert "reason" not in job.status()
        jobs.cancel("cancelme")
        wait_for(lambda: job.finished, GENEROUS_S, "the cancelled job to end")
        assert job.status()["reason"] == "cancelled by a cancel request"
        failing = jobs.launch(_launch_body("failing", script="fail.py", script_bytes=b"import sys; sys.exit(3)\n"))
        wait_for(lambda: failing.finished, GENEROUS_S, "the failing job to end")
        assert failing.status() | {"ranks": None} == {"job": "failing", "state": "failed", "ranks": None,
                                                        "reason": "rank 0 exited with code 3"}
    finally:
        jobs.shutdown()


CRASH_ONE = """\
import os, sys, time
if os.environ["RANK"] == "0":
    sys.exit(7)
time.sleep(300)
"""


def test_a_failed_host_stays_failed_when_the_launcher_s_cancel_comes_first(tmp_path, monkeypatch):
    """A launcher that reads a rank's non-zero exit cancels the job on every host, this
    one included, at once. Here the cancel runs inside the exit's publication (the
    earliest moment it can arrive): the host whose rank crashed still reports "failed",
    with the crash as its reason, and its other rank is stopped."""
    from hapd.serve.jobs import HostJob

    jobs = _manager(tmp_path)
    publish = HostJob.add_event

    def launcher_cancels_on_exit(self, rank, stream, line, **kw):
        publish(self, rank, stream, line, **kw)
        if stream == "exit" and line != "0":
            jobs.cancel(self.spec.job, reason="cancelled by the launcher: another rank failed")

    monkeypatch.setattr(HostJob, "add_event", launcher_cancels_on_exit)
    try:
        job = jobs.launch(_launch_body("crashes", script="crash.py", script_bytes=CRASH_ONE.encode(), nproc=2,
                                       world_size=2))
        wait_for(lambda: job.finished, GENEROUS_S, "the job to end")
        assert job.status()["state"] == "failed"
        assert job.status()["reason"] == "rank 0 exited with code 7"
        assert [r.returncode for r in job.ranks][0] == 7 and job.ranks[1].returncode != 0  # stopped
    finally:
        jobs.shutdown()


# ----------------------------------------------------------------------------- end to end


def test_a_sigkilled_launcher_leaves_no_rank_past_its_lease(tmp_path):
    """(a) SIGKILL gives a launcher that uses a running daemon no chance to cancel: the
    daemon stops the ranks itself once the lease has run out without a poll."""
    job = "killedlauncher"
    with running_daemon(tmp_path / "daemon") as (_, address), \
            launcher(tmp_path, address, tmp_path / "daemon" / "key", job, "--lease", str(TEST_LEASE_S)) as proc:
        wait_ranks_up(proc, 2)
        assert len(job_processes(job)) == 6  # 2 ranks, each with its guard and its child
        proc.kill()
        proc.communicate()
        wait_job_gone(job)
        status = finished_status(address, tmp_path / "daemon" / "key", job)
        assert status["state"] == "cancelled"
        assert status["reason"].startswith("lease expired: launcher silent for "), status
        assert f"(lease {TEST_LEASE_S:g} s)" in status["reason"]
        log = (tmp_path / "daemon" / "logs" / "daemon.log").read_text()
        assert f"job {job}: lease expired: launcher silent for" in log


def test_a_sigkilled_daemon_takes_its_ranks_with_it(tmp_path):
    """A daemon killed outright can clean nothing up: each rank's guard
    (``hapd.serve.rank_guard``) sees its daemon end and kills the rank's process group,
    the rank's own child included."""
    job = "killeddaemon"
    with running_daemon(tmp_path / "daemon") as (daemon, address), \
            launcher(tmp_path, address, tmp_path / "daemon" / "key", job, "--lease", "600") as proc:
        wait_ranks_up(proc, 2)
        assert len(job_processes(job)) == 6
        daemon.kill()
        daemon.wait()
        wait_job_gone(job)


def test_a_guard_spares_the_other_guards_of_its_job(tmp_path):
    """What a guard kills outside its group is the job's marked processes less the other
    ranks' guards: two guards that killed each other first left both ranks running (seen
    as a flaky ``test_a_sigkilled_daemon_takes_its_ranks_with_it``)."""
    token = f"spare-{os.getpid()}"
    env = {**os.environ, MARKER_ENV: token}
    other_guard = subprocess.Popen([sys.executable, "-m", GUARD_MODULE, str(os.getpid()), "--", "sleep", "300"],
                                   env=env, start_new_session=True)
    marked = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    try:
        wait_for(lambda: len(marked_processes({token}).get(token, [])) == 3, GENEROUS_S,
                 "the other guard's rank to start")
        ranks = set(marked_processes({token})[token]) - {other_guard.pid}
        assert set(victims(token)) == ranks and marked.pid in ranks
    finally:
        for proc in (other_guard, marked):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


GUARDED_DAEMON = """\
import os, subprocess, sys, time
guard = subprocess.Popen([sys.executable, "-m", "hapd.serve.rank_guard", str(os.getpid()), "--",
                          "sh", "-c", "env -u HAPD_JOB_TOKEN sleep 300 & exec sleep 301"], start_new_session=True)
print(guard.pid, flush=True)
time.sleep(300)
"""


def test_a_guard_whose_daemon_is_gone_kills_its_group_though_its_rank_already_died(tmp_path):
    """Once the daemon is gone, a rank that died (another guard killed it: it carries the
    job's token) does not let its guard return quietly: the rank's children in the group,
    even one without the token, are killed too. The guard is stopped while its daemon and
    its rank die, so it sees both at once."""
    env = {**os.environ, MARKER_ENV: f"group-{os.getpid()}", "PYTHONPATH": str(ROOT)}
    daemon = subprocess.Popen([sys.executable, "-c", GUARDED_DAEMON], env=env, stdout=subprocess.PIPE, text=True)
    group = int(daemon.stdout.readline())
    try:
        wait_for(lambda: sorted(_cmdline(pid) for pid in group_members(group) if pid != group) == ["sleep 300", "sleep 301"],
                 GENEROUS_S, "the guard's rank and its child to start")
        (rank,) = [pid for pid in group_members(group) if _cmdline(pid) == "sleep 301"]
        os.kill(group, signal.SIGSTOP)
        daemon.kill()
        daemon.wait()
        os.kill(rank, signal.SIGKILL)
        wait_for(lambda: rank not in group_members(group), GENEROUS_S, "the rank to die")
        os.kill(group, signal.SIGCONT)
        wait_for(lambda: not group_members(group), GENEROUS_S, "the guard's group to end")
    finally:
        daemon.stdout.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGKILL)


def group_members(group: int) -> list[int]:
    """Live (not zombie) processes of process group ``group``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == group and fields[0] != "Z":
                pids.append(int(entry.name))
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


def test_a_guard_runs_its_command_and_passes_its_status_on(tmp_path):
    """Without a daemon death the guard is transparent: the command's output and exit
    status (a signal as 128 + its number); a usage error is status 2."""
    guard = [sys.executable, "-m", "hapd.serve.rank_guard", str(os.getpid()), "--"]
    done = subprocess.run([*guard, sys.executable, "-c", "print('hi'); raise SystemExit(7)"], capture_output=True,
                          text=True, timeout=GENEROUS_S)
    assert (done.returncode, done.stdout) == (7, "hi\n")
    done = subprocess.run([*guard, sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"],
                          timeout=GENEROUS_S)
    assert done.returncode == 128 + signal.SIGTERM
    done = subprocess.run([sys.executable, "-m", "hapd.serve.rank_guard", "x"], capture_output=True, text=True,
                          timeout=GENEROUS_S)
    assert done.returncode == 2 and "usage" in done.stderr


def test_a_hung_up_launcher_stops_every_rank(tmp_path):
    """(a) SIGHUP (its terminal closed) stops the job as Ctrl-C does, at once."""
    job = "hungup"
    with running_daemon(tmp_path / "daemon") as (_, address), \
            launcher(tmp_path, address, tmp_path / "daemon" / "key", job, "--lease", "600") as proc:
        wait_ranks_up(proc, 2)
        proc.send_signal(signal.SIGHUP)
        err = proc.communicate(timeout=GENEROUS_S)[1]
        wait_job_gone(job)  # the lease (600 s) is not what stopped them
        status = finished_status(address, tmp_path / "daemon" / "key", job)
    assert proc.returncode == 130, err
    assert "interrupted: stopping all ranks" in err, err
    assert status["state"] == "cancelled" and status["reason"] == "cancelled by a cancel request"


def test_a_launcher_that_gives_up_on_a_stopped_daemon_says_so_and_the_daemon_stops_the_ranks(tmp_path):
    """(b) The daemon is stopped (SIGSTOP) for 3 s: the launcher gives up on it after
    --lost-after, exits 1 and says the daemon will stop the ranks when the lease expires
    (not "all ranks stopped"); continued, the daemon does exactly that."""
    job = "stoppeddaemon"
    with running_daemon(tmp_path / "daemon") as (daemon, address), \
            launcher(tmp_path, address, tmp_path / "daemon" / "key", job, "--lease", str(TEST_LEASE_S),
                     "--lost-after", "1") as proc:
        wait_ranks_up(proc, 2)
        stopped = time.monotonic()
        daemon.send_signal(signal.SIGSTOP)
        try:
            err = proc.communicate(timeout=GENEROUS_S)[1]
            time.sleep(max(0.0, STOPPED_DAEMON_S - (time.monotonic() - stopped)))  # the fault lasts 3 s at least
            assert len(job_processes(job)) == 6  # nobody could stop them yet (ranks, guards, children)
        finally:
            daemon.send_signal(signal.SIGCONT)
        wait_job_gone(job)
        status = finished_status(address, tmp_path / "daemon" / "key", job)
    assert proc.returncode == 1, err
    assert "all ranks stopped" not in err, err
    assert f"lost the daemon of {address.removeprefix('tcp://')} (ranks 0-1)" in err, err
    assert (f"daemon {address.removeprefix('tcp://')} stopped answering: this launcher cannot stop ranks 0-1 there; "
            f"that daemon stops them itself when the job's lease expires, {TEST_LEASE_S:g} s after the last poll") in err, err
    assert f"are left to the job's lease there ({TEST_LEASE_S:g} s without a poll), not stopped by this launcher" in err, err
    assert status["state"] == "cancelled" and status["reason"].startswith("lease expired: launcher silent for "), status


def test_the_launcher_refuses_a_bad_lease(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE")}
    env["HAPD_HOME"] = str(tmp_path / "home")
    for bad in ("0.5", "nan", "1e300"):
        done = subprocess.run([sys.executable, "-m", "launcher", "run", str(script), "--lease", bad], capture_output=True,
                              text=True, cwd=ROOT, env=env, timeout=GENEROUS_S)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"hapd launcher: OptionsError: --lease {float(bad):g} must be in 1..604800 s"], done.stderr
