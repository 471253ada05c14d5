#!/usr/bin/env python3
"""Train a small GPT-2 (random init) on byte-level text with hapd: the example to copy.

    ./run_all examples/train_gpt2.py 2 -- --steps 200 --save-every 50
    ./run_all examples/train_gpt2.py 2 -- --steps 300 --resume       # goes on from step 200
    ./run_all examples/train_gpt2.py 2 --hosts HOSTS -- --profile cluster.json   # a cluster's profile: hapd
                                                    # searches SPMD plans and pipelines for it and runs the faster
    python -m launcher run examples/train_gpt2.py -n 2 --hosts HOSTS --elastic 2:3 -- --profile cluster.json
                                                    # a host lost or joining: the job goes on (hapd.Elastic)

(or ``torchrun --nproc-per-node 2 examples/train_gpt2.py ...``, or plain ``python`` for one
process). Every rank builds the same model from the same seed; :func:`hapd.parallelize`
exports it for one global batch, gets the plan (from the daemon's cache under
``./run_all``) and keeps this rank's pieces. :func:`hapd.loader` gives each rank only its
samples of every global batch. The rest is ordinary PyTorch: AdamW, a cosine LR schedule,
gradient clipping by global norm. Checkpoints hold every rank's shards, the optimizer and
the step, and load on any number of ranks; at the end the model is exported as one
single-device safetensors file that ``GPT2LMHeadModel.from_pretrained`` reads.

The text is this repository's README.md and docs/*.md (or ``--text FILE ...``), as bytes:
tokens 0..255, no tokenizer and no downloads.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset, default_collate
from transformers import GPT2Config, GPT2LMHeadModel

import hapd
from hapd.models.zoo import LanguageModelLoss

VOCAB = 256
"""Byte-level tokens."""


def default_texts() -> list[Path]:
    """README.md and docs/*.md of the repository hapd is installed from (an editable
    install), else hapd's own Python sources."""
    root = Path(hapd.__file__).resolve().parent
    found = [root.parent / "README.md", *sorted((root.parent / "docs").glob("*.md"))]
    found = [p for p in found if p.is_file()]
    return found or sorted(root.rglob("*.py"))


class ByteWindows(Dataset):
    """Fixed-length windows of a byte string: sample ``i`` is ``(ids, labels)``, both the
    ``seq`` bytes from ``i * stride`` (GPT-2 shifts the labels itself)."""

    def __init__(self, data: bytes, seq: int, stride: int | None = None):
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.seq, self.stride = seq, stride or seq
        if len(self.tokens) < seq:
            raise SystemExit(f"the text has {len(self.tokens)} bytes, fewer than one window of {seq}")

    def __len__(self) -> int:
        return (len(self.tokens) - self.seq) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = self.tokens[i * self.stride : i * self.stride + self.seq]
        return ids, ids


def build_model(args: argparse.Namespace) -> LanguageModelLoss:
    """A small GPT-2 whose forward returns the loss (what hapd trains), without dropout."""
    torch.manual_seed(args.seed)  # every rank builds the same weights
    config = GPT2Config(vocab_size=VOCAB, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                        bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "sdpa"
    return LanguageModelLoss(GPT2LMHeadModel(config))


def cosine(warmup: int, total: int, floor: float = 0.1):
    """LR factor at a step: linear warm-up, then cosine down to ``floor``."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * done))
    return factor


class _Lines:
    """tqdm's output when it is not a terminal (under ``./run_all`` the launcher reads
    lines): every refresh is one line instead of a carriage return."""

    def write(self, text: str) -> int:
        line = text.replace("\r", "").strip()
        if line:
            print(line, flush=True)
        return len(text)

    def flush(self) -> None:
        sys.stdout.flush()


def progress(total: int, initial: int, show: bool):
    """Rank 0's progress bar (a line every few seconds when output is not a terminal)."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=initial, disable=not show, desc="train", unit="step", dynamic_ncols=True,
                file=None if tty else _Lines(), mininterval=0.2 if tty else 5.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train a small byte-level GPT-2 with hapd.")
    p.add_argument("--steps", type=int, default=200, help="train until this step (default 200)")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this step, as an interrupted run would (the LR schedule still spans --steps)")
    p.add_argument("--batch", type=int, default=16, help="global batch, in windows (default 16)")
    p.add_argument("--seq", type=int, default=64, help="window length in bytes (default 64)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--warmup", type=int, default=10, help="LR warm-up steps (default 10)")
    p.add_argument("--clip", type=float, default=1.0, help="clip gradients to this global norm (default 1.0)")
    p.add_argument("--width", type=int, default=128, help="n_embd (default 128)")
    p.add_argument("--layers", type=int, default=4, help="n_layer (default 4)")
    p.add_argument("--heads", type=int, default=4, help="n_head (default 4)")
    p.add_argument("--text", type=Path, nargs="+", default=None, help="text files (default: README.md, docs/*.md)")
    p.add_argument("--checkpoint", type=Path, default=Path("checkpoints/gpt2"), help="checkpoint folder")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint")
    p.add_argument("--export", type=Path, default=Path("gpt2-bytes"),
                   help="folder for the final model (config.json + model.safetensors)")
    p.add_argument("--profile", type=Path, default=None,
                   help="the cluster's profile (hapd profile / ./run_all --profile): plans, and pipelines when it "
                        "spans several hosts, are searched for it (default: the devices as each rank sees its own)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = b"\n\n".join(p.read_bytes() for p in args.text or default_texts())
    dataset = ByteWindows(text, args.seq)
    model = build_model(args)
    example = tuple(default_collate([dataset[i] for i in range(args.batch)]))  # one global batch

    module = hapd.parallelize(model, example, profile=args.profile)  # collective: every rank calls it
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine(args.warmup, args.steps))
    # this rank's samples of every global batch; whole batches only, so that every step has args.batch samples
    # (the tokens/s below; by default the short last batch of an epoch trains too, with a program for its size)
    data = hapd.loader(dataset, module, seed=args.seed, drop_last=True)
    per_epoch = len(data)

    # under `--elastic`, a job restarted on other hosts goes on from its newest in-memory snapshot
    elastic = hapd.Elastic(module, optimizer, sampler=data, state={"scheduler": scheduler})
    step = elastic.resume()  # 0 unless an elastic launcher restarted the job
    epoch = data.sampler.epoch if step else 0
    if args.resume and not step:  # parameters, optimizer, data position, RNG; on any number of ranks
        state = hapd.load_checkpoint(args.checkpoint, module, optimizer, sampler=data)
        step, epoch = state["step"], data.sampler.epoch
        scheduler.load_state_dict(state["extra"]["scheduler"])
    first = module.rank == 0
    split = module.sample_lengths()  # None: every rank reads whole batches (a pipeline's stages cut them)
    reading = f"reading {split} samples each" if split is not None else "reading whole batches"
    if first:
        print(f"gpt2: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, {len(dataset)} windows of "
              f"{args.seq} bytes, {per_epoch} steps per epoch, {module.world} rank(s) {reading}; "
              f"{'resuming at' if args.resume else 'starting at'} step {step}", flush=True)

    def save() -> None:
        hapd.save_checkpoint(args.checkpoint, module, optimizer, sampler=data, step=step,
                             extra={"scheduler": scheduler.state_dict()})
        if first:
            print(f"checkpoint: step {step} in {args.checkpoint}", flush=True)

    last = args.steps if args.stop_at is None else min(args.steps, args.stop_at)
    tokens = args.batch * args.seq
    bar = progress(last, step, first)
    start, start_step = time.perf_counter(), step
    first_loss = loss = math.nan
    while step < last:
        data.set_epoch(epoch)  # the epoch's shuffle; a resumed epoch goes on where the checkpoint was taken
        for ids, labels in data:
            optimizer.zero_grad(set_to_none=True)
            part = module(ids, labels)  # this rank's part of the global batch's loss
            part.backward()
            module.clip_grad_norm_(args.clip)
            optimizer.step()
            scheduler.step()
            step += 1
            loss = module.global_loss(part.detach())  # the single-device loss (collective)
            if step == start_step + 1:
                first_loss = loss
            rate = (step - start_step) * tokens / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}", tok_s=f"{rate:,.0f}",
                            refresh=False)
            bar.update()
            if args.save_every and step % args.save_every == 0:
                save()
            elastic.step_done(step)  # a snapshot when due; stops here when a host joins
            if step >= last:
                break
        epoch += 1
    bar.close()
    elastic.close()
    seconds = time.perf_counter() - start
    if not args.save_every or step % args.save_every:
        save()

    # one single-device file (+ config.json) under the GPT-2's own names: from_pretrained reads it
    hapd.export_safetensors(module, args.export, strip_prefix="model.", config=model.model.config)
    if first:
        rate = (step - start_step) * tokens / seconds if step > start_step else math.nan
        print(f"loss {first_loss:.5f} at step {start_step + 1} -> {loss:.5f} at step {step}; {rate:,.0f} tokens/s; "
              f"model: {args.export} (GPT2LMHeadModel.from_pretrained)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
