"""Runtime overhead: worker.py with a data-parallel plan against DDP, same model and batch.

    .venv/bin/python bench/runtime_overhead.py                    # bert, vit, mlp; 3 rounds
    .venv/bin/python bench/runtime_overhead.py --models bert --rounds 5

Both run on 2 local CPU ranks (torchrun, Gloo) with an even split of the global batch:
DDP (``ddp.py --split even``) and hapd (``worker.py --mode data_parallel`` on an
estimated homogeneous profile, so the plan is the batch split with replicated
parameters). Runs alternate (DDP, hapd, DDP, hapd, …) so drift on a shared machine hits
both alike; the printed ratio is hapd's median per-iteration time over DDP's (target
≤ 1.05).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(script: str, flags: list[str], nproc: int) -> dict:
    """One torchrun job; its ``{"hapd": "summary"}`` line."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / script), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{script} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("{") and '"summary"' in line:
            return json.loads(line)
    raise SystemExit(f"{script} printed no summary:\n{proc.stdout[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["bert", "vit", "mlp"])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "runtime_overhead.json")
    args = parser.parse_args()
    common = ["--batch", str(args.batch), "--iterations", str(args.iterations), "--warmup", str(args.warmup)]
    rows = []
    print(f"{'model':<8} {'DDP ms':>10} {'hapd ms':>10} {'hapd/DDP':>9}   (medians of {args.rounds} alternating runs, "
          f"{args.nproc} CPU ranks, batch {args.batch})")
    for model in args.models:
        ddp, hapd = [], []
        for _ in range(args.rounds):
            ddp.append(run("ddp.py", ["--model", model, "--split", "even", *common], args.nproc)["mean_s"])
            hapd.append(run("worker.py", ["--model", model, "--mode", "data_parallel", *common], args.nproc)["mean_s"])
        d, h = statistics.median(ddp), statistics.median(hapd)
        rows.append({"model": model, "ddp_s": ddp, "hapd_s": hapd, "ratio": h / d})
        print(f"{model:<8} {d * 1e3:>10.2f} {h * 1e3:>10.2f} {h / d:>8.3f}×", flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
