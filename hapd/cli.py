"""``hapd`` command line."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hapd import __version__
from hapd.compiler.options import TECHNIQUE_MARGIN
from hapd.errors import HapdError, OptionsError
from hapd.serve.cache import DEFAULT_MAX_CACHE_BYTES
from hapd.util import private_folder

if TYPE_CHECKING:
    from hapd.compiler.plan import Plan


class _HapdGroup(click.Group):
    """Turns hapd errors, and a file the system refuses (a path that cannot be written,
    a full disk), into one readable line and exit status 2, not a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except HapdError as exc:
            where = "".join(f" [{k} {v}]" for k, v in (("node", exc.node), ("field", exc.field)) if v)
            click.echo(f"hapd: {type(exc).__name__}: {exc}{where}", err=True)
            sys.exit(2)
        except OSError as exc:
            where = f": {exc.filename}" if exc.filename else ""
            click.echo(f"hapd: {type(exc).__name__}: {exc.strerror or exc}{where}", err=True)
            sys.exit(2)


@click.group(cls=_HapdGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hapd")
def main() -> None:
    """Automatic SPMD training for PyTorch on heterogeneous GPU clusters."""


_import_option = click.option(
    "--import", "imports", multiple=True, metavar="MODULE",
    help="Import MODULE first: it registers custom ops the program uses (repeatable).",
)


def _cwd_importable() -> None:
    """Let the user's modules be imported from the current folder, as ``python -m``
    does: ``hapd export mymodels:factory`` in the folder that holds ``mymodels.py``
    needs no ``PYTHONPATH=.`` (the folder goes first on ``sys.path``, once)."""
    cwd = str(Path.cwd())
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def _import(imports: tuple[str, ...]) -> None:
    """Import the modules ``--import`` names (before any program is loaded), from the
    current folder too."""
    if imports:
        from hapd.ir.export import import_modules

        _cwd_importable()
        import_modules(imports)


def _parse_overrides(pairs: tuple[str, ...]) -> dict[str, object]:
    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep:
            raise click.BadParameter(f"{pair!r} is not KEY=VALUE", param_hint="--set")
        for convert in (int, float):
            try:
                out[key] = convert(raw)
                break
            except ValueError:
                continue
        else:
            out[key] = {"true": True, "false": False}.get(raw.lower(), raw)
    return out


@contextlib.contextmanager
def _building(*, with_weights: bool) -> Iterator[None]:
    """Where a benchmark model is built: as usual, or with its parameters on the meta
    device (:func:`hapd.init_on_meta`: shapes only, buffers real)."""
    if with_weights:
        yield
        return
    from hapd.state.weights import init_on_meta

    with init_on_meta():
        yield


@main.command("export")
@click.argument("model")
@click.option("--batch", "-b", type=click.IntRange(min=1), default=8, show_default=True, help="Global batch size.")
@click.option("--size", type=click.Choice(["tiny", "small", "paper"]), default="tiny", show_default=True,
              help="Size preset of a benchmark model.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a benchmark model's config field.")
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Output .pt2 (default MODEL.pt2).")
@click.option("--hapg/--no-hapg", default=True, show_default=True, help="Also write the lowered graph IR beside it.")
@click.option("--weights/--no-weights", default=None,
              help="Build a benchmark model with its weights, or on the meta device (shapes only: the program holds no "
                   "weights, lowers to the same graph and plans the same; runs take weights=)  "
                   "[default: --no-weights for --size paper, else --weights]")
@click.option("--symbolic-batch/--static-batch", "symbolic", default=True, show_default=True,
              help="Export the batch dim symbolic: the one .pt2 gives the graph at every batch a compile prices "
                   "(micro-batches of --pipeline auto, the half batch of --overlap). A model that cannot be exported "
                   "so is exported static, and the command says why.")
def export_cmd(model: str, batch: int, size: str, overrides: tuple[str, ...], out: Path | None, hapg: bool,
               weights: bool | None, symbolic: bool) -> None:
    """Export MODEL to a torch.export program.

    MODEL is a benchmark model name (mlp, vgg19, vit, bert, bert_moe, gpt2_block,
    llama_block) or MODULE:FACTORY, a callable returning (module, example_inputs) that
    may take a ``batch`` keyword. A paper-size benchmark model is built on the meta
    device (its tens of GiB of weights are never allocated) unless --weights is given.
    """
    from hapd.ir.export import call_factory, export, load_factory
    from hapd.ir.summary import format_summary, inspect_graph
    from hapd.ir.lower import lower

    if ":" in model:
        _cwd_importable()
        module, inputs = call_factory(load_factory(model), batch)
        batch_dims = None
        name = type(module).__name__
    else:
        from hapd import models

        try:
            spec = models.get(model)
            with _building(with_weights=size != "paper" if weights is None else weights):
                module, config = models.build(model, size, **_parse_overrides(overrides))
        except (ValueError, TypeError) as exc:  # unknown model or field, a bad override value
            message = str(exc) if isinstance(exc, ValueError) else f"bad --set value for {model}: {exc}"
            raise OptionsError(message) from exc
        inputs = spec.example_inputs(config, batch)
        batch_dims = spec.batch_dims
        name = model
    out = out or Path(f"{name}.pt2")
    out.parent.mkdir(parents=True, exist_ok=True)
    from hapd.ir.shapes import batch_info

    program = export(module, inputs, path=out, batch_dims=batch_dims, name=name, symbolic_batch=symbolic)
    info = batch_info(program)
    if info is not None and info.symbolic:
        click.echo(f"wrote {out} (symbolic batch, example batch {info.size})")
    elif symbolic and info is not None:
        click.echo(f"wrote {out} (static batch {info.size}: not exportable with a symbolic batch: {info.reason})")
    else:
        click.echo(f"wrote {out}")
    if hapg:
        ir = lower(out)
        hapg_path = ir.save(out.with_suffix(".hapg"))
        click.echo(f"wrote {hapg_path}")
        click.echo(format_summary(inspect_graph(ir)))


@main.command("run", add_help_option=False,
              context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("argv", nargs=-1, type=click.UNPROCESSED)
def run_cmd(argv: tuple[str, ...]) -> None:
    """Run a training script on K ranks of every host through the hapd daemons:
    `hapd run SCRIPT -n K [--hosts FILE] [launcher options] [-- ARGS]`.

    SCRIPT is a path relative to the current folder; `worker.py`, `ddp.py` and
    `fsdp.py` are hapd's own when the folder has no such file. Without --hosts the job
    runs on this machine, through its daemon or one started for the job. Every option
    and the exit status are the launcher's (`hapd run --help` lists them):
    `./run_all SCRIPT K` is `hapd run SCRIPT -n K`."""
    import os

    # The launcher is the layer above this CLI (it must not be imported here): it runs
    # as its own program, in this process's place (signals, exit status and output are
    # the launcher's own).
    command = [sys.executable, "-m", "launcher", "run", *argv]
    env = {**os.environ, "HAPD_LAUNCHER_PROG": "hapd"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, command, env)


@main.command("lower")
@click.argument("program", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Output .hapg (default beside it).")
@_import_option
def lower_cmd(program: Path, out: Path | None, imports: tuple[str, ...]) -> None:
    """Lower an exported .pt2 PROGRAM to the graph IR (.hapg)."""
    from hapd.ir.lower import lower

    _import(imports)

    ir = lower(program)
    out = out or program.with_suffix(".hapg")
    out.parent.mkdir(parents=True, exist_ok=True)
    path = ir.save(out)
    click.echo(f"wrote {path}  graph id {ir.graph_id}")


@main.command("inspect")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_import_option
def inspect_cmd(file: Path, imports: tuple[str, ...]) -> None:
    """Print a graph's IR summary: ops by count, parameters, opaque ops. FILE is a
    .pt2 program or a .hapg graph."""
    from hapd.ir.summary import format_summary, inspect_graph

    _import(imports)

    click.echo(format_summary(inspect_graph(file)))


@main.command("compile")
@click.argument("graph", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--profile", "-p", "profile", required=True, help="Cluster profile: a JSON file or a bundled name (paper-8).")
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Output .hplan (default beside GRAPH).")
@click.option("--zero/--no-zero", default=False, show_default=True, help="Allow ZeRO-style parameters.")
@click.option("--overlap/--no-overlap", default=False, show_default=True,
              help="Also price two interleaved duplicas, one computing while the other communicates, on the half-batch "
                   "graph cut from GRAPH (a .pt2 exported with a symbolic batch), the cheaper technique wins; a "
                   "static GRAPH is one duplica's, exported at half the global batch.")
@click.option("--memory-caps/--no-memory-caps", default=True, show_default=True,
              help="Fit the plan in each device's memory (the profile's).")
@click.option("--max-seconds", type=float, default=None, help="Time budget of one search.")
@click.option("--recompute", type=click.Choice(["auto", "never", "always"]), default="auto", show_default=True,
              help="Recompute blocks' activations in the backward pass: when memory binds, never, or every block.")
@click.option("--pipeline", type=click.Choice(["off", "auto"]), default="off", show_default=True,
              help="Also search pipelines: stages on groups of hosts over micro-batches (1F1B), their graphs cut from "
                   "GRAPH (a .pt2 exported with a symbolic batch); the cheaper plan wins.")
@click.option("--micro-graph", "micro_graphs", multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Deprecated (a .pt2 exported with a symbolic batch gives every micro-batch graph): with --pipeline "
                   "auto and a static GRAPH, its model exported at a smaller batch, to price that micro-batch count "
                   "(repeatable).")
@click.option("--global-batch", type=click.IntRange(min=2), default=None,
              help="With --overlap: the global batch the plan trains, checked before compiling: a .pt2 exported with "
                   "a symbolic batch must have been exported at it (the exported batch is the global batch of every "
                   "technique); a static GRAPH, one duplica's, at half of it.")
@click.option("--technique-margin", type=float, default=TECHNIQUE_MARGIN, show_default=True,
              help="How much faster a pipeline or overlap must be predicted than every simpler technique (SPMD, then "
                   "pipeline, then overlap) to be chosen: 0.02 is 2%; in [0, 1).")
@click.option("--precision", type=click.Choice(["fp32", "bf16", "fp16", "auto"]), default="fp32", show_default=True,
              help="What the job trains in: autocast to bf16 or fp16 (fp32 master weights), priced at each device's "
                   "rate in that dtype; auto: bf16 where every device has it, else fp16, fp32 on CPUs.")
@click.option("--reduce-dtype", type=click.Choice(["fp32", "bf16", "fp16"]), default="fp32", show_default=True,
              help="The dtype replicated parameters' gradients are summed over ranks in.")
@click.option("--explain/--no-explain", "show", default=False, help="Print the full report.")
@_import_option
def compile_cmd(graph: Path, profile: str, out: Path | None, zero: bool, overlap: bool, memory_caps: bool,
                max_seconds: float | None, recompute: str, pipeline: str, micro_graphs: tuple[Path, ...],
                global_batch: int | None, technique_margin: float, precision: str, reduce_dtype: str, show: bool,
                imports: tuple[str, ...]) -> None:
    """Synthesize a plan for GRAPH (.pt2 or .hapg) on a cluster PROFILE."""
    from hapd.compiler.driver import compile as compile_plan
    from hapd.compiler.options import CompileOptions
    from hapd.compiler.plan import gap_lines, search_pass_lines, technique_lines
    from hapd.compiler.plan_summary import global_batch as global_batch_of
    from hapd.compiler.plan_summary import plan_line, predicted_seconds, technique_name

    _import(imports)
    if global_batch is not None:
        if not overlap:
            raise OptionsError("--global-batch is for --overlap (a duplica's graph is half the global batch)",
                               field="global_batch")
        _check_global_batch(graph, global_batch, pipeline)

    options = CompileOptions(zero=zero, overlap=overlap, memory_caps=memory_caps, max_seconds=max_seconds,
                             recompute=recompute, pipeline=pipeline, precision=precision, reduce_dtype=reduce_dtype,
                             technique_margin=technique_margin)
    if micro_graphs:
        click.echo("note: --micro-graph is deprecated: export GRAPH with a symbolic batch (hapd export) and every "
                   "micro-batch graph is cut from it", err=True)
    plan = compile_plan(graph, profile, options, micro_graphs=micro_graphs)
    path = plan.save(out or graph.with_suffix(".hplan"))
    base, stats = plan.doc["baselines"], plan.doc["stats"]
    won = predicted_seconds(plan.doc)
    click.echo(
        f"wrote {path}: {won * 1e3:.2f} ms/iteration estimated ({technique_name(plan.technique)}, global batch "
        f"{global_batch_of(plan.doc) or '?'}; speed-up over DP-EV {base['dp_ev'] / won:.2f}×, over DP-CP {base['dp_cp'] / won:.2f}×); "
        f"SPMD search {stats['seconds']:.3f} s in {_count(len(stats.get('passes') or [1]), 'pass', 'passes')}, "
        f"{stats['expanded']} states, {stats['stop_reason']}"
    )
    click.echo(plan_line(plan.doc))
    if len(stats.get("passes") or []) > 1:  # say when and why a search ran again
        for line in search_pass_lines(stats):
            click.echo(line)
    for line in gap_lines(plan.doc.get("dp_gap")):
        click.echo(line)
    for line in _duplica_lines(plan, graph.name):
        click.echo(line)
    for line in technique_lines(plan.doc):
        click.echo(line)
    found = plan.doc.get("pipeline")
    if found:
        click.echo(
            f"pipeline: {len(found['stages'])} stages, {found['micro_batches']} micro-batches of "
            f"{found['micro_batch_size']}, {found['per_iteration'] * 1e3:.2f} ms/iteration predicted, "
            + ("chosen over the SPMD plan" if found["chosen"] else f"not run: the {technique_name(plan.technique)} plan runs")
        )
    if show:
        click.echo(plan.explain())


def _check_global_batch(graph: Path, global_batch: int, pipeline: str) -> None:
    """``--global-batch`` against what GRAPH trains with ``--overlap``: a ``.pt2`` exported
    with a symbolic batch trains its exported batch (every technique cut from it); a
    static graph compiled alone is one duplica's, half the global batch."""
    exported = _exported_batch(graph)
    if exported is not None:
        if exported != global_batch:
            raise OptionsError(f"--overlap: {graph} was exported with a symbolic batch at {exported}, the global batch "
                               f"every technique trains, not {global_batch}: export it at --batch {global_batch}",
                               field="global_batch")
        return
    duplica_batch = _graph_batch(graph)
    if pipeline != "auto" and duplica_batch is not None and 2 * duplica_batch != global_batch:
        raise OptionsError(
            f"--overlap: {graph} was exported at batch {duplica_batch}, but a duplica's graph of global batch "
            f"{global_batch} has batch {global_batch // 2}: export it at --batch {global_batch // 2}"
            + (" (half the global batch)" if global_batch % 2 == 0 else "; the global batch must be even"),
            field="global_batch")


def _exported_batch(graph: Path) -> int | None:
    """The example batch of a ``.pt2`` exported with a symbolic batch (the global batch it
    trains); None for a static program or a ``.hapg``."""
    if graph.suffix != ".pt2":
        return None
    from hapd.ir.lower import load_exported
    from hapd.ir.shapes import batch_info

    info = batch_info(load_exported(graph)[0])
    return info.size if info is not None and info.symbolic and info.size else None


def _duplica_lines(plan: Plan, name: str) -> list[str]:
    """What a compile of one duplica's graph (a static graph with ``--overlap``) trains:
    twice its batch; and that its overlap hides nothing when it does not (the plan was not
    chosen against SPMD: one graph prices no other technique)."""
    from hapd.compiler.plan_summary import format_seconds, global_batch

    if plan.technique != "overlap" or "graphs" in plan.key:
        return []
    batch = global_batch(plan.doc)
    lines = []
    if batch is not None:
        lines.append(f"overlap: {name} is one duplica's graph, of batch {batch // plan.duplicas}: the plan trains global "
                     f"batches of {batch} (two duplicas); a .pt2 exported with a symbolic batch (hapd export) trains "
                     "the batch it was exported at, every technique priced from it")
    shown = plan.estimate.get("overlap") or {}
    if float(shown.get("hidden", 0.0)) <= 0:
        lines.append(f"overlap: the schedule hides no communication under compute "
                     f"({format_seconds(float(shown.get('exposed', 0.0)))} exposed): the SPMD plan of the global batch "
                     "would do the same with one program")
    return lines


def _graph_batch(graph: Path) -> int | None:
    """The batch of GRAPH's inputs (their batch dims' length; None when no input has
    one, or they disagree)."""
    from hapd.ir.summary import inspect_graph

    sizes = {shape[dim] for _name, shape, dim in inspect_graph(graph)["inputs"] if dim is not None}
    return sizes.pop() if len(sizes) == 1 else None


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


@main.command("check")
@click.argument("program", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--rtol", type=click.FloatRange(min=0), default=None, help="Relative tolerance  [default: 1e-5]")
@click.option("--atol", type=click.FloatRange(min=0), default=None, help="Absolute tolerance  [default: 1e-7]")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="A one-device plan to check  [default: compile one]")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the input perturbation and random ops.")
@click.option("--worst", type=click.IntRange(min=1), default=5, show_default=True, help="How many tensors to list.")
@_import_option
def check_cmd(program: Path, rtol: float | None, atol: float | None, plan_path: Path | None, seed: int, worst: int,
              imports: tuple[str, ...]) -> None:
    """Check that hapd computes what PROGRAM (.pt2) computes: one training step of the
    1-rank distributed program against eager program.module() on the program's example
    inputs; the loss, every parameter gradient and the updated buffers must agree.
    Exit status 0 when they do, 1 when a tensor differs or the plan does not fit."""
    from hapd.train.check import DEFAULT_ATOL, DEFAULT_RTOL, check
    from hapd.compiler.plan import Plan
    from hapd.errors import PlanError

    _import(imports)
    plan = Plan.load(plan_path) if plan_path is not None else None
    try:
        report = check(program, rtol=DEFAULT_RTOL if rtol is None else rtol, atol=DEFAULT_ATOL if atol is None else atol,
                       plan=plan, seed=seed)
    except PlanError as exc:
        click.echo(f"hapd check: FAIL: {exc}", err=True)
        sys.exit(1)
    click.echo(report.format(worst))
    if not report.ok:
        names = ", ".join(d.name for d in report.failures[:3])
        click.echo(f"hapd check: FAIL: {names}{' …' if len(report.failures) > 3 else ''}", err=True)
        sys.exit(1)


@main.command("explain")
@click.argument("plan", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--steps", is_flag=True,
              help="After the summary, the details: search passes, pipeline and overlap reports, every rank, and "
                   "every step's layouts and collectives.")
def explain_cmd(plan: Path, steps: bool) -> None:
    """Print a plan for a person: which technique won and by how much the others lost,
    the split, the predicted step time against data parallelism (DP-EV, DP-CP), where
    the time goes, memory, and the terms used (docs/explain.md); with --steps every
    step's layouts and collectives."""
    from hapd.compiler.plan import Plan

    click.echo(Plan.load(plan).explain(steps=steps))


@main.command("serve")
@click.option("--watch", "watch", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Drop folder for .pt2/.hapg files  [default: STATE/watch]")
@click.option("--cache", "cache", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Plan cache folder  [default: STATE/cache]")
@click.option("--profile", "-p", "profile", default="paper-8", show_default=True,
              help="Cluster profile drops are compiled for: a JSON file or a bundled name.")
@click.option("--bind", "bind", default=None, metavar="ADDR",
              help="ZeroMQ endpoint of the control API  [default: tcp://127.0.0.1:5557]; a non-loopback "
                   "address is used only when given here.")
@click.option("--key", "key_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Shared key file, created 0600 if absent  [default: STATE/key]")
@click.option("--state", "home", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="State directory  [default: $HAPD_HOME or ~/.hapd]")
@click.option("--max-cache-bytes", type=click.IntRange(min=1), default=DEFAULT_MAX_CACHE_BYTES, show_default=True,
              help="Plan cache size bound (least recently used entries are evicted).")
@click.option("--max-request-bytes", type=click.IntRange(min=1024), default=256 * 2**20, show_default=True,
              help="Largest request body (compile requests carry whole graphs).")
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE",
              help="A CompileOptions field for drops and requests without options (e.g. zero=true).")
@click.option("--slots", type=click.IntRange(min=0), default=None, help="Rank slots this host offers  [default: CPU count]")
@click.option("--max-connections", type=click.IntRange(min=1), default=None,
              help="Peers connected to the control API at once; more are refused as they connect  [default: 32]")
@click.option("--relp/--no-relp", default=True, show_default=True,
              help="Serve a graph cached for another profile by re-solving only the LP.")
@click.option("--snapshot-mb", type=click.IntRange(min=0), default=None,
              help="MiB of training snapshots (for elastic restarts) held in memory at most  [default: 4096]")
@click.option("--preload/--no-preload", default=True, show_default=True,
              help="Import the compiler and torch at start (~2 s of CPU, ~500 MB), so the first compile does not "
                   "wait for them; --no-preload: on the first compile (a host that only runs ranks or serves "
                   "cached plans).")
@click.option("--standby", type=click.IntRange(min=0, max=256), default=0, show_default=True,
              help="Warm rank processes kept for elastic launches (a host joining a running job, ranks restarting): "
                   "torch, hapd and the --standby-import modules imported ahead, so such a rank starts in a "
                   "fraction of a second instead of importing them (~400 MB each while waiting).")
@click.option("--standby-import", "standby_imports", multiple=True, metavar="MODULE",
              help="A module every standby process imports ahead (the model's library: transformers); MODULE:ATTR "
                   "also reads ATTR from it, which loads a lazily imported library's model module "
                   "(transformers:GPT2LMHeadModel); repeatable.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
@_import_option
def serve_cmd(watch: Path | None, cache: Path | None, profile: str, bind: str | None, key_file: Path | None,
              home: Path | None, max_cache_bytes: int, max_request_bytes: int, options: tuple[str, ...],
              slots: int | None, max_connections: int | None, relp: bool, snapshot_mb: int | None, preload: bool,
              standby: int, standby_imports: tuple[str, ...], log_level: str, imports: tuple[str, ...]) -> None:
    """Run the daemon: compile graphs dropped into the watch folder into plans
    (WATCH/out/NAME.hplan and NAME.report.txt; bad files give WATCH/failed/NAME.error),
    cache plans, and serve the authenticated ZeroMQ control API.

    Drop atomically: write the file into WATCH/.incoming/ (or anywhere on the same
    file system) and rename it into WATCH; a hidden temporary name in WATCH
    (.NAME.pt2.tmp) works too (now and then noticed up to 0.5 s later). Stops cleanly on SIGTERM
    or Ctrl-C.
    """
    import signal
    import threading
    import time

    from hapd.serve.daemon import Daemon, DaemonConfig
    from hapd.wire.keys import default_key_path, home_dir
    from hapd.wire.protocol import DEFAULT_ADDRESS

    if key_file is None:
        key_file = default_key_path() if home is None else home / "key"
    home = home or home_dir()
    _log_daemon(home, log_level)
    config = DaemonConfig.defaults(
        profile=profile, home=home, watch=watch, cache=cache, key_file=key_file,
        bind=bind or DEFAULT_ADDRESS, allow_remote=bind is not None, max_cache_bytes=max_cache_bytes,
        max_body_bytes=max_request_bytes, options=_parse_overrides(options), relp=relp, preload=preload,
        imports=imports, standby=standby, standby_imports=standby_imports,
        **_daemon_extra(slots, max_connections, snapshot_mb),
    )
    stop = threading.Event()
    first_signal: list[float] = []

    def on_signal(signum: int, _frame: object) -> None:
        # A second signal a second or more after the first: stop now. Closer ones are the
        # same request: the kernel repeats a parent-death signal as each thread of the
        # dying launcher exits.
        if stop.is_set() and first_signal and time.monotonic() - first_signal[0] >= 1.0:
            raise KeyboardInterrupt
        if not stop.is_set():
            first_signal.append(time.monotonic())
            logging.getLogger("hapd.daemon").info("%s: stopping", signal.Signals(signum).name)
            stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    Daemon(config, stop=stop).run()


def _log_daemon(home: Path, log_level: str) -> None:
    """hapd's log records at ``log_level`` and above to stderr and HOME/logs/daemon.log (the owner's alone)."""
    private_folder(home)
    (home / "logs").mkdir(mode=0o700, exist_ok=True)
    log_path = home / "logs" / "daemon.log"
    os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600))  # the owner's alone, whatever the umask
    os.chmod(log_path, 0o600)
    fmt = logging.Formatter("%(asctime)s hapd[%(process)d] %(levelname)s %(message)s")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr), logging.FileHandler(log_path)]
    root = logging.getLogger("hapd")
    root.setLevel(log_level.upper())
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.propagate = False


def _daemon_extra(slots: int | None, max_connections: int | None, snapshot_mb: int | None) -> dict[str, object]:
    """The :class:`~hapd.serve.daemon.DaemonConfig` fields the command line gives (the others: defaults)."""
    extra: dict[str, object] = {"slots": slots} if slots is not None else {}
    if max_connections is not None:
        extra["max_connections"] = max_connections
    if snapshot_mb is not None:
        extra["snapshot_max_bytes"] = snapshot_mb * 2**20
    return extra


@main.command("ping")
@click.argument("address", required=False)
@click.option("--key", "key_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Shared key file  [default: $HAPD_KEY_FILE or STATE/key]")
@click.option("--timeout", type=float, default=5.0, show_default=True, help="Seconds to wait for the reply.")
def ping_cmd(address: str | None, key_file: Path | None, timeout: float) -> None:
    """Ask the daemon at ADDRESS (default $HAPD_DAEMON or tcp://127.0.0.1:5557) who it is."""
    import time

    from hapd.wire.client import Client

    with Client(address, key_file, timeout) as client:
        start = time.perf_counter()
        pong = client.ping()
        ms = (time.perf_counter() - start) * 1e3
    click.echo(
        f"{client.address}: hapd {pong['version']} (protocol {pong['protocol']}) on {pong['host']}, "
        f"profile {pong['profile_name']} ({pong['profile_id'][:12]}…), {pong['slots']} free slots, "
        f"{pong['jobs']} jobs; {ms:.1f} ms"
    )


@main.command("profile")
@click.option("--nproc-per-node", "nproc", type=click.IntRange(min=1), default=None,
              help="Local ranks to measure  [default: one per GPU, else 2]")
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), default=Path("profile.json"),
              show_default=True, help="Profile JSON to write.")
@click.option("--quick", is_flag=True, help="Fewer sizes, repeats and shorter samples (~10 s on 2 CPU ranks; "
              "for smoke tests).")
@click.option("--sizes", default=None, metavar="LIST",
              help="Full-tensor bytes of the timed collectives, e.g. 4K,64K,1M,16M  [default: 4K … 16M, ×4]")
@click.option("--repeats", type=click.IntRange(min=1), default=None, help="Fewest timed repeats per collective and size.")
@click.option("--name", default="", help="Profile name  [default: measured-HOST]")
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default="float32", show_default=True)
@click.option("--host", default=None, help="Name of this host in the profile  [default: $HAPD_HOST or the host name]")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True,
              help="Hosts in the job; each runs `hapd profile` with its own --node-rank.")
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True, help="This host's index.")
@click.option("--master-addr", default=None, help="Address of node 0 (needed with --nnodes > 1).")
@click.option("--master-port", type=click.IntRange(min=1, max=65535), default=29500, show_default=True)
def profile_cmd(nproc: int | None, out: Path, quick: bool, sizes: str | None, repeats: int | None, name: str,
                dtype: str, host: str | None, nnodes: int, node_rank: int, master_addr: str | None,
                master_port: int) -> None:
    """Measure this machine into a cluster profile: each of K local ranks measures its
    device's FLOP/s and memory, then all time every collective over several sizes and
    fit latency (s) and bandwidth (bytes of the full tensor per second). Rank 0 (on
    node 0) writes OUT.

    Runs ``python -m hapd.profiler`` under torchrun. Several hosts: run this on each
    with --nnodes/--node-rank/--master-addr (and GLOO_SOCKET_IFNAME set to the interface
    between them), or ``./run_all --profile`` through the daemons; see profiles/README.md.
    """
    from hapd.profiler.driver import ProfilerOptions, Rendezvous, default_nproc, launch_local, parse_sizes

    given: dict[str, object] = {"dtype": dtype, "name": name}
    if sizes is not None:
        given["sizes"] = parse_sizes(sizes)
    if repeats is not None:
        given["repeats"] = repeats
    ProfilerOptions.quick(**given) if quick else ProfilerOptions(**given)  # bad options fail here, not in K ranks
    args = ["--out", str(out), "--dtype", dtype, *(["--name", name] if name else []), *(["--quick"] if quick else []),
            *(["--sizes", sizes] if sizes is not None else []), *(["--repeats", str(repeats)] if repeats else [])]
    rendezvous = Rendezvous(nnodes=nnodes, node_rank=node_rank, master_addr=master_addr, master_port=master_port)
    code = launch_local(nproc or default_nproc(), args, rendezvous=rendezvous, host=host)
    if code != 0:
        click.echo(f"hapd: profiling failed: the ranks exited with status {code}", err=True)
        sys.exit(code)


if __name__ == "__main__":
    main()
