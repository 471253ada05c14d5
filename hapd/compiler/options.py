"""The options of one compile (:class:`CompileOptions`): every field documented and
validated on construction, and :meth:`CompileOptions.from_mapping`, the one way a map of
fields (the API's ``options=``, a daemon request's or its config's, a plan's key)
becomes options. Imports neither torch nor the core: the daemon's room reads options
before it loads the compiler."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

from hapd.errors import OptionsError
from hapd.profile.precision import PRECISIONS, REDUCE_DTYPES


MODES = ("auto", "data_parallel")
"""What ``CompileOptions.mode`` may be."""
RECOMPUTE = ("auto", "never", "always")
"""What ``CompileOptions.recompute`` may be."""
PIPELINE = ("off", "auto")
"""What ``CompileOptions.pipeline`` may be."""
MAX_ROUNDS_LIMIT = 1000
"""Most search ⇄ LP rounds a compile may ask for."""
MAX_STATES_LIMIT = 2**63 - 1
"""Largest state budget (the core counts states in a 64-bit integer)."""
MAX_FRONT_WIDTH = 2**63 - 1
"""Largest front width (a 64-bit integer in the core)."""
MAX_SEARCH_SECONDS = 7 * 24 * 3600.0
"""Longest time budget of one search: a week (the core's timer takes finite seconds)."""
TECHNIQUE_MARGIN = 0.02
"""The default of ``CompileOptions.technique_margin``: a more complex technique must be
predicted at least 2% faster than every simpler one to be chosen."""


def _int_option(name: str, value: Any, most: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise OptionsError(f"{name} {value!r} must be an integer", field=name)
    if not 1 <= value <= most:
        raise OptionsError(f"{name} {value} must be in 1..{most}", field=name)


def _bool_option(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise OptionsError(f"{name} {value!r} must be true or false", field=name)


def _seconds_option(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionsError(f"{name} {value!r} must be a number of seconds", field=name)
    if not (math.isfinite(value) and 0 < value <= MAX_SEARCH_SECONDS):
        raise OptionsError(f"{name} {value!r} must be a finite number of seconds in (0, {MAX_SEARCH_SECONDS:g}]", field=name)


def _margin_option(name: str, value: Any) -> None:
    """A share of a step's time in [0, 1): 1 or more would rule out every complex technique."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptionsError(f"{name} {value!r} must be a number", field=name)
    if not (math.isfinite(value) and 0 <= value < 1):
        raise OptionsError(f"{name} {value!r} must be at least 0 and below 1 (0.02: 2% faster)", field=name)


def _is_force(value: Any) -> bool:
    """Whether ``value`` maps node names to rule names (strings), as ``force`` must."""
    return isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _force_option(value: Any) -> None:
    if not _is_force(value):
        raise OptionsError("force must map node names to rule names (strings)", field="force")


def _ratios_option(value: Any) -> None:
    if not isinstance(value, (tuple, list)) or not value:
        raise OptionsError(f"ratios {value!r} must be a non-empty list of numbers", field="ratios")
    if any(isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0 for r in value):
        raise OptionsError(f"ratios {list(value)} must be finite numbers ≥ 0", field="ratios")
    if abs(sum(value) - 1) > 1e-6:
        raise OptionsError(f"ratios {list(value)} must sum to 1", field="ratios")


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """Options of one compile; part of the plan cache key."""

    mode: str = "auto"
    """``"auto"``: search every rule; ``"data_parallel"``: only the batch-split program
    (replicated parameters, gradients all-reduced), with LP-optimized ratios."""
    zero: bool = False
    """Allow ZeRO-style parameters (stored split on dim 0, all-gathered on use)."""
    overlap: bool = False
    """Price programs as two duplicas interleaved, one computing while the other
    communicates (HiDup; :mod:`hapd.compiler.overlap`). Compiling a program exported
    with a symbolic batch (``hapd export``), overlap joins the techniques searched: the
    program's half-batch graph is compiled so and competes with the SPMD plan (and the
    pipelines with ``pipeline`` auto; :mod:`hapd.compiler.techniques`). Compiling one
    graph, that graph is one duplica's (exported at half the global batch); the plan
    records ``overlap`` and ``duplicas`` for the runtime, and its estimate and baselines
    are for the global batch."""
    memory_caps: bool = True
    """Fit the plan in each device's memory (the profile's ``memory``, each device its
    own): the LP keeps every device's predicted peak (parameters, gradients, Adam state,
    kept activations, communication buffers and workspace: ``rustcore/core/src/memory.rs``)
    under its capacity, and a program that does not fit is searched again with memory
    priced (the search then trades time for memory: tensor or expert parallelism,
    ZeRO-style parameters). :class:`~hapd.errors.SynthesisError` naming the device, its
    capacity and the shortfall when nothing fits."""
    max_rounds: int = 4
    """Most search ⇄ LP rounds."""
    max_states: int = 2_000_000
    """State budget of one search."""
    front_width: int = 24
    """Undominated states kept per program position (larger: slower, closer to proven optimal)."""
    max_seconds: float | None = None
    """Time budget of one search."""
    force: Mapping[str, str] = field(default_factory=dict)
    """Restrict ops (by fx node name) to one rule (by name)."""
    ratios: tuple[float, ...] | None = None
    """Use these sharding ratios instead of optimizing them."""
    recompute: str = "auto"
    """Activation recomputation: the backward pass runs a block's forward again from its
    input instead of keeping its activations (the graph's repeated blocks, transformer
    layers: :mod:`hapd.compiler.recompute`). ``"auto"``: only when memory binds (no
    program fits without it, or fits only with memory priced or squeezed ratios), as
    few blocks as fit, and only where the plan is then cheaper; ``"never"``;
    ``"always"``: every block."""
    pipeline: str = "off"
    """Pipeline stages (HSPMD; ``docs/pipelines.md``): ``"auto"`` also searches
    pipelines that cut the program at block boundaries into stages, each on a group of
    whole hosts with its own SPMD plan, over micro-batches in the 1F1B order, and keeps
    one when its predicted time beats the SPMD plan's (the plan's ``pipeline``). From a
    program exported with a symbolic batch it prices every micro-batch count of
    :func:`~hapd.compiler.pipeline.stage_search.micro_batch_counts`, deriving their graphs;
    from one graph, each count it is given a graph for (``compile``'s
    ``micro_graphs``); ``"off"``: the SPMD plan only. With ``overlap`` too, only from a
    program (:mod:`hapd.compiler.techniques`). Not with fixed ``ratios`` (the ratios of
    the whole cluster)."""
    technique_margin: float = TECHNIQUE_MARGIN
    """How much faster a more complex technique must be predicted to be chosen: the
    techniques rank SPMD, then pipeline, then overlap (each runs more machinery than the
    one before), and one wins only when its predicted seconds per step are at most
    ``1 - technique_margin`` times every simpler technique's (0.02: at least 2% faster);
    of those that qualify the fastest runs, ties to the simpler. An estimate within the
    margin is within the cost model's error, and the simpler program is less to go
    wrong. In [0, 1); 0 picks the fastest (ties still to the simpler)."""
    precision: str = "fp32"
    """What the job trains in: ``"fp32"``; ``"bf16"`` or ``"fp16"``: the forward runs
    under ``torch.autocast`` to that dtype (matmul, convolution and attention in half
    precision, norms, softmax, losses and reductions in fp32, as autocast's op lists
    say), master weights, optimizer state and gradients stay fp32, and the plan is
    priced so (each device's matmul rate in that dtype:
    :mod:`hapd.profile.precision`; activations at the dtype autocast gives them:
    :mod:`hapd.compiler.precision`); fp16 wants loss scaling (:class:`hapd.GradScaler`,
    whose inf check spans every rank). ``"auto"``: bf16 where every device has it, fp16
    where one lacks it (V100, P100), fp32 on CPU devices. The plan records the
    precision it resolved to (``Plan.precision``)."""
    reduce_dtype: str = "fp32"
    """The dtype replicated parameters' gradients are summed over ranks in (FSDP2's
    ``MixedPrecisionPolicy.reduce_dtype``): ``"fp32"`` (default, exact sums of fp32
    gradients), ``"bf16"`` or ``"fp16"`` (half the bytes on the wire, rounded sums)."""

    def __post_init__(self) -> None:
        """Every field's type and range, checked here, before the core sees any of them
        (the options come from the command line, the API and config files)."""
        if not isinstance(self.mode, str) or self.mode not in MODES:
            raise OptionsError(f"mode {self.mode!r} is not auto or data_parallel", field="mode")
        _bool_option("zero", self.zero)
        _bool_option("overlap", self.overlap)
        _bool_option("memory_caps", self.memory_caps)
        _int_option("max_rounds", self.max_rounds, MAX_ROUNDS_LIMIT)
        _int_option("max_states", self.max_states, MAX_STATES_LIMIT)
        _int_option("front_width", self.front_width, MAX_FRONT_WIDTH)
        if self.max_seconds is not None:
            _seconds_option("max_seconds", self.max_seconds)
        _force_option(self.force)
        if self.ratios is not None:
            _ratios_option(self.ratios)
        if not isinstance(self.recompute, str) or self.recompute not in RECOMPUTE:
            raise OptionsError(f"recompute {self.recompute!r} is not auto, never or always", field="recompute")
        if not isinstance(self.pipeline, str) or self.pipeline not in PIPELINE:
            raise OptionsError(f"pipeline {self.pipeline!r} is not off or auto", field="pipeline")
        _margin_option("technique_margin", self.technique_margin)
        if not isinstance(self.precision, str) or self.precision not in PRECISIONS:
            raise OptionsError(f"precision {self.precision!r} is not one of {', '.join(PRECISIONS)}", field="precision")
        if not isinstance(self.reduce_dtype, str) or self.reduce_dtype not in REDUCE_DTYPES:
            raise OptionsError(f"reduce_dtype {self.reduce_dtype!r} is not one of {', '.join(REDUCE_DTYPES)}",
                               field="reduce_dtype")
        if self.pipeline == "auto" and self.ratios is not None:
            raise OptionsError("pipeline auto with fixed ratios: each stage's group gets its own ratios",
                               field="pipeline")

    @classmethod
    def from_mapping(cls, mapping: CompileOptions | Mapping[str, Any] | None) -> CompileOptions:
        """Options from a map of their fields (the API's ``options=``, a daemon request's
        or its config's ``options``, a plan's key); ``None`` gives the defaults, and
        options are returned as they are. A list of ``ratios`` becomes a tuple.
        :class:`OptionsError` naming the option as a request does (``options.<field>``):
        an unknown one (the message lists the known ones) or a bad value."""
        if mapping is None:
            return cls()
        if isinstance(mapping, cls):
            return mapping
        try:
            fields = dict(mapping)
        except (TypeError, ValueError) as exc:
            raise OptionsError(f"bad compile options: {exc}", field="options") from exc
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known, key=str)
        if unknown:
            raise OptionsError(f"unknown compile option {unknown[0]!r} (known: {', '.join(sorted(known))})",
                               field=f"options.{unknown[0]}")
        ratios = fields.get("ratios")
        if ratios is not None and not isinstance(ratios, (str, bytes, Mapping)):
            try:
                fields["ratios"] = tuple(ratios)
            except TypeError:
                pass  # not a sequence: the check of ratios says so
        if "force" in fields and not _is_force(fields["force"]):
            raise OptionsError("option force must map node names to rule names", field="options.force")
        try:
            return cls(**fields)
        except OptionsError as exc:  # name the option as the request does
            raise OptionsError(f"compile option {exc}", field=f"options.{exc.field}") from None
        except (TypeError, ValueError) as exc:
            raise OptionsError(f"bad compile options: {exc}", field="options") from exc

    def key(self) -> dict[str, Any]:
        """The options as a plan's cache key records them. ``precision`` and
        ``reduce_dtype`` at their defaults are left out, so plans cached before they
        existed keep their keys."""
        out = asdict(self)
        if self.precision == "fp32":
            del out["precision"]
        if self.reduce_dtype == "fp32":
            del out["reduce_dtype"]
        out["force"] = dict(sorted(self.force.items()))
        out["ratios"] = list(self.ratios) if self.ratios is not None else None
        out["technique_margin"] = float(self.technique_margin)
        return out

    def core(
        self, mode: str = "auto", memory_price: Sequence[float] | None = None, recompute: Sequence[str] = ()
    ) -> dict[str, Any]:
        """The options as the core reads them, with the blocks to ``recompute``."""
        out: dict[str, Any] = {
            "mode": mode,
            "zero": self.zero,
            "overlap": self.overlap,
            "max_states": self.max_states,
            "front_width": self.front_width,
            "force": dict(self.force) if mode == "auto" else {},
        }
        if self.max_seconds is not None:
            out["max_seconds"] = float(self.max_seconds)
        if memory_price is not None:
            out["memory_price"] = [float(p) for p in memory_price]
        if recompute:
            out["recompute"] = sorted(recompute)
        return out
