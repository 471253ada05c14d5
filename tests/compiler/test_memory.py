"""The memory model: what lowering records as kept for backward, the live-bytes tracker
that measures it, compiles that keep every device's peak under its memory, and peaks
priced at the integer lengths a rank holds."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import hapd
from hapd import _core, models
from hapd.ir.lower import lower
from hapd.compiler.options import CompileOptions
from hapd.compiler.lengths import sharding_lengths
from hapd.compiler import search
from hapd.compiler.recompute import memory_floor
from hapd.compiler.ratios import linear_peak_memory, part_memory, peak_memory, solve_ratios
from hapd.errors import SynthesisError
from hapd.profile.schema import estimated_profile
from hapd.harness.memtrack import LiveTensorBytes


class _Block(nn.Module):
    """linear → relu → add → sum: the linear keeps its input, relu its result, the add
    and the sum nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.proj(x))
        return (h + x).sum()


def _nodes(graph) -> dict[str, dict]:
    return {n["name"]: n for n in graph.doc["nodes"]}


def test_lowering_marks_what_the_backward_pass_keeps():
    graph = lower(torch.export.export(_Block(), (torch.randn(4, 8),)))
    nodes = _nodes(graph)
    assert graph.doc["saved_traced"] is True
    assert nodes["x"].get("saved") == [0]  # the linear's input
    assert nodes["relu"].get("saved") == [0]  # relu keeps its result
    assert "saved" not in nodes["linear"]  # relu's backward reads relu's result, not this
    assert "saved" not in nodes["add"] and "saved" not in nodes["sum_1"]


def test_a_program_that_names_a_device_is_traced_on_meta_tensors():
    class Positions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(4, device=x.device, dtype=x.dtype)
            return torch.tanh(self.proj(x + pos)).sum()

    graph = lower(torch.export.export(Positions(), (torch.randn(2, 4),)))
    assert graph.doc.get("saved_traced") is True
    assert _nodes(graph)["tanh"].get("saved") == [0]


def test_live_tensor_bytes_counts_allocations_and_frees():
    with LiveTensorBytes() as tracker:
        a = torch.zeros(1024)  # 4 KiB
        b = torch.ones(2048)  # 8 KiB
        assert tracker.current == tracker.peak == 3 * 4096
        del b  # stops counting at the next op
        c = a.view(32, 32)  # a view: no new storage
        d = c + 1  # 4 KiB
        assert tracker.current == 2 * 4096 and tracker.peak == 3 * 4096
        tracker.reset_peak()
        e = torch.zeros(1)
        assert tracker.peak == 2 * 4096 + 4
        del d, e


@pytest.fixture(scope="module")
def mlp_graph():
    spec = models.get("mlp")
    module, config = models.build("mlp", "tiny")
    return lower(hapd.export(module, spec.example_inputs(config, 8), batch_dims=spec.batch_dims), name="mlp")


def test_plan_fits_each_device_where_data_parallel_does_not(mlp_graph):
    roomy = hapd.compile(mlp_graph, estimated_profile(2, flops=[1e10, 1e10]))
    data_parallel = max(roomy.doc["baselines"]["dp_memory"])
    cap = 0.6 * data_parallel
    plan = hapd.compile(mlp_graph, estimated_profile(2, flops=[1e10, 1e10], memory=cap))
    assert not plan.doc["baselines"]["dp_fits"]
    assert all(peak <= cap for peak in plan.estimate["memory"])
    assert any(s["rule"] in ("column-parallel", "row-parallel") for s in plan.program["steps"])


def test_memory_caps_off_ignores_device_memory(mlp_graph):
    plan = hapd.compile(mlp_graph, estimated_profile(2, flops=[1e10, 1e10], memory=1024.0),
                        CompileOptions(memory_caps=False))
    assert all(peak > 1024.0 for peak in plan.estimate["memory"])


def test_nothing_fits_names_the_device_its_capacity_and_the_shortfall(mlp_graph):
    with pytest.raises(SynthesisError, match=r"device \d \(estimated on \w+\) has 1.00 KiB and needs .* short"):
        hapd.compile(mlp_graph, estimated_profile(2, flops=[1e10, 1e10], memory=1024.0))


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "bool": 1}


def _held_share(program: dict, tensor: dict, ratios) -> float:
    """The share of ``tensor`` a device holds, read off the plan's tensors and splits
    (not its memory rows): 1 for a replica, its split class's integer length over the
    class's units for a split (one entry per device)."""
    gathers = [int(l[len("Gather("):-1]) for l in tensor["layouts"] if l.startswith("Gather(")]
    if len(gathers) != len(tensor["layouts"]):
        return [1.0] * len(ratios)
    for split in program["splits"]:
        if [tensor["name"], gathers[0], tensor["shape"][gathers[0]]] in [list(m) for m in split["members"]]:
            units = int(split["units"])
            return [n / units for n in sharding_lengths(ratios, units)]
    raise AssertionError(f"{tensor['name']} is split but in no split class")


def test_memory_is_priced_at_the_integer_lengths_a_rank_holds():
    """4 experts at ratios 0.4/0.3/0.2/0.1 split 2/1/1/0: rank 3 holds no expert (not a
    tenth of them) and rank 0 half of them, and the plan's peak says so."""
    spec = models.get("bert_moe")
    module, config = models.build("bert_moe", "tiny")
    graph = lower(hapd.export(module, spec.example_inputs(config, 8), batch_dims=spec.batch_dims), name="bert_moe")
    expert = {n: _core.rule_names()["EXPERT_PARALLEL"] for n in _core.load_graph(graph.data)["expert_parallel"]}
    ratios = (0.4, 0.3, 0.2, 0.1)
    plan = hapd.compile(graph, estimated_profile(4, flops=[1e10] * 4),
                        CompileOptions(ratios=ratios, memory_caps=False, force=expert))
    program = plan.program
    experts = [t for t in program["tensors"] if t["kind"] == "parameter" and t["name"].endswith(("mlp_w1", "mlp_w2"))]
    assert experts and all(_held_share(program, t, ratios) == [0.5, 0.25, 0.25, 0.0] for t in experts)
    expected = [0.0] * 4
    for t in program["tensors"]:
        if t["kind"] in ("parameter", "buffer", "constant"):
            whole = math.prod(t["shape"]) * DTYPE_BYTES[t["dtype"]]
            expected = [e + whole * s for e, s in zip(expected, _held_share(program, t, ratios))]
    assert part_memory(program, ratios)["parameters"] == pytest.approx(expected)
    assert plan.estimate["memory"] == peak_memory(program, ratios)
    assert plan.estimate["memory"][3] < linear_peak_memory(program, ratios)[3]


def _one_split_program(units: int, shard_bytes: float) -> dict:
    """Two devices, device 0 twice as fast on one sharded step, and ``shard_bytes`` of
    memory split by one class of ``units`` units."""
    return {
        "devices": 2,
        "steps": [{"comp": {"constant": [0.0, 0.0], "coef": [1.0, 2.0]},
                   "comm": {"constant": [0.0, 0.0], "coef": [0.0, 0.0]}}],
        "splits": [{"units": units, "members": [["w", 0, units]]}],
        "memory": {"constant": [0.0, 0.0], "coef": [shard_bytes, shard_bytes]},
        "memory_split": {
            "backward": {"replica": 0.0, "shards": [[0, shard_bytes]], "largest": []},
            "update": {"replica": 0.0, "shards": [[0, shard_bytes]], "largest": []},
            "parts": {},
        },
    }


def test_ratios_with_memory_caps_fit_at_their_integer_lengths():
    """Linear in the ratios, device 0 fits at ratio 0.7 of a 100-byte split under a cap of
    70; 4 units split 3/1 there and it holds 75. The LP lowers its cap and solves again."""
    program = _one_split_program(4, 100.0)
    assert solve_ratios(program).ratios[0] == pytest.approx(2 / 3)  # 2.67/1.33 units: 3/1, 75 bytes
    ratios = solve_ratios(program, memory_caps=[70.0, 70.0]).ratios
    assert linear_peak_memory(program, (0.7, 0.3))[0] <= 70.0 < peak_memory(program, (0.7, 0.3))[0]
    assert all(peak <= 70.0 for peak in peak_memory(program, ratios))
    assert sharding_lengths(ratios, 4) == [2, 2]


def test_ratios_no_integer_split_fits_is_an_error():
    """One indivisible unit of 100 bytes: whichever device holds it has 100 > 70."""
    with pytest.raises(SynthesisError):
        solve_ratios(_one_split_program(1, 100.0), memory_caps=[70.0, 70.0])


def test_the_memory_floor_bounds_every_program_and_cuts_searches_that_cannot_fit(mlp_graph, monkeypatch):
    """Every program holds at least the floor over its devices (parameters with Adam's
    moments and kept activations, each once); devices whose memory sums to less are
    not searched again with memory priced: no price makes the program fit."""
    floor = memory_floor(mlp_graph.doc)
    assert floor > 0 and memory_floor(mlp_graph.doc, duplicas=2) > floor
    roomy = hapd.compile(mlp_graph, estimated_profile(2, flops=[1e10, 1e10]))
    capped = hapd.compile(mlp_graph, estimated_profile(2, flops=[1e10, 1e10], memory=0.6 * max(roomy.doc["baselines"]["dp_memory"])))
    for peaks in (roomy.estimate["memory"], capped.estimate["memory"], roomy.doc["baselines"]["dp_memory"]):
        assert sum(peaks) >= floor
    priced = []
    real = search.synthesize
    monkeypatch.setattr(search, "synthesize", lambda *a, **k: priced.append(a[5] if len(a) > 5 else k.get("memory_price"))
                        or real(*a, **k))
    with pytest.raises(SynthesisError, match="short"):
        hapd.compile(mlp_graph, estimated_profile(2, flops=[1e10, 1e10], memory=0.45 * floor),
                     CompileOptions(recompute="never"))
    assert priced and all(p is None for p in priced)
    priced.clear()
    with pytest.raises(SynthesisError, match="short"):  # above the floor: the priced searches run, and fail
        hapd.compile(mlp_graph, estimated_profile(2, flops=[1e10, 1e10], memory=0.55 * floor),
                     CompileOptions(recompute="never"))
    assert any(p is not None for p in priced)


def test_the_memory_price_ladder_stops_once_it_comes_no_closer(monkeypatch):
    """Searches with memory priced higher run while each comes closer to fitting; one
    that falls as short as the one before ends the ladder (the search has stopped
    moving), and the error is the ladder's as before."""
    profile = estimated_profile(2, flops=[1e10, 1e10], memory=1e6)
    scales: list[float | None] = []

    def never_fits(data, profile_, options, caps, price, recompute=(), weigh=None):
        scales.append(None if price is None else price[0])
        raise search._DoesNotFit({"steps": [], "n": len(scales)})

    # no closer; closer each time; no closer at the third; closer by less than 5%; fits at some
    # ratios, not the LP's (a higher price does not change the rounding)
    for shortfalls, searches in (([5.0, 5.0], 3), ([5.0, 4.0, 3.0, 2.0, 1.0], 6), ([5.0, 4.0, 4.0], 4),
                                 ([5.0, 4.9], 3), ([-1.0], 2)):
        left = list(shortfalls)
        scales.clear()
        monkeypatch.setattr(search, "_rounds", never_fits)
        monkeypatch.setattr(search, "_shortfall", lambda program, caps: left.pop(0))
        monkeypatch.setattr(search, "_no_fit_message", lambda tried, caps, profile_: f"none of {len(tried)} fits")
        monkeypatch.setattr(search, "_unfit_why", lambda program, caps, profile_: "short")
        with pytest.raises(SynthesisError, match=f"none of {searches} fits"):
            search._search_rounds(b"", profile, CompileOptions(), [1e6, 1e6])
        assert len(scales) == searches and scales[0] is None and all(s is not None for s in scales[1:])
