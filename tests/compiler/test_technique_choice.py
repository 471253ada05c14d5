"""Ties go to the simpler technique (:mod:`hapd.compiler.choice`): SPMD, then pipeline,
then overlap, a more complex one chosen only when predicted ``technique_margin`` (2%)
faster than every simpler one; an overlap plan that hides no communication is not an
overlap plan. The rule by itself, the option, a small model on paper-8 whose overlap
hides nothing (SPMD, and explain says by how much the others lost), a program whose
duplicas truly hide a collective (overlap), and the margin changing the choice."""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
from click.testing import CliRunner
from torch import nn

import hapd
from hapd import models
from hapd.cli import main
from hapd.compiler.choice import beats, choose, qualifies
from hapd.compiler.driver import compile_techniques
from hapd.compiler.options import CompileOptions
from hapd.compiler.plan import Plan
from hapd.compiler.techniques import GraphSet, graphs_of_program
from hapd.errors import OptionsError
from hapd.ir.export import export
from hapd.ir.lower import GraphIR, lower
from hapd.profile.schema import Profile, profile_from_dict


def test_the_simplest_technique_keeps_a_tie_and_a_near_tie() -> None:
    assert choose({"spmd": 1.0, "pipeline": 1.0, "overlap": 1.0}, 0.02) == "spmd"
    assert choose({"spmd": 1.0, "pipeline": None, "overlap": 0.99}, 0.02) == "spmd"  # 1% faster: short of 2%
    assert choose({"spmd": 1.0, "pipeline": None, "overlap": 0.98}, 0.02) == "overlap"  # 2% faster
    assert choose({"spmd": 1.0, "overlap": 0.97}, 0.0) == "overlap"
    assert choose({"spmd": 1.0, "overlap": 1.0}, 0.0) == "spmd"  # no margin: still the simpler on a tie


def test_a_complex_technique_must_beat_every_simpler_one() -> None:
    # overlap is 4% faster than SPMD but not 2% faster than the pipeline: the pipeline (3% faster) runs
    costs = {"spmd": 1.0, "pipeline": 0.97, "overlap": 0.96}
    assert qualifies("pipeline", costs, 0.02) and not qualifies("overlap", costs, 0.02)
    assert choose(costs, 0.02) == "pipeline"
    assert choose({"spmd": 1.0, "pipeline": 0.97, "overlap": 0.9}, 0.02) == "overlap"
    assert choose({"spmd": 1.0, "pipeline": None, "overlap": None}, 0.02) == "spmd"
    assert beats(0.98, 1.0, 0.02) and not beats(0.981, 1.0, 0.02)


@pytest.mark.parametrize("bad", [1.0, 1.5, -0.01, math.nan, math.inf, "0.02", True, None])
def test_the_margin_is_validated(bad: object) -> None:
    with pytest.raises(OptionsError, match="technique_margin") as caught:
        CompileOptions(technique_margin=bad)  # type: ignore[arg-type]
    assert caught.value.field == "technique_margin"


def test_the_margin_is_an_option_everywhere_options_come_from() -> None:
    assert CompileOptions().technique_margin == 0.02
    assert CompileOptions(technique_margin=0).key()["technique_margin"] == 0.0  # one key for 0 and 0.0
    assert CompileOptions.from_mapping({"technique_margin": 0.1}).technique_margin == 0.1
    with pytest.raises(OptionsError, match="technique_margin 2 must be at least 0 and below 1") as caught:
        CompileOptions.from_mapping({"technique_margin": 2})
    assert caught.value.field == "options.technique_margin"
    done = CliRunner().invoke(main, ["compile", "nowhere.hapg", "-p", "paper-8", "--technique-margin", "1"])
    assert done.exit_code != 0  # no such file, said before anything is compiled
    assert "--technique-margin" in CliRunner().invoke(main, ["compile", "--help"]).output


@functools.cache
def _gpt2_graphs() -> GraphSet:
    """A small GPT-2 block, exported once with a symbolic batch of 16."""
    spec = models.get("gpt2_block")
    model, config = models.build("gpt2_block", "tiny")
    program = export(model, spec.example_inputs(config, 16), batch_dims=spec.batch_dims, symbolic_batch=True)
    return graphs_of_program(program, CompileOptions(overlap=True, pipeline="auto"), name="gpt2_block")


def test_overlap_that_hides_nothing_is_not_chosen_and_explain_says_what_lost() -> None:
    plan = compile_techniques(_gpt2_graphs(), "paper-8", CompileOptions(overlap=True, pipeline="auto"))
    priced = plan.estimate["techniques"]
    assert plan.technique == "spmd" and not (plan.doc.get("pipeline") or {}).get("chosen")
    assert priced["overlap"]["per_iteration"] is None and "hides no communication" in priced["overlap"]["reason"]
    assert priced["overlap"]["predicted"] > 0
    pipeline = priced["pipeline"]["per_iteration"]
    won = priced["spmd"]["per_iteration"]
    text = plan.explain(steps=False)
    (line,) = [t for t in text.splitlines() if t.startswith("technique: ")]
    assert line.startswith("technique: SPMD") and "the others lost:" in line
    assert "overlap: hides no communication under compute" in line and "not an overlap plan" in line
    if pipeline is not None:  # priced: by how much it lost (pipeline seconds include their dispatch)
        assert re.search(r"pipeline [\d.]+ (µs|ms) \([\d.]+× slower\)", line), line
    assert plan.doc["global_batch"] == 16 and won > 0


class UpDown(nn.Module):
    """``down(relu(up(x))).sum()``: two linears without bias (as tests/compiler/test_overlap_cost.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))).sum()


GATHERED = {"linear": "column-parallel", "linear_1": "replicated"}
"""``up`` split by columns, ``down`` whole: relu's result is all-gathered before ``down``."""


@functools.cache
def _updown_graph(batch: int) -> GraphIR:
    torch.manual_seed(0)
    return lower(hapd.export(UpDown(), (torch.randn(batch, 8),)))


def _hand_profile() -> Profile:
    """Two devices whose matmuls take about a millisecond and whose collectives each cost
    1 ms of latency: a gathered activation's collective is there to hide."""
    link = {"inter": {"alpha": 1e-3, "beta": 1e20}}
    kinds = ("all_gather", "all_gather_grouped", "all_reduce", "all_to_all", "broadcast", "reduce_scatter",
             "reduce_scatter_grouped")
    return profile_from_dict({
        "format": "hapd.profile", "version": 1, "name": "hand-2",
        "devices": [{"rank": r, "host": f"h{r}", "model": "toy", "flops": 1.024e6, "elementwise_flops": 1e24,
                     "memory": 2.0**40} for r in range(2)],
        "collectives": {kind: link for kind in kinds},
    })


@functools.cache
def _hiding(margin: float) -> Plan:
    graphs = GraphSet(full=_updown_graph(8), half=_updown_graph(4))
    return compile_techniques(graphs, _hand_profile(),
                              CompileOptions(overlap=True, force=GATHERED, technique_margin=margin))


def test_overlap_that_hides_a_collective_and_is_clearly_faster_is_chosen() -> None:
    plan = _hiding(0.02)
    priced = plan.estimate["techniques"]
    assert plan.technique == "overlap" and plan.overlap and plan.estimate["overlap"]["hidden"] > 0
    assert priced["overlap"]["per_iteration"] <= 0.98 * priced["spmd"]["per_iteration"]
    assert plan.doc["global_batch"] == 8  # the full graph's batch: two duplicas of 4


def test_the_margin_changes_the_choice() -> None:
    faster = _hiding(0.02).estimate["techniques"]
    gain = 1 - faster["overlap"]["per_iteration"] / faster["spmd"]["per_iteration"]
    assert 0.02 < gain < 0.5
    assert _hiding(round(gain - 0.01, 4)).technique == "overlap"
    kept = _hiding(round(gain + 0.01, 4))
    assert kept.technique == "spmd" and not kept.overlap  # the same prices, a wider margin: SPMD runs
    assert kept.estimate["techniques"] == faster
    line = [t for t in kept.explain(steps=False).splitlines() if t.startswith("technique: ")][0]
    assert f"faster, short of the {round(gain + 0.01, 4):.0%} a more complex technique must win by" in line
    assert "technique: spmd runs (a more complex technique must be predicted" in kept.explain()
