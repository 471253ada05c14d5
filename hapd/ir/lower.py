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
import re
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import msgpack
import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from hapd.ir import experts as _experts  # noqa: F401 - registers hapd::routed_experts, which programs may call
from hapd.ir.flops import FlopCounter
from hapd.ir.normalize import buffer_mutations, mark_functional, normalize
from hapd.ir.op_facts import LOSS_OPS, REDUCTIONS
from hapd.ir.saved import SavedActivations, saved_activations
from hapd.ir.shapes import LOWERED_AT, BatchInfo, batch_info, program_at, set_batch_info
from hapd.ir.tied import unread_aliases
from hapd.errors import ExportError, GraphError, GraphFormatError
from hapd.util import atomic_write, gc_paused

_log = logging.getLogger(__name__)

GRAPH_FORMAT = "hapd.graph"
GRAPH_VERSION = 1

_SOURCE_KINDS = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.CONSTANT_TENSOR: "constant",
    InputKind.USER_INPUT: "input",
}


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
        """The decoded document (a fresh copy each call); :class:`GraphFormatError` for
        bytes that are not one msgpack document."""
        try:
            return msgpack.unpackb(self.data, raw=False, strict_map_key=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
            raise GraphFormatError(f"not a graph IR document: {type(exc).__name__}: {exc}") from exc

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
    batch: int | None = None,
) -> GraphIR:
    """Lower an exported program (or a ``.pt2`` path) to the graph IR: its functional
    form (:func:`hapd.ir.normalize.normalize`, which the runtime replays too), with
    the buffers it updates as ``mutations``.

    ``batch_dims`` maps user-input names to their batch dim (``None``: no batch dim);
    inputs not named get dim 0. A ``.pt2`` written by :func:`hapd.export` carries the
    model name and batch dims itself. A program with a symbolic batch
    (:mod:`hapd.ir.shapes`) is lowered at ``batch`` (default: the batch it was
    exported with); a static one only at its own.
    """
    if not isinstance(program, ExportedProgram):
        program, stored = load_exported(program)
        name = name or stored.get("name")
        batch_dims = batch_dims if batch_dims is not None else stored.get("batch_dims")
    apply_frozen_mark(program)
    info = batch_info(program)
    if info is not None and info.symbolic:
        at = batch if batch is not None else info.size
        if not at:
            raise ExportError("the program's batch dim is symbolic and its example batch unknown: pass batch=")
        program = program_at(program, at)
    elif batch is not None:
        program = program_at(program, batch)  # its own batch, else a ShapeError saying it is static
    program = normalize(program)
    try:
        doc = _Lowering(program, name or "model", dict(batch_dims or {}), saved_activations(program)).run()
    except ExportError:
        raise
    except Exception as exc:  # a torch internals change must not surface as a bare KeyError
        raise ExportError(f"cannot lower the exported program: {type(exc).__name__}: {exc}") from exc
    return GraphIR(canonical_bytes(doc))


EXTRA_FILE = "hapd.json"
"""Name of the extra file in a ``.pt2`` where hapd keeps the model name, the batch dims
and the frozen parameters."""

FUNCTIONAL_KEY = "functional"
"""Key of :data:`EXTRA_FILE`: true when the program is its functional form already
(:func:`hapd.ir.normalize.mark_functional`; :func:`hapd.export` saves it so)."""

FROZEN_KEY = "frozen"
"""Key of :data:`EXTRA_FILE` listing the parameters that do not train: ``torch.export``
saves a parameter's values but not its ``requires_grad``, and loads every parameter
trainable."""


def frozen_parameters(program: ExportedProgram) -> list[str]:
    """Names of ``program``'s parameters that do not train (``requires_grad=False``),
    sorted: what :func:`hapd.export` records beside the program in a ``.pt2``."""
    state = program.state_dict
    return sorted(name for name in program.graph_signature.parameters
                  if name in state and not state[name].requires_grad)


FROZEN_META = "hapd_frozen"
"""Key in the ``meta["custom"]`` of a program's first op node where :func:`hapd.export`
records the frozen parameters in the program itself: ``torch.export.save`` serializes a
node's custom meta (not ``requires_grad``), so a program saved by hapd and loaded with
``torch.export.load`` rather than hapd's loader still says what does not train."""


def _first_op(program: ExportedProgram) -> torch.fx.Node | None:
    return next((n for n in program.graph.nodes if n.op == "call_function"), None)


def mark_frozen(program: ExportedProgram) -> None:
    """Record ``program``'s frozen parameters in the program (:data:`FROZEN_META`)."""
    first = _first_op(program)
    if first is not None:
        custom = dict(first.meta.get("custom") or {})
        custom[FROZEN_META] = frozen_parameters(program)
        first.meta["custom"] = custom


def apply_frozen_mark(program: ExportedProgram) -> None:
    """Freeze the parameters the program's own record names (:data:`FROZEN_META`): a
    program hapd exported, loaded by ``torch.export.load``, comes back with every
    parameter trainable. A program without the record is left as it is."""
    first = _first_op(program)
    frozen = (first.meta.get("custom") or {}).get(FROZEN_META) if first is not None else None
    if frozen is not None:
        restore_frozen(program, frozen, "the program's own record of its frozen parameters")


def restore_frozen(program: ExportedProgram, frozen: Any, path: str | Path) -> None:
    """Freeze the parameters ``frozen`` names (a loaded ``.pt2``'s record, see
    :data:`FROZEN_KEY`) in ``program``'s state dict. :class:`GraphFormatError` for a
    record that is not a list of names, or names a parameter the program does not have."""
    if not isinstance(frozen, list) or not all(isinstance(name, str) for name in frozen):
        raise GraphFormatError(f"{path}: {EXTRA_FILE}: {FROZEN_KEY!r} is not a list of parameter names: {frozen!r}")
    parameters = set(program.graph_signature.parameters)
    unknown = sorted(name for name in frozen if name not in parameters or name not in program.state_dict)
    if unknown:
        raise GraphFormatError(f"{path}: {EXTRA_FILE} names frozen parameters the program does not have: "
                               f"{', '.join(unknown[:5])}{' …' if len(unknown) > 5 else ''}")
    for name in frozen:
        program.state_dict[name].requires_grad_(False)


def load_exported(path: str | Path) -> tuple[ExportedProgram, dict[str, Any]]:
    """``torch.export.load`` with a clear error: :class:`GraphFormatError` for a file
    that is no program archive, :class:`ExportError` with torch's own reason (which
    torch logs rather than raises) for an archive it cannot load, such as a program
    whose custom op no imported module registers. Returns the program and hapd's
    metadata stored beside it (empty when absent); the parameters that metadata names
    frozen come back with ``requires_grad=False``, as the exported model had them (a
    ``.pt2`` without it, saved by ``torch.export.save`` alone, loads every parameter
    trainable)."""
    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise GraphFormatError(f"{path}: the file is empty")
    extra = {EXTRA_FILE: ""}
    with _TorchLog() as torch_log, warnings.catch_warnings():
        # torch reads weights from a read-only buffer and says so on every load
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        try:
            program = torch.export.load(path, extra_files=extra)
        except Exception as exc:
            raise _load_error(path, exc, torch_log.reason()) from exc
    try:
        stored = json.loads(extra[EXTRA_FILE]) if extra[EXTRA_FILE] else {}
    except ValueError as exc:
        raise GraphFormatError(f"{path}: unreadable {EXTRA_FILE} ({exc})") from exc
    stored = stored if isinstance(stored, dict) else {}
    restore_frozen(program, stored.get(FROZEN_KEY, []), path)
    if stored.get(FUNCTIONAL_KEY) is True:
        mark_functional(program)
    info = BatchInfo.from_doc(stored)
    if info is not None:
        set_batch_info(program, info)
    return program, stored


def _load_error(path: Path, exc: Exception, reason: str | None) -> GraphError:
    """The error for a failed load: what torch said, and what to do about a custom op."""
    said = f"{type(exc).__name__}: {exc}"
    if not zipfile.is_zipfile(path):
        return GraphFormatError(f"{path}: not a torch.export program ({said})")
    message = f"{path}: torch cannot load the exported program: {reason or said}"
    if reason and "custom op" in reason:
        message += " (pass --import MODULE for the module that registers it, or import it before loading)"
    return ExportError(message)


_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?\w*(?:Error|Exception): .+")
"""The last line of a logged traceback: ``torch._export.serde.serialize.SerializeError: …``."""

_MAX_REASON = 600
"""Characters of torch's reason kept in a message (torch appends the whole node)."""


class _TorchLog(logging.Handler):
    """Captures what ``torch.export`` logs while a program loads (torch logs the reason
    of a failed load and raises only "check the warnings above"), instead of letting it
    reach stderr; on success the records go to hapd's log at debug level."""

    LOGGERS = ("torch.export", "torch._export", "torch._export.serde.serialize")  # the last has a handler of its own

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.records: list[logging.LogRecord] = []
        self._saved: list[tuple[logging.Logger, list[logging.Handler], bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> "_TorchLog":
        # torch gives torch.export its own stderr handler: it is swapped out, not added to
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            self._saved.append((logger, list(logger.handlers), logger.propagate))
            logger.handlers = [self]
            logger.propagate = False
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for logger, handlers, propagate in self._saved:
            logger.handlers = handlers
            logger.propagate = propagate
        if exc_info[0] is None:
            for record in self.records:
                _log.debug("torch.export.load: %s", record.getMessage())

    def reason(self) -> str | None:
        """The last exception line torch logged, else its last warning."""
        # the record's text with any traceback it carries (torch ≥ 2.15 logs the cause there)
        lines = [line for record in self.records for line in logging.Formatter().format(record).splitlines()]
        errors = [line.strip() for line in lines if _ERROR_LINE.match(line)]
        text = errors[-1] if errors else (lines[-1].strip() if lines else "")
        if not text:
            return None
        text = text.split(" Unsupported target type for node ", 1)[0]
        return text if len(text) <= _MAX_REASON else text[: _MAX_REASON - 1] + "…"


def _output_keys(program: ExportedProgram) -> tuple[str, list[str]] | None:
    """(type name, keys) of a forward that returns a dict or a ``ModelOutput`` (a
    pytree node with keys), else None."""
    spec = getattr(getattr(program, "call_spec", None), "out_spec", None)
    context = getattr(spec, "context", None)
    if spec is None or not isinstance(context, (list, tuple)) or not all(isinstance(k, str) for k in context):
        return None
    return getattr(spec.type, "__name__", str(spec.type)), list(context)


def _returned(program: ExportedProgram, count: int) -> str:
    """What the forward returns, for an error: ``a dict with 'loss', 'logits'``, else ``2 outputs``."""
    found = _output_keys(program)
    if found is None:
        return f"{count} outputs" if count != 1 else "a tensor"
    kind, keys = found
    return f"{'a dict' if kind == 'dict' else f'a {kind}'} with {', '.join(map(repr, keys))}"


def _loss_advice(program: ExportedProgram) -> str:
    """How to return the loss instead (``return `out.loss```) when the model gives one."""
    found = _output_keys(program)
    if found is None:
        return " (compute the loss in forward from the labels among its inputs)"
    kind, keys = found
    suffix = "['loss']" if kind == "dict" else ".loss"
    access = f"out{suffix}"
    if "loss" in keys:
        return f": return `{access}` (e.g. a wrapper whose forward is `return self.model(...){suffix}`)"
    return f": pass the labels so that it computes a loss, and return `{access}`"


class _Lowering:
    """One pass over the exported graph; nodes become IR nodes in graph order."""

    def __init__(
        self, program: ExportedProgram, name: str, batch_dims: dict[str, int | None], saved: SavedActivations | None
    ):
        self.program = program
        self.saved = saved
        """what the backward pass keeps (``None``: not traced; the core then assumes every
        result with a gradient)"""
        self.name = name
        self.batch_dims = batch_dims
        self.nodes: list[dict[str, Any]] = []
        # fx node -> [node index, output index] (a single-result node), or the index of a
        # tuple-returning node whose results are picked by getitem
        self.refs: dict[torch.fx.Node, list[int]] = {}
        self.tuples: dict[torch.fx.Node, int] = {}
        self.sources = {spec.arg.name: spec for spec in program.graph_signature.input_specs}
        self.tied_away = unread_aliases(program)
        """names of tied tensors the graph reads under another name (left out: one source)"""
        self.flops = FlopCounter()

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
        doc = {
            "format": GRAPH_FORMAT,
            "version": GRAPH_VERSION,
            "name": self.name,
            "nodes": self.nodes,
            "loss": loss,
            "mutations": self._mutations(),
            "loss_reduction": self._loss_reduction(loss),
            "torch_version": torch.__version__.split("+")[0],
        }
        if self.saved is not None:
            doc["saved_traced"] = True
        return doc

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
        if spec is not None and spec.target in self.tied_away and not node.users:
            return  # a tied parameter's other name: the tensor is the source the graph reads
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
        self._mark_saved(index, node.name)
        self.refs[node] = [index, 0]

    def _op(self, node: torch.fx.Node) -> None:
        inputs: list[list[int]] = []
        args = [{"name": n, "value": self._value(node, v, inputs)} for n, v in _schema_args(node)]
        val = node.meta.get("val")
        if isinstance(val, (tuple, list)):
            outputs = [_tensor_meta(node, v, name=f"{node.name}[{i}]") for i, v in enumerate(val)]
        else:
            outputs = [_tensor_meta(node, val)]
        ir_node = {
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
        tags = op_tags(node.target)
        if tags:
            ir_node["tags"] = tags
        flops = self.flops(node)
        if flops > 0:
            ir_node["flops"] = flops
        block = module_block(node)
        if block is not None:
            ir_node["block"] = block
        index = self._append(ir_node)
        self._mark_saved(index, node.name)
        if isinstance(val, (tuple, list)):
            self.tuples[node] = index
        else:
            self.refs[node] = [index, 0]

    def _mark_saved(self, index: int, fx_name: str) -> None:
        """Record on IR node ``index`` which of its results the backward pass keeps
        (``saved``), the bytes it keeps that are no node's result (``saved_bytes``) and
        those it keeps beyond when hapd's generator draws its dropout
        (``counter_saved_bytes``)."""
        if self.saved is None:
            return
        outputs = self.saved.outputs.get(fx_name)
        if outputs:
            self.nodes[index]["saved"] = sorted(outputs)
        internal = self.saved.internal.get(fx_name, 0.0)
        if internal > 0:
            self.nodes[index]["saved_bytes"] = float(internal)
        counter = self.saved.counter.get(fx_name, 0.0)
        if counter > 0:
            self.nodes[index]["counter_saved_bytes"] = float(counter)

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
                f"the model returns {_returned(self.program, len(user))}; hapd trains a forward that returns the "
                f"scalar loss{_loss_advice(self.program)}"
            )
        _, arg = user[0]
        ref = self.refs.get(arg) if isinstance(arg, torch.fx.Node) else None
        if ref is None:
            raise ExportError(f"the model output {arg!r} is not a tensor computed by the graph")
        meta = self.nodes[ref[0]]["outputs"][ref[1]]
        if meta["shape"]:
            raise ExportError(f"the model returns {_returned(self.program, 1)} of shape {meta['shape']}; hapd needs "
                              f"the scalar loss{_loss_advice(self.program)}")
        return ref

    def _mutations(self) -> list[dict[str, Any]]:
        """Each buffer the step updates, with the op result that is its new value (an
        effect the core must keep: it computes the value and holds it whole at the end)."""
        by_name = {node.name: node for node in self.refs}
        out = []
        for target, value in buffer_mutations(self.program):
            node = by_name.get(value)
            ref = self.refs.get(node) if node is not None else None
            if ref is None or self.nodes[ref[0]]["kind"] != "op":
                raise ExportError(
                    f"buffer {target} is set to {value}, which is not a tensor computed by the graph", node=value
                )
            out.append({"target": target, "value": ref})
        return out

    def _loss_reduction(self, loss: list[int]) -> str:
        node = self.nodes[loss[0]]
        op = node["op"]
        if op in LOSS_OPS:
            for arg in node["args"]:
                if arg["name"] == "reduction":
                    reduction = REDUCTIONS.get(arg["value"].get("i"), "unknown")
                    return reduction if reduction in ("sum", "mean") else "unknown"
            return "mean"  # the schema default
        if op.startswith("aten.sum"):
            return "sum"
        if op.startswith("aten.mean"):
            return "mean"
        return "unknown"


_RECORDED_TAGS = {torch.Tag.pointwise: "pointwise", torch.Tag.nondeterministic_seeded: "nondeterministic_seeded"}
"""torch's op tags the core's rules read (an op tagged pointwise is element-wise; one
that draws random numbers is not split), and their names in the IR."""


def op_tags(target: Any) -> list[str]:
    """The IR names of the :data:`_RECORDED_TAGS` torch gives the op ``target``, sorted
    (none for callables that are not ATen overloads)."""
    if not isinstance(target, torch._ops.OpOverload):  # noqa: SLF001 - the public type of torch.ops.* overloads
        return []
    return sorted(name for tag, name in _RECORDED_TAGS.items() if tag in target.tags)


_INDEXED = re.compile(r"(?:^|\.)\d+$")
"""A module path whose last part is an index (``blocks.3``: a child of a ModuleList or
Sequential)."""


def module_block(node: torch.fx.Node) -> str | None:
    """The repeated block ``node`` runs in: the outermost module of its module stack
    held at an index of a container (``model.layers.3`` for an op of a decoder layer,
    ``layer2.1`` for one of a ResNet block), ``None`` outside such modules. The unit
    activation recomputation works in (``CompileOptions.recompute``)."""
    stack = node.meta.get("nn_module_stack") or {}
    for entry in stack.values():
        path = entry[0] if isinstance(entry, (tuple, list)) and entry else None
        if isinstance(path, str) and _INDEXED.search(path):
            return path
    return None


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


@gc_paused()
def lower_at(program: ExportedProgram, batch: int, *, name: str | None = None,
             batch_dims: Mapping[str, int | None] | None = None) -> GraphIR:
    """The graph IR of :func:`~hapd.ir.shapes.program_at` (kept on ``program``:
    asked again, the same :class:`GraphIR`)."""
    key = (batch, name, tuple(sorted((batch_dims or {}).items())))
    cache: dict[Any, Any] = getattr(program, LOWERED_AT, None) or {}
    setattr(program, LOWERED_AT, cache)
    if key not in cache:
        cache[key] = lower(program_at(program, batch), name=name, batch_dims=batch_dims)
    return cache[key]
