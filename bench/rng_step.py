"""What hapd's generator costs one process: a training step with ``rng="counter"`` (the
default) against ``rng="torch"`` (torch's own dropout and attention kernels).

    python bench/rng_step.py                                  # zoo GPT-2 and BERT, small, CPU or CUDA
    python bench/rng_step.py --models gpt2 --size paper --iterations 10   # on a GPU

Per zoo model (its library's default dropout): both modules are ``hapd.parallelize``d on
one process from the same weights; their steps (forward, backward, AdamW, zero_grad)
alternate so that a busy machine's drift hits both alike. Prints each median, the ratio
counter/torch (the target: ≤ 1.1 on CPU, ≤ 1.03 on a GPU), and where the counter's
step spends its extra time (torch.profiler's self time of the attention, the draws and
the dropouts, one more step of each).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import hapd  # noqa: E402
from hapd.models import zoo  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(module: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=True)
    module(*inputs).backward()
    optimizer.step()
    _sync(device)
    return time.perf_counter() - start


def _profile(module: torch.nn.Module, optimizer: torch.optim.Optimizer, inputs: tuple, top: int) -> list[str]:
    """The ``top`` ops of one step by self CPU time (a CPU run's breakdown)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        optimizer.zero_grad(set_to_none=True)
        module(*inputs).backward()
        optimizer.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [f"    {e.key[:48]:<48} {e.self_cpu_time_total / 1e3:8.1f} ms  ×{e.count}" for e in events]


def measure(name: str, args: argparse.Namespace, device: torch.device) -> float:
    torch.manual_seed(0)
    model, inputs = zoo.make(name, args.batch, args.size)
    inputs = tuple(t.to(device) for t in inputs)
    modules, optimizers = {}, {}
    for rng in ("torch", "counter"):
        modules[rng] = hapd.parallelize(model.to(device), inputs, use_daemon=False, verbose=False, rng=rng)
        optimizers[rng] = torch.optim.AdamW(modules[rng].parameters(), lr=1e-4)
    times: dict[str, list[float]] = {"torch": [], "counter": []}
    for k in range(args.warmup + args.iterations):
        for rng in (("torch", "counter") if k % 2 == 0 else ("counter", "torch")):
            seconds = _step(modules[rng], optimizers[rng], inputs, device)
            if k >= args.warmup:
                times[rng].append(seconds)
    median = {rng: statistics.median(ts) for rng, ts in times.items()}
    ratio = median["counter"] / median["torch"]
    target = 1.03 if device.type == "cuda" else 1.1
    print(f"{name:<6} {args.size:<6} batch {args.batch}: torch {median['torch'] * 1e3:8.1f} ms  counter "
          f"{median['counter'] * 1e3:8.1f} ms  counter/torch {ratio:.3f}×  (target ≤ {target}×"
          f"{'' if ratio <= target else ', MISS'})", flush=True)
    if args.top and device.type == "cpu":
        for rng in ("torch", "counter"):
            print(f"  rng={rng}: top ops of one step by self CPU time")
            print("\n".join(_profile(modules[rng], optimizers[rng], inputs, args.top)))
    return ratio


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "bert"])
    parser.add_argument("--size", default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--top", type=int, default=6, help="top ops per variant on CPU (0: none)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"one process on {device} (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    for name in args.models:
        measure(name, args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
