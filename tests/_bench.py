"""Load a ``bench/`` script as a module (the scripts are not a package), once per run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

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
