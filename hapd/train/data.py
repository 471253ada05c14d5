"""Uneven data loading: each rank reads only its share of every global batch.

A plan splits the global batch of ``B`` samples into per-rank lengths
``lengths[0] + … + lengths[world-1] = B`` (uneven on a mixed cluster).
:class:`UnevenBatchSampler` yields, for one rank, the indices of its contiguous share of
each global batch of a shuffled epoch, so the pieces the ranks read are exactly what
:meth:`hapd.spmd.rank.RankModule.shard_inputs` would cut from the collated global
batch::

    sampler = hapd.UnevenBatchSampler(len(dataset), lengths=[3, 1], rank=rank, seed=0)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for indices in sampler: ...          # this rank's indices of one global batch

The epoch's order is ``torch.randperm`` seeded with ``seed + epoch`` (the same on
every rank, so the ranks' shares partition it): every sample is read exactly once per
epoch across ranks. The last ``len(dataset) % B`` samples form a short batch, dropped
with ``drop_last``, else split in the ``tail`` lengths given (:func:`loader` gives those
of the module's program for that batch) or by the same ratios (largest remainder).
:class:`UnevenSampler` is the flat-index form (like ``DistributedSampler``), and
:func:`loader` gives a rank the ``DataLoader`` of a :class:`~hapd.train.parallel_module.ParallelModule`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data._utils.collate import default_collate

from hapd.compiler.lengths import sharding_lengths
from hapd.errors import OptionsError


def _size_of(data: Any) -> int:
    return data if isinstance(data, int) else len(data)


def tail_lengths(lengths: Sequence[int], tail: int) -> list[int]:
    """``tail`` samples split in the ratios of ``lengths`` (largest remainder, ties to
    the lower rank, as the plan splits its batch)."""
    return sharding_lengths([float(n) for n in lengths], tail)


class UnevenBatchSampler(Sampler[list[int]]):
    """One rank's indices of every global batch of an epoch (see the module docstring).

    ``data``: the dataset or its size. ``lengths``: every rank's samples per global
    batch (the plan's split; :meth:`~hapd.train.parallel_module.ParallelModule.sample_lengths`).
    ``start_batch`` / :meth:`load_state_dict` skip the batches an interrupted epoch has
    already read (resuming mid-epoch). :meth:`state_dict` says where it is: the epoch
    and the global batches of it handed out (``position``), which no world size or
    split changes, so a checkpoint resumes on another plan. ``tail``: every rank's
    samples of the short last batch (they sum to ``len(data) % sum(lengths)``; default
    :func:`tail_lengths`).
    """

    def __init__(self, data: Dataset | Sequence | int, lengths: Sequence[int], rank: int, *, shuffle: bool = True,
                 seed: int = 0, drop_last: bool = False, tail: Sequence[int] | None = None):
        self.size = _size_of(data)
        self.lengths = [int(n) for n in lengths]
        if not self.lengths or any(n < 0 for n in self.lengths) or sum(self.lengths) < 1:
            raise OptionsError(f"lengths {self.lengths} must be ≥ 0 with a positive sum", field="lengths")
        if not 0 <= rank < len(self.lengths):
            raise OptionsError(f"rank {rank} is not in 0..{len(self.lengths) - 1}", field="rank")
        if self.size < 0:
            raise OptionsError(f"dataset size {self.size} is negative", field="data")
        short = self.size % sum(self.lengths)
        self.tail = tail_lengths(self.lengths, short) if tail is None else [int(n) for n in tail]
        if len(self.tail) != len(self.lengths) or any(n < 0 for n in self.tail) or sum(self.tail) != short:
            raise OptionsError(f"tail {self.tail} must be {len(self.lengths)} lengths ≥ 0 summing to the short last "
                               f"batch's {short} samples", field="tail")
        self.rank, self.shuffle, self.seed, self.drop_last = rank, shuffle, int(seed), drop_last
        self.epoch = 0
        self.start_batch = 0
        self.position = 0
        """Global batches of ``epoch`` handed out (the skipped ones included)."""

    @property
    def global_batch(self) -> int:
        return sum(self.lengths)

    def set_epoch(self, epoch: int) -> None:
        """Use epoch ``epoch``'s order from the next iteration on: from its first batch,
        or, when ``epoch`` is the epoch already set (a loaded state's), from where that
        state stopped — so ``set_epoch`` at the top of an epoch loop keeps a resume."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.start_batch = self.position = 0

    def state_dict(self) -> dict[str, int]:
        """Where to resume: the epoch and the global batches of it handed out."""
        return {"epoch": self.epoch, "start_batch": self.position, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume where :meth:`state_dict` was taken: the next iteration starts at batch
        ``start_batch`` of epoch ``epoch``."""
        self.epoch, self.start_batch, self.seed = int(state["epoch"]), int(state["start_batch"]), int(state["seed"])
        self.position = self.start_batch

    def order(self, epoch: int | None = None) -> Tensor:
        """The epoch's sample order (the same on every rank)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            return torch.arange(self.size)
        return torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + epoch))

    def batch_lengths(self) -> list[list[int]]:
        """Every rank's lengths of each batch of an epoch (the last may be short)."""
        full, tail = divmod(self.size, self.global_batch)
        out = [list(self.lengths)] * full
        if tail and not self.drop_last:
            out.append(list(self.tail))
        return out

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order().tolist()
        self.position = self.start_batch
        for b, lengths in enumerate(self.batch_lengths()):
            if b < self.start_batch:
                continue
            start = b * self.global_batch + sum(lengths[: self.rank])
            self.position = b + 1  # before the yield: the batch is handed out once it is taken
            yield order[start : start + lengths[self.rank]]

    def __len__(self) -> int:
        return max(0, len(self.batch_lengths()) - self.start_batch)


class UnevenSampler(Sampler[int]):
    """The flat indices of :class:`UnevenBatchSampler` (this rank's samples of each
    global batch in turn), for ``DataLoader(sampler=…, batch_size=lengths[rank])``
    when there is no short last batch."""

    def __init__(self, data: Dataset | Sequence | int, lengths: Sequence[int], rank: int, **kwargs: Any):
        self.batches = UnevenBatchSampler(data, lengths, rank, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        return self.batches.state_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.batches.load_state_dict(state)

    def __iter__(self) -> Iterator[int]:
        for batch in self.batches:
            yield from batch

    def __len__(self) -> int:
        b = self.batches
        return sum(lengths[b.rank] for lengths in b.batch_lengths()[b.start_batch :])


class _Collate:
    """``collate_fn`` that also collates an empty share (a rank of length 0): one sample,
    collated, then cut to zero rows."""

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list], Any]):
        self.dataset, self.collate_fn = dataset, collate_fn

    def __call__(self, samples: list) -> Any:
        if samples:
            return self.collate_fn(samples)
        return _narrow_empty(self.collate_fn([self.dataset[0]]))


def _narrow_empty(batch: Any) -> Any:
    if isinstance(batch, Tensor):
        return batch[:0]
    if isinstance(batch, (list, tuple)):
        return type(batch)(_narrow_empty(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _narrow_empty(v) for k, v in batch.items()}
    return batch


class RankLoader:
    """A rank's batches for a :class:`~hapd.train.parallel_module.ParallelModule`: each item is
    the tuple of this rank's forward inputs of one global batch. Its
    :meth:`state_dict` counts the batches the training loop took (a ``DataLoader``
    with workers reads its sampler ahead), for :func:`hapd.save_checkpoint`."""

    def __init__(self, loader: DataLoader, sampler: UnevenBatchSampler, module: Any, split: bool,
                 device: torch.device | None):
        self.loader, self.sampler, self.module, self.split, self.device = loader, sampler, module, split, device
        self.position = sampler.position
        """Global batches of the epoch handed out (the skipped ones included)."""

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)
        self.position = self.sampler.position

    def state_dict(self) -> dict[str, int]:
        """The sampler's state, at the batches this loader handed out."""
        return {**self.sampler.state_dict(), "start_batch": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
        self.position = self.sampler.position

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[tuple[Tensor, ...]]:
        self.position = self.sampler.start_batch
        lengths = self.sampler.batch_lengths()
        keys = getattr(self.module, "keywords", None)
        for batch in self.loader:
            inputs = _in_order(batch, keys)
            if self.device is not None:
                inputs = tuple(t.to(self.device, non_blocking=True) for t in inputs)
            if self.split:  # the module's next forward: the program for this batch's size, cut in these lengths
                split = lengths[self.position]
                self.module.expect_batch(*[(sum(split), *t.shape[1:]) for t in inputs], lengths=split)
            else:
                inputs = self.module.shard_inputs(*inputs)
            took = getattr(self.module, "took_batch", None)
            if took is not None:  # the ranks' forwards are checked to take the same batch
                took(self.sampler.epoch, self.position)
            self.position += 1
            yield dict(zip(keys, inputs)) if isinstance(batch, Mapping) else inputs


def _in_order(batch: Any, keys: Sequence[str] | None) -> tuple[Tensor, ...]:
    """A collated batch's tensors in forward order: a tuple's in its order, a dict's in
    the order of the dict batch the module was made for (``keys``);
    :class:`~hapd.errors.OptionsError` naming a dict's keys the module does not take
    (or a dict for a module made for a tuple batch), or a value that is not a tensor."""
    if isinstance(batch, Mapping):
        if keys is None:
            raise OptionsError(f"the dataset's samples are dicts (keys {', '.join(map(str, batch))}), the module was "
                               "made for a tuple batch: parallelize it with a dict example batch (module(**batch))",
                               field="dataset")
        if set(batch) != set(keys):
            raise OptionsError(f"the dataset's samples have keys {', '.join(map(str, batch))}, the module takes "
                               f"{', '.join(keys)} (the example batch's): drop or add those columns", field="dataset")
        inputs = tuple(batch[k] for k in keys)
        names = list(keys)
    else:
        inputs = tuple(batch) if isinstance(batch, (list, tuple)) else (batch,)
        names = [str(k) for k in range(len(inputs))]
    for name, value in zip(names, inputs):
        if not isinstance(value, Tensor):
            raise OptionsError(f"the batch's input {name} is a {type(value).__name__}, not a tensor (the loader "
                               "collates tensors: drop other columns)", field="dataset")
    return inputs


def loader(dataset: Dataset, module: Any, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
           collate_fn: Callable[[list], Any] | None = None, device: torch.device | str | None = "auto",
           **dataloader_kwargs: Any) -> RankLoader:
    """This rank's loader of ``dataset`` for ``module`` (a ParallelModule): batches of the
    global size the plan was compiled for, of which this rank reads only its samples when
    the plan splits every input along dim 0 (else it reads whole batches and keeps its
    pieces). A sample is a tuple of tensors in forward order (collated along dim 0), or
    a dict of tensors for a module made from a dict batch: each batch is then the dict
    of this rank's pieces, for ``module(**batch)``.
    ``device``: where batches go (``"auto"``: where the module's parameters are).

    The last ``len(dataset) % batch`` samples are a short last batch (``drop_last``
    drops it): the module runs it with the program for its size, which splits it in
    its own per-rank lengths; the loader asks the module for them here, so with a short
    last batch this call is collective (every rank makes its loader), and a program
    that needs the short batch whole on every rank while the others are split is an
    :class:`~hapd.errors.OptionsError`. The batches are cut as the program of the
    module's mode at this call cuts them.

    Token sequences of different lengths: :func:`hapd.mixed_loader` packs them into
    rows from a pool of shapes instead (:mod:`hapd.train.mixed_length`).
    """
    if not callable(getattr(module, "global_shapes", None)) or not callable(getattr(module, "sample_lengths", None)):
        raise OptionsError(f"loader takes the ParallelModule hapd.parallelize returned, not a {type(module).__name__}",
                           field="module")
    shapes = module.global_shapes()
    if not shapes or not shapes[0]:
        raise OptionsError("the module's first input has no batch dim to load along", field="module")
    batch = shapes[0][0]
    if len(dataset) == 0 or (drop_last and len(dataset) < batch):
        raise OptionsError(f"the dataset has {len(dataset)} samples: no batch of {batch} to load"
                           + (" (drop_last drops the only, short one)" if len(dataset) else ""), field="dataset")
    lengths = module.sample_lengths(batch)
    short = 0 if drop_last else len(dataset) % batch
    tail = module.sample_lengths(short) if short else None
    split = lengths is not None
    if lengths is None:  # every rank reads whole batches, in the same order
        lengths, rank, tail = [batch], 0, None
    else:
        rank = module.rank
        if short and tail is None:
            raise OptionsError(f"{len(dataset)} samples leave a short last batch of {short}, which the module's program "
                               f"for it needs whole on every rank while it splits the batches of {batch}: pass "
                               "drop_last=True", field="drop_last")
    sampler = UnevenBatchSampler(dataset, lengths, rank, shuffle=shuffle, seed=seed, drop_last=drop_last, tail=tail)
    data = DataLoader(dataset, batch_sampler=sampler, collate_fn=_Collate(dataset, collate_fn or default_collate),
                      **dataloader_kwargs)
    if device == "auto":
        device = next((p.device for p in module.parameters()), None)
    return RankLoader(data, sampler, module, split, torch.device(device) if device is not None else None)


__all__ = ["RankLoader", "UnevenBatchSampler", "UnevenSampler", "loader", "tail_lengths"]
