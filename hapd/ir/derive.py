"""A symbolic program's graph at another batch, derived from two it was lowered at.

A pipeline search prices the model's graph at every micro-batch size (the global batch
over 2, 4, 8, 16 …) and overlap at half the global batch. Lowering a graph
(:func:`hapd.ir.lower.lower_at`: the program made concrete at that batch, normalized,
its saved activations traced) takes 0.3-0.6 s for GPT-2 124M, once per batch. When every
size of the program is linear in the batch (``a·batch + c``: each shape, stride and
size computation; :func:`linear_in_batch`), the lowered graphs at all batches are one
document whose integers are those same linear functions: the same nodes, ops and
names, only the sizes differ. Two graphs lowered for real (the global batch and its
half) fix every function, so the graph at any other batch is computed from them
(:class:`Derivation`) — the document :func:`~hapd.ir.lower.lower_at` gives, byte for
byte, hence the same graph id (tested on the model zoo).

Not derived, lowered instead: a program with a size that is not linear in the batch
(``floor``, ``Min``: the shape of a slice whose end is a constant changes where the
batch passes it; a tensor with two batch-sized dims, whose element count and FLOPs
grow as the batch's square), a batch of 1 (where torch's and hapd's
size-1 cases — broadcasting, squeezes — may differ from any other batch), and any two
graphs whose documents differ in more than integers. Written by hand: it reads hapd's
own graph documents, which no library knows.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Callable, Mapping

import torch
from torch.export import ExportedProgram

from hapd.ir.lower import GraphIR, canonical_bytes, lower_at
from hapd.ir.normalize import functionalize
from hapd.ir.shapes import batch_symbol

_LINEAR = "_hapd_linear_in_batch"
"""Attribute of a program: the cached answer of :func:`linear_in_batch`."""


class _NotDerivable(Exception):
    """The two documents differ in more than integers linear in the batch."""


def linear_in_batch(program: ExportedProgram, symbol: Any) -> bool:
    """Whether every size the program computes — each value's shape, strides and
    element count, each size computation — is ``a·symbol + c`` with integers ``a`` and
    ``c`` (cached on the program). Every number of a lowered graph is then linear in the
    batch: its shapes, and its FLOP and byte counts, each a product of sizes of which at
    most one is the batch's (a product of two would be the element count of a tensor
    holding both)."""
    cached = getattr(program, _LINEAR, None)
    if cached is not None:
        return bool(cached)
    import sympy

    seen: dict[Any, bool] = {}

    def linear(value: Any) -> bool:
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            expr = value.node.expr
            if expr not in seen:
                seen[expr] = _linear_expr(sympy, expr, symbol)
            return seen[expr]
        if isinstance(value, torch.Tensor):
            if not all(linear(d) for d in (*value.shape, *value.stride())):
                return False
            # its element count too: ``[b, b]`` has linear dims but b² elements, and
            # its op's FLOPs and bytes (numbers of the graph document) grow so
            sized = [d.node.expr for d in value.shape if isinstance(d, torch.SymInt)]
            return len(sized) < 2 or _linear_expr(sympy, sympy.expand(sympy.Mul(*sized)), symbol)
        if isinstance(value, (list, tuple)):
            return all(linear(v) for v in value)
        return True

    answer = all(linear(node.meta.get("val")) for node in program.graph.nodes)
    setattr(program, _LINEAR, answer)
    return answer


def _linear_expr(sympy: Any, expr: Any, symbol: Any) -> bool:
    if not getattr(expr, "free_symbols", None):
        return True
    if expr.free_symbols != {symbol} or not expr.is_polynomial(symbol):
        return False
    poly = sympy.Poly(expr, symbol)
    return poly.degree() <= 1 and all(c.is_integer for c in poly.all_coeffs())


class Derivation:
    """The graphs of one program at any batch, from two it was lowered at
    (``first`` at ``first_batch``, ``second`` at ``second_batch``), each number the line
    through its two values. Only for a program that :func:`linear_in_batch` (the
    caller's check)."""

    def __init__(self, first: GraphIR, first_batch: int, second: GraphIR, second_batch: int):
        self.batches = (first_batch, second_batch)
        self._docs: tuple[dict, dict] | None = None
        self._graphs = (first, second)

    def at(self, batch: int) -> GraphIR | None:
        """The graph at ``batch``; None when the two documents differ in anything but
        numbers, a number would not be a whole one at ``batch`` (or negative), or a
        batch is below 2."""
        first_batch, second_batch = self.batches
        if batch < 2 or first_batch == second_batch or min(first_batch, second_batch) < 2:
            return None
        if self._docs is None:
            self._docs = (self._graphs[0].doc, self._graphs[1].doc)  # decoded once for every batch
        try:
            doc = _between(*self._docs, Fraction(batch - first_batch, second_batch - first_batch))
        except _NotDerivable:
            return None
        return GraphIR(canonical_bytes(doc))


def derived_graph(first: GraphIR, first_batch: int, second: GraphIR, second_batch: int, batch: int) -> GraphIR | None:
    """:meth:`Derivation.at` of one batch."""
    return Derivation(first, first_batch, second, second_batch).at(batch)


def _between(a: Any, b: Any, t: Fraction) -> Any:
    """``a + t·(b − a)`` for every number of two documents of the same structure (an
    integer, or a float holding one: a FLOP or byte count)."""
    if type(a) is not type(b):
        raise _NotDerivable
    if isinstance(a, dict):
        if a.keys() != b.keys():
            raise _NotDerivable
        return {k: _between(a[k], b[k], t) for k in a}
    if isinstance(a, list):
        if len(a) != len(b):
            raise _NotDerivable
        return [_between(x, y, t) for x, y in zip(a, b)]
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        if a == b:
            return a
        # exact rationals: a size, a FLOP count or a byte count (a float holding an
        # integer) comes out as the integer lowering computes, never rounded otherwise
        value = Fraction(a) + t * (Fraction(b) - Fraction(a))
        if value.denominator != 1 or value < 0:
            raise _NotDerivable
        return type(a)(value)
    if a != b:
        raise _NotDerivable
    return a


def graphs_at(program: ExportedProgram, size: int, *, name: str | None = None,
              batch_dims: Mapping[str, int | None] | None = None) -> Callable[[int], GraphIR]:
    """The graph of a symbolic ``program`` (exported at the global batch ``size``) at
    any batch: lowered at ``size`` and its half, and at any other batch derived from
    those two (:class:`Derivation`) when every size of the program is linear in the
    batch — else, or where it cannot be derived, lowered."""
    def lowered(batch: int) -> GraphIR:
        return lower_at(program, batch, name=name, batch_dims=batch_dims)

    half = size // 2
    symbol = batch_symbol(program)
    if size % 2 or half < 2 or symbol is None or not linear_in_batch(functionalize(program), symbol):
        return lowered
    derivation: list[Derivation] = []

    def at(batch: int) -> GraphIR:
        if batch in (size, half):
            return lowered(batch)
        if not derivation:
            derivation.append(Derivation(lowered(size), size, lowered(half), half))
        return derivation[0].at(batch) or lowered(batch)

    return at


__all__ = ["Derivation", "derived_graph", "graphs_at", "linear_in_batch"]
