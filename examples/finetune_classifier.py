#!/usr/bin/env python3
"""Fine-tune a sequence classifier with frozen embeddings with hapd.

    hapd run examples/finetune_classifier.py -n 2 -- --steps 100
    python examples/finetune_classifier.py --steps 20          # one process

A transformers DistilBERT classifier built from its config (random init: no downloads),
its embeddings frozen (``requires_grad_(False)``: hapd keeps them frozen on every rank,
and AdamW gets only the trainable parameters), trained on synthetic token sequences whose
label is whether most tokens are in the lower half of the vocabulary. The loop is
examples/train_gpt2.py's: :func:`hapd.parallelize`, :func:`hapd.loader`, AdamW,
clipping by global norm.

hapd trains a forward that returns the loss: the transformers model returns a
``SequenceClassifierOutput``, so the wrapper returns ``out.loss``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset
from transformers import DistilBertConfig, DistilBertForSequenceClassification

import hapd


class ClassifierLoss(nn.Module):
    """(input_ids, labels) → the classifier's loss (``out.loss``: hapd trains the loss)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, labels=labels).loss


def synthetic(samples: int, seq: int, vocab: int, seed: int) -> TensorDataset:
    """Token sequences; label 1 when most tokens are below vocab/2 (a bag-of-words task)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (samples, seq), generator=g)
    labels = ((ids < vocab // 2).sum(1) * 2 > seq).long()
    return TensorDataset(ids, labels)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Fine-tune a DistilBERT classifier with frozen embeddings with hapd.")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    p.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence (default 32)")
    p.add_argument("--samples", type=int, default=512, help="synthetic sequences (default 512)")
    p.add_argument("--vocab", type=int, default=1000, help="vocabulary size (default 1000)")
    p.add_argument("--width", type=int, default=128, help="dim (default 128)")
    p.add_argument("--layers", type=int, default=2, help="n_layers (default 2)")
    p.add_argument("--heads", type=int, default=4, help="n_heads (default 4)")
    p.add_argument("--dropout", type=float, default=0.1, help="dropout (default 0.1)")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm (default 1.0)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # every rank builds the same weights
    config = DistilBertConfig(vocab_size=args.vocab, max_position_embeddings=args.seq, dim=args.width,
                              hidden_dim=4 * args.width, n_layers=args.layers, n_heads=args.heads,
                              dropout=args.dropout, attention_dropout=args.dropout,
                              seq_classif_dropout=args.dropout, num_labels=2)
    classifier = DistilBertForSequenceClassification(config)
    classifier.distilbert.embeddings.requires_grad_(False)  # frozen: word and position embeddings, their norm
    frozen = classifier.distilbert.embeddings.word_embeddings.weight.detach().clone()
    model = ClassifierLoss(classifier)

    dataset = synthetic(args.samples, args.seq, args.vocab, args.seed)
    example = dataset[: args.batch]  # one global batch: (ids, labels)
    module = hapd.parallelize(model, example)  # collective: every rank calls it
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=args.lr)
    data = hapd.loader(dataset, module, seed=args.seed, drop_last=True)

    first = module.rank == 0
    if first:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        print(f"classifier: {trainable:,} of {total:,} parameters trainable (embeddings frozen), "
              f"{module.world} rank(s)", flush=True)
    step = epoch = 0
    first_loss = loss = math.nan
    start = time.perf_counter()
    while step < args.steps:
        data.set_epoch(epoch)
        for ids, labels in data:
            optimizer.zero_grad(set_to_none=True)
            part = module(ids, labels)  # this rank's part of the global batch's loss
            part.backward()
            module.clip_grad_norm_(args.clip)
            optimizer.step()
            step += 1
            loss = module.global_loss(part.detach())  # the single-device loss (collective)
            first_loss = loss if step == 1 else first_loss
            if first and (step % 10 == 0 or step == args.steps):
                print(f"step {step}: loss {loss:.5f}", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    seconds = time.perf_counter() - start

    state = module.full_state_dict()  # the single-device names (collective)
    unchanged = torch.equal(state["model.distilbert.embeddings.word_embeddings.weight"], frozen)
    if first:
        print(f"loss {first_loss:.6f} at step 1 -> {loss:.6f} at step {step}; {step * args.batch / seconds:,.0f} "
              f"sequences/s; frozen embeddings unchanged: {unchanged}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
