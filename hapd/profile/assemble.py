"""Measurements into a :class:`~hapd.profile.schema.Profile`, and a profile's summary for a
person. Imports no torch."""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from hapd import __version__
from hapd.profile.fit import Fit
from hapd.profile.options import ProfilerOptions
from hapd.profile.schema import UNITS, Device, Link, Profile
from hapd.util import format_bytes


def assemble(devices: Sequence[Mapping[str, Any]], fits: Mapping[str, Mapping[str, Fit]], options: ProfilerOptions,
             *, started: datetime.datetime, backend: str, world: int, no_intra: str | None,
             torch_version: str) -> Profile:
    """The profile of what the ranks measured: one device per rank (``devices``, each a
    :class:`~hapd.profiler.measure.DeviceMeasurement` as a dict), each collective's links
    from its fits (``inter`` repeats ``intra`` when nothing crossed a host), and the
    measurement's details in ``extra``."""
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
        "torch_version": torch_version,
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
                   elementwise_flops=float(d["elementwise_flops"]),
                   op_seconds=float(d["op_seconds"]) if d.get("op_seconds") is not None else None,
                   sync_overlap=float(d["sync_overlap"]) if d.get("sync_overlap") is not None else None,
                   dtype_flops=d.get("dtype_flops") or None,
                   fused_attention=bool(d["fused_attention"]) if d.get("fused_attention") is not None else None)
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
        ew += f", {d.op_seconds * 1e6:.1f} µs per op beyond its FLOPs" if d.op_seconds else ""
        ew += f", {d.sync_overlap:.0%} of a gradient sum hidden behind compute" if d.sync_overlap is not None else ""
        ew += ", hapd's fused attention kernel" if d.fused_attention else ""
        lines.append(f"  rank {d.rank} {d.host} {d.model}: {d.flops:.3g} FLOP/s matmul{ew}, "
                     f"{format_bytes(d.memory)}")
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
