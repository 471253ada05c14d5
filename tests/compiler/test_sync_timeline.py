"""The gradient sync's buckets on the backward's timeline (hapd.compiler.sync_timeline)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from hapd.compiler.search import DDP_BUCKETS
from hapd.compiler.sync_timeline import BucketSizes, SyncedGradient, schedule

MIB = 1024.0 * 1024.0
BACKWARD = [1.0, 1.0, 1.0, 1.0]  # forward order: backward runs step 3 first, step 0 last


def grads() -> list[SyncedGradient]:
    """Three 1 MiB gradients of 0.5 s each, first read by steps 3, 1 and 0: backward
    finishes them 1, 3 and 4 s in."""
    return [SyncedGradient(first_step=s, seconds=0.5, nbytes=MIB) for s in (0, 1, 3)]


def test_a_bucket_per_gradient_hides_all_but_the_last_one_after_backward():
    sync = schedule(BACKWARD, grads(), BucketSizes(rest=MIB))
    # [1, 1.5], [3, 3.5], [4, 4.5]: half a second after backward's 4 s
    assert sync.total == pytest.approx(1.5)
    assert sync.exposed == pytest.approx(0.5)
    assert sync.hideable == pytest.approx(1.0)


def test_one_bucket_waits_for_backwards_last_gradient_and_hides_nothing():
    sync = schedule(BACKWARD, grads(), BucketSizes(rest=4 * MIB))
    assert sync.exposed == pytest.approx(1.5)
    assert sync.hideable == 0.0


def test_ddps_small_first_bucket_starts_early():
    sync = schedule(BACKWARD, grads(), BucketSizes(first=MIB, rest=25 * MIB))
    # [1, 1.5] alone, then the other two once the last exists: [4, 5]
    assert sync.exposed == pytest.approx(1.0)
    assert sync.hideable == pytest.approx(0.5)


def test_a_latency_per_bucket_and_a_busy_link_delay_the_next_bucket():
    sync = schedule([0.5, 0.5], [SyncedGradient(first_step=1, seconds=2.0, nbytes=MIB),
                                 SyncedGradient(first_step=0, seconds=0.5, nbytes=MIB)],
                    BucketSizes(rest=MIB), latency=0.25)
    # the first bucket [0.5, 2.75]; the second, ready at 1, waits for the link: [2.75, 3.5]
    assert sync.total == pytest.approx(3.0)
    assert sync.exposed == pytest.approx(2.5)
    assert sync.hideable == pytest.approx(0.5)


def test_ddp_buckets_are_torchs_defaults():
    first = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", None)
    if first is None:
        pytest.skip("this torch does not name DDP's first bucket size")
    assert DDP_BUCKETS.first == first
    assert DDP_BUCKETS.rest == 25 * MIB  # DistributedDataParallel's bucket_cap_mb default
