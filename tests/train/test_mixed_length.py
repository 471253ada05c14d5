"""Mixed-length data (:mod:`hapd.train.mixed_length`, :mod:`hapd.models.packed`).

The planner: every sequence of a step lands in exactly one row of one micro-batch, rows
never overflow, shapes come from the pool, rows follow the program's split, the cost
model decides when a short length's leftovers move up. The packing: a packed row's
loss is the loss of its documents run one by one. The distributed run: packed
variable-length steps on 2 and 4 uneven Gloo ranks reproduce the single-device loss of
the same sequences, run one by one (loss, every gradient, and 20 Adam steps).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from _dist import run_ranks
from _exact import grad_errors
from torch import Tensor

import hapd
from hapd.errors import OptionsError
from hapd.train.mixed_length import (IGNORE, LengthCost, MixedLengthLoader, counted, even_split, one_row,
                                       pack_rows, pack_tensors, pack_step, row_lengths)

TOL = 1e-5
COST = LengthCost(linear=1000.0, quadratic=4.0)


def _lengths(n: int, seed: int = 0, longest: int = 100) -> list[int]:
    """Long-tailed lengths (log-normal), 2..longest."""
    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(2.8 + 0.9 * torch.randn(n, generator=g))
    return [int(min(longest, max(2, round(float(x))))) for x in draws]


# -- the planner ------------------------------------------------------------------------

def test_row_lengths_double_from_the_shortest_to_the_longest() -> None:
    assert row_lengths(64, 300) == (64, 128, 256, 512)
    assert row_lengths(16, 16) == (16,)
    with pytest.raises(OptionsError, match="shortest"):
        row_lengths(0, 10)


def test_pack_rows_is_first_fit_decreasing_and_never_overflows() -> None:
    lengths = [5, 3, 8, 2, 2, 6]
    rows = pack_rows(lengths, range(6), 8)
    assert sorted(i for row in rows for i in row) == list(range(6))
    assert all(sum(lengths[i] for i in row) <= 8 for row in rows)
    assert rows[0] == [2]  # the longest first
    assert len(rows) == math.ceil(sum(lengths) / 8)  # 26 tokens in 4 rows of 8
    with pytest.raises(OptionsError, match="sequence 0 has 9 tokens"):
        pack_rows([9], [0], 8)


@pytest.mark.parametrize("ratios", [(0.75, 0.25), (0.4, 0.3, 0.2, 0.1)])
def test_plan_step_places_every_sequence_once_in_pool_shapes_and_split(ratios) -> None:
    lengths = _lengths(120, seed=3)
    pool = row_lengths(16, max(lengths))
    split = even_split(ratios)
    plan = pack_step(lengths, pool=pool, micro_tokens=256, cost=COST, split=split)
    seen = []
    for mb in plan.micro_batches:
        assert mb.length in pool and mb.rows * mb.length <= max(256, mb.length)
        assert [len(rs) for rs in mb.ranks] == list(split(mb.rows, mb.length))
        for rows in mb.ranks:
            for row in rows:
                assert sum(lengths[i] for i in row) <= mb.length
                seen.extend(row)
    assert sorted(seen) == list(range(len(lengths)))
    assert plan.tokens == sum(lengths) and 0 <= plan.padding < 0.5


def test_rows_follow_the_ranks_shares_and_long_sequences_spread() -> None:
    """At 3:1, the fast rank gets about three times the tokens; four sequences of a
    full row land on both ranks (each in its own row)."""
    lengths = [64] * 4 + [10] * 40
    plan = pack_step(lengths, pool=(16, 32, 64), micro_tokens=256, cost=COST, split=even_split((0.75, 0.25)))
    tokens = [0, 0]
    long_on = set()
    for mb in plan.micro_batches:
        for r, rows in enumerate(mb.ranks):
            for row in rows:
                tokens[r] += sum(lengths[i] for i in row)
                if any(lengths[i] == 64 for i in row):
                    long_on.add(r)
    assert long_on == {0, 1}
    assert 2.0 <= tokens[0] / tokens[1] <= 4.0


def test_the_cost_model_moves_short_leftovers_up_only_when_cheaper() -> None:
    """Two short sequences move into the long rows' micro-batch when those rows have
    room for them (no row added); they keep 2 short rows of their own when moving would
    add a long row, which costs more."""
    kw = dict(pool=(8, 64), micro_tokens=256, split=even_split((1,)), rows_step=1, cost=LengthCost(1000.0, 4.0))
    room = pack_step([50] * 3 + [6, 6], **kw)
    assert [(mb.length, mb.rows) for mb in room.micro_batches] == [(64, 3)]
    full = pack_step([60] * 3 + [6, 6], **kw)
    assert sorted((mb.length, mb.rows) for mb in full.micro_batches) == [(8, 2), (64, 3)]
    moved = pack_step([60] * 3 + [12], **kw)  # 12 tokens need a 16-row... no 8-row holds them: 64 only
    assert [(mb.length, mb.rows) for mb in moved.micro_batches] == [(64, 4)]


def test_plan_step_refuses_what_it_cannot_place() -> None:
    with pytest.raises(OptionsError, match="longer than the longest row"):
        pack_step([10, 200], pool=(16, 32), micro_tokens=64, cost=COST, split=even_split((1,)))
    with pytest.raises(OptionsError, match="at least one"):
        pack_step([], pool=(16,), micro_tokens=64, cost=COST, split=even_split((1,)))
    with pytest.raises(OptionsError, match="does not sum"):
        pack_step([10], pool=(16,), micro_tokens=64, cost=COST, split=lambda rows, _n: [rows + 1])
    with pytest.raises(OptionsError, match="linear"):
        LengthCost(-1.0, 0.0)


def test_pack_tensors_restarts_positions_and_masks_document_starts() -> None:
    seqs = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    ids, positions, labels = pack_tensors(seqs, [[0, 1]], 8, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    assert labels.tolist() == [[IGNORE, 6, 7, IGNORE, 9, IGNORE, IGNORE, IGNORE]]
    assert counted(labels) == (3 - 1) + (2 - 1)


def test_the_length_cost_is_counted_with_attention_s_square_term() -> None:
    model = hapd.PackedLanguageModel(_gpt2())
    cost = LengthCost.of_model(model, one_row)
    assert cost.linear > 0 and cost.quadratic > 0
    # attention's scores and weighted sum: 2 matmuls × 2 FLOPs × width per token pair and layer
    assert cost.quadratic == pytest.approx(2 * 2 * 2 * 64, rel=0.01)


# -- the packed model ---------------------------------------------------------------------

def _text_config(**overrides):
    from hapd.models.zoo import TextConfig

    return dataclasses.replace(TextConfig.tiny(), dropout=0.0, seq=128, **overrides)


def _gpt2():
    from hapd.models.zoo import build_gpt2

    torch.manual_seed(0)
    return build_gpt2(_text_config())


def _llama():
    from hapd.models.zoo import build_llama

    torch.manual_seed(0)
    return build_llama(_text_config())


def _sequences(lengths: list[int], vocab: int = 128, seed: int = 1) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lengths]


def one_by_one(lm, sequences: list[Tensor]) -> Tensor:
    """The token mean of the sequences' losses, each run alone (no packing, no mask)."""
    total = torch.zeros(())
    for seq in sequences:
        total = total + lm(input_ids=seq[None], labels=seq[None]).loss * (seq.numel() - 1)
    return total / sum(seq.numel() - 1 for seq in sequences)


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_a_packed_row_computes_its_documents_one_by_one(build) -> None:
    lm = build().model
    seqs = _sequences([7, 12, 3, 20])
    packed = hapd.PackedLanguageModel(lm)
    ids, positions, labels = pack_tensors(seqs, [[0, 1, 2], [3]], 32)
    got = packed(ids, positions, labels)
    want = one_by_one(lm, seqs)
    assert got.item() == pytest.approx(want.item(), rel=TOL)


# -- on ranks -----------------------------------------------------------------------------

STEPS = 20
TOKENS = 400
SHORTEST = 16


def _corpus() -> list[Tensor]:
    return _sequences(_lengths(400, seed=5, longest=100))


def _reference(build, steps: int) -> tuple[list[float], dict[str, Tensor], list[list[int]]]:
    """The single device: each step's sequences run one by one; the losses of ``steps``
    Adam steps (and the one after), the first step's gradients, the steps' sequences."""
    # not _exact.single_device / adam_steps: each step has its own sequences, run one by one
    corpus = _corpus()
    order = MixedLengthLoader(sequences=corpus, lengths=[s.numel() for s in corpus], tokens=TOKENS, pool=(SHORTEST,),
                              micro_tokens=1, cost=COST, split=even_split((1,)), rank=0)
    indices, at, chosen = order.order(), 0, []
    for _ in range(steps + 1):
        chosen.append(order.step_sequences(indices, at))
        at += len(chosen[-1])
    lm = build().model
    optimizer = torch.optim.Adam(lm.parameters(), lr=1e-3)
    losses, grads = [], {}
    for k, step in enumerate(chosen):
        optimizer.zero_grad()
        loss = one_by_one(lm, [corpus[i] for i in step])
        losses.append(loss.item())
        if k == steps:
            break
        loss.backward()
        if k == 0:
            grads = {name: p.grad.clone() for name, p in lm.named_parameters(remove_duplicate=False)}
        optimizer.step()
    return losses, grads, chosen


def _rank(rank: int, world: int, build, ratios, steps: int, grads: dict[str, Tensor]) -> dict:
    from hapd.profile.schema import estimated_profile

    corpus = _corpus()
    model = hapd.PackedLanguageModel(build().model)
    example = tuple(t.repeat(4, 1) for t in one_row(32))  # 4 rows of 32 tokens: 128 per micro-batch
    profile = estimated_profile(world, flops=[1e10 * r for r in ratios])
    module = hapd.parallelize(model, example, profile=profile, options={"ratios": list(ratios)}, use_daemon=False,
                              verbose=False)
    # whole micro-batches only (rows_step): one program per row length, the fewest builds
    loader = hapd.mixed_loader(corpus, module, tokens=TOKENS, shortest=SHORTEST, seed=0, rows_step=8)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-3)
    losses, grad_error, splits, sequences = [], 0.0, [], []
    for step in loader:
        optimizer.zero_grad()
        if step.index == steps:
            losses.append(sum(module.global_loss(mb.loss(module)) for mb in step))
            break
        losses.append(step.train(module))
        splits.extend(mb.split for mb in step)
        sequences.append(step.packing.tokens)
        if step.index == 0:
            grad_error = _grad_error(module, grads)
        optimizer.step()
    return {"losses": losses, "grad_error": grad_error, "splits": splits, "shapes": dict(loader.shapes),
            "dispatch_ms": 1e3 * max(loader.dispatch_seconds), "padding": step.packing.padding}


def _grad_error(module, grads: dict[str, Tensor]) -> float:
    """The largest error (:func:`_exact.grad_errors`) of this rank's piece of any gradient."""
    inner = module.inner
    named = dict(inner.named_parameters(remove_duplicate=False))
    expected = {fqn: inner.hapd_view.local_value(tensor, layout, grads[fqn.removeprefix("model.")])
                for fqn, (tensor, layout) in inner.hapd_params.items()}
    return max(grad_errors(expected, {fqn: named[fqn].grad for fqn in expected}, scale=grads).values())


@pytest.mark.parametrize("world,ratios,build", [
    (4, (0.4, 0.3, 0.2, 0.1), _gpt2),
    (2, (0.75, 0.25), _llama),
], ids=["gpt2-4ranks", "llama-2ranks"])
def test_packed_steps_on_uneven_ranks_match_one_device_sequence_by_sequence(world, ratios, build) -> None:
    want, grads, _ = _reference(build, STEPS)
    results = run_ranks(world, _rank, build, ratios, STEPS, grads, timeout=600)
    for r, got in enumerate(results):
        errors = [abs(g - w) / abs(w) for g, w in zip(got["losses"], want)]
        assert len(got["losses"]) == STEPS + 1
        assert errors[0] <= TOL, f"rank {r}: first loss {got['losses'][0]} vs {want[0]}"
        assert max(errors) <= TOL, f"rank {r}: loss errors {errors}"
        assert got["grad_error"] <= TOL, f"rank {r}: gradient error {got['grad_error']}"
    first = results[0]
    # rows followed the plan's uneven split: the fastest rank ran the most rows
    assert sum(s[0] for s in first["splits"]) > sum(s[-1] for s in first["splits"])
    # a handful of programs, each used many times
    assert set(first["shapes"]) <= {(128 // n, n) for n in row_lengths(SHORTEST, 100)}
    print(f"\n{world} ranks: losses {first['losses'][0]:.5f} → {first['losses'][-1]:.5f}, shapes {first['shapes']}, "
          f"dispatch ≤ {max(r['dispatch_ms'] for r in results):.1f} ms/step")


# -- the loader on one process ------------------------------------------------------------

@pytest.fixture(scope="module")
def one_process():
    """Tiny GPT-2, packed, parallelized on one process (4 rows of 32 tokens)."""
    model = hapd.PackedLanguageModel(_gpt2())
    example = tuple(t.repeat(4, 1) for t in one_row(32))
    return hapd.parallelize(model, example, use_daemon=False, verbose=False)


def test_mixed_loader_refuses_what_it_cannot_load(one_process) -> None:
    seqs = _sequences([5, 9, 30])
    with pytest.raises(OptionsError, match="takes the ParallelModule"):
        hapd.mixed_loader(seqs, torch.nn.Linear(2, 2), tokens=64)
    with pytest.raises(OptionsError, match="sequence 1 must be a non-empty 1-D tensor"):
        hapd.mixed_loader([seqs[0], seqs[1][None]], one_process, tokens=64)
    with pytest.raises(OptionsError, match="sequence 2 has 30 tokens, more than longest=16"):
        hapd.mixed_loader(seqs, one_process, tokens=64, longest=16)
    with pytest.raises(OptionsError, match="token budget 0"):
        hapd.mixed_loader(seqs, one_process, tokens=0)
    with pytest.raises(OptionsError, match="packing 'tight'"):
        hapd.mixed_loader(seqs, one_process, tokens=64, packing="tight")
    with pytest.raises(OptionsError, match="no sequences"):
        hapd.mixed_loader([], one_process, tokens=64)


def test_a_loaded_state_resumes_at_the_next_sequence(one_process) -> None:
    """Two steps, the state saved, a new loader with it: its next step is the one the
    first loader would have run next (the same sequences, the same loss), and no
    sequence of the epoch is skipped or run twice."""
    corpus = _sequences(_lengths(60, seed=2, longest=60))
    first = hapd.mixed_loader(corpus, one_process, tokens=200, shortest=16, seed=3)
    steps = iter(first)
    seen = [next(steps).packing.tokens for _ in range(2)]
    state = first.state_dict()
    third = next(steps)
    again = hapd.mixed_loader(corpus, one_process, tokens=200, shortest=16, seed=3)
    again.load_state_dict(state)
    resumed = next(iter(again))
    assert resumed.plan == dataclasses.replace(third.plan, seconds=resumed.packing.seconds)
    assert [mb.inputs[0].tolist() for mb in resumed] == [mb.inputs[0].tolist() for mb in third]
    rest = [s.packing.tokens for s in again]
    assert sum(seen) + third.packing.tokens + sum(rest) == sum(s.numel() for s in corpus)


def test_one_process_trains_the_token_mean_of_the_step(one_process) -> None:
    """On one process a step's loss is the token mean of its sequences run one by one,
    and the padded baseline computes the same loss."""
    corpus = _sequences(_lengths(40, seed=4, longest=60))
    for packing in ("packed", "padded"):
        loader = hapd.mixed_loader(corpus, one_process, tokens=150, shortest=16, seed=1, packing=packing)
        step = next(iter(loader))
        chosen = loader.step_sequences(loader.order(), 0)
        with torch.no_grad():
            got = sum(one_process.global_loss(mb.loss(one_process)) for mb in step)
            want = one_by_one(one_process_model(one_process), [corpus[i] for i in chosen])
        assert got == pytest.approx(want.item(), rel=TOL), packing
        assert step.counted == sum(corpus[i].numel() - 1 for i in chosen)


def one_process_model(module):
    """The transformers model behind a one-process module (its recipe's)."""
    return module._recipe.model.model


def test_row_counts_of_one_row_length_share_one_export() -> None:
    """Shapes that differ only in their rows are cut from one symbolic export of that
    row length (:meth:`~hapd.train.programs.Recipe.export_for`), and the graph cut
    runs the ops a static export at that shape runs (the static one keeps an alias of
    a whole slice the cut drops)."""
    from hapd.train.programs import Recipe

    model = hapd.PackedLanguageModel(_gpt2())
    example = tuple(t.repeat(4, 1) for t in one_row(32))
    recipe = Recipe(model=model, example_inputs=example, batch_dims=(0, 0, 0), name="packed", profile=None,
                    use_daemon=False, verbose=False, device=torch.device("cpu"))
    cut = {rows: recipe.export_for(True, ((rows, 64),) * 3)[1] for rows in (4, 2)}
    symbolic = [k for k in recipe.exported if k[0] == "symbolic"]
    assert symbolic == [("symbolic", True, ((None, 64),) * 3)]
    static = recipe.export(True, ((2, 64),) * 3)[1]

    def ops(graph):
        return [(n["op"], [o["shape"] for o in n["outputs"]]) for n in graph.doc["nodes"]
                if n["kind"] == "op" and n["op"] != "aten.alias"]

    assert ops(cut[2]) == ops(static)
    assert cut[4].graph_id != cut[2].graph_id
