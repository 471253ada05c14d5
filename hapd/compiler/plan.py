"""Plans (``.hplan``): a synthesized program with its sharding ratios, integer
lengths, estimates and statistics (DESIGN.md §3). ``Plan.explain()`` renders one for a
person (``hapd explain``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import msgpack

from hapd.errors import PlanError
from hapd.compiler import overlap
from hapd.compiler.lp import row_values
from hapd.compiler.ratios import (
    hidden_sync,
    peak_memory,
    per_device,
    program_cost,
    sharding_lengths,
    sync_overlap,
    sync_seconds,
)
from hapd.compiler.plan_summary import (
    format_seconds,
    global_batch,
    margin_of,
    predicted_seconds,
    summary_lines,
    technique,
    technique_name,
)
from hapd.util import atomic_write, format_bytes

PLAN_FORMAT = "hapd.plan"
PLAN_VERSION = 2


@dataclass(frozen=True)
class Plan:
    """A plan document (a msgpack map; see ``docs/formats.md``)."""

    doc: Mapping[str, Any]

    @property
    def program(self) -> Mapping[str, Any]:
        return self.doc["program"]

    @property
    def ratios(self) -> list[float]:
        return list(self.doc["ratios"])

    @property
    def estimate(self) -> Mapping[str, Any]:
        return self.doc["estimate"]

    @property
    def key(self) -> Mapping[str, Any]:
        return self.doc["key"]

    @property
    def overlap(self) -> bool:
        """Whether the runtime runs the program as interleaved duplicas
        (:mod:`hapd.compiler.overlap`)."""
        return bool(self.doc.get("overlap", False))

    @property
    def precision(self) -> str:
        """What the job trains in: ``"fp32"``, or ``"bf16"``/``"fp16"`` (the rank
        programs run under ``torch.autocast`` to it); a plan written before precision was
        recorded is fp32."""
        return str((self.doc.get("precision") or {}).get("precision", "fp32"))

    @property
    def reduce_dtype(self) -> str:
        """The dtype replicated parameters' gradients are summed over ranks in."""
        return str((self.doc.get("precision") or {}).get("reduce_dtype", "fp32"))

    @property
    def duplicas(self) -> int:
        """How many duplicas the global batch is cut into (1 without overlap)."""
        return int(self.doc.get("duplicas", 1))

    @property
    def pipeline(self) -> Mapping[str, Any] | None:
        """The pipeline the runtime runs instead of ``program`` (``docs/formats.md``:
        stages, their cuts and groups, micro-batches), or ``None``: a compile with
        ``pipeline`` auto records the best one it found even when the SPMD plan beat it,
        and that one is not run."""
        found = self.doc.get("pipeline")
        return found if found and found.get("chosen") else None

    @property
    def technique(self) -> str:
        """What the runtime runs: ``"spmd"``, ``"pipeline"`` (:attr:`pipeline`) or
        ``"overlap"`` (duplicas); a plan written before it was recorded gets it from its
        ``overlap`` and ``pipeline`` fields."""
        return technique(self.doc)

    def to_bytes(self) -> bytes:
        return msgpack.packb(dict(self.doc), use_bin_type=True)

    def save(self, path: str | Path) -> Path:
        """Write the plan atomically (creating its folder) and return the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return atomic_write(path, self.to_bytes())

    @classmethod
    def from_bytes(cls, data: bytes) -> "Plan":
        try:
            doc = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except Exception as exc:
            raise PlanError(f"not a plan file: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != PLAN_FORMAT:
            raise PlanError(f"not a plan file (format {doc.get('format') if isinstance(doc, dict) else None!r})")
        if doc.get("version") != PLAN_VERSION:
            raise PlanError(f"unsupported plan version {doc.get('version')!r} (this hapd reads {PLAN_VERSION})")
        for field in ("key", "program", "ratios", "lengths", "estimate", "baselines", "stats"):
            if field not in doc:
                raise PlanError(f"plan field {field!r} is missing", field=field)
        return cls(doc)

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise PlanError(f"{path}: {exc.strerror}") from exc
        return cls.from_bytes(data)

    def lengths_of(self, tensor: str, dim: int) -> list[int]:
        """Per-rank lengths of ``tensor`` split on ``dim``."""
        for entry in self.doc["lengths"]:
            if entry["tensor"] == tensor and entry["dim"] == dim:
                return list(entry["lengths"])
        raise PlanError(f"the plan does not split {tensor} on dim {dim}", node=tensor)

    def explain(self, steps: bool = True) -> str:
        """The plan for a person (:func:`explain`): a summary first, then with ``steps``
        (the default) the details and every step; without, only the summary (what
        ``hapd explain`` prints unless ``--steps``)."""
        return explain(self, steps=steps)


def split_lengths(program: Mapping[str, Any], ratios: list[float]) -> list[dict[str, Any]]:
    """Integer lengths of every split (tensor, dim): ``L · size / units`` with ``L`` the
    largest-remainder split of the class's units."""
    out = []
    for split in program["splits"]:
        units = int(split["units"])
        base = sharding_lengths(ratios, units)
        for tensor, dim, size in split["members"]:
            out.append({"tensor": tensor, "dim": int(dim), "lengths": [b * (int(size) // units) for b in base]})
    return out


def estimate(program: Mapping[str, Any], ratios: list[float]) -> dict[str, Any]:
    """The plan's ``estimate``: seconds per iteration, per-device compute,
    communication and memory under ``ratios``, and the replicated FLOP share. For an
    overlapped program, all of it for the global batch (both duplicas), and
    ``overlap``: each pass's seconds, the serial collectives', and the communication
    hidden under compute and exposed."""
    if not overlap.is_overlapped(program):
        out = {
            "per_iteration": program_cost(program, ratios),
            "compute": per_device(program, ratios, "comp"),
            "communication": per_device(program, ratios, "comm"),
            "memory": peak_memory(program, ratios),
            "replicated_flop_share": replicated_flop_share(program),
        }
        if sync_overlap(program) > 0:
            out["gradient_sync"] = {"seconds": sync_seconds(program, ratios), "hidden": hidden_sync(program, ratios),
                                    "share": sync_overlap(program)}
        return out
    schedule = overlap.schedule(program, ratios)
    compute, communication = overlap.device_seconds(program, ratios)
    return {
        "per_iteration": schedule.cost,
        "compute": compute,
        "communication": communication,
        "memory": peak_memory(program, ratios),
        "replicated_flop_share": replicated_flop_share(program),
        "overlap": {
            "duplicas": int(program["duplicas"]),
            "forward": schedule.pass_cost("forward"),
            "backward": schedule.pass_cost("backward"),
            "serial": schedule.serial,
            "hidden": schedule.hidden(),
            "exposed": schedule.exposed(),
        },
    }


def replicated_flop_share(program: Mapping[str, Any]) -> float:
    """The share of the program's forward FLOPs that every device runs whole: Σ flops of
    the steps whose work is ``full`` (replicated, or on partial sums) over Σ flops of
    all steps; 0 for a program without FLOPs. A pure data-parallel program of a model
    whose every op has a batch-split rule has share 0."""
    total = sum(float(step["flops"]) for step in program["steps"])
    full = sum(float(step["flops"]) for step in program["steps"] if step["work"] == "full")
    return full / total if total > 0 else 0.0


def _replicated_share(doc: Mapping[str, Any]) -> float:
    """The plan's replicated FLOP share (computed for a plan written before the
    estimate recorded it)."""
    share = doc["estimate"].get("replicated_flop_share")
    return float(share) if share is not None else replicated_flop_share(doc["program"])


def gap_lines(gap: Mapping[str, Any] | None) -> list[str]:
    """The report of a plan's ``dp_gap`` (:mod:`hapd.compiler.dp_gap`; none when it ties
    with or beats DP-CP)."""
    if not gap:
        return []
    lines = [f"costlier than data parallelism: {gap['plan'] / gap['dp_cp']:.3f}× DP-CP "
             f"({format_seconds(gap['plan'])} against {format_seconds(gap['dp_cp'])}), because:"]
    lines += [f"  {cause}" for cause in gap["causes"]]
    for forced in gap.get("forcing", []):
        nodes = forced["nodes"]
        shown = ", ".join(nodes[:3]) + (f", … ({len(nodes) - 3} more)" if len(nodes) > 3 else "")
        lines.append(f"  {forced['op']} has no sharding rules: it runs whole on every device, and ops next to it "
                     f"with it, rather than gather and split again (nodes {shown})")
    if gap["steps"]:
        lines.append("  the steps that cost more than DDP pays for their ops:")
    for s in gap["steps"]:
        lines.append(f"    {s['node']:<28} {s['op']:<32} +{format_seconds(s['extra']):>10}  {s['why']}")
    if gap.get("more_steps"):
        lines.append(f"    … {gap['more_steps']} more step(s)")
    return lines


def _recompute_line(program: Mapping[str, Any]) -> str:
    """What the plan recomputes: the blocks whose activations the backward pass
    rebuilds (their forward runs again), or that it keeps every activation."""
    blocks = list(program.get("recompute") or [])
    if not blocks:
        return "activation recomputation: none (the backward pass keeps every activation it needs)"
    shown = ", ".join(blocks[:4]) + (f", … ({len(blocks) - 4} more)" if len(blocks) > 4 else "")
    return (f"activation recomputation: {len(blocks)} blocks ({shown}): their activations are not kept but "
            f"recomputed, their forward running again in the backward pass")


def _overlap_lines(plan: Plan) -> list[str]:
    """Where overlap hides communication: per pass the totals, and per communication
    point its collectives' time (both duplicas'), how much of it compute hides and how
    much stalls it. Nothing for a plan without overlap."""
    if not overlap.is_overlapped(plan.program):
        return []
    schedule = overlap.schedule(plan.program, plan.ratios)
    batch = global_batch(plan.doc)
    of = f" of {batch} ({batch // plan.duplicas} each)" if batch is not None else ""
    lines = [
        f"overlap: {plan.duplicas} duplicas interleaved, each 1/{plan.duplicas} of the global batch{of}; "
        f"communication hidden {format_seconds(schedule.hidden())}, exposed {format_seconds(schedule.exposed())}, "
        f"serial {format_seconds(schedule.serial)} (parameters' collectives and gradient all-reduce, once)",
    ]
    for p in overlap.PASSES:
        intervals = schedule.intervals[p]
        lines.append(
            f"  {p}: {format_seconds(schedule.pass_cost(p))} = compute {format_seconds(schedule.compute(p))} + exposed "
            f"{format_seconds(schedule.exposed(p))} ({len(intervals) - 1} communication points, hidden {format_seconds(schedule.hidden(p))})"
        )
        for part in intervals[1:]:
            lines.append(
                f"    interval {part.index:<4} at {part.node:<30} communication {format_seconds(part.communication):>10}  "
                f"hidden {format_seconds(part.hidden):>10}  exposed {format_seconds(part.exposed):>10}  "
                f"compute A {format_seconds(part.compute_a)} B {format_seconds(part.compute_b)}"
            )
    return lines


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _pipeline_lines(doc: Mapping[str, Any]) -> list[str]:
    """What the pipeline search found: the stages with their blocks, groups and
    predicted times, the micro-batches, the bubble, and the SPMD plan it beat or lost
    to. Nothing for a compile that did not search pipelines."""
    searched = doc["stats"].get("pipeline")
    found = doc.get("pipeline")
    if searched is None:
        return []
    runs = f"the {technique_name(technique(doc))} plan runs"
    if not found:
        return [f"pipeline: none ({searched.get('reason') or 'no pipeline found'}); {runs}"]
    spmd, cost = found["spmd_only_per_iteration"], found["per_iteration"]
    if found["chosen"]:
        verdict = f"beats the SPMD-only plan's {format_seconds(spmd)} ({spmd / cost:.2f}×): the pipeline runs"
    elif cost < spmd:
        verdict = (f"{spmd / cost:.2f}× faster than the SPMD-only plan's {format_seconds(spmd)}, short of the "
                   f"{margin_of(doc):.0%} margin a more complex technique must win by, or beaten by overlap: {runs}")
    else:
        verdict = f"loses to the SPMD-only plan's {format_seconds(spmd)} ({cost / spmd:.2f}× slower): {runs}"
    batch = global_batch(doc)
    lines = [
        f"pipeline: {len(found['stages'])} stages, {_count(found['micro_batches'], 'micro-batch', 'micro-batches')} "
        f"of {found['micro_batch_size']}{f' (global batch {batch})' if batch is not None else ''} "
        f"({found['schedule'].upper()}), predicted {format_seconds(cost)} per iteration, bubble {found['bubble']:.1%}; {verdict}",
    ]
    for stage in found["stages"]:
        first, last = stage["blocks"]
        blocks = first if first == last else f"{first} … {last}"
        ranks = stage["ranks"]
        span = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"
        cut = (f"cut after {stage['last_node']}, sends {format_bytes(stage['boundary_bytes'])} "
               f"({format_seconds(stage['boundary_seconds'])} both ways) per micro-batch" if stage["last_node"] else "the loss")
        lines.append(
            f"  stage {stage['index']}: {_count(stage['block_count'], 'block', 'blocks')} ({blocks}) on {', '.join(stage['hosts'])} ({span}); "
            f"per micro-batch forward {format_seconds(stage['forward'])}, backward {format_seconds(stage['backward'])}; "
            f"gradient sync {format_seconds(stage['sync'])}; {cut}"
        )
    if found.get("shared_parameters"):
        lines.append(f"  shared parameters summed between stages' groups: {', '.join(found['shared_parameters'])}, "
                     f"{format_seconds(found['shared_sync'])} per iteration")
    tried = ", ".join(f"m={t['micro_batches']}: {format_seconds(t['per_iteration']) if t['per_iteration'] is not None else '-'}"
                      for t in searched.get("tried", []))
    lines.append(f"  micro-batch counts tried: {tried}; search {searched['seconds']:.3f} s, "
                 f"{searched['groups_priced']} group searches")
    return lines


def search_pass_lines(stats: Mapping[str, Any]) -> list[str]:
    """Each SPMD search pass of the compile (``stats["passes"]``), its seconds and why it
    ran; nothing for a plan written before the compile recorded them."""
    passes = stats.get("passes") or []
    if not passes:
        return []
    lines = [f"SPMD search passes: {len(passes)}"]
    for k, p in enumerate(passes, 1):
        kept = "  (kept)" if p.get("kept") else ""
        lines.append(f"  {k}. {p['what']}: {p['seconds']:.3f} s, {format_seconds(p['cost']) if p.get('cost') else '-'}; "
                     f"{p['why']}{kept}")
    return lines


def _sync_lines(est: Mapping[str, Any]) -> list[str]:
    """How much of the gradient sync the estimate hides behind the backward pass."""
    sync = est.get("gradient_sync")
    if not sync or sync["seconds"] <= 0:
        return []
    return [f"gradient sync: {format_seconds(sync['seconds'])}, of it {format_seconds(sync['hidden'])} hidden behind the backward "
            f"pass (the devices hide {sync['share']:.0%} of a sum behind compute, profile sync_overlap)"]


def technique_lines(doc: Mapping[str, Any]) -> list[str]:
    """Which technique runs and what each one searched was predicted at (nothing for a
    plan that priced one technique alone)."""
    priced = doc["estimate"].get("techniques") or {}
    if len(priced) < 2:
        return []
    parts = []
    for name, found in priced.items():
        seconds = found.get("per_iteration")
        parts.append(f"{name} {format_seconds(seconds)}" if seconds is not None else f"{name}: {found.get('reason') or 'none found'}")
    margin = margin_of(doc)
    rule = f" (a more complex technique must be predicted {margin:.0%} faster than every simpler one)" if margin else ""
    return [f"technique: {technique(doc)} runs{rule}; " + "; ".join(parts)]


def explain(plan: Plan, *, steps: bool = True) -> str:
    """A readable report. First a summary (:func:`hapd.compiler.plan_summary.summary_lines`:
    which technique won and by how much the others lost, the split, the predicted step
    time against DP-EV and DP-CP, where time goes, memory, the compile's search passes,
    the terms used) and why the plan costs more than DP-CP where it does; then, with
    ``steps``, the details: estimate vs baselines, the search passes, overlap, gradient
    sync and pipeline reports, per-device totals, and every step with its layouts and
    collectives and why replicated ops are replicated."""
    doc, program, ratios = plan.doc, plan.program, plan.ratios
    gap = doc.get("dp_gap")
    head = summary_lines(doc)
    if gap:
        head += gap_lines(gap)[: 1 + len(gap["causes"])]
    if not steps:
        return "\n".join([*head, "(hapd explain --steps: the details and every step's layouts and collectives)"])
    lines = [*head, "", "details:", *_detail_lines(doc, program)]
    lines += search_pass_lines(doc["stats"])
    lines += technique_lines(doc)
    lines += gap_lines(doc.get("dp_gap"))
    lines += _overlap_lines(plan)
    lines += _sync_lines(doc["estimate"])
    lines += _pipeline_lines(doc)
    lines += _device_lines(doc["estimate"], ratios)
    lines.append("steps:")
    opaque = set(doc.get("opaque_ops", []))
    for step in program["steps"]:
        lines += _step_lines(step, ratios, opaque)
    return "\n".join(lines)


def _detail_lines(doc: Mapping[str, Any], program: Mapping[str, Any]) -> list[str]:
    """The details' head: the plan's key, estimate vs baselines, replicated FLOPs, recompute, synthesis."""
    base, stats = doc["baselines"], doc["stats"]
    won = predicted_seconds(doc)
    return [
        f"plan for {program['graph']} on {doc['key'].get('profile_name', '?')} ({program['devices']} devices)",
        f"  graph {doc['key']['graph_id'][:16]}  profile {doc['key']['profile_id'][:16]}  hapd {doc['key']['compiler_version']}",
        f"estimated per iteration ({technique_name(technique(doc))}): {format_seconds(won)}"
        f"   DP-EV {format_seconds(base['dp_ev'])} ({base['dp_ev'] / won:.2f}×)"
        f"   DP-CP {format_seconds(base['dp_cp'])} ({base['dp_cp'] / won:.2f}×)",
        f"replicated FLOPs: {_replicated_share(doc):.1%} of the forward FLOPs run whole on every device",
        _recompute_line(program),
        f"synthesis: {stats['seconds']:.3f} s, {stats['expanded']} states expanded, "
        f"{stats['lp_rounds']} search/LP rounds, stop reason {stats['stop_reason']}",
    ]


def _device_lines(est: Mapping[str, Any], ratios: Sequence[float]) -> list[str]:
    """Each device's ratio, compute, communication and memory."""
    lines = ["devices:"]
    for d, r in enumerate(ratios):
        lines.append(
            f"  rank {d:<3} ratio {r:.4f}  compute {format_seconds(est['compute'][d]):>10}  "
            f"communication {format_seconds(est['communication'][d]):>10}  memory {format_bytes(est['memory'][d])}"
        )
    return lines


def _step_lines(step: Mapping[str, Any], ratios: Sequence[float], opaque: set[str]) -> list[str]:
    """One step: its rule and time, layouts, sources, collectives, and why it is replicated if it is."""
    comp = max(row_values(step["comp"], ratios), default=0.0)
    comm = max(row_values(step["comm"], ratios), default=0.0)
    ins = ", ".join(f"{i['tensor']}:{i['layout']}" for i in step["inputs"])
    outs = ", ".join(f"{o['tensor']}:{o['layout']}" for o in step["outputs"])
    span = step.get("recompute_span")
    again = f"  recomputed (span {span})" if span is not None else ""
    lines = [f"  {step['node']:<30} {step['op']:<34} {step['rule']:<16} {format_seconds(comp + comm):>10}{again}",
             f"      {ins} -> {outs}"]
    for s in step["sources"]:
        sync = f", gradient all-reduce {format_bytes(s['bytes'])} {format_seconds(max(row_values(s['cost'], ratios)))}" if s["grad_sync"] else ""
        lines.append(f"      source {s['kind']} {s['target']} as {s['layout']}{sync}")
    for c in step["comms"]:
        t = max(row_values(c["cost"], ratios), default=0.0)
        back = " (+ backward)" if c["grad"] else ""
        lines.append(
            f"      {c['collective']} {c['tensor']} {c['from']} -> {c['to']}, {format_bytes(c['bytes'])}, {format_seconds(t)}{back}"
        )
    if step["rule"] == "replicated" and step["work"] != "free":
        why = (
            f"{step['op']} has no sharding rules (opaque)"
            if step["op"] in opaque
            else "cheapest under the cost model: a sharded rule would need more communication than it saves"
        )
        lines.append(f"      replicated: {why}")
    return lines
