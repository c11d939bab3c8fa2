"""The few CUDA driver calls the executor needs (module load, cooperative launch, occupancy),
through ctypes on libcuda: no compiled host extension, so one cubin serves any Python."""

from __future__ import annotations

import ctypes
from functools import lru_cache

from mpk.errors import MpkError


class CudaDriverError(MpkError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise CudaDriverError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from None


def check(result: int, call: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        _lib().cuGetErrorString(result, ctypes.byref(msg))
        raise CudaDriverError(f"{call} failed: CUDA error {result} ({(msg.value or b'?').decode()})")


class Module:
    """A loaded cubin; ``function(name)`` returns a CUfunction handle."""

    def __init__(self, image: bytes):
        self._image = ctypes.create_string_buffer(image)  # the driver reads it during load
        self.handle = ctypes.c_void_p()
        check(_lib().cuModuleLoadData(ctypes.byref(self.handle), self._image), "cuModuleLoadData")

    def function(self, name: str) -> ctypes.c_void_p:
        fn = ctypes.c_void_p()
        check(_lib().cuModuleGetFunction(ctypes.byref(fn), self.handle, name.encode()), f"cuModuleGetFunction({name})")
        return fn

    def global_ptr(self, name: str) -> tuple[int, int]:
        """(device address, size in bytes) of a module-scope variable with C linkage."""
        ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
        check(_lib().cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), self.handle, name.encode()),
              f"cuModuleGetGlobal({name})")
        return ptr.value, size.value

    def __del__(self):
        if getattr(self, "handle", None) and self.handle.value:
            _lib().cuModuleUnload(self.handle)


def copy_device_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    check(_lib().cuMemcpyDtoDAsync_v2(ctypes.c_uint64(dst), ctypes.c_uint64(src), ctypes.c_size_t(nbytes),
                                      ctypes.c_void_p(stream)), "cuMemcpyDtoDAsync")


def memset_d32_async(dst: int, value: int, count: int, stream: int) -> None:
    check(_lib().cuMemsetD32Async(ctypes.c_uint64(dst), ctypes.c_uint(value), ctypes.c_size_t(count),
                                  ctypes.c_void_p(stream)), "cuMemsetD32Async")


def max_blocks_per_sm(fn: ctypes.c_void_p, threads: int, smem: int = 0) -> int:
    n = ctypes.c_int()
    check(_lib().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), fn, threads, ctypes.c_size_t(smem)),
          "cuOccupancyMaxActiveBlocksPerMultiprocessor")
    return n.value


def param_array(values: list) -> ctypes.Array:
    """A launch's parameter array (pointers to each value, which it keeps alive): build it once
    for launches that repeat (``launch`` takes it in place of the list)."""
    holders = [v if isinstance(v, (ctypes._SimpleCData, ctypes.Structure)) else ctypes.c_void_p(v) for v in values]
    arr = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
    arr._holders = holders  # keep alive until the launch call returns
    return arr


CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


def allow_dynamic_smem(fn: ctypes.c_void_p, nbytes: int) -> None:
    """Let launches of ``fn`` ask for ``nbytes`` of dynamic shared memory (beyond the 48 KiB a
    launch gets without asking)."""
    check(_lib().cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(nbytes)),
          f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes})")


def launch(fn, grid: int, threads: int, stream: int, params: list | ctypes.Array, cooperative: bool = False,
           smem: int = 0) -> None:
    p = params if isinstance(params, ctypes.Array) else param_array(params)
    if cooperative:
        check(_lib().cuLaunchCooperativeKernel(fn, grid, 1, 1, threads, 1, 1, smem, ctypes.c_void_p(stream), p),
              "cuLaunchCooperativeKernel")
    else:
        check(_lib().cuLaunchKernel(fn, grid, 1, 1, threads, 1, 1, smem, ctypes.c_void_p(stream), p, None),
              "cuLaunchKernel")


class MappedHostBuffer:
    """Pinned host memory mapped into the device's address space: the host reads and writes it
    (``array``) while a kernel runs, the kernel through ``device_ptr`` — the watchdog's channel."""

    def __init__(self, num_ints: int):
        import numpy as np

        self.nbytes = 4 * max(1, num_ints)
        self.host = ctypes.c_void_p()
        check(_lib().cuMemHostAlloc(ctypes.byref(self.host), ctypes.c_size_t(self.nbytes), 0x02),
              "cuMemHostAlloc(DEVICEMAP)")
        dptr = ctypes.c_uint64()
        check(_lib().cuMemHostGetDevicePointer_v2(ctypes.byref(dptr), self.host, 0), "cuMemHostGetDevicePointer")
        self.device_ptr = dptr.value
        buf = (ctypes.c_int32 * (self.nbytes // 4)).from_address(self.host.value)
        self.array = np.ctypeslib.as_array(buf)
        self.array[:] = 0

    def __del__(self):
        if getattr(self, "host", None) and self.host.value:
            _lib().cuMemFreeHost(self.host)


CUDA_ERROR_NOT_READY = 600
CU_STREAM_NON_BLOCKING = 1


class Stream:
    """A driver stream that does not synchronise with the legacy default stream: the watchdog
    copies a hung launch's device state on it while the launch still runs."""

    def __init__(self):
        self.handle = ctypes.c_void_p()
        check(_lib().cuStreamCreate(ctypes.byref(self.handle), CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    def query(self) -> bool:
        """Whether all work issued to the stream has completed."""
        result = _lib().cuStreamQuery(self.handle)
        if result == CUDA_ERROR_NOT_READY:
            return False
        check(result, "cuStreamQuery")
        return True

    def __del__(self):
        if getattr(self, "handle", None) and self.handle.value:
            _lib().cuStreamDestroy_v2(self.handle)


def copy_to_host_async(dst_host: int, src: int, nbytes: int, stream: Stream) -> None:
    """Device → pinned host memory, asynchronously on ``stream``."""
    check(_lib().cuMemcpyDtoHAsync_v2(ctypes.c_void_p(dst_host), ctypes.c_uint64(src), ctypes.c_size_t(nbytes),
                                      stream.handle), "cuMemcpyDtoHAsync")


def current_context() -> int:
    ctx = ctypes.c_void_p()
    check(_lib().cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
    return ctx.value or 0


def set_current_context(ctx: int) -> None:
    """Make ``ctx`` current on the calling thread (a new thread starts with none)."""
    check(_lib().cuCtxSetCurrent(ctypes.c_void_p(ctx)), "cuCtxSetCurrent")
