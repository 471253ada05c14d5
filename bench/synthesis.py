"""Synthesis time and states expanded vs depth, and plan estimates vs the data-parallel
baselines, on the paper cluster profiles.

    .venv/bin/python bench/synthesis.py                  # full sweep (minutes)
    .venv/bin/python bench/synthesis.py --quick          # a few points

Each point is compiled ``--repeats`` times (default 3) and the median time printed, so a
burst of load on a shared machine moves it less.

Models are built at paper width on the meta device (no weights are allocated) and
exported with torch.export; the global batch is 32 per device as in HAP. "search+LP" is
the search ⇄ LP alternation (what HAP's 6.2 s for ViT-24 measured); the two
data-parallel baseline searches are timed apart. The growth exponent is the slope of
log(time) against log(layers).

Last, cancellation: a search sent SIGINT (as Ctrl-C would) one second into it, and how
long after the signal its process ended. :func:`interrupt_search` is also used by
``tests/compiler/test_synthesis.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from hapd import models  # noqa: E402
from hapd.compiler.driver import compile as compile_plan  # noqa: E402
from hapd.ir.export import export  # noqa: E402
from hapd.ir.lower import lower  # noqa: E402


def paper_graph(name: str, layers: int, world: int):
    """Lower a paper-size model with `layers` layers for `world` devices."""
    overrides = {"layers": layers}
    if name in ("bert", "bert_moe"):
        overrides["vocab"] = world * (33278 // world + 1)
    if name == "bert_moe":
        overrides["n_experts"] = 2 * world
    spec = models.get(name)
    config = models.make_config(name, "paper", **overrides)
    with torch.device("meta"):
        module = spec.build(config)
        inputs = spec.example_inputs(config, 32 * world)
    return lower(export(module, inputs, batch_dims=spec.batch_dims), name=name)


INTERRUPTIBLE = """
import signal
import sys
from hapd import _core
signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even where a background start ignores it
from hapd.profile.schema import load_profile
graph = open(sys.argv[1], "rb").read()
profile = load_profile("paper-64")
print("started", flush=True)
try:
    _core.synthesize(graph, profile.core_bytes(), profile.flops_ratios(), {"front_width": 10**6, "max_states": 10**9})
    print("finished", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""
"""A search for paper-64 with an unbounded front (several seconds on the bert_moe
fixture), printing ``started``, then ``finished`` or ``interrupted``."""

CANCEL_GRAPH = ROOT / "tests" / "fixtures" / "bert_moe.hapg"


@dataclass(frozen=True)
class Interrupted:
    """How an interrupted search's process ended."""

    returncode: int
    stdout: str
    stderr: str
    stop_s: float
    """Seconds from the SIGINT to the process's exit."""


def interrupt_search(graph: Path = CANCEL_GRAPH, after_s: float = 1.0, timeout: float = 60.0) -> Interrupted:
    """:data:`INTERRUPTIBLE` on ``graph`` in a child process, sent SIGINT ``after_s``
    seconds after it starts the search."""
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTIBLE, str(graph)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        started = proc.stdout.readline()
        time.sleep(after_s)
        sent = time.perf_counter()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=timeout)
        stop_s = time.perf_counter() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return Interrupted(proc.returncode, started + out, err, stop_s)


def slope(xs, ys):
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="ViT/BERT/BERT-MoE at 12 and 24 layers on 8 devices only")
    parser.add_argument("--repeats", type=int, default=3, help="compiles per point; the median time is reported")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "out" / "synthesis.json")
    args = parser.parse_args()
    depths = [12, 24] if args.quick else [2, 4, 8, 12, 24, 48, 96]
    worlds = [8] if args.quick else [8, 16, 64]
    rows = []
    print(f"{'model':<9} {'dev':>3} {'layers':>6} {'search+LP':>10} {'states':>8} {'rounds':>6} {'stop':>9} "
          f"{'estimate':>10} {'DP-EV':>10} {'DP-CP':>10} {'vs EV':>6} {'vs CP':>6}")
    for world in worlds:
        profile = ROOT / "profiles" / f"paper-{world}.json"
        for name in ("vit", "bert", "bert_moe"):
            times = []
            for layers in depths:
                graph = paper_graph(name, layers, world)
                runs = []
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    plan = compile_plan(graph, profile)
                    runs.append((plan.doc["stats"]["synthesis_seconds"], time.perf_counter() - start))
                synthesis, wall = (statistics.median(r[i] for r in runs) for i in (0, 1))
                s, e, b = dict(plan.doc["stats"], synthesis_seconds=synthesis), plan.estimate["per_iteration"], plan.doc["baselines"]
                times.append(synthesis)
                row = {
                    "model": name, "devices": world, "layers": layers,
                    "synthesis_seconds": s["synthesis_seconds"], "wall_seconds": wall,
                    "expanded": s["expanded"], "rounds": s["lp_rounds"], "stop_reason": s["stop_reason"],
                    "estimate": e, "dp_ev": b["dp_ev"], "dp_cp": b["dp_cp"],
                }
                rows.append(row)
                print(f"{name:<9} {world:>3} {layers:>6} {s['synthesis_seconds']:>9.3f}s {s['expanded']:>8} "
                      f"{s['lp_rounds']:>6} {s['stop_reason']:>9} {e * 1e3:>8.1f}ms {b['dp_ev'] * 1e3:>8.1f}ms "
                      f"{b['dp_cp'] * 1e3:>8.1f}ms {b['dp_ev'] / e:>5.2f}× {b['dp_cp'] / e:>5.2f}×", flush=True)
            if len(depths) > 1:
                print(f"{name:<9} {world:>3} growth exponent of search+LP time in layers: {slope(depths, times):.2f}")
    cancel = interrupt_search()
    print(f"SIGINT 1 s into a search ({CANCEL_GRAPH.stem}, paper-64): "
          f"{cancel.stdout.split()[-1] if cancel.stdout.split() else 'no output'}, exit {cancel.returncode}, "
          f"{cancel.stop_s * 1e3:.0f} ms after the signal")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
