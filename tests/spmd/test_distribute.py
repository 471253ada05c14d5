"""The distributed program reproduces the single-device run exactly.

For every benchmark model (tiny size) on 2 and 4 Gloo ranks with uneven ratios, under
the searched plan and under plans with forced layouts (tensor, expert, vocabulary,
hidden and sequence parallelism, a replicated loss, pure data parallelism, and a
profile on which the grouped collective variants are the cheap ones): the loss and
every parameter gradient equal the single-device ones (fp32: the loss within 1e-5
relative, each gradient within 1e-5 of max(its own largest value, 1e-2 of the model's
largest gradient), :func:`_exact.grad_errors`), and so does the loss after 5 Adam
steps. A coverage test checks that these cases together run every collective and every
rule the runtime adapts.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import pytest
import torch
from _dist import run_ranks
from _exact import (GRAD_FLOOR, Case, _grad_errors, _ops, distribute_saved, grad_errors, profile_flops, run_cases,
                    save_normal_form, single_device)
from conftest import MODEL_NAMES

import hapd
from hapd import models
from hapd.compiler.options import CompileOptions
from hapd.profile.schema import COLLECTIVES, estimated_profile

BATCH = 8
STEPS = 5
"""Adam steps after the first gradients: each step runs the same forward, backward and
update on the ranks' pieces, so five show that training stays on the single-device
trajectory as well as more would (every step of a rank is ~12 collectives on Gloo).
Adam's learning rate is ``_exact.LR``."""
TOL = 1e-5
"""Of the loss (relative) and of every gradient (:func:`_exact.grad_errors`)."""
RATIOS = {2: (0.6, 0.4), 4: (0.4, 0.3, 0.2, 0.1)}
PADDED = ("all_gather", "reduce_scatter")


def profile_for(world: int, *, grouped_cheap: bool = False):
    """An uneven cluster (fast ranks first) on which the padded all-gather and
    reduce-scatter are 10× faster than their grouped variants, or (``grouped_cheap``)
    100× slower."""
    padded = 1e7 if grouped_cheap else 1e10
    beta = {c: (padded if c in PADDED else 1e9) for c in COLLECTIVES}
    return estimated_profile(world, flops=profile_flops(world), beta=beta)


def force_sets(doc: dict[str, Any]) -> dict[str, dict[str, str]]:
    """Named sets of forced rules for one model's graph (only the sets that apply)."""
    linear, conv = _ops(doc, "aten.linear"), _ops(doc, "aten.conv2d")
    sdpa, emb = _ops(doc, "aten.scaled_dot_product_attention"), _ops(doc, "aten.embedding")
    loss = _ops(doc, "aten.cross_entropy_loss")
    alternate = ("column-parallel", "row-parallel")
    megatron = {n: alternate[i % 2] for i, n in enumerate(linear)}
    megatron |= {n: alternate[i % 2] for i, n in enumerate(conv)}
    megatron |= {n: "head-parallel" for n in sdpa} | {n: "vocab-parallel" for n in emb[:1]}
    sets = {"megatron": megatron, "replicated-loss": {n: "replicated" for n in loss}}
    sets["row-first"] = {n: alternate[(i + 1) % 2] for i, n in enumerate(linear)}
    if emb:
        sets["hidden"] = {n: "hidden-split" for n in emb}
    non_causal = [n["name"] for n in doc["nodes"] if n.get("op") == "aten.scaled_dot_product_attention"
                  and not any(a["name"] == "is_causal" and a["value"].get("b") for a in n["args"])]
    if non_causal:
        sets["sequence"] = {n: "query-split" for n in non_causal}
    return sets


class Exported(NamedTuple):
    """One model exported once for the module (both worlds and the two-level test use it)."""

    program: Any  # torch.export.ExportedProgram
    inputs: tuple[torch.Tensor, ...]
    saved: bytes  # its normal form, saved (save_normal_form)
    ir: Any  # hapd.ir.lower.GraphIR
    losses: tuple[float, ...]  # single device: the first loss, then after each of STEPS Adam steps
    grads: dict[str, torch.Tensor]  # single device: the first gradients, by every name


def _export(name: str):
    spec = models.get(name)
    module, config = models.build(name)
    inputs = spec.example_inputs(config, BATCH)
    program = hapd.export(module, inputs, batch_dims=spec.batch_dims)
    return program, inputs, save_normal_form(program)


def _exported(name: str) -> Exported:
    """``name`` exported, lowered and run on one device (:func:`_exact.single_device`)."""
    program, inputs, saved = _export(name)
    ir = hapd.lower(program, name=name)
    losses, grads, _ = single_device(program, inputs, STEPS)
    return Exported(program, inputs, saved, ir, losses, grads)


def _cases(world: int, exported: dict[str, Exported]) -> list[Case]:
    cases = []
    for name in MODEL_NAMES:
        ref = exported[name]
        ir = ref.ir
        ratios = RATIOS[world]
        variants: dict[str, tuple[Any, CompileOptions]] = {
            "auto": (profile_for(world), CompileOptions(ratios=ratios)),
            "data-parallel": (profile_for(world), CompileOptions(ratios=ratios, mode="data_parallel")),
        }
        for set_name, force in force_sets(ir.doc).items():
            variants[set_name] = (profile_for(world), CompileOptions(ratios=ratios, force=force))
        variants["grouped"] = (profile_for(world, grouped_cheap=True), CompileOptions(ratios=ratios, force=force_sets(ir.doc)["megatron"]))
        for variant, (profile, options) in variants.items():
            plan = hapd.compile(ir, profile, options)
            cases.append(Case(f"{name}/{variant}/{world}", ref.saved, plan.to_bytes(), ref.inputs, ref.losses, ref.grads,
                              frozenset(), dict(options.force)))
    return cases


def _plan_facts(module: Any, plan: Any) -> dict[str, Any]:
    """The collectives and the (op, rule) pairs the plan runs."""
    steps = plan.program["steps"]
    return {"collectives": sorted({c["collective"] for s in steps for c in s["comms"]}),
            "rules": sorted({(s["op"], s["rule"]) for s in steps})}


@pytest.fixture(scope="module")
def exported() -> dict[str, Exported]:
    """Every model exported, lowered and run on one device, once for the module."""
    return {name: _exported(name) for name in MODEL_NAMES}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def results(request, exported) -> list[dict[str, Any]]:
    """Every case run on ``world`` ranks (:func:`_exact._run_case`: the loss after each of
    STEPS Adam steps is its ``loss_errors``' last), every rank's results."""
    world = request.param
    return run_cases(_cases(world, exported), world, extra=_plan_facts)


@pytest.mark.distributed
def test_loss_and_gradients_match_single_device(results):
    bad = [
        f"{r['case']}: loss {r['loss_error']:.2e}, worst grad {r['worst_grad'][0]} {r['worst_grad'][1]:.2e}"
        for r in results
        if r["loss_error"] > TOL or r["worst_grad"][1] > TOL
    ]
    print(f"\n{len(results)} rank-cases: worst loss error {max(r['loss_error'] for r in results):.1e}, "
          f"worst gradient error {max(r['worst_grad'][1] for r in results):.1e}, "
          f"worst loss error after {STEPS} Adam steps {max(r['loss_errors'][-1] for r in results):.1e}")
    assert not bad, "\n".join(bad)


@pytest.mark.distributed
def test_every_parameter_is_placed(results):
    bad = [f"{r['case']}: {r['missing_params']}" for r in results if r["missing_params"]]
    assert not bad, "\n".join(bad)


@pytest.mark.distributed
def test_loss_after_adam_steps_matches(results):
    bad = [f"{r['case']}: {r['loss_errors'][-1]:.2e}" for r in results if r["loss_errors"][-1] > TOL]
    assert not bad, "\n".join(bad)


ADAPTED_RULES = {
    ("aten.linear", "row-parallel"),
    ("aten.conv2d", "row-parallel"),
    ("aten.embedding", "vocab-parallel"),
    ("aten.reshape", "sharded"),  # views run as reshapes in the functional form (hapd/ir/normalize.py)
    ("aten.expand", "sharded"),
    ("aten.mean.dim", "sharded-mean"),
}
REQUIRED_RULES = ADAPTED_RULES | {
    ("aten.linear", "column-parallel"),
    ("aten.linear", "data-parallel"),
    ("aten.conv2d", "column-parallel"),
    ("aten.scaled_dot_product_attention", "head-parallel"),
    ("aten.scaled_dot_product_attention", "query-split"),
    ("aten.embedding", "hidden-split"),
    ("aten.cross_entropy_loss", "sharded-sum"),
    ("aten.cross_entropy_loss", "replicated"),
    ("aten.einsum", "split"),
}
ALL_COLLECTIVES = {
    "all_gather", "all_gather_grouped", "reduce_scatter", "reduce_scatter_grouped",
    "all_reduce", "all_to_all", "dynamic_slice", "mask_to_rank_zero",
}


@pytest.mark.distributed
def test_cases_exercise_every_collective_and_adapted_rule(results):
    collectives = {c for r in results for c in r["collectives"]}
    rules = {tuple(x) for r in results for x in r["rules"]}
    assert ALL_COLLECTIVES <= collectives, f"never run: {sorted(ALL_COLLECTIVES - collectives)}"
    assert REQUIRED_RULES <= rules, f"never run: {sorted(REQUIRED_RULES - rules)}"
    counts = Counter(r["case"].split("/")[0] for r in results)
    assert set(counts) == set(MODEL_NAMES)


def _run_two_level(rank: int, world: int, case: Case, bucket_sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    """:func:`_run_two_level_once` with each of ``bucket_sizes`` (one group of ranks)."""
    loaded: dict[bytes, Any] = {}
    return [_run_two_level_once(rank, world, case, size, loaded) for size in bucket_sizes]


def _run_two_level_once(rank: int, world: int, case: Case, bucket_bytes: int,
                        loaded: dict[bytes, Any]) -> dict[str, Any]:
    """Gradients with replicated parameters summed in two levels over 2 emulated hosts
    of 2 ranks each; also the bare sum and when two levels do not apply."""
    from hapd.spmd import collectives
    from hapd.compiler.plan import Plan
    from hapd.spmd.rewrite import global_loss

    flat_cases = [collectives.host_groups([0] * world), collectives.host_groups(list(range(world)))]
    hosts = collectives.host_groups([0, 0, 1, 1])
    buf = torch.arange(6, dtype=torch.float32) * (rank + 1)
    collectives.two_level_sum_(buf, hosts)
    module = distribute_saved(case.program, Plan.from_bytes(case.plan), rank, loaded, hosts=hosts,
                              bucket_bytes=bucket_bytes)
    local = module(*module.shard_inputs(*case.inputs))
    local.backward()
    loss = case.losses[0]
    return {"flat": flat_cases, "sum": buf.tolist(), "loss_error": abs(global_loss(local) - loss) / abs(loss),
            "grad_error": max(_grad_errors(module, case).values()), "two_level": module.hapd_sync.hosts is not None,
            "synced": sum(len(b) for b in module.hapd_sync.buckets), "buckets": len(module.hapd_sync.buckets)}


@pytest.mark.distributed
def test_two_level_gradient_sum_across_hosts(exported):
    bert = exported["bert"]
    plan = hapd.compile(bert.ir, profile_for(4), CompileOptions(ratios=RATIOS[4], mode="data_parallel"))
    case = Case("bert/data-parallel/two-level", bert.saved, plan.to_bytes(), bert.inputs, bert.losses, bert.grads,
                frozenset(), {})
    # one bucket, and a pipeline of many (4 KiB: a few parameters each), in one group:
    # results[:4] are the ranks with one bucket, results[4:] with many
    sizes = (2**25, 4096)
    per_rank = run_ranks(4, _run_two_level, case, sizes, timeout=300)
    results = [per_rank[rank][i] for i in range(len(sizes)) for rank in range(4)]
    assert {r["buckets"] for r in results[:4]} == {1} and min(r["buckets"] for r in results[4:]) > 5
    for r in results:
        assert r["flat"] == [None, None]
        assert r["sum"] == [10.0 * i for i in range(6)]  # (1 + 2 + 3 + 4) · i
        assert r["two_level"] and r["synced"] > 10
        assert r["loss_error"] < TOL and r["grad_error"] < TOL, r


def test_the_gradient_comparison_holds_a_small_tensor_to_its_own_size() -> None:
    """:func:`_exact.grad_errors`: a tensor 1e-3 of the model's largest gradient, wrong by
    1e-3 of its own size, fails (``test_api`` divided by the largest gradient itself and
    passed it); the same tensor off by fp32 rounding (1e-7 of itself) passes, and so does
    rounding noise of 1e-8 of the largest on a gradient that is zero in exact arithmetic."""
    big = torch.tensor([1.0, -0.5, 0.25])
    small = torch.tensor([1e-3, -4e-4, 2e-4])
    expected = {"big": big, "small": small, "cancelled": torch.zeros(3)}

    def errors(small_got: torch.Tensor) -> dict[str, float]:
        return grad_errors(expected, {"big": big, "small": small_got, "cancelled": torch.tensor([1e-8, -1e-8, 0.0])})

    wrong = errors(small * (1 + 1e-3))
    assert wrong["small"] == pytest.approx(1e-6 / GRAD_FLOOR, rel=1e-3) and wrong["small"] > TOL  # 1e-6 over 1e-2 · G
    assert float((small * 1e-3).abs().max()) / float(big.abs().max()) <= TOL  # the old test_api measure
    rounded = errors(small * (1 + 1e-7))
    assert max(rounded.values()) <= TOL, rounded
