"""Waiting in a test for something to happen: a file to appear, a process to exit, a
status to change. Tests wait for the event with a generous deadline and never assert
how long it took (timings live in ``bench/``)."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")

GENEROUS_S = 60.0
"""Deadline for an event that normally comes within a second or two: long enough for
a loaded machine, short enough that a test that will never pass says so."""


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """The first truthy value ``check()`` returns, polled every ``interval`` seconds;
    AssertionError naming ``what`` if none came within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
