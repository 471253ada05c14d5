#!/usr/bin/env python3
"""Elastic training on an emulated heterogeneous cluster: recovery from a lost host, a
host joining, random faults, the cost of snapshots, and re-plan times.

    .venv/bin/python bench/elastic_cluster.py              # every scenario, 60 steps
    .venv/bin/python bench/elastic_cluster.py --quick      # fewer steps and faults
    .venv/bin/python bench/elastic_cluster.py --scenarios kill,join

Needs root (network namespaces, tc, cpu cgroups v1) for scenarios 1-4; without it they
are skipped with the reason (exit 0). Scenario 5 (re-plan) runs anywhere.

The cluster (DESIGN.md §5): 3 hosts, network namespaces ``hapd-el0..2`` on a bridge
(``bench/launcher.py``'s :class:`NamespaceCluster`, entered with ``nsenter --net`` as
``bench/emulated_cluster.py`` does), one ``hapd serve`` per namespace with 2 slots, every
namespace's interface shaped by ``tc tbf`` (``--rate-mbit``), Gloo over it. Each host's 2
ranks are in cpu cgroups (cfs period 10 ms) with quotas in the host speeds 3:2:1 scaled
to the machine's 2 cores (0.5, 0.33, 0.17 of a core per rank); a rank finds its cgroup
by its host label and local rank (not its global rank, which changes as hosts leave and
join). The profile is :func:`~hapd.profile.schema.estimated_profile` with the host
labels of the host file and FLOP/s in the quotas' proportion.

The model: transformers' GPT-2 from the zoo (``zoo.gpt2``) at width 128, 2 layers,
vocabulary 512, sequence 32 (0.47M parameters, dropout as it ships: 0.1), global batch
24, a fixed dataset of 600 token sequences (25 batches per epoch, so 60 steps cross two
epochs), Adam, ``hapd.loader`` and ``hapd.Elastic``. Rank 0 prints each step's loss,
world and time; every rank prints the dataset indices of the samples it trained on (and
checks they are the rows it got); the end prints a digest of the full parameters.

Scenarios (``--scenarios``, default all):

1. ``kill``: host 2 SIGKILLed (every process in its namespace) after step 20 of 60,
   with ``--snapshot-every 1``, the survivors switched in place and restarted
   (``--restart``), then ``--snapshot-every 0`` (auto) in place (``--kill-runs``; an
   ``in-place-snapshot`` run switches in place with the step copies off, the state from
   the snapshot, to compare with the survivors' memory). From the launcher's report: kill → first
   step on the survivors and its parts, steps lost, where the state came from; rank 0's
   step copy time against its step time. ``--mode data_parallel`` plans every run
   data-parallel, so that the survivors hold the whole state. Reference: the chain of checkpoint
   restarts with the same hosts and resume steps (3 hosts to step k, a checkpoint, the
   2 survivors from it): every loss (relative ≤ 1e-5), the final digest, and the
   samples of every step (skipped or repeated: 0).
2. ``join``: the job starts on hosts 0-1 for 240 steps; ``python -m launcher join`` adds
   host 2 after step 10; steps/s over the last steps against a fresh elastic launch on
   the 3 hosts (the same snapshots and pause checks; target ≥ 95%). In place (the
   default) host 2's ranks start while the others train (on its sixth of a core they
   take ~45 s to import, build and export the model: a shorter job would end first), and the
   others pause once they are ready: the table says the join → host 2 training time,
   how long the others stood still (their last step before the pause to their first
   after) and the pause's step.
2b. ``rankkill``: the script of local rank 1 of host 2 SIGKILLed after step 20 of 60
   (``--snapshot-every 1``), in place (the others park and go on, host 2 with one rank)
   and restarted (``--restart``), back to back: kill → first step and its parts, and
   the same reference check as ``kill`` (the chain's segments run host 2 with the
   generation's ranks).
3. ``faults``: a seeded schedule of 10 faults (host kill, rank kill, link down for a
   few seconds), one after another's recovery. A killed host's daemon is restarted a
   few seconds later and a host whose link came back answers again: both rejoin through
   the host file the launcher watches. Checked: every fault recovered, no process of
   the run left, the final digest against the chain of checkpoint restarts with the
   run's generations (host sets in order, resume steps).
4. ``snapshot``: steps/s with ``--snapshot-every -1`` (none), ``1`` and ``0`` (auto),
   back to back in one invocation, as ratios to none.
5. ``replan``: the daemon's answer time for a profile cut to one host fewer
   (:meth:`~hapd.profile.schema.Profile.on_hosts`) after the full profile's plan is
   cached: LP-only re-plan, then a cache hit; paper-8 and paper-64, ``bert`` tiny
   exported at global batch 64.

Prints one table per scenario and writes ``bench/out/elastic_cluster.json``.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
OUT = ROOT / "bench" / "out"
CG_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000
SHARES = 8192
HOSTS = 3
RANKS_PER_HOST = 2
HOST_SPEEDS = (3.0, 2.0, 1.0)
CORES = 2.0
FLOPS_PER_CORE = 2e10
"""The estimated profile's FLOP/s of a whole core (only the ratios between ranks matter)."""
FAULT_KINDS = ("host", "rank", "link")
LOSS_RTOL = 1e-5
JOIN_TARGET = 0.95

TRAIN_SCRIPT = r'''
import hashlib, json, os, sys
groups = json.loads(os.environ.get("ELBENCH_CGROUPS") or "{}").get(os.environ.get("HAPD_HOST", ""))
if groups:
    with open(os.path.join(groups[int(os.environ.get("LOCAL_RANK", "0"))], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
import time
import torch
from torch.utils.data import TensorDataset
import hapd
from hapd import models

steps, profile = int(sys.argv[1]), sys.argv[2]
save_to = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
load_from = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "-" else None
gen = int(os.environ.get("HAPD_GENERATION", "0"))
torch.set_num_threads(1)
torch.manual_seed(0)  # rank 0's seed is the dropout streams' seed: the same in every run
BATCH, SAMPLES = 24, 600
net, config = models.build("zoo.gpt2", "small", hidden=128, layers=2, seq=32, vocab=512)
g = torch.Generator().manual_seed(1)
ids = torch.randint(0, config.vocab, (SAMPLES, config.seq), generator=g)
data = TensorDataset(ids, ids.clone())
mode = os.environ.get("ELBENCH_MODE")  # the compiler's mode (--mode): every run and its reference alike
module = hapd.parallelize(net, (ids[:BATCH], ids[:BATCH].clone()), profile=profile,
                          options={"mode": mode} if mode not in (None, "", "auto") else None)
optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
loader = hapd.loader(data, module, seed=0, drop_last=True)
elastic = hapd.Elastic(module, optimizer, sampler=loader)
if module.rank == 0:  # which plan this generation runs: a reference must run the same to be bit-equal
    plan = module.plan_source.plan
    print(json.dumps({"plan": hashlib.sha256(json.dumps(plan.doc, sort_keys=True, default=str).encode()).hexdigest()[:16],
                      "ratios": [round(r, 6) for r in plan.ratios], "origin": module.plan_source.origin, "gen": gen}),
          flush=True)
step = elastic.resume()
if load_from:
    step = hapd.load_checkpoint(load_from, module, optimizer, sampler=loader)["step"]
sampler = loader.sampler
while step < steps:
    loader.set_epoch(sampler.epoch)
    for xb, yb in loader:
        b = sampler.position - 1
        order = sampler.order()
        if loader.split:
            start = b * sampler.global_batch + sum(sampler.lengths[:sampler.rank])
            idx = order[start:start + sampler.lengths[sampler.rank]]
        else:
            idx = order[b * sampler.global_batch:(b + 1) * sampler.global_batch]
        assert torch.equal(xb, ids[idx]), "the rank's batch is not the dataset rows its sampler names"
        optimizer.zero_grad()
        part = module(xb, yb)
        part.backward()
        optimizer.step()
        step += 1
        loss = float(module.global_loss(part.detach()))
        if loader.split or module.rank == 0:
            print(json.dumps({"samples": step, "gen": gen, "rank": module.rank, "idx": idx.tolist()}), flush=True)
        if module.rank == 0:
            print(json.dumps({"step": step, "loss": loss, "world": module.world, "gen": gen, "t": time.time()}),
                  flush=True)
        elastic.step_done(step)
        if step >= steps:
            break
    else:
        loader.set_epoch(sampler.epoch + 1)
elastic.close()
if save_to:
    hapd.save_checkpoint(save_to, module, optimizer, sampler=loader, step=step)
state = module.full_state_dict()
if module.rank == 0:
    digest = hashlib.sha256(b"".join(state[k].detach().numpy().tobytes() for k in sorted(state))).hexdigest()
    print(json.dumps({"final": digest, "step": step}), flush=True)
'''


def log(msg: str) -> None:
    print(f"[elastic {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- pure parts (tests/bench/test_elastic_cluster_report.py)


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule."""

    index: int
    step: int
    """Injected once rank 0 reports this step (and the fault before it was recovered)."""
    kind: str
    """``host`` (SIGKILL every process of the host), ``rank`` (SIGKILL one rank) or
    ``link`` (the host's interface down for ``seconds``)."""
    pick: int
    """Which of the hosts running then (sorted by label) is hit: ``pick % len(hosts)``."""
    local_rank: int = 0
    """The rank of that host killed (``rank`` faults)."""
    seconds: float = 0.0
    """How long the link stays down (``link``), or the host's daemon stays dead (``host``)."""


def fault_schedule(seed: int, n: int, steps: int, *, first: int = 4, kinds: Sequence[str] = FAULT_KINDS,
                   down_s: tuple[float, float] = (6.0, 10.0)) -> list[Fault]:
    """``n`` faults at increasing steps in ``[first, steps - 2]`` drawn with ``seed``
    (each kind at least once when ``n ≥ len(kinds)``); the same seed, the same schedule."""
    if n < 0 or steps - 2 - first + 1 < n:
        raise ValueError(f"{n} faults do not fit in steps {first}..{steps - 2}")
    rng = random.Random(seed)
    at = sorted(rng.sample(range(first, steps - 1), n))
    chosen = list(kinds) * (n // len(kinds)) + rng.sample(list(kinds), n % len(kinds)) if n else []
    rng.shuffle(chosen)
    return [Fault(i, s, k, rng.randrange(HOSTS), rng.randrange(RANKS_PER_HOST),
                  round(rng.uniform(*down_s), 1) if k in ("link", "host") else 0.0)
            for i, (s, k) in enumerate(zip(at, chosen))]


def rank_quotas(speeds: Sequence[float] = HOST_SPEEDS, ranks_per_host: int = RANKS_PER_HOST,
                cores: float = CORES) -> list[float]:
    """Each host's per-rank cpu quota in cores: ``speeds`` scaled so all ranks sum to ``cores``."""
    if not speeds or any(not s > 0 for s in speeds) or not cores > 0:
        raise ValueError(f"host speeds {list(speeds)} and cores {cores} must be positive")
    scale = cores / (ranks_per_host * sum(speeds))
    return [s * scale for s in speeds]


def parse_lines(stdout: str) -> dict[str, Any]:
    """Rank output of a launcher run: ``losses`` (step → (loss, world, generation,
    time), the last generation's), ``samples`` (step → generation → rank → indices),
    ``final`` (the digest or None) and ``events`` (rank 0's elastic events)."""
    losses: dict[int, tuple[float, int, int, float]] = {}
    samples: dict[int, dict[int, dict[int, list[int]]]] = {}
    events: list[dict[str, Any]] = []
    plans: list[dict[str, Any]] = []
    final = None
    for line in stdout.splitlines():
        text = line.split("] ", 1)[1] if line.startswith("[rank ") and "] " in line else line
        if not text.startswith("{"):
            continue
        try:
            value = json.loads(text)
        except ValueError:
            continue
        if "loss" in value and "step" in value:
            old = losses.get(value["step"])
            if old is None or value.get("gen", 0) >= old[2]:
                losses[value["step"]] = (value["loss"], value["world"], value.get("gen", 0), value.get("t", 0.0))
        elif "samples" in value:
            samples.setdefault(value["samples"], {}).setdefault(value.get("gen", 0), {})[value["rank"]] = value["idx"]
        elif "final" in value:
            final = value["final"]
        elif "plan" in value and "ratios" in value and "hapd" not in value:  # the script's plan line
            plans.append(value)
        elif value.get("hapd") == "elastic":
            events.append(value)
    return {"losses": losses, "samples": samples, "final": final, "events": events, "plans": plans}


def step_samples(samples: Mapping[int, Mapping[int, Mapping[int, list[int]]]]) -> dict[int, list[int]]:
    """Step → the sorted samples trained in it, from the last generation that trained it."""
    out = {}
    for step, gens in samples.items():
        last = gens[max(gens)]
        out[step] = sorted(i for idx in last.values() for i in idx)
    return out


def compare_samples(got: Mapping[int, list[int]], ref: Mapping[int, list[int]]) -> dict[str, int]:
    """Samples skipped (in the reference, not trained) and repeated (trained more often
    than in the reference) over all steps, and the steps whose samples differ."""
    a = collections.Counter(i for v in got.values() for i in v)
    b = collections.Counter(i for v in ref.values() for i in v)
    differ = sum(1 for s in set(got) | set(ref) if sorted(got.get(s, [])) != sorted(ref.get(s, [])))
    return {"skipped": sum((b - a).values()), "repeated": sum((a - b).values()), "steps_differ": differ}


def compare_losses(got: Mapping[int, Sequence[float]], ref: Mapping[int, Sequence[float]],
                   rtol: float = LOSS_RTOL) -> dict[str, Any]:
    """Per-step relative loss differences: the worst, the steps over ``rtol``, steps missing."""
    worst, over, missing, first = 0.0, [], [], None
    for s in sorted(ref):
        if s not in got:
            missing.append(s)
            continue
        r, g = ref[s][0], got[s][0]
        rel = abs(g - r) / max(abs(r), 1e-30)
        worst = max(worst, rel)
        if rel > 0 and first is None:
            first = {"step": s, "rel": rel, "got": g, "ref": r}
        if rel > rtol:
            over.append(s)
    return {"max_rel": worst, "over": over, "missing": missing, "ok": not over and not missing,
            "first_difference": first}


def throughput(losses: Mapping[int, Sequence[float]], last: int) -> float | None:
    """Steps per second over the last ``last`` steps (rank 0's step times)."""
    steps = sorted(losses)
    if len(steps) <= last:
        return None
    t1, t0 = losses[steps[-1]][3], losses[steps[-1 - last]][3]
    return last / (t1 - t0) if t1 > t0 else None


def chain_segments(generations: Sequence[Mapping[str, Any]], steps: int) -> list[dict[str, Any]]:
    """The checkpoint-restart runs that redo an elastic run: one per generation that
    trained (its hosts in order), from the step it resumed at to the step the next one
    resumed at (the last to ``steps``). A generation that resumed before where the last
    one began (a restart from a snapshot older than the survivors' step) takes the
    history back: the runs after that step are dropped and the one running then ends
    there, so the chain has a checkpoint of the step it resumed at."""
    gens = [g for g in generations if g.get("first_step") is not None or g is generations[-1]]
    starts = [int((g.get("resumed") or {}).get("step", 0)) for g in gens]
    segs: list[dict[str, Any]] = []
    for i, g in enumerate(gens):
        while segs and segs[-1]["start"] >= starts[i]:
            segs.pop()  # trained again from an earlier step: those runs are not the history
        if segs and segs[-1]["end"] > starts[i]:
            segs[-1]["end"] = starts[i]
        end = starts[i + 1] if i + 1 < len(gens) else steps
        if end > starts[i] or i == len(gens) - 1:
            segs.append({"hosts": generation_hosts(g), "start": starts[i], "end": end})
    merged: list[dict[str, Any]] = []
    for s in segs:  # a generation that resumed and failed before its next resume point adds nothing
        if merged and merged[-1]["hosts"] == s["hosts"] and merged[-1]["end"] == s["start"]:
            merged[-1]["end"] = s["end"]
        else:
            merged.append(s)
    return merged


def generation_hosts(gen: Mapping[str, Any]) -> list[str]:
    """A generation's hosts in order, ``LABEL#N`` for one that ran N ranks, fewer than
    :data:`RANKS_PER_HOST` (a rank of it killed, switched in place without it)."""
    ranks = gen.get("ranks") or {}
    return [f"{h}#{ranks[h]}" if ranks.get(h, RANKS_PER_HOST) < RANKS_PER_HOST else h for h in gen["hosts"]]


def recovery_rows(report: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One row per recovery of an elastic report (a generation that failed and the next
    that resumed)."""
    rows = []
    for g in (report.get("elastic") or {}).get("generations", []):
        r = g.get("recovery")
        if r:
            rows.append({"generation": g["index"], "outcome": g.get("outcome", ""), "lost": r.get("lost", []),
                         **{k: r.get(k) for k in ("total_s", "detection_s", "replan_s", "replan_asked_s", "restart_s",
                                                  "load_s",
                                                  "resumed_step", "steps_lost", "source", "plan",
                                                  "restart_parts")}})
    return rows


def format_table(title: str, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A titled plain-text table; floats with 3 significant digits, None as '-'."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}"
        return str(v)

    body = [[cell(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in body)) if body else len(str(h)) for i, h in enumerate(header)]
    line = "  ".join(str(h).rjust(w) for h, w in zip(header, widths))
    out = [title, line, "-" * len(line)]
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(out)


# ----------------------------------------------------------------------------- the cluster


def available() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, cpu cgroups)"
    for tool in ("ip", "tc", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not (CG_ROOT / "cpu.cfs_quota_us").exists():
        return f"needs the cgroup v1 cpu controller at {CG_ROOT}"
    return None


def _bench_launcher():
    name = "hapd_bench_launcher"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "launcher.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def make_cluster(work: Path):
    base = _bench_launcher().NamespaceCluster

    class ElasticCluster(base):
        """3 namespaces hapd-el0..2 on bridge hapdelbr; daemons entered with nsenter."""

        def __init__(self) -> None:
            super().__init__(work, HOSTS, RANKS_PER_HOST, tag=9931)
            self.namespaces = [f"hapd-el{i}" for i in range(HOSTS)]
            self.subnet = "10.77.231"
            self.ips = [f"{self.subnet}.{i + 2}" for i in range(HOSTS)]
            self.bridge = "hapdelbr"

        def _command(self, i: int) -> list[str]:
            return ["nsenter", f"--net=/var/run/netns/{self.namespaces[i]}", "--"]

        def shape(self, rate_mbit: float) -> None:
            rate_kbit = max(1, int(rate_mbit * 1000))
            burst = max(16 * 1024, int(rate_mbit * 1e6 / 8 / 250))
            for ns in self.namespaces:
                self._run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", self.IFNAME, "root", "tbf",
                          "rate", f"{rate_kbit}kbit", "burst", str(burst), "latency", "200ms")

        def pids(self, i: int) -> list[int]:
            done = subprocess.run(["ip", "netns", "pids", self.namespaces[i]], capture_output=True, text=True)
            return [int(p) for p in done.stdout.split() if p.isdigit()]

        def kill_host(self, i: int) -> int:
            """SIGKILL every process in host ``i``'s namespace (daemon and ranks)."""
            pids = self.pids(i)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc = self.procs[i]
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    pass
            return len(pids)

        def link(self, i: int, up: bool) -> None:
            self._run("ip", "-n", self.namespaces[i], "link", "set", self.IFNAME, "up" if up else "down")

        def restart_daemon(self, i: int) -> None:
            if self.procs[i] is None or self.procs[i].poll() is not None:
                self.start_daemon(i)

    return ElasticCluster()


def setup_cgroups(quotas: Sequence[float]) -> dict[int, list[str]]:
    """Host index → its ranks' cpu cgroups (created with the host's quota)."""
    out = {}
    for h, quota in enumerate(quotas):
        out[h] = []
        for j in range(RANKS_PER_HOST):
            group = CG_ROOT / f"hapd-el-h{h}-l{j}"
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (group / "cpu.cfs_quota_us").write_text(f"{int(round(quota * PERIOD_US))}\n")
            (group / "cpu.shares").write_text(f"{SHARES}\n")
            out[h].append(str(group))
    return out


def teardown_cgroups() -> None:
    for group in sorted(CG_ROOT.glob("hapd-el-h*-l*")):
        if not _bench_launcher().remove_cgroup(group, CG_ROOT):
            log(f"could not remove {group}")


def job_processes(prefix: str) -> list[int]:
    """Live processes whose ``HAPD_JOB`` starts with ``prefix`` (a run's every generation)."""
    needle = b"\0HAPD_JOB=" + prefix.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            data = b"\0" + (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in data and state != "Z":
            pids.append(int(entry.name))
    return pids


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def running_ranks(prefix: str, groups: Mapping[int, Sequence[str]] | None = None,
                  labels: Sequence[str] = ()) -> dict[str, list[tuple[int, int]]]:
    """Host label → (local rank, pid) of the run's rank processes now (the launcher's
    children only: a rank's own children carry the environment too). A rank a daemon
    handed to a warm standby process (``hapd serve --standby``) keeps the standby's
    environment in ``/proc``: it is found by the cpu cgroup its script put it in
    (``groups``: host index → its ranks' cgroups, ``labels`` the hosts')."""
    out: dict[str, list[tuple[int, int]]] = {}
    for pid in job_processes(prefix):
        env = _environ(pid)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"rank_guard" in a for a in argv) or not any(a.endswith(b"train.py") for a in argv):
            continue  # the daemon's guard around the rank, or a child of the rank
        if "LOCAL_RANK" in env and "HAPD_HOST" in env and "ELBENCH_CGROUPS" in env:
            out.setdefault(env["HAPD_HOST"], []).append((int(env["LOCAL_RANK"]), pid))
    for h, paths in (groups or {}).items():
        for local, path in enumerate(paths):
            for pid in standby_ranks(path):
                out.setdefault(labels[h], []).append((local, pid))
    return out


def standby_ranks(cgroup: str) -> list[int]:
    """The live warm-standby processes (``hapd.elastic.standby``) in ``cgroup``: ranks
    handed to them, which the bench's script moved there."""
    try:
        pids = [int(p) for p in Path(cgroup, "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []
    found = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"hapd.elastic.standby" in argv and state != "Z":
            found.append(pid)
    return found


# ----------------------------------------------------------------------------- runs


@dataclass
class Bench:
    cluster: Any
    work: Path
    labels: list[str]
    lines: list[str]
    profile: Path
    script: Path
    groups: dict[int, list[str]]
    verbose: bool = False
    mode: str = "auto"
    """The compiler's mode for every run (``data_parallel``: every rank holds every tensor)."""
    check: bool = True
    """Whether kill runs are checked against their reference chain (``--no-check``: times only)."""
    runs: int = 0
    leftovers: dict[str, int] = field(default_factory=dict)
    logs: Path | None = None
    """Where each launcher run's whole output goes (``JOB.log``: both streams, each line after the time it
    came; ``--logs``), or nowhere."""

    def hostfile(self, hosts: Sequence[int] | Sequence[str], name: str) -> Path:
        """A host file of ``hosts`` (indices or labels; ``LABEL#N``: that host with N slots)."""
        lines = []
        for h in hosts:
            label, _, count = h.partition("#") if isinstance(h, str) else ("", "", "")
            line = self.lines[self.labels.index(label) if isinstance(h, str) else h]
            lines.append(line.replace(f"slots={RANKS_PER_HOST}", f"slots={count}") if count else line)
        path = self.work / f"{name}.hosts"
        path.write_text("".join(line + "\n" for line in lines))
        return path

    def profile_for(self, hosts: Sequence[str]) -> Path:
        if list(hosts) == self.labels:
            return self.profile
        from hapd.profile.schema import load_profile

        path = self.work / ("profile-" + "-".join(h.rsplit(".", 1)[-1] for h in hosts) + ".json")
        load_profile(self.profile).on_hosts(list(hosts)).save(path)
        return path

    def launch(self, name: str, hostfile: Path, script_args: Sequence[str], *, elastic: str | None = None,
               extra: Sequence[str] = (), on_line: Callable[[str], None] | None = None,
               timeout: float = 1200, nproc: int | None = RANKS_PER_HOST) -> dict[str, Any]:
        """One launcher run; its output parsed (:func:`parse_lines`), exit code, report.
        ``nproc`` None: each host's slots in ``hostfile``."""
        self.runs += 1
        job = f"elb{os.getpid() % 10000}-{self.runs}-{name}"
        report = self.work / f"{job}.json"
        cmd = [PY, "-m", "launcher", "run", str(self.script), *(["-n", str(nproc)] if nproc else []),
               "--hosts", str(hostfile),
               "--key", str(self.cluster.key_file), "--cwd", str(ROOT),
               "--job-id", job, "--report", str(report), "-v",
               "--env", f"GLOO_SOCKET_IFNAME={self.cluster.IFNAME}", "--env", "OMP_NUM_THREADS=1",
               "--env", "HAPD_COLLECTIVE_TIMEOUT=30", "--env", f"ELBENCH_MODE={self.mode}",
               "--env", "ELBENCH_CGROUPS=" + json.dumps({self.labels[h]: g for h, g in self.groups.items()})]
        if elastic:
            cmd += ["--elastic", elastic, *extra]
        cmd += ["--", *script_args]
        if self.verbose:
            log("$ " + " ".join(cmd))
        t0 = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=False)
        err: list[str] = []
        stamped: list[str] = []  # both streams' lines as they came, each after its arrival time (--logs)

        def read_errors() -> None:  # the launcher's own lines (its generations, joins) come on stderr
            for line in proc.stderr:
                err.append(line)
                if self.logs is not None:
                    stamped.append(f"{time.time():.3f} {line}")
                if on_line is not None and line.startswith("hapd launcher:"):
                    on_line(line.rstrip("\n"))

        reader = threading.Thread(target=read_errors, daemon=True)
        reader.start()
        out: list[str] = []
        killer = threading.Timer(timeout, proc.send_signal, (signal.SIGTERM,))
        killer.start()
        try:
            for line in proc.stdout:
                out.append(line.rstrip("\n"))
                if self.logs is not None:
                    stamped.append(f"{time.time():.3f} {line}")
                if on_line is not None:
                    on_line(line.rstrip("\n"))
            code = proc.wait()
        except BaseException:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except BaseException:
                proc.kill()
            raise
        finally:
            killer.cancel()
            reader.join(30)
        stderr = "".join(err)
        if self.logs is not None:
            self.logs.mkdir(parents=True, exist_ok=True)
            (self.logs / f"{job}.log").write_text("".join(stamped))
        if code != 0 or self.verbose:
            sys.stderr.write(stderr[-3000:])
        parsed = parse_lines("\n".join(out))
        data = {}
        for path in (report,):
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                pass
        time.sleep(2.0)
        left = job_processes(job) + [pid for paths in self.groups.values() for path in paths
                                     for pid in standby_ranks(path)]  # ranks handed to standbys: by cgroup
        self.leftovers[job] = len(left)
        for pid in left:  # not ours to keep: say so, then clean up
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return {"job": job, "code": code, "wall_s": time.time() - t0, "report": data, "stderr_tail": stderr[-2000:],
                "leftover": len(left),
                "launcher_lines": [l for l in stderr.splitlines() if l.startswith("hapd launcher:")][-40:], **parsed}

    def plain(self, name: str, hosts: Sequence[str], steps: int, save: Path | None = None,
              load: Path | None = None) -> dict[str, Any]:
        """A non-elastic run on ``hosts`` (in that order) to ``steps``, optionally from
        and to a checkpoint."""
        cut = any("#" in h for h in hosts)  # a host with fewer ranks: each host's slots in the host file
        return self.launch(name, self.hostfile(hosts, name), [str(steps), str(self.profile_for(hosts)),
                                                              str(save) if save else "-", str(load) if load else "-"],
                           nproc=None if cut else RANKS_PER_HOST)

    def chain(self, name: str, segments: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The checkpoint-restart reference of ``segments`` (:func:`chain_segments`)."""
        losses: dict[int, tuple] = {}
        samples: dict[int, dict] = {}
        ckpt = None
        final = None
        plans: list[dict[str, Any]] = []
        ended = 0
        for i, seg in enumerate(segments):
            to = self.work / f"{name}-ckpt{i}"
            last = i == len(segments) - 1
            if seg["start"] == 0:  # the run began again from its start (no snapshot held every rank's files)
                ckpt = None
            elif seg["start"] != ended:
                return {"error": f"segment {i} ({seg}) resumes at step {seg['start']}, where no segment ended "
                                 f"(the last ended at {ended}): the chain has no checkpoint of it"}
            r = self.plain(f"{name}-s{i}", seg["hosts"], seg["end"], save=None if last else to, load=ckpt)
            ended = seg["end"]
            if r["code"] != 0:
                return {"error": f"segment {i} ({seg}) exited {r['code']}: {r['stderr_tail'][-500:]}"}
            losses.update(r["losses"])
            for s, gens in r["samples"].items():
                samples[s] = gens
            plans.extend({**p, "segment": i} for p in r["plans"])
            ckpt, final = to, r["final"]
        return {"losses": losses, "samples": samples, "final": final, "segments": list(segments), "plans": plans}


def check_against(run: Mapping[str, Any], ref: Mapping[str, Any]) -> dict[str, Any]:
    if "error" in ref:
        return {"error": ref["error"]}
    return {"losses": compare_losses(run["losses"], ref["losses"]),
            "samples": compare_samples(step_samples(run["samples"]), step_samples(ref["samples"])),
            "digest_equal": run["final"] is not None and run["final"] == ref["final"],
            "segments": ref["segments"],
            # each generation's and each reference segment's plan (hash, ratios, origin): a digest
            # that differs while every plan matches is a state that did not come back exactly
            "plans": {"run": run.get("plans", []), "reference": ref.get("plans", [])}}


# ----------------------------------------------------------------------------- scenarios


NO_COPIES = "in place, the step copies off"
"""A kill run switched in place with ``HAPD_STEP_COPY=0``: the state from the snapshot (the
comparison for the survivors' memory)."""


def scenario_kill(b: Bench, steps: int, kill_at: int, variants: Sequence[tuple[int, bool | str]]) -> dict[str, Any]:
    """``variants``: (``--snapshot-every``, in place) per run; the survivors switched in
    place (the default) or restarted as new processes (``--restart``), back to back."""
    out: dict[str, Any] = {"steps": steps, "kill_at": kill_at, "runs": []}
    for every, in_place in variants:
        copies = in_place is not NO_COPIES  # in place with the step copies off: the state from the snapshot
        in_place = bool(in_place)
        how = ("in-place" if copies else "in-place-snapshot") if in_place else "restart"
        name = f"kill{every}{'' if in_place else 'r'}{'' if copies else 's'}"
        hostfile = b.hostfile([0, 1, 2], name)
        killed: dict[str, float] = {}

        def on_line(line: str, killed=killed) -> None:
            if not killed and f'"event": "step", "step": {kill_at}' in line:
                killed["at"] = time.time()
                killed["pids"] = b.cluster.kill_host(2)

        log(f"kill: --snapshot-every {every}, {how}, host 2 killed after step {kill_at} of {steps}")
        try:
            r = b.launch(name, hostfile, [str(steps), str(b.profile)], elastic="2:3",
                         extra=["--snapshot-every", str(every), "--in-place" if in_place else "--restart",
                                *([] if copies else ["--env", "HAPD_STEP_COPY=0"])],
                         on_line=on_line)
        finally:
            b.cluster.restart_daemon(2)
        rows = recovery_rows(r["report"])
        entry = {"every": every, "in_place": in_place, "step_copies": copies, "code": r["code"], "killed_at": killed.get("at"), "recovery": rows,
                 "leftover": r["leftover"], "steps_done": max(r["losses"], default=0),
                 "launcher_lines": r["launcher_lines"]}
        snaps = [e for e in r["events"] if e.get("event") == "snapshot"]
        entry["snapshot_every_chosen"] = snaps[0].get("every") if snaps else None
        entry["snapshot_s"] = snaps[0].get("seconds") if snaps else None
        copied = [e["step_copy_s"] for e in snaps if e.get("step_copy_s") is not None]
        entry["step_copy_s"] = statistics.median(copied) if copied else None  # rank 0's, median of the last copies
        beside = [e["step_copy_beside_s"] for e in snaps if e.get("step_copy_beside_s") is not None]
        entry["step_copy_beside_s"] = statistics.median(beside) if beside else None  # its part beside the next step
        entry["step_copy_bytes"] = next((e["step_copy_bytes"] for e in snaps if "step_copy_bytes" in e), None)
        times = [t for _, (_, _, gen, t) in sorted(r["losses"].items()) if gen == 0]
        entry["step_s"] = statistics.median(b - a for a, b in zip(times, times[1:])) if len(times) > 2 else None
        gens = (r["report"].get("elastic") or {}).get("generations", [])
        if rows and killed.get("at"):
            first = (gens[-1].get("first_step") or {}).get("time")
            entry["kill_to_first_step_s"] = first - killed["at"] if first else None
        if r["code"] == 0 and gens and b.check:
            segs = chain_segments(gens, steps)
            log(f"kill: reference chain {segs}")
            entry["check"] = check_against(r, b.chain(f"killref{every}{'' if in_place else 'r'}", segs))
        out["runs"].append(entry)
    return out


def scenario_rankkill(b: Bench, steps: int, kill_at: int, variants: Sequence[tuple[int, bool | str]]) -> dict[str, Any]:
    """The script of local rank 1 of host 2 SIGKILLed after ``kill_at``: per variant
    (``--snapshot-every``, in place), the others switched in place (host 2 goes on with
    one rank; ``NO_COPIES``: the step copies off) or restarted (``--restart``)."""
    out: dict[str, Any] = {"steps": steps, "kill_at": kill_at, "runs": []}
    for every, how in variants:
        copies = how is not NO_COPIES
        in_place = bool(how)
        name = f"rankkill{'' if in_place else 'r'}"
        prefix = f"elb{os.getpid() % 10000}-{b.runs + 1}-{name}"
        killed: dict[str, Any] = {}

        def on_line(line: str, killed=killed, prefix=prefix) -> None:
            if not killed and f'"event": "step", "step": {kill_at}' in line:
                pid = dict(running_ranks(prefix, b.groups, b.labels).get(b.labels[2], [])).get(1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed.update(at=time.time(), pid=pid)

        log(f"rankkill: {'in place' if in_place else 'restart'}, local rank 1 of host 2 killed after step {kill_at} "
            f"of {steps}")
        r = b.launch(name, b.hostfile([0, 1, 2], name), [str(steps), str(b.profile)], elastic="2:3",
                     extra=["--snapshot-every", str(every), "--in-place" if in_place else "--restart",
                            *([] if copies else ["--env", "HAPD_STEP_COPY=0"])], on_line=on_line)
        gens = (r["report"].get("elastic") or {}).get("generations", [])
        entry = {"every": every, "in_place": in_place, "step_copies": copies, "code": r["code"], "killed": killed, "recovery": recovery_rows(r["report"]),
                 "leftover": r["leftover"], "steps_done": max(r["losses"], default=0),
                 "worlds": [g.get("world") for g in gens], "launcher_lines": r["launcher_lines"]}
        first = (gens[-1].get("first_step") or {}).get("time") if len(gens) > 1 else None
        if first and killed.get("at"):
            entry["kill_to_first_step_s"] = first - killed["at"]
        if r["code"] == 0 and gens and b.check:
            segs = chain_segments(gens, steps)
            log(f"rankkill: reference chain {segs}")
            entry["check"] = check_against(r, b.chain(f"rankkillref{'' if in_place else 'r'}", segs))
        out["runs"].append(entry)
    return out


def scenario_join(b: Bench, steps: int, join_at: int, last: int) -> dict[str, Any]:
    hostfile = b.hostfile([0, 1], "join")
    joined: dict[str, float] = {}

    def on_line(line: str) -> None:
        if "ready to join: their ranks start now" in line and "answered" not in joined:
            joined["answered"] = time.time()  # the launcher's ping of the joining daemon answered: its ranks start
        if "at" not in joined and f'"event": "step", "step": {join_at}' in line:
            joined["at"] = time.time()
            subprocess.run([PY, "-m", "launcher", "join", *b.lines[2].split(), "--hosts", str(hostfile)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)

    log(f"join: 2 hosts, host 2 joins after step {join_at} of {steps}")
    r = b.launch("join", hostfile, [str(steps), str(b.profile)], elastic="2:3", on_line=on_line)
    log("join: a fresh elastic launch on 3 hosts (the same snapshots and pause checks)")
    fresh = b.launch("fresh3", b.hostfile([0, 1, 2], "fresh3"), [str(steps), str(b.profile)], elastic="2:3")
    gens = (r["report"].get("elastic") or {}).get("generations", [])
    worlds = sorted({v[1] for s, v in r["losses"].items() if s > join_at + 1})
    tj, tf = throughput(r["losses"], last), throughput(fresh["losses"], last)
    out = {"steps": steps, "join_at": join_at, "last": last, "code": r["code"], "fresh_code": fresh["code"],
           "generations": [{k: g.get(k) for k in ("index", "hosts", "outcome", "last_step", "resumed")} for g in gens],
           "worlds_after_join": worlds, "steps_per_s_after_join": tj, "steps_per_s_fresh": tf,
           "ratio": tj / tf if tj and tf else None, "leftover": r["leftover"],
           "launcher_lines": r["launcher_lines"]}
    if gens:
        pause = next((g for g in gens if str(g.get("outcome", "")).startswith("paused")), None)
        nxt = gens[-1]
        if pause and joined.get("at") and nxt.get("first_step"):
            out["join_to_first_step_s"] = nxt["first_step"]["time"] - joined["at"]
            if joined.get("answered"):
                out["answered_to_first_step_s"] = nxt["first_step"]["time"] - joined["answered"]
            out["paused_at_step"] = pause.get("last_step")
            out["resumed_step"] = (nxt.get("resumed") or {}).get("step")
            out["in_place"] = bool(nxt.get("in_place"))
            before = [t for s, (_, _, gen, t) in r["losses"].items() if gen == pause.get("index")]
            if before:  # the others stood still from their last step before the pause to their first after it
                out["others_idle_s"] = nxt["first_step"]["time"] - max(before)
    if r["code"] == 0 and gens:
        segs = chain_segments(gens, steps)
        out["check"] = check_against(r, b.chain("joinref", segs))
    return out


MISSED_STEPS = 5
"""Steps rank 0 completes in the same generation after a fault before the next fault may
come: a fault that hit no rank of the job (one that had just exited) does not hold up the
schedule."""


def joining_hosts(line: str, preparing: set[str]) -> set[str]:
    """The hosts preparing to join after the launcher's ``line``: a host whose ranks start
    (``host(s) A, B ready to join: their ranks start now``) prepares until a generation
    places it (:func:`placed_hosts`) or it does not join."""
    text = line.removeprefix("hapd launcher:").strip()
    if " ready to join: their ranks start now" in text and text.startswith("host(s) "):
        names = text.removeprefix("host(s) ").split(" ready to join", 1)[0]
        return preparing | {n.strip() for n in names.split(",") if n.strip()}
    placed = placed_hosts(text)
    if placed is not None:
        return preparing - placed
    gone = re.match(r"(?:joining host (\S+) .*does not join|could not start the ranks of joining host (\S+?):)", text)
    if gone:
        return preparing - {gone.group(1) or gone.group(2)}
    return preparing


def placed_hosts(line: str) -> set[str] | None:
    """The hosts a generation runs on, from the launcher's ``generation N on K host(s)
    (A, B#1, …), …`` line (a host that lost ranks is named ``HOST#N``) or its ``job J:
    switched in place to generation N: W ranks on K host(s) (A ranks 0-1, …)``; None for
    any other line. Only these hosts' ranks are the job's: a joining host's ranks prepare
    beside it, and a dropped host's may still run until its daemon stops them."""
    text = line.strip().removeprefix("hapd launcher:").strip()
    placed = re.match(r"generation \d+ on \d+ host\(s\) \(([^)]*)\)", text)
    if placed is None:  # a generation switched in place (a join's has only this line): "(A ranks 0-1, B ranks 2-2)"
        placed = re.match(r"job \S+: switched in place to generation \d+: \d+ ranks on \d+ host\(s\) \(([^)]*)\)", text)
    if placed is None:
        return None
    return {n.strip().split(" ", 1)[0].partition("#")[0] for n in placed.group(1).split(",") if n.strip()}


def scenario_faults(b: Bench, steps: int, schedule: Sequence[Fault]) -> dict[str, Any]:
    hostfile = b.hostfile([0, 1, 2], "faults")
    state: dict[str, Any] = {"next": 0, "gen": 0, "waiting": False, "done": [], "timers": [], "placed": None,
                             "injected_at": None, "preparing": set()}
    lock = threading.Lock()
    prefix = f"elb{os.getpid() % 10000}-{b.runs + 1}-faults"

    def inject(f: Fault) -> None:
        ranks = running_ranks(prefix, b.groups, b.labels)
        with lock:  # only the generation's hosts: a joining host's ranks or a dropped host's leftovers are not the job's
            placed = state["placed"]
            hosts = sorted(h for h in ranks if placed is None or h in placed)
        rec = {"index": f.index, "kind": f.kind, "step": f.step, "time": time.time()}
        if sum(len(ranks[h]) for h in hosts) < 2:  # the job's last rank: it would end the job, not hit it
            with lock:  # the fault waits for a host to join
                state["next"], state["waiting"] = state["next"] - 1, False
            return
        label = hosts[f.pick % len(hosts)]
        h = b.labels.index(label)
        rec["host"] = label
        if f.kind in ("host", "link") and len(hosts) < 2:  # the last host lost would end the job: a rank instead
            f = Fault(f.index, f.step, "rank", f.pick, f.local_rank)
            rec["kind"] = "rank (last host)"
        if f.kind == "host":
            rec["killed"] = b.cluster.kill_host(h)

            def back(h=h) -> None:
                try:
                    b.cluster.restart_daemon(h)
                except RuntimeError as exc:
                    log(f"could not restart host {h}'s daemon: {exc}")
            timer = threading.Timer(f.seconds, back)
        elif f.kind == "rank":
            pid = dict(ranks[label]).get(f.local_rank) or ranks[label][0][1]
            os.kill(pid, signal.SIGKILL)
            rec["pid"] = pid
            timer = None
        else:
            b.cluster.link(h, False)
            timer = threading.Timer(f.seconds, b.cluster.link, (h, True))
        if timer is not None:
            timer.daemon = True
            timer.start()
            state["timers"].append(timer)
        state["done"].append(rec)
        log(f"fault {f.index + 1}/{len(schedule)}: {rec['kind']} on {label} after step {f.step}"
            + (f" for {f.seconds} s" if f.seconds and f.kind != "rank" else ""))

    def on_line(line: str) -> None:
        text = line.split("] ", 1)[1] if line.startswith("[rank ") and "] " in line else line
        if text.startswith("hapd launcher:"):
            hosts = placed_hosts(text)
            with lock:
                if hosts is not None:
                    state["placed"] = hosts
                state["preparing"] = joining_hosts(text, state["preparing"])
            return
        if '"hapd": "elastic"' not in text:
            return
        try:
            ev = json.loads(text)
        except ValueError:
            return
        with lock:
            if ev.get("event") == "first_step" and int(ev.get("generation", 0)) > state["gen"]:
                state["gen"], state["waiting"] = int(ev["generation"]), False
            if ev.get("event") not in ("step", "first_step"):
                return
            step = int(ev.get("step", 0))
            if state["waiting"] and state["injected_at"] is not None and step >= state["injected_at"] + MISSED_STEPS:
                state["waiting"] = False  # the job went on in the same generation: the fault hit none of its ranks
            # a host preparing to join: the next fault waits until it is placed, so that every
            # fault hits a job of several hosts, as a cluster that keeps its machines sees them
            if state["waiting"] or state["preparing"] or state["next"] >= len(schedule):
                return
            f = schedule[state["next"]]
            if step >= f.step:
                state["next"] += 1
                state["waiting"], state["injected_at"] = True, step
                threading.Thread(target=inject, args=(f,), daemon=True).start()

    log(f"faults: {len(schedule)} faults over {steps} steps: "
        + ", ".join(f"{f.kind}@{f.step}" for f in schedule))
    try:
        r = b.launch("faults", hostfile, [str(steps), str(b.profile)], elastic="1:3",
                     extra=["--max-restarts", str(4 * len(schedule)), "--snapshot-every", "0"], on_line=on_line,
                     timeout=600 + 300 * len(schedule))  # a fault and a rejoin cost two restarts, ~2.5 min here
    finally:
        for t in state["timers"]:
            t.cancel()
        for h in range(HOSTS):
            subprocess.run(["ip", "-n", b.cluster.namespaces[h], "link", "set", b.cluster.IFNAME, "up"],
                           capture_output=True)
            b.cluster.restart_daemon(h)
    gens = (r["report"].get("elastic") or {}).get("generations", [])
    rows = recovery_rows(r["report"])
    injected = [d for d in state["done"] if "skipped" not in d]
    out = {"steps": steps, "schedule": [f.__dict__ for f in schedule], "injected": state["done"], "code": r["code"],
           "generations": len(gens), "faults_seen": (r["report"].get("elastic") or {}).get("faults"),
           "joins": len((r["report"].get("elastic") or {}).get("joined", [])), "recoveries": rows,
           "leftover": r["leftover"], "steps_done": max(r["losses"], default=0),
           "launcher_lines": r["launcher_lines"]}
    out["all_recovered"] = r["code"] == 0 and out["steps_done"] >= steps and len(injected) == len(schedule)
    if r["code"] == 0 and gens:
        segs = chain_segments(gens, steps)
        log(f"faults: reference chain of {len(segs)} runs")
        out["check"] = check_against(r, b.chain("faultsref", segs))
    return out


SNAPSHOT_VARIANTS = ("-1", "1", "0", "off")
"""The snapshot A/B's runs: none, every step, automatic, none without the replicas."""


def scenario_snapshot(b: Bench, steps: int, last: int, rounds: int,
                      variants: Sequence[str] = SNAPSHOT_VARIANTS) -> dict[str, Any]:
    """Steps/s without snapshots, with one every step and at the automatic interval (the
    replicas of the lonely pieces on in all three, as by default), and without snapshots
    or replicas (``off``: what the replicas cost, against ``-1``). Each round runs every
    variant once (the order reversed every other round); a variant's cost is the median
    over the rounds of its steps/s against the same round's none — runs minutes apart on
    this shared machine differ by up to ~18%, runs of one round less."""
    order = ["-1", *[e for e in variants if e != "-1"]]
    res: dict[str, list[float]] = {e: [] for e in order}
    paired: dict[str, list[float]] = {e: [] for e in order}
    """Per round: the variant's steps/s over that round's none."""
    snaps: dict[str, list] = {e: [] for e in order}
    chosen: dict[str, list[int]] = {e: [] for e in order}
    """The interval in force at each run's end (the automatic one's choice)."""
    window: dict[str, list[int]] = {e: [] for e in order}
    """The snapshots taken inside each run's measured window (the last ``last`` steps)."""
    replicas: list[Any] = []
    for rnd in range(rounds):
        got: dict[str, float] = {}
        for every in (order if rnd % 2 == 0 else order[::-1]):
            log(f"snapshot: --snapshot-every {every} (round {rnd + 1})")
            flags = (["--snapshot-every", "-1", "--env", "HAPD_REPLICA=0"] if every == "off"
                     else ["--snapshot-every", every])
            r = b.launch(f"snap{every}", b.hostfile([0, 1, 2], f"snap{every}"), [str(steps), str(b.profile)],
                         elastic="2:3", extra=flags)
            tp = throughput(r["losses"], last)
            if tp:
                res[every].append(tp)
                got[every] = tp
            taken = [e for e in r["events"] if e.get("event") == "snapshot"]
            snaps[every].append(taken[:3])
            window[every].append(sum(1 for e in taken if int(e.get("step") or 0) > steps - last))
            if taken:
                chosen[every].append(int(taken[-1].get("every") or every))
            replicas += [e.get("bytes") for e in r["events"] if e.get("event") == "replicas"][:1]
        base = got.get("-1")
        for every, tp in (got.items() if base else ()):
            paired[every].append(tp / base)
    median = {e: statistics.median(v) if v else None for e, v in res.items()}
    ratio = {e: statistics.median(v) if v else None for e, v in paired.items()}
    off = ratio.get("off")
    return {"steps": steps, "last": last, "rounds": rounds, "steps_per_s": res, "paired": paired,
            "median": median, "ratio_to_none": ratio,
            "cost": {e: (1 - v if v else None) for e, v in ratio.items()},
            "replica_cost": 1 - 1 / off if off else None, "replica_bytes": replicas[:1],
            "interval": chosen, "in_window": window, "first_snapshots": snaps}


def scenario_replan(work: Path, runs: int) -> dict[str, Any]:
    """Daemon answer times for a profile cut to one host fewer, paper-8 and paper-64."""
    sys.path.insert(0, str(ROOT))
    from hapd import models
    from hapd.ir.export import export
    from hapd.ir.lower import lower
    from hapd.profile.schema import load_profile
    from hapd.wire.client import Client

    cache = _load_cache_bench()
    spec = models.get("bert")
    module, config = models.build("bert", "tiny")
    pt2 = work / "bert.pt2"
    export(module, spec.example_inputs(config, 64), path=pt2, batch_dims=spec.batch_dims, name="bert")
    graph = lower(pt2).data
    home = work / "replan-daemon"
    proc, address = cache.start_daemon(home)
    out: dict[str, Any] = {"model": "bert tiny", "batch": 64, "profiles": {}}
    try:
        with Client(address, home / "key", timeout_s=600) as client:
            client.ping()
            client.compile((ROOT / "tests" / "fixtures" / "mlp.hapg").read_bytes(), "hapg")  # warm the worker
            for name in ("paper-8", "paper-64"):
                full = load_profile(name)
                t = time.perf_counter()
                _, path_full = client.compile(graph, "hapg", profile=json.loads(full.to_json()))
                full_s = time.perf_counter() - t
                row = {"full_s": full_s, "full_path": path_full, "subsets": []}
                for drop in list(dict.fromkeys([full.hosts[-1], full.hosts[0]]))[:runs]:
                    sub = full.on_hosts([h for h in full.hosts if h != drop])
                    doc = json.loads(sub.to_json())
                    t = time.perf_counter()
                    _, p1 = client.compile(graph, "hapg", profile=doc)
                    first = time.perf_counter() - t
                    hits = []
                    for _ in range(5):
                        t = time.perf_counter()
                        _, p2 = client.compile(graph, "hapg", profile=doc)
                        hits.append(time.perf_counter() - t)
                    row["subsets"].append({"without": drop, "devices": len(sub.devices), "first_s": first,
                                           "first_path": p1, "hit_s": sorted(hits)[len(hits) // 2], "hit_path": p2})
                out["profiles"][name] = row
            client.shutdown()
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return out


def _load_cache_bench():
    name = "hapd_bench_cache"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "cache.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def state_source(source: str | None) -> str:
    """Where a resume's state came from, in a word: ``memory`` (the survivors' copies),
    ``memory+replicas`` (and replicas of lost ranks' pieces), ``snapshot``, else ``-``."""
    if not source:
        return "-"
    if source.startswith("survivors' memory"):
        return "memory+replicas" if "from replicas" in source else "memory"
    return "snapshot" if source.startswith("snapshot") else source.split(",")[0][:20]


# ----------------------------------------------------------------------------- tables


def tables(results: Mapping[str, Any]) -> list[str]:
    out = []
    kill = results.get("kill")
    if kill:
        rows = []
        for r in kill["runs"]:
            rec = (r.get("recovery") or [{}])[0]
            chk = r.get("check") or {}
            survivors = ("in place" if r.get("step_copies", True) else "in place, no copies") if r.get("in_place") \
                else "restart"
            copy_share = (r["step_copy_s"] / r["step_s"]) if r.get("step_copy_s") and r.get("step_s") else None
            rows.append([r["every"], survivors, r["code"], r.get("kill_to_first_step_s"), rec.get("total_s"), rec.get("detection_s"),
                         rec.get("replan_s"), rec.get("restart_s"), rec.get("load_s"), rec.get("resumed_step"),
                         rec.get("steps_lost"), (chk.get("losses") or {}).get("max_rel"),
                         chk.get("digest_equal"), (chk.get("samples") or {}).get("skipped"),
                         (chk.get("samples") or {}).get("repeated"), r.get("leftover"), str(rec.get("source"))[:60],
                         r.get("step_copy_s"), copy_share])
        out.append(format_table(
            f"1. host kill after step {kill['kill_at']} of {kill['steps']} (3 → 2 hosts); seconds",
            ["every", "survivors", "exit", "kill→step", "total", "detect", "replan", "restart", "load", "resumed", "lost",
             "max rel Δloss", "digest =", "skipped", "repeated", "orphans", "state from", "step copy s",
             "copy/step"], rows))
    rankkill = results.get("rankkill")
    if rankkill:
        rows = []
        for r in rankkill["runs"]:
            rec = (r.get("recovery") or [{}])[0]
            chk = r.get("check") or {}
            rows.append([r["code"], "in place" if r["in_place"] else "restart", r.get("kill_to_first_step_s"),
                         rec.get("total_s"), rec.get("detection_s"), rec.get("replan_s"), rec.get("restart_s"),
                         rec.get("load_s"), rec.get("resumed_step"), rec.get("steps_lost"),
                         "→".join(str(w) for w in r.get("worlds", [])), (chk.get("losses") or {}).get("max_rel"),
                         chk.get("digest_equal"), (chk.get("samples") or {}).get("skipped"),
                         (chk.get("samples") or {}).get("repeated"), r.get("leftover")])
        out.append(format_table(
            f"2b. rank kill (local rank 1 of host 2) after step {rankkill['kill_at']} of {rankkill['steps']}; seconds",
            ["exit", "others", "kill→step", "total", "detect", "replan", "switch/restart", "load", "resumed", "lost",
             "worlds", "max rel Δloss", "digest =", "skipped", "repeated", "orphans"], rows))
    join = results.get("join")
    if join:
        chk = join.get("check") or {}
        out.append(format_table(
            f"2. host join after step {join['join_at']} of {join['steps']} (2 → 3 hosts); steps/s over the last "
            f"{join['last']} steps (target ≥ {JOIN_TARGET:.0%} of a fresh 3-host launch)",
            ["exit", "in place", "join→step s", "answered→step s", "others idle s", "paused at", "resumed",
             "worlds after", "steps/s joined", "steps/s fresh", "ratio", "max rel Δloss", "digest ="],
            [[join["code"], join.get("in_place"), join.get("join_to_first_step_s"),
              join.get("answered_to_first_step_s"), join.get("others_idle_s"),
              join.get("paused_at_step"), join.get("resumed_step"),
              join.get("worlds_after_join"), join.get("steps_per_s_after_join"), join.get("steps_per_s_fresh"),
              join.get("ratio"), (chk.get("losses") or {}).get("max_rel"), chk.get("digest_equal")]]))
    faults = results.get("faults")
    if faults:
        rows = [[d["index"] + 1, d["kind"], d.get("host"), d["step"]] for d in faults["injected"]]
        out.append(format_table("3. random faults (injected)", ["#", "kind", "host", "after step"], rows))
        rec = [[r["generation"], ",".join(r["lost"]) or "-", r["total_s"], r["detection_s"], r["replan_s"],
                r["restart_s"], r["load_s"], r["resumed_step"], r["steps_lost"], state_source(r.get("source"))]
               for r in faults["recoveries"]]
        out.append(format_table("   recoveries (launcher report); seconds",
                                ["gen", "lost", "total", "detect", "replan", "restart", "load", "resumed", "lost steps",
                                 "state from"], rec))
        chk = faults.get("check") or {}
        out.append(format_table(
            "   summary", ["exit", "injected", "faults seen", "joins", "generations", "all recovered", "orphans",
                          "chain runs", "max rel Δloss", "digest =", "skipped", "repeated"],
            [[faults["code"], len(faults["injected"]), faults["faults_seen"], faults["joins"], faults["generations"],
              faults["all_recovered"], faults["leftover"], len(chk.get("segments") or []),
              (chk.get("losses") or {}).get("max_rel"), chk.get("digest_equal"),
              (chk.get("samples") or {}).get("skipped"), (chk.get("samples") or {}).get("repeated")]]))
    snap = results.get("snapshot")
    if snap:
        names = {"-1": "none (-1)", "1": "every step (1)", "0": "auto (0)"}
        def interval(e: str) -> str:
            got = (snap.get("interval") or {}).get(e) or []
            return ", ".join(str(x) for x in got) if e == "0" else ("-" if e in ("-1", "off") else e)

        def lost(e: str) -> str:  # a fault loses the steps since the last snapshot: 0 … every-1, (every-1)/2 on average
            got = (snap.get("interval") or {}).get(e) or []
            return "-" if e == "-1" or not got else ", ".join(f"≤{x - 1} (avg {(x - 1) / 2:g})" for x in got)

        names["off"] = "none, no replicas"
        rows = [[names[e], snap["median"][e], snap["ratio_to_none"][e], (snap.get("cost") or {}).get(e), interval(e),
                 ", ".join(str(n) for n in (snap.get("in_window") or {}).get(e, [])) or "-",
                 lost(e), ", ".join(f"{x:.3g}" for x in snap["steps_per_s"][e]),
                 ", ".join(f"{x:.3f}" for x in (snap.get("paired") or {}).get(e, []))]
                for e in SNAPSHOT_VARIANTS if e in snap["median"]]
        out.append(format_table(f"4. snapshot cost: steps/s over the last {snap['last']} of {snap['steps']} steps, "
                                f"{snap['rounds']} round(s); vs none: the median over the rounds of each round's "
                                "ratio (target: automatic ≤ 5% of step time)",
                                ["snapshots", "steps/s (median)", "vs none", "cost", "interval", "taken in window",
                                 "steps lost per fault", "runs", "each round vs none"], rows))
        if snap.get("replica_cost") is not None:
            out.append(f"   the replicas of the lonely pieces (bytes a step by rank: {snap.get('replica_bytes')}) "
                       f"cost {snap['replica_cost']:.1%} of the steps/s without them")
    replan = results.get("replan")
    if replan:
        rows = []
        for name, p in replan["profiles"].items():
            for s in p["subsets"]:
                rows.append([name, s["without"], s["devices"], p["full_s"] * 1e3, p["full_path"], s["first_s"] * 1e3,
                             s["first_path"], s["hit_s"] * 1e3, s["hit_path"]])
        out.append(format_table(f"5. re-plan through the daemon ({replan['model']}, batch {replan['batch']}); ms",
                                ["profile", "without", "devices", "full", "path", "subset 1st", "path", "subset again",
                                 "path"], rows))
    return out


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default="kill,rankkill,join,faults,snapshot,replan")
    p.add_argument("--quick", action="store_true", help="30 steps, 4 faults, one snapshot round")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--faults", type=int, default=None)
    p.add_argument("--faults-steps", type=int, default=None,
                   help="the faults scenario's steps (default --steps): enough for its faults and the hosts' rejoins")
    p.add_argument("--snapshot-steps", type=int, default=None,
                   help="each snapshot A/B run's steps, steps/s taken over the last half (default 2/3 of --steps); "
                        "at the automatic interval (~10 steps here) a window of 20 steps holds 1 or 2 snapshots, so "
                        "its cost reads ±50%%: take 150 or more")
    p.add_argument("--seed", type=int, default=33)
    p.add_argument("--kill-runs", default=None,
                   help="the kill and rankkill scenarios' runs: EVERY:in-place|restart|in-place-snapshot (in place, "
                        "the step copies off: the state from the snapshot), comma-separated (default: kill "
                        f"{KILL_RUNS}, rankkill {RANKKILL_RUNS})")
    p.add_argument("--no-check", action="store_true",
                   help="kill and rankkill: no reference chain (times only; nothing checked for exactness)")
    p.add_argument("--mode", default="auto", choices=["auto", "data_parallel"],
                   help="the compiler's mode for every run: data_parallel makes every rank hold every tensor, so "
                        "that survivors hold the whole state after a kill (default: auto)")
    p.add_argument("--rounds", type=int, default=1, help="snapshot A/B rounds (the order reversed every other round)")
    p.add_argument("--snapshot-variants", default=",".join(SNAPSHOT_VARIANTS),
                   help="the snapshot A/B's runs, comma-separated: -1 (none, always run: the baseline), 1 (every "
                        "step), 0 (automatic), off (none, no replicas)")
    p.add_argument("--rate-mbit", type=float, default=400.0, help="tbf rate of every host's link (default 400)")
    p.add_argument("--out", type=Path, default=OUT / "elastic_cluster.json")
    p.add_argument("--standby", type=int, default=RANKS_PER_HOST,
                   help="warm rank processes each daemon keeps (hapd serve --standby, importing transformers and "
                        f"its GPT-2 ahead); 0: every rank a new process (default {RANKS_PER_HOST})")
    p.add_argument("--keep", action="store_true", help="leave the cluster up (debugging)")
    p.add_argument("--logs", type=Path, default=None,
                   help="write each launcher run's whole stdout and stderr there (JOB.log, each line after the "
                        "time it came)")
    p.add_argument("-v", "--verbose", action="store_true")
    ns = p.parse_args(argv)
    ns.steps = ns.steps or (30 if ns.quick else 60)
    ns.faults_steps = ns.faults_steps or ns.steps
    ns.snapshot_steps = ns.snapshot_steps or max(20, 2 * ns.steps // 3)
    ns.faults = ns.faults if ns.faults is not None else (4 if ns.quick else 10)
    ns.scenarios = [s.strip() for s in ns.scenarios.split(",") if s.strip()]
    given = ns.kill_runs
    try:
        ns.kill_runs = kill_variants(given or KILL_RUNS)
        ns.rankkill_runs = kill_variants(given or RANKKILL_RUNS)
    except (ValueError, KeyError):
        p.error(f"--kill-runs {given!r}: expected EVERY:in-place or EVERY:restart, comma-separated")
    ns.snapshot_variants = [v.strip() for v in ns.snapshot_variants.split(",") if v.strip()]
    if not set(ns.snapshot_variants) <= set(SNAPSHOT_VARIANTS):
        p.error(f"--snapshot-variants {','.join(ns.snapshot_variants)}: each one of {', '.join(SNAPSHOT_VARIANTS)}")
    unknown = set(ns.scenarios) - {"kill", "rankkill", "join", "faults", "snapshot", "replan"}
    if unknown:
        p.error(f"unknown scenario(s) {sorted(unknown)}")
    return ns


KILL_RUNS = "1:in-place,1:restart,0:in-place"
RANKKILL_RUNS = "1:in-place,1:restart"


def kill_variants(text: str) -> list[tuple[int, bool | str]]:
    """``--kill-runs``' text as (``--snapshot-every``, in place) pairs; ValueError or
    KeyError for a run that is not ``EVERY:MODE``."""
    modes = {"in-place": True, "restart": False, "in-place-snapshot": NO_COPIES}
    return [(int(every), modes[mode]) for every, mode in (run.strip().split(":") for run in text.split(",")
                                                          if run.strip())]


def _on_term(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _save(results: Mapping[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, default=str) + "\n")


def main(argv=None) -> int:
    ns = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    work = Path(tempfile.mkdtemp(prefix="hapd-elastic-"))
    os.environ.setdefault("HAPD_HOME", str(work / "home"))
    results: dict[str, Any] = {"steps": ns.steps, "quick": ns.quick, "rate_mbit": ns.rate_mbit, "standby": ns.standby,
                               "host_speeds": list(HOST_SPEEDS), "model": "zoo.gpt2 width 128, 2 layers, vocab 512, "
                               "seq 32, batch 24, 600 samples, Adam 1e-3, dropout 0.1"}
    cluster = None
    code = 0
    try:
        if "replan" in ns.scenarios:
            log("replan: paper-8 and paper-64")
            results["replan"] = scenario_replan(work, 2)
            _save(results, ns.out)
        cluster_scenarios = [s for s in ns.scenarios if s != "replan"]
        why = available() if cluster_scenarios else None
        if why:
            print(f"elastic_cluster: scenarios {', '.join(cluster_scenarios)} skipped: {why}")
            results["skipped"] = why
        elif cluster_scenarios:
            quotas = rank_quotas()
            groups = setup_cgroups(quotas)
            cluster = make_cluster(work)
            if ns.standby:
                # the model's class read too: transformers imports a model's module when its class is first
                # read (~0.6 s of CPU for GPT-2's, ~3.6 s of a joining rank's script on a sixth of a core)
                cluster.daemon_args = ("--standby", str(ns.standby), "--standby-import", "transformers:GPT2LMHeadModel")
            cluster.create()
            cluster.shape(ns.rate_mbit)
            cluster.start()
            from hapd.profile.schema import estimated_profile

            lines = cluster.host_lines(slots=[RANKS_PER_HOST] * HOSTS).splitlines()
            from launcher.hosts import parse_hosts

            labels = [h.label for h in parse_hosts("\n".join(lines), "<bench>")]
            profile = work / "profile.json"
            flops = [q * FLOPS_PER_CORE for q in quotas for _ in range(RANKS_PER_HOST)]
            estimated_profile(HOSTS * RANKS_PER_HOST, flops=flops, hosts=[l for l in labels for _ in
                                                                          range(RANKS_PER_HOST)],
                              beta=ns.rate_mbit * 1e6 / 8, name="elastic-bench").save(profile)
            script = work / "train.py"
            script.write_text(TRAIN_SCRIPT)
            b = Bench(cluster, work, labels, lines, profile, script, groups, ns.verbose, ns.mode, not ns.no_check,
                      logs=ns.logs)
            results["quotas"] = quotas
            log(f"cluster up: hosts {labels}, per-rank quotas {[round(q, 3) for q in quotas]} cores, "
                f"link {ns.rate_mbit} Mbit/s")
            s = ns.steps
            if "kill" in cluster_scenarios:
                results["kill"] = scenario_kill(b, s, max(2, s // 3), ns.kill_runs)
                _save(results, ns.out)
            if "rankkill" in cluster_scenarios:
                results["rankkill"] = scenario_rankkill(b, s, max(2, s // 3), ns.rankkill_runs)
                _save(results, ns.out)
            if "join" in cluster_scenarios:
                # its ranks start and export while the others train: on the slowest host ~45 s to be ready
                results["join"] = scenario_join(b, 4 * s, max(2, s // 6), max(3, s // 6))
                _save(results, ns.out)
            if "faults" in cluster_scenarios:
                # the faults fall in the job's first half: each waits for the hosts that rejoin
                # after the one before (~50 s on a sixth of a core), so they come later than drawn
                fs = ns.faults_steps
                schedule = fault_schedule(ns.seed, ns.faults, max(ns.faults + 6, fs // 2), first=3)
                results["faults"] = scenario_faults(b, fs, schedule)
                _save(results, ns.out)
            if "snapshot" in cluster_scenarios:
                results["snapshot"] = scenario_snapshot(b, ns.snapshot_steps, max(5, ns.snapshot_steps // 2), ns.rounds,
                                                        ns.snapshot_variants)
            results["leftovers"] = b.leftovers
    except KeyboardInterrupt:
        log("interrupted: tearing down")
        code = 130
    finally:
        _save(results, ns.out)
        if ns.keep:
            log(f"--keep: leaving the namespaces, cgroups and {work}")
        else:
            if cluster is not None:
                cluster.close()
            if available() is None:
                teardown_cgroups()
            shutil.rmtree(work, ignore_errors=True)
    print()
    for t in tables(results):
        print(t)
        print()
    print(f"wrote {ns.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
