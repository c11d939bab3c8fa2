"""Worker targets for the launcher's CPU tests (tests/distributed): fake steps that record
what they were sent in the job's store, so the driver can check every rank ran every step;
and a fake nvshmem4py for the NVSHMEM bootstrap's logic."""

from __future__ import annotations

import os

import numpy as np
import torch

from mpk.distributed.launch import Job
from mpk.distributed.steps import agree, serve_steps


def record(job: Job, inputs: object) -> None:
    """A fake step: append ``inputs`` to this rank's list in the store (``steps/<rank>``)."""
    job.store.append(f"steps/{job.rank}", f"{inputs!r};")


def echo_worker(job: Job, digest: str = "same", die_at: int | None = None, die_rank: int = 1) -> None:
    """Agree on ``digest`` (a rank may pass another: ``{rank: digest}`` as a string
    "rank=digest,..."), then run ``record`` for each step; rank ``die_rank`` dies (exit
    status 3) on step ``die_at`` instead."""
    mine = dict(pair.split("=") for pair in digest.split(",")) if "=" in digest else {}
    agree(job, mine.get(str(job.rank), "same") if mine else digest)
    steps = 0

    def step(inputs: object) -> None:
        nonlocal steps
        if die_at is not None and steps == die_at and job.rank == die_rank:
            os._exit(3)
        record(job, inputs)
        steps += 1

    serve_steps(job, step)


# --- a fake nvshmem4py: the bootstrap's logic (unique id, PE checks, teardown order) on the CPU ---

UID_BYTES = 128  # sizeof(nvshmemx_uniqueid_v1)


class FakeUid:
    """nvshmem.bindings.uniqueid's shape: a one-record numpy array in ``_data``."""

    def __init__(self):
        self._data = np.zeros(1, dtype=[("version", "<i4"), ("internal", "u1", (UID_BYTES - 4,))])


class FakeNvshmem:
    """nvshmem.core, nvshmem.bindings and cuda.core.Device in one object, recording calls;
    ``pe_shift``: NVSHMEM numbers this process's PE that much off its rank (a mismatch);
    ``fail_init``: init raises it."""

    def __init__(self, pe_shift: int = 0, fail_init: Exception | None = None):
        self.calls: list[tuple] = []
        self.pe_shift, self.fail_init = pe_shift, fail_init
        self.rank = self.world = -1
        self.core = self.bindings = self

    def device(self, index: int) -> "FakeNvshmem":
        self.calls.append(("device", index))
        return self

    def set_current(self) -> None:
        self.calls.append(("set_current",))

    def get_unique_id(self, empty: bool = False) -> FakeUid:
        uid = FakeUid()
        if not empty:
            uid._data.view(np.uint8)[:] = np.arange(UID_BYTES, dtype=np.uint8) * 7 + 1
        return uid

    def init(self, device, uid, rank, nranks, initializer_method) -> None:
        self.calls.append(("init", uid._data.tobytes(), rank, nranks, initializer_method))
        if self.fail_init is not None:
            raise self.fail_init
        self.rank, self.world = rank, nranks

    def my_pe(self) -> int:
        return self.rank + self.pe_shift

    def n_pes(self) -> int:
        return self.world

    def ptr(self, addr: int, pe: int) -> int:
        """Every PE reachable; a peer's copy at a distinct made-up address."""
        return addr if pe == self.rank else addr + (pe + 1) * (1 << 40)

    def tensor(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(shape, dtype=dtype)
        self.calls.append(("tensor", shape))
        return t

    def free_tensor(self, t: torch.Tensor) -> None:
        self.calls.append(("free", tuple(t.shape)))

    def finalize(self) -> None:
        self.calls.append(("finalize",))


def patch_nvshmem(fake: FakeNvshmem) -> None:
    """Make ``init_nvshmem`` use ``fake`` and no CUDA device (this process only)."""
    import mpk.distributed.nvshmem as nv

    nv._import = lambda: nv._Nvshmem(fake, fake, fake.device)
    torch.cuda.set_device = lambda index: None
    torch.cuda.current_device = lambda: 0


def nvshmem_worker(job: Job) -> None:
    """Initialise the fake NVSHMEM over the job's group; store the unique id this rank got."""
    from mpk.distributed.nvshmem import init_nvshmem

    fake = FakeNvshmem()
    patch_nvshmem(fake)
    with init_nvshmem():
        pass
    job.store.set(f"uid/{job.rank}", next(c[1] for c in fake.calls if c[0] == "init"))


# --- NVSHMEM on a GPU (tests/distributed/test_nvshmem.py, marked gpu) ---


def store_through_peer(allocator, buf: torch.Tensor, pe: int, values: torch.Tensor) -> None:
    """Copy ``values`` (on this GPU) into PE ``pe``'s copy of ``buf`` through its peer pointer
    (a P2P store by the copy engine), and wait for it."""
    from mpk.executors import cuda_driver as drv

    dst = int(allocator.peer_pointers(buf)[pe])
    drv.copy_device_async(dst, values.data_ptr(), values.numel() * values.element_size(),
                          torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()


def pair_on_one_gpu(job: Job) -> str:
    """Two PEs on GPU 0 (NVSHMEM's multi-process-per-GPU mode): each allocates a buffer, rank 0
    stores into rank 1's copy through its peer pointer, rank 1 checks it. Returns "ok", or why
    it could not run ("unsupported: ..." when NVSHMEM refuses the mode); rank 1 also puts its
    answer in the store (``pair/1``)."""
    import torch.distributed as dist

    from mpk.distributed.nvshmem import init_nvshmem
    from mpk.errors import DistributedError

    try:
        allocator = init_nvshmem(job.control, device=0)
    except DistributedError as e:
        job.store.set(f"pair/{job.rank}", f"unsupported: {e}")
        return f"unsupported: {e}"
    with allocator:
        buf = allocator.allocate((256,), torch.float32)
        buf.zero_()
        torch.cuda.synchronize()
        dist.barrier(group=job.control)
        if job.rank == 0:
            store_through_peer(allocator, buf, 1, torch.arange(256, dtype=torch.float32, device="cuda"))
        dist.barrier(group=job.control)
        ok = job.rank == 0 or torch.equal(buf.cpu(), torch.arange(256, dtype=torch.float32))
        answer = "ok" if ok else f"rank {job.rank} read {buf[:8].tolist()}… after rank 0's store"
        job.store.set(f"pair/{job.rank}", answer)
        dist.barrier(group=job.control)  # free and finalize together
    return answer


def nvshmem_missing_worker(job: Job) -> None:
    """A rank where nvshmem4py does not import: ``init_nvshmem``'s error goes to the store."""
    import sys

    from mpk.distributed.nvshmem import init_nvshmem
    from mpk.errors import NvshmemUnavailableError

    sys.modules["nvshmem"] = None  # import nvshmem raises ImportError
    try:
        init_nvshmem()
    except NvshmemUnavailableError as e:
        job.store.set(f"missing/{job.rank}", str(e))
