"""The profiler's measuring side, run on every rank: device speed, memory and collective
costs (DESIGN.md §3). torch is imported by the functions that use it, never at import.

What the numbers mean -- exactly what the cost model (``rustcore/core/src/cost.rs``,
``comm.rs``) charges:

* ``flops``: achieved FLOP/s of ``dtype`` matmuls of a few square sizes, FLOPs
  = 2·m·n·k; the median over sizes of each size's median rate.
* ``elementwise_flops``: achieved rate on ``add``, ``mul`` and ``gelu`` over large
  tensors, counted as the core counts them (1, 1 and 8 FLOPs per output element,
  ``rules/binary.rs`` and ``rules/unary.rs``): total counted FLOPs over total time of one
  of each.
* ``op_seconds``: what a training op costs beyond its FLOPs, as a pipeline stage runs
  it: a small fx graph of a transformer-like op mix on tiny tensors (:func:`op_probe`)
  run node by node through ``torch.fx.Interpreter`` with autograd recording, then its
  backward; the time of one forward and backward over three times its op count (the
  compiler charges it once forward and twice backward per op). Dispatch, autograd, the
  interpreter and on a GPU the launch. The probe's counted FLOPs (under a MFLOP a
  sample) are at most a few percent of its time on a CPU core, negligible on a GPU.
* Each rate sample runs the op back to back for at least ``window_s`` seconds of wall
  time, so a CPU quota (CFS period 100 ms) shows up as the slower rate it causes rather
  than as bursts at full speed. All ranks measure at the same time, as they compute in
  training.
* ``sync_overlap`` (η, several ranks only): the share of a gradient all-reduce's time
  that hides behind compute (:func:`sync_overlap`). C: one all-reduce of a gradient
  bucket (``GRAD_BUCKET_BYTES``), launched ``async_op`` as the runtime's ``GradSync``
  launches it, the slowest rank's time; D: matmuls sized to last about C; T: both at
  once. η = (C + D − T) / min(C, D), clamped to [0, 1]: 1 when the shorter one
  hides whole, 0 when they run one after the other (a rank's CPU quota shared by Gloo's
  threads and the compute; NCCL kernels sharing the SMs). D and T run rounds back to
  back for a third of ``window_s`` or more, so a CPU quota throttles them as it does a
  backward pass.
* ``memory``: the memory a rank can use — on a GPU its free memory (what another
  process already holds is not the rank's), on CPU the smallest cgroup memory limit
  above this process, capped by ``MemAvailable`` (what the machine can still give).
* Collectives: the full tensor has ``B`` bytes (``B`` from ``sizes``); every rank
  holds its even shard (``B/N``) or the full tensor, as the collective's input layout
  needs. Per repeat: a barrier, then each rank times one call (with its device
  synchronized), and the repeat's time is the largest over ranks; the size's time is
  the median over repeats after ``warmup`` untimed calls (more repeats for fast calls,
  see ``point_s``; repeats go round the sizes). ``time = α + B/β`` is fitted by least
  squares weighted by 1/time, leaving out sizes far slower than the fit of the rest
  (:func:`~hapd.profile.fit.fit_alpha_beta`); α < 0 refits through the origin
  (α = 0). With even shards this is the cost model's charge for each collective:
  padded all-gather, reduce-scatter and all-to-all α + N·(1/N)·B/β, grouped variants,
  all-reduce and broadcast (from rank 0) α + B/β. The calls are hapd's own runtime collectives
  (:mod:`hapd.runtime.collectives`), so what is timed is what a plan runs.
* Links: with one host, the collectives over all ranks give ``intra`` (and ``inter``
  repeats them: nothing crossed a host). With several hosts, collectives over all ranks
  give ``inter`` (every collective the cost model prices spans all devices) and, when
  every host has the same number (≥ 2) of ranks, the same collectives run within each
  host at once give ``intra``.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from hapd.errors import OptionsError, ProfileError
from hapd.profile.assemble import assemble
from hapd.profile.fit import NOT_COMMUNICATED, Fit, bound_alpha_beta, fit_alpha_beta
from hapd.profile.options import HOST_ENV, ProfilerOptions
from hapd.profile.schema import COLLECTIVES, Profile

ELEMENTWISE_OPS: dict[str, float] = {"add": 1.0, "mul": 1.0, "gelu": 8.0}
"""Element-wise ops timed for ``elementwise_flops`` → FLOPs per output element, as the
core counts them."""


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
    """``MemAvailable`` (bytes the machine can give without swapping), else
    ``MemTotal`` (kernels before 3.14 have no ``MemAvailable``)."""
    fields: dict[str, int] = {}
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                fields[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return fields.get("MemAvailable", fields.get("MemTotal"))


def _cgroup_usage(path: Path) -> int:
    """Bytes a cgroup already uses (``memory.current`` / ``memory.usage_in_bytes``; 0
    where the file is missing)."""
    try:
        raw = path.read_text().strip()
    except OSError:
        return 0
    return int(raw) if raw.isdigit() else 0


def _cgroup_memory_limits(proc: Path, root: Path) -> list[int]:
    """What is left under the memory limit (bytes) of this process's cgroup and each of
    its ancestors, v1 and v2: the limit less what the cgroup already uses (this process's
    own torch and Python among it: what a GPU's free memory leaves out too). ``root`` is
    where paths in ``/proc/self/mountinfo`` are resolved (``/``)."""
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
        used_name = "memory.current" if key == "v2" else "memory.usage_in_bytes"
        while True:
            try:
                raw = (here / name).read_text().strip()
                if raw.isdigit():
                    limits.append(int(raw) - _cgroup_usage(here / used_name))
            except OSError:
                pass
            if here == top or top not in here.parents:
                break
            here = here.parent
    return limits


def host_memory(proc: Path = Path("/proc"), root: Path = Path("/")) -> int:
    """Bytes this process may still use on the CPU: the least headroom under a cgroup
    memory limit above it (the limit less the cgroup's usage), capped by ``MemAvailable``
    (``MemTotal`` where the kernel has no such line)."""
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
    op_seconds: float | None = None
    """Seconds a training op costs beyond its FLOPs, a third of its forward and backward
    (:func:`op_seconds`)."""
    sync_overlap: float | None = None
    """Share of a gradient all-reduce hidden behind compute (:func:`sync_overlap`); None
    with one rank or without a process group."""


OP_PROBE_BLOCKS = 32
"""Repeats of the op mix in :func:`op_probe`'s graph."""
OP_PROBE_ROWS, OP_PROBE_WIDTH = 8, 16
"""Shape of the op probe's activations (rows × width; its weights are width × width)."""


def op_probe(device: Any, dtype: Any) -> tuple[Any, Any]:
    """(a ``torch.fx.GraphModule``, its input): :data:`OP_PROBE_BLOCKS` repeats of a
    transformer-like op mix on tiny tensors — ``linear`` by a trainable weight, ``add``,
    ``layer_norm``, ``gelu``, ``mul``, ``transpose``, ``matmul``, ``softmax``,
    ``matmul``, ``reshape`` — ending in a ``sum``; traced with ``symbolic_trace``, so each
    op is one node, as in the programs a pipeline stage runs. The activations stay of
    order one through the repeats (normalized, then averaged), so no dtype underflows."""
    import torch
    import torch.nn.functional as F
    from torch import fx, nn

    rows, width = OP_PROBE_ROWS, OP_PROBE_WIDTH

    class OpMix(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for i in range(OP_PROBE_BLOCKS):
                weight = torch.randn(width, width, device=device, dtype=dtype) / math.sqrt(width)
                self.register_parameter(f"w{i}", nn.Parameter(weight))

        def forward(self, x: Any) -> Any:
            for i in range(OP_PROBE_BLOCKS):
                h = F.layer_norm(F.linear(x, getattr(self, f"w{i}")) + x, (width,))
                h = F.gelu(h) * h
                x = (torch.softmax(h @ h.transpose(0, 1), dim=-1) @ h).reshape(rows, width)
            return x.sum()

    return fx.symbolic_trace(OpMix()), torch.randn(rows, width, device=device, dtype=dtype)


def probe_ops(graph_module: Any) -> int:
    """The ops of a graph module: its ``call_function``, ``call_method`` and
    ``call_module`` nodes (what a stage dispatches one by one)."""
    return sum(1 for node in graph_module.graph.nodes if node.op in ("call_function", "call_method", "call_module"))


def op_seconds(device: Any, dtype: Any, *, repeats: int, window_s: float) -> float:
    """Seconds a training op costs beyond its FLOPs, a third of one op's forward and
    backward: :func:`op_probe`'s graph run forward node by node through
    ``torch.fx.Interpreter`` (as :mod:`hapd.runtime.pipeline` runs a stage) and then
    backward, back to back for ``window_s`` (so a CPU quota shows); the median time of
    one such sample over 3 × :func:`probe_ops`. A third, because the compiler charges it
    once forward and twice backward per op."""
    from torch import fx

    graph_module, x = op_probe(device, dtype)
    nodes = list(graph_module.graph.nodes)

    def sample() -> None:
        interp = fx.Interpreter(graph_module)
        env: dict[Any, Any] = {}
        for node in nodes:
            if node.op == "placeholder":
                env[node] = x
            elif node.op == "output":
                env[node.args[0]].backward()
            else:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                env[node] = getattr(interp, node.op)(node.target, args, kwargs)

    per_sample = 1.0 / statistics.median(sample_rate(sample, 1.0, device, repeats=repeats, window_s=window_s))
    return per_sample / (3 * probe_ops(graph_module))


SYNC_OVERLAP_CALLS = 3
"""Timed single all-reduces of :func:`sync_overlap`'s C (the median is kept)."""
SYNC_OVERLAP_ROUNDS = (3, 1000)
"""Fewest and most rounds of :func:`sync_overlap`'s D and T."""


def overlap_share(comm: float, compute: float, together: float) -> float:
    """η = (C + D − T) / min(C, D) clamped to [0, 1]: the share of the shorter of a
    collective (C seconds alone) and a compute load (D) that hides when both run at once
    (T): T = max(C, D) gives 1, T = C + D gives 0."""
    shorter = min(comm, compute)
    if not shorter > 0:
        return 0.0
    return min(1.0, max(0.0, (comm + compute - together) / shorter))


def sync_overlap(device: Any, dtype: Any, matmul_n: int, matmul_flops: float, *, window_s: float) -> float:
    """η, the share of a gradient all-reduce's time that hides behind compute on this
    device (:func:`overlap_share` of R·C, D and T). Every rank of the world calls it at
    once.

    * C: one ``all_reduce`` of a gradient bucket (``GRAD_BUCKET_BYTES`` of ``dtype``)
      launched ``async_op`` and waited for, as the runtime's ``GradSync`` runs it, after
      a barrier: the slowest rank's time, the median of :data:`SYNC_OVERLAP_CALLS` after
      an untimed call. The single call the collectives' fits time too, which is what the
      compiler prices a gradient sync at.
    * D: R rounds of ``k`` ``matmul_n``-square matmuls, back to back on every rank at
      once; ``k`` (at least one) makes a round last about C at the measured rate
      ``matmul_flops``.
    * T: R rounds of: the all-reduce launched, the ``k`` matmuls, the all-reduce waited
      for; back to back.

    R (the same on every rank, whose all-reduces must match) makes D last about a third
    of ``window_s`` (T up to twice that): the compute runs without a pause, as a
    backward pass does, so a CPU quota that Gloo's threads share with it throttles both
    as in training. (One short round after a pause runs in a burst at full speed and
    shows an overlap that a throttled rank does not have.)"""
    import torch
    import torch.distributed as dist

    from hapd._core import GRAD_BUCKET_BYTES

    itemsize = torch.empty((), dtype=dtype).element_size()
    bucket = torch.zeros(GRAD_BUCKET_BYTES // itemsize, dtype=dtype, device=device)
    a = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
    b = torch.randn(matmul_n, matmul_n, device=device, dtype=dtype)
    out = torch.empty(matmul_n, matmul_n, device=device, dtype=dtype)

    def reduce() -> None:
        dist.all_reduce(bucket, async_op=True).wait()

    def compute() -> None:
        for _ in range(k):
            torch.mm(a, b, out=out)

    def both() -> None:
        handle = dist.all_reduce(bucket, async_op=True)
        compute()
        handle.wait()

    def repeated(call: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(rounds):
                call()

        return run

    _timed(reduce, device)
    comm = statistics.median(_max_over_ranks([_timed(reduce, device) for _ in range(SYNC_OVERLAP_CALLS)], device))
    per_matmul = 2.0 * matmul_n**3 / matmul_flops
    k = max(1, round(comm / per_matmul))
    (round_s,) = _max_over_ranks([max(comm, k * per_matmul)], device)
    low, high = SYNC_OVERLAP_ROUNDS
    rounds = min(high, max(low, math.ceil(window_s / (3 * round_s))))
    alone = _timed(repeated(compute), device)
    return overlap_share(rounds * comm, alone, _timed(repeated(both), device))


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
    if barrier is not None:
        barrier()
    per_op_s = op_seconds(device, dtype, repeats=options.speed_repeats, window_s=options.window_s)
    detail: dict[str, Any] = {"matmul_flops_by_size": per_size, "elementwise_flops_by_op": per_op,
                              "elementwise_numel": numel, "dtype": options.dtype, "load_average_1m": load}
    if cuda:
        props = torch.cuda.get_device_properties(device)
        model, memory = props.name, int(torch.cuda.mem_get_info(device)[0])  # free bytes
        detail["float32_matmul_precision"] = torch.get_float32_matmul_precision()
        detail["cuda"] = torch.version.cuda
    else:
        model, memory = cpu_model(), host_memory()
        detail["threads"] = torch.get_num_threads()
    return DeviceMeasurement(host=host_name(), model=model, flops=flops, elementwise_flops=ew,
                             memory=memory, detail=detail, op_seconds=per_op_s)


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
                    hosts: Any = None, p2p_sharing: int = 1) -> tuple[Callable[[], Any], int]:
    """(a call of collective ``name`` on a full tensor of about ``nbytes`` with even
    shards over ``group``, the full tensor's exact bytes). Inputs are made once.
    ``grad_sync`` (the runtime's two-level gradient sum) needs ``hosts``. For ``p2p``
    the bytes are the message's times ``p2p_sharing``, the pairs that send at once
    between one pair of hosts (:func:`pairs_per_host_pair`): what crosses that host pair's link."""
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
    calls["p2p"] = _point_to_point(full, rank, n, group)
    if name not in calls:
        raise OptionsError(f"unknown collective {name!r}; known: {', '.join(calls)}")
    return calls[name], full.numel() * full.element_size() * (p2p_sharing if name == "p2p" else 1)


def pairs_per_host_pair(hosts: Sequence[str]) -> int:
    """The most pairs of :func:`_point_to_point` (rank ``r`` of the group's first half to
    ``r + n // 2``; ``hosts``: each group rank's host) that send between one pair of
    hosts at once: they share that pair's link, so a host pair carries that many messages
    in the time measured. A pipeline boundary spread over the ranks of two hosts moves
    the same way; two hosts with one rank each send one message."""
    half = len(hosts) // 2
    pairs: dict[tuple[str, str], int] = {}
    for r in range(half):
        key = (hosts[r], hosts[r + half])
        pairs[key] = pairs.get(key, 0) + 1
    return max(pairs.values(), default=1)


def _point_to_point(message: Any, rank: int, n: int, group: Any) -> Callable[[], Any]:
    """One message from each rank of the group's first half to its peer in the second
    half (``rank + n // 2``; with the ranks of a host together, that crosses hosts
    when the group spans two): the sender's ``send``, the receiver's ``recv``, nothing
    for the last rank of an odd group."""
    import torch.distributed as dist

    half = n // 2
    if rank < half:
        return lambda: dist.send(message, group=group, group_dst=rank + half)
    if rank < 2 * half:
        return lambda: dist.recv(message, group=group, group_src=rank - half)
    return lambda: None


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
                    group: Any, hosts: Any = None, p2p_sharing: int = 1) -> list[tuple[int, float]]:
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
    calls = [collective_call(name, size, dtype=dtype, device=device, group=group, hosts=hosts,
                             p2p_sharing=p2p_sharing) if active else (None, 0)
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
    import torch
    import torch.distributed as dist

    from hapd.runtime.training import init_distributed

    env = init_distributed()
    rank, world = env.rank, env.world
    started = datetime.datetime.now(datetime.timezone.utc)
    _say(rank, f"hapd profile: {world} rank(s), backend {env.backend}, dtype {options.dtype}")
    _say(rank, "measuring device speed and memory on every rank …")
    mine = measure_device(env.device, options, barrier=dist.barrier)
    if world > 1:  # with one rank nothing is summed, so nothing overlaps
        _say(rank, "measuring how much of a gradient all-reduce hides behind compute …")
        n = min(int(size) for size in mine.detail["matmul_flops_by_size"])
        mine = replace(mine, sync_overlap=sync_overlap(env.device, getattr(torch, options.dtype), n,
                                                       mine.detail["matmul_flops_by_size"][str(n)],
                                                       window_s=options.window_s))
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
    if world > 1:
        _say(rank, "measuring p2p (one rank's message to another) …")
        members = {"inter": hosts, "intra": [hosts[rank]] * len(next(g for g in groups if rank in g))}
        fits["p2p"] = {kind: _measure_link("p2p", kind, group, options, env.device, rank,
                                           p2p_sharing=pairs_per_host_pair(members[kind]))
                       for kind, group in kinds.items()}
    dist.barrier()
    if rank != 0:
        return None
    return assemble(devices, fits, options, started=started, backend=env.backend, world=world,
                    no_intra=no_intra if multi_host else None, torch_version=torch.__version__)


def _measure_link(name: str, kind: str, group: Any, options: ProfilerOptions, device: Any, rank: int,
                  hosts: Any = None, p2p_sharing: int = 1) -> Fit:
    """Time one collective over ``group`` and fit α/β. Times that do not grow with the
    size (a link so fast that latency noise hides the transfer) are measured once more;
    if they still do not grow, α and β are bounded instead (:func:`bound_alpha_beta`) and
    the profile says so. Every rank takes the same branch: the times are the slowest
    rank's, the same everywhere."""
    where = f"collectives.{name}.{kind}"
    for attempt in (1, 2):
        points = time_collective(name, options.sizes, options, device=device, group=group, hosts=hosts,
                                 p2p_sharing=p2p_sharing)
        sizes, times = [b for b, _ in points], [t for _, t in points]
        try:
            return fit_alpha_beta(sizes, times, where=where)
        except ProfileError as exc:
            if len(set(sizes)) < 2 or not all(math.isfinite(t) and t > 0 for t in times):
                raise
            _say(rank, f"{exc}" + ("; measuring again" if attempt == 1 else
                                   "; using bounds: α = the fastest time, β = the largest size over its time"))
    return bound_alpha_beta(sizes, times)


def measure_local_device(options: ProfilerOptions) -> DeviceMeasurement:
    """:func:`measure_device` of this process's device (its current GPU, else the CPU),
    without a process group."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    return measure_device(device, options)


def close_process_group() -> None:
    """Destroy the default process group when one was initialized."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
