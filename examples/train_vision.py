#!/usr/bin/env python3
"""Train a torchvision image classifier (a small ConvNeXt, or a ResNet-18) with hapd.

    hapd run examples/train_vision.py -n 2 -- --steps 100
    hapd run examples/train_vision.py -n 2 -- --model resnet18 --steps 100
    python examples/train_vision.py --steps 20                 # one process

The model comes from torchvision's constructor (random init: no downloads): a ConvNeXt
of two stages (``--width``, ``--depth``; stochastic depth and layer scale as torchvision
builds them) or ``resnet18`` (batch norm). The images are synthetic: noise plus a
pattern that depends on the class, so the loss goes down. The loop is
examples/train_gpt2.py's: :func:`hapd.parallelize`, :func:`hapd.loader`, AdamW, a
cosine LR schedule, clipping by global norm.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset
from torchvision.models import resnet18
from torchvision.models.convnext import CNBlockConfig, ConvNeXt

import hapd


class ClassifierLoss(nn.Module):
    """(images, targets) → cross-entropy of the batch (hapd trains a forward that returns the loss)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(images), targets)


def build(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)  # every rank builds the same weights
    if args.model == "resnet18":
        return resnet18(num_classes=args.classes)
    w = args.width
    stages = [CNBlockConfig(w, 2 * w, args.depth), CNBlockConfig(2 * w, None, args.depth)]
    return ConvNeXt(stages, stochastic_depth_prob=args.drop_path, num_classes=args.classes)


def synthetic(samples: int, classes: int, image: int, seed: int) -> TensorDataset:
    """Images [samples, 3, image, image]: noise plus the class's fixed pattern."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(classes, 3, image, image, generator=g)
    targets = torch.randint(0, classes, (samples,), generator=g)
    images = torch.randn(samples, 3, image, image, generator=g) + patterns[targets]
    return TensorDataset(images, targets)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a torchvision classifier on synthetic images with hapd.")
    p.add_argument("--model", choices=["convnext", "resnet18"], default="convnext")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps (default 100)")
    p.add_argument("--batch", type=int, default=16, help="global batch (default 16)")
    p.add_argument("--image", type=int, default=32, help="image height and width (default 32)")
    p.add_argument("--classes", type=int, default=10, help="classes (default 10)")
    p.add_argument("--samples", type=int, default=512, help="synthetic images (default 512)")
    p.add_argument("--width", type=int, default=32, help="ConvNeXt: channels of the first stage (default 32)")
    p.add_argument("--depth", type=int, default=2, help="ConvNeXt: blocks per stage (default 2)")
    p.add_argument("--drop-path", type=float, default=0.1, help="ConvNeXt: stochastic depth (default 0.1)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm (default 1.0)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = ClassifierLoss(build(args))
    dataset = synthetic(args.samples, args.classes, args.image, args.seed)
    example = dataset[: args.batch]  # one global batch: (images, targets)

    module = hapd.parallelize(model, example)  # collective: every rank calls it
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.05)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    data = hapd.loader(dataset, module, seed=args.seed, drop_last=True)

    first = module.rank == 0
    if first:
        lengths = module.sample_lengths()  # None: some rank needs more than its slice of the batch
        reading = (f"reading {'/'.join(map(str, lengths))} images of every batch of {args.batch}" if lengths else
                   f"each reading the whole batch of {args.batch} (the plan does not split every input by samples)")
        print(f"{args.model}: {sum(p.numel() for p in model.parameters()):,} parameters, {module.world} rank(s) "
              f"{reading}", flush=True)
    step = epoch = 0
    first_loss = loss = math.nan
    start = time.perf_counter()
    while step < args.steps:
        data.set_epoch(epoch)
        for images, targets in data:
            optimizer.zero_grad(set_to_none=True)
            part = module(images, targets)  # this rank's part of the global batch's loss
            part.backward()
            module.clip_grad_norm_(args.clip)
            optimizer.step()
            scheduler.step()
            step += 1
            loss = module.global_loss(part.detach())  # the single-device loss (collective)
            first_loss = loss if step == 1 else first_loss
            if first and (step % 10 == 0 or step == args.steps):
                print(f"step {step}: loss {loss:.5f}", flush=True)
            if step >= args.steps:
                break
        epoch += 1
    seconds = time.perf_counter() - start
    if first:
        print(f"loss {first_loss:.6f} at step 1 -> {loss:.6f} at step {step}; {step * args.batch / seconds:,.0f} "
              "images/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
