"""One batch meaning: the batch a model is exported at (with a symbolic batch) or given
to ``hapd.parallelize`` is the global batch of every technique; overlap's duplicas take
half each, a pipeline's micro-batches their share. ``hapd compile``'s output,
``hapd explain``, ``hapd explain --steps`` and the one-line summary
(:meth:`hapd.train.plan_source.PlanSource.summary`) of one plan state the same global
batch, per-rank batches and technique: for an overlap plan of a one-duplica graph
(forced with ``--overlap``), an overlap plan chosen by a technique search, and a
pipeline plan."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import torch
from click.testing import CliRunner
from torch import nn

import hapd
from hapd import models
from hapd.cli import main
from hapd.compiler.driver import compile_techniques
from hapd.compiler.options import CompileOptions
from hapd.compiler.plan import Plan
from hapd.compiler.plan_summary import input_split
from hapd.compiler.techniques import GraphSet
from hapd.ir.export import export
from hapd.ir.lower import GraphIR, lower
from hapd.profile.schema import Profile, profile_from_dict
from hapd.train.plan_source import PlanSource

BATCH = 8
"""The global batch of the overlap plans (each duplica 4)."""


class UpDown(nn.Module):
    """``down(relu(up(x))).sum()``: two linears without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))).sum()


@functools.cache
def _updown(batch: int) -> GraphIR:
    torch.manual_seed(0)
    return lower(hapd.export(UpDown(), (torch.randn(batch, 8),)))


def _hand_profile() -> Profile:
    """Two devices on two hosts, collectives of 1 ms latency, matmuls of about a millisecond."""
    link = {"inter": {"alpha": 1e-3, "beta": 1e20}}
    kinds = ("all_gather", "all_gather_grouped", "all_reduce", "all_to_all", "broadcast", "reduce_scatter",
             "reduce_scatter_grouped")
    return profile_from_dict({
        "format": "hapd.profile", "version": 1, "name": "hand-2",
        "devices": [{"rank": r, "host": f"h{r}", "model": "toy", "flops": 1.024e6, "elementwise_flops": 1e24,
                     "memory": 2.0**40} for r in range(2)],
        "collectives": {kind: link for kind in kinds},
    })


def _cli(*args: str) -> str:
    done = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert done.exit_code == 0, done.output
    return done.output


def _texts(plan_path: Path, compiled: str | None = None) -> dict[str, str]:
    """Everything that states the plan's batch: the compile's output (when compiled by the
    CLI), explain, explain --steps and the summary line."""
    out = {"explain": _cli("explain", str(plan_path)), "steps": _cli("explain", "--steps", str(plan_path)),
           "summary": PlanSource(Plan.load(plan_path), "given", 0.0).summary()}
    if compiled is not None:
        out["compile"] = compiled
    return out


def _every_global_batch_is(texts: dict[str, str], batch: int) -> None:
    """Every "global batch N" (and "global batches of N") in every text says ``batch``."""
    for name, text in texts.items():
        found = re.findall(r"global batch(?:es)?(?: of)? (\d+)", text)
        assert found, f"{name} states no global batch:\n{text}"
        assert {int(n) for n in found} == {batch}, f"{name}: {found}\n{text}"


def _check_overlap(texts: dict[str, str], plan: Plan) -> None:
    duplica = input_split(plan.doc)
    if duplica is not None:  # the inputs split by samples: each rank's share of the step and of each duplica
        assert sum(duplica) == BATCH // 2  # each duplica is half the global batch
        step = [2 * n for n in duplica]
        split = (f"per-rank batch {'/'.join(map(str, step))} of {BATCH} (2 duplicas of {BATCH // 2}, "
                 f"each rank {'/'.join(map(str, duplica))} of each)")
    else:  # split otherwise: the ratios
        step = []
        split = f", global batch {BATCH} (2 duplicas of {BATCH // 2})"
    _every_global_batch_is(texts, BATCH)
    for name, text in texts.items():
        assert split in text, f"{name}:\n{text}"
        assert "the SPMD plan runs" not in text and "technique: spmd" not in text.lower(), f"{name}:\n{text}"
    assert texts["summary"].startswith("plan: overlap, ")
    assert "\ntechnique: overlap" in "\n" + texts["explain"]
    assert f"each 1/2 of the global batch of {BATCH} ({BATCH // 2} each)" in texts["steps"]
    assert "estimated per iteration (overlap)" in texts["steps"]
    rows = re.findall(r"^  ranks? [\d-]+\s+ratio [\d.]+\s+batch (\d+)", texts["explain"], re.M)
    assert {int(r) for r in rows} == set(step), texts["explain"]  # the rank rows: a step's samples
    if "compile" in texts:
        assert f"(overlap, global batch {BATCH};" in texts["compile"]
        assert texts["summary"].split("; given")[0] in texts["compile"]  # the compile prints the same line


def test_a_forced_overlap_plan_states_one_global_batch(tmp_path: Path) -> None:
    """A static graph compiled with --overlap is one duplica's: the plan trains twice its batch, and says so."""
    graph = _updown(BATCH // 2).save(tmp_path / "updown.hapg")
    profile = tmp_path / "hand.json"
    profile.write_text(_hand_profile().to_json())
    out = tmp_path / "updown.hplan"
    compiled = _cli("compile", str(graph), "-p", str(profile), "-o", str(out), "--overlap")
    plan = Plan.load(out)
    assert plan.technique == "overlap" and plan.doc["global_batch"] == BATCH
    assert f"one duplica's graph, of batch {BATCH // 2}: the plan trains global batches of {BATCH}" in compiled
    _check_overlap(_texts(out, compiled), plan)


def test_an_overlap_plan_a_technique_search_chose_states_one_global_batch(tmp_path: Path) -> None:
    """Overlap chosen (it hides the gathered activation's collective) with pipelines
    searched too: --steps names the overlap plan as the one that runs."""
    graphs = GraphSet(full=_updown(BATCH), half=_updown(BATCH // 2))
    options = CompileOptions(overlap=True, pipeline="auto", force={"linear": "column-parallel", "linear_1": "replicated"})
    plan = compile_techniques(graphs, _hand_profile(), options)
    assert plan.technique == "overlap" and plan.doc["global_batch"] == BATCH
    path = plan.save(tmp_path / "chosen.hplan")
    texts = _texts(path)
    assert "pipeline: none (" in texts["steps"] and "the overlap plan runs" in texts["steps"]
    assert "technique: overlap runs" in texts["steps"]
    _check_overlap(texts, plan)


def test_a_pipeline_plan_states_one_global_batch(tmp_path: Path) -> None:
    spec = models.get("mlp")
    model, config = models.build("mlp", "tiny", hidden=256, layers=3)
    program = tmp_path / "mlp.pt2"
    export(model, spec.example_inputs(config, 16), batch_dims=spec.batch_dims, symbolic_batch=True, path=program,
           name="mlp")
    out = tmp_path / "mlp.hplan"
    compiled = _cli("compile", str(program), "-p", "paper-8", "-o", str(out), "--pipeline", "auto")
    plan = Plan.load(out)
    assert plan.technique == "pipeline" and plan.doc["global_batch"] == 16
    found = plan.pipeline
    m, size = found["micro_batches"], found["micro_batch_size"]
    assert m * size == 16
    texts = _texts(out, compiled)
    _every_global_batch_is(texts, 16)
    split = f"global batch 16 in {m} micro-batch{'es' if m != 1 else ''} of {size}"
    for name, text in texts.items():
        assert split in text, f"{name}:\n{text}"
        assert "the SPMD plan runs" not in text, f"{name}:\n{text}"
    assert texts["summary"].startswith("plan: pipeline, ")
    assert "\ntechnique: pipeline" in "\n" + texts["explain"]
    assert f"of {size} (global batch 16)" in texts["steps"] and "the pipeline runs" in texts["steps"]
    assert "estimated per iteration (pipeline)" in texts["steps"]
    assert "(pipeline, global batch 16;" in compiled
    assert f"{found['per_iteration'] * 1e3:.2f} ms/iteration estimated" in compiled  # the pipeline's, not SPMD's
