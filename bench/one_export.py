"""Compile time with every technique in the space (SPMD, pipelines, overlap), from one
export against one export per shape.

    .venv/bin/python bench/one_export.py                       # ViT-24 on paper-8, before and after
    .venv/bin/python bench/one_export.py --zoo gpt2 vit_b16    # zoo models at paper size, after only
    .venv/bin/python bench/one_export.py --no-before

**Before** (what a user did by hand): the model exported at the global batch, at the
global batch over each micro-batch count (2, 4, 8, 16) and at half the global batch,
each lowered, then one compile with ``pipeline="auto"`` and the micro-batch graphs and
one with ``overlap=True`` on the half-batch graph. **After**: the model exported once
with a symbolic batch (``hapd export``), then one compile from it with
``CompileOptions(pipeline="auto", overlap=True)`` (the graphs at every batch are cut
from the one program, :mod:`hapd.compiler.techniques`). Printed: the export seconds and
the compile seconds (lowering included) of each, and the technique that won; after, the
compile's parts (lowering: every graph derived from the program, the symbolic program
made functional once included; then each technique's search).
Models are built on the meta device, the global batch 32 per device as in HAP.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hapd import models  # noqa: E402
from hapd.compiler.driver import compile as compile_plan  # noqa: E402
from hapd.ir.export import export  # noqa: E402
from hapd.ir.lower import lower  # noqa: E402
from hapd.compiler.options import CompileOptions  # noqa: E402
from hapd.compiler.pipeline.stage_search import micro_batch_counts  # noqa: E402
from hapd.compiler.techniques import graphs_of_program  # noqa: E402
from hapd.profile.schema import load_profile  # noqa: E402

EVERYTHING = CompileOptions(pipeline="auto", overlap=True)


def vit(layers: int):
    spec = models.get("vit")
    config = models.make_config("vit", "paper", layers=layers)

    def build(batch: int):
        with torch.device("meta"):
            return spec.build(config), spec.example_inputs(config, batch), spec.batch_dims
    return build


def zoo(name: str):
    from hapd.models.zoo import ZOO
    from hapd.state.weights import init_on_meta

    def build(batch: int):
        with init_on_meta():
            module, inputs = ZOO[name](batch=batch, size="paper")
        return module, inputs, None
    return build


def before(build, batch: int, profile) -> tuple[float, float, str]:
    start = time.perf_counter()
    programs = {}
    for b in sorted({batch, batch // 2, *(batch // m for m in micro_batch_counts(batch))}):
        module, inputs, dims = build(b)
        programs[b] = export(module, inputs, batch_dims=dims)
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    graphs = {b: lower(p, name="model") for b, p in programs.items()}
    micro = [graphs[batch // m] for m in micro_batch_counts(batch) if m > 1]
    spmd = compile_plan(graphs[batch], profile, CompileOptions(pipeline="auto"), micro_graphs=micro)
    both = compile_plan(graphs[batch // 2], profile, CompileOptions(overlap=True))
    compile_s = time.perf_counter() - start
    chosen = spmd.doc.get("pipeline") or {}
    best = min([("spmd", spmd.estimate["per_iteration"]), ("overlap", both.estimate["per_iteration"])]
               + ([("pipeline", chosen["per_iteration"])] if chosen.get("chosen") else []), key=lambda t: t[1])
    return export_s, compile_s, best[0]


def after(build, batch: int, profile) -> tuple[float, float, str, dict]:
    """(export seconds, compile seconds, the technique that won, the searches' seconds
    with ``lowering``: the compile's seconds deriving every graph from the program)."""
    start = time.perf_counter()
    module, inputs, dims = build(batch)
    program = export(module, inputs, batch_dims=dims, symbolic_batch=True)
    export_s = time.perf_counter() - start
    start = time.perf_counter()
    graphs = graphs_of_program(program, EVERYTHING)  # what compile_plan(program, …) does first
    lowering = time.perf_counter() - start
    plan = compile_plan(graphs, profile, EVERYTHING)
    return export_s, time.perf_counter() - start, plan.technique, {"lowering": lowering,
                                                                   **plan.doc["stats"]["techniques"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="paper-8")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--zoo", nargs="*", default=None, help="zoo models at paper size instead of the ViT")
    parser.add_argument("--no-before", action="store_true")
    args = parser.parse_args()
    profile = load_profile(args.profile)
    batch = 32 * profile.world
    targets = [(f"vit-{args.layers}", vit(args.layers))] if args.zoo is None else [(n, zoo(n)) for n in args.zoo]
    for name, build in targets:
        if not args.no_before:
            e, c, won = before(build, batch, profile)
            print(f"{name:<10} before: exports {e:6.1f} s  compile {c:6.1f} s  ({won} wins)", flush=True)
        try:
            e, c, won, stats = after(build, batch, profile)
        except Exception as exc:  # noqa: BLE001 - one model's failure is a line of the report
            print(f"{name:<10} after:  failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        parts = ", ".join(f"{k.removesuffix('_seconds')} {v:.1f} s" for k, v in stats.items() if k != "seconds")
        print(f"{name:<10} after:  export  {e:6.1f} s  compile {c:6.1f} s  ({won} wins; of the compile: {parts})",
              flush=True)


if __name__ == "__main__":
    main()
