"""The module one rank runs, and what the plan says about that rank.

- :class:`RankView` — the plan seen from one rank: the lengths of each split tensor,
  this rank's slice of it, full and local shapes;
- :class:`Communicate` — one collective of the plan on one tensor, as the module the
  rank's fx graph calls;
- :class:`RankModule` — one rank's program (the fx module :func:`hapd.distribute`
  builds): its inputs, parameters and buffers with their layouts, and its gradient sync;
- :func:`set_attr` — registering a parameter or buffer at a dotted path of a module.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import Tensor, fx, nn

from hapd.compiler.plan import Plan
from hapd.errors import PlanError
from hapd.spmd import collectives
from hapd.spmd.gradsync import GradSync
from hapd.spmd.layout import IDENTITY, REDUCE, gather_dim


# --------------------------------------------------------------------------------------
# What the plan says about this rank
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankView:
    """The plan seen from one rank: lengths and local shapes of tensors."""

    plan: Plan
    rank: int
    world: int

    def lengths(self, tensor: str, dim: int) -> list[int]:
        lengths = self.plan.lengths_of(tensor, dim)
        if len(lengths) != self.world:
            raise PlanError(f"tensor {tensor} dim {dim}: {len(lengths)} lengths for {self.world} ranks", node=tensor)
        return lengths

    def offset(self, tensor: str, dim: int) -> tuple[int, int]:
        """(start, length) of this rank's slice of ``tensor`` along ``dim``."""
        lengths = self.lengths(tensor, dim)
        return sum(lengths[: self.rank]), lengths[self.rank]

    def full_shape(self, tensor: str) -> list[int]:
        return list(self.tensors[tensor]["shape"])

    def local_shape(self, tensor: str, layout: str) -> list[int]:
        shape = self.full_shape(tensor)
        d = gather_dim(layout)
        if d is not None:
            shape[d] = self.offset(tensor, d)[1]
        return shape

    def output_index(self, tensor: str) -> int:
        return int(self.tensors[tensor]["output"])

    def dtype(self, tensor: str) -> str:
        return str(self.tensors[tensor]["dtype"])

    @cached_property
    def tensors(self) -> Mapping[str, Mapping[str, Any]]:
        """The plan's tensors by name."""
        return {t["name"]: t for t in self.plan.program["tensors"]}

    def local_value(self, tensor: str, layout: str, value: Tensor) -> Tensor:
        """This rank's piece of the full ``value`` of ``tensor`` held in ``layout``
        (a fresh tensor that shares no storage with ``value``)."""
        d = gather_dim(layout)
        if d is not None:
            start, length = self.offset(tensor, d)
            return value.narrow(d, start, length).clone()
        if layout == REDUCE:
            return value.clone() if self.rank == 0 else torch.zeros_like(value)
        return value.clone()


# --------------------------------------------------------------------------------------
# The module the rewritten graph calls for a collective (fx code can call modules with
# state; the state here is the collective's dims, lengths and process group)
# --------------------------------------------------------------------------------------


class Communicate(nn.Module):
    """One collective of the plan on one tensor: ``from_layout → to_layout``."""

    def __init__(self, kind: str, tensor: str, src: str, dst: str, view: RankView, group: Any):
        super().__init__()
        self.kind, self.tensor, self.src, self.dst = kind, tensor, src, dst
        self.group = group
        self.rank = view.rank
        i, j = gather_dim(src), gather_dim(dst)
        self.src_dim, self.dst_dim = i, j
        self.src_lengths = view.lengths(tensor, i) if i is not None else None
        self.dst_lengths = view.lengths(tensor, j) if j is not None else None
        expected = {
            "all_gather": (i is not None and dst == IDENTITY),
            "all_gather_grouped": (i is not None and dst == IDENTITY),
            "reduce_scatter": (src == REDUCE and j is not None),
            "reduce_scatter_grouped": (src == REDUCE and j is not None),
            "all_reduce": (src == REDUCE and dst == IDENTITY),
            "all_to_all": (i is not None and j is not None and i != j),
            "dynamic_slice": (src == IDENTITY and j is not None),
            "mask_to_rank_zero": (src == IDENTITY and dst == REDUCE),
        }
        if not expected.get(kind, False):
            raise PlanError(f"tensor {tensor}: collective {kind!r} cannot turn {src} into {dst}", node=tensor)

    def forward(self, x: Tensor) -> Tensor:
        kind, group = self.kind, self.group
        if kind in ("all_gather", "all_gather_grouped"):
            return collectives.all_gather(x, self.src_dim, self.src_lengths, grouped=kind.endswith("grouped"), group=group)
        if kind in ("reduce_scatter", "reduce_scatter_grouped"):
            return collectives.reduce_scatter(
                x, self.dst_dim, self.dst_lengths, grouped=kind.endswith("grouped"), group=group
            )
        if kind == "all_reduce":
            return collectives.all_reduce(x, group=group)
        if kind == "all_to_all":
            return collectives.all_to_all(
                x, self.src_dim, self.dst_dim, self.src_lengths, self.dst_lengths, group=group
            )
        if kind == "dynamic_slice":
            return collectives.dynamic_slice(x, self.dst_dim, self.dst_lengths, group=group)
        return collectives.mask_to_rank_zero(x, group=group)

    def extra_repr(self) -> str:
        return f"{self.kind}: {self.tensor} {self.src} -> {self.dst}"


# --------------------------------------------------------------------------------------
# The rank's module
# --------------------------------------------------------------------------------------


class RankModule(fx.GraphModule):
    """One rank's program: ``forward(*local_inputs) -> this rank's loss part``."""

    hapd_view: RankView
    hapd_inputs: list[tuple[str, str]]
    """(input name, layout) of each forward argument."""
    hapd_params: dict[str, tuple[str, str]]
    """parameter name (as in the original model) -> (plan tensor, layout); every name of
    a tied parameter is a key, and names the same ``nn.Parameter`` of this module
    (``named_parameters(remove_duplicate=False)`` lists each)."""
    hapd_buffers: dict[str, tuple[str, str, str]]
    """buffer or constant name (as in the original model) -> (plan tensor, layout,
    attribute of this module holding the rank's piece) for those read but not updated."""
    hapd_updated: list[str]
    """buffers the step updates, held whole on every rank at their own name."""
    hapd_sync: GradSync

    def shard_inputs(self, *full: Tensor) -> tuple[Tensor, ...]:
        """This rank's pieces of the full (global-batch) inputs, in forward order."""
        if len(full) != len(self.hapd_inputs):
            raise PlanError(f"expected {len(self.hapd_inputs)} inputs ({', '.join(n for n, _ in self.hapd_inputs)}), got {len(full)}")
        out = []
        for (name, layout), value in zip(self.hapd_inputs, full):
            expected = self.hapd_view.full_shape(name) if name in self.hapd_view.tensors else list(value.shape)
            if list(value.shape) != expected:
                raise PlanError(f"input {name}: shape {list(value.shape)}, the plan was compiled for {expected}", node=name)
            d = gather_dim(layout)
            if d is None:
                out.append(value)
            else:
                start, length = self.hapd_view.offset(name, d)
                out.append(value.narrow(d, start, length))
        return tuple(out)

    def local_shapes(self) -> list[list[int]]:
        """The shape of each input this rank's forward takes."""
        view = self.hapd_view
        return [view.local_shape(n, layout) if n in view.tensors else [] for n, layout in self.hapd_inputs]


def set_attr(root: nn.Module, target: str, value: Tensor, *, parameter: bool) -> None:
    """Register ``value`` at the dotted path ``target`` under ``root``."""
    *path, leaf = target.split(".")
    module = root
    for part in path:
        child = getattr(module, part, None) if part in module._modules else None  # noqa: SLF001 - nn.Module's own registry
        if child is None:
            child = nn.Module()
            module.add_module(part, child)
        module = child
    if parameter:
        module.register_parameter(leaf, value if isinstance(value, nn.Parameter) else nn.Parameter(value))
    else:
        module.register_buffer(leaf, value)


__all__ = ["Communicate", "RankModule", "RankView", "set_attr"]
