"""The graph IR: lowering every benchmark model, canonical bytes and stable graph ids,
what the IR records, and the errors for bad files (fixtures in ``tests/fixtures``)."""

from __future__ import annotations

import hashlib
import json
import operator
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest
import torch
from conftest import BAD_FIXTURES, MODEL_NAMES, make_fixtures
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hapd
from hapd import _core
from hapd.errors import (ExportError, GraphFormatError, GraphValidationError, GraphVersionError, HapdError,
                         ShapeError)
from hapd.ir.lower import GRAPH_FORMAT, GRAPH_VERSION, GraphIR, canonical_bytes, canonical_op_name, load_exported, lower
from hapd.ir.normalize import normalize

FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# ----------------------------------------------------------------------------- fixtures


def test_fixture_files_are_current(fixture_bytes, lowered) -> None:
    """The committed fixtures are what the lowering produces today."""
    stale = [name for name in MODEL_NAMES if fixture_bytes.get(name) != lowered[name].ir.data]
    stale += [name for name, data in make_fixtures.bad_fixtures(fixture_bytes["mlp"]).items()
              if fixture_bytes.get(name) != data]
    assert not stale, f"stale fixtures {stale}: run python tests/fixtures/make_fixtures.py"
    assert set(fixture_bytes) == set(MODEL_NAMES) | set(BAD_FIXTURES)
    assert all(len(data) < 200_000 for data in fixture_bytes.values())


# ----------------------------------------------------------------------------- lowering


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_model_lowers_round_trips_and_loads(name, lowered) -> None:
    ir = lowered[name].ir
    doc = msgpack.unpackb(ir.data, raw=False)
    assert canonical_bytes(doc) == ir.data  # decode -> encode is the identity on canonical bytes
    assert ir.doc == doc and ir.graph_id == hashlib.sha256(ir.data).hexdigest()
    assert (doc["format"], doc["version"], doc["name"]) == (GRAPH_FORMAT, GRAPH_VERSION, name)
    assert doc["torch_version"] == torch.__version__.split("+")[0]
    assert doc["loss_reduction"] == "sum"
    assert set(doc) == {"format", "version", "name", "nodes", "loss", "loss_reduction", "mutations", "torch_version",
                        "saved_traced"}
    assert doc["saved_traced"] is True
    for index, node in enumerate(doc["nodes"]):
        assert set(node) - {"tags", "flops", "saved", "saved_bytes", "block"} == {
            "name", "kind", "op", "target", "inputs", "args", "outputs", "requires_grad", "batch_dim"}
        # optional: the results the backward pass keeps, sorted indices, never empty
        saved = node.get("saved", [0])
        assert saved and saved == sorted(set(saved)) and all(0 <= k < len(node["outputs"]) for k in saved)
        assert node["kind"] == "op" or "saved_bytes" not in node
        # optional: ops only, torch's FLOP count when it counts any
        assert node["kind"] == "op" or "flops" not in node
        assert isinstance(node.get("flops", 1.0), float) and node.get("flops", 1.0) > 0
        # optional: ops only, the torch tags the core reads, sorted, never empty
        assert node.get("tags", ["pointwise"]) and set(node.get("tags", [])) <= {"pointwise", "nondeterministic_seeded"}
        assert node["kind"] == "op" or "tags" not in node
        # optional: ops only, the repeated block the op runs in (``layers.3``)
        assert node["kind"] == "op" or "block" not in node
        assert isinstance(node.get("block", "x.0"), str) and node.get("block", "x.0")[-1].isdigit()
        assert all(ref[0] < index for ref in node["inputs"]), node["name"]
        assert list(node) == sorted(node)  # keys in sorted order at every level
    loss = doc["nodes"][doc["loss"][0]]
    assert loss["op"] == "aten.cross_entropy_loss" and loss["outputs"][doc["loss"][1]]["shape"] == []

    summary = _core.load_graph(ir.data)
    assert summary["name"] == name and summary["nodes"] == len(doc["nodes"])
    ops = dict(summary["ops"])
    assert sum(ops.values()) == sum(n["kind"] == "op" for n in doc["nodes"])
    assert {op for op, _ in summary["opaque_ops"]} <= set(ops)


def test_canonical_bytes_sort_keys_and_use_float64() -> None:
    a = canonical_bytes({"b": 1, "a": {"y": [0.5, {"d": None, "c": True}], "x": "s"}})
    b = canonical_bytes({"a": {"x": "s", "y": [0.5, {"c": True, "d": None}]}, "b": 1})
    assert a == b
    assert b"\xcb" + bytes.fromhex("3fe0000000000000") in a  # 0.5 as a float64
    assert canonical_bytes({"t": (1, 2)}) == canonical_bytes({"t": [1, 2]})


def test_save_and_load(lowered, tmp_path) -> None:
    ir = lowered["mlp"].ir
    path = ir.save(tmp_path / "mlp.hapg")
    assert path == tmp_path / "mlp.hapg" and path.read_bytes() == ir.data
    assert [p.name for p in tmp_path.iterdir()] == ["mlp.hapg"]  # no temp file left behind
    again = GraphIR.load(path)
    assert again == ir and again.graph_id == ir.graph_id


def test_pt2_carries_name_batch_dims_and_frozen_parameters(lowered, tmp_path) -> None:
    """A .pt2 written by hapd.export lowers to the same bytes as the program in memory
    (a model with frozen parameters: ``tests/spmd/test_frozen.py``)."""
    import hapd.models as models

    spec = models.get("mlp")
    model, config = models.build("mlp")
    path = tmp_path / "mlp.pt2"
    hapd.export(model, spec.example_inputs(config, make_fixtures.BATCH), path=path, name="mlp")
    assert [p.name for p in tmp_path.iterdir()] == ["mlp.pt2"]
    program, stored = load_exported(path)
    assert stored == {"name": "mlp", "batch_dims": {"x": 0, "y": 0}, "frozen": [], "batch": make_fixtures.BATCH,
                      "symbolic_batch": False, "static_reason": "exported static", "functional": True}
    assert lower(path).data == lowered["mlp"].ir.data
    assert lower(path, name="other").doc["name"] == "other"
    assert lower(program).doc["name"] == "model"  # a program alone has no name


# ----------------------------------------------------------------------------- graph ids

_ID_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {fixtures!r})
    import make_fixtures
    print(json.dumps({{name: make_fixtures.lower_model(name)[1].graph_id for name in {names!r}}}))
""")


def test_graph_ids_are_stable_across_processes(lowered) -> None:
    names = ["mlp", "bert"]
    script = _ID_SCRIPT.format(fixtures=str(make_fixtures.FIXTURES), names=names)
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for _ in range(2)]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=240)
        assert run.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    expected = {name: lowered[name].ir.graph_id for name in names}
    assert results == [expected, expected]


def test_graph_id_depends_on_batch_and_config(lowered) -> None:
    base = lowered["mlp"].ir
    _, again = make_fixtures.lower_model("mlp")
    assert again.data == base.data  # a second export gives the same bytes
    _, batch3 = make_fixtures.lower_model("mlp", batch=3)
    _, wider = make_fixtures.lower_model("mlp", hidden=48)
    assert len({base.graph_id, batch3.graph_id, wider.graph_id}) == 3
    x = next(n for n in batch3.doc["nodes"] if n["name"] == "x")
    assert x["outputs"][0]["shape"] == [3, 32]


# ----------------------------------------------------------------------------- what the IR records


def _nodes(doc, kind=None):
    return [n for n in doc["nodes"] if kind is None or n["kind"] == kind]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_ir_records_fx_names_and_sources(name, lowered) -> None:
    program, doc = normalize(lowered[name].program), lowered[name].doc  # the IR is of the functional form
    fx = [n for n in program.graph.nodes if n.op != "output"]
    tuple_items = {n.name for n in fx if n.target is operator.getitem and isinstance(n.args[0].meta.get("val"), (tuple, list))}
    # one IR node per fx node, in graph order, named after it (getitems of tuples become
    # outputs, and a tuple-returning op takes the name of its first picked result)
    def ir_name(n):
        picked = sorted((u.args[1], u.name) for u in n.users if u.name in tuple_items)
        return picked[0][1] if picked else n.name

    assert [n["name"] for n in doc["nodes"]] == [ir_name(n) for n in fx if n.name not in tuple_items]
    output_names = {out["name"] for n in doc["nodes"] for out in n["outputs"]}
    assert tuple_items <= output_names

    # parameters: FQN, shape and requires_grad of the module's parameters, in signature order
    params = {p["target"]: (p["outputs"][0]["shape"], p["requires_grad"]) for p in _nodes(doc, "parameter")}
    assert params == {fqn: (list(t.shape), t.requires_grad) for fqn, t in program.named_parameters()}
    assert all(p["requires_grad"] for p in _nodes(doc, "parameter"))
    # buffers: FQN and shape, no gradient
    buffers = {b["target"]: b["outputs"][0]["shape"] for b in _nodes(doc, "buffer")}
    assert buffers == {fqn: list(t.shape) for fqn, t in program.named_buffers()}
    assert not any(n["requires_grad"] for n in doc["nodes"] if n["kind"] != "parameter")
    # user inputs: x and y, batch dim 0; nothing else has a batch dim
    inputs = [(n["name"], n["target"], n["batch_dim"], n["outputs"][0]["shape"][0]) for n in _nodes(doc, "input")]
    assert inputs == [("x", "x", 0, make_fixtures.BATCH), ("y", "y", 0, make_fixtures.BATCH)]
    assert all(n["batch_dim"] is None for n in doc["nodes"] if n["kind"] != "input")
    # sources carry no op; ops carry their canonical name, schema args and a target of ""
    for n in doc["nodes"]:
        assert (n["op"] == "") == (n["kind"] != "op"), n["name"]
        if n["kind"] == "op":
            assert n["target"] == "" and n["op"].startswith("aten."), n
            tensor_args = [a for a in n["args"] if "t" in a["value"]]
            assert len(tensor_args) <= len(n["inputs"])


def test_bert_buffer_and_linear_args(lowered) -> None:
    doc = lowered["bert"].doc
    (positions,) = _nodes(doc, "buffer")
    assert positions == {"name": "b_positions", "kind": "buffer", "op": "", "target": "positions", "inputs": [],
                         "args": [], "outputs": [{"name": "b_positions", "shape": [16, 32], "dtype": "float32"}],
                         "requires_grad": False, "batch_dim": None}
    summary = _core.load_graph(lowered["bert"].ir.data)
    assert summary["buffers"] == [("positions", [16, 32])]
    assert ("aten.scaled_dot_product_attention", 2) in summary["ops"]
    sdpa = next(n for n in doc["nodes"] if n["op"] == "aten.scaled_dot_product_attention")
    args = {a["name"]: a["value"] for a in sdpa["args"]}
    assert args["is_causal"] == {"b": True} and args["dropout_p"] == {"f": 0.0}
    assert args["attn_mask"] == {"n": None}
    assert [args[k] for k in ("query", "key", "value")] == [{"t": 0}, {"t": 1}, {"t": 2}]


def test_llama_buffers(lowered) -> None:
    buffers = {b["target"]: b["outputs"][0]["shape"] for b in _nodes(lowered["llama_block"].doc, "buffer")}
    assert buffers == {"rope_cos": [16, 8], "rope_sin": [16, 8]}


def test_tuple_outputs_map_getitem_names(lowered) -> None:
    program, doc = normalize(lowered["bert_moe"].program), lowered["bert_moe"].doc
    index = next(i for i, n in enumerate(doc["nodes"]) if n["op"] == "aten.topk")
    topk = doc["nodes"][index]
    # the op is named after its first result (a getitem of the fx topk node)
    fx_topk = next(n for n in program.graph.nodes if n.name == topk["name"]).args[0]
    getitems = {n.args[1]: n.name for n in fx_topk.users if n.target is operator.getitem}
    # (a result nobody reads has no getitem in the functional form: it is named op[k])
    assert [out["name"] for out in topk["outputs"]] == [getitems.get(k, f"{topk['name']}[{k}]") for k in (0, 1)]
    assert [(o["dtype"], o["shape"]) for o in topk["outputs"]] == [("float32", [2, 16, 2]), ("int64", [2, 16, 2])]
    # the indices (result 1) feed one_hot through a [topk, 1] reference
    users = [n for n in doc["nodes"] if [index, 1] in n["inputs"]]
    assert users and all(n["op"] in ("aten.select.int",) for n in users)


def test_frozen_parameter_and_custom_batch_dims() -> None:
    class Frozen(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Linear(4, 3)
            self.body.bias.requires_grad_(False)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.body(x).reshape(-1, 3), y.reshape(-1))

    x, y = torch.randn(5, 2, 4), torch.zeros(5, 2, dtype=torch.long)
    doc = lower(hapd.export(Frozen(), (x, y)), batch_dims={"x": 1, "y": None}).doc
    assert {p["target"]: p["requires_grad"] for p in _nodes(doc, "parameter")} == {"body.weight": True,
                                                                                  "body.bias": False}
    assert [n["batch_dim"] for n in _nodes(doc, "input")] == [1, None]
    assert doc["loss_reduction"] == "mean"
    summary = _core.load_graph(canonical_bytes(doc))
    assert summary["parameters"] == [("body.weight", [3, 4], True), ("body.bias", [3], False)]
    assert summary["inputs"] == [("x", [5, 2, 4], 1), ("y", [5, 2], None)]
    with pytest.raises(ExportError, match="batch dim 3 out of range"):
        lower(hapd.export(Frozen(), (x, y)), batch_dims={"x": 3})


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)


class _NotScalar(_Head):
    def forward(self, x):
        return self.lin(x)


class _TwoOutputs(_Head):
    def forward(self, x):
        y = self.lin(x)
        return y.sum(), y.mean()


class _SumOfSquares(_Head):
    def forward(self, x):
        return self.lin(x).pow(2).sum() * 0.5


class _DataDependent(_Head):
    def forward(self, x):
        return self.lin(x).sum() if x.sum() > 0 else self.lin(x).mean()


def test_loss_reduction_of_other_losses() -> None:
    x = torch.randn(2, 4)
    assert lower(hapd.export(_SumOfSquares(), (x,))).doc["loss_reduction"] == "unknown"


class _DictOutput(_Head):
    def forward(self, x):
        y = self.lin(x)
        return {"loss": y.sum(), "logits": y}


class _LogitsOnly(_Head):
    def forward(self, x):
        return {"logits": self.lin(x)}


@pytest.mark.parametrize(("module", "message"), [
    (_NotScalar, r"^the model returns a tensor of shape \[2, 3\]; hapd needs the scalar loss \(compute the loss in forward"),
    (_TwoOutputs, "^the model returns 2 outputs; hapd trains a forward that returns the scalar loss"),
    (_DictOutput, r"^the model returns a dict with 'loss', 'logits'; hapd trains a forward that returns the scalar loss: "
                  r"return `out\['loss'\]` \(e\.g\. a wrapper whose forward is `return self\.model\(\.\.\.\)\['loss'\]`\)$"),
    (_LogitsOnly, r"^the model returns a dict with 'logits' of shape \[2, 3\]; hapd needs the scalar loss: pass the labels "
                  r"so that it computes a loss, and return `out\['loss'\]`$"),
])
def test_lowering_needs_one_scalar_output(module, message) -> None:
    program = hapd.export(module(), (torch.randn(2, 4),))
    with pytest.raises(ExportError, match=message):
        lower(program)


def test_export_failure_is_export_error() -> None:
    with pytest.raises(ExportError, match="torch.export failed for _DataDependent"):
        hapd.export(_DataDependent(), (torch.randn(2, 4),))
    with pytest.raises(ExportError, match="2 batch dims for 1 example inputs"):
        hapd.export(_NotScalar(), (torch.randn(2, 4),), batch_dims=[0, 0])


def test_bad_pt2_files(tmp_path) -> None:
    garbage = tmp_path / "garbage.pt2"
    garbage.write_bytes(b"PK\x03\x04 this is no zip archive" * 10)
    with pytest.raises(GraphFormatError, match="not a torch.export program"):
        lower(garbage)
    empty = tmp_path / "empty.pt2"
    empty.write_bytes(b"")
    with pytest.raises(GraphFormatError, match="empty"):
        lower(empty)
    with pytest.raises(ExportError, match="no such file"):
        lower(tmp_path / "missing.pt2")


def test_canonical_op_names() -> None:
    assert canonical_op_name(torch.ops.aten.linear.default) == "aten.linear"
    assert canonical_op_name(torch.ops.aten.add.Tensor) == "aten.add.Tensor"
    assert canonical_op_name(torch.ops.aten.softmax.int) == "aten.softmax.int"
    assert canonical_op_name(operator.add) == "python._operator.add"


# ----------------------------------------------------------------------------- bad files

BAD_EXPECTED = {
    "truncated": (GraphFormatError, None, None, "cannot decode graph"),
    "garbage": (GraphFormatError, None, None, "cannot decode graph"),
    "empty": (GraphFormatError, None, None, "empty"),
    "wrong_format": (GraphFormatError, None, None, 'unknown format "hapd.plan"'),
    "wrong_version": (GraphVersionError, None, None, "version 99"),
    "dangling": (GraphValidationError, "linear_1", "inputs", r"refers to \[23, 0\]"),
    "forward_ref": (GraphValidationError, "linear_1", "inputs", "topological order"),
    "shape_mismatch": (ShapeError, "linear", None, r"input \[2, 32\] does not match weight \[64, 33\]"),
    "not_scalar_loss": (GraphValidationError, None, "loss", "must be a scalar"),
    "bad_kind": (GraphValidationError, "gelu", "kind", "unknown variant `weird`"),
    "negative_dim": (GraphValidationError, "gelu", "outputs[0].shape", "negative dimension -64"),
}


def test_every_bad_fixture_has_an_expectation() -> None:
    assert sorted(BAD_EXPECTED) == sorted(BAD_FIXTURES)


@pytest.mark.parametrize("name", sorted(BAD_EXPECTED))
def test_bad_fixture_raises_its_error(name, fixture_bytes) -> None:
    cls, node, field, message = BAD_EXPECTED[name]
    with pytest.raises(HapdError, match=message) as info:
        _core.load_graph(fixture_bytes[name])
    assert type(info.value) is cls
    assert (info.value.node, info.value.field) == (node, field)
    assert info.value.message == str(info.value)


def test_inspect_rejects_bad_fixture_files(fixtures_dir) -> None:
    with pytest.raises(ShapeError):
        hapd.inspect_graph(fixtures_dir / "shape_mismatch.hapg")
    with pytest.raises(GraphVersionError):
        hapd.inspect_graph((fixtures_dir / "wrong_version.hapg").read_bytes())
    summary = hapd.inspect_graph(fixtures_dir / "mlp.hapg")
    assert summary["graph_id"] == hashlib.sha256((fixtures_dir / "mlp.hapg").read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- fuzzing


def _load_or_hapd_error(data: bytes) -> None:
    """The core either loads ``data`` or raises a hapd error; anything else fails."""
    try:
        summary = _core.load_graph(data)
    except HapdError as exc:
        assert type(exc) is not HapdError and str(exc)
    else:
        assert summary["nodes"] > 0


@FUZZ
@given(st.binary(max_size=4096))
def test_fuzz_random_bytes(data) -> None:
    _load_or_hapd_error(data)


@FUZZ
@given(model=st.sampled_from(MODEL_NAMES), edits=st.lists(
    st.tuples(st.integers(min_value=0), st.integers(0, 255), st.sampled_from(["flip", "set", "delete"])),
    min_size=1, max_size=8), cut=st.none() | st.integers(min_value=0))
def test_fuzz_mutated_fixtures(fixture_bytes, model, edits, cut) -> None:
    data = bytearray(fixture_bytes[model])
    for at, byte, how in edits:
        i = at % len(data)
        if how == "flip":
            data[i] ^= 1 << (byte % 8)
        elif how == "set":
            data[i] = byte
        else:
            del data[i]
    if cut is not None:
        del data[cut % (len(data) + 1):]
    _load_or_hapd_error(bytes(data))


_MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_NODE_KEYS = ["name", "kind", "op", "target", "inputs", "args", "outputs", "requires_grad", "batch_dim", "extra"]
_GRAPH_KEYS = ["format", "version", "name", "nodes", "loss", "loss_reduction", "torch_version"]


@FUZZ
@given(model=st.sampled_from(["mlp", "bert_moe"]), where=st.integers(min_value=0),
       key=st.sampled_from(_NODE_KEYS + _GRAPH_KEYS), value=_MSGPACK_VALUES, drop=st.booleans())
def test_fuzz_structured_edits(lowered, model, where, key, value, drop) -> None:
    """A field of a node (or of the graph) replaced by any msgpack value, or removed."""
    doc = lowered[model].ir.doc
    target = doc if key in _GRAPH_KEYS else doc["nodes"][where % len(doc["nodes"])]
    if drop:
        target.pop(key, None)
    else:
        target[key] = value
    _load_or_hapd_error(msgpack.packb(doc, use_bin_type=True))


def test_core_errors_are_hapd_errors_even_on_odd_inputs() -> None:
    for data in [b"\xc1", b"\x80", b"\x90", msgpack.packb({"format": "hapd.graph"}),
                 msgpack.packb({"format": "hapd.graph", "version": 1, "nodes": [], "loss": [0, 0]}),
                 msgpack.packb([1, 2, 3]), msgpack.packb({"format": 7}), b"\xdd\xff\xff\xff\xff"]:
        with pytest.raises((GraphFormatError, GraphValidationError)):
            _core.load_graph(data)
    with pytest.raises(TypeError):
        _core.load_graph("not bytes")


def test_graph_id_survives_a_pt2_round_trip(lowered, tmp_path) -> None:
    """torch.export.save/load renames tuple-returning fx nodes (topk → topk_default);
    the IR names them after their results, so the graph id does not change."""
    program = lowered["bert_moe"].program
    path = tmp_path / "bert_moe.pt2"
    torch.export.save(program, path)
    again = hapd.lower(torch.export.load(path), name="bert_moe")
    assert again.graph_id == lowered["bert_moe"].ir.graph_id
