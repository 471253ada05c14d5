"""Launcher start-up: how soon ``./run_all`` has every rank running, and how far apart
the ranks start.

    .venv/bin/python bench/launcher.py                 # 4 namespace hosts × 2 ranks, 5 runs
    .venv/bin/python bench/launcher.py --hosts 2 --ranks 4 --runs 10
    .venv/bin/python bench/launcher.py --worker        # also one real worker.py job (mlp)

Emulated cluster (DESIGN.md §5): one network namespace per host, joined to the root
namespace by a veth pair on a bridge (one address each, 10.77.N.2…), one ``hapd serve``
per namespace bound to its address; the launcher runs in the root namespace. Without
root or ``ip netns`` the hosts are daemons on loopback ports instead (said in the output).

Each run starts ``./run_all PROBE K --hosts FILE`` as a subprocess (bash shim, Python
start-up, the checks, the synchronized launch: all included) at ``t0``. The probe script's
first statement records ``time.time()``; it also reads its own creation time from
``/proc/self/stat`` (clock ticks since boot, 10 ms resolution, converted with
``CLOCK_BOOTTIME``) and prints both as a ``{"hapd": "started"}`` line. Reported, median
and worst over the runs:

- **to all running**: ``max over ranks(created) − t0`` (the daemons have started every
  rank's process) and ``max(first statement) − t0`` (every interpreter is running the
  script);
- **start skew**: ``max − min`` over the ranks of the creation times, and of the
  first-statement times. The creation skew is what the synchronized start controls; the
  first-statement skew adds the interpreters' start-up competing for the CPU cores
  (8 interpreters on 2 cores here).

Targets (issue): to all running ≤ 2 s, skew ≤ 50 ms. All hosts share this machine's
clock, so cross-host skews need no clock correction.

:class:`NamespaceCluster` and :class:`LoopbackCluster` are also used by
``tests/launcher/test_launcher.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hapd.wire.keys import load_or_create_key  # noqa: E402
from hapd.util import summarize  # noqa: E402

PROBE = '''\
import time
t0 = time.time()
import json, os
with open("/proc/self/stat") as f:
    ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time, clock ticks since boot
created = time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
print(json.dumps({"hapd": "started", "rank": int(os.environ["RANK"]), "time": t0, "created": created}), flush=True)
'''


# ----------------------------------------------------------------------------- emulated clusters


class _Daemons:
    """Daemons started as subprocesses; ``addresses`` and ``host_lines`` describe them."""

    def __init__(self, workdir: Path, n: int, slots: int) -> None:
        self.workdir, self.n, self.slots = Path(workdir), n, slots
        self.key_file = self.workdir / "key"
        load_or_create_key(self.key_file)
        self.procs: list[subprocess.Popen | None] = [None] * n
        self.homes = [self.workdir / f"daemon{i}" for i in range(n)]
        self.addresses: list[str] = [""] * n
        self.daemon_args: tuple[str, ...] = ()
        """Further ``hapd serve`` options of every daemon (``--standby 2``, say)."""

    def _command(self, i: int) -> list[str]:
        raise NotImplementedError

    def _bind(self, i: int) -> str:
        raise NotImplementedError

    def start_daemon(self, i: int, timeout: float = 60.0) -> None:
        home = self.homes[i]
        home.mkdir(parents=True, exist_ok=True)
        (home / "daemon.json").unlink(missing_ok=True)
        with open(home / "stderr.txt", "ab") as log:
            self.procs[i] = subprocess.Popen(
                [*self._command(i), sys.executable, "-m", "hapd.cli", "serve", "--state", str(home), "--bind", self._bind(i),
                 "--key", str(self.key_file), "--slots", str(self.slots), "--log-level", "info",
                 *self.daemon_args],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, cwd=ROOT)
        self._wait(i, timeout)

    def _wait(self, i: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        proc = self.procs[i]
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon {i} exited with {proc.returncode}:\n{self.log(i)[-3000:]}")
            try:
                info = json.loads((self.homes[i] / "daemon.json").read_text())
            except (OSError, ValueError):
                time.sleep(0.02)
                continue
            if info.get("pid") == proc.pid:
                self.addresses[i] = info["address"]
                return
            time.sleep(0.02)
        raise RuntimeError(f"daemon {i} did not start within {timeout} s:\n{self.log(i)[-3000:]}")

    def start(self) -> "_Daemons":
        for i in range(self.n):
            self.start_daemon(i)
        return self

    def log(self, i: int) -> str:
        text = ""
        for name in ("stderr.txt", "logs/daemon.log"):
            try:
                text += (self.homes[i] / name).read_text(errors="replace")
            except OSError:
                pass
        return text

    def host_name(self, i: int) -> str:
        return re.match(r"tcp://\[?([^\]]+?)\]?:(\d+)$", self.addresses[i]).group(1)

    def port(self, i: int) -> int:
        return int(self.addresses[i].rsplit(":", 1)[1])

    def host_lines(self, slots: Sequence[int] | None = None, gpus: Sequence[str] | None = None) -> str:
        lines = []
        for i in range(self.n):
            gpu = f" gpu={gpus[i]}" if gpus else ""
            lines.append(f"{self.host_name(i)} slots={slots[i] if slots else self.slots} port={self.port(i)}{gpu}")
        return "\n".join(lines) + "\n"

    def stop_daemon(self, i: int) -> None:
        proc = self.procs[i]
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def stop(self) -> None:
        for i in range(self.n):
            self.stop_daemon(i)


class LoopbackCluster(_Daemons):
    """``n`` daemons on 127.0.0.1, each on its own free port."""

    def __init__(self, workdir: Path, n: int, slots: int) -> None:
        super().__init__(workdir, n, slots)
        self.env: dict[str, str] = {}
        """Environment the launcher should give the ranks (none needed on loopback)."""

    def _command(self, i: int) -> list[str]:
        return []

    def _bind(self, i: int) -> str:
        return "tcp://127.0.0.1:*"

    def close(self) -> None:
        self.stop()


class NamespaceCluster(_Daemons):
    """``n`` network namespaces ``hapd-lTAG-i`` on a bridge ``hlTAGbr`` (10.77.N.1/24 in
    the root namespace), host ``i`` at 10.77.N.(i+2) on an interface named ``hapd0`` in
    every namespace (so ``GLOO_SOCKET_IFNAME=hapd0`` is right on all of them), one daemon
    per namespace on port 5557. :meth:`shape` limits each host's link with ``tc … tbf``.
    :meth:`create` raises :class:`RuntimeError` with the reason when namespaces cannot be
    made here; :meth:`close` removes everything."""

    IFNAME = "hapd0"
    PORT = 5557

    def __init__(self, workdir: Path, n: int, slots: int, tag: int | None = None) -> None:
        super().__init__(workdir, n, slots)
        self.tag = (os.getpid() if tag is None else tag) % 10000
        self.subnet = f"10.77.{20 + self.tag % 200}"
        self.namespaces = [f"hapd-l{self.tag}-{i}" for i in range(n)]
        self.bridge = f"hl{self.tag}br"
        self.ips = [f"{self.subnet}.{i + 2}" for i in range(n)]
        self.made: list[str] = []
        self.env = {"GLOO_SOCKET_IFNAME": self.IFNAME}

    @staticmethod
    def available() -> str | None:
        """None when namespaces can be made here, else why not."""
        if os.geteuid() != 0:
            return "needs root for network namespaces"
        if shutil.which("ip") is None:
            return "needs iproute2 (ip)"
        return None

    def _run(self, *cmd: str) -> None:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")

    def create(self) -> "NamespaceCluster":
        why = self.available()
        if why:
            raise RuntimeError(why)
        try:
            self._run("ip", "link", "add", self.bridge, "type", "bridge")
            self.made.append("bridge")
            self._run("ip", "addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            self._run("ip", "link", "set", self.bridge, "up")
            for i, ns in enumerate(self.namespaces):
                self._run("ip", "netns", "add", ns)
                self.made.append(ns)
                outer, inner = f"hl{self.tag}r{i}", f"hl{self.tag}n{i}"
                self._run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
                self._run("ip", "link", "set", inner, "netns", ns)
                self._run("ip", "-n", ns, "link", "set", inner, "name", self.IFNAME)
                self._run("ip", "-n", ns, "addr", "add", f"{self.ips[i]}/24", "dev", self.IFNAME)
                self._run("ip", "-n", ns, "link", "set", self.IFNAME, "up")
                self._run("ip", "-n", ns, "link", "set", "lo", "up")
                self._run("ip", "link", "set", outer, "master", self.bridge)
                self._run("ip", "link", "set", outer, "up")
        except BaseException:
            self.close()
            raise
        return self

    def shape(self, rate_mbit: float) -> None:
        """tbf on each namespace's interface: what the host sends goes at ``rate_mbit``
        (Mbit/s); traffic inside a namespace (loopback) is not shaped."""
        if not (rate_mbit > 0 and math.isfinite(rate_mbit)):
            raise ValueError(f"link rate {rate_mbit!r} Mbit/s must be a positive number")
        rate_kbit = max(1, int(rate_mbit * 1000))
        burst = max(16 * 1024, int(rate_mbit * 1e6 / 8 / 250))  # ≥ 4 ms at rate
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", self.IFNAME, "root"],
                           capture_output=True)
            self._run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.IFNAME, "root", "tbf",
                      "rate", f"{rate_kbit}kbit", "burst", str(burst), "latency", "200ms")

    def _command(self, i: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[i]]

    def _bind(self, i: int) -> str:
        return f"tcp://{self.ips[i]}:{self.PORT}"

    def close(self) -> None:
        self.stop()
        for ns in self.namespaces:
            if ns in self.made:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        for i in range(self.n):
            subprocess.run(["ip", "link", "del", f"hl{self.tag}r{i}"], capture_output=True, timeout=30)
        if "bridge" in self.made:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
        self.made.clear()


def remove_cgroup(group: Path, root: Path, tries: int = 20) -> bool:
    """Move what is left in the cgroup-v1 ``group`` to ``root`` and remove it, retrying
    while the kernel still frees a killed process; whether it is gone (the cluster
    benches' teardown)."""
    for _ in range(tries):
        try:
            pids = [p for p in (group / "cgroup.procs").read_text().split() if p]
        except OSError:
            pids = []
        for pid in pids:
            try:
                (root / "cgroup.procs").write_text(f"{pid}\n")
            except OSError:
                pass
        try:
            group.rmdir()
            return True
        except OSError:
            time.sleep(0.25)
    return False


def make_cluster(workdir: Path, n: int, slots: int, *, namespaces: bool = True) -> tuple[_Daemons, str]:
    """A started cluster and what it is (falls back to loopback daemons)."""
    if namespaces:
        cluster = NamespaceCluster(workdir, n, slots)
        try:
            cluster.create()
            cluster.start()
            return cluster, f"{n} network namespaces on a bridge ({cluster.subnet}.0/24), one daemon each"
        except RuntimeError as exc:
            cluster.close()
            reason = str(exc)
    else:
        reason = "asked for loopback"
    cluster = LoopbackCluster(workdir, n, slots).start()
    return cluster, f"{n} daemons on loopback ports (namespaces unavailable: {reason})"


# ----------------------------------------------------------------------------- the benchmark


def one_run(probe: Path, hostfile: Path, k: int, env: dict[str, str], report: Path) -> dict[str, float]:
    cmd = [str(ROOT / "run_all"), str(probe), str(k), "-v", "--hosts", str(hostfile), "--report", str(report)]
    cmd += ["--key", env["HAPD_KEY_FILE"]]
    for key, value in env.items():
        if key != "HAPD_KEY_FILE":
            cmd += ["--env", f"{key}={value}"]
    t0 = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    wall = time.time() - t0
    if done.returncode != 0:
        raise SystemExit(f"run_all exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    started = {}
    for line in done.stdout.splitlines():
        m = re.match(r"\[rank (\d+)\] (\{.*\"started\".*\})$", line)
        if m:
            value = json.loads(m.group(2))
            started[value["rank"]] = value
    info = json.loads(report.read_text())
    world = info["world_size"]
    if sorted(started) != list(range(world)):
        raise SystemExit(f"start lines from ranks {sorted(started)} of {world}:\n{done.stdout[-2000:]}")
    created = [v["created"] for v in started.values()]
    first = [v["time"] for v in started.values()]
    start = info["start"]
    return {
        "to_created_s": max(created) - t0,
        "to_first_statement_s": max(first) - t0,
        "skew_created_s": max(created) - min(created),
        "skew_first_statement_s": max(first) - min(first),
        "to_checked_s": start["checked"] - t0,
        "start_at_after_t0_s": start["start_at"] - t0,
        "launched_before_start_at_s": start["start_at"] - start["launched"],
        "wall_s": wall,
    }


def worker_run(hostfile: Path, k: int, env: dict[str, str], report: Path) -> str:
    cmd = [str(ROOT / "run_all"), "worker.py", str(k), "--hosts", str(hostfile), "--report", str(report), "--quiet",
           "--key", env["HAPD_KEY_FILE"]]
    for key, value in env.items():
        if key != "HAPD_KEY_FILE":
            cmd += ["--env", f"{key}={value}"]
    cmd += ["--", "--model", "mlp", "--iterations", "6", "--warmup", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"worker job exited with {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=4, help="emulated hosts (default 4)")
    parser.add_argument("--ranks", type=int, default=2, help="ranks per host (default 2)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs (default 5)")
    parser.add_argument("--loopback", action="store_true", help="daemons on loopback ports, no namespaces")
    parser.add_argument("--worker", action="store_true", help="also run worker.py (mlp) across the cluster once")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "launcher.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="hapd-bench-launcher-") as tmp:
        work = Path(tmp)
        probe = work / "probe.py"
        probe.write_text(PROBE)
        cluster, what = make_cluster(work, args.hosts, args.ranks, namespaces=not args.loopback)
        try:
            print(f"cluster: {what}; {args.hosts} hosts × {args.ranks} ranks")
            hostfile = work / "hosts.txt"
            hostfile.write_text(cluster.host_lines())
            env = dict(cluster.env)
            env["HAPD_KEY_FILE"] = str(cluster.key_file)
            one_run(probe, hostfile, args.ranks, env, work / "warmup.json")  # warm-up: page cache, daemons' imports
            runs = [one_run(probe, hostfile, args.ranks, env, work / f"run{i}.json") for i in range(args.runs)]
            worker_table = worker_run(hostfile, args.ranks, env, work / "worker.json") if args.worker else None
        finally:
            cluster.close()

    def stat(key: str) -> dict[str, float]:
        s = summarize(r[key] for r in runs)
        return {"median": s.median, "max": s.max, "min": s.min}

    keys = ["to_checked_s", "start_at_after_t0_s", "to_created_s", "to_first_statement_s", "skew_created_s",
            "skew_first_statement_s", "launched_before_start_at_s", "wall_s"]
    stats = {k: stat(k) for k in keys}
    labels = {
        "to_checked_s": "run_all start → every daemon checked",
        "start_at_after_t0_s": "run_all start → start_at",
        "to_created_s": "run_all start → all rank processes created",
        "to_first_statement_s": "run_all start → all ranks' first statement",
        "skew_created_s": "start skew (process creation)",
        "skew_first_statement_s": "start skew (first statement)",
        "launched_before_start_at_s": "last launch acknowledged before start_at",
        "wall_s": "whole run_all (probe job, report)",
    }
    print(f"{args.runs} runs (after 1 warm-up), median / worst:")
    for k in keys:
        s = stats[k]
        worst = s["min"] if k == "launched_before_start_at_s" else s["max"]
        print(f"  {labels[k]:<46} {s['median'] * 1e3:8.1f} ms / {worst * 1e3:8.1f} ms")
    running, skew = stats["to_created_s"]["max"], stats["skew_created_s"]["max"]
    skew_first = stats["skew_first_statement_s"]["max"]
    print(f"target: all ranks running ≤ 2 s after run_all starts: worst {running:.3f} s "
          f"({'met' if running <= 2.0 else 'MISSED'}; first statement {stats['to_first_statement_s']['max']:.3f} s)")
    print(f"target: start skew ≤ 50 ms: worst {skew * 1e3:.1f} ms by process creation ({'met' if skew <= 0.05 else 'MISSED'}), "
          f"{skew_first * 1e3:.1f} ms by first statement ({'met' if skew_first <= 0.05 else 'MISSED'})")
    if worker_table:
        print("worker.py --model mlp across the cluster:")
        print("\n".join(line for line in worker_table.splitlines() if not line.startswith("[rank")))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"cluster": what, "hosts": args.hosts, "ranks_per_host": args.ranks, "runs": runs,
                                     "stats": stats}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
