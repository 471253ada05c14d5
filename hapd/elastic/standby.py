"""A warm process a daemon keeps for the ranks of an elastic launch.

    python -m hapd.elastic.standby [--import MODULE[:ATTR]]…      # what the daemon runs (``hapd serve --standby N``)

A rank that starts as a new process imports Python's startup, torch, hapd and the model's
library before its script reaches :func:`hapd.parallelize`: ~3.5 s of CPU, tens of seconds
on a slow host's share of a core, and a host joining a running job (or a generation
restarted) waits for all of it. A daemon started with ``--standby N`` keeps N processes of
this module ready instead: each imports torch, hapd's training path and the modules
named by ``--import`` (the model's library: ``transformers``; ``MODULE:ATTR`` reads an
attribute too, so a library that imports lazily loads the model's own module:
``transformers:GPT2LMHeadModel``, :func:`import_named`), exports a two-layer model
once (torch's exporter pays most of its first-call cost then, not in the script), and
waits for the daemon's **hand-over** on its standard input: one JSON line

    {"env": {...}, "cwd": "...", "argv": ["SCRIPT", "ARG", …], "runner": "in_place"}

— the launch's whole environment (torchrun's variables, the job's token and daemon),
its folder and its script. The process then takes that environment as its own, prints
one line on stderr saying it started warm, and runs the script under the in-place
runner (:mod:`hapd.elastic.in_place`), exactly as ``python -u -m hapd.elastic.in_place
SCRIPT ARGS…`` would in that environment. End of input without a hand-over (the
daemon stopping) ends the process quietly.

What a warm process cannot give as a new one would: settings read while torch was
imported. The daemon hands a launch to a standby only when the launch's environment
agrees with the standby's on every variable the interpreter or torch reads at start
(:data:`hapd.wire.standby.START_VARIABLES`); a launch that sets one gets a new process. Thread counts
(``OMP_NUM_THREADS``) are applied at hand-over with :func:`torch.set_num_threads`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from typing import Any, Mapping, Sequence

from hapd.util import exit_process
from hapd.wire.standby import READY_FD_ENV, read_order

def _warm(imports: Sequence[str]) -> list[str]:
    """Import torch, hapd's training path and ``imports``, and export a small model
    once; the modules that could not be imported (said on stderr, not fatal: the
    script imports what it needs)."""
    import torch
    from torch import nn

    import hapd
    import hapd.elastic.in_place  # noqa: F401 - imported to be warm

    _ = hapd.parallelize, hapd.Elastic  # the package imports its training path on first use: now
    from hapd.ir.export import export

    failed = []
    for name in imports:
        try:
            import_named(name)
        except Exception as exc:  # noqa: BLE001 - any import error: the module stays cold, the standby stays
            failed.append(name)
            print(f"hapd standby: cannot import {name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8), nn.Dropout(0.1), nn.Linear(8, 2))
    try:
        export(model, (torch.zeros(4, 8),), batch_dims=(0,), training=True, symbolic_batch=True)
    except Exception as exc:  # noqa: BLE001 - a warm-up that fails leaves the exporter cold, nothing else
        print(f"hapd standby: warm-up export failed ({type(exc).__name__}: {exc}): the script's first export "
              "pays torch's first-call cost", file=sys.stderr, flush=True)
    return failed


def import_named(name: str) -> None:
    """Import ``name``: a module (``transformers``, ``transformers.models.gpt2``), or
    ``MODULE:ATTR[,ATTR…]``, the module and then each attribute read from it
    (``transformers:GPT2LMHeadModel``). A library that imports lazily — transformers —
    imports little at ``import transformers``: its models' modules (~0.6 s of CPU for
    GPT-2's and what it needs, most of a joining rank's script on a slow host) load
    when the script first reads the class; reading it here loads them while the
    standby waits. :class:`ImportError` or :class:`AttributeError` when it cannot."""
    module_name, _, attributes = name.partition(":")
    module = importlib.import_module(module_name)
    for attribute in filter(None, (a.strip() for a in attributes.split(","))):
        getattr(module, attribute)


def _scheduling(policy: int) -> bool:
    """Put every thread of this process in scheduling ``policy``; whether all went.
    A standby warms under ``SCHED_IDLE`` — its imports then take only CPU that nothing
    else on the host wants (the running ranks, the daemon answering its launcher) — and
    goes back to ``SCHED_OTHER`` at the hand-over, which Linux allows a process of nice
    0 without privileges."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    try:
        for tid in tids:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
    except (OSError, AttributeError):
        return False
    return True


def _say_ready() -> None:
    """Tell the daemon this process is warm (:data:`READY_FD_ENV`), and close that pipe."""
    try:
        fd = int(os.environ.pop(READY_FD_ENV, "") or "")
    except ValueError:
        return
    try:
        os.write(fd, b"ready\n")
    except OSError:
        pass
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


def _take_environment(order: Mapping[str, Any], started_in: str) -> None:
    """Make the hand-over's environment and folder this process's own."""
    env = order["env"]
    os.environ.clear()
    os.environ.update(env)
    cwd = order["cwd"]
    os.chdir(cwd)
    if sys.path and sys.path[0] in (started_in, ""):
        sys.path[0] = cwd  # ``python -m`` put the folder it started in first, as it would have put the launch's
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hapd.elastic.standby")
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE[:ATTR]")
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    started_in = os.getcwd()
    begun = time.monotonic()
    idle = _scheduling(os.SCHED_IDLE) if hasattr(os, "SCHED_IDLE") else False
    failed = _warm(ns.imports)
    warm_s = time.monotonic() - begun
    _say_ready()
    ready = time.monotonic()
    try:
        order = read_order(sys.stdin)
    except ValueError as exc:
        print(f"hapd standby: {exc}", file=sys.stderr, flush=True)
        return 2
    if order is None:
        return 0
    waited = time.monotonic() - ready
    if idle and not _scheduling(os.SCHED_OTHER):
        print("hapd standby: cannot leave the idle scheduling class it warmed in: the rank would run only on a "
              "CPU nothing else wants; ending (the launcher restarts it)", file=sys.stderr, flush=True)
        return 1
    _take_environment(order, started_in)
    warm = ", ".join(["torch", "hapd", *[m for m in ns.imports if m not in failed]])
    print(f"hapd standby: rank {os.environ.get('RANK', '?')} runs in a warm process ({warm} imported and the exporter "
          f"warmed in {warm_s:.1f} s, {waited:.1f} s before the launch)", file=sys.stderr, flush=True)
    from hapd.elastic import in_place

    return in_place.main([str(a) for a in order["argv"]])


if __name__ == "__main__":
    exit_process(main())
