"""NVSHMEM's bootstrap from torch.distributed. On the CPU with a fake nvshmem4py: the unique id
travels from rank 0 to every rank, PE numbering is checked, init failures are wrapped, the
teardown frees before it finalises; without nvshmem4py a clear error names the pip command.
On a GPU (marked gpu; skipped without nvshmem4py): one PE through the same path, its peer
pointer, a store through it; two PEs on one GPU when NVSHMEM allows it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import mpk.distributed.nvshmem as nv
from mpk.distributed.launch import RankInfo, free_port, join, start_driver
from mpk.errors import DistributedError, NvshmemUnavailableError, RankMismatchError
from mpk.testing.distributed import FakeNvshmem, patch_nvshmem


@pytest.fixture
def world_of_one(monkeypatch):
    """A one-rank job (gloo on 127.0.0.1); the test's patch_nvshmem is undone after it."""
    _undo_patches(monkeypatch)
    job = join(RankInfo(0, 1, 0, "127.0.0.1", free_port()), timeout_s=5)
    yield job
    if nv.active_allocator() is not None:
        nv.active_allocator().abandon()
    job.close()


def test_missing_nvshmem4py_names_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvshmem", None)  # import nvshmem raises ImportError
    with pytest.raises(NvshmemUnavailableError, match="pip install nvshmem4py-cu13 nvidia-nvshmem-cu13"):
        nv._import()


def test_import_of_mpk_needs_no_nvshmem():
    code = "import sys, mpk, mpk.distributed.nvshmem, mpk.engine.parallel; assert 'nvshmem' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_init_without_a_process_group_is_refused():
    assert not dist.is_initialized()
    with pytest.raises(DistributedError, match="needs torch.distributed initialised"):
        nv.init_nvshmem()


def test_one_pe_allocates_gives_its_own_pointer_and_tears_down_in_order(world_of_one):
    fake = FakeNvshmem()
    patch_nvshmem(fake)
    with nv.init_nvshmem() as allocator:
        assert nv.active_allocator() is allocator
        init = next(c for c in fake.calls if c[0] == "init")
        assert init[1] == fake.get_unique_id()._data.tobytes() and init[2:] == (0, 1, "uid")
        a = allocator.allocate((4, 8), torch.bfloat16)
        b = allocator.allocate([16], torch.float32)
        assert a.shape == (4, 8) and a.dtype == torch.bfloat16
        ptrs = allocator.peer_pointers(a)
        assert ptrs.dtype == torch.int64 and ptrs.tolist() == [a.data_ptr()]
        assert allocator.peer_pointers(b[4:]).tolist() == [b.data_ptr() + 16]  # a view: its own address
        with pytest.raises(DistributedError, match="did not allocate"):
            allocator.peer_pointers(torch.zeros(3))
        with pytest.raises(DistributedError, match="initialised already"):
            nv.init_nvshmem()
    assert [c[0] for c in fake.calls if c[0] in ("free", "finalize")] == ["free", "free", "finalize"]
    assert nv.active_allocator() is None
    with pytest.raises(DistributedError, match="is closed"):
        allocator.allocate((1,), torch.float32)


def test_an_unreachable_peer_is_refused_with_the_reason(world_of_one):
    fake = FakeNvshmem()
    patch_nvshmem(fake)
    fake.ptr = lambda addr, pe: 0  # nvshmem_ptr's answer for a PE across the network
    with nv.init_nvshmem() as allocator:
        with pytest.raises(DistributedError, match=r"PE\(s\) \[0\] have no peer pointer .* one node's NVLink"):
            allocator.peer_pointers(allocator.allocate((2,), torch.float32))


def test_init_failure_and_pe_mismatch_are_typed(world_of_one):
    patch_nvshmem(FakeNvshmem(fail_init=RuntimeError("bootstrap: no route")))
    with pytest.raises(NvshmemUnavailableError, match="failed to initialise PE 0 of 1 on cuda:0: RuntimeError: "
                                                      "bootstrap: no route") as e:
        nv.init_nvshmem()
    assert isinstance(e.value.__cause__, RuntimeError)
    fake = FakeNvshmem(pe_shift=1)
    patch_nvshmem(fake)
    with pytest.raises(RankMismatchError, match="started PE 1 of 1 for rank 0 of 1"):
        nv.init_nvshmem()
    assert fake.calls[-1] == ("finalize",) and nv.active_allocator() is None


def test_a_failed_peer_skips_the_collective_teardown(world_of_one):
    fake = FakeNvshmem()
    patch_nvshmem(fake)
    allocator = nv.init_nvshmem()
    allocator.allocate((2,), torch.float32)
    allocator.abandon()
    allocator.close()
    assert not [c for c in fake.calls if c[0] in ("free", "finalize")]


def _undo_patches(monkeypatch) -> None:
    """patch_nvshmem's replacements are undone after the test (monkeypatch restores what it saw)."""
    for name in ("set_device", "current_device"):
        monkeypatch.setattr(torch.cuda, name, getattr(torch.cuda, name))
    monkeypatch.setattr(nv, "_import", nv._import)


def test_every_rank_gets_rank_0s_unique_id(monkeypatch):
    _undo_patches(monkeypatch)
    job = start_driver(2, "mpk.testing.distributed:nvshmem_worker", {}, timeout_s=5)
    try:
        fake = FakeNvshmem()
        patch_nvshmem(fake)
        with nv.init_nvshmem():
            pass
        assert job.procs[1].wait(60) == 0
        expected = FakeNvshmem().get_unique_id()._data.tobytes()
        assert job.store.get("uid/1") == expected  # rank 1 made an empty id and was sent rank 0's
        assert next(c for c in fake.calls if c[0] == "init")[1:4] == (expected, 0, 2)
    finally:
        job.close(wait_s=1)


# --- on a GPU ------------------------------------------------------------------------------

ONE_PE = textwrap.dedent("""
    import torch
    from mpk.distributed.launch import RankInfo, free_port, join
    from mpk.distributed.nvshmem import init_nvshmem
    from mpk.testing.distributed import store_through_peer
    job = join(RankInfo(0, 1, 0, "127.0.0.1", free_port()), timeout_s=30)
    with init_nvshmem() as allocator:
        buf = allocator.allocate((1024,), torch.float32)
        buf.zero_()
        ptrs = allocator.peer_pointers(buf)
        assert ptrs.tolist() == [buf.data_ptr()], (ptrs.tolist(), buf.data_ptr())
        values = torch.arange(1024, dtype=torch.float32, device="cuda")
        store_through_peer(allocator, buf, 0, values)
        assert torch.equal(buf, values), buf[:8].tolist()
    job.close()
    print("one PE ok")
""")


def _needs_nvshmem() -> None:
    try:
        nv._import()
    except NvshmemUnavailableError as e:
        pytest.skip(str(e))


@pytest.mark.gpu
def test_gpu_one_pe_through_torch_distributed():
    _needs_nvshmem()
    done = subprocess.run([sys.executable, "-c", ONE_PE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "one PE ok" in done.stdout, done.stdout + done.stderr


PAIR = textwrap.dedent("""
    from mpk.distributed.launch import start_driver
    from mpk.testing.distributed import pair_on_one_gpu
    job = start_driver(2, "mpk.testing.distributed:pair_on_one_gpu", {}, timeout_s=60)
    print("rank 0:", pair_on_one_gpu(job))
    print("rank 1:", job.store.get("pair/1").decode())
    job.close()
""")


@pytest.mark.gpu
def test_gpu_two_pes_on_one_gpu_when_nvshmem_allows_it():
    _needs_nvshmem()
    try:
        done = subprocess.run([sys.executable, "-c", PAIR], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as e:
        pytest.skip(f"two PEs on one GPU did not finish within 120 s (NVSHMEM's multi-process-per-GPU mode "
                    f"without MPS): {e.stdout!r} {e.stderr!r}")
    if "unsupported:" in done.stdout:
        pytest.skip(f"NVSHMEM refuses two PEs on one GPU here: {done.stdout.strip()}")
    assert done.returncode == 0 and "rank 1: ok" in done.stdout, done.stdout + done.stderr


def test_a_rank_without_nvshmem4py_stops_every_rank_with_its_reason(monkeypatch):
    _undo_patches(monkeypatch)
    job = start_driver(2, "mpk.testing.distributed:nvshmem_missing_worker", {}, timeout_s=5)
    try:
        patch_nvshmem(FakeNvshmem())  # rank 0 has it; rank 1 does not
        with pytest.raises(NvshmemUnavailableError, match=r"unavailable on rank\(s\) \[1\] .*pip install nvshmem4py"):
            nv.init_nvshmem()
        assert job.procs[1].wait(60) == 0  # (the worker raised the same and reported it)
        assert b"unavailable on rank(s) [1]" in job.store.get("missing/1")
    finally:
        job.close(wait_s=1)
