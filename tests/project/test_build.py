"""The compiled extension ``hapd._core``: an abi3 build that imports on its own."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
from pathlib import Path

import hapd
from hapd import _core
from hapd.ir import lower as ir


def test_extension_is_an_abi3_build() -> None:
    path = Path(_core.__file__)
    assert path.name == "_core.abi3.so"
    assert path.parent == Path(hapd.__file__).parent
    assert ".abi3.so" in importlib.machinery.EXTENSION_SUFFIXES


def test_versions() -> None:
    assert _core.graph_version() == ir.GRAPH_VERSION == 1
    assert _core.__version__ == hapd.__version__


def test_functions_are_listed() -> None:
    for name in ("load_graph", "graph_version"):
        assert callable(getattr(_core, name)), name


def test_import_in_a_fresh_interpreter_without_torch() -> None:
    """The extension imports by itself, and neither it nor ``hapd`` pulls in torch."""
    code = "import sys, hapd._core as c; assert c.graph_version() == 1; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_core_errors_import_hapd_errors_lazily() -> None:
    """A core error raised in a fresh interpreter arrives as the hapd.errors class."""
    code = ("import hapd._core as c\n"
            "try:\n    c.load_graph(b'')\nexcept Exception as e:\n"
            "    print(type(e).__module__, type(e).__name__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "hapd.errors GraphFormatError"
