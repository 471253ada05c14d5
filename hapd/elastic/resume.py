"""Elastic training, the rank's side: resume where the job left off, keep in-memory
snapshots on another host, stop at a step boundary when the launcher asks.

    elastic = hapd.Elastic(module, optimizer, sampler=data, state={"scheduler": scheduler})
    step = elastic.resume()                 # 0 on a fresh start, else the step to go on from
    while step < total:
        ... one training step ...
        step += 1
        elastic.step_done(step)             # snapshots; stops here when the launcher asks

Under ``./run_all --elastic`` (``python -m launcher run --elastic MIN:MAX``) a lost host
or a killed rank does not end the job: the launcher drops the hosts that no longer
answer and runs the script again on the hosts left (a *generation*) — in the same
processes after a lost host (the ranks park and are switched in place,
:mod:`hapd.elastic.in_place`), else in new ones. The script runs from its top again: :func:`hapd.parallelize` gets the plan for the new
device set from the daemon's cache (``$HAPD_HOSTS`` cuts the cluster profile to those
hosts, :func:`hapd.train.plan_source.job_profile`), and :meth:`Elastic.resume` loads
the state: parameters, optimizer state, the sampler's position (the same global
batches in the same order, whatever the world size: no sample skipped or seen twice),
every rank's RNG, the step and ``state``. After a switch in place it comes from the
survivors' memory: every :meth:`Elastic.step_done` keeps a copy of the rank's state of
that step (:mod:`hapd.elastic.step_copy`, the last two steps), the survivors agree on
the last step all of them completed and their pieces move point to point to the new
plan's (:mod:`hapd.elastic.moves`). When a piece was held only by a lost rank (a plan
that split it), or after a restart (new processes hold no copies), it is the newest
complete snapshot, resharded to the new plan and world size by
:func:`hapd.load_checkpoint`.

**Snapshots.** Every ``every`` steps :meth:`Elastic.step_done` writes this rank's pieces
(:func:`hapd.state.checkpoint.snapshot_files`: a checkpoint written on each rank's own
host, in memory where ``/dev/shm`` exists) and a background thread sends them to two
daemons: this host's and the next host's in the job (``$HAPD_ELASTIC_BUDDY``), which
keep them in memory (:mod:`hapd.serve.snapshots`). One lost host loses no snapshot:
its ranks' files are on the next host, the others' on their own. ``every`` is
``$HAPD_SNAPSHOT_EVERY`` when set; else chosen at each snapshot so that snapshots cost
at most :data:`SNAPSHOT_BUDGET` of the steps' time (every step when that is cheap
enough): a snapshot's cost is its write in the foreground and what the steps until the
next one lost, measured in wall time against the steps without a send beside them
(:class:`SnapshotCost`; the send's CPU time until such a step was seen): the send on
this rank and what it costs elsewhere (the daemons storing this and the other ranks'
files on the same CPUs), averaged over the snapshots so far. Without snapshots (``every`` < 0) or when none is complete,
``checkpoint`` (a :func:`hapd.save_checkpoint` folder) is loaded; without it the job
starts again at step 0, and says so.

**Pauses.** A host joining is taken at a step boundary: the launcher asks rank 0's
daemon to pause the job (:meth:`hapd.wire.client.Client.job_pause`); rank 0 reads it in
:meth:`Elastic.step_done`, every rank learns it in the same step (one broadcast), waits
for the snapshot being sent to reach the daemons and, after printing the ``paused``
event, parks (raises :class:`~hapd.errors.ElasticPause` under the in-place runner: the
launcher switches it into the generation with the joining host) or exits with status 0
(``--restart``); the next generation resumes from that step: no step is lost. In place,
every rank goes on in its process and its step copy of that step gives the state, so
the pause takes no snapshot of its own when every rank keeps copies (one snapshot's
write and send less while the joining host waits; the interval's snapshots go on); with
``--restart``, or a rank without copies, it snapshots that step first.

What rank 0 prints for the launcher (``{"hapd": "elastic", ...}`` lines): ``resumed``
(generation, step, where the state came from, seconds the job stood still for the plan
— the part of its request left once the ranks had joined, when rank 0 sent it before —
and the request's own, seconds to load the state, when its process started and what
:func:`hapd.parallelize` took), ``first_step``
(the first step finished in this generation), ``snapshot`` (step, bytes, seconds),
``paused``. Outside an elastic launch (``$HAPD_ELASTIC_RUN`` unset)
:class:`Elastic` does nothing and :meth:`~Elastic.resume` returns 0.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from hapd.errors import CheckpointError, CollectiveError, ElasticPause, HapdError
from hapd.elastic import export_share, moves, replica, step_copy
from hapd.elastic.export_share import DAEMONS_ENV
from hapd.state.checkpoint import held_tensors, load_checkpoint, load_optimizer_entries, set_draw_count, snapshot_files
from hapd.state.checkpoint_format import MODEL, OPTIM
from hapd.state.checkpoint_format import find_checkpoint
from hapd.elastic.in_place import GENERATION_ENV, RUN_ENV, runs_in_place
from hapd.elastic.park_events import PARK_REQUESTED
from hapd.wire.client import Client
from hapd.wire.contract import STARTED_ENV
from hapd.wire.switch import say
from hapd.wire.keys import default_key_path, load_key

FORMER_DAEMONS_ENV = "HAPD_ELASTIC_FORMER_DAEMONS"
"""Comma-separated addresses of the daemons of hosts the job ran on before and no
longer does (dropped): their copies are looked for too when resuming (a host whose
link came back holds its buddy's files), each asked at most :data:`LIST_TIMEOUT_S`."""
BUDDY_ENV = "HAPD_ELASTIC_BUDDY"
"""The daemon that keeps this host's second copy of its snapshots (the next host's);
empty on a one-host job."""
EVERY_ENV = "HAPD_SNAPSHOT_EVERY"
"""Snapshot every N steps; 0 or unset: chosen from the measured cost; negative: never."""
PAUSE_CHECK_ENV = "HAPD_PAUSE_CHECK"
"""Whether rank 0 asks its daemon for a pause request after every step ("1", the
launcher's default with a host file it watches; "0": never)."""

SNAPSHOT_BUDGET = 0.05
"""The share of the training steps' time that writing snapshots may take when ``every``
is chosen automatically."""
SNAPSHOT_AIM = 0.8 * SNAPSHOT_BUDGET
"""The share the automatic interval is chosen for: under the budget by a margin, since it
is chosen from the snapshots' average cost and one snapshot's varies from the next (its
send shares the CPUs with the steps and the daemons)."""
DAEMON_TIMEOUT_S = 30.0
"""How long a snapshot transfer to or from a daemon may take."""
LIST_TIMEOUT_S = 3.0
"""How long a daemon may take to list the snapshots it holds when resuming (one that
does not answer, its host gone, is passed over)."""


def _say(event: str, **fields: Any) -> None:
    say(event, **fields)  # one line, whole, whatever thread says another at once


def local_folder() -> Path:
    """Where snapshots are written and fetched on this host: ``/dev/shm`` (memory)
    when it is there and writable, else the temporary folder."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return shm
    return Path(tempfile.gettempdir())


@dataclass
class _Sender:
    """Sends each snapshot's files to the daemons in a background thread; the next
    snapshot waits for the previous one to be sent."""

    run: str
    addresses: list[str]
    key: bytes
    rank: int
    thread: threading.Thread | None = None
    errors: list[str] = field(default_factory=list)
    cpu_s: float = 0.0
    """CPU seconds the last finished send took in its thread (what it took from the rank)."""
    busy_from: float | None = None
    """When the last send began (``perf_counter``)."""
    busy_until: float | None = None
    """When the last send ended; None while it runs."""

    def send(self, step: int, world: int, files: Mapping[str, bytes]) -> None:
        self.wait()
        self.busy_from, self.busy_until = time.perf_counter(), None
        self.thread = threading.Thread(target=self._send, args=(step, world, dict(files)), daemon=True,
                                       name="hapd-snapshot-sender")
        self.thread.start()

    def _send(self, step: int, world: int, files: dict[str, bytes]) -> None:
        start = time.thread_time()
        try:
            for address in self.addresses:
                try:
                    with Client(address, self.key, DAEMON_TIMEOUT_S) as client:
                        client.snapshot_put(self.run, step, self.rank, world, files)
                except HapdError as exc:  # that copy is missing; the other may do
                    self.errors.append(f"{address}: {type(exc).__name__}: {exc}")
        finally:
            self.cpu_s = time.thread_time() - start
            self.busy_until = time.perf_counter()

    def sending_between(self, start: float, end: float) -> bool:
        """Whether a send ran at some time between ``start`` and ``end`` (``perf_counter``)."""
        if self.busy_from is None or self.busy_from >= end:
            return False
        return self.busy_until is None or self.busy_until > start

    def drop(self, runs: list[str], addresses: list[str]) -> None:
        """Free ``runs``' snapshots on ``addresses`` in the background (after the previous send)."""
        self.wait()

        def drop() -> None:
            for address in addresses:
                try:
                    with Client(address, self.key, DAEMON_TIMEOUT_S) as client:
                        for run in runs:
                            client.snapshot_drop(run)
                except HapdError as exc:
                    self.errors.append(f"{address}: {type(exc).__name__}: {exc}")

        self.thread = threading.Thread(target=drop, daemon=True, name="hapd-snapshot-drop")
        self.thread.start()

    def wait(self) -> float:
        """Seconds spent waiting for the previous send. Raises
        :class:`~hapd.errors.CollectiveError` when the launcher asks this rank to park
        meanwhile (a host was lost: the send may be waiting on it)."""
        start = time.perf_counter()
        if self.thread is not None:
            while self.thread.is_alive():
                self.thread.join(0.05)
                if PARK_REQUESTED.is_set() and self.thread.is_alive():
                    raise CollectiveError(f"rank {self.rank}: asked to park (a host was lost) while waiting "
                                          f"{time.perf_counter() - start:.1f} s for a snapshot's send")
            self.thread = None
        return time.perf_counter() - start


CLEAN_STEPS = 8
"""How many of the last steps without a send :class:`SnapshotCost` takes the median of."""


@dataclass
class SnapshotCost:
    """What a snapshot's background work costs the training steps, measured in wall
    time: every step from one snapshot to the next against the steps that ran with no
    send of this rank's beside them (their median), summed. Not only the steps beside
    the rank's own send: the daemons that store the snapshots (this host's ranks' and
    the previous host's) run on the same CPUs after it ended — counting the steps beside
    the send alone, the automatic interval's estimate was near 0.27 s a snapshot where
    the job lost about 0.49 s (it cost 9% of the step time against its 5%). On a rank whose CPU is shared or
    throttled (a sixth of a core), a send's CPU time costs the steps several times as
    much wall time; on a rank whose steps wait on a GPU it may cost them nothing: the
    CPU seconds the send took are only the estimate until steps without a send were seen."""

    clean: collections.deque = field(default_factory=lambda: collections.deque(maxlen=CLEAN_STEPS))
    """The last steps with no send beside them, in seconds."""
    beside_s: float = 0.0
    """The steps since the last snapshot: their time beyond ``clean_step``, summed."""
    beside_steps: int = 0

    @property
    def clean_step(self) -> float | None:
        """Seconds a step takes with no send beside it: the median of the last
        :data:`CLEAN_STEPS` (an outlier, a slow first step, moves it not)."""
        return statistics.median(self.clean) if self.clean else None

    def step(self, took: float, sending: bool) -> None:
        """One step that took ``took`` seconds, beside a send or not."""
        if not sending:
            self.clean.append(took)
        if self.clean_step is not None:
            self.beside_s += took - self.clean_step
            self.beside_steps += 1

    def send_cost(self, cpu_s: float) -> float:
        """The wall seconds the last snapshot's background work took from the steps since
        (its send's CPU seconds ``cpu_s`` while no step without a send was seen); starts over."""
        measured = max(0.0, self.beside_s) if self.beside_steps else cpu_s
        self.beside_s, self.beside_steps = 0.0, 0
        return measured


class Elastic:
    """One training job's elastic state on this rank (see the module docstring)."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, sampler: Any = None,
                 state: Mapping[str, Any] | None = None, checkpoint: str | Path | None = None,
                 every: int | None = None, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.module, self.optimizer, self.sampler = module, optimizer, sampler
        self.state = dict(state or {})
        for name, obj in self.state.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise HapdError(f"state[{name!r}] has no state_dict()/load_state_dict(): Elastic cannot keep it")
        self.checkpoint = Path(checkpoint) if checkpoint is not None else None
        self.run = env.get(RUN_ENV) or None
        self.generation = int(env.get(GENERATION_ENV) or 0)
        self.daemons = [a for a in (env.get(DAEMONS_ENV) or "").split(",") if a]
        self.former_daemons = [a for a in (env.get(FORMER_DAEMONS_ENV) or "").split(",")
                               if a and a not in self.daemons]
        own = env.get("HAPD_DAEMON") or ""
        buddy = env.get(BUDDY_ENV) or ""
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.local_rank = int(env.get("LOCAL_RANK") or 0)
        self.host = env.get("HAPD_HOST") or env.get("GROUP_RANK") or "0"
        every_env = env.get(EVERY_ENV)
        self.every = every if every is not None else (int(every_env) if every_env else 0)
        self._auto = self.every == 0
        """The interval is chosen (and chosen again at each snapshot) from what snapshots cost."""
        self._cost: float | None = None
        """Seconds a snapshot takes from the steps: its foreground write and what its send cost the steps
        beside it (EMA)."""
        self._send_cost = SnapshotCost()
        self.pause_check = (env.get(PAUSE_CHECK_ENV) or "0") == "1"
        self.started_at = _float_or_none(env.get(STARTED_ENV))
        self.job = env.get("HAPD_JOB") or ""
        self._sender: _Sender | None = None
        self._step_time: float | None = None
        self._last_step_end: float | None = None
        self._first_step_said = False
        self._snapshots = 0
        self._snapshot_step: int | None = None
        """The step of this generation's last snapshot (the automatic interval counts from it)."""
        self._own = own
        self._copies = (step_copy.kept(self.run) if self.run is not None and env.get(step_copy.COPY_ENV, "1") != "0"
                        else None)
        """This rank's copies of its last two completed steps (:mod:`hapd.elastic.step_copy`): kept by this
        process across the script's runs, so that a switch in place takes the state from the survivors."""
        self._laid_at: int | None = None
        """The step at which this generation's replicas were laid out (:meth:`_replicate`)."""
        self._entries: list[Any] = []
        """This rank's pieces (:func:`hapd.elastic.step_copy.entries`) as of its last step copy."""
        self._overlap = False
        """Whether the parameters and the optimizer state are copied beside the next step (the optimizer's
        next step waits for them first: its pre-hook)."""
        self._replicas = (replica.kept(self.run) if self._copies is not None
                          and env.get(replica.REPLICA_ENV, "1") != "0" else None)
        """The replicas this rank holds of its sources' lonely pieces and sends of its own
        (:mod:`hapd.elastic.replica`): a lost rank's pieces of a split tensor come back from memory."""
        self._replica_max = float(env.get(replica.MAX_MB_ENV) or replica.DEFAULT_MAX_MB) * 2**20
        if self._copies is not None and optimizer is not None:
            copies, replicas = self._copies, self._replicas
            optimizer.register_step_pre_hook(lambda *_: _before_update(copies, replicas))
            self._overlap = True
        if self._replicas is not None:  # the last step's replicas before this step's first collective
            waits = self._replicas
            module.register_forward_pre_hook(lambda *_: waits.before_step())
        if self.active:
            targets = [a for a in dict.fromkeys([own, buddy]) if a]
            self._sender = _Sender(self.snapshot_run(self.generation), targets, _key_bytes(), self.rank)

    def snapshot_run(self, generation: int) -> str:
        """The daemons' key of one generation's snapshots (its job id): a generation's
        files never mix with another's of the same step."""
        return f"{self.run}-g{generation}"

    @property
    def active(self) -> bool:
        """Whether this is an elastic launch (``$HAPD_ELASTIC_RUN`` set)."""
        return self.run is not None

    # ------------------------------------------------------------------ resume

    def resume(self) -> int:
        """The step to train from: 0 on a first launch (or outside an elastic launch);
        after a switch in place the last step every survivor completed, its state moved
        from their step copies when they hold every piece; else the newest complete
        snapshot's (every rank loads it, resharded), else ``checkpoint``'s, else 0.
        Collective."""
        if not self.active or self.generation == 0:
            if self.active:
                self._fresh_copy(0)
                self._replicate(0)
            self._last_step_end = time.perf_counter()
            return 0
        start = time.perf_counter()
        memory = self._from_memory()
        choice = None
        if memory.step is not None:
            step, source = memory.step, memory.source
        else:
            choice = self._broadcast(self._newest_snapshot() if self.rank == 0 else None)
            source, step = "none", 0
            if choice is not None:
                step = self._load_snapshot(choice)
                source = f"snapshot of step {step} (world {choice['world']})"
            elif self.checkpoint is not None and _has_checkpoint(self.checkpoint):
                step = self._load(self.checkpoint)
                source = f"checkpoint {self.checkpoint} (step {step})"
            if memory.fallback:
                source += f" (fallback: {memory.fallback})"
        load_s = time.perf_counter() - start
        if self._replicas is not None:
            self._replicas.reset()  # laid out by the old plan: laid out again below
        self._fresh_copy(step)
        if self.rank == 0:
            plan_source = getattr(self.module, "plan_source", None)
            built = getattr(self.module, "build_times", None)
            _say("resumed", generation=self.generation, step=step, source=source, load_s=load_s, world=self.world,
                 plan_s=getattr(plan_source, "stood_s", None), plan_asked_s=getattr(plan_source, "seconds", None),
                 plan=getattr(plan_source, "origin", None),
                 started_at=self.started_at, build=dataclasses.asdict(built) if built is not None else None,
                 time=time.time())
            if choice is None and memory.step is None:
                print(f"hapd elastic: no complete snapshot{' or checkpoint' if self.checkpoint else ''} to resume "
                      "from: training starts again at step 0", flush=True)
        self._replicate(step)  # the resumed step's replicas, beside the first step: a loss in it rolls back to here
        self._last_step_end = time.perf_counter()
        return step

    def _fresh_copy(self, step: int) -> None:
        """This generation's first copy, of the step it resumed at: the previous
        generation's copies (laid out by the old plan) are freed first."""
        if self._copies is not None:
            self._copies.clear()
            self._copy_step(step)

    def _copy_step(self, step: int) -> None:
        """Keep this rank's copy of ``step`` (:mod:`hapd.elastic.step_copy`)."""
        if self._copies is None:
            return
        found, objects = step_copy.entries(self.module, self.optimizer)
        self._entries = found
        small = step_copy.small_state(self.module, self.optimizer, self.sampler, self.state)
        self._copies.local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        try:
            self._copies.keep(step, self.generation, self.rank, self.world, found, objects, small,
                              overlap=self._overlap)
        except step_copy.CopiesTooLarge as exc:  # the state comes from the snapshot after a switch, as without copies
            self._copies.clear()
            self._copies = None
            _say("step_copy_off", rank=self.rank, reason=str(exc), time=time.time())
            print(f"hapd elastic: rank {self.rank} keeps no step copies: {exc}; after a switch in place its state "
                  "comes from the snapshot", file=sys.stderr, flush=True)

    def _from_memory(self) -> "_FromMemory":
        """Load the state of the last step every survivor completed from their step
        copies and the replicas they hold of lost ranks' pieces (:mod:`hapd.elastic.replica`),
        moved point to point to the new plan's pieces (:mod:`hapd.elastic.moves`); the
        step before when only that step's replicas cover a lost rank's pieces; its step,
        or None and why not (no rank holds a copy: a restart; or a piece only a lost rank
        held: ``fallback``). Collective (one gather, then the moves)."""
        if self._copies is None:
            return _FromMemory()
        self._copies.ready()
        if self._replicas is not None:
            self._replicas.settle()  # the last generation's transfer: ended, or given up (never an endless wait)
        needs, params = step_copy.needed_pieces(self.module, self.optimizer)
        kept = self._copies.copies
        generation = self._copies.generation
        offer = step_copy.Offer(
            rank=self.rank, generation=generation, old_rank=kept[-1].rank if kept else None,
            copies={c.step: (c.pieces, c.objects, c.small) for c in kept}, needs=needs, params=params,
            replicas=self._replicas.offered(generation) if self._replicas is not None else {})
        offers = sorted(self._gather(offer), key=lambda o: o.rank)
        agreement = step_copy.agree(offers)
        if agreement.step is None:
            holders = any(o.generation is not None for o in offers)
            return _FromMemory(fallback=agreement.reason if holders else "")
        covered = _cover(offers, agreement)
        if isinstance(covered, str):
            return _FromMemory(fallback=covered)
        step, plan, needed, every_held = covered
        mine = self._copies.of_step(step) if self.rank in agreement.survivors else None
        sources = moves.by_piece(mine.pieces, mine.tensors) if mine is not None else {}
        if self._replicas is not None:
            sources.update(self._replicas.sources(step, generation))
        targets: dict[str, torch.Tensor] = {MODEL + h.key: h.local for h in held_tensors(self.module)}
        loaded = {p.key: torch.empty(p.shape, dtype=getattr(torch, p.dtype))
                  for p in needed[self.rank] if not p.key.startswith(MODEL)}
        moved = moves.execute(plan, self.rank, sources, {**targets, **loaded})
        self._load_small(offers, dataclasses.replace(agreement, step=step), loaded,
                         {p.key for p in every_held if p.key.startswith(OPTIM)})
        total = sum(t.numel * moves.dtype_size(t.dtype) for t in plan.transfers)
        between = plan.bytes_between_ranks()
        replicated = {(r, p.key, p.offsets) for r in agreement.survivors for p in offers[r].replicas.get(step, ())}
        from_replicas = sum(t.numel * moves.dtype_size(t.dtype) for t in plan.transfers
                            if (t.src, t.key, t.src_offsets) in replicated)
        told = f"survivors' memory, step {step}, moved {total / 2**20:.2f} MB in {moved.seconds:.3f} s " \
               f"({between / 2**20:.2f} MB of it between ranks"
        if from_replicas:
            told += f", {from_replicas / 2**20:.2f} MB from replicas of lost ranks' pieces"
        if step != agreement.step:
            told += f"; the step before {agreement.step}, whose replicas had not all arrived"
        return _FromMemory(step, told + ")")

    def _load_small(self, offers: list[step_copy.Offer], agreement: step_copy.Agreement,
                    optimizer_tensors: Mapping[str, torch.Tensor], optimizer_keys: set[str]) -> None:
        """After the moves: the optimizer (``optimizer_tensors``, this rank's moved
        states; its values that are not tensors; its groups' settings; ``optimizer_keys``:
        every tensor state's key), the sampler, the dropouts' generator step, ``state``
        and this rank's RNG, as the survivors kept them at the agreed step: the first
        survivor's, and the RNG of the old rank of this rank's number, as a snapshot keeps
        it (else seeded ``seed + rank``, as from a snapshot without it)."""
        step = agreement.step
        assert step is not None
        survivors = [offers[r].copies[step] for r in agreement.survivors]
        small = survivors[0][2]
        if self.optimizer is not None:
            params = {h.key for h in held_tensors(self.module)}
            values: dict[str, Any] = {}
            for _pieces, objects, _small in survivors:  # a value of a parameter is the same on its holders
                for key, value in objects.items():
                    if key[len(OPTIM):].rsplit("/", 1)[0] in params:
                        values.setdefault(key, value)
            load_optimizer_entries(self.module, self.optimizer, {**optimizer_tensors, **values},
                                   small.hyperparameters, keys=optimizer_keys | set(values))
        if self.sampler is not None and small.sampler is not None:
            self.sampler.load_state_dict(small.sampler)
        set_draw_count(self.module, small.draws)
        for name, obj in self.state.items():
            if name in small.user:
                obj.load_state_dict(small.user[name])
        same = next((offers[r] for r in agreement.survivors if offers[r].old_rank == self.rank), None)
        if same is not None:
            rng = same.copies[step][2].rng
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        else:
            torch.manual_seed(small.seed + self.rank)

    def _newest_snapshot(self) -> dict[str, Any] | None:
        """Rank 0: the newest step every one of whose ranks' files some daemon holds, of
        the latest earlier generation that has one complete. This generation's daemons
        are asked at once, then, when they hold none complete, the former hosts' too;
        each for at most :data:`LIST_TIMEOUT_S` (one that does not answer, a host that
        was killed, is passed over)."""
        runs = [self.snapshot_run(g) for g in range(self.generation - 1, -1, -1)]

        def listed(address: str) -> dict[str, list[dict[str, Any]]]:
            found: dict[str, list[dict[str, Any]]] = {}
            try:
                with Client(address, _key_bytes(), LIST_TIMEOUT_S) as client:
                    for run in runs:
                        found[run] = client.snapshot_list(run)
            except HapdError:
                pass  # gone, or its link is down: the others may hold the files
            return found

        answers: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for group in (self.daemons, self.former_daemons):  # the former hosts' only when this generation's lack one
            if not group:
                continue
            with ThreadPoolExecutor(max_workers=min(16, len(group))) as pool:
                answers.update(zip(group, pool.map(listed, group)))
            found = _complete(runs, answers)
            if found is not None:
                return found
        return None

    def _load_snapshot(self, choice: Mapping[str, Any]) -> int:
        folder = local_folder() / f"hapd-restore-{self.run}-g{self.generation}-{_safe(self.host)}"
        error = None
        if self.local_rank == 0:
            try:
                folder.mkdir(parents=True, exist_ok=True)
                clients: dict[str, Client] = {}
                try:
                    for rank, address in sorted(choice["holders"].items(), key=lambda kv: int(kv[0])):
                        client = clients.get(address) or clients.setdefault(address, Client(address, _key_bytes(),
                                                                                            DAEMON_TIMEOUT_S))
                        for name, data in client.snapshot_get(choice["run"], int(choice["step"]), int(rank)).items():
                            (folder / name).write_bytes(data)
                finally:
                    for client in clients.values():
                        client.close()
            except (HapdError, OSError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        errors = self._gather(error)
        if any(errors):
            raise CheckpointError(f"fetching the snapshot of step {choice['step']} failed: "
                                  + "; ".join(e for e in errors if e))
        try:
            return self._load(folder)
        finally:
            self._barrier()
            if self.local_rank == 0:
                shutil.rmtree(folder, ignore_errors=True)

    def _load(self, folder: Path) -> int:
        got = load_checkpoint(folder, self.module, self.optimizer, sampler=self.sampler)
        saved = got["extra"].get("elastic_state", {})
        for name, obj in self.state.items():
            if name in saved:
                obj.load_state_dict(saved[name])
        return int(got["step"])

    # ------------------------------------------------------------------ steps

    def step_done(self, step: int) -> None:
        """After each optimizer step (``step`` counts the steps done): a snapshot when it
        is due; when the launcher asked the job to pause, after a snapshot of this step,
        parks the rank (:class:`~hapd.errors.ElasticPause`, under the in-place runner) or
        stops the process (status 0). Collective."""
        if not self.active:
            return
        now = time.perf_counter()
        self._copy_step(step)  # before any collective: a failure in one leaves this step's copy
        export_share.refresh()  # the program shared with joining hosts stays in the daemon's store
        if self._last_step_end is not None:
            took = now - self._last_step_end
            self._step_time = took if self._step_time is None else 0.9 * self._step_time + 0.1 * took
            sending = self._sender is not None and self._sender.sending_between(self._last_step_end, now)
            if self._first_step_said:  # a generation's first step (its warm-up) says nothing of the others
                self._send_cost.step(took, sending)
        if self.rank == 0:
            if not self._first_step_said:
                _say("first_step", generation=self.generation, step=step, time=time.time())
            else:
                _say("step", step=step)
        self._first_step_said = True
        self._replicate(step)
        pause = self._pause_requested()
        due = self._due(step)
        if due or (pause and not self._pause_from_copies()):
            self.snapshot(step)
        if pause:
            assert self._sender is not None
            self._sender.wait()
            if self._replicas is not None:
                self._replicas.wait()  # its peers' transfers end before the groups are left
            if self.rank == 0:
                _say("paused", generation=self.generation, step=step, time=time.time())
            if runs_in_place():  # parked, and switched in its process into the generation with the joining host
                raise ElasticPause(f"paused at step {step} for a joining host")
            raise SystemExit(0)
        self._last_step_end = time.perf_counter()

    def _due(self, step: int) -> bool:
        """Whether ``step`` takes a snapshot: every ``every`` steps — a fixed interval at
        its multiples, the automatic one counted from the last snapshot (at multiples of
        an interval chosen again at each snapshot, 15 then 17 then 16…, snapshots came 2
        steps apart: twice as many as chosen, 7.8–9.0% of the step time for a 5%
        budget); the first step of a generation at the automatic interval before one was
        chosen."""
        if self.every < 0:
            return False
        if self.every == 0:
            return True
        if self._auto and self._snapshot_step is not None:
            return step - self._snapshot_step >= self.every
        return step % self.every == 0

    def _replicate(self, step: int) -> None:
        """Send this rank's lonely pieces of ``step``'s copy to its partner and receive its
        sources' (:mod:`hapd.elastic.replica`), beside the next step; at the generation's
        resume the replicas are laid out first (collective: every rank's host and pieces)."""
        if self._replicas is None:
            return
        copies = self._copies
        newest = copies.copies[-1] if copies is not None and copies.copies else None
        layout = self._replicas.layout
        # laid out at step 0 of a fresh start, before the optimizer made its state: again at step 1, with it
        again = step == 1 and self._laid_at == 0
        if layout is None or layout.generation != self.generation or again:
            self._laid_at = step
            mine = newest.pieces if newest is not None and newest.step == step else None
            every = self._gather((self.host, mine))
            layout = self._replicas.set_up(self.generation, self.rank, [h for h, _ in every], [p for _, p in every],
                                           self._replica_max)
            if self.rank == 0 and any(self._replicas.sent_bytes):
                _say("replicas", generation=self.generation, bytes=list(self._replicas.sent_bytes),
                     active=self._replicas.active, time=time.time())
        whole = copies is not None and newest is not None and newest.step == step
        if not whole or copies is None or newest is None:
            self._replicas.start(step, None, lambda: False)
            return
        # a host tensor only the optimizer changes is sent as it is (the optimizer's next step waits for the
        # send): not after the copy's part beside the step, which on a slow rank ends late in the next step
        live = {h.key: h.local.detach() for h in self._entries
                if self._overlap and not h.local.is_cuda and step_copy.updated_only_by_optimizer(h)}
        sent = {p.key for p in (self._replicas.layout.sends if self._replicas.layout is not None else ())}
        if sent <= set(live):
            self._replicas.start(step, {k: live[k] for k in sent}, lambda: True)
        else:
            self._replicas.start(step, newest.tensors, copies.landing())

    def _pause_from_copies(self) -> bool:
        """At a pause for a joining host: whether the next generation takes this step's
        state from the ranks' step copies alone, so that the pause needs no snapshot of
        its own — in place (every rank of this generation goes on in its process, so
        their copies hold every piece) and every rank keeps copies. The newest snapshot
        taken at the interval stays the fallback (a switch that fails restarts from it,
        a few steps earlier). Collective (every rank learns of the pause in one step)."""
        if not runs_in_place():
            return False  # --restart: the next generation's new processes load this step's snapshot
        return all(self._gather(self._copies is not None))

    def snapshot(self, step: int) -> float:
        """Write this rank's snapshot of ``step`` and send it to the daemons in the
        background; the seconds it took in the foreground. Collective."""
        assert self._sender is not None
        start = time.perf_counter()
        waited = self._sender.wait()
        folder = local_folder() / f"hapd-snapshot-{self.run}-g{self.generation}-r{self.rank}"
        extra = {"elastic_state": {name: obj.state_dict() for name, obj in self.state.items()}}
        try:
            files = snapshot_files(folder, self.module, self.optimizer, sampler=self.sampler, step=step, extra=extra)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        self._snapshots += 1
        self._snapshot_step = step
        if self._snapshots == 2 and self.rank == 0 and self.generation > 0:
            # every rank waited for its first snapshot's send before this one's collective write: this
            # generation has a complete snapshot, and the older generations' are no longer needed
            self._sender.drop([self.snapshot_run(g) for g in range(self.generation)], self.daemons)
        # what the previous snapshot's send cost the steps since (it ended: waited for above)
        sent = self._send_cost.send_cost(self._sender.cpu_s) if self._snapshots > 1 else 0.0
        self._sender.send(step, self.world, files)
        took = time.perf_counter() - start
        if self._auto:
            self._choose_interval(took + sent)
        if self.rank == 0:
            _say("snapshot", step=step, bytes=sum(len(b) for b in files.values()), seconds=took, waited_s=waited,
                 every=self.every, errors=self._sender.errors[-3:], **self._copy_cost())
        return took

    def _copy_cost(self) -> dict[str, Any]:
        """What the step copies cost: the median seconds of the last ones in the foreground
        and beside the next step (a thread), their bytes."""
        if self._copies is None or not self._copies.seconds:
            return {}
        newest = self._copies.copies[-1] if self._copies.copies else None
        beside = statistics.median(self._copies.beside) if self._copies.beside else None
        return {"step_copy_s": statistics.median(self._copies.seconds), "step_copy_beside_s": beside,
                "step_copy_bytes": newest.nbytes if newest is not None else 0}

    def _choose_interval(self, cost: float) -> None:
        """The interval at which snapshots cost :data:`SNAPSHOT_AIM` of the steps' time,
        from this snapshot's ``cost`` (its time in the foreground, a wait for the previous
        send included, and what that send cost the steps it ran beside:
        :class:`SnapshotCost`), averaged over the snapshots so far, against a step without
        snapshots (the steps' average until one was seen); chosen again at every snapshot,
        the same on every rank (the largest any rank wants)."""
        self._cost = cost if self._cost is None else 0.7 * self._cost + 0.3 * cost
        step_time = self._send_cost.clean_step or self._step_time
        wanted = max(1, math.ceil(self._cost / (SNAPSHOT_AIM * step_time))) if step_time else 0
        self.every = max(self._gather(wanted))

    def _pause_requested(self) -> bool:
        wanted = False
        if self.pause_check and self.rank == 0 and self._own and self.job:
            try:
                with Client(self._own, _key_bytes(), 2.0) as client:
                    wanted = client.job_paused(self.job)
            except HapdError:
                wanted = False
        if self.pause_check:
            return bool(self._broadcast(wanted))
        return False

    def close(self) -> None:
        """Wait for the last snapshot to reach the daemons (and the last replicas theirs)."""
        if self._sender is not None:
            self._sender.wait()
        if self._replicas is not None:
            self._replicas.wait()

    # ------------------------------------------------------------------ collectives

    def _distributed(self) -> bool:
        return self.world > 1 and dist.is_available() and dist.is_initialized()

    def _broadcast(self, value: Any) -> Any:
        if not self._distributed():
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _gather(self, value: Any) -> list[Any]:
        if not self._distributed():
            return [value]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def _barrier(self) -> None:
        if self._distributed():
            dist.barrier()


def _before_update(copies: step_copy.StepCopies, replicas: "replica.Replicas | None") -> None:
    """The optimizer's step pre-hook: the step copy's part beside the step whole, the
    replicas of the last step sent and received (:mod:`hapd.elastic.replica`)."""
    copies.before_update()
    if replicas is not None:
        replicas.wait()


def _cover(offers: list[step_copy.Offer], agreement: step_copy.Agreement
           ) -> tuple[int, moves.Schedule, dict[int, list[moves.Piece]], list[moves.Piece]] | str:
    """The step the survivors go on from and its moves: the agreed step when their copies
    and the replicas they hold of that step cover every piece the new plan needs, else
    the step before (when every survivor holds it); else why not (the keys no survivor
    holds)."""
    missing = ""
    for step in (agreement.step, agreement.earlier):
        if step is None:
            continue
        held = {r: (*offers[r].copies[step][0], *offers[r].replicas.get(step, ())) for r in agreement.survivors}
        every_held = [p for pieces in held.values() for p in pieces]
        needed = {o.rank: [*o.needs, *step_copy.optimizer_needs(o.params, every_held)] for o in offers}
        plan = moves.schedule(held, needed)
        if plan.covered:
            return step, plan, needed, every_held
        if not missing:
            keys = ", ".join(plan.missing[:4]) + (f" and {len(plan.missing) - 4} more" if len(plan.missing) > 4 else "")
            missing = f"keys {keys} not held by any survivor"
    return missing


@dataclass(frozen=True)
class _FromMemory:
    """What :meth:`Elastic._from_memory` did: the step loaded (None: none) and where from,
    or why the survivors' memory could not give the state (empty: no rank holds copies)."""

    step: int | None = None
    source: str = ""
    fallback: str = ""


def _complete(runs: list[str], answers: Mapping[str, Mapping[str, list[dict[str, Any]]]]) -> dict[str, Any] | None:
    """The newest step of the first of ``runs`` that the daemons' ``answers`` (address →
    run → entries, in the order asked) hold every rank of; None when none is whole."""
    for run in runs:
        holders: dict[tuple[int, int], dict[int, str]] = {}
        for address, listed in answers.items():  # the first daemon asked that holds a rank's files gives them
            for entry in listed.get(run, []):
                holders.setdefault((int(entry["step"]), int(entry["world"])), {}).setdefault(int(entry["rank"]), address)
        for (step, world), ranks in sorted(holders.items(), reverse=True):
            if set(ranks) == set(range(world)):
                return {"run": run, "step": step, "world": world, "holders": {str(r): a for r, a in ranks.items()}}
    return None


def _key_bytes() -> bytes:
    """The daemons' key (``$HAPD_KEY_FILE``, which the daemon sets for its ranks)."""
    return load_key(default_key_path())


def _float_or_none(text: str | None) -> float | None:
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in text)[:64]


def _has_checkpoint(path: Path) -> bool:
    try:
        find_checkpoint(path)
    except CheckpointError:
        return False
    return True


__all__ = ["Elastic", "SnapshotCost", "local_folder"]
