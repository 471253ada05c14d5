"""A real ``hapd serve`` process in a temporary state directory (its own profile, the
compiler preloaded: as users start it), and the documented atomic drop into its folder.
Used by ``test_daemon.py`` and ``test_shapes.py``; the hardening tests start theirs
with :mod:`_hardening_daemon`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from _hardening_daemon import daemon_info
from _wait import wait_for

from hapd.wire.client import Client

ROOT = Path(__file__).resolve().parent.parent


def drop(folder: Path, name: str, data: bytes, staging: bool = False) -> Path:
    """A documented atomic drop: write a dot-named temp file in the folder (or, with
    ``staging``, in its ``.incoming/`` folder) and rename it in."""
    tmp = folder / ".incoming" / name if staging else folder / f".{name}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, folder / name)
    return folder / name


class DaemonProcess:
    """``python -m hapd.cli serve`` in a temporary state directory."""

    def __init__(self, home: Path, *args: str, profile: str = "paper-8") -> None:
        self.home, self.args, self.profile = home, args, profile
        self.watch = home / "watch"
        self.proc: subprocess.Popen | None = None
        self.address = ""

    def start(self, timeout: float = 60.0) -> "DaemonProcess":
        (self.home / "daemon.json").unlink(missing_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        stderr = open(self.home / "stderr.txt", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hapd.cli", "serve", "--state", str(self.home), "--bind", "tcp://127.0.0.1:*",
             "--profile", self.profile, *self.args],
            stdout=subprocess.DEVNULL, stderr=stderr, cwd=ROOT,
        )
        stderr.close()

        def started() -> bool:
            info = daemon_info(self.proc, self.home, self.log)
            if info is None or info.get("pid") != self.proc.pid:
                return False
            self.address = info["address"]
            return True

        wait_for(started, timeout, "the daemon to start")
        return self

    def client(self, timeout_s: float = 10.0) -> Client:
        return Client(self.address, self.home / "key", timeout_s)

    def log(self) -> str:
        try:
            return (self.home / "logs" / "daemon.log").read_text()
        except FileNotFoundError:
            return ""

    def wait_log(self, pattern: str, timeout: float = 30.0, start: int = 0) -> re.Match:
        return wait_for(lambda: re.search(pattern, self.log()[start:]), timeout, f"log line {pattern!r}")

    def stop(self, timeout: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
