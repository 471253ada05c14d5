"""How fast the launcher finds a host lost, and that a loaded machine is not taken for
one (issue 50, item 4). Two loopback daemons, one sleeping rank each, every core kept
busy by Python loops all along (nothing installed: the load is this test's own).

- under the default ``--lost-after`` (1.5 s), seconds of polling on the loaded machine
  lose no host;
- a daemon that stops answering without refusing (SIGSTOP: as a host whose link is
  down) is lost after ``--lost-after`` (``DaemonTimeout``);
- a daemon killed while its host is up (its port refuses connections) is lost at once
  (``DaemonDown``: its port probed after 0.5 s without an answer), not after
  ``--lost-after``."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import _bench
import pytest
from _jobs import launched
from _wait import GENEROUS_S

from hapd.wire.client import Client

pytestmark = [pytest.mark.daemon, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
bench = _bench.load("launcher")

SLEEPER = """\
import os, sys, time
print(f"rank {os.environ['RANK']} up", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 300)
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = bench.LoopbackCluster(tmp_path_factory.mktemp("detect"), 2, 2).start()
    yield c
    c.close()


@pytest.fixture
def load():
    """Every core kept busy by a Python loop for the test's length (as ``stress -c N``)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    yield
    for p in procs:
        p.kill()
        p.wait()


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE")}
    return {**env, "HAPD_HOME": str(tmp_path / "home")}


def _wait_line(proc: subprocess.Popen, pattern: str, count: int) -> None:
    seen = 0
    deadline = time.monotonic() + GENEROUS_S
    while seen < count:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise AssertionError(f"launcher rc {proc.poll()}: {proc.stderr.read() if proc.poll() is not None else ''}")
        if re.search(pattern, proc.stdout.readline()):
            seen += 1


def _answering(cluster) -> None:
    """Every daemon answers a ping (one just started on a loaded machine is slow to)."""
    for address in cluster.addresses:
        with Client(address, cluster.key_file, GENEROUS_S) as client:
            client.ping()


def test_a_loaded_machine_loses_no_host_a_silent_daemon_is_lost_after_lost_after_a_killed_one_at_once(
        cluster, load, tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(cluster.host_lines(slots=[1, 1]))
    _answering(cluster)
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    key = ["--key", str(cluster.key_file)]

    # 1. the default --lost-after (1.5 s) on a loaded machine: seconds of polls lose no host; then a daemon that
    # takes connections but never answers (stopped, as one whose link is down) is lost after --lost-after
    with launched(["run", str(script), "--hosts", str(hosts), *key, "--job-id", "silent"], _env(tmp_path),
                  "silent") as proc:
        _wait_line(proc, r"^\[rank \d\] rank \d up", 2)
        time.sleep(3)
        assert proc.poll() is None
        os.kill(cluster.procs[1].pid, signal.SIGSTOP)
        try:
            err = proc.communicate(timeout=GENEROUS_S)[1]
        finally:
            os.kill(cluster.procs[1].pid, signal.SIGCONT)
    assert proc.returncode == 1, err
    assert err.count("lost the daemon") == 1, err
    assert re.search(rf"lost the daemon of 127\.0\.0\.1:{cluster.port(1)} \(ranks 1-1\): DaemonTimeout", err), err

    # 2. a daemon killed, its host up: lost at once (its port refuses connections: DaemonDown), not after
    # --lost-after (its rank of job 1 is still there: it has a second slot)
    _answering(cluster)
    with launched(["run", str(script), "--hosts", str(hosts), *key, "--job-id", "killed"], _env(tmp_path),
                  "killed") as proc:
        _wait_line(proc, r"^\[rank \d\] rank \d up", 2)
        cluster.procs[1].kill()
        err = proc.communicate(timeout=GENEROUS_S)[1]
    assert proc.returncode == 1, err
    assert re.search(rf"lost the daemon of 127\.0\.0\.1:{cluster.port(1)} \(ranks 1-1\): DaemonDown", err), err
