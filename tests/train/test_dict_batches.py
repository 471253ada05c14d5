"""Issue 51: dict batches, as ``datasets`` and transformers' collators give them.

``hapd.parallelize(model, example_dict)`` exports the model called by keyword
(:class:`~hapd.train.programs.KeywordModel`), ``module(**batch)`` runs it, and
``hapd.loader`` over a dataset whose samples are dicts gives each rank the dict of its
pieces of every tensor. On 2 uneven Gloo ranks (3:1) against the single-device model:
the loss and every gradient of each step (:func:`_exact.grad_errors`), and the
parameter names; on one process, the errors that name a batch's wrong keys.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _dist import run_ranks
from _exact import TOL, grad_errors
from torch import nn

import hapd
from hapd.errors import OptionsError

B, SEQ, VOCAB = 8, 6, 24
RATIOS = (0.75, 0.25)
STEPS = 3


class TinyLM(nn.Module):
    """A forward as a transformers causal LM's: keyword token ids and labels in, the loss out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        hidden = torch.tanh(self.proj(self.embed(input_ids)))
        return nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), labels.flatten())


def _dataset(count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (count, SEQ), generator=generator)
    return [{"input_ids": ids[i], "labels": ids[i].roll(-1)} for i in range(count)]


def _collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return torch.utils.data.default_collate(samples)


def _train(rank: int, world: int) -> dict:
    """Three SGD steps from the loader on both the module and the single-device model."""
    torch.manual_seed(0)
    model = TinyLM()
    ref = copy.deepcopy(model)
    data = _dataset(B * STEPS)
    module = hapd.parallelize(model, _collate(data[:B]), options={"ratios": RATIOS}, use_daemon=False, verbose=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(ref.parameters(), lr=0.5)
    out: dict = {"names": sorted(module.full_state_dict()) == sorted(ref.state_dict()), "loss": [], "grad": [],
                 "rows": []}
    for step, batch in enumerate(hapd.loader(data, module, shuffle=False)):
        whole = _collate(data[step * B:(step + 1) * B])
        out["rows"].append(sorted(batch) == ["input_ids", "labels"] and int(batch["input_ids"].shape[0]))
        part = module(**batch)
        expected = ref(**whole)
        out["loss"].append(abs(module.global_loss(part) - float(expected)) / float(expected))
        part.backward()
        expected.backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        out["grad"].append(max(grad_errors(grads, {n: p.grad for n, p in module.inner.named_parameters()}).values()))
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
    return out


def test_a_dict_dataset_trains_as_one_device_on_uneven_ranks():
    results = run_ranks(2, _train)
    assert [r["rows"] for r in results] == [[6] * STEPS, [2] * STEPS]  # each rank its share of every tensor
    for r in results:
        assert r["names"]
        assert max(r["loss"]) <= TOL, r["loss"]
        assert max(r["grad"]) <= TOL, r["grad"]


def test_a_dict_batch_with_other_keys_is_named():
    torch.manual_seed(0)
    data = _dataset(B)
    module = hapd.parallelize(TinyLM(), _collate(data), use_daemon=False, verbose=False)
    batch = _collate(data)
    assert module.keywords == ("input_ids", "labels")
    assert float(module(**batch).detach()) == pytest.approx(float(module(batch["input_ids"], batch["labels"]).detach()))
    with pytest.raises(OptionsError, match=r"missing \['labels'\], unknown \['targets'\]"):
        module(input_ids=batch["input_ids"], targets=batch["labels"])
    with pytest.raises(OptionsError, match="takes no argument 'mask'"):
        hapd.parallelize(TinyLM(), {**batch, "mask": batch["labels"]}, use_daemon=False, verbose=False)
    with pytest.raises(OptionsError, match="samples have keys input_ids, labels, text"):
        next(iter(hapd.loader([{**s, "text": s["labels"]} for s in data], module)))
