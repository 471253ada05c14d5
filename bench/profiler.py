"""What ``hapd profile`` measures on emulated hardware whose speed is known (DESIGN.md §5),
printed as measured / expected ratios.

    .venv/bin/python bench/profiler.py               # both measurements (about a minute)
    .venv/bin/python bench/profiler.py --only cpu    # or: --only link

- **device speed**: the profiler's single-thread ``flops`` (``linear_flops``, sampled
  over windows several cfs periods long) in a cpu cgroup allowed 50 ms of CPU per
  100 ms, over the same loop free. Expected ratio 0.5. Each side is the best of two
  alternating runs, so a burst of other load on the machine (which slows the free run
  too) does not decide the ratio.
- **link rate**: two ranks, one per network namespace, profile across a veth pair whose
  ends tbf shapes to R = 100 Mbit/s (12.5 MB/s each way). β counts bytes of the full
  tensor (B) per second, so for 2 ranks:

  * broadcast sends B one way: t ≈ B/R, β ≈ R;
  * all-reduce (Gloo's ring: reduce-scatter, then all-gather of the halves) sends B/2
    twice each way, both ways at once: t ≈ B/R, β ≈ R;
  * all-gather sends B/2 each way: β ≈ 2R if both ways overlap fully, R if they take
    turns; Gloo's TCP pairs overlap them only in part;
  * all-to-all sends B/4 each way: β ≈ 4R overlapped, 2R in turns.

  TCP/IP and Ethernet headers take ~4 % of the line rate.

Needs root (cgroups, ``ip netns``, ``tc``); a measurement the machine cannot do is
skipped with the reason. :func:`shaped_veth` and :func:`profile_across` are also used
by ``tests/profile/test_profiler.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hapd.profile.schema import COLLECTIVES, load_profile  # noqa: E402


class Unavailable(Exception):
    """This machine cannot emulate the hardware; the message says why."""


# ----------------------------------------------------------------------------- device speed


@dataclass(frozen=True)
class CpuCgroup:
    """A child cpu cgroup; ``procs`` is where a pid is written to move a process in."""

    path: Path
    version: int

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"


def _cpu_hierarchy() -> tuple[Path, int] | None:
    """(mount point, version) of a cgroup hierarchy with the cpu controller, v2 first."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[Path, int]] = []
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = Path(fields[4])
        if tail[0] == "cgroup2":
            try:
                if "cpu" in (point / "cgroup.controllers").read_text().split():
                    found.append((point, 2))
            except OSError:
                pass
        elif tail[0] == "cgroup" and "cpu" in tail[2].split(","):
            found.append((point, 1))
    return min(found, key=lambda f: -f[1]) if found else None


@contextlib.contextmanager
def half_cpu_cgroup() -> Iterator[CpuCgroup]:
    """A cpu cgroup allowed 50 ms of CPU per 100 ms, with a high weight so that other
    work on the machine does not starve it below its quota; removed afterwards."""
    if os.geteuid() != 0:
        raise Unavailable("needs root to create a cgroup")
    hierarchy = _cpu_hierarchy()
    if hierarchy is None:
        raise Unavailable("no cgroup hierarchy with the cpu controller is mounted")
    mount, version = hierarchy
    path = mount / f"hapd-bench-{os.getpid()}"
    try:
        if version == 2:
            (mount / "cgroup.subtree_control").write_text("+cpu")
        path.mkdir()
    except OSError as exc:
        raise Unavailable(f"cannot create a cpu cgroup under {mount}: {exc}") from exc
    try:
        if version == 2:
            (path / "cpu.max").write_text("50000 100000")
            (path / "cpu.weight").write_text("10000")
        else:
            (path / "cpu.cfs_period_us").write_text("100000")
            (path / "cpu.cfs_quota_us").write_text("50000")
            (path / "cpu.shares").write_text("262144")
        yield CpuCgroup(path, version)
    finally:
        _remove_cgroup(path, mount)


def _remove_cgroup(path: Path, mount: Path) -> None:
    """Move any process left in ``path`` back to the top and remove it."""
    for _ in range(50):
        try:
            for pid in (path / "cgroup.procs").read_text().split():
                try:
                    (mount / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"could not remove the cgroup {path}")


_FLOPS_LOOP = """
import os, sys, torch
from hapd.profiler.measure import linear_flops
torch.set_num_threads(1)
os.setpriority(os.PRIO_PROCESS, 0, -20)  # root: other work on the machine barely slows it
if len(sys.argv) > 1:
    open(sys.argv[1], "w").write(str(os.getpid()))  # moves every thread of this process
rate, _ = linear_flops(torch.device("cpu"), torch.float32, (384,), 128, repeats=3, window_s=0.6)
print(rate)
"""


def single_thread_flops(procs: Path | None) -> float:
    """The profiler's ``flops`` of one single-threaded process, moved into the
    cgroup whose ``cgroup.procs`` is ``procs`` (if given) before it measures."""
    cmd = [sys.executable, "-c", _FLOPS_LOOP, *([str(procs)] if procs else [])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"the flops loop failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.split()[-1])


def quota_ratio(group: CpuCgroup) -> dict[str, float]:
    """Measured FLOP/s free and in ``group`` (each the best of two alternating runs)."""
    free = limited = 0.0
    for _ in range(2):
        free = max(free, single_thread_flops(None))
        limited = max(limited, single_thread_flops(group.procs))
    return {"free": free, "limited": limited, "ratio": limited / free, "expected": 0.5}


# ----------------------------------------------------------------------------- link rate


RATE_BYTES_S = 100e6 / 8
"""The emulated link: ``tbf rate 100mbit``, each direction."""

EXPECTED_BETA = {"broadcast": "1", "all_reduce": "1", "all_gather": "1–2", "all_to_all": "2–4"}
"""β / R each collective should measure across the link (see the module docstring)."""


@dataclass(frozen=True)
class VethLink:
    """Two emulated hosts: this namespace (``a``) and ``ns`` (``b``) joined by a veth."""

    ns: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@contextlib.contextmanager
def shaped_veth() -> Iterator[VethLink]:
    """A network namespace joined to this one by a veth pair, both ends shaped to
    100 Mbit/s by tbf; deleted afterwards (deleting the namespace deletes its end, and
    with it the pair and both qdiscs)."""
    if os.geteuid() != 0:
        raise Unavailable("needs root for network namespaces and tc")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        raise Unavailable("needs iproute2 (ip, tc)")
    tag = os.getpid() % 100000
    subnet = 10 + tag % 200  # a private /24 per process: 10.233.N.0/24
    link = VethLink(ns=f"hapd-tc-{tag}", dev_a=f"hpd{tag}a", dev_b=f"hpd{tag}b",
                    addr_a=f"10.233.{subnet}.1", addr_b=f"10.233.{subnet}.2")
    made = _ip("netns", "add", link.ns, check=False)
    if made.returncode != 0:
        raise Unavailable(f"ip netns add failed: {made.stderr.strip()}")
    try:
        steps = [
            ["ip", "link", "add", link.dev_a, "type", "veth", "peer", "name", link.dev_b],
            ["ip", "link", "set", link.dev_b, "netns", link.ns],
            ["ip", "addr", "add", f"{link.addr_a}/24", "dev", link.dev_a],
            ["ip", "link", "set", link.dev_a, "up"],
            ["ip", "-n", link.ns, "addr", "add", f"{link.addr_b}/24", "dev", link.dev_b],
            ["ip", "-n", link.ns, "link", "set", link.dev_b, "up"],
            ["ip", "-n", link.ns, "link", "set", "lo", "up"],
        ]
        for dev, prefix in ((link.dev_a, []), (link.dev_b, ["ip", "netns", "exec", link.ns])):
            steps.append([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "100mbit",
                          "burst", "32kbit", "latency", "400ms"])
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                raise Unavailable(f"{' '.join(step)} failed: {done.stderr.strip()}")
        yield link
    finally:
        _ip("link", "del", link.dev_a, check=False)
        _ip("netns", "del", link.ns, check=False)
        if link.ns in _ip("netns", "list").stdout:
            raise RuntimeError(f"could not delete the network namespace {link.ns}")


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RankRun:
    """How one profiler rank ended: its exit status and its output."""

    returncode: int
    output: str


def profile_across(link: VethLink, out: Path, timeout: float = 120.0) -> list[RankRun]:
    """``hapd profile --quick`` on two ranks, one per end of ``link`` (hosts ``emu-a``
    and ``emu-b``), writing the profile ``emulated-2`` to ``out``."""
    port = _free_port(link.addr_a)
    args = [sys.executable, "-m", "hapd.profiler", "--quick", "--sizes", "64K,256K,1M", "--repeats", "3",
            "--out", str(out), "--name", "emulated-2"]
    common = {**os.environ, "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
              "MASTER_ADDR": link.addr_a, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**common, "RANK": "0", "HAPD_HOST": "emu-a", "GLOO_SOCKET_IFNAME": link.dev_a}),
        subprocess.Popen(["ip", "netns", "exec", link.ns, *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env={**common, "RANK": "1", "HAPD_HOST": "emu-b", "GLOO_SOCKET_IFNAME": link.dev_b}),
    ]
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [RankRun(p.returncode, output) for p, output in zip(ranks, outputs)]


def link_betas(link: VethLink) -> dict[str, float]:
    """β / R of every collective, profiled across ``link``."""
    with tempfile.TemporaryDirectory(prefix="hapd-bench-profiler-") as tmp:
        out = Path(tmp) / "emulated.json"
        runs = profile_across(link, out)
        if any(run.returncode != 0 for run in runs):
            raise RuntimeError("the profiler failed:\n" + "\n".join(run.output[-2000:] for run in runs))
        profile = load_profile(out, world_size=2)
    return {name: profile.collectives[name]["inter"].beta / RATE_BYTES_S for name in COLLECTIVES}


# ----------------------------------------------------------------------------- the benchmark


def bench_cpu() -> dict[str, float]:
    """The quota measurement, printed."""
    with half_cpu_cgroup() as group:
        result = quota_ratio(group)
    print(f"device speed (cgroup v{group.version}, 50 ms per 100 ms): quota-limited {result['limited']:.3g} / "
          f"free {result['free']:.3g} FLOP/s = {result['ratio']:.2f} (expected {result['expected']:.2f})")
    return result


def bench_link() -> dict[str, float]:
    """The link measurement, printed."""
    with shaped_veth() as link:
        betas = link_betas(link)
    print(f"link rate (tbf 100 Mbit/s, R = {RATE_BYTES_S / 1e6:.1f} MB/s each way): β / R")
    for name, ratio in betas.items():
        print(f"  {name:<22} {ratio:5.2f}   expected {EXPECTED_BETA.get(name, '-')}")
    return betas


def run_or_skip(what: str, measure: Callable[[], dict[str, float]]) -> dict[str, float] | str:
    """``measure()``; where this machine cannot emulate the hardware, the reason, printed."""
    try:
        return measure()
    except Unavailable as why:
        print(f"{what}: skipped ({why})")
        return str(why)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", choices=("cpu", "link"), help="one measurement only")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "profiler.json")
    args = parser.parse_args()
    results = {}
    if args.only in (None, "cpu"):
        results["cpu"] = run_or_skip("device speed", bench_cpu)
    if args.only in (None, "link"):
        results["link"] = run_or_skip("link rate", bench_link)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
