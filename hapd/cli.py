"""``hapd`` command line."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hapd import __version__
from hapd.errors import HapdError, OptionsError


class _Group(click.Group):
    """Turns hapd errors into one readable line and exit status 2, not a traceback."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except HapdError as exc:
            where = "".join(f" [{k} {v}]" for k, v in (("node", exc.node), ("field", exc.field)) if v)
            click.echo(f"hapd: {type(exc).__name__}: {exc}{where}", err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hapd")
def main() -> None:
    """Automatic SPMD training for PyTorch on heterogeneous GPU clusters."""


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


@main.command("export")
@click.argument("model")
@click.option("--batch", "-b", type=click.IntRange(min=1), default=8, show_default=True, help="Global batch size.")
@click.option("--size", type=click.Choice(["tiny", "paper"]), default="tiny", show_default=True,
              help="Size preset of a benchmark model.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a benchmark model's config field.")
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Output .pt2 (default MODEL.pt2).")
@click.option("--hapg/--no-hapg", default=True, show_default=True, help="Also write the lowered graph IR beside it.")
def export_cmd(model: str, batch: int, size: str, overrides: tuple[str, ...], out: Path | None, hapg: bool) -> None:
    """Export MODEL to a torch.export program.

    MODEL is a benchmark model name (mlp, vgg19, vit, bert, bert_moe, gpt2_block,
    llama_block) or MODULE:FACTORY, a callable returning (module, example_inputs) that
    may take a ``batch`` keyword.
    """
    from hapd.frontend import call_factory, export, load_factory
    from hapd.inspect import format_summary, inspect_graph
    from hapd.ir import lower

    if ":" in model:
        module, inputs = call_factory(load_factory(model), batch)
        batch_dims = None
        name = type(module).__name__
    else:
        from hapd import models

        try:
            spec = models.get(model)
            module, config = models.build(model, size, **_parse_overrides(overrides))
        except (ValueError, TypeError) as exc:  # unknown model or field, a bad override value
            message = str(exc) if isinstance(exc, ValueError) else f"bad --set value for {model}: {exc}"
            raise OptionsError(message) from exc
        inputs = spec.example_inputs(config, batch)
        batch_dims = spec.batch_dims
        name = model
    out = out or Path(f"{name}.pt2")
    out.parent.mkdir(parents=True, exist_ok=True)
    export(module, inputs, path=out, batch_dims=batch_dims, name=name)
    click.echo(f"wrote {out}")
    if hapg:
        ir = lower(out)
        hapg_path = ir.save(out.with_suffix(".hapg"))
        click.echo(f"wrote {hapg_path}")
        click.echo(format_summary(inspect_graph(ir)))


@main.command("lower")
@click.argument("program", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Output .hapg (default beside it).")
def lower_cmd(program: Path, out: Path | None) -> None:
    """Lower an exported .pt2 PROGRAM to the graph IR (.hapg)."""
    from hapd.ir import lower

    ir = lower(program)
    out = out or program.with_suffix(".hapg")
    out.parent.mkdir(parents=True, exist_ok=True)
    path = ir.save(out)
    click.echo(f"wrote {path}  graph id {ir.graph_id}")


@main.command("inspect")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def inspect_cmd(file: Path) -> None:
    """Print a graph's IR summary: ops by count, parameters, opaque ops. FILE is a
    .pt2 program or a .hapg graph."""
    from hapd.inspect import format_summary, inspect_graph

    click.echo(format_summary(inspect_graph(file)))


@main.command("compile")
@click.argument("graph", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--profile", "-p", "profile", required=True, help="Cluster profile: a JSON file or a bundled name (paper-8).")
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), help="Output .hplan (default beside GRAPH).")
@click.option("--zero/--no-zero", default=False, show_default=True, help="Allow ZeRO-style parameters.")
@click.option("--max-seconds", type=float, default=None, help="Time budget of one search.")
@click.option("--explain/--no-explain", "show", default=False, help="Print the full report.")
def compile_cmd(graph: Path, profile: str, out: Path | None, zero: bool, max_seconds: float | None, show: bool) -> None:
    """Synthesize a plan for GRAPH (.pt2 or .hapg) on a cluster PROFILE."""
    from hapd.compiler import CompileOptions, compile as compile_plan

    plan = compile_plan(graph, profile, CompileOptions(zero=zero, max_seconds=max_seconds))
    path = plan.save(out or graph.with_suffix(".hplan"))
    est, base, stats = plan.estimate, plan.doc["baselines"], plan.doc["stats"]
    click.echo(
        f"wrote {path}: {est['per_iteration'] * 1e3:.2f} ms/iteration estimated "
        f"(DP-EV {base['dp_ev'] / est['per_iteration']:.2f}×, DP-CP {base['dp_cp'] / est['per_iteration']:.2f}× slower); "
        f"synthesis {stats['synthesis_seconds']:.3f} s, {stats['expanded']} states, {stats['stop_reason']}"
    )
    if show:
        click.echo(plan.explain())


@main.command("explain")
@click.argument("plan", type=click.Path(exists=True, dir_okay=False, path_type=Path))
def explain_cmd(plan: Path) -> None:
    """Print a plan for a person: estimate, ratios, every step's layouts and collectives."""
    from hapd.plan import Plan

    click.echo(Plan.load(plan).explain())


if __name__ == "__main__":
    main()
