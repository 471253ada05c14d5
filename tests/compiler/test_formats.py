"""docs/formats.md documents every field a plan file has (the plan section is checked
against a real plan with collectives, sources and splits)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterable

import hapd
from hapd.ir.lower import GraphIR

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _plan_section() -> str:
    text = (ROOT / "docs" / "formats.md").read_text()
    start = text.index("## Plan")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _keys(doc: Any, path: str = "") -> Iterable[tuple[str, str]]:
    """(dotted path, key) of every map key in a plan, lists looked into."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield f"{path}.{key}", key
            if key not in ("force",):  # option values, not fields
                yield from _keys(value, f"{path}.{key}")
    elif isinstance(doc, list):
        for item in doc:
            yield from _keys(item, path)


def test_every_plan_field_is_documented() -> None:
    plan = hapd.compile(GraphIR.load(FIXTURES / "bert_moe.hapg"), "paper-8")
    documented = {word for span in re.findall(r"`([^`]+)`", _plan_section()) for word in re.findall(r"[a-z_]+", span)}
    fields = dict(_keys(plan.doc))
    assert any(step["comms"] for step in plan.program["steps"])  # the comm fields are there to check
    missing = sorted(path for path, key in fields.items() if key not in documented)
    assert not missing, f"plan fields not in docs/formats.md: {missing}"
