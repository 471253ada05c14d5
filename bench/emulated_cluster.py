#!/usr/bin/env python3
"""hapd vs DP-EV vs DP-CP on an emulated heterogeneous cluster, and the cost model's error.

    .venv/bin/python bench/emulated_cluster.py --quick            # one model, few iterations, 3:1
    .venv/bin/python bench/emulated_cluster.py --models bert,vit --variants 3:1
    .venv/bin/python bench/emulated_cluster.py                    # bert,vit,bert_moe × 3:1,2:1,1:1
    .venv/bin/python bench/emulated_cluster.py --models all --variants 3:1   # every benchmark model
    .venv/bin/python bench/emulated_cluster.py --models zoo.gpt2,zoo.resnet18 --variants 3:1   # the zoo's

Needs root (network namespaces, tc, cpu cgroups v1); without it, prints why and exits 0.

Emulated cluster (DESIGN.md §5), built and torn down by this script:

- **2 machines**: network namespaces ``hapd-e0`` and ``hapd-e1`` on a bridge through veth
  pairs (``bench/launcher.py``'s :class:`NamespaceCluster`), one ``hapd serve`` per
  namespace (shared key file, its own ``--state`` home). The daemons enter the namespace
  with ``nsenter --net`` rather than ``ip netns exec``, which remounts ``/sys`` and hides
  the cgroup files the ranks must write.
- **the link**: ``tc qdisc … tbf rate R`` on each namespace's interface (what a machine
  sends); ranks of one machine talk over loopback (unshaped). ``R`` keeps the paper
  cluster's compute-to-bandwidth balance: a V100 doing ~5 TFLOP/s over ~10 Gbit/s
  (1.25 GB/s) is ~4000 FLOP per byte; here ``R = fast rank FLOP/s / 4000`` with the fast
  rank's matmul FLOP/s measured first (``--rate-mbit`` overrides).
- **devices**: 4 ranks, 2 per machine; machine 0 runs the 2 "fast" ranks, machine 1 the 2
  "slow" ones. Every rank is in its own cpu cgroup ``/sys/fs/cgroup/cpu/hapd-e-r{0..3}``
  (``bench/in_cgroup.py`` moves the rank's process at its start, so the whole run is
  inside): CFS period 10 ms (a 100 ms period made collective latency jitter huge),
  quotas of the variant (3:1 → 0.75/0.75/0.25/0.25 of a core; total 2 cores, the
  machine), ``cpu.shares`` raised so the quota, not other load on the machine, sets the
  rank's speed. One thread per rank (``OMP_NUM_THREADS=1``).

Models: the ``small`` presets by default (width 256, 4 layers, 3–9M parameters; a fast
rank trains them at 55–90% of its 512³-matmul FLOP/s depending on the machine — measured
and printed every run — where the 32-wide ``tiny`` ones reach 20–30%), global batch 64
(``--size``, ``--batch``, ``--layers`` override). The third-party zoo (transformers and
torchvision, ``pip install -e '.[test]'``) runs by its registry names, ``zoo.gpt2``,
``zoo.resnet18``, … (``--models zoo`` for all of them): their ``small`` sizes are as wide
(GPT-2 3.4M parameters, sequence 64; resnet18 on 64×64 images, global batch 128).

Per variant: profile the cluster (``hapd.profiler.driver`` on the 4 ranks through the daemons,
each rank in its cgroup), then per model, through the launcher (``./run_all``'s
``python -m launcher run``): hapd's plan (``worker.py --profile``), DP-EV (``ddp.py --split
even``) and DP-CP (``ddp.py --split flops --profile``). Prints one table, writes
``bench/out/emulated_cluster.json`` and a PNG bar chart beside it (matplotlib: ``pip
install -e '.[bench]'``; without it the script says so and writes no chart). Every target
is printed: one a failed run leaves unmeasured reads ``MISS (run failed: …)``, and the
script then exits 1 (``--from-json`` too, re-printing such a run).

Columns: "ideal" is hapd's share of the ideal step (the model's FLOPs over the cluster's
summed matmul FLOP/s); "bound" its share of the larger of that and the least time the
plan's own gradient sum takes over the machines' link (its replicated parameters'
gradients, ``2·(hosts-1)/hosts`` of their bytes out of each machine): what no schedule
of that plan beats. The diagnosis (not a target) adds hapd's share of the same bound at
the model's achieved rate: the FLOP/s one fast rank alone trains that model at (measured
first, printed as "compute: …"), scaled to each rank by its quota, in place of the
512³-matmul rate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv" / "bin" / "python") if (ROOT / ".venv" / "bin" / "python").exists() else sys.executable
OUT = ROOT / "bench" / "out"
CG_ROOT = Path("/sys/fs/cgroup/cpu")
CG_NAMES = [f"hapd-e-r{i}" for i in range(4)]
PERIOD_US = 10_000
SHARES = 8192
FLOP_PER_BYTE = 4000.0
"""Paper balance: ~5e12 FLOP/s (V100) over ~1.25e9 B/s (10 Gbit/s)."""
RANKS_PER_HOST = 2
SYSTEMS = ["hapd", "ddp-ev", "ddp-cp"]
SPEEDUP_TARGET_MODELS = {"bert", "vit", "bert_moe", "zoo.gpt2", "zoo.resnet18"}
"""The models the 3:1 speed-up targets (≥1.6× DP-EV, ≥1.2× DP-CP) are checked on."""

# Default benchmark sizes: the "small" presets (width 256, 4 layers: matmuls near a core's
# peak, unlike the 32-wide "tiny" ones) with a global batch that keeps DP-EV around a
# second per iteration. --size tiny uses DEFAULT_BATCH_TINY. The zoo's small language
# models are as wide (GPT-2: 3.4M parameters, its gradient sum ~1.4 s over the link, so
# DP-EV cannot go much under 2 s); resnet18 keeps its 11.2M parameters at any image
# size, so its gradient sum alone takes ~3-5 s and batch 128 (64×64 images) gives DP-EV's
# slow rank ~1.5 s of compute beside it.
DEFAULT_SIZE = "small"
DEFAULT_BATCH = {"bert": 64, "vit": 64, "bert_moe": 64, "mlp": 512, "vgg19": 64,
                 "gpt2_block": 64, "llama_block": 64,
                 "zoo.gpt2": 64, "zoo.llama": 64, "zoo.bert": 64, "zoo.mixtral": 64, "zoo.qwen2_moe": 64,
                 "zoo.t5": 64, "zoo.resnet18": 128, "zoo.vit": 64}
DEFAULT_BATCH_TINY = {"bert": 1024, "vit": 384, "bert_moe": 1024, "mlp": 512, "vgg19": 16}
DEFAULT_LAYERS_TINY = {"bert": 4, "vit": 4, "bert_moe": 4}


def default_batch(model: str, size: str) -> int:
    return (DEFAULT_BATCH_TINY if size == "tiny" else DEFAULT_BATCH).get(model, 64)


def default_layers(model: str, size: str) -> int | None:
    return DEFAULT_LAYERS_TINY.get(model) if size == "tiny" else None


def _load_bench_launcher():
    name = "hapd_bench_launcher"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / "launcher.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def log(msg: str) -> None:
    print(f"[emulated {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------- setup


def available() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc, cpu cgroups)"
    for tool in ("ip", "tc", "nsenter"):
        if shutil.which(tool) is None:
            return f"needs {tool}"
    if not (CG_ROOT / "cpu.cfs_quota_us").exists():
        return f"needs the cgroup v1 cpu controller at {CG_ROOT}"
    return None


def make_cluster_class():
    bench = _load_bench_launcher()

    class EmulatedCluster(bench.NamespaceCluster):
        """Two namespaces hapd-e0/hapd-e1; daemons entered with ``nsenter --net``."""

        def __init__(self, workdir: Path) -> None:
            super().__init__(workdir, 2, RANKS_PER_HOST, tag=9917)
            self.namespaces = ["hapd-e0", "hapd-e1"]
            self.subnet = "10.77.217"
            self.ips = [f"{self.subnet}.{i + 2}" for i in range(2)]
            self.bridge = "hapdebr"

        def _command(self, i: int) -> list[str]:
            return ["nsenter", f"--net=/var/run/netns/{self.namespaces[i]}", "--"]

    return EmulatedCluster


def model_names(text: str) -> list[str]:
    """``--models``: 'all' (every benchmark model), 'zoo' (every zoo model) or a
    comma-separated list of benchmark and zoo models (``zoo.gpt2``, …)."""
    from hapd.models import MODELS, NAMES, ZOO_MODELS

    groups = {"all": list(MODELS), "zoo": list(ZOO_MODELS)}
    names = groups.get(text.strip()) or [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in NAMES]
    if unknown or not names:
        raise ValueError(f"--models {text!r}: unknown {unknown or 'empty'}; "
                         f"choose from {', '.join(NAMES)}, 'all' or 'zoo'")
    return names


def parse_variant(text: str, cores: float = 2.0) -> tuple[float, float]:
    """'3:1' → quotas (fast, slow) in cores, 2 fast + 2 slow summing to ``cores`` (the
    whole 2-core machine by default; less leaves the kernel's networking and Gloo's
    threads a core share of their own, as separate machines would have)."""
    if not (math.isfinite(cores) and 0 < cores <= 64):
        raise ValueError(f"cores {cores!r}: the quotas must sum to a positive number of cores")
    try:
        fast, slow = (float(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"variant {text!r} is not FAST:SLOW (e.g. 3:1)") from None
    if not (fast > 0 and slow > 0 and math.isfinite(fast) and math.isfinite(slow)):
        raise ValueError(f"variant {text!r}: both parts must be positive numbers")
    scale = cores / (2 * fast + 2 * slow)
    return fast * scale, slow * scale


def setup_cgroups(quotas: list[float]) -> list[Path]:
    groups = []
    for name, quota in zip(CG_NAMES, quotas):
        group = CG_ROOT / name
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
        (group / "cpu.cfs_quota_us").write_text(f"{int(round(quota * PERIOD_US))}\n")
        (group / "cpu.shares").write_text(f"{SHARES}\n")
        groups.append(group)
    return groups


def teardown_cgroups() -> None:
    for name in CG_NAMES:
        group = CG_ROOT / name
        if group.exists() and not _load_bench_launcher().remove_cgroup(group, CG_ROOT):
            log(f"could not remove {group}")


def measure_rank_flops(group: Path, seconds: float = 1.5) -> float:
    """Single-thread float32 512³ matmul FLOP/s of one process inside ``group``."""
    code = (
        "import os, sys, time, torch\n"
        f"open('{group}/cgroup.procs', 'w').write(str(os.getpid()))\n"
        "torch.set_num_threads(1)\n"
        "a = torch.randn(512, 512); b = torch.randn(512, 512)\n"
        "for _ in range(3): a @ b\n"
        f"n = 0; t0 = time.perf_counter()\n"
        f"while time.perf_counter() - t0 < {seconds}: a @ b; n += 1\n"
        "print(2 * 512 ** 3 * n / (time.perf_counter() - t0))\n")
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"flops probe failed: {done.stderr[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- jobs

PROFILE_SHIM = '''\
import os, sys
os.environ["HAPD_HOST"] = "emu" + os.environ.get("GROUP_RANK", "0")
from hapd.profiler.driver import main
sys.exit(main(sys.argv[1:]))
'''


class Runner:
    def __init__(self, cluster, work: Path, hostfile: Path, groups: list[Path], verbose: bool) -> None:
        self.cluster, self.work, self.hostfile, self.groups, self.verbose = cluster, work, hostfile, groups, verbose

    def launch(self, args: list[str], report: Path | None, timeout: float) -> subprocess.CompletedProcess:
        cmd = [PY, "-m", "launcher", "run", "bench/in_cgroup.py", "-n", str(RANKS_PER_HOST), "--hosts", str(self.hostfile),
               "--key", str(self.cluster.key_file), "--cwd", str(ROOT), "--timeout", "20", "--lost-after", "30",
               "--env", f"GLOO_SOCKET_IFNAME={self.cluster.IFNAME}", "--env", "OMP_NUM_THREADS=1",
               "--env", "HAPD_RANK_CGROUPS=" + ":".join(str(g) for g in self.groups)]
        if report is not None:
            cmd += ["--report", str(report)]
        cmd += ["--", *args]
        if self.verbose:
            log("$ " + " ".join(cmd))
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException:  # Ctrl-C, SIGTERM or the timeout: the launcher stops every rank on every host
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=30)
            except BaseException:
                proc.kill()
                proc.communicate()
            raise
        done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
        if self.verbose or done.returncode != 0:
            sys.stdout.write(done.stdout[-4000:])
            sys.stderr.write(done.stderr[-4000:])
        return done

    def profile(self, out: Path, quick: bool) -> dict:
        shim = self.work / "profile_rank.py"
        shim.write_text(PROFILE_SHIM)
        args = [str(shim), "--out", str(out), "--name", out.stem]
        if quick:
            args.append("--quick")
        done = self.launch(args, None, timeout=900)
        if done.returncode != 0 or not out.exists():
            raise RuntimeError(f"profiling failed (exit {done.returncode})")
        return json.loads(out.read_text())

    def train(self, system: str, model: str, ns: argparse.Namespace, profile: Path, tag: str) -> dict:
        batch = ns.batch or default_batch(model, ns.size)
        common = ["--model", model, "--size", ns.size, "--batch", str(batch), "--iterations", str(ns.iterations),
                  "--warmup", str(ns.warmup)]
        layers = default_layers(model, ns.size) if ns.layers is None else ns.layers
        if layers:
            common += ["--layers", str(layers)]
        if system == "hapd":
            args = ["worker.py", *common, "--profile", str(profile), "--technique", ns.hapd_technique]
        elif system == "ddp-ev":
            args = ["ddp.py", *common, "--split", "even"]
        else:
            args = ["ddp.py", *common, "--split", "flops", "--profile", str(profile)]
        if system != "hapd" and ns.ddp_bucket_mib is not None:
            args += ["--bucket-mib", str(ns.ddp_bucket_mib)]
        report = self.work / f"{tag}-{model}-{system}.json"
        for attempt in (1, 2):  # one retry: a rank now and then aborts in Gloo's teardown
            t0 = time.monotonic()
            report.unlink(missing_ok=True)
            done = self.launch(args, report, timeout=ns.run_timeout)
            row: dict[str, Any] = {"model": model, "system": system, "batch": batch, "layers": layers,
                                   "exit_code": done.returncode, "wall_s": time.monotonic() - t0, "attempt": attempt}
            data = json.loads(report.read_text()) if report.exists() else {}
            summary = data.get("summary") or {}
            overall = data.get("overall") or {}
            complete = not data.get("missing_ranks") and (summary.get("mean_s") or overall.get("mean_s"))
            if done.returncode == 0 or complete:
                break
        if not complete:
            row["error"] = (done.stderr or done.stdout)[-600:]
            return row
        if done.returncode != 0:  # every rank reported its timings, then one exited badly
            row["warning"] = f"exit {done.returncode} after all timings: " + done.stderr.strip()[-200:]
        row["mean_s"] = summary.get("mean_s", overall.get("mean_s"))
        row["std_s"] = summary.get("std_s", overall.get("std_s"))
        row["per_rank_mean_s"] = [r.get("mean_s") for r in data.get("ranks", [])]
        if system == "hapd":
            row["estimate_s"] = summary.get("estimate_s")
            row["ratios"] = summary.get("ratios")
            row["chosen_from"] = summary.get("chosen_from")
            row["technique"] = summary.get("technique", "spmd")
        return row


class Session:
    """What one benchmark run sets up on this machine and takes down again: a work folder
    (``HAPD_HOME`` below it unless set), the 4 ranks' cgroups, and once started the two
    namespaces joined by the shaped link, their daemons and the launcher's :class:`Runner`
    over the ranks (host 0 fast, host 1 slow)."""

    def __init__(self, prefix: str, verbose: bool) -> None:
        self.work = Path(tempfile.mkdtemp(prefix=prefix))
        self.verbose = verbose
        self.groups: list[Path] = []
        self.cluster = None
        self.runner: Runner | None = None
        os.environ.setdefault("HAPD_HOME", str(self.work / "home"))

    def measure_link(self, fast_quota: float, rate_mbit: float | None) -> tuple[float, float]:
        """Every rank's cgroup at ``fast_quota``; the fast rank's matmul FLOP/s and the
        link rate in Mbit/s it sets (:data:`FLOP_PER_BYTE`), or ``rate_mbit`` when given."""
        self.groups = setup_cgroups([fast_quota] * 4)
        rank_flops = measure_rank_flops(self.groups[0])
        return rank_flops, rate_mbit or rank_flops / FLOP_PER_BYTE * 8 / 1e6

    def start(self, rate_mbit: float) -> Runner:
        """The cluster up with its link at ``rate_mbit``; the runner that launches jobs on it."""
        self.cluster = make_cluster_class()(self.work)
        self.cluster.create()
        self.cluster.shape(rate_mbit)
        self.cluster.start()
        hostfile = self.work / "hosts.txt"
        hostfile.write_text(self.cluster.host_lines(slots=[RANKS_PER_HOST] * 2, gpus=["fast", "slow"]))
        self.runner = Runner(self.cluster, self.work, hostfile, self.groups, self.verbose)
        return self.runner

    def run(self, body: Callable[[], None], save: Callable[[], None], keep: bool, log: Callable[[str], None]) -> int:
        """``body()``, then the exit code: 0, or 130 when Ctrl-C or SIGTERM
        (:func:`stop_on_signals`) stopped it, after ``save()`` kept what it measured. The
        session is taken down either way (``keep``: left up, for debugging)."""
        try:
            body()
            return 0
        except KeyboardInterrupt:
            log("interrupted: tearing down")
            save()
            return 130
        finally:
            if keep:
                log(f"--keep: leaving namespaces hapd-e0/1, cgroups {CG_NAMES}, daemons, {self.work}")
            else:
                self.close()

    def close(self) -> None:
        if self.cluster is not None:
            self.cluster.close()
        teardown_cgroups()
        shutil.rmtree(self.work, ignore_errors=True)


# ----------------------------------------------------------------------------- model FLOPs and plans


def model_flops(model: str, size: str, batch: int, layers: int | None) -> float:
    """FLOPs of one training iteration (forward + backward) on the global batch."""
    from torch.utils.flop_counter import FlopCounterMode

    sys.path.insert(0, str(ROOT))
    from hapd import models

    overrides = {"layers": layers} if layers else {}
    net, config = models.build(model, size, **overrides)
    inputs = models.get(model).example_inputs(config, batch)
    counter = FlopCounterMode(display=False)
    with counter:
        out = net(*inputs)
        loss = out if out.dim() == 0 else out.float().sum()
        loss.backward()
    return float(counter.get_total_flops())


def step_seconds(group: Path, model: str, size: str, layers: int | None, batches: Sequence[int], seconds: float,
                 min_steps: int = 1, timeout: float = 300) -> dict[int, float]:
    """Seconds per training step (forward + backward) of ``model`` at each batch of
    ``batches``, in one process inside the cpu cgroup ``group`` (1 thread, eager PyTorch,
    no communication): 2 warm-up steps, then steps for ``seconds`` and at least
    ``min_steps``. A failed process raises RuntimeError with the end of its stderr."""
    code = (
        "import os, sys, time, torch\n"
        f"open('{group}/cgroup.procs', 'w').write(str(os.getpid()))\n"
        "torch.set_num_threads(1)\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from hapd import models\n"
        f"net, cfg = models.build({model!r}, {size!r}, **({{'layers': {layers}}} if {bool(layers)} else {{}}))\n"
        f"for b in {list(batches)!r}:\n"
        f"    x = models.get({model!r}).example_inputs(cfg, b)\n"
        "    def step():\n"
        "        out = net(*x); (out if out.dim() == 0 else out.float().sum()).backward()\n"
        "    for _ in range(2): step()\n"
        "    n = 0; t0 = time.perf_counter()\n"
        f"    while time.perf_counter() - t0 < {seconds} or n < {min_steps}: step(); n += 1\n"
        "    print('step', b, (time.perf_counter() - t0) / n, flush=True)\n")
    done = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-500:])
    rows = (line.split() for line in done.stdout.splitlines() if line.startswith("step "))
    return {int(b): float(t) for _, b, t in rows}


def model_rate(group: Path, model: str, size: str, batch: int, layers: int | None, flops: float) -> float:
    """Achieved FLOP/s of one process in ``group`` (1 thread) training ``model`` on batch/4
    (one rank's DP-EV share): what the model's ops really reach, next to the profile's
    matmul rate that "ideal" divides by."""
    share = max(1, batch // 4)
    try:
        per_step = step_seconds(group, model, size, layers, [share], 2.0)[share]
    except RuntimeError as e:
        log(f"model rate probe failed: {e}")
        return float("nan")
    return flops / 4 / per_step


def explain_plan(model: str, size: str, batch: int, layers: int | None, profile: Path, work: Path,
                 technique: str = "default") -> tuple[str, dict]:
    """Compile hapd's plan the way the worker does (same model, batch, profile, with every
    technique priced for ``technique`` ``default``); its explanation and its estimate
    (per iteration, per-device compute and communication of the SPMD program)."""
    base = work / f"{model}-b{batch}"
    cmd = [PY, "-m", "hapd.cli", "export", model, "--size", size, "--batch", str(batch), "-o", str(base) + ".pt2"]
    if layers:
        cmd += ["--set", f"layers={layers}"]
    everything = ["--pipeline", "auto", "--overlap"] if technique == "default" else []
    steps = [cmd, [PY, "-m", "hapd.cli", "compile", str(base) + ".pt2", "--profile", str(profile), *everything,
                   "-o", str(base) + ".hplan"],
             [PY, "-m", "hapd.cli", "explain", "--steps", str(base) + ".hplan"]]
    text = ""
    for step in steps:
        done = subprocess.run(step, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return text + f"\n{' '.join(step)} failed: {done.stderr[-1500:]}", {}
        text = done.stdout
    from hapd.compiler.plan import Plan

    plan = Plan.load(str(base) + ".hplan")
    return text, {**dict(plan.estimate), "technique": plan.technique, "synced_bytes": link_synced_bytes(plan)}


def link_synced_bytes(plan: Any) -> float:
    """Bytes of gradients ``plan`` sums across the machines' link at the least: an SPMD
    plan's replicated parameters' (:func:`synced_bytes`); a pipeline whose every stage
    lies on one machine sums each stage's gradients inside its machine, so none."""
    stages = (plan.pipeline or {}).get("stages") if plan.technique == "pipeline" else None
    if stages and all(len(set(stage.get("hosts") or ())) == 1 for stage in stages):
        return 0.0
    return synced_bytes(plan.program)


def synced_bytes(program: dict) -> float:
    """Bytes of the gradients ``program`` sums over every rank (its replicated
    parameters'): what any data-parallel exchange of this plan moves at the least."""
    synced: dict[str, float] = {}
    for step in program["steps"]:
        for source in step["sources"]:
            if source.get("grad_sync") and source.get("layout") == "Identity":
                synced[source["tensor"]] = float(source.get("bytes") or 0.0)
    return sum(synced.values())


def exchange_floor(synced: float, rate_mbit: float, hosts: int = 2) -> float:
    """Seconds the gradient sum of ``synced`` bytes takes at the least over the
    machines' link of ``rate_mbit``: a ring all-reduce over ``hosts`` machines sends
    ``2·(hosts-1)/hosts`` of the bytes out of each machine."""
    if rate_mbit <= 0:
        return 0.0
    return 2.0 * (hosts - 1) / hosts * synced / (rate_mbit * 1e6 / 8)


def achieved_rate(model_rate_: float, fast_quota: float, quotas: Sequence[float]) -> float:
    """FLOP/s the cluster's ranks would train a model at if each reached the rate one fast
    rank alone measured on it (``model_rate_``, at ``fast_quota`` cores), scaled by its
    own quota (``quotas``, cores): what "ideal" would be at the model's achieved rate
    rather than the 512³-matmul rate. NaN when the rate or the quota is unknown."""
    if not (model_rate_ == model_rate_ and model_rate_ > 0 and fast_quota and fast_quota > 0):
        return float("nan")
    return sum(model_rate_ * q / fast_quota for q in quotas)


def achieved_bound(flops: float, rate: float, floor: float) -> float:
    """The bound at the achieved rate (:func:`achieved_rate`): the larger of ``flops`` at
    ``rate`` and the plan's gradient-exchange ``floor`` (:func:`exchange_floor`). NaN
    when ``rate`` is not a positive number."""
    if not (rate == rate and rate > 0):
        return float("nan")
    return max(flops / rate, floor)


# ----------------------------------------------------------------------------- table


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def summarize(results: dict) -> list[dict]:
    rows = []
    for variant, v in results["variants"].items():
        total_flops = sum(d["flops"] for d in v["profile_devices"])
        for model, m in v["models"].items():
            runs = {r["system"]: r for r in m["runs"]}
            h, ev, cp = (runs.get(s, {}) for s in SYSTEMS)
            for system in SYSTEMS:
                r = runs.get(system)
                if r is None:
                    continue
                row = {"variant": variant, "model": model, "system": system, "mean_s": r.get("mean_s"),
                       "std_s": r.get("std_s"), "error": r.get("error")}
                if r.get("mean_s"):
                    row["fraction_of_ideal"] = m["flops"] / total_flops / r["mean_s"]
                synced = (m.get("estimate") or {}).get("synced_bytes")
                if system == "hapd" and r.get("mean_s") and synced is not None:
                    floor = exchange_floor(synced, float(results.get("rate_mbit") or 0.0))
                    row["bound_s"] = max(m["flops"] / total_flops, floor)
                    row["fraction_of_bound"] = row["bound_s"] / r["mean_s"]
                    # diagnosis, not a target: the same bound at the model's rate measured on one fast rank
                    rate = achieved_rate(float((results.get("model_rate") or {}).get(model, float("nan"))),
                                         float(results.get("fast_quota") or 0.0), v.get("quotas") or ())
                    bound = achieved_bound(m["flops"], rate, floor)
                    if bound == bound:
                        row["achieved_bound_s"] = bound
                        row["fraction_of_achieved_bound"] = bound / r["mean_s"]
                if system == "hapd" and r.get("mean_s"):
                    if ev.get("mean_s"):
                        row["speedup_vs_ev"] = ev["mean_s"] / r["mean_s"]
                    if cp.get("mean_s"):
                        row["speedup_vs_cp"] = cp["mean_s"] / r["mean_s"]
                    if r.get("estimate_s"):
                        row["estimate_s"] = r["estimate_s"]
                        row["rel_error"] = (r["estimate_s"] - r["mean_s"]) / r["mean_s"]
                if system == "hapd":
                    row["technique"] = r.get("technique", "spmd")
                rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    head = (f"{'variant':>7} {'model':>12} {'system':>7} {'mean ms':>9} {'± std':>7} {'vs EV':>6} {'vs CP':>6} "
            f"{'pred ms':>8} {'rel err':>8} {'ideal':>6} {'bound':>6}  technique")
    out = [head, "-" * len(head)]
    for r in rows:
        f = lambda k, fmt: fmt.format(r[k]) if r.get(k) is not None else "-"  # noqa: E731
        if r.get("error"):
            out.append(f"{r['variant']:>7} {r['model']:>12} {r['system']:>7}  FAILED: {_last_line(r['error'])}")
            continue
        out.append(f"{r['variant']:>7} {r['model']:>12} {r['system']:>7} {_ms(r['mean_s']):>9} {_ms(r['std_s']):>7} "
                   f"{f('speedup_vs_ev', '{:.2f}x'):>6} {f('speedup_vs_cp', '{:.2f}x'):>6} "
                   f"{_ms(r.get('estimate_s')):>8} {f('rel_error', '{:+.1%}'):>8} {f('fraction_of_ideal', '{:.0%}'):>6} "
                   f"{f('fraction_of_bound', '{:.0%}'):>6}  {r.get('technique') or ''}")
    return "\n".join(out)


def _last_line(error: str) -> str:
    """A failed run's error in one line: its output's last (a traceback's names the error)."""
    return (error.strip().splitlines() or [""])[-1][-80:]


def _run_failed(*runs: dict) -> str | None:
    """``MISS (run failed: SYSTEM: ERROR)`` for the first of ``runs`` that failed, None when none did."""
    failed = next((r for r in runs if r.get("error")), None)
    return f"MISS (run failed: {failed['system']}: {_last_line(failed['error'])})" if failed else None


def targets(rows: list[dict]) -> list[str]:
    """Every target of the table's rows: MET or MISS, or ``MISS (run failed: …)`` where a
    run it needs failed."""
    lines = []
    runs = {(r["variant"], r["model"], r["system"]): r for r in rows}
    for r in rows:
        if r["system"] != "hapd" or (r.get("mean_s") is None and not r.get("error")):
            continue
        v, m = r["variant"], r["model"]
        ev, cp = runs.get((v, m, "ddp-ev"), {}), runs.get((v, m, "ddp-cp"), {})
        if v == "3:1" and m in SPEEDUP_TARGET_MODELS:
            for key, goal, other in (("speedup_vs_ev", 1.6, ev), ("speedup_vs_cp", 1.2, cp)):
                val, failed = r.get(key), _run_failed(r, other)
                if failed:
                    lines.append(f"{failed} {v} {m}: hapd vs {key[-2:].upper()} (target ≥{goal}x)")
                elif val is not None:
                    lines.append(f"{'MET ' if val >= goal else 'MISS'} {v} {m}: hapd {val:.2f}x {key[-2:].upper()} "
                                 f"(target ≥{goal}x)")
        if v == "1:1" and (failed := _run_failed(r, ev)):
            lines.append(f"{failed} 1:1 {m}: hapd/DDP time (target ≤1.05)")
        elif v == "1:1" and r.get("speedup_vs_ev"):
            ratio = 1 / r["speedup_vs_ev"]
            lines.append(f"{'MET ' if ratio <= 1.05 else 'MISS'} 1:1 {m}: hapd/DDP time {ratio:.2f} (target ≤1.05)")
    for r in rows:
        if r["system"] == "hapd" and r["variant"] != "1:1" and r.get("error"):
            lines.append(f"{_run_failed(r)} {r['variant']} {r['model']}: hapd of ideal (target ≥80%)")
        elif r.get("fraction_of_ideal") is not None and r["system"] == "hapd" and r["variant"] != "1:1":
            val = r["fraction_of_ideal"]
            lines.append(f"{'MET ' if val >= 0.8 else 'MISS'} {r['variant']} {r['model']}: hapd at {val:.0%} of ideal "
                         f"(target ≥80%)")
        if r.get("fraction_of_bound") is not None and r["system"] == "hapd" and r["variant"] != "1:1":
            val = r["fraction_of_bound"]
            lines.append(f"{'MET ' if val >= 0.8 else 'MISS'} {r['variant']} {r['model']}: hapd at {val:.0%} of the bound "
                         f"{_ms(r['bound_s'])} ms, the larger of ideal compute and the plan's gradient exchange over "
                         f"the link (target ≥80%)")
    errors = [abs(r["rel_error"]) for r in rows if r.get("rel_error") is not None]
    failed = [r for r in rows if r["system"] == "hapd" and r.get("error")]
    if failed:
        med = f"{statistics.median(errors):.1%}" if errors else "-"
        lines.append(f"{_run_failed(*failed)} cost-model median |relative error| {med} over {len(errors)} hapd "
                     f"run(s), {len(failed)} failed (target ≤10%)")
    elif errors:
        med = statistics.median(errors)
        lines.append(f"{'MET ' if med <= 0.10 else 'MISS'} cost-model median |relative error| {med:.1%} over "
                     f"{len(errors)} hapd run(s) (target ≤10%)")
    return lines


def exit_status(rows: list[dict]) -> int:
    """The bench's exit code: 1 when a run of the table failed, else 0."""
    return 1 if any(r.get("error") for r in rows) else 0


def failure_line(rows: list[dict]) -> str:
    """How many runs failed, which, and the exit code that says so."""
    failed = [f"{r['variant']} {r['model']} {r['system']}" for r in rows if r.get("error")]
    return f"{len(failed)} of {len(rows)} run(s) failed ({', '.join(failed)}): exit 1"


def diagnosis(results: dict) -> list[str]:
    """The measurements behind the misses: what the model's ops reach against the
    profile's matmul rate, and where the cost model's estimate goes (compute against
    communication, each the sum over steps of the slowest device)."""
    lines = []
    rank_flops = results.get("fast_rank_flops")
    for model, rate in results.get("model_rate", {}).items():
        if rank_flops and rate == rate:
            lines.append(f"compute: {model} trains at {rate / 1e9:.1f} GFLOP/s on one fast rank alone (no communication) "
                         f"= {rate / rank_flops:.0%} of that rank's 512³-matmul rate (the profile's own rate, which "
                         f"'ideal' divides by, trains Linear layers on a micro-batch's rows: lower)")
    for variant, v in results.get("variants", {}).items():
        for model, m in v.get("models", {}).items():
            est = m.get("estimate") or {}
            h = next((r for r in m["runs"] if r["system"] == "hapd"), {})
            if not est.get("compute") or not h.get("estimate_s") or not h.get("mean_s"):
                continue
            comp, comm = max(est["compute"]), max(est["communication"])
            lines.append(
                f"cost model {variant} {model}: predicted {h['estimate_s'] * 1e3:.0f} ms (slowest device: compute "
                f"{comp * 1e3:.0f} ms, communication {comm * 1e3:.0f} ms) vs measured {h['mean_s'] * 1e3:.0f} ms "
                f"({(h['estimate_s'] - h['mean_s']) / h['mean_s']:+.0%})")
    for r in summarize(results):
        if r.get("fraction_of_achieved_bound") is not None:
            lines.append(
                f"diagnosis (not a target) {r['variant']} {r['model']}: hapd at {r['fraction_of_achieved_bound']:.0%} "
                f"of the achieved-rate bound {_ms(r['achieved_bound_s'])} ms (the bound with the model's rate measured "
                f"on one fast rank alone, scaled by each rank's quota, in place of the 512³-matmul rate; the "
                f"target's bound is {_ms(r.get('bound_s'))} ms)")
    return lines


def write_png(rows: list[dict], path: Path, title: str = "") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not importable: no PNG chart (pip install -e '.[bench]')")
        return
    keys = sorted({(r["variant"], r["model"]) for r in rows})
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(keys)), 4))
    width = 0.27
    for j, system in enumerate(SYSTEMS):
        vals = [next((r["mean_s"] * 1e3 for r in rows if (r["variant"], r["model"]) == k and r["system"] == system
                      and r.get("mean_s")), 0) for k in keys]
        errs = [next((r["std_s"] * 1e3 for r in rows if (r["variant"], r["model"]) == k and r["system"] == system
                      and r.get("std_s")), 0) for k in keys]
        ax.bar([i + (j - 1) * width for i in range(len(keys))], vals, width, yerr=errs, label=system)
    ax.set_xticks(range(len(keys)), [f"{m}\n{v}" for v, m in keys])
    ax.set_ylabel("ms per iteration")
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    log(f"wrote {path}")


# ----------------------------------------------------------------------------- main


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bert,vit,bert_moe",
                   help="comma-separated benchmark or zoo models (zoo.gpt2, zoo.resnet18, ...), 'all' (every "
                        "benchmark model) or 'zoo' (every zoo model) (default: the transformers)")
    p.add_argument("--variants", default="3:1,2:1,1:1", help="fast:slow quota ratios (1:1 = homogeneous control)")
    p.add_argument("--rate-mbit", type=float, default=None,
                   help=f"link rate (default: fast rank matmul FLOP/s / {FLOP_PER_BYTE:.0f} FLOP/B)")
    p.add_argument("--iterations", type=int, default=15)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--batch", type=int, default=None, help="global batch for every model (default per model)")
    p.add_argument("--size", default=DEFAULT_SIZE, choices=("tiny", "small", "paper"),
                   help=f"model size preset (default: {DEFAULT_SIZE})")
    p.add_argument("--layers", type=int, default=None, help="--layers for every model (default per model)")
    p.add_argument("--hapd-technique", choices=["default", "spmd"], default="default",
                   help="default: hapd runs what hapd.parallelize chooses for the cluster's profile (SPMD, pipelines "
                        "and overlap priced, the simplest within the margin), as a user gets it; spmd: the SPMD plan "
                        "only (default: default)")
    p.add_argument("--ddp-bucket-mib", type=float, default=None,
                   help="DDP's bucket_cap_mb for DP-EV/DP-CP (default: DDP's 25)")
    p.add_argument("--quick", action="store_true", help="one model (bert), 3:1 only, 8 iterations, quick profile")
    p.add_argument("--full-profile", action="store_true", help="the profiler's full sizes/repeats (default --quick)")
    p.add_argument("--keep", action="store_true", help="skip teardown (debugging)")
    p.add_argument("--no-explain", action="store_true", help="do not compile+explain hapd's plan per model")
    p.add_argument("--run-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=OUT / "emulated_cluster.json")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--from-json", type=Path, default=None,
                   help="run nothing: re-print the table, targets and diagnosis of a saved results JSON")
    ns = p.parse_args(argv)
    if ns.quick:
        ns.models = ns.models if "--models" in (argv or sys.argv) else "bert"
        ns.variants = ns.variants if "--variants" in (argv or sys.argv) else "3:1"
        ns.iterations, ns.warmup = min(ns.iterations, 8), min(ns.warmup, 3)
    return ns


def _on_term(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def stop_on_signals() -> None:
    """SIGTERM and SIGINT raise KeyboardInterrupt in this script's main thread (SIGINT also
    when started in the background, where it is ignored), so :meth:`Session.run` tears the
    cluster down however the run is stopped."""
    signal.signal(signal.SIGTERM, _on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def report(results: dict, out: Path | None) -> int:
    """Print the table, the targets and the diagnosis; save the JSON (and PNG) to ``out``;
    the exit code (:func:`exit_status`: 1 when a run failed, said in the last line)."""
    rows = summarize(results)
    results["table"] = rows
    results["targets"] = targets(rows)
    results["diagnosis"] = diagnosis(results)
    print()
    print(f"Emulated cluster: 2 machines × 2 ranks, link {results.get('rate_mbit', 0):.1f} Mbit/s (tbf), cfs period "
          f"{results.get('period_us')} us, {results.get('iterations')} iterations ({results.get('warmup')} warm-up)")
    print(format_table(rows))
    print()
    print("\n".join(results["targets"]))
    print()
    print("\n".join(results["diagnosis"]))
    if out is not None:
        _save(results, out)
        write_png(rows, out.with_suffix(".png"),
                  f"hapd vs DP-EV vs DP-CP: 2 emulated machines × 2 CPU ranks, {results.get('rate_mbit', 0):.0f} Mbit/s "
                  f"link, {results.get('size', 'tiny')} models")
    if exit_status(rows):
        print()
        print(failure_line(rows))
    return exit_status(rows)


def measure(session: Session, ns: argparse.Namespace, models_: list[str], variants: dict[str, tuple[float, float]],
            results: dict) -> None:
    """The link rate and each model's compute rate, the cluster up, then per variant its
    profile and every model's systems; the report."""
    # the fast rank's speed sets the link rate
    fast_quota = max(fast for fast, _ in variants.values())
    rank_flops, rate = session.measure_link(fast_quota, ns.rate_mbit)
    groups, work = session.groups, session.work
    results.update(fast_rank_flops=rank_flops, fast_quota=fast_quota, rate_mbit=rate, size=ns.size)
    results["model_rate"] = {}
    for model in models_:
        batch = ns.batch or default_batch(model, ns.size)
        layers = default_layers(model, ns.size) if ns.layers is None else ns.layers
        rate_m = model_rate(groups[0], model, ns.size, batch, layers, model_flops(model, ns.size, batch, layers))
        results["model_rate"][model] = rate_m
        log(f"{model}: one fast rank trains batch {batch}/4 at {rate_m / 1e9:.1f} GFLOP/s "
            f"= {rate_m / rank_flops:.0%} of its 512³ matmul rate")
    log(f"fast rank ({fast_quota:.2f} core, 1 thread): {rank_flops / 1e9:.1f} GFLOP/s matmul -> link "
        f"{rate:.1f} Mbit/s ({rank_flops / (rate * 1e6 / 8):.0f} FLOP/B)")

    runner = session.start(rate)
    log(f"cluster up: {runner.hostfile.read_text().strip()!r}")

    flops_cache: dict[tuple, float] = {}
    for variant, (fast, slow) in variants.items():
        setup_cgroups([fast, fast, slow, slow])
        log(f"variant {variant}: quotas {fast:.3f},{fast:.3f},{slow:.3f},{slow:.3f} cores (period {PERIOD_US} us)")
        prof_path = work / f"profile-{variant.replace(':', 'to')}.json"
        t0 = time.monotonic()
        prof = runner.profile(prof_path, quick=not ns.full_profile)
        devices = prof["devices"]
        log(f"profiled in {time.monotonic() - t0:.0f} s: FLOP/s " +
            ", ".join(f"{d['flops'] / 1e9:.1f}G" for d in devices) + "; " +
            ", ".join(f"{k} α={c['inter']['alpha'] * 1e3:.2f}ms β={c['inter']['beta'] / 1e6:.1f}MB/s"
                      for k, c in prof["collectives"].items() if k in ("all_reduce", "all_gather", "all_to_all")))
        entry = {"quotas": [fast, fast, slow, slow], "profile": prof, "profile_devices": devices, "models": {}}
        results["variants"][variant] = entry
        for model in models_:
            batch = ns.batch or default_batch(model, ns.size)
            layers = default_layers(model, ns.size) if ns.layers is None else ns.layers
            key = (model, batch, layers)
            if key not in flops_cache:
                flops_cache[key] = model_flops(model, ns.size, batch, layers)
            m = {"flops": flops_cache[key], "size": ns.size, "batch": batch, "layers": layers, "runs": []}
            entry["models"][model] = m
            for system in SYSTEMS:
                row = runner.train(system, model, ns, prof_path, variant.replace(":", "to"))
                m["runs"].append(row)
                log(f"{variant} {model} {system}: " + (f"{_ms(row.get('mean_s'))} ± {_ms(row.get('std_s'))} ms"
                    + (f" ({row.get('technique', 'spmd')}, predicted {_ms(row.get('estimate_s'))} ms, ratios "
                       f"{row.get('ratios')})"
                       if system == "hapd" else "") if "error" not in row else f"FAILED {row['error'][-300:]}"))
            if not ns.no_explain:
                m["explain"], m["estimate"] = explain_plan(model, ns.size, batch, layers, prof_path, work,
                                                           ns.hapd_technique)
                log(f"{variant} {model} plan: {m['explain'].splitlines()[2] if m['explain'].count(chr(10)) > 2 else ''}")
                OUT.mkdir(parents=True, exist_ok=True)
                (OUT / f"emulated_explain_{variant.replace(':', 'to')}_{model}.txt").write_text(m["explain"])
            rows = summarize(results)
            results["table"] = rows
            _save(results, ns.out)
    report(results, ns.out)


def main(argv=None) -> int:
    ns = parse_args(argv)
    if ns.from_json is not None:
        return report(json.loads(ns.from_json.read_text()), None)
    try:
        models_ = model_names(ns.models)
        variants = {v.strip(): parse_variant(v.strip()) for v in ns.variants.split(",") if v.strip()}
        if not variants:
            raise ValueError("--variants is empty")
    except ValueError as e:
        print(f"emulated_cluster: {e}", file=sys.stderr)
        return 2
    why = available()
    if why:
        print(f"emulated_cluster: skipped: {why}")
        return 0
    stop_on_signals()
    session = Session("hapd-emulated-", ns.verbose)
    results: dict[str, Any] = {"variants": {}, "period_us": PERIOD_US, "flop_per_byte": FLOP_PER_BYTE,
                               "iterations": ns.iterations, "warmup": ns.warmup, "workdir": str(session.work)}
    return session.run(lambda: measure(session, ns, models_, variants, results), lambda: _save(results, ns.out),
                       ns.keep, log) or exit_status(summarize(results))


def _save(results: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    slim = json.loads(json.dumps(results, default=str))
    for v in slim.get("variants", {}).values():
        v.get("profile", {}).pop("device_detail", None)
    path.write_text(json.dumps(slim, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
