"""Repeated blocks in the pipeline search (:mod:`hapd.compiler.pipeline.repeats`): which units
repeat, the reduced graph, and stage costs priced on it against the whole graph's."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from hapd import models
from hapd.ir.export import export
from hapd.ir.lower import GraphIR, lower
from hapd.compiler.options import CompileOptions
from hapd.compiler.pipeline.stage_cost import graph_units
from hapd.compiler.pipeline.stage_search import search, stage_table
from hapd.compiler.pipeline.repeats import KEPT, Run, reduce_graph
from hapd.profile.schema import Link, estimated_profile

BATCH = 8


@functools.cache
def _graph(name: str, layers: int, batch: int = BATCH) -> GraphIR:
    """``name`` at its tiny size with ``layers`` blocks."""
    spec = models.get(name)
    model, config = models.build(name, "tiny", layers=layers)
    return lower(export(model, spec.example_inputs(config, batch), batch_dims=spec.batch_dims), name=name)


@functools.cache
def _three_hosts():
    """A fast host and two slow ones of two ranks each, linked fast within a host and
    slowly between hosts: groups of one, two and three hosts, of both kinds."""
    profile = estimated_profile(6, flops=[2e10] * 2 + [1e10] * 4, hosts=["a"] * 2 + ["b"] * 2 + ["c"] * 2,
                                alpha=1e-5, beta=1e8)
    links = {name: {"inter": link["inter"], "intra": Link(alpha=1e-6, beta=1e10)} for name, link in profile.collectives.items()}
    return dataclasses.replace(profile, collectives=links, name="three-hosts")


def test_a_transformers_middle_blocks_repeat_and_the_reduced_graph_keeps_a_few() -> None:
    doc = _graph("gpt2_block", 8).doc
    units = graph_units(doc)
    reduction = reduce_graph(doc, units.unit_of, len(units.units))
    assert reduction is not None and reduction.units == 8
    # unit 0 holds the embedding, unit 7 the head: the run is units 1-6, of which 1-3 stay
    [run] = reduction.runs
    assert run.kept == ((1,), (2,), (3,)) and run.dropped == ((4,), (5,), (6,))
    assert reduction.kept == 5
    reduced = graph_units(reduction.ir.doc)
    assert [u.blocks for u in reduced.units] == [u.blocks for u in units.units[:4]] + [units.units[7].blocks]
    # the dropped blocks' parameters go with them; the tied embedding, read by the first and last unit, stays
    names = {n["name"] for n in reduction.ir.doc["nodes"] if n["kind"] == "parameter"}
    assert not any("blocks_4" in name or "blocks_6" in name for name in names)
    assert any("blocks_3" in name for name in names)
    assert units.shared and all(name in names for name, *_ in units.shared)
    # the last kept block hands on the hidden state as the block before it did
    assert len(run.exits) == KEPT + 1 and all(len(e) == len(run.exits[0]) > 0 for e in run.exits)


def test_a_graph_without_a_long_run_of_repeated_blocks_has_no_reduction() -> None:
    for name, layers in (("vit", 4), ("mlp", 3)):  # a run of 2 blocks; 3 periods of (linear, gelu, dropout)
        doc = _graph(name, layers).doc
        units = graph_units(doc)
        assert reduce_graph(doc, units.unit_of, len(units.units)) is None


def test_layers_that_alternate_two_kinds_of_block_repeat_with_period_two() -> None:
    doc = _graph("bert_moe", 10).doc  # mixture-of-experts FFNs in odd layers
    units = graph_units(doc)
    reduction = reduce_graph(doc, units.unit_of, len(units.units))
    assert reduction is not None
    [run] = reduction.runs
    assert all(len(period) == 2 for period in run.kept + run.dropped)
    assert len(run.kept) == KEPT and run.dropped


@pytest.mark.parametrize("name", ["vit", "bert", "gpt2_block"])
def test_stage_costs_priced_on_the_reduced_graph_are_the_whole_graphs(name: str) -> None:
    ir = _graph(name, 7)
    profile = _three_hosts()
    reduced = stage_table(ir, profile, CompileOptions())
    whole = stage_table(ir, profile, CompileOptions(), repeats=False)
    assert reduced.priced_units == 5 < whole.priced_units == len(whole.units.units) == 7
    assert reduced.whole_searches == 0 and reduced.searches == whole.searches > 0
    assert reduced.costs.keys() == whole.costs.keys()
    for key, costs in whole.costs.items():
        assert costs is not None and reduced.costs[key] is not None
        for mine, theirs in zip((reduced.costs[key].forward, reduced.costs[key].backward, reduced.costs[key].sync),
                                (costs.forward, costs.backward, costs.sync)):
            assert mine == pytest.approx(theirs, rel=1e-9, abs=1e-15)


def test_the_pipeline_found_on_the_reduced_graphs_is_the_whole_graphs() -> None:
    graphs = {1: _graph("gpt2_block", 7), 2: _graph("gpt2_block", 7, BATCH // 2)}
    profile = _three_hosts()
    reduced = search(graphs, profile, CompileOptions(pipeline="auto"), 1.0)
    whole = search(graphs, profile, CompileOptions(pipeline="auto"), 1.0, repeats=False)
    assert reduced.best is not None and whole.best is not None
    assert reduced.best.per_iteration == pytest.approx(whole.best.per_iteration, rel=1e-9)
    assert [t["priced_units"] for t in reduced.tried] == [5, 5] and [t["units"] for t in reduced.tried] == [7, 7]
    assert [t["priced_units"] for t in whole.tried] == [7, 7]


def test_a_cycle_is_the_fewest_last_kept_periods_that_hand_on_what_they_took() -> None:
    run = Run(kept=((1,), (2,), (3,)), dropped=((4,), (5,)), exits=(("a",), ("b",), ("c",), ("d",)))
    # each block takes the hidden state whole and hands it on whole
    assert run.cycle({"a": "Identity", "b": "Identity", "c": "Identity", "d": "Identity"}) == 1
    # tensor-parallel pairs: split after the first of each pair, whole after the second
    assert run.cycle({"a": "Identity", "b": "Gather(1)", "c": "Identity", "d": "Gather(1)"}) == 2
    assert run.cycle({"a": "Reduce", "b": "Identity", "c": "Gather(0)", "d": "Reduce"}) == 3
    # the last kept block hands on what no kept block took: the dropped blocks cannot repeat it
    assert run.cycle({"a": "Identity", "b": "Identity", "c": "Identity", "d": "Reduce"}) == 0
