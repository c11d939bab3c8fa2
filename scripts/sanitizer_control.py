"""Positive controls for scripts/gpu_sanitize.sh: one planted bug per compute-sanitizer tool,
in a cubin built by mpk's nvcc step and launched through mpk's own driver calls (the path every
megakernel takes). Run under ``compute-sanitizer --tool TOOL`` as ``python3
scripts/sanitizer_control.py TOOL``: the tool must report the bug, or a sweep's "0 errors"
says nothing about mpk's kernels.

memcheck: one warp writes past the end of a tensor. racecheck: two warps exchange values
through shared memory with no barrier between the writes and the reads. synccheck: a lane
calls ``__syncwarp`` with a mask that leaves itself out."""

from __future__ import annotations

import ctypes
import os
import sys

# each tensor its own cudaMalloc, so that a write past it leaves every allocation (in a pooled
# block memcheck would not see it); set before torch reads it
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
import torch  # noqa: E402

from mpk.executors.build import build_cubin  # noqa: E402
from mpk.executors.cuda_driver import Module, launch  # noqa: E402

SOURCE = r"""
extern "C" __global__ void planted_memcheck(float* p, int n) { p[n + threadIdx.x] = 1.0f; }

extern "C" __global__ void planted_racecheck(float* p, int n) {
  __shared__ float s[64];
  s[threadIdx.x] = p[threadIdx.x];
  p[threadIdx.x] = s[63 - threadIdx.x];  // reads the other warp's write: no __syncthreads
}

extern "C" __global__ void planted_synccheck(float* p, int n) {
  __syncwarp(threadIdx.x == 0 ? 0xfffffffeu : 0xffffffffu);
  p[threadIdx.x] = 1.0f;
}
"""
THREADS = {"memcheck": 32, "racecheck": 64, "synccheck": 32}


def main(tool: str) -> None:
    if tool not in THREADS:
        raise SystemExit(f"tool {tool!r}; expected one of {sorted(THREADS)}")
    n = 1 << 16
    buf = torch.randn(n, device="cuda")
    module = Module(build_cubin(SOURCE, progress=False).read_bytes())
    launch(module.function(f"planted_{tool}"), 1, THREADS[tool], torch.cuda.current_stream().cuda_stream,
           [buf.data_ptr(), ctypes.c_int(n)])
    torch.cuda.synchronize()
    print(f"sanitizer control: launched the planted {tool} bug")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "memcheck")
