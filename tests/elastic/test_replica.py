"""The replicas of the pieces no other host holds (:mod:`hapd.elastic.replica`): who
partners whom, which pieces are lonely, the step the survivors go on from with them,
and on Gloo ranks a lost host's pieces of a split tensor put back exactly from the
replicas its partner received."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

from hapd.elastic import moves, replica, resume, step_copy
from hapd.elastic.moves import Piece
from hapd.errors import CollectiveError


def _rows(key: str, start: int, rows: int, size: tuple[int, ...]) -> Piece:
    return Piece(key, (start, *([0] * (len(size) - 1))), (rows, *size[1:]), size)


def _whole(key: str, size: tuple[int, ...]) -> Piece:
    return Piece(key, (0,) * len(size), size, size)


def test_each_rank_partners_the_rank_of_its_local_index_on_the_next_host():
    assert replica.partners(["a", "a", "b", "b", "c", "c"]) == [2, 3, 4, 5, 0, 1]
    assert replica.partners(["a", "a", "b"]) == [2, 2, 0]  # the next host has one rank: both send to it
    assert replica.partners(["b", "a", "b"]) == [1, 0, 1]  # hosts in the order of their first rank
    assert replica.partners(["a", "a"]) == [None, None]  # one host: no other to keep them


def test_lonely_pieces_are_those_no_other_host_covers_each_sent_once_per_host():
    size = (8, 4)
    hosts = ["a", "a", "b", "b"]
    held = [
        [_rows("w", 0, 2, size), _whole("b", (4,)), _rows("u", 0, 4, size)],
        [_rows("w", 2, 2, size), _whole("b", (4,)), _rows("u", 0, 4, size)],  # u: host a's rows, twice
        [_rows("w", 4, 2, size), _whole("b", (4,)), _rows("u", 4, 4, size), _rows("v", 0, 8, size)],
        [_rows("w", 6, 2, size), _whole("b", (4,)), _rows("u", 4, 4, size), _rows("v", 0, 3, size)],
    ]
    held[0].append(_rows("v", 0, 3, size))
    held[1].append(_rows("v", 3, 5, size))  # host a's two pieces of v cover rank 2's whole v between them
    alone = replica.lonely(hosts, held)
    assert alone[0] == (_rows("w", 0, 2, size), _rows("u", 0, 4, size))  # b is everywhere; v covered by host b
    assert alone[1] == (_rows("w", 2, 2, size),)  # u is rank 0's to send: the same piece on its host
    assert alone[2] == (_rows("w", 4, 2, size), _rows("u", 4, 4, size))  # v covered by host a's two pieces
    assert alone[3] == (_rows("w", 6, 2, size),)
    assert replica.lonely(["a", "a"], [[_whole("b", (4,))], [_whole("b", (4,))]]) == [(_whole("b", (4,)),), ()]

    mine = replica.layout(3, 2, hosts, held)
    assert (mine.partner, mine.sends) == (0, alone[2])
    assert mine.sources == ((0, alone[0]),)  # rank 0 partners rank 2, rank 1 partners rank 3
    assert replica.layout(3, 0, ["a", "a"], [[_whole("b", (4,))], [_whole("b", (4,))]]).active is False


def _offer(rank: int, steps: list[int], pieces: tuple[Piece, ...], replicas: dict[int, tuple[Piece, ...]],
           needs: tuple[Piece, ...]) -> step_copy.Offer:
    return step_copy.Offer(rank, 1, rank, {s: (pieces, {}, None) for s in steps}, needs, (), replicas)


def test_the_survivors_go_on_from_the_newest_step_their_replicas_cover():
    """Host b (old ranks 2 and 3) lost: ranks 0 and 1 held rows 0:4 of w, the replicas
    of rows 4:8 came from host b; the new plan splits w over the two survivors."""
    size = (8, 4)
    own = {0: (_rows("model/w", 0, 2, size),), 1: (_rows("model/w", 2, 2, size),)}
    theirs = {0: (_rows("model/w", 4, 2, size),), 1: (_rows("model/w", 6, 2, size),)}
    needs = {0: (_rows("model/w", 0, 4, size),), 1: (_rows("model/w", 4, 4, size),)}

    def cover(steps: dict[int, list[int]], replicated: dict[int, list[int]]):
        offers = [_offer(r, steps[r], own[r], {s: theirs[r] for s in replicated[r]}, needs[r]) for r in (0, 1)]
        return resume._cover(offers, step_copy.agree(offers))

    step, plan, _needed, _held = cover({0: [4, 5], 1: [4, 5]}, {0: [4, 5], 1: [4, 5]})
    assert step == 5 and plan.covered
    assert {(t.src, t.dst, t.src_offsets) for t in plan.transfers if t.src != t.dst} == {(0, 1, (4, 0)),
                                                                                       (1, 0, (2, 0))}
    # rank 1's replica of step 5 had not arrived: both go on from step 4, which both hold
    assert cover({0: [4, 5], 1: [4, 5]}, {0: [4, 5], 1: [4]})[0] == 4
    # rank 0 applied step 6 (it holds 5 and 6): step 4 is no longer every survivor's, the snapshot then
    missing = cover({0: [5, 6], 1: [4, 5]}, {0: [5, 6], 1: [4]})
    assert isinstance(missing, str) and "model/w" in missing


def _replicate_then_recover(rank: int, world: int) -> list[float]:
    """Hosts a (ranks 0, 1) and b (2, 3): w (8×3) split by rows over the 4 ranks, b whole
    on each. Three steps of replicas (each step's pieces differ), then host b is lost:
    ranks 0 and 1 rebuild the whole w of step 3 from their copies and the replicas."""
    import torch.distributed as dist

    hosts = ["a", "a", "b", "b"]
    size = (8, 3)
    pieces = [(_rows("model/w", 2 * r, 2, size), _whole("model/b", (3,))) for r in range(world)]
    whole = {s: torch.arange(24, dtype=torch.float32).reshape(size) * s for s in range(1, 4)}
    keep = replica.Replicas()
    plan = keep.set_up(1, rank, hosts, pieces, max_bytes=2**20)
    assert plan.sends == (pieces[rank][0],) and keep.sent_bytes == (24, 24, 24, 24)
    copies = {}
    for s in range(1, 4):
        copies[s] = {"model/w": whole[s][2 * rank:2 * rank + 2].clone(), "model/b": torch.full((3,), float(s))}
        keep.start(s, copies[s], lambda: True)
        keep.wait()
    assert not keep.errors, keep.errors
    offered = keep.offered(1)
    source = {0: 2, 1: 3, 2: 0, 3: 1}[rank]
    assert sorted(offered) == [2, 3] and offered[3] == (pieces[source][0],)
    assert keep.offered(0) == {}  # another generation's layout
    assert torch.equal(keep.sources(3, 1)[("model/w", (2 * source, 0))], whole[3][2 * source:2 * source + 2])
    # host b lost: the survivors' new plan splits w in halves over ranks 0 and 1
    if rank < 2:
        held = {r: (*pieces[r], *[p for p in pieces[{0: 2, 1: 3}[r]][:1]]) for r in (0, 1)}
        needed = {r: [_rows("model/w", 4 * r, 4, size), _whole("model/b", (3,))] for r in (0, 1)}
        schedule = moves.schedule(held, needed)
        assert schedule.covered
        sources = {**moves.by_piece(pieces[rank], copies[3]), **keep.sources(3, 1)}
        targets = {"model/w": torch.zeros(4, 3), "model/b": torch.zeros(3)}
        moves.execute(schedule, rank, sources, targets)
        assert torch.equal(targets["model/w"], whole[3][4 * rank:4 * rank + 4]), targets
    # rank 2's copy of step 4 torn (its part beside the step failed): rank 0 keeps its replica of step 3 alone
    keep.start(4, copies[3], (lambda: False) if rank == 2 else (lambda: True))
    keep.wait()
    assert sorted(keep.offered(1)) == ([3] if rank == 0 else [3, 4]), keep.offered(1)
    dist.barrier()
    keep.reset()
    return keep.seconds


@pytest.mark.distributed
def test_a_lost_hosts_pieces_come_back_from_its_partners_replicas_on_gloo_ranks():
    seconds = run_ranks(4, _replicate_then_recover, timeout=90)
    assert all(len(s) == 4 for s in seconds)


def test_a_failed_transfer_parks_the_rank_before_its_next_step():
    keep = replica.Replicas()
    keep.before_step()  # nothing under way: nothing to wait for
    keep.failed = "step 4: RuntimeError: Connection closed by peer"
    with pytest.raises(CollectiveError, match="Connection closed by peer"):
        keep.before_step()
    keep.before_step()  # told once: the parked rank's next run starts clean
    keep.failed = "step 5: ValueError: not a peer's loss"
    keep.before_step()  # said on stderr, not a park


def test_a_transfer_stuck_on_a_silent_host_parks_the_rank_when_asked():
    """A transfer from a host whose link went down never ends by itself (its connections
    do not close): the rank waiting for it before its next step parks once the launcher
    asks (once, it waited past the launcher's hold and every rank restarted)."""
    import threading

    from hapd.elastic.in_place import PARK_REQUESTED

    release = threading.Event()
    keep = replica.Replicas()
    keep._thread = threading.Thread(target=release.wait, daemon=True)
    keep._thread.start()
    threading.Timer(0.2, PARK_REQUESTED.set).start()
    try:
        with pytest.raises(CollectiveError, match="asked to park"):
            keep.before_step()
    finally:
        PARK_REQUESTED.clear()
        release.set()
    keep.reset()  # the transfer ended (its group left): the next generation starts clean
    assert keep._thread is None


def test_a_switch_gives_up_the_last_generations_transfer_that_never_ends():
    """A new generation's resume waits for the transfer of the generation it parked from
    at most :data:`~hapd.elastic.replica.SETTLE_S`, then gives it up (its replicas are not
    kept) — once a new rank 0 waited there without end while the others timed out in the
    resume's gather, and every rank restarted."""
    import threading

    release = threading.Event()
    keep = replica.Replicas()
    keep._thread = threading.Thread(target=release.wait, daemon=True)
    keep._thread.start()
    try:
        keep.settle(0.1)
        assert keep._thread is None and keep._epoch == 1
        assert "given up" in keep.errors[-1], keep.errors
        keep.settle(0.1)  # nothing under way: nothing to do
        assert keep._epoch == 1
    finally:
        release.set()


def test_a_rank_that_has_not_parked_soon_after_the_request_prints_its_threads(capfd, monkeypatch):
    """What a rank asked to park waits on, when it does not within
    :data:`~hapd.elastic.in_place.PARK_STALL_S`: every thread's stack on its stderr
    (the launcher shows it); nothing once it parked or in another generation."""
    from hapd.elastic import in_place

    monkeypatch.setenv(in_place.GENERATION_ENV, "3")
    in_place.PARK_REQUESTED.set()
    try:
        in_place._not_parked(3)
        err = capfd.readouterr().err
        assert "has not parked" in err and "most recent call first" in err, err
        in_place._not_parked(2)  # a request of an earlier generation: this one's run is another
        in_place.PARKED.set()
        in_place._not_parked(3)
        assert capfd.readouterr().err == ""
    finally:
        in_place.PARK_REQUESTED.clear()
        in_place.PARKED.clear()


def test_event_lines_said_from_two_threads_at_once_stay_whole_lines():
    """The park watcher's ``park_requested`` and the main thread's ``parked`` come at the
    same moment; ``print``'s two writes once ran them into one line the launcher could not
    read (the rank's park lost, every rank restarted)."""
    import io
    import json
    import sys
    import threading
    import time

    from hapd.wire.switch import say

    class Slow(io.StringIO):  # yields the interpreter at every write, as a pipe's write can
        def write(self, text: str) -> int:
            time.sleep(0.0002)
            return super().write(text)

    out, real = Slow(), sys.stdout
    sys.stdout = out
    try:
        threads = [threading.Thread(target=lambda n=n: [say("tick", thread=n, i=i) for i in range(100)])
                   for n in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.stdout = real
    lines = out.getvalue().splitlines()
    assert len(lines) == 400 and all(json.loads(line)["event"] == "tick" for line in lines)
