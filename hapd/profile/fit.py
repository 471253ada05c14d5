"""Fitting ``time = α + bytes / β`` to a collective's measured times. Imports no torch."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hapd.errors import ProfileError


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
