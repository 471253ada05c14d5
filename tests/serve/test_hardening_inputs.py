"""Issue 17, item 6: options and inputs are validated at the boundary. Compile options
(over the API, on the command line, in the daemon's config), profiles, ``hapd export``'s
factory and output path, job ids and shipped scripts: each bad one is refused with a
one-line error naming it (exit status 2 on the command line), never a traceback, a
panic of the core, an ``internal error``, or a log line the size of the input."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from _hardening_daemon import FIXTURES, ROOT, ServedDaemon, signed_request

from hapd.compiler.options import MAX_SEARCH_SECONDS, CompileOptions
from hapd.errors import OptionsError, ProfileError, ProtocolError, RemoteError
from hapd.profile.schema import RANGES, estimated_profile, profile_from_dict
from hapd.serve.guard import MAX_LOGGED_CHARS
from hapd.wire.protocol import MAX_JOB_ID_CHARS, Session

PAPER8 = json.loads((ROOT / "profiles" / "paper-8.json").read_text())
HUGE_JOB_ID = "j" * 100_000


# ----------------------------------------------------------------------------- CompileOptions


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_seconds": 1e300}, "max_seconds"),
        ({"max_seconds": -1.0}, "max_seconds"),
        ({"max_seconds": math.nan}, "max_seconds"),
        ({"max_seconds": math.inf}, "max_seconds"),
        ({"max_seconds": 0}, "max_seconds"),
        ({"max_seconds": MAX_SEARCH_SECONDS * 2}, "max_seconds"),
        ({"max_seconds": "10"}, "max_seconds"),
        ({"zero": "yes"}, "zero"),
        ({"zero": 1}, "zero"),
        ({"memory_caps": None}, "memory_caps"),
        ({"front_width": 1.5}, "front_width"),
        ({"front_width": True}, "front_width"),
        ({"max_states": 2**64}, "max_states"),
        ({"max_rounds": 10**9}, "max_rounds"),
        ({"mode": ["auto"]}, "mode"),
        ({"force": {"node": 3}}, "force"),
        ({"ratios": (math.nan, 1.0)}, "ratios"),
        ({"ratios": ()}, "ratios"),
        ({"ratios": (0.5, 0.6)}, "ratios"),
    ],
)
def test_bad_compile_options_are_named(options, field):
    with pytest.raises(OptionsError) as info:
        CompileOptions(**options)
    assert info.value.field == field and field in str(info.value)
    with pytest.raises(OptionsError) as info:  # as the daemon builds them from a request
        CompileOptions.from_mapping(options)
    assert info.value.field == f"options.{field}"


def test_good_compile_options_still_pass():
    options = CompileOptions(max_seconds=5, zero=True, front_width=8, ratios=(0.25, 0.75))
    assert options.core()["max_seconds"] == 5.0


# ----------------------------------------------------------------------------- profiles


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["devices"][0].update(flops=1e-300), "devices[0].flops"),
        (lambda d: d["devices"][0].update(flops=1e300), "devices[0].flops"),
        (lambda d: d["devices"][1].update(elementwise_flops=1e-3), "devices[1].elementwise_flops"),
        (lambda d: d["devices"][2].update(memory=1e-9), "devices[2].memory"),
        (lambda d: d["devices"][2].update(memory=10**400), "devices[2].memory"),
        (lambda d: d["collectives"]["all_reduce"]["inter"].update(beta=1e-300), "collectives.all_reduce.inter.beta"),
        (lambda d: d["collectives"]["all_reduce"]["inter"].update(alpha=1e9), "collectives.all_reduce.inter.alpha"),
    ],
)
def test_absurd_profile_numbers_are_refused(edit, field):
    bad = copy.deepcopy(PAPER8)
    edit(bad)
    with pytest.raises(ProfileError) as info:
        profile_from_dict(bad)
    assert info.value.field == field and "\n" not in str(info.value)


def test_profile_ranges_are_documented_and_hold_the_bundled_profiles():
    for path in (ROOT / "profiles").glob("*.json"):
        profile_from_dict(json.loads(path.read_text()))
    assert RANGES["flops"][0] >= 1 and RANGES["beta"][1] >= 1e18  # the profiler's "not communicated" link
    with pytest.raises(ProfileError):
        estimated_profile(2, flops=[1e-300, 1e10])


# ----------------------------------------------------------------------------- command line


def _hapd(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hapd.cli", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def _one_line_error(done: subprocess.CompletedProcess, *needles: str) -> None:
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and "panicked" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hapd: "), done.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("seconds", ["1e300", "-1", "nan"])
def test_cli_compile_refuses_a_bad_time_budget(tmp_path, seconds):
    (tmp_path / "mlp.hapg").write_bytes((FIXTURES / "mlp.hapg").read_bytes())
    done = _hapd("compile", "mlp.hapg", "-p", "paper-8", "--max-seconds", seconds, cwd=tmp_path)
    _one_line_error(done, "OptionsError", "max_seconds")
    assert not (tmp_path / "mlp.hplan").exists()


def test_cli_compile_refuses_an_absurd_profile(tmp_path):
    bad = copy.deepcopy(PAPER8)
    bad["devices"][0]["flops"] = 1e-300
    (tmp_path / "tiny.json").write_text(json.dumps(bad))
    (tmp_path / "mlp.hapg").write_bytes((FIXTURES / "mlp.hapg").read_bytes())
    done = _hapd("compile", "mlp.hapg", "-p", "tiny.json", cwd=tmp_path)
    _one_line_error(done, "ProfileError", "devices[0].flops")


def test_cli_export_of_something_that_is_not_a_factory(tmp_path):
    _one_line_error(_hapd("export", "json:dumps", "--no-hapg", cwd=tmp_path), "ExportError", "dumps")


def test_cli_export_to_an_unwritable_path(tmp_path):
    _one_line_error(_hapd("export", "mlp", "--no-hapg", "--out", "/proc/x.pt2", cwd=tmp_path), "ExportError", "/proc/x.pt2")


# ----------------------------------------------------------------------------- over the API


def test_the_api_refuses_bad_options_ids_and_scripts(tmp_path):
    graph = (FIXTURES / "mlp.hapg").read_bytes()
    with ServedDaemon(tmp_path / "hapd") as daemon, daemon.client(timeout_s=120) as client:
        for options, field in (({"max_seconds": 1e300}, "max_seconds"), ({"zero": "yes"}, "zero"),
                               ({"front_width": 1.5}, "front_width")):
            with pytest.raises(RemoteError) as info:
                client.compile(graph, "hapg", options=options)
            assert f"OptionsError: compile option {field}" in str(info.value) and "internal error" not in str(info.value)
        launch = {"job": HUGE_JOB_ID, "script": "x.py", "script_bytes": b"print(1)", "args": [], "env": {}, "nproc": 1,
                  "node_rank": 0, "nnodes": 1, "rank_offset": 0, "world_size": 1, "master_addr": "127.0.0.1",
                  "master_port": 29999}
        reply = signed_request(client, daemon.address, "launch", launch)
        assert reply.type == "error" and reply.body["kind"] == "ProtocolError"
        assert reply.body["message"] == f"launch: field 'job' is {len(HUGE_JOB_ID)} characters; at most {MAX_JOB_ID_CHARS}"
        reply = signed_request(client, daemon.address, "job_status", {"job": HUGE_JOB_ID})
        assert reply.type == "error" and len(reply.body["message"]) < 200
        with pytest.raises(RemoteError, match="script_bytes is empty"):
            client.launch("emptyjob", "x.py", script_bytes=b"", nproc=1, world_size=1, master_addr="127.0.0.1",
                          master_port=29999)
        assert all(j["job"] != "emptyjob" for j in client.status()["jobs"])
        assert client.ping()["profile_name"] == "paper-8"
    longest = max(len(line) for line in daemon.log().splitlines())
    assert longest < 2 * MAX_LOGGED_CHARS
    assert "internal error" not in daemon.log()


def test_the_client_refuses_a_huge_job_id_before_sending():
    with pytest.raises(ProtocolError, match="at most 64"):
        Session(b"k" * 32).encode("job_status", {"job": HUGE_JOB_ID})
