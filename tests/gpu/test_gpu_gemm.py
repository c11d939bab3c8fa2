"""The tensor-core GEMM (cuda/mpk_tasks/gemm.cuh) on the GPU (marker ``gpu``; skipped without
CUDA): projections of more than 16 rows through ``torch.compile(backend="mpk")`` against float64
references on fresh random inputs, M, N and K off the 128 × 128 × 64 tile, bf16 and fp16, plain
(with a residual, a bias vector, alpha and beta) and with the SiLU·mul epilogue, tiles of one
and of several sub-tiles; and the split-K partial products of GEMMs too small to fill the
workers. Each case is one nvcc build."""

from __future__ import annotations

import pytest
import torch

from mpk.backend import COMPILED
from mpk.compiler.splitk import gemm_slices
from mpk.executors.codegen import generate, matmul_path
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


# (m, n, k, dtype, extra, tiles): 300 × 1000 × 776 off the tile everywhere (24 sub-tiles: split
# over K into 3 slices, the last one 200 long); 2049 rows over K = 4096 (17 row sub-tiles, the
# last one's rows partial; whole); 40 rows (one sub-tile a third full; 4 slices); tiles of
# 3 × 3 sub-tiles starting at odd columns (scalar stores at the odd bounds; K too short to
# split); addmm's bias vector with alpha and beta (whole); a short prompt's o-projection (16
# sub-tiles: 8 slices); 2100 × 2100 whole (289 sub-tiles)
@pytest.mark.parametrize("m,n,k,dtype,extra,tiles", [
    (300, 1000, 776, torch.bfloat16, "residual", None),
    (2049, 256, 4096, torch.bfloat16, None, None),
    (40, 520, 1032, torch.float16, "residual", None),
    (600, 703, 136, torch.bfloat16, "residual", [2, 2]),
    (129, 130, 264, torch.float16, "addmm", None),
    (64, 2048, 2048, torch.bfloat16, "residual", None),
    (2100, 2100, 776, torch.bfloat16, "residual", None),
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
    tables = COMPILED[-1].tables
    slices = tables.meta["ops"][0]["attrs"].get("slices", 1)
    workers = int(tables.meta["placement"]["num_workers"])
    assert slices == (1 if tiles else gemm_slices(m, n, k, workers))  # (a given partition: the tiles named)
    # one rounding of the fp32 result (the bias or residual added in fp32), a K + S-term fp32 sum
    assert relative_error(out, ref) <= rounding_bound(dtype, 1, k + slices - 1)
    kinds = [o["kind"] for o in tables.meta["ops"]]
    assert kinds == (["matmul_partial", "matmul_finish"] if slices > 1 else ["matmul"])
    assert matmul_path(tables, 0) == "gemm"
    assert ("mpk::gemm_task<" + ("__half" if dtype == torch.float16 else "__nv_bfloat16") + ", false, true, true>"
            in generate(tables)) == (slices > 1)


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
