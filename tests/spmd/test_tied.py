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
from _exact import Case, Force, Reference, Spec, make_case, reference, run_cases, worst
from torch import Tensor, nn

import hapd
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


class Exported(NamedTuple):
    """The zoo's GPT-2 exported, lowered and run on one device (:data:`ADAM_STEPS`
    steps, :data:`LR`, :data:`EPS`), once for the module (every case of both worlds
    compiles a plan for it)."""

    module: nn.Module
    ref: Reference


@pytest.fixture(scope="module")
def exported() -> Exported:
    module, inputs = _gpt2()
    return Exported(module, reference(lambda: (module, inputs), "gpt2", ADAM_STEPS, lr=LR, eps=EPS))


def _force(rules: tuple[str, str]) -> Force:
    """The two uses of the tied tensor given ``rules`` (embedding rule, linear rule)."""

    def force(doc: dict[str, Any]) -> dict[str, str]:
        users = _tied_users(doc)
        return {users["aten.embedding"]: rules[0], users["aten.linear"]: rules[1]}

    return force


def _case(name: str, world: int, exported: Exported) -> Case:
    """The case ``name@world``: the loss, the gradients and every parameter after the
    Adam steps compared (the ranks take the reference's Adam, ``LR`` and ``EPS``)."""
    rules = FORCES[name]
    spec = Spec(f"{name}@{world}", _gpt2, "auto", None if rules is None else _force(rules), frozenset(), params=True)
    return make_case(spec, RATIOS[world], exported.ref)


def _tied_facts(module: Any, plan: Any) -> dict[str, Any]:
    """How the rank module holds the tied tensor, and the layouts the plan gives its uses."""
    named = dict(module.named_parameters(remove_duplicate=False))
    synced = [id(p) for bucket in module.hapd_sync.buckets for p in bucket]
    return {
        "names": sorted(n for n in module.hapd_params if n in TIED),
        "one_parameter": named.get(TIED[0]) is named.get(TIED[1]) is not None,
        "synced_once": len(synced) == len(set(synced)),
        "tied_layouts": sorted({(s["op"], i["layout"]) for s in plan.program["steps"] for i in s["inputs"]
                                if i["tensor"] == "p_model_lm_head_weight"}),
    }


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}-ranks")
def results(request, exported) -> list[dict[str, Any]]:
    world = request.param
    names = list(FORCES) if world == 2 else ["auto", "whole/rows"]
    return run_cases([_case(name, world, exported) for name in names], world, extra=_tied_facts)


@pytest.mark.distributed
def test_loss_gradients_and_adam_steps_match_single_device(results) -> None:
    bad = [f"{r['case']}: loss {max(r['loss_errors']):.2e}, grad {r['worst_grad'][0]} {r['worst_grad'][1]:.2e}, "
           f"param {r['worst_param'][0]} {r['worst_param'][1]:.2e}" for r in results if worst(r) > TOL]
    print(f"\n{len(results)} rank-cases: worst loss error {max(max(r['loss_errors']) for r in results):.1e}, "
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
    module, ir = exported.module, exported.ref.ir
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
