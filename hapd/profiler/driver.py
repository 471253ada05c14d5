"""``hapd profile`` and ``python -m hapd.profiler``: the profiler's driver and CLI.

Rank side, one process per device, under torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; any launcher that sets
them will do, ``./run_all`` included)::

    python -m hapd.profiler [--out FILE] [--sizes 4K,64K,1M] [--repeats N] [--quick]

``hapd profile`` starts K local ranks this way (:func:`launch_local`). Rank 0 prints
progress and writes the profile; every rank measures its own device
(:mod:`hapd.profiler.measure`, which says what the numbers mean).

This module imports no torch at import time: :func:`main` loads the measuring code
when it runs and :func:`default_nproc` asks torch for the GPU count when called.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from hapd.errors import HapdError, OptionsError
from hapd.profile.assemble import summary
from hapd.profile.options import HOST_ENV, ProfilerOptions, parse_sizes
from hapd.util import exit_process


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hapd.profiler",
                                description="Measure a cluster profile; run one process per device under torchrun.")
    p.add_argument("--out", "-o", type=Path, default=Path("profile.json"), help="profile JSON rank 0 writes")
    p.add_argument("--name", default="", help="profile name (default measured-HOST)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats, shorter samples")
    p.add_argument("--sizes", type=parse_sizes, default=None, help="full-tensor bytes, e.g. 4K,64K,1M,16M")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per collective and size")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first")
    p.add_argument("--window", type=float, default=None, help="seconds of one device-speed sample")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device-only", action="store_true",
                   help="measure this device only (no process group) and print it as JSON")
    return p


def options_from_args(ns: argparse.Namespace) -> ProfilerOptions:
    """The options the command line gives (``--quick`` starts from the quick ones)."""
    given = {k: v for k, v in (("sizes", ns.sizes), ("repeats", ns.repeats), ("warmup", ns.warmup),
                               ("window_s", ns.window)) if v is not None}
    given.update(dtype=ns.dtype, name=ns.name)
    return ProfilerOptions.quick(**given) if ns.quick else ProfilerOptions(**given)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m hapd.profiler``, run on every rank: measure, then (rank 0) write the
    profile and print its summary. Returns the exit status (2 on a hapd error)."""
    ns = _parser().parse_args(argv)
    from hapd.profiler import measure

    try:
        options = options_from_args(ns)
        if ns.device_only:
            print(json.dumps(asdict(measure.measure_local_device(options))), flush=True)
            return 0
        profile = measure.measure(options)
        if profile is not None:
            ns.out.parent.mkdir(parents=True, exist_ok=True)
            profile.save(ns.out)
            print(summary(profile), flush=True)
            print(f"wrote {ns.out}", flush=True)
        return 0
    except HapdError as exc:
        print(f"hapd profiler: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        measure.close_process_group()


def default_nproc() -> int:
    """Local ranks ``hapd profile`` starts: one per GPU, else 2."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Where the ranks of a profiling job meet: this machine alone (``--standalone``), or
    ``nnodes`` hosts that each start their own ranks (torchrun's static rendezvous)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    """Address of node 0, reachable from every node (needed when ``nnodes > 1``)."""
    master_port: int = 29500

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise OptionsError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.master_addr:
            raise OptionsError(f"--nnodes {self.nnodes} needs --master-addr (node 0's address)")

    def torchrun_args(self) -> list[str]:
        if self.nnodes == 1:
            return ["--standalone"]
        return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}", f"--master-addr={self.master_addr}",
                f"--master-port={self.master_port}"]


def launch_local(nproc: int, args: Sequence[str], *, rendezvous: Rendezvous = Rendezvous(), host: str | None = None,
                 environ: Mapping[str, str] | None = None) -> int:
    """Run ``python -m hapd.profiler ARGS`` on ``nproc`` ranks of this machine through
    torchrun; their output streams to this process's. Returns the exit code.

    Sets, when unset: ``OMP_NUM_THREADS`` (CPU cores / nproc); ``GLOO_SOCKET_IFNAME=lo``
    for a standalone job (its ranks talk over loopback; a multi-node job needs the
    interface that reaches the other nodes, given by the caller); ``HAPD_HOST`` to
    ``host`` when given."""
    if nproc < 1:
        raise OptionsError(f"--nproc-per-node {nproc} must be ≥ 1")
    env = dict(os.environ if environ is None else environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if rendezvous.nnodes == 1 and Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if host:
        env[HOST_ENV] = host
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous.torchrun_args(), f"--nproc-per-node={nproc}",
           "-m", "hapd.profiler", *args]
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except BaseException:  # Ctrl-C or an error here: stop the ranks, then re-raise
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


if __name__ == "__main__":
    exit_process(main())
