"""Expert parallelism for transformers' mixture-of-experts models as they ship: the zoo's
Mixtral and Qwen2-MoE run transformers' default experts (``grouped_mm``), which
:func:`hapd.export` traces as one ``hapd.routed_experts`` op (:mod:`hapd.ir.experts`),
with the router's auxiliary loss on.

- the exported program computes what the model computes, bit for bit (loss and every
  gradient), and lowers with no opaque op;
- the op's partial sums over a partition of the experts (empty and one-expert ranges
  included) add up to the whole, in value and gradient;
- plans forced into expert parallelism (every ``hapd.routed_experts`` ``expert-parallel``)
  run on 2 Gloo ranks with uneven ratios with the loss and every gradient equal to the
  single-device run, each rank holding only its experts (the harness of
  ``tests/_exact.py``; ``tests/models/test_zoo.py`` runs the searched plans and plans
  forced into tensor and expert parallelism on 2 and 4 ranks, with 5 Adam steps);
- an expert-parallel model's ``export_safetensors`` loads with ``from_pretrained``, and
  its sharded checkpoint into the single-device model;
- hapd's dense experts implementation (:mod:`hapd.models.hf_experts`) stays the same
  function as transformers' ``eager`` loop.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _exact import EXPERT_WEIGHTS, TOL, Spec, _expert_einsums, _zoo, assert_exact, assert_rules_ran, run_specs

import hapd
from hapd.compiler.options import CompileOptions
from hapd.ir import experts
from hapd.ir.summary import format_summary
from hapd.profile.schema import estimated_profile

BATCH = 8
RULE = frozenset({("hapd.routed_experts", "expert-parallel")})

SPECS = [
    Spec("mixtral/expert-parallel", _zoo("mixtral", BATCH), "auto", _expert_einsums, RULE),
    Spec("qwen2_moe/expert-parallel", _zoo("qwen2_moe", BATCH), "auto", _expert_einsums, RULE),
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


def _loss_and_grads(module: torch.nn.Module, inputs: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    loss = module(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_the_exported_program_is_the_model_as_shipped(name) -> None:
    """transformers' own ``grouped_mm`` experts and the exported ``hapd.routed_experts``:
    the same loss and gradients, bit for bit; no opaque op left; the model keeps
    transformers' experts function once exported."""
    model, inputs = _zoo(name, BATCH)()
    assert model.model.config._experts_implementation == "grouped_mm"
    program = hapd.export(copy.deepcopy(model), inputs)
    targets = [str(n.target) for n in program.graph.nodes if n.op == "call_function"]
    assert targets.count("hapd.routed_experts.default") == 2
    assert not any("grouped_mm" in t or "sort" in t for t in targets), targets
    summary = hapd.inspect_graph(hapd.lower(program, name=name).data)
    assert summary["opaque_ops"] == []
    assert "2 layers traced as hapd.routed_experts, the same values" in format_summary(summary)
    loss, grads = _loss_and_grads(model, inputs)
    loss_p, grads_p = _loss_and_grads(program.module(), inputs)
    assert torch.equal(loss, loss_p)
    assert grads.keys() == grads_p.keys() and any(EXPERT_WEIGHTS[0] in n for n in grads)
    for n, g in grads.items():
        assert torch.equal(g, grads_p[n]), n
    from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

    assert ExpertsInterface._global_mapping["grouped_mm"] is grouped_mm_experts_forward


def test_partial_sums_over_the_experts_add_up_to_the_whole() -> None:
    """The op on expert ranges [0, 2), [2, 3), [3, 4) and the empty [4, 4) (what the
    expert-parallel ranks run): their sum is the whole output, and so are the gradients."""
    torch.manual_seed(0)
    t, h, i, e, k = 12, 8, 4, 4, 2
    hidden = torch.randn(t, h, requires_grad=True)
    logits = torch.randn(t, e)
    weights, index = torch.topk(logits.softmax(-1), k)
    weights = weights.detach().requires_grad_()
    gate_up, down = torch.randn(e, 2 * i, h, requires_grad=True), torch.randn(e, h, i, requires_grad=True)
    op = torch.ops.hapd.routed_experts
    whole = op(hidden, index, weights, gate_up, down, "silu", 0, e)
    cotangent = torch.randn_like(whole)
    want = torch.autograd.grad(whole, [hidden, weights, gate_up, down], cotangent)
    parts = [op(hidden, index, weights, gate_up[a:b], down[a:b], "silu", a, e) for a, b in ((0, 2), (2, 3), (3, 4), (4, 4))]
    summed = sum(parts)
    assert float(parts[-1].detach().abs().max()) == 0.0  # the empty range contributes nothing
    assert all(float(p.detach().abs().max()) > 0.0 for p in parts[:-1])
    assert float((summed - whole).detach().abs().max()) <= 1e-6 * float(whole.detach().abs().max())
    got = torch.autograd.grad(summed, [hidden, weights, gate_up, down], cotangent)
    for name, g, w in zip(("hidden", "weights", "gate_up", "down"), got, want):
        assert float((g - w).abs().max()) <= 1e-5 * float(w.abs().max()), name


def test_experts_of_another_layout_keep_transformers_ops(caplog) -> None:
    """An experts module hapd's op does not implement (here: its own gating) is exported
    with transformers' function, as shipped, and the log says why."""
    model, inputs = _zoo("mixtral", BATCH)()
    for layer in model.model.model.layers:
        layer.mlp.experts._apply_gate = lambda x: torch.nn.functional.silu(x.chunk(2, -1)[0]) * x.chunk(2, -1)[1]
    reason = experts.unsupported(model.model.model.layers[0].mlp.experts)
    assert reason is None  # an instance attribute is not the class's gating: checked per class
    type_ = type(model.model.model.layers[0].mlp.experts)
    subclass = type(type_.__name__, (type_,), {"_apply_gate": lambda self, x: x.chunk(2, -1)[0] * x.chunk(2, -1)[1]})
    for layer in model.model.model.layers:
        layer.mlp.experts.__class__ = subclass
    assert experts.unsupported(model.model.model.layers[0].mlp.experts) == "it gates with its own _apply_gate"
    with caplog.at_level(logging.WARNING, logger="hapd.ir.experts"):
        program = hapd.export(model, inputs)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert "hapd.routed_experts.default" not in targets
    assert "own _apply_gate" in caplog.text


def _export_on_rank(rank: int, world: int, force: dict[str, str], folder: str) -> dict[str, Any]:
    from hapd.models.zoo import ZOO

    wrapper, inputs = ZOO["mixtral"](batch=BATCH)
    module = hapd.parallelize(wrapper, inputs, profile=estimated_profile(2, flops=[2e10, 1e10]),
                              options=CompileOptions(ratios=(0.6, 0.4), force=force), use_daemon=False, verbose=False)
    with torch.no_grad():
        for p in module.parameters():  # a change training would make, visible after loading
            p.add_(0.01)
    hapd.export_safetensors(module, folder, strip_prefix="model.", config=wrapper.model.config)
    hapd.save_checkpoint(Path(folder) / "checkpoint", module, step=1)
    held = {n: list(p.shape) for n, p in module.named_parameters() if n.endswith(EXPERT_WEIGHTS)}
    full = module.full_state_dict()  # collective
    return {"held": held, "full": full if rank == 0 else None}


@pytest.mark.distributed
def test_an_expert_parallel_model_loads_with_from_pretrained_and_from_its_checkpoint(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    wrapper, inputs = _zoo("mixtral", BATCH)()
    force = _expert_einsums(hapd.lower(hapd.export(copy.deepcopy(wrapper), inputs), name="mixtral").doc)
    assert len(force) == 2
    folder = tmp_path / "mixtral"
    per_rank = run_ranks(2, _export_on_rank, force, str(folder))
    held = [r["held"] for r in per_rank]
    assert held[0] and all(sum(h[n][0] for h in held) == 4 and held[0][n][0] < 4 for n in held[0])
    loaded = transformers.MixtralForCausalLM.from_pretrained(folder).eval()
    state, full = loaded.state_dict(), per_rank[0]["full"]
    full = {k[len("model."):]: v for k, v in full.items()}
    assert set(state) <= set(full)  # the file also holds the rotary buffer, which the model does not persist
    assert any("experts" in k for k in state) and all(torch.equal(v, full[k]) for k, v in state.items())
    assert loaded.config._experts_implementation == "grouped_mm"
    # the sharded checkpoint loads into the plain single-device model
    plain, _ = _zoo("mixtral", BATCH)()
    assert hapd.load_checkpoint(folder / "checkpoint", plain)["step"] == 1
    assert all(torch.equal(v, full[k[len("model."):]]) for k, v in plain.state_dict().items())


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_dense_experts_equal_transformers_own(name) -> None:
    """hapd's dense experts: loss and gradients equal those of transformers' ``eager``
    loop over the experts, on the same weights."""
    from hapd.models.hf_experts import register

    model, inputs = _zoo(name, BATCH)()
    runs = {}
    for implementation in ("eager", register()):
        copied = copy.deepcopy(model)
        copied.model.set_experts_implementation(implementation)
        loss = copied(*inputs)
        loss.backward()
        runs[implementation] = (float(loss.detach()), {n: p.grad for n, p in copied.named_parameters()})
    (loss_a, grads_a), (loss_b, grads_b) = runs["eager"], runs["hapd_dense"]
    assert abs(loss_a - loss_b) <= TOL * abs(loss_a)
    for n, g in grads_a.items():
        assert float((g - grads_b[n]).abs().max()) <= TOL * float(g.abs().max()), n
