"""A ParallelModule's other programs: ``eval()`` forwards and batches of another size
(the short last batch of an epoch) run programs exported again for them, on the
training program's parameters, buffers and gradient sync.

On 2 Gloo ranks with uneven ratios (3:1) and a plan that splits parameters (column- and
row-parallel linears) and replicates others, a model with batch norm and dropout
(p > 0) against the single-device model: (a) the eval loss after training steps, (b)
one epoch of a dataset that leaves a short last batch, read by ``hapd.loader``, (c)
``train()`` after ``eval()``; and pieces cut for another program refused. Dropout draws
with hapd's counter-based generator, and the single-device model's dropout draws with
the same generator, seed and step sequence (:class:`_CounterDrop`): the ranks' other
programs (the short last batch) continue the training program's steps.
Plus, in one process: the alignment of a training and an eval graph, and a plan that
holds a parameter otherwise than the training plan refused, naming the parameter.
fp32 tolerance: 1e-5 relative.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _dist import run_ranks
from torch import nn
from torch.utils.data import TensorDataset

import hapd
from hapd.compiler.driver import compile as compile_plan
from hapd.compiler.options import CompileOptions
from hapd.errors import PlanError
from hapd.profile.schema import estimated_profile
from hapd.spmd.random.counter_rng import uniform
from hapd.train.programs import Recipe, aligned_force, op_nodes

B = 8
SAMPLES = 22
"""Two global batches of 8 and a short one of 6."""
RATIOS = (0.75, 0.25)
FORCE = {"linear": "data-parallel", "getitem": "replicated", "linear_1": "column-parallel", "linear_2": "row-parallel"}
"""The batch split at the first linear, batch norm whole on every rank, then the second
linear split by output features and the third by input features."""
TOL = 1e-5
SEED = 1234


class Net(nn.Module):
    """Linear, batch norm, ReLU, dropout, two linears; forward returns the loss."""

    def __init__(self, dropout: float = 0.25) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 16)
        self.norm = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(dropout)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.norm(self.inp(x))))
        return nn.functional.cross_entropy(self.out(torch.relu(self.hidden(h))), y)


class _CounterDrop(nn.Module):
    """The single-device dropout hapd's ranks reproduce: the one dropout of the program
    (stream 0) drawn with hapd's generator at ``seed``, one step per training forward."""

    def __init__(self, p: float, seed: int) -> None:
        super().__init__()
        self.p, self.seed, self.step = p, seed, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        self.step += 1
        keep = uniform(self.seed, 0, self.step, x.shape, [0] * x.dim(), x.shape) >= self.p
        return x * keep.to(x.dtype) * (1.0 / (1.0 - self.p))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return torch.randn(SAMPLES, 6, generator=generator), torch.randint(0, 3, (SAMPLES,), generator=generator)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    # not _exact.relative: in float64 (the state's running statistics included), no empty-tensor case
    return float((a.double() - b.double()).abs().max()) / max(float(b.double().abs().max()), 1e-12)


def _state_error(module, ref: nn.Module) -> float:
    """Largest relative error of the module's full state (parameters and batch norm's
    running statistics) against the single-device model's."""
    full = module.full_state_dict()
    return max(_rel(full[k], v) for k, v in ref.state_dict().items())


def _seeded(step: int, fn):
    torch.manual_seed(SEED + step)  # the same dropout masks for both runs
    return fn()


def _programs(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    ref.drop = _CounterDrop(model.drop.p, torch.initial_seed())  # the seed parallelize draws with
    x, y = _data()
    module = hapd.parallelize(model, (x[:B], y[:B]), options={"ratios": RATIOS, "force": FORCE}, use_daemon=False,
                              verbose=False)
    params = list(module.parameters())
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    out: dict[str, Any] = {"layouts": module.parameter_layouts()}

    # (b) one epoch with a short last batch, through the loader
    data = hapd.loader(TensorDataset(x, y), module, seed=3)
    order = data.sampler.order(0)
    out["batch_lengths"] = data.sampler.batch_lengths()
    step = 0
    for local in data:
        start = step * B
        idx = order[start:start + B]
        optimizer.zero_grad(set_to_none=True)
        ref_optimizer.zero_grad(set_to_none=True)
        _seeded(step, lambda: module(*local)).backward()
        _seeded(step, lambda: ref(x[idx], y[idx])).backward()
        optimizer.step()
        ref_optimizer.step()
        step += 1
    out["steps"] = step
    out["epoch_error"] = _state_error(module, ref)

    # (a) eval with no_grad: the single-device eval loss (running statistics, no dropout)
    module.eval(), ref.eval()
    eval_losses = []
    with torch.no_grad():
        for batch in ((x[:B], y[:B]), (x[B:B + 5], y[B:B + 5])):  # the example size and another
            got = module.global_loss(module(*module.shard_inputs(*batch)))
            eval_losses.append((got, float(ref(*batch))))
    out["eval_losses"] = eval_losses
    out["eval_kept_state"] = _state_error(module, ref)  # eval updates no running statistic

    # (c) train() after eval(): the training program again (batch statistics, dropout)
    module.train(), ref.train()
    optimizer.zero_grad(set_to_none=True)
    ref_optimizer.zero_grad(set_to_none=True)
    local = module.shard_inputs(x[:B], y[:B])
    part = _seeded(99, lambda: module(*local))
    expected = _seeded(99, lambda: ref(x[:B], y[:B]))
    part.backward()
    expected.backward()
    optimizer.step()
    ref_optimizer.step()
    out["train_again_loss"] = (module.global_loss(part), float(expected.detach()))
    out["train_again_error"] = _state_error(module, ref)
    out["same_parameters"] = all(a is b for a, b in zip(params, module.parameters()))

    # pieces cut otherwise than the program of the batch they are said to come from
    module.expect_batch((B, 6), (B,), lengths=[4, 4])
    try:
        module(*local)
    except PlanError as exc:
        out["cut_error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def programs() -> list[dict[str, Any]]:
    return run_ranks(2, _programs, timeout=300)


@pytest.mark.distributed
def test_the_training_plan_splits_and_replicates_parameters(programs):
    layouts = set(programs[0]["layouts"].values())
    assert {"Identity", "Gather(0)", "Gather(1)"} <= layouts, layouts
    assert all(r["same_parameters"] for r in programs)


@pytest.mark.distributed
def test_an_epoch_with_a_short_last_batch_trains_as_on_one_device(programs):
    for r in programs:
        assert r["steps"] == 3 and [sum(b) for b in r["batch_lengths"]] == [8, 8, 6], r["batch_lengths"]
        assert r["batch_lengths"][0] == [6, 2]  # the plan's uneven split
        assert r["epoch_error"] <= TOL, r


@pytest.mark.distributed
def test_eval_forwards_give_the_single_device_eval_loss(programs):
    for r in programs:
        for got, want in r["eval_losses"]:
            assert abs(got - want) <= TOL * abs(want), r["eval_losses"]
        assert r["eval_kept_state"] <= TOL


@pytest.mark.distributed
def test_pieces_cut_for_another_program_are_refused(programs):
    for r in programs:
        assert "these inputs were cut for another program than the training one for batch shapes [[8, 6], [8]]" \
            in r.get("cut_error", ""), r.get("cut_error")


@pytest.mark.distributed
def test_train_after_eval_runs_the_training_program(programs):
    for r in programs:
        got, want = r["train_again_loss"]
        assert abs(got - want) <= TOL * abs(want) and r["train_again_error"] <= TOL, r


# ----------------------------------------------------------------------------- one process


def _recipe(model: nn.Module) -> Recipe:
    x, y = _data()
    return Recipe(model=model, example_inputs=(x[:B], y[:B]), batch_dims=(0, 0), name="Net", profile=None,
                  use_daemon=False, verbose=False, device=torch.device("cpu"))


def test_aligned_force_follows_ops_not_names():
    """The eval graph has no dropout and batch norm on running statistics: later
    tuple ops are named otherwise, and the alignment still pairs each op with its own."""
    model = Net()
    recipe = _recipe(model)
    _, training = recipe.export(True, recipe.example_shapes)
    _, evaluating = recipe.export(False, recipe.example_shapes)
    assert model.training  # left in its mode
    rules = {"linear": "data-parallel", "getitem": "data-parallel-synced", "getitem_3": "replicated",
             "linear_1": "column-parallel", "linear_2": "row-parallel", "relu": "sharded", "relu_1": "sharded",
             "cross_entropy_loss": "sharded-mean", "add": "replicated"}
    force = aligned_force(op_nodes(training), rules, op_nodes(evaluating))
    ops = dict(op_nodes(evaluating))
    assert ops["getitem"] == "aten._native_batch_norm_legit_no_training"
    assert force["getitem"] == "data-parallel"  # the batch split on running statistics
    assert {force[n] for n, op in ops.items() if op == "aten.linear"} == {"data-parallel", "column-parallel",
                                                                          "row-parallel"}
    assert force["cross_entropy_loss"] == "sharded-mean" and "aten.native_dropout" not in ops.values()


def test_a_plan_holding_a_parameter_otherwise_is_refused_naming_it():
    """Rank 0 of 2 (no process group needed to build): the training program splits the
    hidden linear, a data-parallel plan of the eval graph replicates it."""
    model = Net()
    recipe = _recipe(model)
    program, graph = recipe.export(True, recipe.example_shapes)
    profile = estimated_profile(2, name="estimated-2")
    plan = compile_plan(graph, profile, CompileOptions(ratios=RATIOS, force=FORCE))
    inner = hapd.distribute(program, plan, 0, world=2, check_graph=False)
    eval_program, eval_graph = recipe.export(False, recipe.example_shapes)
    replicated = compile_plan(eval_graph, profile, CompileOptions(ratios=RATIOS, mode="data_parallel"))
    with pytest.raises(PlanError, match=r"parameter hidden\.weight: this program's plan holds it as Identity, "
                                        r"the training plan as Gather\(0\)"):
        hapd.distribute(eval_program, replicated, 0, world=2, check_graph=False, shared=inner)
    aligned = compile_plan(eval_graph, profile, CompileOptions(
        ratios=RATIOS, force=aligned_force(op_nodes(graph), {s["node"]: s["rule"] for s in plan.program["steps"]},
                                           op_nodes(eval_graph))))
    evaluating = hapd.distribute(eval_program, aligned, 0, world=2, check_graph=False, shared=inner)
    assert evaluating.get_parameter("hidden.weight") is inner.get_parameter("hidden.weight")
    assert evaluating.hapd_sync is inner.hapd_sync


def test_the_graphs_a_search_prices_are_derived_not_lowered_and_equal_the_lowered():
    """Rank 0 prices the graph at every micro-batch size: derived from the global batch's
    and its half's (no program cut and lowered at those batches: seconds on a slow rank
    that becomes rank 0 in a switch; batch 1 is lowered), each byte for byte the graph
    lowered there."""
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    recipe = Recipe(model=Net(), example_inputs=(x, y), batch_dims=(0, 0), name="Net", profile=None,
                    use_daemon=False, verbose=False, device=torch.device("cpu"))
    graphs = recipe.graphs(CompileOptions(pipeline="auto", overlap=True), priced=True)
    assert sorted(graphs.micro) == [2, 4, 8, 16] and graphs.half is not None  # 16: batch 1, lowered
    cut = sorted(k[2] for k in recipe.exported if k[0] == "at")
    assert cut == [16], cut  # the global batch's program alone (the half's graph lowered, its program not kept)
    again = recipe.graphs(CompileOptions(pipeline="auto", overlap=True), priced=True)
    assert all(again.micro[m] is graphs.micro[m] for m in graphs.micro)  # kept with the exports
    for m, graph in graphs.micro.items():
        assert graph.graph_id == recipe.export_at(True, 16 // m)[1].graph_id, m


def test_under_the_runner_an_spmd_only_request_is_cut_from_the_carried_symbolic_program(monkeypatch):
    """A job switched in place to one host searches SPMD alone: under the runner its
    program is cut from the symbolic one every switch carries (a static export took 5 s
    of a switch on a third of a core), and so for every process of the job (a static
    export's graph may differ from the cut one's); outside the runner, exported at the
    batch as before."""
    from hapd.elastic.in_place import KEEP_EXPORTS_ENV
    from hapd.train.parallelize import _plan_request

    monkeypatch.setenv(KEEP_EXPORTS_ENV, "1")
    recipe = _recipe(Net())
    request = _plan_request(recipe, None, CompileOptions(), always=False)
    assert ("symbolic", True) in recipe.exported and not any(k[0] == "export" for k in recipe.exported)
    assert request.runs is not None and request.graph is recipe.export_at(True, B)[1]
    monkeypatch.delenv(KEEP_EXPORTS_ENV)
    outside = _recipe(Net())
    _plan_request(outside, None, CompileOptions(), always=False)
    assert [k[0] for k in outside.exported] == ["export"]
