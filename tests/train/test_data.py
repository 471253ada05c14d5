"""The uneven sampler and loader: every sample exactly once per epoch across ranks.

Property tests (hypothesis) over dataset sizes, global batches, uneven lengths (zeros
allowed) and 1–5 ranks; then the loader of a parallelized mlp on 2 Gloo ranks (3:1):
each rank's batches are exactly ``shard_inputs`` of the global batch, the short last
one included (cut as the program for its size cuts it).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from _dist import run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

import hapd
from hapd import models
from hapd.errors import OptionsError
from hapd.train.data import UnevenBatchSampler, UnevenSampler, tail_lengths


@st.composite
def setups(draw):
    world = draw(st.integers(1, 5))
    lengths = draw(st.lists(st.integers(0, 6), min_size=world, max_size=world).filter(lambda ls: sum(ls) > 0))
    size = draw(st.integers(0, 60))
    return size, lengths, draw(st.booleans()), draw(st.integers(0, 3)), draw(st.booleans())


def _epoch(size, lengths, drop_last, epoch, shuffle):
    """Every rank's batches of one epoch."""
    per_rank = []
    for rank in range(len(lengths)):
        sampler = UnevenBatchSampler(size, lengths, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    return per_rank


@settings(max_examples=300, deadline=None)
@given(setups())
def test_every_sample_once_per_epoch_and_each_rank_reads_its_length(setup):
    size, lengths, drop_last, epoch, shuffle = setup
    per_rank = _epoch(size, lengths, drop_last, epoch, shuffle)
    batch = sum(lengths)
    full, tail = divmod(size, batch)
    counts = Counter(i for batches in per_rank for b in batches for i in b)
    read = set(counts)
    assert all(c == 1 for c in counts.values())  # no sample twice
    assert read <= set(range(size))
    if drop_last or tail == 0:
        assert len(read) == full * batch  # the dropped tail only is missing
    else:
        assert read == set(range(size))
    for rank, batches in enumerate(per_rank):
        assert len(batches) == full + (1 if tail and not drop_last else 0)
        assert all(len(b) == lengths[rank] for b in batches[:full])
        if len(batches) > full:
            assert len(batches[-1]) == tail_lengths(lengths, tail)[rank]
    # a global batch is the ranks' shares in rank order: the same contiguous slice of the order
    if size and shuffle is False:
        for b in range(full):
            assert [i for batches in per_rank for i in batches[b]] == list(range(b * batch, (b + 1) * batch))


@settings(max_examples=100, deadline=None)
@given(setups())
def test_flat_sampler_and_lengths_agree(setup):
    size, lengths, drop_last, epoch, shuffle = setup
    for rank in range(len(lengths)):
        flat = UnevenSampler(size, lengths, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        flat.set_epoch(epoch)
        batches = UnevenBatchSampler(size, lengths, rank, shuffle=shuffle, seed=7, drop_last=drop_last)
        batches.set_epoch(epoch)
        assert list(flat) == [i for b in batches for i in b] and len(flat) == sum(map(len, batches))
        assert len(batches) == len(list(batches))


def test_shuffle_is_deterministic_per_epoch_and_differs_between_epochs():
    a = UnevenBatchSampler(40, [3, 1], 0, seed=3)
    b = UnevenBatchSampler(40, [3, 1], 0, seed=3)
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    a.load_state_dict({"epoch": 0, "start_batch": 4, "seed": 3})
    assert list(a) == first[4:] and len(a) == len(first) - 4


def test_bad_arguments_are_errors():
    with pytest.raises(OptionsError):
        UnevenBatchSampler(10, [0, 0], 0)
    with pytest.raises(OptionsError):
        UnevenBatchSampler(10, [1, 2], 2)
    with pytest.raises(OptionsError):
        UnevenBatchSampler(10, [1, -1], 0)


def test_the_loader_refuses_an_empty_dataset_and_a_plain_module():
    model, config = models.build("mlp")
    batch = models.get("mlp").example_inputs(config, 4)
    module = hapd.parallelize(model, batch, use_daemon=False, verbose=False)
    empty = TensorDataset(batch[0][:0], batch[1][:0])
    with pytest.raises(OptionsError, match="has 0 samples"):
        hapd.loader(empty, module)
    with pytest.raises(OptionsError, match="drop_last drops the only"):
        hapd.loader(TensorDataset(batch[0][:2], batch[1][:2]), module, drop_last=True)
    with pytest.raises(OptionsError, match="not a Sequential|not a .*Module|ParallelModule"):
        hapd.loader(TensorDataset(*batch), torch.nn.Linear(2, 2))


def test_works_in_a_torch_data_loader():
    data = TensorDataset(torch.arange(20.0))
    loader = DataLoader(data, batch_sampler=UnevenBatchSampler(data, [2, 3], 1, seed=0, drop_last=True))
    got = [t[0].tolist() for t in loader]
    assert len(got) == 4 and all(len(b) == 3 for b in got)


# ----------------------------------------------------------------------------- on 2 ranks


def _loader_batches(rank: int, world: int, options: dict) -> dict:
    model, config = models.build("mlp")
    x, y = models.get("mlp").example_inputs(config, 8 * 5 + 3)
    dataset = TensorDataset(x, y)
    module = hapd.parallelize(model, (x[:8], y[:8]), options=options, use_daemon=False, verbose=False)
    counts, lasts = {}, {}
    same = True
    for drop_last in (False, True):
        loader = hapd.loader(dataset, module, seed=5, drop_last=drop_last)
        loader.set_epoch(2)
        order = loader.sampler.order(2)
        counts[drop_last] = 0
        for b, local in enumerate(loader):
            idx = order[b * 8:(b + 1) * 8]  # the last: the short batch of 3
            expected = module.shard_inputs(x[idx], y[idx])
            same = same and all(torch.equal(g, e) for g, e in zip(local, expected))
            counts[drop_last] += 1
        lasts[drop_last] = loader.sampler.batch_lengths()[-1]
    return {"same": same, "counts": counts, "lengths": module.sample_lengths(), "split": loader.split,
            "tail": lasts[False], "tail_plan": module.sample_lengths(3)}


@pytest.mark.distributed
def test_the_loader_gives_each_rank_its_share_of_every_global_batch():
    data_parallel = run_ranks(2, _loader_batches, {"ratios": (0.75, 0.25), "mode": "data_parallel"})
    assert [r["lengths"] for r in data_parallel] == [[6, 2], [6, 2]] and all(r["split"] for r in data_parallel)
    split = run_ranks(2, _loader_batches, {"ratios": (0.75, 0.25), "force": {"linear": "column-parallel"}})
    for r in data_parallel + split:
        assert r["same"] and r["counts"] == {False: 6, True: 5}  # the short last batch of 3, unless dropped
        if r["split"]:  # each rank reads its share of the short batch, as its own program splits it
            assert sum(r["tail"]) == 3 and r["tail"] == r["tail_plan"]
        else:  # every rank reads it whole and cuts its pieces
            assert r["tail"] == [3] and r["tail_plan"] is None
