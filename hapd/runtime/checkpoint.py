"""Sharded checkpoints that load on another world size, profile and plan.

    hapd.save_checkpoint("ckpt/run", module, optimizer, sampler=loader, step=step,
                         extra={"scheduler": scheduler.state_dict()})     # collective
    state = hapd.load_checkpoint("ckpt/run", module, optimizer, sampler=loader)
    step = state["step"]

The format is ``torch.distributed.checkpoint`` (DCP): every rank writes its own pieces
in parallel (``__<rank>_0.distcp``), rank 0 writes DCP's ``.metadata`` and hapd's
manifest ``hapd.json``. Tensors are stored under the single-device model's names and
shapes, each rank's piece as a DCP chunk with its global offsets — the plan's uneven
splits (3:1 …) are not DCP's even ``DTensor`` shards, so :class:`PieceSavePlanner` and
:class:`PieceLoadPlanner` (DCP's planner extension points) give each piece its
offsets. Loading asks DCP for the pieces *this* rank's plan holds, and DCP's resharding
reads the overlapping parts of whatever pieces were saved: any world size, profile or
plan, one process without a process group included. A replicated tensor is written
once (DCP deduplicates equal chunks).

What a checkpoint holds:

* ``model/<name>``: parameters and buffers (tied parameters once, under their
  alphabetically first name).
* ``optim/<name>/<state>``: the optimizer state of parameter ``<name>``; a state tensor
  shaped like the parameter's piece (Adam's ``exp_avg``, ``exp_avg_sq``) is split like
  the parameter, a scalar (``step``) is whole. ``optim/param_groups``: the
  hyperparameters of each group and the names of its parameters.
* ``hapd/sampler``: the sampler's (or loader's) ``state_dict()``: its epoch and the
  global batches of it already read, which no world size changes.
* ``hapd/rng/<rank>``: each rank's torch CPU (and CUDA) RNG state; ``hapd.json`` holds the
  global seed (rank 0's ``torch.initial_seed()``). A rank that did not exist when the
  checkpoint was written is seeded with ``seed + rank``: a fresh stream, not a
  continuation (dropout masks on another plan differ anyway).
* ``hapd/extra``: the ``extra`` dict (anything ``torch.save`` takes), and ``step``.

Writes are atomic: the ranks write into a hidden sibling folder
(``.<name>.tmp-<tag>``); only after every rank finished, DCP wrote its metadata and rank
0 its manifest does rank 0 rename it into place (a previous checkpoint at the path is
first renamed aside, then deleted). A crash before that leaves the previous
checkpoint; a crash between the two renames leaves it at ``.<name>.old-<tag>``, where
:func:`load_checkpoint` finds it. Ranks on several hosts need a shared file system.
"""

from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from hapd.errors import CheckpointError, OptionsError, PlanError
from hapd.util import atomic_write, fsync_folder

FORMAT = "hapd-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "hapd.json"
"""Rank 0's manifest: written last, so a folder without it is no checkpoint."""

MODEL, OPTIM, GROUPS = "model/", "optim/", "optim/param_groups"
SAMPLER, EXTRA, RNG = "hapd/sampler", "hapd/extra", "hapd/rng/"


# --------------------------------------------------------------------------------------
# What a module holds: each tensor's local piece and where it lies in the whole
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """One state-dict entry as this rank holds it."""

    key: str
    """The single-device state-dict name (the first of a tied parameter's names)."""
    local: Tensor
    """This rank's piece: the live parameter or buffer (loading copies into it)."""
    offsets: tuple[int, ...]
    """Where the piece starts in the whole tensor."""
    size: tuple[int, ...]
    """The whole tensor's shape."""

    @property
    def partial(self) -> bool:
        return tuple(self.local.shape) != self.size

    def chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(offsets=torch.Size(self.offsets), sizes=self.local.shape)


def held_tensors(module: nn.Module) -> list[Held]:
    """Every parameter and buffer ``module`` (a :class:`~hapd.runtime.api.ParallelModule`
    or a plain single-device module) holds, once each, in name order."""
    from hapd.runtime.api import ParallelModule

    if isinstance(module, ParallelModule):
        return _held_by_rank(module)
    first: dict[int, str] = {}
    state = module.state_dict(keep_vars=True)
    for key in sorted(state):
        first.setdefault(id(state[key]), key)
    return [_whole(key, state[key]) for key in sorted(state) if first[id(state[key])] == key]


def _whole(key: str, tensor: Tensor) -> Held:
    return Held(key, tensor, (0,) * tensor.dim(), tuple(tensor.shape))


def _held_by_rank(module: Any) -> list[Held]:
    """A ParallelModule's pieces: parameters and read-only buffers as the plan lays them
    out, updated buffers and state outside the plan whole."""
    inner = module.inner
    out: list[Held] = []
    seen: set[int] = set()
    params = dict(inner.named_parameters(remove_duplicate=False))
    for key in sorted(inner.hapd_params):
        tensor, layout = inner.hapd_params[key]
        param = params[key]
        if id(param) not in seen:
            seen.add(id(param))
            out.append(_placed(module, key, tensor, layout, param))
    for key in sorted(inner.hapd_buffers):
        tensor, layout, attr = inner.hapd_buffers[key]
        buffer = inner.get_buffer(attr)
        if id(buffer) not in seen:
            seen.add(id(buffer))
            out.append(_placed(module, key, tensor, layout, buffer))
    out += [_whole(key, inner.get_buffer(key)) for key in sorted(inner.hapd_updated)]
    out += [_whole(key, module.extra[key]) for key in sorted(module.extra)]
    return sorted(out, key=lambda h: h.key)


def _placed(module: Any, key: str, tensor: str, layout: str, local: Tensor) -> Held:
    from hapd.runtime.layout import IDENTITY, gather_dim

    view = module.inner.hapd_view
    size = tuple(view.full_shape(tensor)) if tensor in view.tensors else tuple(local.shape)
    offsets = [0] * len(size)
    d = gather_dim(layout)
    if d is not None:
        offsets[d] = view.offset(tensor, d)[0]
    elif layout != IDENTITY:
        raise PlanError(f"{key} is held as {layout}: no piece of the whole tensor to checkpoint", node=tensor)
    return Held(key, local, tuple(offsets), size)


# --------------------------------------------------------------------------------------
# DCP planners for pieces with explicit offsets
# --------------------------------------------------------------------------------------


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus entries that are pieces of a larger tensor:
    ``pieces`` maps such a key to its ``(offsets, whole size)``; the state dict holds the
    piece itself. Whole tensors and other objects go the default way (replicated ones
    are written once)."""

    def __init__(self, pieces: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = dict(pieces)

    def create_local_plan(self) -> SavePlan:
        rest = {k: v for k, v in self.state_dict.items() if k not in self.pieces}
        plan = create_default_local_save_plan(rest, self.is_coordinator)
        items = [self._piece_item(key) for key in self.pieces]
        self.plan = SavePlan(list(plan.items) + items)
        return self.plan

    def _piece_item(self, key: str) -> WriteItem:
        offsets, size = self.pieces[key]
        local = self.state_dict[key]
        return WriteItem(
            index=MetadataIndex(key, torch.Size(offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=local.shape),
                properties=TensorProperties.create_from_tensor(local),
                size=torch.Size(size),
            ),
        )

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.pieces:
            return self.state_dict[index.fqn]
        return super().lookup_object(index)


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, plus entries that are pieces of a larger tensor
    (``pieces``: key -> ``(offsets, whole size)``): DCP reads into each piece the parts of
    the saved chunks that overlap it, however the checkpoint was split."""

    def __init__(self, pieces: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = dict(pieces)

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        rest = {k: v for k, v in self.state_dict.items() if k not in self.pieces}
        plan = create_default_local_load_plan(rest, self.metadata, True)
        items = list(plan.items)
        for key, (offsets, size) in self.pieces.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(size):
                raise CheckpointError(f"{key}: the checkpoint has {_describe(md)}, this rank needs a piece of a tensor "
                                      f"of shape {list(size)}", node=key)
            local = self.state_dict[key]
            items += create_read_items_for_chunk_list(
                key, md, [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=local.shape)])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        if index.fqn in self.pieces:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)


def _describe(md: Any) -> str:
    if md is None:
        return "no such entry"
    if isinstance(md, TensorStorageMetadata):
        return f"a tensor of shape {list(md.size)}"
    return "a non-tensor entry"


# --------------------------------------------------------------------------------------
# The job: rank, world, group
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Job:
    rank: int
    world: int
    group: Any
    distributed: bool
    """A process group exists (else: one process, no collectives)."""

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if not self.distributed:
            return value
        box = [value]
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]


def _job(module: nn.Module) -> _Job:
    from hapd.runtime.api import ParallelModule

    group = module.group if isinstance(module, ParallelModule) else None
    if dist.is_available() and dist.is_initialized():
        return _Job(dist.get_rank(group), dist.get_world_size(group), group, True)
    return _Job(0, 1, None, False)


@contextmanager
def _quiet_dcp() -> Iterator[None]:
    """Silence two warnings DCP gives that are not the caller's to act on: that it
    assumes one process when there is no process group (here the intent), and its own
    use of ``tensor.storage()`` (TypedStorage deprecation, inside torch)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
        yield


# --------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------


def save_checkpoint(path: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    sampler: Any = None, step: int = 0, extra: dict | None = None) -> Path:
    """Write a checkpoint of ``module`` (a ParallelModule, or a plain single-device
    module), ``optimizer``, ``sampler`` (anything with ``state_dict()``: a
    :class:`~hapd.runtime.data.RankLoader` or sampler), the RNG, ``step`` and ``extra``
    to the folder ``path``, replacing a checkpoint there all at once. Collective: every
    rank calls it and writes its own pieces. Returns ``path``."""
    target = Path(path)
    job = _job(module)
    held = held_tensors(module)
    state, pieces = _model_state(held)
    if optimizer is not None:
        optim_state, optim_pieces = _optimizer_state(optimizer, held)
        state.update(optim_state)
        pieces.update(optim_pieces)
    state[f"{RNG}{job.rank}"] = _rng_state()
    if job.rank == 0:
        state[EXTRA] = {"step": int(step), "extra": dict(extra or {})}
        if sampler is not None:
            state[SAMPLER] = sampler.state_dict()
    temp = _temp_folder(target, job)
    try:
        with _quiet_dcp():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(temp), planner=PieceSavePlanner(pieces),
                     process_group=job.group, no_dist=not job.distributed)
    except BaseException:
        if job.rank == 0:  # DCP raises on every rank once every rank is done writing
            shutil.rmtree(temp, ignore_errors=True)
        raise
    error = None
    if job.rank == 0:
        try:
            _write_manifest(temp, module, held, job, step)
            _publish(temp, target)
        except OSError as exc:
            shutil.rmtree(temp, ignore_errors=True)
            error = f"{type(exc).__name__}: {exc}"
    error = job.broadcast(error)  # also: no rank returns before the checkpoint is in place
    if error is not None:
        raise CheckpointError(f"could not put the checkpoint in place at {target}: {error}")
    return target


def _model_state(held: Iterable[Held]) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
    state: dict[str, Any] = {}
    pieces: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for h in held:
        key = MODEL + h.key
        if h.partial and h.local.numel() == 0:
            continue  # this rank holds nothing of it
        state[key] = h.local.detach()
        if h.partial:
            pieces[key] = (h.offsets, h.size)
    return state, pieces


def _param_keys(optimizer: torch.optim.Optimizer, held: Iterable[Held]) -> list[list[tuple[Held, Tensor]]]:
    """Each param group's parameters with what the module says about them."""
    by_id = {id(h.local): h for h in held}
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        found = []
        for param in group["params"]:
            h = by_id.get(id(param))
            if h is None:
                raise CheckpointError(f"param group {g} of the optimizer holds a parameter of shape "
                                      f"{list(param.shape)} that is not one of the module's")
            found.append((h, param))
        groups.append(found)
    return groups


def _state_placement(h: Held, name: str, value: Tensor) -> Held | None:
    """How optimizer state ``name`` of parameter ``h`` is laid out: like the parameter
    (shaped like its piece), or whole (a scalar, or any state of a whole parameter)."""
    if tuple(value.shape) == tuple(h.local.shape):
        return Held(h.key, value, h.offsets, h.size)
    if not h.partial or value.dim() == 0:
        return None
    raise CheckpointError(f"optimizer state {name!r} of {h.key} has shape {list(value.shape)}, neither the shape of "
                          f"this rank's piece {list(h.local.shape)} nor a scalar: hapd cannot tell how it is split",
                          node=h.key)


def _optimizer_state(optimizer: torch.optim.Optimizer, held: Iterable[Held]) -> tuple[dict, dict]:
    state: dict[str, Any] = {}
    pieces: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    groups = _param_keys(optimizer, held)
    for found in groups:
        for h, param in found:
            for name, value in optimizer.state.get(param, {}).items():
                key = f"{OPTIM}{h.key}/{name}"
                if not isinstance(value, Tensor):
                    state[key] = value
                    continue
                placed = _state_placement(h, name, value)
                if placed is not None and placed.partial:
                    if value.numel():
                        state[key] = value.detach()
                        pieces[key] = (placed.offsets, placed.size)
                else:
                    state[key] = value.detach()
    state[GROUPS] = [{**{k: v for k, v in group.items() if k != "params"}, "params": [h.key for h, _ in found]}
                     for group, found in zip(optimizer.param_groups, groups)]
    return state, pieces


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"cpu": torch.get_rng_state(), "seed": torch.initial_seed()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _temp_folder(target: Path, job: _Job) -> Path:
    """The hidden folder rank 0 made beside ``target`` for every rank to write into
    (collective: a refusal on rank 0 is an error on every rank)."""
    made: tuple[str | None, str | None] = (None, None)
    if job.rank == 0:
        try:
            made = (str(_prepare(target)), None)
        except (CheckpointError, OSError) as exc:
            made = (None, str(exc))
    temp, error = job.broadcast(made)
    if error is not None:
        raise CheckpointError(error)
    return Path(temp)


def _prepare(target: Path) -> Path:
    """A fresh hidden folder beside ``target`` to write into (rank 0)."""
    if target.exists() and not (target / MANIFEST).is_file():
        if not target.is_dir() or any(target.iterdir()):
            raise CheckpointError(f"{target} exists and is not a hapd checkpoint: not replacing it")
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = target.with_name(f".{target.name}.tmp-{secrets.token_hex(4)}")
    temp.mkdir()
    return temp


def _write_manifest(folder: Path, module: nn.Module, held: list[Held], job: _Job, step: int) -> None:
    from hapd import __version__

    plan = getattr(module, "plan", None)
    layouts = module.parameter_layouts() if hasattr(module, "parameter_layouts") else {}
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": int(step),
        "world": job.world,
        "seed": torch.initial_seed(),
        "graph_id": plan.key.get("graph_id") if plan is not None else None,
        "layouts": layouts,
        "model": {h.key: list(h.size) for h in held},
        "hapd": __version__,
        "torch": torch.__version__,
        "saved_at": time.time(),
    }
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def _publish(temp: Path, target: Path) -> None:
    """Rename the finished ``temp`` to ``target`` (a previous checkpoint there first
    aside, then deleted), and remove leftovers of interrupted saves of ``target``."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{secrets.token_hex(4)}")
        os.rename(target, old)
    os.rename(temp, target)
    fsync_folder(target.parent)
    for leftover in target.parent.glob(glob.escape(f".{target.name}.") + "*"):
        if leftover.name.startswith((f".{target.name}.tmp-", f".{target.name}.old-")):
            shutil.rmtree(leftover, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder for ``path``: ``path`` when it holds a manifest, else the
    previous checkpoint a save interrupted between its two renames left beside it.
    :class:`~hapd.errors.CheckpointError` when there is none."""
    target = Path(path)
    if (target / MANIFEST).is_file():
        return target
    aside = sorted(target.parent.glob(glob.escape(f".{target.name}.old-") + "*"), key=lambda p: p.stat().st_mtime,
                   reverse=True)
    for candidate in aside:
        if (candidate / MANIFEST).is_file():
            return candidate
    if not target.exists():
        raise CheckpointError(f"no checkpoint at {target}: it does not exist")
    raise CheckpointError(f"no checkpoint at {target}: it has no {MANIFEST} (not a checkpoint, or its save did not "
                          "finish)")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``."""
    folder = find_checkpoint(path)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / MANIFEST}: {exc}") from exc
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{folder}: format {manifest.get('format')!r} version {manifest.get('version')!r}, this "
                              f"hapd reads {FORMAT!r} version {FORMAT_VERSION}")
    return manifest


def load_checkpoint(path: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    sampler: Any = None) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``module`` (a ParallelModule of any world
    size, profile and plan, or a plain single-device module), ``optimizer`` (of the same
    kind and param groups as the saved one), ``sampler`` (``load_state_dict``) and this
    rank's RNG. Collective. Returns ``{"step": int, "extra": dict}``."""
    folder = find_checkpoint(path)
    manifest = read_manifest(folder)
    metadata = dcp.FileSystemReader(folder).read_metadata()
    saved = metadata.state_dict_metadata
    job = _job(module)
    held = held_tensors(module)
    _check_model_keys(held, saved, folder)
    state, pieces = _model_request(held)
    if optimizer is not None:
        if GROUPS not in saved:
            raise CheckpointError(f"{folder} holds no optimizer state")
        optim_state, optim_pieces = _optimizer_request(optimizer, held, saved)
        state.update(optim_state)
        pieces.update(optim_pieces)
    state[EXTRA] = None
    rng_key = f"{RNG}{job.rank}"
    if rng_key in saved:
        state[rng_key] = None
    if sampler is not None:
        if SAMPLER not in saved:
            raise CheckpointError(f"{folder} holds no sampler state")
        state[SAMPLER] = None
    with _quiet_dcp():
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder), planner=PieceLoadPlanner(pieces),
                 process_group=job.group, no_dist=not job.distributed)
    _copy_model(held, state)
    if optimizer is not None:
        _load_optimizer(optimizer, held, state, saved)
    if sampler is not None:
        sampler.load_state_dict(state[SAMPLER])
    _set_rng(state.get(rng_key), int(manifest.get("seed", 0)) + job.rank)
    return {"step": int(state[EXTRA]["step"]), "extra": dict(state[EXTRA]["extra"])}


def _check_model_keys(held: list[Held], saved: Mapping[str, Any], folder: Path) -> None:
    mine = {MODEL + h.key for h in held}
    theirs = {k for k in saved if k.startswith(MODEL)}
    missing, unexpected = sorted(mine - theirs), sorted(theirs - mine)
    if missing or unexpected:
        raise CheckpointError(f"{folder} is of another model: missing {[k[len(MODEL):] for k in missing[:8]]}, "
                              f"unexpected {[k[len(MODEL):] for k in unexpected[:8]]}")
    for h in held:
        md = saved[MODEL + h.key]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != h.size:
            raise CheckpointError(f"{h.key}: the checkpoint has {_describe(md)}, the model's is {list(h.size)}",
                                  node=h.key)


def _model_request(held: Iterable[Held]) -> tuple[dict[str, Any], dict]:
    """Fresh CPU tensors, shaped like this rank's pieces, for DCP to read into."""
    state: dict[str, Any] = {}
    pieces: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for h in held:
        key = MODEL + h.key
        if h.partial and h.local.numel() == 0:
            continue
        state[key] = torch.empty(h.local.shape, dtype=h.local.dtype)
        if h.partial:
            pieces[key] = (h.offsets, h.size)
    return state, pieces


def _optimizer_request(optimizer: torch.optim.Optimizer, held: list[Held],
                       saved: Mapping[str, Any]) -> tuple[dict[str, Any], dict]:
    """What to read of the optimizer state: this rank's pieces of states split like
    their parameter, whole scalars, objects (``None``: DCP fills them in). A rank whose
    piece of a parameter is empty reads nothing of it."""
    state: dict[str, Any] = {GROUPS: None}
    pieces: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for found in _param_keys(optimizer, held):
        for h, _param in found:
            for key in _saved_states(saved, h.key):
                md = saved[key]
                if isinstance(md, BytesStorageMetadata):
                    state[key] = None
                elif h.partial and tuple(md.size) == h.size:  # split like the parameter
                    if h.local.numel():
                        state[key] = torch.empty(h.local.shape, dtype=md.properties.dtype)
                        pieces[key] = (h.offsets, h.size)
                else:
                    state[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
    return state, pieces


def _saved_states(saved: Mapping[str, Any], key: str) -> list[str]:
    """The checkpoint's optimizer-state keys of parameter ``key``."""
    prefix = f"{OPTIM}{key}/"
    return sorted(k for k in saved if k.startswith(prefix))


@torch.no_grad()
def _copy_model(held: Iterable[Held], state: Mapping[str, Any]) -> None:
    for h in held:
        value = state.get(MODEL + h.key)
        if value is not None:
            h.local.copy_(value.to(h.local.device))


def _load_optimizer(optimizer: torch.optim.Optimizer, held: list[Held], state: Mapping[str, Any],
                    saved: Mapping[str, Any]) -> None:
    """Hand the loaded pieces to ``optimizer.load_state_dict`` (which casts them to each
    parameter's device and dtype as torch does), keyed by this optimizer's own ids."""
    groups = _param_keys(optimizer, held)
    saved_groups = state[GROUPS]
    if len(saved_groups) != len(groups):
        raise CheckpointError(f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one "
                              f"{len(groups)}")
    current = optimizer.state_dict()
    per_param: dict[int, dict[str, Any]] = {}
    new_groups = []
    for g, (found, saved_group, group) in enumerate(zip(groups, saved_groups, current["param_groups"])):
        keys = [h.key for h, _ in found]
        if sorted(keys) != sorted(saved_group["params"]):
            raise CheckpointError(f"param group {g} holds other parameters than the checkpoint's: "
                                  f"{sorted(set(keys) ^ set(saved_group['params']))[:8]}")
        for (h, param), pid in zip(found, group["params"]):
            prefix = f"{OPTIM}{h.key}/"
            entries = {k[len(prefix):]: state[k] if k in state else torch.empty(param.shape, dtype=param.dtype)
                       for k in _saved_states(saved, h.key)}  # not read: this rank's piece is empty
            if entries:
                per_param[pid] = entries
        new_groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": group["params"]})
    optimizer.load_state_dict({"state": per_param, "param_groups": new_groups})


def _set_rng(saved: Mapping[str, Any] | None, seed: int) -> None:
    if saved is None:
        torch.manual_seed(seed)
        return
    torch.set_rng_state(saved["cpu"])
    if "cuda" in saved and torch.cuda.is_available():
        torch.cuda.set_rng_state(saved["cuda"])


# --------------------------------------------------------------------------------------
# The single-device state dict as safetensors
# --------------------------------------------------------------------------------------

SAFETENSORS_NAME = "model.safetensors"


def _file_of(path: str | Path) -> Path:
    """``path`` itself when it names a ``.safetensors`` file, else ``path/model.safetensors``."""
    path = Path(path)
    return path if path.suffix == ".safetensors" else path / SAFETENSORS_NAME


def _single_device_state(module: nn.Module) -> dict[str, Tensor]:
    from hapd.runtime.api import ParallelModule

    if isinstance(module, ParallelModule):
        return module.full_state_dict()
    return {k: v.detach().cpu() for k, v in module.state_dict().items()}


def export_safetensors(module: nn.Module, path: str | Path, *, strip_prefix: str | None = None,
                       config: Any = None) -> Path:
    """Write the single-device state dict of ``module`` (``full_state_dict()`` of a
    ParallelModule) as a safetensors file: ``path`` when it ends in ``.safetensors``,
    else ``path/model.safetensors``. ``strip_prefix`` drops a prefix every key has
    (``"model."`` for a transformers model in the zoo's ``LanguageModelLoss``);
    ``config`` (a transformers config) is saved beside it (``config.json``), so that
    ``AutoModel.from_pretrained(folder)`` loads it. Tied weights are written under each
    of their names, so a plain ``model.load_state_dict(safetensors.torch.load_file(…))``
    is complete. Collective for a ParallelModule; rank 0 writes. Returns the file."""
    from safetensors.torch import save

    state = _single_device_state(module)
    if strip_prefix:
        state = _strip(state, strip_prefix)
    job = _job(module)
    target = _file_of(path)
    error = None
    if job.rank == 0:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}  # no shared storage
            atomic_write(target, save(tensors, metadata={"format": "pt"}))
            if config is not None:
                config.save_pretrained(target.parent)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    error = job.broadcast(error)
    if error is not None:
        raise CheckpointError(f"could not write {target}: {error}")
    return target


def _strip(state: Mapping[str, Tensor], prefix: str) -> dict[str, Tensor]:
    lacking = sorted(k for k in state if not k.startswith(prefix))
    if lacking:
        raise OptionsError(f"strip_prefix={prefix!r}: keys {lacking[:8]} do not start with it", field="strip_prefix")
    return {k[len(prefix):]: v for k, v in state.items()}


def import_safetensors(module: nn.Module, path: str | Path, *, strip_prefix: str | None = None,
                       strict: bool = True) -> None:
    """Load a single-device safetensors file (as :func:`export_safetensors` or
    transformers' ``save_pretrained`` writes it) into ``module``: every rank reads the
    file and keeps its pieces. ``strip_prefix``: the prefix the module's keys have and
    the file's lack. A tied weight the file holds under one of its names only is loaded
    under every name."""
    from safetensors.torch import load_file

    file = _file_of(path)
    if not file.is_file():
        raise CheckpointError(f"no safetensors file at {file}")
    state = load_file(str(file))
    if strip_prefix:
        state = {strip_prefix + k: v for k, v in state.items()}
    _fill_tied(module, state)
    from hapd.runtime.api import ParallelModule

    if isinstance(module, ParallelModule):
        module.load_full_state_dict(state, strict=strict)
    else:
        module.load_state_dict(state, strict=strict)


def _fill_tied(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Every name of a tied tensor, from whichever of its names ``state`` has."""
    from hapd.runtime.api import ParallelModule

    by_id: dict[int, list[str]] = {}
    if isinstance(module, ParallelModule):
        params = dict(module.inner.named_parameters(remove_duplicate=False))
        for key in module.inner.hapd_params:
            by_id.setdefault(id(params[key]), []).append(key)
    else:
        for key, tensor in module.state_dict(keep_vars=True).items():
            by_id.setdefault(id(tensor), []).append(key)
    groups = list(by_id.values())
    for key, target in getattr(module, "aliases", {}).items():  # names the rank module does not hold
        group = next((g for g in groups if target in g), None)
        if group is None:
            group = [target]
            groups.append(group)
        group.append(key)
    for group in groups:
        present = next((k for k in group if k in state), None)
        if present is not None:
            for k in group:
                state.setdefault(k, state[present])


__all__ = ["CheckpointError", "Held", "PieceLoadPlanner", "PieceSavePlanner", "export_safetensors",
           "find_checkpoint", "held_tensors", "import_safetensors", "load_checkpoint", "read_manifest",
           "save_checkpoint"]
