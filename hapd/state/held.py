"""What a rank holds of a model's state, as checkpoints see it.

:class:`Held` is one state-dict entry as this rank holds it: its piece and where the
piece lies in the whole tensor. :class:`HoldsPieces` is what a module that holds this
rank's pieces of a model (:class:`~hapd.train.parallel_module.ParallelModule`)
answers, so that checkpoints and safetensors files (:mod:`hapd.state.checkpoint`)
read and write it without knowing its class; a plain single-device module holds every
tensor whole (:func:`whole`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from hapd.compiler.plan import Plan

STEP = "hapd_rng_step"
"""The module buffer holding the training step the dropouts draw for (a counter-based
generator's step, :mod:`hapd.spmd.random`): state a checkpoint saves with the model."""


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
    writes: bool = True
    """Whether this rank writes it to checkpoints (False: another rank holding the same
    block writes it, e.g. the first of the pipeline stages that hold a tied weight);
    every rank that holds a piece reads it."""

    @property
    def partial(self) -> bool:
        return tuple(self.local.shape) != self.size


def whole(key: str, tensor: Tensor) -> Held:
    """``tensor`` held whole under ``key``."""
    return Held(key, tensor, (0,) * tensor.dim(), tuple(tensor.shape))


@runtime_checkable
class HoldsPieces(Protocol):
    """A module that holds this rank's pieces of a model's parameters and buffers
    (:class:`~hapd.train.parallel_module.ParallelModule`): what checkpoints read and
    write of it. ``isinstance(module, HoldsPieces)`` tells it from a plain module."""

    group: Any
    """The process group of the job (None: the default group)."""

    @property
    def plan(self) -> Plan:
        """The plan the pieces are laid out by."""
        ...

    def held_tensors(self) -> list[Held]:
        """Every parameter and buffer this rank holds, once each (a tied parameter under
        its first name), with where its piece lies in the whole tensor, in name order."""
        ...

    def tied_names(self) -> list[list[str]]:
        """Groups of state-dict keys that name one tensor: every name of each parameter
        (several for tied weights), and the keys that name a held tensor under another
        key (a group may have one key)."""
        ...

    def parameter_layouts(self) -> dict[str, str]:
        """Each parameter's layout."""
        ...

    def full_state_dict(self) -> dict[str, Tensor]:
        """The single-device model's state dict (collective)."""
        ...

    def load_full_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> None:
        """Load a single-device state dict: every rank keeps its pieces."""
        ...


__all__ = ["Held", "HoldsPieces", "whole"]
