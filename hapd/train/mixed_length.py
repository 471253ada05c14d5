"""Mixed-length data: sequences of different lengths, packed into rows, split by cost.

Real text is long-tailed: most sequences are far shorter than the longest. Padding
every sequence of a batch to the batch's longest wastes most of a step, and packing
them all into rows of the longest length spends attention's quadratic term on rows much
longer than their documents. :func:`mixed_loader` does neither::

    module = hapd.parallelize(PackedLanguageModel(model), example_rows)   # e.g. 8 rows of 512
    loader = hapd.mixed_loader(sequences, module, tokens=16384)           # a token budget per step
    for step in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = step.train(module)          # every micro-batch's forward and backward; the global loss
        optimizer.step()

Each step draws sequences in a shuffled order until the token budget is reached (the
order is seeded, the same on every rank; :meth:`MixedLengthLoader.state_dict` says
where it is, for checkpoints). The step is then packed on every rank alike
(:func:`pack_step`, a few milliseconds):

1. **Shapes from a small pool.** Rows have a length from :func:`row_lengths` (``shortest``
   times a power of two, up to the longest sequence); a micro-batch of row length ``R``
   has ``micro_tokens // R`` rows (``micro_tokens``: the example batch's rows times its
   row length), or that rounded up to ``rows_step`` for the last one. A run therefore
   builds a handful of programs (:attr:`MixedLengthLoader.shapes`), each once
   (:class:`~hapd.train.parallel_module.ParallelModule` keeps them; the daemon caches
   their plans for later runs).
2. **Rows by predicted cost.** A row of ``R`` tokens costs ``linear·R + quadratic·R²``
   (:class:`LengthCost`: the model's FLOPs per token and per attended token pair,
   counted by ``torch.utils.flop_counter``). Each sequence goes to the shortest row
   length that holds it; a row length whose sequences would fill a last micro-batch
   only partly hands them to the next length when the cost model says that is cheaper.
   Sequences are packed into rows first-fit decreasing: several documents per row,
   positions restarting at each, attention kept inside each
   (:class:`hapd.models.packed.PackedLanguageModel` builds the mask from the positions).
3. **Rows over ranks by speed.** A micro-batch's rows are cut over the ranks as its
   program cuts them (the plan's sharding ratios: a fast rank gets more rows, so more
   tokens); the fullest rows are dealt first so every rank's padding is in proportion,
   and long sequences, one per row, land on different ranks.

The loss is the single-device loss of the step's sequences: every micro-batch's token
mean is weighted by its share of the step's counted tokens (:attr:`MicroBatch.weight`),
so the sum is the token mean over the whole global batch, whatever the split.

Every rank packs every step (the packing is a pure function of the lengths, the seed
and the split) and builds only its own rows.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from hapd.compiler.lengths import sharding_lengths
from hapd.errors import OptionsError

_log = logging.getLogger(__name__)

IGNORE = -100
"""The label of a token whose prediction is not counted (torch's ``ignore_index``)."""

Splitter = Callable[[int, int], Sequence[int]]
"""(rows, row length) → the rows each rank runs of a micro-batch of that shape."""


# -- the cost model ---------------------------------------------------------------------

@dataclass(frozen=True)
class LengthCost:
    """Predicted work of one row of ``R`` tokens: ``linear·R + quadratic·R²`` (FLOPs of
    a forward; a rank's time is that over its speed, the same factor for every shape)."""

    linear: float
    """FLOPs per token (the matmuls of every layer, the embedding and the head)."""
    quadratic: float
    """FLOPs per attended token pair (attention's scores and weighted sum)."""

    def __post_init__(self) -> None:
        if not (self.linear >= 0 and self.quadratic >= 0) or self.linear + self.quadratic <= 0:
            raise OptionsError(f"a length cost needs linear {self.linear} and quadratic {self.quadratic} ≥ 0, "
                               "one of them positive", field="cost")

    def row(self, length: int) -> float:
        """The work of one row of ``length`` tokens (dense attention: every row of that
        length costs the same, however full)."""
        return self.linear * length + self.quadratic * length * length

    def per_token(self, length: int) -> float:
        """The work per token slot of a row of ``length`` tokens."""
        return self.linear + self.quadratic * length

    @classmethod
    def of_model(cls, model: nn.Module, make_inputs: Callable[[int], tuple[Tensor, ...]],
                 lengths: tuple[int, int] = (32, 64)) -> LengthCost:
        """Fitted to ``model``'s forward FLOPs on one row at two lengths
        (``make_inputs(R)``: the inputs of one row of ``R`` tokens), counted by
        :class:`torch.utils.flop_counter.FlopCounterMode` (shapes only: nothing is
        trained, the model's mode is kept)."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.utils.flop_counter import FlopCounterMode

        short, long = lengths
        if not 0 < short < long:
            raise OptionsError(f"fit lengths {lengths} must be 0 < short < long", field="lengths")
        flops = []
        was = model.training
        try:
            model.eval()  # no dropout draws: FLOPs do not depend on them
            for length in lengths:
                counter = FlopCounterMode(display=False)
                # the math kernel: attention as matmuls the counter sees (a fused CPU kernel has no formula)
                with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
                    model(*make_inputs(length))
                flops.append(float(counter.get_total_flops()))
        finally:
            model.train(was)
        # f(R) = a·R + b·R² at two points
        f1, f2 = flops[0] / short, flops[1] / long  # a + b·R
        quadratic = max(0.0, (f2 - f1) / (long - short))
        linear = max(0.0, f1 - quadratic * short)
        return cls(linear=linear, quadratic=quadratic)


# -- shapes -----------------------------------------------------------------------------

def row_lengths(shortest: int, longest: int) -> tuple[int, ...]:
    """The pool's row lengths: ``shortest`` times powers of two, the last the first that
    holds ``longest`` tokens (``shortest=64, longest=300`` → 64, 128, 256, 512)."""
    if shortest < 1:
        raise OptionsError(f"the shortest row length {shortest} must be ≥ 1", field="shortest")
    if longest < 1:
        raise OptionsError(f"the longest sequence has {longest} tokens", field="sequences")
    out = [shortest]
    while out[-1] < longest:
        out.append(out[-1] * 2)
    return tuple(out)


def pack_rows(lengths: Sequence[int], items: Sequence[int], row: int) -> list[list[int]]:
    """``items`` (indices into ``lengths``) packed into rows of ``row`` tokens, first-fit
    decreasing (ties: lower index first); each row lists its items in packing order."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(items, key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > row:
            raise OptionsError(f"sequence {i} has {n} tokens, more than a row of {row}", field="sequences")
        for r, space in enumerate(free):
            if n <= space:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(row - n)
    return rows


@dataclass(frozen=True)
class MicroBatchPacking:
    """One micro-batch of a step: ``rows`` rows of ``length`` tokens, and which sequences
    (indices into the step's) each rank packs into each of its rows."""

    length: int
    rows: int
    ranks: tuple[tuple[tuple[int, ...], ...], ...]
    """Per rank, its rows, each the step-local indices of the sequences it holds."""

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.length)


@dataclass(frozen=True)
class StepPacking:
    """Where a step's sequences go (:func:`pack_step`)."""

    micro_batches: tuple[MicroBatchPacking, ...]
    tokens: int
    """The step's tokens (the sum of its sequences' lengths)."""
    seconds: float = 0.0
    """How long packing it took (building a new shape's program included)."""

    @property
    def slots(self) -> int:
        """Token slots the step runs (its micro-batches' rows times their lengths)."""
        return sum(mb.rows * mb.length for mb in self.micro_batches)

    @property
    def padding(self) -> float:
        """The share of the token slots that are padding."""
        return 1.0 - self.tokens / self.slots if self.slots else 0.0

    def work(self, cost: LengthCost) -> float:
        """The predicted work of the step (every row of every micro-batch)."""
        return sum(mb.rows * cost.row(mb.length) for mb in self.micro_batches)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


def pack_step(lengths: Sequence[int], *, pool: Sequence[int], micro_tokens: int, cost: LengthCost,
              split: Splitter, rows_step: int | None = None) -> StepPacking:
    """Where each of a step's sequences (their ``lengths``) goes: which micro-batch, which
    row, which rank (see the module docstring). ``pool``: the row lengths, ascending;
    ``split(rows, length)``: each rank's rows of a micro-batch of that shape;
    ``rows_step``: a last micro-batch's rows are rounded up to a multiple of it
    (default: half a full micro-batch's rows)."""
    started = time.perf_counter()
    pool = sorted(pool)
    if not lengths:
        raise OptionsError("a step needs at least one sequence", field="sequences")
    if max(lengths) > pool[-1]:
        raise OptionsError(f"a sequence of {max(lengths)} tokens is longer than the longest row {pool[-1]}",
                           field="sequences")
    by_length: dict[int, list[int]] = {r: [] for r in pool}
    for i, n in enumerate(lengths):
        by_length[next(r for r in pool if r >= n)].append(i)
    micro: list[MicroBatchPacking] = []
    carried: list[int] = []
    for k, length in enumerate(pool):
        items = by_length[length] + carried
        carried = []
        if not items:
            continue
        full, step = _rows_per(length, micro_tokens, rows_step)
        rows = pack_rows(lengths, items, length)
        whole, rest = divmod(len(rows), full)
        if rest and k + 1 < len(pool):
            # the last, partly filled micro-batch here, or its sequences in the next length's rows
            up = pool[k + 1]
            last = [i for row in rows[whole * full:] for i in row]
            alone = by_length[up]
            keep = _rounded_rows(rest, full, step) * cost.row(length) + _work(lengths, alone, up, micro_tokens, rows_step, cost)
            move = _work(lengths, alone + last, up, micro_tokens, rows_step, cost)
            if move < keep:
                carried = last
                rows = rows[:whole * full]
        for start in range(0, len(rows), full):
            chunk = rows[start:start + full]
            micro.append(_deal(lengths, chunk, _rounded_rows(len(chunk), full, step), length, split))
    return StepPacking(micro_batches=tuple(micro), tokens=int(sum(lengths)), seconds=time.perf_counter() - started)


def pack_padded(lengths: Sequence[int], *, pool: Sequence[int], micro_tokens: int, split: Splitter,
                rows_step: int | None = None) -> StepPacking:
    """The padded baseline of :func:`pack_step`: one sequence per row, every row as long
    as the pool's first length that holds the step's longest sequence, in micro-batches
    of as many tokens, cut over the ranks alike."""
    started = time.perf_counter()
    if not lengths:
        raise OptionsError("a step needs at least one sequence", field="sequences")
    fits = [r for r in sorted(pool) if r >= max(lengths)]
    if not fits:
        raise OptionsError(f"a sequence of {max(lengths)} tokens is longer than the longest row {max(pool)}",
                           field="sequences")
    length = fits[0]
    full, step = _rows_per(length, micro_tokens, rows_step)
    rows = [[i] for i in range(len(lengths))]
    micro = tuple(_deal(lengths, rows[s:s + full], _rounded_rows(len(rows[s:s + full]), full, step), length, split)
                  for s in range(0, len(rows), full))
    return StepPacking(micro_batches=micro, tokens=int(sum(lengths)), seconds=time.perf_counter() - started)


def _rows_per(length: int, micro_tokens: int, rows_step: int | None) -> tuple[int, int]:
    """(rows of a full micro-batch of this row length, the rounding of a last one's)."""
    full = max(1, micro_tokens // length)
    return full, max(1, min(full, rows_step if rows_step is not None else full // 2))


def _rounded_rows(rows: int, full: int, step: int) -> int:
    """Rows run for ``rows`` filled ones: whole micro-batches, the last rounded up to ``step``."""
    whole, rest = divmod(rows, full)
    return whole * full + (_round_up(rest, step) if rest else 0)


def _work(lengths: Sequence[int], items: Sequence[int], length: int, micro_tokens: int, rows_step: int | None,
          cost: LengthCost) -> float:
    """The work of ``items`` packed into rows of ``length`` and run in micro-batches."""
    if not items:
        return 0.0
    full, step = _rows_per(length, micro_tokens, rows_step)
    return _rounded_rows(len(pack_rows(lengths, items, length)), full, step) * cost.row(length)


def _deal(lengths: Sequence[int], rows: list[list[int]], n: int, length: int, split: Splitter) -> MicroBatchPacking:
    """A micro-batch of ``n`` rows (``rows`` filled, the rest padding) dealt over the
    ranks in the program's split: fullest rows first, each to the rank with the most of
    its share still free, so every rank's real tokens follow its share."""
    shares = [int(s) for s in split(n, length)]
    if sum(shares) != n or any(s < 0 for s in shares):
        raise OptionsError(f"the split {shares} of a micro-batch of {n} rows does not sum to {n}", field="split")
    filled = sorted(rows, key=lambda row: -sum(lengths[i] for i in row))
    filled += [[] for _ in range(n - len(rows))]
    per_rank: list[list[tuple[int, ...]]] = [[] for _ in shares]
    for row in filled:
        r = max((r for r in range(len(shares)) if len(per_rank[r]) < shares[r]),
                key=lambda r: ((shares[r] - len(per_rank[r])) / shares[r], -r))
        per_rank[r].append(tuple(row))
    return MicroBatchPacking(length=length, rows=n, ranks=tuple(tuple(rs) for rs in per_rank))


def even_split(ratios: Sequence[float]) -> Splitter:
    """A :data:`Splitter` that cuts rows in ``ratios`` (largest remainder, as a plan cuts
    its batch), for planning without a module (benchmarks, dry runs)."""
    return lambda rows, _length: sharding_lengths([float(r) for r in ratios], rows)


# -- building a rank's rows ------------------------------------------------------------

def pack_tensors(sequences: Sequence[Tensor], rows: Sequence[Sequence[int]], length: int, *,
                 pad_id: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """``(input_ids, position_ids, labels)``, each ``[len(rows), length]``, of these rows:
    each row's sequences one after another, positions restarting at 0 for each, then
    padding as one more document of ``pad_id`` tokens. ``labels`` are the tokens, with
    :data:`IGNORE` on each document's first token (a causal LM that shifts its labels
    predicts token ``t + 1`` from ``t``: never across two documents) and on padding."""
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    positions = torch.empty((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            seq = sequences[i]
            n = int(seq.numel())
            ids[r, at:at + n] = seq
            positions[r, at:at + n] = torch.arange(n)
            labels[r, at + 1:at + n] = seq[1:]
            at += n
        positions[r, at:] = torch.arange(length - at)
    return ids, positions, labels


def counted(labels: Tensor) -> int:
    """Tokens whose prediction a causal LM that shifts its labels counts."""
    return int((labels[:, 1:] != IGNORE).sum())


# -- the loader -------------------------------------------------------------------------

@dataclass
class MicroBatch:
    """This rank's inputs of one micro-batch, and the weight of its loss in the step's."""

    inputs: tuple[Tensor, ...]
    weight: float
    """The micro-batch's counted tokens over the step's: ``module(*inputs) * weight``
    summed over micro-batches and ranks is the step's token mean."""
    shape: tuple[int, int]
    """(rows, row length) of the global micro-batch."""
    split: tuple[int, ...]
    """Each rank's rows."""
    new_shape: bool = False
    """The first micro-batch of this shape in this run (its program is built for it)."""

    def loss(self, module: Any) -> Tensor:
        """This rank's part of the micro-batch's weighted loss: ``module`` told the global
        shapes and this rank's cut (:meth:`~hapd.train.parallel_module.ParallelModule.expect_batch`),
        then run on the inputs, times :attr:`weight`."""
        module.expect_batch(*[self.shape] * len(self.inputs))  # cut as its program cuts: ``split`` came from it
        return module(*self.inputs) * self.weight


@dataclass
class Step:
    """One training step's micro-batches on this rank."""

    index: int
    micro_batches: list[MicroBatch]
    packing: StepPacking
    """How the step's sequences are packed into micro-batches and rows (all ranks)."""
    tokens: int
    """The step's tokens (all ranks)."""
    counted: int
    """The step's counted tokens (all ranks): the token mean's denominator."""

    @property
    def plan(self) -> StepPacking:
        """The step's packing, under its former name (kept for one release)."""
        return self.packing

    def __iter__(self) -> Iterator[MicroBatch]:
        return iter(self.micro_batches)

    def __len__(self) -> int:
        return len(self.micro_batches)

    def train(self, module: Any) -> float:
        """Forward and backward of every micro-batch (gradients summed over ranks once,
        at the last), and the step's loss: the single-device token mean (collective)."""
        total = None
        last = len(self.micro_batches) - 1
        for k, mb in enumerate(self.micro_batches):
            context = module.no_sync() if k < last else contextlib.nullcontext()
            with context:
                loss = mb.loss(module)
                loss.backward()
            part = loss.detach().to(torch.float64)
            total = part if total is None else total + part
        return module.global_loss(total)


@dataclass
class MixedLengthLoader:
    """This rank's steps of a dataset of token sequences (:func:`mixed_loader`)."""

    sequences: Sequence[Tensor]
    lengths: list[int]
    tokens: int
    pool: tuple[int, ...]
    micro_tokens: int
    cost: LengthCost
    split: Splitter
    rank: int
    module: Any = None
    seed: int = 0
    shuffle: bool = True
    rows_step: int | None = None
    pad_id: int = 0
    device: torch.device | None = None
    packing: str = "packed"
    """``"packed"`` (:func:`pack_step`) or ``"padded"`` (:func:`pack_padded`, the baseline)."""
    epoch: int = 0
    position: int = 0
    """Sequences of the epoch's order handed out."""
    shapes: dict[tuple[int, int], int] = field(default_factory=dict)
    """(rows, row length) → micro-batches run at that shape (the pool's programs)."""
    dispatch_seconds: list[float] = field(default_factory=list)
    """Planning and packing time of each step on this rank (building a new shape's
    program not counted: :attr:`build_seconds`)."""
    build_seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    """(rows, row length) → seconds its program took to build (export, plan, distribute)."""
    _splits: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict, repr=False)

    def split_of(self, rows: int, length: int) -> tuple[int, ...]:
        """Each rank's rows of a micro-batch of that shape (its program's cut; the
        program is built on first need, collectively, and timed)."""
        key = (rows, length)
        if key not in self._splits:
            started = time.perf_counter()
            self._splits[key] = tuple(int(n) for n in self.split(rows, length))
            self.build_seconds[key] = time.perf_counter() - started
        return self._splits[key]

    def order(self) -> list[int]:
        """The epoch's order of the sequences (the same on every rank)."""
        if not self.shuffle:
            return list(range(len(self.lengths)))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.lengths), generator=g).tolist()

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self.epoch, self.position = int(epoch), 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.position, self.seed = int(state["epoch"]), int(state["position"]), int(state["seed"])

    def step_sequences(self, order: Sequence[int], start: int) -> list[int]:
        """The indices of the step that starts at ``start`` of ``order``: sequences in
        order while their tokens fit the budget (at least one)."""
        taken, used = [], 0
        for i in order[start:]:
            n = self.lengths[i]
            if taken and used + n > self.tokens:
                break
            taken.append(i)
            used += n
        return taken

    def __iter__(self) -> Iterator[Step]:
        order = self.order()
        index = 0
        while self.position < len(order):
            started = time.perf_counter()
            built = sum(self.build_seconds.values())
            chosen = self.step_sequences(order, self.position)
            lengths = [self.lengths[i] for i in chosen]
            if self.packing == "padded":
                packing = pack_padded(lengths, pool=self.pool, micro_tokens=self.micro_tokens, split=self.split_of,
                                      rows_step=self.rows_step)
            else:
                packing = pack_step(lengths, pool=self.pool, micro_tokens=self.micro_tokens, cost=self.cost,
                                    split=self.split_of, rows_step=self.rows_step)
            micro, counts = [], []
            for mb in packing.micro_batches:
                rows = [[chosen[i] for i in row] for row in mb.ranks[self.rank]]
                ids, positions, labels = pack_tensors(self.sequences, rows, mb.length, pad_id=self.pad_id)
                counts.append(sum(self.lengths[chosen[i]] - 1 for rs in mb.ranks for row in rs for i in row))
                inputs = (ids, positions, labels)
                if self.device is not None:
                    inputs = tuple(t.to(self.device, non_blocking=True) for t in inputs)
                new = mb.shape not in self.shapes
                self.shapes[mb.shape] = self.shapes.get(mb.shape, 0) + 1
                if new and self.rank == 0:
                    _log.info("mixed-length: step %d runs a new shape, %d rows × %d tokens (program %d of this run)",
                              index, *mb.shape, len(self.shapes))
                micro.append(MicroBatch(inputs=inputs, weight=0.0, shape=mb.shape,
                                        split=tuple(len(rs) for rs in mb.ranks), new_shape=new))
            total = sum(counts)
            for mb, n in zip(micro, counts):
                mb.weight = n / total if total else 0.0
            self.dispatch_seconds.append(time.perf_counter() - started - (sum(self.build_seconds.values()) - built))
            self.position += len(chosen)
            yield Step(index=index, micro_batches=micro, packing=packing, tokens=packing.tokens, counted=total)
            index += 1


def mixed_loader(sequences: Sequence[Tensor], module: Any, *, tokens: int, shortest: int = 64,
                 longest: int | None = None, cost: LengthCost | None = None, seed: int = 0, shuffle: bool = True,
                 rows_step: int | None = None, pad_id: int = 0, packing: str = "packed",
                 device: torch.device | str | None = "auto") -> MixedLengthLoader:
    """This rank's steps of ``sequences`` (1-D token tensors of any lengths) for
    ``module``, a :class:`~hapd.train.parallel_module.ParallelModule` of a model whose
    forward takes ``(input_ids, position_ids, labels)`` rows, such as
    :class:`hapd.models.packed.PackedLanguageModel` (see the module docstring).

    ``tokens``: each step's token budget (sequences are drawn until the next would pass
    it). ``shortest``: the shortest row length; the others are it times powers of two up
    to ``longest`` (default: the longest sequence). A micro-batch holds as many tokens
    as the module's example batch (its rows times its row length). ``cost``: the
    length cost model (default: counted on the module's model, :meth:`LengthCost.of_model`).
    ``device``: where batches go (``"auto"``: where the module's parameters are).
    ``packing``: ``"packed"``, or ``"padded"`` (one sequence per row, every row of a
    step padded to its longest: the baseline, to measure against).
    Building a shape's program is collective: every rank iterates the loader alike."""
    if packing not in ("packed", "padded"):
        raise OptionsError(f"packing {packing!r} is not 'packed' or 'padded'", field="packing")
    if not callable(getattr(module, "expect_batch", None)) or not callable(getattr(module, "global_shapes", None)):
        raise OptionsError(f"mixed_loader takes the ParallelModule hapd.parallelize returned, not a "
                           f"{type(module).__name__}", field="module")
    lengths = _sequence_lengths(sequences)
    if tokens < 1:
        raise OptionsError(f"token budget {tokens} must be ≥ 1", field="tokens")
    rows, row = _row_shape(module)
    longest = max(lengths) if longest is None else int(longest)
    if max(lengths) > longest:
        too_long = lengths.index(max(lengths))
        raise OptionsError(f"sequence {too_long} has {lengths[too_long]} tokens, more than longest={longest}: "
                           "hapd does not cut sequences (split them before loading)", field="sequences")
    pool = row_lengths(shortest, longest)
    if cost is None:
        cost = _model_cost(module, pad_id)

    def split(n: int, length: int) -> Sequence[int]:
        got = module.sample_lengths(shapes=((n, length),) * 3)
        if got is None:
            raise OptionsError(f"the program for {n} rows of {length} tokens does not split the rows over the ranks "
                               "(mixed-length loading needs the plan to cut the batch dim)", field="module")
        return got

    if device == "auto":
        device = next((p.device for p in module.parameters()), None)
    return MixedLengthLoader(sequences=sequences, lengths=lengths, tokens=int(tokens), pool=pool,
                             micro_tokens=rows * row, cost=cost, split=split, rank=module.rank, module=module,
                             seed=seed, shuffle=shuffle, rows_step=rows_step, pad_id=pad_id, packing=packing,
                             device=torch.device(device) if device is not None else None)


def _sequence_lengths(sequences: Sequence[Tensor]) -> list[int]:
    """Each sequence's token count; :class:`OptionsError` for one that is not a non-empty 1-D tensor, or none."""
    lengths = []
    for i, seq in enumerate(sequences):
        if not isinstance(seq, Tensor) or seq.dim() != 1 or seq.numel() < 1:
            raise OptionsError(f"sequence {i} must be a non-empty 1-D tensor of token ids, not "
                               f"{getattr(seq, 'shape', type(seq).__name__)}", field="sequences")
        lengths.append(int(seq.numel()))
    if not lengths:
        raise OptionsError("no sequences to load", field="sequences")
    return lengths


def _row_shape(module: Any) -> tuple[int, int]:
    """The module's example batch as (rows, row length); it must take (input_ids, position_ids, labels) rows."""
    shapes = module.global_shapes()
    if len(shapes) != 3 or any(len(s) != 2 for s in shapes):
        raise OptionsError(f"mixed_loader feeds (input_ids, position_ids, labels) rows; the module takes inputs of "
                           f"shapes {shapes}", field="module")
    rows, row = shapes[0]
    return rows, row


def _model_cost(module: Any, pad_id: int) -> LengthCost:
    """The length cost model counted on the module's model (:meth:`LengthCost.of_model`)."""
    recipe = getattr(module, "_recipe", None)
    if recipe is None:
        raise OptionsError("no cost model: pass cost=LengthCost(...) (the module has no model to count)",
                           field="cost")
    return LengthCost.of_model(recipe.model, lambda n: one_row(n, pad_id))


def one_row(length: int, pad_id: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """The inputs of one row holding one document of ``length`` tokens."""
    ids = torch.full((1, length), pad_id, dtype=torch.long)
    return pack_tensors([ids[0]], [[0]], length, pad_id=pad_id)


__all__ = ["IGNORE", "LengthCost", "MicroBatch", "MicroBatchPacking", "MixedLengthLoader", "Step", "StepPacking",
           "counted", "even_split", "mixed_loader", "one_row", "pack_rows", "pack_tensors", "pack_padded", "pack_step",
           "row_lengths"]
