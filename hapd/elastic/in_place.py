"""An elastic job's ranks run their script under this runner, so that a rank whose peer
went away keeps its process (HSPMD's switch in place, instead of a restart).

    python -m hapd.elastic.in_place SCRIPT ARGS…      # what the daemon runs (launch ``in_place``)

The runner runs ``SCRIPT`` as ``__main__`` (as ``python SCRIPT`` would: ``sys.argv``, the
script's folder first on ``sys.path``). When the script raises because a peer went away
(a collective's closed connection or timeout: :data:`hapd.errors.PEER_FAILURE`, or a
:class:`~hapd.errors.CollectiveError`) in an elastic launch, the rank **parks**:

0. (a rank waiting in a collective on a host that went silent — its link down — would
   wait for the collective timeout: the launcher, having lost that host, asks the
   daemons of the others to ``park`` the generation; a thread of this runner reads the
   request from the daemon's pipe, ``$HAPD_PARK_FD``, and shuts the rank's process
   groups' connections down, so that collective fails at once);
1. it prints ``{"hapd": "elastic", "event": "parked", ...}`` (the launcher waits for every
   rank of the hosts left to say it before it switches them in place);
2. it leaves its process groups (:func:`hapd.spmd.distributed.leave_group`): their
   connections are shut down, so work still pending on a silent peer fails at once
   (destroying a Gloo group waits for it otherwise, up to the collective timeout) and a
   peer still waiting on this rank fails at once and parks too; then the groups are
   destroyed (a ``left_group`` line says how long that took);
3. it asks its daemon (``job_status``) for the job's ``switch`` until one names a later
   generation, at most ``$HAPD_COLLECTIVE_TIMEOUT`` seconds (60 by default);
4. it sets the new generation's environment (torchrun's variables from the order, its
   ``env``: ``HAPD_GENERATION``, ``HAPD_HOSTS``, the snapshot daemons) and runs the
   script again from its top, in the same process: Python, torch and the model's
   library are imported already, and :func:`hapd.parallelize` takes the programs it
   exported and lowered last time, rebound to the new model's tensors
   (:class:`hapd.train.programs.ExportCarry`), so joining the new group, the plan
   from the daemon's cache and :meth:`hapd.Elastic.resume` (the state moved from the
   survivors' step copies to the new plan's pieces) are most of what the switch costs.

A pause for a joining host (:class:`~hapd.errors.ElasticPause`, raised by
:meth:`hapd.Elastic.step_done` once that step's snapshot reached the daemons) parks the
rank the same way. A ``switch`` order names the local ranks that go on (``kept``): a rank
of this host killed by a signal is left out, and the others are renumbered from 0. A
joining host's ranks, launched while the others train (:data:`JOIN_HELD_ENV`), export
their model ahead in :func:`hapd.parallelize` and wait for their ``switch`` in
:func:`wait_to_join` before joining the process group.

The state comes back from the survivors' memory: a step cut by a failure leaves the
ranks' parameters and optimizer states at different steps (some applied the update,
some never reached it), so each rank keeps copies of its last two completed steps in
this process (:mod:`hapd.elastic.step_copy`), which the script's next run finds; the
survivors go on from the last step all of them completed, and from the snapshot only
when a piece was held by a lost rank alone. Any other exception, a failure outside an elastic launch, or no switch in time
ends the process as the script alone would (its traceback, status 1): the launcher then
takes the restart path.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import threading
import time
import traceback
from typing import Any, Mapping

from hapd.elastic.park_events import PARK_REQUESTED, PARKED
from hapd.errors import PEER_FAILURE, CollectiveError, ElasticPause, HapdError
from hapd.spmd import group_sockets
from hapd.wire.contract import PARK_FD_ENV, RUN_ENV, STARTED_ENV
from hapd.wire.switch import (  # noqa: F401 - re-exported: the runner's names as before
    DEFAULT_PARK_S, GENERATION_ENV, JOIN_HELD_ENV, POLL_S, park_seconds as _park_s, say as _say, switch_env,
    wait_for_switch, wait_to_join,
)
from hapd.spmd.script import exit_status, report_exception, run_script
from hapd.util import exit_process

IN_PLACE_ENV = "HAPD_IN_PLACE"
"""Set ("1") by this runner: a pause for a joining host parks the rank
(:class:`~hapd.errors.ElasticPause`) instead of ending its process."""
KEEP_EXPORTS_ENV = "HAPD_KEEP_EXPORTS"
"""Set ("1") by this runner: :func:`hapd.parallelize` keeps what it exported for the
script's next run in this process (:class:`hapd.train.programs.ExportCarry`)."""
def peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says a peer went away (not a bug of the script)."""
    if isinstance(exc, CollectiveError):
        return True
    return bool(PEER_FAILURE.search(f"{type(exc).__name__}: {exc}"))


def runs_in_place() -> bool:
    """Whether this process runs its script under this runner (a pause parks it)."""
    return os.environ.get(IN_PLACE_ENV) == "1"


PARK_STALL_S = 3.0
"""Seconds after a park request by which a rank that has not parked prints every
thread's stack to its stderr: what it waits on, before the launcher's hold
(``launcher.job.HOLD_S``) runs out and every rank is restarted."""


def _watch_park_requests() -> None:
    """Read the daemon's park requests (``GENERATION`` lines on :data:`PARK_FD_ENV`) on
    a thread: one for this rank's generation shuts its process groups' connections down
    (:func:`hapd.spmd.group_sockets.shut_down`), so the collective it waits in on a
    silent host fails at once and the rank parks; one for an earlier generation (late)
    is ignored. Ends when the daemon's end closes."""
    try:
        fd = int(os.environ.get(PARK_FD_ENV) or "")
    except ValueError:
        return

    def watch() -> None:
        pending = b""
        while True:
            try:
                data = os.read(fd, 256)
            except OSError:
                return
            if not data:
                return
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                try:
                    asked = int(line)
                except ValueError:
                    continue
                if asked == int(os.environ.get(GENERATION_ENV) or 0):
                    PARK_REQUESTED.set()
                    shut = group_sockets.shut_down()
                    _say("park_requested", rank=int(os.environ.get("RANK") or 0), generation=asked,
                         connections=shut, time=time.time())
                    stall = threading.Timer(PARK_STALL_S, _not_parked, args=(asked,))
                    stall.daemon = True
                    stall.start()

    threading.Thread(target=watch, daemon=True, name="hapd-park-requests").start()


def _not_parked(generation: int) -> None:
    """:data:`PARK_STALL_S` after a park request: when this rank has not parked (still
    in ``generation``), say so with every thread's stack."""
    if PARKED.is_set() or not PARK_REQUESTED.is_set() or int(os.environ.get(GENERATION_ENV) or 0) != generation:
        return
    print(f"hapd in place: rank {os.environ.get('RANK') or 0} has not parked {PARK_STALL_S:g} s after the park "
          "request; its threads:", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)


_frozen_once = False


def freeze_long_lived() -> None:
    """Hide every object alive now from Python's cycle collector (:func:`gc.freeze`),
    under this runner: the collection at each park (which frees the last run's model,
    its module and optimizer, their reference cycles included) then walks only what was
    made since, not the hundreds of thousands of objects of torch, the model's library and
    hapd (~0.2 s of CPU a park, over a second on a sixth of a core). A frozen object is
    still freed when nothing refers to it; one in a reference cycle is not: so this is
    called where what is alive stays so — by :func:`hapd.parallelize` on the script's
    first run, before it builds anything (the script's imports and its model, which no
    cycle holds, are frozen), and after each park's collection. Nothing outside this
    runner."""
    if runs_in_place():
        gc.freeze()


def freeze_before_first_run() -> None:
    """:func:`freeze_long_lived` once, on the script's first run (:func:`hapd.parallelize` calls it)."""
    global _frozen_once
    if not _frozen_once and runs_in_place():
        _frozen_once = True
        freeze_long_lived()


def _import_held_frames_first() -> None:
    """Import what keeps the frames of its own import alive before the script runs:
    pulp (hapd's LP solver) catches an import error into a class attribute at import,
    and the traceback it keeps holds every frame below, back to the code that imported
    it first — the script's first run, whose globals (its model, module, optimizer)
    would then stay alive for the whole process, after every switch. Imported here,
    the frames it keeps are this runner's. Torch-free, as the runner must stay."""
    try:
        import pulp  # noqa: F401 - imported for the frames it keeps, see above
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m hapd.elastic.in_place SCRIPT [ARGS…]", file=sys.stderr)
        return 2
    script, args = argv[0], argv[1:]
    _import_held_frames_first()
    os.environ[KEEP_EXPORTS_ENV] = "1"  # the script's next run here rebinds its model's exports, no export
    os.environ[IN_PLACE_ENV] = "1"
    _watch_park_requests()
    while True:
        generation = int(os.environ.get(GENERATION_ENV) or 0)
        PARK_REQUESTED.clear()
        PARKED.clear()
        try:
            run_script(script, args)
            return 0
        except SystemExit as exc:
            return exit_status(exc.code)
        except KeyboardInterrupt as exc:
            report_exception(exc)
            return 130
        except BaseException as exc:  # noqa: BLE001 - a peer's failure is parked, anything else told and ends
            if not os.environ.get(RUN_ENV) or not (peer_failure(exc) or isinstance(exc, ElasticPause)):
                report_exception(exc)
                return 1
            cause = f"{type(exc).__name__}: {str(exc)[:300]}"
            told = traceback.format_exc()
        # out of the except block: the failed step's frames (the old model, its optimizer) are freed
        order = _park(generation, cause)
        if order is None:
            print(told, file=sys.stderr, end="")
            print(f"hapd in place: no switch to a later generation came within {_park_s():g} s: this rank ends",
                  file=sys.stderr, flush=True)
            return 1
        local = int(os.environ.get("LOCAL_RANK") or 0)
        nproc = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        os.environ.update(switch_env(order, local, nproc))
        os.environ[STARTED_ENV] = f"{time.time():.6f}"


def _park(generation: int, cause: str) -> Mapping[str, Any] | None:
    """Say this rank is parked, leave the broken process group and wait for the switch."""
    rank = int(os.environ.get("RANK") or 0)
    PARKED.set()
    _say("parked", rank=rank, generation=generation, cause=cause, time=time.time())
    # imported only now (torch is, by the script): the runner imports nothing of torch before the
    # script, whose own settings (OMP_NUM_THREADS, CUDA_VISIBLE_DEVICES, …) come first
    from hapd.spmd.distributed import leave_group

    start = time.perf_counter()
    leave_group()  # its connections shut down first: no wait on work pending on a silent peer
    gc.collect()
    freeze_long_lived()  # what is left is the runner's, the carried exports, the copies: the next park walks less
    _say("left_group", rank=rank, generation=generation, seconds=time.perf_counter() - start, time=time.time())
    return wait_for_switch(generation, time.monotonic() + _park_s())


if __name__ == "__main__":
    exit_process(main())
