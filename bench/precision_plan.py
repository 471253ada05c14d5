"""Plans in the precision a job trains in: fp32 against fp16 (or bf16) on one profile.

    .venv/bin/python bench/precision_plan.py                         # zoo GPT-2 124M, batch 64 × 1024, paper-8
    .venv/bin/python bench/precision_plan.py --model gpt2 --batch 64 --profile paper-8 --precision fp16

The model is the zoo's (transformers, its default dropout), built on the meta device at
paper size and exported once. Three plans, compiled back to back:

- **fp32**: what hapd planned before it knew precisions (HAP's fp32 rates: V100 : P100
  1.8 : 1);
- **fp16**: the plan for the job in fp16 (each device's fp16 matmul rate: 7.1 : 1 on
  paper-8, activations at autocast's dtypes);
- **fp32 split at fp16**: the fp32 plan's program and ratios (every op forced to its
  rule, the ratios fixed) priced at the fp16 rates: what running the fp32 plan in fp16
  costs. The fp16 plan must beat it.

Printed: each plan's ratios and predicted step, and the ratio of the third's step to the
fp16 plan's (> 1: planning in the right precision pays). Exits 1 when the fp16 plan is
predicted slower than the fp32 split in fp16.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hapd.compiler.driver import compile as compile_plan  # noqa: E402
from hapd.compiler.options import CompileOptions  # noqa: E402
from hapd.compiler.replan import forced_rules  # noqa: E402
from hapd.ir.export import export  # noqa: E402
from hapd.ir.lower import lower  # noqa: E402
from hapd.models.zoo import ZOO  # noqa: E402
from hapd.profile.schema import load_profile  # noqa: E402
from hapd.state.weights import init_on_meta  # noqa: E402


def _ratios(plan) -> str:
    return " ".join(f"{r:.3f}" for r in plan.ratios)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2", help="a zoo model (hapd.models.zoo.ZOO)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--profile", default="paper-8")
    parser.add_argument("--precision", default="fp16", choices=["fp16", "bf16"])
    args = parser.parse_args()
    profile = load_profile(args.profile)
    start = time.perf_counter()
    with init_on_meta():
        module, inputs = ZOO[args.model](batch=args.batch, size="paper")
    graph = lower(export(module, inputs))
    print(f"{args.model} paper size, batch {args.batch}, on {profile.name}: exported and lowered in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    plans = {}
    for label, options in (("fp32", CompileOptions()), (args.precision, CompileOptions(precision=args.precision))):
        start = time.perf_counter()
        plans[label] = compile_plan(graph, profile, options)
        print(f"  {label:<22} ratios {_ratios(plans[label])}  {plans[label].estimate['per_iteration'] * 1e3:9.2f} ms "
              f"predicted  (compiled in {time.perf_counter() - start:.1f} s)", flush=True)
    fp32 = plans["fp32"]
    as_is = CompileOptions(precision=args.precision, ratios=tuple(fp32.ratios), force=forced_rules(fp32))
    priced = compile_plan(graph, profile, as_is)
    label = f"fp32 split at {args.precision}"
    print(f"  {label:<22} ratios {_ratios(priced)}  {priced.estimate['per_iteration'] * 1e3:9.2f} ms predicted")
    own = plans[args.precision].estimate["per_iteration"]
    ratio = priced.estimate["per_iteration"] / own
    print(f"the {args.precision} plan against the fp32 plan run in {args.precision}: {ratio:.2f}× faster "
          f"(predicted); {plans[args.precision].explain().splitlines()[4]}")
    met = ratio >= 1.0
    print(f"target: the {args.precision} plan beats the fp32 split in {args.precision}: {'MET' if met else 'MISS'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
