"""Measuring the peak tensor memory of a training step, on CPU as on GPU.

On a GPU, torch's caching allocator counts every byte it hands out
(``torch.cuda.max_memory_allocated``). On CPU there is no such counter, so
:class:`LiveTensorBytes` counts the same thing itself: a
:class:`~torch.utils._python_dispatch.TorchDispatchMode` that sees every ATen op below
autograd (forward, backward and the optimizer's), records the storage of every tensor
an op returns, and sums the bytes of the storages still alive; its peak is the most
that sum reached. Storages are compared by identity (a view adds nothing), and one
that is freed stops counting at the next op. What it cannot see — an op kernel's
private scratch, the collective library's buffers, the Python heap — is not tensor
memory of the program and is what the memory model leaves out as well.

Used by ``bench/memory_model.py`` to check the memory model against measurement.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages while active (``with LiveTensorBytes()
    as m: ...``); :attr:`peak` is the most they reached. Tensors that existed before
    (parameters, inputs) count only once passed to :meth:`track`."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[StorageWeakRef, int] = {}
        self.current = 0
        """Bytes of the storages alive after the last op."""
        self.peak = 0
        """The most :attr:`current` reached since construction or :meth:`reset_peak`."""

    def track(self, tensors: Iterable[Any]) -> None:
        """Count the storages of ``tensors`` (those made before the mode was entered)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.current)

    def reset_peak(self) -> None:
        """Start a new peak from the bytes alive now."""
        self._sweep()
        self.peak = self.current

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self._sweep()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        self.peak = max(self.peak, self.current)
        return out

    def _add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = StorageWeakRef(storage)
        if key not in self._live:
            nbytes = int(storage.nbytes())
            self._live[key] = nbytes
            self.current += nbytes

    def _sweep(self) -> None:
        """Stop counting storages that were freed."""
        dead = [key for key in self._live if key.expired()]
        for key in dead:
            self.current -= self._live.pop(key)
