"""What the profiler measures and how long: :class:`ProfilerOptions` and the byte-size
parser of ``--sizes``. Imports no torch, so the CLI can check options before starting ranks."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from hapd.errors import OptionsError

KiB, MiB = 2**10, 2**20
DEFAULT_SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
"""Full-tensor bytes of the timed collectives: 4 KiB … 16 MiB, ×4 apart."""
QUICK_SIZES = (16 * KiB, 256 * KiB, 4 * MiB)

HOST_ENV = "HAPD_HOST"
"""Overrides this rank's host name (network namespaces share the machine's name)."""


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
    linear_widths: tuple[int, ...] | None = None
    """Widths of the ``Linear`` layers trained to time ``flops`` (default: 256, 512, 1024
    on CPU; 2048, 4096, 8192 on GPU)."""
    linear_rows: int | None = None
    """Rows (tokens) of their input: a rank's share of a micro-batch (default 128 on CPU,
    2048 on GPU)."""
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
        if self.linear_widths is not None and (not self.linear_widths or min(self.linear_widths) < 1):
            problems.append(f"linear widths {self.linear_widths} must be ≥ 1")
        if self.linear_rows is not None and self.linear_rows < 1:
            problems.append(f"linear rows {self.linear_rows} must be ≥ 1")
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
