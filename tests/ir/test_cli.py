"""The ``hapd`` command line: export, lower, inspect, and one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import make_fixtures

from hapd import _core, __version__
from hapd.cli import main
from hapd.ir.lower import GraphIR, lower

HAPD = Path(sys.executable).with_name("hapd")
"""The console script installed beside the interpreter."""


def run(*args, cwd: Path | None = None):
    """``hapd ARGS`` in-process, in folder ``cwd``; click's result has stdout and stderr apart."""
    before = Path.cwd()
    if cwd is not None:
        os.chdir(cwd)
    try:
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    finally:
        os.chdir(before)


def has_line(output: str, *words: str) -> bool:
    """Whether a line of ``output`` is ``words`` separated by any spaces."""
    return any(line.split() == list(words) for line in output.splitlines())


def opaque_section(output: str) -> list[str]:
    """The op names listed under "opaque ops (…):", or [] for "opaque ops: none"."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("opaque ops"))
    if lines[start] == "opaque ops: none":
        return []
    return [line.split()[1] for line in lines[start + 1:] if line.startswith("  ")]


@pytest.fixture(scope="session")
def exported(tmp_path_factory):
    """``{model: (output, folder)}`` of ``hapd export MODEL`` run once per model."""
    cache: dict[str, tuple[str, Path]] = {}

    def get(model: str) -> tuple[str, Path]:
        if model not in cache:
            folder = tmp_path_factory.mktemp(f"export-{model}")
            result = run("export", model, "--batch", "2", cwd=folder)
            assert result.exit_code == 0, result.output
            cache[model] = (result.stdout, folder)
        return cache[model]

    return get


# ----------------------------------------------------------------------------- help


def test_help_and_version_in_a_subprocess() -> None:
    done = subprocess.run([HAPD, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Automatic SPMD training" in done.stdout
    for command in ("export", "lower", "inspect"):
        assert command in done.stdout
    done = subprocess.run([HAPD, "--version"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and __version__ in done.stdout


def test_command_help() -> None:
    result = run("export", "--help")
    assert result.exit_code == 0
    assert "MODULE:FACTORY" in result.stdout and "--batch" in result.stdout
    assert "gpt2_block" in result.stdout


# ----------------------------------------------------------------------------- export


def test_export_mlp_writes_pt2_and_hapg(tmp_path) -> None:
    result = run("export", "mlp", "--batch", "4", "--out", "tmp/x.pt2", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    pt2, hapg = tmp_path / "tmp" / "x.pt2", tmp_path / "tmp" / "x.hapg"
    assert sorted(p.name for p in (tmp_path / "tmp").iterdir()) == ["x.hapg", "x.pt2"]
    lines = result.stdout.splitlines()
    assert lines[:2] == ["wrote tmp/x.pt2 (symbolic batch, example batch 4)", "wrote tmp/x.hapg"]
    ir = GraphIR.load(hapg)
    assert lines[2].startswith(f"graph mlp  id {ir.graph_id[:16]}  ")
    assert has_line(result.stdout, "x", "[4,", "32]", "batch", "dim", "0")
    assert has_line(result.stdout, "y", "[4]", "batch", "dim", "0")
    assert any(line.startswith("parameters: 6 tensors, ") for line in lines)
    assert has_line(result.stdout, "body.0.weight", "[64,", "32]")
    assert has_line(result.stdout, "3", "aten.linear")
    # the .hapg is what lowering the .pt2 gives, and differs from the batch-2 graph
    assert lower(pt2).data == ir.data
    assert ir.graph_id != make_fixtures.lower_model("mlp")[1].graph_id
    assert _core.load_graph(ir.data)["inputs"][0] == ("x", [4, 32], 0)


def test_export_without_weights_builds_on_meta_and_gives_the_same_graph(tmp_path) -> None:
    """``--no-weights``: the model is built on the meta device; the program holds no
    weights (its parameters load as meta tensors), yet lowers to the graph, and graph
    id, of the export with weights, so it plans the same."""
    from hapd.ir.lower import load_exported

    for flag in ("--weights", "--no-weights"):
        result = run("export", "bert", "-b", "2", "--set", "layers=1", flag, "-o", f"{flag}.pt2", cwd=tmp_path)
        assert result.exit_code == 0, result.output
    real, meta = GraphIR.load(tmp_path / "--weights.hapg"), GraphIR.load(tmp_path / "--no-weights.hapg")
    assert meta.graph_id == real.graph_id
    program, _ = load_exported(tmp_path / "--no-weights.pt2")
    assert {str(t.device) for t in program.state_dict.values() if t.requires_grad} == {"meta"}
    assert (tmp_path / "--no-weights.pt2").stat().st_size < (tmp_path / "--weights.pt2").stat().st_size


def test_a_paper_size_model_is_exported_from_shapes(tmp_path, monkeypatch) -> None:
    """``hapd export llama_block --size paper`` never allocates the model's weights (25
    GiB): it is built on the meta device (the export itself is stopped here: it takes a
    while at this size; ``--no-weights`` exports are checked above)."""
    import hapd.ir.export as export_module
    from hapd.ir.export import on_meta
    from hapd.errors import ExportError

    built = []

    def stop(module, inputs, **kwargs):
        built.append(module)
        raise ExportError("stopped by the test")

    monkeypatch.setattr(export_module, "export", stop)
    result = CliRunner().invoke(main, ["export", "llama_block", "--size", "paper", "--no-hapg", "-o",
                                       str(tmp_path / "l.pt2")])
    assert "stopped by the test" in result.output
    [module] = built
    assert on_meta(module)
    params = list(module.parameters())
    assert all(p.is_meta for p in params) and sum(p.numel() for p in params) > 6e9  # the real size, no storage


def test_export_without_hapg_and_overrides(tmp_path) -> None:
    out = tmp_path / "deep" / "bert.pt2"
    result = run("export", "bert", "-b", "3", "--set", "layers=1", "--set", "dropout=0.0", "--no-hapg", "-o", out)
    assert result.exit_code == 0, result.output
    assert result.stdout == f"wrote {out} (symbolic batch, example batch 3)\n"
    assert [p.name for p in out.parent.iterdir()] == ["bert.pt2"]
    summary = _core.load_graph(lower(out).data)
    assert ("aten.scaled_dot_product_attention", 1) in summary["ops"]
    assert summary["inputs"][0] == ("x", [3, 16], 0)


@pytest.mark.parametrize(("args", "message"), [
    (["export", "nope"], "hapd: OptionsError: unknown model 'nope'"),
    (["export", "bert", "--set", "nope=1"], "hapd: OptionsError: unknown config field(s) nope"),
    (["export", "bert", "--set", "heads=5"], "hapd: OptionsError: hidden 32 is not divisible by heads 5"),
    (["export", "bert", "--set", "layers=abc"], "hapd: OptionsError: bad --set value for bert"),
    (["export", "no_such_module_hapd:factory"], "hapd: ExportError: cannot import 'no_such_module_hapd'"),
    (["export", "os:no_such_factory"], "hapd: ExportError: 'os' has no attribute 'no_such_factory'"),
])
def test_export_errors_are_one_line(args, message, tmp_path) -> None:
    result = run(*args, cwd=tmp_path)
    assert result.exit_code == 2
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1, result.stderr
    assert result.stdout == "" and list(tmp_path.iterdir()) == []


def test_bad_set_syntax_is_a_usage_error() -> None:
    result = run("export", "bert", "--set", "layers")
    assert result.exit_code == 2 and "is not KEY=VALUE" in result.stderr


_FACTORY = textwrap.dedent('''
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(6, 4)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.proj(x), y, reduction="sum")

    def factory(batch=3):
        return Tiny(), (torch.randn(batch, 6), torch.zeros(batch, dtype=torch.long))

    def fixed():
        return Tiny(), (torch.randn(2, 6), torch.zeros(2, dtype=torch.long))

    def broken(batch):
        return Tiny()
''')


@pytest.fixture
def factory_module(tmp_path, monkeypatch) -> str:
    """A module on sys.path with factories; a fresh name so no import is cached."""
    name = f"hapd_test_factory_{uuid.uuid4().hex[:8]}"
    src = tmp_path / "src"
    src.mkdir()
    (src / f"{name}.py").write_text(_FACTORY)
    monkeypatch.syspath_prepend(str(src))
    yield name
    sys.modules.pop(name, None)


def test_export_factory(factory_module, tmp_path) -> None:
    result = run("export", f"{factory_module}:factory", "--batch", "5", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("wrote Tiny.pt2 (symbolic batch, example batch 5)\nwrote Tiny.hapg\ngraph Tiny  id ")
    summary = _core.load_graph((tmp_path / "Tiny.hapg").read_bytes())
    assert summary["inputs"] == [("x", [5, 6], 0), ("y", [5], 0)]
    assert summary["parameters"] == [("proj.weight", [4, 6], True), ("proj.bias", [4], True)]
    assert GraphIR.load(tmp_path / "Tiny.hapg").doc["loss_reduction"] == "sum"

    result = run("export", f"{factory_module}:fixed", "--batch", "5", "--out", "fixed.pt2", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert has_line(result.stdout, "x", "[2,", "6]", "batch", "dim", "0")  # a factory without `batch` keeps its own

    result = run("export", f"{factory_module}:broken", cwd=tmp_path)
    assert result.exit_code == 2
    assert result.stderr == "hapd: ExportError: a factory must return (module, example_inputs)\n"


def test_export_factory_in_a_subprocess(factory_module, tmp_path) -> None:
    src = next(p for p in map(Path, sys.path) if (p / f"{factory_module}.py").is_file())
    done = subprocess.run([HAPD, "export", f"{factory_module}:factory", "--no-hapg", "-o", tmp_path / "f.pt2"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(src)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {tmp_path / 'f.pt2'}") and done.stdout.count("\n") == 1


def test_export_and_import_take_modules_from_the_current_folder(tmp_path) -> None:
    """``hapd export mymodels:factory`` in the folder holding ``mymodels.py``, without
    ``PYTHONPATH=.`` (as ``python -m`` would), and ``--import mymodels`` likewise."""
    (tmp_path / "mymodels.py").write_text(_FACTORY)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    here = os.environ.get("PYTHONPATH")  # the checkout under test, never the current folder
    if here:
        env["PYTHONPATH"] = here
    done = subprocess.run([HAPD, "export", "mymodels:factory", "--no-hapg", "-o", "f.pt2"], capture_output=True,
                          text=True, timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "wrote f.pt2 (symbolic batch, example batch 8)\n"
    done = subprocess.run([HAPD, "inspect", "f.pt2", "--import", "mymodels"], capture_output=True, text=True,
                          timeout=120, env=env, cwd=tmp_path)
    assert done.returncode == 0 and "graph Tiny" in done.stdout, done.stderr
    done = subprocess.run([HAPD, "export", "othermodels:factory"], capture_output=True, text=True, timeout=120,
                          env=env, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr == "hapd: ExportError: cannot import 'othermodels': No module named 'othermodels'\n"


# ----------------------------------------------------------------------------- lower / inspect


def test_lower_and_inspect_pt2_and_hapg(tmp_path) -> None:
    result = run("export", "mlp", "--no-hapg", "--out", "m.pt2", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    result = run("lower", "m.pt2", "--out", "out/m.hapg", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    ir = GraphIR.load(tmp_path / "out" / "m.hapg")
    assert result.stdout == f"wrote out/m.hapg  graph id {ir.graph_id}\n"
    assert run("lower", "m.pt2", cwd=tmp_path).stdout.startswith("wrote m.hapg  graph id ")
    from_pt2 = run("inspect", tmp_path / "m.pt2")
    from_hapg = run("inspect", tmp_path / "out" / "m.hapg")
    assert from_pt2.exit_code == from_hapg.exit_code == 0
    assert from_pt2.stdout == from_hapg.stdout  # same graph, same id, same summary
    assert from_hapg.stdout.startswith(f"graph mlp  id {ir.graph_id[:16]}  18 nodes\ninputs:\n")
    assert "ops:" in from_hapg.stdout.splitlines()


def test_inspect_fixture_matches_the_core(fixtures_dir) -> None:
    result = run("inspect", fixtures_dir / "bert_moe.hapg")
    assert result.exit_code == 0, result.output
    summary = _core.load_graph((fixtures_dir / "bert_moe.hapg").read_bytes())
    assert opaque_section(result.stdout) == [op for op, _ in summary["opaque_ops"]]
    assert "buffers: 1" in result.stdout.splitlines()
    assert has_line(result.stdout, "1", "aten.topk")


@pytest.mark.parametrize("model", ["gpt2_block", "llama_block"])
def test_export_and_inspect_blocks_name_opaque_ops(model, exported) -> None:
    output, folder = exported(model)
    summary = _core.load_graph((folder / f"{model}.hapg").read_bytes())
    opaque = [op for op, _ in summary["opaque_ops"]]
    assert opaque_section(output) == opaque
    header = "opaque ops (no sharding rules; they run replicated):"
    assert (header in output.splitlines()) == bool(opaque)
    inspected = run("inspect", folder / f"{model}.pt2")
    assert inspected.exit_code == 0
    assert output.endswith(inspected.stdout)
    assert f"graph {model}  " in inspected.stdout


# ----------------------------------------------------------------------------- bad files


@pytest.mark.parametrize(("fixture", "line"), [
    ("garbage", "hapd: GraphFormatError: cannot decode graph: 509 trailing bytes after the document"),
    ("empty", "hapd: GraphFormatError: cannot decode graph: the file is empty"),
    ("wrong_version", "hapd: GraphVersionError: unsupported hapd.graph version 99 (this hapd reads version 1)"),
    ("dangling", "hapd: GraphValidationError: node 11 (linear_1): input 0 refers to [23, 0], but the graph has "
                 "18 nodes [node linear_1] [field inputs]"),
    ("shape_mismatch", "hapd: ShapeError: node linear (aten.linear): input [2, 32] does not match weight [64, 33] "
                       "(in features) [node linear]"),
])
def test_bad_file_is_one_line_and_exit_2(fixture, line, fixtures_dir) -> None:
    result = run("inspect", fixtures_dir / f"{fixture}.hapg")
    assert result.exit_code == 2
    assert (result.stdout, result.stderr) == ("", line + "\n")


def test_compile_of_a_dangling_loss_is_one_line(tmp_path, fixtures_dir) -> None:
    """A graph whose loss names a node it lacks: ``hapd compile`` says so in one line
    (the graph is validated before any search reads it)."""
    import msgpack

    doc = msgpack.unpackb((fixtures_dir / "mlp.hapg").read_bytes(), raw=False, strict_map_key=False)
    doc["loss"] = [999, 0]
    bad = tmp_path / "dangling_loss.hapg"
    bad.write_bytes(msgpack.packb(doc))
    result = run("compile", bad, "--profile", "paper-8", "--out", tmp_path / "x.hplan")
    assert result.exit_code == 2
    assert result.stderr.startswith("hapd: GraphValidationError: graph field `loss`: refers to node 999")
    assert result.stderr.count("\n") == 1


def test_bad_file_in_a_subprocess_has_no_traceback(tmp_path, fixtures_dir) -> None:
    bad = tmp_path / "bad.pt2"
    bad.write_bytes(b"\x00garbage" * 50)
    runs = [subprocess.Popen([HAPD, "inspect", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for path in (fixtures_dir / "truncated.hapg", bad)]
    for done in runs:
        stdout, stderr = done.communicate(timeout=120)
        assert done.returncode == 2, stderr
        assert stdout == ""
        assert stderr.startswith("hapd: GraphFormatError: ") and stderr.count("\n") == 1, stderr
        assert "Traceback" not in stderr


def test_missing_file_is_a_usage_error(tmp_path) -> None:
    result = run("inspect", tmp_path / "nope.hapg")
    assert result.exit_code == 2 and "does not exist" in result.stderr


def test_overlap_checks_the_duplica_graphs_batch(factory_module, tmp_path) -> None:
    """``--overlap`` takes GRAPH as one duplica's: with --global-batch a graph exported at
    the full batch is refused, saying which batch to export; without it, the batch it
    trains is said."""
    assert run("export", f"{factory_module}:factory", "--batch", "8", "-o", "m.pt2", cwd=tmp_path).exit_code == 0
    result = run("compile", "m.hapg", "-p", "paper-8", "--overlap", "--global-batch", "8", cwd=tmp_path)
    assert result.exit_code == 2
    assert result.stderr == ("hapd: OptionsError: --overlap: m.hapg was exported at batch 8, but a duplica's graph of "
                             "global batch 8 has batch 4: export it at --batch 4 (half the global batch) [field global_batch]\n")
    result = run("compile", "m.hapg", "-p", "paper-8", "--overlap", "--global-batch", "16", cwd=tmp_path)
    assert result.exit_code == 0, result.output
    assert ("overlap: m.hapg is one duplica's graph, of batch 8: the plan trains global batches of 16 (two duplicas)"
            in result.stdout)
    result = run("compile", "m.hapg", "-p", "paper-8", "--global-batch", "16", cwd=tmp_path)
    assert result.exit_code == 2 and "--global-batch is for --overlap" in result.stderr
