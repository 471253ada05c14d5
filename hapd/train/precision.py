"""Running a plan in its precision: the rank programs' forward under ``torch.autocast``
to the plan's dtype (:attr:`hapd.compiler.plan.Plan.precision`), and what happens when
a user's own ``torch.autocast`` surrounds the forward.

A plan of ``precision="bf16"`` or ``"fp16"`` runs each forward under
``torch.autocast(device_type, dtype)``: matmul, convolution and attention in the half
dtype, the rest as autocast's op lists say; parameters, gradients and optimizer state
stay fp32 (master weights). The program is exported in fp32 (exporting under autocast
fails in torch's functionalization), so the one program serves every precision.

A user's own autocast around the forward keeps working (the ops inside run as autocast
says), but an fp32 plan under it was priced for the wrong speeds and bytes: the module
says so once (a log record at WARNING: ``parallelize(..., precision="bf16")`` plans for
it). Under an autocast of another dtype than the plan's, the user's wins (the innermost
autocast is the plan's, so the plan's dtype runs; the message says which).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch

from hapd.profile.precision import TORCH_DTYPE

_log = logging.getLogger("hapd.precision")

__all__ = ["autocast_dtype", "plan_autocast"]


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of a plan's ``precision`` (None: fp32, no autocast)."""
    name = TORCH_DTYPE.get(precision)
    return None if name is None or precision == "fp32" else getattr(torch, name)


def _device_type(inputs: Sequence[object]) -> str:
    for t in inputs:
        if isinstance(t, torch.Tensor):
            return t.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def plan_autocast(precision: str, inputs: Sequence[object], warned: set[str]) -> Iterator[None]:
    """The context a rank program's forward runs in for a plan of ``precision``:
    ``torch.autocast`` to its dtype, or nothing for fp32. ``warned`` keeps what was
    already said (one message per module and case)."""
    device_type = _device_type(inputs)
    dtype = autocast_dtype(precision)
    user = torch.is_autocast_enabled(device_type)
    if user:
        theirs = torch.get_autocast_dtype(device_type)
        if dtype is None and "fp32-under-autocast" not in warned:
            warned.add("fp32-under-autocast")
            _log.warning("the forward runs under torch.autocast to %s but the plan was priced for fp32: pass "
                         "precision=%r to hapd.parallelize to plan for it", theirs,
                         "bf16" if theirs == torch.bfloat16 else "fp16")
        elif dtype is not None and theirs != dtype and "other-dtype" not in warned:
            warned.add("other-dtype")
            _log.warning("the forward runs under torch.autocast to %s; the plan's precision is %s, which runs "
                         "inside it", theirs, precision)
    if dtype is None:
        yield
        return
    with torch.autocast(device_type, dtype=dtype):
        yield
