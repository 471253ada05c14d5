"""The model zoo trained exactly: every model of :mod:`hapd.models.zoo` (GPT-2, Llama
with GQA and RoPE, BERT, Mixtral, Qwen2-MoE, T5, resnet18, torchvision's ViT) lowers
with no opaque op, passes the self-check (``hapd.check``), and runs on 2 and 4 Gloo
ranks with uneven ratios — (0.75, 0.25) and (0.4, 0.3, 0.2, 0.1) — with the loss, every
gradient and the loss after each of 5 Adam steps equal to the single-device run
(within 1e-5: :func:`_exact.grad_errors` for the gradients), under two plans: the
searched one, and one forced into tensor parallelism (every linear, ``addmm`` and
convolution column-parallel and row-parallel in turn, the Megatron pairing) with, for
the mixtures of experts (transformers' default experts, with the router's auxiliary
loss), every ``hapd.routed_experts`` expert-parallel. The
forced plans must run every forced rule, so a replicated plan cannot pass for them.

resnet18 runs in float64 (see ``FLOAT64``: its fp32 single-device run is itself further
than 1e-5 from exact); every other model in fp32.

Tied parameters stay tied (GPT-2's output projection is its token embedding, T5's
embeddings and output projection are one tensor): the harness compares the gradient of
every name. ViT's zero-initialized head is given random weights (with a zero head every
other gradient is zero). Every zoo model has its library's default dropout (GPT-2,
BERT and T5: 0.1, attention probabilities included), drawn on the ranks and in the
single-device run by hapd's counter-based generator (:mod:`hapd.spmd.random.random_ops`).

``-s`` prints the table: per model, the opaque ops and the worst relative error (loss /
gradient / loss after the Adam steps) of each plan on each world.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from _exact import (TENSOR_PARALLEL, TOL, Build, Reference, Spec, _tensor_parallel, fill_zero_parameters, make_cases,
                    reference, run_cases, worst)
from torch import Tensor, nn

import hapd

BATCH = 8
"""Batch of every case: it splits over 4 ranks with ratios (0.4, 0.3, 0.2, 0.1)."""
RATIOS = {2: (0.75, 0.25), 4: (0.4, 0.3, 0.2, 0.1)}
"""World size → sharding ratios."""
ADAM_STEPS = 5
MODELS = ["gpt2", "llama", "bert", "mixtral", "qwen2_moe", "t5", "resnet18", "vit"]
FLOAT64 = frozenset({"resnet18"})
"""Models whose cases run in float64 (the module and its float inputs ``.double()``
before export): resnet18's single-device fp32 run is itself 2e-5 (gradients) and 1e-3
(loss after the Adam steps) from its float64 run — twenty batch norms over batches of
8 and 1×1 maps amplify the convolutions' rounding — so a 1e-5 comparison in fp32 would
measure rounding, not the plan. ViT's patch convolution stays within 1e-6 in fp32."""
OPAQUE_ALLOWED: dict[str, str] = {}
"""Op → why it may stay opaque on a zoo model's hot path (none may)."""


# --------------------------------------------------------------------------------------
# Models and plans
# --------------------------------------------------------------------------------------


def _builder(name: str) -> Build:
    """The zoo's ``name`` at batch ``BATCH`` (ViT with its zero head filled; a
    ``FLOAT64`` model and its float inputs in float64)."""

    def build() -> tuple[nn.Module, tuple[Tensor, ...]]:
        from hapd.models.zoo import ZOO

        module, inputs = ZOO[name](batch=BATCH)
        if name == "vit":
            fill_zero_parameters(module)
        if name in FLOAT64:
            module = module.double()
            inputs = tuple(x.double() if x.is_floating_point() else x for x in inputs)
        return module, inputs

    return build


BUILDS = {name: _builder(name) for name in MODELS}


PLANS: dict[str, tuple[str, Callable[[dict[str, Any]], dict[str, str]] | None]] = {
    "searched": ("auto", None),
    "forced": ("auto", _tensor_parallel),
}
"""Plan name → (search mode, forced rules)."""

SPECS = [Spec(f"{model}/{plan}", BUILDS[model], mode, force, frozenset())
         for model in MODELS for plan, (mode, force) in PLANS.items()]
CASES = [f"{spec.name}@{world}" for world in RATIOS for spec in SPECS]


# --------------------------------------------------------------------------------------
# Runs (once for the module)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def references() -> dict[Build, Reference]:
    """Each model exported, lowered and run on one device (with the Adam steps)."""
    return {build: reference(build, name, ADAM_STEPS) for name, build in BUILDS.items()}


@pytest.fixture(scope="module")
def results(references) -> dict[str, list[dict[str, Any]]]:
    """Case ``model/plan@world`` → its result on every rank; each world's cases run in
    one call."""
    out: dict[str, list[dict[str, Any]]] = {}
    for world, ratios in RATIOS.items():
        cases = make_cases(SPECS, ratios, ADAM_STEPS, references)
        for r in run_cases(cases, world):
            out.setdefault(f"{r['case']}@{world}", []).append(r)
    return out


# --------------------------------------------------------------------------------------
# Lowering and the self-check
# --------------------------------------------------------------------------------------


def _opaque(references: dict[Build, Reference], name: str) -> list[tuple[str, int]]:
    return [(op, n) for op, n in hapd.inspect_graph(references[BUILDS[name]].ir.data)["opaque_ops"]
            if op not in OPAQUE_ALLOWED]


@pytest.mark.parametrize("name", MODELS)
def test_lowering_has_no_opaque_op(name, references) -> None:
    assert _opaque(references, name) == []


DROPOUT_ON = frozenset({"gpt2", "bert", "t5"})
"""Models whose library's default config has dropout (0.1)."""


@pytest.mark.parametrize("name", MODELS)
def test_default_dropout_is_on_and_drawn_by_hapd(name, references) -> None:
    """A model whose library defaults to dropout has random ops in its graph, and every
    random op is one hapd draws with its own generator (a dropout, an attention with
    ``dropout_p > 0``): no ``bernoulli`` or ``rand`` the ranks would draw apart."""
    from hapd.spmd.random.random_ops import ATTENTION, dropout_args, is_random

    graph = references[BUILDS[name]].program.graph
    random = [n for n in graph.nodes if is_random(n) and (n.target is ATTENTION or dropout_args(n)[0] > 0)]
    assert bool(random) == (name in DROPOUT_ON), [n.name for n in random]
    ops = {n["op"] for n in references[BUILDS[name]].ir.doc["nodes"] if n.get("op")}
    assert not [op for op in ops if any(word in op for word in ("bernoulli", "rand"))]


@pytest.mark.parametrize("name", MODELS)
def test_self_check_passes(name, references) -> None:
    """``hapd.check`` of the program as users export it (fp32 for every model)."""
    if name in FLOAT64:
        from hapd.models.zoo import ZOO

        program = hapd.export(*ZOO[name](batch=BATCH))
    else:
        program = references[BUILDS[name]].program
    report = hapd.check(program)
    assert report.ok, report.format(10)
    assert len(report.differences) > 10


# --------------------------------------------------------------------------------------
# Exactness on 2 and 4 ranks
# --------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_loss_gradients_and_adam_steps_match_single_device(case, results) -> None:
    per_rank = results[case]
    assert len(per_rank) == int(case.rsplit("@", 1)[1])
    bad = [f"loss {r['loss_error']:.2e}, grad {r['worst_grad'][0]} {r['worst_grad'][1]:.2e}, "
           f"after Adam steps {r['adam_error']:.2e}" for r in per_rank if worst(r) > TOL]
    assert not bad, "\n".join(bad)


@pytest.mark.distributed
@pytest.mark.parametrize("case", [c for c in CASES if "/forced@" in c])
def test_forced_plans_run_the_forced_rules(case, results, references) -> None:
    model = case.split("/")[0]
    forced = set(_tensor_parallel(references[BUILDS[model]].ir.doc).values())
    assert set(TENSOR_PARALLEL) <= forced
    assert ("expert-parallel" in forced) == (model in ("mixtral", "qwen2_moe"))
    for r in results[case]:
        assert r["not_forced"] == [], r["not_forced"]


def _cell(rs: list[dict[str, Any]]) -> str:
    """Worst loss / gradient / after-Adam error over the ranks."""
    return "/".join(f"{max(v(r) for r in rs):.0e}" for v in (lambda r: r["loss_error"],
                                                             lambda r: r["worst_grad"][1],
                                                             lambda r: r["adam_error"]))


@pytest.mark.distributed
def test_print_the_matrix(results, references) -> None:
    """The table (``-s``): worst relative errors, loss/gradient/after Adam steps."""
    columns = [(plan, world) for plan in PLANS for world in RATIOS]
    head = f"{'model':<10} {'opaque':<7}" + "".join(f" {f'{plan}@{world}':<23}" for plan, world in columns)
    rows = [head]
    for model in MODELS:
        cells = "".join(f" {_cell(results[f'{model}/{plan}@{world}']):<23}" for plan, world in columns)
        dtype = " (float64)" if model in FLOAT64 else ""
        rows.append(f"{model:<10} {len(_opaque(references, model)):<7}{cells}{dtype}")
    print("\n" + "\n".join(rows))
    assert len(results) == len(CASES)
