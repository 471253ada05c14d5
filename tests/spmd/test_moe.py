"""Expert parallelism for transformers' mixture-of-experts models (the zoo's Mixtral and
Qwen2-MoE, run by hapd's dense experts implementation, :mod:`hapd.models.hf_experts`).

The implementation is the same function as transformers' own (loss and gradients
equal its ``eager`` loop), exports to ATen ops with rules only, and a plan forced into
expert parallelism (every einsum over stacked expert weights ``expert-parallel``) runs
on 2 Gloo ranks with uneven ratios with the loss and every gradient equal to the
single-device run, each rank holding only its experts' weights (the harness of
``tests/_exact.py``).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _exact import EXPERT_WEIGHTS, TOL, Spec, _expert_einsums, _zoo, assert_exact, assert_rules_ran, run_specs

import hapd

BATCH = 8

SPECS = [
    Spec("mixtral/expert-parallel", _zoo("mixtral", BATCH), "auto", _expert_einsums,
         frozenset({("aten.einsum", "expert-parallel")})),
    Spec("qwen2_moe/expert-parallel", _zoo("qwen2_moe", BATCH), "auto", _expert_einsums,
         frozenset({("aten.einsum", "expert-parallel")})),
]


def _expert_shapes(module: Any, plan: Any) -> dict[str, Any]:
    """Added to the harness's results: the local shapes and layouts of the expert weights."""
    return {"expert_shapes": {n: (list(p.shape), module.hapd_params[n][1]) for n, p in module.named_parameters()
                              if n.endswith(EXPERT_WEIGHTS)}}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_specs(SPECS, extra=_expert_shapes)


@pytest.mark.distributed
def test_expert_parallel_plans_match_single_device(results) -> None:
    assert_exact(results, SPECS)
    assert_rules_ran(results)


@pytest.mark.distributed
def test_each_rank_holds_only_its_experts(results) -> None:
    for r in results:
        assert r["expert_shapes"], r["case"]
        for name, (shape, layout) in r["expert_shapes"].items():
            assert layout == "Gather(0)", (r["case"], name, layout)
    for case in {r["case"] for r in results}:
        held = [r["expert_shapes"] for r in results if r["case"] == case]
        for name in held[0]:
            assert sum(h[name][0][0] for h in held) == 4 and all(h[name][0][0] < 4 for h in held), (case, name)


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_dense_experts_equal_transformers_own(name) -> None:
    """Loss and gradients of the zoo model equal those of transformers' ``eager`` loop
    over the experts, on the same weights."""
    model, inputs = _zoo(name, BATCH)()
    runs = {}
    for implementation in ("eager", "hapd_dense"):
        copied = copy.deepcopy(model)
        copied.model.set_experts_implementation(implementation)
        loss = copied(*inputs)
        loss.backward()
        runs[implementation] = (float(loss.detach()), {n: p.grad for n, p in copied.named_parameters()})
    (loss_a, grads_a), (loss_b, grads_b) = runs["eager"], runs["hapd_dense"]
    assert abs(loss_a - loss_b) <= TOL * abs(loss_a)
    for n, g in grads_a.items():
        assert float((g - grads_b[n]).abs().max()) <= TOL * float(g.abs().max()), n


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_dense_experts_export_without_opaque_ops(name) -> None:
    model, inputs = _zoo(name, BATCH)()
    summary = hapd.inspect_graph(hapd.lower(hapd.export(model, inputs), name=name).data)
    assert summary["opaque_ops"] == []
