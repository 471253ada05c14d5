"""The profiler (hapd/profile/profiler.py, ``hapd profile``) and profile validation on load.

Unit tests (fit, sizes, memory, bad profiles) run anywhere. The distributed ones start
real ranks: ``hapd profile --quick`` on 2 local Gloo ranks; a rank in a cpu cgroup with
half a CPU's quota (root, cgroup cpu controller); two ranks in two network namespaces
across a ``tc``-limited veth pair (root, ``ip netns``). Those skip with the reason when
the machine cannot do them, and always remove what they created.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from hapd.errors import OptionsError, ProfileError
from hapd.profile.schema import COLLECTIVES, UNITS, Profile, load_profile, profile_from_dict
from hapd.profile.profiler import (ProfilerOptions, Rendezvous, _intra_groups, fit_alpha_beta, host_memory, host_name,
                           parse_size, parse_sizes)

REPO = Path(__file__).resolve().parent.parent
PROFILES = REPO / "profiles"


@pytest.fixture(scope="module")
def paper8() -> dict:
    return json.loads((PROFILES / "paper-8.json").read_text())


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
    from hapd.profile.profiler import bound_alpha_beta

    sizes, times = [16384, 262144, 4194304], [7.59e-3, 2.87e-3, 3.54e-3]
    fit = bound_alpha_beta(sizes, times)
    assert fit.bound and fit.to_json()["bound"] is True
    assert fit.alpha == pytest.approx(2.87e-3)
    assert fit.beta == pytest.approx(4194304 / 3.54e-3)
    # never below any measured time at the largest size, never above the slowest call by more than α
    assert fit.alpha + 4194304 / fit.beta >= 3.54e-3
    assert all(fit.alpha + s / fit.beta <= max(times) + fit.alpha for s in sizes)
    assert "bound" not in fit_alpha_beta([1000, 2000, 4000], [2e-6, 3e-6, 5e-6]).to_json()


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
# Validation on load
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["units"].update(bandwidth="elements/s"), "units.bandwidth"),
        (lambda d: d["units"].update(time="ms"), "units.time"),
        (lambda d: d["units"].update(speed="TFLOP/s"), "units.speed"),
        (lambda d: d["units"].update(size="MiB"), "units.size"),
        (lambda d: d["units"].update(energy="J"), "units.energy"),
        (lambda d: d.update(units="bytes"), "units"),
        (lambda d: d["collectives"].pop("broadcast"), "collectives.broadcast"),
        (lambda d: d["collectives"]["all_gather_grouped"].pop("inter"), "collectives.all_gather_grouped"),
        (lambda d: d["collectives"]["all_to_all"]["intra"].update(beta=-5.0), "collectives.all_to_all.intra.beta"),
        (lambda d: d["devices"][6].update(flops="3.8e12"), "devices[6].flops"),
        (lambda d: d["devices"][6].update(flops=None), "devices[6].flops"),
        (lambda d: d["devices"][2].update(elementwise_flops="fast"), "devices[2].elementwise_flops"),
    ],
)
def test_bad_profiles_name_the_field(paper8, edit, field):
    bad = copy.deepcopy(paper8)
    edit(bad)
    with pytest.raises(ProfileError) as info:
        profile_from_dict(bad)
    assert info.value.field == field
    assert field.split(".")[-1].split("[")[0] in str(info.value)


def test_units_may_be_partial_or_absent(paper8):
    partial = dict(copy.deepcopy(paper8), units={"bandwidth": "bytes/s"})
    absent = {k: v for k, v in paper8.items() if k != "units"}
    assert profile_from_dict(partial).profile_id == profile_from_dict(absent).profile_id


def test_device_count_must_match_the_job(paper8, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(paper8))
    assert load_profile(path, world_size=8).world == 8
    with pytest.raises(ProfileError, match="8 devices but the job has 2 ranks") as info:
        load_profile(path, world_size=2)
    assert info.value.field == "devices"


def test_profile_id_ignores_cosmetic_fields(paper8, tmp_path):
    base = profile_from_dict(paper8).profile_id
    cosmetic = copy.deepcopy(paper8)
    cosmetic.update(name="x", description="re-measured on Tuesday", measured_at="2031-01-01T00:00:00+00:00",
                    tool="hapd profile", fits={"all_reduce": {"inter": {"r2": 0.5}}})
    cosmetic["units"] = dict(reversed(list(UNITS.items())))
    path = tmp_path / "cosmetic.json"
    path.write_text(json.dumps({k: cosmetic[k] for k in reversed(list(cosmetic))}, indent=3))
    assert load_profile(path).profile_id == base
    assert load_profile(path).extra["measured_at"] == "2031-01-01T00:00:00+00:00"
    changed = copy.deepcopy(paper8)
    changed["devices"][0]["host"] = "elsewhere"
    assert profile_from_dict(changed).profile_id != base


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
    assert set(profile.collectives) == set(COLLECTIVES)
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
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hapd.cli", "profile", "--quick", "--nproc-per-node", "2",
                           "--out", str(out), "--name", "cpu-test"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for i, name in enumerate(COLLECTIVES, 1):
        assert f"measuring {name} ({i}/{len(COLLECTIVES)}) …" in proc.stdout
    assert proc.stdout.count("measuring all_gather (1/7)") == 1  # rank 0 only
    assert f"wrote {out}" in proc.stdout
    profile = load_profile(out, world_size=2)
    assert profile.name == "cpu-test"
    assert len(profile.hosts) == 1
    _check_measured(profile, kinds={"intra", "inter"})
    for links in profile.collectives.values():
        assert links["inter"] == links["intra"]  # one host: nothing crossed a host
        assert links["intra"].beta > 1e6  # loopback moves more than a MB/s
    assert took < 60, f"--quick took {took:.0f} s"


def test_bad_options_fail_before_starting_ranks(tmp_path):
    cmd = [sys.executable, "-m", "hapd.cli", "profile", "--sizes", "4K", "--out", str(tmp_path / "p.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "need two different sizes" in proc.stderr
    assert not (tmp_path / "p.json").exists()


# --- a halved CPU quota ---------------------------------------------------------------


@dataclass(frozen=True)
class CpuCgroup:
    """A child cpu cgroup; ``procs`` is where a pid is written to move a process in."""

    path: Path
    version: int

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"


def _cpu_hierarchy() -> tuple[Path, int] | None:
    """(mount point, version) of a cgroup hierarchy with the cpu controller, v2 first."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found: list[tuple[Path, int]] = []
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        point = Path(fields[4])
        if tail[0] == "cgroup2":
            try:
                if "cpu" in (point / "cgroup.controllers").read_text().split():
                    found.append((point, 2))
            except OSError:
                pass
        elif tail[0] == "cgroup" and "cpu" in tail[2].split(","):
            found.append((point, 1))
    return min(found, key=lambda f: -f[1]) if found else None


@pytest.fixture
def half_cpu_cgroup() -> Iterator[CpuCgroup]:
    """A cpu cgroup allowed 50 ms of CPU per 100 ms, with a high weight so that other
    work on the machine does not starve it below its quota; removed afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create a cgroup")
    hierarchy = _cpu_hierarchy()
    if hierarchy is None:
        pytest.skip("no cgroup hierarchy with the cpu controller is mounted")
    mount, version = hierarchy
    path = mount / f"hapd-test-{os.getpid()}"
    try:
        if version == 2:
            (mount / "cgroup.subtree_control").write_text("+cpu")
        path.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cpu cgroup under {mount}: {exc}")
    try:
        if version == 2:
            (path / "cpu.max").write_text("50000 100000")
            (path / "cpu.weight").write_text("10000")
        else:
            (path / "cpu.cfs_period_us").write_text("100000")
            (path / "cpu.cfs_quota_us").write_text("50000")
            (path / "cpu.shares").write_text("262144")
        yield CpuCgroup(path, version)
    finally:
        _remove_cgroup(path, mount)


def _remove_cgroup(path: Path, mount: Path) -> None:
    """Move any process left in ``path`` back to the top and remove it."""
    for _ in range(50):
        try:
            for pid in (path / "cgroup.procs").read_text().split():
                try:
                    (mount / "cgroup.procs").write_text(pid)
                except OSError:
                    pass
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"could not remove the test cgroup {path}")


_MATMUL_LOOP = """
import os, sys, torch
from hapd.profile.profiler import matmul_flops
torch.set_num_threads(1)
os.setpriority(os.PRIO_PROCESS, 0, -20)  # root: other work on the machine barely slows it
if len(sys.argv) > 1:
    open(sys.argv[1], "w").write(str(os.getpid()))  # moves every thread of this process
rate, _ = matmul_flops(torch.device("cpu"), torch.float32, (384,), repeats=3, window_s=0.6)
print(rate)
"""


def _single_thread_flops(procs: Path | None) -> float:
    cmd = [sys.executable, "-c", _MATMUL_LOOP, *([str(procs)] if procs else [])]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    return float(proc.stdout.split()[-1])


@pytest.mark.distributed
def test_half_cpu_quota_halves_measured_flops(half_cpu_cgroup):
    """A 50 % quota (50 ms per 100 ms period): the profiler's matmul rate, sampled over
    windows several periods long, halves. Expected ratio 0.5; accepted 0.35–0.65. Each
    side is the best of two alternating runs, so a burst of other load on the machine
    (which slows the free run too) does not decide the ratio."""
    free = limited = 0.0
    for _ in range(2):
        free = max(free, _single_thread_flops(None))
        limited = max(limited, _single_thread_flops(half_cpu_cgroup.procs))
    ratio = limited / free
    print(f"cgroup v{half_cpu_cgroup.version}: {limited:.3g} / {free:.3g} FLOP/s = {ratio:.2f}")
    assert 0.35 < ratio < 0.65, f"quota-limited {limited:.3g} vs free {free:.3g} FLOP/s: ratio {ratio:.2f}"


# --- a tc-limited link between two namespaces -------------------------------------------


RATE_BYTES_S = 100e6 / 8
"""The emulated link: ``tbf rate 100mbit``, each direction."""


@dataclass(frozen=True)
class VethLink:
    """Two emulated hosts: this namespace (``a``) and ``ns`` (``b``) joined by a veth."""

    ns: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


@pytest.fixture
def shaped_veth() -> Iterator[VethLink]:
    """A network namespace joined to this one by a veth pair, both ends shaped to
    100 Mbit/s by tbf; deleted afterwards (deleting the namespace deletes its end, and
    with it the pair and both qdiscs)."""
    if os.geteuid() != 0:
        pytest.skip("needs root for network namespaces and tc")
    if shutil.which("ip") is None or shutil.which("tc") is None:
        pytest.skip("needs iproute2 (ip, tc)")
    tag = os.getpid() % 100000
    subnet = 10 + tag % 200  # a private /24 per test process: 10.233.N.0/24
    link = VethLink(ns=f"hapd-tc-{tag}", dev_a=f"hpd{tag}a", dev_b=f"hpd{tag}b",
                 addr_a=f"10.233.{subnet}.1", addr_b=f"10.233.{subnet}.2")
    made = _ip("netns", "add", link.ns, check=False)
    if made.returncode != 0:
        pytest.skip(f"ip netns add failed: {made.stderr.strip()}")
    try:
        steps = [
            ["ip", "link", "add", link.dev_a, "type", "veth", "peer", "name", link.dev_b],
            ["ip", "link", "set", link.dev_b, "netns", link.ns],
            ["ip", "addr", "add", f"{link.addr_a}/24", "dev", link.dev_a],
            ["ip", "link", "set", link.dev_a, "up"],
            ["ip", "-n", link.ns, "addr", "add", f"{link.addr_b}/24", "dev", link.dev_b],
            ["ip", "-n", link.ns, "link", "set", link.dev_b, "up"],
            ["ip", "-n", link.ns, "link", "set", "lo", "up"],
        ]
        for dev, prefix in ((link.dev_a, []), (link.dev_b, ["ip", "netns", "exec", link.ns])):
            steps.append([*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", "100mbit",
                          "burst", "32kbit", "latency", "400ms"])
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, timeout=30)
            if done.returncode != 0:
                pytest.skip(f"{' '.join(step)} failed: {done.stderr.strip()}")
        yield link
    finally:
        _ip("link", "del", link.dev_a, check=False)
        _ip("netns", "del", link.ns, check=False)
        assert link.ns not in _ip("netns", "list").stdout


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return s.getsockname()[1]


@pytest.mark.distributed
def test_tc_limited_link_measures_its_rate(shaped_veth, tmp_path):
    """Two ranks, one per namespace, profile across the shaped veth: R = 12.5 MB/s each
    way. β counts bytes of the full tensor (B) per second, so for 2 ranks:

    * broadcast sends B one way: t ≈ B/R, β ≈ R;
    * all-reduce (Gloo's ring: reduce-scatter, then all-gather of the halves) sends B/2
      twice each way, both ways at once: t ≈ B/R, β ≈ R;
    * all-gather sends B/2 each way: β ≈ 2R if both ways overlap fully, R if they take
      turns; Gloo's TCP pairs overlap them only in part (measured here ≈ 1.2–1.4 R);
    * all-to-all sends B/4 each way: β ≈ 4R overlapped, 2R in turns (measured ≈ 1.9 R).

    TCP/IP and Ethernet headers take ~4 % of the line rate. Accepted: 0.7–1.1 × the
    expected rate, the range spanning both for all-gather and all-to-all."""
    link, out = shaped_veth, tmp_path / "emulated.json"
    port = _free_port(link.addr_a)
    args = [sys.executable, "-m", "hapd.profiler", "--quick", "--sizes", "64K,256K,1M", "--repeats", "3",
            "--out", str(out), "--name", "emulated-2"]
    common = {**os.environ, "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
              "MASTER_ADDR": link.addr_a, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    ranks = [
        subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**common, "RANK": "0", "HAPD_HOST": "emu-a", "GLOO_SOCKET_IFNAME": link.dev_a}),
        subprocess.Popen(["ip", "netns", "exec", link.ns, *args], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True,
                         env={**common, "RANK": "1", "HAPD_HOST": "emu-b", "GLOO_SOCKET_IFNAME": link.dev_b}),
    ]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in ranks] == [0, 0], "\n".join(outputs)
    profile = load_profile(out, world_size=2)
    assert profile.hosts == ["emu-a", "emu-b"]
    _check_measured(profile, kinds={"inter"})
    assert all("intra" not in links for links in profile.collectives.values())  # one rank per host
    assert "intra-host not measured (one rank per host)" in profile.description
    beta = {name: profile.collectives[name]["inter"].beta / RATE_BYTES_S for name in COLLECTIVES}
    print("β / R: " + ", ".join(f"{name} {ratio:.2f}" for name, ratio in beta.items()))
    assert 0.7 < beta["broadcast"] < 1.1
    assert 0.7 < beta["all_reduce"] < 1.1
    assert 0.7 < beta["all_gather"] < 2.2
    assert 1.4 < beta["all_to_all"] < 4.4


def test_measure_link_retries_then_bounds(monkeypatch, capsys):
    import hapd.profile.profiler as prof

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
