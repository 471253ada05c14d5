"""The rooms of hapd as a checked contract: import-linter's layers and no-torch
contracts (``[tool.importlinter]`` in pyproject.toml) hold, they break when a room
imports upward or the daemon's room imports torch, and the torch-free rooms really
import without torch."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"]


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
    return subprocess.run([*LINT, "--config", str(cwd / "pyproject.toml"), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def _copy_tree(dest: Path) -> None:
    """The Python sources of hapd and launcher plus the contract, nothing else."""
    for package in ("hapd", "launcher"):
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", dest / "pyproject.toml")


def test_import_contracts_hold(tmp_path: Path) -> None:
    _copy_tree(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(("module", "line", "contract"), [
    ("hapd/wire/keys.py", "import torch", "never import torch"),
    ("launcher/hosts.py", "import hapd.spmd.collectives", "never import torch"),
    ("hapd/compiler/plan.py", "import hapd.spmd.rewrite", "imports only the rooms below it"),
    ("hapd/spmd/distributed.py", "import hapd.harness.training", "imports only the rooms below it"),
    ("hapd/errors.py", "import hapd.wire.protocol", "imports only the rooms below it"),
    # a cycle inside a room: the layout vocabulary is the runtime's ground floor
    ("hapd/spmd/layout.py", "import hapd.spmd.rewrite", "import each other one way"),
    ("hapd/state/checkpoint_format.py", "import hapd.state.checkpoint", "import each other one way"),
    ("hapd/compiler/lp.py", "import hapd.compiler.ratios", "import each other one way"),
    ("hapd/compiler/search.py", "import hapd.compiler.driver", "import each other one way"),
])
def test_contract_breaks_on_a_violation(tmp_path: Path, module: str, line: str, contract: str) -> None:
    _copy_tree(tmp_path)
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n{line}  # an import the contract forbids\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    broken = [ln for ln in result.stdout.splitlines() if " BROKEN" in ln]
    assert len(broken) == 1 and contract in broken[0], result.stdout


def test_torch_free_rooms_import_without_torch() -> None:
    code = (
        "import importlib, pkgutil, sys\n"
        "import hapd.serve, launcher\n"
        "names = ['hapd', 'hapd.errors', 'hapd.profile.schema', 'launcher.__main__']\n"
        "for pkg in (hapd.serve, launcher):\n"
        "    names += [pkg.__name__ + '.' + m.name for m in pkgutil.iter_modules(pkg.__path__)]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "print(len(names), loaded[:3])\n"
        "sys.exit(1 if loaded else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, f"torch was imported: {result.stdout}{result.stderr}"


def test_the_runtime_loads_checkpointing_only_when_a_checkpoint_is_used() -> None:
    """Every rank imports the runtime; ``torch.distributed.checkpoint`` (~0.2 s, FSDP
    with it) loads when a checkpoint is saved or read, not on ``hapd.parallelize``."""
    code = (
        "import sys, hapd, hapd.train.parallelize, hapd.spmd.rewrite, hapd.state.weights\n"
        "hapd.parallelize\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint'))[:3])\n"
        "import hapd.state.checkpoint\n"
        "print('torch.distributed.checkpoint' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["[]", "True"], result.stdout


def test_runtime_adapters_key_on_the_cores_rule_names() -> None:
    from hapd import _core
    from hapd.spmd.adapters import ADAPTERS

    names = set(_core.rule_names().values())
    assert {"replicated", "row-parallel", "vocab-parallel"} <= names
    assert {rule for _, rule in ADAPTERS} <= names
