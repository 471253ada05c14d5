"""Compile time with the whole space priced (SPMD, pipelines, overlap), from a saved
symbolic ``.pt2`` to the plan, as ``hapd compile MODEL.pt2 --profile P --pipeline auto
--overlap`` runs it: a fresh process loads the file, derives every graph (global batch,
micro-batches, one duplica) and searches each technique.

    .venv/bin/python bench/compile_time.py                          # the three models on paper-8 and paper-64
    .venv/bin/python bench/compile_time.py --models gpt2 --profiles paper-8
    .venv/bin/python bench/compile_time.py --before ../hapd-old     # the same files compiled by another checkout too

Models, built on the meta device and exported once with a symbolic batch
(``hapd.export(..., symbolic_batch=True, path=...)``, timed apart): transformers GPT-2
124M as it ships (dropout 0.1, sequence 1024) at batch 64, hapd's ViT at paper width
with 24 layers at 32 samples per device of paper-8 (256), and Llama-7B at paper size
(sequence 2048) at batch 4.

Printed per model and profile: load (``torch.export.load`` alone, timed apart), derive
(the graphs of every batch read or made, while the SPMD search runs; "-" for a hapd that
does not say), the SPMD, pipeline and overlap searches (each its own seconds: the SPMD and overlap
searches run on threads while the other graphs are derived and the pipeline search
runs, so the parts add up to more than the wall time), the wall time of
``hapd.compile(FILE, PROFILE, everything)`` from its start to the plan (what ``hapd
compile`` runs: the graphs the file keeps read — ``hapd.export`` lowers them once,
:mod:`hapd.ir.kept` —, or for a file without them its load and every graph derived;
then every search), and the winner with its prediction and stages. The export's
seconds (which now include lowering the kept graphs) are printed per model. With ``--before DIR``, each compile runs again under the
hapd of ``DIR`` (a checkout with its extension built) back to back, and the ratio of
the wall times is printed: the same files, the same machine, the same minute.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

MODELS = ("gpt2", "vit24", "llama7b")
PROFILES = ("paper-8", "paper-64")

EXPORT = r"""
import sys, time, torch
import hapd
from hapd import models
from hapd.models import zoo
name, out = sys.argv[1], sys.argv[2]
with torch.device("meta"):
    if name == "gpt2":
        model, inputs = zoo.make("gpt2", 64, "paper")
        dims = None
    else:
        spec = models.get({"vit24": "vit", "llama7b": "llama_block"}[name])
        config = models.make_config(spec.name, "paper", **({"layers": 24} if name == "vit24" else {}))
        model = spec.build(config)
        inputs = spec.example_inputs(config, 256 if name == "vit24" else 4)
        dims = spec.batch_dims
inputs = tuple(torch.zeros(t.shape, dtype=t.dtype) if t.is_meta else t for t in inputs)
start = time.perf_counter()
hapd.export(model, inputs, batch_dims=dims, symbolic_batch=True, path=out, name=name)
print(time.perf_counter() - start)
"""
"""Export one model to a symbolic ``.pt2`` (argv: name, path); prints the export's seconds."""

COMPILE = r"""
import json, sys, time
start = time.perf_counter()
import hapd
from hapd.compiler.options import CompileOptions
from hapd.ir.lower import load_exported
from hapd.profile.schema import load_profile
imported = time.perf_counter()
options = CompileOptions(pipeline="auto", overlap=True)
load_exported(sys.argv[1])  # the load alone, timed; the compile below loads the file again, as hapd compile does
loaded = time.perf_counter()
profile = load_profile(sys.argv[2])
begun = time.perf_counter()
plan = hapd.compile(sys.argv[1], profile, options)
done = time.perf_counter()
parts = plan.doc["stats"].get("techniques", {})
pipeline = plan.doc.get("pipeline") or {}
print(json.dumps({
    "import": imported - start, "load": loaded - imported,
    "derive": parts.get("derive_seconds"), "spmd": parts.get("spmd_seconds"), "pipeline": parts.get("pipeline_seconds"), "overlap": parts.get("overlap_seconds"),
    "wall": done - begun, "technique": plan.technique,
    "per_iteration": (plan.estimate.get("techniques", {}).get(plan.technique) or {}).get("per_iteration")
                     or plan.estimate["per_iteration"],
    "stages": len(pipeline.get("stages") or ()) if pipeline.get("chosen") else 1,
}))
"""
"""Load a ``.pt2`` and compile it with every technique (argv: path, profile); prints
the parts as JSON. Uses only what every hapd with symbolic exports has, so an older
checkout runs it as it is."""


def run_child(code: str, args: list[str], hapd_root: Path, timeout: float) -> str:
    env = {**os.environ, "PYTHONPATH": str(hapd_root)}
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          cwd=hapd_root, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{args}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def fmt(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:6.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--profiles", nargs="+", default=list(PROFILES))
    parser.add_argument("--before", type=Path, help="another hapd checkout to compile the same files with")
    parser.add_argument("--workdir", type=Path, help="where the .pt2 files go (default: a temporary folder)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds one export or compile may take")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="hapd-compile-time-"))
    workdir.mkdir(parents=True, exist_ok=True)
    header = (f"{'model':8} {'profile':9} {'hapd':6} {'load':>6} {'derive':>6} {'spmd':>6} {'pipe':>6} "
              f"{'overlap':>7} {'wall':>6}  winner")
    print(header, flush=True)
    for name in args.models:
        path = workdir / f"{name}.pt2"
        exported = float(run_child(EXPORT, [name, str(path)], ROOT, args.timeout))
        print(f"{name}: exported in {exported:.1f} s ({path.stat().st_size / 2**20:.1f} MiB)", flush=True)
        for profile in args.profiles:
            runs = [("now", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
            walls = {}
            for label, root in runs:
                got = json.loads(run_child(COMPILE, [str(path), profile], root, args.timeout))
                walls[label] = got["wall"]
                print(f"{name:8} {profile:9} {label:6} {fmt(got['load'])} {fmt(got.get('derive'))} {fmt(got['spmd'])} "
                      f"{fmt(got['pipeline'])} {fmt(got['overlap']):>7} {fmt(walls[label])}  {got['technique']} "
                      f"{got['per_iteration']:.3f} s, {got['stages']} stage(s)", flush=True)
            if "before" in walls:
                print(f"{'':18} before/now: {walls['before'] / walls['now']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
