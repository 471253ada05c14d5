"""How much of the gradient sync the backward pass can hide: its buckets on a timeline.

A data-parallel step sums the replicated parameters' gradients in buckets launched while
backward still runs (:class:`hapd.spmd.gradsync.GradSync`; DDP does the same with its own
bucket sizes). What can hide behind backward is bounded by *when* each bucket is ready,
not only by how long backward lasts: backward produces the gradients in reverse order of
first use, so the embeddings — used first, often a fifth of a small language model's
parameters — are ready only when backward ends, and their bucket's sum is exposed
whatever the rest does. ``min(S, B)`` (the sync or the backward, whichever is shorter)
counted every second of backward as available and over-credited such models: at 2:1 on
the emulated cluster it priced GPT-2's step 14–17% short of the measurement.

The timeline (:func:`hideable`): backward runs the steps in reverse, each for its
backward share of the slowest device's compute; a gradient is ready when backward has
finished the first step that uses it; the gradients are packed into buckets in that
order, as the runtime packs them; a bucket's sum starts when it is ready and the one
before it has finished (one link, the buckets in order), and lasts its gradients' sync
seconds. What ends after backward is exposed; the rest of the sync could hide. The
profile's ``sync_overlap`` (η, how much of a sum the devices really hide when compute and
communication share them) then scales that: hidden = η · (S − exposed).

Written by hand: neither torch nor any profiler library prices a bucket schedule from a
program's cost rows; it is a few lines over the rows the core already gives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class SyncedGradient:
    """One replicated parameter's gradient as the sync sees it."""

    first_step: int
    """Index of the first step (in forward order) that reads the parameter: backward
    finishes its gradient when it has run back to that step."""
    seconds: float
    """Its share of the sync: the slowest device's seconds of its rows."""
    nbytes: float
    """Its gradient's bytes (what fills a bucket)."""


@dataclass(frozen=True)
class BucketSizes:
    """How a sync packs gradients into buckets: ``first`` bytes for the first bucket
    (DDP's is smaller, so that the first sum starts early), ``rest`` for the others."""

    rest: float
    first: float | None = None

    def cap(self, index: int) -> float:
        """The capacity of bucket ``index``."""
        return self.first if index == 0 and self.first is not None else self.rest


@dataclass(frozen=True)
class SyncSchedule:
    """The sync's buckets laid on the backward's timeline."""

    total: float
    """Seconds of every bucket's sum, one after another."""
    exposed: float
    """Seconds of it that end after backward does."""

    @property
    def hideable(self) -> float:
        """What of the sync could hide behind backward."""
        return max(0.0, self.total - self.exposed)


def schedule(backward: Sequence[float], synced: Sequence[SyncedGradient], buckets: BucketSizes,
             latency: float = 0.0) -> SyncSchedule:
    """The sync of ``synced`` behind a backward pass of per-step seconds ``backward``
    (forward order; backward runs them last to first): the gradients packed into
    ``buckets`` in the order backward produces them, each bucket summed from when all its
    gradients exist and the bucket before it has finished, for its gradients' seconds
    plus ``latency``."""
    total_backward = sum(backward)
    done_at = [0.0] * len(backward)  # when backward has finished each step
    elapsed = 0.0
    for i in range(len(backward) - 1, -1, -1):
        elapsed += backward[i]
        done_at[i] = elapsed
    order = sorted(synced, key=lambda g: g.first_step, reverse=True)  # the order backward produces them
    link_free, total = 0.0, 0.0
    bucket_ready, bucket_seconds, filled, index = 0.0, 0.0, None, 0
    for grad in order:
        if filled is not None and filled + grad.nbytes > buckets.cap(index):
            link_free = max(link_free, bucket_ready) + bucket_seconds + latency
            total += bucket_seconds + latency
            bucket_ready, bucket_seconds, filled, index = 0.0, 0.0, None, index + 1
        ready = done_at[grad.first_step] if 0 <= grad.first_step < len(done_at) else total_backward
        bucket_ready = max(bucket_ready, ready)
        bucket_seconds += grad.seconds
        filled = (filled or 0.0) + grad.nbytes
    if filled is not None:
        link_free = max(link_free, bucket_ready) + bucket_seconds + latency
        total += bucket_seconds + latency
    return SyncSchedule(total=total, exposed=max(0.0, link_free - total_backward))


def hideable(backward: Sequence[float], synced: Sequence[SyncedGradient], buckets: BucketSizes) -> float:
    """Seconds of the sync of ``synced`` that could hide behind a backward pass of
    per-step seconds ``backward`` (:func:`schedule`): its total less what ends after
    backward does."""
    return schedule(backward, synced, buckets).hideable
