"""A rank program runs the kernels eager PyTorch runs (``bench/op_counts.py``): per
training step, as many attention, matmul, norm and loss kernels — no attention run
with a materialized mask where eager runs a causal one, no block recomputed where the
device has room, no norm decomposed."""

from __future__ import annotations

import pytest
from _bench import load

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", ["gpt2", "llama", "t5"])
def test_a_rank_step_runs_eagers_kernels(name) -> None:
    bench = load("op_counts")
    eager, mine, eager_by, mine_by = bench.compare(name, "tiny", 4, 0.0)
    assert eager_by["attention"] > 0 and eager_by["matmul"] > 0 and eager_by["loss"] > 0
    for category in bench.CATEGORIES:
        assert mine_by[category] == eager_by[category], (category, bench._differences(
            eager, mine, lambda op: bench.category(op) == category))


def test_categories() -> None:
    bench = load("op_counts")
    assert bench.category("aten._scaled_dot_product_flash_attention_for_cpu.default") == "attention"
    assert bench.category("aten.addmm.default") == "matmul"
    assert bench.category("aten.native_layer_norm_backward.default") == "norm"
    assert bench.category("aten.nll_loss_forward.default") == "loss"
    assert bench.category("aten.add.Tensor") == "other"
