"""Lowering a ``torch.export`` program to hapd's graph IR (``.hapg``).

The IR is the only thing the Rust core reads (schema: ``docs/formats.md``). Lowering
keeps every schema argument of every ATen op, the fx node name of every result, the
shapes and dtypes FakeTensor propagation computed, and where parameters, buffers and
user inputs come from. Maps are written with sorted keys and floats as float64, so the
bytes are canonical and the **graph id** (sha256 of the bytes) is the same for the same
model and shapes on every machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import operator
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import msgpack
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from hapd.errors import ExportError, GraphFormatError
from hapd.util import atomic_write

GRAPH_FORMAT = "hapd.graph"
GRAPH_VERSION = 1

_SOURCE_KINDS = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
    InputKind.USER_INPUT: "input",
}

# reduction enum of aten's loss ops
_LOSS_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


@dataclass(frozen=True)
class GraphIR:
    """A lowered graph: its canonical bytes, and the decoded map for Python callers."""

    data: bytes
    """Canonical msgpack bytes (what a ``.hapg`` file holds)."""

    @property
    def graph_id(self) -> str:
        """sha256 of the canonical bytes, hex."""
        return hashlib.sha256(self.data).hexdigest()

    @property
    def doc(self) -> dict[str, Any]:
        """The decoded document (a fresh copy each call)."""
        return msgpack.unpackb(self.data, raw=False, strict_map_key=False)

    def save(self, path: str | Path) -> Path:
        """Write the IR atomically (see :func:`hapd.util.atomic_write`) and return the path."""
        return atomic_write(path, self.data)

    @classmethod
    def load(cls, path: str | Path) -> "GraphIR":
        """Read a ``.hapg`` file; its contents are validated by the core on use."""
        return cls(Path(path).read_bytes())


def canonical_bytes(doc: Mapping[str, Any]) -> bytes:
    """msgpack with map keys sorted at every level and floats as float64."""
    return msgpack.packb(_sorted(doc), use_bin_type=True, use_single_float=False)


def _sorted(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _sorted(obj[k]) for k in sorted(obj)}
    if isinstance(obj, (list, tuple)):
        return [_sorted(v) for v in obj]
    return obj


def canonical_op_name(target: Any) -> str:
    """``aten.linear`` for ``torch.ops.aten.linear.default``; the overload is kept
    unless it is ``default`` (``aten.add.Tensor``). Non-ATen callables get a
    ``python.`` name and become opaque ops."""
    if isinstance(target, torch._ops.OpOverload):  # noqa: SLF001 - the public type of torch.ops.* overloads
        namespace, rest = target.name().split("::", 1)
        name, _, overload = rest.partition(".")
        overload = overload or target._overloadname  # noqa: SLF001
        return f"{namespace}.{name}" if overload in ("", "default") else f"{namespace}.{name}.{overload}"
    module = getattr(target, "__module__", None) or "python"
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"python.{module}.{qualname}"


def lower(
    program: ExportedProgram | str | Path,
    *,
    name: str | None = None,
    batch_dims: Mapping[str, int | None] | None = None,
) -> GraphIR:
    """Lower an exported program (or a ``.pt2`` path) to the graph IR.

    ``batch_dims`` maps user-input names to their batch dim (``None``: no batch dim);
    inputs not named get dim 0. A ``.pt2`` written by :func:`hapd.export` carries the
    model name and batch dims itself.
    """
    if not isinstance(program, ExportedProgram):
        program, stored = load_exported(program)
        name = name or stored.get("name")
        batch_dims = batch_dims if batch_dims is not None else stored.get("batch_dims")
    try:
        doc = _Lowering(program, name or "model", dict(batch_dims or {})).run()
    except ExportError:
        raise
    except Exception as exc:  # a torch internals change must not surface as a bare KeyError
        raise ExportError(f"cannot lower the exported program: {type(exc).__name__}: {exc}") from exc
    return GraphIR(canonical_bytes(doc))


EXTRA_FILE = "hapd.json"
"""Name of the extra file in a ``.pt2`` where hapd keeps the model name and batch dims."""


def load_exported(path: str | Path) -> tuple[ExportedProgram, dict[str, Any]]:
    """``torch.export.load`` with a clear error for files that are not exported programs;
    returns the program and hapd's metadata stored beside it (empty when absent)."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise GraphFormatError(f"{path}: the file is empty")
    extra = {EXTRA_FILE: ""}
    export_log = logging.getLogger("torch.export")
    level = export_log.level
    try:
        with warnings.catch_warnings():
            # torch reads weights from a read-only buffer and says so on every load
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            # and logs a warning for a file that is no archive before failing: the
            # GraphFormatError below says it once
            export_log.setLevel(logging.ERROR)
            program = torch.export.load(path, extra_files=extra)
    except Exception as exc:
        raise GraphFormatError(f"{path}: not a torch.export program ({type(exc).__name__}: {exc})") from exc
    finally:
        export_log.setLevel(level)
    try:
        stored = json.loads(extra[EXTRA_FILE]) if extra[EXTRA_FILE] else {}
    except ValueError as exc:
        raise GraphFormatError(f"{path}: unreadable {EXTRA_FILE} ({exc})") from exc
    return program, stored if isinstance(stored, dict) else {}


class _Lowering:
    """One pass over the exported graph; nodes become IR nodes in graph order."""

    def __init__(self, program: ExportedProgram, name: str, batch_dims: dict[str, int | None]):
        self.program = program
        self.name = name
        self.batch_dims = batch_dims
        self.nodes: list[dict[str, Any]] = []
        # fx node -> [node index, output index] (a single-result node), or the index of a
        # tuple-returning node whose results are picked by getitem
        self.refs: dict[torch.fx.Node, list[int]] = {}
        self.tuples: dict[torch.fx.Node, int] = {}
        self.sources = {spec.arg.name: spec for spec in program.graph_signature.input_specs}

    def run(self) -> dict[str, Any]:
        loss = None
        for node in self.program.graph.nodes:
            if node.op == "placeholder":
                self._source(node)
            elif node.op == "call_function":
                if node.target is operator.getitem and node.args[0] in self.tuples:
                    self._getitem(node)
                else:
                    self._op(node)
            elif node.op == "output":
                loss = self._loss(node)
            else:
                raise ExportError(f"node {node.name}: unexpected fx node kind {node.op!r}")
        if loss is None:
            raise ExportError("the exported graph has no output")
        self._name_tuple_ops()
        return {
            "format": GRAPH_FORMAT,
            "version": GRAPH_VERSION,
            "name": self.name,
            "nodes": self.nodes,
            "loss": loss,
            "loss_reduction": self._loss_reduction(loss),
            "torch_version": torch.__version__.split("+")[0],
        }

    def _name_tuple_ops(self) -> None:
        """A tuple-returning op is named after its first result picked by getitem:
        ``torch.export.save``/``load`` renames such fx nodes (``topk`` → ``topk_default``)
        but keeps getitem names, so the graph id survives a round trip through a .pt2."""
        for fx_node, index in self.tuples.items():
            ir_node = self.nodes[index]
            picked = [o["name"] for o in ir_node["outputs"] if not o["name"].startswith(f"{fx_node.name}[")]
            if not picked:
                continue
            ir_node["name"] = picked[0]
            for i, out in enumerate(ir_node["outputs"]):
                if out["name"] == f"{fx_node.name}[{i}]":
                    out["name"] = f"{picked[0]}[{i}]"

    def _append(self, node: dict[str, Any]) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def _source(self, node: torch.fx.Node) -> None:
        spec = self.sources.get(node.name)
        kind = _SOURCE_KINDS.get(spec.kind) if spec is not None else None
        if kind is None:
            raise ExportError(f"node {node.name}: unsupported input kind {getattr(spec, 'kind', None)}")
        meta = _tensor_meta(node, node.meta.get("val"))
        if meta["dtype"] == "none":
            raise ExportError(f"node {node.name}: input is not a tensor (hapd needs static tensor inputs)")
        requires_grad = False
        if kind == "parameter":
            param = self.program.state_dict.get(spec.target)
            requires_grad = bool(param is not None and param.requires_grad)
        batch_dim = None
        if kind == "input":
            batch_dim = self.batch_dims.get(node.name, 0 if meta["shape"] else None)
            if batch_dim is not None and not 0 <= batch_dim < len(meta["shape"]):
                raise ExportError(f"input {node.name}: batch dim {batch_dim} out of range for shape {meta['shape']}")
        index = self._append(
            {
                "name": node.name,
                "kind": kind,
                "op": "",
                "target": spec.target if spec.target is not None else node.name,
                "inputs": [],
                "args": [],
                "outputs": [meta],
                "requires_grad": requires_grad,
                "batch_dim": batch_dim,
            }
        )
        self.refs[node] = [index, 0]

    def _op(self, node: torch.fx.Node) -> None:
        inputs: list[list[int]] = []
        args = [{"name": n, "value": self._value(node, v, inputs)} for n, v in _schema_args(node)]
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            outputs = [_tensor_meta(node, v, name=f"{node.name}[{i}]") for i, v in enumerate(val)]
        else:
            outputs = [_tensor_meta(node, val)]
        index = self._append(
            {
                "name": node.name,
                "kind": "op",
                "op": canonical_op_name(node.target),
                "target": "",
                "inputs": inputs,
                "args": args,
                "outputs": outputs,
                "requires_grad": False,
                "batch_dim": None,
            }
        )
        if isinstance(val, (tuple, list)):
            self.tuples[node] = index
        else:
            self.refs[node] = [index, 0]

    def _getitem(self, node: torch.fx.Node) -> None:
        producer = self.tuples[node.args[0]]
        k = node.args[1]
        outputs = self.nodes[producer]["outputs"]
        if not isinstance(k, int) or not 0 <= k < len(outputs):
            raise ExportError(f"node {node.name}: getitem {k!r} out of range for {self.nodes[producer]['name']}")
        outputs[k]["name"] = node.name
        self.refs[node] = [producer, k]

    def _value(self, node: torch.fx.Node, value: Any, inputs: list[list[int]]) -> dict[str, Any]:
        if isinstance(value, torch.fx.Node):
            ref = self.refs.get(value)
            if ref is None:
                raise ExportError(f"node {node.name}: operand {value.name} is not a single tensor")
            inputs.append(ref)
            return {"t": len(inputs) - 1}
        if isinstance(value, bool):
            return {"b": value}
        if isinstance(value, int):
            return {"i": value}
        if isinstance(value, float):
            return {"f": value}
        if isinstance(value, str):
            return {"s": value}
        if value is None:
            return {"n": None}
        if isinstance(value, (list, tuple)):
            return {"l": [self._value(node, v, inputs) for v in value]}
        if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
            return {"s": str(value)}
        if isinstance(value, torch.SymInt):
            raise ExportError(f"node {node.name}: dynamic shapes are not supported (symbolic {value})")
        return {"s": repr(value)}

    def _loss(self, node: torch.fx.Node) -> list[int]:
        user = [
            (spec, arg)
            for spec, arg in zip(self.program.graph_signature.output_specs, node.args[0])
            if spec.kind == OutputKind.USER_OUTPUT
        ]
        if len(user) != 1:
            raise ExportError(
                f"the model returns {len(user)} outputs; hapd trains a forward that returns the scalar loss"
            )
        _, arg = user[0]
        ref = self.refs.get(arg) if isinstance(arg, torch.fx.Node) else None
        if ref is None:
            raise ExportError(f"the model output {arg!r} is not a tensor computed by the graph")
        meta = self.nodes[ref[0]]["outputs"][ref[1]]
        if meta["shape"]:
            raise ExportError(f"the model returns shape {meta['shape']}; hapd needs a scalar loss")
        return ref

    def _loss_reduction(self, loss: list[int]) -> str:
        node = self.nodes[loss[0]]
        op = node["op"]
        if op in ("aten.cross_entropy_loss", "aten.nll_loss", "aten.nll_loss_forward", "aten.mse_loss"):
            for arg in node["args"]:
                if arg["name"] == "reduction":
                    reduction = _LOSS_REDUCTIONS.get(arg["value"].get("i"), "unknown")
                    return reduction if reduction in ("sum", "mean") else "unknown"
            return "mean"  # the schema default
        if op.startswith("aten.sum"):
            return "sum"
        if op.startswith("aten.mean"):
            return "mean"
        return "unknown"


def _schema_args(node: torch.fx.Node) -> Sequence[tuple[str, Any]]:
    """Every schema argument of an OpOverload call, defaults filled in, in schema order.
    Other callables get their positional args as ``arg0…`` and their kwargs by name."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):  # noqa: SLF001
        out = []
        for i, arg in enumerate(target._schema.arguments):  # noqa: SLF001
            if i < len(node.args) and not arg.kwarg_only:
                out.append((arg.name, node.args[i]))
            elif arg.name in node.kwargs:
                out.append((arg.name, node.kwargs[arg.name]))
            elif arg.has_default_value():
                out.append((arg.name, arg.default_value))
            else:
                out.append((arg.name, None))
        return out
    return [(f"arg{i}", a) for i, a in enumerate(node.args)] + sorted(node.kwargs.items())


def _tensor_meta(node: torch.fx.Node, val: Any, *, name: str | None = None) -> dict[str, Any]:
    if isinstance(val, torch.Tensor):
        shape = []
        for d in val.shape:
            if not isinstance(d, int):
                raise ExportError(f"node {node.name}: dynamic dimension {d} (hapd needs static shapes)")
            shape.append(int(d))
        return {"name": name or node.name, "shape": shape, "dtype": str(val.dtype).removeprefix("torch.")}
    return {"name": name or node.name, "shape": [], "dtype": "none"}
