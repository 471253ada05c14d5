"""Rank side of ``python -m launcher profile``: :func:`hapd.profiler.driver.main`, then
(rank 0) the profile as ``{"hapd": "profile-part"}`` lines the launcher reassembles (a
daemon splits lines longer than 64 KiB).

The launcher ships this file's bytes to every daemon, which runs the copy as a script
(``python -u hapd_profile_rank.py PROFILER_ARGS``), so it imports only what an installed
hapd provides.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Sequence

from hapd.profiler.driver import main as profiler_main
from hapd.util import exit_process

PART_CHARS = 8000
"""Characters of the profile's JSON text per ``profile-part`` line."""


def profile_parts(text: str) -> list[dict[str, object]]:
    """The ``{"hapd": "profile-part", "index", "count", "text"}`` lines carrying ``text``."""
    parts = [text[i:i + PART_CHARS] for i in range(0, len(text), PART_CHARS)] or [""]
    return [{"hapd": "profile-part", "index": i, "count": len(parts), "text": part} for i, part in enumerate(parts)]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the profiler with ``argv`` (default: this process's arguments) writing to a
    private file, then print the profile rank 0 wrote as ``profile-part`` lines.
    Returns the profiler's exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    out = os.path.join(tempfile.mkdtemp(prefix="hapd-profile-"), "profile.json")
    code = profiler_main([*args, "--out", out])
    if code == 0 and os.path.exists(out):
        with open(out) as f:
            text = f.read()
        for part in profile_parts(text):
            print(json.dumps(part), flush=True)
    return code


if __name__ == "__main__":
    exit_process(main())
