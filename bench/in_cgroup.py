#!/usr/bin/env python3
"""Run a training script with this rank in its own cgroups (emulated device speed and memory).

    HAPD_RANK_CGROUPS=/sys/fs/cgroup/cpu/hapd-r0:/sys/fs/cgroup/cpu/hapd-r1 \
        torchrun --nproc-per-node 2 bench/in_cgroup.py worker.py --model bert
    HAPD_RANK_CGROUPS=/sys/fs/cgroup/cpu/r0,/sys/fs/cgroup/memory/r0:/sys/fs/cgroup/cpu/r1,/sys/fs/cgroup/memory/r1 \
        torchrun --nproc-per-node 2 bench/in_cgroup.py ddp.py --model llama_block

``HAPD_RANK_CGROUPS`` lists one entry per global rank (``:``-separated); an entry is one
cgroup directory or several (``,``-separated: one per controller, e.g. a cpu cgroup that
sets the rank's speed and a memory cgroup that sets its memory). This process writes its
pid into the ``cgroup.procs`` of each of ``RANK``'s directories, before the script
imports anything, so everything the rank allocates is charged to its memory cgroup, and
then runs the script as ``__main__`` with the remaining arguments. Used by
bench/emulated_cluster.py (cpu) and bench/memory_cluster.py (cpu and memory).
"""

import os
import runpy
import sys
from pathlib import Path


def rank_groups(spec: str, rank: int) -> list[Path]:
    """The cgroup directories of ``rank`` in a ``HAPD_RANK_CGROUPS`` value (none when the
    value has no entry for it)."""
    entries = [e for e in spec.split(":") if e]
    if rank >= len(entries):
        return []
    return [Path(g) for g in entries[rank].split(",") if g]


if __name__ == "__main__":
    for group in rank_groups(os.environ.get("HAPD_RANK_CGROUPS", ""), int(os.environ.get("RANK", "0"))):
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
    if len(sys.argv) < 2:
        sys.exit("usage: in_cgroup.py SCRIPT [ARGS...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
