"""Llama-7B on the paper cluster with its real memory: does the plan fit, does data
parallelism, and what does activation recomputation change?

    .venv/bin/python bench/memory_fit.py                     # the recomputation sweep (below)
    .venv/bin/python bench/memory_fit.py --batch 4 --seq 512 # one compile, every device's peak
    .venv/bin/python bench/memory_fit.py --batch 1 --seq 2048 --recompute never --profile paper-16

Llama at its paper size (32 × 4096, ~6.7B parameters) is built and exported on the
meta device (nothing is allocated), lowered, and compiled for ``--profile`` whose
devices carry their own memory (paper-8: two 32 GiB V100s, six 16 GiB P100s) with
memory caps on (the default). Printed: the compile's seconds, each device's predicted
peak against its capacity (with the parts: parameters, gradients, Adam state, kept
activations, …), which rules the plan runs, and the data-parallel program's peak per
device with whether any split of the batch fits it.

fp32 weights with Adam's moments take ~108 GiB of the cluster's 160 GiB, and attention
with dropout keeps its probabilities (heads × seq² per sequence and layer), so without
activation recomputation 4 × 512 tokens fit and a full 2048-token sequence does not (the
compile says by how much, on which device).

Without ``--batch``/``--seq`` the script sweeps global batches (1 × 2048 tokens, and 4,
8, 16 and 32 sequences of 512) and compiles each twice: with recomputation off
(``recompute="never"``) and as a compile chooses it (``"auto"``: only when memory binds,
the fewest blocks that fit). Per case it prints whether each fits, the seconds per
iteration, how many of the 32 blocks are recomputed and each compile's seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hapd import models  # noqa: E402
from hapd.compiler.driver import compile as compile_plan  # noqa: E402
from hapd.ir.export import export  # noqa: E402
from hapd.ir.lower import lower  # noqa: E402
from hapd.compiler.options import CompileOptions  # noqa: E402
from hapd.compiler.ratios import part_memory  # noqa: E402
from hapd.errors import SynthesisError  # noqa: E402
from hapd.profile.schema import load_profile  # noqa: E402
from hapd.util import format_bytes  # noqa: E402


def paper_llama(batch: int, seq: int | None):
    """Llama-7B (``llama_block`` at paper size) exported and lowered on the meta device."""
    name = "llama_block"
    spec = models.get(name)
    overrides = {"seq": seq} if seq else {}
    config = models.make_config(name, "paper", **overrides)
    with torch.device("meta"):
        module = spec.build(config)
        inputs = spec.example_inputs(config, batch)
    params = sum(p.numel() for p in module.parameters())
    return lower(export(module, inputs, batch_dims=spec.batch_dims), name=name), config, params


SWEEP = ((1, 2048), (4, 512), (8, 512), (16, 512), (32, 512))
"""(global batch, sequence length) of the recomputation sweep."""


def compile_case(graph, profile, recompute: str):
    """The plan (or the SynthesisError) and the compile's seconds."""
    start = time.perf_counter()
    try:
        plan = compile_plan(graph, profile, CompileOptions(recompute=recompute))
    except SynthesisError as exc:
        return exc, time.perf_counter() - start
    return plan, time.perf_counter() - start


def outcome(result) -> str:
    """One line for a compile: fits, time per iteration, blocks recomputed."""
    if isinstance(result, SynthesisError):
        short = str(result).split(", in the best of")[0].split("needs ")[-1]
        return f"does not fit (needs {short})"
    blocks = len(result.program.get("recompute", []))
    return (f"fits, {result.estimate['per_iteration']:.2f} s/iteration, {blocks} blocks recomputed, "
            f"peak {format_bytes(max(result.estimate['memory']))}")


def sweep(profile) -> None:
    """Each case of :data:`SWEEP` compiled without recomputation and with it chosen."""
    print(f"{'batch x seq':>12}  {'recompute':>9}  {'compile':>8}  outcome")
    for batch, seq in SWEEP:
        graph, _, _ = paper_llama(batch, seq)
        for recompute in ("never", "auto"):
            result, seconds = compile_case(graph, profile, recompute)
            print(f"{batch:>5} x {seq:<5}  {recompute:>9}  {seconds:>7.2f}s  {outcome(result)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="paper-8")
    parser.add_argument("--batch", type=int, default=None, help="global batch (default: the sweep)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the sweep; the paper's is 2048)")
    parser.add_argument("--recompute", default="auto", choices=("auto", "never", "always"))
    args = parser.parse_args()
    profile = load_profile(args.profile)
    print(f"profile {profile.name}: " + ", ".join(f"{d.model} {format_bytes(d.memory)}" for d in profile.devices))
    if args.batch is None and args.seq is None:
        sweep(profile)
        return

    start = time.perf_counter()
    graph, config, params = paper_llama(args.batch or 4, args.seq or 512)
    lowered_s = time.perf_counter() - start
    print(f"Llama paper size: {config.layers} x {config.hidden}, seq {config.seq}, {params / 1e9:.2f}B parameters, "
          f"global batch {args.batch or 4}; export + lowering {lowered_s:.1f} s")

    plan, seconds = compile_case(graph, profile, args.recompute)
    if isinstance(plan, SynthesisError):
        print(f"compile {seconds:.2f} s: {plan}")
        return
    print(f"compile {seconds:.2f} s (search {plan.doc['stats']['synthesis_seconds']:.2f} s), "
          f"chosen from {plan.doc['stats']['chosen_from']}, {plan.estimate['per_iteration']:.2f} s per iteration "
          f"(DP-CP {plan.doc['baselines']['dp_cp']:.2f} s)")
    rules = Counter(s["rule"] for s in plan.program["steps"] if s["work"] != "free")
    print("rules: " + ", ".join(f"{rule} {n}" for rule, n in rules.most_common()))
    recomputed = plan.program.get("recompute", [])
    print(f"activation recomputation: {len(recomputed)} of {config.layers} blocks")

    ratios = plan.doc["ratios"]
    parts = part_memory(plan.program, ratios)
    dp = plan.doc["baselines"]["dp_memory"]
    print(f"\n{'rank':>4} {'device':<6} {'capacity':>10} {'plan peak':>10} {'fits':>5} {'ratio':>6} {'DP peak':>10}  parts")
    for d, device in enumerate(profile.devices):
        peak = plan.estimate["memory"][d]
        shown = ", ".join(f"{k} {format_bytes(v[d])}" for k, v in parts.items() if v[d] >= 2**20)
        print(f"{d:>4} {device.model:<6} {format_bytes(device.memory):>10} {format_bytes(peak):>10} "
              f"{'yes' if peak <= device.memory else 'NO':>5} {ratios[d]:>6.3f} {format_bytes(dp[d]):>10}  {shown}")
    fits = all(p <= d.memory for p, d in zip(plan.estimate["memory"], profile.devices))
    print(f"\nplan fits every device: {'yes' if fits else 'NO'}; data parallel fits: "
          f"{'yes' if plan.doc['baselines']['dp_fits'] else 'no'} (its peak under the FLOP/s split: "
          f"{format_bytes(max(dp))} on the fullest device)")


if __name__ == "__main__":
    main()
