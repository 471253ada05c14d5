"""The precision a job trains in, as the profile prices it: each device's achieved
matmul FLOP/s per dtype, and which precision ``"auto"`` picks. Never imports torch.

A profile states what it measured (``dtype_flops`` of a device: ``fp32``, ``tf32``,
``bf16``, ``fp16``; null where the device has no such arithmetic, a V100's bf16). A
device that states nothing is estimated from its model's datasheet: the peak dense
rate of the dtype over the peak fp32 rate, times the measured ``flops`` (fp32); a model
hapd does not know gets no gain from half precision (its fp32 rate), and every
estimate says so (:func:`device_speed`'s source). Only matmul-class work (linear,
matmul, convolution, attention: what autocast runs in half precision) takes the
dtype's rate; element-wise work keeps the device's ``elementwise_flops``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

from hapd.errors import OptionsError

PRECISIONS = ("fp32", "bf16", "fp16", "auto")
"""What a job's ``precision`` may be: autocast to bf16 or fp16 (fp32 master weights,
fp32 gradient reduction by default), plain fp32, or ``auto``."""
DTYPES = ("fp32", "tf32", "bf16", "fp16")
"""The dtypes a profile may state a matmul rate for."""
REDUCE_DTYPES = ("fp32", "bf16", "fp16")
"""What gradients may be summed over ranks in (``reduce_dtype``)."""
TORCH_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""Each precision's autocast dtype, by its torch name."""
BYTES = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of each dtype."""


@dataclass(frozen=True)
class Datasheet:
    """Peak dense FLOP/s of one device model per dtype (None: no such arithmetic), and
    where the numbers come from."""

    fp32: float
    tf32: float | None
    bf16: float | None
    fp16: float | None
    source: str


DATASHEET: Mapping[str, Datasheet] = {
    # NVIDIA's datasheets (SXM parts, dense tensor-core rates, no sparsity)
    "V100": Datasheet(15.7e12, None, None, 125e12, "NVIDIA V100 datasheet (SXM2): 15.7 TF fp32, 125 TF fp16 tensor cores"),
    "P100": Datasheet(10.6e12, None, None, 21.2e12, "NVIDIA P100 datasheet (SXM2): 10.6 TF fp32, 21.2 TF fp16, no tensor cores"),
    "T4": Datasheet(8.1e12, None, None, 65e12, "NVIDIA T4 datasheet: 8.1 TF fp32, 65 TF fp16 tensor cores"),
    "A100": Datasheet(19.5e12, 156e12, 312e12, 312e12, "NVIDIA A100 datasheet: 19.5 TF fp32, 156 TF tf32, 312 TF bf16/fp16"),
    "A10": Datasheet(31.2e12, 62.5e12, 125e12, 125e12, "NVIDIA A10 datasheet: 31.2 TF fp32, 62.5 TF tf32, 125 TF bf16/fp16"),
    "L4": Datasheet(30.3e12, 60e12, 121e12, 121e12, "NVIDIA L4 datasheet: 30.3 TF fp32, 60 TF tf32, 121 TF bf16/fp16"),
    "H100": Datasheet(67e12, 495e12, 990e12, 990e12, "NVIDIA H100 SXM datasheet: 67 TF fp32, 495 TF tf32, 990 TF bf16/fp16"),
    "H200": Datasheet(67e12, 495e12, 990e12, 990e12, "NVIDIA H200 SXM datasheet: 67 TF fp32, 495 TF tf32, 990 TF bf16/fp16"),
}
"""Device models hapd knows the half-precision rates of, matched by name
(:func:`datasheet_of`: ``"Tesla V100-SXM2-32GB"`` is a V100)."""


def datasheet_of(model: str) -> Datasheet | None:
    """The datasheet of a device model by name (the longest known name it contains)."""
    upper = model.upper()
    found = [name for name in DATASHEET if name in upper]
    return DATASHEET[max(found, key=len)] if found else None


def device_speed(device: object, dtype: str) -> tuple[float | None, str]:
    """(matmul FLOP/s of ``device`` in ``dtype``, where it comes from): the profile's
    ``dtype_flops`` when it states the dtype ("measured"), else the datasheet ratio of its
    model times its fp32 ``flops`` ("estimated: …"), else its fp32 ``flops`` ("assumed:
    …"). None as the speed: the device has no such arithmetic."""
    if dtype not in DTYPES:
        raise OptionsError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}", field="precision")
    flops = float(getattr(device, "flops"))
    stated = getattr(device, "dtype_flops", None) or {}
    if dtype == "fp32":
        return float(stated.get("fp32") or flops), "measured"
    if dtype in stated:
        value = stated[dtype]
        return (None if value is None else float(value)), "measured" if value is not None else "the profile says none"
    sheet = datasheet_of(str(getattr(device, "model", "")))
    if sheet is not None:
        peak = getattr(sheet, dtype)
        if peak is None:
            return None, f"none on a {getattr(device, 'model')} ({sheet.source})"
        return flops * peak / sheet.fp32, f"estimated: the profile's fp32 rate × {peak / sheet.fp32:.3g} ({sheet.source})"
    return flops, f"assumed: no gain over fp32 (the profile states no {dtype} rate and hapd has no datasheet for model {getattr(device, 'model', '')!r})"


def supports(device: object, dtype: str) -> bool:
    """Whether ``device`` has ``dtype`` arithmetic (stated, or by its datasheet)."""
    return device_speed(device, dtype)[0] is not None


def resolve_precision(precision: str, profile: object) -> str:
    """The precision a job of ``profile`` trains in: ``precision`` itself, or for
    ``"auto"``: fp32 on CPU devices, bf16 where every device has it, else fp16 (with
    loss scaling: :class:`hapd.GradScaler`). :class:`OptionsError` for a precision a
    device lacks (bf16 on a V100)."""
    if precision not in PRECISIONS:
        raise OptionsError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}", field="precision")
    devices = list(getattr(profile, "devices"))
    if precision == "auto":
        if all(str(d.model).lower().startswith("cpu") for d in devices):
            return "fp32"
        return "bf16" if all(supports(d, "bf16") for d in devices) else "fp16"
    lacking = [d for d in devices if not supports(d, precision)]
    if lacking:
        d = lacking[0]
        raise OptionsError(f"precision {precision}: device {d.rank} ({d.model}) has no {precision} arithmetic "
                           f"({device_speed(d, precision)[1]}); use precision='fp16' or 'auto'", field="precision")
    return precision


def for_precision(profile: object, precision: str) -> object:
    """``profile`` with each device's matmul rate (``flops``) in ``precision`` (resolved:
    fp32, bf16 or fp16): the profile the search and the LP price a job in that precision
    with. Element-wise work keeps its rate (``elementwise_flops``, or the fp32 ``flops``
    it defaulted to)."""
    if precision == "fp32":
        return profile
    devices = []
    for d in getattr(profile, "devices"):
        speed, _ = device_speed(d, precision)
        if speed is None:
            raise OptionsError(f"precision {precision}: device {d.rank} ({d.model}) has no {precision} arithmetic",
                               field="precision")
        elementwise = d.elementwise_flops if d.elementwise_flops is not None else d.flops
        devices.append(dataclasses.replace(d, flops=speed, elementwise_flops=elementwise))
    return dataclasses.replace(profile, devices=tuple(devices))


def speeds_table(profile: object, precision: str) -> list[dict[str, object]]:
    """Each device's fp32 and ``precision`` matmul rates with their sources (for plans and
    ``explain``)."""
    out = []
    for d in getattr(profile, "devices"):
        speed, source = device_speed(d, precision if precision != "auto" else "fp32")
        out.append({"rank": d.rank, "model": d.model, "fp32": float(d.flops), precision: speed, "source": source})
    return out
