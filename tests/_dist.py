"""Run a function on several Gloo ranks (CPU processes) and collect what each returns.

``run_ranks(world, fn, *args)`` starts ``world`` processes; each joins a Gloo process
group (rendezvous through a FileStore in a fresh temporary directory, so no port has to
be picked), calls ``fn(rank, world, *args)`` with one intra-op thread, destroys the group
and sends the result back through a pipe. ``fn`` and its results must be picklable: give
a module-level function of a test module (under pytest ``tests/`` is on ``sys.path``, by
pyproject's ``pythonpath``, and so is each test file's folder, ``tests/<room>/``, whose
files import by their unique basenames; the ranks get the parent's ``sys.path``).

The ranks are forked from a fork server that imported torch and hapd's runtime once
(:data:`PRELOAD`): a rank starts in a fraction of a second instead of the seconds a
fresh interpreter takes to import torch, which a test of a few cases pays once per
rank. Each rank still starts from a clean state: nothing but those imports happened in
the server (no op ran), a rank draws its own seeds as a fresh interpreter does, and it
takes the environment and working directory the parent has when it calls ``run_ranks``.

If a rank raises, the other ranks are killed and ``run_ranks`` raises an AssertionError
with that rank's number and traceback; if the ranks are not done within ``timeout``
seconds, all of them are killed and it raises too. No rank outlives the call (the fork
server lives until the session ends).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import shutil
import tempfile
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

PRELOAD = [
    "torch", "torch.distributed", "pytest",
    # what a rank of hapd imports: the runtime, and torch.export (a rank exports its
    # model or loads a saved program: ~1 s of imports, torch._dynamo's among them)
    "hapd.spmd.rewrite", "hapd.train.parallelize", "hapd.models", "torch.export",
    "torch.export.pt2_archive._package",
    # the zoo's libraries (~1.5 s): a test without them skips, and the server passes over
    # a module it cannot import
    "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
    "transformers.models.bert.modeling_bert", "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.qwen2_moe.modeling_qwen2_moe", "transformers.models.t5.modeling_t5", "torchvision.models",
]
"""What the fork server imports once for every rank: torch, the runtime the ranks run,
the model libraries and what the test modules that hold rank functions import. Only
imports: none of them runs an op or starts a thread, so each forked rank starts as a
fresh interpreter that imported them would."""


def _context() -> Any:
    """The multiprocessing context of the ranks: the fork server, preloaded."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call)
    return ctx


def _child(
    rank: int, world: int, store: str, timeout: float, call: bytes, conn: Connection, env: dict[str, str], cwd: str,
) -> None:
    """One rank, in the parent's environment and working directory, running ``call``
    (``(fn, args)`` pickled): sends ``("ok", time, result)`` or ``("error", time,
    traceback)``."""
    initialized = False
    try:
        os.environ.clear()  # the server's is the parent's when the server started
        os.environ.update(env)
        os.chdir(cwd)
        import numpy
        import torch
        import torch.distributed as dist

        # a fresh interpreter's seeds: torch and numpy draw theirs from the OS at import,
        # so ranks forked from one server would otherwise share the server's
        torch.seed()
        numpy.random.seed()
        if os.path.exists("/sys/class/net/lo"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # this child only: ranks talk over loopback
        torch.set_num_threads(1)
        fn, args = pickle.loads(call)
        dist.init_process_group(
            "gloo",
            init_method=f"file://{store}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout),
        )
        initialized = True
        _send(conn, ("ok", time.time(), fn(rank, world, *args)))
    except BaseException:
        # Sent before the group is destroyed, so the time orders it before the errors
        # this rank's exit causes on the others.
        _send(conn, ("error", time.time(), traceback.format_exc()))
    finally:
        if initialized:
            dist.destroy_process_group()
        conn.close()


def _send(conn: Connection, message: Any) -> None:
    """``message`` pickled with the plain pickler, its tensors by value: sent as the
    connection's own pickle, torch's reductions would pass each tensor's storage by a
    file descriptor that the parent fetches from this process after it has exited
    (``ConnectionResetError`` or ``FileNotFoundError`` when the rank is gone first)."""
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _stop(procs: list) -> None:
    """Terminate, then kill, then reap every process still alive."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 120.0) -> list[Any]:
    """``[fn(0, world, *args), …, fn(world - 1, world, *args)]``, each run on its own
    Gloo rank. Raises AssertionError naming the rank (with its traceback) when a rank
    fails, dies or does not finish within ``timeout`` seconds."""
    ctx = _context()
    # Pickled here with the plain pickler: each rank gets its own copy of every tensor
    # in ``args``. Left to the process start, torch's reductions would share each one
    # through a file descriptor, and the fork server takes at most ~250 of those.
    call = pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL)
    tmp = tempfile.mkdtemp(prefix="hapd-dist-")
    store = os.path.join(tmp, "store")
    procs, readers = [], []
    try:
        for rank in range(world):
            reader, writer = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(rank, world, store, timeout, call, writer, dict(os.environ), os.getcwd()),
                name=f"hapd-rank-{rank}",
                daemon=True,
            )
            p.start()
            writer.close()
            procs.append(p)
            readers.append(reader)
        results: dict[int, Any] = {}
        failures: list[tuple[float, str]] = []  # (when, report)
        deadline = time.monotonic() + timeout
        while len(results) < world and not failures:
            pending = [r for r in range(world) if r not in results]
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"run_ranks: ranks {pending} of {world} did not finish within {timeout:.0f} s")
            wait([readers[r] for r in pending], timeout=left)
            for rank in pending:
                if not readers[rank].poll():
                    continue
                try:
                    status, when, value = pickle.loads(readers[rank].recv_bytes())
                except EOFError:  # the process died without a word
                    procs[rank].join(5)
                    status, when, value = "error", time.time(), f"exited with code {procs[rank].exitcode}"
                if status == "ok":
                    results[rank] = value
                else:
                    failures.append((when, f"rank {rank} of {world} failed:\n{value}"))
        if failures:  # the earliest first: later ones are usually its consequences
            raise AssertionError("run_ranks: " + "\n".join(report for _, report in sorted(failures)))
        for p in procs:
            p.join(10)
        return [results[r] for r in range(world)]
    finally:
        _stop(procs)
        for reader in readers:
            reader.close()
        shutil.rmtree(tmp, ignore_errors=True)
