"""The training harness (hapd/harness/training.py) and the DDP baseline (ddp.py, hapd/harness/ddp.py):
flags, data slicing, report format, torchrun end to end on 2 CPU ranks, and the
baseline's exactness against single-process full-batch training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from _exact import relative_norm

from hapd import models
from hapd.errors import HapdError
from hapd.harness.ddp import DDPStep, loss_weight, main, split_lengths, wrap
from hapd.harness.training import TrainArgs, local_batch, summarize, trace_path, train
from hapd.profile.schema import Device, Link, Profile, load_profile
from hapd.spmd.distributed import DistEnv, _join, init_distributed, join_timeout_s

REPO = Path(__file__).resolve().parents[2]


def _profile(path: Path, flops: list[float]) -> Path:
    """A small profile with one device per entry of ``flops``, all on one host."""
    link = Link(alpha=1e-5, beta=1e9)
    devices = tuple(Device(rank=r, host="h0", model="cpu", flops=f, memory=2**30) for r, f in enumerate(flops))
    names = ("all_gather", "all_gather_grouped", "reduce_scatter", "reduce_scatter_grouped", "all_reduce",
             "all_to_all", "broadcast")
    profile = Profile(name=f"test-{len(flops)}", devices=devices,
                      collectives={name: {"inter": link, "intra": link} for name in names})
    return profile.save(path)


def _hapd_lines(stdout: str) -> list[dict]:
    """The launcher's view of a worker's stdout: JSON objects with a "hapd" key."""
    out = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            doc = json.loads(line)
            if isinstance(doc, dict) and "hapd" in doc:
                out.append(doc)
    return out


def _torchrun(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "ddp.py"), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------
# Flags, environment and data
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "nope"], "unknown model 'nope'"),
    (["--model", "mlp", "--split", "flops"], "--split flops needs --profile"),
    (["--model", "mlp", "--iterations", "3", "--warmup", "3"], "--warmup 3 must be in [0, --iterations 3)"),
    (["--model", "vgg19", "--layers", "2"], "unknown config field(s) layers"),
    (["--model", "zoo.resnet18", "--layers", "2"], "unknown config field(s) layers for model 'zoo.resnet18'"),
    (["--model", "zoo.nope"], "unknown model 'zoo.nope'"),
    (["--model", "mlp", "--dtype", "float64"], "invalid choice: 'float64'"),
    (["--model", "mlp", "--batch", "0"], "0 is less than 1"),
    (["--model", "mlp", "--lr", "-1"], "is not a positive number"),
])
def test_bad_flags_exit_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_defaults_and_trace_flag():
    import argparse

    from hapd.harness.training import add_train_flags, parse_train_args

    parser = add_train_flags(argparse.ArgumentParser())
    args, _ = parse_train_args(parser, [])
    assert args == TrainArgs()
    assert (args.model, args.size, args.batch, args.iterations, args.warmup, args.dtype) == \
        ("bert", "tiny", 16, 20, 3, "float32")
    args, _ = parse_train_args(parser, ["--trace", "--layers", "1", "--dtype", "bfloat16"])
    assert args.trace == Path("trace.json") and args.overrides == {"layers": 1}
    assert args.torch_dtype == torch.bfloat16
    assert trace_path(Path("out/t.json"), 0) == Path("out/t.json")
    assert trace_path(Path("out/t.json"), 3) == Path("out/t.rank3.json")


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not in [0, WORLD_SIZE=2)"),
    ({"RANK": "0"}, "WORLD_SIZE is not set"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "MASTER_ADDR is not set"),
])
def test_inconsistent_environment(env, message, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(HapdError) as exc:
        init_distributed()
    assert message in str(exc.value)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_rank_late_past_the_collective_timeout_still_joins(monkeypatch):
    """Rank 1 reaches the rendezvous 1.5 s after rank 0, three times the collective
    timeout: both join (the join timeout is apart); alone, rank 0 fails after the join
    timeout with an error saying how many ranks came."""
    from datetime import timedelta
    import threading

    from hapd.errors import CollectiveError

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("HAPD_JOIN_TIMEOUT", "20")
    stores: dict[int, object] = {}

    def late() -> None:
        time.sleep(1.5)
        stores[1] = _join(1, 2, timedelta(seconds=0.5))

    thread = threading.Thread(target=late)
    thread.start()
    stores[0] = _join(0, 2, timedelta(seconds=0.5))
    thread.join(30)
    assert set(stores) == {0, 1}
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("HAPD_JOIN_TIMEOUT", "1")
    with pytest.raises(CollectiveError, match="joining the job|ranks joined"):
        _join(0, 2, timedelta(seconds=0.5))
    assert join_timeout_s({}) == 180.0 and join_timeout_s({"HAPD_JOIN_TIMEOUT": "7"}) == 7.0
    with pytest.raises(HapdError, match="HAPD_JOIN_TIMEOUT"):
        join_timeout_s({"HAPD_JOIN_TIMEOUT": "0"})


AT_EXIT = """\
import atexit
import torch.distributed as dist
from hapd.spmd.distributed import init_distributed
# registered first, so it runs last: what the interpreter's finalization will find
atexit.register(lambda: print("group alive at finalization:", dist.is_initialized(), flush=True))
init_distributed()
print("joined:", dist.is_initialized(), dist.get_world_size(), flush=True)
"""


def _run_alone(code: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``code`` in a fresh interpreter outside any job (a 1-rank group); its stdout
    lines without Gloo's."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    return done, [line for line in done.stdout.splitlines() if not line.startswith("[Gloo]")]


def test_the_group_hapd_created_is_destroyed_before_the_interpreter_finalizes():
    """A process ending with its Gloo group alive can abort in finalization (status 134,
    "terminate called without an active exception"); hapd's group is destroyed at exit."""
    done, said = _run_alone(AT_EXIT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert said == ["joined: True 1", "group alive at finalization: False"], done.stdout


EXIT_RANK = """\
import atexit, sys, threading, time
import torch.distributed as dist
from hapd.spmd.distributed import init_distributed
from hapd.util import exit_process

class Finalized:
    def __del__(self):
        print("finalization ran", flush=True)

held = Finalized()  # a module global: collected only when the interpreter finalizes
atexit.register(lambda: print("atexit ran; group alive:", dist.is_initialized(), flush=True))
init_distributed()
late = threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True)))
late.start()
sys.stderr.write("unflushed")  # no newline, no flush: left in the line buffer
exit_process(3)
print("never")
"""


def test_a_rank_exits_with_its_status_after_its_threads_and_exit_handlers_without_finalizing():
    """``exit_process`` (the entry points' exit): non-daemon threads finish, ``atexit``
    handlers run with the group destroyed by hapd's own handler, buffered output is
    flushed, the status is kept, and the interpreter's finalization (where C++ threads
    that outlive the Python code can abort the process) never runs."""
    done, said = _run_alone(EXIT_RANK)
    assert done.returncode == 3, done.stderr[-2000:]
    assert said == ["thread finished", "atexit ran; group alive: False"], done.stdout
    assert done.stderr.endswith("unflushed") and "finalization ran" not in done.stdout, done.stderr[-2000:]


def test_local_batch_cuts_the_global_batch():
    spec = models.get("mlp")
    _, config = models.build("mlp")
    full = spec.example_inputs(config, 8)
    pieces = [local_batch(spec, config, [5, 3, 0], r, 0, "cpu", torch.bfloat16) for r in range(3)]
    assert [p[0].shape[0] for p in pieces] == [5, 3, 0]
    assert pieces[0][0].dtype == torch.bfloat16 and pieces[0][1].dtype == torch.int64
    assert torch.equal(torch.cat([p[1] for p in pieces]), full[1])
    assert torch.equal(torch.cat([p[0] for p in pieces]), full[0].to(torch.bfloat16))
    shuffled = [local_batch(spec, config, [5, 3], r, 7, "cpu", torch.float32) for r in range(2)]
    x, y = (torch.cat(parts) for parts in zip(*shuffled))
    assert not torch.equal(y, full[1]) or not torch.equal(x, full[0])
    order = x[:, 0].argsort()  # same samples, (x, y) pairs kept
    assert torch.equal(x[order], full[0][full[0][:, 0].argsort()])
    assert torch.equal(y[order], full[1][full[0][:, 0].argsort()])


def test_loss_weight_is_a_ranks_share_of_a_mean():
    """A sum loss counts whole on every rank; a mean counts by the rank's share of the
    samples (the global mean is Σ_r n_r/N · mean_r); a mean over no samples is refused."""
    assert [loss_weight("sum", [3, 2, 0], r) for r in range(3)] == [1.0, 1.0, 1.0]
    assert [loss_weight("mean", [3, 2], r) for r in range(2)] == [0.6, 0.4]
    with pytest.raises(HapdError, match="rank 1 would get none"):
        loss_weight("mean", [5, 0], 1, "zoo.gpt2")
    with pytest.raises(HapdError, match="unknown loss reduction 'max'"):
        loss_weight("max", [5], 0)


def test_split_lengths(tmp_path):
    profile = load_profile(_profile(tmp_path / "p.json", [3e12, 1e12]))
    assert split_lengths("even", 9, 2, None) == [5, 4]
    assert split_lengths("flops", 8, 2, profile) == [6, 2]
    with pytest.raises(HapdError, match="has 2 devices but the job has 3 ranks"):
        split_lengths("flops", 8, 3, profile)


def test_summary_takes_the_slowest_rank_per_iteration():
    lines = [{"hapd": "timings", "rank": r, "world": 2, "system": "s", "model": "m", "iteration_s": times,
              "warmup": 1, "mean_s": sum(times[1:]) / 2, "std_s": 0.0, "loss": 1.0, "split": "even"}
             for r, times in enumerate([[9.0, 1.0, 4.0], [9.0, 3.0, 2.0]])]
    summary = summarize(lines)
    assert summary["mean_s"] == pytest.approx(3.5) and summary["std_s"] == pytest.approx(0.5)
    assert summary["slowest_rank"] == 0 and summary["split"] == "even" and len(summary["ranks"]) == 2


def test_single_process_run_with_trace_and_json(tmp_path, capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    code = main(["--model", "mlp", "--iterations", "3", "--warmup", "1", "--batch", "4",
                 "--trace", str(tmp_path / "t.json"), "--json", str(tmp_path / "s.json")])
    assert code == 0
    lines = _hapd_lines(capsys.readouterr().out)
    assert [line["hapd"] for line in lines] == ["timings", "summary"]
    assert lines[0]["world"] == 1 and len(lines[0]["iteration_s"]) == 3
    assert json.loads((tmp_path / "s.json").read_text()) == lines[1]
    assert "traceEvents" in json.loads((tmp_path / "t.json").read_text())


# --------------------------------------------------------------------------
# torchrun end to end
# --------------------------------------------------------------------------


def _check_run(proc: subprocess.CompletedProcess, system: str, lengths: list[int]) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = _hapd_lines(proc.stdout)
    timings = sorted((line for line in lines if line["hapd"] == "timings"), key=lambda line: line["rank"])
    assert [line["rank"] for line in timings] == [0, 1], proc.stdout
    for line in timings:
        assert line["system"] == system and line["world"] == 2 and line["model"] == "mlp"
        assert len(line["iteration_s"]) == 5 and all(t > 0 for t in line["iteration_s"])
        assert line["warmup"] == 1 and line["mean_s"] > 0 and line["std_s"] >= 0
        assert line["lengths"] == lengths
    assert timings[0]["loss"] == timings[1]["loss"]  # the global loss, on every rank
    summaries = [line for line in lines if line["hapd"] == "summary"]
    assert len(summaries) == 1 and summaries[0]["ranks"] == timings
    assert f"{system} mlp: 2 rank(s)" in proc.stdout and "slowest" in proc.stdout
    return timings


@pytest.mark.distributed
def test_ddp_even_on_two_ranks():
    proc = _torchrun("--model", "mlp", "--iterations", "5", "--warmup", "1")
    _check_run(proc, "ddp-ev", [8, 8])


@pytest.mark.distributed
def test_ddp_flops_split_on_two_ranks(tmp_path):
    profile = _profile(tmp_path / "two.json", [3e12, 1e12])
    proc = _torchrun("--model", "mlp", "--iterations", "5", "--warmup", "1", "--batch", "8",
                     "--split", "flops", "--profile", str(profile), "--trace", str(tmp_path / "trace.json"))
    _check_run(proc, "ddp-cp", [6, 2])
    for name in ("trace.json", "trace.rank1.json"):
        assert "traceEvents" in json.loads((tmp_path / name).read_text())


@pytest.mark.distributed
def test_ddp_profile_must_match_the_world(tmp_path):
    profile = _profile(tmp_path / "three.json", [1e12, 1e12, 1e12])
    proc = _torchrun("--model", "mlp", "--split", "flops", "--profile", str(profile))
    assert proc.returncode != 0
    assert "the profile has 3 devices but the job has 2 ranks" in proc.stderr


# --------------------------------------------------------------------------
# Exactness: DDP on an uneven split == single-process full-batch training
# --------------------------------------------------------------------------

BATCH, STEPS, LR = 8, 3, 1e-3


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process full-batch gradient, and the parameters after STEPS Adam steps."""
    # not _exact.single_device: the eager model as the harness builds it (no export), no losses
    args = TrainArgs(model="mlp", batch=BATCH, lr=LR)
    model, config = args.build()
    inputs = models.get("mlp").example_inputs(config, BATCH)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    grads = {}
    for i in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        model(*inputs).backward()
        if i == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        optimizer.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _exactness_rank(rank: int, world: int) -> None:
    env = init_distributed()  # joins the group run_ranks started
    assert env == DistEnv(rank=rank, world=world, local_rank=rank, backend="gloo", device=torch.device("cpu"))
    ref_grads, ref_params = _reference()
    for lengths in ([5, 3], [8, 0]):
        args = TrainArgs(model="mlp", batch=BATCH, lr=LR)
        model, config = args.build()
        ddp = wrap(model, env)
        inputs = local_batch(models.get("mlp"), config, lengths, rank, 0, env.device, torch.float32)
        optimizer = torch.optim.Adam(ddp.parameters(), lr=LR)
        step = DDPStep(ddp, inputs, world)
        step()
        for name, param in model.named_parameters():
            err = relative_norm(param.grad, ref_grads[name])
            assert err <= 1e-5, f"split {lengths} rank {rank}: grad {name} relative error {err:.2e}"
        times = train(step, optimizer, env, iterations=STEPS, warmup=0, trace=None)
        assert len(times) == STEPS
        for name, param in model.named_parameters():
            err = relative_norm(param.detach(), ref_params[name])
            assert err <= 1e-5, f"split {lengths} rank {rank}: {name} after {STEPS} steps, error {err:.2e}"


@pytest.mark.distributed
def test_ddp_uneven_split_is_exact():
    """Split [5, 3] (and [8, 0]: a rank with no samples) of a batch of 8 on 2 Gloo ranks:
    gradients and the parameters after 3 Adam steps equal single-process full-batch
    training (relative error in the 2-norm of each tensor ≤ 1e-5)."""
    run_ranks(2, _exactness_rank, timeout=300)
