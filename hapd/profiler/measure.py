"""The profiler's measuring side, run on every rank: device speed, memory and collective
costs (DESIGN.md §3). torch is imported by the functions that use it, never at import.

What the numbers mean -- exactly what the cost model (``rustcore/core/src/cost.rs``,
``comm.rs``) charges:

* ``flops``: achieved FLOP/s of ``dtype`` ``Linear`` layers trained as a step trains
  them (:func:`linear_flops`): a stack of :data:`LINEAR_PROBE_LAYERS` layers of a few
  widths, forward and backward (the weight's and the input's gradient), FLOPs = 3 · 2 ·
  rows · width² a layer (less the first layer's input gradient); the median over widths
  of each width's median rate. The rows are a rank's share of a (micro-)batch in tokens
  (128 on a CPU, 2048 on a GPU): training's matmuls are tall and thin, each weight is
  read once a pass and the backward multiplies by transposes, which on a CPU core runs
  14–17% below a square matmul repeated on operands the cache already holds.
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
* ``sync_overlap`` (η, several ranks only): the share of the gradient sync's time that
  hides behind the backward pass (:func:`sync_overlap`), timed on the mechanism itself: a
  model of many ``Linear`` layers whose gradients fill several buckets
  (``GRAD_BUCKET_BYTES``), summed by the runtime's ``GradSync`` as training sums them
  (buckets launched from gradient hooks during backward; two levels, with a helper
  thread on each host leader, when hosts hold several ranks). C: the sync alone; D:
  forward and backward without communication, B its backward; T: forward and backward
  with the sync. η = (C + D − T) / min(C, B), clamped to [0, 1]: 1 when the shorter one
  hides whole, 0 when they run one after the other (a rank's CPU quota shared by
  autograd, its hooks and Gloo's threads; NCCL kernels sharing the SMs). Each rank's batch
  makes a backward last about one sync; rounds of the three, taking turns without a
  pause for about ``window_s``, so a CPU quota throttles them as it does training.
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
  (:mod:`hapd.spmd.collectives`), so what is timed is what a plan runs.
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
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hapd.errors import OptionsError, ProfileError
from hapd.profile.assemble import assemble
from hapd.profiler.machine import (cpu_model, host_memory, host_name, linear_flops, runs_fused_attention, sample_rate,
                                   sync_device)
from hapd.profile.fit import NOT_COMMUNICATED, Fit, bound_alpha_beta, fit_alpha_beta
from hapd.profile.options import ProfilerOptions
from hapd.profile.schema import COLLECTIVES, Profile

ELEMENTWISE_OPS: dict[str, float] = {"add": 1.0, "mul": 1.0, "gelu": 8.0}
"""Element-wise ops timed for ``elementwise_flops`` → FLOPs per output element, as the
core counts them."""


# --------------------------------------------------------------------------
# This device: name, memory, speed
# --------------------------------------------------------------------------


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
    dtype_flops: dict[str, float | None] | None = None
    """The linear probe's rate per half dtype (:func:`half_precision_flops`): ``bf16``,
    ``fp16``; None for one the device has no arithmetic for."""
    fused_attention: bool = False
    """Whether the device runs hapd's fused attention kernel
    (:func:`hapd.profiler.machine.runs_fused_attention`)."""


def half_precision_flops(device: Any, width: int, rows: int, *, repeats: int, window_s: float,
                         barrier: Callable[[], Any] | None = None) -> dict[str, float | None]:
    """The linear probe at ``width`` in the half dtypes (weights and activations in the
    dtype: the matmul rate autocast gets). On CUDA bf16 and fp16, bf16 None where the
    device has none (``torch.cuda.is_bf16_supported``). On a CPU bf16 only: torch runs a
    CPU's fp16 matmuls emulated (1.2 GFLOP/s against 16 fp32 and 62 bf16 on the 2-core
    machine hapd is tested on), whose probe alone would take a minute; the profile
    states no fp16 rate and :mod:`hapd.profile.precision` says how it prices one."""
    import torch

    dtypes = (("bf16", torch.bfloat16), ("fp16", torch.float16)) if device.type == "cuda" else (("bf16", torch.bfloat16),)
    out: dict[str, float | None] = {}
    for name, dtype in dtypes:
        if device.type == "cuda" and name == "bf16" and not torch.cuda.is_bf16_supported():
            out[name] = None
            continue
        out[name], _ = linear_flops(device, dtype, (width,), rows, repeats=repeats, window_s=window_s, barrier=barrier)
    return out


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
    ``torch.fx.Interpreter`` (as :mod:`hapd.spmd.pipeline` runs a stage) and then
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


SYNC_PROBE_WIDTH = 512
"""Width of :func:`sync_probe_model`'s layers (``width × width`` weights, a bias each)."""
SYNC_PROBE_BUCKETS = 4
"""Gradient buckets (``GRAD_BUCKET_BYTES``) the probe's parameters fill at least."""
SYNC_PROBE_ROWS = (8, 32)
"""Batch rows of the two calibrating steps of :func:`sync_overlap`."""
SYNC_PROBE_SAMPLES = 2
"""Steps timed at each of :data:`SYNC_PROBE_ROWS` (the fastest is kept)."""
SYNC_PROBE_MAX_ROWS = 4096
"""Most batch rows of the timed steps (their activations stay within a few hundred MiB)."""
SYNC_OVERLAP_ROUNDS = (1, 1000)
"""Fewest and most rounds of :func:`sync_overlap`'s C, D and T."""


def overlap_share(comm: float, compute: float, together: float) -> float:
    """η = (C + D − T) / min(C, D) clamped to [0, 1]: the share of the shorter of a
    collective (C seconds alone) and a compute load (D) that hides when both run at once
    (T): T = max(C, D) gives 1, T = C + D gives 0."""
    shorter = min(comm, compute)
    if not shorter > 0:
        return 0.0
    return min(1.0, max(0.0, (comm + compute - together) / shorter))


def sync_probe_model(device: Any, dtype: Any) -> Any:
    """The model :func:`sync_overlap` trains: ``Linear(w, w)`` (with bias) and ``GELU``
    layers, ``w`` = :data:`SYNC_PROBE_WIDTH`, as many as make its parameters fill at
    least :data:`SYNC_PROBE_BUCKETS` gradient buckets of ``dtype`` (fp32: 16 layers,
    16 MiB). Many layers of moderate width: backward is a sequence of ops, each parameter's
    gradient arriving through autograd and its hooks, as in a real model."""
    import torch
    from torch import nn

    from hapd._core import GRAD_BUCKET_BYTES

    width = SYNC_PROBE_WIDTH
    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = math.ceil(SYNC_PROBE_BUCKETS * GRAD_BUCKET_BYTES / (width * (width + 1) * itemsize))
    blocks = [block for _ in range(layers) for block in (nn.Linear(width, width), nn.GELU())]
    return nn.Sequential(*blocks).to(device=device, dtype=dtype)


class SyncProbe:
    """:func:`sync_probe_model` with the runtime's gradient sync
    (:class:`hapd.spmd.gradsync.GradSync` over the world, two-level with ``hosts``)
    and an input batch: the training step whose sync :func:`sync_overlap` times."""

    def __init__(self, device: Any, dtype: Any, hosts: Any, rows: int) -> None:
        from hapd.spmd.gradsync import GradSync

        self.device, self.dtype = device, dtype
        self.model = sync_probe_model(device, dtype)
        self.params = list(self.model.parameters())
        self.sync = GradSync(self.params, None, hosts=hosts)
        self.set_rows(rows)

    def set_rows(self, rows: int) -> None:
        """Use a batch of ``rows`` rows from now on."""
        import torch

        self.x = torch.randn(rows, SYNC_PROBE_WIDTH, device=self.device, dtype=self.dtype)

    def step(self, *, synced: bool) -> float:
        """One training step's forward and backward, as the runtime runs it: gradients
        set to None (``zero_grad``), the sync reset (the rank module's forward pre-hook),
        forward, backward — which with ``synced`` sums the gradients over ranks as
        backward produces them, else (``no_sync``) communicates nothing. Returns the
        forward's seconds."""
        for p in self.params:
            p.grad = None
        self.sync.reset()
        start = time.perf_counter()
        loss = self.model(self.x).sum()
        sync_device(self.device)
        forward = time.perf_counter() - start
        if synced:
            loss.backward()
        else:
            with self.sync.no_sync():
                loss.backward()
        sync_device(self.device)
        return forward

    def timed_step(self) -> tuple[float, float]:
        """(forward, backward) seconds of one :meth:`step` under ``no_sync``."""
        start = time.perf_counter()
        forward = self.step(synced=False)
        return forward, time.perf_counter() - start - forward

    def sync_alone(self) -> None:
        """The sync of the gradients as they stand, with no compute: every parameter
        reported ready in bucket order through the hook ``GradSync`` registers (what
        backward calls as each gradient lands), so the buckets launch back to back and
        the sums are waited for and written back — the sync's whole path without the
        backward around it. A backward of a graph with no compute would still allocate
        and write every gradient (megabytes, a fair part of a fast sync's time)."""
        self.sync.reset()
        for bucket in self.sync.buckets:
            for p in bucket:
                self.sync.grad_ready(p)


def _affine(timed: dict[int, float]) -> tuple[float, float]:
    """(a, b) of ``a + b·rows`` through the two points of ``timed`` (``{rows: seconds}``)."""
    (r0, t0), (r1, t1) = sorted(timed.items())
    slope = (t1 - t0) / (r1 - r0)
    return t0 - slope * r0, slope


def _rows_lasting(seconds: float, timed: dict[int, float]) -> int:
    """Batch rows whose time is ``seconds``, from times at two row counts (``{rows:
    seconds}``) fitted as ``a + b·rows``; at most twice the larger count scaled by
    ``seconds`` over its time (a slope flattened by noise would give far too many rows;
    scaling alone counts the fixed cost ``a`` per row, too few); within [1,
    :data:`SYNC_PROBE_MAX_ROWS`]."""
    offset, slope = _affine(timed)
    largest = max(timed)
    scaled = largest * seconds / max(timed[largest], 1e-9)
    rows = min((seconds - offset) / slope, 2 * scaled) if slope > 0 else scaled
    return int(min(SYNC_PROBE_MAX_ROWS, max(1, round(rows))))


def _warm_up_groups(hosts: Any, device: Any, dtype: Any) -> None:
    """One element summed as the sync sums (two levels with ``hosts``): a process
    group's first collective may set up its connections (NCCL does), which no timing
    should include."""
    import torch
    import torch.distributed as dist

    from hapd.spmd.collectives import two_level_sum_

    one = torch.ones(1, device=device, dtype=dtype)
    if hosts is None:
        dist.all_reduce(one)
    else:
        two_level_sum_(one, hosts)
    sync_device(device)


def sync_overlap(device: Any, dtype: Any, *, hosts: Any, window_s: float) -> float:
    """η, the share of the gradient sync's time that hides behind the backward pass in
    a training step (:func:`overlap_share` of C, B and T − F below), timed on the mechanism
    the compiler prices: a :class:`SyncProbe` — a model of many ``Linear`` layers whose
    gradients fill several buckets, summed by the runtime's ``GradSync`` (``hosts``: the
    job's :class:`~hapd.spmd.collectives.HostGroups`, None for a flat all-reduce, as
    the runtime builds them), its buckets launched from the gradient hooks as backward
    produces them, on a leader through its helper thread. Every rank of the world calls
    it at once.

    Each of R rounds runs, every phase after a barrier (the ranks sharing a machine run
    the same phase), each phase's time the slowest rank's (a training step ends when its
    slowest rank's does):

    * a step (forward and backward) under ``no_sync``: D, B its backward's share;
    * the sync alone (:meth:`SyncProbe.sync_alone`) of that step's gradients: C;
    * a step with the sync: T.

    η = (ΣC + ΣD − ΣT) / min(ΣC, ΣB), the same on every rank: the forward is in both D
    and T, so it cancels in the hidden time, while what the sync can hide behind is the
    backward only (as the compiler's ``serial − η·min(S, B)``, with B and S the
    slowest device's). The phases take turns, so a burst of other work on the machine
    slows all three alike, and they follow each other without a pause, as training's
    steps do, so a CPU quota that the sync's threads share with autograd throttles them
    as in training.

    Each rank's batch makes its backward last about one sync (fitted from steps of
    :data:`SYNC_PROBE_ROWS` rows and a first sync timed alone), so the ranks' backwards
    end together, as they do when a plan gives each device a share of the batch in
    proportion to its speed. R (the same on every rank, whose collectives must match)
    makes the rounds last about ``window_s``, at least one. With R = 1 (a sync about as
    long as the window, so its first call's costs are negligible) that first sync is C,
    which saves timing it again on a slow link."""
    import torch.distributed as dist

    probe = SyncProbe(device, dtype, hosts, rows=SYNC_PROBE_ROWS[0])
    first_sync, rows, rounds = _probe_rows_and_rounds(probe, device, dtype, hosts, window_s)
    probe.set_rows(rows)
    steps, backwards, syncs, togethers = [], [], [], []
    for _ in range(rounds):
        dist.barrier()
        sync_device(device)
        f, b = probe.timed_step()
        steps.append(f + b)
        backwards.append(b)
        if rounds > 1:
            syncs.append(_timed(probe.sync_alone, device))
        togethers.append(_timed(lambda: probe.step(synced=True), device))
    slowest = _max_over_ranks([*steps, *backwards, *syncs, *togethers], device)  # each round's slowest rank
    compute, backward_s = sum(slowest[:rounds]), sum(slowest[rounds:2 * rounds])
    comm = sum(slowest[2 * rounds:-rounds]) if rounds > 1 else first_sync
    together = sum(slowest[-rounds:])
    return overlap_share(comm, backward_s, together - (compute - backward_s))


def _probe_rows_and_rounds(probe: SyncProbe, device: Any, dtype: Any, hosts: Any,
                           window_s: float) -> tuple[float, int, int]:
    """(first sync's seconds, rows whose backward lasts about one sync, rounds lasting about ``window_s``)."""
    probe.step(synced=False)  # allocations, first-call costs
    forward, backward = {}, {}
    for rows in SYNC_PROBE_ROWS:
        probe.set_rows(rows)
        forward[rows], backward[rows] = min((probe.timed_step() for _ in range(SYNC_PROBE_SAMPLES)), key=sum)
    _warm_up_groups(hosts, device, dtype)
    (first_sync,) = _max_over_ranks([_timed(probe.sync_alone, device)], device)
    rows = _rows_lasting(first_sync, backward)
    offset, slope = _affine({r: forward[r] + backward[r] for r in SYNC_PROBE_ROWS})
    (round_s,) = _max_over_ranks([2 * (first_sync + max(0.0, offset + slope * rows))], device)
    low, high = SYNC_OVERLAP_ROUNDS
    return first_sync, rows, min(high, max(low, math.ceil(window_s / round_s)))


def measure_device(device: Any, options: ProfilerOptions, *,
                   barrier: Callable[[], Any] | None = None) -> DeviceMeasurement:
    """Speed, memory and name of ``device`` (a ``torch.device``). ``barrier`` (all
    ranks') aligns the workloads of ranks that measure together: ranks on one machine
    share its memory bandwidth, and each workload should meet the same neighbours."""
    import torch

    dtype = getattr(torch, options.dtype)
    cuda = device.type == "cuda"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # busy machine → slower numbers
    widths = options.linear_widths or ((2048, 4096, 8192) if cuda else (256, 512, 1024))
    rows = options.linear_rows or (2048 if cuda else 128)
    numel = options.elementwise_numel or (2**26 if cuda else 2**22)
    flops, per_width = linear_flops(device, dtype, widths, rows, repeats=options.speed_repeats,
                                    window_s=options.window_s, barrier=barrier)
    ew, per_op = elementwise_flops(device, dtype, numel, repeats=options.speed_repeats, window_s=options.window_s,
                                   barrier=barrier)
    half = half_precision_flops(device, widths[-1], rows, repeats=options.speed_repeats, window_s=options.window_s,
                                barrier=barrier)
    if barrier is not None:
        barrier()
    per_op_s = op_seconds(device, dtype, repeats=options.speed_repeats, window_s=options.window_s)
    detail: dict[str, Any] = {"linear_flops_by_width": per_width, "linear_rows": rows,
                              "elementwise_flops_by_op": per_op,
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
                             memory=memory, detail=detail, op_seconds=per_op_s,
                             dtype_flops={**({"fp32": flops} if options.dtype == "float32" else {}), **half},
                             fused_attention=runs_fused_attention(device))


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

    from hapd.spmd import collectives as C

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
    sync_device(device)
    if call is None:
        return 0.0
    start = time.perf_counter()
    call()
    sync_device(device)
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

    from hapd.spmd.collectives import host_groups
    from hapd.spmd.distributed import init_distributed

    env = init_distributed()
    rank, world = env.rank, env.world
    started = datetime.datetime.now(datetime.timezone.utc)
    _say(rank, f"hapd profile: {world} rank(s), backend {env.backend}, dtype {options.dtype}")
    _say(rank, "measuring device speed and memory on every rank …")
    mine = measure_device(env.device, options, barrier=dist.barrier)
    hosts: list[str] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(hosts, mine.host)
    # the runtime's two-level gradient sums (None: one host, or one rank per host)
    index = {h: i for i, h in enumerate(dict.fromkeys(hosts))}
    two_level = host_groups([index[h] for h in hosts]) if world > 1 else None
    if world > 1:  # with one rank nothing is summed, so nothing overlaps
        _say(rank, "measuring how much of a gradient all-reduce hides behind compute …")
        mine = replace(mine, sync_overlap=sync_overlap(env.device, getattr(torch, options.dtype), hosts=two_level,
                                                       window_s=options.window_s))
    devices: list[dict[str, Any]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(devices, asdict(mine))
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
    fits = _measure_links(kinds, world, rank, hosts, groups, two_level, options, env.device)
    dist.barrier()
    if rank != 0:
        return None
    return assemble(devices, fits, options, started=started, backend=env.backend, world=world,
                    no_intra=no_intra if multi_host else None, torch_version=torch.__version__)


def _measure_links(kinds: dict[str, Any], world: int, rank: int, hosts: list[str], groups: list[list[int]],
                   two_level: Any, options: ProfilerOptions, device: Any) -> dict[str, dict[str, Fit]]:
    """Each collective's fit per link kind (``kinds``: kind → its group), the runtime's grad_sync and p2p's."""
    fits: dict[str, dict[str, Fit]] = {}
    for i, name in enumerate(COLLECTIVES, 1):
        if world == 1:  # nothing is communicated, and the cost model charges nothing
            fits[name] = {"intra": NOT_COMMUNICATED}
            continue
        _say(rank, f"measuring {name} ({i}/{len(COLLECTIVES)}) …")
        fits[name] = {}
        for kind, group in kinds.items():
            fits[name][kind] = _measure_link(name, kind, group, options, device, rank)
    if two_level is not None:
        _say(rank, "measuring grad_sync (the runtime's two-level gradient all-reduce) …")
        fits["grad_sync"] = {"inter": _measure_link("grad_sync", "inter", None, options, device, rank,
                                                    hosts=two_level)}
    if world > 1:
        _say(rank, "measuring p2p (one rank's message to another) …")
        members = {"inter": hosts, "intra": [hosts[rank]] * len(next(g for g in groups if rank in g))}
        fits["p2p"] = {kind: _measure_link("p2p", kind, group, options, device, rank,
                                           p2p_sharing=pairs_per_host_pair(members[kind]))
                       for kind, group in kinds.items()}
    return fits


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
