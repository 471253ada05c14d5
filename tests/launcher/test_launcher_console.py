"""A clean launcher console: the ranks' ``{"hapd": ...}`` lines are the launcher's, not
the reader's, and a job prints one timing table.

- the launcher consumes the JSON lines (the table, the report) without echoing them;
  ``-v`` echoes them too, and every other line is streamed either way;
- the table is printed once, by the launcher: a rank under the launcher (``HAPD_JOB``
  set) prints none of its own, one started otherwise (torchrun, plain python) does.

The job is a torch-free script on 2 ranks through a daemon the launcher starts for it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hapd.harness.training import report
from hapd.spmd.distributed import DistEnv
from launcher.job import crowded_cores, usable_cores
from launcher.report import Timings, build_report, format_table
from launcher.tracebacks import TRACEBACK_START, Tracebacks, strip_rank_prefix

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """\
import json, os
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
print(f"hello from rank {rank}", flush=True)
times = [0.5, 0.010 * (rank + 1), 0.012 * (rank + 1)]
line = {"hapd": "timings", "rank": rank, "world": world, "system": "probe", "model": "none", "iteration_s": times,
        "warmup": 1, "mean_s": sum(times[1:]) / 2, "std_s": 0.0, "loss": 2.5}
print(json.dumps(line), flush=True)
if rank == 0:
    print(json.dumps({"hapd": "summary", "world": world, "loss": 2.5, "mean_s": 0.02}), flush=True)
print(f"bye from rank {rank}", flush=True)
"""


@pytest.fixture
def launcher_env(tmp_path) -> dict[str, str]:
    """A launcher subprocess's environment: its own state folder, no daemon to find."""
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE", "HAPD_JOB")}
    env["HAPD_HOME"] = str(tmp_path / "home")
    return env


def _run(script: Path, env: dict[str, str], *flags: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "launcher", "run", str(script), "-n", "2", *flags], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(SCRIPT)
    return path


def test_json_lines_are_consumed_and_one_table_is_printed(script, launcher_env):
    done = _run(script, launcher_env)
    out = done.stdout
    assert '{"hapd"' not in out and '{"hapd"' not in done.stderr, out
    for rank in (0, 1):  # people's lines are streamed
        assert f"[rank {rank}] hello from rank {rank}" in out and f"[rank {rank}] bye from rank {rank}" in out
    assert out.count("per-iteration timings of job") == 1, out
    assert "per-iteration timings of job probe-" in out and "(probe none; 2 of 2 ranks;" in out
    assert re.search(r"^loss 2\.5 ", out, re.M), out
    report_path = Path(re.search(r"hapd launcher: report: (\S+)", done.stderr).group(1))
    data = json.loads(report_path.read_text())  # consumed: they are in the report
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and data["summary"]["loss"] == 2.5


def test_verbose_echoes_the_json_lines(script, launcher_env):
    out = _run(script, launcher_env, "-v").stdout
    for rank in (0, 1):
        assert re.search(rf'^\[rank {rank}\] {{"hapd": "timings", "rank": {rank}, ', out, re.M), out
        assert f"[rank {rank}] hello from rank {rank}" in out
    assert re.search(r'^\[rank 0\] {"hapd": "summary"', out, re.M)
    assert out.count("per-iteration timings of job") == 1, out


def test_quiet_still_prints_the_table_only(script, launcher_env):
    out = _run(script, launcher_env, "-q").stdout
    assert "[rank " not in out and out.count("per-iteration timings of job") == 1


def test_the_table_shows_the_jobs_loss():
    timings = Timings()
    timings.feed(0, json.dumps({"hapd": "timings", "rank": 0, "iteration_s": [1.0, 0.5], "warmup": 1, "loss": 4.0,
                                "system": "hapd", "model": "gpt2"}))
    table = format_table(build_report(timings, job="j", script="s.py", args=[], world_size=1, placement=[],
                                      rank_hosts={}, exit_code=0))
    assert "(hapd gpt2; 1 of 1 ranks;" in table and table.splitlines()[-2].startswith("overall")
    assert table.splitlines()[-1] == "loss 4 (last iteration, global batch)"


@pytest.mark.parametrize("job", [None, "a-job"])
def test_a_rank_prints_its_table_only_outside_the_launcher(job, monkeypatch, capsys):
    if job is None:
        monkeypatch.delenv("HAPD_JOB", raising=False)
    else:
        monkeypatch.setenv("HAPD_JOB", job)
    env = DistEnv(rank=0, world=1, local_rank=0, backend="gloo", device=torch.device("cpu"))
    summary = report(env, system="hapd", model="mlp", times=[0.3, 0.1, 0.2], warmup=1, loss=1.5)
    out = capsys.readouterr().out
    kinds = [json.loads(line)["hapd"] for line in out.splitlines() if line.startswith('{"hapd"')]
    assert kinds == ["timings", "summary"] and summary["loss"] == 1.5  # the launcher's lines, either way
    assert ("hapd mlp: 1 rank(s)" in out) == (job is None), out


# ----------------------------------------------------------------------------- errors and `hapd run`

FAILING = """\
import os
import torch.distributed as dist
dist.init_process_group("gloo")  # torch's excepthook then prefixes every line of a traceback with "[rankN]: "
dist.barrier()  # every rank past the rendezvous: a rank that fails first cannot cut another's Gloo set-up short
rank = dist.get_rank()


def check_batch(batch):
    if batch % 3:
        raise ValueError(f"batch {batch} is not a multiple of 3 (rank {rank} saw it)" if rank == 2 else
                         f"batch {batch} is not a multiple of 3")


print(f"rank {rank} ready", flush=True)
check_batch(8)
"""


def test_tracebacks_are_held_printed_once_and_folded():
    tb = Tracebacks(hold_s=1.0)
    frames = [TRACEBACK_START, '  File "x.py", line 3, in <module>', "    f()"]
    assert tb.feed(0, "warming up", now=0.0) == ["warming up"]
    for line in [*frames, "ValueError: bad batch", "  (more of the message)"]:
        assert tb.feed(0, strip_rank_prefix(f"[rank0]: {line}", 0), now=0.1) is None
    for line in [*frames, "mod.ValueError: bad batch"]:
        assert tb.feed(1, line, now=0.2) is None
    for line in [TRACEBACK_START, '  File "y.py", line 1, in <module>', "ValueError: other batch"]:
        assert tb.feed(2, line, now=0.3) is None
    assert tb.due(now=1.15) == [0] and tb.due(now=1.25) == [0, 1]
    assert tb.flush(0) == [*frames, "ValueError: bad batch", "  (more of the message)"]
    assert tb.flush(1) == ["(the same traceback as rank 0, ending:)", "mod.ValueError: bad batch"]
    assert tb.flush(2) == [TRACEBACK_START, '  File "y.py", line 1, in <module>', "ValueError: other batch"]  # new: whole
    for line in [*frames, "ValueError: bad batch", "  (more of the message)"]:
        tb.feed(3, line)
    assert tb.flush(3) == ["(the same traceback as rank 0)"] and tb.flush(3) == []
    assert tb.cause(0) == tb.cause(1) == "ValueError: bad batch" and tb.alike(0) == [1, 3]
    assert strip_rank_prefix("[rank1]: x", 0) == "[rank1]: x" and strip_rank_prefix("[rank1]:", 1) == ""


def test_a_failing_script_under_hapd_run_from_another_folder(tmp_path, launcher_env):
    """``hapd run fail.py -n 3`` in a folder outside the repository: the traceback is
    printed once (the other ranks' as one line each), without torch's ``[rankN]:``, and
    the closing line names the exception, the rank and the host."""
    (tmp_path / "fail.py").write_text(FAILING)
    done = subprocess.run([sys.executable, "-m", "hapd.cli", "run", "fail.py", "-n", "3"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=launcher_env)
    err = done.stderr
    assert done.returncode == 1, err
    assert "[rank0]" not in err and "[rank1]" not in err and "[rank2]" not in err, err
    assert err.count("Traceback (most recent call last):") == 1, err
    first = int(re.search(r"^\[rank (\d)\] Traceback", err, re.M).group(1))
    same = re.findall(r"^\[rank (\d)\] \(the same traceback as rank (\d)(, ending:)?\)$", err, re.M)
    assert sorted(int(r) for r, _, _ in same) == sorted({0, 1, 2} - {first}) and {int(o) for _, o, _ in same} == {first}
    assert "[rank 2] ValueError: batch 8 is not a multiple of 3 (rank 2 saw it)" in err or first == 2
    if usable_cores() < 3:  # more ranks than cores: said once, before the job starts
        assert err.count("3 ranks on this machine's") == 1 and "use -n" in err, err
    closing = re.search(r"^hapd launcher: job fail-\S+ failed: rank (\d) on 127\.0\.0\.1:\d+ exited with code 1: (.*)$",
                        err, re.M)
    assert closing, err
    if closing.group(1) == "2":
        assert closing.group(2) == "ValueError: batch 8 is not a multiple of 3 (rank 2 saw it)"
    else:
        assert closing.group(2).startswith("ValueError: batch 8 is not a multiple of 3 (rank")


@pytest.mark.distributed
def test_hapd_run_finds_the_packaged_worker_from_any_folder(tmp_path, launcher_env):
    """``hapd run worker.py -n 2`` where no worker.py is: hapd's own worker (``python -m
    hapd.worker``'s file) runs; a script that is nowhere is named in one line."""
    done = subprocess.run([sys.executable, "-m", "hapd.cli", "run", "worker.py", "-n", "2", "--", "--iterations", "4"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path, env=launcher_env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "per-iteration timings of job worker-" in done.stdout
    done = subprocess.run([sys.executable, "-m", "hapd.cli", "run", "nowhere.py", "-n", "2"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path, env=launcher_env)
    assert done.returncode == 2
    assert done.stderr.startswith(f"hapd launcher: OptionsError: script nowhere.py not found in {tmp_path} (")
    assert len(done.stderr.strip().splitlines()) <= 3, done.stderr  # a newcomer's mistake: cause and fix, ≤ 3 lines


def test_ranks_that_outnumber_the_cores_are_said_with_the_fix():
    assert crowded_cores(2, 2) is None and crowded_cores(1, 8) is None
    said = crowded_cores(4, 2)
    assert len(said.splitlines()) <= 3
    assert said.startswith("4 ranks on this machine's 2 CPU core(s)") and said.endswith("use -n 2 or fewer for timings "
                                                                                         "that mean something")
