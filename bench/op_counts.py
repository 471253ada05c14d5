"""The kernels a training step runs: eager PyTorch against hapd's rank program.

    .venv/bin/python bench/op_counts.py                      # every zoo model, tiny, dropout 0
    .venv/bin/python bench/op_counts.py --dropout default    # the libraries' default dropout
    .venv/bin/python bench/op_counts.py --models gpt2 llama --size small

For each zoo model, one training step (forward and backward) of the model as users run
it and of ``hapd.parallelize``'s program on one device (no profile: the device as it
is), each counted below autograd with a ``TorchDispatchMode``: the ATen kernels that
run, grouped by what they are (:data:`CATEGORIES`: attention, matmuls, norms, losses,
and every other op as ``other``). A rank program that exported into slower math shows
here as a count eager does not have (a masked attention where eager runs a causal one,
a block recomputed, a decomposed norm). With dropout, one device keeps torch's own
dropout and attention kernels (``distribute``'s ``rng="torch"``), as the model has them;
only a plan of several devices draws with hapd's counter-based generator
(``docs/runtime.md``).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hapd  # noqa: E402
from hapd.models import zoo  # noqa: E402

CATEGORIES: dict[str, tuple[str, ...]] = {
    "attention": ("_scaled_dot_product", "scaled_dot_product"),
    "matmul": ("aten.mm.", "aten.addmm.", "aten.bmm.", "aten.baddbmm.", "aten.convolution", "aten.linear."),
    "norm": ("native_layer_norm", "native_batch_norm", "_native_batch_norm", "_fused_rms_norm", "native_group_norm",
             "batch_norm_backward"),
    "loss": ("nll_loss", "_log_softmax", "cross_entropy"),
}
"""Category → prefixes (of ``str(op)``, ``aten.NAME.OVERLOAD``) of the kernels it counts."""


def category(op: str) -> str:
    """The :data:`CATEGORIES` entry ``op`` (``aten.mm.default``…) falls in, or ``other``."""
    for name, prefixes in CATEGORIES.items():
        if any(op.startswith(p) or op.startswith("aten." + p) for p in prefixes):
            return name
    return "other"


class _Count(TorchDispatchMode):
    """Counts every ATen op dispatched below autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def step_ops(module: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> Counter[str]:
    """The ATen ops of one forward and backward of ``module`` on ``inputs``."""
    with _Count() as counting:
        module(*inputs).backward()
    return counting.ops


def by_category(ops: Counter[str]) -> Counter[str]:
    out: Counter[str] = Counter()
    for op, n in ops.items():
        out[category(op)] += n
    return out


def compare(name: str, size: str, batch: int, dropout: float | None) -> tuple[Counter[str], Counter[str], Counter[str],
                                                                             Counter[str]]:
    """(eager ops, hapd ops, eager by category, hapd by category) of one training step
    of zoo model ``name``."""
    eager, inputs = zoo.make(name, batch=batch, size=size, dropout=dropout)
    step_ops(eager, inputs)  # warm: lazy inits (transformers' rotary caches) run once
    eager_ops = step_ops(eager, inputs)
    model, _ = zoo.make(name, batch=batch, size=size, dropout=dropout)
    module = hapd.parallelize(model, inputs, use_daemon=False, verbose=False)
    step_ops(module, inputs)
    hapd_ops = step_ops(module, inputs)
    return eager_ops, hapd_ops, by_category(eager_ops), by_category(hapd_ops)


def _row(name: str, eager: Counter[str], mine: Counter[str]) -> str:
    cells = [f"{eager[c]:>4}/{mine[c]:<4}" for c in (*CATEGORIES, "other")]
    same = all(eager[c] == mine[c] for c in CATEGORIES)
    return f"{name:<10} " + " ".join(f"{cell:>11}" for cell in cells) + ("   equal" if same else "   DIFFER")


def _differences(eager: Counter[str], mine: Counter[str], keep: Callable[[str], bool]) -> list[str]:
    return [f"{op} {eager[op]}→{mine[op]}" for op in sorted(set(eager) | set(mine)) if keep(op) and eager[op] != mine[op]]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(zoo.MODELS), choices=list(zoo.MODELS))
    parser.add_argument("--size", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dropout", default="0", help="a probability for every dropout, or 'default' (the "
                                                      "libraries' defaults) (default: 0)")
    args = parser.parse_args(argv)
    dropout: Any = None if args.dropout == "default" else float(args.dropout)
    import transformers

    transformers.logging.set_verbosity_error()
    print(f"ATen kernels of one training step, eager/hapd (zoo, {args.size}, batch {args.batch}, dropout "
          f"{args.dropout})")
    print(f"{'model':<10} " + " ".join(f"{c:>11}" for c in (*CATEGORIES, "other")))
    for name in args.models:
        try:
            dropout_here = dropout if name not in ("resnet18",) else None
            eager, mine, eager_c, mine_c = compare(name, args.size, args.batch, dropout_here)
        except Exception as exc:  # a model that fails is a line of the report, not the end of it
            print(f"{name:<10} failed: {type(exc).__name__}: {exc}")
            continue
        print(_row(name, eager_c, mine_c))
        diff = _differences(eager, mine, lambda op: category(op) != "other")
        if diff:
            print("           " + ", ".join(diff))


if __name__ == "__main__":
    main()
