"""Weights for a model exported without them: each rank materializes only its pieces.

A model too large for one host is built on the meta device, exported and compiled
from shapes alone (:func:`hapd.export` takes a meta model), and each rank then reads
its own pieces of every parameter and buffer from a *weight source*, one tensor at a
time, instead of slicing the program's state dict::

    with hapd.init_on_meta():                     # parameters on meta, buffers real
        model = Model(config)
    module = hapd.parallelize(model, batch, weights=hapd.module_init(model, seed=0))
    module = hapd.parallelize(model, batch, weights="model.safetensors")   # or a file
    module = hapd.parallelize(model, batch, weights="ckpt/step-1000")      # or a checkpoint

The sources (:class:`WeightSource`, what :func:`weight_source` accepts):

* an **initializer** (:class:`Initializer`): a callable ``(name, like) -> full tensor``
  (``like``: a meta tensor of the full shape and dtype); the rank keeps its slice and
  drops the full tensor before the next one. :func:`module_init` is the natural one:
  the module owning the tensor is cloned alone (its own parameters and buffers, no
  children) on a real device and re-initialized (``reset_parameters()``, or ``init=``),
  with the RNG seeded from ``seed`` and the tensor's name.
* a **safetensors file** (:class:`SafetensorsWeights`): ``get_slice(name)[start:stop]``
  reads only the rank's rows or columns. Names are the single-device state dict's
  (``full_state_dict()``, :func:`hapd.export_safetensors`).
* a **hapd checkpoint** (:class:`CheckpointWeights`): each piece read alone through
  ``torch.distributed.checkpoint`` (no collectives), whatever world size wrote it.

A list of sources is tried in order (:class:`Chain`); a source answers ``None`` for a
name it does not have.

**Host memory.** A rank holds its pieces plus, while one tensor is read: the full
tensor for an initializer (with :func:`module_init`, the owning module's own tensors:
a linear's weight and bias), the rank's slice for a safetensors file, the saved chunks
overlapping the slice for a checkpoint. So its peak is about its shards plus the
largest single parameter, never the model.

**What an initializer guarantees.** Every rank computes the same full value of each
tensor (the seed depends on the name only, not on the rank, world size, plan or
order), so the pieces are exactly the slices of the single-device model that
:func:`materialize` builds from the same source. :func:`module_init` equals a model
initialized by its own constructor only where the constructor's init is per module
(each module's ``reset_parameters()``, or ``init=``) and seeded the same way; init
written in a parent's constructor (``nn.init.uniform_(self.embed.weight)`` in the
model's ``__init__``) is not replayed — pass ``init=`` for that.
"""

from __future__ import annotations

import copy
import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from hapd.ir.export import on_meta
from hapd.errors import CheckpointError, WeightsError
from hapd.state.checkpoint_format import (
    MANIFEST,
    MODEL,
    SAFETENSORS_NAME,
    find_checkpoint,
    read_manifest,
    safetensors_file,
    verify_files,
)

Region = tuple[int, int, int]
"""``(dim, start, length)``: the slice of a tensor a rank holds along one dim."""

Init = Callable[[nn.Module], None]
"""Re-initializes one module's own parameters and buffers in place."""


class WeightSource:
    """Where a rank's pieces of the parameters and buffers come from."""

    def read(self, names: Sequence[str], like: Tensor, region: Region | None) -> Tensor | None:
        """The value of the tensor named ``names[0]`` (a tied tensor's other names
        follow), of ``like``'s shape and dtype, or only its ``region``: a fresh CPU
        tensor that shares no storage with anything the source keeps. ``None`` when
        this source does not have it."""
        raise NotImplementedError


def _cut(full: Tensor, region: Region | None) -> Tensor:
    """``region`` of ``full`` as a fresh tensor (the whole of it without a region)."""
    if region is None:
        return full.detach().clone()
    dim, start, length = region
    return full.detach().narrow(dim, start, length).clone()


def _check_like(name: str, got: Tensor, like: Tensor, what: str) -> None:
    if tuple(got.shape) != tuple(like.shape):
        raise WeightsError(f"{name}: {what} gives shape {list(got.shape)}, the model's is {list(like.shape)}",
                           node=name)


# --------------------------------------------------------------------------------------
# Initializers
# --------------------------------------------------------------------------------------


class Initializer(WeightSource):
    """Full tensors from ``fn(name, like)`` (``None``: not this source's), one at a time:
    the rank keeps its slice and the full tensor is dropped before the next."""

    def __init__(self, fn: Callable[[str, Tensor], Tensor | None]):
        self.fn = fn

    def read(self, names: Sequence[str], like: Tensor, region: Region | None) -> Tensor | None:
        full = self.fn(names[0], like)
        if full is None:
            return None
        if not isinstance(full, Tensor):
            raise WeightsError(f"{names[0]}: the initializer returned {type(full).__name__}, not a tensor",
                               node=names[0])
        _check_like(names[0], full, like, "the initializer")
        piece = _cut(full, region).to(like.dtype)
        del full
        return piece


def seed_for(seed: int, name: str) -> int:
    """The RNG seed of tensor ``name``: ``seed`` and the name only (the same on every
    rank, world size and plan)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63)


def reset_parameters(module: nn.Module) -> None:
    """The default :data:`Init`: the module's own ``reset_parameters()``."""
    reset = getattr(module, "reset_parameters", None)
    if not callable(reset):
        raise WeightsError(f"{type(module).__name__} has no reset_parameters(): pass init= (a function that "
                           "initializes one module's own parameters in place)")
    reset()


class ModuleInit:
    """The initializer of :func:`module_init` (a callable ``(name, like)``)."""

    def __init__(self, model: nn.Module, seed: int, init: Init | None, device: torch.device):
        self.seed, self.init, self.device = seed, init, device
        self.owners: dict[str, tuple[str, nn.Module, str]] = {}
        """every state name (a tied tensor's each) -> (module name, module, attribute)."""
        self.tied: dict[str, str] = {}
        """every state name -> the name it is seeded by: a tied tensor's smallest."""
        by_tensor: dict[int, list[str]] = {}
        for module_name, module in model.named_modules(remove_duplicate=False):
            for table in (module._parameters, module._buffers):  # noqa: SLF001 - a module's own tensors
                for attr, tensor in table.items():
                    if tensor is None:
                        continue
                    name = f"{module_name}.{attr}" if module_name else attr
                    self.owners[name] = (module_name, module, attr)
                    by_tensor.setdefault(id(tensor), []).append(name)
        for names in by_tensor.values():
            for name in names:
                self.tied[name] = min(names)

    def __call__(self, name: str, like: Tensor) -> Tensor | None:
        owner = self.owners.get(name)
        if owner is None:
            return None
        module_name, module, attr = owner
        tensor = module._parameters.get(attr, module._buffers.get(attr))  # noqa: SLF001
        if not tensor.is_meta:
            return tensor.detach()  # real already (a buffer built under init_on_meta)
        shell = _shell(module, self.device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed_for(self.seed, self.tied.get(name, name)))
            try:
                with torch.no_grad():
                    if self.init is None:
                        reset_parameters(shell)
                    else:
                        if callable(getattr(shell, "reset_parameters", None)):
                            shell.reset_parameters()
                        self.init(shell)
            except WeightsError:
                raise
            except Exception as exc:  # noqa: BLE001 - whatever the model's init raises, said with its name
                raise WeightsError(f"{name}: initializing module {module_name or '(the model)'} "
                                   f"({type(module).__name__}) failed: {type(exc).__name__}: {exc}", node=name) from exc
        value = shell._parameters.get(attr, shell._buffers.get(attr))  # noqa: SLF001
        if value is None or (value.is_floating_point() and value.numel() and bool(value.isnan().all())):
            raise WeightsError(f"{name}: the init of {type(module).__name__} does not set it; build the model under "
                               "hapd.init_on_meta() (buffers stay real) or pass init= or another source", node=name)
        return value.detach()


def _shell(module: nn.Module, device: torch.device) -> nn.Module:
    """A clone of ``module`` alone on ``device``: its own parameters and buffers fresh
    (floating ones NaN until initialized), no children; the original is untouched."""
    shell = copy.copy(module)
    shell._modules = {}  # noqa: SLF001 - a module's own registries, replaced on the clone only
    shell._parameters = {k: None if p is None else nn.Parameter(_blank(p, device), requires_grad=p.requires_grad)
                         for k, p in module._parameters.items()}  # noqa: SLF001
    shell._buffers = {k: None if b is None else _blank(b, device) for k, b in module._buffers.items()}  # noqa: SLF001
    return shell


def _blank(like: Tensor, device: torch.device) -> Tensor:
    """A real tensor like ``like`` on ``device``: NaN when floating (so that one no init
    wrote is seen), else zeros."""
    if like.is_floating_point() or like.is_complex():
        return torch.full(like.shape, math.nan, dtype=like.dtype, device=device)
    return torch.zeros(like.shape, dtype=like.dtype, device=device)


def module_init(model: nn.Module, seed: int = 0, *, init: Init | None = None,
                device: torch.device | str = "cpu") -> Initializer:
    """An :class:`Initializer` for ``model`` built on the meta device: the value of each
    tensor is its owning module cloned alone on ``device`` (its own parameters and
    buffers, no children) and re-initialized, with the RNG seeded by :func:`seed_for`
    (``seed``, the tensor's name; a tied tensor's smallest name), by its
    ``reset_parameters()`` and then ``init`` when given — as a model built by modules'
    constructors and then ``model.apply(init)`` (GPT-2's, transformers'
    ``_init_weights``) is. Without ``init`` a module with parameters must have
    ``reset_parameters()``. A tensor of ``model`` that is real already (a buffer built
    under :func:`init_on_meta`) is its own value."""
    return Initializer(ModuleInit(model, seed, init, torch.device(device)))


@contextmanager
def init_on_meta() -> Iterator[None]:
    """Build models inside with their parameters on the meta device and their buffers
    real (position tables, rotary caches: small, and computed by the constructor, which
    no initializer can replay). Each parameter is moved to meta as it is registered,
    before the constructor initializes it (so init costs nothing and no parameter's
    memory is ever touched). Not thread-safe: it patches ``nn.Module.register_parameter``
    for the duration."""
    original = nn.Module.register_parameter

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


# --------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------


class SafetensorsWeights(WeightSource):
    """Pieces read from a single-device safetensors file, slice by slice
    (``get_slice(name)[..., start:stop]``): only the rank's rows or columns are read.
    ``strip_prefix``: a prefix the model's names have and the file's lack. Values are
    cast to the model's dtype."""

    def __init__(self, path: str | Path, *, strip_prefix: str | None = None):
        from safetensors import safe_open  # optional (not a dependency of hapd): only when a file is read

        self.file = safetensors_file(path)
        if not self.file.is_file():
            raise CheckpointError(f"no safetensors file at {self.file}")
        try:
            self.handle = safe_open(str(self.file), framework="pt")
        except Exception as exc:  # noqa: BLE001 - safetensors' own errors, said with the file
            raise CheckpointError(f"{self.file}: not a safetensors file: {exc}") from exc
        self.keys = set(self.handle.keys())
        self.prefix = strip_prefix or ""

    def read(self, names: Sequence[str], like: Tensor, region: Region | None) -> Tensor | None:
        key = next((k for k in (self._key(n) for n in names) if k in self.keys), None)
        if key is None:
            return None
        piece = self.handle.get_slice(key)
        shape = list(piece.get_shape())
        if shape != list(like.shape):
            raise WeightsError(f"{names[0]}: {self.file} holds it with shape {shape}, the model's is "
                               f"{list(like.shape)}", node=names[0])
        if region is None:
            value = self.handle.get_tensor(key)
        else:
            dim, start, length = region
            value = piece[(slice(None),) * dim + (slice(start, start + length),)]
        return value.to(dtype=like.dtype, memory_format=torch.contiguous_format, copy=True)  # one copy, off the map

    def _key(self, name: str) -> str | None:
        if not name.startswith(self.prefix):
            return None
        return name[len(self.prefix):]


class CheckpointWeights(WeightSource):
    """Pieces read from a hapd checkpoint (:func:`hapd.save_checkpoint`), each alone
    through ``torch.distributed.checkpoint`` (no collectives): DCP reads the saved chunks
    that overlap it, whatever world size and plan wrote them."""

    def __init__(self, path: str | Path):
        # torch.distributed.checkpoint (~0.2 s to import) loads only when a checkpoint is read
        import torch.distributed.checkpoint as dcp

        self.folder = find_checkpoint(path)
        verify_files(self.folder, read_manifest(self.folder))  # every byte as saved, or a CheckpointError naming the file
        self.metadata = dcp.FileSystemReader(self.folder).read_metadata().state_dict_metadata

    def read(self, names: Sequence[str], like: Tensor, region: Region | None) -> Tensor | None:
        import torch.distributed.checkpoint as dcp  # loaded in __init__ already: a lookup
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from hapd.state.checkpoint_planners import PieceLoadPlanner, quiet_dcp

        key = next((MODEL + n for n in names if MODEL + n in self.metadata), None)
        if key is None:
            return None
        md = self.metadata[key]
        if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(like.shape):
            raise WeightsError(f"{names[0]}: the checkpoint at {self.folder} does not hold it with the model's shape "
                               f"{list(like.shape)}", node=names[0])
        shape, offsets = list(like.shape), [0] * like.dim()
        if region is not None:
            dim, offsets[dim], shape[dim] = region
        piece = torch.empty(shape, dtype=md.properties.dtype)
        if piece.numel():
            pieces = {key: (tuple(offsets), tuple(like.shape))} if region is not None else {}
            with quiet_dcp():
                dcp.load({key: piece}, storage_reader=dcp.FileSystemReader(self.folder),
                         planner=PieceLoadPlanner(pieces), no_dist=True)
        return piece.to(like.dtype)


class ModelTensors(WeightSource):
    """The real tensors of a model (a partly meta one: its buffers built under
    :func:`init_on_meta`); ``None`` for a name it holds on meta or not at all."""

    def __init__(self, model: nn.Module):
        self.state = model.state_dict(keep_vars=True)

    def read(self, names: Sequence[str], like: Tensor, region: Region | None) -> Tensor | None:
        tensor = next((self.state[n] for n in names if n in self.state), None)
        if tensor is None or tensor.is_meta:
            return None
        _check_like(names[0], tensor, like, "the model")
        return _cut(tensor, region).cpu()


class Chain(WeightSource):
    """Sources tried in order: the first that has a name gives it."""

    def __init__(self, sources: Sequence[WeightSource]):
        self.sources = list(sources)

    def read(self, names: Sequence[str], like: Tensor, region: Region | None) -> Tensor | None:
        for source in self.sources:
            value = source.read(names, like, region)
            if value is not None:
                return value
        return None


Weights = WeightSource | str | Path | Callable[[str, Tensor], Tensor | None] | Sequence[Any]
"""What ``weights=`` takes (see :func:`weight_source`)."""


# --------------------------------------------------------------------------------------
# Where a rank's weights come from
# --------------------------------------------------------------------------------------


def weight_source(weights: Weights | None, model: nn.Module | None = None) -> WeightSource | None:
    """Where a rank's pieces of the parameters and buffers come from: the one place
    that decides it (:func:`hapd.parallelize`, :func:`hapd.distribute` and
    :func:`materialize` ask here).

    ``weights``: a :class:`WeightSource` as is; a path to a ``.safetensors`` file (or a
    folder with ``model.safetensors``) or to a hapd checkpoint; a callable
    ``(name, like) -> tensor`` (an :class:`Initializer`); a list of these (a
    :class:`Chain`). With ``model`` (the model the program is exported from), its own
    real tensors come after ``weights`` (:class:`ModelTensors`: buffers built under
    :func:`init_on_meta`), and a ``model`` on the meta device without ``weights`` is a
    :class:`~hapd.errors.WeightsError`. ``None``: no source, the pieces are cut from
    the exported program's state dict."""
    source = _source_of(weights)
    if model is None:
        return source
    if source is None:
        if on_meta(model):
            raise WeightsError(f"{type(model).__name__} is on the meta device: pass weights= (hapd.module_init(model), "
                               "a safetensors file or a checkpoint folder) for each rank to read its pieces from")
        return None
    return Chain([source, ModelTensors(model)])


def _source_of(weights: Weights | None) -> WeightSource | None:
    """``weights=`` as a :class:`WeightSource` (see :func:`weight_source`)."""
    if weights is None or isinstance(weights, WeightSource):
        return weights
    if isinstance(weights, (str, Path)):
        path = Path(weights)
        if path.suffix == ".safetensors" or (path / SAFETENSORS_NAME).is_file() and not (path / MANIFEST).is_file():
            return SafetensorsWeights(path)
        find_checkpoint(path)  # a clear error when it is neither
        return CheckpointWeights(path)
    if isinstance(weights, Sequence):
        return Chain([s for s in (_source_of(w) for w in weights) if s is not None])
    if callable(weights):
        return Initializer(weights)
    raise WeightsError(f"weights= takes a weight source, a safetensors file, a checkpoint folder, an initializer "
                       f"(name, like) -> tensor or a list of them, not {type(weights).__name__}")


# --------------------------------------------------------------------------------------
# Pieces for a rank, and whole models for one device
# --------------------------------------------------------------------------------------


def rank_piece(source: WeightSource, names: Sequence[str], like: Tensor, region: Region | None) -> Tensor:
    """This rank's piece of tensor ``names[0]`` (``like``: the program's value, meta or
    real, of the full shape and dtype): from ``source``, else from ``like`` when it is
    real. :class:`~hapd.errors.WeightsError` when neither has it."""
    value = source.read(names, like, region)
    if value is None:
        if like.is_meta:
            raise WeightsError(f"{names[0]}: the weights source does not have it and the program holds it on the "
                               "meta device only", node=names[0])
        return _cut(like, region)
    expected = list(like.shape)
    if region is not None:
        expected[region[0]] = region[2]
    if list(value.shape) != expected:
        raise WeightsError(f"{names[0]}: the weights source gave shape {list(value.shape)} for a piece of shape "
                           f"{expected}", node=names[0])
    return value


@torch.no_grad()
def materialize(model: nn.Module, weights: Weights, *, device: torch.device | str = "cpu") -> nn.Module:
    """Give every meta parameter and buffer of ``model`` its value from ``weights``, in
    place, one tensor at a time (tied tensors stay tied): the single-device model a
    distributed run's pieces are slices of. Returns ``model``."""
    source = weight_source(weights)
    if source is None:
        raise WeightsError("materialize needs weights (an initializer, a safetensors file or a checkpoint)")
    names_of: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        names_of.setdefault(id(tensor), []).append(name)
    for names in names_of.values():
        names.sort()
    done: dict[int, Tensor] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for table, is_param in ((module._parameters, True), (module._buffers, False)):  # noqa: SLF001
            for attr, tensor in list(table.items()):
                if tensor is None or not tensor.is_meta:
                    continue
                if id(tensor) not in done:
                    names = names_of.get(id(tensor)) or [f"{module_name}.{attr}" if module_name else attr]
                    value = rank_piece(source, names, tensor, None).to(device)
                    done[id(tensor)] = nn.Parameter(value, requires_grad=tensor.requires_grad) if is_param else value
                table[attr] = done[id(tensor)]
    return model


__all__ = ["Chain", "CheckpointWeights", "Initializer", "ModelTensors", "ModuleInit", "SafetensorsWeights",
           "WeightSource", "init_on_meta", "materialize", "module_init", "rank_piece", "reset_parameters",
           "seed_for", "weight_source"]
