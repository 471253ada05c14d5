"""The module lists in the docs are true: every package docstring lists exactly its
modules, the README's layout table names every module of each room, each room's list
in ``docs/*.md`` names every file of the room and nothing else, and every module path
or dotted name the docs mention exists."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
while not (ROOT / "pyproject.toml").exists():  # the suite's folders may nest
    ROOT = ROOT.parent
PACKAGES = sorted(p.parent for p in (ROOT / "hapd").rglob("__init__.py") if "__pycache__" not in p.parts)
FILE_SUFFIXES = {"json", "pt2", "hapg", "hplan", "md", "py", "toml", "spill"}
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _children(package: Path) -> set[str]:
    """The modules and subpackages directly in ``package`` (``__main__`` and private
    ``_name`` modules aside)."""
    names = {p.stem for p in package.glob("*.py") if not p.stem.startswith("_")}
    names |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    return names


def _dotted(package: Path) -> str:
    return ".".join(package.relative_to(ROOT).parts)


def _listing_packages() -> list[Path]:
    """The packages whose docstring lists modules (``- :mod:`` items)."""
    out = []
    for package in PACKAGES:
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        if re.search(r"^- :mod:", doc, re.M):
            out.append(package)
    return out


@pytest.mark.parametrize("package", _listing_packages(), ids=_dotted)
def test_a_package_docstring_lists_exactly_its_modules(package: Path) -> None:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    prefix = _dotted(package) + "."
    named = {m[len(prefix):].split(".")[0] for m in re.findall(r":mod:`~?([\w.]+)`", doc) if m.startswith(prefix)}
    assert named == _children(package), f"{prefix[:-1]}: listed {sorted(named)}, has {sorted(_children(package))}"


def test_every_room_with_modules_lists_them() -> None:
    """Every package with more than one module has a list (a newcomer reads it first)."""
    listing = set(_listing_packages())
    missing = [_dotted(p) for p in PACKAGES if len(_children(p)) > 1 and p not in listing and p.name != "models" and p != ROOT / "hapd"]
    assert not missing, f"packages without a module list in their docstring: {missing}"


def _layout_rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `(hapd/[\w/]+/)` \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = m.group(2)
    return rows


def test_the_readme_layout_names_every_module_of_each_room() -> None:
    rows = _layout_rows()
    assert rows, "the README's layout table has no rows for hapd's rooms"
    rooms = {p.relative_to(ROOT).as_posix() + "/" for p in PACKAGES if p.parent == ROOT / "hapd"}
    assert rooms <= set(rows), f"rooms missing from the layout table: {sorted(rooms - set(rows))}"
    for room, row in rows.items():
        folder = ROOT / room
        assert folder.is_dir(), f"the layout table names {room}, which does not exist"
        named = set(re.findall(r"`(\w+)`", row))
        expected = _children(folder) - {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
        for sub in (p for p in folder.iterdir() if (p / "__init__.py").exists()):
            expected |= _children(sub)
        if room == "hapd/models/":
            continue  # described, not listed: the registry is hapd.models.NAMES
        assert expected <= named, f"{room}: the layout table leaves out {sorted(expected - named)}"
        assert named <= expected | {"launcher"}, f"{room}: the layout table names {sorted(named - expected)}, not in it"


def _room_bullets(text: str) -> list[tuple[str, str]]:
    """``- `hapd/ROOM/` — …`` bullets of a doc with their continuation lines."""
    out = []
    for m in re.finditer(r"^- `(hapd/[\w/]+/)` — (.*?)(?=^- |^\s*$)", text, re.M | re.S):
        out.append((m.group(1), m.group(2)))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_a_docs_room_list_names_every_file_of_its_room_and_only_those(doc: Path) -> None:
    for room, body in _room_bullets(doc.read_text()):
        folder = ROOT / room
        assert folder.is_dir(), f"{doc.name} lists {room}, which does not exist"
        # a subfolder introduced as "`random/`:" owns the names after it
        current = ""
        named = set()
        for token in re.findall(r"`(\w+/)`|`(\w+)\.py`", body):
            if token[0]:
                current = token[0]
            else:
                named.add(current + token[1])
        files = {p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.py")
                 if not p.stem.startswith("_") and "__pycache__" not in p.parts}
        assert named == files, f"{doc.name}, {room}: names {sorted(named - files)} not there, leaves out {sorted(files - named)}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            found = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            found = None
        if found is None:
            continue
        obj = importlib.import_module(module)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_module_a_doc_names_exists(doc: Path) -> None:
    text = doc.read_text()
    paths = set(re.findall(r"(?<![\w/.])((?:hapd|launcher)/[\w/]*\w\.py)", text))
    folders = set(re.findall(r"`((?:hapd|launcher)/[\w/]+)/`", text))
    dotted = set(re.findall(r"`((?:hapd|launcher)\.[a-z_][\w.]*[a-z_])`", text))
    dotted |= set(re.findall(r"python -m ((?:hapd|launcher)(?:\.\w+)*)", text))
    dotted = {d for d in dotted if d.rsplit(".", 1)[-1] not in FILE_SUFFIXES}  # hapd.json: a file's name
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    missing += sorted(f + "/" for f in folders if not (ROOT / f).is_dir())
    missing += sorted(d for d in dotted if not _resolves(d))
    assert not missing, f"{doc.name} names what does not exist: {missing}"
