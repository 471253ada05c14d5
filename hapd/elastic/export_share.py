"""A running elastic job's exported program, shared with the hosts that join it.

A joining host's rank (launched ahead, :data:`hapd.wire.switch.JOIN_HELD_ENV`) exports
the model before it can join: ``torch.export`` and making the program functional are
most of its time (~2.5 s of CPU for the elastic bench's GPT-2, ~15 s on a sixth of a
core), while every rank of the running job holds that very program already (the
in-place runner carries it, :class:`hapd.train.programs.ExportCarry`). So rank 0 of an
elastic run **publishes** it once — the functional form without weights (meta tensors,
~0.4 MB for that GPT-2 whatever its size; :func:`hapd.ir.export.save_shared`) — in its
daemon's in-memory store (the snapshot store, under an entry of its own:
:func:`entry`), and a joining rank whose model has the same export key **fetches** it
from the daemons of the job's hosts (``$HAPD_ELASTIC_DAEMONS``), loads it and rebinds
it to its own model's tensors (:func:`hapd.train.programs.from_shared`): the program
its own export would give, normalized to the same names. Without one (none published
yet, the publishing host gone, the store's time-to-live passed) it exports as before.

This module moves bytes only; the train room makes and reads them. The daemons drop a
run's entries untouched for their time-to-live (15 min by default): rank 0 puts its
copy again every :data:`REFRESH_S` (:func:`refresh`, from :meth:`hapd.Elastic.step_done`).

A process that becomes rank 0 after a switch (the old rank 0 killed) first asks the
job's daemons whether one holds the program already (the old rank 0's copy outlives it
on its host's daemon) and makes nothing then: making it costs seconds of CPU on a slow
rank, beside the generation's first steps. It makes and puts it when the copy is gone
(the host lost, or at a refresh, the time-to-live passed).
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from hapd.elastic.in_place import RUN_ENV, runs_in_place
from hapd.errors import HapdError
from hapd.wire.client import Client
from hapd.wire.keys import default_key_path, load_key

_log = logging.getLogger(__name__)

DAEMONS_ENV = "HAPD_ELASTIC_DAEMONS"
"""Comma-separated addresses of the daemons of the job's hosts (this generation)."""
PROGRAM_FILE = "program.pt2"
DIGEST_FILE = "digest"
REFRESH_S = 300.0
"""How often rank 0 puts its published program again (the daemons' default time-to-live
of an untouched run is 900 s)."""
TIMEOUT_S = 5.0
ENTRIES = 4096
"""Entries a run's store holds (its "world"); two models of one script that fall on one
entry find the other's digest there, and the second exports as before."""
"""How long one daemon may take to answer a put, a list or a get."""


def entry(run: str, digest: str) -> tuple[str, int]:
    """The store entry (run, rank) of ``run``'s program of export key ``digest``: a run
    id of its own (the store keeps a run's newest steps; its snapshots must not push the
    program out), and a number from the digest (one entry per model of the script)."""
    return "export-" + hashlib.sha256(run.encode()).hexdigest()[:16], int(digest[:3], 16) % ENTRIES


@dataclass
class _Published:
    run: str
    digest: str
    data: bytes
    address: str
    at: float


@dataclass
class _Found:
    """A program another process published and a daemon of the job holds: made and put by
    this process only once it is gone (:func:`refresh`)."""

    make: Callable[[], bytes | None]
    address: str
    at: float


_published: dict[tuple[str, str], _Published] = {}
_found: dict[tuple[str, str], _Found] = {}
_claimed: set[tuple[str, str]] = set()
"""(run, digest) this process publishes, or tried to (a static export has nothing to share): not again."""
_lock = threading.Lock()


def _put(p: _Published) -> None:
    store, number = entry(p.run, p.digest)
    try:
        with Client(p.address, load_key(default_key_path()), TIMEOUT_S) as client:
            client.snapshot_put(store, 0, number, ENTRIES, {PROGRAM_FILE: p.data, DIGEST_FILE: p.digest.encode()})
        _log.info("shared the exported program (%d bytes) with hosts that join, on %s", len(p.data), p.address)
    except HapdError as exc:
        _log.warning("could not share the exported program on %s (%s): a joining host exports it itself",
                     p.address, exc)


def publish(digest: str, make: Callable[[], bytes | None]) -> bool:
    """On an elastic run's rank (under the in-place runner), make the program of export
    key ``digest`` (``make``: its bytes; None: there is nothing to share) and put it in
    this host's daemon, both on a thread once the generation's first step ended (the
    switch and that step do not share the CPU with them); once per run and key in this
    process. Whether it is being published."""
    run, address = os.environ.get(RUN_ENV), os.environ.get("HAPD_DAEMON")
    if not run or not address or not runs_in_place():
        return False
    with _lock:
        if (run, digest) in _published or (run, digest) in _claimed:
            return False
        _claimed.add((run, digest))

    seen = _steps_done()

    def made_and_put() -> None:
        _wait_for_a_step(seen)
        held = fetch(digest, listed_only=True)
        if held is not None:  # published by a former rank 0: nothing to make unless it goes
            with _lock:
                _found[(run, digest)] = _Found(make, address, time.monotonic())
            _log.info("the exported program is shared already, on %s", held[1])
            return
        _make_and_put(run, digest, make, address)

    threading.Thread(target=made_and_put, daemon=True, name="hapd-export-share").start()
    return True


def _make_and_put(run: str, digest: str, make: Callable[[], bytes | None], address: str) -> None:
    """Make the program (on this thread) and put it in this host's daemon."""
    try:
        data = make()
    except Exception as exc:  # noqa: BLE001 - a program that cannot be saved is exported by the joining host
        _log.warning("cannot share the exported program (%s: %s): a joining host exports it itself",
                     type(exc).__name__, exc)
        return
    if not data:
        return
    p = _Published(run, digest, data, address, time.monotonic())
    with _lock:
        _published[(run, digest)] = p
    _put(p)


_stepped = threading.Condition()
_steps = 0
"""How many times :func:`refresh` ran (each step a rank of an elastic job finishes)."""
WAIT_FOR_STEP_S = 60.0
"""The longest a publication waits for the next step before it goes ahead."""


def _steps_done() -> int:
    with _stepped:
        return _steps


def _wait_for_a_step(seen: int) -> None:
    """Until a step ended after ``seen`` (at most :data:`WAIT_FOR_STEP_S`): making the
    program takes seconds of a slow rank's CPU, which would otherwise fall in the switch
    and the generation's first step."""
    with _stepped:
        _stepped.wait_for(lambda: _steps > seen, timeout=WAIT_FOR_STEP_S)


def refresh(now: float | None = None) -> int:
    """After each step: let a publication waiting for a step go on; put again, in the
    background, what this process published more than :data:`REFRESH_S` ago, and make
    and put what it found published by another process when no daemon holds that any
    more; how many of the latter two."""
    global _steps
    with _stepped:
        _steps += 1
        _stepped.notify_all()
    now = time.monotonic() if now is None else now
    with _lock:
        due = [p for p in _published.values() if now - p.at >= REFRESH_S]
        for p in due:
            p.at = now
        found = [(key, f) for key, f in _found.items() if now - f.at >= REFRESH_S]
        for _key, f in found:
            f.at = now
    for p in due:
        threading.Thread(target=_put, args=(p,), daemon=True, name="hapd-export-share").start()
    for (run, digest), f in found:
        def again(run: str = run, digest: str = digest, f: _Found = f) -> None:
            if fetch(digest, listed_only=True) is None:
                with _lock:
                    _found.pop((run, digest), None)
                _make_and_put(run, digest, f.make, f.address)

        threading.Thread(target=again, daemon=True, name="hapd-export-share").start()
    return len(due) + len(found)


def fetch(digest: str, *, listed_only: bool = False) -> tuple[bytes, str] | None:
    """The program of export key ``digest`` that a rank of this elastic run published,
    and the daemon it came from; None when no daemon of the job's hosts holds it.
    ``listed_only``: whether one holds it (its entry listed, nothing fetched: the bytes
    are empty), without the transfer."""
    run = os.environ.get(RUN_ENV)
    daemons = [a for a in (os.environ.get(DAEMONS_ENV) or "").split(",") if a]
    if not run or not daemons:
        return None
    store, number = entry(run, digest)
    key = load_key(default_key_path())
    for address in daemons:
        try:
            with Client(address, key, TIMEOUT_S) as client:
                if not any(e["rank"] == number for e in client.snapshot_list(store)):
                    continue
                if listed_only:
                    return b"", address
                files = client.snapshot_get(store, 0, number, timeout_s=TIMEOUT_S)
        except HapdError as exc:
            _log.info("no shared program from %s (%s)", address, exc)
            continue
        if files.get(DIGEST_FILE) == digest.encode() and files.get(PROGRAM_FILE):
            return files[PROGRAM_FILE], address
    return None


__all__ = ["DAEMONS_ENV", "entry", "fetch", "publish", "refresh"]
