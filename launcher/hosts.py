"""Host files: which daemons a job runs on, and how many ranks each may take.

The DeepSpeed / OpenMPI / Horovod form, one host per line, extended with the daemon's
port and the host's GPU model::

    # comments start with '#', anywhere on a line
    gpu-a     slots=2 gpu=V100          # daemon at tcp://gpu-a:5557
    10.0.0.7  slots=4 port=6000 gpu=P100
    [fd00::3] slots=1                   # IPv6 literals in brackets

Grammar: ``HOST slots=N [port=P] [gpu=MODEL]``; ``HOST`` is a host name or address,
``N`` ≥ 1 the most ranks the job may put there, ``P`` the daemon's control port
(default 5557, the port of ``hapd serve``'s default bind), ``MODEL`` a free-form label
(shown in the launcher's report). A host may appear twice only with different ports
(two daemons on one machine). Every error names the file and line.

The first host is the job's ``MASTER_ADDR`` (global rank 0 runs there), as with Slurm's
first node. No torch import here.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path

from hapd.errors import OptionsError

DEFAULT_PORT = 5557
"""The control port of ``hapd serve`` unless ``--bind`` says otherwise."""

KEYS = ("slots", "port", "gpu")
_HOST = re.compile(r"[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.%a-zA-Z]+\]")


@dataclass(frozen=True, kw_only=True)
class Host:
    """One daemon of a job, as a line of the host file names it."""

    name: str
    """Host name or address as written (IPv6 without its brackets)."""
    slots: int
    """Most ranks the job may start there."""
    port: int = DEFAULT_PORT
    """The daemon's control port."""
    gpu: str | None = None
    """GPU model label (``gpu=``), for the report."""
    where: str = ""
    """``FILE:LINE`` it came from (empty for the implicit local host)."""

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise OptionsError(f"{self.where or self.name}: slots={self.slots} must be ≥ 1", field="slots")
        if not 1 <= self.port <= 65535:
            raise OptionsError(f"{self.where or self.name}: port={self.port} is not a port (1-65535)", field="port")

    @property
    def address(self) -> str:
        """The daemon's ZeroMQ endpoint, ``tcp://HOST:PORT``."""
        host = f"[{self.name}]" if ":" in self.name else self.name
        return f"tcp://{host}:{self.port}"

    @property
    def label(self) -> str:
        """``HOST`` (``HOST:PORT`` when the port is not the default)."""
        return self.name if self.port == DEFAULT_PORT else f"{self.name}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        """Whether the daemon is on this machine's loopback interface."""
        if self.name == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.name.split("%")[0]).is_loopback
        except ValueError:
            return False


def parse_hosts(text: str, source: str = "<hosts>") -> list[Host]:
    """The hosts of a host file's text, in order; :class:`OptionsError` names the
    offending ``source:LINE``."""
    hosts: list[Host] = []
    seen: dict[tuple[str, int], str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        where = f"{source}:{number}"
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, *pairs = line.split()
        if not _HOST.fullmatch(name) or "=" in name:
            raise OptionsError(f"{where}: {name!r} is not a host name or address (expected 'HOST slots=N [port=P] [gpu=MODEL]')", field="hosts")
        fields: dict[str, str] = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not value:
                raise OptionsError(f"{where}: {pair!r} is not KEY=VALUE (expected 'HOST slots=N [port=P] [gpu=MODEL]')", field="hosts")
            if key not in KEYS:
                raise OptionsError(f"{where}: unknown key {key!r} (known: {', '.join(KEYS)})", field="hosts")
            if key in fields:
                raise OptionsError(f"{where}: {key} given twice", field="hosts")
            fields[key] = value
        if "slots" not in fields:
            raise OptionsError(f"{where}: {name} has no slots=N (the most ranks it may run)", field="hosts")
        numbers = {}
        for key in ("slots", "port"):
            if key in fields:
                try:
                    numbers[key] = int(fields[key])
                except ValueError:
                    raise OptionsError(f"{where}: {key}={fields[key]} is not an integer", field="hosts") from None
        host = Host(name=name.strip("[]"), slots=numbers["slots"], port=numbers.get("port", DEFAULT_PORT),
                    gpu=fields.get("gpu"), where=where)
        key = (host.name, host.port)
        if key in seen:
            raise OptionsError(f"{where}: {host.label} is already listed at {seen[key]} (one daemon per host and port)", field="hosts")
        seen[key] = where
        hosts.append(host)
    if not hosts:
        raise OptionsError(f"{source}: no hosts (expected lines 'HOST slots=N [port=P] [gpu=MODEL]')", field="hosts")
    return hosts


def load_hosts(path: str | Path) -> list[Host]:
    """Read and parse a host file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise OptionsError(f"cannot read host file {path}: {exc.strerror or exc}", field="hosts") from None
    return parse_hosts(text, str(path))
