"""Tied parameters: the zoo's GPT-2 as transformers builds it (``lm_head.weight`` is
``transformer.wte.weight``), compiled with uneven ratios on 2 and 4 Gloo ranks, auto
and with the two uses of the tied tensor (the token embedding and the output
projection) forced into the same and into different layouts. The loss and the gradient
of every name of every parameter equal the single-device run, and so do the loss and
the parameters over 5 Adam steps.

Also: the lowered graph has one source for the tied tensor (memory and gradient sync
count it once), and the rank module holds one parameter under both names.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import pytest
import torch
from _dist import run_ranks
from _exact import distribute_saved, save_normal_form
from torch import Tensor, nn

import hapd
from hapd.spmd.random.random_ops import counter_reference
from hapd.compiler.options import CompileOptions
from hapd.profile.schema import estimated_profile

BATCH = 8
TOL = 1e-5
ADAM_STEPS = 5
LR = 1e-2
EPS = 1e-4
"""Adam's epsilon: the key projection's bias has a gradient that is zero in exact
arithmetic (softmax does not change when a constant is added to every score), and with
the default 1e-8 Adam turns its rounding noise (1e-9) into full-size steps of either
sign, in the single-device run as much as in the distributed one; 1e-4 keeps such noise
from moving a weight while every gradient that is not noise still drives its step."""
TIED = ("model.transformer.wte.weight", "model.lm_head.weight")
RATIOS = {2: (0.6, 0.4), 4: (0.4, 0.3, 0.2, 0.1)}


def _gpt2() -> tuple[nn.Module, tuple[Tensor, ...]]:
    from hapd.models.zoo import gpt2

    module, inputs = gpt2(batch=BATCH)
    assert module.model.lm_head.weight is module.model.transformer.wte.weight  # tied, as the zoo builds it
    return module, inputs


def _tied_users(doc: dict[str, Any]) -> dict[str, str]:
    """op -> name of each op node that reads the tied tensor (one embedding, one linear)."""
    source = next(i for i, n in enumerate(doc["nodes"]) if n["kind"] == "parameter" and n["target"] in TIED)
    return {n["op"]: n["name"] for n in doc["nodes"] if any(ref[0] == source for ref in n["inputs"])}


FORCES: dict[str, tuple[str, str] | None] = {
    "auto": None,
    "rows/rows": ("vocab-parallel", "column-parallel"),  # both uses split the vocab: Gather(0)
    "whole/rows": ("data-parallel", "column-parallel"),  # Identity for one use, Gather(0) for the other
    "rows/whole": ("vocab-parallel", "data-parallel"),
    "columns/columns": ("hidden-split", "row-parallel"),  # both split the hidden dim: Gather(1)
}
"""case -> (embedding rule, linear rule) for the two uses of the tied tensor."""


class Case(NamedTuple):
    name: str
    program: bytes  # the normal form, saved (save_normal_form)
    plan: bytes
    inputs: tuple[Tensor, ...]
    losses: list[float]  # single device: the first loss, then after each Adam step
    grads: dict[str, Tensor]  # every name, tied ones included
    params: dict[str, Tensor]  # after the Adam steps


def _reference(program: Any, inputs: tuple[Tensor, ...]) -> tuple[list[float], dict[str, Tensor], dict[str, Tensor]]:
    """The single-device run of ``program.module()`` (a copy: the steps must not change
    the program's weights), its dropouts drawn with hapd's generator and the seed the
    ranks draw with (``torch.manual_seed(0)``: :func:`_run_cases`): losses, first
    gradients by every name, parameters after the Adam steps by every name."""
    module = counter_reference(program, seed=0)
    optimizer = torch.optim.Adam(module.parameters(), lr=LR, eps=EPS)
    losses: list[float] = []
    grads: dict[str, Tensor] = {}
    for step in range(ADAM_STEPS + 1):
        optimizer.zero_grad()
        loss = module(*inputs)
        losses.append(float(loss.detach()))
        if step == ADAM_STEPS:
            break
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)
                     if p.grad is not None}
        optimizer.step()
    params = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    return losses, grads, params


class Exported(NamedTuple):
    """The zoo's GPT-2 exported, lowered and run on one device, once for the module
    (every case of both worlds compiles a plan for it)."""

    module: nn.Module
    inputs: tuple[Tensor, ...]
    ir: Any  # hapd.ir.lower.GraphIR
    saved: bytes  # its normal form, saved (save_normal_form)
    reference: tuple[list[float], dict[str, Tensor], dict[str, Tensor]]  # _reference's


@pytest.fixture(scope="module")
def exported() -> Exported:
    module, inputs = _gpt2()
    program = hapd.export(module, inputs)
    return Exported(module, inputs, hapd.lower(program, name="gpt2"), save_normal_form(program), _reference(program, inputs))


def _case(name: str, world: int, exported: Exported) -> Case:
    rules = FORCES[name]
    force = {}
    if rules is not None:
        users = _tied_users(exported.ir.doc)
        force = {users["aten.embedding"]: rules[0], users["aten.linear"]: rules[1]}
    profile = estimated_profile(world, flops=[1e10 * (world - r) for r in range(world)])
    plan = hapd.compile(exported.ir, profile, CompileOptions(ratios=RATIOS[world], force=force))
    return Case(f"{name}@{world}", exported.saved, plan.to_bytes(), exported.inputs, *exported.reference)


def _relative(got: Tensor, expected: Tensor, floor: float) -> float:
    return float((got - expected).abs().max()) / max(float(expected.abs().max()), floor) if expected.numel() else 0.0


def _errors(module: Any, expected: dict[str, Tensor], got: dict[str, Tensor | None]) -> dict[str, float]:
    """Relative error of this rank's piece of every name (a value that is zero in exact
    arithmetic is rounding noise in both runs: compared against a hundredth of the
    largest)."""
    floor = 1e-2 * max(float(t.abs().max()) for t in expected.values() if t.numel())
    out = {}
    for fqn, (tensor, layout) in module.hapd_params.items():
        full = expected.get(fqn, torch.zeros(module.hapd_view.full_shape(tensor)))
        want = module.hapd_view.local_value(tensor, layout, full)
        have = got[fqn]
        out[fqn] = _relative(have if have is not None else torch.zeros_like(want), want, floor)
    return out


def _run_case(rank: int, case: Case, loaded: dict[bytes, Any]) -> dict[str, Any]:
    from hapd.compiler.plan import Plan
    from hapd.spmd.rewrite import global_loss

    plan = Plan.from_bytes(case.plan)
    module = distribute_saved(case.program, plan, rank, loaded)
    named = dict(module.named_parameters(remove_duplicate=False))
    local_inputs = module.shard_inputs(*case.inputs)
    optimizer = torch.optim.Adam(module.parameters(), lr=LR, eps=EPS)
    losses, grad_errors = [], {}
    for step in range(ADAM_STEPS + 1):
        optimizer.zero_grad()
        local = module(*local_inputs)
        losses.append(global_loss(local))
        if step == ADAM_STEPS:
            break
        local.backward()
        if step == 0:
            grad_errors = _errors(module, case.grads, {n: p.grad for n, p in named.items()})
        optimizer.step()
    param_errors = _errors(module, case.params, {n: p.detach() for n, p in named.items()})
    synced = [id(p) for bucket in module.hapd_sync.buckets for p in bucket]
    return {
        "case": case.name,
        "names": sorted(n for n in module.hapd_params if n in TIED),
        "one_parameter": named.get(TIED[0]) is named.get(TIED[1]) is not None,
        "synced_once": len(synced) == len(set(synced)),
        "loss_error": max(abs(a - b) / abs(b) for a, b in zip(losses, case.losses)),
        "worst_grad": max(grad_errors.items(), key=lambda kv: kv[1]),
        "worst_param": max(param_errors.items(), key=lambda kv: kv[1]),
        "tied_layouts": sorted({(s["op"], i["layout"]) for s in plan.program["steps"] for i in s["inputs"]
                                if i["tensor"] == "p_model_lm_head_weight"}),
    }


def _run_cases(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    loaded: dict[bytes, Any] = {}
    return [_run_case(rank, case, loaded) for case in cases]


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}-ranks")
def results(request, exported) -> list[dict[str, Any]]:
    world = request.param
    names = list(FORCES) if world == 2 else ["auto", "whole/rows"]
    cases = [_case(name, world, exported) for name in names]
    per_rank = run_ranks(world, _run_cases, cases, timeout=600)
    return [r for rank_results in per_rank for r in rank_results]


@pytest.mark.distributed
def test_loss_gradients_and_adam_steps_match_single_device(results) -> None:
    bad = [f"{r['case']}: loss {r['loss_error']:.2e}, grad {r['worst_grad'][0]} {r['worst_grad'][1]:.2e}, "
           f"param {r['worst_param'][0]} {r['worst_param'][1]:.2e}"
           for r in results if max(r["loss_error"], r["worst_grad"][1], r["worst_param"][1]) > TOL]
    print(f"\n{len(results)} rank-cases: worst loss error {max(r['loss_error'] for r in results):.1e}, "
          f"gradient {max(r['worst_grad'][1] for r in results):.1e}, "
          f"parameter after {ADAM_STEPS} Adam steps {max(r['worst_param'][1] for r in results):.1e} "
          f"({max((r['worst_param'][1], r['case'], r['worst_param'][0]) for r in results)[1:]})")
    assert not bad, "\n".join(bad)


@pytest.mark.distributed
def test_one_parameter_under_both_names(results) -> None:
    for r in results:
        assert r["names"] == sorted(TIED), r["case"]
        assert r["one_parameter"], r["case"]
        assert r["synced_once"], r["case"]


@pytest.mark.distributed
def test_forced_cases_give_the_uses_their_layouts(results) -> None:
    layouts = {r["case"]: dict(r["tied_layouts"]) for r in results}
    expected = {
        "rows/rows@2": {"aten.embedding": "Gather(0)", "aten.linear": "Gather(0)"},
        "whole/rows@2": {"aten.embedding": "Identity", "aten.linear": "Gather(0)"},
        "whole/rows@4": {"aten.embedding": "Identity", "aten.linear": "Gather(0)"},
        "rows/whole@2": {"aten.embedding": "Gather(0)", "aten.linear": "Identity"},
        "columns/columns@2": {"aten.embedding": "Gather(1)", "aten.linear": "Gather(1)"},
    }
    for case, want in expected.items():
        if case in layouts:
            assert layouts[case] == want, case


def test_lowering_has_one_source_for_the_tied_tensor(exported) -> None:
    module, ir = exported.module, exported.ir
    targets = [n["target"] for n in ir.doc["nodes"] if n["kind"] == "parameter"]
    assert sum(t in TIED for t in targets) == 1
    summary = hapd.inspect_graph(ir.data)
    assert summary["parameter_elements"] == sum(p.numel() for p in module.parameters())  # counted once


def test_parameters_sharing_memory_but_both_read_stay_two() -> None:
    """Two parameter objects the graph reads separately get their own gradients, even
    when one was made from the other's memory (only names the graph does not read are
    aliases)."""
    from hapd.ir.tied import aliases_of_read

    class TwoViews(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.randn(4, 4))
            self.b = nn.Parameter(self.a.detach())  # same memory, another leaf

        def forward(self, x: Tensor) -> Tensor:
            return (x @ self.a + (x @ self.b) ** 2).sum()

    program = hapd.export(TwoViews(), (torch.randn(3, 4),))
    assert aliases_of_read(program) == {}
    assert [n["target"] for n in hapd.lower(program).doc["nodes"] if n["kind"] == "parameter"] == ["a", "b"]


class TiedToy(nn.Module):
    """An embedding and an output projection sharing one weight (the second name is
    registered last, as transformers ties ``lm_head.weight``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x)))).logsumexp(-1).sum()


@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_one_device_program_keeps_the_tie(strict) -> None:
    """Strict export has one placeholder for the tied weight, non-strict one per name
    with only the last read; either way the rank module holds one parameter under both
    names with the single-device gradient."""
    from hapd.spmd.rewrite import distribute

    model, x = TiedToy(), torch.randint(0, 10, (3, 5))
    program = torch.export.export(model, (x,), strict=strict)
    plan = hapd.compile(hapd.lower(program), estimated_profile(1))
    module = distribute(program, plan, rank=0, world=1)
    module(*module.shard_inputs(x)).backward()
    model(x).backward()
    assert module.get_parameter("emb.weight") is module.get_parameter("head.weight")
    assert sorted(module.hapd_params) == ["emb.weight", "head.weight", "mid.bias", "mid.weight"]
    assert len(list(module.parameters())) == 3
    torch.testing.assert_close(module.get_parameter("emb.weight").grad, model.emb.weight.grad, rtol=TOL, atol=0)
