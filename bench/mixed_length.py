#!/usr/bin/env python3
"""Mixed-length training on an emulated 3:1 cluster: hapd packed vs hapd padded vs DP-CP bucketed.

    .venv/bin/python bench/mixed_length.py                  # zoo GPT-2 and Llama (small), 3:1
    .venv/bin/python bench/mixed_length.py --models gpt2 --steps 4 --warmup 2

**Data.** Token sequences with log-normal lengths: median 31 tokens, σ 0.75, clipped to
8..512 (``--longest``): 97% are shorter than 128, a quarter of the longest (the
long-tailed shape of web text; printed every run). Each step draws sequences in a seeded
order until its token budget (``--tokens``) is reached; all three systems train on the
same steps.

**Cluster.** 2 Gloo ranks on loopback, each in its own cpu cgroup (CFS period 10 ms):
1 core and 1/3 core (speeds 3:1), one thread each; without root the ranks run
unthrottled and the bench says so. The profile states the 3:1 speeds
(``estimated_profile``); plans come from one ``hapd serve`` on loopback, so a second run
of the bench (or the bench's own second launch) hits its cache.

**Systems** (the same model, seed and steps):
- ``packed``: :func:`hapd.mixed_loader` — rows from a pool of lengths 64·2^k, several
  documents per row, rows over ranks by the plan's split (:mod:`hapd.train.mixed_length`).
- ``padded``: hapd with ``packing="padded"`` — one sequence per row, every row of a step
  padded to the pool length that holds the step's longest sequence.
- ``dpcp``: torch DDP on the plain model, each step's sequences sorted by length and
  dealt to the ranks in proportion to their FLOP/s (3:1 by count), each rank padding its
  sequences to their length bucket (the same pool) in micro-batches of the same token
  size, gradients summed once per step.

Per system: tokens/s over the measured steps (the wall time between step barriers, a
new shape's program build taken out and reported apart), padding (the share of token
slots that are padding), dispatch and packing time per step. Also, planning alone over
1,000 steps: the pool's programs and padding. Writes ``bench/out/mixed_length.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

OUT = ROOT / "bench" / "out" / "mixed_length.json"
CGROUP = Path("/sys/fs/cgroup/cpu")
SPEEDS = (3.0, 1.0)
"""Emulated speeds of the 2 ranks (cpu quota: 1 core and 1/3 core)."""
MEDIAN, SIGMA, SHORTEST = 31.0, 0.75, 8


def draw_lengths(n: int, longest: int, seed: int = 0) -> list[int]:
    """Log-normal lengths (median 31, σ 0.75), clipped to SHORTEST..longest."""
    import torch

    g = torch.Generator().manual_seed(seed)
    draws = torch.exp(math.log(MEDIAN) + SIGMA * torch.randn(n, generator=g))
    return [int(min(longest, max(SHORTEST, round(float(x))))) for x in draws]


def corpus(n: int, longest: int, vocab: int, seed: int = 0) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(0, vocab, (L,), generator=g) for L in draw_lengths(n, longest, seed)]


def build(name: str, longest: int):
    import dataclasses

    import torch

    from hapd.models.zoo import TextConfig, build_gpt2, build_llama

    config = dataclasses.replace(TextConfig.small(), seq=longest)  # the library's default dropout stays on
    torch.manual_seed(0)
    return {"gpt2": build_gpt2, "llama": build_llama}[name](config).model, config


# -- a rank ------------------------------------------------------------------------------

def _timed_steps(steps, run_step, barrier, warmup: int, measure: int, builds) -> dict[str, Any]:
    """Run warmup + measure steps; the measured ones' wall times (a build taken out)."""
    times, tokens, slots, dispatch, rebuilt = [], [], [], [], 0
    for k, step in enumerate(steps):
        if k >= warmup + measure:
            break
        built = builds()
        barrier()
        started = time.perf_counter()
        info = run_step(step)
        barrier()
        elapsed = time.perf_counter() - started + info.get("outside_s", 0.0)
        new_build = builds() - built
        if k >= warmup:
            rebuilt += new_build > 0
            times.append(elapsed)
            tokens.append(info["tokens"])
            slots.append(info["slots"])
            dispatch.append(info["dispatch_ms"])
    return {"step_s": times, "tokens": tokens, "slots": slots, "dispatch_ms": dispatch,
            "tokens_per_s": sum(tokens) / sum(times) if times else None,
            "padding": 1 - sum(tokens) / sum(slots) if slots else None, "steps_with_a_build": rebuilt}


def run_hapd(model, config, seqs, ns, packing: str, barrier) -> dict[str, Any]:
    import torch

    import hapd
    from hapd.profile.schema import estimated_profile
    from hapd.train.mixed_length import one_row

    packed = hapd.PackedLanguageModel(model)
    example = tuple(t.repeat(ns.micro_tokens // ns.longest, 1) for t in one_row(ns.longest))
    profile = estimated_profile(2, flops=[1e10 * s for s in SPEEDS])
    module = hapd.parallelize(packed, example, profile=profile, verbose=False)
    loader = hapd.mixed_loader(seqs, module, tokens=ns.tokens, shortest=ns.shortest, longest=ns.longest, seed=ns.seed,
                               packing=packing)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step_fn(step) -> dict[str, Any]:
        optimizer.zero_grad(set_to_none=True)
        step.train(module)
        optimizer.step()
        # planning and packing ran in the loader, before the step's clock: added to it
        return {"tokens": step.tokens, "slots": step.packing.slots, "dispatch_ms": 1e3 * loader.dispatch_seconds[-1],
                "outside_s": loader.dispatch_seconds[-1]}

    out = _timed_steps(loader, step_fn, barrier, ns.warmup, ns.steps, lambda: len(loader.build_seconds))
    origins: dict[str, int] = {}
    for source in module.program_sources.values():
        origins[source.origin.split(" (")[0]] = origins.get(source.origin.split(" (")[0], 0) + 1
    out.update(programs=len(loader.build_seconds), build_s=sum(loader.build_seconds.values()), origins=origins,
               shapes={f"{r}x{L}": n for (r, L), n in loader.shapes.items()}, cost=vars(loader.cost) | {})
    return out


def run_dpcp(model, config, seqs, ns, rank: int, barrier) -> dict[str, Any]:
    """DDP, the batch dealt by FLOP/s, each rank's sequences padded to their bucket."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hapd.train.mixed_length import IGNORE, MixedLengthLoader, even_split, row_lengths

    ddp = DDP(model)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    lengths = [int(s.numel()) for s in seqs]
    pool = row_lengths(ns.shortest, ns.longest)
    order = MixedLengthLoader(sequences=seqs, lengths=lengths, tokens=ns.tokens, pool=pool, micro_tokens=1,
                              cost=None, split=even_split((1,)), rank=0, seed=ns.seed)  # the same steps

    def steps():
        indices, at = order.order(), 0
        while at < len(indices):
            chosen = order.step_sequences(indices, at)
            at += len(chosen)
            yield chosen

    def step_fn(chosen: list[int]) -> dict[str, Any]:
        started = time.perf_counter()
        ranked = sorted(chosen, key=lambda i: -lengths[i])
        mine, slots = [], 0
        weights = [s / sum(SPEEDS) for s in SPEEDS]
        given = [0.0] * len(SPEEDS)
        for i in ranked:  # weighted round robin by FLOP/s: counts in the speeds' ratio, lengths mixed
            r = min(range(len(SPEEDS)), key=lambda r: (given[r] / weights[r], r))
            given[r] += 1
            if r == rank:
                mine.append(i)
        count = sum(lengths[i] - 1 for i in chosen)  # the step's counted tokens (all ranks)
        micro = []
        for length in pool:
            bucket = [i for i in mine if length // 2 < lengths[i] <= length or (length == pool[0] and lengths[i] <= length)]
            per = max(1, ns.micro_tokens // length)
            for s in range(0, len(bucket), per):
                micro.append((length, bucket[s:s + per]))
        for length, items in micro:
            slots += length * len(items)
        dispatch = time.perf_counter() - started
        optimizer.zero_grad(set_to_none=True)
        for k, (length, items) in enumerate(micro):
            ids = torch.zeros((len(items), length), dtype=torch.long)
            mask = torch.zeros((len(items), length), dtype=torch.long)
            labels = torch.full((len(items), length), IGNORE, dtype=torch.long)
            for r, i in enumerate(items):
                n = lengths[i]
                ids[r, :n], mask[r, :n], labels[r, :n] = seqs[i], 1, seqs[i]
            inner = sum(int(lengths[i]) - 1 for i in items)
            context = ddp.no_sync() if k < len(micro) - 1 else contextlib.nullcontext()
            with context:
                loss = ddp(input_ids=ids, attention_mask=mask, labels=labels).loss * (inner * len(SPEEDS) / count)
                loss.backward()
        if not micro:  # nothing dealt to this rank: still join the gradient sum
            raise RuntimeError("a rank got no sequence; raise --tokens")
        optimizer.step()
        slots_all = torch.tensor([slots], dtype=torch.float64)
        dist.all_reduce(slots_all)
        return {"tokens": sum(lengths[i] for i in chosen), "slots": int(slots_all), "dispatch_ms": 1e3 * dispatch}

    return _timed_steps(steps(), step_fn, barrier, ns.warmup, ns.steps, lambda: 0)


def rank_main(ns: argparse.Namespace) -> None:
    rank = int(os.environ["RANK"])
    if ns.cgroups:
        (Path(ns.cgroups.split(":")[rank]) / "cgroup.procs").write_text(f"{os.getpid()}\n")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results: dict[str, Any] = {}
    for name in ns.models.split(","):
        for system in ns.systems.split(","):
            model, config = build(name, ns.longest)
            seqs = corpus(ns.sequences, ns.longest, config.vocab, ns.seed)
            started = time.perf_counter()
            if system == "dpcp":
                row = run_dpcp(model, config, seqs, ns, rank, dist.barrier)
            else:
                row = run_hapd(model, config, seqs, ns, system, dist.barrier)
            row["wall_s"] = time.perf_counter() - started
            results[f"{name}/{system}"] = row
            if rank == 0:
                print(f"  {name:6} {system:7} {_line(row)}", flush=True)
    if rank == 0:
        Path(ns.result).write_text(json.dumps(results))
    dist.destroy_process_group()


def _line(row: dict[str, Any]) -> str:
    tps = row.get("tokens_per_s")
    text = (f"{tps:8.0f} tokens/s, padding {100 * (row['padding'] or 0):4.1f}%, "
            f"dispatch ≤ {max(row['dispatch_ms'] or [0]):.2f} ms/step") if tps else "no measured step"
    if "programs" in row:
        text += f", {row['programs']} programs built in {row['build_s']:.1f} s ({row['origins']})"
    return text


# -- the parent ------------------------------------------------------------------------

def make_cgroups(tag: str) -> list[Path] | None:
    if os.geteuid() != 0 or not (CGROUP / "cpu.cfs_quota_us").exists():
        return None
    groups = []
    for r, speed in enumerate(SPEEDS):
        group = CGROUP / f"hapd-ml{tag}-r{r}"
        group.mkdir(exist_ok=True)
        (group / "cpu.cfs_period_us").write_text("10000\n")
        (group / "cpu.cfs_quota_us").write_text(f"{int(10000 * speed / max(SPEEDS))}\n")
        (group / "cpu.shares").write_text("262144\n")
        groups.append(group)
    return groups


def launch(ns: argparse.Namespace, systems: str, steps: int, env: dict[str, str], result: Path,
           cgroups: list[Path] | None) -> dict[str, Any]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, __file__, "--rank-main", "--models", ns.models, "--systems", systems,
            "--steps", str(steps), "--warmup", str(ns.warmup), "--tokens", str(ns.tokens), "--shortest", str(ns.shortest),
            "--longest", str(ns.longest), "--micro-tokens", str(ns.micro_tokens), "--sequences", str(ns.sequences),
            "--seed", str(ns.seed), "--result", str(result)]
    if cgroups:
        args += ["--cgroups", ":".join(str(g) for g in cgroups)]
    procs = []
    for r in range(len(SPEEDS)):
        rank_env = {**env, "RANK": str(r), "WORLD_SIZE": str(len(SPEEDS)), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        procs.append(subprocess.Popen(args, env=rank_env, cwd=ROOT))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    return json.loads(result.read_text())


def length_cost(name: str, longest: int):
    """The length cost the runs' loader counts for model ``name`` (``hapd.mixed_loader``
    without ``cost``: :meth:`LengthCost.of_model` on the packed model, rows of pad id 0)."""
    import hapd
    from hapd.train.mixed_length import LengthCost, one_row

    model, _ = build(name, longest)
    return LengthCost.of_model(hapd.PackedLanguageModel(model), lambda n: one_row(n, 0))


def dry_planning(ns: argparse.Namespace) -> dict[str, Any]:
    """Planning alone over 1,000 steps (nothing trained): the pool's programs, padding,
    time, with the length cost of the first of ``--models`` (counted on that model)."""
    from hapd.train.mixed_length import MixedLengthLoader, even_split, pack_padded, pack_step, row_lengths

    lengths = draw_lengths(200_000, ns.longest, ns.seed)
    pool = row_lengths(ns.shortest, ns.longest)
    cost_model = ns.models.split(",")[0]
    cost = length_cost(cost_model, ns.longest)  # GPT-2 small (width 256, 4 layers): 6.8e6 per token, 4096 per pair
    split = even_split([s / sum(SPEEDS) for s in SPEEDS])
    order = MixedLengthLoader(sequences=[], lengths=lengths, tokens=ns.tokens, pool=pool, micro_tokens=ns.micro_tokens,
                              cost=cost, split=split, rank=0, seed=ns.seed)
    indices, at = order.order(), 0
    shapes: dict[str, set] = {"packed": set(), "padded": set()}
    padding: dict[str, list[float]] = {"packed": [], "padded": []}
    ms = []
    for _ in range(1000):
        chosen = order.step_sequences(indices, at)
        at += len(chosen)
        ls = [lengths[i] for i in chosen]
        started = time.perf_counter()
        packed = pack_step(ls, pool=pool, micro_tokens=ns.micro_tokens, cost=cost, split=split)
        ms.append(1e3 * (time.perf_counter() - started))
        padded = pack_padded(ls, pool=pool, micro_tokens=ns.micro_tokens, split=split)
        for name, plan in (("packed", packed), ("padded", padded)):
            shapes[name].update(mb.shape for mb in plan.micro_batches)
            padding[name].append(plan.padding)
    return {"cost_model": cost_model, "cost": vars(cost), "programs_per_1000_steps": {k: len(v) for k, v in shapes.items()},
            "padding": {k: statistics.mean(v) for k, v in padding.items()},
            "plan_ms_mean": statistics.mean(ms), "plan_ms_max": max(ms),
            "under_quarter": sum(L < ns.longest / 4 for L in lengths) / len(lengths)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument("--systems", default="packed,padded,dpcp")
    p.add_argument("--steps", type=int, default=6, help="measured steps per system")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tokens", type=int, default=4096, help="token budget per step")
    p.add_argument("--micro-tokens", type=int, default=2048, help="token slots per micro-batch")
    p.add_argument("--shortest", type=int, default=64, help="the shortest row length")
    p.add_argument("--longest", type=int, default=512)
    p.add_argument("--sequences", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cgroups", default="", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.rank_main:
        rank_main(ns)
        return
    from launcher import LoopbackCluster, remove_cgroup

    dry = dry_planning(ns)
    print(f"lengths: log-normal, median {MEDIAN:.0f}, σ {SIGMA}, {SHORTEST}..{ns.longest}: "
          f"{100 * dry['under_quarter']:.1f}% under {ns.longest // 4} tokens")
    print(f"planning alone, 1,000 steps of {ns.tokens} tokens ({dry['cost_model']}'s length cost "
          f"{dry['cost']['linear']:.3g}·R + {dry['cost']['quadratic']:.3g}·R²): programs {dry['programs_per_1000_steps']}, "
          f"padding packed {100 * dry['padding']['packed']:.1f}% / padded {100 * dry['padding']['padded']:.1f}%, "
          f"plan {dry['plan_ms_mean']:.2f} ms mean, {dry['plan_ms_max']:.2f} ms max")
    work = Path(tempfile.mkdtemp(prefix="hapd-ml-"))
    tag = str(os.getpid())
    cgroups = make_cgroups(tag)
    print("cluster: 2 Gloo ranks, speeds 3:1 " + ("(cpu cgroups: 1 core, 1/3 core)" if cgroups else
                                                  "NOT emulated (needs root and cgroup v1 cpu): ranks unthrottled"))
    daemons = LoopbackCluster(work, 1, slots=2).start()
    env = {**os.environ, "HAPD_DAEMON": daemons.addresses[0], "HAPD_KEY_FILE": str(daemons.key_file),
           "PYTHONPATH": str(ROOT)}
    results: dict[str, Any] = {"dry": dry, "config": vars(ns) | {"out": str(ns.out)}, "emulated": bool(cgroups)}
    try:
        print("first launch (every system; the daemon compiles each new shape's plan):")
        results["runs"] = launch(ns, ns.systems, ns.steps, env, work / "r1.json", cgroups)
        print("second launch (packed, warm-up only: the daemon's cache):")
        again = launch(ns, "packed", 0, env, work / "r2.json", cgroups)
        results["second_run_origins"] = {k: v["origins"] for k, v in again.items()}
        for k, v in again.items():
            print(f"  {k}: {v['programs']} programs, plans {v['origins']}, built in {v['build_s']:.1f} s")
    finally:
        daemons.stop()
        for g in cgroups or []:
            remove_cgroup(g, CGROUP)
        shutil.rmtree(work, ignore_errors=True)
    print("\nspeed-ups in tokens/s:")
    for name in ns.models.split(","):
        runs = results["runs"]
        base = runs.get(f"{name}/packed", {}).get("tokens_per_s")
        for other in ("padded", "dpcp"):
            theirs = runs.get(f"{name}/{other}", {}).get("tokens_per_s")
            if base and theirs:
                print(f"  {name}: packed / {other} = {base / theirs:.2f}")
                results.setdefault("speedups", {})[f"{name}/{other}"] = base / theirs
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(results, indent=1))
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
