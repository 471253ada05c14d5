"""Dropout drawn with hapd's counter-based generator, on a rank and on one device.

A plan may split a dropout like an element-wise op (``rustcore/core/src/rules/random.rs``):
each rank runs :class:`CounterDropout` on its piece, drawing its slice of the
single-device mask with :func:`hapd.runtime.counter_rng.uniform`. What keys a draw:

- the **seed**: an attribute of every :class:`CounterDropout`, set at distribute time
  (default ``torch.initial_seed()`` of rank 0, which distribute sends to the other ranks;
  :func:`set_seed` changes it later, on every rank alike);
- the **stream**: the dropout's position among the program's dropouts in graph order
  (:func:`random_streams`), the same on every rank and in the single-device reference;
- the **step**: a scalar int64 buffer of the module (:data:`STEP`) that a forward
  pre-hook *replaces* (never writes into) before each forward, so it advances once per
  training forward, is equal on every rank, and a recompute span rerun in the backward
  (non-reentrant ``torch.utils.checkpoint`` keeps the tensors its forward read) draws
  with the value its forward used;
- the **part**: which part of the batch a run computes when a batch is run in parts
  (pipeline micro-batches: the buffer :data:`PART`; overlapped duplicas: the
  ``duplica`` argument), so that the parts draw distinct masks;
- the element's linear index in the single-device tensor: the piece's offsets along
  each dim (where this rank's piece starts) plus its local index.

:func:`counter_reference` is the single-device program with the same generator in place:
what ``hapd check`` and the exactness tests compare a distributed program against.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, fx, nn
from torch.export import ExportedProgram

from hapd.compiler.normalize import normalize
from hapd.runtime.counter_rng import uniform

DROPOUT_OPS = frozenset({torch.ops.aten.native_dropout.default, torch.ops.aten.dropout.default})
"""The random ops hapd draws with its own generator (``native_dropout``, and
``dropout`` should it survive normalization)."""
SEED = "hapd_rng_seed"
"""The rank module attribute holding the seed its dropouts draw with (another program of
the same model, distributed with ``shared=``, draws with it too)."""
STEP = "hapd_rng_step"
"""The module buffer holding the training step the dropouts draw for."""
PART = "hapd_rng_part"
"""The module buffer holding the part of the batch being run (pipeline micro-batch)."""


class CounterDropout(nn.Module):
    """``native_dropout(x, p, train)`` on this rank's piece of ``x``, whose single-device
    shape is ``global_shape`` and which starts at ``offsets``: returns ``(result,
    mask)`` as ``native_dropout`` does (``result = x · mask / (1 − p)``, ``mask`` bool;
    with ``train`` false: ``x`` and an all-true mask), or the result alone for
    ``aten.dropout`` (``single``)."""

    def __init__(self, p: float, train: bool, stream: int, global_shape: Sequence[int], offsets: Sequence[int],
                 seed: int, *, single: bool = False):
        super().__init__()
        self.p, self.drops, self.stream = float(p), bool(train), int(stream)
        # (``drops``, not ``train``: that name is nn.Module's mode switch)
        self.global_shape, self.offsets = [int(s) for s in global_shape], [int(o) for o in offsets]
        self.seed = int(seed)
        self.single = single

    def forward(self, x: Tensor, step: Tensor, part: Tensor, duplica: int = 0) -> Any:
        if not self.drops:
            out, mask = x.clone(), torch.ones_like(x, dtype=torch.bool)
        else:
            u = uniform(self.seed, self.stream, step, self.global_shape, self.offsets, list(x.shape), x.device,
                        part=part * 2 + duplica)
            mask = u >= self.p
            scale = 1.0 / (1.0 - self.p) if self.p < 1.0 else 0.0
            out = x * mask.to(x.dtype) * scale
        return out if self.single else (out, mask)

    def extra_repr(self) -> str:
        return (f"p={self.p}, train={self.drops}, stream={self.stream}, global_shape={self.global_shape}, "
                f"offsets={self.offsets}")


def dropout_args(node: fx.Node) -> tuple[float, bool]:
    """``(p, train)`` of a dropout node (``train=None`` is training, as in ATen)."""
    names = ("input", "p", "train")
    values = list(node.args) + [node.kwargs.get(n) for n in names[len(node.args):]]
    train = values[2]
    return float(values[1]), True if train is None else bool(train)


def random_streams(graph: fx.Graph) -> dict[str, int]:
    """Dropout node name -> its stream: its position among the graph's dropouts."""
    drops = (n for n in graph.nodes if n.op == "call_function" and n.target in DROPOUT_OPS)
    return {n.name: k for k, n in enumerate(drops)}


def has_random_ops(graph: fx.Graph) -> bool:
    """Whether the graph has a dropout hapd draws."""
    return any(n.op == "call_function" and n.target in DROPOUT_OPS for n in graph.nodes)


def default_seed() -> int:
    """The seed a distributed program draws with unless told: the process's
    ``torch.initial_seed()`` (the same on every rank when each set it alike)."""
    return torch.initial_seed()


def install_step(module: nn.Module, shared: nn.Module | None = None) -> None:
    """Give ``module`` the step and part buffers (not saved in its state dict) and a
    forward pre-hook that advances the step by replacing the buffer. With ``shared``
    (the training program of the same model, whose pieces ``module`` runs on) the two
    count one sequence of steps, as one device training the model does: a forward of
    either advances ``shared``'s step, and ``module`` draws with it."""
    device = next((t.device for t in (*module.parameters(), *module.buffers())), None)
    for name in (STEP, PART):
        old = getattr(module, name, None)
        value = old if isinstance(old, Tensor) else torch.zeros((), dtype=torch.int64, device=device)
        module.register_buffer(name, value, persistent=False)
    if shared is not None and isinstance(getattr(shared, STEP, None), Tensor):
        module.register_forward_pre_hook(lambda m, _args: _advance_shared(m, shared))
    else:
        module.register_forward_pre_hook(lambda m, _args: advance_step(m))


def _advance_shared(module: nn.Module, shared: nn.Module) -> None:
    """The next step of ``shared``'s sequence, drawn with by ``module``."""
    advance_step(shared)
    setattr(module, STEP, getattr(shared, STEP))


def advance_step(module: nn.Module) -> None:
    """The next training step: a new tensor (a recompute span keeps the old one)."""
    setattr(module, STEP, getattr(module, STEP) + 1)


def set_part(module: nn.Module, part: int) -> None:
    """The part of the batch the next forward runs (a new tensor, as for the step)."""
    step = getattr(module, STEP)
    setattr(module, PART, torch.full((), part, dtype=torch.int64, device=step.device))


def set_seed(module: nn.Module, seed: int) -> None:
    """Every dropout of ``module`` draws with ``seed`` from now on."""
    for sub in module.modules():
        if isinstance(sub, CounterDropout):
            sub.seed = int(seed)


def counter_reference(program: ExportedProgram, seed: int) -> nn.Module:
    """The single-device program (``program.module()`` of the normalized program, a
    copy) with every dropout drawn by :class:`CounterDropout` with ``seed``: what a
    distributed program with the same seed equals. A program without dropout gives a
    copy of ``program.module()``."""
    if not has_random_ops(program.graph):
        return copy.deepcopy(program.module())
    gm = copy.deepcopy(normalize(program).module())
    streams = random_streams(gm.graph)
    gm.register_buffer(STEP, torch.zeros((), dtype=torch.int64), persistent=False)
    gm.register_buffer(PART, torch.zeros((), dtype=torch.int64), persistent=False)
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in DROPOUT_OPS:
            continue
        p, train = dropout_args(node)
        shape = list(node.args[0].meta["val"].shape)
        single = node.target is torch.ops.aten.dropout.default
        name = f"hapd_dropout_{streams[node.name]}"
        gm.add_module(name, CounterDropout(p, train, streams[node.name], shape, [0] * len(shape), seed, single=single))
        with gm.graph.inserting_before(node):
            step, part = gm.graph.get_attr(STEP), gm.graph.get_attr(PART)
            new = gm.graph.call_module(name, (node.args[0], step, part))
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()
    install_step(gm)
    return gm


__all__ = ["DROPOUT_OPS", "PART", "SEED", "STEP", "CounterDropout", "advance_step", "counter_reference", "default_seed",
           "dropout_args", "has_random_ops", "install_step", "random_streams", "set_part", "set_seed"]
