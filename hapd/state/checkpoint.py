"""Sharded checkpoints that load on another world size, profile and plan.

    hapd.save_checkpoint("ckpt/run", module, optimizer, sampler=loader, step=step,
                         extra={"scheduler": scheduler.state_dict()})     # collective
    state = hapd.load_checkpoint("ckpt/run", module, optimizer, sampler=loader)
    step = state["step"]

The format (:mod:`hapd.state.checkpoint_format`) is ``torch.distributed.checkpoint``
(DCP): every rank writes its own pieces in parallel, under the single-device model's
names and shapes, each as a DCP chunk with its global offsets; rank 0 writes DCP's
``.metadata`` and hapd's manifest ``hapd.json``. Loading asks DCP for the pieces *this*
rank's plan holds (:func:`held_tensors`), and DCP's resharding reads the overlapping
parts of whatever pieces were saved: any world size, profile or plan, one process
without a process group included. A checkpoint holds the model's parameters and
buffers, the optimizer state split like its parameter, the sampler's state, every
rank's RNG state and ``extra``. A rank that did not exist when the checkpoint was
written is seeded with ``seed + rank`` (the manifest's global seed): a fresh stream,
not a continuation (dropout masks on another plan differ anyway).

Writes are atomic: the ranks write into a hidden sibling folder
(``.<name>.tmp-<tag>``); only after every rank finished, DCP wrote its metadata and rank
0 its manifest does rank 0 rename it into place (a previous checkpoint at the path is
first renamed aside, then deleted). A crash before that leaves the previous
checkpoint; a crash between the two renames leaves it at ``.<name>.old-<tag>``, where
:func:`load_checkpoint` finds it. Ranks on several hosts need a shared file system.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from hapd import __version__
from hapd.errors import CheckpointError, OptionsError
from hapd.state.checkpoint_format import (
    ASIDE,
    EXTRA,
    GROUPS,
    MANIFEST,
    MODEL,
    OPTIM,
    RNG,
    SAMPLER,
    TEMP,
    file_digests,
    find_checkpoint,
    read_manifest,
    safetensors_file,
    sibling,
    siblings,
    verify_files,
    write_manifest,
)
from hapd.state.checkpoint_planners import PieceLoadPlanner, PieceSavePlanner, describe_entry, quiet_dcp
from hapd.state.held import STEP, Held, HoldsPieces, whole
from hapd.util import atomic_write, fsync_folder

# --------------------------------------------------------------------------------------
# What a module holds: each tensor's local piece and where it lies in the whole
# --------------------------------------------------------------------------------------


def held_tensors(module: nn.Module) -> list[Held]:
    """Every parameter and buffer ``module`` (one that holds a rank's pieces,
    :class:`~hapd.state.held.HoldsPieces`, or a plain single-device module) holds, once
    each, in name order."""
    if isinstance(module, HoldsPieces):
        return module.held_tensors()
    first: dict[int, str] = {}
    state = module.state_dict(keep_vars=True)
    for key in sorted(state):
        first.setdefault(id(state[key]), key)
    return [whole(key, state[key]) for key in sorted(state) if first[id(state[key])] == key]


# --------------------------------------------------------------------------------------
# The ranks a checkpoint is saved or loaded by: rank, world, group
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Ranks:
    """The ranks that save or load a checkpoint together."""

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


def _ranks(module: nn.Module) -> _Ranks:
    group = module.group if isinstance(module, HoldsPieces) else None
    if dist.is_available() and dist.is_initialized():
        return _Ranks(dist.get_rank(group), dist.get_world_size(group), group, True)
    return _Ranks(0, 1, None, False)


# --------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------


def save_checkpoint(path: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    sampler: Any = None, step: int = 0, extra: dict | None = None, scaler: Any = None) -> Path:
    """Write a checkpoint of ``module`` (a ParallelModule, or a plain single-device
    module), ``optimizer``, ``sampler`` (anything with ``state_dict()``: a
    :class:`~hapd.train.data.RankLoader` or sampler), ``scaler`` (a
    :class:`hapd.GradScaler` or ``torch.amp.GradScaler``: its scale is the same on every
    rank, rank 0's is kept), the RNG, ``step`` and ``extra`` to the folder ``path``,
    replacing a checkpoint there all at once. Collective: every rank calls it and writes
    its own pieces. Returns ``path``."""
    target = Path(path)
    if scaler is not None:
        extra = {**(extra or {}), SCALER_KEY: dict(scaler.state_dict())}
    ranks = _ranks(module)
    held = held_tensors(module)
    temp = _temp_folder(target, ranks)
    try:
        _write_pieces(temp, module, held, optimizer, sampler, step, extra, ranks)
    except BaseException as exc:
        if ranks.rank == 0:  # DCP raises on every rank once every rank is done writing
            shutil.rmtree(temp, ignore_errors=True)
        if isinstance(exc, (Exception, CheckpointException)):  # a full disk, an unwritable folder
            raise CheckpointError(f"could not write the checkpoint for {target}: {_first_line(exc)}"
                                  f"{_disk_note(target)}") from exc
        raise
    error = None
    if ranks.rank == 0:
        try:
            _write_manifest(temp, module, held, ranks, step, optimizer)
            _publish(temp, target)
        except OSError as exc:
            shutil.rmtree(temp, ignore_errors=True)
            error = f"{type(exc).__name__}: {exc}"
    error = ranks.broadcast(error)  # also: no rank returns before the checkpoint is in place
    if error is not None:
        raise CheckpointError(f"could not put the checkpoint in place at {target}: {error}{_disk_note(target)}")
    return target


FULL_BELOW_BYTES = 64 * 2**20
"""Free bytes below which a failed write is put down to a full disk."""


def _disk_note(target: Path) -> str:
    """What the file system holding ``target`` has free, when a write there failed: a
    full disk fails a write with ``ENOSPC`` or, inside torch's serializer, with an
    error that does not say so (``unexpected pos 704 vs 598``)."""
    folder = next((p for p in (target, *target.parents) if p.exists()), None)
    if folder is None:
        return ""
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    if free < FULL_BELOW_BYTES:
        return (f"; the disk holding {folder} is full ({free / 2**20:.1f} MiB free): free space there or save "
                "elsewhere")
    return f" ({free / 2**30:.1f} GiB free on the disk holding {folder})"


def _write_pieces(folder: Path, module: nn.Module, held: list[Held], optimizer: torch.optim.Optimizer | None,
                  sampler: Any, step: int, extra: dict | None, ranks: _Ranks) -> None:
    """Every rank writes its pieces (model, optimizer, its RNG; rank 0 the step, ``extra``
    and the sampler) into ``folder`` with DCP (collective); rank 0 also DCP's metadata."""
    state, pieces = _model_state(held)
    if optimizer is not None:
        optim_state, optim_pieces = _optimizer_state(optimizer, held, ranks)
        state.update(optim_state)
        pieces.update(optim_pieces)
    state[f"{RNG}{ranks.rank}"] = _rng_state()
    if ranks.rank == 0:
        state[EXTRA] = {"step": int(step), "extra": dict(extra or {}), "draws": draw_count(module)}
        if sampler is not None:
            state[SAMPLER] = sampler.state_dict()
    with quiet_dcp():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, thread_count=1), planner=PieceSavePlanner(pieces),
                 process_group=ranks.group, no_dist=not ranks.distributed)


def snapshot_files(folder: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                   sampler: Any = None, step: int = 0, extra: dict | None = None) -> dict[str, bytes]:
    """This rank's files of a checkpoint of the same content as :func:`save_checkpoint`,
    written in ``folder`` *on this rank's own host* (each rank makes it; no shared file
    system is needed) and returned as bytes: this rank's DCP file, and on rank 0 also
    DCP's metadata and the manifest, whose digests cover every rank's files (gathered).
    The files of every rank of one call, put in one folder, are a checkpoint
    :func:`load_checkpoint` reads on any world size (:mod:`hapd.elastic.resume` keeps
    them in the daemons' memory). Collective."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ranks = _ranks(module)
    held = held_tensors(module)
    before = {p.name for p in folder.iterdir()}
    try:
        _write_pieces(folder, module, held, optimizer, sampler, step, extra, ranks)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"could not write the snapshot in {folder}: {_first_line(exc)}") from exc
    mine = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name not in before and p.name != MANIFEST)
    digests = file_digests(folder, mine)
    if ranks.distributed:
        every: list[Any] = [None] * ranks.world
        dist.all_gather_object(every, digests, group=ranks.group)
    else:
        every = [digests]
    if ranks.rank == 0:
        merged = {name: digest for part in every for name, digest in part.items()}
        _write_manifest(folder, module, held, ranks, step, optimizer, files=merged)
        mine.append(MANIFEST)
    return {name: (folder / name).read_bytes() for name in mine}


def _first_line(exc: BaseException) -> str:
    """What went wrong, in one line: the first failure of any rank DCP collected (its
    ``CheckpointException`` holds them by rank), else the exception's own text."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        rank, failure = sorted(failures.items(), key=lambda kv: kv[0])[0]
        cause = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _model_state(held: Iterable[Held]) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
    state: dict[str, Any] = {}
    pieces: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for h in held:
        key = MODEL + h.key
        if (h.partial and h.local.numel() == 0) or not h.writes:
            continue  # this rank holds nothing of it, or another rank writes it
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


def _optimizer_state(optimizer: torch.optim.Optimizer, held: Iterable[Held], ranks: _Ranks) -> tuple[dict, dict]:
    state: dict[str, Any] = {}
    pieces: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    groups = _param_keys(optimizer, held)
    for h, name, key, value in _state_entries(optimizer, groups):
        if not h.writes:
            continue
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
    state[GROUPS] = [{**{k: v for k, v in group.items() if k != "params"}, "params": keys}
                     for group, keys in zip(optimizer.param_groups, _group_keys(groups, ranks))]
    return state, pieces


def optimizer_held(optimizer: torch.optim.Optimizer, held: Iterable[Held]) -> tuple[list[Held], dict[str, Any]]:
    """This rank's optimizer state under the keys checkpoints give it
    (``optim/<parameter>/<state>``): each tensor as a :class:`Held` — split like its
    parameter (Adam's ``exp_avg``) or whole (a scalar ``step``) — and the values that are
    not tensors. Every holder's, those another rank writes included (an in-memory copy,
    :mod:`hapd.elastic.step_copy`, keeps what each rank holds)."""
    tensors: list[Held] = []
    objects: dict[str, Any] = {}
    for h, name, key, value in _state_entries(optimizer, _param_keys(optimizer, held)):
        if not isinstance(value, Tensor):
            objects[key] = value
            continue
        placed = _state_placement(h, name, value)
        tensors.append(whole(key, value) if placed is None else Held(key, value, placed.offsets, placed.size))
    return tensors, objects


def _state_entries(optimizer: torch.optim.Optimizer, groups: Iterable[Iterable[tuple[Held, Any]]]
                   ) -> Iterator[tuple[Held, str, str, Any]]:
    """(its parameter's entry, the state's name, its checkpoint key ``optim/<parameter>/<state>``,
    its value) of every optimizer state of the parameters ``groups`` pair with their entries."""
    for found in groups:
        for h, param in found:
            for name, value in optimizer.state.get(param, {}).items():
                yield h, name, f"{OPTIM}{h.key}/{name}", value


def optimizer_parameters(optimizer: torch.optim.Optimizer, held: Iterable[Held]) -> list[Held]:
    """What ``held`` says of each parameter of ``optimizer``, group by group."""
    return [h for found in _param_keys(optimizer, held) for h, _ in found]


def optimizer_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings but its parameters (what a checkpoint keeps of
    ``optim/param_groups``: a scheduler's ``lr`` among them)."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def load_optimizer_entries(module: nn.Module, optimizer: torch.optim.Optimizer, entries: Mapping[str, Any],
                           hyperparameters: list[dict[str, Any]], *, keys: Iterable[str] | None = None) -> None:
    """Load optimizer state given by checkpoint key (``optim/<parameter>/<state>``: this
    rank's pieces and whole values) and each group's settings into ``optimizer``, as
    :func:`load_checkpoint` does after reading them. ``keys``: every state key of the
    whole model (default: ``entries``'): a parameter whose piece here is empty gets
    empty states under them."""
    held = held_tensors(module)
    groups = _param_keys(optimizer, held)
    if len(hyperparameters) != len(groups):
        raise CheckpointError(f"the optimizer state has {len(hyperparameters)} param groups, this optimizer "
                              f"{len(groups)}")
    saved_groups = [{**settings, "params": [h.key for h, _ in found]} for settings, found in zip(hyperparameters, groups)]
    saved = dict.fromkeys(entries if keys is None else keys)
    _load_optimizer(optimizer, held, {**entries, GROUPS: saved_groups}, saved,
                    every=set(model_sizes(module, held)) == {h.key for h in held})


def _group_keys(groups: list[list[tuple[Held, Tensor]]], ranks: _Ranks) -> list[list[str]]:
    """Each param group's parameter keys over every rank (a pipeline's ranks each hold
    their stage's), in first-seen order."""
    mine = [[h.key for h, _ in found] for found in groups]
    if not ranks.distributed:
        return mine
    everyone: list[Any] = [None] * ranks.world
    dist.all_gather_object(everyone, mine, group=ranks.group)
    out: list[list[str]] = [[] for _ in mine]
    for theirs in everyone:
        if len(theirs) != len(mine):
            raise CheckpointError(f"the ranks' optimizers have {len(mine)} and {len(theirs)} param groups")
        for keys, more in zip(out, theirs):
            keys += [k for k in more if k not in keys]
    return out


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"cpu": torch.get_rng_state(), "seed": torch.initial_seed()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _temp_folder(target: Path, ranks: _Ranks) -> Path:
    """The hidden folder rank 0 made beside ``target`` for every rank to write into
    (collective: a refusal on rank 0 is an error on every rank)."""
    made: tuple[str | None, str | None] = (None, None)
    if ranks.rank == 0:
        try:
            made = (str(_prepare(target)), None)
        except (CheckpointError, OSError) as exc:
            made = (None, str(exc))
    temp, error = ranks.broadcast(made)
    if error is not None:
        raise CheckpointError(error)
    return Path(temp)


def _prepare(target: Path) -> Path:
    """A fresh hidden folder beside ``target`` to write into (rank 0)."""
    if target.exists() and not (target / MANIFEST).is_file():
        if not target.is_dir() or any(target.iterdir()):
            raise CheckpointError(f"{target} exists and is not a hapd checkpoint: not replacing it")
    target.parent.mkdir(parents=True, exist_ok=True)
    temp = sibling(target, TEMP)
    temp.mkdir()
    return temp


def _write_manifest(folder: Path, module: nn.Module, held: list[Held], ranks: _Ranks, step: int,
                    optimizer: torch.optim.Optimizer | None, *, files: Mapping[str, str] | None = None) -> None:
    plan = getattr(module, "plan", None)
    layouts = module.parameter_layouts() if hasattr(module, "parameter_layouts") else {}
    write_manifest(folder, {
        "step": int(step),
        "world": ranks.world,
        "seed": torch.initial_seed(),
        "graph_id": plan.key.get("graph_id") if plan is not None else None,
        "layouts": layouts,
        "model": {k: list(v) for k, v in model_sizes(module, held).items()},
        "hapd": __version__,
        "torch": torch.__version__,
        "saved_at": time.time(),
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
    }, files=files)


def _publish(temp: Path, target: Path) -> None:
    """Rename the finished ``temp`` to ``target`` (a previous checkpoint there first
    aside, then deleted), and remove leftovers of interrupted saves of ``target``."""
    old = None
    if target.exists():
        old = sibling(target, ASIDE)
        os.rename(target, old)
    os.rename(temp, target)
    fsync_folder(target.parent)
    for leftover in siblings(target, TEMP) + siblings(target, ASIDE):
        shutil.rmtree(leftover, ignore_errors=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------


def load_checkpoint(path: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    sampler: Any = None, scaler: Any = None) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``module`` (a ParallelModule of any world
    size, profile and plan, or a plain single-device module), ``optimizer`` (of the same
    kind and param groups as the saved one), ``sampler`` (``load_state_dict``),
    ``scaler`` (a grad scaler: the saved scale and growth tracker, on any world size) and
    this rank's RNG. Collective. Returns ``{"step": int, "extra": dict}``."""
    loaded = _load_checkpoint(path, module, optimizer, sampler=sampler)
    state = loaded["extra"].pop(SCALER_KEY, None)
    if scaler is not None:
        if state is None:
            raise CheckpointError(f"{path} holds no grad scaler state (saved without scaler=)")
        scaler.load_state_dict(state)
    return loaded


def _load_checkpoint(path: str | Path, module: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                     sampler: Any) -> dict[str, Any]:
    """:func:`load_checkpoint` but the grad scaler."""
    folder = find_checkpoint(path)
    manifest = read_manifest(folder)
    verify_files(folder, manifest)
    try:
        metadata = dcp.FileSystemReader(folder).read_metadata()
    except Exception as exc:  # a damaged .metadata: an unpickling error naming no file
        raise CheckpointError(f"{folder}: cannot read DCP's .metadata: {type(exc).__name__}: {exc}") from exc
    saved = metadata.state_dict_metadata
    ranks = _ranks(module)
    held = held_tensors(module)
    _check_model_keys(held, model_sizes(module, held), saved, folder,  # another model first: it says most
                      unsaved=_non_persistent_buffers(module))
    if optimizer is not None and manifest.get("optimizer") not in (None, type(optimizer).__name__):
        raise CheckpointError(f"{folder} holds the state of a {manifest['optimizer']} optimizer, not of a "
                              f"{type(optimizer).__name__}")
    state, pieces = _model_request(held)
    if optimizer is not None:
        if GROUPS not in saved:
            raise CheckpointError(f"{folder} holds no optimizer state")
        optim_state, optim_pieces = _optimizer_request(optimizer, held, saved)
        state.update(optim_state)
        pieces.update(optim_pieces)
    state[EXTRA] = None
    rng_key = f"{RNG}{ranks.rank}"
    if rng_key in saved:
        state[rng_key] = None
    if sampler is not None:
        if SAMPLER not in saved:
            raise CheckpointError(f"{folder} holds no sampler state")
        state[SAMPLER] = None
    try:
        with quiet_dcp():
            dcp.load(state, storage_reader=dcp.FileSystemReader(folder), planner=PieceLoadPlanner(pieces),
                     process_group=ranks.group, no_dist=not ranks.distributed)
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"{folder}: reading the checkpoint failed: {_first_line(exc)}") from exc
    _copy_model(held, state)
    if optimizer is not None:
        _load_optimizer(optimizer, held, state, saved, every=set(model_sizes(module, held)) == {h.key for h in held})
    if sampler is not None:
        sampler.load_state_dict(state[SAMPLER])
    _set_rng(state.get(rng_key), int(manifest.get("seed", 0)) + ranks.rank)
    set_draw_count(module, state[EXTRA].get("draws"))
    return {"step": int(state[EXTRA]["step"]), "extra": dict(state[EXTRA]["extra"])}


SCALER_KEY = "hapd_grad_scaler"
"""The key of a grad scaler's state in a checkpoint's ``extra``."""


def draw_count(module: nn.Module) -> int | None:
    """The counter-based generator's step (:data:`~hapd.state.held.STEP`: the
    forwards run so far) of ``module``'s programs; None when none draws with it."""
    counts = [int(getattr(m, STEP)) for m in _draw_holders(module)]
    return max(counts) if counts else None


def set_draw_count(module: nn.Module, count: int | None) -> None:
    """Set every program's counter-based step to ``count`` (a checkpoint's), so that a
    resumed run drops what the uninterrupted run drops; nothing for a checkpoint
    saved without one."""
    if count is None:
        return
    for holder in _draw_holders(module):
        old = getattr(holder, STEP)
        setattr(holder, STEP, torch.full((), int(count), dtype=old.dtype, device=old.device))


def _draw_holders(module: nn.Module) -> list[nn.Module]:
    """The modules that hold a counter-based step (every program of a rank)."""
    return [m for m in module.modules() if isinstance(getattr(m, STEP, None), Tensor)]


def model_sizes(module: nn.Module, held: Iterable[Held]) -> dict[str, tuple[int, ...]]:
    """Every state-dict key of the whole model and its shape: what ``module`` says
    (``state_sizes()``: a pipeline's rank holds only its stage's), else what it holds."""
    sizes = getattr(module, "state_sizes", None)
    if callable(sizes):
        return {k: tuple(v) for k, v in sizes().items()}
    return {h.key: tuple(h.size) for h in held}


def _non_persistent_buffers(module: nn.Module) -> set[str]:
    """The buffers a plain module keeps out of its state dict (``persistent=False``, as
    transformers' rotary ``inv_freq``); a ParallelModule holds every buffer of its
    program, so its checkpoints have them."""
    if isinstance(module, HoldsPieces):
        return set()
    return {name for name, _ in module.named_buffers()} - set(module.state_dict())


def _check_model_keys(held: list[Held], sizes: Mapping[str, tuple[int, ...]], saved: Mapping[str, Any],
                      folder: Path, unsaved: set[str] = frozenset()) -> None:
    mine = {MODEL + k for k in sizes}
    theirs = {k for k in saved if k.startswith(MODEL) and k[len(MODEL):] not in unsaved}
    missing, unexpected = sorted(mine - theirs), sorted(theirs - mine)
    if missing or unexpected:
        raise CheckpointError(f"{folder} is of another model: missing {[k[len(MODEL):] for k in missing[:8]]}, "
                              f"unexpected {[k[len(MODEL):] for k in unexpected[:8]]}")
    for h in held:
        md = saved[MODEL + h.key]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != h.size:
            raise CheckpointError(f"{h.key}: the checkpoint has {describe_entry(md)}, the model's is {list(h.size)}",
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
                    saved: Mapping[str, Any], *, every: bool = True) -> None:
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
        # a module holding every tensor has every parameter of the group; a pipeline's
        # rank, its stage's
        if (sorted(keys) != sorted(saved_group["params"])) if every else not set(keys) <= set(saved_group["params"]):
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

def _single_device_state(module: nn.Module) -> dict[str, Tensor]:
    if isinstance(module, HoldsPieces):
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
    from safetensors.torch import save  # optional (not a dependency of hapd): only when a file is written

    state = _single_device_state(module)
    if strip_prefix:
        state = _strip(state, strip_prefix)
    ranks = _ranks(module)
    target = safetensors_file(path)
    error = None
    if ranks.rank == 0:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tensors = {k: v.detach().cpu().contiguous().clone() for k, v in state.items()}  # no shared storage
            atomic_write(target, save(tensors, metadata={"format": "pt"}))
            if config is not None:
                config.save_pretrained(target.parent)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
    error = ranks.broadcast(error)
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
    from safetensors.torch import load_file  # optional (not a dependency of hapd): only when a file is read

    file = safetensors_file(path)
    if not file.is_file():
        raise CheckpointError(f"no safetensors file at {file}")
    state = load_file(str(file))
    if strip_prefix:
        state = {strip_prefix + k: v for k, v in state.items()}
    _fill_tied(module, state)
    if isinstance(module, HoldsPieces):
        module.load_full_state_dict(state, strict=strict)
    else:
        module.load_state_dict(state, strict=strict)


def _fill_tied(module: nn.Module, state: dict[str, Tensor]) -> None:
    """Every name of a tied tensor, from whichever of its names ``state`` has."""
    if isinstance(module, HoldsPieces):
        groups = module.tied_names()
    else:
        by_id: dict[int, list[str]] = {}
        for key, tensor in module.state_dict(keep_vars=True).items():
            by_id.setdefault(id(tensor), []).append(key)
        groups = list(by_id.values())
    for group in groups:
        present = next((k for k in group if k in state), None)
        if present is not None:
            for k in group:
                state.setdefault(k, state[present])


__all__ = ["export_safetensors", "held_tensors", "import_safetensors", "load_checkpoint", "load_optimizer_entries",
           "optimizer_held", "optimizer_hyperparameters", "optimizer_parameters", "save_checkpoint"]
