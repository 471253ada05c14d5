"""hapd.parallelize: the module it returns trains exactly like the single-device model.

On 2 Gloo ranks with uneven ratios (3:1) and a plan that splits parameters (column- and
row-parallel linears) as well as replicating others, against the single-device model:
the full state dict, gradient clipping by global norm, gradient accumulation over
micro-batches (with and without ``no_sync``), an LR scheduler over several steps,
``eval()`` / ``torch.no_grad()`` forwards, and bf16 autocast. fp32 tolerance: 1e-5
(gradients: :func:`_exact.grad_errors`); bf16 autocast: see ``BF16_TOL``. Plus: one
process without a process group, the single-device names of a transformers GPT-2, and
plans from a real daemon.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import run_ranks
from _exact import grad_errors, tensor_error
from _wait import wait_for

import hapd
from hapd import models
from hapd.errors import PlanError, UnsupportedOpError

ROOT = Path(__file__).resolve().parents[2]
B = 8
RATIOS = (0.75, 0.25)
FORCE = {"linear": "column-parallel", "linear_1": "row-parallel"}
"""The mlp's first linear split by output features, the second by input features; the
head stays replicated (the plan's choice)."""
TOL = 1e-5
BF16_TOL = 2e-2
"""bf16 autocast: the split matmuls round partial sums to bf16 in other places than
the single-device run, so losses and gradients agree to bf16's precision (8 bits of
mantissa, ≈ 4e-3 per rounding) rather than exactly."""
STEPS = 6


def _batches(config: Any, count: int) -> list[tuple[torch.Tensor, ...]]:
    """``count`` different global batches of the mlp."""
    x, y = models.get("mlp").example_inputs(config, B * count)
    return [(x[i * B:(i + 1) * B], y[i * B:(i + 1) * B]) for i in range(count)]


def _grad_error(module, ref: torch.nn.Module) -> float:
    """Largest error (:func:`_exact.grad_errors`) of this rank's gradient pieces against
    the single-device gradients."""
    grads = dict((n, p.grad) for n, p in ref.named_parameters())
    named = dict(module.inner.named_parameters())
    expected = {name: module.inner.hapd_view.local_value(*module.inner.hapd_params[name], grads[name])
                for name in named}
    return max(grad_errors(expected, {name: p.grad for name, p in named.items()}, scale=grads).values())


def _zero(*modules) -> None:
    for m in modules:
        for p in m.parameters():
            p.grad = None


def _loss(module, batch) -> torch.Tensor:
    return module(*module.shard_inputs(*batch))


def _features(rank: int, world: int) -> dict[str, Any]:
    """Every feature on this rank against the single-device model."""
    torch.manual_seed(0)
    model, config = models.build("mlp")
    ref = copy.deepcopy(model)
    initial = copy.deepcopy(model.state_dict())
    batches = _batches(config, 4)
    module = hapd.parallelize(model, batches[0], options={"ratios": RATIOS, "force": FORCE}, use_daemon=False,
                              verbose=False)
    out: dict[str, Any] = {"layouts": module.parameter_layouts(), "plan": module.plan_source.origin}

    # full state dict: the single-device names, shapes and values; loading slices it
    full = module.full_state_dict()
    out["state_keys"] = sorted(full) == sorted(initial)
    out["state_error"] = max(tensor_error(full[k], initial[k]) for k in initial)
    changed = {k: v + 1.0 for k, v in initial.items()}
    module.load_full_state_dict(changed)
    out["reload_error"] = max(tensor_error(v, changed[k]) for k, v in module.full_state_dict().items())
    module.load_full_state_dict(initial)

    # clipping by global norm
    _loss(module, batches[0]).backward()
    ref(*batches[0]).backward()
    total = module.clip_grad_norm_(0.5)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    out["clip_norm_error"] = tensor_error(total, ref_total)
    out["clip_grad_error"] = _grad_error(module, ref)
    out["clipped"] = float(ref_total) > 0.5
    inf_module, inf_ref = module.clip_grad_norm_(1e-3, norm_type="inf"), torch.nn.utils.clip_grad_norm_(
        ref.parameters(), 1e-3, norm_type="inf")
    out["clip_inf_error"] = max(tensor_error(inf_module, inf_ref), _grad_error(module, ref))

    # accumulation over micro-batches: plain, with no_sync, mixed
    accumulation = {}
    for name, synced in {"plain": (True, True, True), "no_sync": (False, False, True),
                         "mixed": (True, False, True)}.items():
        _zero(module, ref)
        for batch, sync in zip(batches[1:], synced):
            if sync:
                _loss(module, batch).backward()
            else:
                with module.no_sync():
                    _loss(module, batch).backward()
            ref(*batch).backward()
        accumulation[name] = _grad_error(module, ref)
    out["accumulation"] = accumulation

    # eval() and no_grad forwards leave nothing waiting; a forward without backward neither
    module.eval(), ref.eval()
    with torch.no_grad():
        want = float(ref(*batches[2]))
        out["eval_error"] = abs(module.global_loss(_loss(module, batches[2])) - want) / abs(want)
    _loss(module, batches[3])  # eval, with grad, no backward
    module.train(), ref.train()
    _loss(module, batches[3])  # no backward
    _zero(module, ref)
    _loss(module, batches[1]).backward()
    ref(*batches[1]).backward()
    out["after_eval_grad_error"] = _grad_error(module, ref)

    # a schedule: AdamW + OneCycleLR + clipping + 2 micro-batches per step (no_sync)
    module.load_full_state_dict(initial)
    ref.load_state_dict(initial)
    losses = []
    for m in (module, ref):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-2, total_steps=STEPS)
        run = []
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            first, second = batches[step % 4], batches[(step + 1) % 4]
            if m is module:
                with m.no_sync():
                    part = _loss(m, first)
                    part.backward()
                last = _loss(m, second)
                last.backward()
                run.append(m.global_loss(part) + m.global_loss(last))
                m.clip_grad_norm_(1.0)
            else:
                part, last = m(*first), m(*second)
                (part + last).backward()
                run.append(float(part.detach()) + float(last.detach()))
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opt.step()
            sched.step()
        losses.append(run)
    out["schedule_losses"] = losses

    # bf16 autocast against single-device bf16 autocast
    module.load_full_state_dict(initial)
    ref.load_state_dict(initial)
    _zero(module, ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        local = _loss(module, batches[0])
        expected = ref(*batches[0])
    local.backward()
    expected.backward()
    out["bf16_loss_error"] = abs(module.global_loss(local) - float(expected.detach())) / abs(float(expected.detach()))
    out["bf16_grad_error"] = _grad_error(module, ref)
    return out


@pytest.fixture(scope="module")
def features() -> list[dict[str, Any]]:
    return run_ranks(2, _features, timeout=300)


@pytest.mark.distributed
def test_the_plan_splits_and_replicates_parameters(features):
    layouts = set(features[0]["layouts"].values()) | set(features[1]["layouts"].values())
    assert "Identity" in layouts and {"Gather(0)", "Gather(1)"} <= layouts, layouts
    assert features[0]["plan"] == "compiled on rank 0" == features[1]["plan"]


@pytest.mark.distributed
def test_full_state_dict_is_the_single_device_one(features):
    for r in features:
        assert r["state_keys"] and r["state_error"] == 0.0 and r["reload_error"] == 0.0


@pytest.mark.distributed
def test_clip_grad_norm_matches_single_device(features):
    for r in features:
        assert r["clipped"]
        assert r["clip_norm_error"] <= TOL and r["clip_grad_error"] <= TOL, r
        assert r["clip_inf_error"] <= TOL, r


@pytest.mark.distributed
def test_gradient_accumulation_matches_single_device(features):
    for r in features:
        assert all(e <= TOL for e in r["accumulation"].values()), r["accumulation"]


@pytest.mark.distributed
def test_eval_and_no_grad_forwards(features):
    for r in features:
        assert r["eval_error"] <= TOL and r["after_eval_grad_error"] <= TOL, r


@pytest.mark.distributed
def test_lr_scheduler_clipping_accumulation_steps_match(features):
    for r in features:
        hapd_losses, ref_losses = r["schedule_losses"]
        assert len(hapd_losses) == STEPS
        for got, want in zip(hapd_losses, ref_losses):
            assert abs(got - want) <= TOL * abs(want), (hapd_losses, ref_losses)
        assert ref_losses[-1] < ref_losses[0]


@pytest.mark.distributed
def test_bf16_autocast_matches_single_device_bf16(features):
    for r in features:
        assert r["bf16_loss_error"] <= BF16_TOL and r["bf16_grad_error"] <= BF16_TOL, r


# ----------------------------------------------------------------------------- one process


def _assert_one_step_is_the_model(module, ref: torch.nn.Module, inputs) -> None:
    """A forward and backward of the one-process ``module`` equal ``ref``'s: the loss
    and every gradient."""
    loss = module(*module.shard_inputs(*inputs))
    expected = ref(*inputs)
    loss.backward()
    expected.backward()
    assert float(loss.detach()) == pytest.approx(float(expected.detach()), rel=TOL)
    assert _grad_error(module, ref) <= TOL


def test_one_process_without_a_process_group_is_the_model():
    model, config = models.build("gpt2_block")
    ref = copy.deepcopy(model)
    inputs = models.get("gpt2_block").example_inputs(config, 4)
    module = hapd.parallelize(model, inputs, use_daemon=False, verbose=False)
    assert module.world == 1 and module.sample_lengths() == [4]
    _assert_one_step_is_the_model(module, ref, inputs)
    full = module.full_state_dict()
    assert {k: tuple(v.shape) for k, v in full.items()} == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    fresh, _ = models.build("gpt2_block")
    fresh.load_state_dict(full)  # a plain torch model loads it
    with pytest.raises(PlanError, match="missing keys"):
        module.load_full_state_dict({})


def test_a_batch_of_another_size_runs_its_own_program(capsys):
    model, config = models.build("mlp")
    ref = copy.deepcopy(model)
    module = hapd.parallelize(model, _batches(config, 1)[0], use_daemon=False)
    x, y = models.get("mlp").example_inputs(config, B - 1)
    # one process as two ranks: a batch of another size is named first (shard_inputs, the loader), not guessed
    with pytest.raises(PlanError, match=r"^rank 0: input 0 \(x\): expected shape \[8, \d+\], given \[7, \d+\] \(the plan "
                                        r"runs a batch of the example's size: cut a batch of another size with shard_inputs"):
        module(x, y)
    assert float(module(*module.shard_inputs(x, y)).detach()) == pytest.approx(float(ref(x, y).detach()), rel=TOL)
    assert "plan (training, batch shapes [[7, " in capsys.readouterr().out
    with pytest.raises(PlanError, match=r"expected 2 inputs \(x, y\), got 1"):
        module.shard_inputs(x)


def test_eval_of_a_mode_dependent_graph_is_the_models_eval_forward():
    model, config = models.build("mlp", dropout=0.25)
    ref = copy.deepcopy(model).eval()
    batch = _batches(config, 1)[0]
    module = hapd.parallelize(model, batch, use_daemon=False, verbose=False)
    module.eval()
    with torch.no_grad():
        assert float(module(*batch)) == pytest.approx(float(ref(*batch)), rel=TOL)  # no dropout
    assert model.training  # the model's own mode is left as it was


def test_eval_without_a_recipe_is_an_error_naming_the_op():
    """A ParallelModule made from a rank module alone has only the training program."""
    model, config = models.build("mlp", dropout=0.25)
    module = hapd.parallelize(model, _batches(config, 1)[0], use_daemon=False, verbose=False)
    bare = hapd.ParallelModule(module.inner, module.plan_source)
    bare.eval()
    with pytest.raises(UnsupportedOpError, match="dropout"):
        bare(*_batches(config, 1)[0])
    bare.train()
    x, y = models.get("mlp").example_inputs(config, B - 1)
    with pytest.raises(PlanError, match="runs only batch shapes"):
        bare.shard_inputs(x, y)


def test_transformers_gpt2_keeps_its_single_device_names():
    pytest.importorskip("transformers")
    from hapd.models.zoo import ZOO

    model, inputs = ZOO["gpt2"](batch=2)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    module = hapd.parallelize(model, inputs, use_daemon=False, verbose=False)
    full = module.full_state_dict()
    assert "model.transformer.h.0.attn.c_attn.weight" in full
    assert sorted(full) == sorted(ref)
    assert all(torch.equal(full[k], ref[k]) for k in ref)


# ----------------------------------------------------------------------------- the daemon


def _start_daemon(home: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "hapd.cli", "serve", "--state", str(home), "--bind",
                             "tcp://127.0.0.1:*", "--profile", "paper-8"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=ROOT)
    found: dict[str, str] = {}

    def started() -> bool:
        assert proc.poll() is None, f"the daemon exited with {proc.returncode}"
        try:
            info = json.loads((home / "daemon.json").read_text())
        except (OSError, ValueError):
            return False
        found["address"] = info["address"]
        return info.get("pid") == proc.pid

    wait_for(started, 60, "the daemon to start")
    return proc, found["address"]


@pytest.mark.daemon
def test_plans_come_from_the_daemon_and_its_cache(tmp_path, monkeypatch, capsys):
    home = tmp_path / "hapd"
    proc, address = _start_daemon(home)
    try:
        monkeypatch.setenv("HAPD_DAEMON", address)
        monkeypatch.setenv("HAPD_KEY_FILE", str(home / "key"))  # as a rank it launched sees
        origins = []
        for _ in range(2):
            model, config = models.build("mlp")
            module = hapd.parallelize(model, _batches(config, 1)[0])
            origins.append(module.plan_source.origin)
        assert origins == ["compiled by the daemon", "daemon cache hit"]
        line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("plan: ")][-1]
        assert line.startswith("plan: SPMD (") and "/step predicted" in line and "DP-CP" in line, line
        assert re.search(r"; daemon cache hit, \d+ ms$", line), line
    finally:
        proc.terminate()
        proc.wait(30)
    model, config = models.build("mlp")  # no daemon answers: rank 0 compiles, saying why
    module = hapd.parallelize(model, _batches(config, 1)[0], verbose=False)
    assert module.plan_source.origin.startswith("compiled on rank 0 (daemon at ")


def test_inputs_that_are_not_tensors_and_models_that_are_not_modules_are_named():
    """``forward(list)``, ``forward(None)``, ``shard_inputs`` of a dict and
    ``parallelize(function)`` say what is wrong (not an AttributeError from inside)."""
    from hapd.errors import OptionsError

    model, config = models.build("mlp")
    batch = _batches(config, 1)[0]
    module = hapd.parallelize(model, batch, use_daemon=False, verbose=False)
    for bad in ([list(batch)], [None, batch[1]], [{"x": batch[0]}, batch[1]]):
        with pytest.raises(OptionsError, match=r"input \d is a (list|NoneType|dict), not a tensor"):
            module(*bad)
    with pytest.raises(OptionsError, match="input 0 is a dict"):
        module.shard_inputs({"x": batch[0]}, batch[1])
    with pytest.raises(OptionsError, match="takes a torch.nn.Module"):
        hapd.parallelize(lambda x: x.sum(), batch, use_daemon=False, verbose=False)


def test_a_second_run_in_the_process_rebinds_the_kept_exports_to_its_model(monkeypatch):
    """With the carry on (an in-place switch runs the script again in its process), the
    same model built again with other values takes the kept programs — nothing is
    exported or normalized again — and trains exactly like a fresh parallelize of it, on
    its own values; a model of another structure exports as before."""
    from hapd.ir import normalize
    from hapd.train import programs

    carry = programs.ExportCarry()
    monkeypatch.setenv("HAPD_KEEP_EXPORTS", "1")
    monkeypatch.setattr("hapd.train.parallelize.CARRY", carry)
    first, config = models.build("gpt2_block")
    inputs = models.get("gpt2_block").example_inputs(config, 4)
    hapd.parallelize(first, inputs, use_daemon=False, verbose=False)
    again, _ = models.build("gpt2_block")
    with torch.no_grad():  # other values than the first model's (models.build seeds itself)
        for p in again.parameters():
            p.add_(0.1 * torch.randn_like(p))
    ref = copy.deepcopy(again)

    def no_export(*args, **kwargs):
        raise AssertionError("exported again")

    def no_normalize(*args, **kwargs):
        raise AssertionError("normalized again")

    monkeypatch.setattr(programs, "export", no_export)
    monkeypatch.setattr(normalize, "_canonical_names", no_normalize)  # the last pass of every normalize
    module = hapd.parallelize(again, inputs, use_daemon=False, verbose=False)
    monkeypatch.undo()
    monkeypatch.setenv("HAPD_KEEP_EXPORTS", "1")
    monkeypatch.setattr("hapd.train.parallelize.CARRY", carry)
    monkeypatch.setattr(programs, "export", no_export)
    _assert_one_step_is_the_model(module, ref, inputs)
    full = module.full_state_dict()
    assert all(torch.equal(full[k], v) for k, v in ref.state_dict().items())  # the second model's values
    other, other_config = models.build("gpt2_block", layers=1)
    with pytest.raises(AssertionError, match="exported again"):  # another structure: no kept export fits
        hapd.parallelize(other, models.get("gpt2_block").example_inputs(other_config, 4), use_daemon=False,
                         verbose=False)
