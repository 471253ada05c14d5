"""The memory model against measurement: predicted vs measured peak bytes per rank.

    .venv/bin/python bench/memory_model.py                      # every model, 2 and 4 ranks
    .venv/bin/python bench/memory_model.py --models mlp zoo.gpt2 --worlds 2
    .venv/bin/python bench/memory_model.py --precision bf16     # planned and run under bf16 autocast

For each benchmark model and zoo model (``--size``, default small), exported at the
global batch ``--batch-per-rank`` × ranks and compiled for an estimated profile of
unequal devices with uneven sharding ratios (``RATIOS``), every rank runs two training
steps (``zero_grad(set_to_none=True)``, forward, backward, Adam's step) on Gloo CPU
ranks, and the peak of the second step (the steady state: Adam's moments exist) is
measured with :class:`hapd.harness.memtrack.LiveTensorBytes` — the bytes of live tensor
storages, counted at every ATen op. The prediction is the plan's ``estimate.memory``
for that rank (the larger of the bytes held while the backward pass runs and during
the optimizer step, ``rustcore/core/src/memory.rs``, with every split dim priced at the
integer lengths the rank holds). The table prints both per rank
with the relative error ``(predicted − measured) / measured``, then the median and
worst |error| over all ranks of all models. With ``--precision bf16`` (or fp16) the plan
is compiled for that precision (activations priced at autocast's dtypes) and each rank
runs its steps under ``torch.autocast`` to it, as :func:`hapd.parallelize` does.
"""

from __future__ import annotations

import argparse
import datetime
import io
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import hapd  # noqa: E402
from hapd import models  # noqa: E402
from hapd.ir.export import export  # noqa: E402
from hapd.ir.lower import lower  # noqa: E402
from hapd.compiler.options import CompileOptions  # noqa: E402
from hapd.compiler.ratios import part_memory  # noqa: E402
from hapd.profile.schema import estimated_profile  # noqa: E402
from hapd.util import format_bytes  # noqa: E402

RATIOS = {2: (0.6, 0.4), 4: (0.4, 0.3, 0.2, 0.1)}
"""Uneven sharding ratios per world size."""
DEFAULT_MODELS = (*models.MODELS, *models.ZOO_MODELS)


@dataclass(frozen=True)
class RankResult:
    """One rank's measurement."""

    rank: int
    predicted: float
    measured: float
    parts: dict[str, float]

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def _rank_main(rank: int, world: int, store: str, program: bytes, plan: bytes, inputs: tuple, conn,
               precision: str = "fp32") -> None:
    """One Gloo rank: two training steps; sends the peak bytes of the second."""
    import torch.distributed as dist

    from hapd.ir.normalize import normalize
    from hapd.compiler.plan import Plan
    from hapd.harness.memtrack import LiveTensorBytes
    from hapd.spmd.rewrite import distribute
    from hapd.train.precision import plan_autocast

    import warnings

    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    try:
        if os.path.exists("/sys/class/net/lo"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=600))
        torch.manual_seed(0)
        module = distribute(normalize(torch.export.load(io.BytesIO(program))), Plan.from_bytes(plan), rank)
        local = module.shard_inputs(*inputs)
        del inputs
        optimizer = torch.optim.Adam(module.parameters(), lr=1e-4)
        with LiveTensorBytes() as tracker:
            tracker.track(module.parameters())
            tracker.track(module.buffers())
            tracker.track(local)
            for step in range(2):
                if step == 1:
                    tracker.reset_peak()
                optimizer.zero_grad(set_to_none=True)
                with plan_autocast(precision, local, set()):
                    loss = module(*local)
                loss.backward()
                optimizer.step()
        conn.send(("ok", tracker.peak))
        dist.destroy_process_group()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def measure(program: bytes, plan: bytes, inputs: tuple, world: int, precision: str = "fp32") -> list[int]:
    """The measured peak bytes of every rank."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="hapd-mem-") as tmp:
        store = os.path.join(tmp, "store")
        pipes, procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_rank_main, args=(rank, world, store, program, plan, inputs, child, precision))
            p.start()
            child.close()
            pipes.append(parent)
            procs.append(p)
        results = [pipe.recv() for pipe in pipes]
        for p in procs:
            p.join(60)
    errors = [r[1] for r in results if r[0] != "ok"]
    if errors:
        raise RuntimeError(errors[0])
    return [int(r[1]) for r in results]


def case(name: str, size: str, world: int, batch_per_rank: int, precision: str = "fp32") -> list[RankResult]:
    """Compile ``name`` for ``world`` ranks with uneven ratios, run it, compare."""
    spec = models.get(name)
    module, config = models.build(name, size)
    inputs = spec.example_inputs(config, batch_per_rank * world)
    program = export(module, inputs, batch_dims=spec.batch_dims)
    graph = lower(program, name=name)
    profile = estimated_profile(world, flops=[1e10 * (world - r) for r in range(world)])
    plan = hapd.compile(graph, profile, CompileOptions(ratios=RATIOS[world], memory_caps=False, precision=precision))
    buf = io.BytesIO()
    torch.export.save(program, buf)
    measured = measure(buf.getvalue(), plan.to_bytes(), inputs, world, precision)
    parts = part_memory(plan.program, plan.ratios)
    return [
        RankResult(rank=r, predicted=plan.estimate["memory"][r], measured=m, parts={k: v[r] for k, v in parts.items()})
        for r, m in enumerate(measured)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS))
    parser.add_argument("--worlds", nargs="+", type=int, default=[2, 4], choices=sorted(RATIOS))
    parser.add_argument("--size", default="small", choices=("tiny", "small"))
    parser.add_argument("--batch-per-rank", type=int, default=4)
    parser.add_argument("--parts", action="store_true", help="print each rank's predicted parts")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                        help="plan and run the steps in this precision (autocast)")
    args = parser.parse_args()
    errors: list[float] = []
    print(f"{'model':<18} {'ranks':>5} {'rank':>4} {'predicted':>11} {'measured':>11} {'error':>7}")
    for name in args.models:
        for world in args.worlds:
            try:
                rows = case(name, args.size, world, args.batch_per_rank, args.precision)
            except Exception as exc:  # a model that cannot run prints why and the table goes on
                print(f"{name:<18} {world:>5}  failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1][:150]}")
                continue
            for row in rows:
                errors.append(abs(row.error))
                print(f"{name:<18} {world:>5} {row.rank:>4} {format_bytes(row.predicted):>11} "
                      f"{format_bytes(row.measured):>11} {row.error:>+7.1%}", flush=True)
                if args.parts:
                    print("      " + ", ".join(f"{k} {format_bytes(v)}" for k, v in row.parts.items() if v))
    if errors:
        print(f"\n{len(errors)} ranks: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}")


if __name__ == "__main__":
    main()
