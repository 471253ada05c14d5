"""A model's other programs: its eval forward and batches of other sizes.

A :class:`~hapd.train.parallel_module.ParallelModule` runs another program than its
training one in ``eval()`` mode or for a global batch of other shapes. :class:`Recipe`
keeps what :func:`~hapd.train.parallelize.parallelize` was given, to export the model
again for that mode and batch (:meth:`Recipe.export`); :func:`aligned_force` keeps the
training plan's choices for every op the two graphs share (:func:`op_nodes`), so the
other program's plan holds every parameter as the training plan does.

A dict batch (what ``datasets`` and transformers' collators give, ``model(**batch)``)
is exported through :class:`KeywordModel` (:func:`by_keyword`): the model seen as one
whose forward takes the dict's tensors in its order, under their names, with the
model's own parameter names.
"""

from __future__ import annotations

import difflib
import hashlib
import inspect
import logging
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.export import ExportedProgram

from hapd.ir import normalize as normal_form
from hapd.ir.export import export, save_shared, user_input_names
from hapd.ir.lower import GraphIR, load_exported, lower
from hapd.ir.op_facts import EVAL_RULE, SAME_OP_IN_EVAL
from hapd.compiler.options import CompileOptions
from hapd.ir.derive import graphs_at
from hapd.ir.lower import lower_at
from hapd.ir.shapes import batch_info, is_symbolic, program_at, set_batch_info
from hapd.compiler.techniques import GraphSet, graph_set
from hapd.errors import ExportError, OptionsError, PlanError
from hapd.profile.schema import Profile
from hapd.elastic.in_place import KEEP_EXPORTS_ENV
from hapd.state.weights import WeightSource

_log = logging.getLogger(__name__)

Shapes = tuple[tuple[int, ...], ...]
"""The shapes of a global batch's inputs, in forward order."""


@dataclass(frozen=True, kw_only=True)
class Recipe:
    """What :func:`~hapd.train.parallelize.parallelize` was given, kept to export and
    distribute the model again for another program (its eval forward, another batch
    size). The model is kept by reference: its parameters' values are never read again
    (a program runs on the training program's pieces), only its structure and
    forward."""

    model: nn.Module
    example_inputs: tuple[Tensor, ...]
    batch_dims: tuple[int | None, ...]
    name: str
    profile: Profile | str | Path | Mapping | None
    use_daemon: bool
    verbose: bool
    device: torch.device
    training_ops: tuple[tuple[str, str], ...] = ()
    """(node name, op) of the training graph's op nodes, in graph order."""
    weights: WeightSource | None = None
    """Where the buffers another program reads come from (a model on the meta device)."""
    compile: Mapping[str, Any] | None = None
    """``torch.compile`` keyword arguments every program of the module runs under; None:
    the programs run as fx modules."""
    rng: str = "counter"
    """What the programs' random ops draw with (:func:`hapd.parallelize`'s ``rng``)."""
    exported: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    """What was exported, kept: training mode → the program exported with a symbolic
    batch (:meth:`symbolic`), and (mode, shapes) → a program and its graph."""

    @property
    def batch(self) -> int:
        """The example batch (the global batch of a training step; 0 without a batch dim)."""
        for shape, d in zip(self.example_shapes, self.batch_dims):
            if d is not None:
                return int(shape[d])
        return 0

    def shapes_at(self, batch: int) -> Shapes:
        """The example batch's shapes with ``batch`` samples."""
        return tuple(shape if d is None else (*shape[:d], batch, *shape[d + 1:])
                     for shape, d in zip(self.example_shapes, self.batch_dims))

    def symbolic(self, training: bool = True, shapes: Shapes | None = None) -> Any:
        """The model exported once in that mode with a symbolic batch
        (:mod:`hapd.ir.shapes`): every batch's program is cut from it. A model that
        cannot be exported so comes back static (:func:`~hapd.ir.shapes.batch_info`
        says why). ``shapes``: exported at these input shapes (their other dims: one
        symbolic program per sequence length, say); default: the example batch's."""
        shapes = self.example_shapes if shapes is None else tuple(tuple(s) for s in shapes)
        rest = self._rest(shapes)
        key = ("symbolic", training) if rest == self._rest(self.example_shapes) else ("symbolic", training, rest)
        if key not in self.exported:
            inputs = self.example_inputs if len(key) == 2 else self.inputs_of(shapes)
            was = self.model.training
            try:
                with torch.enable_grad(), _naming_index_inputs(self.model, inputs):
                    self.exported[key] = export(self.model, inputs, batch_dims=self.batch_dims,
                                                training=training, symbolic_batch=True)
                check_index_inputs(self.exported[key])
            finally:
                self.model.train(was)
        return self.exported[key]

    def _dims_of(self, program: Any) -> dict[str, int | None]:
        """Each of ``program``'s inputs by name → its batch dim (what a lowering records)."""
        return dict(zip(user_input_names(program), self.batch_dims))

    def _rest(self, shapes: Shapes) -> tuple:
        """``shapes`` with each batch dim's size left out: what one symbolic program serves."""
        return tuple(tuple(n if k != d else None for k, n in enumerate(shape))
                     for shape, d in zip(shapes, self.batch_dims))

    def export_at(self, training: bool, batch: int, shapes: Shapes | None = None) -> tuple[Any, GraphIR]:
        """The program and graph of a global batch of ``batch`` samples (of ``shapes``'
        other dims; default: the example batch's), cut from one symbolic program
        (:meth:`symbolic`); the model exported again at that batch when that program is
        static."""
        base = self.example_shapes if shapes is None else tuple(tuple(s) for s in shapes)
        rest = self._rest(base)
        key = ("at", training, batch) if rest == self._rest(self.example_shapes) else ("at", training, batch, rest)
        if key not in self.exported:
            program = self.symbolic(training, base)
            if is_symbolic(program) or batch == _batch_of(base, self.batch_dims):
                self.exported[key] = (program_at(program, batch),
                                      lower_at(program, batch, name=self.name, batch_dims=self._dims_of(program)))
            else:
                self.exported[key] = self.export(training, _with_batch(base, self.batch_dims, batch))
        return self.exported[key]

    def export_for(self, training: bool, shapes: Shapes) -> tuple[Any, GraphIR]:
        """The program and graph of a global batch of ``shapes``: cut from the symbolic
        program of their other dims (:meth:`export_at`), so batches that differ only in
        their batch dim share one export; exported whole when no input has a batch dim."""
        shapes = tuple(tuple(s) for s in shapes)
        batch = _batch_of(shapes, self.batch_dims)
        if batch is None:
            return self.export(training, shapes)
        return self.export_at(training, batch, shapes)

    def graphs(self, options: CompileOptions, *, priced: bool = True) -> GraphSet:
        """The graphs a compile with ``options`` prices (the global batch's, the
        micro-batches' of pipelines, the half batch's of overlap), from the one symbolic
        program; with a static one, from the model exported again at each batch (said
        in the log). ``priced`` False, for a rank that searches nothing (the plan comes
        from rank 0): only the graphs it checks the plan against and runs — the global
        batch's and, with overlap, the half batch's; a pipeline's micro-batch program is
        cut when its plan wins (:func:`~hapd.train.pipeline_module.build_pipeline_module`)."""
        program = self.symbolic(True)
        if not is_symbolic(program):
            info = batch_info(program)
            _log.info("%s: the model exports only at a static batch (%s): exporting it again at each batch priced",
                      self.name, info.reason if info is not None else "?")
        full = self.export_at(True, self.batch)[1]
        if not priced:
            return graph_set(lambda b: self.export_at(True, b)[1], full, replace(options, pipeline="off"))
        return graph_set(self._priced_at(program), full, options)

    def _priced_at(self, program: Any) -> Callable[[int], GraphIR]:
        """The graph at a batch only a search prices: the one this recipe lowered where it
        cut that batch's program (:meth:`export_at`), else derived from the global batch's
        and its half's (:func:`hapd.ir.derive.graphs_at`: byte for byte the lowered graph,
        without a lowering a batch — 0.3-0.6 s of CPU each, seconds on a rank at a sixth of
        a core, in the switch where it becomes rank 0), kept with the exports (carried
        across switches). A static program is exported again at each batch."""
        if not is_symbolic(program):
            return lambda b: self.export_at(True, b)[1]
        derived = graphs_at(program, self.batch, name=self.name, batch_dims=self._dims_of(program))

        def at(batch: int) -> GraphIR:
            cut = self.exported.get(("at", True, batch))
            if cut is not None:
                return cut[1]
            key = ("priced", batch)
            if key not in self.exported:
                self.exported[key] = derived(batch)
            return self.exported[key]

        return at

    @property
    def example_shapes(self) -> Shapes:
        return tuple(tuple(t.shape) for t in self.example_inputs)

    def half_shapes(self) -> Shapes:
        """The example batch's shapes with half its samples (one duplica of an
        overlapped run); :class:`PlanError` for an odd batch."""
        out = []
        for shape, d in zip(self.example_shapes, self.batch_dims):
            if d is None:
                out.append(shape)
                continue
            if shape[d] % 2:
                raise PlanError(f"overlapped execution cuts the batch in two halves; batch {shape[d]} is odd")
            out.append((*shape[:d], shape[d] // 2, *shape[d + 1:]))
        return tuple(out)

    def inputs_of(self, shapes: Shapes) -> tuple[Tensor, ...]:
        """Example inputs of these shapes: the example batch's cut or repeated along the
        batch dim where only that dim differs (real values: token ids stay ids), else
        zeros."""
        if len(shapes) != len(self.example_inputs):
            raise PlanError(f"{len(shapes)} inputs, the model takes {len(self.example_inputs)}")
        return tuple(_resized(t, list(shape), d) for t, shape, d in zip(self.example_inputs, shapes, self.batch_dims))

    def export(self, training: bool, shapes: Shapes) -> tuple[Any, GraphIR]:
        """The model exported in that mode for a global batch of ``shapes``, and its
        lowered graph (the model's own mode is left as it was); kept."""
        key = ("export", training, tuple(tuple(s) for s in shapes))
        if key not in self.exported:
            self.exported[key] = self._export(training, shapes)
        return self.exported[key]

    def _export(self, training: bool, shapes: Shapes) -> tuple[Any, GraphIR]:
        was = self.model.training
        try:
            inputs = self.inputs_of(shapes)
            with torch.enable_grad(), _naming_index_inputs(self.model, inputs):  # as for training, also inside no_grad
                program = export(self.model, inputs, batch_dims=self.batch_dims, training=training)
                check_index_inputs(program)
                graph = lower(program, name=self.name,
                              batch_dims=dict(zip(user_input_names(program), self.batch_dims)))
        finally:
            self.model.train(was)
        return program, graph


# --------------------------------------------------------------------------------------
# Example inputs an exported program uses as indices
# --------------------------------------------------------------------------------------

_INDEX_ARGS = {"embedding": 1, "cross_entropy_loss": 1, "nll_loss": 1, "nll_loss_forward": 1, "nll_loss2d_forward": 1,
               "nll_loss_nd": 1, "gather": 2, "index_select": 2, "one_hot": 0, "take_along_dim": 1, "scatter": 2,
               "scatter_add": 2, "scatter_reduce": 2, "embedding_bag": 1}
"""aten ops by name → the argument they read as indices (token ids, class labels)."""
_SAME_VALUES = {"reshape", "view", "_unsafe_view", "flatten", "contiguous", "clone", "unsqueeze", "squeeze", "slice",
                "select", "expand", "permute", "transpose", "t", "detach", "alias", "narrow", "getitem", "split",
                "chunk", "unflatten", "repeat"}
"""aten ops whose output holds their input's values (so its dtype too) in another shape."""


def check_index_inputs(program: ExportedProgram) -> None:
    """:class:`~hapd.errors.OptionsError` naming an example input of a floating or bool
    dtype that the program uses as indices (an embedding's token ids, a loss's class
    labels): ``torch.export`` traces such a model without complaint, but every forward
    would then fail inside torch. A float target of the input's shape (class
    probabilities) is not an index."""
    names = set(user_input_names(program))
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in names:
            continue
        value = node.meta.get("val")
        if not isinstance(value, Tensor) or not (value.is_floating_point() or value.dtype == torch.bool
                                                 or value.is_complex()):
            continue
        use = _index_use(node, value.dtype)
        if use is not None:
            raise OptionsError(f"example input {node.name} is {value.dtype}, and the model uses it as indices "
                               f"({use}: token ids or class labels): give it as integers (torch.long)",
                               field=f"inputs[{node.name!r}]")


_INDEX_DTYPE = re.compile(r"(?:for index|scalar type (?:Long|Int)|indices).*?(?:got|found) (?:torch\.)?(\w+)", re.I)
"""torch's complaint about an index argument of another dtype, and the dtype it got."""
_DTYPE_WORDS = {"Float": torch.float32, "Double": torch.float64, "Half": torch.float16, "BFloat16": torch.bfloat16,
                "Bool": torch.bool}


@contextmanager
def _naming_index_inputs(model: nn.Module, inputs: Sequence[Tensor]) -> Iterator[None]:
    """An export that failed because an op got indices of another dtype (class labels as
    floats) re-raised as :class:`~hapd.errors.OptionsError` naming the example inputs of
    that dtype (the forward's argument names), which should be integers."""
    try:
        yield
    except ExportError as exc:
        found = _INDEX_DTYPE.search(str(exc))
        if found is None:
            raise
        dtype = _DTYPE_WORDS.get(found.group(1), getattr(torch, found.group(1), None))
        names = _argument_names(model, len(inputs))
        which = [f"{names[k]} ({t.dtype})" for k, t in enumerate(inputs) if isinstance(t, Tensor) and t.dtype == dtype]
        if not which:
            raise
        raise OptionsError(f"example input {' or '.join(which)} is used as indices (token ids or class labels) by "
                           f"{type(model).__name__}'s forward, which needs integers: give it as torch.long "
                           f"[{str(exc)[:200]}]", field="inputs") from exc


def _argument_names(model: nn.Module, count: int) -> list[str]:
    """The names of the first ``count`` arguments of ``model.forward`` (``input k`` where unknown)."""
    try:
        params = [n for n, p in inspect.signature(model.forward).parameters.items()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return [params[k] if k < len(params) else f"input {k}" for k in range(count)]


def _index_use(start: Any, dtype: torch.dtype) -> str | None:
    """The first op that reads ``start``'s values (through ops that only reshape them) as
    indices, as ``aten.NAME``; None when none does."""
    todo, seen = [start], {start}
    while todo:
        node = todo.pop()
        for user in node.users:
            name = _op_name(user.target)
            position = _INDEX_ARGS.get(name)
            if position is not None and position < len(user.args) and _refers(user.args[position], node) \
                    and not _probabilities(user, name, node):
                return f"aten.{name}"
            value = user.meta.get("val")
            if name in _SAME_VALUES and user not in seen and (
                    not isinstance(value, Tensor) or value.dtype == dtype):
                seen.add(user)
                todo.append(user)
    return None


def _op_name(target: Any) -> str:
    """``aten.embedding.default`` → ``embedding``; ``operator.getitem`` → ``getitem``."""
    name = getattr(target, "__name__", str(target))
    packet = getattr(target, "_overloadpacket", None)
    return getattr(packet, "__name__", name).split(".")[-1]


def _refers(arg: Any, node: Any) -> bool:
    return arg is node or (isinstance(arg, (list, tuple)) and any(a is node for a in arg))


def _probabilities(user: Any, name: str, target: Any) -> bool:
    """A cross-entropy target of the logits' own shape: class probabilities, not labels."""
    if name != "cross_entropy_loss" or not user.args:
        return False
    logits, labels = user.args[0].meta.get("val"), target.meta.get("val")
    return isinstance(logits, Tensor) and isinstance(labels, Tensor) and labels.is_floating_point() \
        and tuple(logits.shape) == tuple(labels.shape)


# --------------------------------------------------------------------------------------
# Dict batches: the model called by keyword
# --------------------------------------------------------------------------------------


class KeywordModel(nn.Module):
    """``model`` called as ``model(**dict(zip(keys, inputs)))`` by a forward that takes
    the inputs in ``keys``' order, named as the keys (the exported program's inputs are
    ``input_ids``, ``labels``, …). It shares the model's parameters, buffers and
    submodules under their own names (the same dicts, not a ``model.`` prefix), so the
    state dict, the plan's tensors and checkpoints name them as the model does. Made
    by :func:`by_keyword` (a subclass per key list, whose forward's signature names
    them: :func:`torch.export.export` reads the input names from it)."""

    keys: tuple[str, ...] = ()

    def __init__(self, model: nn.Module):
        super().__init__()
        object.__setattr__(self, "keyword_model", model)  # not a child: its entries are this module's own
        self._parameters = model._parameters  # noqa: SLF001 - shared, so every name stays the model's
        self._buffers = model._buffers  # noqa: SLF001
        self._modules = model._modules  # noqa: SLF001
        self._non_persistent_buffers_set = model._non_persistent_buffers_set  # noqa: SLF001
        self.training = model.training

    def train(self, mode: bool = True) -> "KeywordModel":
        """Sets the model's own mode too (its forward may read ``self.training``)."""
        self.keyword_model.train(mode)
        return super().train(mode)

    def forward(self, *inputs: Tensor) -> Tensor:
        return self.keyword_model(**dict(zip(self.keys, inputs)))

    def extra_repr(self) -> str:
        return f"{type(self.keyword_model).__name__} called with {', '.join(self.keys)}"


def by_keyword(model: nn.Module, example: Sequence[Tensor] | Mapping[str, Tensor],
               batch_dims: Sequence[int | None] | Mapping[str, int | None] | None, name: str | None
               ) -> tuple[nn.Module, tuple[Tensor, ...], Sequence[int | None] | None, str | None]:
    """``(model, example inputs, batch dims, name)`` as :func:`hapd.parallelize` exports
    them: unchanged for a tuple batch; for a dict batch (``model(**batch)``), the model
    as a :class:`KeywordModel` of the dict's keys, its tensors in the dict's order,
    ``batch_dims`` (a sequence in that order, or a dict by key) in that order too, and
    the model's class name. :class:`~hapd.errors.OptionsError` naming a key whose
    value is not a tensor or that the model's forward does not take."""
    if not isinstance(example, Mapping):
        return model, example, batch_dims, name
    keys = [str(k) for k in example]
    for key, value in example.items():
        if not isinstance(value, Tensor):
            raise OptionsError(f"example batch[{key!r}] is a {type(value).__name__}, not a tensor (a dict batch "
                               "holds the forward's tensor arguments: drop other columns)", field=f"inputs[{key!r}]")
    _check_keywords(model, keys)
    if isinstance(batch_dims, Mapping):
        batch_dims = [batch_dims.get(k, 0 if example[k].dim() > 0 else None) for k in keys]
    forward = _keyword_forward(keys)
    cls = type(type(model).__name__, (KeywordModel,), {"forward": forward, "keys": tuple(keys)})
    return cls(model), tuple(example[k] for k in keys), batch_dims, name or type(model).__name__


def _keyword_forward(keys: Sequence[str]) -> Any:
    """``KeywordModel.forward`` with a signature that names ``keys``."""
    def forward(self: KeywordModel, *inputs: Tensor) -> Tensor:
        return self.keyword_model(**dict(zip(self.keys, inputs)))

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    forward.__signature__ = inspect.Signature([inspect.Parameter("self", kind)]  # type: ignore[attr-defined]
                                              + [inspect.Parameter(k, kind) for k in keys])
    return forward


def _check_keywords(model: nn.Module, keys: Sequence[str]) -> None:
    """:class:`~hapd.errors.OptionsError` naming the keys ``model.forward`` takes no
    argument for (none when it takes ``**kwargs``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    unknown = [k for k in keys if k not in named]
    if unknown:
        raise OptionsError(f"{type(model).__name__}.forward takes no argument {', '.join(map(repr, unknown))} of the "
                           f"example batch (it takes {', '.join(named)}): drop those keys from the batch",
                           field=f"inputs[{unknown[0]!r}]")


def keyword_names(model: nn.Module) -> tuple[str, ...] | None:
    """The keys a module built from ``model`` is called with (``module(**batch)``), or
    None for a model exported from a tuple batch."""
    return tuple(model.keys) if isinstance(model, KeywordModel) else None


# --------------------------------------------------------------------------------------
# Exports carried across a run of the script again in the same process
# --------------------------------------------------------------------------------------


def key_digest(key: tuple) -> str:
    """An :func:`export_key` as a hex digest (what another process computes for the same model)."""
    return hashlib.sha256(repr(key).encode()).hexdigest()


SHARED_KEY = ("symbolic", True)
"""Where a recipe keeps the program exported with a symbolic batch in training mode
(:meth:`Recipe.symbolic`): what an elastic job shares with the hosts that join it."""


def shared_bytes(recipe: Recipe) -> bytes | None:
    """The recipe's symbolic training program as a joining host loads it
    (:func:`hapd.ir.export.save_shared`: functional, weightless); None when it has none
    (a static export, or no search over batches)."""
    program = recipe.exported.get(SHARED_KEY)
    if not is_symbolic(program):
        return None
    with tempfile.TemporaryDirectory(prefix="hapd-share-") as folder:
        path = Path(folder) / "program.pt2"
        save_shared(program, path, name=recipe.name, batch_dims=recipe.batch_dims)
        return path.read_bytes()


def take_shared(recipe: Recipe, data: bytes) -> None:
    """Take a program another rank of the job shared (:func:`shared_bytes`) as the
    recipe's symbolic training program, rebound to its model's tensors: what exporting
    the model here would give. :class:`~hapd.errors.HapdError` (a
    :class:`~hapd.errors.GraphError` or :class:`~hapd.errors.PlanError`) when it cannot
    be read or does not fit the model."""
    with tempfile.TemporaryDirectory(prefix="hapd-share-") as folder:
        path = Path(folder) / "program.pt2"
        path.write_bytes(data)
        program, _ = load_exported(path)
    info = batch_info(program)
    if info is None or not info.symbolic:
        raise PlanError("the shared program has no symbolic batch")
    rebound = rebind(program, recipe.model)
    set_batch_info(rebound, info)
    recipe.exported[SHARED_KEY] = rebound


def export_key(model: nn.Module, example_inputs: Sequence[Tensor], batch_dims: Sequence[int | None],
               name: str, device: torch.device) -> tuple:
    """What a model's export depends on, but its tensors' values: its class, its
    structure as printed (sizes, options), every state entry's name, shape, dtype and
    whether it trains, the example inputs' shapes and dtypes, the batch dims, its mode,
    the name and the device. Two models with one key export to one program."""
    state = tuple((k, tuple(v.shape), str(v.dtype), bool(v.requires_grad))
                  for k, v in model.state_dict(keep_vars=True).items())
    inputs = tuple((tuple(t.shape), str(t.dtype)) for t in example_inputs)
    return (type(model).__module__, type(model).__qualname__, repr(model), state, inputs, tuple(batch_dims),
            model.training, name, str(device))


@dataclass(frozen=True)
class _Tensors:
    """A model's state entries and buffers, read once for every program rebound to it."""

    state: Mapping[str, Tensor]
    buffers: Mapping[str, Tensor]
    """The non-persistent ones too (a program's constants)."""

    @classmethod
    def of(cls, model: nn.Module) -> "_Tensors":
        return cls(model.state_dict(keep_vars=True), dict(model.named_buffers()))


def rebind(program: ExportedProgram, model: nn.Module | _Tensors) -> ExportedProgram:
    """``program`` (exported from another model of the same :func:`export_key`) over
    ``model``'s parameters and buffers: the program a fresh export of ``model`` gives,
    without exporting. Raises :class:`~hapd.errors.PlanError` when ``model`` lacks one of
    the program's state entries."""
    tensors = model if isinstance(model, _Tensors) else _Tensors.of(model)
    state, buffers = tensors.state, tensors.buffers
    missing = [k for k in program.state_dict if k not in state]
    if missing:
        raise PlanError(f"cannot rebind an exported program: the model has no {missing[:3]}")
    constants = {k: buffers.get(k, v) for k, v in program.constants.items()}
    out = ExportedProgram(
        root=program.graph_module, graph=program.graph, graph_signature=program.graph_signature,
        state_dict={k: state[k] for k in program.state_dict}, range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph, example_inputs=program.example_inputs, constants=constants,
        verifiers=program.verifiers,
    )
    out.graph_module.meta.update(program.graph_module.meta)
    _keep_forms(program, out, tensors)
    return out


def _keep_forms(program: ExportedProgram, out: ExportedProgram, model: _Tensors) -> None:
    """What :mod:`hapd.ir.normalize` made of ``program`` given to ``out``, its graph over
    ``model``'s tensors: that it is in normal form already, else its normal form and its
    functional form, each rebound too. Without them :func:`hapd.distribute` would
    normalize the rebound program again — re-tracing it: most of a switch's time on a
    slow host (~0.5 s of CPU for the bench's GPT-2, 3-4 s on a sixth of a core). Done by
    hand: :mod:`hapd.ir.normalize` keeps them as attributes of the program and has no
    setter for them."""
    if normal_form.is_normalized(program):
        setattr(out, normal_form._MARK, True)  # noqa: SLF001 - see above
        return
    normal = getattr(program, normal_form._NORMAL_FORM, None)  # noqa: SLF001
    if isinstance(normal, ExportedProgram):
        setattr(out, normal_form._NORMAL_FORM, rebind(normal, model))  # noqa: SLF001
    functional = getattr(program, normal_form._FUNCTIONAL_FORM, None)  # noqa: SLF001
    if functional is program:
        normal_form.mark_functional(out)
    elif isinstance(functional, ExportedProgram):
        setattr(out, normal_form._FUNCTIONAL_FORM, rebind(functional, model))  # noqa: SLF001


class ExportCarry:
    """What :func:`~hapd.train.parallelize.parallelize` exported in this process,
    kept for the script's next run in it: an elastic job's ranks switched in place
    (:mod:`hapd.elastic.in_place`) run the script again, build the same model again
    and would export and lower it again — most of what a switch costs on a slow host.
    A model of the same :func:`export_key` takes the kept programs and graphs instead,
    each program rebound to its own tensors (:func:`rebind`): what it then trains on is
    exactly what a fresh export would give. Off but under the in-place runner
    (``$HAPD_KEEP_EXPORTS``); at most ``limit`` models kept, the least recently used
    forgotten."""

    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self._kept: OrderedDict[tuple, dict[Any, Any]] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        """Whether exports are kept: under the in-place runner (``$HAPD_KEEP_EXPORTS``)."""
        return os.environ.get(KEEP_EXPORTS_ENV) == "1"

    def take(self, key: tuple, model: nn.Module) -> dict[Any, Any]:
        """The exports kept for ``key``, rebound to ``model``; empty when none are (or
        carrying is off, or one cannot be rebound)."""
        if not self.enabled:
            return {}
        with self._lock:
            kept = self._kept.pop(key, None)
        if not kept:
            return {}
        tensors = _Tensors.of(model)
        try:
            return {k: _rebound(v, tensors) for k, v in kept.items()}
        except PlanError as exc:
            _log.warning("the exports kept from the script's last run do not fit this model (%s): exporting again", exc)
            return {}

    def keep(self, key: tuple, exported: dict[Any, Any]) -> None:
        """Keep a recipe's exports (the dict itself: what it exports later is kept too)."""
        if not self.enabled:
            return
        with self._lock:
            self._kept[key] = exported
            self._kept.move_to_end(key)
            while len(self._kept) > self.limit:
                self._kept.popitem(last=False)


def _rebound(value: Any, model: _Tensors) -> Any:
    """A kept export (a program, or a program and its graph) over ``model``'s tensors;
    the kept one itself when it is over them already (:func:`bound_to`)."""
    if isinstance(value, ExportedProgram):
        return value if bound_to(value, model) else rebind(value, model)
    if isinstance(value, tuple) and value and isinstance(value[0], ExportedProgram):
        return value if bound_to(value[0], model) else (rebind(value[0], model), *value[1:])
    return value


def bound_to(program: ExportedProgram, model: nn.Module | _Tensors) -> bool:
    """Whether ``program`` — and the normal and functional forms kept on it — reads
    ``model``'s very tensors (every state entry the same object, every constant that is
    a buffer of ``model`` too): what :func:`rebind` would give is the program itself. So
    for a joining host's rank, whose exports made before its place came are carried
    into the same :func:`~hapd.train.parallelize.parallelize` call over the same
    model: rebinding them all again took ~0.2 s there on a sixth of a core, after the
    switch, while every rank waited."""
    tensors = model if isinstance(model, _Tensors) else _Tensors.of(model)
    if any(tensors.state.get(k) is not v for k, v in program.state_dict.items()):
        return False
    if any(tensors.buffers.get(k, v) is not v for k, v in program.constants.items()):
        return False
    for attr in (normal_form._NORMAL_FORM, normal_form._FUNCTIONAL_FORM):  # noqa: SLF001 - see _keep_forms
        form = getattr(program, attr, None)
        if isinstance(form, ExportedProgram) and form is not program and not bound_to(form, tensors):
            return False
    return True


CARRY = ExportCarry()
"""This process's carried exports (see :class:`ExportCarry`)."""


def _batch_of(shapes: Shapes, batch_dims: Sequence[int | None]) -> int | None:
    """The batch of these shapes (the first input with a batch dim); None without one."""
    for shape, d in zip(shapes, batch_dims):
        if d is not None:
            return int(shape[d])
    return None


def _with_batch(shapes: Shapes, batch_dims: Sequence[int | None], batch: int) -> Shapes:
    """``shapes`` with ``batch`` samples along each batch dim."""
    return tuple(shape if d is None else (*shape[:d], batch, *shape[d + 1:]) for shape, d in zip(shapes, batch_dims))


def _resized(example: Tensor, shape: list[int], batch_dim: int | None) -> Tensor:
    """A tensor of ``shape`` like ``example`` (see :meth:`Recipe.inputs_of`)."""
    have = list(example.shape)
    if have == shape:
        return example
    d = batch_dim
    only_batch = d is not None and len(have) == len(shape) and have[:d] + have[d + 1:] == shape[:d] + shape[d + 1:]
    if not only_batch or have[d] == 0:
        return torch.zeros(shape, dtype=example.dtype, device=example.device)
    repeats = -(-shape[d] // have[d])
    whole = torch.cat([example] * repeats, dim=d) if repeats > 1 else example
    return whole.narrow(d, 0, shape[d])


def op_nodes(graph: GraphIR) -> tuple[tuple[str, str], ...]:
    """(node name, op) of a lowered graph's op nodes, in graph order."""
    return tuple((n["name"], n["op"]) for n in graph.doc["nodes"] if n["kind"] == "op")


def aligned_force(training: Sequence[tuple[str, str]], rules: Mapping[str, str],
                  other: Sequence[tuple[str, str]]) -> dict[str, str]:
    """``CompileOptions.force`` for another graph of the model (``other``'s op nodes)
    that keeps the training plan's choices: the op nodes of the two graphs are aligned
    in graph order (the longest matching runs of ops, :class:`difflib.SequenceMatcher`;
    an eval graph lacks dropout and has batch norm on running statistics, so names
    alone shift), and each node of ``other`` aligned with a training node gets the rule
    the training plan chose for it (``rules``: node -> rule), in its eval form
    (:data:`~hapd.ir.op_facts.EVAL_RULE`) where the ops differ."""
    def key(op: str) -> str:
        return SAME_OP_IN_EVAL.get(op, op)

    matcher = difflib.SequenceMatcher(None, [key(op) for _, op in training], [key(op) for _, op in other], autojunk=False)
    force: dict[str, str] = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            (name, op), (other_name, other_op) = training[block.a + k], other[block.b + k]
            rule = rules.get(name)
            if rule is not None:
                force[other_name] = rule if op == other_op else EVAL_RULE.get(rule, rule)
    return force


__all__ = ["CARRY", "ExportCarry", "KeywordModel", "Recipe", "Shapes", "aligned_force", "bound_to", "by_keyword",
           "check_index_inputs", "export_key", "keyword_names", "op_nodes", "rebind"]
