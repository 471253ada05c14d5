"""Rules that close the gaps which made zoo plans lose to DDP, run on 2 Gloo ranks with
uneven ratios (the harness of ``tests/_exact.py``): each case forces the rule under
test, and the loss and every gradient must equal the single-device ones.

Covered: ``pad`` on a dim it does not pad (transformers' causal-LM label shift) and
``constant_pad_nd`` by zero on partial sums, the reflection pad, ``diff`` with a
``prepend`` (transformers' packed-sequence check), ``cat`` with a legacy empty operand
(T5's cache), ``expand`` of a replicated operand to each rank's length of the batch
(ViT's class token, position ids), and reshapes that merge the batch with the next dim
or change nothing (Mixtral's router input). GPT-2 and T5 end to end with those rules.
"""

from __future__ import annotations

import torch
from _exact import Spec, _all, _merge, _ops, _seeded, rule_tests
from test_rules_zoo import BATCH, _gpt2
from torch import Tensor, nn

# --------------------------------------------------------------------------------------
# Tiny modules (forward returns the loss)
# --------------------------------------------------------------------------------------

VOCAB = 11


class ShiftedLabels(nn.Module):
    """A language-model loss whose labels are shifted by ``pad`` (as transformers' loss
    does), plus ``diff`` of the positions with a ``prepend`` feeding the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 6)
        self.head = nn.Linear(6, VOCAB)

    def forward(self, ids: Tensor, labels: Tensor, positions: Tensor) -> Tensor:
        steps = torch.diff(positions, dim=-1, prepend=positions[:, :1] - 1)  # [B, S], all 1
        h = self.embed(ids) * steps.unsqueeze(-1).to(torch.float32)
        shifted = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), shifted.flatten())


def _shifted_inputs() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, 5), generator=g)
    positions = torch.arange(5).expand(BATCH, 5).contiguous()
    return ids, torch.randint(0, VOCAB, (BATCH, 5), generator=g), positions


class PartialPad(nn.Module):
    """A row-parallel linear's partial sums padded by zero, then by reflection."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 6), nn.Linear(8, 5)

    def forward(self, x: Tensor) -> Tensor:
        h = nn.functional.pad(self.a(x), (1, 1))  # [B, 8]
        r = nn.functional.pad(self.b(h).unsqueeze(1), (2, 1), mode="reflect")  # [B, 1, 8]
        return (r ** 2).sum()


class LegacyCache(nn.Module):
    """Keys appended to an empty 1-D cache, as T5's legacy cache does."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(8, 8)
        self.register_buffer("cache", torch.tensor([]), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        keys = self.k(x).unflatten(-1, (2, 4)).transpose(1, 2)  # [B, 2, S, 4]
        return (torch.cat([self.cache, keys], dim=-2) ** 2).sum()


class ClassToken(nn.Module):
    """ViT's class token expanded to the batch and concatenated to the patches, and
    position ids expanded from ``[1, S]`` to ``[B, S]``."""

    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Parameter(torch.randn(1, 1, 6))
        self.pos = nn.Embedding(8, 6)
        self.lin = nn.Linear(6, 6)

    def forward(self, patches: Tensor) -> Tensor:
        b, s, _ = patches.shape
        tokens = torch.cat([self.token.expand(b, -1, -1), patches], dim=1)  # [B, S+1, 6]
        ids = torch.arange(s + 1).unsqueeze(0).expand(b, -1)  # [B, S+1]
        return (self.lin(tokens + self.pos(ids)).tanh() ** 2).sum()


class MergedRows(nn.Module):
    """Mixtral's router input: ``[B, S, F] → [B·S, F] → [B·S, F]``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(6, 4)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1]).reshape(-1, 6)
        return (self.gate(rows).softmax(-1) ** 2).sum()


def _t5() -> tuple[nn.Module, tuple[Tensor, ...]]:
    """The zoo's T5 with its output projection and both embeddings untied from the
    shared one (tied parameters are not what these cases test)."""
    from hapd.models.zoo import t5

    module, inputs = t5(batch=BATCH)
    t5_model = module.model
    for layer in (t5_model.lm_head, t5_model.encoder.embed_tokens, t5_model.decoder.embed_tokens):
        layer.weight = nn.Parameter(layer.weight.detach().clone())
    return module, inputs


SPECS = [
    Spec("pad+diff", lambda: (_seeded(ShiftedLabels)()[0], _shifted_inputs()), "auto",
         _merge(_all("aten.pad", "sharded"), _all("aten.diff", "sharded")),
         frozenset({("aten.pad", "sharded"), ("aten.diff", "sharded")})),
    Spec("pad/partial", _seeded(PartialPad, lambda: torch.randn(BATCH, 12)), "auto",
         lambda doc: {**dict(zip(_ops(doc, "aten.linear"), ("row-parallel", "partial"))),
                      **{n: "partial" for n in _ops(doc, "aten.pad")[:1]}},
         frozenset({("aten.pad", "partial")})),
    Spec("cat/legacy-empty", _seeded(LegacyCache, lambda: torch.randn(BATCH, 3, 8)), "auto",
         _all("aten.cat", "sharded"), frozenset({("aten.cat", "sharded")})),
    Spec("expand/broadcast-split", _seeded(ClassToken, lambda: torch.randn(BATCH, 7, 6)), "auto",
         _merge(_all("aten.expand", "broadcast-split"), _all("aten.cat", "sharded")),
         frozenset({("aten.expand", "broadcast-split"), ("aten.cat", "sharded")})),
    Spec("reshape/merged-rows", _seeded(MergedRows, lambda: torch.randn(BATCH, 3, 6)), "auto",
         _all("aten.reshape", "sharded"), frozenset({("aten.reshape", "sharded")})),
    Spec("gpt2/data-parallel", _gpt2, "data_parallel", None, frozenset({("aten.pad", "sharded")})),
    Spec("t5/data-parallel", _t5, "data_parallel", None, frozenset({("aten.cat", "sharded")})),
]


# the fixture ``results`` and the tests test_loss_and_gradients_match_single_device and
# test_plans_run_the_rules_under_test, for SPECS
results, test_loss_and_gradients_match_single_device, test_plans_run_the_rules_under_test = rule_tests(SPECS)
