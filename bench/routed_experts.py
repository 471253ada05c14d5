"""Plans of transformers' mixture-of-experts models as shipped (default ``grouped_mm``
experts, router auxiliary loss on), on paper-8 and on a 3:1 two-device profile: the
opaque ops left, the share of FLOPs replicated, the plan against DP-CP, where it splits
the experts, and the seconds to export, lower and compile.

    .venv/bin/python bench/routed_experts.py                       # zoo mixtral, qwen2_moe (tiny)
    .venv/bin/python bench/routed_experts.py --size small --batch 8
    .venv/bin/python bench/routed_experts.py --mixtral-8x7b        # paper-size Mixtral on meta, paper-64

Prints one line per (model, profile). ``DP-CP/plan`` ≥ 1 means the plan is no slower
than data parallelism with compute-proportional ratios (the cost model's estimate).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import hapd  # noqa: E402
from hapd.ir.experts import OP  # noqa: E402
from hapd.models import zoo  # noqa: E402
from hapd.profile.schema import estimated_profile  # noqa: E402


def profiles() -> dict[str, Any]:
    """paper-8 and a two-device profile whose first device is 3× the second."""
    return {"paper-8": "paper-8",
            "3:1": estimated_profile(2, flops=[3e10, 1e10], name="3:1", description="two devices, 3:1 speeds")}


def report(name: str, graph: Any, profile_name: str, profile: Any, seconds: dict[str, float]) -> str:
    start = time.perf_counter()
    plan = hapd.compile(graph, profile)
    seconds["compile"] = time.perf_counter() - start
    summary = hapd.inspect_graph(graph.data)
    doc = plan.doc
    won = doc["estimate"]["per_iteration"]
    rules = Counter(s.get("rule") for s in plan.program["steps"] if s.get("op") == OP)
    memory = doc["estimate"].get("memory") or []
    peak = max(memory) / 2**30 if memory else float("nan")
    return (f"{name:10s} {profile_name:8s} opaque {summary['opaque_ops'] or 'none'}  "
            f"replicated {doc['estimate']['replicated_flop_share']:.1%}  "
            f"DP-CP/plan {doc['baselines']['dp_cp'] / won:.3f}  DP-EV/plan {doc['baselines']['dp_ev'] / won:.3f}  "
            f"{OP} rules {dict(rules)}  peak memory {peak:.2f} GiB  "
            + "  ".join(f"{k} {v:.2f} s" for k, v in seconds.items()))


def zoo_models(size: str, batch: int) -> None:
    for name in ("mixtral", "qwen2_moe"):
        model, inputs = zoo.make(name, batch=batch, size=size)
        t0 = time.perf_counter()
        program = hapd.export(model, inputs)
        t1 = time.perf_counter()
        graph = hapd.lower(program, name=name)
        t2 = time.perf_counter()
        for pname, profile in profiles().items():
            print(report(name, graph, pname, profile, {"export": t1 - t0, "lower": t2 - t1}), flush=True)


def mixtral_8x7b(batch: int, seq: int) -> None:
    """Mixtral-8x7B's published sizes (32 layers, width 4096, 8 experts of 14336, top-2),
    built on the meta device, on paper-64."""
    import transformers as t

    config = t.MixtralConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8, num_local_experts=8,
                             num_experts_per_tok=2, max_position_embeddings=max(seq, 4096),
                             output_router_logits=True)
    with torch.device("meta"):
        model = zoo.LanguageModelLoss(t.MixtralForCausalLM(config))
    model.model.config.use_cache = False
    ids = torch.randint(0, 32000, (batch, seq))
    t0 = time.perf_counter()
    program = hapd.export(model, (ids, ids))
    t1 = time.perf_counter()
    graph = hapd.lower(program, name="mixtral-8x7b")
    t2 = time.perf_counter()
    print(report("8x7b", graph, "paper-64", "paper-64", {"export": t1 - t0, "lower": t2 - t1}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=["tiny", "small", "paper"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--mixtral-8x7b", action="store_true", help="the paper-size Mixtral on meta, on paper-64")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length of --mixtral-8x7b")
    args = parser.parse_args()
    if args.mixtral_8x7b:
        mixtral_8x7b(args.batch, args.seq)
    else:
        zoo_models(args.size, args.batch)


if __name__ == "__main__":
    main()
