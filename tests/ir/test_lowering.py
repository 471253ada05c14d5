"""The functional lowering never drops an effect (issue 15).

- T5 writes its decoder inputs into a buffer (``_shift_right``: writes into a view); the
  functional form keeps those writes as ops the loss reads, and the 1-rank check passes;
- Llama and Mixtral (rotary embedding under ``@torch.no_grad()``: a higher-order op)
  lower;
- the graph id is the same in memory, after ``torch.export.save``/``load``, and after
  normalizing twice, for every zoo and benchmark model;
- batch norm's running statistics are effects: every rank ends a step with the
  single-device buffers (1 rank through ``hapd check``, 2 Gloo ranks here);
- an effect hapd cannot keep is an error naming the op or output and the node;
- ``hapd check`` exits 0 and 1; ``--import`` loads a program's custom op, and a load
  failure says torch's reason.
"""

from __future__ import annotations

import io
import operator
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from click.testing import CliRunner
from conftest import MODEL_NAMES
from torch import fx, nn

import hapd
from hapd.cli import main
from hapd.train.check import check
from hapd.compiler.driver import compile as compile_plan
from hapd.ir.export import export
from hapd.ir.lower import load_exported, lower
from hapd.ir.normalize import _check_node, buffer_mutations, is_normalized, normalize
from hapd.compiler.options import CompileOptions
from hapd.compiler.plan import Plan
from hapd.errors import ExportError, UnsupportedOpError
from hapd.profile.schema import estimated_profile

ZOO_NAMES = ["gpt2", "llama", "bert", "mixtral", "t5", "resnet18", "vit"]

WRITE_OPS = ("aten.copy", "aten.slice_scatter", "aten.select_scatter", "aten.fill.Tensor")
"""The functional forms of T5's writes into its decoder inputs."""


def _zoo(name: str, batch: int = 2):
    from hapd.models.zoo import ZOO

    return ZOO[name](batch=batch)


def _round_trip(program):
    buf = io.BytesIO()
    torch.export.save(program, buf)
    buf.seek(0)
    with warnings.catch_warnings():  # torch reads weights from a read-only buffer and says so
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.export.load(buf)


class TinyBN(nn.Module):
    """conv → batch norm → relu → linear, summed: the smallest model with running stats."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1)).sum()


def _tiny_bn_program(batch: int = 4):
    torch.manual_seed(1)
    return export(TinyBN(), (torch.randn(batch, 3, 6, 6),))


# ------------------------------------------------------------------------------ T5, Llama


@pytest.mark.slow
def test_t5_keeps_the_decoder_input_writes(check_program) -> None:
    program = normalize(export(*_zoo("t5")))
    ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert not any("assert" in op for op in ops), "assertion nodes are dropped"
    ir = lower(program)
    plan = compile_plan(ir, estimated_profile(1))
    stepped = {step["op"] for step in plan.program["steps"]}
    kept = [op for op in WRITE_OPS if op in stepped]
    assert kept, f"none of T5's decoder-input writes {WRITE_OPS} is a step of the plan: {sorted(stepped)}"
    report = check_program(program, plan=plan, rtol=1e-5)
    assert report.loss > 0 and len(report.differences) > 10


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_llama_and_mixtral_lower(name, check_program) -> None:
    program = normalize(export(*_zoo(name)))
    assert not [n for n in program.graph.nodes if n.op == "get_attr"]
    assert not [n for n in program.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]  # noqa: SLF001
    doc = lower(program).doc
    assert doc["mutations"] == []
    check_program(program)


# ------------------------------------------------------------------------------ graph ids


def _assert_stable_graph_id(program, name: str) -> None:
    base = lower(program, name=name).graph_id
    assert lower(_round_trip(program), name=name).graph_id == base, "saved and loaded"
    normalized = normalize(program)
    assert normalize(normalized) is normalized and is_normalized(normalized)
    # one round trip of the normal form serves both checks: lower() normalizes the
    # loaded program (a fresh object, so really normalized a second time) and keeps that
    # normal form on it, which the explicit normalize() then returns
    loaded = _round_trip(normalized)
    assert lower(loaded, name=name).graph_id == base, "normalized, saved and loaded"
    twice = normalize(loaded)
    assert twice is not normalized and is_normalized(twice)
    assert lower(twice, name=name).graph_id == base, "normalized twice"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_graph_id_survives_save_and_load_benchmark(name, lowered) -> None:
    _assert_stable_graph_id(lowered[name].program, name)
    assert lower(lowered[name].program, name=name).graph_id == lowered[name].ir.graph_id


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO_NAMES)
def test_graph_id_survives_save_and_load_zoo(name) -> None:
    """The zoo's larger graphs: the round trip users make (a program exported, saved,
    loaded and lowered) keeps the id; the benchmark models above also check the normal
    form's round trips, which lower the same graph twice more."""
    program = export(*_zoo(name))
    assert lower(_round_trip(program), name=name).graph_id == lower(program, name=name).graph_id


# ------------------------------------------------------------------------------ buffer updates


@pytest.mark.slow
def test_resnet18_running_stats_after_one_step(check_program) -> None:
    program = export(*_zoo("resnet18"))
    before = {k: v.clone() for k, v in program.state_dict.items() if "running" in k or "num_batches" in k}
    doc = lower(program).doc
    assert len(doc["mutations"]) == 3 * 20  # mean, var and count of 20 batch norms
    assert {m["target"] for m in doc["mutations"]} == set(before)
    report = check_program(program)
    buffers = [d for d in report.differences if d.name.startswith("buffer ")]
    assert len(buffers) == 60 and all(d.ok for d in buffers)
    # the eager reference ran on a copy: the program's own buffers are untouched
    assert all(torch.equal(program.state_dict[k], v) for k, v in before.items())


def test_buffer_updates_are_recorded_and_kept() -> None:
    program = _tiny_bn_program()
    doc = lower(program).doc
    names = [n["name"] for n in doc["nodes"]]
    targets = {m["target"]: names[m["value"][0]] for m in doc["mutations"]}
    assert set(targets) == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
    plan = compile_plan(lower(program), estimated_profile(2))
    held = {t["name"]: t["layouts"] for t in plan.program["tensors"]}
    for target, (_, value) in zip(targets, buffer_mutations(normalize(program))):
        assert "Identity" in held[value], f"{target}: the plan ends with {held.get(value)}"


def test_one_rank_state_dict_after_a_step_equals_eager(check_program) -> None:
    program = _tiny_bn_program()
    report = check_program(program)
    assert {d.name for d in report.differences if d.name.startswith("buffer ")} == {
        "buffer bn.running_mean", "buffer bn.running_var", "buffer bn.num_batches_tracked"
    }
    module = hapd.distribute(program, compile_plan(lower(program), estimated_profile(1)), rank=0, world=1)
    state = module.state_dict()
    assert float(state["bn.num_batches_tracked"]) == 0
    x = program.example_inputs[0][0]
    module(*module.shard_inputs(x)).backward()
    eager = program.module()
    before = {k: v.clone() for k, v in eager.state_dict().items()}
    eager(x)
    after = eager.state_dict()
    for key in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"):
        assert not torch.equal(after[key], before[key])
        torch.testing.assert_close(module.state_dict()[key], after[key], rtol=1e-5, atol=1e-7)


def _bn_rank_step(rank: int, world: int, program_bytes: bytes, plan_bytes: bytes) -> dict[str, list]:
    """One step on this rank; the buffers after it (as lists: tensors do not cross the pipe)."""
    program = torch.export.load(io.BytesIO(program_bytes))
    module = hapd.distribute(program, Plan.from_bytes(plan_bytes), rank)
    x = program.example_inputs[0][0]
    module(*module.shard_inputs(x)).backward()
    return {k: v.tolist() for k, v in module.state_dict().items() if k.startswith("bn.")}


@pytest.mark.slow
@pytest.mark.parametrize("rule", [None, "data-parallel-synced"])
def test_two_ranks_end_with_the_single_device_buffers(rule) -> None:
    """The searched plan, and the batch split with synchronized statistics (each rank
    updates the running statistics from the whole batch's)."""
    program = _tiny_bn_program(batch=6)
    ir = lower(program)
    force = {n["name"]: rule for n in ir.doc["nodes"] if n.get("op") == "aten._native_batch_norm_legit_functional"}
    options = CompileOptions(ratios=(0.75, 0.25), force=force if rule else {})
    plan = compile_plan(ir, estimated_profile(2), options)
    if rule:
        assert {s["rule"] for s in plan.program["steps"] if s["node"] in force} == {rule}
    buf = io.BytesIO()
    torch.export.save(program, buf)
    per_rank = run_ranks(2, _bn_rank_step, buf.getvalue(), plan.to_bytes(), timeout=240)
    eager = program.module()
    eager(program.example_inputs[0][0])
    expected = {k: v for k, v in eager.state_dict().items() if k in ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")}
    assert len(expected) == 3
    for rank, state in enumerate(per_rank):
        for key, value in expected.items():
            got = torch.tensor(state[key], dtype=value.dtype)
            torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {key}")


# ------------------------------------------------------------------------------ linears on leading dims


class FlatLinear(nn.Module):
    """``[S, B, H, D]`` flattened to ``[S·B, H·D]`` rows, a linear, and (``restore``)
    the rows unflattened to ``[S, B, n]`` — ``nn.MultiheadAttention``'s output
    projection."""

    def __init__(self, restore: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.restore = nn.Linear(8, 6), restore

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b = x.shape[:2]
        y = self.lin(x.reshape(s * b, 8))
        return (y.reshape(s, b, 6).sum(1) ** 2).sum() if self.restore else (y ** 2).sum()


def _linear_inputs(program) -> list[list[int]]:
    return [list(n.args[0].meta["val"].shape) for n in program.graph.nodes if n.target is torch.ops.aten.linear.default]


def test_a_flattened_linear_keeps_its_leading_dims() -> None:
    x = torch.randn(5, 3, 2, 4)
    program = normalize(export(FlatLinear(restore=True), (x,)))
    assert _linear_inputs(program) == [[5, 3, 8]]
    assert torch.equal(program.module()(x), FlatLinear(restore=True)(x))
    # the rows stay flat where nothing restores them
    kept = normalize(export(FlatLinear(restore=False), (x,)))
    assert _linear_inputs(kept) == [[15, 8]]


def test_vit_attention_keeps_the_batch_split() -> None:
    """torchvision's ViT: every linear sees the batch (16) as its own dim, never rows
    of sequence × batch (17 · 16), and the plan on paper-8 runs no FLOP replicated."""
    program = normalize(export(*_zoo("vit", batch=16)))
    assert all(16 in shape and 17 * 16 not in shape for shape in _linear_inputs(program))
    plan = compile_plan(lower(program), "paper-8")
    assert plan.estimate["replicated_flop_share"] == 0.0


# ------------------------------------------------------------------------------ constant attention masks


class MaskedAttention(nn.Module):
    """Self-attention whose mask is built from ``arange``s (as transformers builds its
    causal mask), or from the input (a padding mask)."""

    def __init__(self, mask: str, float_mask: bool = False, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj, self.mask, self.float_mask, self.dropout = nn.Linear(8, 8), mask, float_mask, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        s = x.shape[1]
        rows, cols = torch.arange(s).view(s, 1), torch.arange(s).view(1, s)
        keep = {"causal": cols <= rows, "all": cols >= 0, "window": (cols <= rows) & (cols > rows - 2),
                "padding": (x[:, None, None, :, 0] > -10).expand(-1, 1, s, s)}[self.mask]
        keep = keep.expand(x.shape[0], 1, s, s)
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min) if self.float_mask else keep
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask, dropout_p=self.dropout).sum()


def _attention_args(program) -> list[tuple]:
    return [(n.args + (None,) * 6)[3:6] for n in program.graph.nodes
            if n.target is torch.ops.aten.scaled_dot_product_attention.default]


@pytest.mark.parametrize("mask,float_mask,expected", [
    ("causal", False, "causal"), ("causal", True, "causal"), ("all", False, "none"), ("all", True, "none"),
    ("window", False, "kept"), ("padding", False, "kept")])
def test_a_constant_attention_mask_becomes_what_it_means(mask, float_mask, expected) -> None:
    """A causal triangle computed from constants runs as ``is_causal``, a mask keeping
    everything as none; a sliding window, or a mask from the input, stays a mask. The
    values do not change."""
    x = torch.randn(3, 6, 8)
    model = MaskedAttention(mask, float_mask)
    program = normalize(export(model, (x,)))
    ((attn_mask, _, is_causal),) = _attention_args(program)
    if expected == "kept":
        assert isinstance(attn_mask, torch.fx.Node) and not is_causal
    else:
        assert attn_mask is None and bool(is_causal) == (expected == "causal")
        assert not [n for n in program.graph.nodes if n.target is torch.ops.aten.arange.default]
    torch.testing.assert_close(program.module()(x), model(x), rtol=1e-6, atol=1e-6)


def test_a_constant_causal_mask_keeps_the_attentions_dropout() -> None:
    program = normalize(export(MaskedAttention("causal", dropout=0.1), (torch.randn(3, 6, 8),)))
    ((attn_mask, dropout_p, is_causal),) = _attention_args(program)
    assert attn_mask is None and dropout_p == 0.1 and is_causal is True


# ------------------------------------------------------------------------------ unsupported effects


class WritesItsInput(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return x.sum()


def test_a_write_into_an_input_is_an_error_naming_it() -> None:
    program = export(WritesItsInput(), (torch.randn(2, 3),))
    with pytest.raises(ExportError, match=r"writes into its input x \(node "):
        lower(program)


def _call(target, *args) -> fx.Node:
    graph = fx.Graph()
    x = graph.placeholder("x")
    return graph.call_function(target, (x, *args))


@pytest.mark.parametrize(
    ("target", "op"),
    [
        (torch.ops.aten.add_.Tensor, "aten.add_.Tensor"),
        (torch.ops.aten.relu_.default, "aten.relu_"),
        (torch.ops.higher_order.wrap_with_set_grad_enabled, "higher_order.wrap_with_set_grad_enabled"),
    ],
)
def test_a_mutating_or_higher_order_op_is_named_with_its_node(target, op) -> None:
    node = _call(target, 1) if "add_" in op else _call(target)
    with pytest.raises(UnsupportedOpError) as info:
        _check_node(node)
    assert info.value.op == op and info.value.node == node.name
    assert op in str(info.value) and f"node {node.name}" in str(info.value)


def test_a_get_attr_left_over_is_named() -> None:
    graph = fx.Graph()
    node = graph.get_attr("submod_3")
    with pytest.raises(UnsupportedOpError, match="node submod_3"):
        _check_node(node)


def test_functional_ops_pass() -> None:
    _check_node(_call(torch.ops.aten.add.Tensor, 1))
    _check_node(_call(operator.getitem, 0))


# ------------------------------------------------------------------------------ hapd check


@pytest.fixture(scope="module")
def tiny_pt2(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("check") / "tiny_bn.pt2"
    torch.manual_seed(1)
    export(TinyBN(), (torch.randn(4, 3, 6, 6),), path=path, name="tiny_bn")
    return path


def test_check_cli_exit_codes(tiny_pt2, tmp_path, monkeypatch) -> None:
    runner = CliRunner()
    ok = runner.invoke(main, ["check", str(tiny_pt2)])
    assert ok.exit_code == 0, ok.output
    assert "equal within rtol 1e-05" in ok.output and "FAIL" not in ok.output

    # a runtime that forgets the buffer write-back: the check names the buffer
    import hapd.spmd.rewrite as rewrite

    with monkeypatch.context() as m:
        m.setattr(rewrite, "_write_back_buffers", lambda em: None)
        lost = runner.invoke(main, ["check", str(tiny_pt2)])
    assert lost.exit_code == 1, lost.output
    assert "FAIL buffer bn.running_mean" in lost.output

    # a plan compiled for another graph
    other = tmp_path / "other.pt2"
    export(WritesNothing(), (torch.randn(4, 3),), path=other)
    plan_path = compile_plan(lower(other), estimated_profile(1)).save(tmp_path / "other.hplan")
    wrong = runner.invoke(main, ["check", str(tiny_pt2), "--plan", str(plan_path)])
    assert wrong.exit_code == 1 and "compiled for graph" in wrong.output


class WritesNothing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()


def test_check_api_reports_the_worst_tensors(tiny_pt2) -> None:
    report = check(tiny_pt2)
    assert report.ok and report.rtol == 1e-5
    text = report.format(3)
    assert text.count("\n  ok ") == 3 and "loss" in text
    assert hapd.check is check


# ------------------------------------------------------------------------------ custom ops


CUSTOM_OP_MODULE = """
import torch

@torch.library.custom_op("hapdtest::scale", mutates_args=())
def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor

@scale.register_fake
def _(x, factor):
    return torch.empty_like(x)

def _backward(ctx, grad):
    return grad * ctx.factor, None

def _setup(ctx, inputs, output):
    ctx.factor = inputs[1]

scale.register_autograd(_backward, setup_context=_setup)
"""


class UsesCustomOp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.hapdtest.scale(self.lin(x), 3.0).sum()


@pytest.fixture(scope="module")
def custom_op_pt2(tmp_path_factory) -> tuple[Path, Path]:
    """A .pt2 using ``hapdtest::scale``, and the folder of the module registering it."""
    folder = tmp_path_factory.mktemp("customop")
    (folder / "hapd_test_customop.py").write_text(textwrap.dedent(CUSTOM_OP_MODULE))
    sys.path.insert(0, str(folder))
    try:
        import hapd_test_customop  # noqa: F401
    finally:
        sys.path.remove(str(folder))
    path = folder / "uses_custom_op.pt2"
    export(UsesCustomOp(), (torch.randn(4, 3),), path=path, name="uses_custom_op")
    return path, folder


def _hapd(*args: str, pythonpath: Path) -> subprocess.CompletedProcess:
    """``hapd ARGS`` in a fresh interpreter (no custom op registered in it)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(pythonpath), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hapd.cli", *args], capture_output=True, text=True, env=env,
                          timeout=240)


@pytest.mark.slow
def test_import_registers_a_custom_op_and_a_load_failure_says_why(custom_op_pt2) -> None:
    path, folder = custom_op_pt2
    failed = _hapd("inspect", str(path), pythonpath=folder)
    assert failed.returncode == 2
    assert "ExportError" in failed.stderr and "hapdtest.scale" in failed.stderr
    assert "custom op" in failed.stderr and "--import" in failed.stderr
    assert "Ran into the following error" not in failed.stderr, "torch's log is captured, not printed"
    loaded = _hapd("inspect", str(path), "--import", "hapd_test_customop", pythonpath=folder)
    assert loaded.returncode == 0, loaded.stderr
    assert "hapdtest.scale" in loaded.stdout
    checked = _hapd("check", str(path), "--import", "hapd_test_customop", pythonpath=folder)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_import_of_a_missing_module_is_an_error(custom_op_pt2) -> None:
    path, _ = custom_op_pt2
    result = CliRunner().invoke(main, ["inspect", str(path), "--import", "no_such_module_hapd"])
    assert result.exit_code == 2 and "cannot import 'no_such_module_hapd'" in result.output


def test_load_failure_in_process_names_torch_reason(custom_op_pt2, monkeypatch) -> None:
    path, _ = custom_op_pt2
    # an op cannot be unregistered: torch's resolver is made to miss it, as in a fresh process
    import torch._export.serde.serialize as serialize

    resolve = serialize.GraphModuleDeserializer.deserialize_operator

    def unresolved(self, serialized_target: str):
        return serialized_target if "hapdtest" in serialized_target else resolve(self, serialized_target)

    monkeypatch.setattr(serialize.GraphModuleDeserializer, "deserialize_operator", unresolved)
    with pytest.raises(ExportError, match=r"torch cannot load the exported program: .*SerializeError: We failed to "
                                          r"resolve .*custom op.*--import MODULE"):
        load_exported(path)


def test_a_forward_returning_a_model_output_with_a_cache_is_told_to_return_the_loss():
    """A transformers GPT-2 whose wrapper returns the ModelOutput (its cache among the
    outputs): one line naming the cache and the fix, not torch's pytree message."""
    transformers = pytest.importorskip("transformers")

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                             bos_token_id=0, eos_token_id=0)
            self.model = transformers.GPT2LMHeadModel(config)

        def forward(self, ids, labels):
            return self.model(input_ids=ids, labels=labels)

    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(hapd.errors.ExportError) as info:
        hapd.export(Wrapper(), (ids, ids))
    message = str(info.value)
    assert "\n" not in message and "DynamicCache" in message and "return `out.loss`" in message, message
