"""The runner of a user's script on a rank (``python -m hapd.spmd.script``): the script
runs as ``python SCRIPT`` would run it, and the process ends without finalization."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hapd.serve.jobs import SCRIPT_MODULE

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """\
import atexit, sys
print("name", __name__, "argv", sys.argv[1:], "path0", sys.path[0], flush=True)
atexit.register(lambda: print("atexit ran", flush=True))
def inner():
    raise ValueError("boom from the script")
mode = sys.argv[1]
if mode == "raise":
    inner()
if mode == "exit":
    sys.exit(3)
if mode == "message":
    sys.exit("a message for stderr")
"""


def _run(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-u", "-m", SCRIPT_MODULE, str(script), mode], capture_output=True,
                          text=True, timeout=60, env=env, cwd=tmp_path)


def test_the_runner_is_the_module_the_daemon_names():
    import hapd.spmd.script as runner

    assert runner.SCRIPT_MODULE == SCRIPT_MODULE


def test_a_script_that_returns_ends_0_with_its_atexit_handlers_run(tmp_path):
    done = _run(tmp_path, "return")
    assert done.returncode == 0, done.stderr
    assert f"name __main__ argv ['return'] path0 {tmp_path}" in done.stdout
    assert done.stdout.rstrip().endswith("atexit ran")


def test_an_uncaught_exception_is_status_1_with_a_traceback_from_the_script(tmp_path):
    done = _run(tmp_path, "raise")
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "user_script.py" in lines[1], done.stderr  # the runner's and runpy's frames are left out
    assert "runpy" not in done.stderr and "hapd/spmd/script.py" not in done.stderr
    assert lines[-1] == "ValueError: boom from the script"
    assert "atexit ran" in done.stdout


def test_sys_exit_keeps_its_status_and_message(tmp_path):
    assert _run(tmp_path, "exit").returncode == 3
    done = _run(tmp_path, "message")
    assert done.returncode == 1 and done.stderr.strip() == "a message for stderr"
