"""One export serves every batch (:mod:`hapd.ir.shapes`) and one compile searches
every technique from it (:mod:`hapd.compiler.techniques`): the CLI, the daemon's drop
folder and its cache."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import msgpack
import pytest
import torch
from click.testing import CliRunner
from _wait import wait_for

import hapd.models as models
from hapd.cli import main
from hapd.compiler.driver import compile as compile_plan
from hapd.ir.export import export
from hapd.ir.lower import lower
from hapd.compiler.options import CompileOptions
from hapd.compiler.plan import Plan
from hapd.ir.lower import load_exported, lower_at
import hapd.ir.kept as kept_module
from hapd.compiler import driver, techniques
from hapd.ir.derive import Derivation, linear_in_batch
from hapd.ir.kept import read_kept
from hapd.ir.normalize import functionalize
from hapd.ir.shapes import batch_info, batch_symbol, program_at
from hapd.compiler.plan_summary import technique as technique_of
from hapd.compiler.techniques import GraphSet, graphs_of_program
from hapd.errors import GraphError, OptionsError, ShapeError
from hapd.profile.schema import Link, estimated_profile
from hapd.serve.cache import PlanCache

BATCH = 8
EVERYTHING = CompileOptions(pipeline="auto", overlap=True)


def _build(name: str, batch: int, **overrides):
    spec = models.get(name)
    torch.manual_seed(0)
    model, config = models.build(name, "tiny", **overrides)
    return model, spec.example_inputs(config, batch), spec.batch_dims


@functools.cache
def _symbolic(name: str):
    model, inputs, dims = _build(name, BATCH)
    return export(model, inputs, batch_dims=dims, symbolic_batch=True)


def _static_graph(name: str, batch: int):
    model, inputs, dims = _build(name, batch)
    return lower(export(model, inputs, batch_dims=dims), name=name)


def _two_hosts(world: int = 4):
    half = world // 2
    profile = estimated_profile(world, flops=[2e10] * half + [1e10] * half, hosts=["a"] * half + ["b"] * half,
                                alpha=1e-5, beta=1e6)
    links = {n: {"inter": link["inter"], "intra": Link(alpha=1e-6, beta=1e10)} for n, link in profile.collectives.items()}
    return dataclasses.replace(profile, collectives=links, name="two-hosts")


@pytest.mark.parametrize("name, batches", [("vit", (BATCH, 2)), ("bert", (BATCH // 2,))])
def test_the_symbolic_export_lowers_at_each_batch_as_a_fixed_export_does(name: str, batches: tuple[int, ...]) -> None:
    program = _symbolic(name)
    info = batch_info(program)
    assert info is not None and info.symbolic and info.size == BATCH
    for batch in batches:
        cut, fixed = lower_at(program, batch, name=name), _static_graph(name, batch)
        ops = [(n["op"], [o["shape"] for o in n["outputs"]]) for n in cut.doc["nodes"]]
        assert ops == [(n["op"], [o["shape"] for o in n["outputs"]]) for n in fixed.doc["nodes"]]
        assert cut.graph_id == fixed.graph_id
    assert program_at(program, 4) is program_at(program, 4)  # each batch is cut once
    assert lower(program, name=name).graph_id == lower_at(program, BATCH, name=name).graph_id  # its example batch


@pytest.mark.parametrize("name", ["vit", "bert", "zoo.gpt2"])
def test_a_graph_derived_from_two_batches_is_the_one_lowered_there(name: str) -> None:
    if name.startswith("zoo."):
        from hapd.models import zoo

        model, inputs = zoo.make(name.removeprefix("zoo."), BATCH, "tiny")
        program, dims = export(model, inputs, symbolic_batch=True), None
    else:
        program, dims = _symbolic(name), None
    symbol = batch_symbol(program)
    assert symbol is not None and linear_in_batch(functionalize(program), symbol)
    derivation = Derivation(lower_at(program, BATCH, name=name), BATCH, lower_at(program, BATCH // 2, name=name),
                            BATCH // 2)
    derived = derivation.at(2)
    assert derived is not None and derived.graph_id == lower_at(program, 2, name=name).graph_id
    assert derivation.at(1) is None  # a batch of 1 is lowered, never derived


def test_a_program_with_two_batch_sized_dims_is_not_derived() -> None:
    class Gram(torch.nn.Module):  # [b, b]: linear dims, b² elements and FLOPs
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.proj(x)
            return (h @ h.T).sum()

    program = export(Gram(), (torch.randn(BATCH, 4),), symbolic_batch=True)
    assert batch_info(program).symbolic
    assert not linear_in_batch(functionalize(program), batch_symbol(program))
    graphs = graphs_of_program(program, CompileOptions(pipeline="auto"))
    assert graphs.micro[4].graph_id == lower_at(program, 2).graph_id  # lowered, not derived


def test_a_model_that_cannot_export_a_symbolic_batch_is_exported_static_and_says_why() -> None:
    model, inputs, dims = _build("vit", 1)  # torch specializes a dim of size 1
    program = export(model, inputs, batch_dims=dims, symbolic_batch=True)
    info = batch_info(program)
    assert info is not None and not info.symbolic and "batch 1" in info.reason
    with pytest.raises(ShapeError, match="static batch of 1"):
        program_at(program, 2)
    graphs = graphs_of_program(program, CompileOptions(overlap=True), name="vit")
    assert graphs.half is None and "static batch" in graphs.missing["overlap"]


def test_one_compile_prices_every_technique_from_one_file(tmp_path: Path) -> None:
    model, inputs, dims = _build("vit", BATCH)
    path = export(model, inputs, batch_dims=dims, symbolic_batch=True, path=tmp_path / "vit.pt2", name="vit")
    del path
    profile = _two_hosts()
    plan = compile_plan(tmp_path / "vit.pt2", profile, EVERYTHING)
    priced = plan.estimate["techniques"]
    assert set(priced) == {"spmd", "pipeline", "overlap"} and plan.technique in priced
    assert priced["spmd"]["per_iteration"] > 0
    overlap = priced["overlap"]  # priced, or hides no communication: not an overlap plan (hapd.compiler.choice)
    assert overlap["per_iteration"] > 0 if overlap["per_iteration"] is not None else (
        overlap["predicted"] > 0 and "hides no communication" in overlap["reason"])
    assert plan.doc["technique"] == plan.technique
    assert set(plan.key["graphs"]["micro"]) == {"2", "4", "8"} and plan.key["graphs"]["half"] is not None
    best = min(v["per_iteration"] for v in priced.values() if v["per_iteration"] is not None)
    if plan.technique == "overlap":
        assert plan.overlap and plan.key["graph_id"] == plan.key["graphs"]["half"]
    elif plan.technique == "pipeline":
        assert plan.pipeline is not None and priced["pipeline"]["per_iteration"] == best
    else:
        assert plan.pipeline is None and plan.key["graph_id"] == plan.key["graphs"]["full"]
    assert "technique:" in plan.explain()
    # the same graphs sent as bytes (a runtime's request to the daemon) give the same plan
    graphs = GraphSet.from_bytes(graphs_of_program(_symbolic("vit"), EVERYTHING, name="vit").to_bytes())
    again = compile_plan(graphs, profile, EVERYTHING)
    assert again.technique == plan.technique and again.key == plan.key


def test_a_saved_program_is_functional_already_and_never_retraced(tmp_path: Path, monkeypatch) -> None:
    """hapd.export saves the functional form (normalize's costly step 1, made once at
    export): a compile that loads the .pt2 lowers every batch without re-tracing, to
    the graphs of the program in memory."""
    model, inputs, dims = _build("vit", BATCH)
    export(model, inputs, batch_dims=dims, symbolic_batch=True, path=tmp_path / "vit.pt2", name="vit")
    loaded, stored = load_exported(tmp_path / "vit.pt2")
    assert stored["functional"] is True
    in_memory = {batch: lower_at(_symbolic("vit"), batch, name="vit").graph_id for batch in (BATCH, BATCH // 2)}
    monkeypatch.setattr(torch.export.ExportedProgram, "run_decompositions",
                        lambda *a, **k: pytest.fail("a saved program was re-traced"))
    assert {batch: lower_at(loaded, batch, name="vit").graph_id for batch in in_memory} == in_memory
    monkeypatch.undo()
    # a .pt2 saved by torch.export alone is re-traced, as before
    torch.export.save(_symbolic("vit"), tmp_path / "plain.pt2")
    plain, stored = load_exported(tmp_path / "plain.pt2")
    assert "functional" not in stored
    assert lower_at(plain, BATCH // 2, name="vit").graph_id == lower_at(loaded, BATCH // 2, name="vit").graph_id


def test_a_saved_program_keeps_its_graphs_and_a_compile_reads_them_alone(tmp_path: Path, monkeypatch) -> None:
    """hapd.export keeps the graphs a compile prices in the .pt2 (hapd.ir.kept): the
    ones lowering the loaded program gives; a compile of the file reads them without
    loading the program, to the plan of one that loads it; under another lowering's
    fingerprint they are not used."""
    model, inputs, dims = _build("vit", BATCH)
    path = tmp_path / "vit.pt2"
    export(model, inputs, batch_dims=dims, symbolic_batch=True, path=path, name="vit")
    kept = read_kept(path)
    assert kept is not None and kept.batch == BATCH and sorted(kept.graphs) == [1, 2, 4, 8]
    loaded, _ = load_exported(path)
    assert {b: g.graph_id for b, g in kept.graphs.items()} == {b: lower_at(loaded, b, name="vit").graph_id
                                                              for b in kept.graphs}
    options = CompileOptions(pipeline="auto", overlap=True)
    from_program = compile_plan(graphs_of_program(loaded, options, name="vit"), _two_hosts(), options)  # lowered
    monkeypatch.setattr(techniques, "load_exported", lambda *a, **k: pytest.fail("the program was loaded"))
    monkeypatch.setattr(driver, "load_exported", lambda *a, **k: pytest.fail("the program was loaded"))
    from_file = compile_plan(path, _two_hosts(), options)
    assert from_file.doc["key"]["graphs"] == from_program.doc["key"]["graphs"]
    assert (from_file.technique, from_file.estimate["per_iteration"]) == (from_program.technique,
                                                                         from_program.estimate["per_iteration"])
    monkeypatch.undo()
    monkeypatch.setattr(kept_module, "fingerprint", lambda: "another lowering")
    assert read_kept(path) is None
    assert compile_plan(path, _two_hosts(), options).doc["key"]["graphs"] == from_program.doc["key"]["graphs"]


def test_a_program_hapd_cannot_lower_still_exports_without_kept_graphs(tmp_path: Path, monkeypatch) -> None:
    def failing(*args, **kwargs):
        def at(batch: int):
            raise GraphError(f"no rule for an op at batch {batch}")
        return at

    monkeypatch.setattr(kept_module, "graphs_at", failing)
    model, inputs, dims = _build("mlp", BATCH)
    export(model, inputs, batch_dims=dims, symbolic_batch=True, path=tmp_path / "mlp.pt2", name="mlp")
    assert read_kept(tmp_path / "mlp.pt2") is None and load_exported(tmp_path / "mlp.pt2")[1]["name"] == "mlp"


def test_one_graph_cannot_price_pipelines_with_overlap() -> None:
    with pytest.raises(OptionsError, match="symbolic batch"):
        compile_plan(_static_graph("mlp", BATCH), _two_hosts(), EVERYTHING)


def test_old_plans_load_with_their_technique() -> None:
    plan = compile_plan(_static_graph("mlp", BATCH), _two_hosts(), CompileOptions())
    doc = dict(plan.doc)
    doc.pop("technique")
    old = Plan.from_bytes(msgpack.packb(doc, use_bin_type=True))
    assert old.technique == "spmd"
    assert technique_of({**doc, "overlap": True, "duplicas": 2}) == "overlap"
    assert technique_of({**doc, "pipeline": {"chosen": True}}) == "pipeline"
    assert technique_of({**doc, "pipeline": {"chosen": False}}) == "spmd"


def _profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "two-hosts.json"
    path.write_text(_two_hosts().to_json())
    return path


def test_the_cli_compiles_everything_from_one_export(tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "vit.pt2"
    result = runner.invoke(main, ["export", "vit", "--batch", str(BATCH), "--no-hapg", "-o", str(out)],
                           catch_exceptions=False)
    assert result.exit_code == 0 and "symbolic batch" in result.output
    result = runner.invoke(main, ["compile", str(out), "--profile", str(_profile_file(tmp_path)), "--pipeline", "auto",
                                  "--overlap"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "technique:" in result.output
    plan = Plan.load(out.with_suffix(".hplan"))
    assert set(plan.estimate["techniques"]) == {"spmd", "pipeline", "overlap"}


def test_the_cache_key_covers_the_graphs_priced(tmp_path: Path) -> None:
    cache = PlanCache(tmp_path / "cache")
    profile = _two_hosts()
    graphs = graphs_of_program(_symbolic("vit"), EVERYTHING, name="vit")
    first = cache.compile(graphs, profile, EVERYTHING)
    assert first.path == "miss"
    assert cache.compile(graphs, profile, EVERYTHING).path == "hit"
    fewer = dataclasses.replace(graphs, micro={m: g for m, g in graphs.micro.items() if m != 8})
    assert cache.lookup(fewer, profile, EVERYTHING) is None  # other graphs priced: another key
    assert cache.lookup(graphs.full.data, profile, EVERYTHING) is None  # one graph: another key


@pytest.mark.daemon
def test_a_dropped_symbolic_pt2_is_planned_as_the_cli_plans_it(tmp_path: Path) -> None:
    from _daemon import DaemonProcess, drop

    out = tmp_path / "vit.pt2"
    model, inputs, dims = _build("vit", BATCH)
    export(model, inputs, batch_dims=dims, symbolic_batch=True, path=out, name="vit")
    profile = _profile_file(tmp_path)
    result = CliRunner().invoke(main, ["compile", str(out), "--profile", str(profile), "--pipeline", "auto",
                                       "--overlap"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    cli = Plan.load(out.with_suffix(".hplan"))
    daemon = DaemonProcess(tmp_path / "hapd", "--option", "pipeline=auto", "--option", "overlap=true",
                           profile=str(profile)).start()
    try:
        drop(daemon.watch, "vit.pt2", out.read_bytes())
        planned = wait_for(lambda: (daemon.watch / "out" / "vit.hplan").exists() and daemon.watch / "out" / "vit.hplan",
                           120, "the plan")
        served = Plan.load(planned)
        assert served.technique == cli.technique and served.key == cli.key
        assert served.program["steps"] == cli.program["steps"] and served.ratios == cli.ratios
        assert served.estimate["techniques"].keys() == cli.estimate["techniques"].keys()
        drop(daemon.watch, "vit_again.pt2", out.read_bytes())
        daemon.wait_log(r"drop vit_again\.pt2 → out/vit_again\.hplan \(cache hit", timeout=60)
        with daemon.client(timeout_s=60) as client:  # a runtime's request: the graphs of every batch
            graphs = graphs_of_program(export(model, inputs, batch_dims=dims, symbolic_batch=True), EVERYTHING,
                                       name="vit")
            data, cache = client.compile(graphs.to_bytes(), "graphs", options=EVERYTHING.key())
            assert cache == "hit" and Plan.from_bytes(data).key == cli.key
    finally:
        assert daemon.stop() == 0, daemon.log()
