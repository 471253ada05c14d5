"""The profiler (hapd/profile/, ``hapd profile``); validation of a profile on load is
tests/profile/test_profile.py's.

Unit tests (fit, sizes, memory) run anywhere. The distributed ones start real ranks:
``hapd profile --quick`` on 2 local Gloo ranks; two ranks in two network namespaces
joined by ``bench/profiler.py``'s veth pair (root, ``ip netns``), which skips with the
reason when the machine cannot make it and always removes what it created. What the
profiler measures of known hardware (a halved CPU quota, a tc-limited link) is
``bench/profiler.py``'s to print: tests assert no speeds.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import _bench
import pytest
from _dist import run_ranks

from hapd.errors import OptionsError, ProfileError
from hapd.profile.schema import COLLECTIVES, UNITS, Profile, load_profile
from hapd.profile.fit import fit_alpha_beta
from hapd.profiler.machine import LINEAR_PROBE_LAYERS, host_memory, host_memory_size, host_name, linear_probe
from hapd.profiler.measure import (OP_PROBE_BLOCKS, SYNC_PROBE_MAX_ROWS, SyncProbe, _intra_groups, _rows_lasting, op_probe,
                                  overlap_share, pairs_per_host_pair, probe_ops)
from hapd.profile.options import ProfilerOptions, parse_size, parse_sizes
from hapd.profiler.driver import Rendezvous

bench = _bench.load("profiler")


# --------------------------------------------------------------------------
# Pieces
# --------------------------------------------------------------------------


def test_sizes_parse_in_binary_units():
    assert parse_size("4096") == 4096
    assert parse_size("4K") == parse_size("4KiB") == parse_size("4k") == 4096
    assert parse_size("16M") == parse_size("16MiB") == 16 * 2**20
    assert parse_sizes("4K, 64K,1M") == (4096, 65536, 2**20)
    with pytest.raises(OptionsError):
        parse_size("lots")
    with pytest.raises(OptionsError, match="two different sizes"):
        ProfilerOptions(sizes=(4096, 4096))
    with pytest.raises(OptionsError, match="window"):
        ProfilerOptions.quick(window_s=0)
    with pytest.raises(OptionsError, match="linear widths"):
        ProfilerOptions(linear_widths=(256, 0))
    with pytest.raises(OptionsError, match="linear rows"):
        ProfilerOptions(linear_rows=0)


def test_fit_recovers_alpha_and_beta():
    sizes = [4096 * 4**i for i in range(7)]
    exact = fit_alpha_beta(sizes, [50e-6 + s / 2e9 for s in sizes])
    assert exact.alpha == pytest.approx(50e-6)
    assert exact.beta == pytest.approx(2e9)
    assert exact.r2 == pytest.approx(1.0)
    assert exact.max_rel_error == pytest.approx(0.0, abs=1e-9)
    # ±10 % alternating noise: still close, and the fit quality says it is not exact
    noisy = fit_alpha_beta(sizes, [(50e-6 + s / 2e9) * (1.1 if i % 2 else 0.9) for i, s in enumerate(sizes)])
    assert noisy.alpha == pytest.approx(50e-6, rel=0.3)
    assert noisy.beta == pytest.approx(2e9, rel=0.15)
    assert 0.9 < noisy.r2 < 1.0
    # one size where most repeats were disturbed is left out, and said so
    spiked = [50e-6 + s / 2e9 for s in sizes]
    spiked[3] *= 8
    robust = fit_alpha_beta(sizes, spiked)
    assert robust.dropped == (sizes[3],)
    assert (robust.alpha, robust.beta) == (pytest.approx(50e-6), pytest.approx(2e9))
    assert fit_alpha_beta(sizes, spiked, reject_outliers=False).dropped == ()
    # a negative intercept is refitted through the origin
    through_origin = fit_alpha_beta([1000, 2000, 4000], [0.5e-6, 1.5e-6, 3.5e-6])
    assert through_origin.alpha == 0.0
    assert through_origin.beta > 0
    # times that do not grow with the size cannot give a bandwidth
    with pytest.raises(ProfileError) as info:
        fit_alpha_beta([1000, 2000, 4000], [3e-6, 2e-6, 1e-6], where="collectives.all_reduce.intra")
    assert info.value.field == "collectives.all_reduce.intra.beta"


def test_bounds_when_times_do_not_grow():
    """A link so fast that latency noise hides the transfer (times seen on throttled
    ranks over loopback): α and β are bounded instead of failing the whole profile."""
    from hapd.profile.fit import bound_alpha_beta

    sizes, times = [16384, 262144, 4194304], [7.59e-3, 2.87e-3, 3.54e-3]
    fit = bound_alpha_beta(sizes, times)
    assert fit.bound and fit.to_json()["bound"] is True
    assert fit.alpha == pytest.approx(2.87e-3)
    assert fit.beta == pytest.approx(4194304 / 3.54e-3)
    # never below any measured time at the largest size, never above the slowest call by more than α
    assert fit.alpha + 4194304 / fit.beta >= 3.54e-3
    assert all(fit.alpha + s / fit.beta <= max(times) + fit.alpha for s in sizes)
    assert "bound" not in fit_alpha_beta([1000, 2000, 4000], [2e-6, 3e-6, 5e-6]).to_json()


def _fake_machine_with_available(tmp_path, available_kb: int):
    """:func:`_fake_machine` (no cgroup limits) whose meminfo has a MemAvailable line."""
    proc, root = _fake_machine(tmp_path, v1_limit=None, v2_limit="max\n")
    (proc / "meminfo").write_text(f"MemTotal:       16384000 kB\nMemAvailable: {available_kb} kB\n")
    return proc, root


def _fake_machine(tmp_path: Path, *, v1_limit: str | None, v2_limit: str | None) -> tuple[Path, Path]:
    """A /proc and a / with a process in cgroup /job (v1 memory and v2), as files."""
    proc, root = tmp_path / "proc", tmp_path / "root"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text("MemTotal:       16384000 kB\nMemFree:  1 kB\n")
    (proc / "self" / "cgroup").write_text("4:memory:/job\n0::/job\n")
    (proc / "self" / "mountinfo").write_text(
        "30 25 0:26 / /sys/fs/cgroup/memory rw,relatime shared:9 - cgroup cgroup rw,memory\n"
        "31 25 0:27 / /sys/fs/cgroup/unified rw,relatime shared:10 - cgroup2 cgroup2 rw\n"
    )
    v1 = root / "sys/fs/cgroup/memory/job"
    v2 = root / "sys/fs/cgroup/unified/job"
    v1.mkdir(parents=True)
    v2.mkdir(parents=True)
    (root / "sys/fs/cgroup/memory/memory.limit_in_bytes").write_text("9223372036854771712\n")
    (root / "sys/fs/cgroup/unified/memory.max").write_text("max\n")
    if v1_limit is not None:
        (v1 / "memory.limit_in_bytes").write_text(v1_limit)
    if v2_limit is not None:
        (v2 / "memory.max").write_text(v2_limit)
    return proc, root


def test_memory_is_the_smallest_cgroup_limit_or_memtotal(tmp_path):
    total = 16384000 * 1024
    assert host_memory(*_fake_machine(tmp_path / "a", v1_limit=None, v2_limit="max\n")) == total
    assert host_memory(*_fake_machine(tmp_path / "b", v1_limit=f"{2**30}\n", v2_limit="max\n")) == 2**30
    assert host_memory(*_fake_machine(tmp_path / "c", v1_limit=f"{2**31}\n", v2_limit=f"{2**29}\n")) == 2**29
    assert 0 < host_memory() <= 2**50  # this machine


def test_memory_is_the_headroom_under_the_cgroup_limit(tmp_path):
    """A rank already using memory in its cgroup (torch itself) has only the rest."""
    proc, root = _fake_machine(tmp_path, v1_limit=f"{2**30}\n", v2_limit="max\n")
    (root / "sys/fs/cgroup/memory/job/memory.usage_in_bytes").write_text(f"{300 * 2**20}\n")
    assert host_memory(proc, root) == 2**30 - 300 * 2**20


def test_memory_is_capped_by_what_the_machine_has_available(tmp_path):
    assert host_memory(*_fake_machine_with_available(tmp_path, 1024)) == 1024 * 1024


def test_the_machines_size_is_the_limit_not_the_headroom(tmp_path):
    """``host_memory_size`` (a default profile's memory): the cgroup limit or MemTotal,
    whatever the cgroup and the machine use at the moment."""
    proc, root = _fake_machine(tmp_path / "a", v1_limit=f"{2**30}\n", v2_limit="max\n")
    (root / "sys/fs/cgroup/memory/job/memory.usage_in_bytes").write_text(f"{300 * 2**20}\n")
    assert host_memory_size(proc, root) == 2**30
    assert host_memory_size(*_fake_machine_with_available(tmp_path / "b", 1024)) == 16384000 * 1024


def test_the_op_probe_divides_by_the_ops_its_graph_runs():
    """``op_seconds`` divides a forward and backward of the probe's graph by 3 × its op
    nodes: each repeat of the mix is ten ops (linear, add, layer_norm, gelu, mul,
    transpose, matmul, softmax, matmul, reshape), then one sum; the weights are read by
    ``get_attr`` nodes, which are no ops."""
    import operator

    import torch
    import torch.nn.functional as F

    graph_module, x = op_probe(torch.device("cpu"), torch.float32)
    nodes = list(graph_module.graph.nodes)
    ops = [n for n in nodes if n.op not in ("placeholder", "output", "get_attr")]
    assert probe_ops(graph_module) == len(ops) == 10 * OP_PROBE_BLOCKS + 1
    assert sum(n.op == "get_attr" for n in nodes) == OP_PROBE_BLOCKS
    per_target = {t: sum(n.target == t for n in ops) for t in (F.linear, operator.add, F.layer_norm, F.gelu,
                                                                operator.mul, "transpose", torch.softmax, "reshape")}
    assert per_target == dict.fromkeys(per_target, OP_PROBE_BLOCKS)
    assert sum(n.target is operator.matmul for n in ops) == 2 * OP_PROBE_BLOCKS
    loss = graph_module(x)
    loss.backward()  # trainable weights: the probe times a backward too
    assert torch.isfinite(loss) and all(p.grad is not None for p in graph_module.parameters())


@pytest.mark.parametrize("width, rows", [(32, 8), (48, 5)])
def test_the_linear_probe_counts_the_flops_its_training_step_runs(width, rows):
    """``flops`` divides the probe's FLOPs by its time: 3 · 2 · rows · width² a layer, but
    the first layer's input gradient, must be what the step multiplies -- as torch's FLOP
    counter counts it."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    step, work = linear_probe(torch.device("cpu"), torch.float32, width, rows)
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    assert counter.get_total_flops() == work == 2 * rows * width * width * (3 * LINEAR_PROBE_LAYERS - 1)


def test_the_linear_probe_keeps_its_weights_within_its_memory_bound(monkeypatch):
    """A wide probe trains fewer layers, so weights and gradients stay under the bound
    (at least one layer)."""
    import torch

    from hapd.profiler import machine

    monkeypatch.setattr(machine, "LINEAR_PROBE_BYTES", 3 * 2 * 4 * 64 * 64)  # three layers' weights and grads
    assert linear_probe(torch.device("cpu"), torch.float32, 64, 4)[1] == 2 * 4 * 64 * 64 * (3 * 3 - 1)
    assert linear_probe(torch.device("cpu"), torch.float32, 512, 4)[1] == 2 * 4 * 512 * 512 * 2


def test_overlap_share_is_the_hidden_part_of_the_shorter_one():
    assert overlap_share(2.0, 1.0, 2.0) == 1.0  # the compute hid whole behind the collective
    assert overlap_share(1.0, 3.0, 3.0) == 1.0  # the collective hid whole behind the compute
    assert overlap_share(2.0, 1.0, 3.0) == 0.0  # one after the other
    assert overlap_share(2.0, 2.0, 3.0) == pytest.approx(0.5)
    assert overlap_share(2.0, 1.0, 3.5) == 0.0  # slower together than apart: clamped
    assert overlap_share(2.0, 1.0, 1.5) == 1.0  # faster together than alone (noise): clamped
    assert overlap_share(0.0, 1.0, 1.0) == 0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_sync_probe_fills_several_gradient_buckets(dtype):
    """The overlap probe's model gives ``GradSync`` at least four buckets of
    ``GRAD_BUCKET_BYTES``, so backward launches buckets while it still has work."""
    import torch

    from hapd._core import GRAD_BUCKET_BYTES

    probe = SyncProbe(torch.device("cpu"), getattr(torch, dtype), None, rows=2)  # no process group: no hooks
    assert sum(p.numel() * p.element_size() for p in probe.params) >= 4 * GRAD_BUCKET_BYTES
    assert len(probe.sync.buckets) >= 4
    assert all(isinstance(m, torch.nn.Linear) and m.bias is not None for m in probe.model[::2])


def test_the_sync_probe_batch_lasts_about_one_sync():
    """Rows from two timed steps fitted as a + b·rows; a flattened slope is capped at
    twice plain scaling; the result stays within [1, SYNC_PROBE_MAX_ROWS]."""
    assert _rows_lasting(0.1, {8: 0.01, 32: 0.02}) == 224  # on the line 0.01 s + (rows - 8) · 0.01/24 s
    assert _rows_lasting(0.1, {8: 0.019, 32: 0.02}) == 2 * 32 * 5  # near-flat: 2 x 32 rows x 0.1/0.02
    assert _rows_lasting(0.1, {8: 0.03, 32: 0.02}) == 32 * 5  # shrinking (noise): scaled
    assert _rows_lasting(0.001, {8: 0.01, 32: 0.02}) == 1  # a sync shorter than the fixed cost
    assert _rows_lasting(100.0, {8: 0.01, 32: 0.02}) == SYNC_PROBE_MAX_ROWS


def _fingerprint(params, seed: int) -> list[float]:
    """A linear fingerprint of each parameter's gradient: its dot product with fixed
    random weights (the same on every rank), so that sums over ranks carry over."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [float((p.grad.double() * torch.rand(p.shape, generator=gen, dtype=torch.float64)).sum())
            for p in params]


def _probe_sums(rank: int, world: int) -> dict[str, object]:
    """On every rank: the probe's gradients before and after a synced step, with a flat
    sync and with the two-level one of two hosts of two ranks (its leaders' helper
    thread); then η measured on the two-level sync."""
    import torch

    from hapd.profiler.measure import sync_overlap
    from hapd.spmd.collectives import host_groups

    two_level = host_groups([0, 0, 1, 1])
    assert two_level is not None
    out: dict[str, object] = {}
    for name, hosts in (("flat", None), ("two_level", two_level)):
        torch.manual_seed(rank)  # each rank its own weights and batch: the parts differ
        probe = SyncProbe(torch.device("cpu"), torch.float32, hosts, rows=3)
        probe.step(synced=False)
        local = _fingerprint(probe.params, seed=7)
        probe.step(synced=True)  # what the probe's T runs
        out[name] = (local, _fingerprint(probe.params, seed=7))
    out["eta"] = sync_overlap(torch.device("cpu"), torch.float32, hosts=two_level, window_s=0.05)
    return out


@pytest.mark.distributed
def test_the_sync_probe_sums_gradients_over_ranks():
    """The step the overlap probe times with the sync on really sums every gradient over
    the ranks, flat and in two levels: each rank ends with the sum of all ranks' local
    gradients (which differ, so a sync that did nothing would fail)."""
    ranks = run_ranks(4, _probe_sums, timeout=180)
    for name in ("flat", "two_level"):
        locals_ = [r[name][0] for r in ranks]
        assert locals_[0] != pytest.approx(locals_[1], rel=1e-3)
        total = [sum(parts) for parts in zip(*locals_)]
        for r in ranks:
            assert r[name][1] == pytest.approx(total, rel=1e-4, abs=1e-6), name
    assert all(0.0 <= r["eta"] <= 1.0 for r in ranks)


def test_links_measured_depend_on_the_hosts():
    assert _intra_groups(["a", "a"]) == ([[0, 1]], None)
    assert _intra_groups(["a", "a", "b", "b"]) == ([[0, 1], [2, 3]], None)
    assert _intra_groups(["a", "b"])[1] == "one rank per host"
    assert "different rank counts" in _intra_groups(["a", "a", "b"])[1]


def test_rendezvous_options():
    assert Rendezvous().torchrun_args() == ["--standalone"]
    two = Rendezvous(nnodes=2, node_rank=1, master_addr="10.0.0.1", master_port=1234)
    assert two.torchrun_args() == ["--nnodes=2", "--node-rank=1", "--master-addr=10.0.0.1", "--master-port=1234"]
    with pytest.raises(OptionsError, match="needs --master-addr"):
        Rendezvous(nnodes=2)
    with pytest.raises(OptionsError, match="--node-rank 2"):
        Rendezvous(nnodes=2, node_rank=2, master_addr="x")


def test_host_name_can_be_overridden(monkeypatch):
    monkeypatch.setenv("HAPD_HOST", "emu-a")
    assert host_name() == "emu-a"
    monkeypatch.delenv("HAPD_HOST")
    assert host_name() == socket.gethostname()


# --------------------------------------------------------------------------
# Measuring on real ranks
# --------------------------------------------------------------------------


def _check_measured(profile: Profile, *, kinds: set[str]) -> None:
    """Numbers a measured profile must have, whatever the machine."""
    assert profile.extra["tool"] == "hapd profile"
    assert profile.extra["units"] == UNITS
    datetime.datetime.fromisoformat(profile.extra["measured_at"])
    assert "measured by hapd profile" in profile.description
    for d in profile.devices:
        assert d.flops > 1e8, d
        assert d.elementwise_flops is not None and 1e6 < d.elementwise_flops < d.flops, d
        assert d.memory > 2**20, d
        assert d.op_seconds is not None and 1e-8 < d.op_seconds < 1e-2, d  # a small op: µs, not FLOPs
        assert d.sync_overlap is not None and 0.0 <= d.sync_overlap <= 1.0, d  # several ranks: measured
    assert set(profile.collectives) == {*COLLECTIVES, "p2p"}  # every collective, and one rank's message to another
    for name, links in profile.collectives.items():
        assert kinds <= set(links), name
        for kind in kinds:
            assert links[kind].alpha >= 0 and links[kind].beta > 0, (name, kind, links[kind])
        for kind, fit in profile.extra["fits"][name].items():  # the links that were measured
            assert (fit["alpha"], fit["beta"]) == (links[kind].alpha, links[kind].beta)
            assert fit["r2"] <= 1.0 and len(fit["median_s"]) == len(fit["bytes"]) >= 2
            assert all(t > 0 for t in fit["median_s"])


@pytest.mark.distributed
def test_hapd_profile_quick_on_two_ranks(tmp_path):
    out = tmp_path / "cpu.json"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "hapd.cli", "profile", "--quick", "--nproc-per-node", "2",
                           "--out", str(out), "--name", "cpu-test"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for i, name in enumerate(COLLECTIVES, 1):
        assert f"measuring {name} ({i}/{len(COLLECTIVES)}) …" in proc.stdout
    assert proc.stdout.count("measuring all_gather (1/7)") == 1  # rank 0 only
    assert proc.stdout.count("measuring p2p") == 1
    assert proc.stdout.count("measuring how much of a gradient all-reduce hides behind compute") == 1
    assert proc.stdout.count("of a gradient sum hidden behind compute") == 2  # the summary: both devices
    assert f"wrote {out}" in proc.stdout
    profile = load_profile(out, world_size=2)
    assert profile.name == "cpu-test"
    assert len(profile.hosts) == 1
    for device in profile.devices:  # each dtype's matmul rate, measured (a CPU's emulated fp16 is not)
        assert set(device.dtype_flops) == {"fp32", "bf16"}, device.dtype_flops
        assert device.dtype_flops["fp32"] == device.flops
        assert all(v is not None and v > 1e6 for v in device.dtype_flops.values())
    _check_measured(profile, kinds={"intra", "inter"})
    for links in profile.collectives.values():
        assert links["inter"] == links["intra"]  # one host: nothing crossed a host
        assert links["intra"].beta > 1e6  # loopback moves more than a MB/s


def test_bad_options_fail_before_starting_ranks(tmp_path):
    cmd = [sys.executable, "-m", "hapd.cli", "profile", "--sizes", "4K", "--out", str(tmp_path / "p.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "need two different sizes" in proc.stderr
    assert not (tmp_path / "p.json").exists()


# --- two hosts joined by a veth pair --------------------------------------------------


@pytest.fixture
def shaped_veth() -> Iterator[object]:
    """``bench/profiler.py``'s veth pair between this namespace and another, both ends
    shaped by tbf; skipped with the reason where it cannot be made."""
    try:
        with bench.shaped_veth() as link:
            yield link
    except bench.Unavailable as why:
        pytest.skip(str(why))


@pytest.mark.distributed
def test_profile_across_two_namespace_hosts(shaped_veth, tmp_path):
    """Two ranks, one per namespace, profile across the veth: one device per host, and
    only inter-host links measured. (What β the link's rate gives: ``bench/profiler.py``.)"""
    out = tmp_path / "emulated.json"
    runs = bench.profile_across(shaped_veth, out)
    assert [run.returncode for run in runs] == [0, 0], "\n".join(run.output for run in runs)
    profile = load_profile(out, world_size=2)
    assert profile.hosts == ["emu-a", "emu-b"]
    _check_measured(profile, kinds={"inter"})
    assert all("intra" not in links for links in profile.collectives.values())  # one rank per host
    assert "intra-host not measured (one rank per host)" in profile.description


def test_measure_link_retries_then_bounds(monkeypatch, capsys):
    import hapd.profiler.measure as prof

    bad = [(16384, 7.59e-3), (262144, 2.87e-3), (4194304, 3.54e-3)]
    good = [(16384, 1e-4), (262144, 3e-4), (4194304, 4e-3)]
    for answers, bounded in (([bad, good], False), ([bad, bad], True)):
        calls = iter(answers)
        monkeypatch.setattr(prof, "time_collective", lambda *a, **k: next(calls))
        fit = prof._measure_link("all_gather_grouped", "intra", None, prof.ProfilerOptions(), "cpu", 0)
        assert fit.bound is bounded
        assert next(calls, None) is None  # measured exactly twice
        out = capsys.readouterr().out
        assert "measuring again" in out
        assert ("using bounds" in out) is bounded


def test_p2p_bytes_count_the_pairs_sharing_a_host_pair() -> None:
    """The profile's p2p link is what one pair of hosts carries: two hosts with two
    ranks each send two messages between them at once, eight hosts with one rank each
    one message per host pair."""
    assert pairs_per_host_pair(["a", "a", "b", "b"]) == 2
    assert pairs_per_host_pair([f"h{i}" for i in range(8)]) == 1
    assert pairs_per_host_pair(["a", "a", "a", "b", "b", "b"]) == 3
    assert pairs_per_host_pair(["a", "a", "b", "b", "c", "c", "d", "d"]) == 2  # a→c and b→d, two each
    assert pairs_per_host_pair(["a"]) == 1
