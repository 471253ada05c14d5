"""hapd.spmd.collectives on 1, 2 and 4 Gloo ranks, against single-process references.

Every rank builds the same deterministic full tensors from seeds, so it can compute its
expected output and input gradient locally. The backward check uses the loss
``(out * w[rank]).sum()`` with a known weight per rank (the rank's share of the loss):
the input gradient must then equal what the sum of all ranks' losses gives on one
device, restricted to this rank's layout.

Starting ranks costs seconds, so all checks of one world size run in a single
``run_ranks`` call (``_run_cases``); each check is then reported as its own test.
"""

from __future__ import annotations

import functools
import multiprocessing
import time
import traceback
import warnings
from typing import Callable, Sequence

import pytest
import torch
import torch.distributed as dist

from _dist import run_ranks
from hapd.spmd import collectives as C
from hapd.errors import PlanError

WORLDS = (1, 2, 4)
LENGTHS = {
    1: [(5,), (0,)],
    2: [(3, 1), (0, 4), (2, 2)],
    4: [(2, 0, 1, 3), (0, 0, 5, 0), (1, 1, 1, 1), (0, 0, 0, 0)],
}
"""Uneven splits per world size, with empty shards, all-but-one empty and all empty."""
A2A = {
    1: [(0, 1, (3,), (4,))],
    2: [(0, 1, (3, 1), (1, 4)), (1, 0, (0, 5), (2, 1)), (1, 2, (2, 3), (3, 0)), (2, 1, (4, 1), (1, 2))],
    4: [
        (0, 1, (2, 0, 1, 3), (1, 1, 3, 0)),
        (1, 0, (1, 2, 0, 1), (0, 0, 5, 0)),
        (1, 2, (3, 1, 0, 2), (1, 0, 2, 2)),
        (2, 1, (0, 2, 2, 1), (2, 2, 0, 1)),
    ],
}
"""(src_dim, dst_dim, src_lengths, dst_lengths) per world size."""
BASE_SHAPE = (3, 4, 2)
UNSIGNED = (torch.uint8, torch.uint16, torch.uint32, torch.uint64)
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
GLOO_LACKS = (torch.int16, torch.uint16, torch.uint32, torch.uint64, *FLOAT8)
"""dtypes Gloo refuses ("Invalid scalar type"): the collectives convert them."""
ABS_SUM_MAX = 6.5
"""The largest sum over ranks of |x| of the 16-bit values these seeds give (4 ranks' normals: 6.44)."""
# A sum over W ≤ 4 ranks rounds its W-1 partial sums (each ≤ Σ|x|) to the dtype, the reference its exact sum once:
# at most 4 half-ulps of Σ|x| ≤ ABS_SUM_MAX (8 significant bits: 2**-8; fp16's 11: 2**-11). Copies are exact.
TOLERANCE = {torch.bfloat16: {"atol": 4 * ABS_SUM_MAX * 2**-8, "rtol": 0.0},
             torch.float16: {"atol": 4 * ABS_SUM_MAX * 2**-11, "rtol": 0.0}}

Check = Callable[[int, int], None]


# --- reference data ------------------------------------------------------------------------


def _values(seed: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Deterministic values: normals for 16-bit floats (compared with a tolerance), small
    multiples of 1/4 for other floats (sums are exact in any order), small integers."""
    g = torch.Generator().manual_seed(seed)
    if dtype in TOLERANCE:
        return torch.randn(tuple(shape), generator=g).to(dtype)
    if dtype.is_floating_point:
        return (torch.randint(-16, 17, tuple(shape), generator=g) / 4).to(dtype)
    low = 0 if dtype in UNSIGNED else -50
    return torch.randint(low, 50, tuple(shape), generator=g).to(dtype)


def _sum(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    dtype = parts[0].dtype
    if dtype in TOLERANCE:  # the bound TOLERANCE is derived from
        abs_sum = torch.stack([p.double().abs() for p in parts]).sum(0)
        assert not abs_sum.numel() or float(abs_sum.max()) <= ABS_SUM_MAX, float(abs_sum.max())
    acc = torch.float64 if dtype.is_floating_point else torch.int64
    return torch.stack([p.to(acc) for p in parts]).sum(0).to(dtype)


def _shape(dim: int, size: int, base: Sequence[int] = BASE_SHAPE) -> list[int]:
    shape = list(base)
    shape[dim] = size
    return shape


def _part(t: torch.Tensor, dim: int, lengths: Sequence[int], r: int) -> torch.Tensor:
    return t.narrow(dim, sum(lengths[:r]), lengths[r])


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values with transposed strides (not contiguous when dims 0 and -1 have
    more than one element)."""
    return t.transpose(0, -1).contiguous().transpose(0, -1) if t.dim() >= 2 else t.clone()


def _input(t: torch.Tensor, strided: bool) -> torch.Tensor:
    x = _strided(t) if strided else t.clone()
    if strided and t.dim() >= 2 and t.shape[0] > 1 and t.shape[-1] > 1 and t.numel():
        assert not x.is_contiguous()
    return x.requires_grad_(x.dtype.is_floating_point and x.dtype not in FLOAT8)


def _exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` in a dtype ``torch.equal`` supports (float8 has no comparison kernels)."""
    return t.float() if t.dtype in FLOAT8 else t


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {list(actual.shape)}, expected {list(expected.shape)}"
    if expected.dtype in TOLERANCE:
        torch.testing.assert_close(actual.double(), expected.double(), **TOLERANCE[expected.dtype], msg=what)
    else:
        assert torch.equal(_exact(actual), _exact(expected)), f"{what}:\n{actual}\n!=\n{expected}"


def _run(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` checked against ``expected``; ``x`` must be left unchanged and not aliased."""
    before = x.detach().clone()
    out = fn(x)
    _assert_same(out, expected, "forward")
    assert torch.equal(_exact(x.detach()), _exact(before)), "input modified"
    if out.numel():
        assert out.untyped_storage().data_ptr() != x.untyped_storage().data_ptr(), "output aliases the input"
        assert out.is_contiguous(), "output not contiguous"
    return out


def _backward(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, expected: torch.Tensor) -> None:
    """Backpropagate this rank's loss ``(out * w).sum()`` and compare ``x.grad``."""
    if not x.requires_grad:
        return
    (out * w).sum().backward()
    _assert_same(x.grad, expected, "gradient")


# --- checks (each runs on every rank) ------------------------------------------------------


def check_all_gather(rank, world, *, lengths, dim, dtype, grouped, strided=False):
    full = _values(1, _shape(dim, sum(lengths)), dtype)
    x = _input(_part(full, dim, lengths, rank), strided)
    out = _run(lambda t: C.all_gather(t, dim, lengths, grouped=grouped), x, full)
    ws = [_values(100 + k, full.shape, dtype) for k in range(world)]
    _backward(out, x, ws[rank], _part(_sum(ws), dim, lengths, rank))


def check_reduce_scatter(rank, world, *, lengths, dim, dtype, grouped, strided=False):
    parts = [_values(10 + k, _shape(dim, sum(lengths)), dtype) for k in range(world)]
    x = _input(parts[rank], strided)
    out = _run(lambda t: C.reduce_scatter(t, dim, lengths, grouped=grouped), x, _part(_sum(parts), dim, lengths, rank))
    ws = [_values(200 + r, _shape(dim, n), dtype) for r, n in enumerate(lengths)]
    _backward(out, x, ws[rank], torch.cat(ws, dim))


def check_all_reduce(rank, world, *, shape, dtype, strided=False):
    parts = [_values(20 + k, shape, dtype) for k in range(world)]
    x = _input(parts[rank], strided)
    out = _run(lambda t: C.all_reduce(t), x, _sum(parts))
    ws = [_values(300 + k, shape, dtype) for k in range(world)]
    _backward(out, x, ws[rank], _sum(ws))


def check_all_to_all(rank, world, *, src_dim, dst_dim, src_lengths, dst_lengths, dtype, strided=False):
    shape = _shape(dst_dim, sum(dst_lengths), _shape(src_dim, sum(src_lengths)))
    full = _values(2, shape, dtype)
    x = _input(_part(full, src_dim, src_lengths, rank), strided)
    expected = _part(full, dst_dim, dst_lengths, rank)
    out = _run(lambda t: C.all_to_all(t, src_dim, dst_dim, src_lengths, dst_lengths), x, expected)
    ws = [_values(400 + r, _part(full, dst_dim, dst_lengths, r).shape, dtype) for r in range(world)]
    _backward(out, x, ws[rank], _part(torch.cat(ws, dst_dim), src_dim, src_lengths, rank))


def check_replicate(rank, world, *, dtype):
    full = _values(3, BASE_SHAPE, dtype)
    x = _input(full, False)
    out = _run(lambda t: C.replicate(t), x, full)
    ws = [_values(500 + k, BASE_SHAPE, dtype) for k in range(world)]
    _backward(out, x, ws[rank], _sum(ws))


def check_dynamic_slice(rank, world, *, lengths, dim, dtype, strided=False):
    full = _values(4, _shape(dim, sum(lengths)), dtype)
    x = _input(full, strided)
    out = _run(lambda t: C.dynamic_slice(t, dim, lengths), x, _part(full, dim, lengths, rank))
    w = _values(600 + rank, out.shape, dtype)
    grad = torch.zeros_like(full)
    _part(grad, dim, lengths, rank).copy_(w)
    _backward(out, x, w, grad)


def check_mask_to_rank_zero(rank, world, *, dtype):
    full = _values(5, BASE_SHAPE, dtype)
    x = _input(full, False)
    out = _run(lambda t: C.mask_to_rank_zero(t), x, full if rank == 0 else torch.zeros_like(full))
    w = _values(700 + rank, BASE_SHAPE, dtype)
    _backward(out, x, w, w if rank == 0 else torch.zeros_like(w))


def check_gather_then_scatter(rank, world, *, lengths):
    """all_gather then reduce_scatter of a replicated value: the shard times the world size."""
    full = _values(6, _shape(1, sum(lengths)), torch.float64)
    x = _part(full, 1, lengths, rank).clone()
    out = C.reduce_scatter(C.all_gather(x, 1, lengths), 1, lengths, grouped=True)
    _assert_same(out, x * world, "round trip")


def check_expanded_grad(rank, world, *, lengths):
    """``out.sum()`` hands each backward an expanded (stride 0) gradient of ones."""
    dim, other = 1, sum(lengths) + 1
    full = _values(8, [2, sum(lengths), other], torch.float32)
    shard = _part(full, dim, lengths, rank)
    calls = {
        "all_gather": (lambda t: C.all_gather(t, dim, lengths), shard, world),
        "all_gather grouped": (lambda t: C.all_gather(t, dim, lengths, grouped=True), shard, world),
        "reduce_scatter": (lambda t: C.reduce_scatter(t, dim, lengths), full, 1),
        "reduce_scatter grouped": (lambda t: C.reduce_scatter(t, dim, lengths, grouped=True), full, 1),
        "all_reduce": (lambda t: C.all_reduce(t), full, world),
        "all_to_all": (lambda t: C.all_to_all(t, dim, 2, lengths, [other] + [0] * (world - 1)), shard, 1),
    }
    for name, (fn, value, scale) in calls.items():
        x = value.clone().requires_grad_()
        fn(x).sum().backward()
        _assert_same(x.grad, torch.full_like(x, scale), f"{name} gradient")


def check_double_backward(rank, world, *, lengths, grouped):
    """Second derivatives through all_gather and reduce_scatter: with the per-rank losses
    ``(out² · w).sum()`` the first gradients are ``2·x·W``-like, and backpropagating
    ``(grad · v).sum()`` through them must give ``2·W·v`` on the right layout."""
    dtype, dim = torch.float64, 1
    full = _values(7, _shape(dim, sum(lengths)), dtype)
    x = _part(full, dim, lengths, rank).clone().requires_grad_()
    ws = [_values(800 + k, full.shape, dtype) for k in range(world)]
    vs = [_values(900 + r, _part(full, dim, lengths, r).shape, dtype) for r in range(world)]
    out = C.all_gather(x, dim, lengths, grouped=grouped)
    (grad,) = torch.autograd.grad((out * out * ws[rank]).sum(), x, create_graph=True)
    (grad * vs[rank]).sum().backward()
    _assert_same(x.grad, 2 * _part(_sum(ws), dim, lengths, rank) * vs[rank], "all_gather second derivative")

    parts = [_values(30 + k, full.shape, dtype) for k in range(world)]
    x = parts[rank].clone().requires_grad_()
    ws = [_values(1000 + r, _part(full, dim, lengths, r).shape, dtype) for r in range(world)]
    vs = [_values(1100 + k, full.shape, dtype) for k in range(world)]
    out = C.reduce_scatter(x, dim, lengths, grouped=grouped)
    (grad,) = torch.autograd.grad((out * out * ws[rank]).sum(), x, create_graph=True)
    (grad * vs[rank]).sum().backward()
    _assert_same(x.grad, 2 * torch.cat(ws, dim) * _sum(vs), "reduce_scatter second derivative")


def check_plan_error(rank, world, *, call, words):
    """``call()`` raises PlanError before communicating, naming ``words``."""
    try:
        call()
    except PlanError as exc:
        missing = [w for w in words if w not in str(exc)]
        assert not missing, f"PlanError {str(exc)!r} does not mention {missing}"
    else:
        raise AssertionError("no PlanError")


def _error_cases(world: int) -> dict[str, tuple[Callable[[], object], list[str]]]:
    """Bad calls and the words their PlanError must contain; bad on every rank alike."""
    x = torch.zeros(7, 3, 2)
    even = [2] * world
    count = [1] * (world + 1)
    negative = [-1] + [8] * (world - 1)
    first = [3] + [0] * (world - 1)
    ag, rs, ds, a2a = C.all_gather, C.reduce_scatter, C.dynamic_slice, C.all_to_all
    return {
        "all_gather count": (lambda: ag(x, 0, count), ["all_gather", "dim 0", str(count), f"{world} ranks"]),
        "all_gather negative": (lambda: ag(x, 1, negative), ["all_gather", "dim 1", str(negative)]),
        "all_gather non-int": (lambda: ag(x, 0, [1.5] * world), ["all_gather", "dim 0", "1.5"]),
        "all_gather shard size": (lambda: ag(x, 0, even), ["all_gather", "dim 0", "7", str(even)]),
        "all_gather dim high": (lambda: ag(x, 3, even), ["all_gather", "dim 3", "3-d"]),
        "all_gather dim low": (lambda: ag(x, -4, even), ["all_gather", "dim -4"]),
        "reduce_scatter sum": (lambda: rs(x, 0, even), ["reduce_scatter", "dim 0", "7", str(even), str(2 * world)]),
        "reduce_scatter count": (lambda: rs(x, -1, count, grouped=True), ["reduce_scatter", "dim 2", str(count)]),
        "reduce_scatter dim": (lambda: rs(x, 5, even), ["reduce_scatter", "dim 5"]),
        "dynamic_slice sum": (lambda: ds(x, 1, even), ["dynamic_slice", "dim 1", "3", str(even)]),
        "dynamic_slice negative": (lambda: ds(x, 0, negative), ["dynamic_slice", "dim 0", str(negative)]),
        "all_to_all same dim": (lambda: a2a(x, 0, -3, even, even), ["all_to_all", "dim 0"]),
        "all_to_all src size": (lambda: a2a(x, 0, 1, even, first), ["all_to_all", "dim 0", "7", str(even)]),
        "all_to_all dst sum": (lambda: a2a(x, 1, 0, [3] * world, even), ["all_to_all", "dim 0", "7", str(even)]),
        "all_to_all dst dim": (lambda: a2a(x, 0, 3, even, even), ["all_to_all", "dim 3"]),
        "all_to_all count": (lambda: a2a(x, 0, 1, count, even), ["all_to_all", "dim 0", str(count)]),
    }


def _cases(world: int) -> dict[str, Check]:
    """Every check for ``world`` ranks, by name (the same on every rank and in the parent)."""
    cases: dict[str, Check] = {}

    def add(name: str, fn: Callable[..., None], **kwargs) -> None:
        assert name not in cases, name
        cases[name] = functools.partial(fn, **kwargs)

    lengths_sets = LENGTHS[world]
    for lengths in lengths_sets:
        for dim in (0, 1, -1):
            for grouped in (False, True):
                variant = "grouped" if grouped else "padded"
                kw = {"lengths": lengths, "dim": dim, "grouped": grouped, "dtype": torch.float32}
                add(f"all_gather {variant} {list(lengths)} dim {dim}", check_all_gather, **kw)
                add(f"reduce_scatter {variant} {list(lengths)} dim {dim}", check_reduce_scatter, **kw)
        add(f"dynamic_slice {list(lengths)}", check_dynamic_slice, lengths=lengths, dim=1, dtype=torch.float32)
        add(f"gather then scatter {list(lengths)}", check_gather_then_scatter, lengths=lengths)
        add(f"expanded gradient {list(lengths)}", check_expanded_grad, lengths=lengths)
        for grouped in (False, True):
            add(f"double backward {'grouped' if grouped else 'padded'} {list(lengths)}", check_double_backward,
                lengths=lengths, grouped=grouped)
    uneven = lengths_sets[0]
    for grouped in (False, True):
        variant = "grouped" if grouped else "padded"
        kw = {"lengths": uneven, "grouped": grouped}
        for dtype in (torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8, *GLOO_LACKS):
            add(f"all_gather {variant} {dtype}", check_all_gather, dim=1, dtype=dtype, **kw)
            add(f"reduce_scatter {variant} {dtype}", check_reduce_scatter, dim=1, dtype=dtype, **kw)
        add(f"all_gather {variant} bool", check_all_gather, dim=0, dtype=torch.bool, **kw)
        add(f"all_gather {variant} strided", check_all_gather, dim=0, dtype=torch.float32, strided=True, **kw)
        add(f"reduce_scatter {variant} strided", check_reduce_scatter, dim=2, dtype=torch.float32, strided=True, **kw)
    for src_dim, dst_dim, src_lengths, dst_lengths in A2A[world]:
        kw = {"src_dim": src_dim, "dst_dim": dst_dim, "src_lengths": src_lengths, "dst_lengths": dst_lengths}
        name = f"all_to_all {src_dim}->{dst_dim} {list(src_lengths)}->{list(dst_lengths)}"
        add(name, check_all_to_all, dtype=torch.float32, **kw)
        add(f"{name} strided", check_all_to_all, dtype=torch.float32, strided=True, **kw)
    a2a = A2A[world][0]
    kw = dict(zip(("src_dim", "dst_dim", "src_lengths", "dst_lengths"), a2a))
    for dtype in (torch.float64, torch.bfloat16, torch.float16, torch.int64, *GLOO_LACKS):
        add(f"all_to_all {dtype}", check_all_to_all, dtype=dtype, **kw)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, *GLOO_LACKS):
        add(f"all_reduce {dtype}", check_all_reduce, shape=BASE_SHAPE, dtype=dtype)
    add("all_reduce scalar", check_all_reduce, shape=(), dtype=torch.float32)
    add("all_reduce empty", check_all_reduce, shape=(0, 3), dtype=torch.float32)
    add("all_reduce strided", check_all_reduce, shape=BASE_SHAPE, dtype=torch.float32, strided=True)
    for dtype in (torch.float32, torch.bfloat16):
        add(f"replicate {dtype}", check_replicate, dtype=dtype)
        add(f"mask_to_rank_zero {dtype}", check_mask_to_rank_zero, dtype=dtype)
    add("mask_to_rank_zero int64", check_mask_to_rank_zero, dtype=torch.int64)
    for dtype in (torch.int64, torch.bfloat16, torch.float8_e4m3fn):
        add(f"dynamic_slice {dtype}", check_dynamic_slice, lengths=uneven, dim=0, dtype=dtype)
    add("dynamic_slice strided", check_dynamic_slice, lengths=uneven, dim=-1, dtype=torch.float32, strided=True)
    for name, (call, words) in _error_cases(world).items():
        add(f"PlanError {name}", check_plan_error, call=call, words=words)
    return cases


def _run_cases(rank: int, world: int) -> tuple[int, dict[str, str | None]]:
    """Runs on each rank: every case, warnings as errors; failures as traceback text."""
    assert dist.get_world_size() == world and dist.get_rank() == rank
    outcome: dict[str, str | None] = {}
    for name, check in _cases(world).items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                check(rank, world)
            outcome[name] = None
        except Exception:
            outcome[name] = traceback.format_exc()
    return rank, outcome


# --- tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def outcomes() -> Callable[[int], list[tuple[int, dict[str, str | None]]]]:
    """``outcomes(world)``: every rank's ``_run_cases`` result, from one run per world size."""
    cache: dict[int, object] = {}

    def get(world: int):
        if world not in cache:
            try:
                cache[world] = run_ranks(world, _run_cases, timeout=90)
            except AssertionError as exc:
                cache[world] = exc
        if isinstance(cache[world], AssertionError):
            raise cache[world]
        return cache[world]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize("world,case", [(w, c) for w in WORLDS for c in _cases(w)], ids=lambda v: str(v))
def test_collective(outcomes, world: int, case: str) -> None:
    per_rank = outcomes(world)
    assert [r for r, _ in per_rank] == list(range(world)), "run_ranks returned the ranks out of order"
    failures = [f"--- rank {r} ---\n{result[case]}" for r, result in per_rank if result[case]]
    assert not failures, f"{case} on {world} ranks failed:\n" + "\n".join(failures)


def _fail_on_rank_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # never completes: rank 1 is gone; run_ranks must kill this rank


def _sleep(rank: int, world: int) -> None:
    time.sleep(600)


def _hapd_children() -> list[str]:
    return [p.name for p in multiprocessing.active_children() if p.name.startswith("hapd-rank")]


@pytest.mark.distributed
def test_run_ranks_reports_a_failing_rank() -> None:
    """The failure is reported as it happens (not as a timeout) and the rank blocked on
    the failed one is killed."""
    with pytest.raises(AssertionError) as info:
        run_ranks(2, _fail_on_rank_one)
    message = str(info.value)
    assert "rank 1 of 2 failed" in message and "did not finish" not in message
    assert "Traceback" in message and "ValueError: boom on rank 1" in message
    assert _hapd_children() == []


@pytest.mark.distributed
def test_run_ranks_times_out() -> None:
    with pytest.raises(AssertionError, match="did not finish within 4 s"):
        run_ranks(1, _sleep, timeout=4)
    assert _hapd_children() == []
