"""Import cycles between hapd's Python files: none, counting imports inside functions
too (``tools/import_cycles.py``), and the count catches one when it is put in."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
while not (ROOT / "tools" / "import_cycles.py").exists():  # the suite's folders may nest
    ROOT = ROOT.parent
SCRIPT = ROOT / "tools" / "import_cycles.py"


def _count(tree: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
    return subprocess.run([sys.executable, str(SCRIPT)], cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def _copy(dest: Path) -> None:
    for package in ("hapd", "launcher"):
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))


def test_no_import_cycles_between_files(tmp_path: Path) -> None:
    _copy(tmp_path)
    result = _count(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 import cycles" in result.stdout


def test_an_import_inside_a_function_that_closes_a_cycle_is_counted(tmp_path: Path) -> None:
    _copy(tmp_path)
    layout = tmp_path / "hapd" / "spmd" / "layout.py"
    layout.write_text(layout.read_text() + "\n\ndef _back():\n    import hapd.spmd.rewrite  # a cycle through a function\n")
    result = _count(tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 import cycles" in result.stdout
    assert "hapd.spmd.layout" in result.stdout and "hapd.spmd.rewrite" in result.stdout
