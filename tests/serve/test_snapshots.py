"""The daemon's in-memory snapshot store (elastic restarts): the store itself, then
through a real ``hapd serve``."""

from __future__ import annotations

import os

import pytest
from _hardening_daemon import ServedDaemon, signed_request

from hapd.errors import RemoteError, SnapshotError
from hapd.serve.snapshots import MAX_SNAPSHOT_READ_BYTES, SnapshotStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def put_entry(store: SnapshotStore, run: str, step: int, rank: int, size: int, world: int = 2) -> None:
    store.put(run, step, rank, world, "shard.distcp", bytes([step % 256]) * size)


def held(store: SnapshotStore, run: str) -> list[tuple[int, int]]:
    return [(e["step"], e["rank"]) for e in store.list(run)]


# ----------------------------------------------------------------------------- the store


def test_the_two_newest_steps_are_kept():
    store = SnapshotStore()
    for step in (10, 20):
        for rank in (0, 1):
            put_entry(store, "job-1", step, rank, 100)
    assert held(store, "job-1") == [(10, 0), (10, 1), (20, 0), (20, 1)]
    put_entry(store, "job-1", 30, 0, 100)  # a newer step evicts the oldest
    assert held(store, "job-1") == [(20, 0), (20, 1), (30, 0)]
    assert store.stats() == {"runs": 1, "entries": 3, "bytes": 300, "max_bytes": store.max_bytes}
    put_entry(store, "job-1", 30, 1, 100)  # a step already kept evicts nothing
    assert held(store, "job-1") == [(20, 0), (20, 1), (30, 0), (30, 1)]
    with pytest.raises(SnapshotError, match=r"step 10 of run job-1 is older than the 2 steps kept \(30, 20\)"):
        put_entry(store, "job-1", 10, 0, 100)
    assert store.drop("job-1", before_step=30) == 2
    assert held(store, "job-1") == [(30, 0), (30, 1)]
    assert store.drop("job-1") == 2 and store.drop("job-1") == 0 and store.drop("nothing-here") == 0
    assert store.stats()["runs"] == 0 and store.stats()["bytes"] == 0


def test_the_byte_cap_evicts_older_steps_then_refuses_naming_the_sizes():
    store = SnapshotStore(max_bytes=1000)
    put_entry(store, "a", 1, 0, 300)
    put_entry(store, "b", 1, 0, 300)
    put_entry(store, "a", 2, 0, 300)
    # 900 held; 300 more: run a's step 1 (older than its newest) goes, run b's only step stays
    put_entry(store, "b", 2, 0, 300)
    assert held(store, "a") == [(2, 0)] and held(store, "b") == [(1, 0), (2, 0)]
    assert store.stats()["bytes"] == 900
    with pytest.raises(SnapshotError) as err:  # the step being put and every run's newest step are never evicted
        put_entry(store, "a", 2, 1, 500)
    assert "needs 500 more bytes; the store holds 900 of its 1000 bytes" in str(err.value)
    assert "would free only 300" in str(err.value)
    assert held(store, "b") == [(1, 0), (2, 0)] and store.stats()["bytes"] == 900  # refused: nothing evicted
    put_entry(store, "a", 2, 1, 400)
    assert held(store, "a") == [(2, 0), (2, 1)] and held(store, "b") == [(2, 0)] and store.stats()["bytes"] == 1000
    with pytest.raises(SnapshotError, match="needs 2000 more bytes"):
        SnapshotStore(max_bytes=1000).put("a", 0, 0, 1, "big", b"", offset=0, total=2000)


def test_runs_untouched_past_the_ttl_are_dropped():
    clock = FakeClock()
    store = SnapshotStore(ttl_s=60, clock=clock)
    put_entry(store, "old", 1, 0, 10)
    put_entry(store, "young", 1, 0, 10)
    clock.now += 50
    assert held(store, "young")  # a list touches the run
    clock.now += 50
    assert store.stats() == {"runs": 1, "entries": 1, "bytes": 10, "max_bytes": store.max_bytes}
    assert held(store, "old") == [] and held(store, "young") == [(1, 0)]
    clock.now += 61
    with pytest.raises(SnapshotError, match="no snapshot of run young at step 1 rank 0"):
        store.get("young", 1, 0, "shard.distcp")


def test_a_file_in_chunks_completes_its_entry_only_when_every_file_has_every_byte():
    store = SnapshotStore()
    big, small = os.urandom(2500), b"metadata"
    assert not store.put("r", 5, 1, 4, "big", big[:1000], total=2500, count=2)
    assert not store.put("r", 5, 1, 4, "big", big[1000:2000], offset=1000, total=2500, count=2)
    assert not store.put("r", 5, 1, 4, "big", big[1000:2000], offset=1000, total=2500, count=2)  # sent again
    assert store.list("r") == []
    with pytest.raises(SnapshotError, match=r"still being received \(2000 of 2500 bytes\)"):
        store.get("r", 5, 1, "big")
    with pytest.raises(SnapshotError, match="at offset 2100, but only 2000 bytes of it came"):
        store.put("r", 5, 1, 4, "big", big[2100:], offset=2100, total=2500, count=2)
    with pytest.raises(SnapshotError, match="started with 2500 bytes, this chunk says 2600"):
        store.put("r", 5, 1, 4, "big", big[2000:], offset=2000, total=2600, count=2)
    assert not store.put("r", 5, 1, 4, "big", big[2000:], offset=2000, total=2500, count=2)
    assert store.list("r") == []  # one file of two
    assert store.put("r", 5, 1, 4, ".metadata", small, count=2)
    assert store.list("r") == [{"step": 5, "rank": 1, "world": 4, "bytes": 2508, "files": [".metadata", "big"]}]
    assert store.get("r", 5, 1, "big", 0, 1000) == (big[:1000], 2500)
    assert store.get("r", 5, 1, "big", 2400) == (big[2400:], 2500)
    assert store.get("r", 5, 1, "big", 2500) == (b"", 2500)
    assert store.put("r", 6, 0, 4, "empty", b"")  # a file of no bytes is complete at once
    with pytest.raises(SnapshotError, match="already has its 2 files"):
        store.put("r", 5, 1, 4, "third", b"x", count=2)
    with pytest.raises(SnapshotError, match="was put with world 4 and 2 files, now with world 8"):
        store.put("r", 5, 1, 8, "big", b"x", count=2)
    with pytest.raises(SnapshotError, match="before its first chunk"):
        store.put("r", 7, 0, 4, "late", b"x", offset=10, total=20)


@pytest.mark.parametrize("name", ["", "a/b", "..", "x..y", ".", "a b", "é", "n" * 129])
def test_bad_file_names_are_refused(name):
    with pytest.raises(SnapshotError, match="snapshot file name") as err:
        SnapshotStore().put("run", 0, 0, 1, name, b"x")
    assert err.value.field == "name"


@pytest.mark.parametrize("args, field", [
    (("", 0, 0, 1), "run"), (("-run", 0, 0, 1), "run"), (("a/b", 0, 0, 1), "run"), (("r" * 65, 0, 0, 1), "run"),
    (("run", -1, 0, 1), "step"), (("run", 0, -1, 1), "rank"), (("run", 0, 2, 2), "rank"), (("run", 0, 0, 0), "world"),
    (("run", True, 0, 1), "step"),
])
def test_bad_ids_and_numbers_are_refused(args, field):
    with pytest.raises(SnapshotError) as err:
        SnapshotStore().put(*args, "f", b"x")
    assert err.value.field == field
    with pytest.raises(SnapshotError, match="ends past the file's 2 bytes"):
        SnapshotStore().put("run", 0, 0, 1, "f", b"xyz", total=2)
    with pytest.raises(SnapshotError, match="length"):
        SnapshotStore().get("run", 0, 0, "f", 0, MAX_SNAPSHOT_READ_BYTES + 1)


# ----------------------------------------------------------------------------- through a daemon


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    with ServedDaemon(tmp_path_factory.mktemp("hapd"), "--snapshot-mb", "64") as served:
        yield served


def test_two_ranks_snapshots_round_trip_through_the_daemon(daemon):
    shards = {rank: {"__%d_0.distcp" % rank: os.urandom(5 * 2**20 + 17 if rank == 0 else 3000),
                     ".metadata": b"meta %d" % rank} for rank in (0, 1)}
    with daemon.client() as client:
        for rank, files in shards.items():
            client.snapshot_put("job-7", 40, rank, 2, files)
        client.snapshot_put("job-7", 30, 0, 2, {"old": b"o" * (3 * 2**20)}, chunk_bytes=3 * 2**20)  # a chunk in parts
        assert client.snapshot_list("job-7") == [
            {"step": 30, "rank": 0, "world": 2, "bytes": 3 * 2**20, "files": ["old"]},
            {"step": 40, "rank": 0, "world": 2, "bytes": 5 * 2**20 + 17 + 6, "files": [".metadata", "__0_0.distcp"]},
            {"step": 40, "rank": 1, "world": 2, "bytes": 3006, "files": [".metadata", "__1_0.distcp"]},
        ]
        for rank, files in shards.items():
            assert client.snapshot_get("job-7", 40, rank) == files
        assert client.snapshot_list("another-run") == []
        stats = client.status()["snapshots"]
        assert stats == {"runs": 1, "entries": 3, "bytes": 3 * 2**20 + 5 * 2**20 + 17 + 6 + 3006, "max_bytes": 64 * 2**20}
        assert client.snapshot_drop("job-7", before_step=40) == 1
        with pytest.raises(SnapshotError, match="holds no complete snapshot of run job-7 at step 30"):
            client.snapshot_get("job-7", 30, 0)
        assert client.snapshot_drop("job-7") == 2
        assert client.snapshot_list("job-7") == []
        assert client.ping()["protocol"] == 1


def test_bad_snapshot_requests_get_error_replies(daemon):
    with daemon.client() as client:
        with pytest.raises(RemoteError, match="SnapshotError: snapshot file name '../escape'"):
            client.snapshot_put("job-8", 0, 0, 1, {"../escape": b"x"})
        with pytest.raises(RemoteError, match="SnapshotError: snapshot store full: big of run job-8 step 0 needs"):
            client.request("snapshot_put", {"run": "job-8", "step": 0, "rank": 0, "world": 1, "count": 1,
                                            "name": "big", "offset": 0, "total": 65 * 2**20, "data": b""})
        with pytest.raises(RemoteError, match="no snapshot of run job-8 at step 3 rank 0"):
            client.request("snapshot_get", {"run": "job-8", "step": 3, "rank": 0, "name": "f", "offset": 0,
                                            "length": 10})
        reply = signed_request(client, daemon.address, "snapshot_put",
                               {"run": "job-8", "step": "zero", "rank": 0, "world": 1, "count": 1, "name": "f",
                                "offset": 0, "total": 1, "data": b"x"})
        assert reply.type == "error" and "field 'step' should be int" in reply.body["message"]
        reply = signed_request(client, daemon.address, "snapshot_drop", {"run": "job-8", "before_step": -1})
        assert reply.type == "error" and "before_step -1 must be an integer ≥ 0" in reply.body["message"]
        assert client.ping()["protocol"] == 1  # still serving


def test_the_automatic_interval_counts_the_send_and_follows_the_cost():
    """Without ``--snapshot-every`` the interval is chosen at every snapshot: a snapshot
    whose write and background send take 0.2 s of 1 s steps is taken every 5 steps
    (4%: the budget of 5% less a margin for the cost's spread); when snapshots get
    cheaper the interval follows, averaged."""
    import torch

    import hapd

    elastic = hapd.Elastic(torch.nn.Linear(2, 2), environ={})
    assert elastic._auto and elastic.every == 0
    elastic._step_time = 1.0
    elastic._choose_interval(0.15 + 0.05)  # the write, the previous send's CPU time
    assert elastic.every == 5
    elastic._choose_interval(0.02)
    assert elastic.every == 4  # 0.7 · 0.2 + 0.3 · 0.02 = 0.146 s: 3.65 steps' 4%, every 4 steps
    pinned = hapd.Elastic(torch.nn.Linear(2, 2), every=5, environ={})
    assert not pinned._auto
    assert [s for s in range(1, 21) if pinned._due(s)] == [5, 10, 15, 20]  # a fixed interval: its multiples


def test_the_automatic_interval_counts_from_the_last_snapshot():
    """An interval chosen again at each snapshot (15, 17, 16, …) takes a snapshot that
    many steps after the last one — at their multiples instead, snapshots came at steps
    15, 17, 30, 32, 34: twice as many as chosen."""
    import torch

    import hapd

    elastic = hapd.Elastic(torch.nn.Linear(2, 2), environ={})
    assert elastic._due(1)  # before an interval was chosen: the first step's snapshot times one
    taken, chosen = [], iter([15, 17, 16, 15, 17, 16, 15, 17])
    for step in range(1, 81):
        if elastic._due(step):
            taken.append(step)
            elastic._snapshot_step, elastic.every = step, next(chosen)
    assert taken == [1, 16, 33, 49, 64], taken


def test_a_send_costs_what_the_steps_beside_it_lost_in_wall_time():
    """The send's cost is measured on the steps: on a rank at a sixth of a core, 0.1 CPU
    seconds of sending slowed two 1 s steps by 0.3 s each: 0.6 s, not 0.1 s; a step
    slowed after the send ended counts as well. Before a
    step without a send was seen, the CPU time is the estimate; a send that slowed
    nothing costs nothing (noise in both directions sums, never below 0)."""
    from hapd.elastic.resume import SnapshotCost

    cost = SnapshotCost()
    cost.step(1.3, sending=True)  # no step without a send yet: nothing to compare with
    assert cost.send_cost(0.1) == 0.1
    for _ in range(3):
        cost.step(1.0, sending=False)
    cost.step(1.3, sending=True)
    cost.step(1.3, sending=True)
    assert cost.send_cost(0.1) == pytest.approx(0.6)
    cost.step(1.02, sending=True)
    cost.step(0.97, sending=True)
    assert cost.send_cost(0.1) == 0.0  # started over, and -0.01 s is no cost
    assert cost.clean_step == pytest.approx(1.0)
    # the steps after the send ended count too (the daemons store the files on the same CPUs)
    cost.step(1.0, sending=False)
    cost.step(1.2, sending=True)
    cost.step(1.2, sending=False)
    cost.step(1.0, sending=False)
    assert cost.send_cost(0.1) == pytest.approx(0.4)
    slow_start = SnapshotCost()
    for took in (9.0, 1.0, 1.0):  # a slow step (a warm-up) does not move the step time
        slow_start.step(took, sending=False)
    assert slow_start.clean_step == 1.0
