"""Front end: a module and example inputs → a ``torch.export`` program (``.pt2``)."""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import logging
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

from hapd.errors import ExportError
from hapd.ir import experts
from hapd.ir.fake import model_faked
from hapd.ir.kept import GRAPHS_FILE, kept_graphs
from hapd.ir.lower import EXTRA_FILE, FROZEN_KEY, FUNCTIONAL_KEY, frozen_parameters, mark_frozen
from hapd.ir.normalize import functionalize, is_functional, mark_functional
from hapd.ir.shapes import BatchInfo, batch_info, dynamic_shapes, set_batch_info
from hapd.util import atomic_file

_log = logging.getLogger(__name__)


def export(
    model: torch.nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    path: str | Path | None = None,
    batch_dims: Sequence[int | None] | None = None,
    name: str | None = None,
    training: bool = True,
    symbolic_batch: bool = False,
) -> ExportedProgram:
    """Export ``model`` (whose forward returns the scalar loss) in training mode, or in
    eval mode with ``training=False`` (dropout is the identity, batch norm uses its
    running statistics); the model is left in that mode.

    ``batch_dims[i]`` is the batch dim of ``example_inputs[i]`` (default 0 for every
    input). With ``path`` the program is saved with ``torch.export.save``, together with
    the model name and batch dims, so that dropping the file into a watched folder is
    enough for hapd to compile it, and the names of the frozen parameters
    (``requires_grad=False``), which ``torch.export`` does not save: loaded by hapd
    (:func:`hapd.ir.lower.load_exported`), they stay frozen. The program records them
    in itself too (:data:`hapd.ir.lower.FROZEN_META`), so one loaded with
    ``torch.export.load`` and given to :func:`hapd.lower` or :func:`hapd.distribute`
    keeps them frozen as well.

    A model whose parameters are on the meta device (built under
    ``torch.device("meta")`` or :func:`hapd.init_on_meta`) is exported from shapes
    alone (:func:`hapd.ir.fake.model_faked`): traced as the same model with real
    weights on the example inputs' device would be, so both lower to the same graph and
    share a graph id (and a cached plan), and the program holds no weights — :func:`hapd.distribute`
    and :func:`hapd.parallelize` then take ``weights=``.

    ``symbolic_batch``: export the batch dim symbolic (one ``torch.export`` dimension on
    every input's batch dim, :mod:`hapd.ir.shapes`), so that one program gives the
    graph at any batch (:func:`hapd.ir.shapes.program_at`): micro-batches of a
    pipeline, one duplica of overlap. A model that cannot be exported so is exported at
    the example batch instead, and the program says why
    (:func:`hapd.ir.shapes.batch_info`, the ``.pt2``'s ``static_reason``), which
    is logged at warning level.
    """
    example_inputs = tuple(example_inputs)
    if batch_dims is None:
        batch_dims = [0 if t.dim() > 0 else None for t in example_inputs]
    if len(batch_dims) != len(example_inputs):
        raise ExportError(f"{len(batch_dims)} batch dims for {len(example_inputs)} example inputs")
    model.train(training)
    size = _batch_size(example_inputs, batch_dims)
    program, info = None, BatchInfo(size=size, symbolic=False, reason="exported static")
    if symbolic_batch:
        program, info = _export_symbolic(model, example_inputs, batch_dims, size, name)
    if program is None:
        program = _export_static(model, example_inputs)
    set_batch_info(program, info)
    mark_frozen(program)
    if path is not None:
        _save(_functional(program, info), path, name or type(model).__name__, batch_dims, info)
    return program


def _functional(program: ExportedProgram, info: BatchInfo) -> ExportedProgram:
    """``program``'s functional form (normalize's step 1, kept on ``program`` too), as
    a ``.pt2`` stores it: every compile and rank that loads the file skips the re-trace."""
    functional = functionalize(program)
    mark_functional(functional)
    set_batch_info(functional, info)
    mark_frozen(functional)
    return functional


def _export_symbolic(model: torch.nn.Module, example_inputs: tuple[Any, ...], batch_dims: Sequence[int | None],
                     size: int, name: str | None) -> tuple[ExportedProgram | None, BatchInfo]:
    """The program exported with a symbolic batch dim, or None and why not (logged at warning level)."""
    try:
        program = _export(model, example_inputs, dynamic_shapes(example_inputs, batch_dims))
        return program, BatchInfo(size=size, symbolic=True)
    except Exception as exc:  # noqa: BLE001 - any reason torch gives: fall back, and say why
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"[:300]
        if size < 2:
            reason = f"example batch {size}: torch.export specializes a dim of size 0 or 1 ({reason})"
        _log.warning("%s: exported at the static batch %d, not a symbolic batch: %s",
                     name or type(model).__name__, size, reason)
        return None, BatchInfo(size=size, symbolic=False, reason=reason)


def _export_static(model: torch.nn.Module, example_inputs: tuple[Any, ...]) -> ExportedProgram:
    """The program exported at the example batch; :class:`ExportError` when torch cannot."""
    try:
        return _export(model, example_inputs, None)
    except Exception as exc:
        unreturnable = _UNRETURNABLE.search(str(exc))
        if unreturnable is not None:  # a ModelOutput with a cache, or any other object torch cannot return
            raise ExportError(
                f"{type(model).__name__}'s forward returns {unreturnable.group(1)} among its outputs, which torch.export "
                "cannot return (a transformers ModelOutput holds one); hapd trains a forward that returns the scalar "
                "loss: return `out.loss` (e.g. a wrapper whose forward is `return self.model(...).loss`)") from None
        raise ExportError(f"torch.export failed for {type(model).__name__}: {type(exc).__name__}: {exc}") from exc


_UNRETURNABLE = re.compile(r"Found <class '(?:[\w.]+\.)?(\w+)'> in output, which is not a known type")
"""torch.export's error for a forward whose outputs hold an object it cannot flatten."""


def save_shared(program: ExportedProgram, path: str | Path, *, name: str, batch_dims: Sequence[int | None]) -> None:
    """``program``'s functional form without its weights — every parameter and buffer
    a meta tensor of its shape, dtype and ``requires_grad``; constants kept —, saved as
    :func:`export` saves a ``.pt2`` but without the graphs: what a host joining an
    elastic job loads (:func:`hapd.ir.lower.load_exported`) and rebinds to its own
    model's tensors instead of exporting (:mod:`hapd.elastic.export_share`)."""
    info = batch_info(program) or BatchInfo(size=0, symbolic=False, reason="exported static")
    functional = _functional(program, info)
    light = ExportedProgram(
        root=functional.graph_module, graph=functional.graph, graph_signature=functional.graph_signature,
        state_dict={k: _meta_like(v) for k, v in functional.state_dict.items()},
        range_constraints=functional.range_constraints, module_call_graph=functional.module_call_graph,
        example_inputs=None, constants=functional.constants, verifiers=functional.verifiers,
    )
    light.graph_module.meta.update(functional.graph_module.meta)
    mark_functional(light)
    set_batch_info(light, info)
    _save(light, path, name, batch_dims, info, graphs=False)


def _meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``tensor``'s shape and dtype (a parameter stays a parameter, its ``requires_grad`` kept)."""
    meta = torch.empty_like(tensor, device="meta")
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
    return meta


def _save(program: ExportedProgram, path: str | Path, name: str, batch_dims: Sequence[int | None],
          info: BatchInfo, *, graphs: bool = True) -> None:
    """Save ``program`` to ``path`` with hapd's extra file: name, batch dims, frozen
    parameters, batch info; and, with ``graphs``, the graphs every compile of the file reads."""
    names = user_input_names(program)
    meta = {"name": name, "batch_dims": dict(zip(names, batch_dims)),
            FROZEN_KEY: frozen_parameters(program), FUNCTIONAL_KEY: is_functional(program), **info.to_doc()}
    extra: dict[str, Any] = {EXTRA_FILE: json.dumps(meta, sort_keys=True)}
    kept = kept_graphs(program, name=name, batch_dims=meta["batch_dims"]) if graphs else None
    if kept is not None:
        extra[GRAPHS_FILE] = kept
    try:
        with atomic_file(path) as handle:
            torch.export.save(program, handle, extra_files=extra)
    except OSError as exc:
        raise ExportError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _export(model: torch.nn.Module, example_inputs: tuple[Any, ...], shapes: Any) -> ExportedProgram:
    """``torch.export.export`` (non-strict), from shapes alone for a meta model;
    transformers' default experts traced as one ``hapd.routed_experts`` op (the same
    values: :mod:`hapd.ir.experts`)."""
    if on_meta(model):
        with model_faked(model, example_inputs) as (fake_inputs, restore), experts.captured():
            program = torch.export.export(model, fake_inputs, dynamic_shapes=shapes, strict=False)
        restore(program)
        return program
    with experts.captured():
        return torch.export.export(model, example_inputs, dynamic_shapes=shapes, strict=False)


def _batch_size(example_inputs: Sequence[Any], batch_dims: Sequence[int | None]) -> int:
    """The example batch: the length of the first input's batch dim (0 without one)."""
    for t, d in zip(example_inputs, batch_dims):
        if d is not None and isinstance(t, torch.Tensor) and 0 <= d < t.dim():
            return int(t.shape[d])
    return 0


def on_meta(model: torch.nn.Module) -> bool:
    """Whether some parameter or buffer of ``model`` is on the meta device (it has no
    values: hapd exports it from shapes and materializes it per rank)."""
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def user_input_names(program: ExportedProgram) -> list[str]:
    """Placeholder names of the user inputs, in call order."""
    return [s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]


def import_modules(names: Sequence[str]) -> None:
    """Import the modules that register a program's custom ops (``torch.library``), so
    that a ``.pt2`` using them loads: ``hapd inspect/compile/check/serve --import``."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an ImportError, or whatever the module raises on import
            raise ExportError(f"cannot import {name!r} (for its custom ops): {type(exc).__name__}: {exc}") from exc


def load_factory(spec: str) -> Callable[..., Any]:
    """Resolve ``package.module:callable``."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ExportError(f"{spec!r} is not MODULE:FACTORY")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ExportError(f"cannot import {module_name!r}: {exc}") from exc
    factory = module
    for part in attr.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ExportError(f"{module_name!r} has no attribute {attr!r}")
    if not callable(factory):
        raise ExportError(f"{spec} is not callable")
    return factory


def call_factory(factory: Callable[..., Any], batch: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """A factory is called with ``batch=`` (when it takes it) and returns
    ``(module, example_inputs)``."""
    name = getattr(factory, "__qualname__", None) or repr(factory)
    try:
        takes_batch = "batch" in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        takes_batch = False
    try:
        result = factory(batch=batch) if takes_batch else factory()
    except Exception as exc:  # noqa: BLE001 - whatever the factory raises, said in one line
        raise ExportError(f"calling the factory {name} failed: {type(exc).__name__}: {exc} (a factory takes no "
                          "arguments but an optional batch= and returns (module, example_inputs))") from exc
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module)):
        raise ExportError("a factory must return (module, example_inputs)")
    model, inputs = result
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return model, tuple(inputs)
