"""Synthesis with pipelines: the best pipeline the compile finds against the SPMD-only
plan, on the paper cluster profiles and on the emulated cluster's.

    .venv/bin/python bench/pipeline_search.py            # ViT-24 on paper-8 and paper-64, deep ViTs, the emulated cluster
    .venv/bin/python bench/pipeline_search.py --quick    # ViT-24 on paper-8 only, m ∈ {1, 4, 16}
    .venv/bin/python bench/pipeline_search.py --emulated-only
    .venv/bin/python bench/pipeline_search.py --deep-only --deep 24,96

**Paper profiles.** ViT with 24 layers, paper width otherwise, built on the meta device
(no weights), as configured (dropout 0.1: ``vit-24``) and without dropout
(``vit-24-nd``, see :data:`NO_DROPOUT`), and exported at the global batch (32 per device, as in HAP) and at the
global batch over each micro-batch count ``m`` (1, 2, 4, 8, 16 by default), then
compiled once with ``CompileOptions(pipeline="auto")``: the SPMD plan of the global batch
as always, and the pipeline search over the micro-batch graphs
(:mod:`hapd.compiler.pipeline.stage_search`). Printed per profile: the SPMD compile's and the
pipeline search's seconds (exports apart), the best pipeline (stages: hosts and blocks,
``m``, bubble), its predicted seconds per iteration, and how many times faster than the
SPMD-only plan it is predicted to be (SPMD-only / pipeline: above 1 the pipeline wins).

**Repeated blocks.** The pipeline search prices its groups on the graph with its
repeated blocks dropped (:mod:`hapd.compiler.pipeline.repeats`); each row also runs the search
with every group priced on the whole graph (``repeats=False``, what the search did
before; ``--no-whole`` skips it) and prints both searches' seconds, how many times
faster the reduced one is, and both best pipelines' predicted seconds per iteration
with their relative difference. **Deep models** (``--deep``, layers of the paper ViT
on paper-8, 24, 48 and 96 by default): the same for a model 4× deeper, whose reduced
search should take about as long as the 24-layer one's while the whole graph's grows
with depth.

**Emulated cluster** (``bench/emulated_cluster.py``: 2 machines × 2 CPU ranks, 3:1
speeds, a shaped link between the machines): the cost model's answer for the
transformers at their ``small`` sizes and global batch 64 — bert, vit and the zoo's
GPT-2 (``zoo.gpt2``; ``pip install -e '.[test]'``) — pipeline or not. The profile is
the one that script measured last (``bench/out/emulated_cluster.json``, variant 3:1)
when there is one, else an estimate of it (ranks at 6.6e10 and 2.2e10 FLOP/s, loopback
within a machine, 171 Mbit/s between them).

Writes ``bench/out/pipeline_search.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hapd import models  # noqa: E402
from hapd.compiler.driver import compile as compile_plan  # noqa: E402
from hapd.ir.export import export  # noqa: E402
from hapd.ir.lower import GraphIR, lower  # noqa: E402
from hapd.compiler.options import CompileOptions  # noqa: E402
from hapd.compiler.pipeline.stage_search import micro_batch_counts, micro_batch_graphs, search as pipeline_search  # noqa: E402
from hapd.profile.schema import Link, Profile, estimated_profile, load_profile, profile_from_dict  # noqa: E402

NO_DROPOUT = {"dropout": 0.0, "attention_dropout": 0.0}
"""The paper ViT without dropout: hapd has no sharding rule for ``aten.native_dropout``
(training dropout), so the paper config's SPMD plan runs every op after the first
dropout replicated, and a pipeline of one-device stages escapes that; without dropout
the SPMD plan can split the batch."""
EMULATED = ROOT / "bench" / "out" / "emulated_cluster.json"
EMULATED_MODELS = ("bert", "vit", "zoo.gpt2")
EMULATED_BATCH = 64
EMULATED_LINK_BYTES = 171e6 / 8
"""The emulated cluster's link between machines when no measured profile is at hand."""


def graph(name: str, size: str, batch: int, meta: bool, **overrides: Any) -> GraphIR:
    """Lower ``name`` at ``size`` (with ``overrides``) for a global ``batch``."""
    spec = models.get(name)
    config = models.make_config(name, size, **overrides)
    device = torch.device("meta") if meta else torch.device("cpu")
    with device:
        module = spec.build(config)
        inputs = spec.example_inputs(config, batch)
    return lower(export(module, inputs, batch_dims=spec.batch_dims), name=name)


def graphs(name: str, size: str, batch: int, counts: list[int], meta: bool, **overrides: Any) -> tuple[GraphIR, list[GraphIR], float]:
    """The global batch's graph, the micro-batch graphs of ``counts`` (those that divide
    the batch), and the seconds the exports took."""
    start = time.perf_counter()
    full = graph(name, size, batch, meta, **overrides)
    micro = [graph(name, size, batch // m, meta, **overrides) for m in micro_batch_counts(batch, counts) if m > 1]
    return full, micro, time.perf_counter() - start


def emulated_profile() -> tuple[Profile, str]:
    """The emulated cluster's 3:1 profile as last measured, else an estimate of it."""
    if EMULATED.is_file():
        variant = json.loads(EMULATED.read_text()).get("variants", {}).get("3:1")
        if variant and "profile" in variant:
            return profile_from_dict(variant["profile"]), f"measured ({EMULATED.relative_to(ROOT)})"
    fast, slow = 6.6e10, 2.2e10
    profile = estimated_profile(4, flops=[fast, fast, slow, slow], hosts=["emu0", "emu0", "emu1", "emu1"],
                                alpha=1e-3, beta=EMULATED_LINK_BYTES, name="emulated-3to1-estimate")
    loopback = Link(alpha=4e-4, beta=3.5e8)
    links = {c: {"inter": link["inter"], "intra": loopback} for c, link in profile.collectives.items()}
    return dataclasses.replace(profile, collectives=links), "estimated (171 Mbit/s between machines)"


def pipeline_row(
    label: str, model: str, full: GraphIR, micro: list[GraphIR], profile: Profile, export_s: float, whole: bool = True
) -> dict:
    """Compile with pipelines and print one row; with ``whole``, also the pipeline
    search with every group priced on the whole graph, and the two compared."""
    start = time.perf_counter()
    plan = compile_plan(full, profile, CompileOptions(pipeline="auto"), micro_graphs=micro)
    wall = time.perf_counter() - start
    stats = plan.doc["stats"]
    spmd = plan.estimate["per_iteration"]
    found = plan.doc.get("pipeline")
    row = {
        "profile": label, "model": model, "devices": profile.world, "hosts": len(profile.hosts),
        "spmd_per_iteration": spmd, "spmd_compile_seconds": stats["seconds"],
        "pipeline_search_seconds": stats["pipeline"]["seconds"], "groups_priced": stats["pipeline"]["groups_priced"],
        "synthesis_seconds": wall, "export_seconds": export_s, "tried": stats["pipeline"]["tried"], "pipeline": found,
    }
    if whole:
        row["whole_graph"] = whole_graph_row(full, micro, profile, spmd, stats["pipeline"], found)
    if found is None:
        print(f"{label:<22} {model:<9} SPMD {spmd:9.4f} s   no pipeline: {stats['pipeline']['reason']}")
        return row
    stages = " | ".join(f"{'+'.join(s['hosts'])}: {s['blocks'][0]}…{s['blocks'][1]} ({s['block_count']})"
                        for s in found["stages"])
    speedup = spmd / found["per_iteration"]
    print(f"{label:<22} {model:<9} SPMD {spmd:9.4f} s  pipeline {found['per_iteration']:9.4f} s  "
          f"SPMD/pipeline {speedup:5.2f}×  {'pipeline' if found['chosen'] else 'SPMD'} wins   "
          f"{len(found['stages'])} stages, m={found['micro_batches']}, bubble {found['bubble']:.1%}   "
          f"synthesis {wall:6.1f} s (SPMD {stats['seconds']:.1f} s + pipeline {stats['pipeline']['seconds']:.1f} s, "
          f"{stats['pipeline']['groups_priced']} group searches; exports {export_s:.0f} s apart)")
    print(f"{'':<33}stages: {stages}")
    print(f"{'':<33}per micro-batch count: " + ", ".join(
        f"m={t['micro_batches']} {t['per_iteration']:.4f} s ({t['stages']} stages)" if t["per_iteration"] is not None
        else f"m={t['micro_batches']} none" for t in stats["pipeline"]["tried"]))
    row["speedup_over_spmd"] = speedup
    return row


def whole_graph_row(
    full: GraphIR, micro: list[GraphIR], profile: Profile, spmd: float, reduced: dict, found: dict | None
) -> dict:
    """The pipeline search with every group priced on the whole graph, against the
    reduced graphs' search (``reduced``: its stats; ``found``: its best pipeline):
    seconds, searches and the best pipelines' predictions, printed."""
    searched = pipeline_search(micro_batch_graphs(full, micro), profile, CompileOptions(pipeline="auto"), spmd,
                               repeats=False)
    best = searched.best.per_iteration if searched.best is not None else None
    mine = found["per_iteration"] if found is not None else None
    units = sorted({(t.get("units"), t.get("priced_units")) for t in reduced["tried"]})
    whole_searches = sum(t.get("whole_searches", 0) for t in reduced["tried"])
    out = {"seconds": searched.seconds, "groups_priced": searched.groups_priced, "per_iteration": best,
           "speedup": searched.seconds / reduced["seconds"] if reduced["seconds"] > 0 else None,
           "relative_difference": mine / best - 1 if mine is not None and best else None,
           "units_priced": units, "reduced_whole_searches": whole_searches}
    difference = f"{out['relative_difference']:+.3%}" if out["relative_difference"] is not None else "n/a"
    print(f"{'':<33}repeated blocks: pipeline search {reduced['seconds']:.1f} s against {searched.seconds:.1f} s on the "
          f"whole graphs ({out['speedup']:.1f}× faster; units priced {', '.join(f'{p} of {u}' for u, p in units)}; "
          f"{reduced['groups_priced']} and {searched.groups_priced} group searches, {whole_searches} of them on the "
          f"whole graph); best pipeline {_seconds(mine)} against {_seconds(best)} ({difference})")
    return out


def _seconds(value: float | None) -> str:
    return f"{value:.4f} s" if value is not None else "none"


def deep_rows(layers: list[int], counts: list[int], whole: bool) -> list[dict]:
    """The paper ViT (no dropout) at each depth of ``layers`` on paper-8: the pipeline
    search's seconds as the model deepens."""
    profile = load_profile(ROOT / "profiles" / "paper-8.json")
    print(f"deep models: vit-nd at paper width on paper-8, layers {', '.join(map(str, layers))}")
    rows = []
    for depth in layers:
        full, micro, export_s = graphs("vit", "paper", 32 * profile.world, counts, meta=True, layers=depth, **NO_DROPOUT)
        rows.append(pipeline_row("paper-8 deep", f"vit-{depth}-nd", full, micro, profile, export_s, whole))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="paper-8 only, micro-batch counts 1, 4, 16, no emulated cluster")
    parser.add_argument("--emulated-only", action="store_true", help="only the emulated cluster's transformers")
    parser.add_argument("--deep-only", action="store_true", help="only the deep models")
    parser.add_argument("--layers", type=int, default=24, help="ViT layers on the paper profiles")
    parser.add_argument("--deep", default="24,48,96", help="layers of the deep models ('' for none)")
    parser.add_argument("--no-whole", action="store_true", help="skip the search with groups priced on the whole graph")
    parser.add_argument("--micro-batches", default="1,2,4,8,16", help="micro-batch counts to price")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "pipeline_search.json")
    args = parser.parse_args()
    counts = [1, 4, 16] if args.quick else [int(m) for m in args.micro_batches.split(",")]
    whole = not args.no_whole
    rows = []
    variants = {f"vit-{args.layers}": {}, f"vit-{args.layers}-nd": NO_DROPOUT}
    for world in [] if args.emulated_only or args.deep_only else [8] if args.quick else [8, 64]:
        profile = load_profile(ROOT / "profiles" / f"paper-{world}.json")
        for label, overrides in variants.items():
            full, micro, export_s = graphs("vit", "paper", 32 * world, counts, meta=True, layers=args.layers, **overrides)
            rows.append(pipeline_row(f"paper-{world}", label, full, micro, profile, export_s, whole))
    if not args.quick and not args.emulated_only and args.deep:
        rows.extend(deep_rows([int(n) for n in args.deep.split(",")], counts, whole))
    if not args.quick and not args.deep_only:
        profile, where = emulated_profile()
        print(f"emulated cluster, 3:1, profile {where}: small sizes, global batch {EMULATED_BATCH}")
        for model in EMULATED_MODELS:
            try:
                full, micro, export_s = graphs(model, "small", EMULATED_BATCH, counts, meta=False)
            except ImportError as exc:  # the zoo needs transformers
                print(f"{'emulated 3:1':<22} {model:<9} skipped: {exc}")
                continue
            rows.append(pipeline_row("emulated 3:1", model, full, micro, profile, export_s, whole))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
