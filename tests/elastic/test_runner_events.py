"""The elastic runner, started as the daemon starts it (``python -m
hapd.elastic.in_place``), sets the park events hapd's waits read.

Run as ``-m``, the runner's file is ``__main__``, a second copy of the module beside the
``hapd.elastic.in_place`` that the snapshot sender and the replicas import. While the
events were defined there, the watcher set the copy's, and a rank waiting on a
snapshot's send to a lost host never saw the park request: it waited past the
launcher's hold and its host was dropped (:mod:`hapd.elastic.park_events` holds them now)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hapd.wire.contract import PARK_FD_ENV, RUN_ENV
from hapd.wire.switch import GENERATION_ENV

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import sys
from hapd.elastic import in_place
print("ready", flush=True)
seen = in_place.PARK_REQUESTED.wait(20)
print("seen" if seen else "not seen", flush=True)
sys.exit(0 if seen else 3)
'''


def test_a_park_request_reaches_the_module_hapd_imports(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    read_end, write_end = os.pipe()
    env = {**os.environ, "PYTHONPATH": str(ROOT), PARK_FD_ENV: str(read_end), GENERATION_ENV: "4",
           "RANK": "0"}
    env.pop(RUN_ENV, None)
    with subprocess.Popen([sys.executable, "-u", "-m", "hapd.elastic.in_place", str(script)], env=env,
                          pass_fds=(read_end,), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        os.close(read_end)
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            os.write(write_end, b"3\n4\n")  # an earlier generation's request is ignored; this one's is seen
        finally:
            os.close(write_end)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, f"{out}\n{err}"
    assert out.strip().splitlines()[-1] == "seen"
