"""Symmetric memory for the collectives' buffers, as a protocol, and its CPU simulation.

A tensor-parallel graph's communication buffers (mpk.distributed.shard.InputSpec ``comm``)
exist once per rank at "the same place": a put writes into a peer's copy through the address
``peer_pointers`` gives for it. ``SymmetricAllocator`` is what a runner needs of that memory;
the NVSHMEM implementation (mpk/distributed/nvshmem.py: ``nvshmem_malloc`` and
``nvshmem_ptr``) and ``CpuSymmetricHeap`` below (the interpreter's) provide it.

The CPU heap also checks the cross-rank protocol: each element of a receive slot records the
sequence number last put there and whether its owner has consumed it. A put over data not yet
consumed, or a read of a slot that does not hold the sequence expected (stale, or already
overwritten), is a ``RaceError`` naming both ranks, the buffer, the slot and the sequences.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from mpk.errors import MpkError, RaceError


@runtime_checkable
class SymmetricAllocator(Protocol):
    """One rank's view of a symmetric heap shared by ``world`` ranks.

    Every rank makes the same sequence of ``allocate`` calls (same shapes and dtypes), so the
    i-th allocation of every rank is one symmetric object."""

    rank: int
    world: int

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This rank's copy of a new symmetric buffer, zero-filled (signals start at 0)."""

    def peer_pointers(self, tensor: torch.Tensor) -> torch.Tensor:
        """int64 [world] on the tensor's device: entry r is the address at which this rank
        reaches rank r's copy of ``tensor`` (entry ``rank``: its own address)."""


@dataclass
class LocalAllocator:
    """The SymmetricAllocator of a world of one rank: plain device memory, its own address its
    only peer's (a degree-1 graph runs its collectives' tasks without any peer)."""

    device: torch.device
    rank: int = 0
    world: int = 1

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def peer_pointers(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.tensor([tensor.data_ptr()], dtype=torch.int64, device=tensor.device)


_PROCESS_ALLOCATOR: SymmetricAllocator | None = None


def set_allocator(allocator: SymmetricAllocator | None) -> None:
    """Make ``allocator`` the process's (the NVSHMEM bootstrap calls this once its PEs are up;
    None on teardown). Runners of tensor-parallel graphs take their buffers from it."""
    global _PROCESS_ALLOCATOR
    _PROCESS_ALLOCATOR = allocator


def allocator_for(rank: int, world: int, device: torch.device) -> SymmetricAllocator:
    """The allocator a runner of rank ``rank`` of ``world`` uses: the process's, or for a world
    of one without one, a LocalAllocator on ``device``."""
    a = _PROCESS_ALLOCATOR
    if a is not None and (a.rank, a.world) == (rank, world):
        return a
    if world == 1 and a is None:
        return LocalAllocator(device)
    have = "none is set" if a is None else f"the process's is rank {a.rank} of {a.world}"
    raise MpkError(f"a graph compiled with tensor_parallel=({rank}, {world}) needs the process's symmetric allocator "
                   f"for rank {rank} of {world} ({have}); initialise NVSHMEM first (mpk.distributed.nvshmem), which "
                   "calls mpk.distributed.symmetric.set_allocator")


@dataclass
class _Object:
    name: str
    copies: list[torch.Tensor]
    stamp: list[torch.Tensor] = field(default_factory=list)  # per rank: sequence last put, −1: none
    pending: list[torch.Tensor] = field(default_factory=list)  # per rank: put, not consumed yet


# fake peer addresses → (heap, object index, rank); storages → the same, for reads by the owner
_HANDLES: dict[int, tuple["CpuSymmetricHeap", int, int]] = {}
_STORAGES: dict[int, tuple["CpuSymmetricHeap", int, int]] = {}
_NEXT_BASE = itertools.count(1)


class CpuSymmetricHeap:
    """The symmetric memory of ``world`` simulated ranks in one process; ``allocator(rank)``
    is rank ``rank``'s SymmetricAllocator. Peer "addresses" are handles this module resolves
    (the CPU tiles of mpk.ops.collective call ``put``, ``signal`` and ``consume``)."""

    def __init__(self, world: int):
        if not isinstance(world, int) or world < 1:
            raise MpkError(f"world={world!r}; expected an int ≥ 1")
        self.world = world
        self.objects: list[_Object] = []
        self._calls = [0] * world
        self._base = next(_NEXT_BASE) << 32

    def allocator(self, rank: int) -> "CpuAllocator":
        if not 0 <= rank < self.world:
            raise MpkError(f"rank={rank!r}; expected 0 ≤ rank < {self.world}")
        return CpuAllocator(self, rank)

    def _allocate(self, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        i = self._calls[rank]
        self._calls[rank] += 1
        if i == len(self.objects):
            copies = [torch.zeros(shape, dtype=dtype) for _ in range(self.world)]
            obj = _Object(f"symmetric#{i} {list(shape)} {str(dtype).removeprefix('torch.')}", copies,
                          [torch.full(shape, -1, dtype=torch.int64) for _ in range(self.world)],
                          [torch.zeros(shape, dtype=torch.bool) for _ in range(self.world)])
            self.objects.append(obj)
            for r, c in enumerate(copies):
                _HANDLES[self._handle(i, r)] = (self, i, r)
                _STORAGES[c.untyped_storage().data_ptr()] = (self, i, r)
        obj = self.objects[i]
        if obj.copies[rank].shape != tuple(shape) or obj.copies[rank].dtype != dtype:
            raise MpkError(f"rank {rank}'s allocation #{i} is {list(shape)} {dtype}; rank 0 made "
                           f"{list(obj.copies[0].shape)} {obj.copies[0].dtype}: every rank must allocate the same "
                           "buffers in the same order")
        return obj.copies[rank]

    def _handle(self, obj: int, rank: int) -> int:
        return self._base + (obj << 8) + rank

    def _pointers(self, tensor: torch.Tensor) -> torch.Tensor:
        key = _STORAGES.get(tensor.untyped_storage().data_ptr())
        if key is None or key[0] is not self:
            raise MpkError("peer_pointers of a tensor this heap did not allocate; expected a tensor from allocate()")
        return torch.tensor([self._handle(key[1], r) for r in range(self.world)], dtype=torch.int64)


@dataclass
class CpuAllocator:
    """Rank ``rank``'s SymmetricAllocator over a CpuSymmetricHeap."""

    heap: CpuSymmetricHeap
    rank: int

    @property
    def world(self) -> int:
        return self.heap.world

    def allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return self.heap._allocate(self.rank, tuple(shape), dtype)

    def peer_pointers(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.heap._pointers(tensor)


def _resolve(handle: int) -> tuple[_Object, int]:
    try:
        heap, obj, rank = _HANDLES[handle]
    except KeyError:
        raise MpkError(f"peer address {handle:#x} is no CPU symmetric buffer; the CPU interpreter's peer tables "
                       "must come from CpuSymmetricHeap allocators") from None
    return heap.objects[obj], rank


def put(handle: int, index: tuple, data: torch.Tensor, seq: int) -> None:
    """Write ``data`` into the peer copy ``handle`` at ``index`` ([slot, source rank, rows, cols])
    as sequence ``seq``; RaceError if that region holds data its owner has not consumed."""
    obj, rank = _resolve(handle)
    pending = obj.pending[rank][index]
    if bool(pending.any()):
        old = int(obj.stamp[rank][index][pending].flatten()[0])
        raise RaceError(f"cross-rank race on {obj.name}: rank {index[1]} put sequence {seq} into rank {rank}'s slot "
                        f"{index[0]} (rows {index[2].start}:{index[2].stop}, cols {index[3].start}:{index[3].stop}), "
                        f"which still holds sequence {old} that rank {rank} has not reduced yet")
    obj.copies[rank][index] = data
    obj.stamp[rank][index] = seq
    obj.pending[rank][index] = True


def signal(handle: int, index: tuple[int, int], seq: int) -> None:
    """Store ``seq`` into the peer's signal ``index`` ([source rank, tile]); signals only grow."""
    obj, rank = _resolve(handle)
    obj.copies[rank][index] = max(int(obj.copies[rank][index]), seq)


def consume(view: torch.Tensor, seq: int, source: int, rank: int) -> None:
    """Rank ``rank`` reads ``view`` (its receive slot from ``source``) as sequence ``seq``;
    RaceError unless every element holds exactly that sequence. A view of memory no CPU heap
    owns (a world-1 graph's unused buffers) is not tracked."""
    key = _STORAGES.get(view.untyped_storage().data_ptr())
    if key is None:
        return
    heap, i, owner = key
    obj = heap.objects[i]
    ids = torch.arange(obj.copies[owner].numel()).as_strided(view.shape, view.stride(), view.storage_offset())
    stamp = obj.stamp[owner].view(-1)[ids]
    if bool((stamp != seq).any()):
        got = int(stamp[stamp != seq].flatten()[0])
        what = "no put yet" if got < 0 else f"sequence {got}"
        raise RaceError(f"cross-rank race on {obj.name}: rank {rank} reduced rank {source}'s data as sequence {seq} "
                        f"but its slot holds {what} (read without the put happening before it, or overwritten)")
    obj.pending[owner].view(-1)[ids] = False
