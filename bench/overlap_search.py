"""What the overlap-aware search adds: plans priced as two duplicas interleaved (HiDup)
against plain plans, on the paper cluster.

    .venv/bin/python bench/overlap_search.py                     # BERT-MoE-12 and ViT-24, batch 64
    .venv/bin/python bench/overlap_search.py --batch 256 --profile paper-16
    .venv/bin/python bench/overlap_search.py --measured bert_moe=0.41 --measured vit=0.29

Models are built at paper width on the meta device and exported at the global batch
and at half of it (one duplica). Per model, three estimates of one training step of the
global batch, each with its compile's seconds:

  (a) plain    the plain plan of the whole-batch graph (bulk-synchronous: every
               collective stalls compute);
  (b) overlap  the plan of the half-batch graph searched with ``overlap=True``: its
               two duplicas interleaved, one computing while the other communicates;
  (c) (a) as overlapped  the program of (a) on the half-batch graph (its rules forced),
               priced as two interleaved duplicas, at (a)'s ratios and at the ratios the
               overlap LP gives it: what overlap alone gains, and so what the
               overlap-aware search adds on top (c / b).

Ratios: a / b (> 1: overlap wins; the cheaper of (a) and (b) is what hapd would run),
c / b, and DP-CP / each. For (b) the forward and backward passes' predicted seconds,
the collectives run once (serial), and the communication hidden and exposed are
printed, for a measured step (``--measured MODEL=SECONDS``) to be set against: the
forward pass is priced as the runtime interleaves it, the backward pass mirrored
(``rustcore/core/src/overlap.rs``). ``bench/overlap_cluster.py`` measures overlapped
plans on the emulated cluster against their predictions.

Synthesis seconds are wall-clock seconds of each compile (search ⇄ LP rounds, the
baselines, and for (b) the plain search whose program it also prices as duplicas);
(c)'s are the forced search's and the LP's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hapd import models  # noqa: E402
from hapd.compiler.driver import compile as compile_plan  # noqa: E402
from hapd.ir.export import export  # noqa: E402
from hapd.ir.lower import GraphIR, lower  # noqa: E402
from hapd.compiler.options import CompileOptions  # noqa: E402
from hapd.compiler.ratios import program_cost, solve_ratios  # noqa: E402
from hapd.compiler.search import synthesize  # noqa: E402
from hapd.profile.schema import Profile, load_profile  # noqa: E402

MODELS = (("bert_moe", 12), ("vit", 24))
"""(model, layers) benchmarked by default."""


def paper_graph(name: str, layers: int, world: int, batch: int) -> GraphIR:
    """A paper-size model with ``layers`` layers for ``world`` devices, exported at
    ``batch`` samples on the meta device and lowered (as ``bench/synthesis.py`` builds
    them)."""
    overrides: dict = {"layers": layers}
    if name in ("bert", "bert_moe"):
        overrides["vocab"] = world * (33278 // world + 1)
    if name == "bert_moe":
        overrides["n_experts"] = 2 * world
    spec = models.get(name)
    config = models.make_config(name, "paper", **overrides)
    with torch.device("meta"):
        module = spec.build(config)
        inputs = spec.example_inputs(config, batch)
    return lower(export(module, inputs, batch_dims=spec.batch_dims), name=name)


@dataclass(frozen=True, kw_only=True)
class Row:
    """One model's estimates (seconds per step of the global batch)."""

    model: str
    layers: int
    batch: int
    plain: float
    plain_s: float
    overlap: float
    overlap_s: float
    forward: float
    backward: float
    serial: float
    hidden: float
    exposed: float
    plain_as_overlap: float
    plain_as_overlap_lp: float
    as_overlap_s: float
    dp_cp: float
    plain_rules: dict
    overlap_rules: dict
    measured: float | None


def _rules(program: dict) -> dict[str, int]:
    """How many steps run each rule."""
    out: dict[str, int] = {}
    for step in program["steps"]:
        out[step["rule"]] = out.get(step["rule"], 0) + 1
    return dict(sorted(out.items()))


def measure(name: str, layers: int, batch: int, profile: Profile, measured: float | None) -> Row:
    world = profile.world
    full, half = paper_graph(name, layers, world, batch), paper_graph(name, layers, world, batch // 2)
    start = time.perf_counter()
    plain = compile_plan(full, profile)
    plain_s = time.perf_counter() - start
    start = time.perf_counter()
    both = compile_plan(half, profile, CompileOptions(overlap=True))
    overlap_s = time.perf_counter() - start
    # (c): the plain plan's program on the half-batch graph, priced as two duplicas
    start = time.perf_counter()
    rules = {s["node"]: s["rule"] for s in plain.program["steps"]}
    as_overlap = synthesize(half.data, profile, plain.ratios, CompileOptions(overlap=True, force=rules))
    at_plain_ratios = program_cost(as_overlap, plain.ratios)
    at_lp_ratios = min(at_plain_ratios, solve_ratios(as_overlap, [float(d.memory) for d in profile.devices]).objective)
    as_overlap_s = time.perf_counter() - start
    est = both.estimate["overlap"]
    return Row(
        model=name, layers=layers, batch=batch,
        plain=plain.estimate["per_iteration"], plain_s=plain_s,
        overlap=both.estimate["per_iteration"], overlap_s=overlap_s,
        forward=est["forward"], backward=est["backward"], serial=est["serial"],
        hidden=est["hidden"], exposed=est["exposed"],
        plain_as_overlap=at_plain_ratios, plain_as_overlap_lp=at_lp_ratios, as_overlap_s=as_overlap_s,
        dp_cp=plain.doc["baselines"]["dp_cp"],
        plain_rules=_rules(plain.program), overlap_rules=_rules(both.program),
        measured=measured,
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f}ms"


def report(row: Row) -> None:
    runs = "overlap (b)" if row.overlap < row.plain else "plain (a)"
    print(f"{row.model}-{row.layers}, global batch {row.batch} (duplicas of {row.batch // 2}):")
    print(f"  (a) plain                {_ms(row.plain)}   compile {row.plain_s:6.2f}s   rules {row.plain_rules}")
    print(f"  (b) overlap              {_ms(row.overlap)}   compile {row.overlap_s:6.2f}s   rules {row.overlap_rules}")
    print(f"      forward {_ms(row.forward)}  backward {_ms(row.backward)}  serial {_ms(row.serial)}  "
          f"communication hidden {_ms(row.hidden)}  exposed {_ms(row.exposed)}")
    print(f"  (c) (a) as overlapped    {_ms(row.plain_as_overlap)} at (a)'s ratios, {_ms(row.plain_as_overlap_lp)} "
          f"at the overlap LP's   pricing {row.as_overlap_s:6.2f}s")
    print(f"  a/b {row.plain / row.overlap:5.2f}×   c/b {row.plain_as_overlap_lp / row.overlap:5.2f}×   "
          f"DP-CP/a {row.dp_cp / row.plain:5.2f}×   DP-CP/b {row.dp_cp / row.overlap:5.2f}×   hapd runs {runs}")
    if row.measured is not None:
        print(f"  measured {_ms(row.measured)}: predicted (b) / measured {row.overlap / row.measured:5.2f}×")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="paper-8", help="profile name or path (default paper-8)")
    parser.add_argument("--batch", type=int, default=64, help="global batch (even; each duplica is half)")
    parser.add_argument("--models", nargs="*", default=[f"{m}={n}" for m, n in MODELS],
                        help="MODEL=LAYERS pairs (default bert_moe=12 vit=24)")
    parser.add_argument("--measured", action="append", default=[],
                        help="MODEL=SECONDS: a measured overlapped step to set the prediction against")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "overlap_search.json")
    args = parser.parse_args()
    if args.batch < 2 or args.batch % 2:
        parser.error("--batch must be an even number ≥ 2")
    profile = load_profile(args.profile if "/" in args.profile or args.profile.endswith(".json")
                           else ROOT / "profiles" / f"{args.profile}.json")
    measured = {k: float(v) for k, v in (m.split("=", 1) for m in args.measured)}
    rows = []
    for spec in args.models:
        name, layers = spec.split("=", 1)
        row = measure(name, int(layers), args.batch, profile, measured.get(name))
        report(row)
        rows.append(asdict(row))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
