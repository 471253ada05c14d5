"""``python -m launcher``: run a training script on every host through the hapd daemons.

    python -m launcher run worker.py --nproc-per-node 2 -- --model bert --iterations 20
    python -m launcher run worker.py -n 2 --hosts hosts.txt -- --model bert
    python -m launcher check --hosts hosts.txt
    python -m launcher profile --hosts hosts.txt --nproc-per-node 2 --out cluster.json

``./run_all SCRIPT K [--hosts FILE] [-- ARGS]`` is ``python -m launcher run SCRIPT
--nproc-per-node K ...``. This module is the only place that turns Ctrl-C, SIGTERM and
SIGHUP (a closed terminal) into :class:`KeyboardInterrupt` (so the job is stopped
everywhere before exiting) and hapd errors into one line and exit status 2. A launcher
killed outright (SIGKILL) cannot stop anything: every daemon stops the job's ranks once
it has heard nothing from the launcher for ``--lease`` seconds. No torch import here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import click

from hapd.errors import HapdError, OptionsError
from hapd.util import atomic_write
from launcher.elastic import ElasticOptions, ElasticRun, append_host, parse_elastic
from launcher.hosts import Host, load_hosts
from launcher.job import (DEFAULT_LEASE_S, EXIT_INTERRUPTED, EXIT_LAUNCH_ERROR, JobOptions, JobResult, check_daemons,
                          launcher_dir, place, run_job)

LAUNCHER_START = time.time()
"""When this process started (the report's ``launcher_start``)."""

STOPPING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""Signals that stop the job everywhere (while a job runs). SIGINT is among them so that
a launcher started with it ignored (in the background of a script, under ``nohup``) still
stops on ``kill -INT``, as it does on Ctrl-C."""


class _LauncherGroup(click.Group):
    """Turns hapd errors into one line on stderr and the launcher's launch-error status."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except HapdError as exc:
            click.echo(f"hapd launcher: {type(exc).__name__}: {exc}", err=True)
            sys.exit(EXIT_LAUNCH_ERROR)


@click.group(cls=_LauncherGroup, context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """hapd's launcher: start SPMD training on every host's daemon at once, stream
    every rank's output, gather per-iteration timings, stop every rank on a failure."""


def _env_pairs(pairs: Sequence[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--env")
        out[key] = value
    return out


def _hosts(path: Path | None) -> list[Host] | None:
    return load_hosts(path) if path is not None else None


def _on_terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _exit(result: JobResult) -> None:
    sys.exit(result.exit_code)


PACKAGED_SCRIPTS = {"worker.py": "hapd.worker", "ddp.py": "hapd.ddp", "fsdp.py": "hapd.fsdp"}
"""Script names the launcher finds in the installed hapd when the current folder has no
such file (the README's ``worker.py``, the baselines): ``python -m hapd.worker``'s file."""


def resolve_script(script: Path) -> Path:
    """SCRIPT as given when it is a file (relative to the current folder); else, for a
    bare ``worker.py``, ``ddp.py`` or ``fsdp.py`` (:data:`PACKAGED_SCRIPTS`) or a module
    name (``hapd.worker``), the installed module's file, found without importing it; else
    an :class:`OptionsError` naming SCRIPT, the folder searched and what is packaged."""
    import importlib.util

    if script.is_file():
        return script
    name = str(script)
    module = PACKAGED_SCRIPTS.get(name) if script.parent == Path(".") else None
    if module is None and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+", name) and not name.endswith(".py"):
        module = name
    if module is not None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.origin and spec.origin.endswith(".py") and Path(spec.origin).is_file():
            return Path(spec.origin)
    packaged = ", ".join(PACKAGED_SCRIPTS)
    where = "" if script.is_absolute() else f" in {Path.cwd()}"
    raise OptionsError(f"script {name} not found{where} (a path relative to the current folder, or one of the "
                       f"packaged scripts {packaged}, or a module such as hapd.worker)", field="script")


_common = [
    click.option("--hosts", "-H", "hosts", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="Host file: lines 'HOST slots=N [port=P] [gpu=MODEL]'  [default: this machine, through the "
                      "daemon at $HAPD_DAEMON or tcp://127.0.0.1:5557, or one started for the job]"),
    click.option("--nproc-per-node", "-n", "nproc", type=click.IntRange(min=1), default=None,
                 help="Ranks per host  [default: each host's slots; 1 without --hosts]"),
    click.option("--key", "key_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="Shared key file of the daemons  [default: $HAPD_KEY_FILE or $HAPD_HOME/key]"),
    click.option("--env", "env", multiple=True, metavar="KEY=VALUE",
                 help="Extra environment for every rank (NCCL_* and GLOO_* are forwarded from here anyway)."),
    click.option("--timeout", "timeout", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
                 help="Seconds a daemon may take to answer the checks, the launch and a cancel."),
    click.option("--master-port", type=click.IntRange(1, 65535), default=None,
                 help="Rendezvous port on the first host  [default: a free one]"),
    click.option("--report", "report", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="JSON report of the timings  [default: $HAPD_HOME/runs/JOB.json]"),
    click.option("--job-id", default=None, help="Job id on the daemons  [default: SCRIPT-DATE-TIME-RANDOM]"),
    click.option("--lease", "lease", type=float, default=DEFAULT_LEASE_S, show_default=True,
                 help="Seconds a daemon keeps the job's ranks running without hearing from this launcher (it polls "
                      "every 50 ms); then that daemon stops them itself (the launcher was killed or lost it)."),
]


def common_options(f: Any) -> Any:
    for option in reversed(_common):
        f = option(f)
    return f


@main.command("run", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": True})
@click.argument("script", type=click.Path(path_type=Path))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@common_options
@click.option("--ship/--no-ship", default=True, show_default=True,
              help="Send the script's bytes to every daemon (it need exist only here), or only its absolute path "
                   "(it must exist at that path on every host).")
@click.option("--cwd", default=None, help="Working directory of the ranks on every host  [default: this one for "
                                          "daemons on this machine's loopback, the daemon's elsewhere]")
@click.option("--lost-after", type=click.FloatRange(min=0.1), default=1.5, show_default=True,
              help="A daemon that does not answer this long mid-run is lost: every rank is stopped.")
@click.option("--quiet", "-q", is_flag=True, help="Do not stream the ranks' output (the table and failures still print).")
@click.option("--verbose", "-v", is_flag=True,
              help='Also print the ranks\' {"hapd": ...} lines (timings, summary), which the launcher consumes.')
@click.option("--progress", is_flag=True,
              help="Rank 0 of a script training a hapd.parallelize module prints its progress (step, the step's "
                   "global loss, ms/step, samples/s) every 2 s and at the end (HAPD_PROGRESS=1).")
@click.option("--log-dir", "log_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Rank 0 of a script training a hapd.parallelize module logs each step's loss, time and rates there: "
                   "TensorBoard scalars when tensorboard is installed, else hapd_steps.jsonl (HAPD_LOG_DIR).")
@click.option("--elastic", "elastic", default=None, metavar="MIN:MAX",
              help="Go on when hosts leave (down to MIN) or join the host file (up to MAX): the job restarts on the "
                   "hosts left from the newest in-memory snapshot (a script using hapd.Elastic); see launcher.elastic.")
@click.option("--max-restarts", type=click.IntRange(min=0), default=10, show_default=True,
              help="With --elastic: faults survived before the job gives up.")
@click.option("--snapshot-every", type=int, default=0, show_default=True,
              help="With --elastic: steps between in-memory snapshots (0: chosen so they cost ≤ 5% of the step "
                   "time; negative: none, resume from the script's checkpoint).")
@click.option("--in-place/--restart", "in_place", default=True, show_default=True,
              help="With --elastic, after a lost host: switch the other hosts' ranks to the hosts left in their own "
                   "processes (they keep Python, torch and the model's library loaded), or restart them as new "
                   "processes. A killed rank, a joining host, or ranks that do not park always restart.")
def run_cmd(script: Path, args: tuple[str, ...], hosts: Path | None, nproc: int | None, key_file: Path | None,
            env: tuple[str, ...], timeout: float, master_port: int | None, report: Path | None, job_id: str | None,
            lease: float, ship: bool, cwd: str | None, lost_after: float, quiet: bool, verbose: bool, progress: bool,
            log_dir: Path | None, elastic: str | None, max_restarts: int, snapshot_every: int, in_place: bool) -> None:
    """Run SCRIPT [ARGS] with K ranks on every host, started at one instant, with
    torchrun's environment. Put the script's own options after `--` (options the
    launcher does not know are passed on too).

    Output lines are printed as `[rank N] LINE`, but `{"hapd": ...}` lines, which the
    launcher consumes (echoed with -v): `{"hapd": "timings"}` lines give the one timing
    table at the end (per rank and overall mean ± std, slowest rank, loss; samples/s and
    tokens/s) and the JSON report. A script that trains a `hapd.parallelize` module
    prints them by itself: each rank its steps' times when it exits.
    When a rank fails, every rank on every host is stopped and the exit status is the
    failing rank's; when a daemon is lost, the other hosts' ranks are stopped, the lost
    daemon stops its own when the job's lease expires, and the exit status is 1."""
    env_map = _env_pairs(env)
    if progress:
        env_map.setdefault("HAPD_PROGRESS", "1")
    if log_dir is not None:
        env_map.setdefault("HAPD_LOG_DIR", str(log_dir.absolute()))
    options = JobOptions(script=resolve_script(script), args=args, nproc_per_node=nproc, env=env_map, ship=ship, cwd=cwd,
                         master_port=master_port, key_file=key_file, timeout_s=timeout, job_id=job_id, report=report,
                         stream=not quiet, verbose=verbose, lost_after_s=lost_after, lease_s=lease)
    host_list = _hosts(hosts)
    runner = None
    if elastic is not None:
        low, high = parse_elastic(elastic, len(host_list) if host_list else 1)

        def runner(found: list[Host], opts: JobOptions) -> JobResult:
            spec = ElasticOptions(low, high, max_restarts=max_restarts, snapshot_every=snapshot_every, host_file=hosts,
                                  in_place=in_place)
            return ElasticRun(found, opts, spec, launcher_start=LAUNCHER_START).run()
    _exit(_run(host_list, options, runner))


def _run(hosts: list[Host] | None, options: JobOptions, runner: Any = None) -> JobResult:
    previous = {sig: signal.signal(sig, _on_terminate) for sig in STOPPING_SIGNALS}
    try:
        return run_job(hosts, options, launcher_start=LAUNCHER_START, runner=runner)
    except KeyboardInterrupt:  # before the job started (a job that started returns a result)
        try:
            click.echo("hapd launcher: interrupted", err=True)
        except OSError:  # a closed terminal
            pass
        sys.exit(EXIT_INTERRUPTED)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@main.command("join")
@click.argument("host_line", nargs=-1, required=True)
@click.option("--hosts", "-H", "hosts", type=click.Path(dir_okay=False, exists=True, path_type=Path), required=True,
              help="The host file of the running elastic job.")
def join_cmd(host_line: tuple[str, ...], hosts: Path) -> None:
    """Add a host to a running elastic job: append `HOST slots=N [port=P] [gpu=MODEL]`
    to its host file; the job's launcher pings it and, once it answers with the slots,
    takes it in at the next step boundary."""
    host = append_host(hosts, " ".join(host_line))
    click.echo(f"{host.label} added to {hosts}: the elastic launcher watching it takes it in at the next step boundary")


@main.command("check")
@click.option("--hosts", "-H", "hosts", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Host file.")
@click.option("--nproc-per-node", "-n", "nproc", type=click.IntRange(min=1), default=None,
              help="Ranks per host to check slots for  [default: each host's slots]")
@click.option("--key", "key_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Shared key file  [default: $HAPD_KEY_FILE or $HAPD_HOME/key]")
@click.option("--timeout", type=click.FloatRange(min=0.1), default=5.0, show_default=True)
def check_cmd(hosts: Path, nproc: int | None, key_file: Path | None, timeout: float) -> None:
    """Ping every daemon of a host file (key, protocol version, free slots); start nothing."""
    from hapd.wire.client import Client
    from hapd.wire.keys import default_key_path, load_key

    placements = place(load_hosts(hosts), nproc)
    key = load_key(key_file or default_key_path())
    clients = {p.node_rank: Client(p.host.address, key, timeout) for p in placements}
    try:
        for c in check_daemons(placements, clients, timeout):
            pong = c.pong
            click.echo(f"{c.placement.host.label}: hapd {pong['version']} (protocol {pong['protocol']}) on {pong['host']}, "
                       f"{pong['slots']} free slots, {pong['jobs']} jobs, profile {pong['profile_name']}; "
                       f"{c.rtt_s * 1e3:.1f} ms")
    finally:
        for client in clients.values():
            client.close()


# ----------------------------------------------------------------------------- profile

PROFILE_RANK_MODULE = "hapd.profiler.rank_script"
"""The rank program of ``profile``: its file is shipped to every daemon and run there."""


def profile_rank_program() -> Path | None:
    """The file of :data:`PROFILE_RANK_MODULE`, found without importing it (it imports
    the profiler); None when this hapd has none."""
    import importlib.util

    spec = importlib.util.find_spec(PROFILE_RANK_MODULE)
    return Path(spec.origin) if spec is not None and spec.origin else None


@main.command("profile", context_settings={"ignore_unknown_options": True})
@click.argument("profiler_args", nargs=-1, type=click.UNPROCESSED)
@common_options
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), default=Path("profile.json"),
              show_default=True, help="Profile JSON to write here.")
def profile_cmd(profiler_args: tuple[str, ...], hosts: Path | None, nproc: int | None, key_file: Path | None,
                env: tuple[str, ...], timeout: float, master_port: int | None, report: Path | None, job_id: str | None,
                lease: float, out: Path) -> None:
    """Measure the cluster into a profile: `python -m hapd.profiler PROFILER_ARGS` on K
    ranks of every host through the daemons (e.g. `--quick`, `--sizes 64K,1M`), then
    write the profile rank 0 measured to OUT. With several hosts, every rank's host is
    named as in the host file (HAPD_HOST)."""
    program = profile_rank_program()
    if program is None:
        raise click.ClickException(f"profiling is not available: this hapd has no {PROFILE_RANK_MODULE} module")
    host_list = _hosts(hosts)
    env_map = _env_pairs(env)
    with launcher_dir() as tmp:
        shim = tmp / "hapd_profile_rank.py"
        shim.write_bytes(program.read_bytes())
        options = JobOptions(script=shim, args=profiler_args, nproc_per_node=nproc or (None if host_list else 2),
                             env=env_map, key_file=key_file, timeout_s=timeout, master_port=master_port,
                             job_id=job_id, report=report, host_env=host_list is not None and len(host_list) > 1,
                             lease_s=lease)
        result = _run(host_list, options)
    if result.exit_code != 0:
        _exit(result)
    parts = sorted((p for p in result.other if p.get("hapd") == "profile-part"), key=lambda p: p["index"])
    if not parts or len(parts) != parts[0]["count"]:
        click.echo("hapd launcher: the ranks succeeded but rank 0 sent no (complete) profile", err=True)
        sys.exit(1)
    document = json.loads("".join(p["text"] for p in parts))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, json.dumps(document, indent=1) + "\n")
    click.echo(f"wrote {out}: {len(document.get('devices', []))} device(s)")


if __name__ == "__main__":
    main(prog_name=os.environ.get("HAPD_LAUNCHER_PROG") or None)
