"""One process equals N ranks, with dropout on and no setting changed.

    python bench/one_equals_n.py                       # 1 process vs 2 and 3 ranks, pipeline, overlap
    python bench/one_equals_n.py --steps 10 --worlds 2 # shorter

A newcomer's script (:data:`SCRIPT`, 30 lines: a transformers GPT-2 from a small config
with its default dropout 0.1, ``hapd.parallelize``, ``hapd.loader``, AdamW) is run as
``python SCRIPT`` and through the launcher as ``hapd run SCRIPT -n N`` for each ``N``,
and, on 3 ranks, with a profile of two hosts behind a slow link on which the search
picks a pipeline, and with the overlapped duplicas forced. Each run writes its global
loss of every step; the table gives, per run, the largest relative gap to the one
process's loss over the steps, and the run exits 1 when one exceeds ``--tol`` (1e-5) —
the same numbers up to the order of the sums a split changes. Also the wall time of
each run (imports, export, plan and training; this machine's, noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = '''\
import json, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel
import hapd

class LanguageModel(torch.nn.Module):
    """A transformers GPT-2 whose forward returns the loss (dropout 0.1: its default)."""
    def __init__(self):
        super().__init__()
        self.gpt = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    def forward(self, ids):
        return self.gpt(input_ids=ids, labels=ids).loss

out, steps, technique = sys.argv[1], int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = LanguageModel()
data = torch.utils.data.TensorDataset(torch.randint(0, 256, (steps * 12, 32), generator=torch.Generator().manual_seed(1)))
extra = {}
if technique != "spmd":
    from profile_two_hosts import two_hosts
    extra = dict(profile=two_hosts(int(__import__("os").environ.get("WORLD_SIZE", 1))), use_daemon=False,
                 options={"pipeline": "auto"} if technique == "pipeline" else {"overlap": True},
                 overlap="always" if technique == "overlap" else "auto")
module = hapd.parallelize(model, (data.tensors[0][:12],), **extra)
optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
losses = []
for (ids,) in hapd.loader(data, module, shuffle=False):
    optimizer.zero_grad(set_to_none=True)
    loss = module(ids)
    loss.backward()
    optimizer.step()
    losses.append(module.global_loss(loss))
if module.rank == 0:
    json.dump({"losses": losses, "technique": type(module).__name__}, open(out, "w"))
'''

PROFILE = '''\
import dataclasses
from hapd.profile.schema import Link, estimated_profile

def two_hosts(world):
    """Host a (one fast rank) and host b (the others) behind a slow link: a pipeline wins."""
    flops = [3e10] + [1e10] * (world - 1)
    hosts = ["a"] + ["b"] * (world - 1)
    profile = estimated_profile(world, flops=flops, hosts=hosts, alpha=1e-5, beta=1e6)
    links = {n: {"inter": l["inter"], "intra": Link(alpha=1e-6, beta=1e10)} for n, l in profile.collectives.items()}
    return dataclasses.replace(profile, collectives=links, name=f"two-hosts-{world}")
'''


def _run(folder: Path, label: str, command: list[str], out: Path, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=folder, env=env, timeout=timeout)
    seconds = time.perf_counter() - start
    if done.returncode != 0 or not out.exists():
        tail = (done.stdout + done.stderr)[-2000:]
        return {"label": label, "error": f"exit {done.returncode}: {tail}", "seconds": seconds}
    return {"label": label, **json.loads(out.read_text()), "seconds": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--no-techniques", action="store_true", help="skip the pipeline and overlap runs")
    parser.add_argument("--tol", type=float, default=1e-5)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="hapd-one-equals-n-"))
    (folder / "my.py").write_text(SCRIPT)
    (folder / "profile_two_hosts.py").write_text(PROFILE)
    hapd_cli = [sys.executable, "-m", "hapd.cli"]
    runs = [("python my.py", [sys.executable, "my.py"], "spmd", 1)]
    runs += [(f"hapd run my.py -n {n}", [*hapd_cli, "run", "my.py", "-n", str(n), "-q", "--"], "spmd", n)
             for n in args.worlds]
    if not args.no_techniques:
        runs += [(f"hapd run -n 3, {t}", [*hapd_cli, "run", "my.py", "-n", "3", "-q", "--"], t, 3)
                 for t in ("pipeline", "overlap")]
    results = []
    for label, command, technique, _ in runs:
        out = folder / f"{len(results)}.json"
        result = _run(folder, label, [*command, str(out), str(args.steps), technique], out, args.timeout)
        results.append(result)
        print(f"  ran {label}: {result.get('technique', result.get('error', '?')[:200])} in "
              f"{result['seconds']:.1f} s", flush=True)
    base = results[0]
    if "error" in base:
        print(f"the one-process run failed: {base['error']}")
        return 1
    failed = False
    print(f"\n{'run':<28} {'module':<16} {'steps':>5} {'max rel gap':>12} {'first loss':>12} {'wall s':>7}")
    for r in results:
        if "error" in r:
            print(f"{r['label']:<28} failed: {r['error'][:300]}")
            failed = True
            continue
        gaps = [abs(a - b) / abs(b) for a, b in zip(r["losses"], base["losses"])]
        gap = max(gaps) if len(r["losses"]) == len(base["losses"]) else float("inf")
        failed |= gap > args.tol
        mark = "" if gap <= args.tol else "  MISS"
        print(f"{r['label']:<28} {r['technique']:<16} {len(r['losses']):>5} {gap:>12.2e} {r['losses'][0]:>12.8f} "
              f"{r['seconds']:>7.1f}{mark}")
    print(f"\ntolerance {args.tol:g} relative at every step; scripts in {folder}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
