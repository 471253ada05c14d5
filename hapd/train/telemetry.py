"""Per-step telemetry of a :class:`~hapd.train.parallel_module.ParallelModule` (or a
:class:`~hapd.train.pipeline_module.PipelineModule`), for any training script, with no
code of the user's.

**What a step is.** A step ends when an optimizer holding the module's parameters
finishes ``step()`` (any ``torch.optim.Optimizer``: a global post-step hook), and begins
where the previous one ended — the first at the module's first training forward. So a
step's time is everything the loop does between two optimizer steps: loading data, the
forward(s) and backward(s) (several with gradient accumulation), clipping and the
update. Its **samples** are the global batch samples of the training forwards in it
(every micro-batch of an accumulation); its **tokens**, when the first integer input of
two or more dims is token ids, samples × that input's sequence length. A script that
never steps a torch optimizer gets forward-to-forward steps instead. Eval forwards
(``module.eval()`` or under ``torch.no_grad()``) are not counted; their time falls in
the step around them. On CUDA the module's device is synchronized at each step's end
(so a step is the device's time, as the benchmark worker measures it;
``HAPD_TELEMETRY_SYNC=0`` turns that off).

**Where it goes.**

- Under the launcher (``HAPD_JOB`` set by the daemon) each rank prints, when the process
  exits, one ``{"hapd": "timings"}`` line (:mod:`hapd.harness.training` documents the
  format): ``iteration_s`` the seconds of every step, ``warmup`` the first
  ``HAPD_TELEMETRY_WARMUP`` (default 2, fewer for short runs) left out of the
  statistics, ``samples_per_step``, ``samples_per_s`` and ``tokens_per_s`` over the
  steps after warm-up, ``loss_part`` (this rank's part of the last training forward's
  loss: the launcher sums them into the job's loss), the plan's ``technique`` and
  predicted ``estimate_s``. The launcher gathers them into its timing table and JSON
  report as it does the benchmark worker's. A script that prints its own timings line
  (the benchmark worker, through :func:`hapd.harness.training.report`) keeps it: the
  module's is then not printed (:func:`script_reported`). ``HAPD_TELEMETRY=1`` prints
  the line without the launcher too; ``HAPD_TELEMETRY=0`` turns all of this off.
- ``HAPD_PROGRESS=1`` (the launcher's ``--progress``): rank 0 shows progress — a tqdm
  bar on a terminal when tqdm is installed, else a line on stderr at the first step,
  then every ``HAPD_PROGRESS_EVERY`` seconds (default 2), and at the end: step, the
  step's loss, ms/step, samples/s (tokens/s).
- ``HAPD_LOG_DIR=DIR`` (the launcher's ``--log-dir``): rank 0 logs each step's
  ``hapd/loss``, ``hapd/step_time_s``, ``hapd/samples_per_s`` and ``hapd/tokens_per_s`` as
  TensorBoard scalars (``torch.utils.tensorboard``, which needs the ``tensorboard``
  package); without it, as JSON lines in ``DIR/hapd_steps.jsonl`` (one ``{"step",
  "loss", "step_time_s", "samples", "samples_per_s", "tokens_per_s", "time"}`` per
  step), and says so once.

**The step's loss** (with either): the global loss of the step — the single-device
loss, the mean over the step's training forwards when it accumulates several — which
every rank's telemetry sums at the step's end (one scalar all-reduce per step in the
module's group, only when one of the two variables is set: every rank of a job sees
the same environment, so all take part).

Without the launcher and none of these variables the module records nothing (no hook,
no cost).
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hapd.compiler.plan_summary import predicted_seconds, technique
from hapd.util import summarize

ENV_TELEMETRY = "HAPD_TELEMETRY"
ENV_WARMUP = "HAPD_TELEMETRY_WARMUP"
ENV_SYNC = "HAPD_TELEMETRY_SYNC"
ENV_PROGRESS = "HAPD_PROGRESS"
ENV_PROGRESS_EVERY = "HAPD_PROGRESS_EVERY"
ENV_LOG_DIR = "HAPD_LOG_DIR"
DEFAULT_WARMUP = 2
LOG_FILE = "hapd_steps.jsonl"

_lock = threading.Lock()
_recorders: list["StepTelemetry"] = []
_hook_handle: Any = None
_reported_by_script = False
_exit_registered = False


def _flag(name: str) -> bool | None:
    """True/False for a set variable (``0``/``off``/``false``/``no`` are False), None unset."""
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return value.strip().lower() not in ("0", "off", "false", "no")


def enabled() -> bool:
    """Whether modules record steps: under the launcher (``HAPD_JOB``), or asked for by
    ``HAPD_TELEMETRY``, ``HAPD_PROGRESS`` or ``HAPD_LOG_DIR``; never with
    ``HAPD_TELEMETRY=0``."""
    asked = _flag(ENV_TELEMETRY)
    if asked is False:
        return False
    return bool(asked or os.environ.get("HAPD_JOB") or _flag(ENV_PROGRESS) or os.environ.get(ENV_LOG_DIR))


def script_reported() -> None:
    """Say that the script printed its own ``{"hapd": "timings"}`` line: the modules'
    are not printed at exit (the launcher keeps a rank's last line)."""
    global _reported_by_script
    _reported_by_script = True


class Passthrough:
    """The telemetry of a module that records nothing: runs the forward."""

    @staticmethod
    def forward(module: Any, run: Callable[..., Tensor], local_inputs: Sequence[Tensor]) -> Tensor:
        return run(*local_inputs)


PASSTHROUGH = Passthrough()


class StepTelemetry:
    """One module's steps (see the module docstring). Holds no reference to the module."""

    def __init__(self, *, rank: int, world: int, name: str, device: torch.device, parameters: Sequence[Tensor],
                 batch_dims: Sequence[int | None] | None, plan_info: dict[str, Any],
                 global_loss: Callable[[], Callable[[Tensor], float] | None] | None = None):
        self.rank, self.world, self.name = rank, world, name
        self.global_loss = global_loss if _flag(ENV_PROGRESS) or os.environ.get(ENV_LOG_DIR) else None
        """A weak reference to the module's ``global_loss`` (collective), when the step's
        loss is shown or logged; None: it is not."""
        self._step_loss: Tensor | None = None
        self._step_forwards = 0
        self.device = torch.device(device)
        self.param_ids = {id(p) for p in parameters}
        self.batch_dims = list(batch_dims) if batch_dims is not None else None
        self.plan_info = dict(plan_info)
        self.sync = self.device.type == "cuda" and _flag(ENV_SYNC) is not False
        self.steps: list[float] = []
        """Seconds of every step that ended at an optimizer step."""
        self.step_samples: list[int] = []
        self.step_tokens: list[int | None] = []
        self.forwards: list[tuple[float, int, int | None]] = []
        """(start time, samples, tokens) of every training forward (forward-to-forward
        steps, when no optimizer steps)."""
        self._start: float | None = None
        self._samples = 0
        self._tokens: int | None = 0
        """Tokens of the step so far; None once a forward's inputs were not token ids."""
        self._loss: Tensor | None = None
        self._sink = _Sink(rank, name) if rank == 0 else None

    # -- recording --------------------------------------------------------------------

    def forward(self, module: Any, run: Callable[..., Tensor], local_inputs: Sequence[Tensor]) -> Tensor:
        """Run ``module``'s forward ``run`` on ``local_inputs``, counting it when it trains."""
        if not (module.training and torch.is_grad_enabled()):
            return run(*local_inputs)
        now = time.perf_counter()
        samples, tokens = self.batch_size(_global_shapes(module, local_inputs), local_inputs)
        if self._start is None:
            self._start = now
        self._samples += samples
        self._tokens = None if tokens is None or self._tokens is None else self._tokens + tokens
        self.forwards.append((now, samples, tokens))
        out = run(*local_inputs)
        self._loss = out.detach() if isinstance(out, Tensor) else None
        if self.global_loss is not None and self._loss is not None and self._loss.numel() == 1:
            part = self._loss.to(torch.float64)
            self._step_loss = part if self._step_loss is None else self._step_loss + part
            self._step_forwards += 1
        return out

    def batch_size(self, shapes: Sequence[Sequence[int]], inputs: Sequence[Tensor]) -> tuple[int, int | None]:
        """(samples, tokens or None) of a global batch of ``shapes``."""
        dims = self.batch_dims or [0 if len(s) > 0 else None for s in shapes]
        samples = next((int(s[d]) for s, d in zip(shapes, dims) if d is not None and len(s) > d), 1)
        for shape, dim, tensor in zip(shapes, dims, inputs):
            if len(shape) >= 2 and not tensor.is_floating_point() and not tensor.is_complex() \
                    and tensor.dtype != torch.bool:
                seq = next((int(n) for k, n in enumerate(shape) if k != dim), 1)
                return samples, samples * seq
        return samples, None

    def optimizer_stepped(self) -> None:
        """End the current step (an optimizer holding the module's parameters stepped)."""
        if self._start is None or self._samples == 0:
            return
        if self.sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        seconds = now - self._start
        self.steps.append(seconds)
        self.step_samples.append(self._samples)
        self.step_tokens.append(self._tokens)
        self._start, self._samples, self._tokens = now, 0, 0
        loss = self._global_step_loss()
        if self._sink is not None:
            self._sink.step(len(self.steps), seconds, self.step_samples[-1], self.step_tokens[-1], loss)

    def _global_step_loss(self) -> float | None:
        """The step's global loss (every rank calls it at the same step's end: a
        collective), or None when it is not asked for."""
        if self.global_loss is None:
            return None
        part, count = self._step_loss, self._step_forwards
        self._step_loss, self._step_forwards = None, 0
        reduce = self.global_loss()
        if reduce is None or part is None:
            return None
        return reduce(part / count)

    def holds_any(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(id(p) in self.param_ids for group in optimizer.param_groups for p in group["params"])

    # -- reporting --------------------------------------------------------------------

    def recorded(self) -> tuple[list[float], list[int], list[int | None], str]:
        """(seconds, samples, tokens of every step, what ended them: ``"optimizer
        step"`` or ``"forward"``)."""
        if self.steps:
            return list(self.steps), list(self.step_samples), list(self.step_tokens), "optimizer step"
        starts = self.forwards
        times = [b[0] - a[0] for a, b in zip(starts, starts[1:])]
        return times, [a[1] for a in starts[:-1]], [a[2] for a in starts[:-1]], "forward"

    def timings_line(self) -> dict[str, Any] | None:
        """This rank's ``{"hapd": "timings"}`` line, or None before any step."""
        times, samples, tokens, boundary = self.recorded()
        if not times:
            return None
        warmup = min(_warmup(), max(len(times) - 1, 0), len(times) // 2)
        timed = summarize(times[warmup:])
        total_s = sum(times[warmup:])
        count = sum(samples[warmup:])
        known_tokens = tokens[warmup:]
        loss = None
        if self._loss is not None and self._loss.numel() == 1:
            loss = float(self._loss.detach().double().cpu())
        line = {
            "hapd": "timings", "rank": self.rank, "world": self.world, "system": "hapd", "model": self.name,
            "iteration_s": times, "warmup": warmup, "mean_s": timed.mean, "std_s": timed.std,
            "loss_part": loss, "step_boundary": boundary, "samples_per_step": count / max(len(times) - warmup, 1),
            "samples_per_s": count / total_s if total_s > 0 else None,
            "tokens_per_s": (sum(t for t in known_tokens if t is not None) / total_s
                             if total_s > 0 and known_tokens and all(t is not None for t in known_tokens) else None),
            "source": "parallel_module", **self.plan_info,
        }
        return line

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()


def _warmup() -> int:
    try:
        return max(0, int(os.environ.get(ENV_WARMUP, DEFAULT_WARMUP)))
    except ValueError:
        return DEFAULT_WARMUP


def _global_shapes(module: Any, local_inputs: Sequence[Tensor]) -> list[list[int]]:
    """The global batch's shapes of this forward (as the module runs it)."""
    if module.world == 1:
        return [list(t.shape) for t in local_inputs]
    cut = getattr(module, "_cut", None)
    shapes = cut[0] if cut is not None else getattr(module, "_example_shapes", None)
    return [list(s) for s in shapes] if shapes is not None else [list(t.shape) for t in local_inputs]


def for_module(module: Any, *, instead_of: Any = None) -> StepTelemetry | Passthrough:
    """The telemetry of a new :class:`~hapd.train.parallel_module.ParallelModule` or
    :class:`~hapd.train.pipeline_module.PipelineModule` (:data:`PASSTHROUGH` when
    :func:`enabled` is false); ``instead_of``: a module inside it whose own telemetry it
    replaces (a pipeline's stage)."""
    if instead_of is not None:
        inner = getattr(instead_of, "_telemetry", PASSTHROUGH)
        with _lock:
            if inner in _recorders:
                _recorders.remove(inner)
                _by_optimizer.clear()
        instead_of._telemetry = PASSTHROUGH
    if not enabled():
        return PASSTHROUGH
    recipe = getattr(module, "_recipe", None)
    doc = module.plan.doc
    device = recipe.device if recipe is not None else next((p.device for p in module.parameters()), torch.device("cpu"))
    info = {"technique": technique(doc), "estimate_s": predicted_seconds(doc), "plan": module.plan_source.origin,
            "plan_s": module.plan_source.seconds, "ratios": list(doc["ratios"])}
    recorder = StepTelemetry(rank=module.rank, world=module.world, name=recipe.name if recipe is not None else str(doc["program"].get("graph", "model")),
                             device=device, parameters=list(module.parameters()),
                             batch_dims=recipe.batch_dims if recipe is not None else None, plan_info=info,
                             global_loss=weakref.WeakMethod(module.global_loss))
    _register(recorder)
    return recorder


_by_optimizer: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list[StepTelemetry]]" = weakref.WeakKeyDictionary()


def _on_optimizer_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    found = _by_optimizer.get(optimizer)
    if found is None:
        with _lock:
            found = [r for r in _recorders if r.holds_any(optimizer)]
        try:
            _by_optimizer[optimizer] = found
        except TypeError:  # not weak-referenceable
            pass
    for recorder in found:
        recorder.optimizer_stepped()


def _register(recorder: StepTelemetry) -> None:
    global _hook_handle, _exit_registered
    with _lock:
        _recorders.append(recorder)
        _by_optimizer.clear()
        if _hook_handle is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _hook_handle = register_optimizer_step_post_hook(_on_optimizer_step)
        if not _exit_registered:
            atexit.register(emit_at_exit)
            _exit_registered = True


def emit_at_exit() -> None:
    """At exit: close the progress and logs, and print the timings line of the module
    that recorded the most steps (under the launcher or with ``HAPD_TELEMETRY=1``,
    unless the script printed its own)."""
    with _lock:
        recorders = list(_recorders)
    for recorder in recorders:
        recorder.close()
    if _reported_by_script or not (os.environ.get("HAPD_JOB") or _flag(ENV_TELEMETRY)):
        return
    lines = [line for line in (r.timings_line() for r in recorders) if line is not None]
    if not lines:
        return
    best = max(enumerate(lines), key=lambda kv: (len(kv[1]["iteration_s"]), kv[0]))[1]
    try:
        sys.stdout.write(json.dumps(_clean(best), separators=(", ", ": ")) + "\n")
        sys.stdout.flush()
    except (OSError, ValueError):  # stdout closed
        pass


def _clean(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


class _Sink:
    """Rank 0's progress display and step log (each only when its variable asks)."""

    def __init__(self, rank: int, name: str):
        self.name = name
        self.progress = bool(_flag(ENV_PROGRESS))
        self.bar: Any = None
        self.every = _float_env(ENV_PROGRESS_EVERY, 2.0)
        self.last_print = 0.0
        self.last_step = 0
        """The last step printed (the end prints the steps after it)."""
        self.index, self.last_loss = 0, None
        self.window: list[tuple[float, int, int | None]] = []
        self.log_dir = os.environ.get(ENV_LOG_DIR)
        self.writer: Any = None
        self.jsonl: Any = None
        self._opened = False

    def _open(self) -> None:
        self._opened = True
        if self.progress and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(desc=f"hapd {self.name}", unit="step", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self.bar = None
        if self.log_dir:
            folder = Path(self.log_dir)
            folder.mkdir(parents=True, exist_ok=True)
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(log_dir=str(folder))
            except ImportError:
                self.jsonl = open(folder / LOG_FILE, "a", encoding="utf-8")  # noqa: SIM115 - closed at exit
                print(f"hapd: tensorboard is not installed: writing step scalars to {folder / LOG_FILE} "
                      f"(pip install tensorboard for TensorBoard event files)", file=sys.stderr, flush=True)

    def step(self, index: int, seconds: float, samples: int, tokens: int | None, loss: float | None = None) -> None:
        if not self._opened:
            self._open()
        rate = samples / seconds if seconds > 0 else 0.0
        token_rate = tokens / seconds if tokens is not None and seconds > 0 else None
        if self.writer is not None:
            if loss is not None:
                self.writer.add_scalar("hapd/loss", loss, index)
            self.writer.add_scalar("hapd/step_time_s", seconds, index)
            self.writer.add_scalar("hapd/samples_per_s", rate, index)
            if token_rate is not None:
                self.writer.add_scalar("hapd/tokens_per_s", token_rate, index)
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": index, "loss": loss, "step_time_s": seconds, "samples": samples,
                                         "samples_per_s": rate, "tokens_per_s": token_rate, "time": time.time()}) + "\n")
            self.jsonl.flush()
        if not self.progress:
            return
        self.window.append((seconds, samples, tokens))
        self.last_loss, self.index = loss, index
        said = "" if loss is None else f"loss {loss:.4f}, "
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(said + _rates(self.window[-10:]), refresh=False)
            return
        now = time.monotonic()
        if index == 1 or now - self.last_print >= self.every:
            self._print(now)

    def _print(self, now: float) -> None:
        """One progress line: the last step, its loss, the rates since the last line."""
        said = "" if self.last_loss is None else f"loss {self.last_loss:.4f}, "
        print(f"hapd: step {self.index}, {said}{_rates(self.window)}", file=sys.stderr, flush=True)
        self.last_print, self.last_step, self.window = now, self.index, []

    def close(self) -> None:
        if self.bar is None and self.progress and self.window and self.index > self.last_step:
            self._print(time.monotonic())  # the end: the steps since the last line
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.writer is not None:
            self.writer.close()
            self.writer = None
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None


def _rates(window: Sequence[tuple[float, int, int | None]]) -> str:
    """``3.21 ms/step, 2490 samples/s, 79680 tokens/s`` over ``window``'s steps."""
    seconds = sum(w[0] for w in window)
    samples = sum(w[1] for w in window)
    text = f"{seconds / len(window) * 1e3:.2f} ms/step, {samples / seconds:.0f} samples/s" if seconds > 0 else "-"
    if seconds > 0 and all(w[2] is not None for w in window):
        text += f", {sum(w[2] for w in window) / seconds:.0f} tokens/s"  # type: ignore[misc]
    return text


def _float_env(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, default)))
    except ValueError:
        return default


__all__ = ["ENV_LOG_DIR", "ENV_PROGRESS", "ENV_TELEMETRY", "PASSTHROUGH", "StepTelemetry", "emit_at_exit", "enabled",
           "for_module", "script_reported"]
