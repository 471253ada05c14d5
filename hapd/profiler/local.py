"""The profile of a job that was given none: its devices as they are.

:func:`hapd.parallelize` without a profile plans for what :func:`device_profile`
describes, never for invented devices:

- **memory**: on CUDA the device's free memory (what other processes hold is not the
  rank's), on CPU the smallest cgroup memory limit above the process capped by
  ``MemTotal`` (:func:`hapd.profiler.machine.host_memory_size`: not the moment's
  ``MemAvailable``, which moves with every other process); shared evenly by the job's
  ranks on that device (or host, on CPU), so a plan recomputes only when memory binds
  on the real device. Rounded down to a sixteenth of its power of two
  (:func:`coarse_memory`): free GPU memory moves by megabytes between two calls, and a
  profile that moved with it would miss the plan cache every time.
- **speed**: on CUDA the linear probe of the profiler (one width, a short window: a
  fraction of a second), remembered per device model in ``$HAPD_HOME/devices.json`` so
  that a later job reads it instead (``hapd profile`` measures the whole cluster, and a
  measured profile given to ``parallelize`` is always preferred). On CPU
  :data:`CPU_FLOPS`, a core's order, said in the profile's description: ranks on one
  machine's cores are alike, so their plan does not depend on it, and a probe would
  cost every small job a second.
- **fused attention**: whether the device runs hapd's fused attention kernel
  (:func:`hapd.profiler.machine.runs_fused_attention`: CUDA of compute capability ≥ 7.0
  with Triton; never a CPU), so that an attention with dropout is priced as what runs.
- **collectives**: the estimated α and β of :func:`hapd.profile.schema.estimated_profile`.

Every rank describes its own device and the descriptions are all-gathered, so each rank
(and rank 0, which compiles) sees one profile. Ranks of one host with the same device
model take the speed of the lowest of them: equal devices get equal shares.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from hapd.errors import ProfileError
from hapd.profiler.machine import cpu_model, host_memory_size, host_name, linear_flops, runs_fused_attention
from hapd.profile.schema import Profile, estimated_profile
from hapd.util import atomic_write, home_dir

_log = logging.getLogger(__name__)

CPU_FLOPS = 1e10
"""FLOP/s a CPU rank is planned with when no profile is given (a core's order)."""
CUDA_PROBE_WIDTH = 4096
"""Width of the probe's linear layers on CUDA (the profiler's middle width)."""
CUDA_PROBE_ROWS = 2048
"""Rows of the probe's input on CUDA (the profiler's)."""
CUDA_PROBE_WINDOW_S = 0.05
"""Seconds of each of the probe's samples on CUDA."""
SPEEDS_FILE = "devices.json"
"""The file under ``$HAPD_HOME`` remembering each CUDA device model's probed FLOP/s."""


@dataclass(frozen=True)
class LocalDevice:
    """One rank's description of its device."""

    host: str
    """The rank's machine."""
    slot: str
    """What ranks of one host share when it is the same: ``cuda:INDEX`` or ``cpu``."""
    model: str
    """The device model (the GPU's name, the CPU's model name)."""
    memory: float
    """Bytes the device can still give (before sharing among the host's ranks on it)."""
    flops: float
    """FLOP/s the device is planned with."""
    measured: bool
    """Whether ``flops`` was measured (the probe, or its remembered value)."""
    fused_attention: bool = False
    """Whether the device runs hapd's fused attention kernel (:func:`runs_fused_attention`)."""


def coarse_memory(nbytes: float) -> float:
    """``nbytes`` rounded down to a multiple of a sixteenth of the largest power of two
    not above it (20.3 GiB → 20 GiB; an 80 GB card's 79.1 GB free, 73.7 GiB → 72 GiB)."""
    if nbytes < 16:
        return max(float(nbytes), 0.0)
    step = 2 ** (math.floor(math.log2(nbytes)) - 4)
    return float(math.floor(nbytes / step) * step)


def _remembered_speeds() -> dict[str, float]:
    path = home_dir() / SPEEDS_FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float)) and v > 0} \
        if isinstance(data, Mapping) else {}


def _remember_speed(model: str, flops: float) -> None:
    speeds = {**_remembered_speeds(), model: flops}
    try:
        home_dir().mkdir(parents=True, exist_ok=True)
        atomic_write(home_dir() / SPEEDS_FILE, json.dumps(speeds, indent=1, sort_keys=True))
    except OSError as exc:  # a read-only home: probe again next time
        _log.warning("could not remember the speed of %s in %s: %s", model, home_dir(), exc)


def cuda_speed(device: Any, model: str) -> float:
    """FLOP/s of CUDA ``device`` (of ``model``): remembered, else probed and remembered."""
    import torch

    known = _remembered_speeds().get(model)
    if known is not None:
        return known
    flops, _ = linear_flops(device, torch.float32, (CUDA_PROBE_WIDTH,), CUDA_PROBE_ROWS, repeats=3,
                            window_s=CUDA_PROBE_WINDOW_S)
    _remember_speed(model, flops)
    return flops


def describe_device(device: Any) -> LocalDevice:
    """This rank's :class:`LocalDevice` for ``device`` (a ``torch.device``)."""
    import torch

    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        model = torch.cuda.get_device_properties(index).name
        free = float(torch.cuda.mem_get_info(index)[0])
        cuda = torch.device("cuda", index)
        return LocalDevice(host_name(), f"cuda:{index}", model, free, cuda_speed(cuda, model), True,
                           runs_fused_attention(cuda))
    return LocalDevice(host_name(), "cpu", cpu_model(), float(host_memory_size()), CPU_FLOPS, False, False)


def profile_of(devices: list[LocalDevice]) -> Profile:
    """The job's profile from every rank's description (rank order)."""
    if not devices:
        raise ProfileError("no devices to describe", field="devices")
    sharing: dict[tuple[str, str], int] = {}
    first: dict[tuple[str, str], float] = {}
    for d in devices:
        sharing[(d.host, d.slot)] = sharing.get((d.host, d.slot), 0) + 1
        first.setdefault((d.host, d.model), d.flops)
    memory = [coarse_memory(d.memory / sharing[(d.host, d.slot)]) for d in devices]
    flops = [first[(d.host, d.model)] for d in devices]
    speed = "measured" if all(d.measured for d in devices) else f"estimated ({CPU_FLOPS:g} FLOP/s a CPU rank)"
    models = sorted({d.model for d in devices})
    description = (f"this job's devices, described by its ranks: {len(devices)} × {', '.join(models)}; memory from "
                   f"the devices, speed {speed}, collectives estimated")
    return estimated_profile(len(devices), flops=flops, hosts=[d.host for d in devices], memory=memory,
                             models=[d.model for d in devices], name=f"local-{len(devices)}", description=description,
                             fused_attention=[d.fused_attention for d in devices])


def device_profile(device: Any, *, world: int = 1, group: Any = None) -> Profile:
    """The profile of a job of ``world`` ranks, each describing its own ``device``
    (collective over ``group`` when ``world > 1``)."""
    mine = describe_device(device)
    if world == 1:
        return profile_of([mine])
    import torch.distributed as dist

    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, asdict(mine), group=group)
    return profile_of([LocalDevice(**d) for d in gathered])


__all__ = ["CPU_FLOPS", "LocalDevice", "coarse_memory", "cuda_speed", "describe_device", "device_profile", "profile_of"]
