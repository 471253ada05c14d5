"""Load a ``bench/`` script as a module (the scripts are not a package), once per run,
and check a script's command line."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(stem: str) -> ModuleType:
    """``bench/STEM.py`` as module ``hapd_bench_STEM`` (the name the bench scripts use
    when one loads another, so both share one copy)."""
    name = f"hapd_bench_{stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{stem}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def reprint(stem: str, results: Mapping[str, Any], folder: Path,
            bad: Sequence[tuple[Sequence[str], str]] = ()) -> str:
    """``bench/STEM.py --from-json`` on ``results`` saved in ``folder``: its output (it
    must exit 0). Each of ``bad``'s arguments must make the script exit 2 with its
    message on stderr."""
    saved = folder / "run.json"
    saved.write_text(json.dumps(results))
    script = str(BENCH / f"{stem}.py")
    done = subprocess.run([sys.executable, script, "--from-json", str(saved)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    for args, message in bad:
        failed = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, timeout=120)
        assert failed.returncode == 2 and message in failed.stderr, failed.stderr
    return done.stdout
