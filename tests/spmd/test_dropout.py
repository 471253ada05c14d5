"""Dropout on split tensors: each rank draws exactly its slice of the single-device mask.

The counter-based generator (:mod:`hapd.spmd.random.counter_rng`) gives any piece of a
random tensor without the rest; the core splits ``native_dropout`` like an element-wise
op (``rustcore/core/src/rules/random.rs``), and the ranks' loss, gradients and
parameters after Adam steps equal the single-device program run with the same generator
(:func:`hapd.spmd.random.random_ops.counter_reference`), on uneven ratios, with a searched
and a forced tensor-parallel plan, and with recomputation.
"""

from __future__ import annotations

import math

import functools

import pytest
import torch
from _dist import run_ranks
from _exact import Case, _alternate, _merge, _ops, assert_exact, assert_rules_ran, reference, run_cases
from torch import nn

import hapd
from hapd import models
from hapd.compiler.options import CompileOptions
from hapd.profile.schema import estimated_profile
from hapd.spmd.random.counter_rng import splitmix64, uniform
from hapd.spmd.random.random_ops import STEP, CounterAttention, CounterRandom, counter_reference

STEPS = 5
"""Adam steps after the first gradients."""

# --------------------------------------------------------------------------- the generator


def test_the_generator_gives_splitmix64s_published_outputs() -> None:
    """SplitMix64 seeded with 0 (the reference C code's first three outputs), and a state
    whose arithmetic wraps past 2**64."""
    assert splitmix64(0, 3) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert splitmix64((1 << 64) - 1, 2) == _splitmix64_by_hand((1 << 64) - 1, 2)


def _splitmix64_by_hand(state: int, count: int) -> list[int]:
    """SplitMix64 in Python's unbounded integers, masked to 64 bits."""
    m, out = (1 << 64) - 1, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & m
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        out.append(z ^ (z >> 31))
    return out


def test_a_large_cpu_draw_in_chunks_has_the_whole_tensor_ops_bits() -> None:
    """Past :data:`~hapd.spmd.random.counter_rng.CHUNK` elements a CPU draw runs in place
    chunk by chunk: the bits are the whole-tensor ops', on a piece at offsets, for a
    seed past 2**63 and a last chunk cut short."""
    from hapd.spmd.random import counter_rng

    g, offsets, local = [9, 3, 100, 90], [3, 1, 5, 0], [5, 2, 95, 90]  # 85,500 elements: 2 whole chunks and a part
    assert math.prod(local) > 2 * counter_rng.CHUNK
    for seed in (0, (1 << 63) + 5):
        index = counter_rng.global_index(g, offsets, local)
        draw = torch.tensor((11 << (2 * counter_rng.STREAM_BITS)) | (3 << counter_rng.STREAM_BITS) | 9)
        seeded = counter_rng.mix64(torch.tensor(counter_rng._signed(seed), dtype=torch.int64))
        base = counter_rng.mix64(seeded + draw * counter_rng._signed(counter_rng._GAMMA))
        words = counter_rng.mix64(base + (index + 1) * counter_rng._signed(counter_rng._GAMMA))
        whole = (counter_rng._shr(words, 40).to(torch.float32) * (1.0 / (1 << 24)))
        assert torch.equal(uniform(seed, 9, 11, g, offsets, local, part=3), whole)


@pytest.mark.parametrize("shape,dim,lengths", [((7, 5, 3), 0, (3, 4)), ((7, 5, 3), 1, (1, 2, 2)),
                                               ((4, 9), 1, (5, 0, 4)), ((6, 4, 3), 2, (2, 1))])
def test_pieces_concatenate_to_the_whole_draw(shape, dim, lengths) -> None:
    whole = uniform(11, 3, 2, shape, [0] * len(shape), shape)
    pieces, start = [], 0
    for length in lengths:
        offsets = [0] * len(shape)
        offsets[dim] = start
        local = list(shape)
        local[dim] = length
        pieces.append(uniform(11, 3, torch.tensor(2), shape, offsets, local))
        start += length
    assert torch.equal(torch.cat(pieces, dim), whole)


def test_draws_look_uniform_and_differ_by_stream_and_step() -> None:
    shape = (200, 500)
    u = uniform(5, 0, 0, shape, [0, 0], shape)
    assert u.dtype == torch.float32 and 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.01
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float((counts / u.numel() - 0.1).abs().max()) < 0.005
    others = [uniform(5, 1, 0, shape, [0, 0], shape), uniform(5, 0, 1, shape, [0, 0], shape),
              uniform(6, 0, 0, shape, [0, 0], shape), uniform(5, 0, 0, shape, [0, 0], shape, part=1)]
    for other in others:
        assert float((other == u).float().mean()) < 0.001


def test_the_reference_drops_as_native_dropout_does_and_advances_its_step() -> None:
    x = torch.ones(64, 128)
    program = hapd.export(_Sum(nn.Dropout(0.25)).train(), (x,))
    ref = counter_reference(program, seed=0)
    first, second = ref(x), ref(x)
    assert int(getattr(ref, STEP)) == 2 and STEP not in ref.state_dict()
    assert float(first) != float(second)  # another step, other masks
    assert torch.equal(counter_reference(program, seed=0)(x), first)  # a pure function of seed and step
    kept = float(first) * 0.75 / x.numel()  # each kept element contributes 1 / (1 - p)
    assert abs(kept - 0.75) < 0.02


class _Sum(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x).sum()


# --------------------------------------------------------------------------- attention


def _attention(p: float, *, causal: bool = False, scale: float | None = None, gqa: bool = False,
               shape=(2, 4, 6, 8), keys: int = 6, offsets=(0, 0, 0, 0), global_shape=None) -> CounterAttention:
    g = list(global_shape or (*shape[:-1], keys))
    return CounterAttention(p, 2, g, list(offsets), 7, is_causal=causal, scale=scale, enable_gqa=gqa)


@pytest.mark.parametrize("kind", ["plain", "causal", "bool mask", "float mask", "scale", "grouped query"])
def test_counter_attention_is_torchs_attention_when_nothing_drops(kind) -> None:
    """With a probability so small that no element drops, the math attention equals
    torch's ``scaled_dot_product_attention`` (masks, causal, scale, grouped query)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64)
    kv_heads = 2 if kind == "grouped query" else 4
    k, v = (torch.randn(2, kv_heads, 6, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = None
    if kind == "bool mask":
        mask = torch.rand(2, 1, 6, 6, generator=g) > 0.3
        mask[..., 0] = True
    elif kind == "float mask":
        mask = torch.randn(2, 4, 6, 6, generator=g, dtype=torch.float64)
    options = {"causal": kind == "causal", "scale": 0.3 if kind == "scale" else None, "gqa": kind == "grouped query"}
    got = _attention(1e-12, **options)(q, k, v, mask, torch.tensor(1), torch.tensor(0))
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=options["causal"], scale=options["scale"], enable_gqa=options["gqa"])
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_a_fully_masked_row_gives_zeros_not_nan() -> None:
    q = k = v = torch.ones(1, 1, 3, 4)
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False
    out = _attention(0.5, shape=(1, 1, 3, 4), keys=3)(q, k, v, mask, torch.tensor(0), torch.tensor(0))
    assert not out.isnan().any() and torch.equal(out[0, 0, 1], torch.zeros(4))


@pytest.mark.parametrize("dim,lengths", [(0, (1, 2)), (1, (3, 1)), (2, (2, 0, 4))])
def test_attention_pieces_concatenate_to_the_whole_attention(dim, lengths) -> None:
    """Split along the batch, the heads or the queries, each piece drops its slice of
    the single-device probabilities: the pieces' outputs are the whole output."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 4, 6, 8, generator=g) for _ in range(3))
    step, part = torch.tensor(3), torch.tensor(0)
    whole = _attention(0.3, shape=(3, 4, 6, 8))(q, k, v, None, step, part)
    pieces, start = [], 0
    for length in lengths:
        offsets = [0, 0, 0, 0]
        offsets[dim] = start
        index = torch.arange(start, start + length)
        kk, vv = (k, v) if dim == 2 else (k.index_select(dim, index), v.index_select(dim, index))
        piece = _attention(0.3, offsets=offsets, global_shape=(3, 4, 6, 6))
        pieces.append(piece(q.index_select(dim, index), kk, vv, None, step, part))
        start += length
    torch.testing.assert_close(torch.cat(pieces, dim), whole)
    assert not torch.equal(whole, _attention(1e-12, shape=(3, 4, 6, 8))(q, k, v, None, step, part))


class _SelfAttention(nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p, self.proj = p, nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(2, 24, 4, 8).transpose(1, 2)
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, dropout_p=self.p, is_causal=True).sum()


def test_lowering_counts_the_memory_the_math_attention_keeps() -> None:
    """What the runtime's attention with dropout keeps for the backward pass beyond its
    operands (probabilities, dropped probabilities, the bool keep mask) is what lowering
    adds to the fused attention's saved bytes."""
    scores = 2 * 4 * 24 * 24
    q, k, v = (torch.randn(2, 4, 24, 8, requires_grad=True) for _ in range(3))
    operands = {t.untyped_storage().data_ptr() for t in (q, k, v)}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in operands:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _attention(0.1, causal=True, shape=(2, 4, 24, 8), keys=24)(q, k, v, None, torch.tensor(0), torch.tensor(0))
    # beyond the per-score tensors: the causal triangle and the fully-masked rows, a byte
    # per query-key pair and per row
    assert sum(kept.values()) == scores * (2 * 4 + 1) + 24 * 24 + 2 * 4 * 24

    def attention_bytes(p: float) -> tuple[float, float]:
        graph = hapd.lower(hapd.export(_SelfAttention(p), (torch.randn(2, 24, 32),)))
        (node,) = [n for n in graph.doc["nodes"] if n.get("op") == "aten.scaled_dot_product_attention"]
        return node["saved_bytes"], node.get("counter_saved_bytes", 0.0)

    # the fused kernel keeps its log-sum-exp (a float per query, 24 padded to 32) and its
    # generator's seed and offset (two int64), never the probabilities; the math
    # attention's bytes count apart, kept only where hapd's generator draws
    fused = 2 * 4 * 32 * 4 + 2 * 8
    assert attention_bytes(0.0) == (fused, 0.0)
    assert attention_bytes(0.1) == (fused, scores * (2 * 4 + 1))


# --------------------------------------------------------------------------- bernoulli, rand_like, randn_like


def _draw(op: str, shape, *, offsets=None, global_shape=None, p=None, dtype=torch.float32) -> CounterRandom:
    return CounterRandom(op, 4, list(global_shape or shape), list(offsets or [0] * len(shape)), 9, dtype=dtype, p=p)


def test_random_draws_have_their_distributions() -> None:
    shape, step, part = (300, 400), torch.tensor(1), torch.tensor(0)
    x = torch.full(shape, 0.3)
    normal = _draw("randn_like", shape)(x, step, part)
    assert abs(float(normal.mean())) < 0.01 and abs(float(normal.std()) - 1.0) < 0.01
    assert torch.isfinite(normal).all()
    u = _draw("rand_like", shape, dtype=torch.float64)(x, step, part)
    assert u.dtype == torch.float64 and abs(float(u.mean()) - 0.5) < 0.01
    kept = _draw("bernoulli", shape)(x, step, part)
    assert set(kept.unique().tolist()) == {0.0, 1.0} and abs(float(kept.mean()) - 0.3) < 0.01
    assert abs(float(_draw("bernoulli_p", shape, p=0.8)(x, step, part).mean()) - 0.8) < 0.01


@pytest.mark.parametrize("op", ["bernoulli", "bernoulli_p", "rand_like", "randn_like"])
def test_random_pieces_concatenate_to_the_whole_draw(op) -> None:
    x = torch.rand(5, 7, generator=torch.Generator().manual_seed(3))
    step, part = torch.tensor(2), torch.tensor(1)
    whole = _draw(op, (5, 7), p=0.6)(x, step, part)
    pieces = [_draw(op, (5, 3), offsets=(0, 0), global_shape=(5, 7), p=0.6)(x[:, :3], step, part),
              _draw(op, (5, 4), offsets=(0, 3), global_shape=(5, 7), p=0.6)(x[:, 3:], step, part)]
    assert torch.equal(torch.cat(pieces, 1), whole)


class _Stochastic(nn.Module):
    """Stochastic depth (torchvision's ``empty(...).bernoulli_(p)`` per sample), a
    ``bernoulli`` of probabilities, and ``rand_like``/``randn_like`` noise."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        keep = torch.empty([h.shape[0], 1], dtype=h.dtype).bernoulli_(0.8)
        h = h + self.b(h) * keep / 0.8
        h = h * torch.bernoulli(torch.sigmoid(h)) + 0.1 * torch.randn_like(h) + 0.1 * torch.rand_like(h)
        return self.c(h).pow(2).mean()


def _stochastic(batch: int = 12):
    torch.manual_seed(0)
    return _Stochastic(), (torch.randn(batch, 16),)


@pytest.mark.distributed
def test_stochastic_depth_and_noise_train_exactly_on_uneven_ranks() -> None:
    ref = reference(_stochastic, "stochastic", STEPS)
    ops = {n["op"] for n in ref.ir.doc["nodes"] if n.get("op")}
    assert {"aten.bernoulli", "aten.bernoulli.p", "aten.rand_like", "aten.randn_like"} <= ops
    cases = []
    for name, force in (("searched", {}), ("tensor-parallel", _merge(_alternate("aten.linear", ("column-parallel", "row-parallel")))(ref.ir.doc))):
        profile = estimated_profile(2, flops=[2e10, 1e10])
        plan = hapd.compile(ref.ir, profile, CompileOptions(ratios=(0.7, 0.3), force=force))
        steps = plan.program["steps"]
        random = [s for s in steps if s["op"] in ops and ("rand" in s["op"] or "bernoulli" in s["op"])]
        assert random and any(s["rule"] == "sharded" for s in random), name
        cases.append(Case(f"stochastic/{name}", ref.saved, plan.to_bytes(), ref.inputs, ref.losses, ref.grads,
                          frozenset(), force))
    results = run_cases(cases, 2)
    assert_exact(results, cases)


# --------------------------------------------------------------------------- exactness


def _bert(batch: int = 8):
    torch.manual_seed(0)
    config = models.bert.BertConfig(vocab=64, seq=16, hidden=32, heads=4, layers=2, ffn=64, dropout=0.1,
                                    attention_dropout=0.1)
    model = models.bert.BertLM(config)
    return model, models.get("bert").example_inputs(config, batch)


@functools.cache
def _reference():
    return reference(_bert, "bert", STEPS)


def _tensor_parallel(doc) -> dict[str, str]:
    """The blocks' linears column- then row-parallel (the FFN and attention projections)."""
    return _merge(_alternate("aten.linear", ("column-parallel", "row-parallel")))(doc)


def _case(name: str, ratios, *, force=None, recompute: str = "never") -> Case:
    ref = _reference()
    world = len(ratios)
    forced = force(ref.ir.doc) if force else {}
    profile = estimated_profile(world, flops=[1e10 * (world - r) for r in range(world)])
    plan = hapd.compile(ref.ir, profile, CompileOptions(ratios=tuple(ratios), force=forced, recompute=recompute))
    return Case(name, ref.saved, plan.to_bytes(), ref.inputs, ref.losses, ref.grads, frozenset(), forced)


def _check_plans(cases: list[Case]) -> None:
    """Every plan splits some dropout and every attention (dropping its probabilities):
    none replicated for want of a rule."""
    for case in cases:
        steps = hapd.Plan.from_bytes(case.plan).program["steps"]
        drops = [s for s in steps if s["op"] == "aten.native_dropout"]
        assert drops, case.name
        assert any(s["rule"] != "replicated" for s in drops), case.name
        attention = [s for s in steps if s["op"] == "aten.scaled_dot_product_attention"]
        assert attention and all(s["rule"] != "replicated" for s in attention), case.name


@pytest.mark.distributed
@pytest.mark.slow
def test_two_uneven_ranks_train_exactly_with_dropout() -> None:
    cases = [_case("bert/searched", (0.6, 0.4)), _case("bert/tensor-parallel", (0.6, 0.4), force=_tensor_parallel),
             _case("bert/recompute", (0.6, 0.4), recompute="always")]
    assert hapd.Plan.from_bytes(cases[2].plan).program["recompute"]
    _check_plans(cases)
    results = run_cases(cases, 2)
    assert_exact(results, cases)
    assert_rules_ran(results)


@pytest.mark.distributed
@pytest.mark.slow
def test_four_uneven_ranks_train_exactly_with_dropout() -> None:
    ratios = (0.4, 0.3, 0.2, 0.1)
    cases = [_case("bert/searched", ratios), _case("bert/tensor-parallel", ratios, force=_tensor_parallel)]
    _check_plans(cases)
    results = run_cases(cases, 4)
    assert_exact(results, cases)
    assert_rules_ran(results)


def test_ops_of_the_model_include_dropout() -> None:
    assert _ops(_reference().ir.doc, "aten.native_dropout")


class _MaskedLM(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, labels=labels).loss


@pytest.mark.slow
def test_transformers_bert_with_default_dropout_splits_its_dropouts() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, max_position_embeddings=64)
    assert config.hidden_dropout_prob == 0.1
    ids = torch.randint(0, 128, (32, 64))
    graph = hapd.lower(hapd.export(_MaskedLM(transformers.BertForMaskedLM(config)).train(), (ids, ids)))
    plan = hapd.compile(graph, "profiles/paper-8.json")
    drops = [s for s in plan.program["steps"] if s["op"] == "aten.native_dropout"]
    assert len(drops) == 5 and all(s["rule"] == "sharded" for s in drops)
    assert "no sharding rules" not in plan.explain()
    print("\n" + "\n".join(plan.explain().splitlines()[:4]))


# --------------------------------------------------------------------------- the seed


def _seeds_on_rank(rank: int, world: int) -> tuple[int, list[int]]:
    """Each rank seeds torch differently, then parallelizes a model with dropout."""
    from hapd.spmd.random.random_ops import CounterDropout

    torch.manual_seed(100 + 7 * rank)
    model, config = models.build("bert", "tiny", dropout=0.1)
    inputs = models.get("bert").example_inputs(config, 8)
    module = hapd.parallelize(model, inputs, profile=estimated_profile(world), use_daemon=False, verbose=False)
    return torch.initial_seed(), [m.seed for m in module.modules() if isinstance(m, CounterDropout)]


def test_ranks_seeded_apart_draw_with_rank_zeros_seed() -> None:
    """A rank whose torch seed differs still draws its slice of one mask: distribute
    sends rank 0's seed to every rank."""
    (seed0, drops0), (seed1, drops1) = run_ranks(2, _seeds_on_rank, timeout=300)
    assert seed0 != seed1 and drops0 and drops1
    assert set(drops0) == set(drops1) == {seed0}


# --------------------------------------------------------------------------- one device


def _step(module: nn.Module, inputs: tuple[torch.Tensor, ...], seed: int) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(seed)
    loss = module(*inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_one_device_with_rng_torch_draws_as_the_eager_model_does() -> None:
    """``rng="torch"`` on one process keeps the model's own random ops and torch's
    generator: seeded alike, hapd and the eager model drop the same elements (hidden,
    embedding and attention dropout of GPT-2), so loss and gradients agree. The default
    draws with hapd's generator, as N ranks do."""
    from hapd.errors import OptionsError
    from hapd.spmd.random.random_ops import CounterDraw

    model, inputs = models.zoo.make("gpt2", 4, "tiny", dropout=0.2)
    default = hapd.parallelize(model, inputs, profile=estimated_profile(1), use_daemon=False, verbose=False)
    assert [m for m in default.modules() if isinstance(m, CounterDraw)]
    with pytest.raises(OptionsError, match="overlap runs the batch as two duplicas"):
        hapd.parallelize(model, inputs, profile=estimated_profile(1), use_daemon=False, verbose=False, rng="torch",
                         overlap="always")
    with pytest.raises(OptionsError, match="rng must be one of"):
        hapd.parallelize(model, inputs, profile=estimated_profile(1), use_daemon=False, verbose=False, rng="philox")
    module = hapd.parallelize(model, inputs, profile=estimated_profile(1), use_daemon=False, verbose=False,
                              rng="torch")
    assert not [m for m in module.modules() if isinstance(m, CounterDraw)]
    targets = {n.target for n in module.inner.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.native_dropout.default in targets
    eager_loss, eager_grads = _step(model, inputs, 7)
    hapd_loss, _ = _step(module, inputs, 7)
    # exact: one device runs the model's own aten ops in the eager order on torch's generator, so no rounding
    # differs (no tolerance for a reduction order: there is none to differ), bit for bit
    assert float(hapd_loss) == float(eager_loss)
    assert module.inner.hapd_params
    compared = [fqn for fqn in module.inner.hapd_params if fqn in eager_grads]  # a tied weight: one of its names
    assert len(compared) >= len(eager_grads) - 1
    for fqn in compared:
        torch.testing.assert_close(module.inner.get_parameter(fqn).grad, eager_grads[fqn], rtol=0.0, atol=0.0)
    torch.manual_seed(8)
    assert abs(float(module(*inputs).detach()) - float(eager_loss)) > 1e-4  # another seed, other masks: they matter


def test_rng_choice_is_checked() -> None:
    from hapd.errors import PlanError
    from hapd.spmd.random.random_ops import CounterDropout, choose_rng

    assert choose_rng(None, world=1, overlap=False) == "counter"  # one process draws what N ranks draw
    assert choose_rng("torch", world=1, overlap=False) == "torch"
    assert choose_rng(None, world=2, overlap=False) == "counter"
    assert choose_rng(None, world=1, overlap=True) == "counter"
    with pytest.raises(PlanError, match="2 ranks"):
        choose_rng("torch", world=2, overlap=False)
    with pytest.raises(PlanError, match="duplicas"):
        choose_rng("torch", world=1, overlap=True)
    with pytest.raises(PlanError, match="rng must be one of"):
        choose_rng("philox", world=1, overlap=False)
    model, config = models.build("bert", "tiny", dropout=0.1)
    inputs = models.get("bert").example_inputs(config, 4)
    program = hapd.export(model, inputs)
    plan = hapd.compile(hapd.lower(program), estimated_profile(1))
    counted = hapd.distribute(program, plan, 0, world=1, rng="counter")
    assert [m for m in counted.modules() if isinstance(m, CounterDropout)]


def test_every_plan_prices_the_math_attention_its_counter_dropout_runs() -> None:
    """hapd's generator draws an attention's dropout on every plan by default, one
    device's too (the math attention on CPU): its probabilities and mask are priced on
    one device as on two."""
    from hapd.compiler.ratios import part_memory

    def activations(p: float, devices: int) -> float:
        graph = hapd.lower(hapd.export(_SelfAttention(p), (torch.randn(2, 24, 32),)))
        plan = hapd.compile(graph, estimated_profile(devices))
        return sum(float(v) for v in part_memory(plan.program, plan.ratios)["activations"])

    for devices in (1, 2):
        assert activations(0.1, devices) - activations(0.0, devices) >= 2 * 4 * 24 * 24 * (2 * 4 + 1) * 0.99 / devices


def test_a_cluster_running_the_fused_attention_kernel_is_priced_as_it() -> None:
    """Where every device runs hapd's fused attention kernel (the profile's
    ``fused_attention``), an attention with dropout keeps what one without does (no
    probabilities or mask) and costs its two draws per score, fewer FLOPs than the math
    attention's; one device on the math path keeps the math pricing for the cluster."""
    from hapd.compiler.ratios import part_memory

    graphs = {p: hapd.lower(hapd.export(_SelfAttention(p), (torch.randn(2, 24, 32),))) for p in (0.0, 0.1)}

    def priced(p: float, fused: list[bool] | None) -> tuple[float, float, float]:
        plan = hapd.compile(graphs[p], estimated_profile(2, fused_attention=fused))
        activations = sum(float(v) for v in part_memory(plan.program, plan.ratios)["activations"])
        flops = sum(float(s["flops"]) for s in plan.program["steps"])
        return activations, flops, float(plan.estimate["per_iteration"])

    plain = priced(0.0, [True, True])
    fused = priced(0.1, [True, True])
    math_ = priced(0.1, None)
    assert fused[0] == pytest.approx(plain[0], rel=1e-3)  # nothing of size queries × keys kept
    assert math_[0] - fused[0] >= 2 * 4 * 24 * 24 * (2 * 4 + 1) * 0.99 / 2
    assert plain[1] < fused[1] < math_[1] and fused[2] < math_[2]
    assert priced(0.1, [True, False]) == math_  # a mixed cluster: the math attention's price
    assert priced(0.1, [False, False]) == math_
