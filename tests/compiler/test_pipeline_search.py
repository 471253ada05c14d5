"""Pipeline stages in the plan space (``CompileOptions.pipeline``): the 1F1B cost, the DP
over cuts and groups against a brute force, the graph's cut candidates, when a pipeline
beats the SPMD plan, the plan's record and explanation, and the options."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from hapd import models
from hapd.cli import main
from hapd.compiler.driver import compile as compile_plan
from hapd.ir.export import export
from hapd.ir.lower import GraphIR, lower
from hapd.compiler.options import CompileOptions
from hapd.compiler.pipeline.stage_cost import graph_units, one_f_one_b, simulate_one_f_one_b, steady_period
from hapd.compiler.pipeline.stage_search import best_split, micro_batch_graphs, search as pipeline_search, split_cost, stage_table
from hapd.errors import OptionsError, ProfileError
from hapd.profile.schema import Link, estimated_profile

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
BATCH = 8


@functools.cache
def _mlp(batch: int) -> GraphIR:
    """An MLP of three 256-wide hidden layers: 0.8 MB of gradients against 8 KiB of
    activations per sample batch at a cut."""
    spec = models.get("mlp")
    model, config = models.build("mlp", "tiny", hidden=256, layers=3)
    return lower(export(model, spec.example_inputs(config, batch), batch_dims=spec.batch_dims), name="mlp")


def _two_hosts(inter_beta: float, world: int = 4):
    """Two hosts (a fast and a slow one), their ranks linked fast within a host and at
    ``inter_beta`` bytes/s between the hosts."""
    half = world // 2
    profile = estimated_profile(world, flops=[2e10] * half + [1e10] * half, hosts=["a"] * half + ["b"] * half,
                                alpha=1e-5, beta=inter_beta)
    links = {name: {"inter": link["inter"], "intra": Link(alpha=1e-6, beta=1e10)} for name, link in profile.collectives.items()}
    return dataclasses.replace(profile, collectives=links, name=f"two-hosts-{inter_beta:g}")


def _compile(profile):
    return compile_plan(_mlp(BATCH), profile, CompileOptions(pipeline="auto"), micro_graphs=[_mlp(BATCH // 2)])


@functools.cache
def _linked(inter_beta: float):
    """The pipeline-searching compile on :func:`_two_hosts`."""
    return _compile(_two_hosts(inter_beta))


# --------------------------------------------------------------------------- the 1F1B cost


def test_one_f_one_b_by_hand() -> None:
    # fill: 2 + 3 + 0.5; steady state paced by stage 1's compute (3) three more times; the larger sync
    assert one_f_one_b([2.0, 3.0], [0.5], [1.0, 0.25], 4) == pytest.approx(5.5 + 3 * 3.0 + 1.0)
    assert one_f_one_b([2.0, 3.0], [0.5], [1.0, 0.25], 1) == pytest.approx(5.5 + 1.0)
    # a slow link: stage 0 holds 2 micro-batches in flight, its round trip 1 + 1 + 4 spans two periods
    assert steady_period([1.0, 1.0], [4.0], 8) == pytest.approx(3.0)
    assert one_f_one_b([1.0, 1.0], [4.0], [0.0, 0.0], 8) == pytest.approx(6.0 + 7 * 3.0)
    # with 2 micro-batches both fit in flight at once: the round trip does not pace, the link does (4 / 2)
    assert steady_period([1.0, 1.0], [4.0], 2) == pytest.approx(2.0)
    # three stages: stage 0's round trip 1+1+1 + 0.5+0.5 over 3 in flight, stage 1's 1+1 + 0.5 over 2
    assert steady_period([1.0, 1.0, 1.0], [0.5, 0.5], 8) == pytest.approx(max(1.0, 4.0 / 3, 2.5 / 2))
    # equal stages without communication: the classic (S-1)/(m+S-1) bubble
    for stages, m in ((3, 5), (2, 1)):
        pipelined = simulate_one_f_one_b([0.5] * stages, [0.5] * stages, [0.0] * (stages - 1), m)
        assert 1 - m * stages / (stages * pipelined) == pytest.approx((stages - 1) / (m + stages - 1))
    with pytest.raises(ValueError):
        one_f_one_b([1.0, 1.0], [], [0.0, 0.0], 2)


def test_the_simulated_1f1b_schedule_by_hand() -> None:
    # equal stages, no transfers: (m + S - 1) stage times
    assert simulate_one_f_one_b([0.5] * 3, [0.5] * 3, [0.0, 0.0], 5) == pytest.approx(7.0)
    # a slow first stage: F0 F1 on stage 0 [0, 2], stage 1 runs F0 B0 at [1, 1.5], stage 0's B0 waits for
    # F1 to end (2-3), stage 1 runs F1 B1 at [2, 2.5], stage 0's B1 at [3, 4]
    assert simulate_one_f_one_b([1.0, 0.25], [1.0, 0.25], [0.0], 2) == pytest.approx(4.0)
    # the closed form charges the slow stage's full time in the fill: an upper bound here
    assert one_f_one_b([2.0, 0.5], [0.0], [0.0, 0.0], 2) == pytest.approx(4.5)
    # a slow link: stage 0 holds 2 micro-batches in flight, each round trip 0.5+2+0.5+0.5+2+0.5 = 6, so
    # backwards end in pairs 6 s apart: micro-batches 0 and 1 at 6 and 8, ..., 6 and 7 at 24 and 26
    assert simulate_one_f_one_b([0.5, 0.5], [0.5, 0.5], [4.0], 8) == pytest.approx(26.0)
    # the closed form: fill 6, then 7 periods of 6 / 2
    assert one_f_one_b([1.0, 1.0], [4.0], [0.0, 0.0], 8) == pytest.approx(6.0 + 7 * 3.0)
    with pytest.raises(ValueError):
        simulate_one_f_one_b([1.0, 1.0], [1.0], [0.0], 2)


@pytest.mark.parametrize("seed", range(40))
def test_the_closed_form_1f1b_price_follows_the_simulated_schedule(seed: int) -> None:
    """What the DP prices against the event-by-event schedule the plan reports: equal
    without transfers when stages are equal; otherwise a period's fraction off, at
    most a quarter over (unequal stages' fill) and a tenth under (interlocked stages'
    in-flight limits)."""
    rng = random.Random(seed)
    S, m = rng.randint(2, 4), rng.choice([1, 2, 4, 8, 16])
    u = [rng.uniform(0.5, 2.0) for _ in range(S)]
    c = [rng.uniform(0.0, 2.0) if seed % 4 else 0.0 for _ in range(S - 1)]
    simulated = simulate_one_f_one_b([t / 3 for t in u], [2 * t / 3 for t in u], c, m)
    priced = one_f_one_b(u, c, [0.0] * S, m)
    assert simulated * 0.9 <= priced <= simulated * 1.25
    equal = simulate_one_f_one_b([u[0] / 3] * S, [2 * u[0] / 3] * S, [0.0] * (S - 1), m)
    assert one_f_one_b([u[0]] * S, [0.0] * (S - 1), [0.0] * S, m) == pytest.approx(equal)


# --------------------------------------------------------------------------- the DP


def _brute_force(hosts, units, cuts, stage, boundary, m, fits=None):
    """The cheapest pipeline of ≥ 2 stages over every host partition and every cut set
    (whose stages ``fits`` with their micro-batches in flight, ``min(S − s, m)``)."""
    best = None
    for s in range(2, hosts + 1):
        for hcuts in itertools.combinations(range(1, hosts), s - 1):
            for kcuts in itertools.combinations(sorted(cuts), s - 1):
                hs, ks = (0, *hcuts, hosts), (0, *kcuts, units)
                spans = [(hs[i], hs[i + 1], ks[i], ks[i + 1]) for i in range(s)]
                if fits is not None and not all(fits(*span, min(s - i, m)) for i, span in enumerate(spans)):
                    continue
                cost = split_cost(spans, stage, boundary, m)
                if cost is not None and (best is None or cost < best):
                    best = cost
    return best


@pytest.mark.parametrize("seed", range(60))
def test_the_dp_finds_the_brute_force_optimum_of_random_stage_costs(seed: int) -> None:
    rng = random.Random(seed)
    hosts, units = rng.randint(2, 5), rng.randint(2, 8)
    cuts = [k for k in range(1, units) if rng.random() < 0.8]
    per_unit = {(h0, h1): None if rng.random() < 0.1 else [(rng.uniform(0, 2), rng.uniform(0, 1)) for _ in range(units)]
                for h0 in range(hosts) for h1 in range(h0 + 1, hosts + 1)}
    boundary = [rng.uniform(0, 0.5) for _ in range(units + 1)]

    def stage(h0, h1, k0, k1):
        costs = per_unit[(h0, h1)]
        return None if costs is None else (sum(c for c, _ in costs[k0:k1]), sum(y for _, y in costs[k0:k1]))

    # memory: a group holds at most `room` units' worth, each micro-batch in flight a unit's worth more
    room = {(h0, h1): rng.uniform(1, 4) * (h1 - h0) for h0 in range(hosts) for h1 in range(h0 + 1, hosts + 1)}

    def fits(h0, h1, k0, k1, in_flight):
        return (k1 - k0) * (1 + 0.3 * in_flight) <= room[(h0, h1)]

    for m in (1, 3, 8):
        for check in (None, fits):
            found = best_split(hosts, units, cuts, stage, boundary, m, check)
            expected = _brute_force(hosts, units, cuts, stage, boundary, m, check)
            if expected is None:
                assert found is None
            else:
                assert found is not None and found.cost == pytest.approx(expected)
                assert split_cost(found.spans, stage, boundary, m) == pytest.approx(found.cost)
                if check is not None:
                    assert all(fits(*span, min(len(found.spans) - i, m)) for i, span in enumerate(found.spans))


def test_the_dp_finds_the_brute_force_optimum_on_a_graph() -> None:
    profile = estimated_profile(3, flops=[2e10, 1e10, 1e10], hosts=["a", "b", "c"], alpha=1e-5, beta=1e7)
    for m, ir in micro_batch_graphs(_mlp(BATCH), [_mlp(BATCH // 2)]).items():
        table = stage_table(ir, profile, CompileOptions())
        assert table.searches == 4  # a, a+b, b+c, and b once for b and c (groups of the same devices)
        units = len(table.units.units)
        found = table.best(m)
        expected = _brute_force(3, units, table.units.cuts, table.stage, table.boundary, m)
        assert found is not None and found.cost == pytest.approx(expected)


def test_a_graph_is_cut_between_blocks_where_its_activations_cross() -> None:
    units = graph_units(GraphIR.load(FIXTURES / "vit.hapg").doc)  # 2 layers, batch 2, width 32, 65 tokens
    assert [u.blocks for u in units.units] == [("layers.0",), ("layers.1",)]
    assert units.cuts == [1]
    assert units.crossing[1] == (2 * 65 * 32 * 4,)  # the hidden state, and nothing else (no mask, no input)
    doc = GraphIR.load(FIXTURES / "vit.hapg").doc
    last = [n for n in doc["nodes"] if n.get("block") == "layers.0"][-1]
    assert units.units[0].last_node == last["name"]


# --------------------------------------------------------------------------- pipeline vs SPMD


def test_a_slow_link_between_hosts_makes_a_pipeline_win_and_a_fast_one_spmd() -> None:
    slow = _linked(1e6)
    found = slow.pipeline
    assert found is not None and found["chosen"]
    assert found["per_iteration"] < found["spmd_only_per_iteration"] == pytest.approx(slow.estimate["per_iteration"])
    assert [s["hosts"] for s in found["stages"]] == [["a"], ["b"]]
    assert [s["ranks"] for s in found["stages"]] == [[0, 1], [2, 3]]
    assert found["stages"][0]["last_node"] and found["stages"][1]["last_node"] is None
    assert found["stages"][0]["boundary_bytes"] == BATCH // found["micro_batches"] * 256 * 4
    assert found["micro_batches"] in (1, 2) and found["schedule"] == "1f1b"

    fast = _linked(1e11)
    assert fast.pipeline is None
    lost = fast.doc["pipeline"]
    assert lost is not None and not lost["chosen"] and lost["per_iteration"] >= lost["spmd_only_per_iteration"]


def test_one_host_has_no_pipeline() -> None:
    plan = _compile(estimated_profile(2, flops=[2e10, 1e10]))
    assert plan.doc["pipeline"] is None and plan.pipeline is None
    assert "one host" in plan.doc["stats"]["pipeline"]["reason"]
    assert "pipeline: none (one host" in plan.explain()


def test_explain_lists_the_stages() -> None:
    text = _linked(1e6).explain()
    assert "pipeline: 2 stages" in text and "beats the SPMD-only plan" in text
    assert "stage 0:" in text and "stage 1:" in text and "bubble" in text and "on a (ranks 0-1)" in text
    assert "loses to the SPMD-only plan" in _linked(1e11).explain()


def test_the_command_line_compiles_a_pipeline(tmp_path: Path) -> None:
    profile = _two_hosts(1e6).save(tmp_path / "slow.json")
    full, micro = _mlp(BATCH).save(tmp_path / "mlp.hapg"), _mlp(BATCH // 2).save(tmp_path / "mlp4.hapg")
    result = CliRunner().invoke(main, ["compile", str(full), "--profile", str(profile), "--pipeline", "auto",
                                       "--micro-graph", str(micro), "--explain"])
    assert result.exit_code == 0, result.output
    assert "chosen over the SPMD plan" in result.output and "stage 1:" in result.output


# --------------------------------------------------------------------------- options


def test_pipeline_options_are_validated_and_keyed() -> None:
    with pytest.raises(OptionsError) as err:
        CompileOptions(pipeline="on")
    assert err.value.field == "pipeline"
    with pytest.raises(OptionsError):  # both price other batches: one graph cannot give them
        compile_plan(_mlp(BATCH), _two_hosts(1e6), CompileOptions(pipeline="auto", overlap=True))
    with pytest.raises(OptionsError):
        CompileOptions(pipeline="auto", ratios=(0.5, 0.5))
    assert CompileOptions().key()["pipeline"] == "off" and CompileOptions(pipeline="auto").key()["pipeline"] == "auto"
    with pytest.raises(OptionsError):  # micro-batch graphs without pipeline auto
        compile_plan(_mlp(BATCH), _two_hosts(1e6), CompileOptions(), micro_graphs=[_mlp(BATCH // 2)])
    with pytest.raises(OptionsError):  # a batch that does not divide the global one
        micro_batch_graphs(_mlp(BATCH // 2), [_mlp(BATCH)])
    plan = compile_plan(_mlp(BATCH), _two_hosts(1e6), CompileOptions())
    assert "pipeline" not in plan.doc and "pipeline" not in plan.doc["stats"] and "pipeline:" not in plan.explain()


def test_a_tied_embedding_is_summed_between_the_stages_it_spans() -> None:
    units = graph_units(GraphIR.load(FIXTURES / "gpt2_block.hapg").doc)  # 2 blocks, the LM head tied to the tokens
    (shared,) = units.shared
    name, first, last, size = shared
    assert (first, last) == (0, len(units.units) - 1) and size > 0
    assert units.split_parameters(units.cuts) == [(name, size)]
    assert units.split_parameters([]) == []


def test_a_program_that_updates_buffers_gets_no_pipeline() -> None:
    from hapd.compiler.pipeline.stage_search import search

    from hapd.ir.lower import canonical_bytes

    doc = GraphIR.load(FIXTURES / "vit.hapg").doc
    layer_norm = next(i for i, n in enumerate(doc["nodes"]) if n["op"] == "aten.layer_norm")
    doc["mutations"] = [{"target": "norm.running_mean", "value": [layer_norm, 0]}]  # as batch norm's would be
    found = search({1: GraphIR(canonical_bytes(doc))}, _two_hosts(1e6), CompileOptions(), 1.0)
    assert found.best is None and "updates buffers" in found.reason and found.groups_priced == 0


def test_a_group_of_devices_is_a_profile_of_its_own() -> None:
    profile = _two_hosts(1e6)
    profile = dataclasses.replace(profile, collectives={**profile.collectives, "grad_sync": {"inter": Link(alpha=1e-3, beta=1e6)}})
    group = profile.subset([2, 3], hosts={"b": "h0"})
    assert [d.rank for d in group.devices] == [0, 1] and [d.flops for d in group.devices] == [1e10, 1e10]
    assert group.hosts == ["h0"] and "grad_sync" not in group.collectives  # one host sums with a plain all-reduce
    assert "grad_sync" in profile.subset([1, 2]).collectives  # two hosts: the two-level sum
    with pytest.raises(ProfileError):
        profile.subset([0, 0])
    with pytest.raises(ProfileError):
        profile.subset([4])


# --------------------------------------------------------------------------- stage memory


def test_a_stages_memory_estimate_follows_the_stage_compiled_alone() -> None:
    """The search's estimate of a stage's peak (the group's whole-graph plan scaled to the
    stage's units) against the stage's own program compiled alone: the whole graph
    exactly, every stage of every cut on the safe side and within half again."""
    from hapd.compiler.pipeline.stage_cost import unit_memory
    from hapd.compiler.ratios import peak_memory
    from hapd.compiler.search import search_program
    from hapd.compiler.pipeline.stages import split_program

    spec = models.get("bert")
    model, config = models.build("bert", "tiny", layers=3)
    program = export(model, spec.example_inputs(config, BATCH), batch_dims=spec.batch_dims)
    ir = lower(program, name="bert")
    profile = estimated_profile(2, flops=[2e10, 1e10], hosts=["a", "b"], alpha=1e-5, beta=1e9)
    options = CompileOptions(memory_caps=False, recompute="never")
    units = graph_units(ir.doc)
    whole, ratios = search_program(ir.data, profile, options)
    memory = unit_memory(whole, ratios, ir.doc, units.unit_of, len(units.units), [d.memory for d in profile.devices])
    count = len(units.units)
    assert memory.peak(0, count, 1) == pytest.approx(peak_memory(whole, ratios))
    assert memory.peak(0, count, 2) > memory.peak(0, count, 1)  # a second micro-batch's activations
    for k in units.cuts:
        stages, _ = split_program(program, [units.units[k - 1].last_node])
        for stage, (k0, k1) in zip(stages, ((0, k), (k, count))):
            alone = compile_plan(lower(stage.program, name=f"stage{stage.index}"), profile, options)
            for estimated, actual in zip(memory.peak(k0, k1, 1), alone.estimate["memory"]):
                assert 0.95 * actual <= estimated <= 1.5 * actual, (k, stage.index)
    tight = dataclasses.replace(memory, capacity=tuple(0.9 * p for p in memory.peak(0, 1, 1)))
    assert memory.fits(0, 1, 1) and not tight.fits(0, 1, 1)


def test_the_search_keeps_stages_within_their_groups_memory() -> None:
    """Two hosts, the second with too little memory for more than the head: the
    pipeline the search finds leaves it the fewest units, and with less memory still no
    pipeline fits; without memory caps the memory is not looked at."""
    spec = models.get("bert")
    model, config = models.build("bert", "tiny", layers=4)
    graphs = {m: lower(export(model, spec.example_inputs(config, BATCH // m), batch_dims=spec.batch_dims), name="bert")
              for m in (1, 2)}
    base = _two_hosts(1e8)
    unlimited = stage_table(graphs[2], base, CompileOptions())
    key = unlimited.groups[(1, 2)].key
    memory = unlimited.memory[key]
    units = len(unlimited.units.units)
    # room for the last unit with one micro-batch, not for two units
    need_one = max(memory.peak(units - 1, units, 1))
    need_two = min(memory.peak(units - 2, units, 1))
    assert need_one < need_two
    capped = dataclasses.replace(base, devices=tuple(
        dataclasses.replace(d, memory=(need_one + need_two) / 2 if d.host == "b" else d.memory) for d in base.devices))
    table = stage_table(graphs[2], capped, CompileOptions())
    found = table.best(2)
    assert found is not None and found.spans[-1][:3] == (1, 2, units - 1)
    assert all(table.fits(*span, min(len(found.spans) - i, 2)) for i, span in enumerate(found.spans))
    starved = dataclasses.replace(base, devices=tuple(
        dataclasses.replace(d, memory=need_one / 2 if d.host == "b" else d.memory) for d in base.devices))
    assert stage_table(graphs[2], starved, CompileOptions()).best(2) is None
    assert stage_table(graphs[2], starved, CompileOptions(memory_caps=False)).best(2) is not None


def test_with_no_stage_fitting_the_search_says_memory_is_why() -> None:
    spec = models.get("bert")
    model, config = models.build("bert", "tiny", layers=2)
    graphs = {m: lower(export(model, spec.example_inputs(config, BATCH // m), batch_dims=spec.batch_dims), name="bert")
              for m in (1, 2)}
    base = _two_hosts(1e8)
    starved = dataclasses.replace(base, devices=tuple(dataclasses.replace(d, memory=2**16) for d in base.devices))
    found = pipeline_search(graphs, starved, CompileOptions(), spmd_only=1.0)
    assert found.best is None and "memory" in found.reason


def test_a_stages_memory_from_the_graph_without_its_repeated_blocks_is_the_whole_graphs() -> None:
    spec = models.get("bert")
    model, config = models.build("bert", "tiny", layers=8)
    ir = lower(export(model, spec.example_inputs(config, BATCH), batch_dims=spec.batch_dims), name="bert")
    profile = _two_hosts(1e8)
    reduced = stage_table(ir, profile, CompileOptions())
    whole = stage_table(ir, profile, CompileOptions(), repeats=False)
    assert reduced.priced_units < len(reduced.units.units) and reduced.whole_searches == 0
    units = len(whole.units.units)
    for key, memory in whole.memory.items():
        for k0, k1, n in ((0, 3, 2), (3, units, 1), (0, units, 1), (2, 6, 3)):
            # rel: the reduced graph's parameter and activation parts reach the whole graph's by proportion of bytes
            # (UnitMemory, an estimate), not by pricing the dropped blocks: 0.28% off at worst here
            assert reduced.memory[key].peak(k0, k1, n) == pytest.approx(memory.peak(k0, k1, n), rel=0.01)


def test_every_op_pays_the_profiles_small_op_seconds_once_per_micro_batch() -> None:
    """With ``op_seconds`` in the profile a stage's micro-batch costs its kernels'
    dispatch more (an op's once forward and twice backward, a parameter's fetch and
    gradient accumulation once each), so more micro-batches pay it more often; the SPMD
    plan it competes with pays it once."""
    from hapd.compiler.pipeline.stage_cost import OP_KERNELS, PARAMETER_KERNELS, graph_kernels, op_counts, op_kernels

    base = _two_hosts(1e8)
    slow_ops = dataclasses.replace(base, devices=tuple(dataclasses.replace(d, op_seconds=1e-4) for d in base.devices))
    ir = _mlp(BATCH // 2)
    plain, paying = stage_table(ir, base, CompileOptions()), stage_table(ir, slow_ops, CompileOptions())
    count = len(plain.units.units)
    ops = op_counts(ir.doc, plain.units.unit_of, count)
    forward, backward = op_kernels(ir.doc, plain.units.unit_of, count)
    assert sum(ops) > 0
    for u, n in enumerate(ops):  # an MLP draws nothing: its ops' kernels, and its parameters'
        assert forward[u] - OP_KERNELS[0] * n == (backward[u] - OP_KERNELS[1] * n) * PARAMETER_KERNELS[0] // PARAMETER_KERNELS[1]
    for span, group in plain.groups.items():
        costs, paid = plain.costs[group.key], paying.costs[paying.groups[span].key]
        assert costs is not None and paid is not None
        for u in range(count):
            assert paid.forward[u] == pytest.approx(costs.forward[u] + forward[u] * 1e-4)
            assert paid.backward[u] == pytest.approx(costs.backward[u] + backward[u] * 1e-4)
    graphs = micro_batch_graphs(_mlp(BATCH), [_mlp(BATCH // 2)])
    found = pipeline_search(graphs, slow_ops, CompileOptions(), spmd_only=1.0)
    assert found.best is not None
    assert graph_kernels(graphs[1].doc) > 3 * sum(1 for n in graphs[1].doc["nodes"] if n.get("kind") == "op")
    assert found.best.spmd_only_per_iteration == pytest.approx(1.0 + graph_kernels(graphs[1].doc) * 1e-4)


def test_a_graph_without_blocks_is_searched_for_pipelines_and_runs_spmd():
    """Two bare linears (no module block to cut between) on a profile of three hosts:
    the pipeline search finds no stage cut and the plan is SPMD (it raised IndexError)."""
    import torch
    from torch import nn

    import hapd
    from hapd.compiler.options import CompileOptions
    from hapd.profile.schema import estimated_profile

    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x, y):
            return nn.functional.mse_loss(self.b(torch.relu(self.a(x))), y, reduction="sum")

    graph = hapd.lower(hapd.export(Bare(), (torch.randn(12, 16), torch.randn(12, 4))))
    profile = estimated_profile(3, flops=[3e10, 2e10, 1e10], hosts=["a", "b", "c"])
    assert hapd.compile(graph, profile, CompileOptions.from_mapping({"pipeline": "auto"})).technique == "spmd"


@functools.cache
def _bert_dropout(batch: int) -> GraphIR:
    """Tiny BERT with dropout (its attention's too): the random ops a CPU stage draws
    with hapd's counter-based generator in torch ops."""
    spec = models.get("bert")
    model, config = models.build("bert", "tiny", layers=2, dropout=0.1, attention_dropout=0.1)
    return lower(export(model, spec.example_inputs(config, batch), batch_dims=spec.batch_dims), name="bert-dropout")


def _runtime_draw_kernels(kind: str, rank: int) -> tuple[int, int]:
    """(forward, backward) aten calls the runtime's own draw of ``kind`` dispatches on a
    tiny tensor of ``rank`` dims, counted under a dispatch counter."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hapd.spmd.random.random_ops import CounterAttention, CounterDropout

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    shape = [3, 2, 5, 4, 2][:rank]
    x = torch.randn(*shape, requires_grad=True)
    step = torch.zeros((), dtype=torch.int64)
    if kind == "attention":
        probabilities = [*shape[:-1], shape[-2]]
        module = CounterAttention(0.2, 3, probabilities, [0] * rank, 7, is_causal=False, scale=None, enable_gqa=False)
        run = lambda: module(x, x, x, None, step, step)  # noqa: E731
    else:
        module = CounterDropout(0.3, True, 4, shape, [0] * rank, 11, single=True)
        run = lambda: module(x, step, step)  # noqa: E731
    with Count() as forward:
        out = run()
    with Count() as backward:
        out.backward(torch.ones_like(out))
    return forward.calls, backward.calls


@pytest.mark.parametrize("kind,rank", [("dropout", 1), ("dropout", 2), ("dropout", 3), ("dropout", 4),
                                       ("attention", 3), ("attention", 4)])
def test_a_counter_draw_costs_the_kernels_the_runtimes_draw_dispatches(kind: str, rank: int) -> None:
    """``DRAW_KERNELS`` is what hapd's counter dropout and attention dispatch (counted
    here on the runtime's modules: a change to the generator that changes it fails
    this), many times a plain op's 1 + 2: what makes small micro-batches on a CPU cost
    more than their FLOPs."""
    from hapd.compiler.pipeline.stage_cost import OP_KERNELS, draw_kernels

    assert draw_kernels(kind, rank) == _runtime_draw_kernels(kind, rank)
    assert sum(draw_kernels(kind, rank)) > 15 * sum(OP_KERNELS)


def test_a_units_random_ops_dispatch_their_draws_kernels_where_the_devices_draw_in_torch_ops() -> None:
    from hapd.compiler.pipeline.stage_cost import (OP_KERNELS, PARAMETER_KERNELS, _draw_kind, draw_kernels, graph_kernels,
                                                   op_kernels, unit_parameter_elements)

    ir = _bert_dropout(BATCH)
    units = graph_units(ir.doc)
    count = len(units.units)
    expected = [[0, 0] for _ in range(count)]  # forward, backward kernels per unit
    plain_ops = [0] * count
    kinds = set()
    for node in ir.doc["nodes"]:
        if node.get("kind") == "op" and node["name"] in units.unit_of:
            u, kind = units.unit_of[node["name"]], _draw_kind(node)
            f, b = draw_kernels(kind, len(node["outputs"][0]["shape"])) if kind else OP_KERNELS
            expected[u][0] += f
            expected[u][1] += b
            plain_ops[u] += 1
            kinds.add(kind)
    assert kinds == {None, "dropout", "attention"}
    params = [0] * count  # trainable parameters each unit reads
    for i, node in enumerate(ir.doc["nodes"]):
        if node.get("kind") == "parameter" and node.get("requires_grad", True):
            for u in {units.unit_of[n["name"]] for n in ir.doc["nodes"]
                      if n.get("kind") == "op" and n["name"] in units.unit_of and any(r[0] == i for r in n["inputs"])}:
                params[u] += 1
    assert all(n > 0 for n in params) and sum(params) >= sum(1 for e in unit_parameter_elements(ir.doc, units.unit_of, count) if e)
    for u, n in enumerate(params):
        expected[u] = [expected[u][0] + PARAMETER_KERNELS[0] * n, expected[u][1] + PARAMETER_KERNELS[1] * n]
    drawn, plain = op_kernels(ir.doc, units.unit_of, count), op_kernels(ir.doc, units.unit_of, count, counter_draws=False)
    assert [list(p) for p in zip(*drawn)] == expected
    assert plain == ([OP_KERNELS[0] * n + PARAMETER_KERNELS[0] * k for n, k in zip(plain_ops, params)],
                     [OP_KERNELS[1] * n + PARAMETER_KERNELS[1] * k for n, k in zip(plain_ops, params)])
    assert graph_kernels(ir.doc) == sum(drawn[0]) + sum(drawn[1])
    no_dropout = lower(export(*(lambda m: (m[0], models.get("bert").example_inputs(m[1], BATCH)))(
        models.build("bert", "tiny", layers=2, dropout=0.0)), batch_dims=models.get("bert").batch_dims), name="bert")
    assert graph_kernels(no_dropout.doc) == graph_kernels(no_dropout.doc, counter_draws=False)


def test_each_micro_batch_after_the_first_accumulates_its_stages_gradients() -> None:
    """With ``m`` micro-batches a unit's backward adds its parameters' gradients into the
    sum so far, ``(m − 1)/m`` adds a micro-batch at the slowest device's element-wise
    rate; its forward and the units' syncs are what they were."""
    from hapd.compiler.pipeline.stage_cost import unit_parameter_elements

    profile = _two_hosts(1e8)
    profile = dataclasses.replace(profile, devices=tuple(dataclasses.replace(d, elementwise_flops=1e9 * (1 + d.rank))
                                                         for d in profile.devices))
    ir = _mlp(BATCH // 2)
    once, four = stage_table(ir, profile, CompileOptions()), stage_table(ir, profile, CompileOptions(), micro_batches=4)
    elements = unit_parameter_elements(ir.doc, once.units.unit_of, len(once.units.units))
    assert sum(1 for e in elements if e > 0) >= 2
    for span, group in once.groups.items():
        before, after = once.costs[group.key], four.costs[four.groups[span].key]
        assert before is not None and after is not None
        slowest = min(1e9 * (1 + r) for r in group.ranks)
        assert after.forward == pytest.approx(before.forward) and after.sync == pytest.approx(before.sync)
        for u, e in enumerate(elements):
            assert after.backward[u] == pytest.approx(before.backward[u] + 0.75 * e / slowest)


def test_devices_that_run_the_fused_kernels_draw_in_one_kernel() -> None:
    """A profile whose devices run hapd's fused kernels (a GPU) pays a random op's
    dispatch as a plain op's; a CPU profile pays its counted draw's kernels."""
    from hapd.compiler.pipeline.stage_cost import counter_draws, op_kernels

    def with_op_seconds(profile, seconds):
        return dataclasses.replace(profile, devices=tuple(dataclasses.replace(d, op_seconds=seconds)
                                                          for d in profile.devices))

    cpu = _two_hosts(1e8)
    gpu = dataclasses.replace(cpu, devices=tuple(dataclasses.replace(d, fused_attention=True) for d in cpu.devices))
    assert counter_draws(cpu) and not counter_draws(gpu)
    ir = _bert_dropout(BATCH)
    units = graph_units(ir.doc)
    count = len(units.units)
    for profile, draws in ((cpu, True), (gpu, False)):
        free, paying = (stage_table(ir, with_op_seconds(profile, s), CompileOptions()) for s in (0.0, 1e-5))
        forward, backward = op_kernels(ir.doc, units.unit_of, count, counter_draws=draws)
        for span, group in free.groups.items():
            a, b = free.costs[group.key], paying.costs[paying.groups[span].key]
            assert a is not None and b is not None
            assert [y - x for x, y in zip(a.forward, b.forward)] == pytest.approx([n * 1e-5 for n in forward])
            assert [y - x for x, y in zip(a.backward, b.backward)] == pytest.approx([n * 1e-5 for n in backward])
    assert sum(op_kernels(ir.doc, units.unit_of, count)[0]) > sum(op_kernels(ir.doc, units.unit_of, count,
                                                                             counter_draws=False)[0])
