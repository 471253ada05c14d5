"""Tracing a model or program without weights as if it had them.

A model on the meta device (:func:`hapd.init_on_meta`) has shapes but no values, and
hapd exports and lowers it from shapes alone. Traced on meta tensors it would not give
the graph its real-weight twin gives: ``torch.export`` traces a real model with fake
tensors on the model's device, and some ops' meta kernels disagree with the device's
(attention's result on the CPU is laid out so that the usual
``transpose(1, 2).reshape(...)`` is a view, while its meta kernel's result is contiguous
and the reshape becomes a copy, ``clone`` + ``_unsafe_view``), and ops that take their
input's device (``arange(..., device=x.device)``) would record ``meta``. So the two
would lower to different graphs, with different graph ids, and a plan cached for one
would not serve the other.

Both traces here run on **fake tensors on the real device** instead (no memory: a fake
tensor is a meta tensor that says which device it stands for): exporting a meta model
(:func:`model_faked`, the example inputs' device) and re-tracing a program whose state
dict is on meta (:func:`program_faked`, the device its inputs were traced on). The
recorded ops, shapes and arguments are then the real model's; what the model computes
is unchanged, and the program keeps the model's own meta tensors in its state dict.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind


def fake_device(example_inputs: Sequence[Any]) -> torch.device:
    """The device a meta model is traced on: its example inputs' (the device a model
    with real weights would run them on), the CPU when they are on meta too."""
    for t in example_inputs:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            return t.device
    return torch.device("cpu")


class _Fakes:
    """Fake tensors of one mode on one device, one per tensor object (a tensor
    registered under several names, tied weights, gets one fake), remembering what
    each stands for."""

    def __init__(self, device: torch.device):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.mode = FakeTensorMode()
        self.device = device
        self._of: dict[int, torch.Tensor] = {}
        self.stands_for: dict[int, torch.Tensor] = {}
        """id of a fake -> the meta tensor a program's state dict holds in its place."""

    def shaped(self, t: torch.Tensor) -> torch.Tensor:
        """A fake tensor with ``t``'s shape, strides and dtype on the device."""
        from torch._subclasses.fake_tensor import FakeTensor

        meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
        return FakeTensor(self.mode, meta, self.device)

    def of(self, t: torch.Tensor, parameter: bool) -> torch.Tensor:
        """The fake standing for ``t`` (an ``nn.Parameter`` for a parameter); it stands
        for ``t`` itself when on meta, else for a meta copy."""
        if id(t) not in self._of:
            fake = self.shaped(t)
            if parameter:
                fake = torch.nn.Parameter(fake, requires_grad=t.requires_grad)
            self._of[id(t)] = fake
            self.stands_for[id(fake)] = t if t.is_meta else t.to("meta")
        return self._of[id(t)]

    def restore(self, program: ExportedProgram) -> None:
        """Put the meta tensors the fakes stand for in ``program``'s state dict and
        constants (non-persistent buffers)."""
        for table in (program.state_dict, program.constants):
            for name, value in list(table.items()):
                if id(value) in self.stands_for:
                    table[name] = self.stands_for[id(value)]


@contextlib.contextmanager
def model_faked(
    model: torch.nn.Module, example_inputs: Sequence[Any]
) -> Iterator[tuple[tuple[Any, ...], Callable[[ExportedProgram], None]]]:
    """For the duration, every parameter and buffer of ``model`` swapped for a fake
    tensor on the example inputs' device (:func:`fake_device`). Yields the example
    inputs as fakes of the same mode, and ``restore``, which puts the model's own meta
    parameters (and meta copies of its real buffers) into an exported program's state
    dict and constants in place of the fakes. The model gets its own tensors back after."""
    fakes = _Fakes(fake_device(example_inputs))
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    try:
        for module in model.modules():
            for table, parameter in ((module._parameters, True), (module._buffers, False)):  # noqa: SLF001 - swapping a module's own tensors
                for name, t in table.items():
                    if t is not None:
                        swapped.append((table, name, t))
                        table[name] = fakes.of(t, parameter)
        inputs = tuple(fakes.shaped(t) if isinstance(t, torch.Tensor) else t for t in example_inputs)
        yield inputs, fakes.restore
    finally:
        for table, name, t in swapped:
            table[name] = t


def traced_device(program: ExportedProgram) -> torch.device:
    """The device ``program``'s user inputs were traced on (the CPU when it has none)."""
    for spec in program.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        val = next((n.meta.get("val") for n in program.graph.nodes if n.name == spec.arg.name), None)
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")


@contextlib.contextmanager
def program_faked(program: ExportedProgram) -> Iterator[Callable[[ExportedProgram], None]]:
    """For the duration, every meta tensor of ``program``'s state dict and constants
    swapped for a fake on the device its inputs were traced on (:func:`traced_device`),
    so that a re-trace (``run_decompositions``) sees the devices the export saw. Yields
    ``restore``, which puts the meta tensors back into a program made meanwhile (the
    re-traced one); ``program`` gets them back after. Nothing to do for a program with
    real weights, or one traced on meta."""
    device = traced_device(program)
    tables = (program.state_dict, program.constants)
    metas = [{k: t for k, t in table.items() if isinstance(t, torch.Tensor) and t.is_meta} for table in tables]
    if not any(metas) or device.type == "meta":
        yield lambda _: None
        return
    fakes = _Fakes(device)
    try:
        for table, found in zip(tables, metas):
            for name, t in found.items():
                table[name] = fakes.of(t, isinstance(t, torch.nn.Parameter))
        yield fakes.restore
    finally:
        for table, found in zip(tables, metas):
            table.update(found)
