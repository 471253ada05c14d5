"""Telemetry of a user's script, from the module itself (:mod:`hapd.train.telemetry`):
a ParallelModule times each step (optimizer step to optimizer step, every micro-batch
of an accumulation in one) and counts its samples and tokens; logs scalars where
``HAPD_LOG_DIR`` says; a script that reports its own timings keeps them; and a user's
script on 2 ranks under the launcher gets the timing table and a filled JSON report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hapd
from hapd.train import telemetry
from launcher.report import Timings, build_report, format_table

ROOT = Path(__file__).resolve().parents[2]

USER_SCRIPT = '''\
"""A user's own script: a tiny classifier of token ids, trained with hapd.parallelize."""
import torch
from torch import nn

import hapd


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids, labels):
        return nn.functional.cross_entropy(self.head(self.embed(ids).mean(1)), labels)


torch.manual_seed(0)
model = Classifier()
ids, labels = torch.randint(0, 50, (8, 12)), torch.randint(0, 4, (8,))
module = hapd.parallelize(model, (ids, labels))
optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
for step in range(6):
    optimizer.zero_grad()
    module(*module.shard_inputs(ids, labels)).backward()
    optimizer.step()
'''


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.head(self.embed(ids).mean(1)), labels)


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 50, (8, 12), generator=g), torch.randint(0, 4, (8,), generator=g)


def test_nothing_is_recorded_unless_asked(monkeypatch) -> None:
    for name in ("HAPD_JOB", "HAPD_TELEMETRY", "HAPD_PROGRESS", "HAPD_LOG_DIR"):
        monkeypatch.delenv(name, raising=False)
    torch.manual_seed(0)
    module = hapd.parallelize(Classifier(), _batch(), use_daemon=False, verbose=False)
    assert module._telemetry is telemetry.PASSTHROUGH
    monkeypatch.setenv("HAPD_JOB", "j")
    monkeypatch.setenv("HAPD_TELEMETRY", "0")
    assert not telemetry.enabled()


def test_a_step_is_optimizer_step_to_optimizer_step(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("HAPD_TELEMETRY", "1")
    monkeypatch.setenv("HAPD_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.delenv("HAPD_JOB", raising=False)
    torch.manual_seed(0)
    module = hapd.parallelize(Classifier(), _batch(), use_daemon=False, verbose=False)
    recorder = module._telemetry
    assert isinstance(recorder, telemetry.StepTelemetry)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    for step in range(5):
        optimizer.zero_grad()
        for micro in range(2):  # accumulation: two forwards and backwards per step
            module(*_batch(step * 2 + micro)).backward()
        module.eval()
        with torch.no_grad():
            module(*_batch())  # an eval forward: not counted
        module.train()
        optimizer.step()
    times, samples, tokens, boundary = recorder.recorded()
    assert len(times) == 5 and all(t > 0 for t in times) and boundary == "optimizer step"
    assert samples == [16] * 5 and tokens == [16 * 12] * 5
    line = recorder.timings_line()
    assert line["hapd"] == "timings" and line["rank"] == 0 and line["world"] == 1 and line["warmup"] == 2
    assert line["iteration_s"] == times and line["samples_per_step"] == 16
    assert line["samples_per_s"] == pytest.approx(48 / sum(times[2:]))
    assert line["tokens_per_s"] == pytest.approx(12 * line["samples_per_s"])
    assert line["technique"] == "spmd" and line["estimate_s"] > 0 and line["step_boundary"] == "optimizer step"
    assert isinstance(line["loss_part"], float) and line["loss_part"] > 0  # the last training forward's (one rank)
    # rank 0 logs every step: TensorBoard scalars, or JSON lines without tensorboard
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    if (tmp_path / "logs" / telemetry.LOG_FILE).exists():
        rows = [json.loads(x) for x in (tmp_path / "logs" / telemetry.LOG_FILE).read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[0]["samples"] == 16
        assert all(isinstance(r["loss"], float) and r["loss"] > 0 for r in rows)  # the step's global loss
        assert "tensorboard is not installed" in capsys.readouterr().err
    else:
        assert any(name.startswith("events.out.tfevents") for name in logs), logs
    recorder.close()


def test_a_script_that_reports_its_own_timings_keeps_them(monkeypatch, capsys) -> None:
    monkeypatch.setenv("HAPD_TELEMETRY", "1")
    torch.manual_seed(0)
    module = hapd.parallelize(Classifier(), _batch(), use_daemon=False, verbose=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for _ in range(3):
        module(*_batch()).backward()
        optimizer.step()
    monkeypatch.setattr(telemetry, "_recorders", [module._telemetry])
    monkeypatch.setattr(telemetry, "_reported_by_script", False)  # as in a fresh process
    telemetry.emit_at_exit()
    printed = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith('{"hapd"')]
    assert len(printed) == 1 and printed[0]["source"] == "parallel_module" and len(printed[0]["iteration_s"]) == 3
    monkeypatch.setattr(telemetry, "_reported_by_script", True)  # hapd.harness.training.report says so
    telemetry.emit_at_exit()
    assert '{"hapd"' not in capsys.readouterr().out


def test_the_table_shows_rates_and_sums_the_loss_parts() -> None:
    timings = Timings()
    for rank, part in ((0, 0.5), (1, 0.25)):
        timings.feed(rank, json.dumps({"hapd": "timings", "rank": rank, "world": 2, "system": "hapd", "model": "M",
                                       "iteration_s": [0.5, 0.1, 0.01, 0.01], "warmup": 2, "loss_part": part,
                                       "samples_per_step": 8, "samples_per_s": 800.0, "tokens_per_s": 9600.0,
                                       "step_boundary": "optimizer step"}))
    report = build_report(timings, job="j", script="s.py", args=[], world_size=2, placement=[], rank_hosts={},
                          exit_code=0)
    assert report["loss"] == 0.75 and report["overall"]["samples_per_s"] == pytest.approx(800.0)
    assert report["overall"]["tokens_per_s"] == pytest.approx(9600.0)
    table = format_table(report)
    assert "samples/s" in table.splitlines()[1] and "tokens/s" in table.splitlines()[1]
    assert "throughput 800.0 samples/s, 9600 tokens/s (8 samples per step" in table and "loss 0.75 " in table


@pytest.mark.distributed
def test_a_users_script_under_the_launcher_gets_the_table_and_report(tmp_path) -> None:
    script = tmp_path / "my_script.py"
    script.write_text(USER_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE", "HAPD_JOB")}
    env["HAPD_HOME"] = str(tmp_path / "home")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    report_path = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "launcher", "run", str(script), "-n", "2", "--report",
                           str(report_path), "--progress"], capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert re.search(r"^\[rank 0\] plan: SPMD \(data parallel\), per-rank batch 4/4 of 8; .* DP-CP .*, \d+ ms$", out,
                     re.M), out
    steps = re.findall(r"^\[rank 0\] hapd: step (\d+), loss ([\d.]+), [\d.]+ ms/step, \d+ samples/s, \d+ tokens/s$",
                       done.stderr, re.M)
    assert steps and steps[0][0] == "1" and steps[-1][0] == "6", done.stderr  # the first step, then to the end
    assert '{"hapd"' not in out  # consumed by the launcher
    assert "per-iteration timings of job my_script-" in out and "(hapd Classifier; 2 of 2 ranks" in out
    assert re.search(r"^throughput [\d.]+ samples/s, \d+ tokens/s \(8 samples per step", out, re.M), out
    data = json.loads(report_path.read_text())
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and data["missing_ranks"] == []
    assert all(len(r["iteration_s"]) == 6 and r["iterations"] == 4 and r["samples_per_step"] == 8
               and r["tokens_per_s"] == pytest.approx(12 * r["samples_per_s"]) for r in data["ranks"])
    assert data["overall"]["iterations"] == 4 and data["overall"]["samples_per_s"] > 0
    assert data["loss"] == pytest.approx(sum(r["loss_part"] for r in data["ranks"]))
    assert f"loss {data['loss']:.6g} (last iteration, global batch)" in out
    assert float(steps[-1][1]) == pytest.approx(data["loss"], abs=1e-4)  # the progress line's loss is the global one
