"""The on-disk format of hapd checkpoints and single-device safetensors files.

A checkpoint is a folder in the ``torch.distributed.checkpoint`` (DCP) format: every
rank writes its own pieces in parallel (``__<rank>_0.distcp``), rank 0 writes DCP's
``.metadata`` and hapd's manifest ``hapd.json`` (:data:`MANIFEST`, written last).
Tensors are stored under the single-device model's names and shapes, each rank's piece
as a DCP chunk with its global offsets — the plan's uneven splits (3:1 …) are not DCP's
even ``DTensor`` shards, so the planners of :mod:`hapd.state.checkpoint_planners` (DCP's planner extension
points) give each piece its offsets. A reader asks DCP for
the pieces it needs, and DCP's resharding reads the overlapping parts of whatever
pieces were saved. A replicated tensor is written once (DCP deduplicates equal chunks).

What a checkpoint holds:

* ``model/<name>`` (:data:`MODEL`): parameters and buffers (tied parameters once,
  under their alphabetically first name).
* ``optim/<name>/<state>`` (:data:`OPTIM`): the optimizer state of parameter
  ``<name>``; a state tensor shaped like the parameter's piece (Adam's ``exp_avg``,
  ``exp_avg_sq``) is split like the parameter, a scalar (``step``) is whole.
  ``optim/param_groups`` (:data:`GROUPS`): the hyperparameters of each group and the
  names of its parameters.
* ``hapd/sampler`` (:data:`SAMPLER`): the sampler's (or loader's) ``state_dict()``: its
  epoch and the global batches of it already read, which no world size changes.
* ``hapd/rng/<rank>`` (:data:`RNG`): each rank's torch CPU (and CUDA) RNG state;
  ``hapd.json`` holds the global seed (rank 0's ``torch.initial_seed()``).
* ``hapd/extra`` (:data:`EXTRA`): the ``extra`` dict (anything ``torch.save`` takes),
  and ``step``.

Every file is verified on load: the manifest records a BLAKE2b digest of each file the
save wrote (``files``) and of itself (``manifest_digest``); a file whose bytes changed
(one flipped bit in a tensor, in the pickled ``extra``, in ``.metadata``) or is missing
is a :class:`~hapd.errors.CheckpointError` naming it, before anything is read into the
module (:func:`verify_files`). The manifest also names the optimizer type saved, which
a load into another type refuses.

A save writes into a hidden sibling folder ``.<name>.tmp-<tag>`` and puts the previous
checkpoint aside at ``.<name>.old-<tag>`` while it renames (:func:`sibling`);
:func:`find_checkpoint` finds a checkpoint left aside there. The single-device state
dict is a safetensors file, ``model.safetensors`` in a folder (:func:`safetensors_file`).
"""

from __future__ import annotations

import glob
import hashlib
import json
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

from hapd.errors import CheckpointError
from hapd.util import atomic_write

FORMAT = "hapd-checkpoint"
FORMAT_VERSION = 2
READS_VERSIONS = (1, 2)
"""Versions a load reads (version 1 checkpoints have no digests to verify)."""
DIGEST_BYTES = 32
"""BLAKE2b digest size of each file (``files``) and of the manifest itself."""
MANIFEST = "hapd.json"
"""Rank 0's manifest: written last, so a folder without it is no checkpoint."""

MODEL, OPTIM, GROUPS = "model/", "optim/", "optim/param_groups"
SAMPLER, EXTRA, RNG = "hapd/sampler", "hapd/extra", "hapd/rng/"

SAFETENSORS_NAME = "model.safetensors"

TEMP, ASIDE = "tmp", "old"
"""The kinds of hidden folder a save leaves beside its target (:func:`sibling`): the one
the ranks write into, and the previous checkpoint put aside."""

Pieces = Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]
"""State-dict key -> ``(offsets, whole size)`` of an entry that is a piece of a larger
tensor."""


# --------------------------------------------------------------------------------------
# Files and folders
# --------------------------------------------------------------------------------------


def safetensors_file(path: str | Path) -> Path:
    """``path`` itself when it names a ``.safetensors`` file, else ``path/model.safetensors``."""
    path = Path(path)
    return path if path.suffix == ".safetensors" else path / SAFETENSORS_NAME


def sibling(target: Path, kind: str) -> Path:
    """A fresh name for a hidden folder of ``kind`` (:data:`TEMP`, :data:`ASIDE`) beside
    ``target``: ``.<name>.<kind>-<tag>``."""
    return target.with_name(f".{target.name}.{kind}-{secrets.token_hex(4)}")


def siblings(target: Path, kind: str) -> list[Path]:
    """The hidden folders of ``kind`` beside ``target`` (see :func:`sibling`)."""
    return list(target.parent.glob(glob.escape(f".{target.name}.{kind}-") + "*"))


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint folder for ``path``: ``path`` when it holds a manifest, else the
    previous checkpoint a save interrupted between its two renames left beside it.
    :class:`~hapd.errors.CheckpointError` when there is none."""
    target = Path(path)
    if (target / MANIFEST).is_file():
        return target
    aside = sorted(siblings(target, ASIDE), key=lambda p: p.stat().st_mtime, reverse=True)
    for candidate in aside:
        if (candidate / MANIFEST).is_file():
            return candidate
    if not target.exists():
        raise CheckpointError(f"no checkpoint at {target}: it does not exist")
    raise CheckpointError(f"no checkpoint at {target}: it has no {MANIFEST} (not a checkpoint, or its save did not "
                          "finish)")


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path`` (its own digest checked)."""
    folder = find_checkpoint(path)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / MANIFEST}: {exc}") from exc
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{folder / MANIFEST}: not a manifest")
    if manifest.get("format") != FORMAT or manifest.get("version") not in READS_VERSIONS:
        raise CheckpointError(f"{folder}: format {manifest.get('format')!r} version {manifest.get('version')!r}, this "
                              f"hapd reads {FORMAT!r} versions {', '.join(map(str, READS_VERSIONS))}")
    recorded = manifest.pop("manifest_digest", None)
    if manifest.get("version", 1) >= 2 and recorded != _manifest_digest(manifest):
        raise CheckpointError(f"{folder / MANIFEST}: damaged (its digest does not match its contents)")
    return manifest


def write_manifest(folder: Path, fields: Mapping[str, Any], *, files: Mapping[str, str] | None = None) -> None:
    """Write the manifest of the checkpoint in ``folder``: the format, its version,
    ``fields``, the digest of every other file in the folder (or ``files``: name ->
    digest, for a checkpoint whose files are written on several hosts) and its own
    (atomically)."""
    recorded = dict(files) if files is not None else file_digests(folder)
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, **fields, "files": recorded}
    manifest["manifest_digest"] = _manifest_digest(manifest)
    atomic_write(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))


def _manifest_digest(manifest: Mapping[str, Any]) -> str:
    canonical = json.dumps({k: v for k, v in manifest.items() if k != "manifest_digest"}, sort_keys=True)
    return hashlib.blake2b(canonical.encode(), digest_size=DIGEST_BYTES).hexdigest()


def _file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(folder: Path, names: Sequence[str] | None = None) -> dict[str, str]:
    """File name -> BLAKE2b digest of every file of the checkpoint folder but the
    manifest (or of the files ``names``)."""
    if names is not None:
        return {name: _file_digest(folder / name) for name in names}
    return {p.name: _file_digest(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


def verify_files(folder: Path, manifest: Mapping[str, Any]) -> None:
    """Every file the manifest records is there with the bytes the save wrote;
    :class:`~hapd.errors.CheckpointError` naming the first that is not. A version 1
    checkpoint records none."""
    recorded = manifest.get("files")
    if recorded is None:
        if manifest.get("version", 1) >= 2:
            raise CheckpointError(f"{folder / MANIFEST}: records no file digests")
        return
    for name, digest in sorted(recorded.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the checkpoint's save wrote it)")
        if _file_digest(path) != digest:
            raise CheckpointError(f"{path}: damaged (its bytes changed since the save: digest mismatch)")


__all__ = ["ASIDE", "EXTRA", "FORMAT", "FORMAT_VERSION", "GROUPS", "MANIFEST", "MODEL", "OPTIM", "READS_VERSIONS",
           "RNG", "SAFETENSORS_NAME", "SAMPLER", "TEMP", "Pieces", "file_digests", "find_checkpoint", "read_manifest",
           "safetensors_file", "sibling", "siblings", "verify_files", "write_manifest"]
