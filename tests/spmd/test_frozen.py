"""Frozen stays frozen: a parameter with ``requires_grad=False`` never trains.

``torch.export.save`` keeps a parameter's values but not its ``requires_grad``: loaded
back, every parameter trains. :func:`hapd.export` records the frozen parameters beside
the program in the ``.pt2`` and hapd's loader freezes them again, so the flag survives
export (in memory and in a file), lowering (the IR's ``requires_grad``, which the core
prices: no gradient, optimizer state or gradient sum for a frozen parameter), the plan,
and every rank whatever piece it holds. The model here is the benchmark BERT (tiny) with
its embedding and its first layer frozen, on 2 uneven Gloo ranks (0.7 : 0.3) under a
searched plan and a forced tensor-parallel one, through :func:`hapd.distribute` from the
``.pt2`` and through :func:`hapd.parallelize`: after 5 Adam steps the frozen parameters
are bit-identical to their initial values on every rank, the others and the loss equal
the single-device run (relative 1e-5), and the optimizer holds no state for a frozen
parameter; the same on 2 one-rank pipeline stages cut after the frozen layer (the first
stage trains nothing). The last test runs it through ``hapd export`` → file →
``./run_all``.
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _exact import tensor_error
from click.testing import CliRunner
from torch import Tensor, nn

import hapd
from hapd import models
from hapd.cli import main as cli_main
from hapd.ir.lower import EXTRA_FILE, FROZEN_KEY, load_exported
from hapd.compiler.options import CompileOptions
from hapd.errors import GraphFormatError
from hapd.profile.schema import estimated_profile

ROOT = Path(__file__).resolve().parents[2]
BATCH = 8
RATIOS = (0.7, 0.3)
STEPS = 5
LR = 1e-3
TOL = 1e-5
"""Relative tolerance against the single-device run (as ``_exact.TOL``)."""
FLOOR = 1e-6
"""The least denominator of a parameter's relative error (:func:`_exact.tensor_error`)."""
FROZEN_MODULES = ("embed", "layers.0")
"""The frozen parts of the model: its embedding and its whole first layer."""
PLANS = ("searched", "forced")
CLIP = 1e6
"""The norm gradients are clipped by: above any gradient's, so clipping changes nothing
and the norm it returns is compared."""


def frozen_bert(batch: int = BATCH) -> tuple[nn.Module, tuple[Tensor, ...]]:
    """The benchmark BERT (tiny, no dropout) under seed 0 with :data:`FROZEN_MODULES`
    frozen, and a batch (a ``hapd export MODULE:FACTORY`` factory)."""
    torch.manual_seed(0)
    model, config = models.build("bert", "tiny", dropout=0.0, attention_dropout=0.0)
    for name in FROZEN_MODULES:
        model.get_submodule(name).requires_grad_(False)
    return model, models.get("bert").example_inputs(config, batch)


def frozen_names(model: nn.Module) -> set[str]:
    """Every name of every parameter of ``model`` that does not train."""
    return {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}


def _flags(named: Any) -> dict[str, bool]:
    """``requires_grad`` by name, from ``named_parameters()``."""
    return {n: p.requires_grad for n, p in named}


# --------------------------------------------------------------------------------------
# Export, save, load, lower, plan
# --------------------------------------------------------------------------------------


def test_requires_grad_survives_export_save_and_load(tmp_path):
    """In memory, normalized, saved and loaded by hapd, lowered: every parameter's
    ``requires_grad`` is the model's, and the graph id the same in memory and from the file."""
    model, inputs = frozen_bert()
    flags = _flags(model.named_parameters())
    assert 0 < sum(not f for f in flags.values()) < len(flags)
    program = hapd.export(model, inputs, path=tmp_path / "bert.pt2")
    assert {n: p.requires_grad for n, p in program.state_dict.items() if n in flags} == flags  # in memory
    assert _flags(hapd.normalize(program).module().named_parameters()) == flags

    loaded, stored = load_exported(tmp_path / "bert.pt2")
    assert stored[FROZEN_KEY] == sorted(frozen_names(model))
    assert {n: loaded.state_dict[n].requires_grad for n in flags} == flags
    assert _flags(loaded.module().named_parameters()) == flags

    ir = hapd.lower(tmp_path / "bert.pt2")
    assert {n["target"]: n["requires_grad"] for n in ir.doc["nodes"] if n["kind"] == "parameter"} == flags
    assert ir.graph_id == hapd.lower(program, name=stored["name"]).graph_id  # one graph, in memory or from a file


def _torch_load(path: Path) -> Any:
    """``torch.export.load`` alone (it warns that it reads weights from a read-only buffer)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.export.load(path)


def test_a_program_loaded_by_torch_export_load_keeps_its_frozen_parameters(tmp_path):
    """A ``.pt2`` hapd wrote, loaded with ``torch.export.load`` (not hapd's loader: every
    parameter comes back trainable): lowering and distributing it freeze what the model
    froze, from the record the program carries in itself, so the frozen ones get no
    gradient and the graph is the one compiled from the file."""
    model, inputs = frozen_bert()
    flags = _flags(model.named_parameters())
    hapd.export(model, inputs, path=tmp_path / "bert.pt2")
    loaded = _torch_load(tmp_path / "bert.pt2")
    ir = hapd.lower(loaded, name="BERT")
    assert {n["target"]: n["requires_grad"] for n in ir.doc["nodes"] if n["kind"] == "parameter"} == flags
    assert ir.graph_id == hapd.lower(tmp_path / "bert.pt2", name="BERT").graph_id
    module = hapd.distribute(_torch_load(tmp_path / "bert.pt2"), hapd.compile(ir, estimated_profile(1)),
                             0, world=1)
    module(*inputs).backward()
    grads = {n for n, p in module.named_parameters(remove_duplicate=False) if p.grad is not None}
    assert grads and not grads & frozen_names(model), sorted(grads & frozen_names(model))


def test_a_bad_frozen_record_is_a_format_error(tmp_path):
    """A record naming a parameter the program lacks, or not a list: the file is bad."""
    model, inputs = frozen_bert()
    program = hapd.export(model, inputs)
    for record, message in ((["embed.weight", "nope.weight"], "names frozen parameters the program does not have: "
                                                              "nope.weight"),
                            ("embed.weight", "is not a list of parameter names")):
        path = tmp_path / "bad.pt2"
        torch.export.save(program, path, extra_files={EXTRA_FILE: json.dumps({FROZEN_KEY: record})})
        with pytest.raises(GraphFormatError, match=message):
            load_exported(path)


def test_the_plan_prices_no_gradient_for_frozen_parameters():
    """Data parallel on 2 devices: a frozen parameter gets no gradient sum, and the
    memory model counts gradients and Adam's two states for the trainable ones only."""
    model, inputs = frozen_bert()
    frozen = frozen_names(model)
    plan = hapd.compile(hapd.lower(hapd.export(model, inputs), name="bert"), estimated_profile(2),
                        CompileOptions(ratios=RATIOS, mode="data_parallel"))
    sources = [s for step in plan.program["steps"] for s in step.get("sources", ()) if s["kind"] == "parameter"]
    assert {s["target"] for s in sources} == {n for n, _ in model.named_parameters()}
    assert {s["target"] for s in sources if s["grad_sync"]} == {n for n, _ in model.named_parameters()} - frozen
    trainable = 4.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    held = float(sum(t.numel() * t.element_size() for t in model.state_dict().values()))  # buffers too
    parts = plan.program["memory_parts"]
    assert parts["parameters"]["constant"] == [held] * 2
    assert parts["gradients"]["constant"] == [trainable] * 2
    assert parts["optimizer"]["constant"] == [2 * trainable] * 2


# --------------------------------------------------------------------------------------
# The single-device run and the plans
# --------------------------------------------------------------------------------------


NOISE = 1e-6
"""A gradient below this fraction of the model's largest is zero in exact arithmetic
(the key bias: softmax does not see a shift of every score by the same amount) and
rounding noise in any run; Adam normalizes it into steps of up to the learning rate,
so such a parameter's values after the steps are noise too and are not compared (the
loss after the steps is)."""


def reference_run(model: nn.Module, inputs: tuple[Tensor, ...]) -> dict[str, Any]:
    """A copy of ``model`` trained :data:`STEPS` Adam steps: the loss before each step
    and after the last, every parameter before and after, the frozen parameters and
    those whose gradient is rounding noise (:data:`NOISE`)."""
    single = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in single.named_parameters(remove_duplicate=False)}
    optimizer = torch.optim.Adam(single.parameters(), lr=LR)
    losses: list[float] = []
    norms: list[float] = []
    noise: list[str] = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        loss = single(*inputs)
        losses.append(float(loss.detach()))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(single.parameters(), CLIP)))  # a no-op: below CLIP
        if not noise:
            grads = {n: float(p.grad.abs().max()) for n, p in single.named_parameters() if p.grad is not None}
            noise = sorted(n for n, g in grads.items() if g < NOISE * max(grads.values()))
        optimizer.step()
    with torch.no_grad():
        losses.append(float(single(*inputs)))
    final = {n: p.detach().clone() for n, p in single.named_parameters(remove_duplicate=False)}
    return {"inputs": inputs, "losses": losses, "initial": initial, "final": final,
            "frozen": sorted(frozen_names(model)), "noise": noise, "norms": norms}


def tensor_parallel(doc: dict[str, Any]) -> dict[str, str]:
    """Linears column- and row-parallel in turn, attention head-parallel, the (frozen)
    embedding vocab-parallel: frozen weights split like trainable ones."""
    nodes = doc["nodes"]
    linear = [n["name"] for n in nodes if n.get("op") == "aten.linear"]
    force = {name: ("column-parallel", "row-parallel")[i % 2] for i, name in enumerate(linear)}
    force |= {n["name"]: "head-parallel" for n in nodes if n.get("op") == "aten.scaled_dot_product_attention"}
    force |= {n["name"]: "vocab-parallel" for n in nodes if n.get("op") == "aten.embedding"}
    return force


def compile_plans(pt2: Path) -> dict[str, bytes]:
    """The searched and the forced tensor-parallel plan for the program in ``pt2`` on
    2 uneven devices."""
    ir = hapd.lower(pt2)
    profile = estimated_profile(2, flops=[2e10, 1e10])
    return {plan: hapd.compile(ir, profile, CompileOptions(ratios=RATIOS, force=tensor_parallel(ir.doc) if
                                                           plan == "forced" else {})).to_bytes() for plan in PLANS}


# --------------------------------------------------------------------------------------
# A rank
# --------------------------------------------------------------------------------------


def train(module: Any, inputs: tuple[Tensor, ...], norms: list[float] | None = None) -> tuple[torch.optim.Adam,
                                                                                               list[float]]:
    """:data:`STEPS` Adam steps of a rank module or ParallelModule; the global loss
    before each step and after the last. With ``norms`` (a ParallelModule) each step
    clips the gradients by :data:`CLIP` and appends the total norm to ``norms``."""
    from hapd.spmd.rewrite import global_loss

    optimizer = torch.optim.Adam(module.parameters(), lr=LR)
    local_inputs = module.shard_inputs(*inputs)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        local = module(*local_inputs)
        losses.append(global_loss(local))
        local.backward()
        if norms is not None:
            norms.append(float(module.clip_grad_norm_(CLIP)))
        optimizer.step()
    with torch.no_grad():
        losses.append(global_loss(module(*local_inputs)))
    return optimizer, losses


def rank_report(rank_module: Any, optimizer: torch.optim.Optimizer, losses: list[float], ref: dict[str, Any],
                initial: dict[str, Tensor]) -> dict[str, Any]:
    """What one rank's run shows about its frozen and trainable parameters against the
    single-device run ``ref`` (``initial``: this rank's pieces before training)."""
    named = dict(rank_module.named_parameters(remove_duplicate=False))
    frozen = set(ref["frozen"]) & set(named)  # a pipeline stage holds some parameters only
    synced = {id(p) for bucket in rank_module.hapd_sync.buckets for p in bucket}
    stateful = {id(p) for p in optimizer.state}
    trainable_errors = {}
    for fqn, (tensor, layout) in rank_module.hapd_params.items():
        if fqn not in frozen and fqn not in ref["noise"]:
            expected = rank_module.hapd_view.local_value(tensor, layout, ref["final"][fqn])
            trainable_errors[fqn] = tensor_error(named[fqn].detach(), expected, FLOOR)
    return {
        "wrong_flags": sorted(n for n, p in named.items() if p.requires_grad == (n in frozen)),
        "frozen_changed": sorted(n for n in frozen if not torch.equal(named[n].detach(), initial[n])),
        "frozen_initial_wrong": sorted(n for n in frozen if not torch.equal(
            initial[n], rank_module.hapd_view.local_value(*rank_module.hapd_params[n], ref["initial"][n]))),
        "frozen_with_grad": sorted(n for n in frozen if named[n].grad is not None),
        "frozen_synced": sorted(n for n in frozen if id(named[n]) in synced),
        "frozen_with_state": sorted(n for n in frozen if id(named[n]) in stateful),
        "trainable_with_state": sum(id(named[n]) in stateful for n in named if n not in frozen),
        "trainable": sum(n not in frozen for n in named),
        "trainable_error": max(trainable_errors.values(), default=0.0),
        "worst_trainable": max(trainable_errors, key=trainable_errors.get, default=None),
        "loss_error": max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"])),
        "frozen_layouts": sorted({rank_module.hapd_params[n][1] for n in frozen}),
    }


def distributed_run(rank: int, pt2: str, plan: bytes, ref: dict[str, Any]) -> dict[str, Any]:
    """``hapd.distribute`` of the ``.pt2`` file, trained; :func:`rank_report`."""
    module = hapd.distribute(pt2, hapd.Plan.from_bytes(plan), rank)
    initial = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
    optimizer, losses = train(module, ref["inputs"])
    return rank_report(module, optimizer, losses, ref, initial)


def parallelized_run(rank: int, plan: bytes, ref: dict[str, Any], folder: str | None) -> dict[str, Any]:
    """``hapd.parallelize`` of the model, trained with clipping; :func:`rank_report`,
    plus its full state dict and, with ``folder``, a checkpoint saved there and loaded
    into a fresh module."""
    model, _ = frozen_bert()
    module = hapd.parallelize(model, ref["inputs"], plan=plan, use_daemon=False, verbose=False)
    out: dict[str, Any] = {"parameters_flags": _flags(module.inner.named_parameters()) ==
                           {n: n not in ref["frozen"] for n, _ in module.inner.named_parameters()}}
    initial = {n: p.detach().clone() for n, p in module.inner.named_parameters(remove_duplicate=False)}
    norms: list[float] = []
    optimizer, losses = train(module, ref["inputs"], norms)
    out.update(rank_report(module.inner, optimizer, losses, ref, initial))
    out["norm_error"] = max(abs(a - b) / b for a, b in zip(norms, ref["norms"]))
    full = module.full_state_dict()
    out["full_frozen_changed"] = sorted(n for n in ref["frozen"] if not torch.equal(full[n], ref["initial"][n]))
    out["full_trainable_error"] = max(tensor_error(full[n], ref["final"][n], FLOOR) for n in ref["final"]
                                      if n not in ref["frozen"] and n not in ref["noise"])
    module.load_full_state_dict(full)
    out["flags_after_load_full"] = sorted(n for n, p in module.inner.named_parameters()
                                          if p.requires_grad == (n in ref["frozen"]))

    if folder is None:
        return out
    hapd.save_checkpoint(Path(folder) / "ck", module, optimizer, step=STEPS)
    fresh_model, _ = frozen_bert()
    fresh = hapd.parallelize(fresh_model, ref["inputs"], plan=plan, use_daemon=False, verbose=False)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=LR)
    hapd.load_checkpoint(Path(folder) / "ck", fresh, fresh_optimizer)
    named = dict(fresh.inner.named_parameters())
    out["checkpoint_wrong_flags"] = sorted(n for n, p in named.items() if p.requires_grad == (n in ref["frozen"]))
    out["checkpoint_frozen_with_state"] = sorted(n for n in ref["frozen"] if named[n] in fresh_optimizer.state)
    out["checkpoint_state_error"] = max(tensor_error(v, full[k], FLOOR) for k, v in fresh.full_state_dict().items())
    return out


def pipeline_run(rank: int, ref: dict[str, Any]) -> dict[str, Any]:
    """The model cut after its frozen first layer into 2 pipeline stages of one rank
    each, 2 micro-batches, trained; :func:`rank_report` of this rank's stage (the first
    stage trains nothing: it runs no backward)."""
    import torch.distributed as dist

    from hapd.compiler.pipeline.stages import split_program
    from hapd.spmd.pipeline import PipelineRank

    model, _ = frozen_bert()
    micro = tuple(t.narrow(0, 0, BATCH // 2) for t in ref["inputs"])
    program = hapd.export(model, micro)
    cut = [n["name"] for n in hapd.lower(program).doc["nodes"] if n.get("block") == FROZEN_MODULES[1]][-1]
    stages, boundaries = split_program(program, [cut])
    plans = [hapd.compile(hapd.lower(st.program, name=f"frozen-{st.index}"), estimated_profile(1), CompileOptions())
             for st in stages]
    pipe = PipelineRank(stages, boundaries, plans, [[0], [1]], 2, models.get("bert").batch_dims)
    initial = {n: p.detach().clone() for n, p in pipe.module.named_parameters(remove_duplicate=False)}
    optimizer = torch.optim.Adam(pipe.parameters(), lr=LR)
    losses = []
    for step in range(STEPS + 1):
        optimizer.zero_grad(set_to_none=True)
        total = pipe.step(*ref["inputs"]).detach().double()
        dist.all_reduce(total)
        losses.append(float(total))
        if step < STEPS:
            optimizer.step()
    return {"stage": pipe.s, **rank_report(pipe.module, optimizer, losses, ref, initial)}


def _ranks(rank: int, world: int, pt2: str, plans: dict[str, bytes], ref: dict[str, Any],
           folder: str) -> dict[str, Any]:
    """Every run on this rank: each plan through ``distribute`` and ``parallelize`` (the
    checkpoint with the forced plan), and the pipeline."""
    torch.manual_seed(0)
    out: dict[str, Any] = {plan: {"distribute": distributed_run(rank, pt2, data, ref),
                                  "parallelize": parallelized_run(rank, data, ref, folder if plan == "forced"
                                                                  else None)}
                           for plan, data in plans.items()}
    out["pipeline"] = pipeline_run(rank, ref)
    return out


def assert_frozen_stay_frozen(report: dict[str, Any], where: str, *, trains: bool = True) -> None:
    """One rank's :func:`rank_report` shows frozen parameters untouched and the rest
    (some, with ``trains``) equal to the single-device run."""
    untouched = ("wrong_flags", "frozen_changed", "frozen_initial_wrong", "frozen_with_grad", "frozen_synced",
                 "frozen_with_state")
    assert {k: report[k] for k in untouched} == {k: [] for k in untouched}, where
    assert report["trainable_with_state"] == report["trainable"] and (report["trainable"] > 0) == trains, where
    assert report["trainable_error"] <= TOL and report["loss_error"] <= TOL, (where, report["worst_trainable"], report["trainable_error"], report["loss_error"])


# --------------------------------------------------------------------------------------
# Through hapd.distribute and hapd.parallelize on Gloo ranks
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    """Every rank's reports (``results``), the rules the forced plan ran (``ran``) and
    those forced on it (``forced``), the parameters whose gradient is noise (``noise``)."""
    folder = tmp_path_factory.mktemp("frozen")
    model, inputs = frozen_bert()
    hapd.export(model, inputs, path=folder / "bert.pt2")
    plans = compile_plans(folder / "bert.pt2")
    ref = reference_run(model, inputs)
    results = run_ranks(2, _ranks, str(folder / "bert.pt2"), plans, ref, str(folder), timeout=300)
    ran = {s["node"]: s["rule"] for s in hapd.Plan.from_bytes(plans["forced"]).program["steps"]}
    forced = tensor_parallel(hapd.lower(folder / "bert.pt2").doc)
    return {"results": results, "ran": {node: ran.get(node, "") for node in forced}, "forced": forced,
            "noise": ref["noise"]}


@pytest.mark.distributed
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("api", ["distribute", "parallelize"])
def test_frozen_parameters_stay_frozen_on_every_rank(runs, plan, api):
    for rank, result in enumerate(runs["results"]):
        assert_frozen_stay_frozen(result[plan][api], f"{api}/{plan} rank {rank}")


@pytest.mark.distributed
def test_a_frozen_pipeline_stage_runs_no_backward(runs):
    """Stage 0 (the embedding and the first layer) has nothing to train; stage 1 trains."""
    reports = {r["pipeline"]["stage"]: r["pipeline"] for r in runs["results"]}
    assert sorted(reports) == [0, 1]
    assert_frozen_stay_frozen(reports[0], "pipeline stage 0", trains=False)
    assert_frozen_stay_frozen(reports[1], "pipeline stage 1")


@pytest.mark.distributed
def test_only_the_key_bias_is_left_uncompared(runs):
    assert runs["noise"] == ["layers.1.attn.k.bias"]  # layers.0's is frozen


@pytest.mark.distributed
def test_the_forced_plan_splits_frozen_parameters(runs):
    assert runs["ran"] == runs["forced"]
    for result in runs["results"]:
        layouts = set(result["forced"]["distribute"]["frozen_layouts"])
        assert {"Gather(0)", "Gather(1)"} <= layouts, layouts


@pytest.mark.distributed
def test_parallel_module_state_and_checkpoints_keep_frozen_parameters(runs):
    """``parameters()`` carry the flags, clipping sums the trainable gradients only, the
    full state dict holds the frozen values as they were, loading it or a checkpoint
    (into a fresh module and optimizer) freezes nothing more and thaws nothing."""
    for rank, by_plan in enumerate(runs["results"]):
        for plan in PLANS:
            found = by_plan[plan]["parallelize"]
            where = f"{plan} rank {rank}"
            assert found["parameters_flags"], where
            assert found["norm_error"] <= TOL, (where, found["norm_error"])  # the norm of trainable gradients
            assert found["full_frozen_changed"] == [] and found["full_trainable_error"] <= TOL, (where, found)
            assert found["flags_after_load_full"] == [], where
        found = by_plan["forced"]["parallelize"]  # the checkpoint: frozen pieces split too
        assert found["checkpoint_wrong_flags"] == [] and found["checkpoint_frozen_with_state"] == [], rank
        assert found["checkpoint_state_error"] == 0.0, rank


# --------------------------------------------------------------------------------------
# hapd export -> file -> ./run_all
# --------------------------------------------------------------------------------------

RANK_SCRIPT = """\
import sys
sys.path[:0] = {paths!r}
from test_frozen import run_all_rank
run_all_rank(sys.argv[1])
"""


def run_all_rank(folder: str) -> None:
    """A rank of ``./run_all``: join the job, distribute the ``.pt2`` under each plan in
    ``folder``, train, and write :func:`rank_report` for each to ``rank{R}.json``."""
    from hapd.spmd.distributed import init_distributed

    env = init_distributed()
    torch.set_num_threads(1)
    ref = torch.load(Path(folder) / "reference.pt")
    reports = {}
    for plan in PLANS:
        module = hapd.distribute(Path(folder) / "model.pt2", Path(folder) / f"{plan}.hplan")
        initial = {n: p.detach().clone() for n, p in module.named_parameters(remove_duplicate=False)}
        optimizer, losses = train(module, ref["inputs"])
        reports[plan] = rank_report(module, optimizer, losses, ref, initial)
    (Path(folder) / f"rank{env.rank}.json").write_text(json.dumps(reports))
    print(f"frozen: rank {env.rank} of {env.world} done", flush=True)


@pytest.mark.slow
@pytest.mark.daemon
@pytest.mark.distributed
def test_hapd_export_file_run_all(tmp_path):
    """``hapd export test_frozen:frozen_bert`` → ``model.pt2`` → ``./run_all SCRIPT 2``,
    each rank ``hapd.distribute``-ing the file under a searched and a forced plan."""
    result = CliRunner().invoke(cli_main, ["export", "test_frozen:frozen_bert", "--batch", str(BATCH), "--out",
                                           str(tmp_path / "model.pt2"), "--no-hapg"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    for plan, data in compile_plans(tmp_path / "model.pt2").items():
        (tmp_path / f"{plan}.hplan").write_bytes(data)
    model, inputs = frozen_bert()
    torch.save(reference_run(model, inputs), tmp_path / "reference.pt")
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT.format(paths=[str(Path(__file__).resolve().parent), str(ROOT / "tests")]))

    env = {k: v for k, v in os.environ.items() if k not in ("HAPD_DAEMON", "HAPD_KEY_FILE", "HAPD_JOB")}
    env["HAPD_HOME"] = str(tmp_path / "home")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["HAPD_PYTHON"] = sys.executable  # the ranks run the torch this test runs
    done = subprocess.run([str(ROOT / "run_all"), str(script), "2", "--", str(tmp_path)], capture_output=True,
                          text=True, timeout=240, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for rank in range(2):
        reports = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(reports) == sorted(PLANS)
        for plan, report in reports.items():
            assert_frozen_stay_frozen(report, f"run_all {plan} rank {rank}")
    assert {"Gather(0)", "Gather(1)"} <= set(json.loads((tmp_path / "rank0.json").read_text())["forced"]
                                             ["frozen_layouts"])
