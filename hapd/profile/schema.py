"""Cluster profiles: devices and collective costs (DESIGN.md §3).

A profile is a JSON file (``profiles/*.json``)::

    {"format": "hapd.profile", "version": 1, "name": "...", "description": "...",
     "devices": [{"rank": 0, "host": "v1", "model": "V100", "flops": 3.86e12,
                  "memory": 17179869184}, ...],
     "collectives": {"all_gather": {"inter": {"alpha": 3e-5, "beta": 8.2e8},
                                    "intra": {...}}, ...}}

Units: seconds, bytes, bytes/s (bandwidth counts bytes of the full tensor per second),
FLOP/s; an optional ``units`` map may declare them, and any other unit it declares is an
error (:data:`UNITS`). Every number must be finite and within the documented range of
its quantity (:data:`RANGES`: FLOP/s 1e6 to 1e24, memory 1 B to 2⁶⁰ B, latency 0 to
1 h, bandwidth 1 B/s to 1e24 B/s), so that no cost the compiler derives from a
profile is infinite or zero. ``flops`` is the achieved rate on matmul-heavy work;
``elementwise_flops`` (optional) the rate on element-wise work; ``op_seconds`` (optional)
what one training op costs beyond its FLOPs (dispatch, launch, autograd, run node by
node: what a pipeline's many small micro-batches pay once per op each);
``sync_overlap`` (optional, 0 to 1) the share of a gradient all-reduce's time that hides
behind the backward pass's compute on the device; ``fused_attention`` (optional, a bool)
whether the device runs hapd's fused attention kernel for an attention with dropout.
``intra`` (optional) is the cost within one host; ``inter`` across hosts. The **profile id** is the sha256 of
the canonical form of the devices and collectives: names, descriptions, extra fields,
key order and formatting do not change it. ``hapd profile`` (:mod:`hapd.profiler.driver`)
measures one.
"""

from __future__ import annotations

import hashlib
import json
import math
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import msgpack

from hapd.errors import ProfileError
from hapd.util import atomic_write

PROFILE_FORMAT = "hapd.profile"
PROFILE_VERSION = 1

COLLECTIVES = (
    "all_gather",
    "all_gather_grouped",
    "reduce_scatter",
    "reduce_scatter_grouped",
    "all_reduce",
    "all_to_all",
    "broadcast",
)
"""Every collective the cost model prices; a profile must give each one."""

OPTIONAL_COLLECTIVES = ("grad_sync", "p2p")
"""Collectives a profile may give: ``grad_sync`` is the all-reduce of replicated
parameters' gradient buckets as the runtime runs it on several hosts with several
ranks each (within each host, then between hosts; ``hapd.spmd.collectives.HostGroups``).
The cost model uses ``all_reduce`` where it is absent. ``p2p`` is messages from one
rank to another (``send``/``recv``), between hosts (``inter``) and within one
(``intra``): what moves activations between pipeline stages. Its bytes are what crosses
one pair of hosts at once: the message's times the rank pairs sending between those two
hosts together (their link's total; a pipeline boundary spread over both hosts' ranks
moves the same way)."""


@dataclass(frozen=True, kw_only=True)
class Link:
    """α-β cost of one collective on one kind of link."""

    alpha: float
    """Latency in seconds (≥ 0)."""
    beta: float
    """Bandwidth in bytes of the full tensor per second (> 0)."""


@dataclass(frozen=True, kw_only=True)
class Device:
    """One device (one rank)."""

    rank: int
    """Global rank, equal to the device's position in the list."""
    host: str
    """Machine the device is in; collectives across hosts use ``inter`` links."""
    model: str
    """Device model, for people (``V100``, ``cpu``)."""
    flops: float
    """Achieved FLOP/s on matmul-heavy work."""
    memory: float
    """Memory in bytes."""
    elementwise_flops: float | None = None
    """Achieved FLOP/s on element-wise work (default: ``flops``)."""
    op_seconds: float | None = None
    """Seconds a training op costs beyond its FLOPs, a third of its forward and backward
    (default: none): a pipeline stage runs every op node by node once per micro-batch
    (:mod:`hapd.compiler.pipeline.stage_cost` charges it once forward and twice backward)."""
    sync_overlap: float | None = None
    """Share (0 to 1) of a gradient all-reduce's time that hides behind the backward
    pass's compute on this device (default: none, not measured). The runtime launches
    each gradient bucket's all-reduce during the backward pass; its threads or kernels
    share the device with that compute, so the overlap is seldom whole."""
    dtype_flops: Mapping[str, float | None] | None = None
    """Achieved matmul FLOP/s per dtype (``fp32``, ``tf32``, ``bf16``, ``fp16``; null: the
    device has no such arithmetic, a V100's bf16), as measured (default: none stated;
    :mod:`hapd.profile.precision` estimates a half-precision rate from the device's
    datasheet and says so). ``flops`` is the fp32 rate."""
    fused_attention: bool | None = None
    """Whether the device runs an attention with dropout as hapd's fused kernel
    (:mod:`hapd.spmd.random.attention_kernels`: CUDA with Triton, compute capability
    ≥ 7.0, Triton's minimum), which keeps nothing of size queries × keys and draws the
    mask again in the backward pass (default: none, false: the math attention, its
    probabilities kept). The cost model prices the fused kernel only when every device
    of the profile runs it: a plan's step lasts as long as its slowest rank's."""


@dataclass(frozen=True, kw_only=True)
class Profile:
    """A validated cluster profile."""

    name: str
    """Short name (``paper-8``)."""
    devices: tuple[Device, ...]
    """Devices in rank order."""
    collectives: Mapping[str, Mapping[str, Link]]
    """Collective name → {"inter": Link, "intra": Link (optional)}."""
    description: str = ""
    """Where the numbers come from."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Informational fields kept as written (measured when, on what)."""

    @property
    def world(self) -> int:
        return len(self.devices)

    @property
    def hosts(self) -> list[str]:
        """Hosts in order of first appearance."""
        return list(dict.fromkeys(d.host for d in self.devices))

    def canonical(self) -> dict[str, Any]:
        """The fields that define the cluster, in a canonical form."""
        devices = [
            {
                "rank": d.rank,
                "host": d.host,
                "model": d.model,
                "flops": float(d.flops),
                "memory": float(d.memory),
                **({"elementwise_flops": float(d.elementwise_flops)} if d.elementwise_flops is not None else {}),
                **({"op_seconds": float(d.op_seconds)} if d.op_seconds is not None else {}),
                **({"sync_overlap": float(d.sync_overlap)} if d.sync_overlap is not None else {}),
                **({"dtype_flops": {k: (None if v is None else float(v)) for k, v in sorted(d.dtype_flops.items())}}
                   if d.dtype_flops else {}),
                **({"fused_attention": bool(d.fused_attention)} if d.fused_attention is not None else {}),
            }
            for d in self.devices
        ]
        collectives = {
            name: {kind: {"alpha": float(link.alpha), "beta": float(link.beta)} for kind, link in sorted(links.items())}
            for name, links in sorted(self.collectives.items())
        }
        return {"devices": devices, "collectives": collectives}

    @property
    def profile_id(self) -> str:
        text = json.dumps(self.canonical(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    def core_bytes(self) -> bytes:
        """The msgpack map the Rust core reads (each device's ``flops`` is the rate it
        prices matmul work at: :func:`hapd.profile.precision.for_precision` sets it for
        a job in half precision; the per-dtype rates stay in Python)."""
        canonical = self.canonical()
        for device in canonical["devices"]:
            device.pop("dtype_flops", None)
        return msgpack.packb({"name": self.name, **canonical}, use_bin_type=True)

    def flops_ratios(self) -> list[float]:
        """Sharding ratios proportional to each device's FLOP/s (DP-CP)."""
        total = sum(d.flops for d in self.devices)
        return [d.flops / total for d in self.devices]

    def ranks_of(self, host: str) -> list[int]:
        """Ranks of the devices on ``host``, in rank order."""
        return [d.rank for d in self.devices if d.host == host]

    def subset(self, ranks: Sequence[int], *, name: str | None = None, hosts: Mapping[str, str] | None = None) -> "Profile":
        """The profile of the devices ``ranks`` alone (a pipeline stage's group),
        renumbered 0… in the order given, with the same collectives; ``hosts`` renames
        hosts (the cost model only asks whether two devices share one). A compile for it
        plans those devices as a cluster of their own. On one host, ``grad_sync`` (the
        runtime's sum across hosts) is left out unless it has an ``intra`` link: one
        host's ranks sum gradients with a plain all-reduce."""
        ranks = list(ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < self.world for r in ranks):
            raise ProfileError(f"ranks {ranks} are not distinct ranks of the profile's {self.world} devices", field="devices")
        rename = hosts or {}
        devices = tuple(
            dataclasses.replace(self.devices[r], rank=i, host=rename.get(self.devices[r].host, self.devices[r].host))
            for i, r in enumerate(ranks)
        )
        collectives = dict(self.collectives)
        if len({d.host for d in devices}) == 1 and "intra" not in collectives.get("grad_sync", {"intra": None}):
            del collectives["grad_sync"]
        return Profile(name=name or f"{self.name}[{','.join(map(str, ranks))}]", devices=devices,
                       collectives=collectives, description=f"ranks {ranks} of {self.name}")

    def on_hosts(self, hosts: Sequence[str]) -> "Profile":
        """The profile of the devices on ``hosts`` alone, in that host order (a job running
        on part of the cluster the profile measured: an elastic job after a host left).
        An entry ``HOST#N`` takes the first ``N`` of that host's devices (an elastic job
        whose rank on it was killed goes on there with fewer ranks, numbered from 0).
        :class:`ProfileError` naming a host the profile does not have, or a count it
        does not hold."""
        cuts = [host_cut(h) for h in hosts]
        names = [name for name, _ in cuts]
        missing = [h for h in names if not self.ranks_of(h)]
        if missing or len(set(names)) != len(names):
            known = ", ".join(self.hosts)
            raise ProfileError(f"hosts {', '.join(missing) or ', '.join(names)} are not distinct hosts of profile "
                               f"{self.name} (its hosts: {known})", field="devices")
        short = [f"{name}#{count}" for name, count in cuts if count is not None and count > len(self.ranks_of(name))]
        if short:
            raise ProfileError(f"{', '.join(short)}: more devices than profile {self.name} has on that host",
                               field="devices")
        if list(hosts) == self.hosts:
            return self
        ranks = [r for name, count in cuts for r in self.ranks_of(name)[:count]]
        return self.subset(ranks, name=f"{self.name}@{'+'.join(hosts)}")

    def to_json(self) -> str:
        doc = {
            "format": PROFILE_FORMAT,
            "version": PROFILE_VERSION,
            "name": self.name,
            "description": self.description,
            **dict(self.extra),
            **self.canonical(),
        }
        return json.dumps(doc, indent=1, sort_keys=False) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write the profile JSON atomically and return the path."""
        return atomic_write(path, self.to_json())


def host_cut(entry: str) -> tuple[str, int | None]:
    """``HOST`` → (HOST, None: all its devices); ``HOST#N`` → (HOST, N) for N ≥ 1
    (:meth:`Profile.on_hosts`); :class:`ProfileError` for a bad count."""
    name, mark, count = entry.rpartition("#")
    if not mark:
        return entry, None
    if not name or not count.isdigit() or int(count) < 1:
        raise ProfileError(f"host entry {entry!r}: expected HOST or HOST#N with N ≥ 1 devices", field="devices")
    return name, int(count)


def estimated_profile(
    world: int,
    *,
    flops: Sequence[float] | None = None,
    hosts: Sequence[str] | None = None,
    alpha: float = 100e-6,
    beta: float | Mapping[str, float] = 1e9,
    memory: float | Sequence[float] = 8 * 2**30,
    models: Sequence[str] | None = None,
    name: str = "estimated",
    description: str | None = None,
    fused_attention: bool | Sequence[bool] | None = None,
) -> Profile:
    """A profile from stated guesses, for when no measured one is given (worker.py on a
    laptop, tests): ``world`` devices with ``flops`` each (default 1e10, a CPU core's
    order), ``memory`` bytes each (one value, or one per device), one α and β for every
    collective (``beta`` may map collective names to their own bandwidth), all on one
    host unless ``hosts`` says otherwise; ``fused_attention`` (one value, or one per
    device) says whether each runs hapd's fused attention kernel (:attr:`Device.fused_attention`;
    default: not stated). Its description (default) says it is an estimate; ``hapd
    profile`` measures a real one."""
    if world < 1:
        raise ProfileError(f"world {world} must be ≥ 1", field="devices")
    flops = list(flops) if flops is not None else [1e10] * world
    hosts = list(hosts) if hosts is not None else ["localhost"] * world
    if len(flops) != world or len(hosts) != world:
        raise ProfileError(f"{len(flops)} flops and {len(hosts)} hosts for {world} devices", field="devices")
    memories = [float(m) for m in memory] if isinstance(memory, Sequence) else [float(memory)] * world
    models = list(models) if models is not None else ["estimated"] * world
    if len(memories) != world or len(models) != world:
        raise ProfileError(f"{len(memories)} memories and {len(models)} models for {world} devices", field="devices")
    fused = list(fused_attention) if isinstance(fused_attention, Sequence) else [fused_attention] * world
    if len(fused) != world:
        raise ProfileError(f"{len(fused)} fused_attention flags for {world} devices", field="devices")
    for r, (f, m) in enumerate(zip(flops, memories)):
        check_range("flops", float(f), f"devices[{r}]")
        check_range("memory", m, f"devices[{r}]")
    check_range("alpha", float(alpha), "collectives")
    for c in COLLECTIVES:
        check_range("beta", float(beta[c] if isinstance(beta, Mapping) else beta), f"collectives.{c}")
    devices = tuple(
        Device(rank=r, host=hosts[r], model=models[r], flops=float(flops[r]), memory=memories[r],
               fused_attention=None if fused[r] is None else bool(fused[r]))
        for r in range(world)
    )
    betas = {c: float(beta[c] if isinstance(beta, Mapping) else beta) for c in COLLECTIVES}
    collectives = {c: {"inter": Link(alpha=alpha, beta=betas[c])} for c in COLLECTIVES}
    description = description or f"estimated, not measured: {world} devices, α {alpha:g} s"
    return Profile(name=name, devices=devices, collectives=collectives, description=description)


UNITS = {"time": "s", "size": "bytes", "bandwidth": "bytes/s", "speed": "FLOP/s"}
"""The only units a profile may declare in its optional ``units`` map."""


def _check_units(units: Any) -> None:
    """A ``units`` map, when a profile has one, must declare hapd's units (any subset)."""
    if not isinstance(units, Mapping):
        raise ProfileError(f"units: expected an object like {UNITS}, got {units!r}", field="units")
    for key, value in units.items():
        if key not in UNITS:
            raise ProfileError(f"units.{key}: unknown quantity; known: {', '.join(UNITS)}", field=f"units.{key}")
        if value != UNITS[key]:
            raise ProfileError(f"units.{key}: {value!r}, but hapd profiles measure {key} in {UNITS[key]!r}",
                               field=f"units.{key}")


RANGES: dict[str, tuple[float, float, str]] = {
    "flops": (1e6, 1e24, "FLOP/s"),
    "elementwise_flops": (1e6, 1e24, "FLOP/s"),
    "op_seconds": (0.0, 1.0, "s"),
    "sync_overlap": (0.0, 1.0, ""),
    "memory": (1.0, float(2**60), "bytes"),
    "alpha": (0.0, 3600.0, "s"),
    "beta": (1.0, 1e24, "bytes/s"),
}
"""Each profile number's allowed range (inclusive) and unit: a megaFLOP/s to a
yottaFLOP/s, a byte to an exbibyte, no latency to an hour, a byte per second to 1e24
(the profiler records 1e18 for a link nothing crosses). Outside them a cost the compiler
derives could overflow to infinity or vanish. ``sync_overlap`` is a share: no unit."""


def check_range(key: str, value: float, where: str) -> float:
    """``value`` when it lies in :data:`RANGES` for ``key``; :class:`ProfileError` naming
    ``where.key`` otherwise."""
    low, high, unit = RANGES[key]
    if not (math.isfinite(value) and low <= value <= high):
        unit = f" {unit}" if unit else ""
        raise ProfileError(f"{where}.{key}: {value:g}{unit} is outside {low:g}..{high:g}{unit}", field=f"{where}.{key}")
    return value


def _number(doc: Mapping[str, Any], key: str, where: str) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProfileError(f"{where}.{key}: expected a number, got {value!r}", field=f"{where}.{key}")
    try:
        value = float(value)
    except OverflowError:  # an integer too large for a float
        raise ProfileError(f"{where}.{key}: an integer of {len(str(value))} digits is too large", field=f"{where}.{key}") from None
    return check_range(key, value, where)


DOCUMENT_KEYS = ("format", "version", "name", "description", "units", "devices", "collectives")
"""The keys of a profile document hapd reads."""
MEASURED_KEYS = ("measured_at", "tool", "tool_version", "torch_version", "backend", "options", "fits", "device_detail")
"""The keys ``hapd profile`` adds about its measurement (kept, not read)."""
DEVICE_KEYS = ("rank", "host", "model", "flops", "memory", "elementwise_flops", "op_seconds", "sync_overlap", "dtype_flops",
               "fused_attention")
"""The keys of a device."""
COLLECTIVE_KEYS = ("inter", "intra")
LINK_KEYS = ("alpha", "beta")


def _known_keys(doc: Mapping[str, Any], known: Sequence[str], where: str) -> None:
    """A key not in ``known`` (a misspelling such as ``"flopss"``) is a
    :class:`ProfileError` naming it and the known keys; keys starting with ``_`` are
    comments."""
    unknown = [k for k in doc if k not in known and not (isinstance(k, str) and k.startswith("_"))]
    if unknown:
        at = f"{where}." if where else ""
        raise ProfileError(f"{at}{unknown[0]}: unknown key; known: {', '.join(known)} (keys starting with _ are comments)",
                           field=f"{at}{unknown[0]}")


def profile_from_dict(doc: Any, *, world_size: int | None = None) -> Profile:
    """Validate a decoded profile document; errors name the offending field. Unknown
    keys are refused, naming the known ones (a misspelled key would silently be the
    default otherwise)."""
    _check_document(doc)
    raw_devices = doc.get("devices")
    if not isinstance(raw_devices, list) or not raw_devices:
        raise ProfileError("devices: expected a non-empty list", field="devices")
    devices = [_device_from_dict(d, i) for i, d in enumerate(raw_devices)]
    if world_size is not None and world_size != len(devices):
        raise ProfileError(f"devices: the profile has {len(devices)} devices but the job has {world_size} ranks", field="devices")
    collectives = _collectives_from_dict(doc.get("collectives"))
    known = {"format", "version", "name", "description", "devices", "collectives"}
    return Profile(
        name=str(doc.get("name", "")),
        description=str(doc.get("description", "")),
        devices=tuple(devices),
        collectives=collectives,
        extra={k: v for k, v in doc.items() if k not in known},
    )


def _check_document(doc: Any) -> None:
    """A profile document's format, version, top-level keys and units, or :class:`ProfileError`."""
    if not isinstance(doc, Mapping):
        raise ProfileError("a profile is a JSON object", field="<document>")
    if doc.get("format") != PROFILE_FORMAT:
        raise ProfileError(f"format {doc.get('format')!r} is not {PROFILE_FORMAT!r}", field="format")
    if doc.get("version") != PROFILE_VERSION:
        raise ProfileError(f"version {doc.get('version')!r} is not {PROFILE_VERSION}", field="version")
    _known_keys(doc, (*DOCUMENT_KEYS, *MEASURED_KEYS), "")
    if "units" in doc:
        _check_units(doc["units"])


def _device_from_dict(d: Any, i: int) -> Device:
    """The device of rank ``i`` from its entry ``devices[i]``."""
    where = f"devices[{i}]"
    if not isinstance(d, Mapping):
        raise ProfileError(f"{where}: expected an object", field=where)
    _known_keys(d, DEVICE_KEYS, where)
    if d.get("rank") != i:
        raise ProfileError(f"{where}.rank: {d.get('rank')!r} but devices are listed in rank order", field=f"{where}.rank")
    host = d.get("host")
    if not isinstance(host, str) or not host:
        raise ProfileError(f"{where}.host: expected a host name", field=f"{where}.host")
    ew = d.get("elementwise_flops")
    op = d.get("op_seconds")
    overlap = d.get("sync_overlap")
    return Device(
        dtype_flops=_dtype_flops(d.get("dtype_flops"), where),
        rank=i,
        host=host,
        model=str(d.get("model", "")),
        flops=_number(d, "flops", where),
        memory=_number(d, "memory", where),
        elementwise_flops=None if ew is None else _number(d, "elementwise_flops", where),
        op_seconds=None if op is None else _number(d, "op_seconds", where),
        sync_overlap=None if overlap is None else _number(d, "sync_overlap", where),
        fused_attention=_flag(d, "fused_attention", where),
    )


def _flag(doc: Mapping[str, Any], key: str, where: str) -> bool | None:
    """An optional boolean field (``true``, ``false`` or absent/null): a string such as
    ``"yes"`` or a number is a :class:`ProfileError` naming it, not read as true."""
    value = doc.get(key)
    if value is not None and not isinstance(value, bool):
        raise ProfileError(f"{where}.{key}: expected true or false, got {value!r}", field=f"{where}.{key}")
    return value


DTYPE_KEYS = ("fp32", "tf32", "bf16", "fp16")
"""The dtypes a device's ``dtype_flops`` may state."""


def _dtype_flops(raw: Any, where: str) -> dict[str, float | None] | None:
    """A device's ``dtype_flops``: dtype → FLOP/s in :data:`RANGES` or null (none)."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where}.dtype_flops: expected an object like {{\"fp16\": 1.2e14, \"bf16\": null}}",
                           field=f"{where}.dtype_flops")
    _known_keys(raw, DTYPE_KEYS, f"{where}.dtype_flops")
    out: dict[str, float | None] = {}
    for dtype, value in raw.items():
        if value is None:
            out[dtype] = None
            continue
        at = f"{where}.dtype_flops.{dtype}"
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProfileError(f"{at}: expected a number of FLOP/s or null, got {value!r}", field=at)
        low, high, unit = RANGES["flops"]
        if not (math.isfinite(float(value)) and low <= float(value) <= high):
            raise ProfileError(f"{at}: {float(value):g} {unit} is outside {low:g}..{high:g} {unit}", field=at)
        out[dtype] = float(value)
    return out


def _collectives_from_dict(raw: Any) -> dict[str, dict[str, Link]]:
    """The ``collectives`` object: each required collective, and each optional one given → its links."""
    if not isinstance(raw, Mapping):
        raise ProfileError("collectives: expected an object", field="collectives")
    unknown = sorted(set(raw) - set(COLLECTIVES) - set(OPTIONAL_COLLECTIVES))
    if unknown:
        known = ", ".join((*COLLECTIVES, *OPTIONAL_COLLECTIVES))
        raise ProfileError(f"collectives: unknown collective {unknown[0]!r}; known: {known}",
                           field=f"collectives.{unknown[0]}")
    collectives: dict[str, dict[str, Link]] = {}
    for name in (*COLLECTIVES, *(c for c in OPTIONAL_COLLECTIVES if c in raw)):
        entry = raw.get(name)
        if not isinstance(entry, Mapping) or "inter" not in entry:
            raise ProfileError(f"collectives.{name}: missing (needs at least an 'inter' link)", field=f"collectives.{name}")
        _known_keys(entry, COLLECTIVE_KEYS, f"collectives.{name}")
        collectives[name] = {kind: _link_from_dict(entry[kind], f"collectives.{name}.{kind}")
                             for kind in ("inter", "intra") if kind in entry}
    return collectives


def _link_from_dict(raw: Any, where: str) -> Link:
    """One link's ``{alpha, beta}`` at ``where``."""
    if not isinstance(raw, Mapping):
        raise ProfileError(f"{where}: expected {{alpha, beta}}", field=where)
    _known_keys(raw, LINK_KEYS, where)
    return Link(
        alpha=_number(raw, "alpha", where),
        beta=_number(raw, "beta", where),
    )


BUNDLED = Path(__file__).resolve().parents[2] / "profiles"
"""The profiles that ship with hapd, loaded by name (``paper-8``)."""


def _bundled_hint(path: Path) -> str:
    """``; did you mean paper-8 (a bundled profile, by name)?`` for a path whose stem names a
    bundled profile, else the bundled names."""
    names = sorted(p.stem for p in BUNDLED.glob("*.json"))
    stem = path.stem if path.suffix == ".json" else path.name
    if stem in names:
        return f"; did you mean {stem}? (a bundled profile: give its name, not a path)"
    return f"; bundled profiles, by name: {', '.join(names)}" if names else ""


def load_profile(source: str | Path | Mapping[str, Any] | Profile, *, world_size: int | None = None) -> Profile:
    """A profile from a path, a decoded document or a Profile; validated."""
    if isinstance(source, Profile):
        if world_size is not None and world_size != source.world:
            raise ProfileError(f"the profile has {source.world} devices but the job has {world_size} ranks", field="devices")
        return source
    if isinstance(source, Mapping):
        return profile_from_dict(source, world_size=world_size)
    path = Path(source)
    if not path.is_file():
        bundled = BUNDLED / f"{path.name}.json"
        if path.suffix == "" and bundled.is_file():
            path = bundled
        else:
            raise ProfileError(f"{source}: no such profile file{_bundled_hint(path)}", field="<file>")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ProfileError(f"{path}: not a JSON profile ({exc})", field="<document>") from exc
    return profile_from_dict(doc, world_size=world_size)
