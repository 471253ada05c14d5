"""Tied parameters: several names for one tensor (GPT-2's ``lm_head.weight`` is
``transformer.wte.weight``).

``torch.export`` keeps one placeholder per name but reads only one of them: every use of
the tensor goes through the placeholder of one name (non-strict export: the name
registered last), and the others have no users (strict export leaves them out of the
signature altogether; they remain in ``program.state_dict``). A loaded ``.pt2`` keeps
the sharing as one storage under both keys, not as one Python object, so tensors are
matched by storage and geometry.

The graph IR therefore has one source per tied tensor, named after the placeholder the
graph reads, and is counted once in memory and gradient sync; the lowering leaves the
unread names out (:func:`unread_aliases`) and the runtime registers the one parameter
it builds under every name (:func:`aliases_of_read`), so its gradient is the sum over
all uses, as on one device, and every name of the model resolves.
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import Tensor
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind

_STATE_KINDS = (InputKind.PARAMETER, InputKind.BUFFER)


def tensor_key(value: Tensor) -> tuple | None:
    """What makes two tensors the same memory: storage, offset, shape, strides and
    dtype (``None`` for an empty tensor). A tensor on the meta device has no memory to
    share: two names of one meta tensor (a tied weight of a model built without
    weights, in the program it was exported to) are the same Python object."""
    if value.numel() == 0:
        return None
    if value.device.type == "meta":
        return ("meta", id(value))
    ptr = value.untyped_storage().data_ptr()
    if ptr == 0:
        return None
    return (value.device, ptr, value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)


def read_targets(program: ExportedProgram) -> list[str]:
    """The parameter and buffer names whose placeholders the graph reads, in graph
    order."""
    used = {n.name for n in program.graph.nodes if n.op == "placeholder" and n.users}
    return [s.target for s in program.graph_signature.input_specs
            if s.kind in _STATE_KINDS and s.arg.name in used and s.target is not None]


def aliases_of_read(program: ExportedProgram) -> dict[str, list[str]]:
    """Name of each parameter or buffer the graph reads -> the other state-dict names
    of the same tensor that the graph does not read, in state-dict order (only names
    with aliases are keys). Two names the graph both reads stay two tensors: they were
    two objects in the model (``torch.export`` reads one placeholder per object), each
    with its own gradient."""
    state: Mapping[str, Tensor] = program.state_dict
    read = read_targets(program)
    owner: dict[tuple, str] = {}
    for target in read:
        key = tensor_key(state[target]) if target in state else None
        if key is not None:
            owner.setdefault(key, target)
    out: dict[str, list[str]] = {}
    read_set = set(read)
    for name, value in state.items():
        key = tensor_key(value)
        if name in read_set or key is None or key not in owner:
            continue
        out.setdefault(owner[key], []).append(name)
    return out


def unread_aliases(program: ExportedProgram) -> set[str]:
    """State-dict names the graph does not read that name a tensor it reads under
    another name: the IR leaves their placeholders out (one source per tensor)."""
    return {alias for aliases in aliases_of_read(program).values() for alias in aliases}


__all__ = ["aliases_of_read", "read_targets", "tensor_key", "unread_aliases"]
