"""One export serves every batch: a program exported with a symbolic batch dimension,
and the concrete program at any batch cut from it.

:func:`hapd.export` with ``symbolic_batch=True`` (what ``hapd export`` writes) exports
the model once with one ``torch.export`` dimension, ``batch``, on every input's batch dim
(:func:`dynamic_shapes`). A model that cannot be exported so (its code specializes on
the batch size, or the example batch is 1) is exported at its example batch, and the
program says so (:class:`BatchInfo`: ``symbolic`` false and the reason), never silently.

:func:`program_at` gives the concrete program at a batch: the symbolic program is made
functional once (the expensive re-trace of :func:`hapd.ir.normalize.normalize`),
then each batch is one pass over its nodes (:func:`_concretize`) that substitutes the
batch into every shape and stride and turns the size computations (``sym_size``, their
products) into the integers they are at that batch, and drops the slices over a whole
dim that a static export never records (``x[:, 0]`` slices the batch dim whole first
when its length is symbolic); the rest of ``normalize`` then runs on the result. The
lowered graph is the one a fixed export at that batch lowers to — the same nodes, shapes
and graph id — so plans cached for either serve both. :func:`hapd.ir.lower.lower_at` lowers it; both
keep what they made on the program, so the micro-batch graphs of a pipeline search, the
half-batch graph of overlap and the runtime's programs are each made once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from hapd.ir.normalize import functionalize, normalize
from hapd.errors import ShapeError

BATCH_DIM = "batch"
"""Name of the symbolic batch dimension (``torch.export.Dim``)."""

_INFO = "_hapd_batch_info"
"""Attribute of an exported program: its :class:`BatchInfo`."""
_AT = "_hapd_programs_at"
"""Attribute of a symbolic program: batch → its concrete, normalized program."""
LOWERED_AT = "_hapd_lowered_at"
"""The attribute a program keeps its lowered graphs by batch under (:func:`hapd.ir.lower.lower_at`)."""
"""Attribute of a program: (batch, name, batch dims) → its lowered graph."""


@dataclass(frozen=True, kw_only=True)
class BatchInfo:
    """How a program's batch was exported."""

    size: int
    """The example batch it was exported with (the global batch of a training step)."""
    symbolic: bool
    """Whether its batch dim is symbolic (:func:`program_at` gives any batch)."""
    reason: str = ""
    """Why it is not symbolic: ``torch.export``'s reason, or ``"exported static"``."""

    def to_doc(self) -> dict[str, Any]:
        return {"batch": self.size, "symbolic_batch": self.symbolic, "static_reason": self.reason}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> BatchInfo | None:
        """The info :meth:`to_doc` wrote into a ``.pt2``'s metadata; ``None`` when absent
        (a program exported before hapd recorded it, or by ``torch.export`` alone)."""
        size = doc.get("batch")
        if isinstance(size, bool) or not isinstance(size, int):
            return None
        return cls(size=size, symbolic=bool(doc.get("symbolic_batch", False)), reason=str(doc.get("static_reason", "")))


def dynamic_shapes(example_inputs: Sequence[Any], batch_dims: Sequence[int | None]) -> tuple[Any, ...]:
    """``torch.export``'s ``dynamic_shapes`` for positional ``example_inputs``: one
    dimension, :data:`BATCH_DIM`, on each input's batch dim."""
    dim = torch.export.Dim(BATCH_DIM, min=1)
    return tuple({d: dim} if d is not None and isinstance(t, torch.Tensor) else None
                 for t, d in zip(example_inputs, batch_dims))


def set_batch_info(program: ExportedProgram, info: BatchInfo) -> None:
    setattr(program, _INFO, info)


def batch_info(program: ExportedProgram) -> BatchInfo | None:
    """How ``program``'s batch was exported (:func:`hapd.export` and loading a ``.pt2``
    it wrote record it); ``None`` when unknown. A program with a symbol in its inputs'
    shapes but no record is symbolic of unknown example batch (size 0)."""
    info = getattr(program, _INFO, None)
    if info is not None:
        return info
    if batch_symbol(program) is not None:
        return BatchInfo(size=0, symbolic=True)
    return None


def is_symbolic(program: Any) -> bool:
    """Whether ``program`` is an exported program with a symbolic batch dim."""
    if not isinstance(program, ExportedProgram):
        return False
    info = batch_info(program)
    return info is not None and info.symbolic


def _user_inputs(program: ExportedProgram) -> list[fx.Node]:
    users = {s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    return [n for n in program.graph.nodes if n.op == "placeholder" and n.name in users]


def batch_symbol(program: ExportedProgram) -> Any:
    """The sympy symbol of the batch dim (the one free symbol of the user inputs'
    shapes), ``None`` when every shape is static. :class:`ShapeError` for inputs with
    several symbols (hapd substitutes the batch alone)."""
    found = set()
    for node in _user_inputs(program):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for d in val.shape:
                if isinstance(d, torch.SymInt):
                    found |= d.node.expr.free_symbols
    if len(found) > 1:
        raise ShapeError(f"the program's inputs have several symbolic dims ({', '.join(sorted(map(str, found)))}); "
                         "hapd derives other batches of one symbolic batch dim")
    return next(iter(found), None)


def batch_of(program: ExportedProgram, shapes: Mapping[str, Sequence[int]]) -> int | None:
    """The batch at which ``program``'s symbolic batch dim takes the user inputs'
    ``shapes`` (input name → shape, e.g. a plan's tensors); ``None`` for a static
    program or when no named input has the batch dim."""
    symbol = batch_symbol(program)
    if symbol is None:
        return None
    for node in _user_inputs(program):
        val, shape = node.meta.get("val"), shapes.get(node.name)
        if not isinstance(val, torch.Tensor) or shape is None or len(shape) != val.dim():
            continue
        for d, size in zip(val.shape, shape):
            if isinstance(d, torch.SymInt) and d.node.expr == symbol:
                return int(size)
    return None


def program_at(program: ExportedProgram, batch: int) -> ExportedProgram:
    """The normalized (:func:`hapd.ir.normalize.normalize`) concrete program of
    ``program`` at global batch ``batch``. A static program is only its own batch:
    :class:`ShapeError` for another, with the reason it is static."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ShapeError(f"batch {batch!r} must be a positive integer")
    info = batch_info(program)
    symbol = batch_symbol(program)
    if symbol is None:
        if info is not None and info.size and info.size != batch:
            why = f" ({info.reason})" if info.reason else ""
            raise ShapeError(f"the program was exported at a static batch of {info.size}{why}: it has no graph at "
                             f"batch {batch}; export it with a symbolic batch or at that batch")
        return normalize(program)
    cache: dict[int, ExportedProgram] = getattr(program, _AT, None) or {}
    setattr(program, _AT, cache)
    if batch not in cache:
        concrete = _concretize(functionalize(program), symbol, batch)
        cache[batch] = normalize(concrete, functional=True)
    return cache[batch]


class _Substitution:
    """The batch substituted into symbolic sizes; each expression evaluated once."""

    def __init__(self, symbol: Any, batch: int):
        self.symbol = symbol
        self.batch = batch
        self.values: dict[Any, int] = {}

    def __call__(self, value: Any) -> Any:
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            expr = value.node.expr
            if expr not in self.values:
                out = expr.xreplace({self.symbol: self.batch}) if hasattr(expr, "xreplace") else expr
                if getattr(out, "free_symbols", None):
                    raise ShapeError(f"size {expr} depends on more than the batch dim ({', '.join(map(str, out.free_symbols))})")
                kind = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)]
                self.values[expr] = kind(out)
            return self.values[expr]
        return value


def _concretize(program: ExportedProgram, symbol: Any, batch: int) -> ExportedProgram:
    """``program`` (functional, symbolic) with ``batch`` for its batch symbol: a new
    graph whose values have concrete shapes, whose size computations are constants and
    whose whole-dim slices are gone."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    sub = _Substitution(symbol, batch)
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def concrete(val: Any) -> Any:
        if isinstance(val, torch.Tensor):
            shape = [sub(d) for d in val.shape]
            stride = [sub(s) for s in val.stride()]
            meta = torch.empty_strided(shape, stride, dtype=val.dtype, device="meta")
            return FakeTensor(mode, meta, val.device)
        if isinstance(val, (list, tuple)):
            return type(val)(concrete(v) for v in val)
        return sub(val)

    graph = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for node in program.graph.nodes:
        val = node.meta.get("val")
        if node.op == "call_function" and isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            env[node] = sub(val)  # a size computed from shapes: a constant at this batch
            continue
        new_val = concrete(val) if val is not None else None
        if node.op == "call_function" and _whole_slice(node, new_val, env):
            env[node] = env[node.args[0]]
            continue
        if node.op == "output":
            new = graph.output(fx.node.map_arg(node.args[0], lambda n: env[n]))
        else:
            new = graph.node_copy(node, lambda n: env[n])
            new.args = fx.node.map_aggregate(new.args, sub)
            new.kwargs = fx.node.map_aggregate(new.kwargs, sub)
        new.meta = dict(node.meta)
        new.meta.pop("tensor_meta", None)
        if val is not None:
            new.meta["val"] = new_val
        env[node] = new
    out = ExportedProgram(  # the module of graph made once, with program's attributes (code generated once)
        root=program.graph_module, graph=graph, graph_signature=program.graph_signature, state_dict=program.state_dict,
        range_constraints={}, module_call_graph=program.module_call_graph, example_inputs=None,
        constants=program.constants, verifiers=program.verifiers,
    )
    out.graph_module.meta.update(program.graph_module.meta)
    return out


def _whole_slice(node: fx.Node, val: Any, env: Mapping[fx.Node, Any]) -> bool:
    """A slice with step 1 from 0 over the whole of a symbolic dim: the identity, which
    a static export does not record (indexing ``x[:, 0]`` slices the batch dim whole
    first when its length is symbolic; a whole slice of a static dim, ``table[:seq]``,
    is recorded by both and kept)."""
    if node.target is not torch.ops.aten.slice.Tensor or not isinstance(node.args[0], fx.Node):
        return False
    source_val = node.args[0].meta.get("val")
    new_source = env.get(node.args[0])
    new_val = new_source.meta.get("val") if isinstance(new_source, fx.Node) else None
    if not all(isinstance(v, torch.Tensor) for v in (source_val, new_val, val)):
        return False
    named = dict(zip(("self", "dim", "start", "end", "step"), node.args))
    named.update(node.kwargs)
    dim, start, step = named.get("dim", 0), named.get("start"), named.get("step", 1)
    if not isinstance(dim, int) or not -source_val.dim() <= dim < source_val.dim():
        return False
    return (isinstance(source_val.shape[dim], torch.SymInt) and start in (None, 0) and step in (None, 1)
            and list(new_val.shape) == list(val.shape))


def program_batch(program: ExportedProgram, batch_dims: Sequence[int | None] | None = None) -> int | None:
    """The batch of a static ``program``: its first user input's size along its batch
    dim (``batch_dims``, one per user input, default 0); None for a symbolic program or
    one without such an input."""
    if is_symbolic(program):
        return None
    for k, node in enumerate(_user_inputs(program)):
        d = batch_dims[k] if batch_dims is not None and k < len(batch_dims) else 0
        val = node.meta.get("val")
        if d is not None and isinstance(val, torch.Tensor) and val.dim() > d:
            return int(val.shape[d])
    return None


def micro_batches(batch: int, counts: Sequence[int]) -> dict[int, int]:
    """Micro-batch count → micro-batch size, for the ``counts`` that divide ``batch``."""
    return {m: batch // m for m in counts if m >= 1 and batch % m == 0}


def half_batch(batch: int) -> int:
    """One duplica's batch of an overlapped run; :class:`ShapeError` for an odd batch."""
    if batch % 2:
        raise ShapeError(f"overlapped execution cuts the batch in two halves; batch {batch} is odd")
    return batch // 2


__all__ = ["BATCH_DIM", "BatchInfo", "batch_info", "batch_of", "batch_symbol", "dynamic_shapes", "half_batch", "is_symbolic",
           "micro_batches", "program_at", "program_batch", "set_batch_info"]
