"""Benchmark models for hapd, and a registry to build them by name.

Every model's ``forward(*inputs)`` returns the scalar training loss
(cross-entropy with ``reduction="sum"``), with the labels among the inputs,
and exports cleanly with ``torch.export.export(model, example_inputs)``::

    model, config = hapd.models.build("bert", layers=2)
    inputs = hapd.models.get("bert").example_inputs(config, 8)
    loss = model(*inputs)

The third-party zoo (:mod:`hapd.models.zoo`: transformers and torchvision models) is
registered beside them as ``zoo.NAME`` (:data:`ZOO_MODELS`): ``build("zoo.gpt2",
"small")`` and ``get("zoo.gpt2").example_inputs(config, 8)`` work the same way (their
losses are transformers' means over tokens, see :attr:`ModelSpec.loss`).

Dropout: the ``small`` and ``paper`` sizes (what the benchmarks and users run) have
their papers' dropout (BERT, GPT-2, ViT and the MoE BERT: 0.1 on every residual branch,
in the FFN and on the attention probabilities; Llama none), as the zoo has its
libraries' defaults. ``tiny`` (the tests' size) is dropout-free, so a test compares a
program with its eager model directly; the tests of random ops override it
(``build("bert", dropout=0.1, attention_dropout=0.1)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from . import bert, bert_moe, gpt2, llama, mlp, vgg, vit, zoo
from ._common import SIZES


@dataclass(frozen=True)
class ModelSpec:
    """How to configure, build and feed one benchmark model."""

    name: str
    """Registry key."""
    config_cls: type
    """Frozen config dataclass with ``tiny()``, ``small()`` and ``paper()`` classmethods."""
    build: Callable[[Any], nn.Module]
    """Constructs the model from a config (unseeded; :func:`build` seeds it)."""
    example_inputs: Callable[[Any, int], tuple[Tensor, ...]]
    """``(config, batch) -> inputs``: deterministic, labels included and in range."""
    batch_dims: tuple[int, ...]
    """Batch dimension of each input, in ``forward`` order."""
    description: str
    """One line for humans."""
    loss: str = "sum"
    """How ``forward``'s loss reduces over the samples: ``"sum"`` (every benchmark model)
    or ``"mean"`` (the zoo's transformers models); a data-parallel baseline weights each
    rank's loss by it to train on the global batch's loss."""


def _specs() -> Iterator[ModelSpec]:
    """The registry entries, in a stable order."""
    yield ModelSpec("mlp", mlp.MLPConfig, mlp.MLP, mlp.example_inputs, (0, 0),
                    "MLP classifier: [Linear -> GELU] * layers -> Linear")
    yield ModelSpec("vgg19", vgg.VGG19Config, vgg.VGG19, vgg.example_inputs, (0, 0),
                    "VGG19 on 3x32x32 images (16 conv3x3 + 5 max-pools + 3-layer classifier)")
    yield ModelSpec("vit", vit.ViTConfig, vit.ViT, vit.example_inputs, (0, 0),
                    "ViT on 32x32 images, 4x4 patches, post-LN ReLU encoder, cls head")
    yield ModelSpec("bert", bert.BertConfig, bert.BertLM, bert.example_inputs, (0, 0),
                    "BERT-Base-sized causal LM: post-LN ReLU encoder, sinusoidal positions")
    yield ModelSpec("bert_moe", bert_moe.BertMoEConfig, bert_moe.BertMoE,
                    bert_moe.example_inputs, (0, 0),
                    "bert with top-2 GShard mixture-of-experts FFNs in odd layers")
    yield ModelSpec("gpt2_block", gpt2.GPT2Config, gpt2.GPT2, gpt2.example_inputs, (0, 0),
                    "GPT-2 pre-LN decoder, learned positions, tanh-GELU MLP, tied LM head")
    yield ModelSpec("llama_block", llama.LlamaConfig, llama.Llama, llama.example_inputs, (0, 0),
                    "Llama decoder: RMSNorm, rotary q/k, causal sdpa, SwiGLU, untied head")


def _zoo_specs() -> Iterator[ModelSpec]:
    """The zoo's models as ``zoo.NAME`` entries (every input's batch dim is 0)."""
    for name, entry in zoo.MODELS.items():
        yield ModelSpec(f"zoo.{name}", entry.config_cls, entry.build, entry.example_inputs, (0, 0),
                        entry.description, entry.loss)


MODELS: Mapping[str, ModelSpec] = MappingProxyType({spec.name: spec for spec in _specs()})
"""Every benchmark model by name (read-only)."""

ZOO_MODELS: Mapping[str, ModelSpec] = MappingProxyType({spec.name: spec for spec in _zoo_specs()})
"""Every zoo model by its registry name ``zoo.NAME`` (read-only; building one needs
transformers or torchvision, the test extras)."""

NAMES: tuple[str, ...] = (*MODELS, *ZOO_MODELS)
"""Every name :func:`get` knows: the benchmark models, then the zoo's."""


def get(name: str) -> ModelSpec:
    """The spec registered as ``name`` (a benchmark model or ``zoo.NAME``); ``ValueError``
    listing the known names otherwise."""
    spec = MODELS.get(name) or ZOO_MODELS.get(name)
    if spec is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(NAMES)}")
    return spec


def make_config(name: str, size: str = "tiny", **overrides: Any) -> Any:
    """The ``size`` preset of model ``name``'s config with ``overrides`` replacing fields.

    Raises ``ValueError`` for an unknown model, size or field, and for any
    combination the config's own validation rejects.
    """
    spec = get(name)
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {', '.join(SIZES)}")
    fields = {field.name for field in dataclasses.fields(spec.config_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown config field(s) {', '.join(unknown)} for model {name!r}; "
                         f"fields: {', '.join(sorted(fields))}")
    return dataclasses.replace(getattr(spec.config_cls, size)(), **overrides)


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Run the body with the RNGs seeded to ``seed``, restoring their state afterwards.

    Only CPU and already-initialized CUDA generators are forked and seeded, so
    building a model neither initializes CUDA nor leaves a queued CUDA seed.
    """
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        for device in cuda:
            torch.cuda.default_generators[device].manual_seed(seed)
        yield


def build(name: str, size: str = "tiny", **overrides: Any) -> tuple[nn.Module, Any]:
    """Build model ``name`` at ``size`` ("tiny", "small" or "paper"), with config ``overrides``.

    Construction is deterministic (seeded with 0) and leaves the global RNG
    state untouched.  Returns ``(model, config)``; the model is in train mode.
    """
    config = make_config(name, size, **overrides)
    with _seeded(0):
        model = get(name).build(config)
    return model, config


def module_init_of(model: nn.Module) -> Callable[[nn.Module], None] | None:
    """The per-module init a registry model applies beyond each module's
    ``reset_parameters()`` (for :func:`hapd.module_init`): GPT-2's ``_init_weights``, a
    transformers model's own ``_init_weights``; None when there is none. Init a
    model's constructor writes into its children (BERT's uniform embedding and head,
    torchvision's kaiming convolutions) is not per module and not replayed."""
    if isinstance(model, gpt2.GPT2):
        return gpt2._init_weights
    for module in model.modules():
        init = getattr(module, "_init_weights", None)
        if callable(init) and hasattr(module, "config"):
            return init
    return None


__all__ = ["MODELS", "NAMES", "SIZES", "ZOO_MODELS", "ModelSpec", "build", "get", "make_config", "module_init_of"]
