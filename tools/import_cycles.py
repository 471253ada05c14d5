"""Counts the import cycles between hapd's Python files: ``python tools/import_cycles.py``.

Every import counts, at module level or inside a function: an import moved into a
function to break a cycle is still a cycle here. The graph is grimp's (the library
import-linter is built on); its strongly connected components of more than one module
are the cycles. Exits 1 and prints each cycle's modules when there is one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping

import grimp

PACKAGES = ("hapd", "launcher")


def import_graph(packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """Each module of ``packages`` → the modules of ``packages`` it imports directly."""
    graph = grimp.build_graph(*packages, cache_dir=None)
    return {m: set(graph.find_modules_directly_imported_by(m)) & graph.modules for m in graph.modules}


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of ``graph`` with more than one module, or one
    module importing itself (Tarjan's algorithm, iterative: no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


def main() -> int:
    graph = import_graph()
    found = cycles(graph)
    edges = sum(len(v) for v in graph.values())
    print(f"{len(graph)} modules, {edges} imports between them, {len(found)} import cycles")
    for component in found:
        print("cycle: " + " <-> ".join(component))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
