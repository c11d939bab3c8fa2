"""NVSHMEM through nvshmem4py (``pip install nvshmem4py-cu13 nvidia-nvshmem-cu13``),
bootstrapped from torch.distributed: rank 0 makes NVSHMEM's unique id, the group broadcasts
it, every rank initialises one PE (PE = its rank in the group) on its GPU.

``NvshmemAllocator`` is the ``SymmetricAllocator`` the sharded graph takes its communication
buffers from (mpk.distributed.symmetric): ``allocate`` makes a tensor on NVSHMEM's symmetric
heap (a collective: every rank allocates the same shapes in the same order), and
``peer_pointers`` gives, per PE, the address through which this GPU stores into that PE's copy
(``nvshmem_ptr``): on one node's NVLink every PE has one; a PE across the network has none,
and ``peer_pointers`` refuses it, since mpk's communication tasks store through pointers.

Teardown frees the buffers, then finalises (both collective), at ``close()`` or at exit. After
a peer died (``abandon()``, which the job's monitor calls), nothing collective runs: the
process ends and the driver reclaims the GPU memory with it.

nvshmem4py is imported on first use only, so mpk imports and runs on one GPU without it.
"""

from __future__ import annotations

import atexit
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from mpk.distributed.launch import disable_multicast
from mpk.distributed.symmetric import set_allocator
from mpk.errors import DistributedError, NvshmemUnavailableError, RankMismatchError

PIP = "pip install nvshmem4py-cu13 nvidia-nvshmem-cu13"

_active: "NvshmemAllocator | None" = None


@dataclass(frozen=True)
class _Nvshmem:
    """The parts of nvshmem4py used here (tests substitute fakes)."""

    core: Any  # nvshmem.core: get_unique_id, init, finalize, tensor, free_tensor
    bindings: Any  # nvshmem.bindings: my_pe, n_pes, ptr (nvshmem_ptr)
    device: Any  # cuda.core.Device


def _import() -> _Nvshmem:
    try:
        import nvshmem.bindings as bindings
        import nvshmem.core as core
        from cuda.core import Device
    except ImportError as e:
        raise NvshmemUnavailableError(f"tensor parallelism needs NVSHMEM through nvshmem4py, which does not import "
                                      f"here ({e}); install it: {PIP}") from e
    return _Nvshmem(core, bindings, Device)


def _import_everywhere(group: Any, rank: int, world: int) -> _Nvshmem:
    """``_import()`` on every rank, its failures compared first: a rank without nvshmem4py
    stops them all with its reason (otherwise the others would wait in NVSHMEM's start-up for
    a PE that never comes)."""
    try:
        nv, problem = _import(), None
    except NvshmemUnavailableError as e:
        nv, problem = None, str(e)
    problems: list[Any] = [None] * world
    dist.all_gather_object(problems, problem, group=group)
    failed = [r for r, p in enumerate(problems) if p]
    if failed:
        raise NvshmemUnavailableError(f"NVSHMEM is unavailable on rank(s) {failed} (rank {failed[0]}: "
                                      f"{problems[failed[0]]})")
    return nv


def active_allocator() -> "NvshmemAllocator | None":
    """This process's allocator (NVSHMEM is one per process), or None before ``init_nvshmem``."""
    return _active


def init_nvshmem(group: Any = None, device: int | torch.device | None = None,
                 close_at_exit: bool = True) -> "NvshmemAllocator":
    """Initialise NVSHMEM with one PE per rank of ``group`` (None: the default group) on
    ``device`` (default: the current CUDA device); returns the process's ``NvshmemAllocator``.
    ``close_at_exit``: tear it down at interpreter exit (collective: right for SPMD scripts,
    whose ranks all exit together; an engine closes it itself, after stopping its workers).
    Raises ``NvshmemUnavailableError`` when nvshmem4py is missing or NVSHMEM fails to start (the
    cause chained), ``RankMismatchError`` when NVSHMEM's PEs do not match the group."""
    global _active
    if _active is not None:
        raise DistributedError(f"NVSHMEM is initialised already in this process (PE {_active.rank} of "
                               f"{_active.world}); expected one init_nvshmem per process (active_allocator() "
                               "returns it)")
    if not dist.is_initialized():
        raise DistributedError("init_nvshmem needs torch.distributed initialised (mpk.distributed.launch.join, or "
                               "torch.distributed.init_process_group under torchrun)")
    disable_multicast()  # NVSHMEM reads its environment at init
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    nv = _import_everywhere(group, rank, world)
    index = torch.cuda.current_device() if device is None else device if isinstance(device, int) else device.index
    torch.cuda.set_device(index)
    uid = nv.core.get_unique_id(empty=rank != 0)
    # the id's bytes, rank 0's to every rank (broadcast_object_list works over gloo and NCCL)
    box = [uid._data.tobytes() if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    uid._data.view(np.uint8)[:] = np.frombuffer(box[0], np.uint8)
    dev = nv.device(index)
    dev.set_current()
    try:
        nv.core.init(device=dev, uid=uid, rank=rank, nranks=world, initializer_method="uid")
    except Exception as e:
        raise NvshmemUnavailableError(f"NVSHMEM failed to initialise PE {rank} of {world} on cuda:{index}: "
                                      f"{type(e).__name__}: {e} (NVSHMEM_DEBUG=INFO shows its steps)") from e
    pe, pes = nv.bindings.my_pe(), nv.bindings.n_pes()
    if (pe, pes) != (rank, world):
        nv.core.finalize()
        raise RankMismatchError(f"NVSHMEM started PE {pe} of {pes} for rank {rank} of {world}; expected PE {rank} of "
                                f"{world} (was another NVSHMEM job started with this unique id?)", (rank,))
    _active = NvshmemAllocator(nv, rank, world, index)
    set_allocator(_active)  # tensor-parallel graphs' runners take their buffers from it
    if close_at_exit:
        atexit.register(_active.close)
    return _active


class NvshmemAllocator:
    """Symmetric tensors on NVSHMEM's heap and their peers' addresses (the SymmetricAllocator
    protocol); made by ``init_nvshmem``. A context manager: leaving it tears NVSHMEM down."""

    def __init__(self, nv: _Nvshmem, rank: int, world: int, device: int):
        self.nv, self.rank, self.world, self.device = nv, rank, world, device
        self._tensors: list[torch.Tensor] = []
        self.closed = self.abandoned = False

    def _check_open(self) -> None:
        if self.closed or self.abandoned:
            state = "closed" if self.closed else "abandoned after a peer failed"
            raise DistributedError(f"the NVSHMEM allocator of PE {self.rank} is {state}; expected an open one "
                                   "(init_nvshmem)")

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` on the symmetric heap of this rank's GPU,
        uninitialised. Collective: every rank allocates the same in the same order."""
        self._check_open()
        shape = tuple(int(n) for n in shape)
        if any(n < 0 for n in shape) or not isinstance(dtype, torch.dtype):
            raise DistributedError(f"allocate(shape={shape}, dtype={dtype!r}); expected sizes ≥ 0 and a torch.dtype")
        t = self.nv.core.tensor(shape, dtype=dtype)
        self._tensors.append(t)
        return t

    def peer_pointers(self, tensor: torch.Tensor) -> torch.Tensor:
        """int64 [world]: entry p is the address of ``tensor``'s copy on PE p as this GPU
        reaches it (p = this rank: its own address). ``tensor``: one ``allocate`` returned, or
        a view into one."""
        self._check_open()
        base = tensor.untyped_storage().data_ptr()
        if not any(t.untyped_storage().data_ptr() == base for t in self._tensors):
            raise DistributedError(f"peer_pointers of a tensor at {tensor.data_ptr():#x} that this allocator did not "
                                   "allocate; expected a tensor from allocate() (or a view of one)")
        ptrs = [int(self.nv.bindings.ptr(tensor.data_ptr(), pe)) for pe in range(self.world)]
        far = [pe for pe, p in enumerate(ptrs) if p == 0]
        if far:
            raise DistributedError(f"PE(s) {far} have no peer pointer from PE {self.rank}'s GPU (not on its NVLink / "
                                   "P2P domain); mpk's communication tasks store through peer pointers, so every "
                                   "rank must be on one node's NVLink")
        return torch.tensor(ptrs, dtype=torch.int64, device=tensor.device)

    def abandon(self) -> None:
        """A peer failed: skip the collective teardown (it would wait for the dead peer)."""
        self.abandoned = True
        self._forget()

    def close(self) -> None:
        """Free every buffer, then finalise NVSHMEM (collective; once; nothing after
        ``abandon``)."""
        if self.closed:
            return
        self.closed = True
        if self.abandoned:
            return
        try:
            for t in self._tensors:
                self.nv.core.free_tensor(t)
            self._tensors.clear()
        finally:
            self._forget()
            self.nv.core.finalize()

    def _forget(self) -> None:
        global _active
        if _active is self:
            _active = None
            set_allocator(None)
        atexit.unregister(self.close)

    def __enter__(self) -> "NvshmemAllocator":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leave(job: Any) -> None:
    """End an SPMD script's job (``mpk.distributed.launch.Job``) on every rank together
    (torchrun): a barrier (no rank still reads a peer's buffers), this process's NVSHMEM torn
    down if it started it, then ``job.close()``. Leaving without it lets interpreter exit
    destroy the groups under the monitor's thread (torchrun then reports aborted ranks)."""
    dist.barrier(group=job.control)
    if _active is not None:
        _active.close()
    job.close()
