"""One device, one training step: a zoo model trained eagerly against ``hapd.parallelize``
of the same model, both also under ``torch.compile``, in fp32 and bf16 autocast.

    python bench/gpu_step.py                                  # GPU: paper sizes; CPU: small
    python bench/gpu_step.py --size tiny --iterations 3 --warmup 1 --variants eager hapd
    python bench/gpu_step.py --op-table --out bench/out/gpu_step   # + torch.profiler's per-op table

A step is forward + backward + ``AdamW.step()`` + ``zero_grad(set_to_none=True)`` on one
batch of the zoo model's example inputs (``--batch`` × ``--seq`` tokens; paper size: GPT-2
124M and Llama 183M at batch 8 × 1024). Every variant starts from the same weights (the
model built with seed 0) and a fresh optimizer:

- ``eager``: the zoo model itself;
- ``hapd``: ``hapd.parallelize(model, example)`` on one process (rank 0 of a world of 1,
  no process group), with ``--profile`` (default: none, parallelize's own default);
- ``compiled-eager``: ``torch.compile`` of the model;
- ``compiled-hapd``: ``parallelize(..., compile=True)`` where parallelize has that
  option, else ``torch.compile`` of the returned module (of its rank program
  ``module.inner`` when the module does not compile); a row says which, or why it was
  skipped.

Precisions: ``fp32`` (on CUDA with TF32 matmuls and convolutions) and ``bf16``
(``torch.autocast(device, dtype=torch.bfloat16)`` around the forward; on CPU too).

Per (model, precision, variant): the median step time (``time.perf_counter`` around each
step, the device synchronized before and after), the peak memory of the steps
(CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, every
tensor on the device counted, the parameters and Adam state too, less what the other
variant measured alongside keeps there; CPU: the live tensor bytes of one more step,
counted by hapd's ``LiveTensorBytes``) and the plan's predicted per-device memory
(``module.plan.estimate["memory"][0]``: parameters, gradients, Adam state and
activations). Ratios are against the baseline of the same run: hapd/eager,
compiled-hapd/compiled-eager, peak/estimate. In each precision, eager and hapd steps
alternate (``--no-interleave``: one's after the other's), so a busy machine's drift hits
both alike; then the compiled pair likewise. The model's own parameters stay on the
device for the eager variants: ``parallelize`` keeps copies (the bench prints how much
device memory it took).

``--op-table``: torch.profiler (CPU, and CUDA where there is one) of one more step per
variant: the top ops by self device time (self CPU time on CPU), and per-step counts of
the key ops (attention, matmuls, norms, losses, the causal-mask ops) with the CUDA kernel
count and the host op time, every variant side by side.

Order: every model's eager/hapd pair (both precisions) first, then the compiled pairs,
every model's fp32 before any bf16; the model is built and parallelized afresh for each.
``--budget SECONDS`` skips (as rows that say so) the groups that would end past it, a
compiled pair priced at two of the longest compile seen so far. On a GPU, e.g.::

    python bench/gpu_step.py --size paper --op-table --budget 300 --out /tmp/gpu_step

``--out DIR``: each measurement is written as it exists (``DIR/MODEL-PRECISION-VARIANT.json``
and a line of ``DIR/results.jsonl``), then ``DIR/table.txt`` and ``DIR/ops.txt``, so a
run killed by a timeout keeps what it measured. A variant that fails is a row with its
error; the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import inspect
import json
import platform
import re
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import hapd  # noqa: E402
from hapd.models import zoo  # noqa: E402
from launcher.report import clean_nans  # noqa: E402

MODELS = ("gpt2", "llama")
PRECISIONS = ("fp32", "bf16")
VARIANTS = ("eager", "hapd", "compiled-eager", "compiled-hapd")
BASELINE = {"hapd": "eager", "compiled-hapd": "compiled-eager"}
"""A hapd variant -> the eager variant its time is divided by."""
GB = 1e9

KEY_OPS: tuple[tuple[str, re.Pattern], ...] = (
    ("attention", re.compile(r"scaled_dot_product|flash_attention|efficient_attention|cudnn_attention|_fused_sdp")),
    ("matmul", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$")),
    ("norm", re.compile(r"layer_norm|rms_norm|^aten::rsqrt$")),
    ("loss", re.compile(r"cross_entropy|nll_loss|log_softmax")),
    ("softmax", re.compile(r"^aten::_?softmax")),
    ("mask", re.compile(r"^aten::(arange|cumsum|diff|__and__|bitwise_and|le|ge|lt|gt|masked_fill|where|tril|triu|constant_pad_nd|index)$")),
)
"""The op families whose per-step counts are compared (torch.profiler's names)."""
TOP_OPS = 15


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One (model, precision, variant) measurement."""

    model: str
    precision: str
    variant: str
    status: str = "ok"
    """``ok``, ``error`` or ``skipped``."""
    error: str = ""
    how: str = ""
    """How the variant ran (how it was compiled)."""
    median_s: float | None = None
    times_s: list[float] = dataclasses.field(default_factory=list)
    first_step_s: float | None = None
    """The first step (torch.compile compiles in it)."""
    peak_bytes: float | None = None
    resident_bytes: float | None = None
    """Device (CPU: process) memory in use when the timed steps began."""
    peak_kind: str = ""
    after_forward_bytes: float | None = None
    """CUDA: memory in use after the forward of a timed step, before its backward (what the
    backward pass starts from: the resident state and what the forward kept)."""
    estimate_bytes: float | None = None
    """The hapd plan's predicted per-device peak (hapd variants)."""
    first_loss: float | None = None
    last_loss: float | None = None
    ops: dict[str, Any] | None = None
    """``--op-table``: top ops and key-op counts of one profiled step."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def key(self) -> str:
        return f"{self.model}-{self.precision}-{self.variant}"


class Sink:
    """Where results go as soon as they exist: stdout, and ``--out DIR``'s files."""

    def __init__(self, out: Path | None):
        self.out = out
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            for name in ("results.jsonl", "ops.txt"):  # appended to as the run goes
                (out / name).unlink(missing_ok=True)

    def row(self, row: Row, extra: dict[str, Any]) -> None:
        if self.out is None:
            return
        doc = clean_nans({**dataclasses.asdict(row), **extra})
        (self.out / f"{row.key}.json").write_text(json.dumps(doc, indent=1))
        with open(self.out / "results.jsonl", "a") as f:
            f.write(json.dumps(doc) + "\n")

    def text(self, name: str, text: str) -> None:
        if self.out is not None:
            (self.out / name).write_text(text)

    def append(self, name: str, text: str) -> None:
        if self.out is not None:
            with open(self.out / name, "a") as f:
                f.write(text)


def say(*parts: Any) -> None:
    print(*parts, flush=True)


# --------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    """Between variants on CUDA: what a variant left goes back to the device, so the next
    one's peak is its own. On the CPU peaks are counted tensor by tensor
    (``LiveTensorBytes``), not read from an allocator, so nothing is collected there (a
    ``gc.collect`` is ~0.25 s with torch and transformers loaded)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    from hapd.profiler.measure import cpu_model

    return f"{cpu_model()} ({torch.get_num_threads()} threads)"


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


# --------------------------------------------------------------------------------------
# Models and profiles
# --------------------------------------------------------------------------------------


def build(name: str, size: str, batch: int, seq: int | None,
          dropout: float | None = None) -> tuple[nn.Module, tuple[Tensor, ...], Any]:
    """Zoo model ``name`` at ``size`` (``seq`` overriding its sequence length, ``dropout``
    every dropout probability; None: the library's defaults), seeded with 0, on the CPU,
    with its example inputs and config."""
    entry = zoo.MODELS[name]
    config = getattr(entry.config_cls, size)()
    if seq is not None:
        config = dataclasses.replace(config, seq=seq)
    if dropout is not None:
        config = dataclasses.replace(config, dropout=dropout)
    torch.manual_seed(0)
    return entry.build(config), entry.example_inputs(config, batch), config


def hapd_profile(arg: str | None, device: torch.device) -> Any:
    """What ``--profile`` gives ``parallelize``: None (its default), ``measured`` (this
    device measured now by hapd's profiler, quick options), or the string as given (a
    path or a bundled profile's name)."""
    if arg is None or arg == "none":
        return None
    if arg != "measured":
        return arg
    from hapd.profiler.measure import measure_device
    from hapd.profile.options import ProfilerOptions
    from hapd.profile.schema import Device, Profile, estimated_profile

    m = measure_device(device, ProfilerOptions.quick())
    base = estimated_profile(1)
    dev = Device(rank=0, host=m.host, model=m.model, flops=m.flops, memory=float(m.memory),
                 elementwise_flops=m.elementwise_flops, op_seconds=m.op_seconds)
    return Profile(name="measured-1", devices=(dev,), collectives=base.collectives,
                   description=f"measured now by bench/gpu_step.py (hapd's profiler, quick options) on {m.model}")


def describe_profile(profile: Any, device: Any) -> str:
    """The profile ``parallelize`` plans for with ``profile`` on one rank of ``device``
    (its own ``job_profile``: without a profile, the device as it is), in one line."""
    try:
        from hapd.train.plan_source import job_profile

        p = job_profile(profile, 1, device=device)
        d = p.devices[0]
        return (f"{p.name}: {d.model}, {d.flops / 1e12:.3g} TFLOP/s, memory {d.memory / GB:.2f} GB"
                f" ({p.description})" + (" [parallelize's default: no profile given]" if profile is None else ""))
    except Exception as exc:  # a newer parallelize may pick its default otherwise: the plan says which
        return f"{profile!r} (not described here: {type(exc).__name__}: {exc}; each plan names its profile)"


def plan_facts(module: Any) -> dict[str, Any]:
    """What the hapd module's plan says: profile, estimate, recomputation, origin."""
    plan = module.plan
    est = plan.estimate
    recompute = list(plan.program.get("recompute") or [])
    facts: dict[str, Any] = {
        "profile_name": plan.key.get("profile_name"),
        "origin": module.plan_source.origin,
        "plan_seconds": module.plan_source.seconds,
        "estimate_memory": float(est["memory"][0]),
        "estimate_per_iteration_s": float(est["per_iteration"]),
        "recomputed_blocks": len(recompute),
    }
    try:
        from hapd.compiler.ratios import part_memory

        facts["estimate_memory_parts"] = {k: float(v[0]) for k, v in part_memory(plan.program, plan.ratios).items()}
    except Exception:  # the parts are informative only
        pass
    return facts


# --------------------------------------------------------------------------------------
# One variant
# --------------------------------------------------------------------------------------


FIRST_STEP_SEED = 1234
"""torch's seed before each variant's first step (its loss is compared)."""


def train_step(module: nn.Module, optimizer: torch.optim.Optimizer, inputs: Sequence[Tensor],
               device: torch.device, precision: str, after_forward: Callable[[], None] | None = None) -> Tensor:
    """forward (under autocast for bf16), backward, ``AdamW.step()``, ``zero_grad``;
    ``after_forward`` is called between the forward and the backward."""
    with autocast(device, precision):
        loss = module(*inputs)
    if after_forward is not None:
        after_forward()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


class Variant:
    """One variant of a (model, precision) being measured: started (built, first and
    warm-up steps), stepped (timed steps, each with its own peak memory), finished
    (medians, ``--op-table``). A failure at any point makes its row an error (a compiled
    variant that fails before its first timed step: skipped) and frees its optimizer;
    nothing raises."""

    def __init__(self, row: Row, make: Callable[[], tuple[nn.Module, nn.Module, str]], inputs: Sequence[Tensor],
                 device: torch.device, args: argparse.Namespace, params: nn.Module | None):
        self.row, self.make, self.inputs, self.device, self.args = row, make, inputs, device, args
        self.params = params
        """The uncompiled module whose parameters train (resident while the group lives)."""
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.last: Tensor | None = None
        self.compile_s = 0.0
        """Seconds building the variant took (compiling hapd's module is tried there)."""

    @property
    def ok(self) -> bool:
        return self.row.status == "ok"

    def tensors(self) -> list[Tensor]:
        """The tensors this variant keeps between steps: parameters, buffers, Adam state."""
        out: list[Tensor] = []
        if self.params is not None:
            out += [*self.params.parameters(), *self.params.buffers()]
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                out += [v for v in state.values() if isinstance(v, Tensor)]
        return out

    def step(self, after_forward: Callable[[], None] | None = None) -> Tensor:
        return train_step(self.module, self.optimizer, self.inputs, self.device, self.row.precision, after_forward)

    def fail(self, exc: BaseException) -> None:
        compiled = self.row.variant.startswith("compiled") and not self.row.times_s
        self.row.status = "skipped" if compiled else "error"
        text = str(exc).strip()
        self.row.error = f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
        if self.args.traceback:
            traceback.print_exc()
        self.release()

    def release(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self.module = self.optimizer = None
        free(self.device)

    def start(self) -> bool:
        try:
            start = time.perf_counter()
            self.module, self.params, self.row.how = self.make()
            self.compile_s = time.perf_counter() - start
            self.optimizer = torch.optim.AdamW(self.params.parameters(), lr=1e-4)
            sync(self.device)
            # one seed before each variant's first step: eager and hapd's one-device program
            # with --rng torch (torch's generator, as the model has it) draw the same dropout masks
            torch.manual_seed(FIRST_STEP_SEED)
            start = time.perf_counter()
            self.row.first_loss = float(self.step())
            sync(self.device)
            self.row.first_step_s = time.perf_counter() - start
            for _ in range(self.args.warmup - 1):
                self.step()
            sync(self.device)
            return True
        except Exception as exc:
            self.fail(exc)
            return False

    def timed(self, others: float) -> None:
        """One timed step; on CUDA its peak, less ``others``: the bytes the group's other
        variants keep on the device."""
        if not self.ok:
            return
        try:
            cuda = self.device.type == "cuda"
            if cuda:
                sync(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
                self.row.resident_bytes = float(torch.cuda.memory_allocated(self.device) - others)
            after_forward = None
            if cuda and not self.row.times_s:  # the first timed step: its memory after the forward

                def after_forward() -> None:
                    self.row.after_forward_bytes = float(torch.cuda.memory_allocated(self.device) - others)

            start = time.perf_counter()
            self.last = self.step(after_forward)
            sync(self.device)
            self.row.times_s.append(time.perf_counter() - start)
            if cuda:
                peak = float(torch.cuda.max_memory_allocated(self.device) - others)
                self.row.peak_bytes = max(self.row.peak_bytes or 0.0, peak)
                self.row.peak_kind = "cuda"
        except Exception as exc:
            self.fail(exc)

    def cpu_peak(self) -> None:
        """The peak live tensor bytes of one more step on the CPU (hapd's
        ``LiveTensorBytes``, what its memory model is checked against): the parameters,
        buffers, Adam state and inputs, and every tensor an op makes while it lives.
        Not for compiled variants (a dispatch mode under torch.compile)."""
        if self.row.variant.startswith("compiled"):
            self.row.peak_kind = "n/a (compiled, CPU)"
            return
        from hapd.harness.memtrack import LiveTensorBytes

        with LiveTensorBytes() as tracker:
            tracker.track(self.tensors())
            tracker.track(self.inputs)
            tracker.reset_peak()
            self.row.resident_bytes = float(tracker.current)
            self.step()
        self.row.peak_bytes = float(tracker.peak)
        self.row.peak_kind = "cpu tensors"

    def finish(self) -> None:
        if not self.ok:
            return
        self.row.median_s = statistics.median(self.row.times_s)
        self.row.last_loss = float(self.last) if self.last is not None else None
        if self.device.type != "cuda":
            try:
                self.cpu_peak()
            except Exception as exc:  # the timing stands; the row says the peak failed
                self.row.peak_kind = f"n/a ({type(exc).__name__}: {str(exc).strip()[:120]})"
        if self.args.op_table:
            try:
                self.row.ops = op_table(self.step, self.device)
            except Exception as exc:  # the timing stands; the row says the profile failed
                self.row.error = f"op table: {type(exc).__name__}: {str(exc).strip()[:200]}"
                if self.args.traceback:
                    traceback.print_exc()
        self.release()


def bytes_of(tensors: Sequence[Tensor]) -> float:
    """Bytes of distinct tensors (by data pointer: a tied weight once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t.device.type != "meta":
            seen.setdefault(t.data_ptr(), t.numel() * t.element_size())
    return float(sum(seen.values()))


def measure_group(variants: Sequence[Variant], args: argparse.Namespace) -> None:
    """Start every variant, then time their steps alternately (``--no-interleave``: one
    variant's steps after the other's), then finish them. Each step's peak is its own:
    the device memory the group's other variants keep is subtracted."""
    live = [v for v in variants if v.start()]

    def others(v: Variant) -> float:
        mine = {t.data_ptr() for t in v.tensors()}
        return bytes_of([t for w in live if w is not v for t in w.tensors() if t.data_ptr() not in mine])

    if args.interleave:
        for i in range(args.iterations):
            for v in live if i % 2 == 0 else live[::-1]:
                v.timed(others(v))
    else:
        for v in live:
            for _ in range(args.iterations):
                v.timed(others(v))
    for v in live:
        v.finish()

# --------------------------------------------------------------------------------------
# torch.profiler
# --------------------------------------------------------------------------------------


def _self_device_us(avg: Any) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(avg, name, None)
        if value is not None:
            return float(value)
    return 0.0


def op_table(step: Callable[[], Tensor], device: torch.device) -> dict[str, Any]:
    """torch.profiler of one step: top ops by self device time (self CPU time on CPU),
    per-step counts of every op of :data:`KEY_OPS`, CUDA kernels and host op time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=activities) as prof:
            step()
            sync(device)
        averages = prof.key_averages()
    ops: dict[str, dict[str, float]] = {}
    kernels = 0
    kernel_us = 0.0
    host_us = 0.0
    for avg in averages:
        if getattr(avg, "device_type", DeviceType.CPU) == DeviceType.CUDA:
            kernels += int(avg.count)
            kernel_us += _self_device_us(avg)
            continue
        host_us += float(avg.self_cpu_time_total)
        ops[avg.key] = {"count": int(avg.count), "self_device_us": _self_device_us(avg),
                        "self_cpu_us": float(avg.self_cpu_time_total)}
    by = "self_device_us" if cuda else "self_cpu_us"
    top = sorted(ops.items(), key=lambda kv: -kv[1][by])[:TOP_OPS]
    key_counts = {name: ops[name]["count"] for name in sorted(ops) if any(p.search(name) for _, p in KEY_OPS)}
    return {"sorted_by": by, "top": [{"op": k, **v} for k, v in top], "key_counts": key_counts,
            "aten_ops": sum(v["count"] for k, v in ops.items() if k.startswith("aten::")),
            "cuda_kernels": kernels if cuda else None, "kernel_ms": kernel_us / 1e3 if cuda else None,
            "host_op_ms": host_us / 1e3}


def format_ops(model: str, precision: str, rows: Sequence[Row]) -> str:
    """Each variant's top ops, then the key-op counts of every variant side by side."""
    profiled = [r for r in rows if r.ops]
    if not profiled:
        return ""
    lines = []
    for r in profiled:
        what = "self device ms" if r.ops["sorted_by"] == "self_device_us" else "self CPU ms"
        lines.append(f"-- {model} {precision} {r.variant}: top {TOP_OPS} ops of one step by {what}")
        for o in r.ops["top"]:
            lines.append(f"   {o['op'][:60]:<60} ×{o['count']:<5} {o[r.ops['sorted_by']] / 1e3:>9.3f} ms"
                         f"   (self CPU {o['self_cpu_us'] / 1e3:.3f} ms)")
    names = sorted({k for r in profiled for k in r.ops["key_counts"]},
                   key=lambda n: (next(i for i, (_, p) in enumerate(KEY_OPS) if p.search(n)), n))
    labels = {n: f"{next(f for f, p in KEY_OPS if p.search(n))} {n}" for n in names}
    left = max([40, *(len(v) + 2 for v in labels.values())])
    width = max(14, *(len(r.variant) + 2 for r in profiled))

    def line(label: str, values: Sequence[Any], fmt: str = "") -> str:
        return f"   {label:<{left}}" + "".join(f"{v:>{width}{fmt}}" for v in values)

    lines.append(f"-- {model} {precision}: key ops per step, side by side")
    lines.append(line("per-step count", [r.variant for r in profiled]))
    for n in names:
        lines.append(line(labels[n], [r.ops["key_counts"].get(n, 0) for r in profiled]))
    lines.append(line("aten ops (nested ones counted)", [r.ops["aten_ops"] for r in profiled]))
    if profiled[0].ops["cuda_kernels"] is not None:
        lines.append(line("CUDA kernels (memcpy, memset too)", [r.ops["cuda_kernels"] for r in profiled]))
        lines.append(line("CUDA kernel time ms", [r.ops["kernel_ms"] for r in profiled], ".2f"))
    lines.append(line("host op time ms (self CPU of all ops)", [r.ops["host_op_ms"] for r in profiled], ".2f"))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------


def _ms(s: float | None) -> str:
    return "—" if s is None else f"{s * 1e3:.2f}"


def _gb(b: float | None) -> str:
    """Bytes as GB (MB under 1 GB)."""
    if b is None:
        return "—"
    return f"{b / GB:.2f} GB" if abs(b) >= GB else f"{b / 1e6:.1f} MB"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def _x(r: float | None) -> str:
    return "—" if r is None else f"{r:.3f}×"


def row_line(row: Row, base: Row | None, estimate: float | None) -> str:
    head = f"{row.model:<6} {row.precision:<5} {row.variant:<15}"
    if row.status != "ok":
        return f"{head} {row.status}: {row.error}"
    line = (f"{head} {_ms(row.median_s):>9} ms  first step {row.first_step_s:.2f} s  "
            f"peak {_gb(row.peak_bytes)} ({row.peak_kind})"
            + (f", {_gb(row.after_forward_bytes)} after forward" if row.after_forward_bytes is not None else ""))
    if estimate is not None:
        line += f"  hapd's estimate {_gb(estimate)}, peak/est {_x(_ratio(row.peak_bytes, estimate))}"
    if base is not None and base.status == "ok":
        line += f"  {row.variant}/{base.variant} {_x(_ratio(row.median_s, base.median_s))}"
        if row.first_loss is not None and base.first_loss is not None:
            line += f"  first-loss diff {abs(row.first_loss - base.first_loss):.2e}"
    line += f"  loss {row.first_loss:.4f} -> {row.last_loss:.4f}"
    if row.how:
        line += f"  [{row.how}]"
    if row.error:
        line += f"  ({row.error})"
    return line


TABLE_HEAD = (f"{'model':<6} {'prec':<5} {'eager ms':>9} {'hapd ms':>9} {'hapd/eager':>10} "
              f"{'c-eager ms':>10} {'c-hapd ms':>10} {'c-hapd/c-eager':>14} {'eager peak':>10} {'hapd peak':>10} "
              f"{'estimate':>10} {'hapd/est':>9} {'eager/est':>9} {'recompute':>9} {'loss diff':>9}")


def table(rows: Sequence[Row], facts: dict[str, dict[str, Any]], header: str) -> str:
    """The compact table: per (model, precision) the four times, the two ratios and the
    peaks against the plan's estimate; then every row that did not run."""
    by = {(r.model, r.precision, r.variant): r for r in rows}
    lines = [header, TABLE_HEAD]
    pairs = list(dict.fromkeys((r.model, r.precision) for r in rows if r.precision in PRECISIONS))

    def t(m: str, p: str, v: str) -> float | None:
        r = by.get((m, p, v))
        return r.median_s if r is not None and r.status == "ok" else None

    def peak(m: str, p: str, v: str) -> float | None:
        r = by.get((m, p, v))
        return r.peak_bytes if r is not None and r.status == "ok" else None

    def loss_diff(m: str, p: str) -> str:
        a, b = by.get((m, p, "eager")), by.get((m, p, "hapd"))
        if a is None or b is None or a.first_loss is None or b.first_loss is None:
            return "—"
        return f"{abs(a.first_loss - b.first_loss):.1e}"

    for m, p in pairs:
        est = facts.get(m, {}).get("estimate_memory")
        rec = facts.get(m, {}).get("recomputed_blocks")
        lines.append(
            f"{m:<6} {p:<5} {_ms(t(m, p, 'eager')):>9} {_ms(t(m, p, 'hapd')):>9} "
            f"{_x(_ratio(t(m, p, 'hapd'), t(m, p, 'eager'))):>10} {_ms(t(m, p, 'compiled-eager')):>10} "
            f"{_ms(t(m, p, 'compiled-hapd')):>10} "
            f"{_x(_ratio(t(m, p, 'compiled-hapd'), t(m, p, 'compiled-eager'))):>14} "
            f"{_gb(peak(m, p, 'eager')):>10} {_gb(peak(m, p, 'hapd')):>10} {_gb(est):>10} "
            f"{_x(_ratio(peak(m, p, 'hapd'), est)):>9} {_x(_ratio(peak(m, p, 'eager'), est)):>9} "
            f"{'—' if rec is None else rec:>9} {loss_diff(m, p):>9}")
    for r in rows:
        if r.status != "ok":
            lines.append(f"  {r.model} {r.precision} {r.variant}: {r.status}: {r.error}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------


def _compile_option() -> bool:
    """Whether ``hapd.parallelize`` takes ``compile=``."""
    try:
        return "compile" in inspect.signature(hapd.parallelize).parameters
    except (TypeError, ValueError):
        return False


def _compile_hapd(module: nn.Module, inputs: Sequence[Tensor], device: torch.device,
                  precision: str) -> tuple[nn.Module, str]:
    """``torch.compile`` of the hapd module, tried on one forward and backward; of its
    rank program ``module.inner`` when the module does not compile. Returns the
    compiled module and how (with the seconds the compile took)."""
    tries = [("torch.compile(module)", module)]
    inner = getattr(module, "inner", None)
    if isinstance(inner, nn.Module):
        tries.append(("torch.compile(module.inner)", inner))
    errors = []
    for how, target in tries:
        try:
            start = time.perf_counter()
            compiled = torch.compile(target)
            with autocast(device, precision):
                loss = compiled(*inputs)
            loss.backward()
            sync(device)
            seconds = time.perf_counter() - start
            for p in module.parameters():
                p.grad = None
            return compiled, f"{how}, compiled in {seconds:.1f} s"
        except Exception as exc:
            for p in module.parameters():
                p.grad = None
            text = str(exc).strip()
            errors.append(f"{how}: {type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}")
            torch._dynamo.reset()
    raise RuntimeError("; ".join(errors))


def parallelize(model: nn.Module, inputs: Sequence[Tensor], profile: Any, device: torch.device,
                args: argparse.Namespace, **extra: Any) -> tuple[Any, dict[str, Any]]:
    """``hapd.parallelize`` of ``model`` (on ``device``) and what its plan says; prints
    both, with the device memory the module's own copy of the parameters took."""
    sync(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    start = time.perf_counter()
    module = hapd.parallelize(model, inputs, profile=profile, use_daemon=args.daemon, verbose=False, rng=args.rng,
                              **extra)
    seconds = time.perf_counter() - start
    free(device)
    took = torch.cuda.memory_allocated(device) - before if before is not None else None
    f = plan_facts(module)
    f["parallelize_seconds"] = seconds
    f["device_bytes_taken"] = took
    call = f"hapd.parallelize({', '.join(f'{k}={v!r}' for k, v in extra.items())})"
    say(f"{call}: {seconds:.1f} s; plan: {f['origin']}, profile {f['profile_name']}; "
        f"estimate {f['estimate_per_iteration_s'] * 1e3:.2f} ms/step, memory {_gb(f['estimate_memory'])}; "
        f"recomputed blocks: {f['recomputed_blocks']}"
        + (f"; it took {_gb(took)} of device memory (the model's parameters: {_gb(bytes_of(list(model.parameters())))})"
           if took is not None else ""))
    return module, f


class Clock:
    """The run's ``--budget``: whether a group of variants may start."""

    def __init__(self, budget: float | None):
        self.start = time.perf_counter()
        self.budget = budget
        self.compile_s: float | None = None
        """The longest compile seen so far (a compiled variant's first step)."""

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def refuses(self, compiled: bool, guess: float) -> str:
        """Why a group may not start ('' when it may): a compiled pair needs about two
        compiles (``guess`` seconds each until one was seen)."""
        if self.budget is None:
            return ""
        need = 2 * (self.compile_s or guess) if compiled else 0.0
        if self.elapsed() + need <= self.budget:
            return ""
        return (f"--budget {self.budget:.0f} s: {self.elapsed():.0f} s gone"
                + (f", a compiled pair takes about {need:.0f} s" if compiled else ""))


def run_model(name: str, args: argparse.Namespace, device: torch.device, profile: Any, sink: Sink,
              rows: list[Row], facts: dict[str, dict[str, Any]], clock: Clock, compiled: bool,
              precisions: Sequence[str]) -> None:
    """Zoo model ``name``'s uncompiled pair (eager, hapd) or its compiled pair, in each of
    ``precisions``, the two variants of a pair timed alternately; the model is built
    (seed 0) and parallelized afresh for each call."""
    names = ("compiled-eager", "compiled-hapd") if compiled else ("eager", "hapd")
    wanted = [v for v in names if v in args.variants]
    if not wanted or not precisions:
        return
    model, inputs, config = build(name, args.size, args.batch, args.seq, args.dropout)
    count = sum(p.numel() for p in model.parameters())
    say(f"\n== {name}{' compiled ' + ', '.join(precisions) if compiled else ''}: {count / 1e6:.1f}M parameters, "
        f"batch {args.batch} × {config.seq} tokens ==")
    state0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
    inputs = tuple(t.to(device) for t in inputs)
    model.to(device)

    def emit(row: Row) -> None:
        rows.append(row)
        base = next((r for r in rows if (r.model, r.precision, r.variant) == (name, row.precision,
                                                                              BASELINE.get(row.variant))), None)
        say(row_line(row, base, facts.get(name, {}).get("estimate_memory")))
        sink.row(row, {"device": args.device_name, "torch": torch.__version__, "size": args.size,
                       "batch": args.batch, "seq": config.seq, "parameters": count, "plan": facts.get(name),
                       "ratio_to_baseline": _ratio(row.median_s, base.median_s) if base and base.ok else None})

    module: Any = None
    parallel_error = ""
    why_not = clock.refuses(compiled, args.compile_guess)
    if not why_not and any(v.endswith("hapd") for v in wanted):
        extra = {"compile": True} if compiled and _compile_option() else {}
        try:
            module, facts[name] = parallelize(model, inputs, profile, device, args, **extra)
            parts = facts[name].get("estimate_memory_parts")
            if parts:
                say("plan's memory estimate: " + ", ".join(f"{k} {_gb(v)}" for k, v in parts.items()))
        except Exception as exc:
            text = str(exc).strip()
            call = "parallelize(compile=True)" if extra else "parallelize"
            parallel_error = f"{call}: {type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"
            if args.traceback:
                traceback.print_exc()

    def reset_eager() -> None:
        model.load_state_dict(state0)

    def reset_hapd(m: Any) -> None:
        m.load_full_state_dict(state0, strict=False)  # state0 lacks non-persistent buffers (rotary inv_freq)

    group_rows: list[Row] = []
    for precision in precisions:
        why_not = why_not or clock.refuses(compiled, args.compile_guess)
        group: list[Variant] = []
        for variant in wanted:
            row = Row(name, precision, variant)
            if why_not:
                row.status, row.error = "skipped", why_not
                emit(row)
            elif variant.endswith("eager"):
                def make() -> tuple[nn.Module, nn.Module, str]:
                    reset_eager()
                    return (torch.compile(model), model, "torch.compile(model)") if compiled else (model, model, "")
                group.append(Variant(row, make, inputs, device, args, model))
            elif module is None:
                row.status = "skipped" if compiled else "error"
                row.error = parallel_error
                emit(row)
            else:
                def make(precision: str = precision, m: Any = module) -> tuple[nn.Module, nn.Module, str]:
                    reset_hapd(m)
                    if not compiled:
                        return m, m, "hapd.parallelize"
                    if _compile_option():
                        return m, m, "hapd.parallelize(compile=True)"
                    wrapped, how = _compile_hapd(m, inputs, device, precision)
                    reset_hapd(m)
                    return wrapped, m, how
                group.append(Variant(row, make, inputs, device, args, module))
        measure_group(group, args)
        for v in group:
            emit(v.row)
            group_rows.append(v.row)
            if compiled and v.row.first_step_s is not None:
                taken = v.row.first_step_s + v.compile_s
                clock.compile_s = max(clock.compile_s or 0.0, taken)
        del group
        if compiled:
            torch._dynamo.reset()
        free(device)
    for precision in precisions:
        text = format_ops(name, precision, [r for r in group_rows if r.precision == precision])
        if text:
            say(text)
            sink.append("ops.txt", text + "\n")
    module = None
    model.to("cpu")
    del model
    free(device)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(zoo.MODELS))
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--compiled-precisions", nargs="+", choices=list(PRECISIONS), default=None,
                        help="precisions the compiled variants run in (default: all of --precisions)")
    parser.add_argument("--size", choices=["tiny", "small", "paper"], default=None,
                        help="zoo size (default: paper on CUDA, small on CPU)")
    parser.add_argument("--batch", type=int, default=8, help="batch (default 8)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: the size's)")
    parser.add_argument("--dropout", type=float, default=None,
                        help="every dropout probability (default: the library's; hapd draws with --rng's generator, "
                             "the compiled variants with inductor's)")
    parser.add_argument("--rng", choices=["counter", "torch"], default="counter",
                        help="parallelize's rng (default counter, parallelize's own: one process draws what N ranks "
                             "draw, other masks than eager's; torch: torch's generator as the model draws, so eager "
                             "and hapd first losses agree with dropout on)")
    parser.add_argument("--iterations", type=int, default=None, help="timed steps (default 20; --quick 3)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="untimed steps first, the compiling one among them (default 3; --quick 1)")
    parser.add_argument("--quick", action="store_true", help="3 timed steps after 1 warm-up")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    parser.add_argument("--profile", default=None,
                        help="passed to parallelize: a profile path or name, 'measured' (this device measured "
                             "now, quick), or anything parallelize takes (default: none, parallelize's default)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: a group of variants that would end past it is skipped (compiled pairs "
                             "are priced at two of the longest compile seen so far, --compile-guess before any)")
    parser.add_argument("--compile-guess", type=float, default=60.0,
                        help="seconds one compile is assumed to take before one was measured (default 60)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (CPU; default torch's): 1 is steadier on a shared machine")
    parser.add_argument("--daemon", action="store_true", help="let parallelize ask $HAPD_DAEMON for the plan")
    parser.add_argument("--no-interleave", dest="interleave", action="store_false",
                        help="time one variant's steps after the other's (default: eager and hapd steps "
                             "alternate, so a busy machine's drift hits both alike)")
    parser.add_argument("--op-table", action="store_true", help="torch.profiler of one step per variant")
    parser.add_argument("--out", type=Path, default=None, help="write each measurement here as it exists")
    parser.add_argument("--traceback", action="store_true", help="print the traceback of a failing variant")
    args = parser.parse_args(argv)
    if args.iterations is None:
        args.iterations = 3 if args.quick else 20
    if args.warmup is None:
        args.warmup = 1 if args.quick else 3
    if args.iterations < 1 or args.warmup < 1:
        parser.error("--iterations and --warmup must be at least 1")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.size is None:
        args.size = "paper" if args.device.startswith("cuda") else "small"
    return args


def _quiet_transformers() -> None:
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    _quiet_transformers()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # newer torch prefers fp32_precision; these still hold
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
    args.device_name = device_name(device)
    sink = Sink(args.out)
    profile = hapd_profile(args.profile, device)
    compile_how = "parallelize(compile=True)" if _compile_option() else "torch.compile of parallelize's module"
    header = (f"device {args.device_name} ({device}); torch {torch.__version__}; python {platform.python_version()}; "
              f"size {args.size}, batch {args.batch}{f', seq {args.seq}' if args.seq else ''}; "
              f"median of {args.iterations} steps after {args.warmup} warm-up"
              + (f"; TF32 matmuls {torch.backends.cuda.matmul.allow_tf32}" if device.type == "cuda" else "")
              + f"\nhapd profile: {describe_profile(profile, device)}\ncompiled hapd: {compile_how}")
    say(header)
    rows: list[Row] = []
    facts: dict[str, dict[str, Any]] = {}
    clock = Clock(args.budget)
    compiled_precisions = [p for p in args.precisions if p in (args.compiled_precisions or args.precisions)]
    # every model's uncompiled pair first, then the compiled pairs a precision at a time
    # (every model's fp32 before any bf16), so a --budget cuts the least
    plan = [(False, list(args.precisions))] + [(True, [p]) for p in compiled_precisions]
    for compiled, precisions in plan:
        for name in args.models:
            try:
                run_model(name, args, device, profile, sink, rows, facts, clock, compiled, precisions)
            except Exception as exc:  # building the model failed: a row, not the end of the run
                say(f"{name}: failed: {type(exc).__name__}: {exc}")
                if args.traceback:
                    traceback.print_exc()
                rows.append(Row(name, "-", "compiled" if compiled else "-", status="error",
                                error=f"{type(exc).__name__}: {exc}"))
            free(device)
            sink.text("table.txt", table(rows, facts, header) + "\n")
    say(f"\n{table(rows, facts, header)}\n(the run took {clock.elapsed():.0f} s)")
    return rows


if __name__ == "__main__":
    main()
