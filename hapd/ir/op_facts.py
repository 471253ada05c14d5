"""Facts about ATen ops that the Python side of hapd keys on, in one place.

Ops are named as the graph IR names them (:func:`hapd.ir.lower.canonical_op_name`):
``aten.linear`` for ``torch.ops.aten.linear.default``, the overload kept unless it is
``default`` (``aten.sum.dim_IntList``). Code that matches fx nodes needs torch's op
objects: :func:`resolve` and :func:`overloads` give them.

- loss ops (:data:`LOSS_OPS`) and aten's reduction codes (:data:`REDUCTIONS`): the
  lowering records the loss's reduction, the runtime divides a mean loss on a split
  batch by the global count, overlapped execution and pipelines add the losses of parts
  of the batch;
- ops a loss may pass through after its reduction, and ops that sum
  (:data:`PASS_THROUGH_OPS`, :data:`SUM_OPS`);
- eval-mode ops (:data:`MODE_DEPENDENT_OPS`, :data:`SAME_OP_IN_EVAL`, :data:`EVAL_RULE`):
  where a model's eval forward needs a program of its own;
- ops whose kernels reject an empty split (:data:`NO_EMPTY_SPLIT_OPS`).

Adding a loss op is one entry in :data:`LOSS_OPS` (and, for the core to split it over
the batch, its rule in ``rustcore/core/src/rules/loss.rs``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch


@dataclass(frozen=True)
class LossOp:
    """What hapd needs to know of a loss op."""

    reduction_arg: int
    """The position of its ``reduction`` argument (aten's code: :data:`REDUCTIONS`;
    :data:`MEAN` when not given)."""
    batch_split: bool = False
    """The core's loss rules split it over the batch
    (``rustcore/core/src/rules/loss.rs``): a mean on a split batch runs as the local sum
    over the all-reduced count of counted targets
    (:data:`hapd.spmd.adapters.ADAPTERS`). Overlapped execution and pipelines, which
    add the losses of parts of the batch, take its sum (and overlapped execution its
    mean, merging the parts' counts)."""


LOSS_OPS: Mapping[str, LossOp] = MappingProxyType({
    "aten.cross_entropy_loss": LossOp(reduction_arg=3, batch_split=True),
    "aten.nll_loss": LossOp(reduction_arg=3, batch_split=True),
    "aten.nll_loss_forward": LossOp(reduction_arg=3),
    "aten.mse_loss": LossOp(reduction_arg=2),
})
"""Loss ops with a ``reduction`` argument, by IR op name."""

BATCH_SPLIT_LOSSES = frozenset(name for name, op in LOSS_OPS.items() if op.batch_split)
"""The loss ops the core splits over the batch (see :attr:`LossOp.batch_split`)."""

REDUCTIONS: Mapping[int, str] = MappingProxyType({0: "none", 1: "mean", 2: "sum"})
"""The reduction code of aten's loss ops -> its name."""
MEAN, SUM = 1, 2
"""The reduction codes of a mean (the schemas' default) and a sum."""

PASS_THROUGH_OPS = frozenset({
    "aten.view", "aten.reshape", "aten.clone", "aten._to_copy", "aten.squeeze", "aten.squeeze.dims",
    "aten.unsqueeze", "aten.alias", "aten.detach",
})
"""Ops a loss may pass through after its reduction (they keep values)."""

SUM_OPS = frozenset({"aten.sum", "aten.sum.dim_IntList"})
"""Ops that sum their input: a loss that ends in one is a sum over samples."""

MODE_DEPENDENT_OPS = frozenset({
    "aten.native_dropout", "aten.dropout", "aten.feature_dropout", "aten.alpha_dropout", "aten.feature_alpha_dropout",
    "aten._native_batch_norm_legit_functional", "aten._native_batch_norm_legit", "aten.native_batch_norm",
    "aten.batch_norm", "aten._batch_norm_with_update_functional", "aten._batch_norm_with_update",
    "aten.rrelu_with_noise",
})
"""Ops that compute differently in ``eval()`` mode: the exported (training-mode) graph
cannot stand for the model's eval forward where they occur (the model is exported again
in eval mode)."""

SAME_OP_IN_EVAL: Mapping[str, str] = MappingProxyType({
    "aten._native_batch_norm_legit_functional": "aten.batch_norm",
    "aten._native_batch_norm_legit_no_training": "aten.batch_norm",
    "aten._native_batch_norm_legit": "aten.batch_norm",
    "aten.native_batch_norm": "aten.batch_norm",
})
"""Graph ops that are one op of the model in training and in eval mode (batch norm
with batch statistics and with running ones), for
:func:`hapd.train.programs.aligned_force`."""

EVAL_RULE: Mapping[str, str] = MappingProxyType({"data-parallel-synced": "data-parallel"})
"""A training-mode rule -> the rule of the same op in eval mode that holds its operands
alike (batch norm's batch split with synchronized statistics -> the batch split on
running statistics)."""

NO_EMPTY_SPLIT_OPS = frozenset({"aten.conv1d", "aten.conv2d", "aten.conv3d", "aten.max_pool2d",
                                "aten.scaled_dot_product_attention"})
"""Ops whose kernels reject (or crash on) a zero-length split dim: the runtime pads an
empty piece with one zero slice and cuts the output back."""


def resolve(name: str) -> torch._ops.OpOverload:  # noqa: SLF001 - the public type of torch.ops.* overloads
    """torch's op object for an IR op name: ``aten.sum.dim_IntList`` ->
    ``torch.ops.aten.sum.dim_IntList``, ``aten.linear`` -> ``torch.ops.aten.linear.default``."""
    namespace, op, *overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload[0] if overload else "default")


def overloads(names: Iterable[str]) -> frozenset[torch._ops.OpOverload]:  # noqa: SLF001
    """torch's op objects for these IR op names (an fx node's ``target``)."""
    return frozenset(resolve(name) for name in names)



ATTENTION = torch.ops.aten.scaled_dot_product_attention.default
"""The attention op (random where its ``dropout_p`` is above 0)."""
ATTENTION_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
"""Its schema's arguments, in order."""
_ATTENTION_DEFAULTS = (None, None, None, None, 0.0, False, None, False)


def attention_args(args: Iterable[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """An attention call's arguments by name, the schema's defaults filled in."""
    values = dict(zip(ATTENTION_ARGS, _ATTENTION_DEFAULTS))
    values.update(zip(ATTENTION_ARGS, args))
    values.update(kwargs)
    return values


__all__ = ["ATTENTION", "ATTENTION_ARGS", "BATCH_SPLIT_LOSSES", "EVAL_RULE", "LOSS_OPS", "MEAN", "MODE_DEPENDENT_OPS",
           "NO_EMPTY_SPLIT_OPS", "PASS_THROUGH_OPS", "REDUCTIONS", "SAME_OP_IN_EVAL", "SUM", "SUM_OPS", "LossOp",
           "attention_args", "overloads", "resolve"]
