"""worker.py end to end on 2 CPU ranks, and distribute()'s errors on bad input."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hapd
from hapd import models
from hapd.compiler.options import CompileOptions
from hapd.errors import PlanError
from hapd.harness.training import TRACE_ITERATIONS
from hapd.profile.schema import estimated_profile
from hapd.spmd.rewrite import distribute

ROOT = Path(__file__).resolve().parents[2]


def torchrun(script: str, *flags: str, cwd: Path = ROOT, nproc: int = 2) -> tuple[list[dict], str]:
    """Run ``script`` on ``nproc`` local ranks; its JSON lines (timings and summary) and stdout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / script), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"hapd"')]
    return lines, proc.stdout


@pytest.mark.distributed
def test_worker_trains_and_reports_like_ddp(tmp_path):
    """Both ranks print timings; the worker's loss after the same Adam steps on the same
    global batch equals DDP's (the distributed program is the single-device model)."""
    flags = ["--model", "mlp", "--iterations", "6", "--warmup", "2", "--batch", "12"]
    lines, out = torchrun("worker.py", *flags, "--trace", str(tmp_path / "trace.json"))
    timings = sorted((x for x in lines if x["hapd"] == "timings"), key=lambda x: x["rank"])
    assert [x["rank"] for x in timings] == [0, 1]
    for line in timings:
        assert line["system"] == "hapd" and len(line["iteration_s"]) == 6
        assert all(t > 0 for t in line["iteration_s"]) and line["estimate_s"] > 0
    summary = next(x for x in lines if x["hapd"] == "summary")
    assert "slowest" in out and summary["world"] == 2
    assert (tmp_path / "trace.json").stat().st_size > 0 and (tmp_path / "trace.rank1.json").exists()

    # DDP runs the traced iterations' steps untraced: ddp.py's trace has its own test
    # (test_training.py), and torch's profiler around DDP aborted a rank once in ~20 runs
    ddp_flags = ["--model", "mlp", "--iterations", str(6 + TRACE_ITERATIONS), "--warmup", "2", "--batch", "12"]
    ddp_lines, _ = torchrun("ddp.py", *ddp_flags)
    ddp = next(x for x in ddp_lines if x["hapd"] == "summary")
    assert summary["loss"] == pytest.approx(ddp["loss"], rel=1e-5)


@pytest.mark.distributed
def test_worker_uses_a_plan_file_and_bfloat16(tmp_path):
    spec = models.get("mlp")
    module, config = models.build("mlp")
    module = module.to(torch.bfloat16)
    inputs = tuple(t.to(torch.bfloat16) if t.is_floating_point() else t for t in spec.example_inputs(config, 8))
    program = hapd.export(module, inputs, batch_dims=spec.batch_dims)
    options = CompileOptions(ratios=(0.7, 0.3), force={"linear": "column-parallel", "linear_1": "row-parallel"})
    plan = hapd.compile(hapd.lower(program, name="mlp"), estimated_profile(2), options)
    plan.save(tmp_path / "mlp.hplan")
    lines, _ = torchrun("worker.py", "--model", "mlp", "--batch", "8", "--dtype", "bfloat16", "--iterations", "3",
                        "--warmup", "1", "--plan", str(tmp_path / "mlp.hplan"))
    summary = next(x for x in lines if x["hapd"] == "summary")
    assert summary["plan"].startswith("file") and summary["ratios"] == pytest.approx([0.7, 0.3])
    assert summary["dtype"] == "bfloat16" and summary["loss"] == summary["loss"]  # not NaN


@pytest.mark.distributed
@pytest.mark.parametrize(("model", "batch"), [("zoo.gpt2", 5), ("zoo.resnet18", 6)])
def test_worker_and_ddp_train_a_zoo_model(model, batch):
    """The third-party zoo runs by name in worker.py and ddp.py (tiny size, 2 iterations,
    2 ranks). GPT-2's loss is transformers' mean over tokens: DP-EV's [3, 2] split weighs
    each rank's mean by its share of the samples, so its loss after one Adam step equals
    the plan's (unweighted, it would not). resnet18's batch norm normalizes each DDP
    rank's own samples, so there only the runs and their reports are compared. GPT-2 runs
    with its dropout off here: DDP draws masks with torch's generator, hapd with its own,
    so only dropout-free losses can be equal (hapd's dropout is exact against its own
    single-device run: tests/spmd/test_dropout.py, tests/models/test_zoo.py)."""
    flags = ["--model", model, "--batch", str(batch), "--iterations", "2", "--warmup", "1"]
    if model == "zoo.gpt2":
        flags += ["--set", "dropout=0.0"]
    runs = {script: torchrun(script, *flags)[0] for script in ("worker.py", "ddp.py")}
    for script, lines in runs.items():
        timings = sorted((x for x in lines if x["hapd"] == "timings"), key=lambda x: x["rank"])
        assert [x["rank"] for x in timings] == [0, 1], script
        assert all(x["model"] == model and x["size"] == "tiny" and len(x["iteration_s"]) == 2 for x in timings)
    hapd_run, ddp = (next(x for x in runs[s] if x["hapd"] == "summary") for s in ("worker.py", "ddp.py"))
    assert hapd_run["batch"] == ddp["batch"] == batch and hapd_run["estimate_s"] > 0
    assert ddp["lengths"] == [batch - batch // 2, batch // 2]
    if model == "zoo.gpt2":
        assert hapd_run["loss"] == pytest.approx(ddp["loss"], rel=1e-5)
    assert math.isfinite(hapd_run["loss"]) and math.isfinite(ddp["loss"])


@pytest.mark.distributed
def test_worker_builds_on_meta_and_each_rank_initializes_its_pieces():
    """``--init meta``: llama_block (real rotary buffers, RMSNorm's reset) is built on the
    meta device and each rank initializes only its pieces; it trains to a finite loss
    and its report says how the model started."""
    flags = ["--model", "llama_block", "--batch", "4", "--iterations", "2", "--warmup", "0", "--init", "meta"]
    lines, _ = torchrun("worker.py", *flags)
    summary = next(x for x in lines if x["hapd"] == "summary")
    assert summary["init"] == "meta" and math.isfinite(summary["loss"])


def _two_hosts_slow_link(path: Path) -> Path:
    """Two hosts of one rank each, a slow link between them: a pipeline's point-to-point
    activations cost less than the data-parallel gradient sum across it."""
    import dataclasses

    from hapd.profile.schema import Link

    profile = estimated_profile(2, flops=[2e10, 1e10], hosts=["a", "b"], alpha=1e-5, beta=1e6)
    links = {name: {"inter": link["inter"], "intra": Link(alpha=1e-6, beta=1e10)} for name, link in profile.collectives.items()}
    return dataclasses.replace(profile, collectives=links, name="two-hosts-slow").save(path)


@pytest.mark.distributed
def test_worker_runs_the_pipeline_the_search_picks(tmp_path):
    """``--pipeline auto`` on two hosts with a slow link: the plan's pipeline (one stage
    per host) trains, to the loss the SPMD plan's run reaches after the same Adam steps."""
    profile = _two_hosts_slow_link(tmp_path / "slow.json")
    flags = ["--model", "bert", "--batch", "8", "--iterations", "3", "--warmup", "1", "--profile", str(profile)]
    lines, _ = torchrun("worker.py", *flags, "--pipeline", "auto")
    summary = next(x for x in lines if x["hapd"] == "summary")
    assert summary["pipeline"]["stages"] == [[0], [1]], summary
    assert summary["estimate_s"] < summary["spmd_estimate_s"]
    plain, _ = torchrun("worker.py", *flags)
    expected = next(x for x in plain if x["hapd"] == "summary")["loss"]
    assert abs(summary["loss"] - expected) <= 1e-5 * abs(expected), (summary["loss"], expected)
    # --technique default: what hapd.parallelize chooses without options (every technique on
    # a profile of two hosts) is the pipeline too, run through the module parallelize returns
    chosen, _ = torchrun("worker.py", *flags, "--technique", "default")
    by_default = next(x for x in chosen if x["hapd"] == "summary")
    assert by_default["technique"] == "pipeline", by_default
    assert by_default["estimate_s"] < next(x for x in plain if x["hapd"] == "summary")["estimate_s"]
    assert abs(by_default["loss"] - expected) <= 1e-5 * abs(expected), (by_default["loss"], expected)


@pytest.fixture(scope="module")
def mlp_program_and_plan():
    spec = models.get("mlp")
    module, config = models.build("mlp")
    inputs = spec.example_inputs(config, 6)
    program = hapd.export(module, inputs, batch_dims=spec.batch_dims)
    plan = hapd.compile(hapd.lower(program, name="mlp"), estimated_profile(2), CompileOptions(ratios=(0.5, 0.5)))
    return program, plan, inputs


def test_distribute_rejects_a_plan_for_another_world(mlp_program_and_plan):
    program, plan, _ = mlp_program_and_plan
    with pytest.raises(PlanError, match="2 devices, this job has 3 ranks"):
        distribute(program, plan, 0, world=3)
    with pytest.raises(PlanError, match="rank 5"):
        distribute(program, plan, 5, world=2)


def test_distribute_rejects_a_plan_for_another_graph(mlp_program_and_plan):
    _, plan, _ = mlp_program_and_plan
    spec = models.get("mlp")
    module, config = models.build("mlp", hidden=48)
    other = hapd.export(module, spec.example_inputs(config, 6), batch_dims=spec.batch_dims)
    with pytest.raises(PlanError, match="compiled for graph"):
        distribute(other, plan, 0, world=2)


def test_shard_inputs_checks_count_and_shapes(mlp_program_and_plan):
    program, plan, inputs = mlp_program_and_plan
    module = distribute(program, plan, 1, world=2)
    local = module.shard_inputs(*inputs)
    assert [list(t.shape) for t in local] == module.local_shapes()
    with pytest.raises(PlanError, match="expected 2 inputs"):
        module.shard_inputs(inputs[0])
    with pytest.raises(PlanError, match="compiled for"):
        module.shard_inputs(inputs[0][:4], inputs[1][:4])


def test_one_rank_without_a_process_group_is_the_model(mlp_program_and_plan):
    """world 1 needs no process group: the rank module computes the model's loss."""
    program, _, inputs = mlp_program_and_plan
    plan = hapd.compile(hapd.lower(program, name="mlp"), estimated_profile(1))
    module = distribute(program, plan, 0, world=1)
    assert torch.allclose(module(*module.shard_inputs(*inputs)), program.module()(*inputs), rtol=1e-6)
