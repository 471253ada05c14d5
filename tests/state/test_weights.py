"""Export without weights; each rank materializes only its own pieces.

A model on the meta device exports, lowers and compiles from shapes alone (the
benchmark models and a zoo model), to the graph id of the same model built with weights. On 2 Gloo ranks (ratios 3:1, every linear split),
``distribute(..., weights=...)`` reads each rank's pieces from an initializer, a
safetensors file or a hapd checkpoint, one tensor at a time: the pieces are exactly the
slices of the single-device model (built in this process), and the host memory a rank
allocates while materializing peaks at its shards plus about the largest single
parameter (counted by :class:`LiveBytes`, a dispatch-mode account of live CPU storages,
not the process RSS). ``hapd.parallelize`` does the same for a model built under
``hapd.init_on_meta`` (real buffers) and trains like the single-device model.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import pytest
import torch
from _dist import run_ranks
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import hapd
from hapd import models
from hapd.ir.export import user_input_names
from hapd.compiler.options import CompileOptions
from hapd.errors import WeightsError
from hapd.profile.schema import estimated_profile
from hapd.state.weights import materialize, module_init

WIDTH, LAYERS, B = 128, 8, 4
RATIOS = (0.75, 0.25)
SEED = 7
MARGIN = 4096
"""Bytes allowed above the bound: small tensors besides the pieces (a 0-dim loss
scale, allocator rounding); far below one parameter (64 KiB)."""


class Stack(nn.Module):
    """``LAYERS`` equal linears; the loss is the squared error to ``y``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return ((x - y) ** 2).sum()


def _inputs() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, WIDTH, generator=g), torch.randn(B, WIDTH, generator=g)


def _meta_stack() -> Stack:
    with torch.device("meta"):
        return Stack()


class LiveBytes(TorchDispatchMode):
    """Bytes of CPU storage alive at once, over every storage an op makes while active:
    each is counted from the first op output on it until torch frees it (a storage's
    Python object lives exactly as long as the storage, so a finalizer on it sees the
    free, whichever tensors, views or parameters held it). Storages torch did not
    allocate (not resizable: a memory-mapped file, a Python buffer) are not counted: a
    safetensors slice is a view of the file's map until copied. ``peak``: the most at once."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # storage address -> bytes
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if type(t) in (Tensor, nn.Parameter) and t.device.type == "cpu":  # real: not fake, functional, meta
                self._track(t.untyped_storage())
        return out

    def _track(self, storage: torch.UntypedStorage) -> None:
        key, size = storage.data_ptr(), storage.nbytes()
        if key == 0 or size == 0 or key in self.live or not storage.resizable():
            return
        self.live[key] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._release, key)

    def _release(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)


# --------------------------------------------------------------------------------------
# Export and compile on meta
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*models.MODELS, "zoo.gpt2"])
def test_a_model_on_meta_exports_and_lowers_from_shapes_alone(name):
    if name.startswith("zoo."):
        pytest.importorskip("transformers")
    spec, config = models.get(name), models.make_config(name, "tiny")
    with torch.device("meta"):
        model = spec.build(config)
    inputs = spec.example_inputs(config, 4)  # real inputs: taken to meta for the export
    program = hapd.export(model, inputs)
    assert all(v.is_meta for v in program.state_dict.values())
    graph = hapd.lower(program, name=name, batch_dims=dict(zip(user_input_names(program), spec.batch_dims)))
    assert graph.doc["nodes"]
    assert all(t.is_meta for t in model.parameters())  # nothing was materialized


@pytest.mark.parametrize("name", ["gpt2_block", "zoo.gpt2"])
def test_meta_and_real_exports_lower_to_the_same_graph(name):
    """The same model built with weights and under ``init_on_meta`` lowers to one graph
    id (a plan cached for one serves the other): attention's ``transpose + reshape`` is
    a view in both, ``arange`` names the inputs' device, and a tied weight is one
    source."""
    if name.startswith("zoo."):
        pytest.importorskip("transformers")
    spec = models.get(name)

    def graph_id(meta: bool) -> str:
        with hapd.init_on_meta() if meta else contextlib.nullcontext():
            model, config = models.build(name, "tiny")
        program = hapd.export(model, spec.example_inputs(config, 4), batch_dims=spec.batch_dims)
        assert all(v.is_meta for v in program.state_dict.values()) == meta
        return hapd.lower(program, name=name).graph_id

    assert graph_id(meta=True) == graph_id(meta=False)


def test_init_on_meta_keeps_buffers_real_and_export_leaves_them():
    with hapd.init_on_meta():
        model, config = models.build("bert")
    assert all(p.is_meta for p in model.parameters())
    assert not model.positions.is_meta
    real = model.positions
    hapd.export(model, models.get("bert").example_inputs(config, 2))
    assert model.positions is real


# --------------------------------------------------------------------------------------
# Materializing on 2 ranks
# --------------------------------------------------------------------------------------


def _plan() -> bytes:
    program = hapd.export(_meta_stack(), _inputs())
    graph = hapd.lower(program, name="stack")
    linears = [n["name"] for n in graph.doc["nodes"] if n.get("op") == "aten.linear"]
    force = {n: ("column-parallel", "row-parallel")[i % 2] for i, n in enumerate(linears)}
    plan = hapd.compile(graph, estimated_profile(2, flops=[2e10, 1e10]), CompileOptions(ratios=RATIOS, force=force))
    return plan.to_bytes()


def _reference(seed: int) -> dict[str, Tensor]:
    """The single-device model the initializer stands for (built in this process)."""
    return materialize(_meta_stack(), module_init(_meta_stack(), seed)).state_dict()


def _materialize(rank: int, world: int, plan: bytes, sources: dict[str, Any],
                 expected: dict[str, Tensor]) -> dict[str, Any]:
    """Each source on this rank: the peak live bytes while distributing, the bound, and
    whether every piece is the slice of the single-device value."""
    from hapd.compiler.plan import Plan
    from hapd.spmd.rewrite import distribute, global_loss

    program = hapd.export(_meta_stack(), _inputs())
    out = {}
    for name, weights in sources.items():
        if name == "initializer":
            weights = module_init(_meta_stack(), SEED)
        with LiveBytes() as live:
            module = distribute(program, Plan.from_bytes(plan), rank, world=world, weights=weights)
        pieces = dict(module.named_parameters())
        shards = sum(p.numel() * p.element_size() for p in pieces.values())
        largest = max(t.numel() * t.element_size() for t in expected.values())
        exact = all(torch.equal(pieces[k], module.hapd_view.local_value(t, lay, expected[k]))
                    for k, (t, lay) in module.hapd_params.items())
        split = sum(1 for _, lay in module.hapd_params.values() if lay.startswith("Gather"))
        loss = global_loss(module(*module.shard_inputs(*_inputs())))
        print(f"rank {rank} {name}: peak {live.peak} B, shards {shards} B, largest parameter {largest} B", flush=True)
        out[name] = {"peak": live.peak, "shards": shards, "largest": largest, "exact": exact, "split": split,
                     "loss": loss}
    return out


@pytest.fixture(scope="module")
def materialized(tmp_path_factory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("weights")
    reference = _reference(SEED)
    file = folder / "stack.safetensors"
    save_file({k: v.contiguous() for k, v in reference.items()}, str(file))
    model = Stack()
    model.load_state_dict(reference)
    hapd.save_checkpoint(folder / "ckpt", model)
    single = Stack()
    single.load_state_dict(reference)
    sources = {"initializer": None, "safetensors": str(file), "checkpoint": str(folder / "ckpt")}
    results = run_ranks(2, _materialize, _plan(), sources, reference)
    return {"ranks": results, "loss": float(single(*_inputs()).detach()), "model_bytes": sum(
        v.numel() * v.element_size() for v in reference.values())}


@pytest.mark.parametrize("source", ["initializer", "safetensors", "checkpoint"])
def test_each_rank_materializes_exactly_its_slices(materialized, source):
    for rank in materialized["ranks"]:
        got = rank[source]
        assert got["split"] == LAYERS + LAYERS // 2  # every weight, every column-parallel bias: a real split
        assert got["exact"]
        assert got["loss"] == pytest.approx(materialized["loss"], rel=1e-5)


@pytest.mark.parametrize("source", ["initializer", "safetensors", "checkpoint"])
def test_peak_host_memory_is_the_shards_plus_one_parameter(materialized, source):
    for rank in materialized["ranks"]:
        got = rank[source]
        bound = got["shards"] + got["largest"] + MARGIN
        assert got["peak"] <= bound, f"{source}: peak {got['peak']} B > shards {got['shards']} + largest " \
                                     f"{got['largest']} (+{MARGIN})"
        assert got["peak"] < got["shards"] + materialized["model_bytes"] / 2  # far from the whole model


def test_the_tracker_sees_a_whole_model_built_at_once():
    """The account above can fail: materializing the whole model keeps every tensor."""
    with LiveBytes() as live:
        model = materialize(_meta_stack(), module_init(_meta_stack(), SEED))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert live.peak >= total


# --------------------------------------------------------------------------------------
# The initializer's guarantees
# --------------------------------------------------------------------------------------


def test_module_init_is_seeded_by_name_and_reset_parameters():
    a, b = _reference(SEED), _reference(SEED)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.weight"], a["layers.1.weight"])  # each name its own stream
    assert not torch.equal(a["layers.0.weight"], _reference(SEED + 1)["layers.0.weight"])
    bound = 1 / WIDTH ** 0.5  # nn.Linear.reset_parameters: U(±1/sqrt(fan_in)) for weight and bias
    assert all(float(v.abs().max()) <= bound for v in a.values())
    meta = _meta_stack()
    module_init(meta, SEED)
    assert all(p.is_meta for p in meta.parameters())  # the meta model is untouched


def test_a_per_module_init_replays_gpt2s_and_tied_parameters_stay_tied():
    with torch.device("meta"):
        model, _ = models.build("gpt2_block")
    materialize(model, module_init(model, SEED, init=models.module_init_of(model)))
    assert not any(t.is_meta for t in model.state_dict(keep_vars=True).values())
    std = float(model.tokens.weight.detach().std())
    assert 0.015 < std < 0.025  # GPT-2's N(0, 0.02), not Embedding's N(0, 1)
    assert torch.equal(model.norm.weight.detach(), torch.ones(model.config.hidden))  # LayerNorm's own reset

    with torch.device("meta"):
        tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        tied[1].weight = tied[0].weight
    materialize(tied, module_init(tied, SEED))
    assert tied[1].weight is tied[0].weight and not tied[0].weight.is_meta


# --------------------------------------------------------------------------------------
# parallelize a meta model
# --------------------------------------------------------------------------------------


def test_parallelize_a_model_on_meta_from_a_safetensors_file(tmp_path):
    model, config = models.build("bert", dropout=0.0, attention_dropout=0.0)
    file = tmp_path / "bert.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "positions"}, str(file))
    batch = models.get("bert").example_inputs(config, 4)
    losses = run_ranks(2, _parallel_bert_eval, str(file), batch)
    assert losses == [pytest.approx(float(model(*batch).detach()), rel=1e-5)] * 2


def _parallel_bert_eval(rank: int, world: int, file: str, batch: tuple[Tensor, ...]) -> float:
    """The bert built under init_on_meta (its position table real), its weights read from
    ``file`` (the position table is not in it: the model's own), dropout off."""
    with hapd.init_on_meta():
        model, _ = models.build("bert", dropout=0.0, attention_dropout=0.0)
    module = hapd.parallelize(model, batch, options={"ratios": RATIOS}, use_daemon=False, verbose=False,
                              weights=file)
    assert all(not p.is_meta for p in module.parameters())
    return module.global_loss(module(*module.shard_inputs(*batch)))


# --------------------------------------------------------------------------------------
# Bad inputs
# --------------------------------------------------------------------------------------


def test_what_cannot_be_materialized_is_an_error(tmp_path):
    batch = _inputs()
    with pytest.raises(WeightsError, match="meta device: pass weights="):
        hapd.parallelize(_meta_stack(), batch, use_daemon=False, verbose=False)
    file = tmp_path / "wrong.safetensors"
    save_file({"layers.0.weight": torch.zeros(3, 3)}, str(file))
    with pytest.raises(WeightsError, match=r"layers.0.weight: .* shape \[3, 3\]"):
        hapd.parallelize(_meta_stack(), batch, use_daemon=False, verbose=False, weights=file)
    save_file({"other": torch.zeros(3)}, str(file))
    with pytest.raises(WeightsError, match="does not have it and the program holds it on the meta device"):
        hapd.parallelize(_meta_stack(), batch, use_daemon=False, verbose=False, weights=file)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    with pytest.raises(WeightsError, match="Scale has no reset_parameters"):
        materialize(model, module_init(model))
    with pytest.raises(WeightsError, match="not a tensor"):
        materialize(_meta_stack(), lambda name, like: 3)
    with pytest.raises(WeightsError, match="weights= takes"):
        hapd.parallelize(_meta_stack(), batch, use_daemon=False, verbose=False, weights=3)


class Scale(nn.Module):
    """A module with a parameter and no ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale
