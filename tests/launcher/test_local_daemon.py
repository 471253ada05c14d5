"""The daemon a launcher starts for a job on this machine (``./run_all SCRIPT K`` with
no daemon running): temporary state, but the user's plan cache, so running a job again
gets its plan from the cache; a temporary cache when another daemon holds that folder;
and its ranks find its key through ``HAPD_KEY_FILE`` although it lies in the temporary
state, not at ``$HAPD_HOME/key``. ``$HAPD_HOME`` is a test folder throughout."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

from hapd.serve.daemon import _DirLock, folder_holder
from launcher.job import LAUNCHER_DIR_PREFIX

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parents[2]

KEY_PROBE = """\
import os
key = os.environ.get("HAPD_KEY_FILE", "")
print(f"probe rank={os.environ['RANK']} key={key} key_is_file={os.path.isfile(key)} cache={os.environ.get('HAPD_CACHE')}",
      flush=True)
"""

PROBE_LINE = re.compile(r"^\[rank (\d)\] probe rank=\d key=(\S*) key_is_file=(\w+) cache=(\S+)$", re.M)


@pytest.fixture
def home(tmp_path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def launcher_env(home) -> dict[str, str]:
    """A launcher's environment with its own state directory: no default daemon answers
    under its key (there is none), and no ``$HAPD_DAEMON`` or ``$HAPD_KEY_FILE``."""
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE", "HAPD_JOB")}
    env["HAPD_HOME"] = str(home)
    return env


def run_all(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    done = subprocess.run([str(ROOT / "run_all"), *args], capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def probes(done: subprocess.CompletedProcess) -> dict[int, tuple[str, str, str]]:
    """rank -> (HAPD_KEY_FILE, whether it is a file, HAPD_CACHE) as the ranks saw them."""
    return {int(m.group(1)): m.group(2, 3, 4) for m in PROBE_LINE.finditer(done.stdout)}


def test_ranks_get_the_key_file_and_the_user_plan_cache(home, launcher_env, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(KEY_PROBE)
    done = run_all([str(script), "2"], launcher_env)
    state = Path(re.search(r"started one at tcp://127\.0\.0\.1:\d+ \(state (\S+),", done.stderr).group(1))
    assert state.name.startswith(LAUNCHER_DIR_PREFIX) and f"plan cache {home / 'cache'}," in done.stderr
    seen = probes(done)
    assert sorted(seen) == [0, 1], done.stdout
    for key, is_file, cache in seen.values():
        assert (Path(key), is_file, Path(cache)) == (state / "key", "True", home / "cache")
    assert not (home / "key").exists()  # the key is the job daemon's, gone with its state
    assert not state.exists() and (home / "cache").is_dir()
    assert folder_holder(home / "cache") is None  # released when the daemon stopped


@pytest.mark.distributed
def test_a_job_run_again_gets_its_plan_from_the_cache(launcher_env):
    """Two ``./run_all worker.py 2`` in a row, no daemon running: the first's daemon
    compiles the plan, the second's (another process) finds it in the user's cache;
    both through rank 0's request to the daemon with the key in its temporary state."""
    args = ["worker.py", "2", "--", "--model", "mlp", "--iterations", "2", "--warmup", "1"]
    plans = []
    for _ in range(2):
        done = run_all(args, launcher_env)
        plans.append(re.search(r"^\[rank 0\] plan: .*; ([^;]+), \d+ ms$", done.stdout, re.M).group(1))
    assert plans == ["compiled by the daemon", "daemon cache hit"]


def test_a_cache_held_by_another_daemon_gives_the_job_a_temporary_one(home, launcher_env, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(KEY_PROBE)
    (home / "cache").mkdir(parents=True)
    lock = _DirLock(home / "cache")  # the lock a running `hapd serve` holds on its cache
    try:
        assert folder_holder(home / "cache") == str(os.getpid())
        done = run_all([str(script), "1"], launcher_env)
    finally:
        lock.release()
    notes = [line for line in done.stderr.splitlines() if "is in use" in line]
    assert notes == [f"hapd launcher: the plan cache {home / 'cache'} is in use by another hapd daemon "
                     f"(pid {os.getpid()}); this job's plans are cached only for the job"]
    state = Path(re.search(r"\(state (\S+),", done.stderr).group(1))
    assert {r: Path(c) for r, (_, _, c) in probes(done).items()} == {0: state / "cache"}
    assert "Error" not in done.stderr


def test_folder_holder_only_looks(tmp_path):
    assert folder_holder(tmp_path / "missing") is None
    assert folder_holder(tmp_path) is None and not (tmp_path / ".hapd.lock").exists()
    lock = _DirLock(tmp_path)
    try:
        assert folder_holder(tmp_path) == str(os.getpid())
    finally:
        lock.release()
    assert folder_holder(tmp_path) is None
    _DirLock(tmp_path).release()  # free again: a daemon can take it
