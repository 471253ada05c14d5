"""Moving a model's state from the ranks that hold it to the ranks that need it, point
to point: the reshard of a switch in place (:meth:`hapd.Elastic.resume`).

After a lost host the survivors still hold their pieces of the last step they all
completed (:mod:`hapd.elastic.step_copy`); the new plan lays the same tensors out
differently over fewer (or more) ranks. Two steps:

- :func:`schedule` (pure, no torch.distributed): given every source rank's pieces
  (:class:`Piece`: a state entry's key, where the piece starts in the whole tensor, its
  shape) and every destination rank's needed pieces, it chooses for each needed region
  source pieces that cover it — the rank itself first, then the others in a rotation
  that starts after the destination (deterministic, and it spreads the sends of a
  replicated tensor over its holders) — and returns the :class:`Transfer` list, or the
  keys no source covers (a piece only a lost rank held);
- :func:`execute` runs one rank's part of it: local copies, and the rest packed into one
  buffer per peer and dtype, exchanged with ``torch.distributed.batch_isend_irecv``
  (Gloo on CPU supports it; NCCL on GPUs).

Why not ``torch.distributed.checkpoint`` (which reshards snapshots,
:func:`hapd.load_checkpoint`): DCP reshards between a *storage* and the ranks — its
planners read pieces from files, every rank reading what it needs — and its only
in-memory path (``_load_state_dict_from_keys`` / ``broadcast_from_rank0``) sends whole
tensors from one rank. Here the sources are the survivors' memory, spread over ranks,
and each needed box should come from one holder over one link: a box cover and a P2P
exchange, which this module writes by hand (a few dozen lines).
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Box:
    """An axis-aligned block of a tensor: ``start`` and ``shape`` per dimension (no
    dimension: a scalar, one element)."""

    start: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(s + n for s, n in zip(self.start, self.shape))

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def intersect(self, other: "Box") -> "Box | None":
        """The common block, or None when they share no element."""
        start = tuple(max(a, b) for a, b in zip(self.start, other.start))
        end = tuple(min(a, b) for a, b in zip(self.end, other.end))
        if any(e <= s for s, e in zip(start, end)):
            return None
        return Box(start, tuple(e - s for s, e in zip(start, end)))

    def minus(self, inner: "Box") -> list["Box"]:
        """This block less ``inner`` (a block inside it), as disjoint blocks: along each
        dimension in turn, the slabs before and after ``inner``, the dimensions before it
        cut to ``inner``'s range."""
        out = []
        start, shape = list(self.start), list(self.shape)
        for d in range(len(self.shape)):
            lo, hi = inner.start[d], inner.start[d] + inner.shape[d]
            if lo > start[d]:
                out.append(Box(tuple(start[:d] + [start[d]] + start[d + 1:]),
                               tuple(shape[:d] + [lo - start[d]] + shape[d + 1:])))
            if hi < start[d] + shape[d]:
                out.append(Box(tuple(start[:d] + [hi] + start[d + 1:]),
                               tuple(shape[:d] + [start[d] + shape[d] - hi] + shape[d + 1:])))
            start[d], shape[d] = lo, hi - lo
        return out

    def shifted(self, origin: Sequence[int]) -> "Box":
        """The same block in the coordinates of a piece that starts at ``origin``."""
        return Box(tuple(s - o for s, o in zip(self.start, origin)), self.shape)

    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(s, s + n) for s, n in zip(self.start, self.shape))


@dataclass(frozen=True)
class Piece:
    """One rank's piece of one state entry (a parameter, a buffer, an optimizer state):
    the metadata the schedule needs, no tensor."""

    key: str
    """The entry's checkpoint key (``model/…``, ``optim/…/exp_avg``)."""
    offsets: tuple[int, ...]
    """Where the piece starts in the whole tensor."""
    shape: tuple[int, ...]
    """The piece's shape."""
    size: tuple[int, ...]
    """The whole tensor's shape."""
    dtype: str = "float32"
    """The dtype of the source's piece (what is sent), as ``torch``'s attribute name."""

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.shape)


@dataclass(frozen=True)
class Transfer:
    """One block of one entry from ``src``'s piece to ``dst``'s: each box in the
    coordinates of its own piece."""

    src: int
    dst: int
    key: str
    src_box: Box
    dst_box: Box
    dtype: str
    src_offsets: tuple[int, ...] = ()
    """Where the source's piece starts in the whole tensor: which of its pieces of ``key``
    it is (a rank may hold two: its own and a replica of a lost rank's,
    :mod:`hapd.elastic.replica`)."""

    @property
    def numel(self) -> int:
        return self.src_box.numel


@dataclass(frozen=True)
class Schedule:
    """The transfers that give every destination its pieces; ``missing``: the keys some
    needed region of which no source holds (empty: all covered)."""

    transfers: tuple[Transfer, ...]
    missing: tuple[str, ...] = ()

    @property
    def covered(self) -> bool:
        return not self.missing

    def bytes_between_ranks(self) -> int:
        """What crosses between ranks (the local copies left out), in bytes."""
        return sum(t.numel * dtype_size(t.dtype) for t in self.transfers if t.src != t.dst)


def schedule(held: Mapping[int, Iterable[Piece]], needed: Mapping[int, Iterable[Piece]]) -> Schedule:
    """Transfers that give each rank of ``needed`` (rank → pieces it needs) its pieces from
    the pieces of ``held`` (rank → pieces it holds). Replicas are identical, so which
    holder gives a block is free: the destination itself first, then the others from the
    one after it in rank order, round the ranks; each needed piece is cut into disjoint
    boxes as sources cover it (box arithmetic), and what no source covers names its key
    in ``missing``. A source piece whose whole size differs from the needed one's (another
    model) covers nothing. Pure: the same on every rank given the same metadata."""
    # each key's distinct pieces, with the ranks that hold each (replicas: one piece, many holders)
    by_key: dict[str, dict[tuple, tuple[Piece, list[int]]]] = defaultdict(dict)
    for rank in sorted(held):
        for piece in held[rank]:
            if piece.box.numel:
                by_key[piece.key].setdefault((piece.offsets, piece.shape, piece.size), (piece, []))[1].append(rank)
    ranks = set(held) | set(needed)
    span = max(ranks) + 1 if ranks else 1
    transfers: list[Transfer] = []
    missing: set[str] = set()
    for dst in sorted(needed):
        for want in needed[dst]:
            if not want.box.numel:
                continue
            left = [want.box]
            chosen = [(piece, _holder(holders, dst)) for piece, holders in by_key.get(want.key, {}).values()
                      if piece.size == want.size]
            for piece, src in sorted(chosen, key=lambda c: ((c[1] - dst) % span, c[0].offsets)):
                if not left:
                    break
                rest = []
                for region in left:
                    common = region.intersect(piece.box)
                    if common is None:
                        rest.append(region)
                        continue
                    transfers.append(Transfer(src, dst, want.key, common.shifted(piece.offsets),
                                              common.shifted(want.offsets), piece.dtype, piece.offsets))
                    rest += region.minus(common)
                left = rest
            if left:
                missing.add(want.key)
    return Schedule(tuple(transfers), tuple(sorted(missing)))


def _holder(holders: list[int], dst: int) -> int:
    """Which of ``holders`` (in rank order) gives a piece to ``dst``: itself when it holds
    it, else the first from ``dst`` on, round the ranks."""
    return holders[bisect.bisect_left(holders, dst) % len(holders)]


# --------------------------------------------------------------------------------------
# Running one rank's part of a schedule
# --------------------------------------------------------------------------------------


@dataclass
class Moved:
    """What :func:`execute` did on this rank."""

    sent_bytes: int = 0
    received_bytes: int = 0
    local_bytes: int = 0
    seconds: float = 0.0
    peers: set[int] = field(default_factory=set)


def execute(plan: Schedule, rank: int, sources: Mapping[tuple[str, tuple[int, ...]], Tensor],
            targets: Mapping[str, Tensor], *, group: Any = None) -> Moved:
    """This rank's part of ``plan``: copy its own blocks locally, send its blocks to other
    ranks and receive theirs, every peer's blocks packed into one buffer per dtype, in
    the schedule's order (both ends know it: one message per peer and dtype, each with its
    own tag, so no two messages of one pair can be matched out of order). ``sources``:
    this rank's pieces by key and offsets (what ``held`` described to :func:`schedule`:
    :func:`by_piece`); ``targets``:
    the tensors the pieces it needs are written into (a block is cast to the target's
    dtype and device). Collective over ``group``'s ranks that appear in the plan (ranks
    are ``group``'s)."""
    start = time.perf_counter()
    moved = Moved()
    sends: dict[tuple[int, str], list[Transfer]] = defaultdict(list)
    recvs: dict[tuple[int, str], list[Transfer]] = defaultdict(list)
    with torch.no_grad():
        for t in plan.transfers:
            if t.src == rank and t.dst == rank:
                targets[t.key][t.dst_box.slices()].copy_(sources[(t.key, t.src_offsets)][t.src_box.slices()])
                moved.local_bytes += t.numel * dtype_size(t.dtype)
            elif t.src == rank:
                sends[(t.dst, t.dtype)].append(t)
            elif t.dst == rank:
                recvs[(t.src, t.dtype)].append(t)
        dtypes = sorted({d for _, d in sends} | {d for _, d in recvs})
        device = _wire_device(group) if dtypes else torch.device("cpu")
        ops, received = [], []
        for (peer, dtype), blocks in sorted(sends.items()):
            buffer = torch.cat([sources[(t.key, t.src_offsets)][t.src_box.slices()].reshape(-1)
                                for t in blocks]).to(device)
            ops.append(dist.P2POp(dist.isend, buffer, _global(group, peer), group, dtypes.index(dtype)))
            moved.sent_bytes += buffer.numel() * buffer.element_size()
            moved.peers.add(peer)
        for (peer, dtype), blocks in sorted(recvs.items()):
            buffer = torch.empty(sum(t.numel for t in blocks), dtype=_dtype(dtype), device=device)
            ops.append(dist.P2POp(dist.irecv, buffer, _global(group, peer), group, dtypes.index(dtype)))
            received.append((buffer, blocks))
            moved.received_bytes += buffer.numel() * buffer.element_size()
            moved.peers.add(peer)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for buffer, blocks in received:
            at = 0
            for t in blocks:
                part = buffer[at:at + t.numel].view(t.dst_box.shape)
                targets[t.key][t.dst_box.slices()].copy_(part)
                at += t.numel
    moved.seconds = time.perf_counter() - start
    return moved


def by_piece(pieces: Iterable[Piece], tensors: Mapping[str, Tensor]) -> dict[tuple[str, tuple[int, ...]], Tensor]:
    """``tensors`` (key → a rank's piece of it, described by ``pieces``) as
    :func:`execute` reads its sources: by key and where the piece starts."""
    return {(p.key, p.offsets): tensors[p.key] for p in pieces if p.key in tensors}


def _wire_device(group: Any) -> torch.device:
    """Where the packed buffers live: the GPU for NCCL (it sends only CUDA tensors), else
    the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _global(group: Any, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def dtype_size(name: str) -> int:
    """The bytes of one element of dtype ``name``."""
    return torch.empty((), dtype=_dtype(name)).element_size()


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` → ``"float32"`` (what :class:`Piece` keeps)."""
    return str(dtype).removeprefix("torch.")


__all__ = ["Box", "Moved", "Piece", "Schedule", "Transfer", "by_piece", "dtype_name", "dtype_size", "execute", "schedule"]
