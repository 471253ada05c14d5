"""The hapd worker: train a benchmark model with a synthesized plan on every rank.

    torchrun --nproc-per-node 2 worker.py --model bert --profile paper-8
    torchrun --nproc-per-node 2 -m hapd.worker --model mlp --plan mlp.hplan

Every rank builds the same model (same seed) and parallelizes it for the global batch
with :func:`hapd.parallelize`; with ``--init meta`` the model is built on the meta device
and each rank initializes only its own pieces (a model larger than one host's memory
starts). The plan comes from ``--plan FILE``, or else rank 0 asks
the daemon at ``$HAPD_DAEMON`` (a cache hit, an LP-only re-plan or a compile there) and
compiles it itself when none answers, for ``--profile`` (an estimated homogeneous
profile of this job's ranks when none is given), and sends it to the others: ranks never
synthesize on their own (:func:`hapd.train.plan_source.obtain_plan`; rank 0 prints where the
plan came from and how long it took). Each rank then runs its module on its piece of a
synthetic global batch with
Adam and reports its per-iteration times (see :mod:`hapd.harness.training` for the output
lines; system ``"hapd"``; ``loss`` is the global-batch loss of the last timed
iteration, ``estimate_s`` the plan's predicted seconds per iteration and ``estimate_memory``
its predicted peak bytes on each rank).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from hapd import models
from hapd.compiler.options import CompileOptions
from hapd.profile.schema import Profile
from hapd.compiler.plan import Plan
from hapd.errors import HapdError, OptionsError, PlanError
from hapd.harness.training import TrainArgs, add_init_flag, add_train_flags, parse_train_args, report, run_rank, train
from hapd.spmd.distributed import DistEnv, job_host_groups
from hapd.train.parallel_module import ParallelModule
from hapd.train.parallelize import parallelize
from hapd.train.plan_source import job_profile as _job_profile
from hapd.spmd.pipeline import build_pipeline, compile_pipeline
from hapd.state.weights import WeightSource, init_on_meta, module_init
from hapd.util import exit_process


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="worker.py", description="Train a benchmark model with a hapd plan; launch with torchrun or ./run_all.")
    add_train_flags(parser)
    parser.add_argument("--plan", type=Path, default=None, help="Use this .hplan instead of compiling one.")
    parser.add_argument("--mode", choices=["auto", "data_parallel"], default="auto",
                        help="auto: search every rule; data_parallel: only the batch-split program (default: auto)")
    parser.add_argument("--overlap", choices=["off", "auto", "always"], default="off",
                        help="off: one program for the whole batch; auto: also compile one duplica's program (half "
                             "the batch) priced as two interleaved duplicas, one computing while the other "
                             "communicates, and run the cheaper; always: run the duplicas (default: off)")
    parser.add_argument("--compile", action="store_true",
                        help="run each rank's program under torch.compile (collectives between the compiled graphs)")
    parser.add_argument("--pipeline", choices=["off", "auto"], default="off",
                        help="auto: also search pipelines (stages on groups of hosts, 1F1B over micro-batches) and "
                             "run one when it is predicted faster than the SPMD plan (default: off)")
    parser.add_argument("--technique", choices=["spmd", "default"], default="spmd",
                        help="spmd: the SPMD plan (with --overlap and --pipeline as given); default: what "
                             "hapd.parallelize chooses without options (on a profile of several hosts SPMD, "
                             "pipelines and overlap priced, the simplest within the margin) (default: spmd)")
    add_init_flag(parser, eager="every rank builds the whole model",
                  meta="the model is built on the meta device (buffers real), exported from shapes, and each rank "
                       "initializes only its own pieces")
    return parser


def job_profile(args: TrainArgs, env: DistEnv) -> Profile:
    """``--profile``, or the job's devices as each rank describes its own (collective)."""
    return _job_profile(args.profile, env.world, device=env.device)


def global_inputs(args: TrainArgs, env: DistEnv, config) -> tuple[Tensor, ...]:
    """The synthetic global batch (the same on every rank), floating inputs in ``--dtype``."""
    inputs = models.get(args.model).example_inputs(config, args.batch)
    return tuple((t.to(args.torch_dtype) if t.is_floating_point() else t).to(env.device) for t in inputs)


class HapdStep:
    """Forward and backward of one iteration; ``last_loss`` is this rank's loss part."""

    def __init__(self, module: ParallelModule, inputs: Sequence[Tensor]):
        self.module, self.inputs = module, tuple(inputs)
        self.last_loss: Tensor | None = None

    def __call__(self) -> Tensor:
        loss = self.module(*self.inputs)
        loss.backward()
        self.last_loss = loss.detach()
        return self.last_loss


def build(args: TrainArgs, init: str) -> tuple[torch.nn.Module, Any, WeightSource | None]:
    """The model in ``--dtype``, its config, and where each rank's pieces come from:
    ``eager``: the model itself (None); ``meta``: parameters on the meta device and
    :func:`hapd.module_init` (each module's ``reset_parameters()`` and the model's own
    per-module init, seeded by ``--seed`` and the parameter's name: the same full
    values on every rank and world size, not the eager model's values)."""
    if init == "eager":
        model, config = args.build()
        return model.to(dtype=args.torch_dtype), config, None
    with init_on_meta():
        model, config = args.build()
    model = model.to(dtype=args.torch_dtype)
    return model, config, module_init(model, args.seed, init=models.module_init_of(model))


def pipeline_plan(args: TrainArgs, ns: argparse.Namespace, env: DistEnv, model: torch.nn.Module,
                   full: Sequence[Tensor], profile: Profile) -> Plan:
    """The plan with pipelines in the search space, compiled on rank 0 and sent to the
    others (the model exported at the global batch and at every micro-batch size)."""
    box: list[Any] = [None, None]
    if env.rank == 0:
        try:
            plan = compile_pipeline(model, tuple(t.cpu() for t in full), models.get(args.model).batch_dims,
                                    profile, CompileOptions(mode=ns.mode), name=args.model)
            box = [plan.to_bytes(), None]
        except HapdError as exc:
            box = [None, f"{type(exc).__name__}: {exc}"]
    if env.world > 1:
        dist.broadcast_object_list(box, src=0)
    if box[1] is not None:
        raise PlanError(f"rank 0 could not compile the plan: {box[1]}")
    return Plan.from_bytes(box[0])


def run_pipeline(args: TrainArgs, env: DistEnv, model: torch.nn.Module, full: Sequence[Tensor], plan: Plan,
                 profile: Profile) -> dict:
    """Train with the plan's pipeline: this rank's stage, 1F1B over micro-batches."""
    spec = models.get(args.model)
    pipe = build_pipeline(model, tuple(t.cpu() for t in full), spec.batch_dims, plan, profile, device=env.device)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=args.lr)
    last: list[Tensor] = []

    def step() -> Tensor:
        last[:] = [pipe.step(*full)]
        return last[0]

    times = train(step, optimizer, env, iterations=args.iterations, warmup=args.warmup, trace=args.trace)
    loss = last[0].detach().double()
    if env.world > 1:
        dist.all_reduce(loss)
    found = plan.pipeline
    extra = {
        "batch": args.batch, "size": args.size, "dtype": args.dtype, "profile": plan.key["profile_name"],
        "estimate_s": found["per_iteration"], "spmd_estimate_s": found["spmd_only_per_iteration"],
        "pipeline": {"stages": [list(s["ranks"]) for s in found["stages"]], "micro_batches": found["micro_batches"],
                     "stage": pipe.s, "bubble": found["bubble"]},
    }
    return report(env, system="hapd", model=args.model, times=times, warmup=args.warmup, loss=float(loss),
                  extra=extra, json_path=args.json)


def chosen_estimate(plan: Plan) -> float:
    """The predicted seconds per iteration of the technique ``plan`` runs (a plan whose
    pipeline won keeps the SPMD program's estimate beside the pipeline's)."""
    priced = (plan.estimate.get("techniques") or {}).get(plan.technique) or {}
    seconds = priced.get("per_iteration")
    return float(seconds) if seconds is not None else float(plan.estimate["per_iteration"])


def run(args: TrainArgs, ns: argparse.Namespace, env: DistEnv) -> dict:
    spec = models.get(args.model)
    model, config, weights = build(args, ns.init)
    full = global_inputs(args, env, config)
    plan_given = ns.plan
    profile = job_profile(args, env)
    if ns.technique == "default":
        if ns.plan is not None or ns.overlap != "off" or ns.pipeline != "off" or ns.mode != "auto":
            raise OptionsError("--technique default searches what hapd.parallelize does: without --plan, "
                               "--overlap, --pipeline or --mode")
    elif ns.pipeline == "auto":
        if ns.plan is not None or ns.overlap != "off" or ns.init != "eager":
            raise OptionsError("--pipeline auto compiles its own plan, with --overlap off and --init eager")
        plan_given = pipeline_plan(args, ns, env, model, full, profile)
        if plan_given.pipeline is not None:
            return run_pipeline(args, env, model, full, plan_given, profile)
    options = None if ns.technique == "default" else CompileOptions(mode=ns.mode, overlap=ns.overlap != "off")
    module = parallelize(model, tuple(t.cpu() for t in full), profile=profile, plan=plan_given, options=options,
                         overlap="always" if ns.overlap == "always" else "auto", compile=ns.compile,
                         batch_dims=spec.batch_dims, name=args.model,
                         device=env.device, hosts=job_host_groups(env.world), weights=weights)
    del model  # trained through its pieces (the module keeps it only to export it again: eval, other batch sizes)
    plan, source = module.plan, module.plan_source
    inputs = module.shard_inputs(*full)
    optimizer = torch.optim.Adam(module.parameters(), lr=args.lr)
    step = HapdStep(module, inputs)
    times = train(step, optimizer, env, iterations=args.iterations, warmup=args.warmup, trace=args.trace)
    assert step.last_loss is not None
    extra = {
        "batch": args.batch, "size": args.size, "dtype": args.dtype, "init": ns.init, "profile": plan.key["profile_name"],
        "plan": source.origin, "plan_s": source.seconds, "mode": ns.mode, "estimate_s": chosen_estimate(plan),
        "ratios": plan.ratios, "chosen_from": plan.doc["stats"].get("chosen_from"),
        "estimate_memory": plan.estimate.get("memory"), "overlap": plan.overlap, "technique": plan.technique,
    }
    return report(env, system="hapd", model=args.model, times=times, warmup=args.warmup,
                  loss=module.global_loss(step.last_loss), extra=extra, json_path=args.json)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, ns = parse_train_args(parser, argv)
    return run_rank("worker", lambda env: run(args, ns, env))


if __name__ == "__main__":
    exit_process(main())
