"""The connections of this process's process groups, so that a rank leaving a broken
group can close them at once.

Destroying a Gloo process group waits for its pending work: a collective still queued
or running on a peer that went silent (its host cut off, or itself stuck waiting on
another) blocks :func:`torch.distributed.destroy_process_group` (and
``_abort_process_group``, which Gloo treats alike) until that collective's timeout,
holding the interpreter's lock all along. A parked elastic rank once took 25.7 s to
leave so, and the peers waiting on it waited as long.

Shutting the group's TCP connections down first (:func:`shut_down`) ends that wait:
Gloo's pending work fails at once ("connection closed"), the group is then destroyed
in milliseconds, and every peer blocked on this rank sees its connection close and
fails at once too, instead of at the collective timeout.

Which connections are the groups': the sockets that appeared in this process while
hapd created a process group (:func:`tracked` around the rendezvous and
``init_process_group`` in :func:`hapd.spmd.distributed.init_distributed`, and around
each ``new_group`` of :mod:`hapd.spmd`). Nothing else is touched: not the daemons'
connections (a snapshot still on its way to another host), not the script's own.
Listening sockets are left alone (Gloo's listener aborts the process when its socket
is shut down under it). Linux (``/proc/self/fd``); elsewhere nothing is tracked and a
group is destroyed as before.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Iterator

_lock = threading.Lock()
_tracked: set[str] = set()
"""The ``socket:[inode]`` names of the process groups' sockets."""


def _sockets() -> dict[str, int]:
    """This process's sockets: ``socket:[inode]`` → a file descriptor of it; empty where
    ``/proc/self/fd`` is not there."""
    out: dict[str, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor among them)
        if target.startswith("socket:"):
            out.setdefault(target, int(fd))
    return out


@contextlib.contextmanager
def tracked() -> Iterator[None]:
    """Count the sockets this process opens inside the block as a process group's. Other
    threads' sockets opened meanwhile are counted too (a daemon connection of a snapshot
    send): shutting one down early fails that transfer, whose copy on the other daemon
    remains."""
    before = set(_sockets())
    try:
        yield
    finally:
        new = set(_sockets()) - before
        with _lock:
            _tracked.update(new)


def count() -> int:
    """How many of the tracked sockets are still open."""
    with _lock:
        names = set(_tracked)
    return len(names & set(_sockets()))


def shut_down() -> int:
    """Shut down (both directions) every tracked socket that is still open and
    connected, and forget them all; how many were shut down. Closing nothing itself:
    the descriptors stay Gloo's (or the store's), which see their peer gone."""
    with _lock:
        names = set(_tracked)
        _tracked.clear()
    done = 0
    for name, fd in _sockets().items():
        if name not in names:
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue
        with socket.socket(fileno=dup) as sock:  # closes only the duplicate
            try:
                sock.getpeername()  # a listener (or a socket not yet connected) is left alone
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:
                pass
    return done


__all__ = ["count", "shut_down", "tracked"]
