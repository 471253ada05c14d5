"""A batch run in parts draws the single-device masks: an overlapped run's two duplicas
and a pipeline's micro-batches each draw their rows of the whole batch's dropout masks
(:class:`hapd.spmd.random.random_ops.DrawParts`), so both train exactly as one device
with dropout on — against the single-device program drawing with hapd's generator
(:func:`~hapd.spmd.random.random_ops.counter_reference`)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _exact import TOL, Spec, grad_errors, make_cases, run_cases, worst

import hapd
import hapd.models as M
from hapd.compiler.pipeline.stages import split_program
from hapd.profile.schema import estimated_profile
from hapd.spmd.random.random_ops import (
    CounterAttention,
    CounterDropout,
    DrawParts,
    apply_draw_parts,
    counter_reference,
    random_batch_dims,
    set_part,
)

SEED, STREAM = 11, 3


def _whole_and_parts(global_shape: list[int], dim: int, parts: int, offsets_other: int = 0) -> tuple[Any, Any]:
    """The whole draw's mask and the masks of ``parts`` equal parts along ``dim``, each
    drawn by a module whose program sees only its part."""
    step = torch.tensor(5)
    whole = CounterDropout(0.3, True, STREAM, global_shape, [0] * len(global_shape), SEED)
    _, want = whole(torch.ones(global_shape), step, torch.tensor(0))
    part_shape = list(global_shape)
    part_shape[dim] //= parts
    got = []
    for k in range(parts):
        module = CounterDropout(0.3, True, STREAM, part_shape, [0] * len(part_shape), SEED)
        apply_draw_parts(module, DrawParts(parts, (dim,), STREAM))
        set_part(_Holder(module), k)
        got.append(module(torch.ones(part_shape), step, torch.tensor(k))[1])
    return want, torch.cat(got, dim)


class _Holder(torch.nn.Module):
    """What :func:`set_part` sets the part of: a module with the step buffer."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner
        self.register_buffer("hapd_rng_step", torch.tensor(0))


@pytest.mark.parametrize("shape,dim,parts", [([8, 5, 6], 0, 2), ([8, 5, 6], 0, 4), ([3, 8, 4], 1, 2)])
def test_the_parts_of_a_batch_draw_the_whole_batchs_mask(shape, dim, parts) -> None:
    want, got = _whole_and_parts(shape, dim, parts)
    assert torch.equal(got, want)
    assert 0.5 < float(want.float().mean()) < 0.9  # a real draw at p = 0.3


def test_duplicas_and_unknown_dims() -> None:
    """A duplica's index places it as a micro-batch's does; a random op whose samples'
    dim is not known draws a mask of its own per part (not the whole batch's rows)."""
    step, shape = torch.tensor(2), [4, 6]
    whole = CounterDropout(0.5, True, STREAM, [8, 6], [0, 0], SEED)
    _, want = whole(torch.ones(8, 6), step, torch.tensor(0))
    half = CounterDropout(0.5, True, STREAM, shape, [0, 0], SEED)
    apply_draw_parts(half, DrawParts(2, (0,), STREAM))
    got = torch.cat([half(torch.ones(shape), step, torch.tensor(0), d)[1] for d in (0, 1)])
    assert torch.equal(got, want)
    apply_draw_parts(half, DrawParts(2, (None,), STREAM))
    own = torch.cat([half(torch.ones(shape), step, torch.tensor(0), d)[1] for d in (0, 1)])
    assert not torch.equal(own, want)


def test_an_attentions_parts_draw_the_whole_batchs_probabilities() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 2, 6, 8) for _ in range(3))
    step = torch.tensor(1)
    whole = CounterAttention(0.2, STREAM, [4, 2, 6, 6], [0, 0, 0, 0], SEED, is_causal=True, scale=None,
                             enable_gqa=False)
    want = whole(q, k, v, None, step, torch.tensor(0))
    half = CounterAttention(0.2, STREAM, [2, 2, 6, 6], [0, 0, 0, 0], SEED, is_causal=True, scale=None,
                            enable_gqa=False)
    apply_draw_parts(half, DrawParts(2, (0,), STREAM))
    got = torch.cat([half(q[2 * d:2 * d + 2], k[2 * d:2 * d + 2], v[2 * d:2 * d + 2], None, step, torch.tensor(0), d)
                     for d in (0, 1)])
    torch.testing.assert_close(got, want, rtol=0.0, atol=0.0)


def test_the_samples_dim_of_each_random_op() -> None:
    """Read from a program exported with a symbolic batch, and dim 0 of a batch-first
    static one: every dropout and the attention of a GPT-2 block hold the samples in dim 0."""
    model, config = M.build("gpt2_block", "tiny", dropout=0.1)
    inputs = M.get("gpt2_block").example_inputs(config, 4)
    static = hapd.export(model, inputs)
    dims = random_batch_dims(static, 4)
    assert len(dims) >= 3 and set(dims) == {0}
    assert random_batch_dims(static, 3) == (None,) * len(dims)  # 4 samples are no multiple of 3
    symbolic = hapd.export(model, inputs, symbolic_batch=True)
    assert random_batch_dims(symbolic) == dims


# --------------------------------------------------------------------------------------
# On ranks: a pipeline's micro-batches and an overlapped run's duplicas
# --------------------------------------------------------------------------------------

BATCH, STEPS = 8, 2


def _pipeline_rank(rank: int, world: int) -> dict[str, Any]:
    """GPT-2 blocks with dropout 0.1 in 2 stages of one rank each, 4 micro-batches,
    against the single-device program on the whole batch drawing with hapd's generator."""
    import torch.distributed as dist

    from hapd.spmd.pipeline import PipelineRank

    torch.manual_seed(0)
    model, config = M.build("gpt2_block", "tiny", dropout=0.1)
    inputs = M.get("gpt2_block").example_inputs(config, BATCH)
    m = 4
    reference = counter_reference(hapd.export(copy.deepcopy(model), inputs), seed=0)
    program = hapd.export(model, tuple(t.narrow(0, 0, BATCH // m) for t in inputs))
    ops = [n["name"] for n in hapd.lower(program).doc["nodes"] if n.get("kind") == "op" and n.get("block")]
    stages, boundaries = split_program(program, [ops[len(ops) // 2]])
    plans = [hapd.compile(hapd.lower(st.program, name=f"stage{st.index}"), estimated_profile(1)) for st in stages]
    pipe = PipelineRank(stages, boundaries, plans, [[0], [1]], m, [0] * len(inputs))
    optimizer = torch.optim.Adam(pipe.parameters(), lr=1e-3)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-3)
    losses, errors = [], {}
    for step in range(STEPS + 1):
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        total = pipe.step(*inputs).detach().double()
        dist.all_reduce(total)
        expected = reference(*inputs)
        losses.append((float(total), float(expected)))
        expected.backward()
        if step == 0:
            full = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False) if p.grad is not None}
            mine = dict(pipe.module.named_parameters(remove_duplicate=False))
            want = {fqn: full[fqn] for fqn in pipe.module.hapd_params if fqn in full}
            errors = grad_errors(want, {fqn: mine[fqn].grad for fqn in want}, scale=full)
        optimizer.step()
        ref_optimizer.step()
    draws = [(d.stream, d.parts, d.batch_dim) for d in pipe.module.modules() if isinstance(d, CounterDropout)]
    return {"losses": losses, "grads": errors, "stage": pipe.s, "draws": draws}


@pytest.mark.distributed
def test_pipeline_micro_batches_draw_the_single_device_masks() -> None:
    ranks = run_ranks(2, _pipeline_rank, timeout=300)
    streams = sorted(d[0] for r in ranks for d in r["draws"])
    assert streams == list(range(len(streams))) and len(streams) >= 3, ranks  # the whole program's streams
    for r in ranks:
        assert all(parts == 4 and dim == 0 for _, parts, dim in r["draws"]), r["draws"]
        assert r["grads"], r
        assert max(r["grads"].values()) <= TOL, r["grads"]
        for got, want in r["losses"]:
            assert abs(got - want) <= TOL * abs(want), r["losses"]


def _bert_with_dropout() -> tuple[Any, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    model, config = M.build("bert", "tiny", dropout=0.1)
    return model, M.get("bert").example_inputs(config, BATCH)


@pytest.mark.distributed
def test_overlapped_duplicas_draw_the_single_device_masks() -> None:
    spec = Spec("bert-dropout/overlap", _bert_with_dropout, "auto", None, frozenset(), True)
    results = run_cases(make_cases([spec], (0.75, 0.25), STEPS), 2)
    for r in results:
        assert worst(r) <= TOL, r
