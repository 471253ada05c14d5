"""Llama-7B on the paper cluster with its real memory: does the plan fit, and does data
parallelism?

    .venv/bin/python bench/memory_fit.py                     # Llama-7B, paper-8, 4 x 512 tokens
    .venv/bin/python bench/memory_fit.py --batch 8 --seq 512 --profile paper-16

Llama at its paper size (32 × 4096, ~6.7B parameters) is built and exported on the
meta device (nothing is allocated), lowered, and compiled for ``--profile`` whose
devices carry their own memory (paper-8: two 32 GiB V100s, six 16 GiB P100s) with
memory caps on (the default). Printed: the compile's seconds, each device's predicted
peak against its capacity (with the parts: parameters, gradients, Adam state, kept
activations, …), which rules the plan runs, and the data-parallel program's peak per
device with whether any split of the batch fits it.

The default step is 4 sequences of 512 tokens: fp32 weights with Adam's moments take
~108 GiB of the cluster's 160 GiB, and attention with dropout keeps its probabilities
(heads × seq² per sequence and layer), so 4 × 512 tokens fit and a full 2048-token
sequence does not (the compile says by how much, on which device).
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
from hapd.compiler.driver import CompileOptions  # noqa: E402
from hapd.compiler.driver import compile as compile_plan  # noqa: E402
from hapd.compiler.export import export  # noqa: E402
from hapd.compiler.lower import lower  # noqa: E402
from hapd.compiler.ratios import row_values  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="paper-8")
    parser.add_argument("--batch", type=int, default=4, help="global batch (default 4)")
    parser.add_argument("--seq", type=int, default=512, help="sequence length (default 512; the paper's is 2048)")
    args = parser.parse_args()
    profile = load_profile(args.profile)

    start = time.perf_counter()
    graph, config, params = paper_llama(args.batch, args.seq)
    lowered_s = time.perf_counter() - start
    print(f"Llama paper size: {config.layers} x {config.hidden}, seq {config.seq}, {params / 1e9:.2f}B parameters, "
          f"global batch {args.batch}; export + lowering {lowered_s:.1f} s")
    print(f"profile {profile.name}: " + ", ".join(f"{d.model} {format_bytes(d.memory)}" for d in profile.devices))

    start = time.perf_counter()
    try:
        plan = compile_plan(graph, profile, CompileOptions())
    except SynthesisError as exc:
        print(f"compile {time.perf_counter() - start:.2f} s: {exc}")
        return
    seconds = time.perf_counter() - start
    print(f"compile {seconds:.2f} s (search {plan.doc['stats']['synthesis_seconds']:.2f} s), "
          f"chosen from {plan.doc['stats']['chosen_from']}, {plan.estimate['per_iteration']:.2f} s per iteration "
          f"(DP-CP {plan.doc['baselines']['dp_cp']:.2f} s)")
    rules = Counter(s["rule"] for s in plan.program["steps"] if s["work"] != "free")
    print("rules: " + ", ".join(f"{rule} {n}" for rule, n in rules.most_common()))

    ratios = plan.doc["ratios"]
    parts = plan.program["memory_parts"]
    dp = plan.doc["baselines"]["dp_memory"]
    print(f"\n{'rank':>4} {'device':<6} {'capacity':>10} {'plan peak':>10} {'fits':>5} {'ratio':>6} {'DP peak':>10}  parts")
    for d, device in enumerate(profile.devices):
        peak = plan.estimate["memory"][d]
        part = {k: row_values(v, ratios)[d] for k, v in parts.items()}
        shown = ", ".join(f"{k} {format_bytes(v)}" for k, v in part.items() if v >= 2**20)
        print(f"{d:>4} {device.model:<6} {format_bytes(device.memory):>10} {format_bytes(peak):>10} "
              f"{'yes' if peak <= device.memory else 'NO':>5} {ratios[d]:>6.3f} {format_bytes(dp[d]):>10}  {shown}")
    fits = all(p <= d.memory for p, d in zip(plan.estimate["memory"], profile.devices))
    print(f"\nplan fits every device: {'yes' if fits else 'NO'}; data parallel fits: "
          f"{'yes' if plan.doc['baselines']['dp_fits'] else 'no'} (its peak under the FLOP/s split: "
          f"{format_bytes(max(dp))} on the fullest device)")


if __name__ == "__main__":
    main()
