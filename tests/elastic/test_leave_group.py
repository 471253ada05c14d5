"""A parked rank leaves its broken process group at once (issue 50, item 3).

The case that once took 25.7 s: a rank parks (a peer went away) while its Gloo group
still has work pending on a peer that went silent — alive, its connections open, never
answering (a host whose link is down, or a rank stuck waiting on another). Destroying
that group waited for the pending work until the collective timeout, and a peer
blocked on the parking rank waited as long. Three real ranks under the elastic runner
(:mod:`hapd.elastic.in_place`), a 30 s collective timeout; no daemon, so after parking
each rank finds no switch and ends."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 30.0

SCRIPT = r'''
import sys, time
import torch
import torch.distributed as dist
from hapd.errors import CollectiveError
from hapd.spmd.distributed import init_distributed, side_group

rank = init_distributed().rank
assert side_group() is not None  # an elastic run's side group, made at the rendezvous (left with the rest)
t = torch.ones(4)
dist.all_reduce(t)  # every pair connected and working
if rank == 2:  # the silent peer: alive, its connections open, in no collective again
    time.sleep(120)
    sys.exit(0)
if rank == 0:
    pending = dist.all_reduce(t, async_op=True)  # waits on rank 2 until the collective timeout
    time.sleep(0.5)
    raise CollectiveError("rank 0: a peer went away (injected)")  # parks with that work pending
dist.broadcast(t, src=0)  # rank 1: blocked on rank 0, which never comes
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _events(text: str) -> dict[str, dict]:
    out = {}
    for line in text.splitlines():
        if line.startswith("{"):
            value = json.loads(line)
            if value.get("hapd") == "elastic":
                out[value["event"]] = value
    return out


@pytest.mark.slow
def test_a_parked_rank_leaves_a_group_with_work_pending_on_a_silent_peer_at_once(tmp_path):
    script = tmp_path / "pending.py"
    script.write_text(SCRIPT)
    port = _free_port()
    procs = []
    for rank in range(3):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "HAPD_COLLECTIVE_TIMEOUT": f"{TIMEOUT_S:g}", "HAPD_ELASTIC_RUN": "leave-test",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        for name in ("HAPD_DAEMON", "HAPD_JOB", "CUDA_VISIBLE_DEVICES"):
            env.pop(name, None)
        env["CUDA_VISIBLE_DEVICES"] = ""
        procs.append(subprocess.Popen([sys.executable, "-m", "hapd.elastic.in_place", str(script)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path))
    try:
        outs = {}
        for rank in (0, 1):
            out, err = procs[rank].communicate(timeout=TIMEOUT_S + 60)
            outs[rank] = (out, err, time.time())
            # no switch comes (no daemon): the rank ends with its traceback after parking
            assert procs[rank].returncode == 1, f"rank {rank}: {out}\n{err}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    zero, one = _events(outs[0][0]), _events(outs[1][0])
    assert "parked" in zero and "left_group" in zero, outs[0]
    # the pending work on the silent peer held the group's destruction until the timeout (29.5 s)
    assert zero["left_group"]["seconds"] < TIMEOUT_S / 3, zero["left_group"]
    # rank 1, blocked on rank 0, failed because rank 0's connection closed, not at its timeout
    assert "parked" in one and "left_group" in one, outs[1]
    assert "timed out" not in one["parked"]["cause"].lower(), one["parked"]
    assert one["parked"]["time"] - zero["parked"]["time"] < TIMEOUT_S / 3, (zero["parked"], one["parked"])
    assert one["left_group"]["seconds"] < TIMEOUT_S / 3, one["left_group"]
