"""examples/train_gpt2.py, the example users copy, at tiny sizes through the launcher (a
daemon started for each job): the loss goes down on 2 ranks; a run stopped at a
checkpoint and resumed on 3 ranks given a two-host cluster's profile — where the search
picks a pipeline — ends where the uninterrupted run ends (the step, the optimizer, the
LR schedule and the data position all carry over, from an SPMD plan to a pipeline), and
the exported models load with ``GPT2LMHeadModel.from_pretrained``.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tqdm")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt2.py"
TINY = ["--width", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--batch", "8", "--lr", "1e-2",
        "--warmup", "2"]
STEPS = 8
TEXT = b"the quick brown fox jumps over the lazy dog. " * 10
"""450 bytes: 28 windows of 16, 3 global batches of 8 per epoch, so the runs cross epochs
and the resumed one starts mid-epoch (epoch 1, batch 1)."""
FINAL = re.compile(r"^\[rank 0\] loss (\S+) at step (\d+) -> (\S+) at step (\d+); ", re.M)


def _example_module():
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import train_gpt2
    finally:
        sys.path.remove(str(EXAMPLE.parent))
    return train_gpt2


def two_hosts(path: Path) -> Path:
    """The profile of host a (one fast rank) and host b (two ranks) behind a slow link."""
    import dataclasses

    from hapd.profile.schema import Link, estimated_profile

    profile = estimated_profile(3, flops=[2e10, 1e10, 1e10], hosts=["a", "b", "b"], alpha=1e-5, beta=1e6)
    links = {n: {"inter": link["inter"], "intra": Link(alpha=1e-6, beta=1e10)} for n, link in profile.collectives.items()}
    return dataclasses.replace(profile, collectives=links, name="two-hosts").save(path)


def train(tmp: Path, *flags: str, ranks: int = 2) -> str:
    """``./run_all examples/train_gpt2.py RANKS -- TINY --text TEXT FLAGS`` in ``tmp``; its stdout."""
    text = tmp / "text.txt"
    text.write_bytes(TEXT)
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE", "HAPD_JOB")}
    env["HAPD_HOME"] = str(tmp / "home")
    done = subprocess.run([str(ROOT / "run_all"), str(EXAMPLE), str(ranks), "--", *TINY, "--text", str(text), *flags],
                          capture_output=True, text=True, timeout=300, cwd=tmp, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert '{"hapd"' not in done.stdout  # a clean console
    return done.stdout


def final_losses(out: str) -> tuple[float, int, float, int]:
    """(first loss, its step, last loss, its step) from rank 0's closing line."""
    m = FINAL.search(out)
    assert m, out[-3000:]
    return float(m.group(1)), int(m.group(2)), float(m.group(3)), int(m.group(4))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    """An uninterrupted run of STEPS steps on 2 ranks, and one stopped at STEPS/2 then
    resumed on 3 ranks of a two-host profile (a pipeline)."""
    tmp = tmp_path_factory.mktemp("example")
    whole = train(tmp, "--steps", str(STEPS), "--save-every", "4", "--checkpoint", str(tmp / "ck-whole"),
                  "--export", str(tmp / "model"))
    stopped = train(tmp, "--steps", str(STEPS), "--stop-at", str(STEPS // 2), "--save-every", "4",
                    "--checkpoint", str(tmp / "ck-part"), "--export", str(tmp / "part-model"))
    resumed = train(tmp, "--steps", str(STEPS), "--resume", "--checkpoint", str(tmp / "ck-part"),
                    "--export", str(tmp / "part-model"), "--profile", str(two_hosts(tmp / "two-hosts.json")), ranks=3)
    return {"whole": whole, "stopped": stopped, "resumed": resumed, "tmp": str(tmp)}


@pytest.mark.distributed
def test_the_loss_goes_down_and_checkpoints_are_written(runs):
    out = runs["whole"]
    assert re.search(r"^\[rank 0\] plan: ", out, re.M) and "2 rank(s) reading [4, 4] samples each" in out
    assert "28 windows of 16 bytes, 3 steps per epoch" in out
    assert "checkpoint: step 4 in " in out and "checkpoint: step 8 in " in out
    first, first_step, last, last_step = final_losses(out)
    assert (first_step, last_step) == (1, STEPS)
    assert abs(first - math.log(256)) < 0.2  # a random byte-level model
    assert last < first - 0.3, (first, last)
    assert re.search(r"^\[rank 0\] train: 100%.*loss=.*tok_s=", out, re.M)  # the progress bar, one line per refresh


@pytest.mark.distributed
def test_a_resumed_run_ends_where_an_uninterrupted_one_does(runs):
    assert "checkpoint: step 4 in " in runs["stopped"] and final_losses(runs["stopped"])[3] == STEPS // 2
    resumed = runs["resumed"]
    assert "resuming at step 4" in resumed and "3 rank(s) reading whole batches" in resumed, resumed[:3000]
    assert re.search(r"^\[rank 0\] plan: pipeline, 2 stages \(rank 0, ranks 1-2\)", resumed, re.M), resumed[-3000:]
    _, first_step, last, last_step = final_losses(resumed)
    assert (first_step, last_step) == (STEPS // 2 + 1, STEPS)
    whole_last = final_losses(runs["whole"])[2]
    assert last == pytest.approx(whole_last, abs=2e-5), (last, whole_last)  # printed to 5 decimals


@pytest.mark.distributed
def test_the_exported_model_loads_with_from_pretrained(runs):
    from transformers import GPT2LMHeadModel

    example = _example_module()
    data = example.ByteWindows(TEXT, 16)
    ids = torch.stack([data[i][0] for i in range(len(data))])
    losses = []
    for name in ("model", "part-model"):  # written by an SPMD plan, and by a pipeline
        model = GPT2LMHeadModel.from_pretrained(Path(runs["tmp"]) / name)
        with torch.no_grad():
            losses.append(float(model(input_ids=ids, labels=ids).loss))
    assert losses[0] < math.log(256) - 0.3  # trained weights, not a fresh init
    assert losses[1] == pytest.approx(losses[0], abs=1e-4)  # the same weights, whichever technique trained them


def test_byte_windows():
    example = _example_module()
    data = example.ByteWindows(bytes(range(40)), seq=16)
    assert len(data) == 2
    ids, labels = data[1]
    assert ids.tolist() == list(range(16, 32)) and torch.equal(ids, labels) and ids.dtype == torch.long
    assert len(example.ByteWindows(bytes(40), seq=16, stride=8)) == 4
    factor = example.cosine(warmup=2, total=10)
    assert factor(0) == 0.5 and factor(1) == 1.0 and factor(2) == pytest.approx(1.0)
    assert factor(10) == pytest.approx(0.1) and factor(50) == pytest.approx(0.1)
