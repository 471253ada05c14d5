"""The daemon end to end: a real ``hapd serve`` process, a real drop folder, real
sockets on loopback (DESIGN.md §3 "Daemon")."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from _daemon import DaemonProcess, drop
from _wait import GENEROUS_S, wait_for

from hapd.serve.cache import CacheKey, PlanCache, _parse_header
from hapd.wire.client import Client, DaemonTimeout
from hapd.errors import RemoteError
from hapd.compiler.plan import Plan
from hapd.serve.daemon import message_body_bytes
from hapd.wire.protocol import MAGIC, Session

pytestmark = pytest.mark.daemon

ROOT = Path(__file__).resolve().parents[2]


MAX_REQUEST = 4 * 2**20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProcess(tmp_path_factory.mktemp("hapd"), "--max-request-bytes", str(MAX_REQUEST), "--slots", "4").start()
    yield d
    if d.proc.poll() is None:
        assert d.stop() == 0, d.log()
    assert "stopped" in d.log()


@pytest.fixture(scope="module")
def mlp_pt2(tmp_path_factory) -> bytes:
    import hapd.models as models
    from hapd.ir.export import export

    spec = models.get("mlp")
    model, config = models.build("mlp", "tiny")
    path = tmp_path_factory.mktemp("pt2") / "mlp.pt2"
    export(model, spec.example_inputs(config, 2), path=path, batch_dims=spec.batch_dims, name="mlp")
    return path.read_bytes()


# ----------------------------------------------------------------------------- drop folder


def test_drop_to_plan_and_cache_hit(daemon, fixture_bytes):
    drop(daemon.watch, "first.hapg", fixture_bytes["bert"])
    plan_path = wait_for(lambda: (daemon.watch / "out" / "first.hplan").exists() and daemon.watch / "out" / "first.hplan", 60, "the plan")
    plan = Plan.load(plan_path)
    assert plan.key["profile_name"] == "paper-8" and len(plan.ratios) == 8
    report = (daemon.watch / "out" / "first.report.txt").read_text()
    assert "served:    cache miss" in report and "estimated per iteration" in report
    wait_for(lambda: (daemon.watch / "done" / "first.hapg").exists(), 10, "the drop to be moved to done/")
    assert not (daemon.watch / "first.hapg").exists()
    daemon.wait_log(r"drop first\.hapg → out/first\.hplan \(cache miss")

    drop(daemon.watch, "second.hapg", fixture_bytes["bert"], staging=True)  # the same graph again
    daemon.wait_log(r"drop second\.hapg → out/second\.hplan \(cache hit")
    assert Plan.load(daemon.watch / "out" / "second.hplan").doc == plan.doc


def test_the_log_is_the_owners_alone(daemon):
    """``logs/daemon.log`` is created 0600 in a 0700 folder, whatever the umask."""
    import stat

    assert stat.S_IMODE((daemon.home / "logs" / "daemon.log").stat().st_mode) == 0o600
    assert stat.S_IMODE((daemon.home / "logs").stat().st_mode) == 0o700


def test_a_rename_from_incoming_is_handed_over_without_settling(tmp_path):
    """A rename into the folder is complete by construction: it is handed over on its
    event, not after the settle time or at the next rescan (both an hour here)."""
    from hapd.serve.watch import INCOMING, DropWatcher

    (tmp_path / INCOMING).mkdir()
    ready = []
    watcher = DropWatcher(tmp_path, ready.append, settle_s=3600, fallback_s=3600, rescan_s=3600)
    watcher.start()
    try:
        path = drop(tmp_path, "net.hapg", b"graph", staging=True)
        wait_for(lambda: ready, GENEROUS_S, "the renamed drop to be handed over")
    finally:
        watcher.stop()
    assert [d.path for d in ready] == [path]


def test_pt2_drop_is_lowered_once(daemon, mlp_pt2):
    drop(daemon.watch, "net.pt2", mlp_pt2)
    daemon.wait_log(r"drop net\.pt2 → out/net\.hplan \(cache (miss|hit)", timeout=60)
    drop(daemon.watch, "net_again.pt2", mlp_pt2)
    daemon.wait_log(r"drop net_again\.pt2 → out/net_again\.hplan \(cache hit")
    assert Plan.load(daemon.watch / "out" / "net.hplan").doc == Plan.load(daemon.watch / "out" / "net_again.hplan").doc


def test_bad_files_give_error_files_and_the_daemon_keeps_serving(daemon, fixture_bytes, mlp_pt2):
    bad = {
        "garbage.hapg": fixture_bytes["garbage"],
        "truncated.hapg": fixture_bytes["truncated"],
        "wrong_version.hapg": fixture_bytes["wrong_version"],
        "empty.hapg": b"",
        "junk.pt2": os.urandom(3000),
        "half.pt2": mlp_pt2[: len(mlp_pt2) // 2],
    }
    for name, data in bad.items():
        drop(daemon.watch, name, data)
    for name in bad:
        error = wait_for(lambda n=name: (daemon.watch / "failed" / f"{n}.error").exists(), 60, f"{name}.error")
        assert error
        text = (daemon.watch / "failed" / f"{name}.error").read_text()
        assert text.startswith(f"{name}: ") and "Error" in text, text
        wait_for(lambda n=name: (daemon.watch / "failed" / n).exists() and not (daemon.watch / n).exists(), 10, f"{name} moved aside")
    assert "version" in (daemon.watch / "failed" / "wrong_version.hapg.error").read_text()
    assert "empty" in (daemon.watch / "failed" / "empty.hapg.error").read_text()
    with daemon.client() as client:
        assert client.ping()["profile_name"] == "paper-8"
    drop(daemon.watch, "after_bad.hapg", fixture_bytes["mlp"])
    daemon.wait_log(r"drop after_bad\.hapg → out/after_bad\.hplan")


def test_a_burst_of_100_drops_gives_100_plans(daemon, fixture_bytes):
    names = [f"burst_{i:03d}.hapg" for i in range(100)]
    for i, name in enumerate(names):
        drop(daemon.watch, name, fixture_bytes["mlp"], staging=i % 2 == 0)
    out = daemon.watch / "out"
    wait_for(lambda: all((out / f"{n[:-5]}.hplan").exists() for n in names), 90, "100 plans", interval=0.1)
    wait_for(lambda: all((daemon.watch / "done" / n).exists() for n in names), 10, "100 drops done")
    assert not any((daemon.watch / "failed" / f"{n}.error").exists() for n in names)
    log = daemon.log()
    assert sum(f"drop {n} → " in log for n in names) == 100


def test_a_slowly_written_file_is_not_read_early(daemon, fixture_bytes):
    data = fixture_bytes["vit"]
    path = daemon.watch / "slow.hapg"
    with path.open("wb") as handle:  # written in place, not atomically
        handle.write(data[: len(data) // 3])
        handle.flush()
        time.sleep(0.8)  # well past the settle time, but the file is still open
        handle.write(data[len(data) // 3 : 2 * len(data) // 3])
        handle.flush()
        time.sleep(0.8)
        assert not (daemon.watch / "failed" / "slow.hapg.error").exists()
        assert not (daemon.watch / "out" / "slow.hplan").exists()
        assert "slow.hapg" not in daemon.log()
        handle.write(data[2 * len(data) // 3 :])
    daemon.wait_log(r"drop slow\.hapg → out/slow\.hplan")
    assert not (daemon.watch / "failed" / "slow.hapg.error").exists()


# ----------------------------------------------------------------------------- the API


def test_compile_api_hit_miss_lp_only_and_errors(daemon, fixture_bytes, mlp_pt2):
    graph = fixture_bytes["llama_block"]
    paper16 = json.loads((ROOT / "profiles" / "paper-16.json").read_text())
    with daemon.client() as client:
        data, path = client.compile(graph, "hapg")
        assert path == "miss" and Plan.from_bytes(data).key["profile_name"] == "paper-8"
        assert client.compile(graph, "hapg") == (data, "hit")
        data16, path16 = client.compile(graph, "hapg", profile=paper16)
        assert path16 == "lp-only" and len(Plan.from_bytes(data16).ratios) == 16
        assert client.compile(graph, "hapg", profile=paper16)[1] == "hit"
        assert client.compile(graph, "hapg", options={"zero": True})[1] == "miss"
        pt2_plan, _ = client.compile(mlp_pt2, "pt2")  # lowered by the daemon (or from its cache)
        assert client.compile(mlp_pt2, "pt2") == (pt2_plan, "hit")
        with pytest.raises(RemoteError, match="GraphFormatError"):
            client.compile(fixture_bytes["garbage"], "hapg")
        with pytest.raises(RemoteError, match="GraphFormatError: the .pt2 file: not a torch.export program"):
            client.compile(b"PK\x03\x04 not a zip", "pt2")
        with pytest.raises(RemoteError, match="graph_kind 'onnx'"):
            client.compile(graph, "onnx")
        with pytest.raises(RemoteError, match="ProtocolError: shutdown: unknown field 'now'"):
            unchecked_request(daemon, "shutdown", {"now": True})  # nothing happens: the daemon still answers below
        with pytest.raises(RemoteError, match="OptionsError.*unknown compile option 'speed'"):
            client.compile(graph, "hapg", options={"speed": 11})
        with pytest.raises(RemoteError, match="ProfileError"):
            client.compile(graph, "hapg", profile={"format": "hapd.profile"})
        status = client.status()
        assert status["cache"]["entries"] >= 3 and status["cache"]["lp_only"] >= 1
        assert status["cache"]["hits"] >= 2
        pong = client.ping()
        assert pong["protocol"] == 1 and pong["slots"] == 4 and pong["jobs"] == 0


def unchecked_request(daemon: DaemonProcess, mtype: str, body: dict) -> dict:
    """Send a correctly signed request whose body the client would refuse to build;
    raise RemoteError for an error reply like the client does."""
    session = Session(bytes.fromhex((daemon.home / "key").read_text().strip()))
    header = msgpack.packb({"id": os.urandom(16).hex(), "type": mtype, "time": time.time(), "session": session.session})
    payload = msgpack.packb(body)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(daemon.address)
        sock.send_multipart([MAGIC, b"1", session.sign(b"1", header, payload), header, payload])
        assert sock.poll(5000), "no reply"
        reply = session.decode(sock.recv_multipart(), reply=True)
    finally:
        sock.close()
    if reply.type == "error":
        raise RemoteError(f"{reply.body['kind']}: {reply.body['message']}")
    return reply.body


def _maps_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's library mapped (has imported torch)."""
    return "libtorch_cpu" in Path(f"/proc/{pid}/maps").read_text()


def test_a_daemon_without_preload_imports_the_compiler_on_the_first_compile(tmp_path, mlp_pt2):
    """``--no-preload``: the daemon answers without torch loaded; the first compile (a
    .pt2, lowered by the daemon) imports it and succeeds. The module's daemon preloads
    (the default): torch is loaded before any compile asks for it."""
    d = DaemonProcess(tmp_path / "hapd", "--no-preload").start()
    try:
        with d.client() as client:
            assert client.ping()  # answering
            time.sleep(1.0)  # a preloading daemon has torch loaded by now
            assert not _maps_torch(d.proc.pid)
            plan, origin = client.compile(mlp_pt2, "pt2")
            assert plan and origin == "miss" and _maps_torch(d.proc.pid)
    finally:
        assert d.stop() == 0, d.log()
    fresh = DaemonProcess(tmp_path / "preloaded").start()
    try:
        wait_for(lambda: _maps_torch(fresh.proc.pid), GENEROUS_S, "the preloading daemon to import torch")
    finally:
        assert fresh.stop() == 0, fresh.log()


def test_no_daemon_times_out_naming_the_address(daemon):
    with socket_port() as port:
        with Client(f"tcp://127.0.0.1:{port}", daemon.home / "key", timeout_s=0.5) as client:
            with pytest.raises(DaemonTimeout, match=rf"no daemon answered at tcp://127\.0\.0\.1:{port} within 0\.5 s"):
                client.ping()


class socket_port:
    """A TCP port on loopback that nothing listens on (held while in use)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_protocol_rejections_against_the_live_daemon(daemon):
    key = (daemon.home / "key").read_text().strip()
    good = Session(bytes.fromhex(key))
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(daemon.address)

    def exchange(frames: list[bytes], wait: float = 0.6) -> list[bytes] | None:
        sock.send_multipart(frames)
        if sock.poll(int(wait * 1000)):
            return sock.recv_multipart()
        return None

    log_start = len(daemon.log())
    try:
        # a valid ping is answered
        _, ping = good.encode("ping")
        assert good.decode(exchange(ping), reply=True).type == "pong"
        # ... but not twice
        assert exchange(ping) is None
        # wrong key: nothing happens, even for shutdown and launch
        wrong = Session(os.urandom(32))
        assert exchange(wrong.encode("shutdown")[1]) is None
        launch = {"job": "evil", "script": "x.py", "script_bytes": b"import os", "args": [], "env": {}, "nproc": 1, "node_rank": 0,
                  "nnodes": 1, "rank_offset": 0, "world_size": 1, "master_addr": "127.0.0.1", "master_port": 29400}
        assert exchange(wrong.encode("launch", launch)[1]) is None
        # a flipped byte in a correctly signed shutdown
        _, frames = good.encode("shutdown")
        frames[3] = frames[3][:-1] + bytes([frames[3][-1] ^ 1])
        assert exchange(frames) is None
        # wrong protocol version
        _, frames = good.encode("ping")
        frames[1] = b"2"
        frames[2] = good.sign(b"2", frames[3], frames[4])
        assert exchange(frames) is None
        # oversized frame (over one message's body limit: a larger request comes in parts)
        _, frames = good.encode("compile", {"graph": b"\0" * (message_body_bytes(MAX_REQUEST) + 10), "graph_kind": "hapg"})
        assert exchange(frames) is None
        # malformed (an unsigned header is never decoded: the signature is checked first)
        assert exchange([b"hello"]) is None
        assert exchange([MAGIC, b"1", b"x" * 64, b"\xc1", b"\x80"]) is None
        # an authentic request of an unknown type gets an error and does nothing
        header = msgpack.packb({"id": os.urandom(16).hex(), "type": "rm_rf", "time": time.time(), "session": good.session})
        reply = exchange([MAGIC, b"1", good.sign(b"1", header, b"\x80"), header, b"\x80"])
        assert reply is not None
        error = good.decode(reply, reply=True)
        assert error.type == "error" and error.body["kind"] == "ProtocolError" and "rm_rf" in error.body["message"]
    finally:
        sock.close()
    log = daemon.log()[log_start:]
    for reason in ("replayed message", "bad signature", "protocol version '2'", "oversized body", "not a hapd message"):
        assert re.search(rf"rejected a message from 127\.0\.0\.1: \w+Error: .*{reason}", log), reason
    assert log.count("bad signature") == 4
    assert "unknown request type 'rm_rf'" in log
    with daemon.client() as client:  # still serving, and nothing happened
        assert client.ping()["jobs"] == 0
        assert all(j["job"] != "evil" for j in client.status()["jobs"])


# ----------------------------------------------------------------------------- jobs

ENV_SCRIPT = textwrap.dedent(
    """
    import os, sys
    names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
             "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "HAPD_DAEMON", "HAPD_JOB", "EXTRA"]
    print(" ".join(f"{n}={os.environ.get(n)}" for n in names))
    print("to stderr", file=sys.stderr)
    print("args", *sys.argv[1:])
    """
)


def collect(client: Client, job: str, timeout: float = 30.0) -> list[dict]:
    events, after = [], 0
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch, done = client.job_events(job, after)
        events += batch
        after = batch[-1]["seq"] if batch else after
        if done:
            return events
        time.sleep(0.05)
    raise AssertionError(f"job {job} did not finish: {events}")


def test_launch_gives_ranks_torchrun_env_and_streams_output(daemon):
    with daemon.client() as client:
        pids = client.launch("envjob", "show_env.py", script_bytes=ENV_SCRIPT.encode(), nproc=2, world_size=4, rank_offset=2,
                             node_rank=1, nnodes=2, master_addr="10.0.0.1", master_port=29999, args=["--x", "1"], env={"EXTRA": "yes"})
        assert len(pids) == 2
        events = collect(client, "envjob")
        status = client.job_status("envjob")
    assert status["state"] == "exited" and [r["returncode"] for r in status["ranks"]] == [0, 0]
    assert [r["rank"] for r in status["ranks"]] == [2, 3] and [r["pid"] for r in status["ranks"]] == pids
    lines = {(e["rank"], e["stream"]): [] for e in events}
    for e in events:
        lines[(e["rank"], e["stream"])].append(e["line"])
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    for local, rank in enumerate((2, 3)):
        env = dict(item.split("=", 1) for item in lines[(rank, "stdout")][0].split())
        assert env == {
            "RANK": str(rank), "LOCAL_RANK": str(local), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1",
            "GROUP_WORLD_SIZE": "2", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": "4", "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "envjob", "HAPD_DAEMON": daemon.address, "HAPD_JOB": "envjob", "EXTRA": "yes",
        }
        assert lines[(rank, "stdout")][1] == "args --x 1"
        assert lines[(rank, "stderr")] == ["to stderr"]
        assert lines[(rank, "exit")] == ["0"]


SWITCH_SCRIPT = textwrap.dedent(
    """
    import os, json
    gen = int(os.environ.get("HAPD_GENERATION") or 0)
    print("gen", gen, "pid", os.getpid(), "rank", os.environ["RANK"], "world", os.environ["WORLD_SIZE"],
          "port", os.environ["MASTER_PORT"], "extra", os.environ.get("EXTRA"), flush=True)
    if gen == 0:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
    """
)


def test_an_in_place_rank_parks_and_goes_on_where_a_switch_says(daemon):
    """Under the in-place runner a rank whose peer went away (Gloo's error) parks; the
    ``switch`` request sends it to the next generation in its own process: torchrun's
    variables and the order's env set, its events renumbered. A switch is refused for a
    job not launched in place, and to a generation not after the last."""
    with daemon.client() as client:
        client.launch("inplace", "sw.py", script_bytes=SWITCH_SCRIPT.encode(), nproc=2, world_size=4, rank_offset=2,
                      node_rank=1, nnodes=2, master_addr="127.0.0.1", master_port=29990, in_place=True,
                      env={"HAPD_ELASTIC_RUN": "inplace-run"})
        order = dict(generation=1, node_rank=0, nnodes=1, rank_offset=0, world_size=2, master_addr="127.0.0.1",
                     master_port=29991, env={"EXTRA": "g1", "HAPD_GENERATION": "1"})
        with pytest.raises(RemoteError, match="do not fit world_size"):
            client.job_switch("inplace", **{**order, "world_size": 1})
        wait_for(lambda: sum('"event": "parked"' in e["line"] for e in client.job_events("inplace", 0)[0]) == 2,
                 GENEROUS_S, "both ranks to park")
        pids = [r["pid"] for r in client.job_status("inplace")["ranks"]]
        client.job_switch("inplace", **order)
        with pytest.raises(RemoteError, match="already went to generation 1"):
            client.job_switch("inplace", **order)
        events = collect(client, "inplace", timeout=GENEROUS_S)
        status = client.job_status("inplace")
        with pytest.raises(RemoteError, match="not launched in place"):
            client.launch("plain", "x.py", script_bytes=b"import time; time.sleep(30)\n", nproc=1, world_size=1,
                          master_addr="h", master_port=1)
            client.job_switch("plain", **order)
        client.cancel("plain")
    assert status["state"] == "exited" and status["switch"]["generation"] == 1, status
    assert status["switch"]["nproc"] == 2 and status["switch"]["kept"] == [0, 1], status
    assert [r["pid"] for r in status["ranks"]] == pids and [r["rank"] for r in status["ranks"]] == [0, 1]
    said = [e for e in events if e["stream"] == "stdout" and e["line"].startswith("gen ")]
    before = {e["rank"]: e["line"].split() for e in said if e["line"].startswith("gen 0")}
    after = {e["rank"]: e["line"].split() for e in said if e["line"].startswith("gen 1")}
    assert [before[r][4:] for r in (2, 3)] == [["rank", "2", "world", "4", "port", "29990", "extra", "None"],
                                               ["rank", "3", "world", "4", "port", "29990", "extra", "None"]]
    assert [after[r][4:] for r in (0, 1)] == [["rank", "0", "world", "2", "port", "29991", "extra", "g1"],
                                              ["rank", "1", "world", "2", "port", "29991", "extra", "g1"]]
    assert [after[r][3] for r in (0, 1)] == [before[r][3] for r in (2, 3)]  # the same processes
    parked = [json.loads(e["line"]) for e in events if '"event": "parked"' in e["line"]]
    assert sorted(p["rank"] for p in parked) == [2, 3] and all("Connection closed by peer" in p["cause"] for p in parked)
    left = [json.loads(e["line"]) for e in events if '"event": "left_group"' in e["line"]]
    assert sorted(p["rank"] for p in left) == [2, 3] and all(p["seconds"] >= 0 for p in left)


def test_launch_errors_failure_propagation_and_cancel(daemon, tmp_path):
    with daemon.client() as client:
        with pytest.raises(RemoteError, match="OptionsError.*do not fit world_size"):
            client.launch("bad", "x.py", script_bytes=b"", nproc=2, world_size=2, rank_offset=1, master_addr="h", master_port=1)
        with pytest.raises(RemoteError, match="not a file on this host"):
            client.launch("bad", "no_such_script.py", nproc=1, world_size=1, master_addr="h", master_port=1, cwd=str(tmp_path))
        with pytest.raises(RemoteError, match="no job 'nope'"):
            client.job_status("nope")

        # one local rank fails: the other is stopped, the job failed
        fail = "import os, sys, time\nif os.environ['LOCAL_RANK'] == '1': sys.exit(3)\ntime.sleep(60)\n"
        client.launch("failjob", "fail.py", script_bytes=fail.encode(), nproc=2, world_size=2, master_addr="127.0.0.1", master_port=29998)
        collect(client, "failjob", timeout=30)
        status = client.job_status("failjob")
        assert status["state"] == "failed"
        assert status["ranks"][1]["returncode"] == 3 and status["ranks"][0]["returncode"] == -signal.SIGTERM

        # cancel kills the whole process tree of each rank
        tree = "import subprocess, sys, time\np = subprocess.Popen(['sleep', '60'])\nprint(p.pid, flush=True)\ntime.sleep(60)\n"
        client.launch("treejob", "tree.py", script_bytes=tree.encode(), nproc=1, world_size=1, master_addr="127.0.0.1", master_port=29997)
        child = int(wait_for(lambda: [e for e in client.job_events("treejob", 0)[0] if e["stream"] == "stdout"], 30, "the child pid")[0]["line"])
        client.cancel("treejob")
        collect(client, "treejob", timeout=15)
        assert client.job_status("treejob")["state"] == "cancelled"
        wait_for(lambda: not _alive(child), 10, "the grandchild to be killed")

        # a delayed start can be cancelled before it starts
        assert client.launch("later", "x.py", script_bytes=b"pass\n", nproc=1, world_size=1, master_addr="h", master_port=1, start_at=time.time() + 30) == []
        assert client.job_status("later")["state"] == "starting"
        client.cancel("later")
        assert client.job_status("later")["state"] == "cancelled"


def test_a_launch_past_the_slots_is_refused(daemon):
    """The daemon has 4 slots: 5 ranks are refused; with 3 running, 2 more are refused
    and 1 fits (counted and taken under one lock, so concurrent launches cannot both pass)."""
    sleep = b"import time\ntime.sleep(60)\n"
    with daemon.client() as client:
        with pytest.raises(RemoteError, match="4 rank slot\\(s\\), 0 in use: no room for 5"):
            client.launch("five", "s.py", script_bytes=sleep, nproc=5, world_size=5, master_addr="h", master_port=1)
        client.launch("three", "s.py", script_bytes=sleep, nproc=3, world_size=3, master_addr="h", master_port=1)
        try:
            with pytest.raises(RemoteError, match="3 in use: no room for 2"):
                client.launch("two", "s.py", script_bytes=sleep, nproc=2, world_size=2, master_addr="h", master_port=1)
            client.launch("one", "s.py", script_bytes=sleep, nproc=1, world_size=1, master_addr="h", master_port=1)
            client.cancel("one")
        finally:
            client.cancel("three")
        wait_for(lambda: client.job_status("three")["state"] == "cancelled", 30, "the job to be cancelled")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# ----------------------------------------------------------------------------- crash safety


def test_a_daemon_that_answered_then_died_is_told_dead_not_a_wrong_key(tmp_path):
    """A client whose daemon answered before and was then SIGKILLed is told the daemon
    refuses connections (not running), not that its key is most likely wrong."""
    d = DaemonProcess(tmp_path / "state").start()
    try:
        with d.client(timeout_s=GENEROUS_S) as client:
            assert client.ping()["protocol"]
            d.kill()
            with pytest.raises(DaemonTimeout) as told:
                client.ping(timeout_s=2.0)
    finally:
        if d.proc.poll() is None:
            d.kill()
    message = str(told.value)
    assert "answered before but now refuses connections: it is not running" in message, message
    assert "key" not in message, message


def test_sigkill_during_a_compile_then_restart(tmp_path, fixture_bytes):
    from hapd.compiler.options import CompileOptions
    from hapd.profile.schema import estimated_profile

    world = 3000  # large enough that one compile takes about a second
    profile = estimated_profile(world, flops=[1e12 * (1 + i % 3) for i in range(world)], hosts=[f"h{i // 8}" for i in range(world)], name="big")
    profile_path = profile.save(tmp_path / "big.json")
    home = tmp_path / "state"
    d = DaemonProcess(home, profile=str(profile_path)).start()
    graph = fixture_bytes["bert"]
    try:
        drop(d.watch, "big.hapg", graph)
        wait_for(lambda: "drop big.hapg: compiling" in d.log(), 60, "the compile to start", interval=0.002)
        with d.client(timeout_s=GENEROUS_S) as client:
            client.ping()
        answered_during_compile = "drop big.hapg →" not in d.log()
        d.kill()
    finally:
        if d.proc.poll() is None:
            d.kill()
    assert answered_during_compile, "the API did not answer until the compile had finished"
    assert not (d.watch / "out" / "big.hplan").exists(), "the kill came too late to test anything"
    assert (d.watch / "big.hapg").exists()  # the drop is still pending
    # whatever the killed daemon left in the cache is whole or absent, never torn
    for entry in (home / "cache").rglob("*.entry"):
        header, start_at = _parse_header(entry.read_bytes())
        assert len(entry.read_bytes()) - start_at == header["length"]
    # and a torn entry at exactly the key the restarted daemon looks up is not served
    key = CacheKey.of(hashlib.sha256(graph).hexdigest(), profile, CompileOptions())
    torn = home / "cache" / "plan" / key.digest[:2] / f"{key.digest}.entry"
    torn.parent.mkdir(parents=True, exist_ok=True)
    torn.write_bytes(b"HAPDCACH\x00\x00\x00\x10" + b"\x00" * 40)

    restarted = DaemonProcess(home, profile=str(profile_path))
    log_start = len(d.log())
    restarted.start()
    try:
        restarted.wait_log(r"drop big\.hapg → out/big\.hplan \(cache miss", timeout=90, start=log_start)
        log = restarted.log()[log_start:]
        assert "corrupt or mismatched entry" in log
        plan = Plan.load(restarted.watch / "out" / "big.hplan")
        assert plan.key["profile_id"] == profile.profile_id and len(plan.ratios) == world
        assert (restarted.watch / "done" / "big.hapg").exists()
        # SIGTERM during a compile: the compile in progress is finished, then a clean exit
        drop(restarted.watch, "late.hapg", fixture_bytes["vit"], staging=True)
        wait_for(lambda: "drop late.hapg: compiling" in restarted.log(), 60, "the second compile to start", interval=0.002)
        code = restarted.stop()
    finally:
        if restarted.proc.poll() is None:
            restarted.kill()
    log = restarted.log()[log_start:]
    assert code == 0 and "SIGTERM: stopping" in log and log.rstrip().endswith("INFO stopped")
    assert log.index("SIGTERM: stopping") < log.index("drop late.hapg → out/late.hplan") < log.index("INFO stopped")
    assert Plan.load(restarted.watch / "out" / "late.hplan").key["profile_id"] == profile.profile_id
    assert (restarted.watch / "done" / "late.hapg").exists()
    cached = PlanCache(home / "cache", 2**30).get(key)  # the recompiled entry replaced the torn one
    assert cached is not None and cached[1] == (restarted.watch / "out" / "big.hplan").read_bytes()


# ----------------------------------------------------------------------------- configuration and CLI


def test_non_loopback_bind_needs_to_be_explicit(tmp_path):
    from hapd.serve.daemon import DaemonConfig, is_loopback
    from hapd.errors import OptionsError

    assert is_loopback("tcp://127.0.0.1:5557") and is_loopback("tcp://[::1]:1") and is_loopback("ipc:///tmp/x")
    assert not is_loopback("tcp://0.0.0.0:5557") and not is_loopback("tcp://*:5557") and not is_loopback("tcp://10.1.2.3:5557")
    with pytest.raises(OptionsError, match="refusing to bind tcp://0.0.0.0:5557"):
        DaemonConfig.defaults(profile="paper-8", home=tmp_path, bind="tcp://0.0.0.0:5557")
    assert DaemonConfig.defaults(profile="paper-8", home=tmp_path, bind="tcp://0.0.0.0:5557", allow_remote=True).watch == tmp_path / "watch"


def run_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hapd.cli", *args], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def test_cli_ping_and_a_second_daemon_on_the_same_state(daemon, tmp_path):
    ok = run_cli("ping", daemon.address, "--key", str(daemon.home / "key"))
    assert ok.returncode == 0 and "paper-8" in ok.stdout and "protocol 1" in ok.stdout, ok.stderr
    other_key = tmp_path / "other.key"
    other_key.write_text(os.urandom(32).hex())
    other_key.chmod(0o600)
    bad = run_cli("ping", daemon.address, "--key", str(other_key), "--timeout", "0.5")
    assert bad.returncode == 2 and bad.stderr.startswith(
        f"hapd: DaemonTimeout: the daemon at {daemon.address} took the connection but did not answer the ping within 0.5 s: "
        "most likely it refused the message's signature, holding another key"), bad.stderr
    second = run_cli("serve", "--state", str(daemon.home), "--bind", "tcp://127.0.0.1:*")
    assert second.returncode == 2 and "another hapd daemon" in second.stderr, second.stderr
    with daemon.client() as client:
        assert client.ping()["profile_name"] == "paper-8"


def test_the_daemons_state_is_its_users_alone(daemon):
    """After a job and a compile: the state folder, the plan cache, a job's folder and its
    spill of output are the daemon's user's alone (0700 folders, 0600 files)."""
    import stat

    with daemon.client() as client:
        client.launch("private", "p.py", script_bytes=b"print('secret', flush=True)\n", nproc=1, world_size=1,
                      master_addr="127.0.0.1", master_port=29990)
        collect(client, "private", timeout=30)
    job = daemon.home / "jobs" / "private"
    modes = {path: stat.S_IMODE(path.stat().st_mode) for path in (daemon.home, daemon.home / "cache", job)}
    assert all(mode == 0o700 for mode in modes.values()), {str(k): oct(v) for k, v in modes.items()}
    spill = job / "events.spill"
    assert stat.S_IMODE(spill.stat().st_mode) == 0o600
    kinds = [daemon.home / "cache" / kind for kind in ("plan", "lowered")]
    assert all(stat.S_IMODE(k.stat().st_mode) == 0o700 for k in kinds)


def test_a_cached_graph_is_its_users_alone(tmp_path):
    import stat

    cache = PlanCache(tmp_path / "cache")
    cache.put_lowered("abc", b"graph bytes")
    files = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert files and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files), [oct(p.stat().st_mode) for p in files]
