"""The data-parallel baselines: DDP-EV (even split) and DDP-CP (split by FLOP/s).

    torchrun --nproc-per-node 2 ddp.py --model bert --split flops --profile paper-8
    torchrun --nproc-per-node 2 -m hapd.ddp --model mlp

Every rank builds the same model (same seed), wraps it in
``torch.nn.parallel.DistributedDataParallel`` and trains on its slice of the global
batch: ``sharding_lengths(ratios, batch)`` with ratios all equal (``--split even``) or
proportional to each device's achieved FLOP/s in ``--profile`` (``--split flops``).

**Gradient scaling.** The benchmark models' losses are sums over their samples and DDP
*averages* gradients over the ranks, so backward runs on ``world * local_loss``: the
averaged gradient is then ``(1/world) Σ_r world ∇loss_r = ∇ Σ_r loss_r``, exactly the
gradient of the global-batch sum loss whatever the split (HAP's ddp.py scales the same
way). The zoo's transformers models return a *mean* over their samples' tokens; the
global mean is ``Σ_r (n_r / N) mean_r``, so each rank's loss is weighted by its share
``n_r / N`` of the samples (:func:`loss_weight`) and the gradient is again exactly the
global batch's.

**A rank with no samples** (a batch smaller than the world, or a slow device under
``--split flops``) still runs forward and backward on its empty slice: the sum loss of
no samples is 0 and autograd still reaches every parameter with a zero gradient, so the
rank joins every gradient all-reduce bucket and contributes 0. (Every benchmark model
does this; tests/harness/test_training.py checks the all-reduce with a ``[n, 0]`` split.) A mean
over no samples is not a number, so a model with a mean loss needs samples on every rank.

Output: see :mod:`hapd.harness.training` (system ``"ddp-ev"`` or ``"ddp-cp"``); the reported
``loss`` is the global batch's loss (its sum, or its mean) of the last timed iteration,
all-reduced after the timing, the same on every rank.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from hapd import models
from hapd.errors import HapdError
from hapd.profile.schema import Profile, load_profile
from hapd.compiler.lengths import sharding_lengths
from hapd.harness.training import TrainArgs, add_train_flags, local_batch, parse_train_args, report, run_rank, train
from hapd.spmd.distributed import DistEnv
from hapd.util import exit_process

SPLITS = {"even": "ddp-ev", "flops": "ddp-cp"}
"""``--split`` value -> the system name it reports."""


def split_parser(prog: str, description: str, split_help: str) -> argparse.ArgumentParser:
    """The flags of a data-parallel baseline (this one and :mod:`hapd.harness.fsdp`): the
    training flags and ``--split``."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_train_flags(parser)
    parser.add_argument("--split", choices=list(SPLITS), default="even", help=split_help)
    return parser


def parse_split_args(parser: argparse.ArgumentParser,
                     argv: Sequence[str] | None) -> tuple[TrainArgs, argparse.Namespace]:
    """:func:`~hapd.harness.training.parse_train_args`, and ``--split flops`` needs a
    ``--profile`` (exits through ``parser.error``)."""
    args, ns = parse_train_args(parser, argv)
    if ns.split == "flops" and args.profile is None:
        parser.error("--split flops needs --profile NAME|PATH: the split follows each device's FLOP/s")
    return args, ns


def build_parser() -> argparse.ArgumentParser:
    parser = split_parser("ddp.py", "Data-parallel baseline (DistributedDataParallel); launch with torchrun.",
                          "even: equal shares (DDP-EV); flops: shares proportional to each device's "
                          "FLOP/s in --profile (DDP-CP) (default: even)")
    parser.add_argument("--bucket-mib", type=float, default=25.0, metavar="MIB",
                        help="DDP's gradient bucket size, bucket_cap_mb (default: 25, DDP's own)")
    return parser


def split_lengths(split: str, batch: int, world: int, profile: Profile | None) -> list[int]:
    """Samples of the global ``batch`` on each rank under ``split``."""
    if split == "even":
        return sharding_lengths([1.0] * world, batch)
    if split == "flops":
        if profile is None:
            raise HapdError("--split flops needs --profile (each device's FLOP/s)", field="--profile")
        if profile.world != world:
            raise HapdError(f"profile {profile.name!r} has {profile.world} devices but the job has {world} ranks",
                            field="--profile")
        return sharding_lengths(profile.flops_ratios(), batch)
    raise HapdError(f"unknown split {split!r}; known: {', '.join(SPLITS)}", field="--split")


def loss_weight(reduction: str, lengths: Sequence[int], rank: int, model: str = "the model") -> float:
    """What rank ``rank``'s loss counts for in the global batch's loss: 1 when the loss is
    a sum over samples, the rank's share of the samples when it is a mean (see the module
    docstring). :class:`HapdError` for a mean over a rank with no samples."""
    if reduction == "sum":
        return 1.0
    if reduction != "mean":
        raise HapdError(f"{model}: unknown loss reduction {reduction!r} (sum or mean)", field="loss")
    if lengths[rank] == 0:
        raise HapdError(f"{model}'s loss is a mean over its samples and rank {rank} would get none "
                        f"(split {list(lengths)}): use a larger --batch", field="--batch")
    return lengths[rank] / sum(lengths)


def wrap(model: nn.Module, env: DistEnv, bucket_mib: float = 25.0) -> DistributedDataParallel:
    """``model`` (already on ``env.device``) in DDP with ``bucket_mib`` MiB buckets."""
    if env.is_cuda:
        return DistributedDataParallel(model, device_ids=[env.device.index], output_device=env.device.index,
                                       bucket_cap_mb=bucket_mib)
    return DistributedDataParallel(model, bucket_cap_mb=bucket_mib)


class DDPStep:
    """Forward and backward of one iteration; ``last_loss`` is this rank's part of the
    global loss (its loss times ``weight``, :func:`loss_weight`)."""

    def __init__(self, model: DistributedDataParallel, inputs: Sequence[Tensor], world: int, weight: float = 1.0):
        self.model = model
        self.inputs = tuple(inputs)
        self.world = world
        self.weight = weight
        self.last_loss: Tensor | None = None

    def __call__(self) -> Tensor:
        loss = self.model(*self.inputs) * self.weight
        # DDP averages gradients over ranks; the weighted losses sum: see the module docstring
        (loss * self.world).backward()
        self.last_loss = loss.detach()
        return self.last_loss


@dataclass(frozen=True)
class Shares:
    """How a data-parallel baseline's job splits the global batch (:func:`shares`)."""

    profile: Profile | None
    """``--profile``, loaded (None without one)."""
    lengths: list[int]
    """Samples of the global batch on each rank (:func:`split_lengths`)."""
    spec: models.ModelSpec
    """The model's registry entry."""
    weight: float
    """What this rank's loss counts for in the global batch's loss (:func:`loss_weight`)."""


def shares(args: TrainArgs, split: str, env: DistEnv) -> Shares:
    """This job's :class:`Shares` under ``split``, on this rank."""
    profile = load_profile(args.profile, world_size=env.world) if args.profile is not None else None
    lengths = split_lengths(split, args.batch, env.world, profile)
    spec = models.get(args.model)
    return Shares(profile, lengths, spec, loss_weight(spec.loss, lengths, env.rank, args.model))


def report_run(args: TrainArgs, env: DistEnv, step: DDPStep, times: Sequence[float], *, system: str, split: str,
               shared: Shares, **more: object) -> dict:
    """Report a data-parallel baseline's timed run (:func:`~hapd.harness.training.report`)
    with the global batch's loss of its last iteration (all-reduced: collective) and
    ``more`` beside the split; returns the summary."""
    assert step.last_loss is not None
    total = step.last_loss.float().reshape(1).clone()
    dist.all_reduce(total)
    extra = {"split": split, "lengths": shared.lengths, "batch": args.batch, "size": args.size, "dtype": args.dtype,
             **more, "profile": None if shared.profile is None else shared.profile.name}
    return report(env, system=system, model=args.model, times=times, warmup=args.warmup,
                  loss=float(total.item()), extra=extra, json_path=args.json)


def run(args: TrainArgs, split: str, env: DistEnv, bucket_mib: float = 25.0) -> dict:
    """Train and report on this rank; returns the summary."""
    shared = shares(args, split, env)
    model, config = args.build()
    model = model.to(device=env.device, dtype=args.torch_dtype)
    ddp_model = wrap(model, env, bucket_mib)
    inputs = local_batch(shared.spec, config, shared.lengths, env.rank, args.seed, env.device, args.torch_dtype)
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=args.lr)
    step = DDPStep(ddp_model, inputs, env.world, shared.weight)
    times = train(step, optimizer, env, iterations=args.iterations, warmup=args.warmup, trace=args.trace)
    return report_run(args, env, step, times, system=SPLITS[split], split=split, shared=shared)


def main(argv: Sequence[str] | None = None) -> int:
    args, ns = parse_split_args(build_parser(), argv)
    return run_rank("ddp", lambda env: run(args, ns.split, env, ns.bucket_mib))


if __name__ == "__main__":
    exit_process(main())
