"""examples/finetune_classifier.py (a DistilBERT classifier, frozen embeddings) and
examples/train_vision.py (a torchvision ConvNeXt), at tiny sizes for 3 steps: on one
process (plain python) and on 2 ranks through ``hapd run`` from a folder outside the
repository; the losses of the two runs agree — the classifier with its default dropout
0.1, which one process draws as the two ranks do (hapd's generator, the default) — and,
for the classifier, the frozen embeddings are unchanged.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torchvision")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "finetune_classifier": ["--steps", "3", "--batch", "8", "--seq", "8", "--samples", "64", "--vocab", "50",
                            "--width", "16", "--layers", "1", "--heads", "2"],  # its default dropout 0.1
    "train_vision": ["--steps", "3", "--batch", "8", "--image", "16", "--samples", "32", "--width", "8", "--depth", "1",
                     "--drop-path", "0", "--classes", "4"],
}
FINAL = re.compile(r"^(?:\[rank 0\] )?loss (\S+) at step 1 -> (\S+) at step 3; (.*)$", re.M)


def _final(out: str) -> tuple[float, float, str]:
    m = FINAL.search(out)
    assert m, out[-3000:]
    return float(m.group(1)), float(m.group(2)), m.group(3)


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_an_example_trains_alike_on_one_process_and_two_ranks(name, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE", "HAPD_JOB")}
    env["HAPD_HOME"] = str(tmp_path / "home")
    script = ROOT / "examples" / f"{name}.py"
    one = subprocess.run([sys.executable, str(script), *EXAMPLES[name]], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=env)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    two = subprocess.run([sys.executable, "-m", "hapd.cli", "run", str(script), "-n", "2", "--", *EXAMPLES[name]],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    (first1, last1, rest1), (first2, last2, rest2) = _final(one.stdout), _final(two.stdout)
    assert first1 == pytest.approx(first2, rel=1e-5) and last1 == pytest.approx(last2, rel=1e-5)
    if name == "train_vision":  # what each rank reads is said (lengths, or the whole batch), never "None"
        assert "None" not in one.stdout + two.stdout
        assert re.search(r"^convnext\S*: [\d,]+ parameters, 1 rank\(s\) reading 8 images of every batch of 8", one.stdout,
                         re.M), one.stdout
    if name == "finetune_classifier":
        assert rest1.endswith("frozen embeddings unchanged: True") and rest2.endswith("frozen embeddings unchanged: True")
        assert re.search(r"^\[rank 0\] classifier: [\d,]+ of [\d,]+ parameters trainable \(embeddings frozen\), 2 rank",
                         two.stdout, re.M), two.stdout
