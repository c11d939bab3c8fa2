"""The tensor-core GEMM (cuda/mpk_tasks/gemm.cuh) on the GPU (marker ``gpu``; skipped without
CUDA): projections of more than 16 rows through ``torch.compile(backend="mpk")`` against float64
references on fresh random inputs, M, N and K off the 128 × 128 × 64 tile, bf16 and fp16, plain
(with a residual, a bias vector, alpha and beta) and with the SiLU·mul epilogue, tiles of one
and of several sub-tiles. Each case is one nvcc build."""

from __future__ import annotations

import pytest
import torch

from mpk.backend import COMPILED
from mpk.executors.codegen import matmul_path
from mpk.testing.graphs import relative_error
from mpk.testing.tolerance import SILU_GAIN, rounding_bound

pytestmark = pytest.mark.gpu
DEV = "cuda"
# A rounding the reference repeats can differ by one ulp (2u) where the kernel's fp32 sum and the
# float64 one fall on either side of a rounding boundary: such a rounding counts 2 × its gain.
FLIP = 2


def _gpu_compile(fn, **options):
    return torch.compile(fn, backend="mpk", fullgraph=True, dynamic=False, options={"executor": "gpu", **options})


def _weight(rows: int, k: int, dtype: torch.dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter((torch.randn(rows, k, device=DEV) / k ** 0.5).to(dtype), requires_grad=False)


class _Plain(torch.nn.Module):
    """x @ Wᵀ, plus the residual r (a decoder layer's o and down projections), or addmm with a
    bias vector and alpha, beta."""

    def __init__(self, n: int, k: int, dtype: torch.dtype, extra: str | None):
        super().__init__()
        self.w, self.extra = _weight(n, k, dtype), extra
        self.bias = torch.nn.Parameter(torch.randn(n, device=DEV).to(dtype), requires_grad=False)

    def forward(self, x, r):
        if self.extra == "addmm":
            return torch.addmm(self.bias, x, self.w.t(), beta=0.5, alpha=2.0)
        y = torch.nn.functional.linear(x, self.w)
        return r + y if self.extra == "residual" else y


# (m, n, k, dtype, extra, tiles): 300 × 1000 × 776 off the tile everywhere (24 one-sub-tile tiles
# of ~100 × 125); 2049 rows over K = 4096 (17 row tiles, the last sub-tile's rows partial);
# 40 rows (one sub-tile a third full); tiles of 3 × 3 sub-tiles starting at odd columns (scalar
# stores at the odd bounds); addmm's bias vector with alpha and beta
@pytest.mark.parametrize("m,n,k,dtype,extra,tiles", [
    (300, 1000, 776, torch.bfloat16, "residual", None),
    (2049, 256, 4096, torch.bfloat16, None, None),
    (40, 520, 1032, torch.float16, "residual", None),
    (600, 703, 136, torch.bfloat16, "residual", [2, 2]),
    (129, 130, 264, torch.float16, "addmm", None),
])
def test_gemm_matches_float64(m, n, k, dtype, extra, tiles):
    mod = _Plain(n, k, dtype, extra)
    x = torch.randn(m, k, device=DEV).to(dtype)
    r = torch.randn(m, n, device=DEV).to(dtype)
    out = _gpu_compile(mod, **({"partition": {"matmul": tiles}} if tiles else {}))(x, r)
    ref = x.double() @ mod.w.double().T
    if extra == "residual":
        ref = ref + r.double()
    elif extra == "addmm":
        ref = 2.0 * ref + 0.5 * mod.bias.double()
    # one rounding of the fp32 result (the bias or residual added in fp32), a K-term fp32 sum
    assert relative_error(out, ref) <= rounding_bound(dtype, 1, k)
    assert [matmul_path(COMPILED[-1].tables, 0)] == ["gemm"]


class _GateUp(torch.nn.Module):
    def __init__(self, inter: int, k: int, dtype: torch.dtype):
        super().__init__()
        self.w, self.inter = _weight(2 * inter, k, dtype), inter

    def forward(self, x):
        h = torch.nn.functional.linear(x, self.w)
        return torch.nn.functional.silu(h[:, : self.inter]) * h[:, self.inter:]


# (m, inter, k, dtype, tiles): odd rows, columns and K; 2049 rows in fp16; tiles of several
# 128-row × 64-column sub-tiles with bounds off them
@pytest.mark.parametrize("m,inter,k,dtype,tiles", [
    (300, 520, 776, torch.bfloat16, None),
    (2049, 1000, 264, torch.float16, None),
    (257, 300, 512, torch.bfloat16, [2, 3]),
])
def test_gemm_silu_epilogue_matches_float64(m, inter, k, dtype, tiles):
    """The gate·up projection with SiLU·mul in the GEMM's epilogue against a float64 projection
    rounded to the dtype, then SiLU·mul with the same roundings."""
    mod = _GateUp(inter, k, dtype)
    x = torch.randn(m, k, device=DEV).to(dtype)
    out = _gpu_compile(mod, **({"partition": {"matmul": tiles}} if tiles else {}))(x)
    h = (x.double() @ mod.w.double().T).to(dtype).double()
    ref = torch.nn.functional.silu(h[:, :inter]).to(dtype).double() * h[:, inter:]
    # the output's rounding (not in ref); ref's roundings of gate (through silu), silu(gate) and up
    assert relative_error(out, ref) <= rounding_bound(dtype, [1, FLIP * SILU_GAIN, FLIP, FLIP], k)
    assert [matmul_path(COMPILED[-1].tables, 0)] == ["gemm"]
