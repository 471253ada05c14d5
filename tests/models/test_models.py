"""Tests for the benchmark models in ``hapd.models`` (tiny sizes only, CPU)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import hapd.models as models
from hapd.models.bert_moe import BertMoEConfig, Top2MoE, moe_capacity, top2_gating

NAMES = list(models.MODELS)

# Ops every language model's graph contains.
LANGUAGE_MODEL_OPS = {"aten.embedding.default", "aten.linear.default", "aten.scaled_dot_product_attention.default",
                      "aten.cross_entropy_loss.default"}

# Ops each exported graph must contain: the high-level op, not its decomposition.
REQUIRED_OPS: dict[str, set[str]] = {
    "mlp": {"aten.linear.default", "aten.gelu.default", "aten.cross_entropy_loss.default"},
    "vgg19": {"aten.conv2d.default", "aten.max_pool2d.default", "aten.relu.default",
              "aten.linear.default", "aten.cross_entropy_loss.default"},
    "vit": {"aten.conv2d.default", "aten.cat.default", "aten.linear.default",
            "aten.layer_norm.default", "aten.scaled_dot_product_attention.default",
            "aten.relu.default", "aten.cross_entropy_loss.default"},
    "bert": LANGUAGE_MODEL_OPS | {"aten.layer_norm.default", "aten.relu.default"},
    "bert_moe": LANGUAGE_MODEL_OPS | {"aten.layer_norm.default", "aten.einsum.default", "aten.softmax.int",
                                      "aten.topk.default", "aten.one_hot.default", "aten.cumsum.default"},
    "gpt2_block": LANGUAGE_MODEL_OPS | {"aten.layer_norm.default", "aten.gelu.default"},
    "llama_block": LANGUAGE_MODEL_OPS | {"aten.rsqrt.default", "aten.silu.default"},
}

# Lower-level ops that would mean a high-level op was decomposed.
DECOMPOSED_OPS = {
    "aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.matmul.default",
    "aten.t.default", "aten.native_layer_norm.default", "aten._softmax.default",
    "aten.log_softmax.int", "aten._log_softmax.default", "aten.nll_loss_forward.default",
    "aten.convolution.default", "aten.native_dropout.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
}


def _tiny(name: str):
    """``(model, config, inputs)`` for the tiny size with a batch of 2."""
    model, config = models.build(name)
    return model, config, models.get(name).example_inputs(config, 2)


def _ops(program: torch.export.ExportedProgram) -> set[str]:
    """Names of the call_function targets of an exported graph."""
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function"}


# --------------------------------------------------------------------------- registry


def test_registry_names() -> None:
    assert set(NAMES) == {"mlp", "vgg19", "vit", "bert", "bert_moe", "gpt2_block",
                          "llama_block"}
    for name, spec in models.MODELS.items():
        assert spec.name == name and spec.description


def test_unknown_model_size_and_field() -> None:
    with pytest.raises(ValueError, match=r"unknown model 'nope'; known: .*bert"):
        models.get("nope")
    with pytest.raises(ValueError, match=r"unknown size 'huge'"):
        models.build("bert", "huge")
    with pytest.raises(ValueError, match=r"unknown config field\(s\) nope for model 'bert'"):
        models.build("bert", nope=1)


def test_override_replaces_fields() -> None:
    model, config = models.build("bert", layers=3, seq=8)
    assert (config.layers, config.seq) == (3, 8)
    assert len(model.layers) == 3
    assert config == dataclasses.replace(models.get("bert").config_cls.tiny(), layers=3, seq=8)
    with pytest.raises(ValueError, match="hidden 30 is not divisible by heads 4"):
        models.build("bert", hidden=30)


@pytest.mark.parametrize("name", NAMES)
def test_configs_are_frozen_kw_only(name: str) -> None:
    cls = models.get(name).config_cls
    config = cls.tiny()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.dropout = 0.5
    with pytest.raises(TypeError):
        cls(*dataclasses.astuple(config))
    assert config.dropout == 0.0 and cls.paper().dropout == 0.1


# --------------------------------------------------------------------------- tiny models


@pytest.mark.parametrize("name", NAMES)
def test_build_is_deterministic_and_keeps_rng(name: str) -> None:
    before = torch.get_rng_state()
    a, _ = models.build(name)
    b, _ = models.build(name)
    assert torch.equal(before, torch.get_rng_state())
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", NAMES)
def test_tiny_size_and_param_formula(name: str) -> None:
    model, config, _ = _tiny(name)
    count = sum(p.numel() for p in model.parameters())
    assert count == config.param_count()
    assert 2_000 <= count <= 100_000


@pytest.mark.parametrize("name", NAMES)
def test_example_inputs(name: str) -> None:
    spec = models.get(name)
    _, config, inputs = _tiny(name)
    again = spec.example_inputs(config, 2)
    assert len(inputs) == len(spec.batch_dims) == 2
    for t, u, dim in zip(inputs, again, spec.batch_dims):
        assert torch.equal(t, u) and t.shape[dim] == 2
    x, y = inputs
    assert y.dtype == torch.int64 and y.min() >= 0
    classes = getattr(config, "vocab", getattr(config, "classes", None))
    assert y.max() < classes
    if x.dtype == torch.int64:
        assert x.shape == y.shape and x.max() < classes
    else:
        assert x.dtype == torch.float32


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward(name: str) -> None:
    model, _, inputs = _tiny(name)
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert torch.isfinite(p.grad).all(), pname
    assert any(p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("name", NAMES)
def test_loss_is_sum_reduced(name: str) -> None:
    """Doubling the batch (same samples twice) doubles the loss."""
    model, _, inputs = _tiny(name)
    doubled = tuple(torch.cat((t, t), dim=d) for t, d in zip(inputs,
                                                               models.get(name).batch_dims))
    with torch.no_grad():
        torch.testing.assert_close(model(*doubled), 2 * model(*inputs))


@pytest.mark.parametrize("name", NAMES)
def test_export(name: str) -> None:
    model, _, inputs = _tiny(name)
    program = torch.export.export(model, inputs)
    ops = _ops(program)
    assert REQUIRED_OPS[name] <= ops, REQUIRED_OPS[name] - ops
    assert not ops & DECOMPOSED_OPS, ops & DECOMPOSED_OPS
    out = program.module()(*inputs)
    assert out.dim() == 0
    torch.testing.assert_close(out, model(*inputs))


@pytest.mark.parametrize("name", ["vit", "bert_moe", "llama_block"])
def test_export_with_dropout(name: str) -> None:
    model, config = models.build(name, dropout=0.1, attention_dropout=0.1)
    inputs = models.get(name).example_inputs(config, 2)
    program = torch.export.export(model, inputs)
    sdpa = [n for n in program.graph.nodes
            if str(n.target) == "aten.scaled_dot_product_attention.default"]
    assert sdpa and all(0.1 in n.args for n in sdpa)
    assert "aten.dropout.default" in _ops(program)


# --------------------------------------------------------------------------- paper configs


def test_paper_configs() -> None:
    cfg = lambda name: models.get(name).config_cls.paper()  # noqa: E731
    bert = cfg("bert")
    assert (bert.hidden, bert.heads, bert.layers, bert.ffn, bert.seq, bert.vocab) == (
        768, 12, 12, 3072, 128, 33280)
    moe = cfg("bert_moe")
    assert (moe.hidden, moe.layers, moe.n_experts, moe.capacity_factor) == (768, 12, 16, 2.5)
    assert moe.capacity() == math.ceil(128 / 16 * 2.5) == 20 and moe.moe_layers() == 6
    vit = cfg("vit")
    assert (vit.hidden, vit.heads, vit.layers, vit.ffn, vit.patches()) == (768, 12, 12, 3072, 64)
    vgg = cfg("vgg19")
    assert vgg.channels().count("M") == 5 and len(vgg.channels()) - 5 == 16
    assert vgg.features() == 512
    approx = {"mlp": 126e6, "vgg19": 39e6, "vit": 85e6, "bert": 136e6, "bert_moe": 561e6,
              "gpt2_block": 124e6, "llama_block": 6.74e9}
    for name, expected in approx.items():
        assert cfg(name).param_count() == pytest.approx(expected, rel=0.01), name


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("name", "overrides", "message"), [
    ("mlp", {"hidden": 0}, "hidden must be positive, got 0"),
    ("mlp", {"dropout": 1.0}, r"dropout must be in \[0, 1\), got 1.0"),
    ("vgg19", {"image_size": 48}, "image_size 48 is not divisible by 2\\*\\*pools 32"),
    ("vit", {"hidden": 770, "heads": 12}, "hidden 770 is not divisible by heads 12"),
    ("vit", {"patch": 5}, "image_size 32 is not divisible by patch 5"),
    ("bert", {"vocab": -3}, "vocab must be positive, got -3"),
    ("bert", {"heads": 5}, "hidden 32 is not divisible by heads 5"),
    ("bert", {"hidden": 9, "heads": 3}, "hidden 9 must be even"),
    ("bert_moe", {"n_experts": 1}, "n_experts must be at least 2, got 1"),
    ("bert_moe", {"layers": 1}, "layers must be at least 2, got 1"),
    ("bert_moe", {"capacity_factor": 0.0}, "capacity_factor must be positive, got 0.0"),
    ("gpt2_block", {"attention_dropout": -0.1}, r"attention_dropout must be in \[0, 1\)"),
    ("llama_block", {"hidden": 36, "heads": 12}, r"head size 3 \(hidden 36 / heads 12\)"),
])
def test_invalid_configs(name: str, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        models.make_config(name, **overrides)


def test_sequence_longer_than_config_is_rejected() -> None:
    model, config = models.build("bert")
    x = torch.zeros(1, config.seq + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match=f"sequence length {config.seq + 1} exceeds"):
        model(x, x)


# --------------------------------------------------------------------------- MoE gating


def test_top2_gating_slots() -> None:
    logits = torch.randn(3, 16, 4, generator=torch.Generator().manual_seed(1))
    capacity = moe_capacity(16, 4, 2.5)
    dispatch, combine = top2_gating(logits, capacity)
    assert dispatch.shape == combine.shape == (3, 16, 4, capacity)
    assert set(dispatch.unique().tolist()) <= {0.0, 1.0}
    assert (dispatch.sum(dim=(2, 3)) <= 2).all()  # each token: at most two slots
    assert (dispatch.sum(dim=1) <= 1).all()  # each expert slot: at most one token
    assert ((combine > 0) <= (dispatch > 0)).all()
    kept_both = dispatch.sum(dim=(2, 3)) == 2
    torch.testing.assert_close(combine.sum(dim=(2, 3))[kept_both],
                               torch.ones(int(kept_both.sum())))


def test_top2_gating_drops_over_capacity() -> None:
    # Tokens 0-5 prefer expert 0 then 1; tokens 6-7 prefer expert 1 then 0.
    logits = torch.zeros(1, 8, 2)
    logits[0, :6, 0] = 1.0
    logits[0, 6:, 1] = 1.0
    dispatch, combine = top2_gating(logits, capacity=3)
    slots = {(s, e): c for s, e, c in dispatch[0].nonzero().tolist()}
    # First choices fill slots in sequence order; second choices queue behind
    # all first choices of the same expert and are dropped past capacity.
    assert slots == {(0, 0): 0, (1, 0): 1, (2, 0): 2,  # tokens 3-5 overflow expert 0
                     (6, 1): 0, (7, 1): 1, (0, 1): 2}  # only token 0's 2nd choice fits
    p_hi = torch.softmax(torch.tensor([1.0, 0.0]), dim=0)[0]
    torch.testing.assert_close(combine[0, 1, 0, 1], torch.tensor(1.0))  # renormalized alone
    torch.testing.assert_close(combine[0, 0].sum(), torch.tensor(1.0))
    torch.testing.assert_close(combine[0, 0, 0, 0], p_hi)
    assert combine[0, 3].sum() == 0  # token 3 was dropped by both experts


def test_moe_matches_dense_top2_without_drops() -> None:
    torch.manual_seed(0)
    moe = Top2MoE(hidden=8, ffn=16, n_experts=4, capacity_factor=8.0, dropout=0.0)
    x = torch.randn(2, 5, 8)
    probs = torch.softmax(moe.gate(x), dim=-1)
    weights, chosen = probs.topk(2, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    experts = torch.stack([F.relu(x @ moe.w1[e]) @ moe.w2[e] for e in range(4)], dim=2)
    picked = experts.gather(2, chosen[..., None].expand(-1, -1, -1, 8))  # [B, S, 2, D]
    expected = (weights[..., None] * picked).sum(dim=2)
    torch.testing.assert_close(moe(x), expected)


def test_bert_moe_layers_alternate() -> None:
    model, config = models.build("bert_moe", layers=4)
    assert isinstance(config, BertMoEConfig)
    kinds = [type(layer.mlp).__name__ for layer in model.layers]
    assert kinds == ["FeedForward", "Top2MoE", "FeedForward", "Top2MoE"]
    assert model.layers[1].mlp.w1.shape == (config.n_experts, config.hidden, config.ffn)
    assert model.layers[1].mlp.w2.shape == (config.n_experts, config.ffn, config.hidden)


# --------------------------------------------------------------------------- the zoo in the registry


def test_zoo_models_are_registered_as_zoo_names() -> None:
    from hapd.models import zoo

    assert list(models.ZOO_MODELS) == [f"zoo.{name}" for name in zoo.ZOO]
    assert models.NAMES == (*models.MODELS, *models.ZOO_MODELS)
    assert models.get("zoo.gpt2").loss == "mean" and models.get("zoo.resnet18").loss == "sum"
    assert all(spec.loss == "sum" for spec in models.MODELS.values())
    with pytest.raises(ValueError, match=r"unknown model 'zoo.nope'; known: .*zoo\.gpt2"):
        models.get("zoo.nope")


def test_zoo_tiny_is_the_factorys_model() -> None:
    """The registry's tiny zoo.gpt2 is the factory's (same parameters, same inputs)."""
    from hapd.models import zoo

    built, config = models.build("zoo.gpt2")
    made, inputs = zoo.gpt2(batch=3)
    assert built.state_dict().keys() == made.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), made.state_dict().values()))
    assert all(torch.equal(a, b) for a, b in zip(models.get("zoo.gpt2").example_inputs(config, 3), inputs))


def test_zoo_small_sizes_and_inputs() -> None:
    """small: GPT-2 width 256, 4 layers, ids [B, 64] in [0, 1024); resnet18 on 64×64 images."""
    model, config = models.build("zoo.gpt2", "small", layers=2)
    hf = model.model.config
    assert (hf.n_embd, hf.n_layer, hf.vocab_size, hf.n_positions) == (256, 2, 1024, 64)
    ids, labels = models.get("zoo.gpt2").example_inputs(config, 3)
    assert ids.shape == labels.shape == (3, 64) and ids.dtype == torch.int64
    assert 0 <= int(ids.min()) and int(ids.max()) < 1024
    config = models.make_config("zoo.resnet18", "small")
    images, targets = models.get("zoo.resnet18").example_inputs(config, 2)
    assert images.shape == (2, 3, 64, 64) and targets.shape == (2,) and int(targets.max()) < config.classes
    with pytest.raises(ValueError, match=r"unknown config field\(s\) layers for model 'zoo.resnet18'"):
        models.make_config("zoo.resnet18", "small", layers=2)
    with pytest.raises(ValueError, match="image must be at least 32"):
        models.make_config("zoo.resnet18", image=16)
