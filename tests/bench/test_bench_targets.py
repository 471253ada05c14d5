"""bench/counter_draw.py's verdict without a GPU: the fused kernel's bits against the
CPU's torch ops decide its exit status and its last line."""

from __future__ import annotations

import pytest

import _bench


@pytest.fixture(scope="module")
def bench():
    return _bench.load("counter_draw")


def _row(what: str, dtype: str, mask: bool | None = None, result: bool | None = None) -> dict:
    row = {"what": what, "shape": [1, 1024, 768], "dtype": dtype, "native_s": 1e-3, "counter_ops_s": 2e-3}
    if mask is not None:
        row.update(fused_mask_equal_cpu=mask, fused_result_equal_cpu=result)
    return row


def test_bits_that_differ_from_the_cpus_exit_1_and_say_so_last(bench):
    rows = [_row("hidden", "float32", True, True), _row("probabilities", "bfloat16", True, False)]
    assert bench.exit_status(rows) == 1
    assert bench.verdict(rows) == ("FAILED: the fused kernel's bits differ from the CPU's torch ops in "
                                   "probabilities bfloat16 (result): exit 1")
    assert bench.exit_status([_row("hidden", "float32", False, False)]) == 1
    assert "hidden float32 (mask, result)" in bench.verdict([_row("hidden", "float32", False, False)])


def test_equal_bits_or_none_compared_exit_0(bench):
    rows = [_row("hidden", "float32", True, True), _row("probabilities", "bfloat16", True, True)]
    assert bench.exit_status(rows) == 0
    assert bench.verdict(rows) == "the fused kernel's bits equal the CPU's torch ops in all 2 row(s) compared"
    cpu = [_row("hidden", "float32"), {"what": "attention fwd+bwd, causal, dropout 0.1", "native_s": 1.0}]
    assert bench.exit_status(cpu) == 0
    assert bench.verdict(cpu) == "no fused kernel ran (no CUDA): no bits compared"
