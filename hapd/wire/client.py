"""Client of the hapd daemon's control API (used by worker.py, the launcher and tests).

    from hapd.wire.client import Client
    with Client() as daemon:                   # $HAPD_DAEMON or tcp://127.0.0.1:5557
        print(daemon.ping()["profile_name"])
        plan_bytes, path = daemon.compile(open("bert.hapg", "rb").read(), "hapg")

A DEALER socket (a lost reply never wedges it, as it would a REQ socket); every
request is signed with the shared key file and every reply is checked (signature, time
window, and that it answers this request). A request that gets no reply in time raises
:class:`DaemonTimeout` naming the address; an ``error`` reply raises
:class:`~hapd.errors.RemoteError` with the daemon's message. One ``Client`` is for one
thread at a time (a lock serializes its requests). No torch import here.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import zmq

from hapd.errors import DaemonDown, DaemonTimeout, ProtocolError, RemoteError, SnapshotError
from hapd.wire.keys import default_key_path, load_key
from hapd.wire.protocol import DEFAULT_ADDRESS, PART_BYTES, PART_SLACK_BYTES, Limits, Message, Session

SNAPSHOT_CHUNK_BYTES = PART_BYTES - PART_SLACK_BYTES
"""Bytes of a snapshot file per ``snapshot_put`` by default: each put is then one message,
never sent in parts (parts take as many exchanges, and a daemon receives only a few
requests in parts at once, while every rank of two hosts may be sending)."""
SNAPSHOT_READ_BYTES = 8 * 2**20
"""Bytes of a snapshot file per ``snapshot_get`` (the daemon answers at most 16 MiB)."""


def default_address() -> str:
    """``$HAPD_DAEMON``, else the loopback default ``tcp://127.0.0.1:5557``."""
    return os.environ.get("HAPD_DAEMON") or DEFAULT_ADDRESS


PROBE_TIMEOUT_S = 0.25
"""How long a request that went unanswered waits for a connection to its daemon's port
to be refused (:class:`~hapd.errors.DaemonDown`) before taking it as slow or unreachable
(a refusal comes back within a round trip)."""


def refuses_connections(address: str, timeout_s: float = 1.0) -> bool:
    """Whether a TCP connection to ``tcp://HOST:PORT`` is refused now (no process
    listens there: a daemon that died, its host up); False for other transports and for
    any other outcome, a connection that takes longer than ``timeout_s`` among them
    (a host unreachable, or slow)."""
    if not address.startswith("tcp://"):
        return False
    host, _, port = address[len("tcp://"):].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


__all__ = ["Client", "DaemonTimeout", "default_address", "default_key_path", "refuses_connections",
           "SNAPSHOT_CHUNK_BYTES"]


class Client:
    """A connection to one daemon."""

    def __init__(
        self,
        address: str | None = None,
        key: bytes | str | Path | None = None,
        timeout_s: float = 5.0,
        *,
        max_reply_bytes: int = 1 << 30,
    ) -> None:
        """``key``: the key bytes, or a key file path (default ``default_key_path()``)."""
        self.address = address or default_address()
        key_bytes = key if isinstance(key, bytes) else load_key(key if key is not None else default_key_path())
        self.timeout_s = timeout_s
        self.session = Session(key_bytes, limits=Limits(max_body_bytes=max_reply_bytes))
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._lock = threading.Lock()
        self._answered = False
        """Whether the daemon answered a request of this client: then silence is a
        daemon gone or hung, not a wrong key."""

    # -- connection

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a daemon that is not there
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        """Drop the socket (a late reply to a timed-out request must not linger)."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        with self._lock:
            self._reset()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- one request

    def request(self, mtype: str, body: Mapping[str, Any] | None = None, *, timeout_s: float | None = None,
                probe_s: float | None = None) -> Message:
        """Send a request and return its (checked) reply; raises :class:`RemoteError`
        for an ``error`` reply and :class:`DaemonTimeout` when none comes. A request
        whose body is longer than :data:`~hapd.wire.protocol.PART_BYTES` goes in
        ``part`` messages, each answered before the next is sent; ``timeout_s`` bounds
        each exchange. With ``probe_s``, a daemon that answered this client before and
        has not answered for ``probe_s`` has its port probed every ``probe_s`` while the
        request waits: refused (nothing listens there) raises :class:`DaemonDown` at
        once, without waiting out ``timeout_s`` (a slow daemon's answer is still taken)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        messages = self.session.encode_request(mtype, body)
        with self._lock:
            for message, frames in messages[:-1]:
                self._raise_error(self._exchange(message, frames, mtype, timeout, probe_s))
            reply = self._exchange(*messages[-1], mtype, timeout, probe_s)
        self._raise_error(reply)
        return reply

    def _raise_error(self, reply: Message) -> None:
        if reply.type == "error":
            raise RemoteError(f"{self.address}: {reply.body['kind']}: {reply.body['message']}", field=reply.body["kind"])

    def _exchange(self, message: Message, frames: Sequence[bytes], mtype: str, timeout: float,
                  probe_s: float | None = None) -> Message:
        """Send one message and wait for the reply to it (the lock held)."""
        sock = self._socket()
        deadline = time.monotonic() + timeout
        probe = probe_s if probe_s and self._answered else None
        if not self._send(sock, frames, deadline, None if probe is None else lambda: self._down(timeout, mtype)):
            self._reset()
            raise self._gone(timeout, mtype) if self._answered else self._timeout(timeout, "could not connect")
        rejected = ""
        while True:
            left = deadline - time.monotonic()
            if probe is not None and left > probe and not sock.poll(int(probe * 1000) + 1, zmq.POLLIN):
                self._down(timeout, mtype)
                continue
            if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                self._reset()
                if self._answered:
                    raise self._gone(timeout, mtype)
                raise DaemonTimeout(
                    f"the daemon at {self.address} took the connection but did not answer the {mtype} within "
                    f"{timeout:g} s: most likely it refused the message's signature, holding another key (a daemon "
                    "drops a message signed with another key without a reply and logs `bad signature: wrong key`); "
                    f"use its key file (--key, $HAPD_KEY_FILE), or it is busy{rejected}",
                    field="address")
            raw = sock.recv_multipart()
            try:
                reply = self.session.decode(raw, reply=True, replay=False)
            except ProtocolError as exc:
                rejected = f"; rejected a reply: {exc}"
                continue  # not for us, or forged: keep waiting for ours
            if reply.parent == message.id:
                self._answered = True
                return reply
            # else a late reply to an earlier request

    @staticmethod
    def _send(sock: zmq.Socket, frames: Sequence[bytes], deadline: float, probe: Any = None) -> bool:
        waited = 0
        while True:
            try:
                sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:  # IMMEDIATE: not connected yet
                if time.monotonic() >= deadline:
                    return False
                sock.poll(20, zmq.POLLOUT)
                waited += 1
                if probe is not None and waited % 25 == 0:  # every half second
                    probe()

    def _down(self, timeout: float, mtype: str) -> None:
        """Raise :class:`DaemonDown` (the socket dropped) when the daemon's port refuses
        connections now; return otherwise."""
        if refuses_connections(self.address, PROBE_TIMEOUT_S):
            self._reset()
            raise DaemonDown(f"the daemon at {self.address} answered before but now refuses connections: it is not "
                             "running (killed or stopped); restart it (hapd serve) and run the job again",
                             field="address")

    def _gone(self, timeout: float, mtype: str) -> DaemonTimeout:
        """The timeout of a daemon that answered this client before: refusing
        connections now (no process listens: it died or was stopped), or taking them
        without an answer (hung or overloaded). Its key was right: it answered."""
        if refuses_connections(self.address, PROBE_TIMEOUT_S):
            return DaemonDown(
                f"the daemon at {self.address} answered before but now refuses connections: it is not running "
                f"(killed or stopped); restart it (hapd serve) and run the job again", field="address")
        return DaemonTimeout(
            f"the daemon at {self.address} answered before but did not answer the {mtype} within {timeout:g} s: it "
            "is hung or overloaded (its log: logs/daemon.log in its state folder)", field="address")

    def _timeout(self, timeout: float, what: str) -> DaemonTimeout:
        return DaemonTimeout(
            f"no daemon answered at {self.address} within {timeout:g} s ({what}); is `hapd serve` running there, "
            "with the same key file and protocol version?",
            field="address",
        )

    # -- the API

    def ping(self, *, timeout_s: float | None = None) -> dict[str, Any]:
        """``{protocol, version, host, profile_id, profile_name, slots, jobs}``."""
        return self.request("ping", timeout_s=timeout_s).body

    def compile(
        self,
        graph: bytes,
        kind: str = "hapg",
        profile: Mapping[str, Any] | None = None,
        options: Mapping[str, Any] | None = None,
        *,
        timeout_s: float = 600.0,
    ) -> tuple[bytes, str]:
        """``(plan bytes, cache path)`` for a graph (``kind`` ``"hapg"`` or ``"pt2"``, or
        ``"graphs"``: the graphs of a technique search, ``GraphSet.to_bytes()``);
        the path is ``"hit"``, ``"miss"`` or ``"lp-only"``."""
        body: dict[str, Any] = {"graph": bytes(graph), "graph_kind": kind}
        if profile is not None:
            body["profile"] = dict(profile)
        if options is not None:
            body["options"] = dict(options)
        reply = self.request("compile", body, timeout_s=timeout_s)
        return reply.body["plan"], reply.body["cache"]

    def status(self) -> dict[str, Any]:
        return self.request("status").body

    def shutdown(self) -> None:
        self.request("shutdown")

    def launch(
        self,
        job: str,
        script: str,
        *,
        nproc: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        node_rank: int = 0,
        nnodes: int = 1,
        rank_offset: int = 0,
        script_bytes: bytes | None = None,
        start_at: float | None = None,
        cwd: str | None = None,
        lease_s: float | None = None,
        in_place: bool = False,
    ) -> list[int]:
        """Start this daemon's ranks of a job; the pids of the local ranks (empty when
        ``start_at`` is in the future). The daemon cancels the job when no
        :meth:`job_events` poll about it comes for ``lease_s`` (None: the daemon's
        default lease)."""
        body: dict[str, Any] = {
            "job": job,
            "script": script,
            "args": list(args),
            "env": dict(env or {}),
            "nproc": nproc,
            "node_rank": node_rank,
            "nnodes": nnodes,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "master_addr": master_addr,
            "master_port": master_port,
        }
        for name, value in (("script_bytes", script_bytes), ("start_at", start_at), ("cwd", cwd), ("lease_s", lease_s)):
            if value is not None:
                body[name] = value
        if in_place:
            body["in_place"] = True
        return list(self.request("launch", body).body["pids"])

    def job_status(self, job: str) -> dict[str, Any]:
        """``{job, state, ranks: [{rank, local_rank, pid, returncode}]}``, plus ``reason``
        once the job has ended or is ending."""
        return self.request("job_status", {"job": job}).body

    def job_events(self, job: str, after: int = 0, *, probe_s: float | None = None) -> tuple[list[dict[str, Any]], bool]:
        """Events with ``seq > after`` and whether the job is done after them (each call
        renews the job's lease); ``probe_s`` as :meth:`request` takes it."""
        body = self.request("job_events", {"job": job, "after": after}, probe_s=probe_s).body
        return list(body["events"]), bool(body["done"])

    def job_pause(self, job: str) -> None:
        """Ask ``job``'s ranks to stop at their next step boundary (an elastic job's
        launcher, for a host joining)."""
        self.request("pause", {"job": job})

    def job_park(self, job: str, generation: int) -> None:
        """Ask an in-place ``job``'s ranks of ``generation`` to leave their process
        groups and park at once (an elastic job's launcher, for a host that went silent)."""
        self.request("park", {"job": job, "generation": generation})

    def job_switch(self, job: str, *, generation: int, node_rank: int, nnodes: int, rank_offset: int,
                   world_size: int, master_addr: str, master_port: int, env: Mapping[str, str],
                   nproc: int | None = None) -> None:
        """Tell an in-place ``job``'s ranks on this host where they go on (an elastic
        job's next generation); ``nproc``: how many go on here (the ranks still running:
        those killed by a signal are left out)."""
        body = {"job": job, "generation": generation, "node_rank": node_rank, "nnodes": nnodes,
                "rank_offset": rank_offset, "world_size": world_size, "master_addr": master_addr,
                "master_port": master_port, "env": dict(env)}
        self.request("switch", body if nproc is None else {**body, "nproc": nproc})

    def job_paused(self, job: str) -> bool:
        """Whether a pause was asked for ``job`` (what an elastic job's rank 0 asks after each step)."""
        return bool(self.job_status(job).get("pause", False))

    def cancel(self, job: str) -> None:
        self.request("cancel", {"job": job})

    # -- training snapshots (held in the daemon's memory, for elastic restarts)

    def snapshot_put(self, run: str, step: int, rank: int, world: int, files: Mapping[str, bytes], *,
                     chunk_bytes: int = SNAPSHOT_CHUNK_BYTES, timeout_s: float | None = None) -> None:
        """Store ``rank``'s snapshot of ``step`` (its files, name → bytes) in the daemon,
        each file in ``snapshot_put`` requests of at most ``chunk_bytes`` (a chunk over
        about 1 MiB goes in parts and must fit the daemon's ``--max-request-bytes``).
        The entry is complete, and listed, once the last chunk is in."""
        if not files:
            raise SnapshotError(f"run {run} step {step} rank {rank}: a snapshot needs at least one file", field="files")
        if chunk_bytes < 1:
            raise SnapshotError(f"chunk_bytes {chunk_bytes} must be ≥ 1", field="chunk_bytes")
        head = {"run": run, "step": step, "rank": rank, "world": world, "count": len(files)}
        for name, data in files.items():
            data = bytes(data)
            for offset in range(0, max(len(data), 1), chunk_bytes):
                self.request("snapshot_put", {**head, "name": name, "offset": offset, "total": len(data),
                                              "data": data[offset:offset + chunk_bytes]}, timeout_s=timeout_s)

    def snapshot_list(self, run: str) -> list[dict[str, Any]]:
        """The complete snapshots of ``run`` the daemon holds, by step then rank:
        ``[{step, rank, world, bytes, files: [names]}]`` (empty for an unknown run)."""
        return list(self.request("snapshot_list", {"run": run}).body["entries"])

    def snapshot_get(self, run: str, step: int, rank: int, *, timeout_s: float | None = None) -> dict[str, bytes]:
        """Every file of ``rank``'s complete snapshot of ``step``, name → bytes;
        :class:`~hapd.errors.SnapshotError` when the daemon holds none."""
        entry = next((e for e in self.snapshot_list(run) if (e["step"], e["rank"]) == (step, rank)), None)
        if entry is None:
            raise SnapshotError(f"the daemon at {self.address} holds no complete snapshot of run {run} at step {step} "
                                f"rank {rank}", field="step")
        files: dict[str, bytes] = {}
        for name in entry["files"]:
            data = bytearray()
            while True:
                body = self.request("snapshot_get", {"run": run, "step": step, "rank": rank, "name": name,
                                                     "offset": len(data), "length": SNAPSHOT_READ_BYTES},
                                    timeout_s=timeout_s).body
                data += body["data"]
                if len(data) >= body["total"] or not body["data"]:
                    break
            if len(data) != body["total"]:
                raise SnapshotError(f"{name} of run {run} step {step} rank {rank}: got {len(data)} bytes of "
                                    f"{body['total']} (was it replaced meanwhile?)", field="name")
            files[name] = bytes(data)
        return files

    def snapshot_drop(self, run: str, before_step: int | None = None) -> int:
        """Forget ``run``'s snapshots (only steps < ``before_step`` when given); how many
        (step, rank) entries were forgotten."""
        body: dict[str, Any] = {"run": run}
        if before_step is not None:
            body["before_step"] = before_step
        return int(self.request("snapshot_drop", body).body["count"])
