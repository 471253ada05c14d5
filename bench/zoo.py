"""The model zoo on a cluster profile: what hapd cannot split, and what that costs.

    .venv/bin/python bench/zoo.py                         # every zoo model on paper-8
    .venv/bin/python bench/zoo.py --models gpt2 t5 --batch 64

For each model of :mod:`hapd.models.zoo` (tiny sizes, random init), exported and lowered
at the global batch ``--batch``, then compiled for ``--profile``:

- ``opaque``: op nodes without sharding rules (they run replicated), and the share of
  the graph's forward FLOPs they account for (as the cost model prices them: torch's
  FLOP count where it counts more than one FLOP per result element);
- ``repl``: the plan's replicated FLOP share — forward FLOPs every device runs whole;
- ``lower s`` / ``compile s``: export + lowering, and the compile (search ⇄ LP rounds
  and the baselines);
- the plan's estimated seconds per iteration, the DP-EV / DP-CP baselines (DDP with an
  even and a FLOP/s-proportional split: every op that reads the batch split, only the
  gradient all-reduce; see ``docs/formats.md``) and how many times faster the plan is.
  ``< 1.00×`` means DDP would beat the plan: the search misses something or an op hapd
  cannot split costs more than it should;
- ``hapd DP``: hapd's own data-parallel program under the FLOP/s-proportional split
  (how DP-CP was priced before: ops without a batch-split rule run replicated, after
  all-gathering their operands), so ``hapd DP`` − ``DP-CP`` is what those ops cost.

A model that does not export or lower prints its error instead of a row.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import hapd  # noqa: E402
from hapd.ir.lower import GraphIR, lower  # noqa: E402
from hapd.compiler.options import CompileOptions  # noqa: E402
from hapd.compiler.ratios import program_cost  # noqa: E402
from hapd.compiler.search import synthesize  # noqa: E402
from hapd.ir.summary import inspect_graph  # noqa: E402
from hapd.models.zoo import ZOO  # noqa: E402
from hapd.profile.schema import load_profile  # noqa: E402


@dataclass(frozen=True, kw_only=True)
class Row:
    """One model's line of the table."""

    model: str
    nodes: int
    opaque_nodes: int
    opaque_ops: list[tuple[str, int]]
    opaque_flop_share: float
    replicated_flop_share: float
    lower_s: float
    compile_s: float
    estimate: float
    dp_ev: float
    dp_cp: float
    hapd_dp: float
    chosen_from: str


def lower_zoo_model(name: str, batch: int) -> GraphIR:
    """Build zoo model ``name`` with global batch ``batch``, export and lower it."""
    module, inputs = ZOO[name](batch=batch)
    return lower(hapd.export(module, inputs, name=name), name=name)


def measure(name: str, batch: int, profile: str) -> Row:
    """Lower and compile one zoo model and read its row off the summary and the plan."""
    start = time.perf_counter()
    graph = lower_zoo_model(name, batch)
    lower_s = time.perf_counter() - start
    summary = inspect_graph(graph)
    start = time.perf_counter()
    plan = hapd.compile(graph, profile)
    compile_s = time.perf_counter() - start
    baselines = plan.doc["baselines"]
    loaded = load_profile(profile)
    ratios = loaded.flops_ratios()
    hapd_dp = program_cost(synthesize(graph.data, loaded, ratios, CompileOptions(), "data_parallel"), ratios)
    return Row(
        model=name,
        nodes=summary["nodes"],
        opaque_nodes=sum(n for _, n in summary["opaque_ops"]),
        opaque_ops=[(op, n) for op, n in summary["opaque_ops"]],
        opaque_flop_share=summary["opaque_flops"] / summary["flops"] if summary["flops"] > 0 else 0.0,
        replicated_flop_share=plan.estimate["replicated_flop_share"],
        lower_s=lower_s,
        compile_s=compile_s,
        estimate=plan.estimate["per_iteration"],
        dp_ev=baselines["dp_ev"],
        dp_cp=baselines["dp_cp"],
        hapd_dp=hapd_dp,
        chosen_from=plan.doc["stats"]["chosen_from"],
    )


HEADER = (
    f"{'model':<9} {'nodes':>5} {'opaque':>6} {'FLOP%':>6} {'repl':>6} {'lower s':>8} {'compile s':>9} "
    f"{'estimate':>10} {'DP-EV':>10} {'DP-CP':>10} {'vs EV':>6} {'vs CP':>6} {'hapd DP':>10}  from"
)


def format_row(row: Row) -> str:
    """``row`` as one line under :data:`HEADER`, then its opaque ops."""
    line = (
        f"{row.model:<9} {row.nodes:>5} {row.opaque_nodes:>6} {row.opaque_flop_share:>6.1%} "
        f"{row.replicated_flop_share:>6.1%} {row.lower_s:>8.2f} {row.compile_s:>9.2f} "
        f"{row.estimate * 1e3:>8.3f}ms {row.dp_ev * 1e3:>8.3f}ms {row.dp_cp * 1e3:>8.3f}ms "
        f"{row.dp_ev / row.estimate:>5.2f}× {row.dp_cp / row.estimate:>5.2f}× {row.hapd_dp * 1e3:>8.3f}ms  "
        f"{row.chosen_from}"
    )
    if row.opaque_ops:
        line += "\n          opaque: " + ", ".join(f"{op} ×{n}" for op, n in row.opaque_ops)
    return line


def _quiet_transformers() -> None:
    """transformers warns about the tiny configs' token ids on every build."""
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="paper-8", help="profile name or path (default paper-8)")
    parser.add_argument("--batch", type=int, default=32, help="global batch (default 32)")
    parser.add_argument("--models", nargs="+", default=list(ZOO), choices=list(ZOO))
    args = parser.parse_args()
    _quiet_transformers()
    print(f"zoo on {args.profile}, global batch {args.batch}")
    print(HEADER)
    for name in args.models:
        try:
            row = measure(name, args.batch, args.profile)
        except Exception as exc:  # a model that fails is a line of the report, not the end of it
            print(f"{name:<9} failed: {type(exc).__name__}: {exc}", flush=True)
            continue
        print(format_row(row), flush=True)


if __name__ == "__main__":
    main()
