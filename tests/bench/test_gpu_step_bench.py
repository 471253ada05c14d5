"""bench/gpu_step.py on the CPU at the zoo's tiny sizes, one timed step: every row is
there, the ratios are positive finite numbers, hapd's first loss is eager's, the op
table counts the key ops, ``--out`` holds each measurement, and a variant that cannot
compile is a skipped row rather than the end of the run. Nothing here is time-based."""

from __future__ import annotations

import json
import math

import pytest

import _bench

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bench():
    return _bench.load("gpu_step")


def _positive(x) -> bool:
    return x is not None and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_tiny_run_reports_every_row_ratio_and_op_count(bench, tmp_path, monkeypatch, capsys):
    def no_compile(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(bench.torch, "compile", no_compile)
    # one model (every code path; llama's rows are gpt2's in kind), with dropout: with
    # rng="torch" hapd draws with torch's generator as the model does, so the losses agree
    rows = bench.main(["--size", "tiny", "--device", "cpu", "--iterations", "1", "--warmup", "1", "--batch", "4",
                       "--models", "gpt2", "--op-table", "--out", str(tmp_path), "--dropout", "0.1", "--rng", "torch"])
    out = capsys.readouterr().out

    by = {(r.model, r.precision, r.variant): r for r in rows}
    assert set(by) == {("gpt2", p, v) for p in ("fp32", "bf16") for v in bench.VARIANTS}
    for m in ("gpt2",):
        for p in ("fp32", "bf16"):
            eager, hapd = by[(m, p, "eager")], by[(m, p, "hapd")]
            assert eager.ok and hapd.ok, (eager.error, hapd.error)
            assert _positive(eager.median_s) and _positive(hapd.median_s)
            assert _positive(hapd.median_s / eager.median_s)
            assert _positive(hapd.peak_bytes) or hapd.peak_kind == "n/a"
            assert hapd.first_loss == pytest.approx(eager.first_loss, abs=1e-3 if p == "bf16" else 1e-5)
            for r in (eager, hapd):
                counts = r.ops["key_counts"]
                assert any("scaled_dot_product" in k for k in counts), counts
                assert any(k in counts for k in ("aten::mm", "aten::addmm")), counts
                assert r.ops["top"] and r.ops["host_op_ms"] > 0
            for v in ("compiled-eager", "compiled-hapd"):
                assert by[(m, p, v)].status == "skipped" and "no compiler here" in by[(m, p, v)].error

    assert "hapd profile:" in out and "hapd/eager" in out and "key ops per step" in out
    table = (tmp_path / "table.txt").read_text()
    for m in ("gpt2",):
        for p in ("fp32", "bf16"):
            line = next(x for x in table.splitlines() if x.split()[:2] == [m, p])
            ratio = float(line.split()[4].rstrip("×"))
            assert _positive(ratio)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == len(rows)
    saved = json.loads((tmp_path / "gpt2-fp32-hapd.json").read_text())
    assert saved["status"] == "ok" and saved["plan"]["estimate_memory"] > 0 and _positive(saved["ratio_to_baseline"])
    assert "key ops per step" in (tmp_path / "ops.txt").read_text()
