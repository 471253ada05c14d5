"""The switch in place's state move: the schedule (pure: uneven pieces, replicas, a
piece only a lost rank held), the survivors' agreement on a step, the executor on Gloo
ranks, and a job's state taken back from the step copies its ranks kept."""

from __future__ import annotations

import pytest
import torch
from _dist import run_ranks

from hapd.elastic import moves, step_copy
from hapd.elastic.moves import Box, Piece, schedule


def _rows(key: str, start: int, rows: int, size: tuple[int, ...], dtype: str = "float32") -> Piece:
    """Rows ``start:start+rows`` of a tensor of ``size`` (split along dim 0)."""
    return Piece(key, (start, *([0] * (len(size) - 1))), (rows, *size[1:]), size, dtype)


def _whole(key: str, size: tuple[int, ...]) -> Piece:
    return Piece(key, (0,) * len(size), size, size)


def _covers(plan: moves.Schedule, needed: dict[int, list[Piece]]) -> None:
    """Every element of every needed piece is written exactly once."""
    for dst, pieces in needed.items():
        for want in pieces:
            mask = torch.zeros(want.shape, dtype=torch.int32)
            for t in plan.transfers:
                if t.dst == dst and t.key == want.key:
                    mask[t.dst_box.slices()] += 1
            assert bool((mask == 1).all()), (dst, want, mask)


def test_boxes_intersect_and_subtract_into_disjoint_blocks():
    a = Box((0, 0), (4, 6))
    inner = a.intersect(Box((1, 2), (10, 2)))
    assert inner == Box((1, 2), (3, 2))
    rest = a.minus(inner)
    assert sum(b.numel for b in rest) == a.numel - inner.numel
    mask = torch.zeros(4, 6, dtype=torch.int32)
    for b in [*rest, inner]:
        mask[b.slices()] += 1
    assert bool((mask == 1).all())
    assert Box((0,), (3,)).intersect(Box((3,), (2,))) is None
    assert Box((), ()).intersect(Box((), ())) == Box((), ()) and Box((), ()).numel == 1  # a scalar


def test_uneven_pieces_are_cut_to_the_new_split():
    """3 old ranks hold 3:2:1 row pieces of w; 2 new ranks need 4:2: rank 0 takes its own
    rows first, then rank 1's; rank 1 takes rank 1's last row and rank 2's."""
    size = (6, 4)
    held = {0: [_rows("w", 0, 3, size)], 1: [_rows("w", 3, 2, size)], 2: [_rows("w", 5, 1, size)]}
    needed = {0: [_rows("w", 0, 4, size)], 1: [_rows("w", 4, 2, size)]}
    plan = schedule(held, needed)
    assert plan.covered
    _covers(plan, needed)
    assert {(t.src, t.dst, t.src_box, t.dst_box) for t in plan.transfers} == {
        (0, 0, Box((0, 0), (3, 4)), Box((0, 0), (3, 4))),
        (1, 0, Box((0, 0), (1, 4)), Box((3, 0), (1, 4))),
        (1, 1, Box((1, 0), (1, 4)), Box((0, 0), (1, 4))),
        (2, 1, Box((0, 0), (1, 4)), Box((1, 0), (1, 4))),
    }
    assert plan.bytes_between_ranks() == 2 * 4 * 4


def test_replicas_come_from_the_rank_itself_else_spread_over_the_holders():
    held = {0: [_whole("b", (8,))], 1: [_whole("b", (8,))]}
    needed = {0: [_whole("b", (8,))], 1: [_whole("b", (8,))], 2: [_whole("b", (8,))], 3: [_whole("b", (8,))]}
    plan = schedule(held, needed)
    _covers(plan, needed)
    assert [(t.src, t.dst) for t in plan.transfers] == [(0, 0), (1, 1), (0, 2), (0, 3)]
    # a second replicated tensor split across columns on the destination: any order, exact cover
    held = {0: [_whole("m", (4, 6))], 2: [Piece("m", (0, 3), (4, 3), (4, 6)), Piece("m", (0, 0), (4, 3), (4, 6))]}
    needed = {1: [Piece("m", (1, 2), (2, 3), (4, 6))]}
    plan = schedule(held, needed)
    _covers(plan, needed)
    assert {t.src for t in plan.transfers} == {2}  # after rank 1 comes 2 in the rotation: one holder, two pieces


def test_a_piece_only_a_lost_rank_held_is_not_covered():
    size = (6, 4)
    held = {0: [_rows("w", 0, 3, size), _whole("b", (4,))]}  # rows 3:6 were on the lost rank
    needed = {0: [_rows("w", 0, 6, size), _whole("b", (4,))]}
    plan = schedule(held, needed)
    assert plan.missing == ("w",) and not plan.covered
    other = schedule(held, {0: [Piece("b", (0,), (4,), (5,))]})  # another model's shape covers nothing
    assert other.missing == ("b",)


def test_scalars_and_optimizer_states_follow_their_parameter():
    """A rank's Adam states: exp_avg split like its parameter's new piece, the scalar step whole."""
    survivors = [_rows("optim/w/exp_avg", 0, 6, (6, 4)), Piece("optim/w/step", (), (), (), "float32")]
    params = [_rows("w", 2, 3, (6, 4))]
    needs = step_copy.optimizer_needs(params, survivors)
    assert needs == [_rows("optim/w/exp_avg", 2, 3, (6, 4)), Piece("optim/w/step", (), (), (), "float32")]
    plan = schedule({0: survivors}, {1: needs})
    assert plan.covered and len(plan.transfers) == 2
    assert step_copy.optimizer_needs([_rows("w", 0, 0, (6, 4))], survivors) == [survivors[1]]  # an empty piece


def _offer(rank: int, generation: int | None, steps: list[int]) -> step_copy.Offer:
    return step_copy.Offer(rank, generation, rank, {s: ((), {}, None) for s in steps}, (), ())


def test_survivors_agree_on_the_last_step_all_completed():
    # a failure inside step 8: rank 1 applied it (and kept its copy), ranks 0 and 2 did not
    got = step_copy.agree([_offer(0, 1, [6, 7]), _offer(1, 1, [7, 8]), _offer(2, 1, [6, 7]), _offer(3, None, [])])
    assert (got.step, got.survivors) == (7, (0, 1, 2))
    # a copy of an older generation (a rank that failed in its resume) is not a survivor's
    assert step_copy.agree([_offer(0, 2, [9, 10]), _offer(1, 1, [3, 4])]).survivors == (0,)
    assert step_copy.agree([_offer(0, None, [])]).step is None
    assert "no copy of step 9" in step_copy.agree([_offer(0, 1, [8, 9]), _offer(1, 1, [10, 11])]).reason


def _execute_on_ranks(rank: int, world: int) -> dict[str, list]:
    """Old layout: w (7×3) in rows 0:4 on rank 0 and 4:7 on rank 1, b (5,) whole on both;
    new: w in rows 0:2, 2:3, 3:7 on ranks 0, 1, 2 (rank 2 held nothing), b on every rank,
    kept as float64 on rank 2 (a cast on arrival)."""
    w = torch.arange(21, dtype=torch.float32).reshape(7, 3)
    b = torch.arange(5, dtype=torch.float32) * 10
    old = {0: (0, 4), 1: (4, 7)}
    held = {r: [_rows("w", lo, hi - lo, (7, 3)), _whole("b", (5,))] for r, (lo, hi) in old.items()}
    new = [(0, 2), (2, 3), (3, 7)]
    needed = {r: [_rows("w", lo, hi - lo, (7, 3)), _whole("b", (5,))] for r, (lo, hi) in enumerate(new)}
    plan = schedule(held, needed)
    mine = {"w": w[old[rank][0]:old[rank][1]].clone(), "b": b.clone()} if rank in old else {}
    sources = moves.by_piece(held.get(rank, []), mine)
    lo, hi = new[rank]
    dtype = torch.float64 if rank == 2 else torch.float32
    targets = {"w": torch.full((hi - lo, 3), -1.0, dtype=dtype), "b": torch.full((5,), -1.0, dtype=dtype)}
    done = moves.execute(plan, rank, sources, targets)
    assert torch.equal(targets["w"], w[lo:hi].to(dtype)) and torch.equal(targets["b"], b.to(dtype))
    return {"sent": done.sent_bytes, "received": done.received_bytes, "local": done.local_bytes}


@pytest.mark.distributed
def test_the_executor_moves_uneven_pieces_between_gloo_ranks():
    got = run_ranks(3, _execute_on_ranks, timeout=60)
    assert sum(g["sent"] for g in got) == sum(g["received"] for g in got) > 0
    assert got[2]["local"] == 0 and got[2]["received"] == (4 * 3 + 5) * 4


def _train(elastic, module, optimizer, data, start: int, stop: int) -> list[float]:
    losses = []
    for step in range(start + 1, stop + 1):
        x, y = data[step % len(data)]
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(module(x), y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        if elastic is not None:
            elastic.step_done(step)
    return losses


def _switch_in_place(rank: int, world: int, key_file: str, joined: bool) -> dict:
    """Two ranks train a replicated Linear 3 steps under an elastic run; rank 1 also
    finishes step 4 (a failure inside step 4 cut rank 0 short), or (``joined``) is a new
    process that holds no copies (a host joining). The script runs again in the same
    processes (a new model, optimizer and Elastic, generation 1): both resume at step 3,
    from their copies (rank 1 from the one before its newest), or rank 1 from rank 0's,
    sent point to point, and the next steps' losses are those of training straight on."""
    import os

    from hapd.elastic.resume import Elastic

    os.environ["HAPD_KEY_FILE"] = key_file
    env = {"HAPD_ELASTIC_RUN": "moves-test", "HAPD_GENERATION": "0",
           "HAPD_SNAPSHOT_EVERY": "-1"}
    data = [(torch.randn(4, 5, generator=torch.Generator().manual_seed(i)),
             torch.randn(4, 2, generator=torch.Generator().manual_seed(100 + i))) for i in range(8)]

    def build(seed: int):
        torch.manual_seed(seed)
        module = torch.nn.Linear(5, 2)
        optimizer = torch.optim.Adam(module.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.9)
        return module, optimizer, scheduler

    module, optimizer, scheduler = build(0)
    elastic = Elastic(module, optimizer, state={"scheduler": scheduler}, environ=env)
    assert elastic.resume() == 0
    _train(elastic, module, optimizer, data, 0, 3)
    for _ in range(3):
        scheduler.step()  # (after the steps: the copies hold lr as of each step_done)
    module_ref, optimizer_ref, _ = build(0)
    reference = _train(None, module_ref, optimizer_ref, data, 0, 6)
    if rank == 1 and joined:
        step_copy.forget("moves-test")
    elif rank == 1:
        _train(elastic, module, optimizer, data, 3, 4)
    # the next generation, in the same process: another initialization, nothing trained
    module, optimizer, scheduler = build(7)
    elastic = Elastic(module, optimizer, state={"scheduler": scheduler}, environ={**env, "HAPD_GENERATION": "1"})
    step = elastic.resume()
    losses = _train(None, module, optimizer, data, step, 6)
    return {"step": step, "losses": losses, "reference": reference[3:], "lr": optimizer.param_groups[0]["lr"]}


@pytest.mark.distributed
@pytest.mark.parametrize("joined", [False, True], ids=["cut-inside-a-step", "a-rank-without-copies"])
def test_a_switch_in_place_resumes_from_the_survivors_step_copies(tmp_path, joined):
    from hapd.wire.keys import load_or_create_key

    key = tmp_path / "key"
    load_or_create_key(key)
    got = run_ranks(2, _switch_in_place, str(key), joined, timeout=90)
    for result in got:
        assert result["step"] == 3
        assert result["losses"] == result["reference"], result  # bit for bit: the same state, the same steps
        assert result["lr"] == 0.05  # the step copies' param groups (the scheduler stepped after them)


def test_a_piece_no_survivor_holds_falls_back_to_the_snapshot(tmp_path, monkeypatch, capsys):
    """The script's next run builds a model with a tensor the copies lack: resume says
    which keys no survivor held and takes the snapshot path (here none: step 0)."""
    from hapd.elastic.resume import Elastic
    from hapd.wire.keys import load_or_create_key

    load_or_create_key(tmp_path / "key")
    monkeypatch.setenv("HAPD_KEY_FILE", str(tmp_path / "key"))
    env = {"HAPD_ELASTIC_RUN": f"fallback-{id(tmp_path)}", "HAPD_GENERATION": "0", "HAPD_SNAPSHOT_EVERY": "-1"}
    module = torch.nn.Linear(3, 2)
    elastic = Elastic(module, torch.optim.SGD(module.parameters(), lr=0.1), environ=env)
    elastic.resume()
    elastic.step_done(1)
    grown = torch.nn.Sequential(torch.nn.Linear(3, 2))
    again = Elastic(grown, torch.optim.SGD(grown.parameters(), lr=0.1), environ={**env, "HAPD_GENERATION": "1"})
    assert again.resume() == 0
    said = capsys.readouterr().out
    assert "none (fallback: keys model/0.bias, model/0.weight not held by any survivor)" in said, said
    step_copy.forget(env["HAPD_ELASTIC_RUN"])


def test_a_copy_beside_the_next_step_holds_the_state_of_its_step():
    """With the parameters and the optimizer state copied beside the next step (a thread;
    the optimizer's next step waits for it), each copy is the state at its step_done: a
    buffer the next forward changes (batch norm's running mean) is copied at once."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32))
    optimizer = torch.optim.Adam(module.parameters(), lr=0.1)
    copies = step_copy.StepCopies()
    optimizer.register_step_pre_hook(lambda *_: copies.before_update())
    expected = {}
    for step in range(1, 5):
        optimizer.zero_grad()
        module(torch.randn(8, 32)).square().sum().backward()
        optimizer.step()
        found, objects = step_copy.entries(module, optimizer)
        expected[step] = {h.key: h.local.detach().clone() for h in found}
        copies.keep(step, 0, 0, 1, found, objects, step_copy.small_state(module, optimizer, None, {}), overlap=True)
    module(torch.randn(8, 32))  # a forward after the last copy: the running mean moves again
    copies.wait()
    assert [c.step for c in copies.copies] == [3, 4]
    for kept in copies.copies:
        assert kept.tensors.keys() == expected[kept.step].keys()
        for key, value in kept.tensors.items():
            assert torch.equal(value, expected[kept.step][key]), (kept.step, key)
    assert any(k.endswith("running_mean") for k in expected[4]) and any(k.endswith("exp_avg") for k in expected[4])


def test_copies_that_pass_the_hosts_memory_budget_are_not_kept(monkeypatch):
    """Two copies of a rank's state take at most half the host's available memory,
    shared by its ranks: beyond that none is kept (the state comes from the snapshot
    after a switch), and nothing is half-copied."""
    module = torch.nn.Linear(64, 64)  # 16.6 KB of parameters
    found, objects = step_copy.entries(module, None)
    small = step_copy.small_state(module, None, None, {})
    nbytes = sum(h.local.numel() * h.local.element_size() for h in found)
    step_copy.check_budget(nbytes, 2, 4 * 2 * nbytes)  # exactly the budget: kept
    with pytest.raises(step_copy.CopiesTooLarge, match="more than its share"):
        step_copy.check_budget(nbytes, 2, 4 * 2 * nbytes - 1)
    step_copy.check_budget(10**15, 8, None)  # the host's memory unknown: no limit
    copies = step_copy.StepCopies(local_ranks=4)
    monkeypatch.setattr(step_copy, "host_available_bytes", lambda: 8 * 2 * nbytes - 1)
    with pytest.raises(step_copy.CopiesTooLarge):
        copies.keep(1, 0, 0, 1, found, objects, small)
    assert copies.copies == []
    monkeypatch.setattr(step_copy, "host_available_bytes", lambda: 8 * 2 * nbytes)
    copies.keep(1, 0, 0, 1, found, objects, small)
    assert [c.step for c in copies.copies] == [1]


@pytest.mark.parametrize("case", ["in-place", "no-copies", "restart", "interval-due"])
def test_a_pause_in_place_takes_no_snapshot_of_its_own_when_the_copies_hold_the_state(tmp_path, monkeypatch, case):
    """A pause for a joining host, under the in-place runner with step copies on every
    rank, parks without a snapshot of its step (the next generation takes that step
    from the copies: resumed there, nothing lost); with a rank that keeps no copies, or
    with ``--restart`` (new processes load the snapshot), it snapshots that step first;
    a snapshot the interval makes due at that step is taken as ever."""
    from hapd.elastic import resume
    from hapd.elastic.in_place import IN_PLACE_ENV
    from hapd.errors import ElasticPause
    from hapd.wire.keys import load_or_create_key

    load_or_create_key(tmp_path / "key")
    monkeypatch.setenv("HAPD_KEY_FILE", str(tmp_path / "key"))
    if case != "restart":
        monkeypatch.setenv(IN_PLACE_ENV, "1")
    else:
        monkeypatch.delenv(IN_PLACE_ENV, raising=False)
    run = f"pause-{case}-{id(tmp_path)}"
    env = {"HAPD_ELASTIC_RUN": run, "HAPD_GENERATION": "0", "HAPD_SNAPSHOT_EVERY": "5"}
    if case == "no-copies":
        env[step_copy.COPY_ENV] = "0"
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    elastic = resume.Elastic(module, optimizer, environ=env)
    snapshots: list[int] = []
    monkeypatch.setattr(elastic, "snapshot", lambda step: snapshots.append(step) or 0.0)
    pause_at = 5 if case == "interval-due" else 3
    monkeypatch.setattr(elastic, "_pause_requested", lambda: elastic_step[0] == pause_at)
    elastic_step = [0]
    assert elastic.resume() == 0
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
    stopped = None
    for step in range(1, 8):
        optimizer.zero_grad()
        module(x).square().sum().backward()
        optimizer.step()
        elastic_step[0] = step
        try:
            elastic.step_done(step)
        except (ElasticPause, SystemExit) as exc:
            stopped = exc
            break
    assert elastic_step[0] == pause_at
    if case == "in-place":
        assert isinstance(stopped, ElasticPause) and snapshots == []
        state = {k: v.clone() for k, v in module.state_dict().items()}
        again = torch.nn.Linear(3, 2)  # the script's next run in this process: other values, the copies' state
        follow = resume.Elastic(again, torch.optim.SGD(again.parameters(), lr=0.1),
                                environ={**env, "HAPD_GENERATION": "1"})
        assert follow.resume() == pause_at
        assert all(torch.equal(again.state_dict()[k], v) for k, v in state.items())
    elif case == "no-copies":
        assert isinstance(stopped, ElasticPause) and snapshots == [pause_at]
    elif case == "restart":
        assert isinstance(stopped, SystemExit) and stopped.code == 0 and snapshots == [pause_at]
    else:
        assert isinstance(stopped, ElasticPause) and snapshots == [5]  # the interval's, once
    step_copy.forget(run)
