"""The ranks' Python tracebacks, read as the launcher streams their stderr: each printed
once, ranks that fail alike folded into one, and the cause kept for the closing line.

- ``torch.distributed`` prefixes every line of an uncaught exception with ``[rankN]: ``
  (its ``sys.excepthook``); the launcher prefixes every line with ``[rank N] `` already,
  so the torch prefix of the rank's own number is dropped (:func:`strip_rank_prefix`).
- A traceback (from ``Traceback (most recent call last):`` to the exception line and
  its message) is held until the rank exits or its stderr has been quiet for
  :data:`HOLD_S`, then printed whole — or, when another rank already printed the same
  one, as one line saying so (and the exception line when only the message differs).
- The **cause** of a rank's failure is the last exception line it printed, e.g.
  ``ExportError: the model returns 2 outputs; …`` (the type without its module), or,
  when it printed no traceback, its last non-empty stderr line.

No torch import here.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

HOLD_S = 1.0
"""A held traceback is printed once its rank's stderr has been quiet this long (or at
the rank's exit)."""
HOLD_MAX_S = 10.0
"""… and at the latest this long after it began (a rank that goes on printing)."""

TRACEBACK_START = "Traceback (most recent call last):"
CHAIN_LINES = ("During handling of the above exception, another exception occurred:",
               "The above exception was the direct cause of the following exception:")

_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")


def strip_rank_prefix(line: str, rank: int) -> str:
    """``line`` without torch's ``[rankN]: `` prefix of this rank's number."""
    prefix = f"[rank{rank}]:"
    if line.startswith(prefix):
        rest = line[len(prefix):]
        return rest[1:] if rest.startswith(" ") else rest
    return line


def short_cause(line: str) -> str:
    """``pkg.mod.SomeError: message`` → ``SomeError: message``."""
    m = _EXCEPTION_LINE.match(line)
    if not m:
        return line
    name = m.group(1).rsplit(".", 1)[-1]
    return f"{name}: {m.group(2)}" if m.group(2) is not None else name


@dataclass
class _Held:
    lines: list[str] = field(default_factory=list)
    cause_at: int | None = None
    """Index of the (last) exception line in ``lines``."""
    in_frames: bool = True
    last: float = 0.0
    started: float = 0.0


@dataclass
class Tracebacks:
    """Per rank: the traceback being held, the cause, the last stderr line; the
    tracebacks printed so far (to fold repeats into one line)."""

    hold_s: float = HOLD_S
    held: dict[int, _Held] = field(default_factory=dict)
    causes: dict[int, str] = field(default_factory=dict)
    last_line: dict[int, str] = field(default_factory=dict)
    printed: list[tuple[int, list[str], int | None]] = field(default_factory=list)
    """(rank, lines, cause index) of every traceback printed whole."""

    def feed(self, rank: int, line: str, now: float | None = None) -> list[str] | None:
        """Take one stderr line of ``rank`` (its torch prefix stripped already). Returns
        None when the line is held (a traceback and what follows it until the rank's
        stderr is quiet), else the lines to print now: the line itself."""
        now = time.monotonic() if now is None else now
        if line.strip():
            self.last_line[rank] = line
        block = self.held.get(rank)
        if block is None:
            if line == TRACEBACK_START:
                self.held[rank] = _Held([line], last=now, started=now)
                return None
            return [line]
        block.last = now
        if line == TRACEBACK_START:
            block.in_frames = True
        elif block.in_frames and line.strip() and not line.startswith((" ", "\t")) and line not in CHAIN_LINES:
            block.in_frames = False
            block.cause_at = len(block.lines)
            self.causes[rank] = short_cause(line)
        block.lines.append(line)
        return None

    def flush(self, rank: int) -> list[str]:
        """The lines to print for ``rank``'s held traceback (none held: [])."""
        block = self.held.pop(rank, None)
        if block is None:
            return []
        lines, at = block.lines, block.cause_at
        for other, seen, seen_at in self.printed:
            if seen == lines:
                return [f"(the same traceback as rank {other})"]
            if at is not None and seen_at is not None and seen[:seen_at] == lines[:at]:
                return [f"(the same traceback as rank {other}, ending:)", *lines[at:]]
        self.printed.append((rank, lines, at))
        return lines

    def due(self, now: float | None = None) -> list[int]:
        """Ranks whose held traceback has been quiet for ``hold_s`` (or held for
        :data:`HOLD_MAX_S`)."""
        now = time.monotonic() if now is None else now
        return [rank for rank, block in self.held.items()
                if now - block.last >= self.hold_s or now - block.started >= HOLD_MAX_S]

    def cause(self, rank: int) -> str | None:
        """The exception the rank died of (the last one it printed), else None."""
        return self.causes.get(rank)

    def alike(self, rank: int) -> list[int]:
        """The other ranks whose cause is ``rank``'s."""
        cause = self.causes.get(rank)
        return sorted(r for r, c in self.causes.items() if r != rank and cause is not None and c == cause)
