"""DCP's planners for hapd's checkpoint pieces, apart from the format's names
(:mod:`hapd.state.checkpoint_format`): loading ``torch.distributed.checkpoint`` costs
about 0.2 s, which only a save or a load of a checkpoint should pay, not every import of
the runtime.

:class:`PieceSavePlanner` and :class:`PieceLoadPlanner` give each rank's uneven piece its
global offsets (the plan's 3:1 splits are not DCP's even ``DTensor`` shards).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from hapd.errors import CheckpointError
from hapd.state.checkpoint_format import Pieces


# --------------------------------------------------------------------------------------
# DCP planners for pieces with explicit offsets
# --------------------------------------------------------------------------------------


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus entries that are pieces of a larger tensor:
    ``pieces`` maps such a key to its ``(offsets, whole size)``; the state dict holds the
    piece itself. Whole tensors and other objects go the default way (replicated ones
    are written once)."""

    def __init__(self, pieces: Pieces):
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

    def __init__(self, pieces: Pieces):
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
                raise CheckpointError(f"{key}: the checkpoint has {describe_entry(md)}, this rank needs a piece of a "
                                      f"tensor of shape {list(size)}", node=key)
            local = self.state_dict[key]
            items += create_read_items_for_chunk_list(
                key, md, [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=local.shape)])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        if index.fqn in self.pieces:
            return self.state_dict[index.fqn]
        return super().lookup_tensor(index)


def describe_entry(md: Any) -> str:
    """What a checkpoint holds under a key (its DCP metadata ``md``), in words."""
    if md is None:
        return "no such entry"
    if isinstance(md, TensorStorageMetadata):
        return f"a tensor of shape {list(md.size)}"
    return "a non-tensor entry"


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """Silence two warnings DCP gives that are not the caller's to act on: that it
    assumes one process when there is no process group (here the intent), and its own
    use of ``tensor.storage()`` (TypedStorage deprecation, inside torch)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning)
        yield


__all__ = ["PieceLoadPlanner", "PieceSavePlanner", "describe_entry", "quiet_dcp"]
