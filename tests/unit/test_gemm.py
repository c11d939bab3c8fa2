"""The tensor-core GEMM (cuda/mpk_tasks/gemm.cuh) on a machine without a GPU: codegen picks it
from the row count and leaves decode-sized projections as they were, the partitioner cuts its
output into whole MMA sub-tiles, the CPU interpreter runs its grids against eager PyTorch, and
the generated CUDA of odd shapes compiles for sm_90a with its warpgroup MMAs unserialized and
its shared-memory descriptors reading the stages as the copies wrote them."""

from __future__ import annotations

import itertools
import random
import re
import subprocess
import warnings

import pytest
import torch

from mpk.backend import COMPILED
from mpk.errors import PerformanceWarning
from mpk.executors import build
from mpk.executors.codegen import dynamic_smem_bytes, generate, matmul_path
from mpk.inspection import compile_module
from mpk.ops.linalg import GEMM_COLS, GEMM_MIN_ROWS, GEMM_ROWS, GEMM_SMEM_BYTES, LINEAR_ROWS, _matmul_grid
from mpk.ops.registry import OpSig

needs_nvcc = pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")


class _Projections(torch.nn.Module):
    """A plain projection with a residual (r + x @ Wᵀ) and a gate·up projection with SiLU·mul."""

    def __init__(self, n: int, k: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.w = torch.nn.Parameter((torch.randn(n, k) / k ** 0.5).to(dtype), requires_grad=False)
        self.gate_up = torch.nn.Parameter((torch.randn(2 * inter, k) / k ** 0.5).to(dtype), requires_grad=False)
        self.inter = inter

    def forward(self, x, r):
        h = torch.nn.functional.linear(x, self.gate_up)
        return r + torch.nn.functional.linear(x, self.w), torch.nn.functional.silu(h[:, : self.inter]) * h[:, self.inter:]


def _tables(m: int, n: int, k: int, inter: int, dtype: torch.dtype = torch.bfloat16, workers: int = 132):
    x, r = torch.randn(m, k).to(dtype), torch.randn(m, n).to(dtype)
    return compile_module(_Projections(n, k, inter, dtype), (x, r), {"num_workers": workers}).tables


@pytest.mark.parametrize("rows", [1, LINEAR_ROWS, GEMM_MIN_ROWS, 300])
def test_codegen_picks_the_gemm_from_the_row_count(rows):
    """Up to LINEAR_ROWS rows the projections keep the decode linear (and the dispatch its own
    function); from GEMM_MIN_ROWS they take the tensor-core GEMM, its stages in dynamic shared
    memory and the dispatch inlined into the kernel (ptxas serializes warpgroup MMAs in a callee).
    Here the plain projection's 8 or 24 sub-tiles fill less than a quarter of 132 workers, so it
    is split over K: its partial products run the GEMM, the finish op adds them."""
    tables = _tables(rows, 1024, 512, 512)
    src = generate(tables)
    kinds = [o["kind"] for o in tables.meta["ops"]]
    paths = [matmul_path(tables, i) for i, k in enumerate(kinds) if k != "matmul_finish"]
    if rows <= LINEAR_ROWS:
        assert kinds == ["matmul", "matmul"] and paths == ["linear", "linear"]
        assert "gemm_task" not in src and "__noinline__ void mpk_execute_task" in src
        assert "mpk::linear_task<mpk::kPlain, true>" in src and "mpk::linear_task<mpk::kSiluEpilogue, true>" in src
        assert dynamic_smem_bytes(tables) == 0
    else:
        assert kinds == ["matmul_partial", "matmul_finish", "matmul"] and paths == ["gemm", "gemm"]
        assert "linear_task" not in src and "__forceinline__ void mpk_execute_task" in src
        # <T, SiLU·mul, partial planes, W requested before the gate>
        assert "mpk::gemm_task<__nv_bfloat16, false, true, true>" in src
        assert "mpk::gemm_task<__nv_bfloat16, true, false, true>" in src
        assert dynamic_smem_bytes(tables) == GEMM_SMEM_BYTES


def test_gemm_takes_fp16_and_names_what_keeps_a_projection_off_it():
    """float16 takes the GEMM too (its own instantiation); float32, and K off whole 16-byte
    copies, run the general task, with a PerformanceWarning naming why for model-sized weights."""
    assert "mpk::gemm_task<__half, true, false, true>" in generate(_tables(64, 256, 64, 128, torch.float16))
    for dtype, k, why in [(torch.float32, 512, "its operands and output are float32, not all bfloat16 or all float16"),
                          (torch.bfloat16, 1020, "K = 1020 is not a multiple of 8 (16-byte copies)")]:
        tables = _tables(64, 1024, k, 512, dtype)
        assert [matmul_path(tables, i) for i in range(len(tables.ops))] == ["general", "general"]
        with pytest.warns(PerformanceWarning, match=re.escape(why)) as caught:
            generate(tables)
        assert "or the tensor-core GEMM (bf16 or fp16, more rows)" in str(caught[0].message)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _makespan(m: int, n: int, cols: int, grid: tuple[int, int]) -> int:
    """Sub-tiles of the largest tile of ``grid`` (the balanced split's ceiling in each dim)."""
    return _cdiv(_cdiv(m, grid[0]), GEMM_ROWS) * _cdiv(_cdiv(n, grid[1]), cols)


@pytest.mark.parametrize("m,n,epilogue,workers,want", [
    (300, 1000, None, 132, (3, 8)),  # 24 tiles of about 100 × 125: one sub-tile each
    (2049, 256, None, 132, (17, 2)),  # 2049 rows: 17 row tiles of ≤ 121
    (2048, 2048, None, 132, (8, 16)),  # 256 sub-tiles in 128 tiles of 2
    (40, 4096, None, 128, (1, 32)),  # few rows: one row tile
    (520, 1040, "silu_mul", 132, (5, 17)),  # SiLU·mul sub-tiles hold 64 output columns
])
def test_gemm_grid_cuts_whole_sub_tiles(m, n, epilogue, workers, want):
    """The default grid of a GEMM-sized matmul: tiles of whole sub-tiles (128 rows × 128
    output columns, 64 with SiLU·mul), at most one per worker, the largest tile as few
    sub-tiles as any grid allows — checked against every grid — then the fewest tiles."""
    sig = OpSig(((m, 64), (64, 2 * n if epilogue else n)), (m, n), torch.bfloat16,
                {"epilogue": epilogue} if epilogue else {})
    grid = _matmul_grid(sig, workers)
    assert grid == want
    cols = GEMM_COLS // 2 if epilogue else GEMM_COLS
    best = min(_makespan(m, n, cols, (gm, gn)) for gm in range(1, m + 1) for gn in range(1, n + 1) if gm * gn <= workers)
    assert _makespan(m, n, cols, grid) == best and grid[0] * grid[1] <= workers


def test_gemm_grid_leaves_decode_rows_and_other_forms_to_the_split_order():
    """Decode-sized matmuls, batched ones, float32 ones and the norm forms keep the generic
    split (N first)."""
    def grid(out, dtype=torch.bfloat16, **attrs):
        return _matmul_grid(OpSig(((out[-2], 64), (64, out[-1])), out, dtype, attrs), 132)

    assert grid((LINEAR_ROWS, 4096)) is None and grid((GEMM_MIN_ROWS, 4096)) == (1, 32)
    assert grid((2, 300, 4096)) is None and grid((300, 4096), torch.float32) is None
    assert grid((300, 4096), prologue="rms_norm") is None


def test_random_gemm_grids_are_optimal():
    """Fresh random shapes and worker counts: the grid's largest tile is as short as any grid's."""
    rng = random.Random(random.randrange(1 << 30))
    for _ in range(40):
        m, n, workers = rng.randint(GEMM_MIN_ROWS, 5000), rng.randint(1, 5000), rng.randint(1, 200)
        epilogue = rng.choice([None, "silu_mul"])
        cols = GEMM_COLS // 2 if epilogue else GEMM_COLS
        sig = OpSig(((m, 64), (64, 2 * n if epilogue else n)), (m, n), torch.bfloat16,
                    {"epilogue": epilogue} if epilogue else {})
        gm, gn = _matmul_grid(sig, workers)
        best = min(_makespan(m, n, cols, g) for g in itertools.product(range(1, min(m, workers) + 1),
                                                                    range(1, min(n, workers) + 1))
                   if g[0] * g[1] <= workers)
        assert gm * gn <= workers and _makespan(m, n, cols, (gm, gn)) == best, (m, n, workers, epilogue)


def test_gemm_grids_match_eager_on_the_cpu_interpreter():
    """The GEMM's tiles, run by the CPU interpreter (random schedules, race checks), give the
    eager results bit for bit: plain with a residual and the SiLU·mul epilogue, odd shapes."""
    mod = _Projections(200, 72, 100, torch.bfloat16)
    x, r = torch.randn(150, 72).bfloat16(), torch.randn(150, 200).bfloat16()
    fn = torch.compile(mod, backend="mpk", fullgraph=True, dynamic=False,
                       options={"executor": "cpu", "num_workers": 5, "seed": random.randrange(1 << 16)})
    for got, want in zip(fn(x, r), mod(x, r)):
        assert torch.equal(got, want)
    tables = COMPILED[-1].tables
    assert [matmul_path(tables, i) for i in range(len(tables.ops))] == ["gemm", "gemm"]
    assert [tuple(int(g) for g in o["grid"][:2]) for o in tables.ops] == [(2, 2), (2, 2)]


@needs_nvcc
@pytest.mark.slow
def test_gemm_kernels_of_odd_shapes_compile_unserialized(tmp_path):
    """M, N, K off the tile (300 × 1000 × 776, its gate·up of 520 columns, the plain projection
    split over K; 2049 × 256 × 4096, whole) in bf16 and fp16 build for sm_90a; ptxas keeps the
    warpgroup MMAs asynchronous (no C7510 serialization warning) and spills nothing."""
    for i, (shape, dtype) in enumerate([((300, 1000, 776, 520), torch.bfloat16), ((2049, 256, 4096, 128), torch.float16)]):
        with warnings.catch_warnings():
            warnings.simplefilter("error", PerformanceWarning)
            src = generate(_tables(*shape, dtype))
        assert src.count("mpk::gemm_task<") == 2 and ("true, true>" in src) == (i == 0)  # split: planes
        path = tmp_path / f"gemm{i}.cu"
        path.write_text(src)
        res = subprocess.run([build.nvcc_path(), *build.nvcc_flags(), *[f"-I{d}" for d in build.include_dirs()],
                              "-Xptxas", "-v", "-o", str(tmp_path / f"gemm{i}.cubin"), str(path)],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        assert "C7510" not in res.stderr and "serialized" not in res.stderr, res.stderr[-3000:]
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
        assert spills and all(st == ld == "0" for st, ld in spills), res.stderr[-3000:]


_DESCRIPTORS = r"""
#include <cstdio>
#include "mpk_tasks/gemm.cuh"
// Prints every (row, chunk) -> gemm_chunk_offset of a 128-row tile, then the descriptors of
// warpgroup g's x rows and of W's rows at each k step of a stage placed at shared address BASE.
int main() {
  for (int row = 0; row < mpk::kGemmRows; ++row)
    for (int chunk = 0; chunk < 8; ++chunk) printf("o %d %d %d\n", row, chunk, mpk::gemm_chunk_offset(row, chunk));
  for (int kk = 0; kk < mpk::kGemmK / 16; ++kk) {
    for (int g = 0; g < 2; ++g)
      printf("a %d %d %llu\n", g, kk, mpk::gmma_desc(BASE + g * (mpk::kGemmTileBytes / 2) + 32 * kk));
    printf("b %d %llu\n", kk, mpk::gmma_desc(BASE + mpk::kGemmTileBytes + 32 * kk));
  }
}
"""


def _canonical_sw128_k(desc: int, row: int, chunk: int) -> int:
    """The shared address a wgmma reads for 16-byte chunk ``chunk`` (0 or 1: k 0–7, 8–15) of
    operand row ``row`` through a K-major descriptor in the 128-byte swizzle, as CuTe's
    GmmaDescriptor lays the fields out (start >> 4 in bits 0–13, LBO 16–29, SBO 32–45, layout
    62–63 = 1) and its canonical layout Swizzle<3,4,3> ∘ ((8, m), 2) : ((8, SBO), 1) in 16-byte
    units: rows of 128 bytes in 8-row groups SBO apart, the chunk bits 4–6 xor'ed with 7–9."""
    start, lbo, sbo, layout = (desc & 0x3FFF) << 4, (desc >> 16) & 0x3FFF, ((desc >> 32) & 0x3FFF) << 4, desc >> 62
    assert layout == 1 and lbo == 1 and (desc >> 49) & 7 == 0  # 128-byte swizzle, base offset 0
    addr = start + (row // 8) * sbo + (row % 8) * 128 + 16 * chunk
    return addr ^ (((addr >> 7) & 7) << 4)


@needs_nvcc
def test_gemm_descriptors_read_the_swizzled_stage(tmp_path):
    """Host code compiled by nvcc: each operand row's 16-byte chunks land at distinct offsets of
    its 16 KiB tile, and the descriptors of each warpgroup's 64 rows of x and of W's 128 rows at
    k step kk (k 16·kk …) read exactly the chunks 2kk, 2kk + 1 the copies stored for those rows."""
    base = 0x4400  # a 1024-aligned stage, as the task aligns its dynamic shared memory
    src, exe = tmp_path / "descriptors.cu", tmp_path / "descriptors"
    src.write_text(_DESCRIPTORS.replace("BASE", str(base)))
    res = subprocess.run([build.nvcc_path(), "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                          *[f"-I{d}" for d in build.include_dirs()], "-o", str(exe), str(src)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    offset, desc_a, desc_b = {}, {}, {}
    for line in out.splitlines():
        kind, *vals = line.split()
        if kind == "o":
            offset[int(vals[0]), int(vals[1])] = int(vals[2])
        elif kind == "a":
            desc_a[int(vals[0]), int(vals[1])] = int(vals[2])
        else:
            desc_b[int(vals[0])] = int(vals[1])
    assert sorted(offset.values()) == list(range(0, GEMM_ROWS * 128, 16))
    assert all(offset[r, c] + 32 * 128 * i == offset[r + 32 * i, c] for r in range(32) for c in range(8) for i in range(4))
    for kk in range(4):
        for g in range(2):
            for row, chunk in itertools.product(range(64), range(2)):
                assert _canonical_sw128_k(desc_a[g, kk], row, chunk) == base + offset[64 * g + row, 2 * kk + chunk]
        for row, chunk in itertools.product(range(128), range(2)):
            assert _canonical_sw128_k(desc_b[kk], row, chunk) == base + 128 * 128 + offset[row, 2 * kk + chunk]


@needs_nvcc
@pytest.mark.slow
def test_gemm_benchmark_prebuilds_its_cases(tmp_path):
    """``gemm_tflops.py --prebuild`` traces each projection of the chosen shapes at each row
    count on the CPU and builds its kernel (the tensor-core GEMM) into $MPK_CACHE_DIR, for the
    device run to find."""
    import os
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))  # this checkout's mpk
    res = subprocess.run([sys.executable, str(root / "benchmarks" / "gemm_tflops.py"), "--prebuild", "--models", "tiny",
                          "--rows", "32"], capture_output=True, text=True, timeout=900,
                         env=os.environ | {"MPK_CACHE_DIR": str(tmp_path), "PYTHONPATH": path})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "built 4 cubins" in res.stdout and len(list(tmp_path.glob("*.cubin"))) == 4
    assert all("mpk::gemm_task<__nv_bfloat16, false, " in p.read_text() for p in tmp_path.glob("*.cu"))
