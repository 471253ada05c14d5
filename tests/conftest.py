"""Shared fixtures: the graph IR fixture files and the tiny benchmark models, each
exported and lowered at most once per session."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import pytest

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _load_make_fixtures():
    """``tests/fixtures/make_fixtures.py`` as a module (the folder is not a package)."""
    name = "hapd_tests_make_fixtures"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, FIXTURES / "make_fixtures.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


make_fixtures = _load_make_fixtures()

MODEL_NAMES: list[str] = make_fixtures.model_names()
"""Every benchmark model, in registry order."""

BAD_FIXTURES: list[str] = list(make_fixtures.BAD)
"""Every hand-made bad fixture."""


class Lowered(NamedTuple):
    """One tiny model, exported with batch ``make_fixtures.BATCH`` and lowered."""

    name: str
    program: Any  # torch.export.ExportedProgram
    ir: Any  # hapd.ir.lower.GraphIR
    doc: dict[str, Any]


class _LazyModels(Mapping[str, Lowered]):
    """Exports a model on first access and keeps it for the session."""

    def __init__(self) -> None:
        self._done: dict[str, Lowered] = {}

    def __getitem__(self, name: str) -> Lowered:
        if name not in self._done:
            if name not in MODEL_NAMES:
                raise KeyError(name)
            program, ir = make_fixtures.lower_model(name)
            self._done[name] = Lowered(name, program, ir, ir.doc)
        return self._done[name]

    def __iter__(self) -> Iterator[str]:
        return iter(MODEL_NAMES)

    def __len__(self) -> int:
        return len(MODEL_NAMES)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """``tests/fixtures``."""
    return FIXTURES


@pytest.fixture(scope="session")
def fixture_bytes() -> dict[str, bytes]:
    """``{name: bytes}`` of every ``tests/fixtures/*.hapg``."""
    return {path.stem: path.read_bytes() for path in sorted(FIXTURES.glob("*.hapg"))}


@pytest.fixture(scope="session")
def lowered() -> Mapping[str, Lowered]:
    """``{model: Lowered}``, each model exported and lowered once, on first use."""
    return _LazyModels()


@pytest.fixture(scope="session")
def check_program():
    """``check_program(program, **kw)``: :func:`hapd.train.check.check` as an
    assertion — one step of the 1-rank distributed program equals eager
    ``program.module()`` (loss, every gradient, updated buffers); on failure the
    message lists the worst tensors. Returns the report."""

    def run(program: Any, **kwargs: Any) -> Any:
        from hapd.train.check import check

        report = check(program, **kwargs)
        assert report.ok, report.format(10)
        return report

    return run


LONGEST_FIRST = (
    "test_zoo.py", "test_lowering.py", "test_distribute.py", "test_launcher.py", "test_elastic.py", "test_worker.py",
    "test_mixed_length.py", "test_hardening_leases.py", "test_example.py", "test_pipeline_api.py", "test_cli.py",
    "test_launcher_console.py", "test_checkpoint.py", "test_overlap.py", "test_hardening_preauth.py",
    "test_profiler.py", "test_ir.py", "test_compile.py", "test_example_models.py", "test_gpu_step_bench.py",
    "test_shapes.py", "test_local_daemon.py", "test_frozen.py", "test_dropout.py", "test_memory_cluster.py",
    "test_collectives.py", "test_container.py",
)
"""The test files that take longest (``make test`` prints ``--durations``), longest first,
by file name (the names are unique across the room folders ``tests/<room>/``).

``make test`` runs the files on two pytest-xdist workers, a whole file per worker
(``--dist loadfile``), handed out in collection order: collected alphabetically, the
longest file (``test_zoo.py``) came last and ran alone while the other worker idled.
Handing out the longest files first (the LPT rule) leaves only short files for the end."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order
