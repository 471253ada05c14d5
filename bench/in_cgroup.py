#!/usr/bin/env python3
"""Run a training script with this rank in its own cpu cgroup (emulated device speed).

    HAPD_RANK_CGROUPS=/sys/fs/cgroup/cpu/hapd-r0:/sys/fs/cgroup/cpu/hapd-r1 \
        torchrun --nproc-per-node 2 bench/in_cgroup.py worker.py --model bert

``HAPD_RANK_CGROUPS`` lists one cgroup directory per global rank (``:``-separated);
this process writes its pid into ``RANK``'s ``cgroup.procs`` and then runs the script
as ``__main__`` with the remaining arguments. Used by bench/emulated_cluster.py.
"""

import os
import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    groups = [g for g in os.environ.get("HAPD_RANK_CGROUPS", "").split(":") if g]
    rank = int(os.environ.get("RANK", "0"))
    if rank < len(groups):
        (Path(groups[rank]) / "cgroup.procs").write_text(f"{os.getpid()}\n")
    if len(sys.argv) < 2:
        sys.exit("usage: in_cgroup.py SCRIPT [ARGS...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
