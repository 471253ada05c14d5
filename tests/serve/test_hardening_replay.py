"""Issue 17, item 5: the replay memory. A key holder whose clock runs 50 s fast (inside
the 60 s window) sends more signed pings than the memory holds; senders with a correct
clock must not be locked out, and no replay may get through. On the Session and its
ReplayMemory directly, with an injected clock (no sockets, bounded counts)."""

from __future__ import annotations

import pytest

from hapd.errors import AuthError
from hapd.wire.protocol import Limits, ReplayMemory, Session

KEY = b"k" * 32
SEEN = 512
"""The daemon's replay memory in these tests (the default holds 65536)."""
FLOOD = SEEN + 200
"""Pings from the fast sender: more than the memory holds."""
FAST_S = 50.0
"""How far the fast sender's clock runs ahead (the window is 60 s)."""
STEP_S = 0.001
"""Daemon time between two messages."""


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _daemon(clock: Clock) -> Session:
    return Session(KEY, clock=clock, limits=Limits(seen_ids=SEEN))


def test_a_fast_clock_does_not_lock_out_correct_senders():
    clock = Clock()
    daemon = _daemon(clock)
    fast = Session(KEY, clock=lambda: clock.now + FAST_S)
    good, behind = Session(KEY, clock=clock), Session(KEY, clock=lambda: clock.now - 0.5)
    fast_sent = []
    for _ in range(FLOOD):
        _, frames = fast.encode("ping")
        daemon.decode(frames)
        fast_sent.append(frames)
        clock.now += STEP_S
    # correct senders, one half a second behind, interleaved with more of the flood
    for _ in range(SEEN):
        for sender in (good, behind, fast):
            assert daemon.decode(sender.encode("ping")[1]).type == "ping"
        clock.now += STEP_S
    # and no replay of anything, remembered or forgotten, gets through
    for frames in fast_sent[:5] + fast_sent[-5:]:
        with pytest.raises(AuthError):
            daemon.decode(frames)


def test_a_forgotten_correct_message_is_still_refused():
    clock = Clock()
    daemon = _daemon(clock)
    good = Session(KEY, clock=clock)
    fast = Session(KEY, clock=lambda: clock.now + FAST_S)
    _, first = good.encode("ping")
    daemon.decode(first)
    for _ in range(FLOOD):  # pushes the good sender's id out of the memory
        daemon.decode(fast.encode("ping")[1])
        clock.now += STEP_S
    assert len(daemon.replays) == SEEN
    with pytest.raises(AuthError, match="older than the replay memory reaches"):
        daemon.decode(first)
    assert daemon.decode(good.encode("ping")[1]).type == "ping"  # its next message is fine


def test_the_memory_forgets_what_the_window_refuses_anyway():
    memory = ReplayMemory(capacity=8, window_s=60.0)
    for i in range(8):
        memory.remember(f"{i:032x}", 100.0 + i, "s", now=100.0 + i)
    memory.remember("f" * 32, 300.0, "s", now=300.0)  # the first eight are out of the window
    assert len(memory) == 1


def test_many_senders_merge_floors_and_still_refuse_replays():
    """More senders than floors are kept: the lowest floors merge into one for all,
    and every forgotten message stays refused."""
    memory = ReplayMemory(capacity=4, window_s=60.0, max_senders=4)
    sent = []
    for i in range(40):
        mid, t = f"{i:032x}", 1000.0 + i * 0.01
        memory.remember(mid, t, f"sender-{i}", now=t)
        sent.append((mid, t, f"sender-{i}"))
    assert len(memory) == 4
    for mid, t, sender in sent:
        with pytest.raises(AuthError):
            memory.remember(mid, t, sender, now=1000.5)
    memory.remember("e" * 32, 1000.6, "sender-new", now=1000.6)  # a new message is fine
