"""This machine, as a rank sees it: its name, the memory it may still use and how fast
its device multiplies (the linear probe). The profiler (:mod:`hapd.profiler.measure`)
measures with these, and a job without a profile describes its devices with them
(:mod:`hapd.profiler.local`). torch is imported by the functions that use it."""

from __future__ import annotations

import math
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hapd.errors import ProfileError
from hapd.profile.options import HOST_ENV


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


def _meminfo_total(proc: Path, wanted: str = "MemAvailable") -> int | None:
    """``MemAvailable`` (bytes the machine can give without swapping; ``wanted``
    ``"MemTotal"``: all it has), else ``MemTotal`` (kernels before 3.14 have no
    ``MemAvailable``)."""
    fields: dict[str, int] = {}
    try:
        for line in (proc / "meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("MemTotal", "MemAvailable"):
                fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return fields.get(wanted, fields.get("MemTotal"))


def _cgroup_usage(path: Path) -> int:
    """Bytes a cgroup already uses (``memory.current`` / ``memory.usage_in_bytes``; 0
    where the file is missing)."""
    try:
        raw = path.read_text().strip()
    except OSError:
        return 0
    return int(raw) if raw.isdigit() else 0


def _cgroup_memory_limits(proc: Path, root: Path, *, headroom: bool = True) -> list[int]:
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
                    limits.append(int(raw) - (_cgroup_usage(here / used_name) if headroom else 0))
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


def host_memory_size(proc: Path = Path("/proc"), root: Path = Path("/")) -> int:
    """Bytes this process's machine has for it at most: the least cgroup memory limit
    above it, capped by ``MemTotal``. Unlike :func:`host_memory` it does not move with
    what other processes use at the moment (a job's default profile keys its plans)."""
    total = _meminfo_total(proc, "MemTotal")
    candidates = [n for n in _cgroup_memory_limits(proc, root, headroom=False) if n > 0]
    if total is not None:
        candidates.append(total)
    if not candidates:
        raise ProfileError("cannot tell this machine's memory (no /proc/meminfo)", field="memory")
    return min(candidates)


def sync_device(device: Any) -> None:
    """Wait for ``device``'s queued work (CUDA; nothing on CPU)."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


FUSED_ATTENTION_CAPABILITY = (7, 0)
"""The least CUDA compute capability Triton compiles for, so the least that runs hapd's
fused attention kernel (:mod:`hapd.spmd.random.attention_kernels`)."""


def runs_fused_attention(device: Any) -> bool:
    """Whether ``device`` (a ``torch.device``) runs an attention with dropout as hapd's
    fused kernel, as a profile's ``fused_attention`` says: a CUDA device of compute
    capability ≥ 7.0 (:data:`FUSED_ATTENTION_CAPABILITY`) where Triton imports. A CPU
    runs the math attention (Triton's interpreter is for tests, not training), and so
    does a P100 (6.0)."""
    if device.type != "cuda":
        return False
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    if torch.cuda.get_device_capability(index) < FUSED_ATTENTION_CAPABILITY:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def sample_rate(step: Callable[[], None], work: float, device: Any, *, repeats: int, window_s: float) -> list[float]:
    """``repeats`` samples of ``work`` units per second, each over back-to-back calls of
    ``step`` lasting at least ``window_s`` wall seconds (after warming up)."""
    step()
    sync_device(device)
    calls, elapsed = 1, 0.0
    while True:  # calibrate: double the calls until a batch takes a quarter window
        start = time.perf_counter()
        for _ in range(calls):
            step()
        sync_device(device)
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
        sync_device(device)
        rates.append(calls * work / (time.perf_counter() - start))
    return rates


LINEAR_PROBE_LAYERS = 16
"""Layers of :func:`linear_flops`'s stack (fewer where their weights and gradients would
pass :data:`LINEAR_PROBE_BYTES`)."""
LINEAR_PROBE_BYTES = 1 << 30
"""Most bytes of the probe stack's weights and their gradients."""


def linear_probe(device: Any, dtype: Any, width: int, rows: int) -> tuple[Callable[[], None], float]:
    """(one training call of a stack of ``width × width`` ``Linear`` layers on a
    ``rows × width`` input, its FLOPs). The call is a forward through the stack and the
    backward of its sum: each layer's forward ``x·Wᵀ``, its input's gradient ``g·W`` and
    its weight's gradient ``gᵀ·x``, 3 · 2 · rows · width² FLOPs a layer (less the first
    layer's input gradient, which nothing needs), the weights read from memory once a
    pass as in a training step (the stack outgrows a CPU's caches at all but the
    smallest width). :data:`LINEAR_PROBE_LAYERS` layers, fewer where their weights and
    gradients would pass :data:`LINEAR_PROBE_BYTES`."""
    import torch
    import torch.nn.functional as F

    itemsize = torch.empty((), dtype=dtype).element_size()
    layers = max(1, min(LINEAR_PROBE_LAYERS, LINEAR_PROBE_BYTES // (2 * itemsize * width * width)))
    weights = [(torch.randn(width, width, device=device, dtype=dtype) / math.sqrt(width)).requires_grad_()
               for _ in range(layers)]
    x = torch.randn(rows, width, device=device, dtype=dtype)

    def step() -> None:
        h = x
        for w in weights:
            h = F.linear(h, w)
        h.sum().backward()
        for w in weights:
            w.grad = None

    return step, 2.0 * rows * width * width * (3 * layers - 1)  # the input needs no gradient


def linear_flops(device: Any, dtype: Any, widths: Sequence[int], rows: int, *, repeats: int, window_s: float,
                 barrier: Callable[[], Any] | None = None) -> tuple[float, dict[str, float]]:
    """(median over widths of the median FLOP/s of :func:`linear_probe` at that width,
    {width: rate}). ``barrier`` runs before each width, so ranks sharing a machine measure
    the same workload at the same time."""
    per_width: dict[str, float] = {}
    for width in widths:
        step, work = linear_probe(device, dtype, width, rows)
        if barrier is not None:
            barrier()
        per_width[str(width)] = statistics.median(sample_rate(step, work, device, repeats=repeats, window_s=window_s))
        del step
    return statistics.median(per_width.values()), per_width


__all__ = ["FUSED_ATTENTION_CAPABILITY", "LINEAR_PROBE_BYTES", "LINEAR_PROBE_LAYERS", "cpu_model", "host_memory",
           "host_memory_size", "host_name", "linear_flops", "linear_probe", "runs_fused_attention", "sample_rate",
           "sync_device"]
