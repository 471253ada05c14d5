"""The hand-over between a daemon and its warm rank processes (``hapd serve --standby``):
what a standby runs, which launches it can serve, and the one line that hands it a rank.

The daemon (:mod:`hapd.serve.standby`) writes one JSON line to a standby's standard
input — ``{"env": {...}, "cwd": "...", "argv": ["SCRIPT", "ARG", …], "runner": "in_place"}``
— and the standby (:mod:`hapd.elastic.standby`) reads it with :func:`read_order`.
Torch-free.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

STANDBY_MODULE = "hapd.elastic.standby"
"""The module a daemon's standby processes run (``python -m``)."""

START_VARIABLES = ("PYTHON", "LD_", "MALLOC_", "TORCH_", "PYTORCH_", "KMP_", "MKL_", "GOMP_")
"""Prefixes of environment variables read when the interpreter, torch or its thread
pools start: a launch whose value of one differs from the standby's own runs in a new
process. ``PYTHONUNBUFFERED`` is exempt (the standby runs unbuffered, as ranks do)."""
EXEMPT = frozenset({"PYTHONUNBUFFERED"})

READY_FD_ENV = "HAPD_STANDBY_READY_FD"
"""The descriptor a standby writes ``ready`` to once warm, then closes (the daemon hands
a launch to a warm standby first, and logs how long each took to warm)."""

RUNNERS = ("in_place",)
"""The runners a hand-over may name (the elastic one: a warm process runs nothing else)."""


def start_variables(env: Mapping[str, str]) -> dict[str, str]:
    """The part of ``env`` a process reads at start (:data:`START_VARIABLES`)."""
    return {k: v for k, v in env.items() if k.startswith(START_VARIABLES) and k not in EXEMPT}


def fits(standby_env: Mapping[str, str], launch_env: Mapping[str, str]) -> str | None:
    """None when a standby started with ``standby_env`` can run a rank of ``launch_env``;
    else why not (the first variable that differs)."""
    mine, theirs = start_variables(standby_env), start_variables(launch_env)
    for key in sorted(set(mine) | set(theirs)):
        if mine.get(key) != theirs.get(key):
            return f"{key} differs ({mine.get(key)!r} in the standby, {theirs.get(key)!r} in the launch)"
    return None


def read_order(stream: Any) -> dict[str, Any] | None:
    """The daemon's hand-over (None at end of input); :class:`ValueError` for a line
    that is not one."""
    line = stream.readline()
    if not line:
        return None
    order = json.loads(line)
    if (not isinstance(order, dict) or not isinstance(order.get("env"), dict) or not isinstance(order.get("cwd"), str)
            or not isinstance(order.get("argv"), list) or not order["argv"] or order.get("runner") not in RUNNERS):
        raise ValueError(f"not a hand-over: {line[:200]!r}")
    return order
