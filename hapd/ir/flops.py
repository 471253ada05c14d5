"""Forward FLOPs of an op node, counted by torch's own FLOP counter.

Lowering records them on op nodes (``flops`` in the graph IR, ``docs/formats.md``) so
that the core prices ops it has no formula for — and ops whose formula undercounts —
by what torch says they cost instead of one FLOP per result element.

Each node's target runs once on **meta** tensors shaped like its operands (from the
``val`` FakeTensor propagation left in ``node.meta``) inside
:class:`torch.utils.flop_counter.FlopCounterMode`. Meta tensors allocate nothing and
compute nothing, so counting is cheap; results are cached by (target, operand shapes
and dtypes, other arguments), so the layers of a deep model are counted once. torch
counts matrix products, convolutions and attention (and what composite ops decompose
to); every other op counts 0, and then no FLOPs are recorded for it.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Hashable

import torch
from torch.utils.flop_counter import FlopCounterMode

_log = logging.getLogger(__name__)


class FlopCounter:
    """Counts forward FLOPs of fx ``call_function`` nodes, with a cache shared by all
    nodes counted through one instance (one instance per lowering)."""

    def __init__(self) -> None:
        self._cache: dict[Hashable, float] = {}

    def __call__(self, node: torch.fx.Node) -> float:
        """Forward FLOPs torch counts for ``node`` (0.0 when it counts none, when the
        target is not an ATen op, or when the op cannot run on meta tensors)."""
        target = node.target
        if not isinstance(target, torch._ops.OpOverload):  # noqa: SLF001 - the public type of torch.ops.* overloads
            return 0.0
        try:
            key = (target, _signature(node.args), _signature(node.kwargs))
            hash(key)
        except (TypeError, _NoMeta):
            return 0.0
        if not _has_tensor(key[1:]):  # creation ops: torch counts no FLOPs for them
            return 0.0
        if key not in self._cache:
            self._cache[key] = _count(target, node)
        return self._cache[key]

    @property
    def distinct(self) -> int:
        """How many distinct (target, shapes, arguments) were counted."""
        return len(self._cache)


class _NoMeta(Exception):
    """An operand without a static tensor value in ``node.meta``."""


def _signature(value: Any) -> Hashable:
    """A hashable stand-in for an argument: an fx node by its shape, dtype and
    strides; containers element by element; other values as they are."""
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return ("tensor", tuple(int(d) for d in val.shape), val.dtype, tuple(int(s) for s in val.stride()))
        if isinstance(val, (int, float, bool)):
            return ("scalar", val)
        raise _NoMeta(value.name)
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_signature(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _signature(v)) for k, v in value.items())))
    return value


def _has_tensor(signature: Hashable) -> bool:
    """Whether a :func:`_signature` holds a tensor operand."""
    if isinstance(signature, tuple):
        return signature[:1] == ("tensor",) or any(_has_tensor(v) for v in signature)
    return False


def _to_meta(value: Any) -> Any:
    """The argument with every fx node replaced by a meta tensor of its shape, dtype and
    strides (a symbolic scalar by its value), and every device by the meta device, so
    that nothing is allocated or computed."""
    if isinstance(value, torch.device):
        return torch.device("meta")
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.Tensor):
            return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device="meta")
        return val
    if isinstance(value, list):
        return [_to_meta(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    return value


def _count(target: Callable[..., Any], node: torch.fx.Node) -> float:
    """Run ``target`` on meta operands under torch's FLOP counter."""
    try:
        args, kwargs = _to_meta(node.args), _to_meta(node.kwargs)
        with FlopCounterMode(display=False) as counter:
            target(*args, **kwargs)
        return float(counter.get_total_flops())
    except Exception as exc:  # an op without a meta kernel: torch counts nothing we can read
        _log.debug("no FLOP count for %s at node %s: %s: %s", target, node.name, type(exc).__name__, exc)
        return 0.0
