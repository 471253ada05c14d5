"""A causal language model trained on packed rows: several documents per row.

:class:`PackedLanguageModel` wraps a transformers causal LM (``GPT2LMHeadModel``,
``LlamaForCausalLM``, … or the zoo's :class:`~hapd.models.zoo.LanguageModelLoss`) so its
forward takes the rows :func:`hapd.mixed_loader` builds — ``(input_ids, position_ids,
labels)``, each ``[rows, length]`` — and returns the model's loss. A document starts
where its positions restart at 0; each token attends only to the earlier tokens of its
own document (a block-diagonal causal mask, built here from the positions and passed to
the model as its 4-D boolean ``attention_mask``), and the model sees each document's own
positions. The loader puts ``-100`` on each document's first label, so the model's
shifted loss never predicts across two documents: the loss of a packed row is the loss
of its documents run one by one.
"""

from __future__ import annotations

from torch import Tensor, nn


class PackedLanguageModel(nn.Module):
    """``forward(input_ids, position_ids, labels)`` → the loss of packed rows (see the
    module docstring). ``model``: a transformers causal LM, or a module holding one as
    ``.model`` whose own forward takes only ``(input_ids, labels)``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        inner = getattr(model, "model", None)
        wrapped = not hasattr(model, "config") and isinstance(inner, nn.Module) and hasattr(inner, "config")
        self.model = inner if wrapped else model

    def forward(self, input_ids: Tensor, position_ids: Tensor, labels: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, attention_mask=document_mask(position_ids), position_ids=position_ids,
                          labels=labels).loss


def document_mask(position_ids: Tensor) -> Tensor:
    """``[rows, 1, length, length]`` boolean: token ``q`` attends to token ``k`` when both
    are in one document (positions restart at 0 where a document starts) and ``k`` is
    not after ``q``."""
    document = (position_ids == 0).cumsum(-1)
    same = document.unsqueeze(-1) == document.unsqueeze(-2)
    causal = position_ids.unsqueeze(-2) <= position_ids.unsqueeze(-1)
    return (same & causal).unsqueeze(1)


__all__ = ["PackedLanguageModel", "document_mask"]
