"""The walk from ``hapd.parallelize(model)`` to a rank's program: which of hapd's files
a call of it passes through, and how often a call climbs back up a floor.

``python tools/walk.py [--model mlp]`` traces one ``hapd.parallelize`` of a tiny
benchmark model on one process (its plan compiled here, no daemon) and prints the
files and rooms its calls enter, and the calls by direction between floors: a floor is
a layer of the import contract (``[tool.importlinter]`` in pyproject.toml, top first);
a call from a lower floor into a higher one is a climb. Inside a floor, a call from a
file into one that imports it (directly or not: grimp's graph, the one import-linter
checks) climbs too: a callback, data flowing back up.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def floors(pyproject: Path) -> list[list[str]]:
    """The layers of the contract ``layers``, top first, each a list of module prefixes."""
    config = tomllib.loads(pyproject.read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in config if c.get("type") == "layers")["layers"]
    return [[name.strip() for name in layer.split("|")] for layer in layers]


def floor_of(module: str, layers: list[list[str]]) -> int | None:
    """The index of the floor ``module`` is in (its longest matching prefix)."""
    best: tuple[int, int] | None = None
    for i, layer in enumerate(layers):
        for prefix in layer:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), i)
    return None if best is None else best[1]


def trace_parallelize(model: str) -> list[tuple[str, str]]:
    """(caller module, callee module) of every call between hapd's functions during one
    ``hapd.parallelize`` of the tiny ``model``."""
    import torch

    import hapd
    from hapd import models

    torch.manual_seed(0)
    built, config = models.build(model, size="tiny")
    example = models.get(model).example_inputs(config, 8)
    calls: list[tuple[str, str]] = []

    def tracer(frame, event, arg):
        if event == "call":
            callee = frame.f_globals.get("__name__", "")
            back = frame.f_back
            caller = back.f_globals.get("__name__", "") if back is not None else ""
            if callee.startswith("hapd") and caller.startswith("hapd"):
                calls.append((caller, callee))
        return None

    sys.setprofile(None)
    sys.settrace(tracer)
    try:
        hapd.parallelize(built, example)
    finally:
        sys.settrace(None)
    return calls


def _upstream(modules: set[str]) -> dict[str, set[str]]:
    """Each module → the modules it imports, directly or not."""
    import grimp

    graph = grimp.build_graph("hapd", cache_dir=None)
    return {m: graph.find_upstream_modules(m) if m in graph.modules else set() for m in modules}


def report(calls: list[tuple[str, str]], layers: list[list[str]]) -> dict[str, object]:
    imports = _upstream({m for pair in calls for m in pair})
    files = sorted({m for pair in calls for m in pair})
    rooms = sorted({".".join(m.split(".")[:2]) for m in files})
    moves = collections.Counter()
    climbs = collections.Counter()
    for caller, callee in calls:
        if caller == callee:
            moves["within a file"] += 1
            continue
        a, b = floor_of(caller, layers), floor_of(callee, layers)
        if a is not None and b is not None and b > a:
            moves["down a floor"] += 1
        elif (a is None or b is None or a == b) and caller not in imports[callee]:
            moves["across files, same floor"] += 1
        else:
            moves["up (climbs)"] += 1
            climbs[f"{caller} -> {callee}"] += 1
    return {"files": len(files), "rooms": len(rooms), "room_names": rooms, "calls": len(calls),
            "moves": dict(moves), "climbs": dict(climbs.most_common())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    result = report(trace_parallelize(args.model), floors(ROOT / "pyproject.toml"))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"hapd.parallelize({args.model}): {result['calls']} calls between hapd's functions, "
              f"{result['files']} files in {result['rooms']} rooms ({', '.join(result['room_names'])})")
        for kind, n in result["moves"].items():
            print(f"  {kind}: {n}")
        for edge, n in result["climbs"].items():
            print(f"  climb {edge}: {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
