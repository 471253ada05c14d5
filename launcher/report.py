"""Per-iteration timings the ranks print, gathered into one table and one JSON file.

A training script's stdout lines that are JSON objects with a ``"hapd"`` key are for
the launcher (:mod:`hapd.harness.training` documents them): ``{"hapd": "timings", ...}`` once per
rank (``iteration_s``: seconds of every timed iteration, the first ``warmup`` of them
warm-up) and ``{"hapd": "summary", ...}`` once on rank 0. :class:`Timings` collects
them from the event stream (the launcher's ``[rank N]`` prefix is never part of the
line it parses); :func:`build_report` makes the report and :func:`format_table` the
table people read:

- per rank: iterations after warm-up, mean ± std (population, as the worker reports),
  min and max;
- overall: iteration *i* of the job takes as long as its slowest rank (``max_r
  iteration_s[r][i]``), mean ± std over the post-warm-up iterations every rank ran;
- the slowest rank (largest mean) and how much slower it is than the fastest;
- the job's loss (rank 0's summary line, or the sum of every rank's ``loss_part``);
- with the rates a parallelized module reports (:mod:`hapd.train.telemetry`: any
  script that trains a :class:`~hapd.train.parallel_module.ParallelModule` under the
  launcher prints its ``timings`` line at exit), samples/s and tokens/s per rank and for
  the job (the samples of a step over the job's mean step time).

This is the job's one table: a rank under the launcher (``HAPD_JOB`` set) prints none
of its own (:func:`hapd.harness.training.report`), and the ``{"hapd": ...}`` lines are
not echoed unless asked (``-v``).

The JSON report (``format`` ``hapd.launcher.report``, ``version`` 1) also holds the
job's hosts, placement, start times and exit. No torch import here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Mapping, Sequence

from hapd.util import atomic_write, private_folder, summarize

REPORT_FORMAT = "hapd.launcher.report"
REPORT_VERSION = 1


def parse_hapd_line(line: str) -> dict[str, Any] | None:
    """The JSON object of a ``{"hapd": ...}`` output line, else None."""
    text = line.strip()
    if not (text.startswith("{") and '"hapd"' in text):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) and isinstance(value.get("hapd"), str) else None


class Timings:
    """``{"hapd": ...}`` lines of every rank, as they stream in."""

    def __init__(self) -> None:
        self.ranks: dict[int, dict[str, Any]] = {}
        """Global rank → its ``timings`` line (the last one, should a script print more)."""
        self.summary: dict[str, Any] | None = None
        """Rank 0's ``summary`` line."""
        self.other: list[dict[str, Any]] = []
        """Any other ``hapd`` lines, with ``"_rank"`` added."""

    def feed(self, rank: int, line: str) -> dict[str, Any] | None:
        """Take one stdout line of ``rank``; returns its ``hapd`` object when it is one."""
        value = parse_hapd_line(line)
        if value is None:
            return None
        kind = value["hapd"]
        if kind == "timings":
            self.ranks[int(value.get("rank", rank))] = value
        elif kind == "summary":
            self.summary = value
        elif kind == "elastic" and value.get("event") in ("step", "snapshot"):
            pass  # one per step or snapshot: the elastic launcher keeps the last (launcher.elastic)
        else:
            self.other.append({**value, "_rank": rank})
        return value


def rank_row(line: Mapping[str, Any]) -> dict[str, Any]:
    """One rank's row: its post-warm-up iterations and their statistics."""
    times = [float(t) for t in line.get("iteration_s") or []]
    warmup = int(line.get("warmup") or 0)
    timed = times[warmup:] if len(times) > warmup else times
    stats = summarize(timed)
    mean, std = stats.mean, stats.std
    if not timed and "mean_s" in line:  # a script that reports only its statistics
        mean, std = float(line["mean_s"]), float(line.get("std_s") or 0.0)
    return {
        "rank": int(line["rank"]),
        "iterations": len(timed),
        "warmup": warmup,
        "mean_s": mean,
        "std_s": std,
        "min_s": stats.min if timed else None,
        "max_s": stats.max if timed else None,
        "loss": line.get("loss"),
        "system": line.get("system"),
        "model": line.get("model"),
        "iteration_s": times,
        **{key: line[key] for key in RATE_KEYS if line.get(key) is not None},
    }


RATE_KEYS = ("samples_per_step", "samples_per_s", "tokens_per_s", "loss_part", "step_boundary", "technique",
             "estimate_s")
"""Keys of a ``timings`` line a parallelized module prints (:mod:`hapd.train.telemetry`)
that a rank's row keeps."""


def overall(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Job-level statistics: per iteration the slowest rank's time."""
    if not rows:
        return None
    timed = [r["iteration_s"][r["warmup"]:] for r in rows]
    n = min((len(t) for t in timed), default=0)
    job = [max(t[i] for t in timed) for i in range(n)]
    job_times = summarize(job)
    means = [(r["mean_s"], r["rank"]) for r in rows if not math.isnan(r["mean_s"])]
    slowest = max(means) if means else (math.nan, None)
    fastest = min(means) if means else (math.nan, None)
    per_step = [r["samples_per_step"] for r in rows if r.get("samples_per_step") is not None]
    tokens = [r["tokens_per_s"] / r["samples_per_s"] for r in rows
              if r.get("tokens_per_s") is not None and r.get("samples_per_s")]
    samples_per_s = per_step[0] / job_times.mean if per_step and n and job_times.mean > 0 else None
    return {
        "iterations": n,
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * tokens[0] if samples_per_s is not None and tokens else None,
        "mean_s": job_times.mean,
        "std_s": job_times.std,
        "slowest_rank": slowest[1],
        "slowest_mean_s": slowest[0],
        "fastest_rank": fastest[1],
        "fastest_mean_s": fastest[0],
        "slowest_over_fastest": slowest[0] / fastest[0] if means and fastest[0] > 0 else None,
    }


def build_report(
    timings: Timings,
    *,
    job: str,
    script: str,
    args: Sequence[str],
    world_size: int,
    placement: Sequence[Mapping[str, Any]],
    rank_hosts: Mapping[int, Mapping[str, Any]],
    exit_code: int,
    failure: Mapping[str, Any] | None = None,
    start: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The whole report as a JSON-able map (``rank_hosts``: global rank → ``{host, gpu}``)."""
    rows = []
    for rank in sorted(timings.ranks):
        row = rank_row(timings.ranks[rank])
        where = rank_hosts.get(rank, {})
        rows.append({"rank": row.pop("rank"), "host": where.get("host"), "gpu": where.get("gpu"), **row})
    return {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "job": job,
        "script": script,
        "args": list(args),
        "world_size": world_size,
        "hosts": [dict(p) for p in placement],
        "exit_code": exit_code,
        "failure": dict(failure) if failure else None,
        "start": dict(start) if start else None,
        "ranks": rows,
        "missing_ranks": [r for r in range(world_size) if r not in timings.ranks],
        "overall": overall(rows),
        "summary": timings.summary,
        "loss": _job_loss(timings.summary, rows, world_size),
    }


def _job_loss(summary: Mapping[str, Any] | None, rows: Sequence[Mapping[str, Any]], world: int) -> float | None:
    """The job's loss: rank 0's summary's, else the sum of every rank's ``loss_part``
    (a parallelized module's part of its last training forward's loss) when every rank
    gave one, else the first rank's ``loss``."""
    if summary and _number(summary.get("loss")):
        return float(summary["loss"])
    parts = [r.get("loss_part") for r in rows]
    if rows and len(rows) == world and all(_number(p) for p in parts):
        return float(sum(parts))  # type: ignore[arg-type]
    return next((float(r["loss"]) for r in rows if _number(r.get("loss"))), None)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _ms(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * 1e3:.3f}"


def format_table(report: Mapping[str, Any]) -> str:
    """The report for a person: one row per rank, the job row, the slowest rank."""
    rows = report["ranks"]
    if not rows:
        return f"no per-iteration timings: no rank printed a {{\"hapd\": \"timings\"}} line ({report['world_size']} ranks)"
    total = report["overall"]
    warmups = sorted({r["warmup"] for r in rows})
    host_w = max(4, *(len(str(r["host"] or "-")) for r in rows))
    gpu_w = max(3, *(len(str(r["gpu"] or "-")) for r in rows))
    rates = any(r.get("samples_per_s") is not None for r in rows)
    tokens = any(r.get("tokens_per_s") is not None for r in rows)
    head = f"{'rank':>5}  {'host':<{host_w}}  {'gpu':<{gpu_w}}  {'iters':>5}  {'mean ms':>10}  {'std ms':>9}  {'min ms':>9}  {'max ms':>9}"
    head += f"  {'samples/s':>10}" if rates else ""
    head += f"  {'tokens/s':>10}" if tokens else ""
    what = " ".join(str(v) for v in (rows[0].get("system"), rows[0].get("model")) if v)
    lines = [
        f"per-iteration timings of job {report['job']} ({what + '; ' if what else ''}{len(rows)} of "
        f"{report['world_size']} ranks; after {'/'.join(map(str, warmups))} warm-up iteration(s)):",
        head,
    ]
    for r in rows:
        mark = "  <- slowest" if r["rank"] == total["slowest_rank"] and len(rows) > 1 else ""
        lines.append(
            f"{r['rank']:>5}  {str(r['host'] or '-'):<{host_w}}  {str(r['gpu'] or '-'):<{gpu_w}}  {r['iterations']:>5}  "
            f"{_ms(r['mean_s']):>10}  {_ms(r['std_s']):>9}  {_ms(r['min_s']):>9}  {_ms(r['max_s']):>9}"
            + (f"  {_rate(r.get('samples_per_s')):>10}" if rates else "")
            + (f"  {_rate(r.get('tokens_per_s')):>10}" if tokens else "") + mark
        )
    job_rates = ""
    if rates:
        job_rates = f"  {'':>9}  {'':>9}  {_rate(total.get('samples_per_s')):>10}"
        job_rates += f"  {_rate(total.get('tokens_per_s')):>10}" if tokens else ""
    lines.append(
        f"{'job':>5}  {'(per iteration: slowest rank)':<{host_w + gpu_w + 2}}  {total['iterations']:>5}  "
        f"{_ms(total['mean_s']):>10}  {_ms(total['std_s']):>9}{job_rates}"
    )
    ratio = total.get("slowest_over_fastest")
    lines.append(
        f"overall {_ms(total['mean_s'])} ± {_ms(total['std_s'])} ms per iteration; slowest rank {total['slowest_rank']} "
        f"({_ms(total['slowest_mean_s'])} ms mean" + (f", {ratio:.2f}× the fastest, rank {total['fastest_rank']})" if ratio else ")")
    )
    if total.get("samples_per_s") is not None:
        lines.append(f"throughput {total['samples_per_s']:.1f} samples/s"
                     + (f", {total['tokens_per_s']:.0f} tokens/s" if total.get("tokens_per_s") is not None else "")
                     + f" ({rows[0].get('samples_per_step', 0):g} samples per step"
                     + (f", steps end at each {rows[0]['step_boundary']}" if rows[0].get("step_boundary") else "")
                     + ")")
    loss = _final_loss(report)
    if loss is not None:
        lines.append(f"loss {loss:.6g} (last iteration, global batch)")
    if report.get("missing_ranks"):
        lines.append(f"no timings from rank(s) {', '.join(map(str, report['missing_ranks']))}")
    return "\n".join(lines)


def _rate(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def _final_loss(report: Mapping[str, Any]) -> float | None:
    """The loss the job reported: the report's (:func:`_job_loss`), else rank 0's
    summary's, else the first rank's timings line's."""
    if report.get("loss") is not None:
        return float(report["loss"])
    for source in (report.get("summary") or {}, *report["ranks"]):
        value = source.get("loss")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def write_report(report: Mapping[str, Any], path: str | Path) -> Path:
    """Write the report as JSON (atomically: see :func:`hapd.util.atomic_write`)."""
    path = Path(path)
    private_folder(path.parent)
    return atomic_write(path, json.dumps(clean_nans(report), indent=1, allow_nan=False) + "\n", mode=0o600)


def clean_nans(value: Any) -> Any:
    """NaN/inf → None, recursively (JSON has no NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean_nans(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_nans(v) for v in value]
    return value
