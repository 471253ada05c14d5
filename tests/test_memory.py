"""The memory model: what lowering records as kept for backward, the live-bytes tracker
that measures it, and compiles that keep every device's peak under its memory."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hapd
from hapd import models
from hapd.compiler.driver import CompileOptions
from hapd.compiler.lower import lower
from hapd.errors import SynthesisError
from hapd.profile.schema import estimated_profile
from hapd.runtime.memtrack import LiveTensorBytes


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
