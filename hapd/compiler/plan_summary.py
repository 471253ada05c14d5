"""A plan for a person in a few lines: which technique won and by how much the others
lost, how the batch is split, the predicted step time against data parallelism, memory
and where the time goes.

:func:`plan_line` is the one line :func:`hapd.parallelize` prints on rank 0 (through
:meth:`hapd.train.plan_source.PlanSource.summary`); :func:`summary_lines` is the first
screen of ``hapd explain`` (:func:`hapd.compiler.plan.explain`), ending with
:data:`GLOSSARY`, the terms it uses (``docs/explain.md`` says more).

A plan document names its technique (``doc["technique"]``: ``"spmd"``, ``"pipeline"``
or ``"overlap"``) and each technique's predicted seconds per step
(``doc["estimate"]["techniques"]``: name → seconds, None for a technique searched that
found nothing); a plan written before those fields gets them from what it records:
the chosen pipeline (``doc["pipeline"]["chosen"]``), the overlap flag and the pipeline
search's statistics (``doc["stats"]["pipeline"]``). Nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from hapd.util import format_bytes

TECHNIQUES = ("spmd", "pipeline", "overlap")
"""The techniques a plan may run: one SPMD program, pipeline stages over micro-batches,
or two interleaved duplicas of an SPMD program."""

_NAMES = {"spmd": "SPMD", "pipeline": "pipeline", "overlap": "overlap"}

GLOSSARY = (
    "terms (docs/explain.md):",
    "  SPMD = one program every rank runs on its share of the work; pipeline = stages of layers on groups of",
    "    ranks, micro-batches flowing through them (1F1B); overlap = two half-batch duplicas interleaved, one",
    "    computing while the other communicates; a more complex technique runs only when predicted faster",
    "    than every simpler one by the margin (2% unless compiled with another technique_margin)",
    "  DP-EV / DP-CP = data parallelism as DDP runs it, the batch split evenly (EV) or in proportion to each",
    "    device's FLOP/s (CP), priced by the same cost model from the same profile",
    "  global batch = the batch the model was exported at (or given to hapd.parallelize), whatever the",
    "    technique: overlap's duplicas take half each, a pipeline's micro-batches their share",
    "  ratio = the share of every split dimension a rank computes; per-rank batch = its samples of the global",
    "    batch in a step (both duplicas' with overlap)",
    "  layouts (how a rank holds a tensor): Identity = whole on every rank (replicated); Gather(d) = split",
    "    along dim d, each rank holding its ratio's slice; Reduce = a partial sum (the value is the ranks' sum)",
    "  sharded = a step whose work is split between the ranks; replicated = every rank does all of it",
)


def format_seconds(seconds: float) -> str:
    """``1.234 s``, ``12.35 ms`` or ``123.4 µs``."""
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def technique_name(name: str) -> str:
    """How a person reads a technique's name: ``SPMD``, ``pipeline``, ``overlap``."""
    return _NAMES.get(name, name)


def _fmt_duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def technique(doc: Mapping[str, Any]) -> str:
    """The technique the plan runs: ``doc["technique"]``, else a chosen pipeline, else
    overlap when the program runs as duplicas, else SPMD."""
    named = doc.get("technique")
    if named in TECHNIQUES:
        return str(named)
    found = doc.get("pipeline")
    if found and found.get("chosen"):
        return "pipeline"
    return "overlap" if doc.get("overlap") or int(doc.get("duplicas", 1)) > 1 else "spmd"


def _seconds(found: Any) -> float | None:
    """A technique's entry: ``{"per_iteration": s or None, "reason": …}`` (or bare seconds)."""
    if isinstance(found, Mapping):
        found = found.get("per_iteration")
    return None if found is None else float(found)


def technique_times(doc: Mapping[str, Any]) -> dict[str, float | None]:
    """Each technique the compile priced → its predicted seconds per step (None: searched,
    none found). ``doc["estimate"]["techniques"]`` when the plan records it; else the
    plan's own technique from its estimate and the pipeline search's best (or None when
    it found none), with the SPMD plan the pipeline was measured against."""
    recorded = doc.get("estimate", {}).get("techniques")
    if isinstance(recorded, Mapping) and recorded:
        return {str(k): _seconds(v) for k, v in recorded.items()}
    out: dict[str, float | None] = {}
    own = technique(doc)
    found = doc.get("pipeline")
    if own == "pipeline":
        out["pipeline"] = float(found["per_iteration"])
        out["spmd"] = float(found.get("spmd_only_per_iteration", doc["estimate"]["per_iteration"]))
        return out
    out[own] = float(doc["estimate"]["per_iteration"])
    if doc.get("stats", {}).get("pipeline") is not None:
        out["pipeline"] = float(found["per_iteration"]) if found else None
    return out


def predicted_seconds(doc: Mapping[str, Any]) -> float:
    """The predicted seconds per step of what the plan runs."""
    times = technique_times(doc)
    own = times.get(technique(doc))
    if own is not None:
        return own
    found = doc.get("pipeline")
    if technique(doc) == "pipeline" and found:
        return float(found["per_iteration"])
    return float(doc["estimate"]["per_iteration"])


def _program_inputs(program: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(input tensor, layout) of each user input the program reads, in step order."""
    seen: dict[str, str] = {}
    for step in program.get("steps", ()):
        for source in step.get("sources", ()):
            if source.get("kind") == "input" and source["tensor"] not in seen:
                seen[source["tensor"]] = source["layout"]
    return list(seen.items())


def input_split(doc: Mapping[str, Any]) -> list[int] | None:
    """Samples of the global batch each rank reads when every batch input is split
    along dim 0 in the same lengths (data-parallel inputs), else None."""
    lengths = {(e["tensor"], int(e["dim"])): list(e["lengths"]) for e in doc.get("lengths", ())}
    shapes = {t["name"]: t.get("shape") for t in doc["program"].get("tensors", ())}
    found: list[int] | None = None
    for tensor, layout in _program_inputs(doc["program"]):
        m = re.fullmatch(r"Gather\((\d+)\)", layout)
        if m is None:
            if shapes.get(tensor) == []:
                continue  # a scalar input
            return None
        got = lengths.get((tensor, int(m.group(1))))
        if got is None or int(m.group(1)) != 0 or (found is not None and got != found):
            return None
        found = got
    return found


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


def _ratios(ratios: Sequence[float]) -> str:
    """``0.625/0.375``, or with many equal ranks ``0.125 ×8``."""
    if len(ratios) > 1 and max(ratios) - min(ratios) < 1e-9:
        return f"{ratios[0]:.3g} ×{len(ratios)}"
    if len(ratios) > 8:
        return f"{min(ratios):.3g}…{max(ratios):.3g} over {len(ratios)} ranks"
    return "/".join(f"{r:.3g}" for r in ratios)


def global_batch(doc: Mapping[str, Any]) -> int | None:
    """The global batch the plan trains, whatever its technique: the batch the model was
    exported at (or given to ``hapd.parallelize``) for a technique search; overlap's two
    duplicas and a pipeline's micro-batches are shares of it. ``doc["global_batch"]``
    when recorded, else from what the plan splits (None when it does not say)."""
    recorded = doc.get("global_batch")
    if recorded is not None:
        return int(recorded)
    if technique(doc) == "pipeline" and doc.get("pipeline"):
        return int(doc["pipeline"]["micro_batches"]) * int(doc["pipeline"]["micro_batch_size"])
    split = input_split(doc)
    return sum(split) * int(doc.get("duplicas", 1)) if split else None


def rank_batches(doc: Mapping[str, Any]) -> list[int] | None:
    """Samples of the global batch each rank computes in a step (both duplicas' shares
    for an overlap plan), when every batch input is split along dim 0 alike; else None."""
    split = input_split(doc)
    if split is None or technique(doc) == "pipeline":
        return None
    return [int(doc.get("duplicas", 1)) * n for n in split]


def _batches(lengths: Sequence[int]) -> str:
    return "/".join(map(str, lengths)) if len(lengths) <= 8 else f"{min(lengths)}…{max(lengths)}"


def split_text(doc: Mapping[str, Any]) -> str:
    """How the plan splits the global batch (:func:`global_batch`): the pipeline's stages
    and micro-batches, the per-rank batch of a data-parallel split of the inputs (a
    step's samples on each rank; an overlap plan's two duplicas and each rank's share of
    one), or the ratios."""
    batch = global_batch(doc)
    if technique(doc) == "pipeline":
        found = doc["pipeline"]
        stages = ", ".join(f"{_ranks(s['ranks'])}" for s in found["stages"])
        of = f"global batch {batch} in " if batch is not None else ""
        return (f"{len(found['stages'])} stages ({stages}), {of}{found['micro_batches']} micro-batch"
                f"{'es' if found['micro_batches'] != 1 else ''} of {found['micro_batch_size']}")
    ratios = list(doc["ratios"])
    split = input_split(doc)
    duplicas = int(doc.get("duplicas", 1))
    each = f"{duplicas} duplicas of {batch // duplicas}" if batch is not None else f"{duplicas} duplicas"
    if split is not None and len(split) > 1:
        text = f"per-rank batch {_batches(rank_batches(doc) or split)} of {batch if batch is not None else sum(split)}"
        return text + (f" ({each}, each rank {_batches(split)} of each)" if duplicas > 1 else "")
    of = f", global batch {batch}" if batch is not None else ""
    if len(ratios) == 1:
        return "one device" + of + (f" ({each})" if duplicas > 1 else "")
    return f"ratios {_ratios(ratios)}{of}" + (f" ({each})" if duplicas > 1 else "")


def _spmd_kind(doc: Mapping[str, Any]) -> str:
    """``data parallel`` or ``sharded`` for an SPMD plan (what its program holds split)."""
    if doc.get("stats", {}).get("chosen_from") == "data_parallel":
        return "data parallel"
    steps = doc["program"].get("steps", ())
    params_split = any(s.get("kind") == "parameter" and s.get("layout") != "Identity"
                       for step in steps for s in step.get("sources", ()))
    return "parameters sharded" if params_split else "data parallel"


def margin_of(doc: Mapping[str, Any]) -> float:
    """The margin a more complex technique had to win by (``CompileOptions.technique_margin``
    in the plan's key; 0 for a plan compiled before it existed)."""
    return float((doc.get("key", {}).get("options") or {}).get("technique_margin", 0.0))


def _reason(doc: Mapping[str, Any], name: str) -> str | None:
    """Why technique ``name`` has no price (recorded in ``estimate.techniques``)."""
    found = (doc.get("estimate", {}).get("techniques") or {}).get(name)
    return str(found["reason"]) if isinstance(found, Mapping) and found.get("reason") else None


def _others(doc: Mapping[str, Any]) -> list[str]:
    """How each other technique priced did, against the winner: how much slower, or how
    much faster and short of the margin a more complex technique must win by, or why it
    has no price."""
    times = technique_times(doc)
    own, won = technique(doc), predicted_seconds(doc)
    out = []
    for name in TECHNIQUES:
        if name == own or name not in times:
            continue
        t = times[name]
        if t is None:
            out.append(f"{_NAMES[name]}: {_reason(doc, name) or 'none found'}")
        elif won > 0:
            out.append(f"{_NAMES[name]} {format_seconds(t)} ({t / won:.2f}× slower)" if t >= won else
                       f"{_NAMES[name]} {format_seconds(t)} ({won / t:.2f}× faster, short of the "
                       f"{margin_of(doc):.0%} a more complex technique must win by)")
    return out


def _against(doc: Mapping[str, Any], which: str) -> str:
    """``1.55× faster than DP-CP (817.1 µs)`` (or slower)."""
    base = float(doc["baselines"][which])
    won = predicted_seconds(doc)
    name = which.upper().replace("_", "-")
    if won <= 0 or base <= 0:
        return f"{name} {format_seconds(base)}"
    if abs(base / won - 1) < 5e-3:
        return f"as fast as {name} ({format_seconds(base)})"
    if base >= won:
        return f"{base / won:.2f}× faster than {name} ({format_seconds(base)})"
    return f"{won / base:.2f}× slower than {name} ({format_seconds(base)})"


def precision_text(doc: Mapping[str, Any]) -> str:
    """``precision: fp16 (asked: auto), autocast; gradients summed in fp32; priced at
    30.7 TFLOP/s (V100) … 4.3 TFLOP/s (P100) matmul`` — what the plan trains in and the
    rates it was priced at."""
    record = doc.get("precision") or {}
    precision = record.get("precision", "fp32")
    asked = record.get("requested", precision)
    text = f"precision: {precision}" + (f" (asked: {asked})" if asked != precision else "")
    text += ", autocast" if precision != "fp32" else ""
    text += f"; gradients summed in {record.get('reduce_dtype', 'fp32')}"
    rates = {}
    for rate in record.get("rates", []):
        if rate.get("flops"):
            rates.setdefault(str(rate.get("model")), (float(rate["flops"]), str(rate.get("source", ""))))
    if rates:
        text += "; matmul priced at " + ", ".join(f"{v[0] / 1e12:.3g} TFLOP/s ({k}{', estimated' if v[1].startswith(('estimated', 'assumed')) else ''})"
                                                 for k, v in rates.items())
    return text


def plan_line(doc: Mapping[str, Any], origin: str | None = None, seconds: float | None = None) -> str:
    """The one line :func:`hapd.parallelize` prints: technique (and what the others
    were predicted at), the ratios or per-rank batch, the predicted time per step
    against DP-CP, where the plan came from and how long getting it took. ::

        plan: SPMD (data parallel), per-rank batch 5/3 of 8; 526.0 µs/step predicted, 1.08× faster than
        DP-CP (568.1 µs); pipeline 711.3 µs (1.35× slower); compiled on rank 0, 65 ms

    (one line, wrapped here).
    """
    own = technique(doc)
    name = _NAMES[own] + (f" ({_spmd_kind(doc)})" if own == "spmd" else "")
    precision = (doc.get("precision") or {}).get("precision", "fp32")
    in_precision = f" in {precision}" if precision != "fp32" else ""
    line = (f"plan: {name}{in_precision}, {split_text(doc)}; {format_seconds(predicted_seconds(doc))}/step predicted, "
            f"{_against(doc, 'dp_cp')}")
    others = _others(doc)
    line += "; " + ", ".join(others) if others else ""
    if origin is not None:
        line += f"; {origin}" + (f", {_fmt_duration(seconds)}" if seconds is not None else "")
    return line


def _stage_rows(doc: Mapping[str, Any]) -> list[str]:
    """A pipeline's stages: ranks, hosts, blocks, per micro-batch times, the cut."""
    out = []
    for stage in doc["pipeline"]["stages"]:
        first, last = stage["blocks"]
        blocks = first if first == last else f"{first} … {last}"
        cut = (f"sends {format_bytes(stage['boundary_bytes'])} per micro-batch" if stage["last_node"] else "the loss")
        out.append(f"  stage {stage['index']}: {_ranks(stage['ranks'])} on {', '.join(stage['hosts'])}, "
                   f"{stage['block_count']} block{'s' if stage['block_count'] != 1 else ''} ({blocks}), forward {format_seconds(stage['forward'])} + backward "
                   f"{format_seconds(stage['backward'])} per micro-batch, {cut}")
    return out


def _device_rows(doc: Mapping[str, Any]) -> list[str]:
    """Ranks with their ratio, batch, compute, communication and memory; consecutive
    ranks alike in all of them in one row."""
    if technique(doc) == "pipeline":
        return _stage_rows(doc)
    est = doc["estimate"]
    ratios = list(doc["ratios"])
    split = rank_batches(doc) or [None] * len(ratios)
    rows: list[tuple[list[int], tuple]] = []
    for d, r in enumerate(ratios):
        key = (f"{r:.4f}", split[d], format_seconds(est["compute"][d]), format_seconds(est["communication"][d]),
               format_bytes(est["memory"][d]))
        if rows and rows[-1][1] == key:
            rows[-1][0].append(d)
        else:
            rows.append(([d], key))
    out = []
    for ranks, (ratio, batch, comp, comm, mem) in rows[:8]:
        who = _ranks(ranks) if len(ranks) > 1 else f"rank {ranks[0]}"
        share = f"batch {batch:<4} " if batch is not None else ""
        out.append(f"  {who:<12} ratio {ratio}  {share}compute {comp:>9}  communication {comm:>9}  memory {mem}")
    if len(rows) > 8:
        out.append(f"  … {sum(len(r) for r, _ in rows[8:])} more ranks (hapd explain --steps lists every rank)")
    return out


def _time_line(doc: Mapping[str, Any]) -> str:
    """Where a step's time goes, by technique."""
    est = doc["estimate"]
    if technique(doc) == "pipeline":
        found = doc["pipeline"]
        work = max(s["forward"] + s["backward"] for s in found["stages"]) * found["micro_batches"]
        sends = sum(s["boundary_seconds"] for s in found["stages"]) * found["micro_batches"]
        return (f"where time goes: the slowest stage computes {format_seconds(work)} per step, the cuts send "
                f"{format_seconds(sends)}, the bubble (stages waiting) is {found['bubble']:.0%} of the step")
    comp, comm = max(est["compute"], default=0.0), max(est["communication"], default=0.0)
    line = f"where time goes: compute up to {format_seconds(comp)} per rank, communication up to {format_seconds(comm)}"
    if est.get("overlap"):
        o = est["overlap"]
        line += f" (of it {format_seconds(o['hidden'])} hidden under compute, {format_seconds(o['exposed'])} exposed)"
    elif est.get("gradient_sync") and est["gradient_sync"]["seconds"] > 0:
        sync = est["gradient_sync"]
        line += f" (gradient sync {format_seconds(sync['seconds'])}, {format_seconds(sync['hidden'])} of it behind the backward)"
    share = est.get("replicated_flop_share")
    if share:
        line += f"; {share:.0%} of the FLOPs replicated"
    return line


def _memory_line(doc: Mapping[str, Any]) -> str:
    est, base = doc["estimate"], doc["baselines"]
    memory = list(est["memory"])
    if not memory:
        return "memory: -"
    top = max(range(len(memory)), key=lambda d: memory[d])
    line = f"memory: peak {format_bytes(memory[top])} on rank {top}"
    dp = base.get("dp_memory")
    if dp:
        line += f" (data parallelism: {format_bytes(max(dp))}{'' if base.get('dp_fits', True) else ', does not fit'})"
    if technique(doc) == "pipeline":
        line = (f"memory: not estimated per stage (the SPMD plan's peak: {format_bytes(memory[top])}; "
                f"data parallelism: {format_bytes(max(dp)) if dp else '-'})")
    recompute = doc["program"].get("recompute") or []
    if recompute:
        line += f"; {len(recompute)} blocks' activations recomputed"
    return line


def _compile_line(doc: Mapping[str, Any]) -> str:
    stats = doc["stats"]
    line = f"compile: SPMD search {stats['seconds']:.3f} s"
    passes = stats.get("passes") or []
    if len(passes) > 1:
        shown = ", ".join(f"{p.get('brief') or p['what']} {p['seconds']:.3f} s{' (kept)' if p.get('kept') else ''}"
                          for p in passes)
        line += f" in {len(passes)} passes: {shown}"
    piped = stats.get("pipeline")
    if piped is not None and piped.get("seconds") is not None:
        line += f"; pipeline search {piped['seconds']:.3f} s"
    return line


def summary_lines(doc: Mapping[str, Any], *, glossary: bool = True) -> list[str]:
    """The first screen of ``hapd explain``: which technique won and by how much the
    others lost, the split, the predicted step time against DP-EV and DP-CP, the ranks,
    where time goes, memory, the compile, and the terms used (:data:`GLOSSARY`)."""
    key, program = doc["key"], doc["program"]
    own = technique(doc)
    won = predicted_seconds(doc)
    others = _others(doc)
    name = _NAMES[own] + (f" ({_spmd_kind(doc)})" if own == "spmd" else "")
    lines = [
        f"plan for {program['graph']} on {key.get('profile_name', '?')} ({program['devices']} devices), "
        f"hapd {key.get('compiler_version', '?')}",
        f"technique: {name}" + (f"; the others lost: {', '.join(others)}" if others else
                                "; the only technique searched (compile with --pipeline auto / --overlap to price others)"),
        f"predicted per step: {format_seconds(won)}, {_against(doc, 'dp_ev')}, {_against(doc, 'dp_cp')}",
        f"split: {split_text(doc)}",
        precision_text(doc),
        _time_line(doc),
        _memory_line(doc),
        _compile_line(doc),
    ]
    lines.append("stages:" if own == "pipeline" else "ranks:")
    lines += _device_rows(doc)
    if glossary:
        lines += GLOSSARY
    return lines


__all__ = ["GLOSSARY", "TECHNIQUES", "format_seconds", "global_batch", "input_split", "margin_of", "plan_line",
           "rank_batches", "technique_name", "precision_text", "predicted_seconds", "split_text", "summary_lines",
           "technique", "technique_times"]
