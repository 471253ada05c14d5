"""The third-party model zoo: the transformers and torchvision models users bring, with
random init (no hub access), each wrapped so that its forward returns the scalar
training loss, as ``hapd.export`` expects.

Every factory takes ``batch=`` and ``size=`` ("tiny", the default; "small"; "paper") and
returns ``(module, example_inputs)``, so it works with ``hapd export
hapd.models.zoo:NAME``. The same models are in :mod:`hapd.models`' registry as
``zoo.NAME`` (:data:`MODELS` here: config class, builder, example inputs), so the
training scripts, the launcher and the benchmarks run them by name. transformers and
torchvision are imported only when a model is built (they are test extras, not
dependencies of hapd).

Dropout is each library's default (GPT-2, BERT and T5: 0.1 everywhere their configs
have one, attention probabilities included; Llama, Mixtral and Qwen2-MoE: their
attention dropout, 0; torchvision's ViT: 0), as users get them; ``dropout=`` (a config
field) sets every dropout of a model to one value, ``dropout=0.0`` gives the
dropout-free variant.

Sizes: ``tiny`` is width 64, 2 layers, sequence 16, vocabulary 128, 32×32 images (fast
tests); ``small`` is width 256, 4 layers, sequence 64, vocabulary 1024, 64×64 images
(matmuls near a CPU core's rate: what the benchmarks use); ``paper`` is the published
base sizes (GPT-2 small's 768 × 12, ViT-B/16 and resnet18 on 224×224 ImageNet images).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable

import torch
from torch import Tensor, nn

from hapd.errors import OptionsError
from hapd.models._common import SIZES, check_at_least, check_divisible, check_positive, check_transformer

SEQ = 16
"""Sequence length of the tiny language models' example inputs."""
VOCAB = 128
"""Vocabulary of the tiny language models."""
MIN_POSITIONS = 64
"""Position table rows of every language model (more when the sequence is longer)."""


# --------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    """Sizes of a zoo language model (GPT-2, Llama, BERT, Mixtral, Qwen2-MoE, T5)."""

    vocab: int
    """Vocabulary size (token ids of the example inputs are in ``[0, vocab)``)."""
    seq: int
    """Sequence length of the example inputs."""
    hidden: int
    """Model width."""
    layers: int
    """Number of blocks (T5: of the encoder and of the decoder each)."""
    heads: int
    """Attention heads; must divide ``hidden``."""
    ffn: int
    """Inner width of each MLP and shared expert; routed experts are half of it, and
    GPT-2's MLP is 4 × ``hidden`` whatever this says (GPT-2's own rule)."""
    dropout: float | None = None
    """Every dropout probability of the library's config (hidden, embedding, attention);
    None: the library's defaults."""

    def __post_init__(self) -> None:
        check_transformer(hidden=self.hidden, heads=self.heads, layers=self.layers, ffn=self.ffn,
                          dropout=self.dropout or 0.0, attention_dropout=0.0)
        check_positive(vocab=self.vocab, seq=self.seq)

    @classmethod
    def tiny(cls) -> TextConfig:
        """Width 64, 2 layers, 4 heads, vocabulary 128, sequence 16."""
        return cls(vocab=VOCAB, seq=SEQ, hidden=64, layers=2, heads=4, ffn=128)

    @classmethod
    def small(cls) -> TextConfig:
        """Width 256, 4 layers, 4 heads, vocabulary 1024, sequence 64 (GPT-2: ~3.5M parameters)."""
        return cls(vocab=1024, seq=64, hidden=256, layers=4, heads=4, ffn=1024)

    @classmethod
    def paper(cls) -> TextConfig:
        """GPT-2 small's sizes: width 768, 12 layers, 12 heads, vocabulary 50257, sequence 1024."""
        return cls(vocab=50257, seq=1024, hidden=768, layers=12, heads=12, ffn=3072)

    @property
    def positions(self) -> int:
        """Rows of the position table: :data:`MIN_POSITIONS`, or ``seq`` when longer."""
        return max(MIN_POSITIONS, self.seq)

    @property
    def kv_heads(self) -> int:
        """Key/value heads of the grouped-query models: half the heads (all when odd)."""
        return self.heads // 2 if self.heads % 2 == 0 else self.heads


@dataclass(frozen=True, kw_only=True)
class TorchvisionViTConfig:
    """Sizes of the zoo's torchvision ViT."""

    image: int
    """Height and width of the example images."""
    patch: int
    """Patch side; must divide ``image``."""
    hidden: int
    """Model width."""
    layers: int
    """Encoder blocks."""
    heads: int
    """Attention heads; must divide ``hidden``."""
    ffn: int
    """Inner width of each MLP."""
    classes: int
    """Output classes (targets of the example inputs are in ``[0, classes)``)."""
    dropout: float | None = None
    """The encoder's dropout and attention dropout; None: torchvision's default (0)."""

    def __post_init__(self) -> None:
        check_transformer(hidden=self.hidden, heads=self.heads, layers=self.layers, ffn=self.ffn,
                          dropout=self.dropout or 0.0, attention_dropout=0.0)
        check_positive(image=self.image, patch=self.patch, classes=self.classes)
        check_divisible("image", self.image, "patch", self.patch)

    @classmethod
    def tiny(cls) -> TorchvisionViTConfig:
        """32×32 images, 8×8 patches, width 64, 2 layers, 10 classes."""
        return cls(image=32, patch=8, hidden=64, layers=2, heads=4, ffn=128, classes=10)

    @classmethod
    def small(cls) -> TorchvisionViTConfig:
        """64×64 images, 8×8 patches, width 256, 4 layers, 10 classes (~3.2M parameters)."""
        return cls(image=64, patch=8, hidden=256, layers=4, heads=4, ffn=1024, classes=10)

    @classmethod
    def paper(cls) -> TorchvisionViTConfig:
        """ViT-B/16 on 224×224 images, 1000 classes (~86M parameters)."""
        return cls(image=224, patch=16, hidden=768, layers=12, heads=12, ffn=3072, classes=1000)


@dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    """Sizes of the zoo's torchvision resnet18: its depth and widths are fixed (no
    ``layers``), only the images and the classes change."""

    image: int
    """Height and width of the example images (at least 32: resnet18 downsamples 32×)."""
    classes: int
    """Output classes (targets of the example inputs are in ``[0, classes)``)."""

    def __post_init__(self) -> None:
        check_positive(classes=self.classes)
        check_at_least("image", self.image, 32)

    @classmethod
    def tiny(cls) -> ResNetConfig:
        """32×32 images, 10 classes (~11.2M parameters, as every resnet18)."""
        return cls(image=32, classes=10)

    @classmethod
    def small(cls) -> ResNetConfig:
        """64×64 images, 10 classes."""
        return cls(image=64, classes=10)

    @classmethod
    def paper(cls) -> ResNetConfig:
        """ImageNet: 224×224 images, 1000 classes."""
        return cls(image=224, classes=1000)


# --------------------------------------------------------------------------
# Loss wrappers and inputs
# --------------------------------------------------------------------------


class LanguageModelLoss(nn.Module):
    """A transformers language model (causal, masked or encoder-decoder) whose forward
    takes (input_ids, labels) and returns the loss the model computes (an
    encoder-decoder builds its decoder inputs by shifting the labels right)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


class ClassifierLoss(nn.Module):
    """An image classifier: (images, targets) → cross-entropy, summed over the batch."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: Tensor, targets: Tensor) -> Tensor:
        return nn.functional.cross_entropy(self.model(images), targets, reduction="sum")


def text_inputs(config: TextConfig, batch: int) -> tuple[Tensor, Tensor]:
    """``(input_ids, labels)``, both ``[batch, seq]`` token ids in ``[0, vocab)``, the same
    tensor (the models shift the labels themselves); deterministic."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab, (batch, config.seq), generator=g)
    return ids, ids.clone()


def image_inputs(config: TorchvisionViTConfig | ResNetConfig, batch: int) -> tuple[Tensor, Tensor]:
    """``(images [batch, 3, image, image], targets [batch] in [0, classes))``; deterministic."""
    g = torch.Generator().manual_seed(0)
    return (torch.randn(batch, 3, config.image, config.image, generator=g),
            torch.randint(0, config.classes, (batch,), generator=g))


def _extra(module: str) -> ModuleType:
    """Import ``module`` (transformers or torchvision); :class:`OptionsError` naming the
    extra that installs it when it is missing."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise OptionsError(f"the model zoo needs {module.split('.')[0]} ({exc}): "
                           "pip install -e '.[test]'") from exc


def _dropouts(c: TextConfig | TorchvisionViTConfig, *names: str) -> dict[str, float]:
    """Config keyword ``names`` all set to ``c.dropout``; none (the library's defaults)
    when it is None."""
    return {} if c.dropout is None else dict.fromkeys(names, c.dropout)


def _lm(hf_config: Any, model_class: Any) -> LanguageModelLoss:
    hf_config._attn_implementation = "sdpa"
    model = model_class(hf_config)
    model.config.use_cache = False
    return LanguageModelLoss(model)


# --------------------------------------------------------------------------
# Builders: config → module (unseeded; the factories and hapd.models.build seed them)
# --------------------------------------------------------------------------


def build_gpt2(c: TextConfig) -> nn.Module:
    t = _extra("transformers")
    return _lm(t.GPT2Config(vocab_size=c.vocab, n_positions=c.positions, n_embd=c.hidden, n_layer=c.layers,
                            n_head=c.heads, bos_token_id=c.vocab - 1, eos_token_id=c.vocab - 1,
                            **_dropouts(c, "resid_pdrop", "embd_pdrop", "attn_pdrop")), t.GPT2LMHeadModel)


def build_llama(c: TextConfig) -> nn.Module:
    t = _extra("transformers")
    return _lm(t.LlamaConfig(vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.ffn,
                             num_hidden_layers=c.layers, num_attention_heads=c.heads, num_key_value_heads=c.kv_heads,
                             max_position_embeddings=c.positions, **_dropouts(c, "attention_dropout")),
               t.LlamaForCausalLM)


def build_bert(c: TextConfig) -> nn.Module:
    t = _extra("transformers")
    return _lm(t.BertConfig(vocab_size=c.vocab, hidden_size=c.hidden, num_hidden_layers=c.layers,
                            num_attention_heads=c.heads, intermediate_size=c.ffn, max_position_embeddings=c.positions,
                            **_dropouts(c, "hidden_dropout_prob", "attention_probs_dropout_prob")),
               t.BertForMaskedLM)


def build_mixtral(c: TextConfig) -> nn.Module:
    """Mixtral with 4 experts, top-2, run by transformers' default experts
    implementation (``grouped_mm``: :func:`hapd.export` traces it as one
    ``hapd.routed_experts`` op, the same values, which a plan splits by tokens or by
    experts: :mod:`hapd.ir.experts`)."""
    t = _extra("transformers")
    hf_config = t.MixtralConfig(vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.ffn,
                                num_hidden_layers=c.layers, num_attention_heads=c.heads,
                                num_key_value_heads=c.kv_heads, max_position_embeddings=c.positions,
                                num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
                                **_dropouts(c, "attention_dropout"))
    return _lm(hf_config, t.MixtralForCausalLM)


def build_qwen2_moe(c: TextConfig) -> nn.Module:
    """Qwen2-MoE with 4 routed experts (top-2) and a gated shared expert, run by
    transformers' default experts implementation (see :func:`build_mixtral`)."""
    t = _extra("transformers")

    hf_config = t.Qwen2MoeConfig(vocab_size=c.vocab, hidden_size=c.hidden, intermediate_size=c.ffn,
                                 moe_intermediate_size=c.ffn // 2, shared_expert_intermediate_size=c.ffn,
                                 num_hidden_layers=c.layers, num_attention_heads=c.heads,
                                 num_key_value_heads=c.kv_heads, max_position_embeddings=c.positions, num_experts=4,
                                 num_experts_per_tok=2, norm_topk_prob=True, output_router_logits=True,
                                 **_dropouts(c, "attention_dropout"))
    return _lm(hf_config, t.Qwen2MoeForCausalLM)


def build_t5(c: TextConfig) -> nn.Module:
    t = _extra("transformers")
    return _lm(t.T5Config(vocab_size=c.vocab, d_model=c.hidden, d_kv=c.hidden // c.heads, d_ff=c.ffn,
                          num_layers=c.layers, num_heads=c.heads, decoder_start_token_id=0, pad_token_id=0,
                          **_dropouts(c, "dropout_rate")), t.T5ForConditionalGeneration)


def build_resnet18(c: ResNetConfig) -> nn.Module:
    return ClassifierLoss(_extra("torchvision.models").resnet18(num_classes=c.classes))


def build_vit(c: TorchvisionViTConfig) -> nn.Module:
    model = _extra("torchvision.models").VisionTransformer(
        image_size=c.image, patch_size=c.patch, num_layers=c.layers, num_heads=c.heads, hidden_dim=c.hidden,
        mlp_dim=c.ffn, num_classes=c.classes, **_dropouts(c, "dropout", "attention_dropout"))
    return ClassifierLoss(model)


# --------------------------------------------------------------------------
# The registry and the factories
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class ZooModel:
    """How to size, build and feed one zoo model (``hapd.models`` registers it as ``zoo.NAME``)."""

    config_cls: type
    """Frozen config dataclass with ``tiny()``, ``small()`` and ``paper()`` classmethods."""
    build: Callable[[Any], nn.Module]
    """Config → the loss-returning module (unseeded)."""
    example_inputs: Callable[[Any, int], tuple[Tensor, ...]]
    """``(config, batch) -> inputs``: deterministic, labels in range."""
    loss: str
    """How the loss reduces over the samples: ``"mean"`` (transformers' language-model
    losses, over every token) or ``"sum"`` (:class:`ClassifierLoss`)."""
    description: str
    """One line for humans."""


MODELS: dict[str, ZooModel] = {
    "gpt2": ZooModel(TextConfig, build_gpt2, text_inputs, "mean", "transformers GPT-2 (GPT2LMHeadModel), tied head"),
    "llama": ZooModel(TextConfig, build_llama, text_inputs, "mean",
                      "transformers Llama (LlamaForCausalLM): grouped-query attention, RoPE"),
    "bert": ZooModel(TextConfig, build_bert, text_inputs, "mean", "transformers BERT (BertForMaskedLM)"),
    "mixtral": ZooModel(TextConfig, build_mixtral, text_inputs, "mean",
                        "transformers Mixtral: 4 experts, top-2, transformers' default (grouped_mm) experts"),
    "qwen2_moe": ZooModel(TextConfig, build_qwen2_moe, text_inputs, "mean",
                          "transformers Qwen2-MoE: 4 experts, top-2, shared expert, default experts"),
    "t5": ZooModel(TextConfig, build_t5, text_inputs, "mean", "transformers T5 (T5ForConditionalGeneration)"),
    "resnet18": ZooModel(ResNetConfig, build_resnet18, image_inputs, "sum", "torchvision resnet18 (batch norm)"),
    "vit": ZooModel(TorchvisionViTConfig, build_vit, image_inputs, "sum", "torchvision VisionTransformer"),
}
"""Zoo name → how to size, build and feed it."""

def make(name: str, batch: int = 4, size: str = "tiny",
         dropout: float | None = None) -> tuple[nn.Module, tuple[Tensor, ...]]:
    """Zoo model ``name`` at ``size`` (seeded with 0) and its example inputs for ``batch``;
    ``dropout`` replaces every dropout probability (None: the library's defaults)."""
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    entry = MODELS[name]
    config = getattr(entry.config_cls, size)()
    if dropout is not None:
        if not hasattr(config, "dropout"):
            raise ValueError(f"zoo model {name!r} has no dropout")
        config = dataclasses.replace(config, dropout=dropout)
    torch.manual_seed(0)
    return entry.build(config), entry.example_inputs(config, batch)


Factory = Callable[..., tuple[nn.Module, tuple[Tensor, ...]]]
"""``(batch=4, size="tiny") -> (module, example_inputs)``."""


def factory(name: str) -> Factory:
    """The factory of zoo model ``name``: :func:`make` with its ``batch`` and ``size``,
    named ``name`` (what ``hapd export hapd.models.zoo:NAME`` calls)."""
    def made(batch: int = 4, size: str = "tiny") -> tuple[nn.Module, tuple[Tensor, ...]]:
        return make(name, batch, size)

    made.__name__ = made.__qualname__ = name
    made.__doc__ = f"{MODELS[name].description}: :func:`make` of {name!r} at ``size`` for ``batch``."
    return made


ZOO: dict[str, Factory] = {name: factory(name) for name in MODELS}
"""Zoo name → factory."""

gpt2, llama, bert, mixtral, qwen2_moe, t5, resnet18, vit = ZOO.values()
"""The factories, one module attribute each (``hapd export hapd.models.zoo:gpt2``)."""
