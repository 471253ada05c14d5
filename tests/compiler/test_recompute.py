"""Activation recomputation: blocks whose activations the backward pass rebuilds instead
of keeping (``CompileOptions.recompute``).

Lowering labels each op with its block; a plan that recomputes them trains exactly as
the single device does on uneven Gloo ranks while holding less memory (measured and
predicted); a compile picks recomputation only when memory binds; the plan, its
explanation and the command line say so.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _exact import Case, reference, run_cases
from click.testing import CliRunner

import hapd
from hapd import models
from hapd.cli import main
from hapd.compiler.options import CompileOptions
from hapd.compiler.recompute import graph_blocks
from hapd.errors import OptionsError, SynthesisError
from hapd.profile.schema import estimated_profile

RATIOS = (0.6, 0.4)
TOL = 1e-6
"""Relative tolerance of the loss and every gradient against the single device."""


def _build(name: str, batch: int):
    model, config = models.build(name, "tiny")
    return model, models.get(name).example_inputs(config, batch)


@functools.cache
def _llama(batch: int = 16):
    """Tiny Llama (2 blocks) exported, lowered, and run on one device."""
    return reference(functools.partial(_build, "llama_block", batch), "llama_block")


def _profile(memory: float = 8 * 2**30):
    return estimated_profile(2, flops=[2e10, 1e10], memory=memory)


def _compile(recompute: str, **options):
    return hapd.compile(_llama().ir, _profile(options.pop("memory", 8 * 2**30)),
                        CompileOptions(recompute=recompute, **options))


# --------------------------------------------------------------------------- lowering


def test_lowering_labels_each_op_with_its_block() -> None:
    doc = _llama().ir.doc
    blocks = {n["name"]: n.get("block") for n in doc["nodes"] if n["kind"] == "op"}
    assert set(blocks.values()) == {None, "blocks.0", "blocks.1"}
    assert blocks["embedding"] is None  # the embedding and the head are no block
    found = graph_blocks(doc)
    assert [b.label for b in found] == ["blocks.0", "blocks.1"]  # equal blocks: program order
    assert found[0].kept_bytes == found[1].kept_bytes > 0


# --------------------------------------------------------------------------- the plan


def test_a_plan_recomputes_what_the_option_says() -> None:
    kept = _compile("never", ratios=RATIOS)
    rebuilt = _compile("always", ratios=RATIOS)
    assert kept.program["recompute"] == [] and {s["recompute_span"] for s in kept.program["steps"]} == {None}
    assert rebuilt.program["recompute"] == ["blocks.0", "blocks.1"]
    spans = [s["recompute_span"] for s in rebuilt.program["steps"]]
    assert {s for s in spans if s is not None} == {0, 1}
    assert spans[0] is None and spans[-1] is None  # the embedding and the loss are kept
    # recomputation trades time for memory: every device holds less, every iteration costs more
    assert all(r < k for r, k in zip(rebuilt.estimate["memory"], kept.estimate["memory"]))
    assert rebuilt.estimate["per_iteration"] > kept.estimate["per_iteration"]
    assert "recomputed" in rebuilt.explain() and "recomputed" not in kept.explain()
    assert kept.key["options"]["recompute"] == "never" and rebuilt.key["options"]["recompute"] == "always"


def test_the_search_recomputes_only_when_memory_binds() -> None:
    ample = _compile("auto")
    assert ample.program["recompute"] == []
    # a capacity between the smallest peak with recomputation and what any plan without needs
    floor = max(_compile("always", ratios=(0.5, 0.5)).estimate["memory"])
    cap = floor * 1.02
    with pytest.raises(SynthesisError, match="does not fit"):
        _compile("never", memory=cap)
    tight = _compile("auto", memory=cap)
    assert tight.program["recompute"], "the plan that fits recomputes"
    assert all(p <= cap for p in tight.estimate["memory"])
    print(f"\ncapacity {cap / 2**20:.2f} MiB: recomputed {tight.program['recompute']}, "
          f"peak {max(tight.estimate['memory']) / 2**20:.2f} MiB")


def test_a_compile_runs_each_core_search_once(monkeypatch) -> None:
    """Where memory binds, the recomputation probe and the memory-price ladder ask the
    core for the same search: it runs once (the search is deterministic), and the plan
    is the one the searches run again would give."""
    from hapd import _core
    from hapd.compiler import search

    cap = max(_compile("always", ratios=(0.5, 0.5)).estimate["memory"]) * 1.02
    seen: list[tuple] = []
    core = _core.synthesize

    def counted(graph, profile, ratios, options):
        seen.append((graph, profile, tuple(ratios), repr(sorted(options.items()))))
        return core(graph, profile, ratios, options)

    monkeypatch.setattr(search._core, "synthesize", counted)
    tight = _compile("auto", memory=cap)
    assert tight.program["recompute"] and len(seen) == len(set(seen)), seen
    once = len(seen)
    monkeypatch.setattr(search, "_core_search", lambda *args: counted(*args))  # every search runs
    again = _compile("auto", memory=cap)
    assert len(seen) - once > once  # the same searches asked for again
    drop = lambda program: {k: v for k, v in program.items() if k != "stats"}  # noqa: E731 - its seconds differ
    assert drop(again.program) == drop(tight.program) and again.ratios == tight.ratios


def test_no_search_without_recomputation_where_no_program_fits_without(monkeypatch) -> None:
    """Devices with less memory together than every program holds without recomputation
    (:func:`hapd.compiler.recompute.memory_floor`): the compile goes straight to
    recomputation, says so in its passes, and keeps the plan the search it skips would
    have led to."""
    from hapd.compiler import search
    from hapd.compiler.recompute import memory_floor
    from hapd.ir.lower import lower

    ir = lower(hapd.export(*_build("llama_block", 64)))
    profile = estimated_profile(2, flops=[2e10, 1e10], memory=0.45 * memory_floor(ir.doc))
    plan = hapd.compile(ir, profile, CompileOptions())
    briefs = [p["brief"] for p in plan.doc["stats"]["passes"]]
    assert plan.program["recompute"] and "no recomputation: skipped, cannot fit" in briefs, briefs
    monkeypatch.setattr(search, "_cannot_fit_whole", lambda *args: False)
    searched = hapd.compile(ir, profile, CompileOptions())
    assert "no recomputation: skipped, cannot fit" not in [p["brief"] for p in searched.doc["stats"]["passes"]]
    drop = lambda program: {k: v for k, v in program.items() if k != "stats"}  # noqa: E731 - its seconds differ
    assert drop(plan.program) == drop(searched.program) and plan.ratios == searched.ratios


def test_recompute_option_is_checked() -> None:
    with pytest.raises(OptionsError, match="recompute 'some'"):
        CompileOptions(recompute="some")


def test_compile_command_takes_recompute(tmp_path) -> None:
    graph = _llama().ir.save(tmp_path / "llama.hapg")
    result = CliRunner().invoke(main, ["compile", str(graph), "-p", "paper-8", "--recompute", "always", "--explain"])
    assert result.exit_code == 0, result.output
    assert "activation recomputation: 2 blocks" in result.output


# --------------------------------------------------------------------------- the ranks


def _run_and_measure(rank: int, world: int, cases: list[Case]) -> list[dict]:
    """Each case on this rank: the loss and every gradient against the single device
    (as :mod:`_exact` compares them), then the peak live tensor bytes of a second
    training step (forward, backward, Adam's step)."""
    import _exact
    from hapd.compiler.plan import Plan
    from hapd.harness.memtrack import LiveTensorBytes
    from hapd.spmd.checkpointed import Checkpointed
    from hapd.spmd.rewrite import distribute, global_loss

    torch.manual_seed(0)
    loaded: dict = {}
    out = []
    for case in cases:
        module = distribute(_exact._load(case.program, loaded), Plan.from_bytes(case.plan), rank, check_graph=False)
        local = module.shard_inputs(*case.inputs)
        loss = module(*local)
        loss_error = abs(global_loss(loss) - case.losses[0]) / abs(case.losses[0])
        loss.backward()
        grad_errors = _exact._grad_errors(module, case)
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-4)
        with LiveTensorBytes() as tracker:
            tracker.track(module.parameters())
            tracker.track(local)
            for step in range(2):
                if step == 1:
                    tracker.reset_peak()
                optimizer.zero_grad(set_to_none=True)
                module(*local).backward()
                optimizer.step()
        out.append({
            "case": case.name,
            "loss_error": loss_error,
            "worst_grad": max(grad_errors.items(), key=lambda kv: kv[1]),
            "peak": tracker.peak,
            "checkpointed": sum(isinstance(m, Checkpointed) for m in module.modules()),
        })
    return out


def _tensor_parallel() -> dict[str, str]:
    """Every linear of the blocks split on its output features: the blocks' steps then
    all-gather activations, so recompute spans hold collectives."""
    doc = _llama().ir.doc
    return {n["name"]: "column-parallel" for n in doc["nodes"] if n.get("op") == "aten.linear" and n.get("block")}


def test_recomputed_plan_trains_exactly_with_less_memory() -> None:
    ref = _llama()
    plans = {rc: _compile(rc, ratios=RATIOS) for rc in ("never", "always")}
    plans["always, tensor parallel"] = _compile("always", ratios=RATIOS, force=_tensor_parallel())
    inside = [c["collective"] for s in plans["always, tensor parallel"].program["steps"] if s["recompute_span"] is not None
              for c in s["comms"]]
    assert "all_gather" in inside or "all_gather_grouped" in inside
    cases = [Case(rc, ref.saved, plan.to_bytes(), ref.inputs, ref.losses, ref.grads, frozenset(), {})
             for rc, plan in plans.items()]
    results = run_cases(cases, len(RATIOS), _run_and_measure)
    ranks = [rank for rank in range(len(RATIOS)) for _ in cases]
    by = {(r["case"], rank): r for rank, r in zip(ranks, results)}
    for (rc, rank), r in sorted(by.items()):
        print(f"\n{rc:>23} rank {rank}: loss error {r['loss_error']:.1e}, worst gradient {r['worst_grad'][0]} "
              f"{r['worst_grad'][1]:.1e}; peak measured {r['peak'] / 2**10:.0f} KiB, "
              f"predicted {plans[rc].estimate['memory'][rank] / 2**10:.0f} KiB")
        assert r["loss_error"] <= TOL and r["worst_grad"][1] <= TOL
        assert r["checkpointed"] == (0 if rc == "never" else 2)
    for rank in range(len(RATIOS)):
        kept, rebuilt = by[("never", rank)], by[("always", rank)]
        assert rebuilt["peak"] < kept["peak"]
        assert plans["always"].estimate["memory"][rank] < plans["never"].estimate["memory"][rank]
        measured = 1 - rebuilt["peak"] / kept["peak"]
        predicted = 1 - plans["always"].estimate["memory"][rank] / plans["never"].estimate["memory"][rank]
        print(f"rank {rank}: recomputation saves {measured:.1%} measured, {predicted:.1%} predicted")
