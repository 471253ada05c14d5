"""The fully sharded data-parallel baseline: PyTorch FSDP (``fully_shard``, FULL_SHARD).

    torchrun --nproc-per-node 4 fsdp.py --model llama_block --size small --init meta
    torchrun --nproc-per-node 2 -m hapd.fsdp --model mlp --split flops --profile paper-8

The same flags and output as the DDP baseline (:mod:`hapd.harness.ddp`): every rank
trains on its slice of the global batch (``--split even``: system ``"fsdp"``, ``--split
flops``: shares proportional to each device's FLOP/s in ``--profile``, system
``"fsdp-cp"``), with Adam, and reports its per-iteration times
(:mod:`hapd.harness.training`).

**Sharding.** FSDP2's ``torch.distributed.fsdp.fully_shard`` (it runs on CPU with
Gloo; FSDP1's ``FullyShardedDataParallel`` needs an accelerator): every element of the
model's outermost ``nn.ModuleList``\\ s (the transformer blocks) is one FSDP unit and the
model itself the root unit, each parameter split evenly on dim 0 over the ranks, and
gathered for its unit's forward and again for its backward (reshard after forward:
FULL_SHARD); gradients are reduce-scattered, so parameters, gradients and Adam's moments
are all 1/world of the model on each rank, whatever its memory.

**Gradient scaling.** FSDP averages the gradients over the ranks as DDP does, so each
rank's loss is weighted the same way (:func:`hapd.harness.ddp.loss_weight`) and scaled
by the world size: the gradient is exactly the global batch's.

**Weights.** ``--init eager`` builds the whole model on every rank (seeded, so every
rank holds the same values) before it is sharded: a rank's peak is the whole model
once. ``--init meta`` builds it on the meta device, shards it, and gives each rank only
its shard of every parameter from :func:`hapd.module_init` (the values the hapd worker's
``--init meta`` gives: the same seed and names), one parameter at a time.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence

import torch
from torch import nn

from hapd import models
from hapd.errors import HapdError
from hapd.harness.ddp import DDPStep, parse_split_args, report_run, shares, split_parser
from hapd.harness.training import TrainArgs, add_init_flag, local_batch, run_rank, train
from hapd.spmd.distributed import DistEnv
from hapd.state.weights import WeightSource, init_on_meta, module_init
from hapd.util import exit_process

SPLITS = {"even": "fsdp", "flops": "fsdp-cp"}
"""``--split`` value -> the system name it reports."""


def build_parser() -> argparse.ArgumentParser:
    parser = split_parser("fsdp.py", "Fully sharded data-parallel baseline (PyTorch FSDP); launch with torchrun.",
                          "even: equal shares; flops: shares proportional to each device's FLOP/s in --profile "
                          "(default: even)")
    add_init_flag(parser, eager="every rank builds the whole model, then shards it",
                  meta="the model is built on the meta device and each rank initializes only its shards")
    return parser


def units(model: nn.Module) -> Iterator[nn.Module]:
    """The modules sharded as their own FSDP units: the elements of every outermost
    ``nn.ModuleList`` (the blocks of a transformer), in model order."""
    def walk(module: nn.Module) -> Iterator[nn.Module]:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                yield from child
            else:
                yield from walk(child)

    yield from walk(model)


def shard(model: nn.Module, env: DistEnv) -> nn.Module:
    """``model`` (on ``env.device`` or the meta device) sharded in place: each of its
    :func:`units`, then the model itself, ``fully_shard`` with FULL_SHARD over every
    rank. Returns ``model``."""
    # FSDP2 loads when a model is sharded, not at import: --help and the flags need none of it
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(env.device.type, (env.world,))
    for unit in list(units(model)):
        fully_shard(unit, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


@torch.no_grad()
def materialize_shards(model: nn.Module, source: WeightSource, env: DistEnv) -> None:
    """Give a model sharded on the meta device (:func:`shard`) its storage on
    ``env.device`` and each rank its shard of every parameter from ``source``, one
    parameter at a time; buffers keep their values (they are real under
    :func:`hapd.init_on_meta`)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=env.device)
    for name, value in model.named_buffers():
        if name in buffers:
            value.copy_(buffers[name])
    for name, param in model.named_parameters():
        like = torch.empty(param.shape, dtype=param.dtype, device="meta")
        if isinstance(param, DTensor):
            shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            local = param.to_local()
            region = (0, int(offset[0]), int(shape[0])) if param.dim() > 0 else None
        else:
            local, region = param, None
        if local.numel() == 0:
            continue
        value = source.read([name], like, region)
        if value is None:
            raise HapdError(f"{name}: the initializer does not have it", field="--init")
        local.copy_(value.reshape(local.shape))


def build(args: TrainArgs, init: str, env: DistEnv) -> tuple[nn.Module, object]:
    """The model in ``--dtype``, sharded (:func:`shard`), with its weights (see the module
    docstring), and its config."""
    if init == "eager":
        model, config = args.build()
        return shard(model.to(device=env.device, dtype=args.torch_dtype), env), config
    with init_on_meta():
        model, config = args.build()
        twin, _ = args.build()  # on meta too, never sharded: the initializer reads its modules
    model, twin = model.to(dtype=args.torch_dtype), twin.to(dtype=args.torch_dtype)
    source = module_init(twin, args.seed, init=models.module_init_of(twin), device=env.device)
    shard(model, env)
    materialize_shards(model, source, env)
    return model, config


class FSDPStep(DDPStep):
    """Forward and backward of one iteration on the sharded model (FSDP averages the
    gradients over the ranks as DDP does: the loss is scaled the same way)."""


def run(args: TrainArgs, split: str, init: str, env: DistEnv) -> dict:
    """Train and report on this rank; returns the summary."""
    shared = shares(args, split, env)
    model, config = build(args, init, env)
    inputs = local_batch(shared.spec, config, shared.lengths, env.rank, args.seed, env.device, args.torch_dtype)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    step = FSDPStep(model, inputs, env.world, shared.weight)
    times = train(step, optimizer, env, iterations=args.iterations, warmup=args.warmup, trace=args.trace)
    return report_run(args, env, step, times, system=SPLITS[split], split=split, shared=shared, init=init)


def main(argv: Sequence[str] | None = None) -> int:
    args, ns = parse_split_args(build_parser(), argv)
    return run_rank("fsdp", lambda env: run(args, ns.split, ns.init, env))


if __name__ == "__main__":
    exit_process(main())
