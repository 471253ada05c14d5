"""The third-party model zoo: the transformers and torchvision models users bring, at
tiny sizes with random init (no hub access), each wrapped so that its forward returns
the scalar training loss, as ``hapd.export`` expects.

Every factory takes ``batch=`` and returns ``(module, example_inputs)``, so it works
with ``hapd export hapd.models.zoo:NAME``. transformers and torchvision are imported
only when a factory is called (they are test extras, not dependencies of hapd).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor, nn

SEQ = 16
"""Sequence length of the language models' example inputs."""
VOCAB = 128
"""Vocabulary of the tiny language models."""


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


def _tokens(batch: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
    return ids, ids.clone()


def _images(batch: int, size: int, classes: int, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)


def _lm(config: Any, model_class: Any, batch: int) -> tuple[nn.Module, tuple[Tensor, ...]]:
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    model = model_class(config)
    model.config.use_cache = False
    return LanguageModelLoss(model), _tokens(batch)


def gpt2(batch: int = 4) -> tuple[nn.Module, tuple[Tensor, ...]]:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return _lm(config, GPT2LMHeadModel, batch)


def llama(batch: int = 4) -> tuple[nn.Module, tuple[Tensor, ...]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return _lm(config, LlamaForCausalLM, batch)


def bert(batch: int = 4) -> tuple[nn.Module, tuple[Tensor, ...]]:
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=64,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return _lm(config, BertForMaskedLM, batch)


def mixtral(batch: int = 4) -> tuple[nn.Module, tuple[Tensor, ...]]:
    """Mixtral with 4 experts, top-2, run by hapd's dense experts implementation
    (:mod:`hapd.models.hf_experts`: transformers' default sorts tokens into a Python
    custom op with data-dependent offsets, which no plan can split; the dense one is
    the same function as einsums over the expert dim, so a plan can split the experts)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    from hapd.models.hf_experts import register

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           num_local_experts=4, num_experts_per_tok=2)
    config._experts_implementation = register()
    return _lm(config, MixtralForCausalLM, batch)


def qwen2_moe(batch: int = 4) -> tuple[nn.Module, tuple[Tensor, ...]]:
    """Qwen2-MoE with 4 routed experts (top-2) and a gated shared expert, run by hapd's
    dense experts implementation (see :func:`mixtral`)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    from hapd.models.hf_experts import register

    config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
                            shared_expert_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=True)
    config._experts_implementation = register()
    return _lm(config, Qwen2MoeForCausalLM, batch)


def t5(batch: int = 4) -> tuple[nn.Module, tuple[Tensor, ...]]:
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    config._attn_implementation = "sdpa"
    model = T5ForConditionalGeneration(config)
    model.config.use_cache = False
    return LanguageModelLoss(model), _tokens(batch)


def resnet18(batch: int = 4) -> tuple[nn.Module, tuple[Tensor, ...]]:
    from torchvision.models import resnet18 as build

    torch.manual_seed(0)
    return ClassifierLoss(build(num_classes=10)), _images(batch, 32, 10)


def vit(batch: int = 4) -> tuple[nn.Module, tuple[Tensor, ...]]:
    from torchvision.models import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=4, hidden_dim=64,
                              mlp_dim=128, num_classes=10)
    return ClassifierLoss(model), _images(batch, 32, 10)


ZOO: dict[str, Callable[..., tuple[nn.Module, tuple[Tensor, ...]]]] = {
    "gpt2": gpt2, "llama": llama, "bert": bert, "mixtral": mixtral, "qwen2_moe": qwen2_moe, "t5": t5,
    "resnet18": resnet18, "vit": vit,
}
"""Zoo name → factory."""
