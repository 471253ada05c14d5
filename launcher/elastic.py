"""Elastic jobs: a host that leaves or joins does not end the job.

    python -m launcher run train.py --hosts hosts.txt --elastic 2:3 -- ARGS
    python -m launcher join gpu-c slots=2 --hosts hosts.txt      # joins once its ranks are ready

An elastic job runs in *generations*: one :class:`~launcher.job.Job` per set of hosts.
When a generation fails the launcher decides what the failure was:

- a host whose daemon stops answering (killed, its link down) is **dropped**;
- a rank killed by a signal (the OOM killer, ``kill -9``), or a rank failing because a
  peer went away (a collective's connection closed or timed out), is a **fault**: the
  same hosts, less any that stopped answering, go on;
- any other failure (an exception in the script) ends the job as without ``--elastic``:
  running the script again would fail again.

Every rank runs under :mod:`hapd.elastic.in_place`: one whose peer went away parks. After
a lost host or a rank killed by a signal, once every other rank of the hosts left parked
(:attr:`~launcher.job.Job.hold_on_host_loss`), the next generation goes on in those
processes: each daemon gets a ``switch`` (the ranks, the rendezvous, the environment)
and its ranks run the script again (``ElasticOptions.in_place``; ``--restart`` turns it
off). A killed rank's slot is dropped: its host goes on with one rank fewer
(``HAPD_HOSTS`` names it ``HOST#N``: the profile's first N devices of it), and a host
left with none leaves the generation and joins again through the host file. Otherwise
every rank of the failed generation is stopped at once by its daemon (SIGTERM, SIGKILL after 5 s; none
waits in a collective: :class:`~launcher.job.Job` cancels them, and the process group's
timeout, ``HAPD_COLLECTIVE_TIMEOUT``, bounds what the cancel cannot reach) and the next
generation starts new ones; a lost daemon stops its own when the job's lease expires.
The next generation runs on the hosts left when at least ``min_hosts`` are (else the
job ends, exit 1) and at most ``max_restarts`` faults happened. Its ranks run the script from its top with
``HAPD_ELASTIC_RUN`` (the run's id), ``HAPD_GENERATION``, ``HAPD_HOSTS`` (the hosts'
labels in rank order: :func:`hapd.train.plan_source.job_profile` cuts the cluster's
profile to them, so the plan comes from the daemon's cache or an LP-only re-plan),
``HAPD_ELASTIC_DAEMONS`` and ``HAPD_ELASTIC_BUDDY`` (where the snapshots are):
:class:`hapd.elastic.resume.Elastic` resumes from the newest complete snapshot.

A host that appears in the host file (``python -m launcher join`` appends it), answers
a ping and has the slots joins at a step boundary: in place, the launcher launches its
ranks at once (:meth:`ElasticRun._start_joiners`: they import and build the model while
the others train, then wait for their place), and once they are ready asks the job to
pause (rank 0 learns it after its step, the ranks snapshot that step and park); the next
generation switches every one of them in place, losing no step. With ``--restart`` the
job pauses at once, its ranks exit and the next generation restarts them all.

The launcher prints each change in one line (what was lost or joined, when, the hosts
and plan now running, the step resumed and the steps lost, and the time to resume split
into detection, re-plan, restart and state load), and the JSON report's ``elastic``
section holds the same per generation. No torch import here.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence, TextIO

from hapd.wire.switch import JOIN_HELD_ENV
from hapd.errors import PEER_FAILURE, HapdError, OptionsError
from hapd.wire.client import Client, refuses_connections
from hapd.wire.keys import default_key_path, home_dir, load_key

from launcher.hosts import Host, load_hosts, parse_hosts
from launcher.job import EXIT_HOST_LOST, Attach, Job, JobOptions, JobResult, LaunchError, Placement, \
    choose_master_port, default_job_id, job_env
from launcher.report import write_report

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0
"""``HAPD_COLLECTIVE_TIMEOUT`` of an elastic job's ranks unless ``--env`` sets it: a
rank waiting on a peer that is gone fails after this long even if nothing stops it."""

MAX_RUN_ID_CHARS = 58
"""An elastic job's id leaves room for its generations' suffix (``-g12``) within a
job id's 64 characters."""

FAILURE_PING_S = 1.5
"""How long a host may take to answer the ping an elastic job's failure sends it."""

WATCH_EVERY_S = 1.0
"""How often the host file is looked at for joining hosts."""

JOIN_RETRY_S = 5.0
"""How long a host whose join failed waits before it is asked again."""


@dataclass(frozen=True)
class ElasticOptions:
    """``--elastic MIN:MAX`` and its companions."""

    min_hosts: int
    max_hosts: int
    max_restarts: int = 10
    """Faults survived before the job gives up (joins do not count)."""
    snapshot_every: int = 0
    """``HAPD_SNAPSHOT_EVERY``: steps between snapshots; 0: chosen by cost; < 0: none."""
    host_file: Path | None = None
    """Watched for hosts joining (None: no joins)."""
    in_place: bool = True
    """After a lost host, a rank killed or at a join, switch the other ranks to the next
    generation in their processes (they park, :mod:`hapd.elastic.in_place`) instead of
    restarting them; ranks that do not park, or a parked rank that exits, take the
    restart path."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_hosts <= self.max_hosts:
            raise OptionsError(f"--elastic {self.min_hosts}:{self.max_hosts}: need 1 ≤ MIN ≤ MAX", field="elastic")
        if self.max_restarts < 0:
            raise OptionsError(f"--max-restarts {self.max_restarts} must be ≥ 0", field="max_restarts")


def parse_elastic(text: str, hosts: int) -> tuple[int, int]:
    """``MIN:MAX``, ``MIN:`` or ``MIN`` (MAX: the hosts given) as host counts."""
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d*)\s*)?", text)
    if match is None:
        raise OptionsError(f"--elastic {text!r}: expected MIN:MAX host counts, e.g. 2:3", field="elastic")
    low = int(match.group(1))
    high = int(match.group(2)) if match.group(2) else max(hosts, low)
    return low, high


@dataclass
class Generation:
    """One set of hosts the job ran on."""

    index: int
    job_id: str
    hosts: list[str]
    started: float
    world: int = 0
    ended: float | None = None
    outcome: str = ""
    resumed: dict[str, Any] | None = None
    first_step: dict[str, Any] | None = None
    last_step: int | None = None
    snapshots: int = 0
    last_snapshot: int | None = None
    plan: str | None = None
    recovery: dict[str, Any] | None = None
    in_place: bool = False
    """Its ranks are the last generation's, switched in place (not new processes)."""
    ranks: dict[str, int] = field(default_factory=dict)
    """Ranks per host label (fewer than its slots on a host that goes on after a rank of
    it was killed)."""

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class _Pending:
    """Hosts of the host file being checked for a join (pinged off the main thread), then
    launched ahead (:meth:`ElasticRun._start_joiners`) while the others train."""

    ready: list[Host] = field(default_factory=list)
    checking: bool = False
    asked: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    started: bool = False
    """The ready hosts' ranks were launched ahead (they wait to be placed)."""
    prepared: bool = False
    """Every rank launched ahead said ``join_ready``: time to pause the others."""
    after: dict[str, int] = field(default_factory=dict)
    """Per host launched ahead, the last of its events read."""
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None


class ElasticRun:
    """An elastic job: generations of :class:`Job` until one finishes (see the module
    docstring). :meth:`run` returns the last generation's result with the elastic
    report."""

    def __init__(self, hosts: Sequence[Host], options: JobOptions, elastic: ElasticOptions, *,
                 out: TextIO | None = None, err: TextIO | None = None, launcher_start: float | None = None) -> None:
        if len(hosts) < elastic.min_hosts:
            raise OptionsError(f"--elastic {elastic.min_hosts}:{elastic.max_hosts}: the host file has {len(hosts)} "
                               "host(s)", field="elastic")
        self.hosts = list(hosts)[:elastic.max_hosts]
        self.options = options
        self.elastic = elastic
        self.out, self.err = out, err
        self.launcher_start = launcher_start or time.time()
        self.run_id = options.job_id or default_job_id(options.script)
        if len(self.run_id) > MAX_RUN_ID_CHARS:
            raise OptionsError(f"--job-id {self.run_id!r}: an elastic job's id is at most {MAX_RUN_ID_CHARS} characters "
                               "(its generations are JOB-g0, JOB-g1, …)", field="job_id")
        self.generations: list[Generation] = []
        self.dropped: list[dict[str, Any]] = []
        self.joined: list[dict[str, Any]] = []
        self.faults = 0
        self._pending = _Pending()
        self._watch_at = 0.0
        self._join_retry_at: dict[str, float] = {}
        """A host whose join failed (its daemon went away, a rank of it exited) is not
        asked again before this (monotonic): it joins once it answers again, not in a
        loop of failed launches."""
        self._job: Job | None = None
        self._key = load_key(options.key_file or default_key_path())
        self._every_host: dict[str, Host] = {h.label: h for h in self.hosts}
        """Every host the job ran on (their daemons hold the run's snapshots)."""
        self._cut: dict[str, int] = {}
        """Ranks on a host that goes on in place with fewer than it started with (a rank of
        it was killed), by label; a restart gives every host its ranks back."""

    # ------------------------------------------------------------------ output

    def say(self, text: str) -> None:
        try:
            print(f"hapd launcher: {text}", file=self.err or sys.stderr, flush=True)
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------ the generations

    def _options_for(self, index: int, hosts: Sequence[Host]) -> JobOptions:
        labels = [h.label for h in hosts]
        addresses = [h.address for h in hosts]
        cut = {label: n for label, n in self._cut.items() if label in labels}
        env = {
            "HAPD_ELASTIC_RUN": self.run_id,
            "HAPD_GENERATION": str(index),
            # a host with ranks killed goes on with its first N devices (Profile.on_hosts)
            "HAPD_HOSTS": ",".join(f"{label}#{cut[label]}" if label in cut else label for label in labels),
            "HAPD_ELASTIC_DAEMONS": ",".join(addresses),
            "HAPD_ELASTIC_FORMER_DAEMONS": ",".join(h.address for label, h in self._every_host.items()
                                                     if label not in labels),
            "HAPD_SNAPSHOT_EVERY": str(self.elastic.snapshot_every),
            "HAPD_PAUSE_CHECK": "1" if self.elastic.host_file is not None else "0",
            "HAPD_COLLECTIVE_TIMEOUT": f"{DEFAULT_COLLECTIVE_TIMEOUT_S:g}",
            **self.options.env,
        }
        buddies = {h.label: {"HAPD_ELASTIC_BUDDY": hosts[(i + 1) % len(hosts)].address if len(hosts) > 1 else ""}
                   for i, h in enumerate(hosts)}
        if self.options.report is not None:
            report = self.options.report.with_name(f"{self.options.report.stem}-g{index}{self.options.report.suffix}")
        else:  # one per generation: one switched in place keeps the job id of the generation it came from
            report = home_dir() / "runs" / f"{self.run_id}-g{index}.json"
        return dataclasses.replace(self.options, job_id=f"{self.run_id}-g{index}", env=env, host_env=True,
                                   env_of_host=buddies, report=report, in_place=self.elastic.in_place,
                                   nproc_of_host=cut)

    def run(self) -> JobResult:
        hosts = list(self.hosts)
        index = 0
        previous: Generation | None = None
        attach: Attach | None = None
        while True:
            gen = Generation(index, f"{self.run_id}-g{index}", [h.label for h in hosts], time.time(),
                             in_place=attach is not None)
            self.generations.append(gen)
            job = self._job_for(gen, previous, hosts, attach)
            try:
                try:
                    job.start()
                except LaunchError as exc:
                    if attach is None:
                        raise
                    # a host could not switch (a rank of it ended meanwhile): stop them all, launch afresh
                    self.say(f"{exc}; restarting generation {index} instead")
                    job.close()
                    self._release(attach.job_id, hosts)
                    gen.in_place, attach = False, None
                    job = self._job_for(gen, previous, hosts, None)
                    job.start()
                result = job.wait()
            finally:
                job.close()
                self._job = None
            result = job.finish(result)
            gen.ended = time.time()
            ahead = self._stop_watching_joiners()
            decided = self._decide(gen, job, result, hosts)
            attach = self._attach_next(gen, job, result, decided, ahead)
            unused = [h for h in self._pending.ready if attach is None or h.label not in attach.after]
            if ahead and unused:  # launched ahead for a join that did not happen in place
                self._release(job.job_id, unused)
            if decided is None:
                return self._finish(result)
            hosts = decided
            previous = gen
            index += 1

    def _job_for(self, gen: Generation, previous: Generation | None, hosts: Sequence[Host],
                 attach: Attach | None) -> Job:
        if attach is None:  # new processes on every host: each with all its ranks again
            self._cut = {}
        job = Job(hosts, self._options_for(gen.index, hosts), out=self.out, err=self.err,
                  launcher_start=self.launcher_start, attach=attach)
        gen.world = job.world_size
        gen.ranks = {p.host.label: p.nproc for p in job.placements}
        job.on_tick = self._watch
        job.on_failure = lambda placements, j=job: self._ping_after_failure(j, placements)
        job.on_elastic = lambda rank, value, g=gen, p=previous: self._on_event(g, p, value)
        job.hold_on_host_loss = self.elastic.in_place
        self._job = job
        self._pending = _Pending()
        return job

    def _attach_next(self, gen: Generation, job: Job, result: JobResult, decided: list[Host] | None,
                     ahead: Mapping[str, int]) -> Attach | None:
        """The next generation switched in place when every host it runs on held its
        parked ranks or joins now (``ahead``: the joining hosts launched ahead, the last
        event read of each; the others are launched at the switch); otherwise the held
        ranks are stopped (the next generation, if any, restarts)."""
        if not result.held:
            return None
        going_on = {h.label for h in decided or ()}
        joining = {j["host"] for j in self.joined if j["generation"] == gen.index + 1}
        if decided is not None and set(result.held) <= going_on and going_on - set(result.held) <= joining:
            return Attach(job.job_id, gen.index + 1,
                          {**dict(result.after), **{k: v for k, v in ahead.items() if k in going_on}})
        self._release(job.job_id, [self._every_host[label] for label in result.held if label in self._every_host])
        return None

    def _release(self, job_id: str, hosts: Sequence[Host]) -> None:
        """Stop a job's ranks on ``hosts`` and wait until their daemons say they ended
        (a restart on the same hosts needs their slots)."""

        def one(h: Host) -> None:
            try:
                with Client(h.address, self._key, self.options.timeout_s) as client:
                    client.cancel(job_id)
                    deadline = time.monotonic() + self.options.grace_s
                    while time.monotonic() < deadline:
                        if client.job_status(job_id).get("state") in ("exited", "failed", "cancelled"):
                            return
                        time.sleep(0.1)
            except HapdError as exc:
                self.say(f"could not stop job {job_id} on {h.label}: {exc}")

        if hosts:
            with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
                list(pool.map(one, hosts))

    def _decide(self, gen: Generation, job: Job, result: JobResult, hosts: list[Host]) -> list[Host] | None:
        """The next generation's hosts, or None when the job ends with ``result``."""
        paused = gen.outcome == "paused"
        failure = result.failure
        if result.exit_code == 0 and not paused:
            gen.outcome = "finished"
            return None
        if failure is not None and failure.get("kind") == "interrupt":
            gen.outcome = "interrupted"
            return None
        if paused and failure is None:
            joining = [h for h in self._pending.ready if h.label not in {x.label for x in hosts}]
            room = self.elastic.max_hosts - len(hosts)
            joining = joining[:room]
            for h in joining:
                self.joined.append({"host": h.label, "generation": gen.index + 1, "time": time.time(),
                                    "at_step": gen.last_step})
            gen.outcome = "paused for " + (", ".join(h.label for h in joining) or "nothing") + " to join"
            if joining:
                self.say(f"host(s) {', '.join(h.label for h in joining)} join at step {gen.last_step}: going on with "
                         f"{len(hosts) + len(joining)} hosts")
            self._every_host.update({h.label: h for h in joining})
            return hosts + joining
        lost = set(result.lost) | self._unanswering([h for h in hosts if h.label not in result.lost])
        fault = self._fault(failure, lost)
        if fault is None:
            gen.outcome = "failed"
            return None
        gen.outcome = fault
        failed_at = job.failed_at or gen.ended or time.time()
        for label in sorted(lost):
            self.dropped.append({"host": label, "generation": gen.index, "time": failed_at, "at_step": gen.last_step})
        emptied = self._drop_killed(job, result)
        # a host left with none of its ranks holds none: the others switch in place without it (its
        # daemon may not have said its job ended when the last rank parked)
        result.held = [label for label in result.held if label not in emptied]
        for label in sorted(emptied):
            self.dropped.append({"host": label, "generation": gen.index, "time": failed_at, "at_step": gen.last_step,
                                 "why": "its ranks were killed"})
        left = [h for h in hosts if h.label not in lost | emptied]
        self.faults += 1
        gen.recovery = {"failed_at": failed_at, "decided_at": time.time(), "lost": sorted(lost),
                        "ranks_killed": {label: ranks for label, ranks in result.killed.items()}}
        if len(left) < self.elastic.min_hosts:
            self.say(f"{fault}: {len(left)} host(s) left, fewer than --elastic's minimum {self.elastic.min_hosts}: "
                     "the job ends")
            result.exit_code = result.exit_code or EXIT_HOST_LOST
            return None
        if self.faults > self.elastic.max_restarts:
            self.say(f"{fault}: {self.faults} faults, more than --max-restarts {self.elastic.max_restarts}: the job ends")
            return None
        what = f"lost {', '.join(sorted(lost))}" if lost else "same hosts"
        if result.held and result.killed:
            what += "; without the killed rank(s) " + ", ".join(
                f"{r} ({label}{', left with none' if label in emptied else ''})"
                for label, ranks in sorted(result.killed.items()) for r in ranks)
        how = "switching in place to" if {h.label for h in left} == set(result.held) else "restarting on"
        self.say(f"{fault} at {time.strftime('%H:%M:%S', time.localtime(failed_at))} (last step {gen.last_step}, "
                 f"last snapshot {gen.last_snapshot}); {what}: {how} {len(left)} host(s) "
                 f"({', '.join(h.label for h in left)}), detection took {time.time() - failed_at:.1f} s")
        return left

    def _drop_killed(self, job: Job, result: JobResult) -> set[str]:
        """The ranks a signal killed while the others parked (:attr:`JobResult.killed`):
        each host goes on in place with that many ranks fewer (:attr:`_cut`); the hosts
        left with none, which leave the generation (and join again through the host file)."""
        if not result.held:
            return set()
        emptied = set()
        for p in job.placements:
            gone = len(result.killed.get(p.host.label, ()))
            if not gone:
                continue
            if gone >= p.nproc:
                emptied.add(p.host.label)
            else:
                self._cut[p.host.label] = p.nproc - gone
        return emptied

    def _fault(self, failure: Mapping[str, Any] | None, lost: set[str]) -> str | None:
        """What the failure was when the job can go on, else None."""
        if lost:
            return f"host(s) {', '.join(sorted(lost))} lost"
        if failure is None:
            return None
        if failure.get("kind") == "host":
            return f"host {failure.get('host')} lost"
        if failure.get("kind") != "rank":
            return None
        code = int(failure.get("code") or 0)
        if code > 128 or code < 0:  # exit_status gives 128 + N for a signal N
            return f"rank {failure.get('rank')} on {failure.get('host')} killed (exit {code})"
        cause = " ".join(str(failure.get(k) or "") for k in ("cause", "last_line"))
        if PEER_FAILURE.search(cause):
            return f"rank {failure.get('rank')} on {failure.get('host')} lost a peer ({cause.strip()[:120]})"
        return None

    def _ping_after_failure(self, job: Job, placements: Sequence[Placement]) -> None:
        """At a generation's first failure, ping the hosts still running (on a thread):
        one whose daemon's port refuses the connection (the daemon killed, its host up)
        is lost at once, without waiting for its poller's probe after half a second of
        silence; one that does not answer within :data:`FAILURE_PING_S` is lost now,
        without waiting for its poller's ``--lost-after``. A host dropped so by mistake (a
        busy daemon) answers pings again and joins back through the host file."""

        def one(p: Placement) -> None:
            if refuses_connections(p.host.address, FAILURE_PING_S):
                job.declare_lost(p, "its daemon's port refused the connection after the job failed (DaemonDown)")
                return
            try:
                with Client(p.host.address, self._key, FAILURE_PING_S) as client:
                    client.ping()
            except HapdError as exc:
                job.declare_lost(p, f"no answer to a ping within {FAILURE_PING_S:g} s after the job failed "
                                    f"({type(exc).__name__})")

        for p in placements:
            threading.Thread(target=one, args=(p,), daemon=True, name="hapd-launcher-failure-ping").start()

    def _unanswering(self, hosts: Sequence[Host]) -> set[str]:
        """The hosts whose daemon does not answer a ping now."""

        def one(h: Host) -> str | None:
            try:
                with Client(h.address, self._key, min(2.0, self.options.timeout_s)) as client:
                    client.ping()
            except HapdError:
                return h.label
            return None

        if not hosts:
            return set()
        with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
            return {label for label in pool.map(one, hosts) if label is not None}

    # ------------------------------------------------------------------ events from rank 0

    def _on_event(self, gen: Generation, previous: Generation | None, value: Mapping[str, Any]) -> None:
        event = value.get("event")
        if event == "step":
            gen.last_step = int(value.get("step", 0))
        elif event == "snapshot":
            gen.snapshots += 1
            gen.last_snapshot = int(value.get("step", 0))
        elif event == "paused":
            gen.outcome = "paused"
            gen.last_step = int(value.get("step", 0))
        elif event == "resumed":
            gen.resumed = dict(value)
            gen.plan = value.get("plan")
        elif event == "first_step":
            gen.first_step = dict(value)
            gen.last_step = int(value.get("step", 0))
            if previous is not None and previous.recovery is not None and gen.resumed is not None:
                self._recovered(gen, previous)

    def _recovered(self, gen: Generation, previous: Generation) -> None:
        rec = previous.recovery or {}
        resumed = gen.resumed or {}
        first = gen.first_step or {}
        plan_s = float(resumed.get("plan_s") or 0.0)  # what the job stood still for: the rest ran while the ranks joined
        asked_s = float(resumed.get("plan_asked_s") or plan_s)
        load_s = float(resumed.get("load_s") or 0.0)
        detection = rec["decided_at"] - rec["failed_at"]
        restart = max(0.0, float(resumed.get("time", first.get("time", 0.0))) - load_s - rec["decided_at"] - plan_s)
        total = float(first.get("time", 0.0)) - rec["failed_at"]
        step = int(resumed.get("step", 0))
        lost_steps = max(0, (previous.last_step or 0) - step)
        parts = restart_parts(resumed, rec["decided_at"], restart, plan_s)
        rec.update(detection_s=detection, replan_s=plan_s, replan_asked_s=asked_s, restart_s=restart, load_s=load_s,
                   total_s=total, in_place=gen.in_place,
                   resumed_step=step, steps_lost=lost_steps, source=resumed.get("source"), plan=resumed.get("plan"),
                   generation=gen.index, hosts=gen.hosts, restart_parts=parts)
        ahead = f" (asked while the ranks joined: {asked_s:.2f} s)" if asked_s > plan_s + 0.005 else ""
        inside = ""
        if parts is not None:
            inside = (f" ({'switch' if gen.in_place else 'launch'} {parts['launch_s']:.1f} s, "
                      f"script to parallelize {parts['script_s']:.1f} s, "
                      f"parallelize {parts['parallelize_s']:.1f} s of which "
                      + (f"preparing {parts['prepare_s']:.1f} s, " if parts.get("prepare_s") is not None else "")
                      + f"joining the ranks {parts['join_s']:.1f} s, "
                      f"then {parts['after_s']:.1f} s)")
        self.say(f"generation {gen.index} on {len(gen.hosts)} host(s) ({', '.join(gen.hosts)}), {gen.world} ranks: "
                 f"resumed at step {step} from {resumed.get('source')} ({lost_steps} step(s) lost); plan: "
                 f"{resumed.get('plan')}; first step {total:.1f} s after the failure: detection {detection:.1f} s, "
                 f"re-plan {plan_s:.2f} s{ahead}, {'switch in place' if gen.in_place else 'restart'} "
                 f"{restart:.1f} s{inside}, state load {load_s:.2f} s")

    # ------------------------------------------------------------------ joins

    def _watch(self) -> None:
        """Look at the host file for hosts to join (main thread, cheap); pings run on a
        thread; once one is ready, launch its ranks ahead (in place) or ask the job to
        pause at once (``--restart``); once those launched ahead are ready, ask the job to
        pause."""
        if self.elastic.host_file is None or self._job is None:
            return
        pending = self._pending
        with pending.lock:
            ready = list(pending.ready)
            checking = pending.checking
        if ready and not pending.started and self.elastic.in_place:
            pending.started = True
            pending.thread = threading.Thread(target=self._start_joiners, args=(self._job, ready, pending), daemon=True,
                                              name="hapd-launcher-joiners")
            pending.thread.start()
            return
        if ready and not pending.asked and (pending.prepared or not self.elastic.in_place):
            pending.asked = True
            self._ask_pause(self._job)
            return
        if pending.started:
            return
        now = time.monotonic()
        if checking or now < self._watch_at:
            return
        self._watch_at = now + WATCH_EVERY_S
        current = {label for g in self.generations[-1:] for label in g.hosts}
        if len(current) >= self.elastic.max_hosts:
            return
        try:
            listed = load_hosts(self.elastic.host_file)
        except OptionsError:
            return  # being written; looked at again next time
        candidates = [h for h in listed if h.label not in current and self._join_retry_at.get(h.label, 0.0) <= now]
        if not candidates:
            return
        pending.checking = True
        threading.Thread(target=self._check_candidates, args=(candidates, pending), daemon=True,
                         name="hapd-launcher-join-check").start()

    def _check_candidates(self, candidates: Sequence[Host], pending: _Pending) -> None:
        need = self.options.nproc_per_node
        ready = []
        for h in candidates:
            try:
                with Client(h.address, self._key, min(2.0, self.options.timeout_s)) as client:
                    pong = client.ping()
            except HapdError:
                continue
            if int(pong.get("slots", 0)) >= (need or h.slots):
                ready.append(h)
        with pending.lock:
            pending.ready = ready
            pending.checking = False

    def _start_joiners(self, job: Job, joiners: Sequence[Host], pending: _Pending) -> None:
        """Launch the joining hosts' ranks now, under the running job's id and placed as
        the next generation will place them (after the hosts running), with
        :data:`~hapd.wire.switch.JOIN_HELD_ENV`: they import, build and export the
        model and wait for their ``switch`` (:func:`hapd.wire.switch.wait_to_join`)
        while the others train. Then read their events (which renews their lease) until each rank
        said ``join_ready`` (``prepared``: the launcher pauses the others) and on, until
        :meth:`_stop_watching_joiners`. A host whose launch fails or whose rank exits
        does not join."""
        gen = self.generations[-1]
        joiners = list(joiners)[:max(0, self.elastic.max_hosts - len(job.hosts))]
        hosts = [*job.hosts, *joiners]
        nxt = Job(hosts, self._options_for(gen.index + 1, hosts), out=self.out, err=self.err,
                  attach=Attach(job.job_id, gen.index + 1, {}))
        env = {**job_env(nxt.options, hosts), JOIN_HELD_ENV: "1"}
        started: list[Placement] = []
        try:
            for p in nxt.placements[len(job.hosts):]:
                try:
                    # a rendezvous no one serves: the switch gives the generation's own (wait_to_join)
                    nxt._launch_on(p, nxt.placements[0].host.name, choose_master_port(nxt.placements[0].host), env,
                                   None, os.getcwd())
                    started.append(p)
                except HapdError as exc:
                    self.say(f"could not start the ranks of joining host {p.host.label}: {exc}")
                    self._join_retry_at[p.host.label] = time.monotonic() + JOIN_RETRY_S
        finally:
            nxt.close()
        with pending.lock:
            pending.ready = [p.host for p in started]
        if started:
            self.say(f"host(s) {', '.join(p.host.label for p in started)} ready to join: their ranks start now, "
                     "the others train on until they are ready")
        self._watch_joiners(job.job_id, started, pending)

    def _watch_joiners(self, job_id: str, started: Sequence[Placement], pending: _Pending) -> None:
        """Read the ranks launched ahead's events (see :meth:`_start_joiners`)."""
        clients = {p.host.label: Client(p.host.address, self._key, self.options.timeout_s) for p in started}
        waiting = {p.host.label: set(p.ranks) for p in started}
        try:
            while not pending.stop.is_set():
                for p in started:
                    label = p.host.label
                    if label not in clients:
                        continue
                    try:
                        events, done = clients[label].job_events(job_id, pending.after.get(label, 0))
                    except HapdError as exc:
                        events, done = [], True
                        self.say(f"joining host {label} stopped answering ({exc}): it does not join")
                    for e in events:
                        pending.after[label] = e["seq"]
                        if e["stream"] == "stdout" and '"event": "join_ready"' in e["line"]:
                            waiting[label].discard(e["rank"])
                        elif e["stream"] == "stderr" or (e["stream"] == "exit" and e["line"] != "0"):
                            self.say(f"joining host {label}: [rank {e['rank']}] {e['line']}")
                            done = done or e["stream"] == "exit"
                    if done:
                        clients.pop(label).close()
                        with pending.lock:
                            pending.ready = [h for h in pending.ready if h.label != label]
                        waiting.pop(label, None)
                        pending.after.pop(label, None)
                        self._join_retry_at[label] = time.monotonic() + JOIN_RETRY_S
                if not clients:
                    # every host launched ahead is gone before the pause: looked for afresh (a host
                    # whose daemon was killed while its ranks prepared joins once it answers again)
                    with pending.lock:
                        pending.ready, pending.started, pending.prepared = [], False, False
                    return
                if not pending.prepared and pending.ready and not any(waiting.values()):
                    pending.prepared = True
                pending.stop.wait(0.2)
        finally:
            for client in clients.values():
                client.close()

    def _stop_watching_joiners(self) -> dict[str, int]:
        """Stop reading the events of the hosts launched ahead; per host still joining,
        the last of its events read (an in-place switch reads on from there)."""
        pending = self._pending
        if pending.thread is None:
            return {}
        pending.stop.set()
        pending.thread.join(timeout=self.options.timeout_s + 1)
        return {h.label: pending.after.get(h.label, 0) for h in pending.ready}

    def _ask_pause(self, job: Job) -> None:
        first = job.placements[0]
        try:
            job.control[first.node_rank].job_pause(job.job_id)
        except HapdError as exc:
            self.say(f"could not ask job {job.job_id} to pause for a joining host: {exc}")
            return
        names = ", ".join(h.label for h in self._pending.ready)
        self.say(f"host(s) {names} ready to join: pausing the job at the next step boundary")

    # ------------------------------------------------------------------ the end

    def _finish(self, result: JobResult) -> JobResult:
        report = dict(result.report or {})
        report["elastic"] = {
            "run": self.run_id,
            "min_hosts": self.elastic.min_hosts,
            "max_hosts": self.elastic.max_hosts,
            "faults": self.faults,
            "dropped": self.dropped,
            "joined": self.joined,
            "generations": [g.describe() for g in self.generations],
        }
        result.report = report
        path = self.options.report or home_dir() / "runs" / f"{self.run_id}.json"
        try:
            result.report_path = write_report(report, path)
            self.say(f"elastic report: {result.report_path} ({len(self.generations)} generation(s), {self.faults} "
                     f"fault(s), {len(self.joined)} join(s))")
        except OSError as exc:
            self.say(f"could not write the report to {path}: {exc}")
        self._drop_snapshots()
        return result

    def _drop_snapshots(self) -> None:
        """Free every generation's snapshots on every daemon that still answers."""
        for h in self._every_host.values():
            try:
                with Client(h.address, self._key, min(2.0, self.options.timeout_s)) as client:
                    for gen in self.generations:
                        client.snapshot_drop(gen.job_id)
            except HapdError:
                pass


def restart_parts(resumed: Mapping[str, Any], decided_at: float, restart_s: float,
                  plan_s: float) -> dict[str, float] | None:
    """A restart's time on rank 0, split at its process's start and at
    :func:`hapd.parallelize` (what the ``resumed`` event says): ``launch_s`` (the
    decision to the process's start: the daemons' launch), ``script_s`` (the script up to
    :func:`hapd.parallelize`: the interpreter, imports, the model), ``parallelize_s``
    (less the plan's own time, which is the re-plan), of which ``prepare_s`` is rank 0's
    own work before joining (its exports rebound, the plan request; None when not said)
    and ``join_s`` joining the process group (waiting for the job's slowest rank to get
    there), and ``after_s`` (the
    script from :func:`hapd.parallelize` to :meth:`hapd.Elastic.resume`). None when the
    event lacks them (a script without :func:`hapd.parallelize`)."""
    started, built = resumed.get("started_at"), resumed.get("build")
    if not isinstance(started, (int, float)) or not isinstance(built, Mapping):
        return None
    try:
        called, total, join = float(built["started"]), float(built["total_s"]), float(built["join_s"])
    except (KeyError, TypeError, ValueError):
        return None
    launch, script = started - decided_at, called - started
    parallel = max(0.0, total - plan_s)
    prepare = built.get("prepare_s")
    return {"launch_s": launch, "script_s": script, "parallelize_s": parallel, "join_s": join,
            "prepare_s": float(prepare) if isinstance(prepare, (int, float)) else None,
            "after_s": restart_s - launch - script - parallel}


def append_host(host_file: Path, line: str) -> Host:
    """Append ``line`` (``HOST slots=N [port=P] [gpu=MODEL]``) to ``host_file``; the
    host it names (checked, and refused when already listed)."""
    new = parse_hosts(line, "<join>")
    if len(new) != 1:
        raise OptionsError(f"{line!r}: expected one host line", field="hosts")
    listed = load_hosts(host_file)
    if any(h.label == new[0].label for h in listed):
        raise OptionsError(f"{new[0].label} is already in {host_file}", field="hosts")
    text = host_file.read_text()
    with open(host_file, "a") as f:
        f.write(("" if text.endswith("\n") or not text else "\n") + line.strip() + "\n")
    return new[0]


__all__ = ["ElasticOptions", "ElasticRun", "Generation", "append_host", "parse_elastic", "restart_parts"]
