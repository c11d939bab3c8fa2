"""``matmul`` (mm / bmm / addmm / linear, batch dims broadcast, with its fused prologues and
epilogues) and ``embedding``.

One kind covers every projection; its attrs name the fusions:

* ``prologue``: None, ``"rms_norm"`` (an RMSNorm of x fused in front: inputs x [M, K], b [K, N],
  the norm weight [K]; attrs eps, compute_dtype, norm_dtype) or ``"norm_stats"`` (x is h·g of a
  ``norm_stats`` epilogue's output and the third input its sums, which give each row's rstd;
  attrs eps, group);
* ``epilogue``: None, ``"silu_mul"`` (b [K, 2N], out = silu(gate)·up of the two halves) or
  ``"norm_stats"`` (h = a @ b + r packed with h·g and sums of h², out [3, M, N/G, G]; inputs a, b,
  r, g).

A ``norm_stats`` prologue and epilogue go together: the RMSNorm between two projections split
over them. Without fusions, ``alpha``/``beta`` scale the product and the optional bias.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mpk.errors import BAD_TOKEN, BadInputError, bad_input_message
from mpk.ops.gpu import CTYPES, GpuSpec, OpInfo, Params, ViewInfo, all_inputs
from mpk.ops.registry import OpDef, OpSig, broadcast_region, register
from mpk.ops.rows import NORM_VECS

PROLOGUES = (None, "rms_norm", "norm_stats")
EPILOGUES = (None, "silu_mul", "norm_stats")


def linear_form(attrs: dict) -> tuple[str | None, str | None]:
    """(prologue, epilogue) of a ``matmul`` op's attrs."""
    return attrs.get("prologue"), attrs.get("epilogue")


def form_name(attrs: dict) -> str:
    """A ``matmul`` op's form in words, as the custom ops name it: ``[prologue_]matmul[_epilogue]``
    (``rms_norm_matmul``, ``matmul_silu_mul``, ``norm_stats_matmul_silu_mul``, …)."""
    pro, epi = linear_form(attrs)
    return "_".join(p for p in (pro, "matmul", epi) if p)


def op_form(kind: str, attrs: dict) -> str:
    """An op's kind, or for a ``matmul`` its form (``form_name``): what profiles and tests tell
    apart."""
    return form_name(attrs) if kind == "matmul" else kind


def _check_form(sig: OpSig) -> tuple[str | None, str | None]:
    pro, epi = linear_form(sig.attrs)
    if pro not in PROLOGUES or epi not in EPILOGUES or (epi == "norm_stats" and pro):
        raise ValueError(f"matmul: prologue {pro!r}, epilogue {epi!r}; expected a prologue among {PROLOGUES} and an "
                         f"epilogue among {EPILOGUES} (a norm_stats epilogue without a prologue)")
    return pro, epi


def _plain_regions(sig: OpSig, rect):
    a_shape, b_shape, *bias = sig.in_shapes
    out = sig.out_shape
    batch_out, m, n = out[:-2], rect[-2], rect[-1]
    a = broadcast_region(a_shape[:-2], batch_out, rect[:-2]) + (m, (0, a_shape[-1]))
    b = broadcast_region(b_shape[:-2], batch_out, rect[:-2]) + ((0, b_shape[-2]), n)
    return [a, b] + [broadcast_region(s, out, rect) for s in bias]


def _plain_cpu(sig: OpSig, rect, xs):
    a, b, *bias = xs
    alpha, beta = sig.attrs.get("alpha", 1), sig.attrs.get("beta", 1)
    out = torch.matmul(a, b)
    if alpha != 1:
        out = out * alpha
    if bias:
        out = out + (bias[0] * beta if beta != 1 else bias[0])
    return out.to(sig.out_dtype)


def _matmul_order(sig: OpSig) -> list[int]:
    if linear_form(sig.attrs)[1] == "norm_stats":
        return [2, 1]  # [3, M, N/G, G]: groups of columns, then rows
    # Decode is weight-bound: split N first so each weight column is streamed by one task,
    # then M, then batch dims (each extra M / batch split re-reads the weight tile).
    nd = len(sig.out_shape)
    return [nd - 1, nd - 2] + list(range(nd - 2))


def _matmul_splittable(sig: OpSig) -> tuple[bool, ...]:
    if linear_form(sig.attrs)[1] == "norm_stats":
        return (False, True, True, False)  # the 3 parts and a group's columns stay in one tile
    return tuple(True for _ in sig.out_shape)


def _matmul_min_tile(sig: OpSig) -> int:
    return 3 * STATS_GROUP if linear_form(sig.attrs)[1] == "norm_stats" else 16


def _gate_up_columns(n2: int, rect) -> tuple[int, int]:
    """b's columns a SiLU·mul tile over output columns [lo, hi) reads: the gate columns
    [lo, hi) and the up columns n2/2 + [lo, hi), bounded."""
    lo, hi = rect[-1]
    return lo, n2 // 2 + hi


def _silu_of_halves(sig: OpSig, rect, h: torch.Tensor) -> torch.Tensor:
    """silu(gate)·up of a gate·up product over ``_gate_up_columns`` (gate first, up at n2/2),
    rounded to the output dtype already."""
    from mpk.ops.registry import get_op

    width, half = rect[1][1] - rect[1][0], sig.in_shapes[1][1] // 2
    gate, up = h[:, :width], h[:, half: half + width]
    silu_sig = OpSig((tuple(gate.shape), tuple(up.shape)), tuple(gate.shape), sig.out_dtype, {})
    return get_op("silu_mul").cpu(silu_sig, tuple((0, n) for n in gate.shape), [gate, up])


def _normed_regions(sig: OpSig, rect):
    """A prologue form: the tile's rows of x (all of K), b's columns of the tile (both halves
    with silu_mul), and the norm's third input — the weight [K] whole, or the sums [M, K] of the
    tile's rows."""
    x_shape, b_shape, third = sig.in_shapes
    n = _gate_up_columns(b_shape[1], rect) if linear_form(sig.attrs)[1] == "silu_mul" else rect[1]
    norm = ((0, third[0]),) if len(third) == 1 else (rect[0], (0, third[1]))
    return [(rect[0], (0, x_shape[1])), ((0, b_shape[0]), n), norm]


def _silu_regions(sig: OpSig, rect):
    (_, k), (_, n2) = sig.in_shapes
    return [(rect[0], (0, k)), ((0, k), _gate_up_columns(n2, rect))]


# The largest tile of normalised activations (rows × K) an rms_norm-prologue task keeps in
# shared memory (cuda/mpk_tasks/linalg.cuh: the launch's dynamic shared memory). The frontend
# fuses an RMSNorm into its projection only when all of x fits: every task normalises all rows
# after its gate, which pays at batch 1 and costs from a few rows on against one norm task per
# row.
NORM_TILE_BYTES = 8 * 1024
# fuse_norm_stats="auto" splits a norm between the projections around it when its input is
# larger than this, and leaves smaller ones to the prologue, which is faster for them.
NORM_SPLIT_MIN_BYTES = 4 * 1024


def _rms_prologue_cpu(sig: OpSig, rect, xs):
    from mpk.ops.registry import get_op

    x, b, w = xs
    a = sig.attrs
    norm = OpSig((tuple(x.shape), tuple(w.shape)), tuple(x.shape), sig.out_dtype,
                 {"eps": a["eps"], "has_weight": True, "compute_dtype": a["compute_dtype"],
                  "norm_dtype": a["norm_dtype"]})
    h = get_op("rms_norm").cpu(norm, tuple((0, n) for n in x.shape), [x, w])
    out = torch.matmul(h, b).to(sig.out_dtype)
    return _silu_of_halves(sig, rect, out) if linear_form(a)[1] == "silu_mul" else out


def _silu_cpu(sig: OpSig, rect, xs):
    x, b = xs
    return _silu_of_halves(sig, rect, torch.matmul(x, b).to(sig.out_dtype))


def _matmul_regions(sig: OpSig, rect):
    pro, epi = _check_form(sig)
    if epi == "norm_stats":
        return _norm_stats_regions(sig, rect)
    if pro:
        return _normed_regions(sig, rect)
    return _silu_regions(sig, rect) if epi == "silu_mul" else _plain_regions(sig, rect)


def _matmul_cpu(sig: OpSig, rect, xs):
    pro, epi = _check_form(sig)
    if epi == "norm_stats":
        return _norm_stats_cpu(sig, rect, xs)
    if pro == "rms_norm":
        return _rms_prologue_cpu(sig, rect, xs)
    if pro == "norm_stats":
        return _stats_prologue_cpu(sig, rect, xs)
    return _silu_cpu(sig, rect, xs) if epi == "silu_mul" else _plain_cpu(sig, rect, xs)


def _embedding_regions(sig: OpSig, rect):
    w_shape, ids_shape = sig.in_shapes
    return [((0, w_shape[0]), rect[-1]), rect[:-1]]


def _embedding_cpu(sig: OpSig, rect, xs):
    w, ids = xs
    start, vocab = _vocab_range(sig.attrs, w.shape[0])
    bad = ((ids < 0) | (ids >= vocab)).nonzero()
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        row = tuple(lo + i for (lo, _), i in zip(rect[:-1], at))
        raise BadInputError(bad_input_message(BAD_TOKEN, int(ids[at]), row[0] if len(row) == 1 else row, vocab))
    local = ids - start
    held = (local >= 0) & (local < w.shape[0])  # a vocabulary shard: other ranks' rows are zeros
    out = F.embedding(torch.where(held, local, 0), w) * held.unsqueeze(-1)
    return out.to(sig.out_dtype)


def _vocab_range(attrs: dict, rows: int) -> tuple[int, int]:
    """(first vocabulary row the table holds, the whole vocabulary): attrs vocab_start and vocab
    of a vocabulary-parallel shard (mpk.distributed.shard), else (0, the table's rows)."""
    return int(attrs.get("vocab_start", 0)), int(attrs.get("vocab", rows))


register(OpDef(
    kind="embedding", type_id=21, input_regions=_embedding_regions, cpu=_embedding_cpu,
    # rows are moved, not computed; iparam: vocab_start, vocab (0: the table's rows)
    gpu=GpuSpec(float64_exact=True, params=lambda op: ([int(op.attrs.get("vocab_start", 0)),
                                                         int(op.attrs.get("vocab", 0))], [])),
    doc="out[..., :] = weight[ids[...], :]",
))


# --- an RMSNorm split between the projection before it and the one after -----------------------
# The ``norm_stats`` epilogue (on the residual projection that produces a decoder layer's hidden
# state h) also writes h·g, g the next RMSNorm's weight, and the sums of h² over groups of 16 or
# 8 columns; the ``norm_stats`` prologue (on the projection after that norm) then streams h·g
# like a plain matmul's input and scales its sums by rstd = rsqrt(Σ groups / K + eps). The norm's own stage
# and event hop go, and no task normalises a row. Roundings differ from the unfused pair's
# (bf16(bf16(h·rstd)·g) there, bf16(h·g) and rstd in fp32 here): about one bf16 ulp of the
# normalised activation either way. A producer's tile holds whole groups, so the group size
# sets how evenly N splits over the workers (stats_group).

STATS_GROUP = 16  # columns per sum of squares by default: a half warp in the producing task's epilogue
STATS_GROUPS = (16, 8)  # the sizes the tasks take (a power of two ≥ 2: the sum's fp32 bits fill two elements)
STATS_SMEM_FLOATS = 8 * 64 * 16  # linalg.cuh: a norm_stats-prologue task's sums wait in its reduction area


def stats_group(rows: int, n: int, num_workers: int) -> int:
    """The group size for h [rows, n] split over ``num_workers`` tiles: 8 where 16-column
    groups would leave some tiles a group wider than 8-column ones do (qwen3-4b's hidden 2560 over
    128 workers: tiles of 16 and 32 columns, against 16 and 24) and the consuming task's shared
    memory holds all its rows' sums; else 16 (fewer sums to add)."""
    widest = {gs: -(-n // gs // num_workers) * gs for gs in STATS_GROUPS}
    return 8 if widest[8] < widest[16] and rows * (n // 8) <= STATS_SMEM_FLOATS else 16


def _butterfly_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim (a power of two) in the order of an xor-shuffle butterfly, as a
    group of lanes adds its values (fp32, the same bits as the CUDA tasks)."""
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = v[..., :half] + v[..., half:]
    return v[..., 0]


def _norm_stats_regions(sig: OpSig, rect):
    a_shape, b_shape, _, _ = sig.in_shapes
    group = sig.out_shape[3]
    rows, (g0, g1) = rect[1], rect[2]
    cols = (g0 * group, g1 * group)
    return [(rows, (0, a_shape[1])), ((0, b_shape[0]), cols), (rows, cols), (cols,)]


def _norm_stats_cpu(sig: OpSig, rect, xs):
    a, b, r, g = xs
    h = (torch.matmul(a.float(), b.float()) + r.float()).to(sig.out_dtype)  # one rounding, as the task's epilogue
    rows, cols = h.shape
    group = sig.out_shape[3]
    groups = cols // group
    hf = h.float()
    stats = torch.zeros(rows, groups, group // 2, dtype=torch.float32)
    stats[..., 0] = _butterfly_sum(hf.pow(2).view(rows, groups, group))
    return torch.stack([h.view(rows, groups, group),
                        (hf * g.float()).to(sig.out_dtype).view(rows, groups, group),
                        stats.view(sig.out_dtype).view(rows, groups, group)])


def stats_rstd(stats: torch.Tensor, eps: float, group: int) -> torch.Tensor:
    """rsqrt(mean + eps) of each row from part 2 of a ``norm_stats`` epilogue's output of
    ``group``-column groups viewed [M, K] (bf16 pairs holding fp32 sums), summed in the
    consuming task's order: lane l of a half warp adds groups l, l + 16, … in turn, then the
    half warp's butterfly."""
    rows, k = stats.shape
    sums = stats.contiguous().reshape(-1).view(torch.float32).view(rows, -1)[:, ::group // 2]  # [M, K/group]
    lanes = sums.view(rows, -1, 16)
    acc = lanes[:, 0]
    for i in range(1, lanes.shape[1]):
        acc = acc + lanes[:, i]
    return torch.rsqrt(_butterfly_sum(acc) / k + eps)


def _stats_prologue_cpu(sig: OpSig, rect, xs):
    x, b, stats = xs
    rstd = stats_rstd(stats, sig.attrs["eps"], sig.attrs["group"])
    out = (torch.matmul(x.float(), b.float()) * rstd[:, None]).to(sig.out_dtype)
    return _silu_of_halves(sig, rect, out) if linear_form(sig.attrs)[1] == "silu_mul" else out


# --- the CUDA side (cuda/mpk_tasks/linalg.cuh) ------------------------------------------------

LINEAR_ROWS = 16  # linalg.cuh: kLinRows
SLOW_LINEAR_MIN_BYTES = 1 << 20  # weights from which the general task's pace matters (a model's projection)


def linear_blockers(op: OpInfo) -> list[str]:
    """Why a matmul cannot take the bandwidth-grade linear of linalg.cuh, in words; empty when it
    can. It needs x [M, K] @ Wᵀ with bf16 operands, bias (at most 2-d) and output, W a graph
    input, unit stride along K, 16-byte aligned rows, K % 32 == 0 and at most 16 rows per tile."""
    pro, epi = linear_form(op.attrs)
    if op.ndim != (4 if epi == "norm_stats" else 2):
        return ["not a 2-d x @ Wᵀ (batched)"]
    a, b = op.inputs[:2]
    dtypes = [a.dtype, b.dtype, op.out_dtype]
    K = a.shape[1]
    rows = op.tile_extent(1 if epi == "norm_stats" else 0)
    why = []
    if not b.graph_input:
        why.append("its weight is computed in the graph")  # weights are streamed with non-coherent loads
    if any(d != torch.bfloat16 for d in dtypes):
        why.append(f"its operands are {'/'.join(sorted({str(d).removeprefix('torch.') for d in dtypes}))}, "
                   "not bfloat16")
    if a.strides[1] != 1 or b.strides[0] != 1:
        why.append("x or W is strided along K")
    if K % 32:
        why.append(f"K = {K} is not a multiple of 32")
    if any(x % 8 for x in (a.offset, a.stride(0), b.offset, b.strides[1])):
        why.append("rows of x or W are not 16-byte aligned")
    if rows > LINEAR_ROWS:
        why.append(f"a tile holds {rows} rows (at most {LINEAR_ROWS}: the batch of a decode step)")
    if why:
        return why  # (the fused forms' own inputs below follow the operands' dtype)
    if pro is None and epi in (None, "norm_stats") and len(op.inputs) > 2:  # the bias: bf16, ≤ 2-d
        bias = op.inputs[2]
        if bias.dtype != torch.bfloat16 or bias.ndim > 2:
            why.append("its bias (residual) is not a bf16 matrix")
    if pro == "norm_stats":
        # the sums: fp32 in bf16 pairs (4-byte aligned), 16 or 32 groups a lane, all rows' in shared memory
        st = op.inputs[2]
        if not (st.strides[1] == 1 and st.offset % 2 == 0 and (a.shape[0] == 1 or st.strides[0] % 2 == 0)
                and K % 256 == 0 and rows * K // op.attrs["group"] <= STATS_SMEM_FLOATS):
            why.append("its norm's sums do not fit the task's layout")
    if pro == "rms_norm":
        # the norm weight in 16-byte words, read before the gate (a graph input); x's rows
        # normalised in fp32 into a bf16 tile of whole 8-word groups (its swizzle) that fits
        w = op.inputs[2]
        if not (w.dtype == torch.bfloat16 and w.graph_input and w.strides[0] == 1 and w.offset % 8 == 0
                and op.attrs["compute_dtype"] == "float32" and op.attrs["norm_dtype"] == "bfloat16" and K % 64 == 0
                and K <= NORM_VECS * 8 * 256 and rows * K * 2 <= NORM_TILE_BYTES):
            why.append("its RMSNorm prologue does not fit the task (a bf16 norm over K ≤ 8192, K % 64 == 0, "
                       f"x within {NORM_TILE_BYTES} bytes)")
    return why


def matmul_rows(op: OpInfo) -> int:
    """M: the rows of a matmul's product (of its [3, M, N/G, G] output with the norm_stats epilogue)."""
    return op.out_shape[1] if linear_form(op.attrs)[1] == "norm_stats" else op.out_shape[-2]


# --- the tensor-core GEMM (cuda/mpk_tasks/gemm.cuh) -----------------------------------------------

# A matmul of more rows than the decode linear takes in a tile (LINEAR_ROWS: a decode step's
# batch) runs on the tensor cores. Below 64 rows most of its 128-row MMA tile is padding (the
# MMAs, not the weights' stream, then set its pace), but the only other task for such an op is
# the general one (one thread per output element), far slower still; at most LINEAR_ROWS rows
# keep the decode linear and its partitioning.
GEMM_MIN_ROWS = LINEAR_ROWS + 1
GEMM_ROWS = 128  # gemm.cuh: kGemmRows, a sub-tile's output rows (two warpgroups × the MMA's 64)
GEMM_COLS = 128  # gemm.cuh: kGemmCols, a sub-tile's MMA columns (output columns; half of them with silu_mul)
GEMM_SMEM_BYTES = 4 * 2 * GEMM_ROWS * 64 * 2 + 1024  # gemm.cuh: kGemmSmemBytes (4 stages of 64 k of x and W, alignment)
GEMM_DTYPES = (torch.bfloat16, torch.float16)


def _gemm_cols(epilogue: str | None) -> int:
    """Output columns of a GEMM sub-tile: with silu_mul its MMA columns are 64 gate and 64 up."""
    return GEMM_COLS // 2 if epilogue == "silu_mul" else GEMM_COLS


def gemm_operand_blockers(a: ViewInfo, b: ViewInfo, out_dtype: torch.dtype,
                          want_out: torch.dtype | None = None) -> list[str]:
    """Why the GEMM cannot read x = ``a`` [M, K] and Wᵀ = ``b`` [K, N], in words: both of one
    16-bit dtype (and the output too, unless ``want_out`` names the output dtype the task
    writes), unit stride along K, 16-byte aligned rows, K % 8 == 0."""
    K = a.shape[1]
    why = []
    dtypes = {a.dtype, b.dtype} | ({out_dtype} if want_out is None else set())
    if len(dtypes) != 1 or a.dtype not in GEMM_DTYPES:
        names = "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        why.append(f"its operands{'' if want_out is not None else ' and output'} are {names}, not all bfloat16 or "
                   "all float16")
    if want_out is not None and out_dtype != want_out:
        why.append(f"its output is {str(out_dtype).removeprefix('torch.')}, not {str(want_out).removeprefix('torch.')}")
    if a.strides[1] != 1 or b.strides[0] != 1:
        why.append("x or W is strided along K")
    if K % 8:
        why.append(f"K = {K} is not a multiple of 8 (16-byte copies)")
    if any(v % 8 for v in (a.offset, a.stride(0), b.offset, b.stride(1))):
        why.append("rows of x or W are not 16-byte aligned")
    return why


def gemm_blockers(op: OpInfo) -> list[str]:
    """Why a matmul cannot take the tensor-core GEMM of gemm.cuh, in words; empty when it can. It
    needs a 2-d x [M, K] @ Wᵀ, plain (a bias of the output's dtype, at most 2-d) or with the
    SiLU·mul epilogue, x, W and the output all bf16 or all fp16, unit stride along K, 16-byte
    aligned rows and K % 8 == 0 (whole 16-byte copies). The prologues and the norm_stats
    epilogue stay on the decode linear: the frontend fuses them only into decode-sized
    projections (NORM_TILE_BYTES of activations, at most 16 rows), and a larger input keeps its
    RMSNorm an op of its own."""
    pro, epi = linear_form(op.attrs)
    if pro or epi == "norm_stats":
        return [(f"its {pro or epi} {'prologue' if pro else 'epilogue'} runs on the decode linear only (≤ 16 rows a "
                 "tile; larger inputs keep the RMSNorm an op of its own)")]
    if op.ndim != 2:
        return ["not a 2-d x @ Wᵀ (batched)"]
    why = gemm_operand_blockers(op.inputs[0], op.inputs[1], op.out_dtype)
    if epi is None and len(op.inputs) > 2 and (op.inputs[2].dtype != op.out_dtype or op.inputs[2].ndim > 2):
        why.append("its bias (residual) is not a matrix or vector of the output's dtype")
    return why


def linear_path(op: OpInfo) -> str:
    """The task that runs a matmul: ``"gemm"`` (tensor cores, more than LINEAR_ROWS rows),
    ``"linear"`` (the bandwidth-grade decode linear) or ``"general"`` (one thread per output)."""
    if matmul_rows(op) >= GEMM_MIN_ROWS and not gemm_blockers(op):
        return "gemm"
    if not linear_blockers(op):
        return "linear"
    return "general"


def linear_fast(op: OpInfo) -> bool:
    """Whether a matmul takes the bandwidth-grade linear (``linear_path``)."""
    return linear_path(op) == "linear"


def _matmul_grid(sig: OpSig, workers: int) -> tuple[int, ...] | None:
    """A tensor-core matmul's tiles: whole GEMM sub-tiles (128 rows × 128 output columns, 64 with
    silu_mul) in both dims, at most ``workers`` tiles, the most sub-tiles of any tile (a wave's
    length) the fewest possible, then the fewest tiles; None for a matmul the GEMM does not take
    by its signature (the split order then: N first)."""
    pro, epi = linear_form(sig.attrs)
    if (len(sig.out_shape) != 2 or pro or epi == "norm_stats" or sig.out_dtype not in GEMM_DTYPES
            or sig.out_shape[0] < GEMM_MIN_ROWS):
        return None

    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    (M, N), cols = sig.out_shape, _gemm_cols(epi)
    best = None
    for gm in range(1, min(cdiv(M, GEMM_ROWS), workers) + 1):
        per_row = cdiv(cdiv(M, gm), GEMM_ROWS)  # sub-tiles down the tallest tile
        per_col = cdiv(cdiv(N, min(cdiv(N, cols), workers // gm)), cols)
        gn = cdiv(N, per_col * cols)  # the fewest column tiles with that many sub-tiles across
        key = (per_row * per_col, gm * gn, -gn)
        if best is None or key < best[0]:
            best = key, (gm, gn)
    return best[1]


def gemm_instance(op: OpInfo, glu: bool, planes: bool) -> str:
    """The ``mpk::gemm_task`` instantiation of a GEMM-path op: its operand type, the SiLU·mul
    epilogue, the split-K partial form, and whether W is a graph input (then its first stages
    are requested before the gate)."""
    t, w = CTYPES[op.inputs[0].dtype], op.inputs[1]
    flag = {True: "true", False: "false"}
    return f"mpk::gemm_task<{t}, {flag[glu]}, {flag[planes]}, {flag[w.graph_input and not w.carried]}>"


def _matmul_params(op: OpInfo) -> Params:
    """Plain: fparam alpha, beta. A prologue: iparam[0] whether the SiLU·mul epilogue follows,
    [1] the norm dtype (rms_norm) or the sums' group (norm_stats); fparam[2] eps. The SiLU·mul
    epilogue alone: alpha 1; the norm-stats epilogue: alpha and beta 1 (h = a @ b + r)."""
    a = op.attrs
    pro, epi = linear_form(a)
    silu = int(epi == "silu_mul")
    if pro == "rms_norm":
        return [silu, op.dtype_code(getattr(torch, a["norm_dtype"]))], [1.0, 0.0, a["eps"]]
    if pro == "norm_stats":
        return [silu, a["group"]], [1.0, 0.0, a["eps"]]
    if epi == "silu_mul":
        return [], [1.0, 0.0]
    if epi == "norm_stats":
        return [], [1.0, 1.0]
    return [], [float(a.get("alpha", 1)), float(a.get("beta", 1))]


_LINEAR_FLAGS = {("prologue", "rms_norm"): "mpk::kNormPrologue", ("prologue", "norm_stats"): "mpk::kStatsPrologue",
                 ("epilogue", "silu_mul"): "mpk::kSiluEpilogue", ("epilogue", "norm_stats"): "mpk::kStatsEpilogue"}


def _matmul_task(op: OpInfo) -> str:
    """``mpk::gemm_task<T, silu>`` on the tensor cores (``linear_path``), else
    ``mpk::linear_task<form, fast>``: the form's LinearForm flags from the op's prologue /
    epilogue, and whether it takes the bandwidth-grade path."""
    pro, epi = linear_form(op.attrs)
    if linear_path(op) == "gemm":
        return gemm_instance(op, epi == "silu_mul", planes=False)
    form = " | ".join(_LINEAR_FLAGS[k, v] for k, v in (("prologue", pro), ("epilogue", epi)) if v) or "mpk::kPlain"
    return f"mpk::linear_task<{form}, {'true' if linear_fast(op) else 'false'}>"


def _matmul_smem(op: OpInfo) -> int:
    """The GEMM's pipeline stages, or the rms_norm prologue's tile of normalised activations
    (decode linear only: norm_tile)."""
    path = linear_path(op)
    if path == "gemm":
        return GEMM_SMEM_BYTES
    if linear_form(op.attrs)[0] != "rms_norm" or path != "linear":
        return 0
    return op.tile_extent(0) * op.inputs[0].shape[1] * 2


def _matmul_vector_inputs(op: OpInfo) -> tuple[int, ...]:
    path = linear_path(op)
    return (0, 1) if path == "gemm" else all_inputs(op) if path == "linear" else ()


def _matmul_slow(op: OpInfo) -> str | None:
    """Why a projection of at least ``SLOW_LINEAR_MIN_BYTES`` of weights runs the general task:
    what keeps it off the GEMM (more than LINEAR_ROWS rows) or off the decode linear."""
    shape = list(op.inputs[1].shape)  # Wᵀ: [..., K, N]
    if math.prod(shape) * op.inputs[1].dtype.itemsize < SLOW_LINEAR_MIN_BYTES or linear_path(op) != "general":
        return None
    why = gemm_blockers(op) if matmul_rows(op) >= GEMM_MIN_ROWS else linear_blockers(op)
    out_in = "×".join(map(str, shape[:-2] + shape[:-3:-1]))  # as nn.Linear holds it: out × in
    return f"({form_name(op.attrs)}, weight {out_in}): {'; '.join(why)}" if why else None


# the fast path and the GEMM request their first weights before the gate; the general one waits first
MATMUL_GPU = GpuSpec(params=_matmul_params, task=_matmul_task, self_gated=True, smem_bytes=_matmul_smem,
                     vector_inputs=_matmul_vector_inputs, slow_path=_matmul_slow,
                     in_kernel=lambda op: linear_path(op) == "gemm")


MATMUL = register(OpDef(
    kind="matmul", type_id=20, input_regions=_matmul_regions, cpu=_matmul_cpu, splittable=_matmul_splittable,
    split_order=_matmul_order, min_tile_elems=_matmul_min_tile, default_grid=_matmul_grid, gpu=MATMUL_GPU,
    doc="out = alpha·(a @ b) + beta·bias; a [..., M, K], b [..., K, N], bias broadcast to out. With a prologue "
        "(attrs['prologue']): rms_norm — out = rms_norm(x, w) @ b with rms_norm's roundings (rstd = rsqrt(mean(x²) "
        "+ eps) in compute_dtype, x·rstd cast to norm_dtype, times w, cast to the output dtype): x [M, K], b [K, N], "
        "w [K]; norm_stats — out = rstd · (x @ b), rstd per row from a norm_stats epilogue's sums (stats_rstd): "
        "x = its h·g [M, K], stats its part 2 viewed [M, K] (groups of attrs['group'] columns); K % 256 == 0. With "
        "a silu_mul epilogue (attrs['epilogue']): b [K, 2N] and out = silu(h[:, :N])·h[:, N:], h = the product "
        "rounded to the output dtype. With the norm_stats epilogue: h = a @ b + r (fp32 sums, one rounding) packed "
        "with what the RMSNorm after it needs: out [3, M, N/G, G] (G = 16 or 8) holds h, h·g (rounded) and, at "
        "the first two elements of each G-column group of part 2, the fp32 bits of that group's Σh² (butterfly "
        "order; the rest 0). a [M, K], b [K, N], r [M, N], g [N]; N % G == 0",
))
