#!/usr/bin/env python3
"""hapd vs DDP vs FSDP on ranks with their own memory limits: the largest model each trains.

    .venv/bin/python bench/memory_cluster.py              # the sweep (~15 min on 2 cores)
    .venv/bin/python bench/memory_cluster.py --sizes 512,768 --no-raw-check --no-timing   # a smoke run
    .venv/bin/python bench/memory_cluster.py --from-json bench/out/memory_cluster.json      # re-print

Needs root and the cgroup v1 cpu and memory controllers; without them it says why and
exits 0.

**The cluster.** 4 ranks on this machine (plain localhost: ``torch.distributed.run``,
Gloo over loopback, no emulated link), each in its own cpu and memory cgroup
(``bench/in_cgroup.py`` moves the rank there before it imports anything):

- ranks 0 and 1 are "fast": 0.75 of a core (CFS quota, period 10 ms) and 2 GiB;
- ranks 2 and 3 are "slow": 0.25 of a core and 1 GiB (``--fast-gib``, ``--slow-gib``);
- ``memory.limit_in_bytes`` and ``memory.memsw.limit_in_bytes`` are both set (no swap
  escape); a rank that passes its limit is killed by the kernel's OOM killer (signal 9,
  exit 137), counted in its cgroup's ``memory.oom_control`` (``oom_kill``), which is how
  this script tells an out-of-memory rank from any other failure, by rank.

**The allocator.** Every rank of every system runs with glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB (``--mmap-threshold-kib``): a freed tensor's
memory goes back to the kernel. Under glibc's own sliding threshold, freed blocks of up
to 32 MiB stay in the heap, and a rank's resident memory drifts far above its live
tensors: FSDP's gathered parameters, freed after each unit, held ~1.09 GiB per rank
at width 768 where they hold 0.61 GiB with the fixed threshold.

**The profile.** hapd's profiler runs on the 4 ranks in their cgroups and reports each
rank's memory: its cgroup's limit (capped by ``MemAvailable``), 2, 2, 1, 1 GiB. That is
not what a rank's tensors can use: the rank's process itself (Python, torch, the
export and compile machinery, Gloo, the allocator's slack) holds 300-500 MiB that
hapd's memory model (``rustcore/core/src/memory.rs``) does not count. So the profile
hapd compiles against is assembled from the measured one: each rank's memory is its
limit less a **reserve**, the largest (peak − predicted peak) of a calibration run
(hapd on the smallest model, every rank) plus ``--margin-mib``. The raw check shows what
happens without it: from the first size the reserved profile refuses, upward, hapd
compiles against the profiler's raw limits and runs, until a size fails (a rank
OOM-killed: the plan fit the limits the profile gave, the process did not).

**The sweep.** hapd's Llama (``llama_block``: 4 blocks, vocabulary 4096, sequence 32,
global batch 8) at widths ``--sizes`` (heads of 64, SwiGLU width 8/3 of the model's),
upward; each system (hapd: ``worker.py --init meta`` with the reserved profile; DDP:
``ddp.py`` even split; FSDP: ``fsdp.py --init meta``, FULL_SHARD) runs ``--iterations``
Adam steps per size until it fails (out of memory, or for hapd no plan that fits); the
largest size it trained is its result. Then hapd and FSDP run again at FSDP's largest
size for ``--timing-iterations`` (one after the other, in this run), with FSDP-CP beside
them (FSDP with the batch split by the profile's FLOP/s: ``fsdp.py --split flops``), and
hapd's speed-up over each is printed.

Prints progress as it goes and a table at the end; writes ``bench/out/memory_cluster.json``
and every job's output to ``bench/out/memory_cluster_logs/``.
Cgroups are removed at the end, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
OUT = ROOT / "bench" / "out"
CPU_ROOT = Path("/sys/fs/cgroup/cpu")
MEMORY_ROOT = Path("/sys/fs/cgroup/memory")
GROUP_PREFIX = "hapd-m-r"
PERIOD_US = 10_000
SHARES = 8192
MiB, GiB = 2**20, 2**30

MODEL = "llama_block"
SEQ, BATCH, HEAD_DIM = 32, 8, 64
DEFAULT_SIZES = (512, 640, 768, 1024, 1152, 1280, 1536, 1792, 2048, 2176, 2304, 2560)
SYSTEMS = ("hapd", "ddp", "fsdp")
SCRIPTS = {"hapd": "worker.py", "ddp": "ddp.py", "fsdp": "fsdp.py", "fsdp-cp": "fsdp.py"}
"""The script of each system; ``fsdp-cp`` is FSDP with the batch split by the profile's
FLOP/s (``--split flops``), timed beside hapd and FSDP."""
TIMED = ("hapd", "fsdp", "fsdp-cp")

PROFILE_SHIM = '''\
import sys
from hapd.profiler.driver import main
sys.exit(main(sys.argv[1:]))
'''


def log(msg: str) -> None:
    print(f"[memory {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- the model


def model_config(hidden: int) -> dict[str, int]:
    """The ``--set`` fields of the sweep's Llama at width ``hidden``."""
    if hidden < HEAD_DIM or hidden % HEAD_DIM:
        raise ValueError(f"width {hidden} must be a positive multiple of {HEAD_DIM} (the head size)")
    return {"hidden": hidden, "ffn": hidden * 8 // 3 // 64 * 64, "heads": hidden // HEAD_DIM, "seq": SEQ}


def param_count(hidden: int) -> int:
    from hapd import models

    return models.make_config(MODEL, "small", **model_config(hidden)).param_count()


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--sizes {text!r} is not a comma-separated list of widths") from None
    if not sizes:
        raise ValueError("--sizes is empty")
    for hidden in sizes:
        model_config(hidden)
    return sizes


# ----------------------------------------------------------------------------- cgroups


@dataclass(frozen=True)
class RankGroup:
    """One rank's cgroups: its speed (cpu quota) and its memory limit."""

    rank: int
    cpu: Path
    memory: Path
    quota: float
    """Cores (CFS quota / period)."""
    limit: int
    """Bytes (``memory.limit_in_bytes``, and ``memory.memsw.limit_in_bytes`` when present)."""

    def entry(self) -> str:
        """The rank's ``HAPD_RANK_CGROUPS`` entry (bench/in_cgroup.py)."""
        return f"{self.cpu},{self.memory}"


def available(cpu_root: Path = CPU_ROOT, memory_root: Path = MEMORY_ROOT) -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    if os.geteuid() != 0:
        return "needs root (cpu and memory cgroups)"
    if not (cpu_root / "cpu.cfs_quota_us").exists():
        return f"needs the cgroup v1 cpu controller at {cpu_root}"
    if not (memory_root / "memory.limit_in_bytes").exists():
        return f"needs the cgroup v1 memory controller at {memory_root}"
    return None


def _write(path: Path, value: int | str) -> None:
    path.write_text(f"{value}\n")


def set_memory_limit(group: Path, limit: int) -> None:
    """``limit`` bytes for memory and memory+swap (memsw must stay ≥ the memory limit,
    so it is lifted first)."""
    memsw = group / "memory.memsw.limit_in_bytes"
    if memsw.exists():
        _write(memsw, -1)
    _write(group / "memory.limit_in_bytes", limit)
    if memsw.exists():
        _write(memsw, limit)


def setup_groups(quotas: list[float], limits: list[int]) -> list[RankGroup]:
    groups = []
    for rank, (quota, limit) in enumerate(zip(quotas, limits)):
        cpu, memory = CPU_ROOT / f"{GROUP_PREFIX}{rank}", MEMORY_ROOT / f"{GROUP_PREFIX}{rank}"
        cpu.mkdir(exist_ok=True)
        memory.mkdir(exist_ok=True)
        _write(cpu / "cpu.cfs_period_us", PERIOD_US)
        _write(cpu / "cpu.cfs_quota_us", int(round(quota * PERIOD_US)))
        _write(cpu / "cpu.shares", SHARES)
        set_memory_limit(memory, limit)
        groups.append(RankGroup(rank, cpu, memory, quota, limit))
    return groups


def _remove_group(root: Path, group: Path) -> None:
    """Move what is left in ``group`` to ``root`` and remove it (retrying while the
    kernel still frees a killed process's memory)."""
    if not group.exists():
        return
    for _ in range(40):
        try:
            pids = [p for p in (group / "cgroup.procs").read_text().split() if p]
        except OSError:
            pids = []
        for pid in pids:
            try:
                _write(root / "cgroup.procs", pid)
            except OSError:
                pass
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.25)
    log(f"could not remove {group}")


def teardown_groups(count: int = 4) -> None:
    for rank in range(count):
        _remove_group(CPU_ROOT, CPU_ROOT / f"{GROUP_PREFIX}{rank}")
        _remove_group(MEMORY_ROOT, MEMORY_ROOT / f"{GROUP_PREFIX}{rank}")


def oom_kills(group: Path) -> int:
    """Processes the OOM killer killed in ``group`` so far (``memory.oom_control``)."""
    for line in (group / "memory.oom_control").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def reset_counters(group: Path) -> None:
    """Zero the cgroup's peak and failure counters before a run."""
    for name in ("memory.max_usage_in_bytes", "memory.failcnt", "memory.memsw.max_usage_in_bytes",
                 "memory.memsw.failcnt"):
        if (group / name).exists():
            _write(group / name, 0)


def peak_bytes(group: Path) -> int:
    return int((group / "memory.max_usage_in_bytes").read_text())


# ----------------------------------------------------------------------------- runs


@dataclass
class RunResult:
    """One job: a system at one size."""

    system: str
    hidden: int
    params: int
    status: str
    """``trains``, ``OOM`` (the kernel killed a rank at its limit), ``no plan`` (hapd found
    no plan that fits the profile's memory) or ``error``."""
    mean_s: float | None = None
    std_s: float | None = None
    oom_ranks: list[int] = field(default_factory=list)
    peaks: list[int] = field(default_factory=list)
    """Each rank's peak bytes (its memory cgroup's ``max_usage_in_bytes``)."""
    predicted: list[float] | None = None
    """hapd: the plan's predicted peak bytes per rank."""
    ratios: list[float] | None = None
    message: str = ""
    wall_s: float = 0.0
    profile: str = ""


def classify(returncode: int, summary: dict | None, oom_ranks: list[int], output: str) -> tuple[str, str]:
    """``(status, message)`` of a finished job (see :attr:`RunResult.status`)."""
    if returncode == 0 and summary is not None:
        return "trains", ""
    if oom_ranks:
        return "OOM", f"rank{'s' if len(oom_ranks) > 1 else ''} {', '.join(map(str, oom_ranks))} killed at the " \
                      f"memory limit (oom_kill)"
    fit = re.search(r"SynthesisError: (the model does not fit[^\n]*)", output)
    if fit:
        return "no plan", fit.group(1)
    lines = output.strip().splitlines()
    errors = [line for line in lines if re.search(r"\w(Error|Exception): ", line) and "ChildFailedError" not in line]
    last = errors[-1] if errors else lines[-1] if lines else f"exit {returncode}"
    return "error", last.strip()[-300:]


class Cluster:
    """The 4 ranks' cgroups, and jobs run on them through ``torch.distributed.run``."""

    def __init__(self, groups: list[RankGroup], work: Path, verbose: bool, mmap_threshold: int) -> None:
        self.groups, self.work, self.verbose, self.mmap_threshold = groups, work, verbose, mmap_threshold
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
               "HAPD_HOME": str(self.work / "home"), "HAPD_RANK_CGROUPS": ":".join(g.entry() for g in self.groups)}
        if self.mmap_threshold > 0:
            env["MALLOC_MMAP_THRESHOLD_"] = str(self.mmap_threshold)
        return env

    def launch(self, script: str, args: list[str], timeout: float) -> tuple[int, str, list[int]]:
        """Run ``script`` on the 4 ranks; ``(exit code, output, ranks OOM-killed)``."""
        for g in self.groups:
            reset_counters(g.memory)
        before = [oom_kills(g.memory) for g in self.groups]
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={len(self.groups)}",
               str(ROOT / "bench" / "in_cgroup.py"), script, *args]
        if self.verbose:
            log("$ " + " ".join(cmd))
        proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except BaseException:  # the timeout or Ctrl-C: stop this job's processes (its own session)
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
            raise
        oom = [g.rank for g, b in zip(self.groups, before) if oom_kills(g.memory) > b]
        if self.verbose:
            sys.stdout.write(output[-3000:])
        return proc.returncode, output, oom

    def profile(self, out: Path) -> dict:
        shim = self.work / "profile_rank.py"
        shim.write_text(PROFILE_SHIM)
        code, output, oom = self.launch(str(shim), ["--quick", "--out", str(out), "--name", out.stem], timeout=600)
        if code != 0 or not out.exists():
            raise RuntimeError(f"profiling failed (exit {code}, OOM ranks {oom}): {output[-2000:]}")
        return json.loads(out.read_text())

    def train(self, system: str, hidden: int, ns: argparse.Namespace, profile: Path | None, *,
              iterations: int, warmup: int) -> RunResult:
        report = self.work / f"{system}-{hidden}.json"
        report.unlink(missing_ok=True)
        args = ["--model", MODEL, "--size", "small", "--batch", str(ns.batch), "--iterations", str(iterations),
                "--warmup", str(warmup), "--json", str(report)]
        for key, value in model_config(hidden).items():
            args += ["--set", f"{key}={value}"]
        if system != "ddp":
            args += ["--init", "meta"]
        if system == "fsdp-cp":
            args += ["--split", "flops"]
        if profile is not None:
            args += ["--profile", str(profile)]
        t0 = time.monotonic()
        for attempt in (1, 2):  # one retry of a failure that is neither OOM nor "no plan" (a Gloo hiccup)
            code, output, oom = self.launch(SCRIPTS[system], args, timeout=ns.run_timeout)
            (self.logs / f"{system}-{hidden}-{attempt}.log").write_text(output)
            summary = json.loads(report.read_text()) if report.exists() else None
            status, message = classify(code, summary, oom, output)
            if status != "error":
                break
            log(f"  {system} at width {hidden} failed ({message}); once more")
        result = RunResult(system=system, hidden=hidden, params=param_count(hidden), status=status, oom_ranks=oom,
                           peaks=[peak_bytes(g.memory) for g in self.groups], message=message,
                           wall_s=time.monotonic() - t0, profile=profile.name if profile else "")
        if summary is not None:
            result.mean_s, result.std_s = summary.get("mean_s"), summary.get("std_s")
            result.predicted, result.ratios = summary.get("estimate_memory"), summary.get("ratios")
        return result


# ----------------------------------------------------------------------------- the profile


def reserve_from(calibration: RunResult, margin: int) -> int:
    """Bytes each rank's process holds beyond what hapd's memory model predicts: the
    largest (peak − predicted) over the ranks of a calibration run, plus ``margin``."""
    if calibration.status != "trains" or not calibration.predicted:
        raise RuntimeError(f"the calibration run did not train: {calibration.status} {calibration.message}")
    return int(max(p - q for p, q in zip(calibration.peaks, calibration.predicted))) + margin


def reserved_profile(measured: dict, reserve: int, limits: list[int] | None = None) -> dict:
    """The measured profile with each device's memory less ``reserve`` bytes, or, given
    the cgroup ``limits``, less what of ``reserve`` the profiler did not already leave out
    (it reports the headroom under the limit: the limit less its own process's usage)."""
    doc = json.loads(json.dumps(measured))
    for device in doc["devices"]:
        already = max(0, limits[device["rank"]] - device["memory"]) if limits else 0
        cut = max(0, reserve - already)
        if device["memory"] <= cut:
            raise RuntimeError(f"rank {device['rank']} has {device['memory'] / MiB:.0f} MiB, less than the "
                               f"{cut / MiB:.0f} MiB its process needs")
        device["memory"] = device["memory"] - cut
    doc["name"] = f"{measured.get('name', 'measured')}-reserved"
    doc["description"] = (f"{measured.get('description', '')} Each device's memory is its cgroup limit less "
                          f"{reserve / MiB:.0f} MiB for the rank's process (Python, torch, export, Gloo).").strip()
    return doc


# ----------------------------------------------------------------------------- report


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MiB:.0f}"


def _cell(r: RunResult | None) -> str:
    if r is None:
        return "-"
    if r.status == "trains":
        return f"trains {r.mean_s * 1e3:.0f} ms"
    if r.status == "OOM":
        return f"OOM (rank {','.join(map(str, r.oom_ranks))})"
    return r.status


def largest(rows: list[dict], system: str) -> dict | None:
    trained = [r for r in rows if r["system"] == system and r["status"] == "trains"]
    return max(trained, key=lambda r: r["params"]) if trained else None


def format_table(results: dict) -> str:
    rows = [RunResult(**r) for r in results["sweep"]]
    sizes = sorted({r.hidden for r in rows})
    head = f"{'width':>6} {'params':>9} " + " ".join(f"{s:>20}" for s in SYSTEMS)
    out = [head, "-" * len(head)]
    for hidden in sizes:
        at = {r.system: r for r in rows if r.hidden == hidden}
        params = next(r.params for r in rows if r.hidden == hidden)
        out.append(f"{hidden:>6} {params / 1e6:>8.1f}M " + " ".join(f"{_cell(at.get(s)):>20}" for s in SYSTEMS))
    out.append("")
    for system in SYSTEMS:
        best = largest(results["sweep"], system)
        out.append(f"largest model {system:>5}: " + (f"{best['params'] / 1e6:.1f}M parameters (width {best['hidden']})"
                                                      if best else "none"))
    return "\n".join(out)


def format_memory(results: dict) -> str:
    """hapd's predicted peak (plus the reserve) against each rank's measured peak."""
    reserve = results.get("reserve", 0)
    out = [f"hapd per rank: predicted peak + reserve {reserve / MiB:.0f} MiB vs measured peak vs limit (MiB)"]
    for r in results["sweep"]:
        if r["system"] != "hapd" or not r.get("predicted"):
            continue
        cells = [f"{_mib(p + reserve)}/{_mib(m)}/{_mib(lim)}"
                 for p, m, lim in zip(r["predicted"], r["peaks"], results["limits"])]
        out.append(f"  width {r['hidden']:>5}: " + "  ".join(cells) + f"   {r['status']}")
    return "\n".join(out)


def report(results: dict) -> None:
    print()
    print(f"4 ranks (quota {results['quotas']} cores, memory {[_mib(x) for x in results['limits']]} MiB), "
          f"{MODEL} widths, batch {results['batch']}, seq {SEQ}, {results['iterations']} iterations per size")
    print(format_table(results))
    print()
    print(format_memory(results))
    raw = results.get("raw_check")
    if isinstance(raw, dict):  # a results file from before the raw check went upward
        raw = [raw]
    if raw:
        print("\nhapd against the profiler's raw limits (no reserve): " + "; ".join(
            f"width {r['hidden']} ({r['params'] / 1e6:.1f}M) {_cell(RunResult(**r))}" for r in raw))
    timing = results.get("timing")
    if timing:
        print(f"\nthroughput at FSDP's largest size (width {timing['hidden']}, {timing['params'] / 1e6:.1f}M "
              f"parameters), {timing['iterations']} iterations each:")
        for system, ms in timing["ms"].items():
            print(f"  {system:>7}: " + (f"{ms:.0f} ms/iteration" if ms else "failed")
                  + (f"  (hapd {timing['speedup'][system]:.2f}x)" if timing["speedup"].get(system) else ""))


def timing_summary(hidden: int, iterations: int, runs: dict[str, RunResult]) -> dict:
    """ms/iteration of each timed system, and hapd's speed-up over each other one."""
    ms = {s: r.mean_s * 1e3 if r.status == "trains" else None for s, r in runs.items()}
    hapd = ms.get("hapd")
    first = next(iter(runs.values()))
    return {"hidden": hidden, "params": first.params, "iterations": iterations, "ms": ms,
            "speedup": {s: v / hapd for s, v in ms.items() if s != "hapd" and v and hapd}}


def _save(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                   help="model widths to sweep, upward (multiples of 64)")
    p.add_argument("--fast-gib", type=float, default=2.0, help="memory of ranks 0 and 1 (default 2)")
    p.add_argument("--slow-gib", type=float, default=1.0, help="memory of ranks 2 and 3 (default 1)")
    p.add_argument("--fast-quota", type=float, default=0.75, help="cores of ranks 0 and 1 (default 0.75)")
    p.add_argument("--slow-quota", type=float, default=0.25, help="cores of ranks 2 and 3 (default 0.25)")
    p.add_argument("--batch", type=int, default=BATCH, help=f"global batch (default {BATCH})")
    p.add_argument("--iterations", type=int, default=3, help="Adam steps per system and size (default 3)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timing-iterations", type=int, default=5,
                   help="steps of the hapd-vs-FSDP timing at FSDP's largest size (default 5, 2 warm-up)")
    p.add_argument("--margin-mib", type=float, default=32.0, help="added to the calibrated reserve (default 32)")
    p.add_argument("--mmap-threshold-kib", type=int, default=1024,
                   help="glibc's MALLOC_MMAP_THRESHOLD_ for every rank of every system: allocations this large "
                        "are mapped and unmapped, so freed tensors leave the rank's memory (default 1024; 0: "
                        "glibc's own sliding threshold, under which freed tensors of up to 32 MiB stay in the heap)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="systems to sweep (default hapd,ddp,fsdp)")
    p.add_argument("--no-raw-check", action="store_true",
                   help="skip hapd against the profiler's raw limits beyond the reserved profile's largest size")
    p.add_argument("--no-timing", action="store_true", help="skip the hapd-vs-FSDP timing")
    p.add_argument("--run-timeout", type=float, default=420.0, help="seconds per job (default 420)")
    p.add_argument("--keep", action="store_true", help="leave the cgroups and the work folder (debugging)")
    p.add_argument("--out", type=Path, default=OUT / "memory_cluster.json")
    p.add_argument("--from-json", type=Path, default=None, help="run nothing: re-print a saved results JSON")
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def sweep(cluster: Cluster, ns: argparse.Namespace, sizes: list[int], systems: list[str], profile: Path,
          results: dict) -> None:
    """Each system at each size, upward, until it fails."""
    alive = list(systems)
    for hidden in sizes:
        if not alive:
            break
        log(f"width {hidden}: {param_count(hidden) / 1e6:.1f}M parameters; {', '.join(alive)}")
        for system in list(alive):
            r = cluster.train(system, hidden, ns, profile if system == "hapd" else None,
                              iterations=ns.iterations, warmup=ns.warmup)
            results["sweep"].append(asdict(r))
            peaks = ", ".join(_mib(p) for p in r.peaks)
            log(f"  {system:>5}: {_cell(r):<22} peaks {peaks} MiB"
                + (f", predicted {', '.join(_mib(p) for p in r.predicted)} MiB" if r.predicted else "")
                + (f" ({r.message})" if r.message else "") + f" [{r.wall_s:.0f} s]")
            if r.status != "trains":
                alive.remove(system)
            _save(results, ns.out)


def main(argv=None) -> int:
    ns = parse_args(argv)
    if ns.from_json is not None:
        report(json.loads(ns.from_json.read_text()))
        return 0
    try:
        sizes = parse_sizes(ns.sizes)
        systems = [s.strip() for s in ns.systems.split(",") if s.strip()]
        unknown = [s for s in systems if s not in SYSTEMS]
        if unknown or not systems:
            raise ValueError(f"--systems: unknown {unknown or 'empty'}; choose from {', '.join(SYSTEMS)}")
    except ValueError as e:
        print(f"memory_cluster: {e}", file=sys.stderr)
        return 2
    why = available()
    if why:
        print(f"memory_cluster: skipped: {why}")
        return 0
    limits = [int(ns.fast_gib * GiB)] * 2 + [int(ns.slow_gib * GiB)] * 2
    quotas = [ns.fast_quota] * 2 + [ns.slow_quota] * 2
    work = Path(tempfile.mkdtemp(prefix="hapd-memory-"))
    results: dict[str, Any] = {"model": MODEL, "seq": SEQ, "batch": ns.batch, "iterations": ns.iterations,
                               "limits": limits, "quotas": quotas, "mmap_threshold": ns.mmap_threshold_kib * 1024,
                               "sweep": [], "workdir": str(work)}
    try:
        cluster = Cluster(setup_groups(quotas, limits), work, ns.verbose, ns.mmap_threshold_kib * 1024)
        log(f"cgroups {GROUP_PREFIX}0..3: quotas {quotas} cores, memory {[_mib(x) for x in limits]} MiB (no swap)")
        measured_path = work / "memory-cluster.json"
        measured = cluster.profile(measured_path)
        results["profile"] = {k: measured[k] for k in ("name", "devices")}
        log("profiled: " + ", ".join(f"rank {d['rank']} {d['flops'] / 1e9:.0f} GFLOP/s {_mib(d['memory'])} MiB"
                                     for d in measured["devices"]))

        calibration = cluster.train("hapd", sizes[0], ns, measured_path, iterations=ns.iterations, warmup=ns.warmup)
        results["calibration"] = asdict(calibration)
        reserve = reserve_from(calibration, int(ns.margin_mib * MiB))
        results["reserve"] = reserve
        reserved_path = work / "memory-cluster-reserved.json"
        reserved_path.write_text(json.dumps(reserved_profile(measured, reserve, limits), indent=1) + "\n")
        log(f"calibration (hapd, width {sizes[0]}): peaks {', '.join(_mib(p) for p in calibration.peaks)} MiB, "
            f"predicted {', '.join(_mib(p) for p in calibration.predicted)} MiB -> reserve {_mib(reserve)} MiB per "
            f"rank (incl. {ns.margin_mib:.0f} MiB margin); hapd compiles against "
            f"{', '.join(_mib(lim - reserve) for lim in limits)} MiB")

        sweep(cluster, ns, sizes, systems, reserved_path, results)

        hapd_fail = next((r for r in results["sweep"] if r["system"] == "hapd" and r["status"] != "trains"), None)
        if not ns.no_raw_check and hapd_fail is not None and hapd_fail["status"] == "no plan":
            results["raw_check"] = []
            for hidden in [h for h in sizes if h >= hapd_fail["hidden"]]:
                log(f"raw check: hapd at width {hidden} against the profiler's raw limits")
                raw = cluster.train("hapd", hidden, ns, measured_path, iterations=ns.iterations, warmup=ns.warmup)
                results["raw_check"].append(asdict(raw))
                log(f"  raw check: {_cell(raw)}, peaks {', '.join(_mib(p) for p in raw.peaks)} MiB"
                    + (f", predicted {', '.join(_mib(p) for p in raw.predicted)} MiB" if raw.predicted else "")
                    + (f" ({raw.message})" if raw.message else ""))
                _save(results, ns.out)
                if raw.status != "trains":
                    break

        fsdp_best = largest(results["sweep"], "fsdp")
        if not ns.no_timing and fsdp_best is not None and "hapd" in systems:
            hidden = fsdp_best["hidden"]
            iterations = max(ns.timing_iterations, 3)
            log(f"timing at FSDP's largest size (width {hidden}): {iterations} iterations each")
            profiles = {"hapd": reserved_path, "fsdp": None, "fsdp-cp": measured_path}
            runs = {}
            for system in TIMED:
                runs[system] = cluster.train(system, hidden, ns, profiles[system], iterations=iterations, warmup=2)
                log(f"  {system:>7}: {_cell(runs[system])} {runs[system].message}")
            results["timing_runs"] = {s: asdict(r) for s, r in runs.items()}
            results["timing"] = timing_summary(hidden, iterations, runs)
        _save(results, ns.out)
        report(results)
        log(f"wrote {ns.out}")
        return 0
    except KeyboardInterrupt:
        log("interrupted: removing the cgroups")
        _save(results, ns.out)
        return 130
    finally:
        if ns.keep:
            log(f"--keep: leaving cgroups {GROUP_PREFIX}0..3 and {work}")
        else:
            teardown_groups()
            logs = ns.out.with_name(ns.out.stem + "_logs")
            shutil.rmtree(logs, ignore_errors=True)
            if (work / "logs").exists():
                shutil.copytree(work / "logs", logs)
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
