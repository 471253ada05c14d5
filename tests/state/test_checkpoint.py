"""Sharded checkpoints: resume on another world size, profile and plan; atomic writes;
the single-device state dict as safetensors.

The resume-equivalence run (issue 16's "must show"): a tiny mlp, fp32, Adam, trained
10 steps on one device; 5 steps on 2 Gloo ranks (3:1, first linear split by output
features, second by input features), saved, then loaded on 4 ranks (0.4/0.3/0.2/0.1,
a plan that splits other parameters along other dims, so every split piece is
resharded) and on one process without a process group, each training 5 more steps:
every step's loss matches the uninterrupted run within ``TOL`` relative. The batches
come from :func:`hapd.loader`, whose position (mid-epoch; the 10 steps cross an epoch)
the checkpoint carries. Between, a save over the checkpoint fails on rank 1 after it
wrote its shards: the previous checkpoint stays and is the one loaded.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _dist import run_ranks
from torch.distributed.checkpoint import FileSystemWriter
from torch.utils.data import DataLoader, TensorDataset

import hapd
from hapd import models
from hapd.errors import CheckpointError
from hapd.state.checkpoint_format import MANIFEST, read_manifest
from hapd.train.data import UnevenBatchSampler

B = 8
SAMPLES = 48
"""6 global batches an epoch: the 10 steps cross into the second epoch."""
SEED = 11
LR = 1e-2
HALF, STEPS = 5, 10
TOL = 1e-5
RATIOS_2 = (0.75, 0.25)
FORCE_2 = {"linear": "column-parallel", "linear_1": "row-parallel"}
RATIOS_4 = (0.4, 0.3, 0.2, 0.1)
FORCE_4 = {"linear_1": "column-parallel", "linear_2": "row-parallel"}
"""On 4 ranks the first linear is replicated, the second split by output features (on 2
ranks: by input features), the head split by input features (on 2 ranks: replicated)."""


def _dataset() -> TensorDataset:
    config = models.make_config("mlp")
    return TensorDataset(*models.get("mlp").example_inputs(config, SAMPLES))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build("mlp")[0]


def _example(data: TensorDataset) -> tuple[torch.Tensor, ...]:
    return tuple(t[:B] for t in data.tensors)


def _train(step_fn, data, optimizer, start: int, stop: int) -> list[float]:
    """Steps ``start`` .. ``stop - 1``; ``data`` resumes where its state says."""
    per_epoch = len(data.sampler.batch_lengths())
    losses, step = [], start
    while step < stop:
        data.set_epoch(step // per_epoch)  # the same epoch keeps a loaded position
        for batch in data:
            optimizer.zero_grad(set_to_none=True)
            losses.append(step_fn(batch))
            optimizer.step()
            step += 1
            if step >= stop:
                break
    return losses


class _GlobalBatches:
    """The single-device run's batches: whole global batches in the sampler's order."""

    def __init__(self, data: TensorDataset):
        self.sampler = UnevenBatchSampler(data, [B], 0, seed=SEED, drop_last=True)
        self.loader = DataLoader(data, batch_sampler=self.sampler)

    def set_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def __iter__(self):
        return iter(self.loader)


def _reference() -> list[float]:
    # not _exact.single_device: the eager model trained on the loader's global batches, one per step
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)

    def step(batch) -> float:
        loss = model(*batch)
        loss.backward()
        return float(loss.detach())

    return _train(step, _GlobalBatches(_dataset()), optimizer, 0, STEPS)


def _parallel_step(module):
    def step(batch) -> float:
        part = module(*batch)
        part.backward()
        return module.global_loss(part)

    return step


def _values(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Tensors as numpy arrays: what a rank sends back must not be a tensor shared
    through a file descriptor of a process that is about to exit."""
    return {k: v.detach().numpy().copy() for k, v in state.items()}


def _pieces(module) -> dict[str, list[int]]:
    return {k: list(p.shape) for k, p in module.inner.named_parameters()}


def _write_then_fail(original):
    def write_data(self, plan, planner):
        original(self, plan, planner).wait()  # this rank's shards are on disk
        raise OSError("simulated crash after this rank wrote its shards")

    return write_data


def _half_on_two_ranks() -> tuple[Any, torch.optim.Adam, Any, list[float]]:
    """HALF steps on this rank of 2 (RATIOS_2, FORCE_2): the module, its optimizer and
    loader, and the losses."""
    data = _dataset()
    module = hapd.parallelize(_model(), _example(data), options={"ratios": RATIOS_2, "force": FORCE_2},
                              use_daemon=False, verbose=False)
    optimizer = torch.optim.Adam(module.parameters(), lr=LR)
    loader = hapd.loader(data, module, seed=SEED)
    return module, optimizer, loader, _train(_parallel_step(module), loader, optimizer, 0, HALF)


def _first_half(rank: int, world: int, folder: str) -> dict[str, Any]:
    module, optimizer, loader, losses = _half_on_two_ranks()
    hapd.save_checkpoint(folder, module, optimizer, sampler=loader, step=HALF, extra={"note": "half"})
    # a second save over it, of another step, that rank 1 crashes in after writing its shards
    original = FileSystemWriter.write_data
    if rank == 1:
        FileSystemWriter.write_data = _write_then_fail(original)
    failed = None
    try:
        hapd.save_checkpoint(folder, module, optimizer, sampler=loader, step=99, extra={"note": "never"})
    except CheckpointError as exc:  # DCP's CheckpointException (a BaseException) comes as hapd's error
        failed = f"{type(exc).__name__}: {exc}"
    finally:
        FileSystemWriter.write_data = original
    return {"losses": losses, "layouts": module.parameter_layouts(), "pieces": _pieces(module),
            "full": _values(module.full_state_dict()), "failed": failed, "loader": loader.state_dict()}


def _second_half(rank: int, world: int, folder: str, options: dict | None) -> dict[str, Any]:
    data = _dataset()
    module = hapd.parallelize(_model(), _example(data), options=options, use_daemon=False, verbose=False)
    optimizer = torch.optim.Adam(module.parameters(), lr=LR / 7)  # the checkpoint's lr replaces it
    loader = hapd.loader(data, module, seed=SEED)
    state = hapd.load_checkpoint(folder, module, optimizer, sampler=loader)
    full = _values(module.full_state_dict())
    losses = _train(_parallel_step(module), loader, optimizer, state["step"], STEPS)
    return {"losses": losses, "state": state, "full": full, "layouts": module.parameter_layouts(),
            "pieces": _pieces(module), "lr": optimizer.param_groups[0]["lr"], "loader": loader.state_dict()}


def _rel(got: list[float], want: list[float]) -> float:
    # not _exact.relative: the worst of per-loss errors over two lists of losses
    assert len(got) == len(want), (got, want)
    return max(abs(g - w) / abs(w) for g, w in zip(got, want))


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> dict[str, Any]:
    folder = str(tmp_path_factory.mktemp("resume") / "ckpt")
    first = run_ranks(2, _first_half, folder, timeout=300)
    four = run_ranks(4, _second_half, folder, {"ratios": RATIOS_4, "force": FORCE_4}, timeout=300)
    one = _second_half(0, 1, folder, None)  # this process, no process group
    return {"folder": folder, "reference": _reference(), "first": first, "four": four, "one": one}


@pytest.mark.slow
@pytest.mark.distributed
def test_the_plans_split_parameters_differently(resumed):
    two, four = resumed["first"], resumed["four"]
    assert two[0]["layouts"]["body.0.weight"] == "Gather(0)" and four[0]["layouts"]["body.0.weight"] == "Identity"
    assert two[0]["layouts"]["body.3.weight"] == "Gather(1)" and four[0]["layouts"]["body.3.weight"] == "Gather(0)"
    assert two[0]["layouts"]["head.weight"] == "Identity" and four[0]["layouts"]["head.weight"] == "Gather(1)"
    assert [r["pieces"]["body.0.weight"][0] for r in two] == [48, 16]
    assert len({r["pieces"]["body.3.weight"][0] for r in four}) > 1  # uneven pieces


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_on_another_world_size_and_plan_matches_the_uninterrupted_run(resumed):
    reference = resumed["reference"]
    first = resumed["first"][0]["losses"]
    worst = {"2 ranks, steps 1-5": _rel(first, reference[:HALF])}
    for name, runs in (("4 ranks", resumed["four"]), ("1 process", [resumed["one"]])):
        for r in runs:
            worst[f"{name}, steps 6-10"] = max(worst.get(f"{name}, steps 6-10", 0.0),
                                               _rel(r["losses"], reference[HALF:]))
    print(f"\nresume equivalence, max relative loss difference: {worst}")
    assert all(v <= TOL for v in worst.values()), worst
    assert reference[-1] < reference[0]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_loaded_checkpoint_is_the_saved_state(resumed):
    saved = resumed["first"][0]["full"]
    for r in [*resumed["four"], resumed["one"]]:
        assert sorted(r["full"]) == sorted(saved)
        assert all(np.array_equal(r["full"][k], saved[k]) for k in saved)
        assert r["state"] == {"step": HALF, "extra": {"note": "half"}}
        assert r["lr"] == LR  # the optimizer's hyperparameters come from the checkpoint
    # the sampler position: 5 batches of epoch 0 read when saved; after 10 steps, 4 of epoch 1
    assert resumed["first"][0]["loader"] == {"epoch": 0, "start_batch": HALF, "seed": SEED}
    assert resumed["one"]["loader"] == {"epoch": 1, "start_batch": 4, "seed": SEED}


@pytest.mark.slow
@pytest.mark.distributed
def test_a_save_that_crashes_on_one_rank_leaves_the_previous_checkpoint(resumed):
    for r in resumed["first"]:
        assert r["failed"].startswith("CheckpointError: could not write the checkpoint for ")
        assert "rank 1: OSError: simulated crash" in r["failed"]
    folder = Path(resumed["folder"])
    assert read_manifest(folder)["step"] == HALF and read_manifest(folder)["world"] == 2
    assert [p.name for p in folder.parent.iterdir()] == ["ckpt"]  # the failed save's folder is gone


# ----------------------------------------------------------------------------- one process


def _trained(steps: int = 1) -> tuple[Any, torch.optim.Optimizer, TensorDataset]:
    data = _dataset()
    module = hapd.parallelize(_model(), _example(data), use_daemon=False, verbose=False)
    optimizer = torch.optim.AdamW(module.parameters(), lr=LR)
    for _ in range(steps):
        module(*module.shard_inputs(*_example(data))).backward()
        optimizer.step()
    return module, optimizer, data


def test_save_and_load_in_one_process_and_into_a_plain_model(tmp_path):
    module, optimizer, _ = _trained()
    path = hapd.save_checkpoint(tmp_path / "ckpt", module, optimizer, step=3, extra={"a": [1, 2]})
    assert path == tmp_path / "ckpt" and (path / MANIFEST).is_file() and (path / ".metadata").is_file()
    plain = _model()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1.0)
    assert hapd.load_checkpoint(path, plain, plain_optimizer) == {"step": 3, "extra": {"a": [1, 2]}}
    full = module.full_state_dict()
    assert all(torch.equal(v, full[k]) for k, v in plain.state_dict().items())
    for mine, theirs in zip(plain.parameters(), module.inner.parameters()):
        assert torch.equal(plain_optimizer.state[mine]["exp_avg"], optimizer.state[theirs]["exp_avg"])
    assert plain_optimizer.param_groups[0]["lr"] == LR


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    module, optimizer, _ = _trained()
    path = hapd.save_checkpoint(tmp_path / "ckpt", module, optimizer, step=1)
    before = {k: v.clone() for k, v in module.full_state_dict().items()}
    module(*module.shard_inputs(*_example(_dataset()))).backward()
    optimizer.step()
    monkeypatch.setattr(FileSystemWriter, "write_data", _write_then_fail(FileSystemWriter.write_data))
    with pytest.raises(CheckpointError, match="simulated crash"):
        hapd.save_checkpoint(path, module, optimizer, step=2)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert hapd.load_checkpoint(path, module, optimizer)["step"] == 1
    assert all(torch.equal(v, before[k]) for k, v in module.full_state_dict().items())


def test_a_crash_between_the_renames_leaves_the_previous_checkpoint_beside(tmp_path):
    module, optimizer, _ = _trained()
    path = hapd.save_checkpoint(tmp_path / "ckpt", module, optimizer, step=1)
    path.rename(tmp_path / ".ckpt.old-0123abcd")  # as a save interrupted after its first rename leaves it
    assert hapd.load_checkpoint(path, module, optimizer)["step"] == 1
    hapd.save_checkpoint(path, module, optimizer, step=2)  # the next save cleans up
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    assert hapd.load_checkpoint(path, module)["step"] == 2


def test_overwriting_replaces_the_checkpoint_all_at_once(tmp_path):
    module, optimizer, _ = _trained()
    path = tmp_path / "ckpt"
    for step in (1, 2):
        hapd.save_checkpoint(path, module, optimizer, step=step)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"] and read_manifest(path)["step"] == 2
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a hapd checkpoint"):
        hapd.save_checkpoint(tmp_path / "mine", module, optimizer)


def test_what_cannot_be_loaded_is_an_error(tmp_path):
    module, optimizer, _ = _trained()
    with pytest.raises(CheckpointError, match="does not exist"):
        hapd.load_checkpoint(tmp_path / "nothing", module)
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointError, match="save did not finish"):
        hapd.load_checkpoint(tmp_path / "half", module)
    path = hapd.save_checkpoint(tmp_path / "ckpt", module)  # no optimizer
    with pytest.raises(CheckpointError, match="no optimizer state"):
        hapd.load_checkpoint(path, module, optimizer)
    other, _ = models.build("mlp", hidden=16)
    with pytest.raises(CheckpointError, match="shape"):
        hapd.load_checkpoint(path, other)
    bigger, _ = models.build("mlp", layers=3)
    with pytest.raises(CheckpointError, match="another model"):
        hapd.load_checkpoint(path, bigger)
    manifest = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**manifest, "version": 99}))
    with pytest.raises(CheckpointError, match="version 99"):
        hapd.load_checkpoint(path, module)


def _flip(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 1 << bit
    path.write_bytes(bytes(data))


def test_a_flipped_bit_anywhere_is_refused_naming_the_file_and_the_module_is_untouched(tmp_path):
    """One bit flipped in a tensor, in the pickled extras, in DCP's ``.metadata`` or in
    the manifest; a file truncated, zero-filled or missing: each a CheckpointError
    naming the file, and the module's and optimizer's state as before the load."""
    module, optimizer, _ = _trained()
    path = hapd.save_checkpoint(tmp_path / "ckpt", module, optimizer, step=3, extra={"lr": 0.125})
    before = {k: v.clone() for k, v in module.full_state_dict().items()}
    data = sorted(path.glob("*.distcp"))
    damages = []
    for f in [*data, path / ".metadata"]:
        size = f.stat().st_size
        for where in (0, size // 3, size // 2, size - 1):
            damages.append((f, lambda f=f, where=where: _flip(f, where, bit=where % 8)))
        damages.append((f, lambda f=f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])))
        damages.append((f, lambda f=f: f.write_bytes(bytes(f.stat().st_size))))
        damages.append((f, lambda f=f: f.unlink()))
    damages.append((path / MANIFEST, lambda: (path / MANIFEST).write_text(
        (path / MANIFEST).read_text().replace('"step": 3', '"step": 4'))))
    pristine = {f: f.read_bytes() for f in [*data, path / ".metadata", path / MANIFEST]}
    for f, damage in damages:
        damage()
        with pytest.raises(CheckpointError, match=re.escape(f.name)):
            hapd.load_checkpoint(path, module, optimizer)
        for g, content in pristine.items():
            g.write_bytes(content)
    assert all(torch.equal(v, before[k]) for k, v in module.full_state_dict().items())
    assert hapd.load_checkpoint(path, module, optimizer) == {"step": 3, "extra": {"lr": 0.125}}


def test_another_optimizer_type_is_refused(tmp_path):
    module, optimizer, _ = _trained()
    path = hapd.save_checkpoint(tmp_path / "ckpt", module, optimizer)
    with pytest.raises(CheckpointError, match="AdamW optimizer, not of a SGD"):
        hapd.load_checkpoint(path, module, torch.optim.SGD(module.parameters(), lr=0.1))


def test_a_full_disk_is_a_checkpoint_error(tmp_path, monkeypatch):
    module, optimizer, _ = _trained()

    def full(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        hapd.save_checkpoint(tmp_path / "ckpt", module, optimizer)
    assert not list(tmp_path.iterdir())

    # torch's serializer on a full disk does not say so: the free space does
    def torn(self, plan, planner):
        raise RuntimeError("[enforce fail at inline_container.cc:664] unexpected pos 704 vs 598")

    monkeypatch.setattr(FileSystemWriter, "write_data", torn)
    monkeypatch.setattr(shutil, "disk_usage", lambda _path: shutil._ntuple_diskusage(10 * 2**30, 10 * 2**30, 4096))
    with pytest.raises(CheckpointError, match=r"unexpected pos 704 vs 598; the disk holding .* is full \(0.0 MiB free\)"):
        hapd.save_checkpoint(tmp_path / "ckpt", module, optimizer)
    assert not list(tmp_path.iterdir())


def test_a_checkpoint_of_another_model_says_so_before_the_optimizer(tmp_path):
    """A 2-layer MLP's checkpoint (AdamW) loaded into another model with Adam: the model
    is named as the mismatch, not the optimizer."""
    module, optimizer, _ = _trained()
    path = hapd.save_checkpoint(tmp_path / "ckpt", module, optimizer)
    other, _ = models.build("mlp", layers=3)
    with pytest.raises(CheckpointError, match="is of another model"):
        hapd.load_checkpoint(path, other, torch.optim.Adam(other.parameters()))


def test_the_sampler_and_loader_say_where_they_are():
    sampler = UnevenBatchSampler(40, [3, 1], 0, seed=3)
    batches = iter(sampler)
    for _ in range(3):
        next(batches)
    assert sampler.state_dict() == {"epoch": 0, "start_batch": 3, "seed": 3}
    resumed = UnevenBatchSampler(40, [3, 1], 0, seed=0)
    resumed.load_state_dict(sampler.state_dict())
    resumed.set_epoch(0)  # the same epoch keeps the loaded position
    assert list(resumed) == list(UnevenBatchSampler(40, [3, 1], 0, seed=3))[3:]
    resumed.set_epoch(1)
    assert resumed.state_dict() == {"epoch": 1, "start_batch": 0, "seed": 3} and len(resumed) == 10

    data = _dataset()
    module = hapd.parallelize(_model(), _example(data), use_daemon=False, verbose=False)
    loader = hapd.loader(data, module, seed=SEED, num_workers=0)
    taken = iter(loader)
    next(taken), next(taken)
    assert loader.state_dict()["start_batch"] == 2


# ----------------------------------------------------------------------------- safetensors


def test_export_safetensors_loads_into_a_plain_model_and_imports_back(tmp_path):
    from safetensors.torch import load_file

    module, _, _ = _trained()
    file = hapd.export_safetensors(module, tmp_path / "mlp.safetensors")
    plain = _model()
    plain.load_state_dict(load_file(file))
    full = module.full_state_dict()
    assert all(torch.equal(v, full[k]) for k, v in plain.state_dict().items())
    fresh, _, _ = _trained(steps=0)
    hapd.import_safetensors(fresh, file)
    assert all(torch.equal(v, full[k]) for k, v in fresh.full_state_dict().items())


@pytest.mark.slow
def test_a_transformers_gpt2_loads_with_from_pretrained(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hapd.models.zoo import ZOO

    wrapper, inputs = ZOO["gpt2"](batch=2)
    reference = copy.deepcopy(wrapper.model).eval()
    module = hapd.parallelize(wrapper, inputs, use_daemon=False, verbose=False)
    with torch.no_grad():
        for p in module.parameters():  # a change training would make, visible after loading
            p.add_(0.01)
    folder = tmp_path / "gpt2"
    file = hapd.export_safetensors(module, folder, strip_prefix="model.", config=wrapper.model.config)
    assert file == folder / "model.safetensors" and (folder / "config.json").is_file()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    full = module.full_state_dict()
    state = loaded.state_dict()
    assert all(torch.equal(state[k[len("model."):]], v) for k, v in full.items())
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
    with torch.no_grad():
        before = reference(inputs[0]).logits
        after = loaded(inputs[0]).logits
    assert not torch.allclose(before, after)
    # and back into a ParallelModule, from the file without the prefix
    again = hapd.parallelize(ZOO["gpt2"](batch=2)[0], inputs, use_daemon=False, verbose=False)
    hapd.import_safetensors(again, folder, strip_prefix="model.")
    assert all(torch.equal(v, full[k]) for k, v in again.full_state_dict().items())


def _snapshot_half(rank: int, world: int, base: str) -> dict[str, Any]:
    """HALF steps on 2 ranks, then each rank's snapshot files written in a folder of its
    own (as on hosts without a shared file system)."""
    from hapd.state.checkpoint import snapshot_files

    module, optimizer, loader, losses = _half_on_two_ranks()
    files = snapshot_files(Path(base) / f"rank{rank}", module, optimizer, sampler=loader, step=HALF,
                           extra={"note": "snapshot"})
    return {"files": files, "losses": losses, "full": _values(module.full_state_dict())}


@pytest.mark.slow
@pytest.mark.distributed
def test_snapshot_files_of_every_rank_are_a_checkpoint_that_reshards(tmp_path, resumed):
    """What elastic jobs keep in memory: each rank's files, written on its own host; put
    together in one folder they load on one process and train on like the checkpoint."""
    ranks = run_ranks(2, _snapshot_half, str(tmp_path / "hosts"), timeout=300)
    assert MANIFEST in ranks[0]["files"] and MANIFEST not in ranks[1]["files"]
    assert not set(ranks[0]["files"]) & set(ranks[1]["files"])  # each rank sends only its own files
    folder = tmp_path / "together"
    folder.mkdir()
    for r in ranks:
        for name, data in r["files"].items():
            (folder / name).write_bytes(data)
    one = _second_half(0, 1, str(folder), None)
    assert one["state"] == {"step": HALF, "extra": {"note": "snapshot"}}
    assert all(np.array_equal(v, ranks[0]["full"][k]) for k, v in one["full"].items())
    assert _rel(one["losses"], resumed["reference"][HALF:]) <= TOL
    (folder / sorted(n for n in ranks[1]["files"])[0]).write_bytes(b"damaged")
    with pytest.raises(CheckpointError, match="damaged|digest"):
        _second_half(0, 1, str(folder), None)


def _dropout_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return models.build("mlp", dropout=0.3)[0]


def _dropout_run(rank: int, world: int, folder: str) -> dict[str, Any]:
    """4 steps straight; 2 steps, a checkpoint, a fresh module loading it, 2 more; and
    those 2 again with the draw counter left at 0 (what a resume did before it was saved)."""
    from hapd.state.checkpoint import draw_count, set_draw_count

    data = _dataset()
    batch = _example(data)

    def losses(module, optimizer, steps: int) -> list[float]:
        out = []
        for _ in range(steps):
            optimizer.zero_grad(set_to_none=True)
            part = module(*module.shard_inputs(*batch))
            part.backward()
            out.append(module.global_loss(part))
            optimizer.step()
        return out

    def fresh():
        module = hapd.parallelize(_dropout_model(), batch, options={"ratios": RATIOS_2}, use_daemon=False,
                                  verbose=False)
        return module, torch.optim.Adam(module.parameters(), lr=LR)

    straight = losses(*fresh(), 4)
    module, optimizer = fresh()
    first = losses(module, optimizer, 2)
    hapd.save_checkpoint(folder, module, optimizer, step=2)
    module, optimizer = fresh()
    hapd.load_checkpoint(folder, module, optimizer)
    counted = draw_count(module)
    resumed = losses(module, optimizer, 2)
    module, optimizer = fresh()
    hapd.load_checkpoint(folder, module, optimizer)
    set_draw_count(module, 0)
    reset = losses(module, optimizer, 2)
    return {"straight": straight, "first": first, "resumed": resumed, "reset": reset, "counted": counted}


def test_a_resumed_run_drops_what_the_uninterrupted_run_drops(tmp_path):
    """Dropout drawn by hapd's counter-based generator on 2 uneven ranks: the checkpoint
    keeps the generator's step, so the steps after a resume draw the masks the
    uninterrupted run draws and their losses are its losses; with the step left at 0
    they differ."""
    got = run_ranks(2, _dropout_run, str(tmp_path / "ckpt"), timeout=300)[0]
    assert got["counted"] == 2  # two forwards before the save
    assert _rel(got["first"] + got["resumed"], got["straight"]) <= TOL
    assert _rel(got["reset"], got["straight"][2:]) > 1e-4
