"""The graphs a compile prices, lowered once by :func:`hapd.export` and kept in the ``.pt2``.

A compile with pipelines or overlap in its space prices the model's graph at several
batches (the global batch, its half, the global batch over each micro-batch count).
Deriving them from the program means ``torch.export.load`` (2-3 s for GPT-2 124M, half
of it importing torch's deserializer) and a lowering per batch (0.3-0.6 s each). A
symbolic ``.pt2`` written by :func:`hapd.export` keeps them instead: one extra file of
the archive (:data:`GRAPHS_FILE`), the graph at the global batch over each of
:data:`KEPT_DIVISORS` that divides it, with the :func:`fingerprint` of the lowering that
made them. A compile reads that file alone (:func:`read_kept`, the zip's one member; no
torch), and uses the graphs only when the fingerprint is the running hapd's and torch's:
an archive written by another version, or edited, is lowered again from its program as
before. A batch not kept (a micro-batch count outside the defaults) is lowered too.

Written by hand: the archive is torch's, the file in it and the key of its contents hapd's.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import msgpack
import torch
from torch.export import ExportedProgram

from hapd import __version__
from hapd.ir.derive import graphs_at
from hapd.ir.lower import GraphIR
from hapd.ir.shapes import batch_info

GRAPHS_FILE = "hapd-graphs.msgpack"
"""The extra file of a ``.pt2`` archive that holds its kept graphs."""

KEPT_DIVISORS = (1, 2, 4, 8, 16)
"""The global batch over each of these (when it divides it) is kept: the global batch,
overlap's half and the default micro-batch counts of a pipeline search
(:data:`hapd.compiler.pipeline.stage_search.DEFAULT_MICRO_BATCHES`)."""

_log = logging.getLogger("hapd.ir.kept")


@functools.cache
def fingerprint() -> str:
    """What the lowered graphs depend on: hapd's version, torch's, and the source of
    every module of :mod:`hapd.ir` (the lowering), hashed."""
    digest = hashlib.sha256(f"hapd {__version__}\0torch {torch.__version__}\0".encode())
    for source in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()


def kept_graphs(program: ExportedProgram, *, name: str | None,
                batch_dims: Mapping[str, int | None] | None) -> str | None:
    """The :data:`GRAPHS_FILE` of a symbolic ``program``: msgpack, base64. None for a
    static one (it has one graph, lowered on use) and for one hapd cannot lower: the
    export goes on, and a compile of the file reports the lowering's error as before."""
    info = batch_info(program)
    if info is None or not info.symbolic or not info.size:
        return None
    at = graphs_at(program, info.size, name=name, batch_dims=batch_dims)
    batches = sorted({info.size // d for d in KEPT_DIVISORS if info.size % d == 0}, reverse=True)
    try:
        graphs = {str(b): at(b).data for b in batches}
    except Exception as exc:  # noqa: BLE001 - a program hapd cannot lower still exports; its compile says why
        _log.info("%s: no graphs kept in the .pt2 (lowering failed: %s: %s)", name, type(exc).__name__, exc)
        return None
    packed = msgpack.packb({"fingerprint": fingerprint(), "batch": info.size, "graphs": graphs}, use_bin_type=True)
    return base64.b64encode(packed).decode("ascii")  # torch's archive takes extra files as text


@dataclass(frozen=True)
class Kept:
    """The graphs a ``.pt2`` keeps."""

    batch: int
    """The global batch it was exported at."""
    graphs: Mapping[int, GraphIR]
    """Batch → its graph."""


def read_kept(path: str | Path) -> Kept | None:
    """The graphs ``path`` keeps, when it is a zip archive with :data:`GRAPHS_FILE`
    written under this :func:`fingerprint`; None otherwise (the caller lowers the
    program, as for any ``.pt2``), with the reason logged at debug level."""
    try:
        with zipfile.ZipFile(path) as archive:
            member = next((n for n in archive.namelist() if n.endswith("/extra/" + GRAPHS_FILE)), None)
            if member is None:
                return None
            doc = msgpack.unpackb(base64.b64decode(archive.read(member), validate=True), raw=False)
    except (OSError, zipfile.BadZipFile, ValueError, msgpack.UnpackException, msgpack.ExtraData) as exc:
        _log.debug("%s: kept graphs not read: %s", path, exc)
        return None
    if not isinstance(doc, dict) or doc.get("fingerprint") != fingerprint():
        _log.debug("%s: kept graphs of another lowering: lowered again", path)
        return None
    try:
        graphs = {int(b): GraphIR(bytes(data)) for b, data in dict(doc["graphs"]).items()}
        batch = int(doc["batch"])
    except (KeyError, TypeError, ValueError) as exc:
        _log.debug("%s: kept graphs unreadable: %s", path, exc)
        return None
    if batch not in graphs:
        return None
    return Kept(batch=batch, graphs=graphs)


__all__ = ["GRAPHS_FILE", "KEPT_DIVISORS", "Kept", "fingerprint", "kept_graphs", "read_kept"]
