"""What the daemon does about peers before they authenticate: it bounds how many may
be connected at once and how many bytes each may send before one of its messages is
authenticated (:class:`ConnectionGate`), and how many log lines their rejected
messages may write (:class:`RateLimitedLog`).

libzmq itself refuses a frame larger than the ROUTER's ``ZMQ_MAXMSGSIZE`` as soon as
its size is read, before buffering it; but it buffers any number of frames of a message
that never ends, any number of messages, and any number of peers: the gate bounds those. Linux only (``TCP_INFO``),
as the rest of the daemon. No torch import here.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
import threading
import time
from collections import Counter
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

REJECT_LOG_BURST = 20
"""Rejections logged one line each per :data:`REJECT_LOG_INTERVAL_S`; the rest are
counted and summarized in one line at the end of the interval."""
REJECT_LOG_INTERVAL_S = 10.0
"""The interval of :data:`REJECT_LOG_BURST`."""
MAX_LOGGED_CHARS = 500
"""Longest text from a peer (an error naming its input) written into one log line."""
MAX_REPLY_ERROR_CHARS = 2000
"""Longest message of an ``error`` reply."""
GATE_AUDIT_S = 5.0
"""How often the connection gate checks that the connections it counts are still open
(a lost monitor event must not leave a phantom connection counted)."""
PREAUTH_CHECK_S = 0.02
"""How often the gate checks the bytes received on connections not yet authenticated
(a peer on loopback can send some hundreds of MiB between two checks)."""
GATE_JOIN_S = 5.0
"""How long stopping waits for the gate's thread."""
TCP_INFO_BYTES = 256
"""Bytes of Linux's ``struct tcp_info`` asked for."""
_TCPI_BYTES_RECEIVED = 128
"""Offset of ``tcpi_bytes_received`` (u64, Linux 4.1+) in ``struct tcp_info``."""
_SRCFD = getattr(zmq, "SRCFD", 2)
"""``zmq_msg_get`` property: the descriptor of the connection a frame came on."""
_MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


def shorten(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters with a note of its full length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} characters)"


class RateLimitedLog:
    """Log lines of one kind, at most ``burst`` per ``interval_s``; the rest are counted
    by ``kind`` and summarized in one line when the interval ends (:meth:`flush`, which
    the caller also calls when idle). Thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        what: str,
        *,
        burst: int = REJECT_LOG_BURST,
        interval_s: float = REJECT_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.what = what
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._start = clock()
        self._lines = 0
        self._held: Counter[str] = Counter()

    def warning(self, kind: str, text: str) -> None:
        """Log ``text`` (one line, shortened), or count it under ``kind`` when this
        interval's lines are spent."""
        self.flush()
        with self._lock:
            logged = self._lines < self.burst
            if logged:
                self._lines += 1
            else:
                self._held[shorten(kind, MAX_LOGGED_CHARS // 4)] += 1
        if logged:
            self.logger.warning("%s", shorten(text, MAX_LOGGED_CHARS))

    def flush(self) -> None:
        """At the end of an interval: one line for what was not logged, then a new interval."""
        now = self.clock()
        with self._lock:
            if now - self._start < self.interval_s:
                return
            held, elapsed = self._held, now - self._start
            self._start, self._lines, self._held = now, 0, Counter()
        if held:
            kinds = ", ".join(f"{kind} ×{n}" for kind, n in held.most_common(5))
            more = "" if len(held) <= 5 else f", {len(held) - 5} other kinds"
            self.logger.warning("%s: %d more in the last %.0f s, not logged one by one (%s%s)",
                                self.what, sum(held.values()), elapsed, kinds, more)


def _local_key(endpoint: str) -> object:
    """What ``getsockname()`` of a connection accepted on ``endpoint`` identifies it
    by: the port for TCP, the path for IPC."""
    transport, _, rest = endpoint.partition("://")
    if transport == "tcp":
        return int(rest.rsplit(":", 1)[1])
    return rest


def _sockname_key(name: object) -> object:
    if isinstance(name, tuple):
        return name[1]
    return os.fsdecode(name) if isinstance(name, bytes) else name


def source_fd(frame: zmq.Frame) -> int | None:
    """The file descriptor of the connection a received frame came on (``ZMQ_SRCFD``)."""
    try:
        fd = frame.get(_SRCFD)
    except (zmq.ZMQError, TypeError, ValueError):
        return None
    return fd if isinstance(fd, int) and fd >= 0 else None


class ConnectionGate:
    """What a peer may cost before it authenticates.

    A socket monitor reports each connection libzmq accepts (with its file descriptor)
    and each it closes; the gate admits connections in the order they were accepted,
    at most ``max_connections`` at once, and shuts any other down (``shutdown(2)`` on its
    descriptor, after checking it is still a connection of this listener, so that
    libzmq closes it). Its thread also shuts down an admitted connection that has
    received more than ``preauth_bytes`` (the kernel's count, ``TCP_INFO``) before the
    daemon authenticated a message from it (:meth:`trust`): libzmq buffers any number of
    frames of an unfinished message, each up to ``ZMQ_MAXMSGSIZE``, so this is what
    bounds one peer. The daemon drops a message whose connection the gate has not
    admitted (:meth:`admits`). Refusals are logged through ``refusals``. The monitor's
    receiving end queues without bound, so libzmq's I/O thread never waits on it; every
    :data:`GATE_AUDIT_S` the connections counted are checked to still be open."""

    def __init__(self, ctx: zmq.Context, router: zmq.Socket, endpoint: str, *, max_connections: int,
                 preauth_bytes: int, refusals: RateLimitedLog) -> None:
        self.router = router
        self.max_connections = max_connections
        self.preauth_bytes = preauth_bytes
        self.refusals = refusals
        self.refused_total = 0
        self._local = _local_key(endpoint)
        self._tcp = endpoint.startswith("tcp://")
        self._lock = threading.Lock()  # the sets below
        self._admitted: set[int] = set()
        self._refused: set[int] = set()
        self._trusted: dict[int, str] = {}  # fd → peer of a connection that sent an authenticated message
        self._monitor_lock = threading.Lock()  # the monitor socket: the gate's thread, or the daemon's in admits()
        self._stop = threading.Event()
        address = f"inproc://hapd-monitor-{os.getpid()}-{id(self):x}"
        router.monitor(address, _MONITOR_EVENTS)
        self._monitor = ctx.socket(zmq.PAIR)
        self._monitor.setsockopt(zmq.RCVHWM, 0)  # 0: unbounded, so the monitor never blocks libzmq's I/O thread
        self._monitor.setsockopt(zmq.LINGER, 0)
        self._monitor.connect(address)
        self._thread = threading.Thread(target=self._run, name="hapd-gate", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop the gate's thread and the monitor (before the router closes)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(GATE_JOIN_S)
        try:
            self.router.disable_monitor()
        except zmq.ZMQError:
            pass
        with self._monitor_lock:
            self._monitor.close(linger=0)

    @property
    def admitted(self) -> int:
        """Connections admitted and open."""
        with self._lock:
            return len(self._admitted)

    def admits(self, fd: int | None) -> bool:
        """Whether the connection on ``fd`` may be served: not refused (its acceptance,
        which libzmq reports before any message of it, is read from the monitor first
        when the gate has not seen it yet)."""
        if fd is None:
            return True
        with self._lock:
            if fd in self._admitted:
                return True
        self._read_events()
        with self._lock:
            return fd not in self._refused

    def trust(self, fd: int | None) -> None:
        """A message from the connection on ``fd`` was authenticated: no byte budget for
        it. Recorded with the connection's peer address, so that the same descriptor
        reused by a later connection is not trusted."""
        if fd is None:
            return
        # the peer is read every time: an entry left by a closed connection whose close
        # event the gate has not read yet may hold this descriptor under another peer
        peer = _peer_of(fd, self._local)
        if peer is not None:
            with self._lock:
                self._trusted[fd] = peer

    # -- the gate's thread

    def _run(self) -> None:
        next_audit = time.monotonic() + GATE_AUDIT_S
        while not self._stop.is_set():
            with self._monitor_lock:
                ready = not self._monitor.closed and self._monitor.poll(0)
            if ready:
                self._read_events()
            if self._tcp:
                self._check_budgets()
            if time.monotonic() >= next_audit:
                self._audit()
                next_audit = time.monotonic() + GATE_AUDIT_S
            self._stop.wait(PREAUTH_CHECK_S)

    def _read_events(self) -> None:
        """Admit or refuse each connection accepted, in order; forget those closed."""
        with self._monitor_lock:
            while not self._monitor.closed:
                try:
                    event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                fd = int(event["value"])
                if event["event"] == zmq.EVENT_ACCEPTED:
                    with self._lock:
                        room = len(self._admitted) < self.max_connections
                        (self._admitted if room else self._refused).add(fd)
                    if not room:
                        self._refuse(fd, f"{self.max_connections} connections are open, the most this daemon accepts")
                elif event["event"] == zmq.EVENT_DISCONNECTED:
                    self._forget(fd)

    def _check_budgets(self) -> None:
        with self._lock:
            checked = {fd: self._trusted.get(fd) for fd in self._admitted}
        for fd, trusted_peer in checked.items():
            found = _bytes_received(fd, self._local)
            if found is None or found[0] == trusted_peer or found[1] <= self.preauth_bytes:
                continue
            with self._lock:
                # the daemon may have authenticated a message of it since the snapshot
                # (its requests in parts arrive meanwhile): decided and shut down under
                # the lock that trust() takes, so a trusted connection is never cut
                if self._trusted.get(fd) == found[0] or fd not in self._admitted:
                    continue
                self._admitted.discard(fd)
                self._refused.add(fd)
                peer = _shut_down(fd, self._local)
            self._refused_one(fd, peer, f"{found[1]} bytes received before any authenticated message "
                                        f"(at most {self.preauth_bytes})")

    def _refuse(self, fd: int, why: str) -> None:
        """Shut the connection on ``fd`` down (it is already counted as refused)."""
        self._refused_one(fd, _shut_down(fd, self._local), why)

    def _refused_one(self, fd: int, peer: str | None, why: str) -> None:
        """Count and log a connection shut down (``peer`` None: it was no longer a
        connection of ours, closed meanwhile)."""
        if peer is None:
            self._forget(fd)
            return
        with self._lock:
            self.refused_total += 1
        self.refusals.warning("refused a connection", f"refused a connection from {peer}: {why}")

    def _forget(self, fd: int) -> None:
        """A connection on ``fd`` closed. Its trust goes with it, unless the trust is the
        live connection's: the close event of a connection may be read after a newer
        connection reused its descriptor and authenticated (the peer tells them apart)."""
        with self._lock:
            trusted = self._trusted.get(fd)
        keep = trusted is not None and _peer_of(fd, self._local) == trusted
        with self._lock:
            self._admitted.discard(fd)
            self._refused.discard(fd)
            if not keep or self._trusted.get(fd) != trusted:
                self._trusted.pop(fd, None)

    def _audit(self) -> None:
        with self._lock:
            counted = self._admitted | self._refused
        for fd in counted:
            if _gone(fd, self._local):
                self._forget(fd)


_GONE_ERRNOS = (errno.EBADF, errno.ENOTSOCK, errno.ENOTCONN)
"""What says a descriptor no longer holds the connection it held."""


def _with_socket(fd: int, local: object, action: Callable[[socket.socket], object] | None) -> tuple[str, object] | None:
    """``(peer, what action returned)`` when ``fd`` is a connected socket accepted on
    ``local`` (``action`` runs on a duplicate of it), else None."""
    try:
        return _probe(fd, local, action)
    except OSError:
        return None


def _probe(fd: int, local: object, action: Callable[[socket.socket], object] | None) -> tuple[str, object] | None:
    """As :func:`_with_socket`; an OSError when the descriptor cannot be checked."""
    dup = os.dup(fd)
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        raise
    try:
        if _sockname_key(sock.getsockname()) != local:
            return None
        peer = sock.getpeername()
        result = action(sock) if action is not None else None
        return (f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "a local process"), result
    finally:
        sock.close()


def _gone(fd: int, local: object) -> bool:
    """Whether ``fd`` certainly no longer holds a connection accepted on ``local`` (not
    when it merely cannot be checked now, as when no descriptor is free)."""
    try:
        return _probe(fd, local, None) is None
    except OSError as exc:
        return exc.errno in _GONE_ERRNOS


def _peer_of(fd: int, local: object) -> str | None:
    found = _with_socket(fd, local, None)
    return None if found is None else found[0]


def _shut_down(fd: int, local: object) -> str | None:
    found = _with_socket(fd, local, lambda sock: sock.shutdown(socket.SHUT_RDWR))
    return None if found is None else found[0]


def _bytes_received(fd: int, local: object) -> tuple[str, int] | None:
    """The peer of the TCP connection ``fd`` and the bytes the kernel has received on it
    (``tcpi_bytes_received``); None when it is not a connection of ours or the kernel
    does not count."""

    def received(sock: socket.socket) -> int | None:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_BYTES)
        if len(info) < _TCPI_BYTES_RECEIVED + 8:
            return None  # a kernel older than 4.1
        return struct.unpack_from("=Q", info, _TCPI_BYTES_RECEIVED)[0]

    found = _with_socket(fd, local, received)
    return None if found is None or found[1] is None else (found[0], found[1])


__all__ = ["ConnectionGate", "RateLimitedLog", "shorten", "source_fd", "MAX_LOGGED_CHARS", "MAX_REPLY_ERROR_CHARS"]
