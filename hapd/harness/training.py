"""The training and timing harness shared by the hapd worker and the DDP baseline.

One process per rank, started by ``torchrun`` (or alone: a 1-rank group). The pieces:
:func:`run_rank` / :func:`shutdown` (join the process group with
:func:`hapd.spmd.distributed.init_distributed`, run the rank, leave the group),
:func:`add_train_flags` / :func:`parse_train_args` (the flags every training script
takes, as a :class:`TrainArgs`), :func:`local_batch` (this rank's slice of the
synthetic global batch), :func:`train` (the timed loop, optionally traced) and
:func:`report` (what every rank prints).

Worker output
-------------
Every line a training script prints to stdout that is a JSON object with the key
``"hapd"`` is for the launcher; every other line is for people. Two kinds:

``{"hapd": "timings", ...}`` -- one line per rank, printed by :func:`report`::

    {"hapd": "timings", "rank": 1, "world": 2, "system": "ddp-ev", "model": "mlp",
     "iteration_s": [0.012, 0.004, ...], "warmup": 3, "mean_s": 0.0041,
     "std_s": 0.0002, "loss": 12.5, ...extra keys...}

``iteration_s`` holds the wall-clock seconds of every timed iteration, warm-up
included; ``mean_s`` and ``std_s`` are over ``iteration_s[warmup:]``, and ``std_s`` is
the *population* standard deviation (0 for a single iteration). ``loss`` is the loss
the script reports for its last iteration (see the script: the DDP baseline reports the
global batch's loss, the same on every rank). Extra keys come from the script
(``split``, ``lengths``, ``batch``, ``dtype``...).

``{"hapd": "summary", ...}`` -- one line, rank 0 only, after every rank's timings::

    {"hapd": "summary", "world": 2, "system": "ddp-ev", "model": "mlp", "warmup": 3,
     "iterations": 20, "mean_s": 0.0042, "std_s": 0.0003, "slowest_rank": 1,
     "loss": 12.5, "ranks": [<the timings line of every rank, in rank order>], ...extra}

Here ``mean_s`` / ``std_s`` (population) are over the post-warm-up iterations of the
*job*: iteration i of the job takes as long as its slowest rank, ``max_r
iteration_s[r][i]``. ``slowest_rank`` is the rank with the largest ``mean_s``.

Lines are written whole and flushed, one ``print`` each, so ranks sharing a pipe do
not interleave within a line; a launcher that prefixes lines (``[rank0]:``) must strip
its prefix before parsing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hapd import models
from hapd.errors import HapdError, OptionsError
from hapd.spmd.distributed import DistEnv, init_distributed
from hapd.spmd.stepwatch import StepWatch
from hapd.train.telemetry import script_reported
from hapd.util import atomic_write, summarize as summarize_times

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""``--dtype`` values."""

TRACE_ITERATIONS = 3
"""Iterations :func:`train` records in a Chrome trace (extra ones, after the timed loop)."""

DEFAULT_TRACE = "trace.json"
"""The trace file when ``--trace`` is given without a path."""


# --------------------------------------------------------------------------
# Process group
# --------------------------------------------------------------------------


def shutdown(env: DistEnv, *, wait: bool = True) -> None:
    """Leave the job: with ``wait`` (after a successful run) wait for every rank, then
    destroy the default process group (no-op when there is none). The barrier keeps a
    rank from tearing down its Gloo connections while a peer still uses them, which can
    abort the peer at exit; after a failure there is no waiting for peers."""
    if dist.is_initialized():
        if wait and env.world > 1:
            dist.barrier()
        dist.destroy_process_group()


def run_rank(name: str, body: Callable[[DistEnv], None]) -> int:
    """A rank's entry point: join the process group, run ``body``, leave the group (after
    the others, when it succeeded). A :class:`HapdError` is one line on stderr prefixed
    with ``name`` (and the rank, once known), exit status 2."""
    try:
        env = init_distributed()
    except HapdError as exc:
        print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    ok = False
    try:
        body(env)
        ok = True
        return 0
    except HapdError as exc:
        print(f"{name}: rank {env.rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        shutdown(env, wait=ok)


# --------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainArgs:
    """The flags every training script takes (see :func:`add_train_flags`)."""

    model: str = "bert"
    size: str = "tiny"
    layers: int | None = None
    batch: int = 16
    """Global batch size (split over ranks)."""
    iterations: int = 20
    """Timed iterations, warm-up included."""
    warmup: int = 3
    """Leading iterations left out of the mean."""
    profile: str | None = None
    dtype: str = "float32"
    lr: float = 1e-3
    seed: int = 0
    trace: Path | None = None
    json: Path | None = None
    config: tuple[tuple[str, Any], ...] = ()
    """``--set KEY=VALUE`` config fields (``hidden``, ``ffn``, ...), in the order given."""

    def __post_init__(self) -> None:
        problems = []
        if self.batch < 1:
            problems.append(f"--batch {self.batch} must be at least 1")
        if self.iterations < 1:
            problems.append(f"--iterations {self.iterations} must be at least 1")
        if not 0 <= self.warmup < self.iterations:
            problems.append(f"--warmup {self.warmup} must be in [0, --iterations {self.iterations})")
        if self.dtype not in DTYPES:
            problems.append(f"--dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            problems.append(f"--lr {self.lr} must be a positive number")
        if self.layers is not None and self.layers < 1:
            problems.append(f"--layers {self.layers} must be at least 1")
        if problems:
            raise OptionsError("; ".join(problems))
        try:
            models.make_config(self.model, self.size, **self.overrides)
        except (ValueError, TypeError) as exc:
            raise OptionsError(f"--model {self.model} --size {self.size}: {exc}") from exc

    @property
    def overrides(self) -> dict[str, Any]:
        """Config overrides for :func:`hapd.models.build`."""
        out = dict(self.config)
        if self.layers is not None:
            out["layers"] = self.layers
        return out

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> TrainArgs:
        """The :class:`TrainArgs` of parsed flags; :class:`OptionsError` if inconsistent."""
        return cls(model=ns.model, size=ns.size, layers=ns.layers, batch=ns.batch, iterations=ns.iterations,
                   warmup=ns.warmup, profile=ns.profile, dtype=ns.dtype, lr=ns.lr, seed=ns.seed,
                   trace=ns.trace, json=ns.json, config=tuple(getattr(ns, "config", None) or ()))

    def build(self) -> tuple[torch.nn.Module, Any]:
        """``torch.manual_seed(seed)``, then the model and config from the registry
        (construction itself is seeded by :func:`hapd.models.build`, so every rank
        builds identical parameters)."""
        torch.manual_seed(self.seed)
        return models.build(self.model, self.size, **self.overrides)


def _model_name(value: str) -> str:
    if value not in models.NAMES:
        raise argparse.ArgumentTypeError(f"unknown model {value!r}; known: {', '.join(models.NAMES)}")
    return value


def _int_at_least(minimum: int) -> Callable[[str], int]:
    def convert(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
        if number < minimum:
            raise argparse.ArgumentTypeError(f"{number} is less than {minimum}")
        return number

    convert.__name__ = "int"
    return convert


def _positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number") from None
    if not (math.isfinite(number) and number > 0):
        raise argparse.ArgumentTypeError(f"{value} is not a positive number")
    return number


def _config_field(value: str) -> tuple[str, Any]:
    """``KEY=VALUE`` as ``(key, value)``: an int, a float, true/false, else the text."""
    key, sep, raw = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{value!r} is not KEY=VALUE")
    for convert in (int, float):
        try:
            return key, convert(raw)
        except ValueError:
            continue
    return key, {"true": True, "false": False}.get(raw.lower(), raw)


def add_train_flags(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the flags of :class:`TrainArgs` to ``parser`` (returned for chaining)."""
    group = parser.add_argument_group("training")
    group.add_argument("--model", type=_model_name, default="bert", metavar="NAME",
                       help=f"benchmark model: {', '.join(models.MODELS)}, or a zoo model: "
                            f"{', '.join(models.ZOO_MODELS)} (default: bert)")
    group.add_argument("--size", choices=models.SIZES, default="tiny", help="model size preset (default: tiny)")
    group.add_argument("--layers", type=_int_at_least(1), default=None, metavar="N",
                       help="override the model's number of layers")
    group.add_argument("--set", dest="config", type=_config_field, action="append", default=None,
                       metavar="KEY=VALUE", help="override a field of the model's config (repeatable), e.g. "
                                                 "--set hidden=512 --set ffn=1408")
    group.add_argument("--batch", type=_int_at_least(1), default=16, metavar="N",
                       help="GLOBAL batch size, split over the ranks (default: 16)")
    group.add_argument("--iterations", type=_int_at_least(1), default=20, metavar="N",
                       help="timed iterations, warm-up included (default: 20)")
    group.add_argument("--warmup", type=_int_at_least(0), default=3, metavar="N",
                       help="leading iterations left out of the mean (default: 3)")
    group.add_argument("--profile", default=None, metavar="NAME|PATH",
                       help="cluster profile (a bundled name such as paper-8, or a JSON file)")
    group.add_argument("--dtype", choices=list(DTYPES), default="float32",
                       help="parameter and input dtype (default: float32)")
    group.add_argument("--lr", type=_positive_float, default=1e-3, help="Adam learning rate (default: 1e-3)")
    group.add_argument("--seed", type=int, default=0, help="RNG seed, the same on every rank (default: 0)")
    group.add_argument("--trace", type=Path, nargs="?", const=Path(DEFAULT_TRACE), default=None, metavar="PATH",
                       help=f"write a Chrome trace of {TRACE_ITERATIONS} extra iterations after the timed ones "
                            f"(default file {DEFAULT_TRACE}; rank r > 0 writes NAME.rank<r>.json beside it)")
    group.add_argument("--json", type=Path, default=None, metavar="PATH",
                       help="also write rank 0's summary JSON to PATH")
    return parser


def add_init_flag(parser: argparse.ArgumentParser, *, eager: str, meta: str) -> None:
    """Add ``--init eager|meta`` (how each rank gets its weights) to ``parser``; ``eager``
    and ``meta`` say what each does in this script (meta: then each rank's pieces come
    one parameter at a time from :func:`hapd.module_init`)."""
    parser.add_argument("--init", choices=["eager", "meta"], default="eager",
                        help=f"eager: {eager}; meta: {meta}, one parameter at a time, seeded by --seed and each "
                             "parameter's name (default: eager)")


def parse_train_args(parser: argparse.ArgumentParser,
                     argv: Sequence[str] | None = None) -> tuple[TrainArgs, argparse.Namespace]:
    """Parse ``argv`` with ``parser`` (which has :func:`add_train_flags`'s flags, and maybe
    more); inconsistent values exit through ``parser.error`` (status 2). Returns the
    :class:`TrainArgs` and the full namespace (for the caller's own flags)."""
    ns = parser.parse_args(argv)
    try:
        return TrainArgs.from_namespace(ns), ns
    except OptionsError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


def local_batch(spec: models.ModelSpec, config: Any, lengths: Sequence[int], rank: int, seed: int,
                device: torch.device | str, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """This rank's inputs: the global batch of ``sum(lengths)`` samples, cut along each
    input's batch dimension (``spec.batch_dims``) into ``lengths``, piece ``rank``.

    The global batch is ``spec.example_inputs(config, sum(lengths))`` (deterministic, so
    every rank cuts the same batch); a ``seed`` other than 0 shuffles its samples with a
    permutation drawn from ``seed`` (seed 0 keeps them in order). Floating inputs are cast
    to ``dtype``, integer ones (ids, labels) kept. A rank with length 0 gets empty inputs.
    """
    lengths = [int(n) for n in lengths]
    if any(n < 0 for n in lengths):
        raise ValueError(f"negative sharding length in {lengths}")
    if not 0 <= rank < len(lengths):
        raise ValueError(f"rank {rank} has no entry in lengths {lengths}")
    total = sum(lengths)
    inputs = spec.example_inputs(config, total)
    if len(inputs) != len(spec.batch_dims):
        raise ValueError(f"{spec.name}: {len(inputs)} inputs but {len(spec.batch_dims)} batch dims")
    order = None
    if seed != 0:
        order = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
    start = sum(lengths[:rank])
    out = []
    for tensor, dim in zip(inputs, spec.batch_dims):
        if order is not None:
            tensor = tensor.index_select(dim, order)
        piece = tensor.narrow(dim, start, lengths[rank])
        if piece.is_floating_point():
            piece = piece.to(dtype)
        out.append(piece.contiguous().to(device))
    return tuple(out)


# --------------------------------------------------------------------------
# The timed loop
# --------------------------------------------------------------------------


def trace_path(path: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its trace: ``path`` for rank 0, ``NAME.rank<r>.SUFFIX``
    beside it for the others (``trace.json`` -> ``trace.rank1.json``)."""
    path = Path(path)
    if rank == 0:
        return path
    suffix = path.suffix or ".json"
    return path.with_name(f"{path.stem if path.suffix else path.name}.rank{rank}{suffix}")


def train(step: Callable[[], Tensor], optimizer: torch.optim.Optimizer, env: DistEnv, *,
          iterations: int, warmup: int, trace: Path | None = None) -> list[float]:
    """Run ``iterations`` timed training iterations; returns the seconds of each, warm-up
    included (``warmup`` only tells which leading ones the trace follows).

    An iteration is ``optimizer.zero_grad(set_to_none=True)``, ``step()`` (forward and
    backward; returns the loss) and ``optimizer.step()``; on a GPU the clock is read
    after ``torch.cuda.synchronize()``. Ranks start together (a barrier). Each rank
    checks in at every iteration (:class:`~hapd.spmd.stepwatch.StepWatch`), so a
    collective that fails or waits past the timeout raises a
    :class:`~hapd.errors.CollectiveError` naming the iteration and the ranks not there.

    With ``trace``, :data:`TRACE_ITERATIONS` more iterations run after the timed ones
    under ``torch.profiler.profile`` and each rank writes a Chrome trace to
    :func:`trace_path` (``trace`` itself on rank 0). They are not timed, so the profiler
    does not distort the times, but they do train the model further.
    """
    if iterations < 1 or not 0 <= warmup < iterations:
        raise ValueError(f"need iterations ≥ 1 and 0 ≤ warmup < iterations, got {iterations}, {warmup}")

    def one() -> None:
        optimizer.zero_grad(set_to_none=True)
        step()
        optimizer.step()

    times: list[float] = []
    env.synchronize()
    if dist.is_initialized():
        dist.barrier()
    watch = StepWatch.for_job()
    for i in range(iterations):
        env.synchronize()
        start = time.perf_counter()
        with watch.watching(i + 1) if watch is not None else contextlib.nullcontext():
            one()
            env.synchronize()
        times.append(time.perf_counter() - start)
    if trace is not None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.is_cuda else [])
        with profile(activities=activities, record_shapes=True) as prof:
            for _ in range(TRACE_ITERATIONS):
                one()
            env.synchronize()
        path = trace_path(trace, env.rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
    return times


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------


def _emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, separators=(", ", ": ")) + "\n")
    sys.stdout.flush()


def summarize(lines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``{"hapd": "summary"}`` document of every rank's timings line (rank order)."""
    first = lines[0]
    warmup = first["warmup"]
    count = min(len(line["iteration_s"]) for line in lines)
    job = [max(line["iteration_s"][i] for line in lines) for i in range(warmup, count)]
    job_times = summarize_times(job)
    slowest = max(range(len(lines)), key=lambda r: (lines[r]["mean_s"], -r))
    core = {"hapd", "rank", "iteration_s", "mean_s", "std_s"}
    extra = {k: v for k, v in first.items() if k not in core and k not in ("world", "system", "model", "warmup", "loss")}
    return {"hapd": "summary", "world": first["world"], "system": first["system"], "model": first["model"],
            "warmup": warmup, "iterations": count, "mean_s": job_times.mean, "std_s": job_times.std, "slowest_rank": slowest,
            "loss": first["loss"], **extra, "ranks": list(lines)}


def format_table(summary: dict[str, Any]) -> str:
    """The human-readable table rank 0 prints."""
    rows = [f"{summary['system']} {summary['model']}: {summary['world']} rank(s), "
            f"{summary['iterations'] - summary['warmup']} timed iterations after {summary['warmup']} warm-up",
            f"{'rank':>6}  {'mean ms':>10}  {'± std ms':>10}"]
    for line in summary["ranks"]:
        mark = "  <- slowest" if line["rank"] == summary["slowest_rank"] else ""
        rows.append(f"{line['rank']:>6}  {line['mean_s'] * 1e3:>10.3f}  {line['std_s'] * 1e3:>10.3f}{mark}")
    rows.append(f"{'job':>6}  {summary['mean_s'] * 1e3:>10.3f}  {summary['std_s'] * 1e3:>10.3f}"
                "  (per iteration: slowest rank)")
    rows.append(f"loss {summary['loss']:.6g}")
    return "\n".join(rows)


def under_launcher() -> bool:
    """True when a hapd daemon started this rank for the launcher (``HAPD_JOB`` is set):
    the launcher prints the job's one timing table from the ``{"hapd": ...}`` lines."""
    return bool(os.environ.get("HAPD_JOB"))


def report(env: DistEnv, *, system: str, model: str, times: Sequence[float], warmup: int, loss: float,
           extra: dict[str, Any] | None = None, json_path: Path | None = None) -> dict[str, Any]:
    """Print this rank's ``{"hapd": "timings"}`` line; rank 0 then prints a table of every
    rank (not under the launcher, which prints the job's table: :func:`under_launcher`)
    and the ``{"hapd": "summary"}`` line, and writes the summary to ``json_path`` when
    given. Collective: every rank must call it. Returns the summary (on every rank).
    See the module docstring for the format.
    """
    script_reported()  # this line, not the parallelized module's (hapd.train.telemetry)
    times = [float(t) for t in times]
    timed = summarize_times(times[warmup:])
    line = {"hapd": "timings", "rank": env.rank, "world": env.world, "system": system, "model": model,
            "iteration_s": times, "warmup": int(warmup), "mean_s": timed.mean, "std_s": timed.std, "loss": float(loss),
            **(extra or {})}
    _emit(line)
    if dist.is_initialized() and env.world > 1:
        lines: list[Any] = [None] * env.world
        dist.all_gather_object(lines, line)
    else:
        lines = [line]
    summary = summarize(lines)
    if env.rank == 0:
        if not under_launcher():
            sys.stdout.write(format_table(summary) + "\n")
        _emit(summary)
        if json_path is not None:
            json_path = Path(json_path)
            json_path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(json_path, json.dumps(summary, indent=1) + "\n")
    return summary


__all__ = ["DTYPES", "TRACE_ITERATIONS", "TrainArgs", "add_init_flag", "add_train_flags", "format_table",
           "under_launcher", "local_batch", "parse_train_args", "report", "shutdown", "summarize", "trace_path",
           "train"]
