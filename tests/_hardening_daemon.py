"""A real ``hapd serve`` process for the issue-17 hardening tests: started in a fresh
state directory on a loopback port, stopped (and its log kept) at the end."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

import msgpack
import zmq
from _wait import GENEROUS_S, wait_for

from hapd.wire.client import Client

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def daemon_info(proc: subprocess.Popen, home: Path, output: Callable[[], str]) -> dict[str, Any] | None:
    """``home/daemon.json`` once the daemon ``proc`` wrote it, else None; an
    AssertionError with ``output()`` when the daemon exited."""
    if proc.poll() is not None:
        raise AssertionError(f"the daemon exited with {proc.returncode}:\n{output()}")
    try:
        return json.loads((home / "daemon.json").read_text())
    except (OSError, ValueError):
        return None


class ServedDaemon:
    """``python -m hapd.cli serve --state HOME --bind tcp://127.0.0.1:* ARGS…``, or the
    command ``wrap`` puts around it (a new mount namespace, …)."""

    def __init__(self, home: Path, *args: str, wrap: Sequence[str] = ()) -> None:
        self.home = home
        self.watch = home / "watch"
        self.args = args
        self.wrap = list(wrap)
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.pid = 0

    def start(self) -> "ServedDaemon":
        self.home.mkdir(parents=True, exist_ok=True)
        # --no-preload: these daemons are tested for their API, jobs and drops; a compile
        # imports the compiler when it comes (~1.5 s of CPU saved per daemon)
        command = [sys.executable, "-m", "hapd.cli", "serve", "--state", str(self.home), "--bind", "tcp://127.0.0.1:*",
                   "--no-preload", *self.args]
        with open(self.home / "stderr.txt", "ab") as stderr:
            self.proc = subprocess.Popen([*self.wrap, *command], stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT)

        def started() -> bool:
            info = daemon_info(self.proc, self.home, self.stderr)
            if info is None:
                return False
            self.address, self.pid = info["address"], info["pid"]
            return True

        wait_for(started, GENEROUS_S, "the daemon to start")
        return self

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def client(self, timeout_s: float = 10.0) -> Client:
        return Client(self.address, self.home / "key", timeout_s)

    def log(self) -> str:
        try:
            return (self.home / "logs" / "daemon.log").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stderr(self) -> str:
        try:
            return (self.home / "stderr.txt").read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_log(self, pattern: str, timeout: float = GENEROUS_S) -> re.Match:
        return wait_for(lambda: re.search(pattern, self.log()), timeout, f"log line {pattern!r}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(GENEROUS_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(GENEROUS_S)

    def __enter__(self) -> "ServedDaemon":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def signed_request(client: Client, address: str, mtype: str, body: dict[str, Any], timeout_s: float = GENEROUS_S):
    """Send a request signed with ``client``'s key but without the client's own field
    checks (as a buggy or hostile key holder could), and return the decoded reply."""
    session = client.session
    header = msgpack.packb({"id": uuid.uuid4().hex, "type": mtype, "time": time.time(), "session": session.session},
                           use_bin_type=True)
    payload = msgpack.packb(body, use_bin_type=True)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        sock.send_multipart([b"hapd", b"1", session.sign(b"1", header, payload), header, payload])
        assert sock.poll(int(timeout_s * 1000)), f"no reply to {mtype}"
        return session.decode(sock.recv_multipart(), reply=True)
    finally:
        sock.close()


def zmtp_connect(port: int) -> socket.socket:
    """A raw ZMTP 3.0 peer (NULL security, DEALER) on loopback, past the handshake: it
    can then send frames as no ZeroMQ library would (a frame declared and never
    finished)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=GENEROUS_S)
    sock.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + b"\0" * 31)
    greeting = b""
    while len(greeting) < 64:
        chunk = sock.recv(64 - len(greeting))
        if not chunk:
            raise ConnectionError("the daemon closed the connection during the greeting")
        greeting += chunk
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    sock.sendall(bytes([0x04, len(ready)]) + ready)
    return sock


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end closed ``sock`` (reading what it sent meanwhile)."""
    sock.settimeout(0.2)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (socket.timeout, BlockingIOError):
        return False


def can_mount_tmpfs() -> str | None:
    """None when this process may make a mount namespace with a tmpfs in it, else why not."""
    if os.geteuid() != 0:
        return "needs root (a tmpfs in a mount namespace)"
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot mount a tmpfs in a new mount namespace: {probe.stderr.strip() or probe.returncode}"
    return None


def rss_bytes(pid: int) -> int:
    """``pid``'s resident bytes (``VmRSS``)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024


def settled_rss(pid: int) -> int:
    """``pid``'s resident bytes once steady (a daemon's compile worker imports torch in the
    background as it starts): two readings half a second apart within 1 MiB."""
    last = [rss_bytes(pid)]

    def steady() -> bool:
        time.sleep(0.5)
        now = rss_bytes(pid)
        settled = abs(now - last[0]) < 2**20
        last[0] = now
        return settled

    wait_for(steady, GENEROUS_S, "the daemon's memory to settle")
    return last[0]

