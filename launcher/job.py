"""One SPMD job across daemons: check, place, start together, stream, stop together.

The steps of :func:`run_job`, in order:

1. **Check** every daemon before anything starts (:func:`check_daemons`, in parallel):
   it answers ``ping`` within ``timeout_s`` under the shared key, speaks this protocol
   version, and has the free slots the job needs there. A host that fails any check is
   named with the reason and nothing is started anywhere.
2. **Place** ranks (:func:`place`): host *i* of the host file runs global ranks
   ``offset_i … offset_i + K_i - 1``, contiguous per host in host-file order, so global
   rank 0 is on the first host, which is ``MASTER_ADDR``; ``MASTER_PORT`` is a free port
   there (:func:`choose_master_port`).
3. **Start together**: every daemon is sent ``launch`` with the same ``start_at`` (now
   plus a margin that covers the launch round trips), so each prepares its job (writes
   the shipped script, builds the environment) and the ranks of all hosts start at that
   instant. If any daemon refuses, the jobs already accepted are cancelled before
   ``start_at``: nothing ran anywhere. Every rank gets exactly torchrun's environment
   from its daemon (``docs/protocol.md``, ``launch``), plus ``HAPD_DAEMON``,
   ``HAPD_KEY_FILE``, ``HAPD_CACHE`` and ``HAPD_JOB``.
4. **Stream**: one thread per host polls ``job_events``; the main thread prints every
   output line prefixed ``[rank N] `` (stdout lines to stdout, stderr lines to stderr),
   except the ``{"hapd": ...}`` stdout lines: those are for the launcher, which feeds
   them to :class:`~launcher.report.Timings` (the one timing table at the end, the
   JSON report) and echoes them only with ``verbose`` (``-v``).
5. **Stop together**: when a rank exits non-zero, a daemon stops answering for
   ``lost_after_s``, or the launcher is interrupted (``KeyboardInterrupt``), every
   daemon that still answers is sent ``cancel`` (its ranks' process groups get SIGTERM,
   SIGKILL 5 s later) and the launcher waits up to ``grace_s`` for every host to report
   its job finished. The failing rank is the one whose non-zero exit came first (daemon
   clock); the job's exit code is its return code (``128 + N`` for a signal N), and its
   last lines are printed.

Every job is **leased** on every daemon (``lease_s``, ``--lease``): the pollers'
``job_events`` renew it, and a daemon that has heard nothing about the job for that long
stops its ranks itself. So a launcher killed outright (SIGKILL) leaves no rank running
for longer than the lease, and a daemon this launcher gave up on (exit status
:data:`EXIT_HOST_LOST`) stops its own ranks once it has heard nothing for the lease: the
launcher says so rather than claiming they stopped.

A private daemon (:class:`LocalDaemon`, :func:`start_local_daemon`) keeps its plans in the
user's plan cache, ``$HAPD_HOME/cache`` as ``hapd serve``'s (so the next job's plan is a
cache hit), unless another daemon holds that folder: then in its temporary state, which
the launcher says in one line. Its temporary state folder (``$TMPDIR/hapd-launcher-*``) names its owner in ``launcher.json``; the daemon removes it when
it stops because its launcher died, and every launcher that makes one first removes the
folders whose owner is gone (:func:`clean_stale_launcher_dirs`).

The script is **shipped**: its bytes go in the ``launch`` request and each daemon writes
them to its job folder and runs that copy, so SCRIPT needs to exist only where the
launcher runs (a shipped script's own folder is not on ``sys.path`` on the hosts, so it
must import what it needs from installed packages, as ``worker.py`` and ``ddp.py`` do).
With ``ship=False`` the absolute path is sent instead and must exist at the same path on
every host; a daemon that lacks it refuses the launch, naming the path.

No torch import here, and no signal handlers: the CLI turns Ctrl-C, SIGTERM and SIGHUP into
``KeyboardInterrupt``.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TextIO

from hapd.serve.jobs import killed_by_signal
from hapd.wire.client import Client, default_address
from hapd.errors import DaemonTimeout, HapdError, OptionsError
from hapd.wire.contract import MAX_LEASE_S, MIN_LEASE_S
from hapd.wire.keys import default_key_path, home_dir, load_key
from hapd.wire.protocol import PROTOCOL_VERSION

from launcher.hosts import Host
from launcher.report import Timings, build_report, format_table, write_report
from launcher.tracebacks import Tracebacks, strip_rank_prefix

EXIT_LAUNCH_ERROR = 2
"""Exit status when the job could not be started (bad input, a host failed a check)."""
EXIT_HOST_LOST = 1
"""Exit status when a daemon stopped answering mid-run (no rank's code is known; that
daemon stops its ranks itself when the job's lease expires)."""
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as a shell reports it)."""

FORWARDED_ENV_PREFIXES = ("NCCL_", "GLOO_")
"""The launcher's environment variables with these prefixes reach every rank (as
DeepSpeed forwards ``NCCL_*``): interface pinning and debug switches."""

TAIL_LINES = 20
"""Output lines of the failing rank printed after a failure."""

HOLD_S = 10.0
"""After a lost host, how long an in-place job's other ranks may take to park (a rank
computing finds its peer gone at its next collective) before they are stopped."""
FIRST_PARK_S = 2.0
"""After a lost host, how long the first of the other ranks may take to park: none by
then means their connections to the lost host did not close (its link is down, not its
processes killed), and they would wait for the collective timeout: they are stopped.
(When a host's processes are killed, its peers park within a second or two, mostly
before the launcher has found the host lost.)"""

PROBE_S = 0.5
"""A host's ``job_events`` poll unanswered this long has its daemon's port probed (and
again every as long): a refused connection (nothing listens: the daemon died, its host
up) makes the host lost at once; otherwise the poll waits on for ``lost_after_s``."""

DEFAULT_LEASE_S = 10.0
"""The job's lease on every daemon: one that gets no ``job_events`` poll from this
launcher for this long stops the job's ranks there (the pollers ask every ``poll_s``)."""

LAUNCHER_DIR_PREFIX = "hapd-launcher-"
"""Name prefix of the launcher's temporary folders (in ``$TMPDIR``)."""
OWNER_FILE = "launcher.json"
"""In such a folder: ``{"pid", "started"}`` of the launcher that made it."""
UNOWNED_STALE_S = 86400.0
"""A launcher folder without an owner file (an older launcher's) is stale this long after
its last change."""


class LaunchError(HapdError):
    """The job could not be started; nothing is left running."""


# ----------------------------------------------------------------------------- options


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """What to run and how; see :func:`run_job`."""

    script: Path
    """The training script (a Python file on this machine)."""
    args: tuple[str, ...] = ()
    """Arguments after the script."""
    nproc_per_node: int | None = None
    """Ranks on every host; None: each host's ``slots``."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Extra environment for every rank (over the forwarded ``NCCL_*``/``GLOO_*``)."""
    ship: bool = True
    """Send the script's bytes (True) or its absolute path, which must exist on every host."""
    cwd: str | None = None
    """Working directory of the ranks on every host; None: the launcher's for daemons on
    this machine's loopback, the daemon's own elsewhere."""
    master_port: int | None = None
    """Rendezvous port on the first host; None: a free one (checked when that host is this
    machine, else drawn from 20000-29999)."""
    key_file: Path | None = None
    """Shared key file; None: ``$HAPD_KEY_FILE`` or ``$HAPD_HOME/key``."""
    timeout_s: float = 5.0
    """How long a daemon may take to answer a check, launch or cancel."""
    lost_after_s: float = 1.5
    """A daemon that does not answer ``job_events`` this long is lost: the job is stopped."""
    poll_s: float = 0.05
    """Pause between ``job_events`` polls of a quiet host."""
    start_margin_s: float = 0.3
    """``start_at`` is at least this far after the checks (plus 3 round trips)."""
    grace_s: float = 7.0
    """After a failure, how long to wait for every host to report its ranks stopped
    (the daemons SIGKILL 5 s after SIGTERM)."""
    lease_s: float = DEFAULT_LEASE_S
    """A daemon that gets no poll from this launcher for this long stops the job's ranks
    there (the launcher was killed, or lost that daemon)."""
    job_id: str | None = None
    """Job id on every daemon; None: ``SCRIPT-DATE-TIME-RANDOM``."""
    report: Path | None = None
    """Where to write the JSON report; None: ``$HAPD_HOME/runs/JOB.json``."""
    stream: bool = True
    """Print every rank's output lines as they come (but the ``{"hapd": ...}`` lines, see
    ``verbose``)."""
    verbose: bool = False
    """Also print the ranks' ``{"hapd": ...}`` stdout lines. They are for the launcher,
    which consumes them (the timing table, the JSON report), so they are not echoed
    by default."""
    host_env: bool = False
    """Give every rank ``HAPD_HOST`` = its host's name in the host file (the profiler names
    devices' hosts by it; namespaces or containers on one machine share a host name)."""
    env_of_host: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    """More environment for the ranks of one host, by its label (an elastic job's
    snapshot partner)."""
    nproc_of_host: Mapping[str, int] = field(default_factory=dict)
    """Ranks on a host, by its label, over ``nproc_per_node`` and its slots (an elastic
    job's host that goes on in place with fewer ranks after one was killed)."""
    in_place: bool = False
    """Run the ranks under :mod:`hapd.elastic.in_place` (an elastic job: a rank whose peer
    went away parks and can be switched to the next generation in its process)."""

    def __post_init__(self) -> None:
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise OptionsError(f"--nproc-per-node {self.nproc_per_node} must be ≥ 1", field="nproc_per_node")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise OptionsError(f"--master-port {self.master_port} is not a port", field="master_port")
        for name in ("timeout_s", "lost_after_s", "poll_s", "start_margin_s", "grace_s"):
            if not getattr(self, name) > 0:
                raise OptionsError(f"{name} {getattr(self, name)} must be > 0", field=name)
        if not MIN_LEASE_S <= self.lease_s <= MAX_LEASE_S:
            raise OptionsError(f"--lease {self.lease_s:g} must be in {MIN_LEASE_S:g}..{MAX_LEASE_S:g} s", field="lease_s")
        if self.job_id is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", self.job_id):
            raise OptionsError(f"job id {self.job_id!r} must be 1-64 letters, digits, '.', '_' or '-'", field="job_id")


@dataclass(frozen=True)
class Placement:
    """One host's share of the job."""

    host: Host
    node_rank: int
    rank_offset: int
    nproc: int

    @property
    def ranks(self) -> range:
        return range(self.rank_offset, self.rank_offset + self.nproc)

    def describe(self) -> dict[str, Any]:
        return {"host": self.host.label, "address": self.host.address, "gpu": self.host.gpu, "node_rank": self.node_rank,
                "ranks": [self.rank_offset, self.rank_offset + self.nproc - 1]}


@dataclass(frozen=True)
class Attach:
    """A generation that goes on in the ranks of a running job (switched in place)
    instead of launching new ones."""

    job_id: str
    """The daemons' job whose ranks are parked."""
    generation: int
    """The elastic generation they switch to."""
    after: Mapping[str, int]
    """Per host label, the last event of that job already read: the hosts whose parked
    ranks are switched. The generation's other hosts (joining) are launched afresh under
    the same job id."""


@dataclass
class JobResult:
    """How the job ended."""

    job: str
    exit_code: int
    world_size: int
    failure: dict[str, Any] | None = None
    """``{"kind": "rank"|"host"|"interrupt", ...}`` when it did not succeed."""
    report: dict[str, Any] | None = None
    report_path: Path | None = None
    start: dict[str, Any] = field(default_factory=dict)
    """Launch timing: ``launcher_start``, ``checked``, ``start_at``, ``launched``,
    ``first_output`` (per rank, daemon clock), ``first_output_skew_s``."""
    stopped_s: float | None = None
    """After a failure: seconds from the cancel to every host reporting its job finished."""
    leftover: list[str] = field(default_factory=list)
    """Hosts that did not report their ranks stopped within ``grace_s``."""
    lost: list[str] = field(default_factory=list)
    """Hosts whose daemon stopped answering (their ranks are left to the job's lease)."""
    other: list[dict[str, Any]] = field(default_factory=list)
    """``{"hapd": ...}`` lines other than timings and summary (with ``"_rank"``)."""
    held: list[str] = field(default_factory=list)
    """Hosts whose every rank parked after a lost host and was left running, to be
    switched in place (:attr:`Job.hold_on_host_loss`)."""
    after: dict[str, int] = field(default_factory=dict)
    """Per host label, the last event read (where a switched generation goes on reading)."""
    killed: dict[str, list[int]] = field(default_factory=dict)
    """Per host label, the ranks a signal killed in an in-place job whose other ranks
    parked (:attr:`Job.hold_on_host_loss`): the next generation goes on without them."""
    paused: bool = False
    """Every rank parked at a pause (a host joins) and was left running, to be switched."""


# ----------------------------------------------------------------------------- placement


def place(hosts: Sequence[Host], nproc_per_node: int | None,
          nproc_of_host: Mapping[str, int] | None = None) -> list[Placement]:
    """Contiguous global ranks per host, in host order; ``nproc_of_host`` (by label)
    over ``nproc_per_node`` over the host's slots."""
    out, offset = [], 0
    for i, host in enumerate(hosts):
        k = host.slots if nproc_per_node is None else nproc_per_node
        k = (nproc_of_host or {}).get(host.label, k)
        if k > host.slots:
            where = f" ({host.where})" if host.where else ""
            raise OptionsError(f"host {host.label}{where} has slots={host.slots}; --nproc-per-node {k} does not fit", field="nproc_per_node")
        out.append(Placement(host, i, offset, k))
        offset += k
    return out


def choose_master_port(host: Host, given: int | None = None) -> int:
    """``given``, else a port free on ``host`` (checked by binding when it is this
    machine's loopback, else drawn at random from 20000-29999, below Linux's
    ephemeral range)."""
    if given is not None:
        return given
    if host.is_loopback:
        family = socket.AF_INET6 if ":" in host.name else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host.name if host.name != "localhost" else "127.0.0.1", 0))
            return s.getsockname()[1]
    return 20000 + secrets.randbelow(10000)


def default_job_id(script: Path) -> str:
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", script.stem).lstrip("._-")[:32] or "job"
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def job_env(options: JobOptions, hosts: Sequence[Host], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for every rank on top of its daemon's: forwarded ``NCCL_*``/``GLOO_*``,
    ``GLOO_SOCKET_IFNAME=lo`` when every host is this machine's loopback (and it is
    unset), then ``options.env``."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
    if all(h.is_loopback for h in hosts) and "GLOO_SOCKET_IFNAME" not in env and "GLOO_SOCKET_IFNAME" not in options.env \
            and Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.update(options.env)
    return env


# ----------------------------------------------------------------------------- checks


@dataclass(frozen=True)
class Checked:
    """A daemon that passed the checks."""

    placement: Placement
    pong: dict[str, Any]
    rtt_s: float


def check_daemons(placements: Sequence[Placement], clients: Mapping[int, Client], timeout_s: float) -> list[Checked]:
    """Ping every daemon at once; :class:`LaunchError` names every host that fails."""

    def one(p: Placement) -> Checked | str:
        start = time.perf_counter()
        try:
            pong = clients[p.node_rank].ping(timeout_s=timeout_s)
        except DaemonTimeout:
            return (f"no answer within {timeout_s:g} s at {p.host.address}: is `hapd serve --bind tcp://0.0.0.0:{p.host.port}` "
                    "running there, reachable from here, and using the same key file? (a daemon drops messages signed "
                    "with another key without answering)")
        except HapdError as exc:
            return f"{type(exc).__name__}: {exc}"
        rtt = time.perf_counter() - start
        if pong.get("protocol") != PROTOCOL_VERSION:
            return f"speaks protocol {pong.get('protocol')}, this launcher {PROTOCOL_VERSION}: install the same hapd version on every host"
        if pong.get("slots", 0) < p.nproc:
            return (f"has {pong.get('slots')} free slot(s) ({pong.get('jobs')} job(s) running), the job needs {p.nproc} there: "
                    "wait for its jobs, use fewer ranks, or restart it with `hapd serve --slots N`")
        return Checked(p, pong, rtt)

    with ThreadPoolExecutor(max_workers=min(32, len(placements))) as pool:
        results = list(pool.map(one, placements))
    bad = [(p, r) for p, r in zip(placements, results) if isinstance(r, str)]
    if bad:
        lines = [f"  {p.host.label}{f' ({p.host.where})' if p.host.where else ''}: {why}" for p, why in bad]
        raise LaunchError(f"{len(bad)} of {len(placements)} host(s) failed the checks; nothing was started:\n" + "\n".join(lines))
    return [r for r in results if isinstance(r, Checked)]


# ----------------------------------------------------------------------------- a local daemon


SERVE_CHILD_MODULE = "launcher.serve_child"
"""``python -m SERVE_CHILD_MODULE LAUNCHER_PID serve ...``: ``hapd serve`` that stops with
the launcher (:mod:`launcher.serve_child`)."""


def process_start(pid: int) -> str | None:
    """None when no process ``pid`` runs (or only its zombie is left); else its start time
    in clock ticks since boot from ``/proc`` (what tells it from a later process given the
    same pid), or "" where there is no ``/proc``."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # another user's: it runs
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return ""
    return None if fields[0] in ("Z", "X") else fields[19]


def make_launcher_dir() -> Path:
    """A new ``$TMPDIR/hapd-launcher-*`` folder (mode 0700) naming this process as its owner."""
    folder = Path(tempfile.mkdtemp(prefix=LAUNCHER_DIR_PREFIX))
    (folder / OWNER_FILE).write_text(json.dumps({"pid": os.getpid(), "started": process_start(os.getpid())}))
    return folder


def _launcher_dir_in_use(folder: Path, mtime: float) -> bool:
    """Whether the launcher that made ``folder``, or the daemon running in it, still runs
    (a folder without a readable owner file: whether it changed in the last
    :data:`UNOWNED_STALE_S`)."""
    try:
        owner = json.loads((folder / OWNER_FILE).read_text())
        pid, started = int(owner["pid"]), str(owner.get("started") or "")
    except (OSError, ValueError, KeyError, TypeError):
        return time.time() - mtime < UNOWNED_STALE_S
    now = process_start(pid)
    if now is not None and (not started or not now or now == started):
        return True
    try:
        daemon = int(json.loads((folder / "daemon.json").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return process_start(daemon) is not None  # it stops, and removes the folder, by itself


def clean_stale_launcher_dirs(root: Path | None = None) -> list[Path]:
    """Remove this user's ``hapd-launcher-*`` folders in ``root`` (default ``$TMPDIR``)
    whose launcher and daemon are gone (a launcher killed with SIGKILL cannot remove its
    own); the folders removed."""
    root = Path(tempfile.gettempdir()) if root is None else Path(root)
    removed = []
    for folder in root.glob(LAUNCHER_DIR_PREFIX + "*"):
        try:
            st = folder.lstat()
        except OSError:
            continue
        if not folder.is_dir() or folder.is_symlink() or st.st_uid != os.getuid() or _launcher_dir_in_use(folder, st.st_mtime):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


@contextlib.contextmanager
def launcher_dir() -> Iterator[Path]:
    """A launcher folder for the duration of a block (stale ones are removed first)."""
    clean_stale_launcher_dirs()
    folder = make_launcher_dir()
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class LocalDaemon:
    """A private ``hapd serve`` on a free loopback port with a temporary state directory,
    for a job on this machine when no daemon answers at the default address; stopped (and
    its state removed) by :meth:`stop` — a ``shutdown`` request, then SIGTERM, then SIGKILL.

    ``cache``: its plan cache folder (``hapd serve --cache``), which outlives it, e.g. the
    user's ``$HAPD_HOME/cache`` (see :func:`start_local_daemon`); None: a ``cache/``
    folder in the temporary state, removed with it.

    It runs in its own session (a Ctrl-C at the terminal reaches only the launcher, which
    stops it in order) and, on Linux, gets SIGTERM should the launcher die first; it then
    removes its state folder itself (:mod:`launcher.serve_child`), and the next launcher
    removes any that a harder death left (:func:`clean_stale_launcher_dirs`)."""

    def __init__(self, slots: int, *, cache: Path | None = None, timeout_s: float = 30.0) -> None:
        clean_stale_launcher_dirs()
        self.home = make_launcher_dir()
        self.key_file = self.home / "key"
        self.cache = Path(cache) if cache is not None else self.home / "cache"
        self.address = ""
        log = open(self.home / "serve.txt", "wb")  # noqa: SIM115 - the child owns it
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", SERVE_CHILD_MODULE, str(os.getpid()), "serve", "--state", str(self.home),
                 "--cache", str(self.cache), "--bind", "tcp://127.0.0.1:*", "--slots", str(slots),
                 "--log-level", "warning"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        finally:
            log.close()
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        info_path = self.home / "daemon.json"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LaunchError(f"the local daemon exited with {self.proc.returncode}:\n{self.output()}")
            try:
                info = json.loads(info_path.read_text())
            except (OSError, ValueError):
                time.sleep(0.01)
                continue
            if info.get("pid") == self.proc.pid:
                self.address = info["address"]
                return
            time.sleep(0.01)
        raise LaunchError(f"the local daemon did not start within {timeout_s:g} s:\n{self.output()}")

    def output(self) -> str:
        try:
            return (self.home / "serve.txt").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def host(self) -> Host:
        port = int(self.address.rsplit(":", 1)[1])
        return Host(name="127.0.0.1", slots=1024, port=port)

    def stop(self, timeout_s: float = 15.0) -> None:
        try:
            if self.proc.poll() is None and self.address:
                try:
                    with Client(self.address, self.key_file, 2.0) as client:
                        client.shutdown()
                except HapdError:
                    pass
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            shutil.rmtree(self.home, ignore_errors=True)


def user_plan_cache() -> Path:
    """The plan cache ``hapd serve`` uses by default: ``$HAPD_HOME/cache`` (``~/.hapd/cache``)."""
    return home_dir().expanduser().absolute() / "cache"


def start_local_daemon(slots: int, say: Callable[[str], None], *, cache: Path | None = None) -> LocalDaemon:
    """A :class:`LocalDaemon` whose plans go to ``cache`` (default :func:`user_plan_cache`),
    so a job run again gets its plan from there; when another daemon holds that folder
    (its lock, see :func:`hapd.serve.daemon.folder_holder`), one with a temporary cache,
    and ``say`` tells why in one line. A daemon that took the folder between the look and
    the start is met the same way."""
    from hapd.serve.daemon import folder_holder

    cache = user_plan_cache() if cache is None else cache

    def in_use(holder: str) -> LocalDaemon:
        say(f"the plan cache {cache} is in use by another hapd daemon (pid {holder}); this job's plans are cached "
            "only for the job")
        return LocalDaemon(slots)

    holder = folder_holder(cache)
    if holder is not None:
        return in_use(holder)
    try:
        return LocalDaemon(slots, cache=cache)
    except LaunchError:
        holder = folder_holder(cache)
        if holder is None:
            raise
        return in_use(holder)


def local_daemon_answers(key_file: Path | None, timeout_s: float = 2.0) -> str | None:
    """The default daemon's address (``$HAPD_DAEMON`` or ``tcp://127.0.0.1:5557``) when
    it answers a ping under the key, else None. A refused TCP connection answers at once."""
    address = default_address()
    key = key_file or default_key_path()
    if not Path(key).exists():
        return None
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if address.startswith("tcp://") and port.isdigit():
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=0.5).close()
        except OSError:
            return None
    try:
        with Client(address, key, timeout_s) as client:
            client.ping()
    except HapdError:
        return None
    return address


# ----------------------------------------------------------------------------- the job


class _Poller(threading.Thread):
    """Polls one host's ``job_events`` (renewing the job's lease there) and hands them to
    the main thread; a host that does not answer is reported ``lost`` with the monotonic
    time of the last poll it answered."""

    def __init__(self, placement: Placement, client: Client, job: str, out: "queue.Queue[tuple]", poll_s: float,
                 after: int = 0) -> None:
        super().__init__(name=f"hapd-launcher-{placement.host.label}", daemon=True)
        self.placement, self.client, self.job, self.out, self.poll_s = placement, client, job, out, poll_s
        self.after = after
        """The last event read."""
        self.quit = threading.Event()
        self.answered = time.monotonic()
        """When the last poll that got an answer was sent."""

    def run(self) -> None:
        while not self.quit.is_set():
            sent = time.monotonic()
            try:
                events, done = self._poll()
            except HapdError as exc:
                self.out.put(("lost", self.placement, (f"{type(exc).__name__}: {exc}", self.answered)))
                return
            self.answered = sent
            if events:
                self.after = events[-1]["seq"]
                self.out.put(("events", self.placement, events))
            if done:
                self.out.put(("done", self.placement, None))
                return
            if len(events) < 100:
                self.quit.wait(self.poll_s)

    def _poll(self) -> tuple[list[dict[str, Any]], bool]:
        """One ``job_events`` poll, up to ``lost_after_s``; unanswered after
        :data:`PROBE_S`, the daemon's port is probed (every :data:`PROBE_S`): refused,
        the daemon is lost at once (:class:`~hapd.errors.DaemonDown`)."""
        return self.client.job_events(self.job, self.after, probe_s=PROBE_S)


def exit_status(code: int) -> int:
    """A shell's exit status for a return code (``128 + N`` for signal N)."""
    return 128 - code if code < 0 else min(code, 255)


class Job:
    """One launch: :meth:`start` (checks, placement, synchronized start), then
    :meth:`wait` (stream, stop on failure, report). :func:`run_job` does both."""

    def __init__(self, hosts: Sequence[Host], options: JobOptions, *, out: TextIO | None = None, err: TextIO | None = None,
                 launcher_start: float | None = None, attach: Attach | None = None) -> None:
        self.hosts = list(hosts)
        self.options = options
        self.out = out or sys.stdout
        self.err = err or sys.stderr
        self.start_info: dict[str, Any] = {"launcher_start": launcher_start or time.time()}
        self.placements = place(self.hosts, options.nproc_per_node, options.nproc_of_host)
        self.world_size = sum(p.nproc for p in self.placements)
        self.attach = attach
        self.job_id = attach.job_id if attach is not None else (options.job_id or default_job_id(options.script))
        self.script_name = options.script.name
        self.rank_host = {r: {"host": p.host.label, "gpu": p.host.gpu} for p in self.placements for r in p.ranks}
        self.timings = Timings()
        self.tails: dict[int, deque[str]] = {r: deque(maxlen=TAIL_LINES) for r in range(self.world_size)}
        self.tracebacks = Tracebacks()
        """The ranks' tracebacks: held, printed once (ranks failing alike folded), and the cause."""
        self.pieces: dict[tuple[int, str], list[str]] = {}
        """(rank, stream) -> the pieces so far of a line longer than a daemon's event."""
        self.exits: dict[int, tuple[int, float]] = {}
        self.first_output: dict[int, float] = {}
        self.failure: dict[str, Any] | None = None
        self.launched: list[Placement] = []
        self.on_elastic: Callable[[int, dict[str, Any]], None] | None = None
        """Called with each ``{"hapd": "elastic", ...}`` line (rank, object) of rank 0."""
        self.failed_at: float | None = None
        """When the job's first failure happened (a failing rank's exit on its daemon's
        clock, a lost daemon's last answer), wall clock."""
        self.on_failure: Callable[[list[Placement]], None] | None = None
        """Called once, at the job's first failure or when a rank first parks, with the
        hosts not yet finished or lost (an elastic launcher pings them at once,
        :meth:`declare_lost`)."""
        self.on_tick: Callable[[], None] | None = None
        """Called about every half second while the job runs (an elastic launcher
        watches its host file from there)."""
        self.hold_on_host_loss = False
        """At a lost host or a rank killed by a signal, leave the other ranks running while
        they park (an in-place elastic job), up to :data:`HOLD_S`; stop them as usual when
        one does not. At a pause (rank 0's ``paused``), wait for every rank to park."""
        self._pinged = False
        self.parked: set[int] = set()
        """Ranks that said they parked (``{"hapd": "elastic", "event": "parked"}``)."""
        self.killed: set[int] = set()
        """Ranks a signal killed while the others are held (:attr:`hold_on_host_loss`)."""
        self.paused = False
        """Rank 0 said ``paused`` (a host joins): its ranks park at that step boundary."""
        self._events: queue.Queue[tuple] = queue.Queue()
        self._pollers: list[_Poller] = []
        key = options.key_file or default_key_path()
        self._key = load_key(key)  # a missing or unsafe key file fails here, naming it
        self.control = {p.node_rank: Client(p.host.address, self._key, options.timeout_s) for p in self.placements}

    # -- output

    def say(self, text: str) -> None:
        self._print(f"hapd launcher: {text}", self.err)

    @staticmethod
    def _print(line: str, stream: TextIO) -> None:
        """One line; a stream that is gone (a closed terminal, a broken pipe) must not
        keep the job from being stopped."""
        try:
            print(line, file=stream, flush=True)
        except (OSError, ValueError):
            pass

    # -- start

    def start(self) -> None:
        """Check every daemon, then launch every host's ranks to start at one instant.
        Raises :class:`LaunchError` (nothing left running) when any step fails. With
        ``attach``, switch the parked ranks of that job in place instead (:meth:`_switch`)."""
        if self.attach is not None:
            self._switch(self.attach)
            return
        opts = self.options
        script = opts.script
        if not script.is_file():
            raise OptionsError(f"script {script} not found (it must exist where the launcher runs)", field="script")
        checked = check_daemons(self.placements, self.control, opts.timeout_s)
        self.start_info["checked"] = time.time()
        master = self.placements[0].host
        port = choose_master_port(master, opts.master_port)
        env = job_env(opts, self.hosts)
        launcher_cwd = os.getcwd()
        rtt = max(c.rtt_s for c in checked)
        start_at = time.time() + opts.start_margin_s + 3 * rtt
        self.start_info.update(start_at=start_at, master_addr=master.name, master_port=port)

        def launch(p: Placement) -> str | None:
            try:
                self._launch_on(p, master.name, port, env, start_at, launcher_cwd)
            except DaemonTimeout as exc:  # it may have accepted the job all the same: cancelled below
                unanswered.add(p.node_rank)
                return f"{type(exc).__name__}: {exc}"
            except HapdError as exc:
                return f"{type(exc).__name__}: {exc}"
            return None

        unanswered: set[int] = set()
        try:
            with ThreadPoolExecutor(max_workers=min(32, len(self.placements))) as pool:
                refusals = list(pool.map(launch, self.placements))
        except BaseException:  # Ctrl-C mid-launch: no host may start the job on its own later
            self._cancel(self.placements, quiet=True)
            raise
        self.launched = [p for p, why in zip(self.placements, refusals) if why is None]
        self.start_info["launched"] = time.time()
        if len(self.launched) < len(self.placements):
            self._cancel_refused(refusals, unanswered, start_at)
        self._start_pollers()
        self._say_started(master.name, port, start_at)

    def _launch_on(self, p: Placement, master_addr: str, port: int, env: Mapping[str, str], start_at: float | None,
                   launcher_cwd: str) -> None:
        """Send one host's daemon its ranks of the job (``launch``)."""
        opts = self.options
        script_bytes = opts.script.read_bytes() if opts.ship else None
        remote_script = opts.script.name if opts.ship else str(opts.script.resolve())
        cwd = opts.cwd if opts.cwd is not None else (launcher_cwd if p.host.is_loopback else None)
        self.control[p.node_rank].launch(
            self.job_id, remote_script, script_bytes=script_bytes, args=opts.args,
            env={**env, **({"HAPD_HOST": p.host.label} if opts.host_env else {}),
                 **opts.env_of_host.get(p.host.label, {})}, nproc=p.nproc,
            node_rank=p.node_rank, nnodes=len(self.placements), rank_offset=p.rank_offset,
            world_size=self.world_size, master_addr=master_addr, master_port=port, start_at=start_at, cwd=cwd,
            lease_s=opts.lease_s, in_place=opts.in_place,
        )

    def _cancel_refused(self, refusals: Sequence[str | None], unanswered: set[int], start_at: float) -> None:
        """Cancel the job on the hosts that took it (or did not answer), and raise :class:`LaunchError`."""
        self._cancel(self.launched)
        self._cancel([p for p in self.placements if p.node_rank in unanswered], quiet=True)
        late = time.time() >= start_at
        lines = [f"  {p.host.label}: {why}" for p, why in zip(self.placements, refusals) if why is not None]
        what = ("the accepted hosts' ranks had started and were stopped" if late
                else "the job was cancelled on the other hosts before its start time: nothing was started")
        raise LaunchError(f"{len(lines)} host(s) refused job {self.job_id}; {what}:\n" + "\n".join(lines))

    def _start_pollers(self) -> None:
        """One poller per host, reading its job's events from the first."""
        opts = self.options
        for p in self.placements:
            poller = _Poller(p, Client(p.host.address, self._key, opts.lost_after_s), self.job_id, self._events, opts.poll_s)
            self._pollers.append(poller)
            poller.start()

    def _say_started(self, master_addr: str, port: int, start_at: float) -> None:
        """The line saying where the job's ranks run and when they start."""
        hosts = ", ".join(f"{p.host.label} ranks {p.rank_offset}-{p.rank_offset + p.nproc - 1}" for p in self.placements)
        left = start_at - time.time()
        when = f"start in {left:.2f} s" if left > 0 else f"started {-left:.2f} s late (a daemon answered the launch slowly)"
        self.say(f"job {self.job_id}: {self.world_size} ranks on {len(self.placements)} host(s) ({hosts}); "
                 f"MASTER_ADDR={master_addr} MASTER_PORT={port}; {when}")

    def _switch(self, attach: Attach) -> None:
        """Tell every held host's daemon where its parked ranks of ``attach.job_id`` go on
        (the ``switch`` request: generation, ranks, rendezvous, environment; its ranks
        killed by a signal left out) and read their events from where the last generation
        stopped; launch the ranks of the hosts joining now, under the same job id. Raises
        :class:`LaunchError` when a host refuses (a rank of it is no longer running); the
        caller then stops them and launches afresh."""
        opts = self.options
        master = self.placements[0].host
        port = choose_master_port(master, opts.master_port)
        env = job_env(opts, self.hosts)
        launcher_cwd = os.getcwd()
        self.start_info.update(master_addr=master.name, master_port=port, switched_to=attach.generation)

        def one(p: Placement) -> str | None:
            try:
                if p.host.label not in attach.after:  # a host joining: new processes
                    self._launch_on(p, master.name, port, env, None, launcher_cwd)
                    return None
                self.control[p.node_rank].job_switch(
                    self.job_id, generation=attach.generation, node_rank=p.node_rank, nnodes=len(self.placements),
                    rank_offset=p.rank_offset, world_size=self.world_size, master_addr=master.name, master_port=port,
                    env={**env, **({"HAPD_HOST": p.host.label} if opts.host_env else {}),
                         **opts.env_of_host.get(p.host.label, {})}, nproc=p.nproc)
            except HapdError as exc:
                return f"{type(exc).__name__}: {exc}"
            return None

        with ThreadPoolExecutor(max_workers=min(32, len(self.placements))) as pool:
            refusals = list(pool.map(one, self.placements))
        self.start_info["launched"] = time.time()
        lines = [f"  {p.host.label}: {why}" for p, why in zip(self.placements, refusals) if why is not None]
        if lines:
            raise LaunchError(f"{len(lines)} host(s) refused to switch job {self.job_id} in place:\n" + "\n".join(lines))
        self.launched = list(self.placements)
        for p in self.placements:
            poller = _Poller(p, Client(p.host.address, self._key, opts.lost_after_s), self.job_id, self._events,
                             opts.poll_s, after=attach.after.get(p.host.label, 0))
            self._pollers.append(poller)
            poller.start()
        hosts = ", ".join(f"{p.host.label} ranks {p.rank_offset}-{p.rank_offset + p.nproc - 1}"
                          + ("" if p.host.label in attach.after else " (joining: new processes)") for p in self.placements)
        self.say(f"job {self.job_id}: switched in place to generation {attach.generation}: {self.world_size} ranks on "
                 f"{len(self.placements)} host(s) ({hosts}); MASTER_ADDR={master.name} MASTER_PORT={port}")

    def declare_lost(self, placement: Placement, message: str) -> None:
        """Take ``placement``'s daemon as lost now (any thread), as its poller would once a
        poll went unanswered for ``lost_after_s``."""
        self._events.put(("lost", placement, (message, time.monotonic())))

    def _cancel(self, placements: Sequence[Placement], *, quiet: bool = False) -> None:
        """Send ``cancel`` to these hosts at once (one that does not answer is skipped)."""

        def one(p: Placement) -> None:
            try:  # a client of its own: the control client may be in use, and this may run on a thread
                with Client(p.host.address, self._key, self.options.timeout_s) as client:
                    client.cancel(self.job_id)
            except HapdError as exc:
                if not quiet:
                    self.say(f"could not cancel job {self.job_id} on {p.host.label}: {exc}")

        if placements:
            with ThreadPoolExecutor(max_workers=min(32, len(placements))) as pool:
                list(pool.map(one, placements))

    # -- run

    def wait(self) -> JobResult:
        """Stream output until every host's job has finished; on a failure or Ctrl-C
        stop every host's ranks and wait up to ``grace_s`` for them. Ctrl-C is not
        re-raised: the result says ``failure.kind == "interrupt"`` (exit status 130)."""
        finished: set[int] = set()
        lost: dict[int, str] = {}
        stop_started: float | None = None
        deadline: float | None = None
        hold_until: float | None = None
        held = False
        try:
            while len(finished) + len(lost) < len(self.placements):
                timeout = 0.5 if deadline is None else deadline - time.monotonic()
                if self.paused and self.failure is None and self.hold_on_host_loss and self._all_parked(finished, lost):
                    held = True  # parked at the pause's step boundary: switched with the joining host
                    break
                if hold_until is not None and stop_started is None:
                    if self._all_parked(finished, lost):
                        held = True
                        break
                    if self._hold_ended(hold_until, lost, finished):
                        if self._drop_unparked(finished, lost):
                            held = True
                            break
                        stop_started, deadline = self._stop_all(finished, lost)
                        continue
                    timeout = min(timeout, hold_until - time.monotonic())
                if timeout <= 0:
                    break
                self._flush_tracebacks(self.tracebacks.due())
                if self.on_tick is not None and stop_started is None:
                    self.on_tick()
                try:
                    kind, p, payload = self._events.get(timeout=min(timeout, self.tracebacks.hold_s / 2))
                except queue.Empty:
                    continue
                failed_now = self._handle(kind, p, payload, finished, lost)
                if failed_now and stop_started is None:
                    if self._holds():
                        hold_until = time.monotonic() + HOLD_S
                        self._park_survivors(lost)
                    else:
                        stop_started, deadline = self._stop_all(finished, lost)
                    self._ping_once(finished, lost)
                elif self.parked and self.failure is None:  # a rank lost a peer: find a host that died at once
                    self._ping_once(finished, lost)
        except KeyboardInterrupt:
            stop_started = self._stop_on_interrupt(finished, lost)
        finally:
            for poller in self._pollers:
                poller.quit.set()
            self._flush_tracebacks(list(self.tracebacks.held))
        result = self._result(finished, lost, stop_started, held)
        if held:  # their pollers stopped: the next generation reads on from their last event
            self._hand_over_held(result)
        return result

    def _park_survivors(self, lost: Mapping[int, str]) -> None:
        """After a lost host, ask the other hosts' daemons to park this generation's ranks
        now (on a thread): those waiting in a collective on the lost host (its link down:
        their connections to it do not close) leave their groups at once instead of at
        the collective timeout; those that parked already ignore it."""
        generation = int(self.options.env.get("HAPD_GENERATION") or 0)
        survivors = self._survivors(lost)

        def one(p: Placement) -> None:
            try:
                with Client(p.host.address, self._key, self.options.timeout_s) as client:
                    client.job_park(self.job_id, generation)
            except HapdError as exc:  # then its ranks park at the collective timeout, or are stopped
                self.say(f"could not ask {p.host.label} to park its ranks: {exc}")

        def all_of_them() -> None:
            with ThreadPoolExecutor(max_workers=min(16, max(1, len(survivors)))) as pool:
                list(pool.map(one, survivors))

        threading.Thread(target=all_of_them, daemon=True, name="hapd-launcher-park").start()

    def _hold_ended(self, hold_until: float, lost: Mapping[int, str], finished: set[int]) -> bool:
        """Whether the hold is over: it ran out, a survivor exited, none parked. Said when
        every held rank is to be stopped (all but when :meth:`_drop_unparked` applies)."""
        now = time.monotonic()
        ran_out = now >= hold_until and not self._survivor_exited(lost)
        if ran_out and self._parked_hosts(finished, lost)[0]:
            return True  # the hosts whose ranks all parked go on: _drop_unparked
        if ran_out or self._survivor_exited(lost) or (not self.parked and now >= hold_until - HOLD_S + FIRST_PARK_S):
            why = "none of them parked" if not self.parked else "not all of them parked"
            self.say(f"the other hosts' ranks are stopped ({why} in {now - hold_until + HOLD_S:.1f} s): "
                     "the next generation restarts them")
            return True
        return False

    def _parked_hosts(self, finished: set[int], lost: Mapping[int, str]) -> tuple[list[Placement], list[Placement]]:
        """The running hosts not lost whose every rank parked (or was killed by a signal,
        not all of them), and the others."""
        ready, stuck = [], []
        for p in self._survivors(lost):
            if p.node_rank in finished or all(r in self.killed for r in p.ranks):
                continue
            parked = all(r in self.killed or (r in self.parked and r not in self.exits) for r in p.ranks)
            (ready if parked else stuck).append(p)
        return (ready, stuck) if stuck else ([], [])

    def _drop_unparked(self, finished: set[int], lost: dict[int, str]) -> bool:
        """At the end of the hold, some ranks not parked (one waiting on something the
        park request did not reach; the stacks it printed say what): their hosts leave
        the generation, their ranks stopped, and join again through the host file; the
        hosts whose every rank parked go on in place — instead of every rank restarting.
        False when no host has every rank parked."""
        ready, stuck = self._parked_hosts(finished, lost)
        if not ready:
            return False
        for p in stuck:
            ranks = [r for r in p.ranks if r not in self.parked and r not in self.killed]
            lost[p.node_rank] = f"rank(s) {', '.join(map(str, ranks))} did not park within {HOLD_S:g} s"
            self.say(f"rank(s) {', '.join(map(str, ranks))} on {p.host.label} did not park within {HOLD_S:g} s: "
                     f"its ranks are stopped and {p.host.label} leaves this generation (it joins again once its "
                     f"daemon answers); {', '.join(q.host.label for q in ready)} go on in place")
        threading.Thread(target=self._cancel, args=(stuck,), daemon=True, name="hapd-launcher-cancel").start()
        return True

    def _stop_on_interrupt(self, finished: set[int], lost: dict[int, str]) -> float:
        """Ctrl-C: stop every host's ranks and take their events up to ``grace_s``; when the stop started."""
        if self.failure is None:
            self.failure = {"kind": "interrupt"}
        self.say("interrupted: stopping all ranks")
        stop_started, deadline = self._stop_all(finished, lost)
        try:
            while len(finished) + len(lost) < len(self.placements) and time.monotonic() < deadline:
                try:
                    kind, p, payload = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                self._handle(kind, p, payload, finished, lost)
        except KeyboardInterrupt:
            self.say("interrupted again: not waiting for the ranks to stop")
        return stop_started

    def _hand_over_held(self, result: JobResult) -> None:
        """The held hosts' pollers joined, where each stopped reading, and the ranks a
        signal killed on each, for the next generation."""
        result.held, result.leftover = list(result.leftover), []
        for p in self.launched:
            gone = [r for r in p.ranks if r in self.killed]
            if gone:
                result.killed[p.host.label] = gone
        for poller in self._pollers:
            if poller.placement.host.label in result.held:
                poller.join(timeout=self.options.lost_after_s + 1)
                result.after[poller.placement.host.label] = poller.after

    def _ping_once(self, finished: set[int], lost: Mapping[int, str]) -> None:
        """Call :attr:`on_failure` once: at the job's first failure, or when a rank first
        parks (its peer went away; the host that died may not have been seen yet)."""
        if self.on_failure is not None and not self._pinged:
            self._pinged = True
            self.on_failure([q for q in self.launched if q.node_rank not in finished and q.node_rank not in lost])

    def _survivors(self, lost: Mapping[int, str]) -> list[Placement]:
        return [p for p in self.launched if p.node_rank not in lost]

    def _holds(self) -> bool:
        """Whether the job's failure leaves the other ranks running while they park (an
        in-place job: a lost host, or a rank killed by a signal)."""
        failure = self.failure or {}
        return self.hold_on_host_loss and (failure.get("kind") == "host" or (
            failure.get("kind") == "rank" and failure.get("rank") in self.killed))

    def _all_parked(self, finished: set[int], lost: Mapping[int, str]) -> bool:
        """Every rank of every host not lost, but those a signal killed, parked and none
        exited (a host finished only when every rank of it was killed)."""
        survivors = self._survivors(lost)
        going = [r for p in survivors for r in p.ranks if r not in self.killed]
        return bool(going) and all(all(r in self.killed for r in p.ranks) for p in survivors if p.node_rank in finished) \
            and all(r in self.parked and r not in self.exits for r in going)

    def _survivor_exited(self, lost: Mapping[int, str]) -> bool:
        return any(r in self.exits and r not in self.killed for p in self._survivors(lost) for r in p.ranks)

    def _flush_tracebacks(self, ranks: Sequence[int]) -> None:
        """Print the held tracebacks of ``ranks`` (once; a repeat of another rank's as one line)."""
        for rank in ranks:
            for line in self.tracebacks.flush(rank):
                if self.options.stream:
                    self._print(f"[rank {rank}] {line}", self.err)

    def _handle(self, kind: str, p: Placement, payload: Any, finished: set[int], lost: dict[int, str]) -> bool:
        """Take one message from a poller; True when it is the job's first failure."""
        if kind == "done":
            finished.add(p.node_rank)
            return False
        if kind == "lost":
            if p.node_rank in lost or p.node_rank in finished:  # said by its poller and by a ping
                return False
            message, answered = payload
            lost[p.node_rank] = message
            first = self.failure is None
            if first:
                self.failed_at = time.time() - (time.monotonic() - answered)
                self.failure = {"kind": "host", "host": p.host.label, "ranks": [p.rank_offset, p.rank_offset + p.nproc - 1],
                                "message": message}
                others = len(self.launched) - len(lost) > 0
                then = "; waiting for the other hosts' ranks to park" if self.hold_on_host_loss else \
                    "; stopping the other hosts' ranks"
                self.say(f"lost the daemon of {p.host.label} (ranks {p.rank_offset}-{p.rank_offset + p.nproc - 1}): {message}"
                         + (then if others else ""))
            self.say(self._lease_note(p, answered))
            return first
        first_failure = False
        for event in payload:
            rank, stream, line = event["rank"], event["stream"], event["line"]
            self.first_output.setdefault(rank, event["time"])
            if event.get("more"):  # a piece of a long line: printed whole when its last piece comes
                self.pieces.setdefault((rank, stream), []).append(line)
                continue
            if (rank, stream) in self.pieces:
                line = "".join(self.pieces.pop((rank, stream))) + line
            if stream == "exit":
                self._flush_tracebacks([rank])
                code = int(line)
                self.exits[rank] = (code, event["time"])
                if code != 0 and (self.failed_at is None or event["time"] < self.failed_at):
                    self.failed_at = float(event["time"])
                if code != 0 and self.hold_on_host_loss and killed_by_signal(code):
                    self.killed.add(rank)
                if code != 0 and self.failure is None:
                    self.failure = {"kind": "rank", "rank": rank, "code": code, "host": p.host.label}
                    then = "waiting for the other ranks to park" if self._holds() else "stopping all ranks"
                    self.say(f"rank {rank} on {p.host.label} exited with code {code}; {then}")
                    first_failure = True
                continue
            line = strip_rank_prefix(line, rank)  # torch's excepthook's "[rankN]: ", a second prefix
            if rank in self.tails:
                self.tails[rank].append(line)
            if stream == "stderr":
                for shown in self.tracebacks.feed(rank, line) or ():
                    if self.options.stream:
                        self._print(f"[rank {rank}] {shown}", self.err)
                continue
            value = self.timings.feed(rank, line) if stream == "stdout" else None
            consumed = value is not None
            if value is not None and value["hapd"] == "elastic" and value.get("event") == "parked":
                self.parked.add(rank)
            elif value is not None and value["hapd"] == "elastic" and rank == 0 and value.get("event") == "paused":
                self.paused = True
            if value is not None and value["hapd"] == "elastic" and rank == 0 and self.on_elastic is not None \
                    and value.get("event") != "parked":
                self.on_elastic(rank, value)
            if self.options.stream and (self.options.verbose or not consumed):
                self._print(f"[rank {rank}] {line}", self.out)
        return first_failure

    def failure_line(self, failure: Mapping[str, Any]) -> str:
        """The closing line of a failed rank: which, where, its exit code and the cause in
        one line (the exception it raised, else its last stderr line)."""
        line = f"job {self.job_id} failed: rank {failure['rank']} on {failure['host']} exited with code {failure['code']}"
        if failure.get("cause"):
            alike = failure.get("alike") or []
            also = f" (ranks {', '.join(map(str, alike))} raised the same)" if len(alike) > 1 else \
                (f" (rank {alike[0]} raised the same)" if alike else "")
            return f"{line}: {failure['cause']}{also}"
        if failure.get("last_line"):
            return f"{line}; its last line on stderr: {failure['last_line'].strip()}"
        return line

    def _lease_note(self, p: Placement, answered: float) -> str:
        """What becomes of the ranks of a host whose daemon stopped answering."""
        left = max(0.0, self.options.lease_s - (time.monotonic() - answered))
        return (f"daemon {p.host.label} stopped answering: this launcher cannot stop ranks "
                f"{p.rank_offset}-{p.rank_offset + p.nproc - 1} there; that daemon stops them itself when the job's lease "
                f"expires, {self.options.lease_s:g} s after the last poll it received (in about {left:.0f} s if it is running)")

    def _stop_all(self, finished: set[int], lost: Mapping[int, str]) -> tuple[float, float]:
        """Cancel every host's ranks, on a thread: a host that died (its daemon not yet
        known lost) keeps its cancel waiting ``timeout_s``, and the events of the others
        (their ranks stopped) must be taken meanwhile. Nothing waits for the thread: the
        hosts' events say when their ranks stopped (:meth:`wait`), and a cancel still
        waiting on a dead host when the launcher exits has nothing left to stop."""
        started = time.monotonic()
        targets = [p for p in self.launched if p.node_rank not in finished and p.node_rank not in lost]
        thread = threading.Thread(target=self._cancel, args=(targets,), daemon=True, name="hapd-launcher-cancel")
        thread.start()
        return started, started + self.options.grace_s

    def _result(self, finished: set[int], lost: Mapping[int, str], stop_started: float | None,
                held: bool = False) -> JobResult:
        result = JobResult(self.job_id, 0, self.world_size, start=self._start_summary(), other=self.timings.other)
        if stop_started is not None:
            result.stopped_s = time.monotonic() - stop_started
        result.leftover = [p.host.label for p in self.placements if p.node_rank not in finished and p.node_rank not in lost]
        result.lost = [p.host.label for p in self.placements if p.node_rank in lost]
        failure = self.failure
        if failure is not None and failure["kind"] == "rank":
            # the first non-zero exit (a rank whose peers died may have been reported first)
            rank, (code, _) = min(((r, c) for r, c in self.exits.items() if c[0] != 0), key=lambda rc: (rc[1][1], rc[0]))
            failure = {**failure, "rank": rank, "code": code, "host": self.rank_host[rank]["host"]}
            result.exit_code = exit_status(code)
        elif failure is not None and failure["kind"] == "host":
            result.exit_code = EXIT_HOST_LOST
        elif failure is not None:
            result.exit_code = EXIT_INTERRUPTED
        elif held:
            result.paused = True  # every rank parked at the pause, left running
        elif len(self.exits) < self.world_size or any(c != 0 for c, _ in self.exits.values()):
            result.exit_code = EXIT_HOST_LOST  # should not happen: a host finished without its exits
            failure = {"kind": "host", "message": f"exits of ranks {sorted(set(range(self.world_size)) - set(self.exits))} never arrived"}
        if failure is not None:
            rank = failure.get("rank", -1)
            failure = {**failure, "tail": list(self.tails.get(rank, []))}
            if failure["kind"] == "rank":
                failure["cause"] = self.tracebacks.cause(rank)
                failure["alike"] = self.tracebacks.alike(rank)
                failure["last_line"] = self.tracebacks.last_line.get(rank)
        result.failure = failure
        return result

    def _start_summary(self) -> dict[str, Any]:
        info = dict(self.start_info)
        if self.first_output:
            times = list(self.first_output.values())
            info["first_output"] = {str(r): t for r, t in sorted(self.first_output.items())}
            info["first_output_skew_s"] = max(times) - min(times)
        return info

    def close(self) -> None:
        for poller in self._pollers:
            poller.quit.set()
        for client in self.control.values():
            client.close()
        for poller in self._pollers:
            poller.join(timeout=self.options.lost_after_s + 1)
            poller.client.close()

    # -- the end

    def _stopped_note(self, result: JobResult) -> str:
        """How far the stop got: only what the daemons reported."""
        if result.leftover:
            return (f"after {result.stopped_s:.1f} s these hosts had not reported their ranks stopped: "
                    f"{', '.join(result.leftover)}")
        if not result.lost:
            return f"all ranks stopped {result.stopped_s:.2f} s after the cancel"
        left_to_lease = (f"the ranks on {', '.join(result.lost)} are left to the job's lease there ({self.options.lease_s:g} s "
                         "without a poll), not stopped by this launcher")
        if len(result.lost) < len(self.placements):
            return f"the other hosts' ranks stopped {result.stopped_s:.2f} s after the cancel; {left_to_lease}"
        return left_to_lease

    def finish(self, result: JobResult) -> JobResult:
        """Print the failure (if any) and the timing table; write the JSON report."""
        failure = result.failure
        if failure is not None:
            if failure["kind"] == "rank":
                self.say(self.failure_line(failure))
                if failure["tail"] and not self.options.stream:  # streamed: on the screen already
                    self.say(f"last {len(failure['tail'])} line(s) of rank {failure['rank']}:")
                    for line in failure["tail"]:
                        print(f"    [rank {failure['rank']}] {line}", file=self.err, flush=True)
            elif failure["kind"] == "host":
                self.say(f"job {self.job_id} failed: {failure.get('host', 'a host')}: {failure['message']}")
            if result.stopped_s is not None:
                self.say(self._stopped_note(result))
        report = build_report(
            self.timings, job=self.job_id, script=str(self.options.script), args=self.options.args, world_size=self.world_size,
            placement=[p.describe() for p in self.placements], rank_hosts=self.rank_host, exit_code=result.exit_code,
            failure=failure, start=result.start,
        )
        result.report = report
        if report["ranks"]:
            print(format_table(report), file=self.out, flush=True)
        path = self.options.report or home_dir() / "runs" / f"{self.job_id}.json"
        try:
            result.report_path = write_report(report, path)
            self.say(f"report: {result.report_path}")
        except OSError as exc:
            self.say(f"could not write the report to {path}: {exc}")
        return result


def run_job(hosts: Sequence[Host] | None, options: JobOptions, *, out: TextIO | None = None, err: TextIO | None = None,
            launcher_start: float | None = None, on_started: Callable[[Job], None] | None = None,
            runner: Callable[[Sequence[Host], JobOptions], JobResult] | None = None) -> JobResult:
    """Run a job on ``hosts`` (None: this machine, through the default daemon, or a
    private one started for the job and stopped afterwards). Raises :class:`LaunchError`
    or :class:`OptionsError` when it cannot start (nothing is left running); otherwise
    returns how it ended (also after Ctrl-C: ``failure.kind == "interrupt"``).
    ``runner(hosts, options)`` runs the job instead of one :class:`Job` (an elastic
    job's generations, :class:`launcher.elastic.ElasticRun`)."""
    launcher_start = launcher_start or time.time()
    err_stream = err or sys.stderr
    local: LocalDaemon | None = None
    try:
        if hosts is None:
            k = options.nproc_per_node or 1
            options = _replace(options, nproc_per_node=k)
            crowded = crowded_cores(k, usable_cores())
            if crowded is not None:
                print(f"hapd launcher: {crowded}", file=err_stream, flush=True)
            address = local_daemon_answers(options.key_file)
            if address is not None:
                host_part, _, port = address.removeprefix("tcp://").rpartition(":")
                hosts = [Host(name=host_part.strip("[]"), slots=k, port=int(port))]
            else:
                if not options.script.is_file():  # before starting a daemon for nothing
                    raise OptionsError(f"script {options.script} not found", field="script")
                local = start_local_daemon(max(k, os.cpu_count() or 1),
                                           lambda text: print(f"hapd launcher: {text}", file=err_stream, flush=True))
                print(f"hapd launcher: no daemon answered at {default_address()}; started one at {local.address} "
                      f"(state {local.home}, plan cache {local.cache}, stopped when the job ends)", file=err_stream,
                      flush=True)
                options = _replace(options, key_file=local.key_file)
                hosts = [local.host()]
        if runner is not None:
            return runner(hosts, options)
        job = Job(hosts, options, out=out, err=err, launcher_start=launcher_start)
        try:
            job.start()
            if on_started is not None:
                on_started(job)
            result = job.wait()
        finally:
            job.close()
        return job.finish(result)
    finally:
        if local is not None:
            local.stop()


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system says it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def crowded_cores(ranks: int, cores: int) -> str | None:
    """The warning for ``ranks`` local CPU ranks on ``cores`` cores when they outnumber
    them (each rank's share of a core slows every step past the plan's prediction, which
    prices a whole device per rank); None otherwise."""
    if ranks <= cores:
        return None
    return (f"{ranks} ranks on this machine's {cores} CPU core(s): ranks share cores, so steps run slower than the "
            f"plan predicts (it prices one device per rank); use -n {cores} or fewer for timings that mean something")


def _replace(options: JobOptions, **changes: Any) -> JobOptions:
    from dataclasses import replace

    return replace(options, **changes)
