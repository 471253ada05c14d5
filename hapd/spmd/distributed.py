"""Joining the job: the process group and this rank's device.

:func:`init_distributed` joins the job ``torchrun`` (or the launcher's daemons) started,
reading torchrun's environment, or runs alone in a 1-rank group; it returns this
process's place in the job as a :class:`DistEnv`. :func:`hapd.parallelize` calls it when
it runs under torchrun and no process group exists yet; the benchmark harness
(:mod:`hapd.harness.training`) and the profiler start every rank with it.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from hapd.errors import CollectiveError, HapdError
from hapd.spmd import collectives, group_sockets
from hapd.spmd.stepwatch import collective_timeout_s, seconds_from_env
from hapd.wire.contract import REPLICA_ENV, RUN_ENV


JOIN_TIMEOUT_ENV = "HAPD_JOIN_TIMEOUT"
"""Seconds every rank of a job has to reach :func:`init_distributed` (the rendezvous),
apart from the collective timeout: ranks started on slow or busy hosts (an elastic
restart on a host at a sixth of a core) may take far longer to import and build their
model than a collective may wait."""
DEFAULT_JOIN_TIMEOUT_S = 180.0
"""The join timeout when ``HAPD_JOIN_TIMEOUT`` is unset (or the collective timeout, when longer)."""
JOINED_KEY = "hapd/joined"
"""Rendezvous store key counting the ranks that arrived."""


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job."""

    rank: int
    """Global rank."""
    world: int
    """Number of ranks."""
    local_rank: int
    """Rank within this host (selects the GPU)."""
    backend: str
    """``"nccl"`` (GPU) or ``"gloo"`` (CPU)."""
    device: torch.device
    """Where this rank computes: ``cuda:LOCAL_RANK`` or ``cpu``."""

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        """Wait for this rank's queued GPU work (no-op on CPU)."""
        if self.is_cuda:
            torch.cuda.synchronize(self.device)


def env_int(environ: dict[str, str] | os._Environ, name: str) -> int | None:
    """The integer value of environment variable ``name`` in ``environ``; None when it is
    unset or empty, :class:`~hapd.errors.HapdError` naming it when it is not an integer."""
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise HapdError(f"environment variable {name}={raw!r} is not an integer", field=name) from None


def job_host_groups(world: int, group: Any = None) -> collectives.HostGroups | None:
    """This rank's :class:`~hapd.spmd.collectives.HostGroups` (two-level gradient sums
    across hosts) from every rank's ``GROUP_RANK`` (torchrun's node index; 0 when unset),
    or None with one rank, in a sub-group ``group``, on one host or with one rank per
    host. Collective: call on every rank of the job."""
    if world == 1 or group is not None:
        return None
    nodes: list[Any] = [None] * world
    dist.all_gather_object(nodes, env_int(os.environ, "GROUP_RANK") or 0)
    return collectives.host_groups([int(n) for n in nodes])


def joining_device() -> torch.device | None:
    """Where :func:`init_distributed` places this process when it joins the job torchrun
    started: ``cuda:LOCAL_RANK`` when CUDA is available (NCCL), else None (Gloo: the CPU,
    where the model is). What a rank that prepares its program before it joins places
    it on, as it would after."""
    if not torch.cuda.is_available():
        return None
    _rank, _world, local = _read_env(os.environ)
    return torch.device("cuda", local)


def _read_env(environ: dict[str, str] | os._Environ) -> tuple[int, int, int]:
    """``(rank, world, local_rank)`` from torchrun's variables; (0, 1, 0) when unset."""
    rank, world = env_int(environ, "RANK"), env_int(environ, "WORLD_SIZE")
    if rank is None and world is None:
        local = env_int(environ, "LOCAL_RANK")
        return 0, 1, 0 if local is None else local
    if rank is None or world is None:
        missing = "RANK" if rank is None else "WORLD_SIZE"
        raise HapdError(f"{missing} is not set but {'WORLD_SIZE' if rank is None else 'RANK'} is: "
                        "set both (torchrun does) or neither (a single process)", field=missing)
    if world < 1:
        raise HapdError(f"WORLD_SIZE={world} must be at least 1", field="WORLD_SIZE")
    if not 0 <= rank < world:
        raise HapdError(f"RANK={rank} is not in [0, WORLD_SIZE={world})", field="RANK")
    local = env_int(environ, "LOCAL_RANK")
    local = rank if local is None else local
    if not 0 <= local <= rank:
        raise HapdError(f"LOCAL_RANK={local} is not in [0, RANK={rank}]", field="LOCAL_RANK")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not environ.get(name):
            raise HapdError(f"{name} is not set (RANK and WORLD_SIZE are): launch with torchrun", field=name)
    env_int(environ, "MASTER_PORT")
    return rank, world, local


def init_distributed(*, timeout_s: float | None = None) -> DistEnv:
    """Join the job torchrun started (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``), or with neither ``RANK`` nor ``WORLD_SIZE`` set
    run alone in a 1-rank group on a free loopback port, so collectives still work.

    NCCL on ``cuda:LOCAL_RANK`` (made the current device) when CUDA is available, else
    Gloo on the CPU. When a default process group already exists it is joined as is.
    Every collective of the group fails after ``timeout_s`` of waiting (default
    ``HAPD_COLLECTIVE_TIMEOUT`` seconds, else 300 s) instead of hanging: a rank missing
    from one makes the job fail (:mod:`hapd.spmd.stepwatch` names it). Joining waits
    longer for the job's last rank to arrive (``HAPD_JOIN_TIMEOUT``, 180 s, or the
    collective timeout when longer): a rank starting on a slow host is late, not lost.
    Raises :class:`~hapd.errors.HapdError` when the environment is inconsistent.
    """
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = env_int(os.environ, "LOCAL_RANK")
        local = rank if local is None else local
        return _make_env(rank, world, local, dist.get_backend(), cuda)
    from hapd.wire.switch import wait_to_join

    wait_to_join()  # a joining host's rank launched ahead of its generation: its place comes now
    rank, world, local = _read_env(os.environ)
    env = _make_env(rank, world, local, backend, cuda)
    timeout = timedelta(seconds=collective_timeout_s() if timeout_s is None else timeout_s)
    extra: dict[str, Any] = {"device_id": env.device} if env.is_cuda else {}
    if env_int(os.environ, "RANK") is not None:
        with group_sockets.tracked():  # the store's and Gloo's connections, closed at once by leave_group
            store = dist.PrefixStore("default_pg", _join(rank, world, timeout))  # as init_method="env://" does
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout, **extra)
            _make_side_group(world)
    else:
        # port 0: the store binds a free port itself, so there is no race for it
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout, **extra)
    _destroy_at_exit()
    return env


def join_timeout_s(environ: dict[str, str] | os._Environ | None = None) -> float:
    """``HAPD_JOIN_TIMEOUT`` (seconds, > 0), else :data:`DEFAULT_JOIN_TIMEOUT_S`."""
    return seconds_from_env(JOIN_TIMEOUT_ENV, DEFAULT_JOIN_TIMEOUT_S, environ)


def _join(rank: int, world: int, timeout: timedelta) -> dist.TCPStore:
    """The job's rendezvous store on ``MASTER_ADDR:MASTER_PORT`` once every rank has
    reached it, waiting up to the join timeout (the longer of ``HAPD_JOIN_TIMEOUT`` and
    the collective timeout) for the last; then its operations time out as collectives
    do. Gloo's connection of every pair waits only the collective timeout, so the ranks
    meet here first. Raises :class:`~hapd.errors.CollectiveError` naming how many came."""
    wait = max(timeout.total_seconds(), join_timeout_s())
    start = time.monotonic()
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                              timeout=timedelta(seconds=wait))
        store.add(JOINED_KEY, 1)
        while (arrived := int(store.add(JOINED_KEY, 0))) < world:
            if time.monotonic() - start > wait:
                raise CollectiveError(f"rank {rank}: only {arrived} of {world} ranks joined the job within {wait:g} s "
                                      f"({JOIN_TIMEOUT_ENV})")
            time.sleep(0.02)
    except RuntimeError as exc:  # the store's own timeout or a refused connection (DistError)
        raise CollectiveError(f"rank {rank}: joining the job at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
                              f"failed after {time.monotonic() - start:.1f} s (join timeout {wait:g} s, "
                              f"{JOIN_TIMEOUT_ENV}): {exc}") from exc
    store.set_timeout(timeout)
    return store


_side: Any = None
"""The side group of this process's job (:func:`side_group`); None: none made."""


def _make_side_group(world: int) -> None:
    """An elastic run's side group, made right after the job's group (in the rendezvous)."""
    global _side
    _side = None
    if world > 1 and os.environ.get(RUN_ENV) and os.environ.get(REPLICA_ENV, "1") != "0":
        _side = dist.new_group(backend="gloo")


def side_group() -> Any:
    """A Gloo group of every rank of the job, made with its group at the rendezvous of an
    elastic run (:mod:`hapd.elastic.replica` sends on it from a thread, point to point,
    apart from the training's collectives); None outside one, or when the script made
    the process group itself. Made there because making a group is collective over the
    job's store: a rank lost while the others make one later leaves them waiting on the
    store, not on a connection that closes at once."""
    return _side if dist.is_available() and dist.is_initialized() else None


_exit_lock = threading.Lock()
_exit_registered = False


def _destroy_at_exit() -> None:
    """Destroy the process group this module created when the interpreter exits, while
    it is still whole. A process that ends with its Gloo group alive can abort during
    finalization (SIGABRT, "terminate called without an active exception": Gloo's
    worker threads release their last work's tensors after the interpreter is gone,
    pytorch#190489) — a finished training run would end with status 134, which a launcher
    reports as a failure and an elastic job as a fault. Registered once; a script that
    destroyed the group itself makes it a no-op. atexit runs handlers in reverse order,
    so one registered later (hapd's telemetry, a script's own) still sees the group."""
    global _exit_registered
    with _exit_lock:
        if not _exit_registered:
            atexit.register(_destroy_group)
            _exit_registered = True


def _destroy_group() -> None:
    global _side
    _side = None
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):  # at exit: nothing left to tell
            dist.destroy_process_group()


def leave_group() -> float:
    """Leave the process group (every group of this process) after a peer went away,
    without waiting on it; the seconds it took. Its connections are shut down first
    (:mod:`hapd.spmd.group_sockets`): work still pending on a silent peer fails at once
    instead of holding the destruction until the collective timeout (Gloo's destructor
    waits for it), and the peers still waiting in a collective with this rank fail at
    once too. Then the groups are aborted (NCCL: ``ncclCommAbort``) or destroyed.
    Errors of the broken group are swallowed; nothing is left to tell it."""
    start = time.perf_counter()
    group_sockets.shut_down()
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            if dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
                dist.distributed_c10d._abort_process_group()
        _destroy_group()
    return time.perf_counter() - start


def _make_env(rank: int, world: int, local: int, backend: str, cuda: bool) -> DistEnv:
    if cuda:
        count = torch.cuda.device_count()
        if local >= count:
            raise HapdError(f"LOCAL_RANK={local} but this host has {count} CUDA device(s)", field="LOCAL_RANK")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    return DistEnv(rank=rank, world=world, local_rank=local, backend=backend, device=device)


__all__ = ["DistEnv", "env_int", "init_distributed", "join_timeout_s", "joining_device", "leave_group", "side_group"]
