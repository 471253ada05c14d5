"""The op facts (:mod:`hapd.ir.op_facts`) name real torch ops: every name resolves
to an ``OpOverload`` of this torch and is the name the graph IR gives that op, and each
loss op's reduction argument is where its schema has ``reduction``."""

from __future__ import annotations

import pytest
import torch

from hapd.ir import op_facts
from hapd.ir.lower import canonical_op_name

NAMES = sorted({
    *op_facts.LOSS_OPS, *op_facts.PASS_THROUGH_OPS, *op_facts.SUM_OPS, *op_facts.MODE_DEPENDENT_OPS,
    *op_facts.SAME_OP_IN_EVAL, *op_facts.SAME_OP_IN_EVAL.values(), *op_facts.NO_EMPTY_SPLIT_OPS,
})


@pytest.mark.parametrize("name", NAMES)
def test_every_name_is_a_torch_op(name: str) -> None:
    op = op_facts.resolve(name)
    assert isinstance(op, torch._ops.OpOverload)  # noqa: SLF001 - the public type of torch.ops.* overloads
    assert canonical_op_name(op) == name


@pytest.mark.parametrize("name", sorted(op_facts.LOSS_OPS))
def test_loss_reduction_argument(name: str) -> None:
    arguments = op_facts.resolve(name)._schema.arguments  # noqa: SLF001 - the op's schema
    at = op_facts.LOSS_OPS[name].reduction_arg
    assert arguments[at].name == "reduction"
    assert arguments[at].default_value in (None, op_facts.MEAN)  # None: the op has no default
    assert op_facts.REDUCTIONS[op_facts.MEAN] == "mean" and op_facts.REDUCTIONS[op_facts.SUM] == "sum"


def test_batch_split_losses_are_loss_ops() -> None:
    assert op_facts.BATCH_SPLIT_LOSSES == {"aten.cross_entropy_loss", "aten.nll_loss"}
    assert op_facts.BATCH_SPLIT_LOSSES <= set(op_facts.LOSS_OPS)
    assert op_facts.overloads(op_facts.SUM_OPS) == {torch.ops.aten.sum.default, torch.ops.aten.sum.dim_IntList}
