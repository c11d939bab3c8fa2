"""Split-K projections: ``matmul_partial`` and ``matmul_finish``.

A decode projection whose input is produced piecewise along K (the o-projection over attention
heads, the down-projection over the gate·up projection's column tiles) reads the whole K extent
of its rows, so each of its tasks waits for every producer tile. The split-K pass
(mpk.compiler.splitk) replaces such a ``matmul`` by two ops:

* ``matmul_partial``: out P [S, M, N] in fp32 (float64 for float64 products) with
  P[s] = a[:, k_s] @ b[k_s, :] over K slice k_s = [bounds[s], bounds[s + 1]) (``slice_bounds``).
  A tile (slices s0..s1, rows, columns) reads only a's columns and b's rows of its slices, so
  dependency analysis gives it exactly the producer tiles that intersect them, and it starts
  while the rest of a is still being computed;
* ``matmul_finish``: out [M, N] = alpha·(P[0] + P[1] + … + P[S-1]) + beta·bias, the sum in that
  fixed order in the accumulation dtype, one rounding to the output dtype at the end. A tile
  reads P[:, rows, columns] for all S slices, so it waits for exactly the partial tasks of its
  column tile.

The split-K pass also splits tensor-core GEMMs (more than 16 rows) of too few sub-tiles to fill
the workers (a short prompt's projections, a decode batch of 17 to a few hundred sequences):
their partial tasks run the GEMM over a K slice (cuda/mpk_tasks/gemm.cuh, kPlanes), one
128 × 128 sub-tile a task.

Accumulation is deterministic: every slice writes its own plane of P (no two tasks write one
element, which the happens-before check and the interpreter's race tracking verify like any
other write) and one finish task adds the planes in slice order. Atomics into one fp32 tile
would save the planes' memory (S·M·N·4 bytes: 128 KiB at S = 8, M = 1, N = 4096) but make the
result depend on the arrival order.
"""

from __future__ import annotations

import math

import torch

from mpk.ops.gpu import GpuSpec, OpInfo, Params
from mpk.ops.linalg import GEMM_COLS, GEMM_MIN_ROWS, GEMM_ROWS, GEMM_SMEM_BYTES, gemm_instance, gemm_operand_blockers
from mpk.ops.registry import OpDef, OpSig, broadcast_region, register


def slice_bounds(k: int, slices: int, granule: int) -> tuple[int, ...]:
    """The S + 1 boundaries of K's slices: whole granules split evenly (slice s starts at
    granule ⌊s·U/S⌋, U = ⌊K / granule⌋ granules), the last slice also taking K's remainder. The
    CUDA tasks recompute them (cuda/mpk_tasks/splitk.cuh: slice_bound)."""
    units = k // granule
    if not 1 <= slices <= units:
        raise ValueError(f"K = {k} in granules of {granule} holds {units}; expected 1 ≤ slices ≤ {units}, "
                         f"got {slices}")
    return tuple((s * units // slices) * granule for s in range(slices)) + (k,)


def accumulation_dtype(out_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the partial products: float64 for a float64 projection, else float32."""
    return torch.float64 if out_dtype == torch.float64 else torch.float32


def column_tiles(slices: int, rows: int, cols: int, workers: int) -> int:
    """Column tiles of both ops by default: a wave of ``workers`` partial tasks (S per column
    tile), tiles of at least 16 output elements. The finish op takes the same column tiles, so
    each finish task waits for the S partial tasks of its own columns only."""
    return max(1, min(cols, workers // slices, rows * cols // 16))


def _bounds(sig: OpSig) -> tuple[int, ...]:
    return slice_bounds(sig.in_shapes[0][1], sig.attrs["slices"], sig.attrs["granule"])


def _partial_regions(sig: OpSig, rect):
    (s0, s1), rows, cols = rect
    kb = _bounds(sig)
    k = (kb[s0], kb[s1])
    return [(rows, k), (k, cols)]


def _partial_cpu(sig: OpSig, rect, xs):
    a, b = xs
    (s0, s1), _, _ = rect
    kb = _bounds(sig)
    acc = sig.out_dtype
    # each slice's product alone (its own fp32 sums), as the slice's task computes it
    planes = [a[:, kb[s] - kb[s0]: kb[s + 1] - kb[s0]].to(acc) @ b[kb[s] - kb[s0]: kb[s + 1] - kb[s0]].to(acc)
              for s in range(s0, s1)]
    return torch.stack(planes)


def _partial_grid(sig: OpSig, workers: int) -> tuple[int, ...]:
    s, m, n = sig.out_shape
    if m >= GEMM_MIN_ROWS:  # the GEMM form: a GEMM sub-tile a task (the pass chose S to fill the workers)
        return s, -(-m // GEMM_ROWS), -(-n // GEMM_COLS)
    return s, 1, column_tiles(s, m, n, workers)


def _finish_regions(sig: OpSig, rect):
    s = sig.in_shapes[0][0]
    return [((0, s),) + tuple(rect)] + [broadcast_region(shape, sig.out_shape, rect) for shape in sig.in_shapes[1:]]


def _finish_cpu(sig: OpSig, rect, xs):
    p, *bias = xs
    acc = p[0]
    for s in range(1, p.shape[0]):  # slice order: the sum is the same whatever order the slices ran in
        acc = acc + p[s]
    alpha, beta = sig.attrs.get("alpha", 1), sig.attrs.get("beta", 1)
    if alpha != 1:
        acc = acc * alpha
    if bias:
        acc = acc + bias[0].to(acc.dtype) * beta
    return acc.to(sig.out_dtype)


def _finish_grid(sig: OpSig, workers: int) -> tuple[int, ...]:
    m, n = sig.out_shape
    if m >= GEMM_MIN_ROWS:  # the GEMM form's column tiles, cut along rows until they fill the workers
        gn = -(-n // GEMM_COLS)
        return max(1, min(-(-m // 16), workers // gn)), gn
    return 1, column_tiles(sig.in_shapes[0][0], m, n, workers)


def partial_gemm(op: OpInfo) -> bool:
    """Whether a matmul_partial runs on the tensor cores (gemm.cuh, kPlanes): more than
    LINEAR_ROWS rows, and x, W as the GEMM reads them (mpk.ops.linalg.gemm_operand_blockers)."""
    return op.out_shape[1] >= GEMM_MIN_ROWS and not gemm_operand_blockers(op.inputs[0], op.inputs[1], op.out_dtype,
                                                                          want_out=torch.float32)


def _partial_params(op: OpInfo) -> Params:
    """iparam[0] S, [1] the granule: the task recomputes its slices' K bounds."""
    return [int(op.attrs["slices"]), int(op.attrs["granule"])], []


def _finish_params(op: OpInfo) -> Params:
    """fparam[0] alpha, [1] beta."""
    return [], [float(op.attrs.get("alpha", 1)), float(op.attrs.get("beta", 1))]


SLOW_PARTIAL_MIN_BYTES = 1 << 20  # as mpk.ops.linalg.SLOW_LINEAR_MIN_BYTES: a model's projection


def _partial_slow(op: OpInfo) -> str | None:
    """The general partial task is one thread per output element (correct, not bandwidth-grade):
    a model-sized weight off the GEMM form is named in a PerformanceWarning."""
    w = op.inputs[1]
    if partial_gemm(op) or math.prod(w.shape) * w.dtype.itemsize < SLOW_PARTIAL_MIN_BYTES:
        return None
    return (f"(matmul_partial, weight {w.shape[1]}×{w.shape[0]}): the split-K partial task of a decode projection "
            "has no bandwidth-grade form yet (split_k is for the CPU interpreter and correctness runs)")


def finish_fast(op: OpInfo) -> bool:
    """Whether a matmul_finish takes the fast form (splitk.cuh: matmul_finish_fast): its planes
    contiguous fp32 and every tile's columns whole groups of 4 (N a multiple of 4 × the column
    tiles)."""
    p = op.inputs[0]
    s, m, n = p.shape
    return (p.dtype == torch.float32 and p.strides == (m * n, n, 1) and p.offset % 4 == 0
            and n % (4 * op.grid[1]) == 0)


def _partial_task(op: OpInfo) -> str:
    return gemm_instance(op, glu=False, planes=True) if partial_gemm(op) else "mpk::task_matmul_partial"


PARTIAL_GPU = GpuSpec(params=_partial_params, task=_partial_task, self_gated=True, slow_path=_partial_slow,
                      smem_bytes=lambda op: GEMM_SMEM_BYTES if partial_gemm(op) else 0,
                      vector_inputs=lambda op: (0, 1) if partial_gemm(op) else (),
                      in_kernel=partial_gemm)


register(OpDef(
    kind="matmul_partial", type_id=22, input_regions=_partial_regions, cpu=_partial_cpu, default_grid=_partial_grid,
    gpu=PARTIAL_GPU,
    doc="out [S, M, N] (fp32, float64 for float64 operands): out[s] = a[:, k_s] @ b[k_s, :], k_s the s-th K slice "
        "(slice_bounds(K, attrs['slices'], attrs['granule'])); a [M, K], b [K, N]",
))

register(OpDef(
    kind="matmul_finish", type_id=23, input_regions=_finish_regions, cpu=_finish_cpu, default_grid=_finish_grid,
    gpu=GpuSpec(params=_finish_params, variant=lambda op: int(finish_fast(op))),
    doc="out [M, N] = alpha·(p[0] + … + p[S-1]) + beta·bias, summed in slice order in p's dtype and rounded once; "
        "p [S, M, N] a matmul_partial's output, bias (optional) broadcast to out",
))
