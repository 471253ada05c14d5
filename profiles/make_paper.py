"""Writes the paper-cluster profiles from HAP's profiled numbers.

HAP's evaluation cluster: 2 machines of 8×V100 and 6 machines of 8×P100 on ~10 Gbit/s
Ethernet. Device FLOP/s are HAP's measured V100 = 3,858,755,112,937 and
P100 = 2,149,250,936,815; memory is the cards' (V100 32 GiB, P100 16 GiB), so the
small cards fill first. Inter-host bandwidths are HAP's measurements on that
heterogeneous cluster (bytes of the full tensor per second); intra-host bandwidths are
its measurements within one machine. HAP modelled no latency; the α values here
(30 µs across hosts, 10 µs within one) are hapd's estimates, stated as such.

Half precision: HAP measured fp32 only, and no measured fp16 rate of these cards under
one profiler is published; each device's ``dtype_flops`` is its fp32 rate times its
datasheet's fp16/fp32 peak ratio (V100 SXM2: 125 / 15.7 TF, tensor cores; P100 SXM2:
21.2 / 10.6 TF, no tensor cores; :data:`hapd.profile.precision.DATASHEET`), and no
bf16 or tf32 (neither card has them): 30.7 TF against 4.3 TF, 7.1 : 1 where fp32 is
1.8 : 1.

    python profiles/make_paper.py   # rewrites profiles/paper-{8,16,64}.json
"""

from __future__ import annotations

from pathlib import Path

from hapd.profile.precision import DATASHEET
from hapd.profile.schema import Device, Link, Profile

V100, P100 = 3_858_755_112_937.0, 2_149_250_936_815.0
MEMORY = {"V100": 32 * 2**30, "P100": 16 * 2**30}
"""Device memory: HAP's cluster had the 32 GB V100 and the 16 GB P100."""
FUSED_ATTENTION = {"V100": True, "P100": False}
"""Whether the card runs hapd's fused attention kernel: Triton compiles for compute
capability 7.0 (the V100) and up, not the P100's 6.0; a cluster with both is priced as
the math attention (:attr:`hapd.profile.schema.Device.fused_attention`)."""


def dtype_flops(model: str, fp32: float) -> dict[str, float | None]:
    """The card's matmul rates per dtype: fp32 as measured, fp16 by its datasheet's
    ratio, no tf32 or bf16."""
    sheet = DATASHEET[model]
    return {"fp32": fp32, "tf32": None, "bf16": None, "fp16": fp32 * sheet.fp16 / sheet.fp32}

INTER = {
    "all_gather": 815_418_707,
    "all_gather_grouped": 549_828_906,
    "all_reduce": 476_774_816,
    "reduce_scatter": 876_490_907,
    "reduce_scatter_grouped": 512_358_434,
    "all_to_all": 7_504_501_871,
    "broadcast": 549_828_906,
}
INTRA = {
    "all_gather": 9_463_184_466,
    "all_gather_grouped": 9_146_232_360,
    "all_reduce": 5_906_161_310,
    "reduce_scatter": 9_740_459_122,
    "reduce_scatter_grouped": 8_756_865_799,
    "all_to_all": 24_588_140_722,
    "broadcast": 9_146_232_360,
}


def paper_profile(world: int) -> Profile:
    """`world` devices of the paper cluster: a quarter V100, the rest P100, spread over
    8 hosts (world / 8 devices per host)."""
    per_host = max(1, world // 8)
    devices = []
    for rank in range(world):
        host = rank // per_host
        model = "V100" if host < 2 else "P100"
        devices.append(
            Device(rank=rank, host=f"{model.lower()}-{host}", model=model,
                   flops=V100 if model == "V100" else P100, memory=MEMORY[model],
                   dtype_flops=dtype_flops(model, V100 if model == "V100" else P100),
                   fused_attention=FUSED_ATTENTION[model])
        )
    collectives = {
        name: {"inter": Link(alpha=30e-6, beta=float(INTER[name])), "intra": Link(alpha=10e-6, beta=float(INTRA[name]))}
        for name in INTER
    }
    return Profile(
        name=f"paper-{world}",
        description=f"HAP's V100/P100 cluster, {world} devices on 8 hosts ({per_host} per host); "
        "FLOP/s and bandwidths from HAP's profiler, α estimated by hapd; fp16 FLOP/s = HAP's fp32 × the "
        "datasheet's fp16/fp32 peak ratio (V100 7.96, P100 2.0), no bf16",
        devices=tuple(devices),
        collectives=collectives,
        extra={"units": {"time": "s", "size": "bytes", "bandwidth": "bytes/s", "speed": "FLOP/s"}},
    )


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    for world in (8, 16, 64):
        print(paper_profile(world).save(here / f"paper-{world}.json"))
