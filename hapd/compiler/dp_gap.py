"""Why a plan costs more than data parallelism, in the words of its ops.

A free ``auto`` compile keeps the data-parallel program where it is cheaper, and
searches again with a wider front when its plan still costs more than DP-CP
(:mod:`hapd.compiler.search`). A plan can still come out costlier than DP-CP, which is
DDP's price with the batch split by FLOP/s: DDP runs *every* op on each device's share
of the batch, while hapd runs an op it has no batch-split rule for (an opaque op, a
random op it cannot draw in slices) whole on every device, after gathering its
operands; or the options or device memory rule data parallelism out. Where that
happens the plan says so: :func:`dp_gap` writes the plan document's ``dp_gap``, which
``hapd compile``, ``hapd explain`` and :meth:`hapd.Plan.explain` print
(:func:`hapd.compiler.plan.gap_lines`) — what ruled
data parallelism out, and the steps that cost more than DDP pays for the same op, the
costliest first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hapd.compiler.lp import row_values
from hapd.compiler.options import CompileOptions
from hapd.compiler.ratios import program_cost
from hapd.compiler.search import batch_tensors, ddp_step_seconds, loss_collectives

TOLERANCE = 1e-6
"""Relative excess over DP-CP below which a plan ties with it (the LP meets its
objective only to a tolerance)."""
SHOWN_STEPS = 8
"""At most this many steps are named."""


def _ddp_step_prices(dp_program: Mapping[str, Any], flops: Sequence[float]) -> dict[str, tuple[float, bool]]:
    """Node -> (what DDP pays for its op, whether it reads the batch)."""
    batch = batch_tensors(dp_program)
    return {step["node"]: (ddp_step_seconds(step, batch, flops), any(i["tensor"] in batch for i in step["inputs"]))
            for step in dp_program["steps"]}


def _why(step: Mapping[str, Any], reads_batch: bool, opaque: set[str]) -> str:
    """Why ``step`` costs more than in DDP."""
    if step.get("recompute_span") is not None:
        return "recomputed in the backward pass (its forward runs twice)"
    if step["rule"] == "replicated" and step["op"] in opaque:
        return "no sharding rules (opaque): runs whole on every device; DDP runs each device's share"
    if step["rule"] == "replicated" and reads_batch:
        return "runs whole on every device; DDP runs each device's share"
    return f"{step['rule']}: its collectives cost more than DDP's share of its work"


def _causes(program: Mapping[str, Any], options: CompileOptions, dp_fits: bool, memory_caps: bool) -> list[str]:
    """What kept the compile from data parallelism, beyond single ops."""
    causes = []
    if options.force:
        causes.append(f"the options force {len(options.force)} node(s) to a rule")
    if options.ratios is not None:
        causes.append("the options fix the sharding ratios")
    if options.mode != "auto":
        causes.append(f"the options ask for mode {options.mode!r}")
    if options.recompute == "always":
        causes.append("the options ask for recomputation everywhere")
    if memory_caps and not dp_fits:
        causes.append("data parallelism does not fit device memory (no split of the batch fits every device)")
    if program.get("recompute"):
        causes.append(f"the plan recomputes {len(program['recompute'])} block(s) to fit memory, which DP-CP's price "
                      "leaves out")
    return causes


def dp_gap(program: Mapping[str, Any], ratios: Sequence[float], dp_program: Mapping[str, Any], dp_cp: float,
           flops: Sequence[float], options: CompileOptions, *, dp_fits: bool, opaque: set[str],
           dp_cp_own: float | None = None) -> dict | None:
    """The plan document's ``dp_gap``: None when the plan costs no more than DP-CP;
    else its cost and DP-CP's, the causes (:func:`_causes`), the ops that forced it
    (``forcing``: opaque ops reading the batch, which hapd runs whole on every device
    and DDP on each device's share, with their nodes) and the steps costing more than
    DDP pays for them (node, op, rule, extra seconds, why), costliest first."""
    cost = program_cost(program, ratios)
    if cost <= dp_cp * (1 + TOLERANCE):
        return None
    prices = _ddp_step_prices(dp_program, flops)
    steps, forcing = [], {}
    for step in program["steps"]:
        mine = max(row_values(step["comp"], ratios), default=0.0) + max(row_values(step["comm"], ratios), default=0.0)
        ddp, reads_batch = prices.get(step["node"], (0.0, False))
        if reads_batch and step["op"] in opaque:
            forcing.setdefault(step["op"], []).append(step["node"])
        if mine - ddp > 0.0:
            steps.append({"node": step["node"], "op": step["op"], "rule": step["rule"], "extra": mine - ddp,
                          "why": _why(step, reads_batch, opaque)})
    steps.sort(key=lambda s: -s["extra"])
    causes = _causes(program, options, dp_fits, options.memory_caps)
    needed = loss_collectives(dp_program, flops)
    if not causes and not forcing and needed > 0.0 and cost <= (dp_cp + needed) * (1 + 1e-4):
        causes.append(f"the single-device loss needs {needed * 1e3:.3f} ms of collectives over the whole batch (a "
                      "mixture-of-experts router's expert counts and probabilities in its auxiliary loss), which "
                      "DDP's price leaves out: DDP computes that loss from each rank's own tokens, another loss")
    if not causes and not forcing and dp_cp_own is not None and cost <= dp_cp_own * (1 + 1e-4):
        causes.append(f"DDP sums the same gradients in larger buckets (1 MiB, then 25 MiB: fewer latencies) over a "
                      f"flat all-reduce, priced from the profile's all_reduce; hapd's sync of them (4 MiB buckets, in "
                      f"two levels across hosts) costs {(dp_cp_own - dp_cp) * 1e3:.3f} ms more, and the plan costs no "
                      f"more than DDP's program with it")
    if not causes and not forcing:
        causes.append(f"the search (front width {options.front_width}, widened within its time budget) found no "
                      "program as cheap; a wider front_width may")
    return {"plan": cost, "dp_cp": dp_cp, "causes": causes,
            "forcing": [{"op": op, "nodes": nodes} for op, nodes in forcing.items()],
            "steps": steps[:SHOWN_STEPS], "more_steps": max(0, len(steps) - SHOWN_STEPS)}


__all__ = ["SHOWN_STEPS", "TOLERANCE", "dp_gap"]
