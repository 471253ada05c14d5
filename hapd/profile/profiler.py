"""Measure a cluster profile: device speed, memory and collective costs (DESIGN.md §3).

Rank side, one process per device, under torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; any launcher that sets
them will do, ``./run_all`` included)::

    python -m hapd.profiler [--out FILE] [--sizes 4K,64K,1M] [--repeats N] [--quick]

``hapd profile`` starts K local ranks this way (:func:`launch_local`). Rank 0 prints
progress and writes the profile; every rank measures its own device.

What the numbers mean -- exactly what the cost model (``rustcore/core/src/cost.rs``,
``comm.rs``) charges:

* ``flops``: achieved FLOP/s of ``dtype`` matmuls of a few square sizes, FLOPs
  = 2·m·n·k; the median over sizes of each size's median rate.
* ``elementwise_flops``: achieved rate on ``add``, ``mul`` and ``gelu`` over large
  tensors, counted as the core counts them (1, 1 and 8 FLOPs per output element,
  ``rules/binary.rs`` and ``rules/unary.rs``): total counted FLOPs over total time of one
  of each.
* Each rate sample runs the op back to back for at least ``window_s`` seconds of wall
  time, so a CPU quota (CFS period 100 ms) shows up as the slower rate it causes rather
  than as bursts at full speed. All ranks measure at the same time, as they compute in
  training.
* ``memory``: total device memory (GPU), or the memory this process may use (the
  smallest cgroup memory limit above it, else ``MemTotal``).
* Collectives: the full tensor has ``B`` bytes (``B`` from ``sizes``); every rank
  holds its even shard (``B/N``) or the full tensor, as the collective's input layout
  needs. Per repeat: a barrier, then each rank times one call (with its device
  synchronized), and the repeat's time is the largest over ranks; the size's time is
  the median over repeats after ``warmup`` untimed calls (more repeats for fast calls,
  see ``point_s``; repeats go round the sizes). ``time = α + B/β`` is fitted by least
  squares weighted by 1/time, leaving out sizes far slower than the fit of the rest
  (:func:`fit_alpha_beta`); α < 0 refits through the origin (α = 0). With even shards
  this is the cost model's charge for each collective: padded all-gather,
  reduce-scatter and all-to-all α + N·(1/N)·B/β, grouped variants, all-reduce and
  broadcast (from rank 0) α + B/β. The calls are hapd's own runtime collectives
  (:mod:`hapd.runtime.collectives`), so what is timed is what a plan runs.
* Links: with one host, the collectives over all ranks give ``intra`` (and ``inter``
  repeats them: nothing crossed a host). With several hosts, collectives over all ranks
  give ``inter`` (every collective the cost model prices spans all devices) and, when
  every host has the same number (≥ 2) of ranks, the same collectives run within each
  host at once give ``intra``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hapd.errors import HapdError, OptionsError, ProfileError
from hapd.profile.schema import COLLECTIVES, UNITS, Device, Link, Profile

KiB, MiB = 2**10, 2**20
DEFAULT_SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
"""Full-tensor bytes of the timed collectives: 4 KiB … 16 MiB, ×4 apart."""
QUICK_SIZES = (16 * KiB, 256 * KiB, 4 * MiB)

ELEMENTWISE_OPS: dict[str, float] = {"add": 1.0, "mul": 1.0, "gelu": 8.0}
"""Element-wise ops timed for ``elementwise_flops`` → FLOPs per output element, as the
core counts them."""

HOST_ENV = "HAPD_HOST"
"""Overrides this rank's host name (network namespaces share the machine's name)."""


# --------------------------------------------------------------------------
# Options
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ProfilerOptions:
    """What to measure and how long."""

    sizes: tuple[int, ...] = DEFAULT_SIZES
    """Full-tensor bytes of each timed collective call."""
    repeats: int = 7
    """Fewest timed repeats per collective and size (the median is kept)."""
    warmup: int = 2
    """Untimed calls before the timed ones."""
    point_s: float = 0.3
    """Seconds to spend on one collective and size: fast calls are repeated more (up
    to 10× ``repeats``), which steadies the small sizes at little cost."""
    window_s: float = 0.25
    """Wall seconds of one device-speed sample."""
    speed_repeats: int = 5
    """Samples per device-speed workload (the median is kept)."""
    matmul_sizes: tuple[int, ...] | None = None
    """Square matmul sizes (default: 256, 512, 1024 on CPU; 2048, 4096, 8192 on GPU)."""
    elementwise_numel: int | None = None
    """Elements per element-wise operand (default 2^22 on CPU, 2^26 on GPU)."""
    dtype: str = "float32"
    """dtype of every measured tensor."""
    name: str = ""
    """Profile name (default ``measured-<host of rank 0>``)."""

    def __post_init__(self) -> None:
        problems = []
        if not self.sizes or any(s < 64 for s in self.sizes):
            problems.append(f"sizes {list(self.sizes)}: need at least one, each ≥ 64 bytes")
        if len(set(self.sizes)) < 2:
            problems.append(f"sizes {list(self.sizes)}: need two different sizes to fit α and β")
        if self.repeats < 1 or self.warmup < 0 or self.speed_repeats < 1:
            problems.append(f"repeats {self.repeats} and speed repeats {self.speed_repeats} must be ≥ 1, "
                            f"warmup {self.warmup} ≥ 0")
        if not (math.isfinite(self.window_s) and self.window_s > 0):
            problems.append(f"window {self.window_s} s must be > 0")
        if not (math.isfinite(self.point_s) and self.point_s >= 0):
            problems.append(f"point time {self.point_s} s must be ≥ 0")
        if self.matmul_sizes is not None and (not self.matmul_sizes or min(self.matmul_sizes) < 1):
            problems.append(f"matmul sizes {self.matmul_sizes} must be ≥ 1")
        if self.elementwise_numel is not None and self.elementwise_numel < 1:
            problems.append(f"elementwise numel {self.elementwise_numel} must be ≥ 1")
        if self.dtype not in ("float32", "float16", "bfloat16"):
            problems.append(f"dtype {self.dtype!r} is not float32, float16 or bfloat16")
        if problems:
            raise OptionsError("; ".join(problems))

    @classmethod
    def quick(cls, **overrides: Any) -> ProfilerOptions:
        """Fewer sizes, repeats and shorter samples (~10 s on 2 CPU ranks): for smoke
        tests, not for profiles to compile with (its fits vary up to 2× between runs)."""
        base: dict[str, Any] = dict(sizes=QUICK_SIZES, repeats=5, warmup=1, point_s=0.05, window_s=0.1, speed_repeats=3)
        return cls(**{**base, **overrides})


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"4096"``, ``"4K"``, ``"4KiB"``, ``"16M"``, ``"1G"`` → bytes (K = 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise OptionsError(f"size {text!r} is not a byte count like 4096, 64K or 16MiB")
    scale = {"": 1, "k": KiB, "m": MiB, "g": 2**30}[match.group(2).lower()]
    return int(float(match.group(1)) * scale)


def parse_sizes(text: str) -> tuple[int, ...]:
    """A comma-separated list of sizes (:func:`parse_size`)."""
    return tuple(parse_size(part) for part in text.split(",") if part.strip())


# --------------------------------------------------------------------------
# This device: name, memory, speed
# --------------------------------------------------------------------------


def host_name() -> str:
    """``$HAPD_HOST`` or the machine's host name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


def cpu_model() -> str:
    """The CPU's model name from ``/proc/cpuinfo`` (``"cpu"`` when unknown)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def _meminfo_total(proc: Path) -> int | None:
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_memory_limits(proc: Path, root: Path) -> list[int]:
    """Memory limits (bytes) of this process's cgroup and its ancestors, v1 and v2.
    ``root`` is where paths in ``/proc/self/mountinfo`` are resolved (``/``)."""
    try:
        mountinfo = (proc / "self" / "mountinfo").read_text().splitlines()
        membership = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return []
    paths: dict[str, str] = {}  # "v2" or "memory" → cgroup path
    for line in membership:
        parts = line.split(":", 2)
        if len(parts) == 3:
            hid, controllers, path = parts
            if hid == "0" and controllers == "":
                paths["v2"] = path
            elif "memory" in controllers.split(","):
                paths["memory"] = path
    limits = []
    for line in mountinfo:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        mount_root, mount_point, fstype, options = fields[3], fields[4], tail[0], tail[2].split(",")
        if fstype == "cgroup2" and "v2" in paths:
            key, name = "v2", "memory.max"
        elif fstype == "cgroup" and "memory" in options and "memory" in paths:
            key, name = "memory", "memory.limit_in_bytes"
        else:
            continue
        rel = os.path.relpath(paths[key], mount_root) if paths[key].startswith(mount_root) else paths[key]
        here = (root / mount_point.lstrip("/") / rel.lstrip("/")).resolve()
        top = (root / mount_point.lstrip("/")).resolve()
        while True:
            try:
                raw = (here / name).read_text().strip()
                if raw.isdigit():
                    limits.append(int(raw))
            except OSError:
                pass
            if here == top or top not in here.parents:
                break
            here = here.parent
    return limits


def host_memory(proc: Path = Path("/proc"), root: Path = Path("/")) -> int:
    """Bytes this process may use on the CPU: the smallest cgroup memory limit above it,
    else ``MemTotal``."""
    total = _meminfo_total(proc)
    candidates = [n for n in _cgroup_memory_limits(proc, root) if n > 0]
    if total is not None:
        candidates.append(total)
    if not candidates:
        raise ProfileError("cannot tell this machine's memory (no /proc/meminfo)", field="memory")
    return min(candidates)


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample_rate(step: Callable[[], None], work: float, device: Any, *, repeats: int, window_s: float) -> list[float]:
    """``repeats`` samples of ``work`` units per second, each over back-to-back calls of
    ``step`` lasting at least ``window_s`` wall seconds (after warming up)."""
    step()
    _sync(device)
    calls, elapsed = 1, 0.0
    while True:  # calibrate: double the calls until a batch takes a quarter window
        start = time.perf_counter()
        for _ in range(calls):
            step()
        _sync(device)
        elapsed = time.perf_counter() - start
        if elapsed >= window_s / 4:
            break
        calls *= 2
    calls = max(1, math.ceil(calls * window_s / elapsed))
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            step()
        _sync(device)
        rates.append(calls * work / (time.perf_counter() - start))
    return rates


def matmul_flops(device: Any, dtype: Any, sizes: Sequence[int], *, repeats: int, window_s: float,
                 barrier: Callable[[], Any] | None = None) -> tuple[float, dict[str, float]]:
    """(median over sizes of the median FLOP/s of an ``n×n @ n×n`` matmul, {n: rate}).
    ``barrier`` runs before each size, so ranks sharing a machine measure the same
    workload at the same time."""
    import torch

    per_size: dict[str, float] = {}
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        if barrier is not None:
            barrier()
        rates = sample_rate(lambda: torch.mm(a, b, out=out), 2.0 * n**3, device, repeats=repeats, window_s=window_s)
        per_size[str(n)] = statistics.median(rates)
        del a, b, out
    return statistics.median(per_size.values()), per_size


def elementwise_flops(device: Any, dtype: Any, numel: int, *, repeats: int, window_s: float,
                      barrier: Callable[[], Any] | None = None) -> tuple[float, dict[str, float]]:
    """(counted FLOPs of one add, mul and gelu over their total time, {op: rate});
    ``barrier`` runs before each op."""
    import torch

    a = torch.randn(numel, device=device, dtype=dtype)
    b = torch.randn(numel, device=device, dtype=dtype)
    out = torch.empty(numel, device=device, dtype=dtype)
    steps: dict[str, Callable[[], Any]] = {  # into one reused output, so no allocation is timed
        "add": lambda: torch.add(a, b, out=out),
        "mul": lambda: torch.mul(a, b, out=out),
        "gelu": lambda: torch.ops.aten.gelu.out(a, out=out),
    }
    per_op: dict[str, float] = {}
    for op, count in ELEMENTWISE_OPS.items():
        if barrier is not None:
            barrier()
        rates = sample_rate(steps[op], count * numel, device, repeats=repeats, window_s=window_s)
        per_op[op] = statistics.median(rates)
    seconds = sum(ELEMENTWISE_OPS[op] * numel / per_op[op] for op in per_op)
    return sum(ELEMENTWISE_OPS.values()) * numel / seconds, per_op


@dataclass(frozen=True, kw_only=True)
class DeviceMeasurement:
    """What one rank measured about its own device."""

    host: str
    model: str
    flops: float
    elementwise_flops: float
    memory: int
    detail: dict[str, Any] = field(default_factory=dict)
    """Per-size and per-op rates, threads, dtype: kept in the profile's ``extra``."""


def measure_device(device: Any, options: ProfilerOptions, *,
                   barrier: Callable[[], Any] | None = None) -> DeviceMeasurement:
    """Speed, memory and name of ``device`` (a ``torch.device``). ``barrier`` (all
    ranks') aligns the workloads of ranks that measure together: ranks on one machine
    share its memory bandwidth, and each workload should meet the same neighbours."""
    import torch

    dtype = getattr(torch, options.dtype)
    cuda = device.type == "cuda"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # busy machine → slower numbers
    sizes = options.matmul_sizes or ((2048, 4096, 8192) if cuda else (256, 512, 1024))
    numel = options.elementwise_numel or (2**26 if cuda else 2**22)
    flops, per_size = matmul_flops(device, dtype, sizes, repeats=options.speed_repeats, window_s=options.window_s,
                                   barrier=barrier)
    ew, per_op = elementwise_flops(device, dtype, numel, repeats=options.speed_repeats, window_s=options.window_s,
                                   barrier=barrier)
    detail: dict[str, Any] = {"matmul_flops_by_size": per_size, "elementwise_flops_by_op": per_op,
                              "elementwise_numel": numel, "dtype": options.dtype, "load_average_1m": load}
    if cuda:
        props = torch.cuda.get_device_properties(device)
        model, memory = props.name, int(props.total_memory)
        detail["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        detail["cuda"] = torch.version.cuda
    else:
        model, memory = cpu_model(), host_memory()
        detail["threads"] = torch.get_num_threads()
    return DeviceMeasurement(host=host_name(), model=model, flops=flops, elementwise_flops=ew,
                             memory=memory, detail=detail)


# --------------------------------------------------------------------------
# Fitting time = α + bytes / β
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Fit:
    """``seconds ≈ alpha + bytes / beta`` over measured points."""

    alpha: float
    beta: float
    r2: float
    """Coefficient of determination of the fit on the points it kept."""
    max_rel_error: float
    """Largest |fit − measured| / measured over the points it kept."""
    bytes: tuple[int, ...]
    seconds: tuple[float, ...]
    """Median seconds per size (every measured point)."""
    dropped: tuple[int, ...] = ()
    """Sizes left out of the fit as outliers (much slower than the fit of the rest)."""
    bound: bool = False
    """The times did not grow with the size (latency noise above the transfer time),
    so α and β are bounds (:func:`bound_alpha_beta`), not a fit."""

    def to_json(self) -> dict[str, Any]:
        out = {"alpha": self.alpha, "beta": self.beta, "r2": self.r2, "max_rel_error": self.max_rel_error,
               "bytes": list(self.bytes), "median_s": list(self.seconds), "dropped_bytes": list(self.dropped)}
        if self.bound:
            out["bound"] = True
        return out


def _line(x: Sequence[float], y: Sequence[float]) -> tuple[float, float]:
    """(α ≥ 0, slope) of ``y = α + slope·x`` by least squares weighted by 1/y."""
    w = [1.0 / t for t in y]
    sw = sum(w)
    sx = sum(wi * xi for wi, xi in zip(w, x))
    sy = sum(wi * yi for wi, yi in zip(w, y))
    sxx = sum(wi * xi * xi for wi, xi in zip(w, x))
    sxy = sum(wi * xi * yi for wi, xi, yi in zip(w, x, y))
    slope = (sw * sxy - sx * sy) / (sw * sxx - sx * sx)
    alpha = (sy - slope * sx) / sw
    if alpha < 0:
        alpha, slope = 0.0, sxy / sxx
    return alpha, slope


OUTLIER_REL = 0.5
"""A point more than this much slower than the fit (relative), and more than 3× the
median relative residual, is an outlier (a size where most repeats were disturbed)."""


def fit_alpha_beta(sizes: Sequence[int], seconds: Sequence[float], *, where: str = "collective",
                   reject_outliers: bool = True) -> Fit:
    """Least squares of ``t = α + b·bytes``, β = 1/b, each point weighted by 1/t: plain
    least squares lets only the largest sizes steer (α comes out as noise), relative
    error (1/t²) only the smallest; 1/t weighs them in between. A negative intercept
    refits through the origin (α = 0). With ``reject_outliers``, points far slower than
    the fit (:data:`OUTLIER_REL`) are dropped and the rest refitted, keeping at least 3
    and at most twice. Raises ProfileError when the times do not grow with the size."""
    if len(sizes) != len(seconds) or len(set(sizes)) < 2:
        raise ProfileError(f"{where}: need times at two or more sizes to fit α and β", field=where)
    if any(not (math.isfinite(t) and t > 0) for t in seconds):
        raise ProfileError(f"{where}: non-positive time in {list(seconds)}", field=where)
    x, y = [float(s) for s in sizes], [float(t) for t in seconds]
    keep = list(range(len(x)))
    alpha, slope = _line(x, y)
    for _ in range(2 if reject_outliers else 0):
        if not slope > 0:
            break
        rel = {i: (y[i] - alpha - slope * x[i]) / (alpha + slope * x[i]) for i in keep}
        typical = statistics.median(abs(r) for r in rel.values())
        kept = [i for i in keep if not (rel[i] > OUTLIER_REL and rel[i] > 3 * typical)]
        if len(kept) == len(keep) or len(kept) < 3 or len({x[i] for i in kept}) < 2:
            break
        keep = kept
        alpha, slope = _line([x[i] for i in keep], [y[i] for i in keep])
    if not slope > 0:
        raise ProfileError(f"{where}: times {['%.3g' % t for t in y]} s do not grow with the size "
                           f"{[int(s) for s in x]} bytes, so no bandwidth can be fitted", field=f"{where}.beta")
    ky = [y[i] for i in keep]
    pred = [alpha + slope * x[i] for i in keep]
    mean = statistics.fmean(ky)
    ss_tot = sum((yi - mean) ** 2 for yi in ky)
    ss_res = sum((yi - pi) ** 2 for yi, pi in zip(ky, pred))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return Fit(alpha=alpha, beta=1.0 / slope, r2=r2, max_rel_error=max(abs(p - t) / t for p, t in zip(pred, ky)),
               bytes=tuple(int(s) for s in sizes), seconds=tuple(y),
               dropped=tuple(int(x[i]) for i in range(len(x)) if i not in keep))


def bound_alpha_beta(sizes: Sequence[int], seconds: Sequence[float]) -> Fit:
    """α and β bounded from times that do not grow with the size: α = the fastest time
    (no call took less), β = the largest size over its time (that many bytes moved in
    that time, latency included). ``α + bytes/β`` then overestimates the largest size
    by at most α, and no size by more than its own noise."""
    x, y = [float(s) for s in sizes], [float(t) for t in seconds]
    largest = max(range(len(x)), key=lambda i: x[i])
    alpha, beta = min(y), x[largest] / y[largest]
    pred = [alpha + xi / beta for xi in x]
    return Fit(alpha=alpha, beta=beta, r2=0.0, max_rel_error=max(abs(p - t) / t for p, t in zip(pred, y)),
               bytes=tuple(int(s) for s in sizes), seconds=tuple(y), bound=True)


NOT_COMMUNICATED = Fit(alpha=0.0, beta=1e18, r2=1.0, max_rel_error=0.0, bytes=(), seconds=())
"""The link of a 1-rank job: no collective moves anything (the cost model charges 0)."""


# --------------------------------------------------------------------------
# Timing collectives
# --------------------------------------------------------------------------


def _shape(nbytes: int, itemsize: int, n: int) -> tuple[int, int]:
    """A ``(rows, cols)`` full-tensor shape of about ``nbytes``, both divisible by ``n``."""
    numel = max(1, nbytes // itemsize)
    cols = n * max(1, round(math.sqrt(numel) / n))
    rows = n * max(1, round(numel / (cols * n)))
    return rows, cols


def collective_call(name: str, nbytes: int, *, dtype: Any, device: Any, group: Any,
                    hosts: Any = None) -> tuple[Callable[[], Any], int]:
    """(a call of collective ``name`` on a full tensor of about ``nbytes`` with even
    shards over ``group``, the full tensor's exact bytes). Inputs are made once.
    ``grad_sync`` (the runtime's two-level gradient sum) needs ``hosts``."""
    import torch
    import torch.distributed as dist

    from hapd.runtime import collectives as C

    n, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, cols = _shape(nbytes, torch.empty((), dtype=dtype).element_size(), n)
    even_rows, even_cols = [rows // n] * n, [cols // n] * n
    full = torch.randn(rows, cols, dtype=dtype, device=device)
    shard = full[rank * (rows // n):(rank + 1) * (rows // n)].contiguous()
    calls: dict[str, Callable[[], Any]] = {
        "all_gather": lambda: C.all_gather(shard, 0, even_rows, group=group),
        "all_gather_grouped": lambda: C.all_gather(shard, 0, even_rows, grouped=True, group=group),
        "reduce_scatter": lambda: C.reduce_scatter(full, 0, even_rows, group=group),
        "reduce_scatter_grouped": lambda: C.reduce_scatter(full, 0, even_rows, grouped=True, group=group),
        "all_reduce": lambda: C.all_reduce(full, group=group),
        "all_to_all": lambda: C.all_to_all(shard, 0, 1, even_rows, even_cols, group=group),
        "broadcast": lambda: dist.broadcast(full, group=group, group_src=0),
    }
    if hosts is not None:
        calls["grad_sync"] = lambda: C.two_level_sum_(full, hosts)
    if name not in calls:
        raise OptionsError(f"unknown collective {name!r}; known: {', '.join(calls)}")
    return calls[name], full.numel() * full.element_size()


def _timed(call: Callable[[], Any] | None, device: Any) -> float:
    """Seconds of one call after a barrier (0 when this rank has nothing to call)."""
    import torch.distributed as dist

    dist.barrier()
    _sync(device)
    if call is None:
        return 0.0
    start = time.perf_counter()
    call()
    _sync(device)
    return time.perf_counter() - start


def _max_over_ranks(values: Sequence[float], device: Any) -> list[float]:
    import torch
    import torch.distributed as dist

    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_collective(name: str, sizes: Sequence[int], options: ProfilerOptions, *, device: Any,
                    group: Any, hosts: Any = None) -> list[tuple[int, float]]:
    """[(exact full-tensor bytes, median over repeats of the slowest rank's seconds)] of
    one collective over ``group`` (None: the world) at each size. Every rank of the world
    calls this (the barriers span the world); a rank in a 1-rank group times nothing.

    Repeats go round the sizes (one call of each size per round), so a burst of other
    work on the machine disturbs one repeat of many sizes, not the median of one. Each
    size's number of repeats is agreed from its slowest warm-up call (``point_s``)."""
    import torch
    import torch.distributed as dist

    dtype = getattr(torch, options.dtype)
    active = dist.get_world_size(group) > 1
    calls = [collective_call(name, size, dtype=dtype, device=device, group=group, hosts=hosts) if active else (None, 0)
             for size in sizes]
    with torch.no_grad():
        last = [0.0] * len(sizes)
        for _ in range(max(1, options.warmup)):
            last = [_timed(call, device) for call, _ in calls]
        agreed = _max_over_ranks([*last, *(float(exact) for _, exact in calls)], device)
        slowest, exact = agreed[:len(sizes)], [int(b) for b in agreed[len(sizes):]]
        repeats = [max(options.repeats, min(10 * options.repeats, int(options.point_s / t))) if t > 0
                   else options.repeats for t in slowest]
        times: list[list[float]] = [[] for _ in sizes]
        for round_ in range(max(repeats)):
            for i, (call, _) in enumerate(calls):
                if round_ < repeats[i]:
                    times[i].append(_timed(call, device))
        flat = _max_over_ranks([t for per_size in times for t in per_size], device)
    medians, at = [], 0
    for n in repeats:
        medians.append(statistics.median(flat[at:at + n]))
        at += n
    return list(zip(exact, medians))


# --------------------------------------------------------------------------
# The rank-side run
# --------------------------------------------------------------------------


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def _intra_groups(hosts: Sequence[str]) -> tuple[list[list[int]], str | None]:
    """(ranks of each host in host order, why ``intra`` cannot be measured or None)."""
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    groups = list(by_host.values())
    counts = {len(g) for g in groups}
    if len(groups) == 1:
        return groups, None
    if len(counts) != 1:
        return groups, f"hosts have different rank counts {[len(g) for g in groups]}"
    if counts == {1}:
        return groups, "one rank per host"
    return groups, None


def measure(options: ProfilerOptions) -> Profile | None:
    """Run on every rank of an initialized job: measure and return the profile on rank
    0 (None elsewhere). Each rank measures its own device; collectives are timed by all."""
    import torch.distributed as dist

    from hapd.runtime.training import init_distributed

    env = init_distributed()
    rank, world = env.rank, env.world
    started = datetime.datetime.now(datetime.timezone.utc)
    _say(rank, f"hapd profile: {world} rank(s), backend {env.backend}, dtype {options.dtype}")
    _say(rank, "measuring device speed and memory on every rank …")
    mine = measure_device(env.device, options, barrier=dist.barrier)
    devices: list[dict[str, Any]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(devices, asdict(mine))
    hosts = [d["host"] for d in devices]
    groups, no_intra = _intra_groups(hosts)
    multi_host = len(groups) > 1
    host_group = None
    if multi_host and no_intra is None:
        for ranks in groups:  # every rank creates every group, in the same order
            g = dist.new_group(ranks)
            if rank in ranks:
                host_group = g
    # kind → the group each rank runs in (None: the world)
    kinds: dict[str, Any] = {"inter": None} if multi_host else {"intra": None}
    if host_group is not None:
        kinds["intra"] = host_group
    fits: dict[str, dict[str, Fit]] = {}
    from hapd.runtime.collectives import host_groups

    index = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    two_level = host_groups([index[h] for h in hosts]) if world > 1 else None
    for i, name in enumerate(COLLECTIVES, 1):
        if world == 1:  # nothing is communicated, and the cost model charges nothing
            fits[name] = {"intra": NOT_COMMUNICATED}
            continue
        _say(rank, f"measuring {name} ({i}/{len(COLLECTIVES)}) …")
        fits[name] = {}
        for kind, group in kinds.items():
            fits[name][kind] = _measure_link(name, kind, group, options, env.device, rank)
    if two_level is not None:
        _say(rank, "measuring grad_sync (the runtime's two-level gradient all-reduce) …")
        fits["grad_sync"] = {"inter": _measure_link("grad_sync", "inter", None, options, env.device, rank,
                                                    hosts=two_level)}
    dist.barrier()
    if rank != 0:
        return None
    return _assemble(devices, fits, options, started=started, backend=env.backend, world=world,
                     no_intra=no_intra if multi_host else None)


def _measure_link(name: str, kind: str, group: Any, options: ProfilerOptions, device: Any, rank: int,
                  hosts: Any = None) -> Fit:
    """Time one collective over ``group`` and fit α/β. Times that do not grow with the
    size (a link so fast that latency noise hides the transfer) are measured once more;
    if they still do not grow, α and β are bounded instead (:func:`bound_alpha_beta`) and
    the profile says so. Every rank takes the same branch: the times are the slowest
    rank's, the same everywhere."""
    where = f"collectives.{name}.{kind}"
    for attempt in (1, 2):
        points = time_collective(name, options.sizes, options, device=device, group=group, hosts=hosts)
        sizes, times = [b for b, _ in points], [t for _, t in points]
        try:
            return fit_alpha_beta(sizes, times, where=where)
        except ProfileError as exc:
            if len(set(sizes)) < 2 or not all(math.isfinite(t) and t > 0 for t in times):
                raise
            _say(rank, f"{exc}" + ("; measuring again" if attempt == 1 else
                                   "; using bounds: α = the fastest time, β = the largest size over its time"))
    return bound_alpha_beta(sizes, times)


def _assemble(devices: Sequence[Mapping[str, Any]], fits: Mapping[str, Mapping[str, Fit]], options: ProfilerOptions,
              *, started: datetime.datetime, backend: str, world: int, no_intra: str | None) -> Profile:
    import torch

    from hapd import __version__

    hosts = list(dict.fromkeys(d["host"] for d in devices))
    collectives: dict[str, dict[str, Link]] = {}
    for name, by_kind in fits.items():
        links = {kind: Link(alpha=f.alpha, beta=f.beta) for kind, f in by_kind.items()}
        if "inter" not in links:  # one host: nothing crossed a host
            links["inter"] = links["intra"]
        collectives[name] = links
    if world == 1:
        links_note = "one rank: no collective was measured (none communicates)"
    elif len(hosts) == 1:
        links_note = "intra-host links measured over all ranks; inter repeats them (one host)"
    elif no_intra:
        links_note = f"inter-host links measured over all ranks; intra-host not measured ({no_intra})"
    else:
        links_note = "inter-host links over all ranks; intra-host links within each host at once"
    models = sorted({d["model"] for d in devices})
    date = started.date().isoformat()
    description = (f"measured by hapd profile on {world} rank(s) ({', '.join(models)}) over "
                   f"{len(hosts)} host(s) ({', '.join(hosts)}) on {date}, {backend}, {options.dtype}; {links_note}")
    extra = {
        "units": dict(UNITS),
        "measured_at": started.isoformat(timespec="seconds"),
        "tool": "hapd profile",
        "tool_version": __version__,
        "torch_version": torch.__version__,
        "backend": backend,
        "options": {"sizes": list(options.sizes), "repeats": options.repeats, "warmup": options.warmup,
                    "point_s": options.point_s, "window_s": options.window_s,
                    "speed_repeats": options.speed_repeats, "dtype": options.dtype},
        "fits": {name: {kind: f.to_json() for kind, f in by_kind.items()} for name, by_kind in fits.items()},
        "device_detail": [dict(d["detail"], rank=r) for r, d in enumerate(devices)],
    }
    return Profile(
        name=options.name or f"measured-{hosts[0]}",
        description=description,
        devices=tuple(
            Device(rank=r, host=d["host"], model=d["model"], flops=float(d["flops"]), memory=float(d["memory"]),
                   elementwise_flops=float(d["elementwise_flops"]))
            for r, d in enumerate(devices)
        ),
        collectives=collectives,
        extra=extra,
    )


def summary(profile: Profile) -> str:
    """A few lines for a person: each device and each collective's fit."""
    lines = [f"{profile.name}: {profile.world} device(s) on {len(profile.hosts)} host(s), "
             f"id {profile.profile_id[:12]}…"]
    for d in profile.devices:
        ew = f", {d.elementwise_flops:.3g} element-wise" if d.elementwise_flops else ""
        lines.append(f"  rank {d.rank} {d.host} {d.model}: {d.flops:.3g} FLOP/s matmul{ew}, "
                     f"{d.memory / 2**30:.1f} GiB")
    fits = profile.extra.get("fits", {})
    one_host = len(profile.hosts) == 1
    for name, links in profile.collectives.items():
        for kind, link in sorted(links.items()):
            if one_host and kind == "inter" and "intra" in links:
                continue  # a copy of intra: nothing crossed a host
            fit = fits.get(name, {}).get(kind)
            quality = f" (R² {fit['r2']:.3f})" if fit and fit["bytes"] else ""
            if fit and fit.get("bound"):
                quality = " (bounds: times did not grow with the size)"
            lines.append(f"  {name:<23} {kind}: α {link.alpha * 1e6:8.1f} µs  "
                         f"β {link.beta / 1e6:10.1f} MB/s{quality}")
    return "\n".join(lines)


# --------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hapd.profiler",
                                description="Measure a cluster profile; run one process per device under torchrun.")
    p.add_argument("--out", "-o", type=Path, default=Path("profile.json"), help="profile JSON rank 0 writes")
    p.add_argument("--name", default="", help="profile name (default measured-HOST)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats, shorter samples")
    p.add_argument("--sizes", type=parse_sizes, default=None, help="full-tensor bytes, e.g. 4K,64K,1M,16M")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats per collective and size")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first")
    p.add_argument("--window", type=float, default=None, help="seconds of one device-speed sample")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device-only", action="store_true",
                   help="measure this device only (no process group) and print it as JSON")
    return p


def options_from_args(ns: argparse.Namespace) -> ProfilerOptions:
    given = {k: v for k, v in (("sizes", ns.sizes), ("repeats", ns.repeats), ("warmup", ns.warmup),
                               ("window_s", ns.window)) if v is not None}
    given.update(dtype=ns.dtype, name=ns.name)
    return ProfilerOptions.quick(**given) if ns.quick else ProfilerOptions(**given)


def main(argv: Sequence[str] | None = None) -> int:
    ns = _parser().parse_args(argv)
    try:
        options = options_from_args(ns)
        if ns.device_only:
            import torch

            cuda = torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
            print(json.dumps(asdict(measure_device(device, options))), flush=True)
            return 0
        profile = measure(options)
        if profile is not None:
            ns.out.parent.mkdir(parents=True, exist_ok=True)
            profile.save(ns.out)
            print(summary(profile), flush=True)
            print(f"wrote {ns.out}", flush=True)
        return 0
    except HapdError as exc:
        print(f"hapd profiler: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def default_nproc() -> int:
    """Local ranks ``hapd profile`` starts: one per GPU, else 2."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


@dataclass(frozen=True, kw_only=True)
class Rendezvous:
    """Where the ranks of a profiling job meet: this machine alone (``--standalone``), or
    ``nnodes`` hosts that each start their own ranks (torchrun's static rendezvous)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    """Address of node 0, reachable from every node (needed when ``nnodes > 1``)."""
    master_port: int = 29500

    def __post_init__(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise OptionsError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1 and not self.master_addr:
            raise OptionsError(f"--nnodes {self.nnodes} needs --master-addr (node 0's address)")

    def torchrun_args(self) -> list[str]:
        if self.nnodes == 1:
            return ["--standalone"]
        return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}", f"--master-addr={self.master_addr}",
                f"--master-port={self.master_port}"]


def launch_local(nproc: int, args: Sequence[str], *, rendezvous: Rendezvous = Rendezvous(), host: str | None = None,
                 environ: Mapping[str, str] | None = None) -> int:
    """Run ``python -m hapd.profiler ARGS`` on ``nproc`` ranks of this machine through
    torchrun; their output streams to this process's. Returns the exit code.

    Sets, when unset: ``OMP_NUM_THREADS`` (CPU cores / nproc); ``GLOO_SOCKET_IFNAME=lo``
    for a standalone job (its ranks talk over loopback; a multi-node job needs the
    interface that reaches the other nodes, given by the caller); ``HAPD_HOST`` to
    ``host`` when given."""
    if nproc < 1:
        raise OptionsError(f"--nproc-per-node {nproc} must be ≥ 1")
    env = dict(os.environ if environ is None else environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    if rendezvous.nnodes == 1 and Path("/sys/class/net/lo").exists():
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if host:
        env[HOST_ENV] = host
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", *rendezvous.torchrun_args(), f"--nproc-per-node={nproc}",
           "-m", "hapd.profiler", *args]
    proc = subprocess.Popen(cmd, env=env)
    try:
        return proc.wait()
    except BaseException:  # Ctrl-C or an error here: stop the ranks, then re-raise
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        raise


if __name__ == "__main__":
    sys.exit(main())
