"""A job given no profile plans for its devices as they are (:mod:`hapd.profiler.local`):
memory from the device (shared by the ranks on it), speed probed on CUDA and remembered
in ``$HAPD_HOME``, and never the estimated profile's invented 8 GiB."""

from __future__ import annotations

import json

import torch
from torch import nn

import hapd
from hapd.compiler.options import CompileOptions
from hapd.profiler import local
from hapd.profiler.local import CPU_FLOPS, LocalDevice, profile_of
from hapd.profiler.machine import host_memory, host_memory_size


def _cpu(host: str, memory: float = 16e9) -> LocalDevice:
    return LocalDevice(host, "cpu", "Some CPU", memory, CPU_FLOPS, False)


def test_ranks_on_one_host_share_its_memory() -> None:
    profile = profile_of([_cpu("a", 16 * 2**30), _cpu("a", 16 * 2**30), _cpu("b", 8 * 2**30)])
    assert [d.memory for d in profile.devices] == [8 * 2**30] * 3
    assert [d.host for d in profile.devices] == ["a", "a", "b"]
    assert [d.flops for d in profile.devices] == [CPU_FLOPS] * 3
    assert "estimated" in profile.description and "memory from the devices" in profile.description


def test_equal_gpus_of_a_host_get_its_first_ranks_speed() -> None:
    gpus = [LocalDevice("a", "cuda:0", "V100", 30e9, 5.0e12, True), LocalDevice("a", "cuda:1", "V100", 31e9, 5.2e12, True),
            LocalDevice("b", "cuda:0", "P100", 15e9, 2.0e12, True)]
    profile = profile_of(gpus)
    assert [d.flops for d in profile.devices] == [5.0e12, 5.0e12, 2.0e12]
    assert [d.memory for d in profile.devices] == [27 * 2**30, 28 * 2**30, 13.5 * 2**30]
    assert [d.model for d in profile.devices] == ["V100", "V100", "P100"]
    assert "speed measured" in profile.description
    assert [d.fused_attention for d in profile.devices] == [False] * 3  # not said: the math attention


def test_the_devices_say_whether_they_run_the_fused_attention_kernel(monkeypatch) -> None:
    """A CUDA device of compute capability ≥ 7.0 with Triton runs hapd's fused attention
    kernel, a P100 (6.0) and a CPU do not; the profile carries each device's answer."""
    from hapd.profiler import machine

    gpus = [LocalDevice("a", "cuda:0", "V100", 30e9, 5.0e12, True, True),
            LocalDevice("b", "cuda:0", "P100", 15e9, 2.0e12, True, False)]
    assert [d.fused_attention for d in profile_of(gpus).devices] == [True, False]
    assert local.describe_device(torch.device("cpu")).fused_attention is False
    assert [d.fused_attention for d in profile_of([_cpu("a")]).devices] == [False]
    assert machine.runs_fused_attention(torch.device("cpu")) is False
    capability = {0: (7, 0), 1: (6, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: capability[index])
    assert machine.runs_fused_attention(torch.device("cuda", 0)) is True
    assert machine.runs_fused_attention(torch.device("cuda", 1)) is False


def test_memory_is_coarse_so_the_profile_stays_put() -> None:
    """Free memory moving by megabytes leaves the profile (and its plan cache key) alone."""
    assert local.coarse_memory(20.3 * 2**30) == local.coarse_memory(20.1 * 2**30) == 20 * 2**30
    assert local.coarse_memory(79.1e9) == 72 * 2**30
    assert local.coarse_memory(79.1e9 + 300e6) == 72 * 2**30
    assert local.coarse_memory(3 * 2**20 + 5) == 3 * 2**20


def test_a_cpu_rank_describes_the_machines_memory_not_the_moments(monkeypatch) -> None:
    monkeypatch.setattr(local, "host_memory_size", lambda: 12 * 2**30)
    mine = local.describe_device(torch.device("cpu"))
    assert mine.memory == 12 * 2**30 and mine.slot == "cpu" and not mine.measured
    assert 0 < host_memory() <= host_memory_size()


def test_a_probed_speed_is_remembered_in_the_state_directory(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HAPD_HOME", str(tmp_path))
    probes = []
    monkeypatch.setattr(local, "linear_flops", lambda *a, **k: (probes.append(a) or 7.5e12, {}))
    assert local.cuda_speed("cuda", "H100") == 7.5e12
    assert local.cuda_speed("cuda", "H100") == 7.5e12
    assert len(probes) == 1
    assert json.loads((tmp_path / "devices.json").read_text()) == {"H100": 7.5e12}


class _Wide(nn.Module):
    """Four residual MLP blocks: at batch 2048 their activations outweigh the weights."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                                    for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x.pow(2).sum()


def test_a_plan_recomputes_only_where_the_devices_memory_binds() -> None:
    graph = hapd.lower(hapd.export(_Wide(), (torch.randn(2048, 256),)))
    roomy = hapd.compile(graph, profile_of([_cpu("a", 80e9)]), CompileOptions(memory_caps=True))
    assert not roomy.program.get("recompute")
    tight = hapd.compile(graph, profile_of([_cpu("a", 110e6)]), CompileOptions(memory_caps=True))
    assert tight.program.get("recompute")


def test_parallelize_without_a_profile_plans_for_this_device() -> None:
    torch.manual_seed(0)
    module = hapd.parallelize(_Wide(), (torch.randn(8, 256),), use_daemon=False, verbose=False)
    assert module.plan.key["profile_name"] == "local-1"
