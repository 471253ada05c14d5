"""What a rank of an elastic job asks its daemon about its place: the ``switch`` order
that moves it into the next generation, and the environment that order gives it.

Torch-free and below the rooms that use it: :mod:`hapd.elastic.in_place` (a parked rank
waits for its switch), :func:`hapd.spmd.distributed.init` (a joining host's rank,
launched while the others still train, waits for its place before it joins the process
group) and the launcher (which starts such ranks with :data:`JOIN_HELD_ENV`).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Mapping

from hapd.errors import HapdError
from hapd.wire.client import Client
from hapd.wire.keys import default_key_path, load_key

GENERATION_ENV = "HAPD_GENERATION"
"""0 for the first launch, then 1, 2, … after each re-launch or switch."""
JOIN_HELD_ENV = "HAPD_JOIN_HELD"
"""Set ("1") on the ranks of a host joining an elastic job, launched while the other
ranks still train: before joining the process group they say ``join_ready`` and wait
for the ``switch`` that places them (:func:`wait_to_join`)."""
DEFAULT_PARK_S = 60.0
"""How long a parked rank waits for its ``switch`` when ``$HAPD_COLLECTIVE_TIMEOUT`` is unset."""
POLL_S = 0.1
"""How often a parked rank asks its daemon for the switch."""


def switch_env(order: Mapping[str, Any], local_rank: int, nproc: int) -> dict[str, str]:
    """The environment of one local rank (``local_rank`` of ``nproc`` before the switch)
    in the generation a ``switch`` order names: torchrun's variables and the order's
    ``env``. The order's ``kept`` lists the local ranks that go on (the others were
    killed): this one becomes local rank ``kept.index(local_rank)`` of ``len(kept)``."""
    kept = [int(k) for k in order.get("kept") or range(nproc)]
    if local_rank not in kept:
        raise HapdError(f"switch to generation {order.get('generation')}: local rank {local_rank} is not among the "
                        f"ranks that go on ({kept})")
    local_rank, nproc = kept.index(local_rank), len(kept)
    rank = int(order["rank_offset"]) + local_rank
    world = str(order["world_size"])
    return {
        **{str(k): str(v) for k, v in dict(order.get("env") or {}).items()},
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(order["node_rank"]), "GROUP_WORLD_SIZE": str(order["nnodes"]),
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": str(order["master_addr"]), "MASTER_PORT": str(order["master_port"]),
        GENERATION_ENV: str(order["generation"]),
    }


_said = threading.Lock()


def say(event: str, **fields: Any) -> None:
    """Print one elastic event line (the launcher reads it from the rank's output), in one
    write under a lock: the park watcher's thread and the main thread say theirs at the
    same moment, and ``print``'s two writes (the text, then the newline) once ran two
    events into one line that the launcher could not read — the rank's ``parked`` lost,
    and every rank restarted after the launcher's hold."""
    line = json.dumps({"hapd": "elastic", "event": event, **fields}) + "\n"
    with _said:
        sys.stdout.write(line)
        sys.stdout.flush()


def park_seconds() -> float:
    """How long a rank waits for its switch: ``$HAPD_COLLECTIVE_TIMEOUT``, else :data:`DEFAULT_PARK_S`."""
    try:
        return float(os.environ.get("HAPD_COLLECTIVE_TIMEOUT") or DEFAULT_PARK_S)
    except ValueError:
        return DEFAULT_PARK_S


def wait_for_switch(generation: int, deadline: float) -> Mapping[str, Any] | None:
    """Ask this rank's daemon for its job's switch to a generation after ``generation``
    until ``deadline`` (monotonic); None when none came, the job ended, or the daemon
    cannot be asked."""
    address, job = os.environ.get("HAPD_DAEMON"), os.environ.get("HAPD_JOB")
    if not address or not job:
        return None
    try:
        key = load_key(default_key_path())
    except HapdError:
        return None
    with Client(address, key, 2.0) as client:
        while time.monotonic() < deadline:
            try:
                status = client.job_status(job)
            except HapdError:
                return None
            order = status.get("switch")
            if isinstance(order, Mapping) and int(order.get("generation", -1)) > generation:
                return order
            if status.get("state") in ("exited", "failed", "cancelled"):
                return None
            time.sleep(POLL_S)
    return None


def wait_to_join() -> None:
    """A joining host's rank launched ahead of its generation (:data:`JOIN_HELD_ENV`),
    its imports and model built: say ``join_ready`` (the launcher pauses the others once
    every joining rank said it) and wait for the ``switch`` that places it, then take
    its variables. Nothing for any other process. :class:`~hapd.errors.HapdError` when
    no switch comes within the collective timeout (the job went on without this host)."""
    if os.environ.get(JOIN_HELD_ENV) != "1":
        return
    generation = int(os.environ.get(GENERATION_ENV) or 0)
    say("join_ready", rank=int(os.environ.get("RANK") or 0), generation=generation, time=time.time())
    order = wait_for_switch(generation - 1, time.monotonic() + park_seconds())
    if order is None:
        raise HapdError(f"this joining rank waited {park_seconds():g} s for its place in generation {generation}, and "
                        "none came: the job went on without its host")
    del os.environ[JOIN_HELD_ENV]
    os.environ.update(switch_env(order, int(os.environ.get("LOCAL_RANK") or 0),
                                 int(os.environ.get("LOCAL_WORLD_SIZE") or 1)))


__all__ = ["DEFAULT_PARK_S", "GENERATION_ENV", "JOIN_HELD_ENV", "POLL_S", "park_seconds", "say", "switch_env",
           "wait_for_switch", "wait_to_join"]
