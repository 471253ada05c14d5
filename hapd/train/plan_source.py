"""Where a job's plan comes from: given, from the daemon, or compiled on rank 0.

:func:`obtain_plan` is how :func:`hapd.parallelize` and ``worker.py`` get a plan. A
given plan (a :class:`~hapd.compiler.plan.Plan`, its bytes or a ``.hplan`` path) is
used as is; otherwise rank 0 asks the daemon at ``$HAPD_DAEMON`` (a cache hit, an
LP-only re-plan or a compile there) and compiles the plan itself when none answers,
and the bytes are broadcast to every rank, so ranks never synthesize on their own.
Both say where a plan came from and how long it took (:meth:`PlanSource.describe`:
``plan: daemon cache hit, 2 ms``); :meth:`PlanSource.summary` is the line
:func:`hapd.parallelize` prints: that and what the plan runs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hapd.compiler.options import CompileOptions
from hapd.compiler.driver import compile as compile_plan
from hapd.ir.lower import GraphIR
from hapd.compiler.plan import Plan
from hapd.compiler.plan_summary import plan_line
from hapd.compiler.techniques import GraphSet
from hapd.errors import HapdError, PlanError
from hapd.profiler.local import device_profile
from hapd.profile.schema import Profile, estimated_profile, load_profile
from hapd.wire.client import Client
from hapd.wire.keys import default_key_path

DAEMON_PING_S = 2.0
"""How long rank 0 waits for the daemon to answer a ping before compiling itself."""

DAEMON_COMPILE_S = 600.0
"""How long rank 0 waits for the daemon's plan."""


@dataclass(frozen=True)
class PlanSource:
    """A plan, where it came from and how long getting it took (on rank 0)."""

    plan: Plan
    origin: str
    """``"daemon cache hit"``, ``"daemon LP-only re-plan"``, ``"compiled by the daemon"``,
    ``"compiled on rank 0"`` (with the reason the daemon was not used, if one was
    named), ``"file PATH"`` or ``"given"``."""
    seconds: float
    waited: float | None = None
    """With the plan asked for while the ranks joined the process group
    (:class:`PlanAhead`): the seconds rank 0 still waited for it once they had, the
    part of ``seconds`` the job stood still for; None: asked for after the join (all of
    ``seconds``)."""

    @property
    def stood_s(self) -> float:
        """The seconds the job stood still for the plan (``waited``, else ``seconds``)."""
        return self.seconds if self.waited is None else self.waited

    def describe(self, what: str = "plan") -> str:
        """``plan: daemon cache hit, 2 ms`` (``what`` names the plan)."""
        return f"{what}: {self.origin}, {_format_duration(self.seconds)}"

    def summary(self) -> str:
        """The one line :func:`hapd.parallelize` prints: the technique and what the others
        were predicted at, the per-rank batch or ratios, the predicted time per step
        against DP-CP, where the plan came from and how long it took
        (:func:`hapd.compiler.plan_summary.plan_line`)."""
        return plan_line(self.plan.doc, self.origin, self.seconds)


def _format_duration(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


_DAEMON_ORIGIN = {"hit": "daemon cache hit", "lp-only": "daemon LP-only re-plan", "miss": "compiled by the daemon"}


def daemon_key_path() -> Path:
    """The key file to sign daemon requests with: ``$HAPD_KEY_FILE`` (a daemon sets it
    for the ranks it launches: its own key, wherever its state lies), else
    ``$HAPD_HOME/key``."""
    return default_key_path()


def plan_from_daemon(graph: GraphIR | GraphSet, profile: Profile, options: CompileOptions, *,
                     address: str | None = None) -> tuple[bytes, str]:
    """``(plan bytes, origin)`` from the daemon at ``address`` (default
    ``$HAPD_DAEMON``): a cache hit, an LP-only re-plan of a cached program, or a compile
    there. ``graph``: one graph, or the graphs of every batch a technique search
    prices (pipelines, overlap: :class:`~hapd.compiler.techniques.GraphSet`, sent as
    ``graphs``). Raises :class:`~hapd.errors.HapdError` when there is no daemon, it
    does not answer, or it refuses."""
    address = address or os.environ.get("HAPD_DAEMON")
    if not address:
        raise HapdError("HAPD_DAEMON is not set")
    profile_doc = json.loads(profile.to_json())
    with Client(address, daemon_key_path(), DAEMON_PING_S) as client:
        client.ping()
        sent, kind = (graph.to_bytes(), "graphs") if isinstance(graph, GraphSet) else (graph.data, "hapg")
        data, cache = client.compile(sent, kind, profile=profile_doc, options=options.key(), timeout_s=DAEMON_COMPILE_S)
    return bytes(data), _DAEMON_ORIGIN.get(cache, f"daemon ({cache})")


def _plan_on_rank_zero(graph: GraphIR | GraphSet, profile: Profile, options: CompileOptions, use_daemon: bool) -> tuple[bytes, str]:
    """Rank 0's plan bytes: from the daemon when one answers, else compiled here."""
    why = ""
    if use_daemon and os.environ.get("HAPD_DAEMON"):
        try:
            return plan_from_daemon(graph, profile, options)
        except HapdError as exc:
            why = f" (daemon at {os.environ['HAPD_DAEMON']}: {type(exc).__name__}: {str(exc)[:200]})"
    return compile_plan(graph, profile, options).to_bytes(), f"compiled on rank 0{why}"


class PlanAhead:
    """Rank 0's plan asked for on a thread before the job's ranks have joined the process
    group (:func:`hapd.parallelize`, given a profile): the daemon's answer — a cache hit,
    an LP-only re-plan, a compile — or rank 0's own compile runs while the ranks still
    start (after an in-place switch, the slowest survivor still parks and runs the
    script again), instead of after, while every rank waits for the plan's broadcast.
    :func:`obtain_plan` takes its answer."""

    def __init__(self, graph: GraphIR | GraphSet, profile: Profile, options: CompileOptions, use_daemon: bool) -> None:
        self._answer: tuple[bytes, str, float] | None = None
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._ask, args=(graph, profile, options, use_daemon), daemon=True,
                                        name="hapd-plan-ahead")
        self._thread.start()

    def _ask(self, graph: GraphIR | GraphSet, profile: Profile, options: CompileOptions, use_daemon: bool) -> None:
        start = time.perf_counter()
        try:
            data, origin = _plan_on_rank_zero(graph, profile, options, use_daemon)
            self._answer = (data, origin, time.perf_counter() - start)
        except Exception as exc:  # noqa: BLE001 - raised in the caller's thread, as if asked there
            self._error = exc

    def result(self) -> tuple[bytes, str, float]:
        """``(plan bytes, origin, seconds the request took)``, once it is answered;
        raises what it failed with (a :class:`~hapd.errors.HapdError`: :func:`obtain_plan`
        tells every rank)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer


def _src_rank(group: Any) -> int:
    """The global rank of the group's rank 0."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def obtain_plan(graph: GraphIR | GraphSet, *, world: int, rank: int, profile: Profile | str | Path | Mapping | None = None,
                options: CompileOptions | Mapping[str, Any] | None = None, plan: Plan | str | Path | bytes | None = None,
                group: Any = None, use_daemon: bool = True, ahead: PlanAhead | None = None) -> PlanSource:
    """The job's plan for ``graph``; collective when ``world > 1`` (every rank calls it).

    ``plan`` (a :class:`Plan`, its bytes or a ``.hplan`` path) is used as is. Otherwise
    rank 0 asks the daemon at ``$HAPD_DAEMON`` (``use_daemon``) and compiles itself when
    none answers, for ``profile`` (default: an estimated homogeneous profile of
    ``world`` devices) and ``options`` — or takes the answer to that request made
    before the join (``ahead``, rank 0's: :class:`PlanAhead`); the bytes are broadcast
    to every rank, so ranks never synthesize on their own. Every rank checks the plan
    is for ``graph`` and ``world``; :class:`~hapd.errors.PlanError` otherwise, and on
    every rank when rank 0 failed to get one.
    """
    start = time.perf_counter()
    if plan is not None:
        found, origin = given_plan(plan)
        source = PlanSource(found, origin, time.perf_counter() - start)
    else:
        box: list[Any] = [None, None, "", 0.0, None]  # bytes, error, origin, seconds, waited
        if rank == 0:
            try:
                if ahead is not None:
                    data, origin, seconds = ahead.result()
                    box = [data, None, origin, seconds, time.perf_counter() - start]
                else:
                    data, origin = _plan_on_rank_zero(graph, job_profile(profile, world), compile_options(options),
                                                      use_daemon)
                    box = [data, None, origin, time.perf_counter() - start, None]
            except HapdError as exc:
                box = [None, f"{type(exc).__name__}: {exc}", "", 0.0, None]
        if world > 1:
            dist.broadcast_object_list(box, src=_src_rank(group), group=group)
        data, error, origin, seconds, waited = box
        if error is not None:
            raise PlanError(f"rank 0 could not get a plan: {error}")
        source = PlanSource(Plan.from_bytes(data), origin, float(seconds), waited)
    _check_plan_fits(source.plan, graph, world)
    return source


def given_plan(plan: Plan | str | Path | bytes) -> tuple[Plan, str]:
    """A given plan (a :class:`Plan`, its bytes or a ``.hplan`` path) and its origin
    (``"given"``, ``"file PATH"``)."""
    if isinstance(plan, Plan):
        return plan, "given"
    if isinstance(plan, (bytes, bytearray)):
        return Plan.from_bytes(bytes(plan)), "given"
    return Plan.load(plan), f"file {plan}"


def _check_plan_fits(plan: Plan, graph: GraphIR | GraphSet, world: int) -> None:
    if isinstance(graph, GraphSet):
        graph = graph.half if plan.technique == "overlap" and graph.half is not None else graph.full
    if plan.key.get("graph_id") != graph.graph_id:
        raise PlanError(f"the plan was compiled for graph {str(plan.key.get('graph_id'))[:12]}…, this program is "
                        f"{graph.graph_id[:12]}… (a different model, batch size or torch version)")
    devices = int(plan.program["devices"])
    if devices != world:
        raise PlanError(f"the plan is for {devices} devices, this job has {world} ranks")


JOB_HOSTS_ENV = "HAPD_HOSTS"
"""The hosts a launcher runs the job on, comma-separated in rank order (their names in
the host file, which a profile measured through that launcher uses too)."""


def job_profile(profile: Profile | str | Path | Mapping | None, world: int, *, device: Any = None,
                group: Any = None) -> Profile:
    """``profile`` loaded for ``world`` ranks; without one, the job's devices as each
    rank describes its ``device`` (:func:`hapd.profiler.local.device_profile`:
    collective over ``group``), or with no device an estimated homogeneous profile.

    A launcher that runs the job on some of the profile's hosts names them, in rank
    order, in ``$HAPD_HOSTS`` (an elastic job after a host left or joined): a profile
    of more devices than ``world`` is then cut to those hosts' devices
    (:meth:`~hapd.profile.schema.Profile.on_hosts`), and one whose hosts the job runs
    on in another order (a host that left and joined again comes last) is put in the
    job's rank order, so each rank's share is its own device's."""
    if profile is not None:
        loaded = load_profile(profile)
        hosts = [h for h in os.environ.get(JOB_HOSTS_ENV, "").split(",") if h]
        if hosts and (loaded.world != world or sorted(hosts) == sorted(loaded.hosts)):
            loaded = loaded.on_hosts(hosts)
        return load_profile(loaded, world_size=world)
    if device is not None:
        return device_profile(torch.device(device), world=world, group=group)
    return estimated_profile(world, name=f"estimated-{world}")


def compile_options(options: CompileOptions | Mapping[str, Any] | None) -> CompileOptions:
    """``options`` as :class:`CompileOptions` (a map gives its fields: :meth:`CompileOptions.from_mapping`)."""
    return CompileOptions.from_mapping(options)


__all__ = ["DAEMON_COMPILE_S", "DAEMON_PING_S", "JOB_HOSTS_ENV", "PlanAhead", "PlanSource", "compile_options", "daemon_key_path", "given_plan",
           "job_profile", "obtain_plan", "plan_from_daemon"]
