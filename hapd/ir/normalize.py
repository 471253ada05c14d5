"""Making an exported program functional, once, in one place.

:func:`normalize` is what both the lowering (:func:`hapd.ir.lower.lower`) and the
runtime (:func:`hapd.spmd.rewrite.distribute`) apply to an exported program before
reading it, so the fx node names a plan refers to are the names of the program every
rank replays. It applies these steps, in order:

1. **functionalize** (:func:`_functionalize`) — ``run_decompositions({})`` with an empty
   table: in-place writes and views become functional ops (``copy_`` → ``aten.copy``,
   writes into slices → ``slice_scatter``/``select_scatter``), buffer updates become
   outputs of the graph (``BUFFER_MUTATION``), and higher-order ops such as
   ``wrap_with_set_grad_enabled`` (a ``@torch.no_grad()`` block) are inlined; ops with a
   CompositeImplicit kernel (``aten.linear``, ``aten.scaled_dot_product_attention``, …)
   are kept as they are;
2. **drop assertions** (:func:`_drop_assertions`) — ``_assert_tensor_metadata``,
   ``_assert_scalar``, … and getitems that nobody reads: no users, no effect on any
   value;
3. **verify** (:func:`_verify`) — no mutating op, higher-order op, ``get_attr``
   submodule or module call is left (:class:`~hapd.errors.UnsupportedOpError` naming
   the op and the node), and the program's outputs are the loss and buffer updates
   only (:class:`~hapd.errors.ExportError` naming any other);
4. **views as reshapes** (:func:`_views_as_reshapes`) — ``aten.view`` and
   ``aten._unsafe_view`` become ``aten.reshape`` to the written-out result shape: the
   re-trace takes strides from fake kernels that can disagree with the eager ones
   (``scaled_dot_product_attention`` on CPU), and drops a ``contiguous`` it believes a
   no-op, so a view it proved legal can fail on the real tensor; in a functional
   program both give the same values;
5. **linears on leading dims** (:func:`_linear_on_leading_dims`) — a linear between a
   reshape that flattens leading dims into rows and one that restores them runs on the
   rows with their leading dims kept (the same values): the batch split then survives
   ``nn.MultiheadAttention``'s output projection;
6. **constant attention masks** (:func:`_constant_attention_masks`) — an attention
   whose mask comes from no input, parameter or buffer (transformers builds its causal
   mask from ``arange``s when no attention mask is given) gets what the mask means:
   no mask where it keeps everything, ``is_causal=True`` where it is the causal
   triangle. The fused kernels then run as they do eagerly (a masked kernel took twice
   the causal one's time on an H100) and the mask costs no memory; the values are the
   same;
7. **canonical names** (:func:`_canonical_names`) — every op node is renamed the way fx
   names a fresh graph (``linear``, ``linear_1``, …, in graph order): torch renames
   nodes when it saves and loads a program (``_assert_tensor_metadata`` →
   ``_assert_tensor_metadata_default``) and when it re-traces one, so only names that
   depend on the ops alone keep the graph id the same for a program in memory, saved
   and loaded, or normalized twice.

Normalizing a normalized program changes nothing; a program :func:`normalize` returned
is marked and returned as it is, and a program it was given keeps its result.
"""

from __future__ import annotations

import contextlib
import copy
import math
import operator
from collections.abc import Iterator
from typing import Any

import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    OutputKind,
    OutputSpec,
    TensorArgument,
)

from hapd.ir.fake import program_faked
from hapd.ir.op_facts import ATTENTION, ATTENTION_ARGS, attention_args
from hapd.errors import ExportError, UnsupportedOpError

_MARK = "_hapd_normalized"
"""Attribute set on a program :func:`normalize` returned."""
_NORMAL_FORM = "_hapd_normal_form"
"""Attribute of a program :func:`normalize` was given: what it returned."""
_FUNCTIONAL_FORM = "_hapd_functional_form"
"""Attribute of a program: its functional form, made once (:func:`functionalize`);
the program itself when it is functional already (:func:`mark_functional`)."""


ASSERTION_OPS = frozenset(
    {
        "aten._assert_tensor_metadata",
        "aten._assert_scalar",
        "aten._assert_async",
        "aten._assert_async.msg",
        "aten._functional_assert_async.msg",
        "aten._functional_assert_scalar",
        "aten.sym_constrain_range",
        "aten.sym_constrain_range_for_size",
        "aten._functional_sym_constrain_range",
        "aten._functional_sym_constrain_range_for_size",
    }
)
"""Ops that only check a value (no result anyone reads, no effect on the model)."""

ALLOWED_OUTPUTS = (OutputKind.USER_OUTPUT, OutputKind.BUFFER_MUTATION)
"""What a program may return: the loss, and the new values of the buffers it updates."""


def normalize(program: ExportedProgram, *, functional: bool = False) -> ExportedProgram:
    """The functional form of ``program`` with canonical node names (a new program;
    ``program`` itself is not changed). Raises :class:`~hapd.errors.UnsupportedOpError`
    for an op that cannot be made functional and :class:`~hapd.errors.ExportError` for
    an output that is neither the loss nor a buffer update. ``functional``: ``program``
    is functional already (cut at one batch from a symbolic program made functional
    once, :func:`hapd.ir.shapes.program_at`): step 1 is skipped, and ``program``
    itself is changed."""
    if getattr(program, _MARK, False):
        return program
    cached = getattr(program, _NORMAL_FORM, None)
    if cached is not None:
        return cached
    if functional:
        work = program
    else:
        kept = getattr(program, _FUNCTIONAL_FORM, None)  # step 1 done already: its copy, the passes change it
        work = _graph_copied(kept) if kept is not None else _functionalize(program)
    _drop_assertions(work.graph_module)
    _verify(work)
    _views_as_reshapes(work.graph_module)
    _linear_on_leading_dims(work.graph_module)
    _constant_attention_masks(work.graph_module)
    # the passes change the graph alone: its module's code is generated once, on the
    # renamed copy (the functional program's module is never run)
    normalized = _canonical_names(work)
    setattr(normalized, _MARK, True)
    setattr(program, _NORMAL_FORM, normalized)  # lowering, then distributing, re-traces once
    return normalized


def is_normalized(program: ExportedProgram) -> bool:
    """Whether ``program`` came from :func:`normalize` (in this process)."""
    return bool(getattr(program, _MARK, False))


# --------------------------------------------------------------------------------------
# 1. functionalize
# --------------------------------------------------------------------------------------


def functionalize(program: ExportedProgram) -> ExportedProgram:
    """Step 1 alone, made once per program and kept on it (a symbolic program is made
    functional once, then cut at each batch: :mod:`hapd.ir.shapes`); a program marked
    functional already (:func:`mark_functional`) is its own."""
    kept = getattr(program, _FUNCTIONAL_FORM, None)
    if kept is None:
        kept = _functionalize(program)
        setattr(program, _FUNCTIONAL_FORM, kept)
    return kept


def _graph_copied(program: ExportedProgram) -> ExportedProgram:
    """``program`` with a copy of its graph (the same weights, signature and module
    attributes): what the passes below may change while ``program`` stays runnable."""
    graph = fx.Graph()
    out = graph.graph_copy(program.graph, {})
    graph.output(out)
    copied = ExportedProgram(
        root=program.graph_module, graph=graph, graph_signature=program.graph_signature, state_dict=program.state_dict,
        range_constraints=program.range_constraints, module_call_graph=program.module_call_graph, example_inputs=None,
        constants=program.constants, verifiers=program.verifiers,
    )
    copied.graph_module.meta.update(program.graph_module.meta)
    return copied


def mark_functional(program: ExportedProgram) -> None:
    """Record that ``program`` is functional already (what step 1 made, saved and
    loaded again): :func:`normalize` and :func:`functionalize` do not re-trace it. Step 1
    is most of a compile's time on a large model (``run_decompositions`` re-traces the
    whole program: ~6 s for GPT-2 124M), so :func:`hapd.export` saves the functional
    form and a ``.pt2`` is re-traced once, when it is exported, not per compile."""
    setattr(program, _FUNCTIONAL_FORM, program)


def is_functional(program: ExportedProgram) -> bool:
    """Whether ``program`` is marked functional already (:func:`mark_functional`)."""
    return getattr(program, _FUNCTIONAL_FORM, None) is program


@contextlib.contextmanager
def _casts_kept(program: ExportedProgram) -> Iterator[None]:
    """While it lasts, every ``x.to(dtype)`` of ``program`` to a floating dtype is an
    ``aten._to_copy`` (restored after): functionalization drops a cast the tensor did
    not need at export (``.float()`` on an fp32 activation) as a no-op, but under
    ``torch.autocast`` that activation is half and the cast is what makes the ops after
    it (a router's softmax and top-k, a norm) run in fp32, as on one device."""
    graph_module = program.graph_module
    changed = []
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.to.dtype and len(node.args) >= 2 \
                and isinstance(node.args[1], torch.dtype) and node.args[1].is_floating_point:
            changed.append((node, node.target, node.args, node.kwargs))
            node.target = torch.ops.aten._to_copy.default
            node.kwargs = {"dtype": node.args[1]}
            node.args = (node.args[0],)
    if changed:
        graph_module.recompile()
    try:
        yield
    finally:
        for node, target, args, kwargs in changed:
            node.target, node.args, node.kwargs = target, args, kwargs
        if changed:
            graph_module.recompile()


def _functionalize(program: ExportedProgram) -> ExportedProgram:
    """``run_decompositions({})``: functional ATen, higher-order ops inlined. A program
    exported without weights is re-traced on fakes of the device it was exported on, as
    a real-weight one is (:func:`hapd.ir.fake.program_faked`: the same decomposed
    ops, ``reshape`` a view where the device's kernels make it one)."""
    try:
        with program_faked(program) as restore:
            with _casts_kept(program):
                functional = program.run_decompositions({})
        restore(functional)
        return functional
    except Exception as exc:  # torch names the op it could not functionalize
        raise ExportError(f"cannot make the exported program functional: {type(exc).__name__}: {exc}") from exc


# --------------------------------------------------------------------------------------
# 2. drop assertions
# --------------------------------------------------------------------------------------


def op_name(target: Any) -> str:
    """``aten.add.Tensor`` for ``torch.ops.aten.add.Tensor``, ``aten.linear`` for a
    ``default`` overload; the callable's name for anything else."""
    if isinstance(target, torch._ops.OpOverload):  # noqa: SLF001 - the public type of torch.ops.* overloads
        namespace, rest = target.name().split("::", 1)
        name, _, overload = rest.partition(".")
        overload = overload or target._overloadname  # noqa: SLF001
        return f"{namespace}.{name}" if overload in ("", "default") else f"{namespace}.{name}.{overload}"
    if isinstance(target, torch._ops.HigherOrderOperator):  # noqa: SLF001
        return f"higher_order.{target.name()}"
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)


def _is_dead_check(node: fx.Node) -> bool:
    """An assertion, or a getitem nobody reads."""
    if node.op != "call_function" or node.users:
        return False
    return node.target is operator.getitem or op_name(node.target) in ASSERTION_OPS


def _drop_assertions(module: fx.GraphModule) -> None:
    """Remove assertion nodes and unread getitems (last first, so a getitem goes before
    its producer would be looked at)."""
    graph = module.graph
    for node in reversed(list(graph.nodes)):
        if _is_dead_check(node):
            graph.erase_node(node)


# --------------------------------------------------------------------------------------
# 3. verify
# --------------------------------------------------------------------------------------


def _verify(program: ExportedProgram) -> None:
    """Every node is a functional op, and every output the loss or a buffer update."""
    for node in program.graph.nodes:
        _check_node(node)
    _check_outputs(program)


def _check_node(node: fx.Node) -> None:
    """:class:`UnsupportedOpError` for a node the functional form must not have."""
    if node.op in ("placeholder", "output"):
        return
    if node.op == "get_attr":
        raise UnsupportedOpError(
            f"node {node.name}: reads submodule or attribute {node.target!r} (a higher-order op's body "
            "that could not be inlined)",
            op="get_attr",
            node=node.name,
        )
    if node.op != "call_function":
        raise UnsupportedOpError(f"node {node.name}: unexpected fx node kind {node.op!r}", op=node.op, node=node.name)
    target = node.target
    name = op_name(target)
    if isinstance(target, torch._ops.HigherOrderOperator):  # noqa: SLF001
        raise UnsupportedOpError(
            f"unsupported higher-order op {name} at node {node.name} (it is not inlined by functionalization)",
            op=name,
            node=node.name,
        )
    if isinstance(target, torch._ops.OpOverload) and _mutates(target):  # noqa: SLF001
        raise UnsupportedOpError(
            f"op {name} at node {node.name} writes into its operands and has no functional form "
            "(register a functional variant, or write the model without it)",
            op=name,
            node=node.name,
        )


def _mutates(op: torch._ops.OpOverload) -> bool:  # noqa: SLF001
    """An op that writes into an operand: a mutable schema, an in-place name (``add_``)
    or an ``out=`` variant."""
    schema = op._schema  # noqa: SLF001
    base = schema.name.split("::", 1)[-1]
    in_place = base.endswith("_") and not base.endswith("__")
    out_variant = op._overloadname.startswith("out")  # noqa: SLF001
    return bool(schema.is_mutable) or in_place or out_variant


def _check_outputs(program: ExportedProgram) -> None:
    """:class:`ExportError` for an output other than the loss or a buffer update."""
    for spec in program.graph_signature.output_specs:
        if spec.kind in ALLOWED_OUTPUTS:
            continue
        what = {
            OutputKind.USER_INPUT_MUTATION: "writes into its input",
            OutputKind.PARAMETER_MUTATION: "writes into its parameter",
            OutputKind.GRADIENT_TO_PARAMETER: "returns the gradient of parameter",
            OutputKind.GRADIENT_TO_USER_INPUT: "returns the gradient of input",
            OutputKind.TOKEN: "has an effect token output",
            OutputKind.LOSS_OUTPUT: "returns a joint-graph loss",
        }.get(spec.kind, f"has a {spec.kind.name} output")
        target = f" {spec.target}" if spec.target else ""
        raise ExportError(
            f"the model {what}{target} (node {spec.arg.name}); hapd keeps only the loss and buffer updates "
            "as effects of a step",
            node=getattr(spec.arg, "name", None),
        )


# --------------------------------------------------------------------------------------
# 4. views as reshapes
# --------------------------------------------------------------------------------------

_RESHAPES = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default)  # noqa: SLF001


def _views_as_reshapes(module: fx.GraphModule) -> None:
    """``aten.view``/``aten._unsafe_view``/``aten.reshape`` → ``aten.reshape`` to the
    result's shape (same values; no stride requirement on the real tensor). The shape is
    written out (no ``-1``): re-tracing a reshape gives a view to the inferred shape, so
    only the written-out form survives normalizing twice."""
    for node in module.graph.nodes:
        if node.op != "call_function" or node.target not in _RESHAPES:
            continue
        node.target = torch.ops.aten.reshape.default
        shape = _static_shape(node.meta.get("val"))
        if shape is not None:
            node.args = (node.args[0], shape)


# --------------------------------------------------------------------------------------
# 5. linears on leading dims
# --------------------------------------------------------------------------------------


def _linear_on_leading_dims(module: fx.GraphModule) -> None:
    """``reshape(x, [∏A, ∏T]) → linear → reshape(·, A + [n])`` becomes
    ``reshape(x, A + [∏T]) → linear``: a linear acts on each row alone, so running it on
    the rows with their leading dims ``A`` kept gives the same values, and the result
    already has the shape the second reshape gave it.

    ``nn.MultiheadAttention`` (torchvision's ViT) flattens ``[seq, batch, heads, dim]``
    to ``[seq·batch, heads·dim]`` for its output projection and unflattens right after.
    Flattened, the batch rows interleave with the sequence, so no split of the batch
    survives the reshape and a plan must gather the whole activation around every
    attention output; with the leading dims kept, the batch split flows through."""
    changed = False
    for flat in list(module.graph.nodes):
        if flat.op != "call_function" or flat.target is not torch.ops.aten.reshape.default or len(flat.users) != 1:
            continue
        (lin,) = flat.users
        if lin.target is not torch.ops.aten.linear.default or lin.args[0] is not flat or len(lin.users) != 1:
            continue
        (back,) = lin.users
        if back.target is not torch.ops.aten.reshape.default:
            continue
        x, flat_val, lin_val, back_val = flat.args[0], flat.meta.get("val"), lin.meta.get("val"), back.meta.get("val")
        x_shape, flat_shape = _static_shape(getattr(x, "meta", {}).get("val")), _static_shape(flat_val)
        lin_shape, back_shape = _static_shape(lin_val), _static_shape(back_val)
        if None in (x_shape, flat_shape, lin_shape, back_shape) or len(flat_shape) != 2:
            continue
        lead = _leading_split(x_shape, flat_shape)
        if lead is None or back_shape != x_shape[:lead] + lin_shape[1:]:
            continue
        rows = x_shape[:lead] + flat_shape[1:]
        flat.args = (x, rows)
        flat.meta["val"] = x.meta["val"].reshape(rows)
        lin.meta["val"] = back_val
        back.replace_all_uses_with(lin)
        module.graph.erase_node(back)
        changed = True


def _leading_split(shape: list[int], flat: list[int]) -> int | None:
    """The ``j ≥ 2`` with ``∏shape[:j] = flat[0]`` and ``∏shape[j:] = flat[1]``: the
    reshape flattens two or more leading dims into rows and the rest into one row's
    features. ``None`` when there is none."""
    for j in range(2, len(shape)):
        if math.prod(shape[:j]) == flat[0] and math.prod(shape[j:]) == flat[1]:
            return j
    return None


def _static_shape(val: Any) -> list[int] | None:
    """The shape of a tensor value when every dim is an int."""
    if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
        return None
    return [int(d) for d in val.shape]


# --------------------------------------------------------------------------------------
# 6. constant attention masks
# --------------------------------------------------------------------------------------

MAX_CONSTANT_MASK = 1 << 28
"""Most elements of a mask worth computing at normalize time."""


def _constant_attention_masks(module: fx.GraphModule) -> None:
    """An attention mask computed from constants alone becomes the attention's own
    arguments: no mask (it keeps every key) or ``is_causal`` (it is the causal triangle,
    top left aligned as torch's ``is_causal`` is). The mask's nodes are dropped when
    nothing else reads them."""
    changed = False
    # every layer of a model reads the same mask: it is computed and read once per shape
    meanings: dict[tuple[fx.Node, int, int], str | None] = {}
    for node in module.graph.nodes:
        if node.op != "call_function" or node.target is not ATTENTION:
            continue
        named = attention_args(node.args, node.kwargs)
        mask, query, key = named["attn_mask"], named["query"], named["key"]
        if not isinstance(mask, fx.Node) or named["is_causal"]:
            continue
        q_shape, k_shape = _static_shape(query.meta.get("val")), _static_shape(key.meta.get("val"))
        if q_shape is None or k_shape is None:
            continue
        seen = (mask, q_shape[-2], k_shape[-2])
        if seen not in meanings:
            value = _constant_value(mask)
            meanings[seen] = None if value is None else _mask_meaning(value, q_shape[-2], k_shape[-2])
        meaning = meanings[seen]
        if meaning is None:
            continue
        named.update(attn_mask=None, is_causal=meaning == "causal")
        leading = ATTENTION_ARGS[:6]  # through is_causal, positional; scale and enable_gqa as they were given
        node.args = tuple(named[k] for k in leading) + tuple(node.args[6:])
        node.kwargs = {k: v for k, v in node.kwargs.items() if k not in leading}
        changed = True
    if changed:
        module.graph.eliminate_dead_code()


def _constant_value(node: fx.Node) -> torch.Tensor | None:
    """``node``'s value when it depends on no placeholder, ``get_attr`` or random op and
    is small enough (computed on the CPU); None otherwise."""
    order: list[fx.Node] = []
    seen: set[fx.Node] = set()

    def visit(n: fx.Node) -> bool:
        if n in seen:
            return True
        seen.add(n)
        if n.op != "call_function" or torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()):
            return False
        if not all(visit(i) for i in n.all_input_nodes):
            return False
        order.append(n)
        return True

    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.numel() > MAX_CONSTANT_MASK or not visit(node):
        return None
    env: dict[fx.Node, Any] = {}
    on_cpu = lambda v: torch.device("cpu") if isinstance(v, torch.device) else v  # noqa: E731
    try:
        for n in order:
            args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env[a])
            args, kwargs = torch.utils._pytree.tree_map(on_cpu, (args, kwargs))  # noqa: SLF001 - torch's pytree
            env[n] = n.target(*args, **kwargs)
    except Exception:  # an op that cannot run here: leave the mask as it is
        return None
    out = env[node]
    return out if isinstance(out, torch.Tensor) else None


def _mask_meaning(mask: torch.Tensor, queries: int, keys: int) -> str | None:
    """``"none"`` when ``mask`` keeps every key of every query, ``"causal"`` when it keeps
    exactly the causal triangle (``tril`` of a ``queries × keys`` matrix) for every
    leading index; None otherwise. A float mask keeps where it is 0 and drops where it
    is ``-inf`` or the dtype's lowest value (what transformers writes)."""
    if mask.dim() < 2 or tuple(mask.shape[-2:]) not in ((queries, keys), (1, keys)):
        return None
    for d in range(mask.dim() - 2):  # a leading dim expanded from one row (stride 0): read that row once
        if mask.stride(d) == 0:
            mask = mask.narrow(d, 0, 1)
    if mask.dtype == torch.bool:
        keep = mask
    elif mask.is_floating_point():
        dropped = torch.isneginf(mask) | (mask == torch.finfo(mask.dtype).min)
        if not bool(((mask == 0) | dropped).all()):
            return None
        keep = mask == 0
    else:
        return None
    if bool(keep.all()):
        return "none"
    causal = torch.ones(queries, keys, dtype=torch.bool).tril()
    if keep.shape[-2] == queries and bool((keep == causal).all()):
        return "causal"
    return None


# --------------------------------------------------------------------------------------
# 7. canonical names
# --------------------------------------------------------------------------------------


def _base_name(node: fx.Node) -> str:
    """The name fx would give a fresh node of this op (``linear`` for ``aten.linear``)."""
    if node.target is operator.getitem:
        return "getitem"
    if isinstance(node.target, torch._ops.OpOverload):  # noqa: SLF001
        return node.target._schema.name.split("::", 1)[-1]  # noqa: SLF001
    return getattr(node.target, "__name__", None) or "op"


def _canonical_names(program: ExportedProgram) -> ExportedProgram:
    """The same program on a copy of its graph whose op nodes are named by fx's own
    namespace from their ops alone, in graph order (placeholders keep their names:
    the signature names them)."""
    old = program.graph
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    renamed: dict[str, str] = {}
    for node in old.nodes:
        if node.op == "output":
            new = graph.output(fx.node.map_arg(node.args[0], env.__getitem__))
        elif node.op == "placeholder":
            new = graph.placeholder(node.name)
        else:
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            new = graph.create_node(node.op, node.target, args, kwargs, name=_base_name(node))
        new.meta = copy.copy(node.meta)
        env[node] = new
        renamed[node.name] = new.name
    signature = ExportGraphSignature(
        input_specs=list(program.graph_signature.input_specs),
        output_specs=[_renamed_output(spec, renamed) for spec in program.graph_signature.output_specs],
    )
    module_call_graph = copy.deepcopy(program.module_call_graph)
    for entry in module_call_graph:
        if entry.signature is not None:
            for arg in [*entry.signature.inputs, *entry.signature.outputs]:
                if isinstance(getattr(arg, "name", None), str) and arg.name in renamed:
                    arg.name = renamed[arg.name]
    out = ExportedProgram(
        root=program.graph_module,  # its attributes are copied onto the module made of graph (code generated once)
        graph=graph,
        graph_signature=signature,
        state_dict=program.state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=module_call_graph,
        example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=program.verifiers,
    )
    out.graph_module.meta.update(program.graph_module.meta)
    return out


def _renamed_output(spec: OutputSpec, renamed: dict[str, str]) -> OutputSpec:
    if isinstance(spec.arg, TensorArgument) and spec.arg.name in renamed:
        return OutputSpec(kind=spec.kind, arg=TensorArgument(name=renamed[spec.arg.name]), target=spec.target)
    return spec


def buffer_mutations(program: ExportedProgram) -> list[tuple[str, str]]:
    """``(buffer fqn, fx node of its new value)`` for every buffer the program updates,
    in output order."""
    return [
        (str(spec.target), spec.arg.name)
        for spec in program.graph_signature.output_specs
        if spec.kind == OutputKind.BUFFER_MUTATION
    ]
