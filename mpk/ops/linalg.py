"""``matmul`` (mm / bmm / addmm / linear, batch dims broadcast), its fused forms
(``rms_matmul``, ``matmul_silu``) and ``embedding``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpk.errors import BAD_TOKEN, BadInputError, bad_input_message
from mpk.ops.registry import OpDef, OpSig, broadcast_region, register


def _matmul_regions(sig: OpSig, rect):
    a_shape, b_shape, *bias = sig.in_shapes
    out = sig.out_shape
    batch_out, m, n = out[:-2], rect[-2], rect[-1]
    a = broadcast_region(a_shape[:-2], batch_out, rect[:-2]) + (m, (0, a_shape[-1]))
    b = broadcast_region(b_shape[:-2], batch_out, rect[:-2]) + ((0, b_shape[-2]), n)
    return [a, b] + [broadcast_region(s, out, rect) for s in bias]


def _matmul_cpu(sig: OpSig, rect, xs):
    a, b, *bias = xs
    alpha, beta = sig.attrs.get("alpha", 1), sig.attrs.get("beta", 1)
    out = torch.matmul(a, b)
    if alpha != 1:
        out = out * alpha
    if bias:
        out = out + (bias[0] * beta if beta != 1 else bias[0])
    return out.to(sig.out_dtype)


def _matmul_order(sig: OpSig) -> list[int]:
    # Decode is weight-bound: split N first so each weight column is streamed by one task,
    # then M, then batch dims (each extra M / batch split re-reads the weight tile).
    nd = len(sig.out_shape)
    return [nd - 1, nd - 2] + list(range(nd - 2))


register(OpDef(
    kind="matmul", type_id=20, input_regions=_matmul_regions, cpu=_matmul_cpu,
    split_order=_matmul_order, min_tile_elems=16,
    doc="out = alpha·(a @ b) + beta·bias; a [..., M, K], b [..., K, N], bias broadcast to out",
))


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


def _normed_matmul_regions(sig: OpSig, rect):
    """rms_matmul and norm_stats_matmul: the tile's rows of x (all of K), b's columns of the tile
    (both halves with silu), and the norm's third input — the weight [K] whole, or the sums
    [M, K] of the tile's rows."""
    x_shape, b_shape, third = sig.in_shapes
    n = _gate_up_columns(b_shape[1], rect) if sig.attrs.get("silu") else rect[1]
    norm = ((0, third[0]),) if len(third) == 1 else (rect[0], (0, third[1]))
    return [(rect[0], (0, x_shape[1])), ((0, b_shape[0]), n), norm]


# The largest tile of normalised activations (rows × K) an rms_matmul task keeps in shared
# memory (cuda/mpk_tasks/linalg.cuh: the launch's dynamic shared memory). The frontend fuses
# an RMSNorm into its projection only when all of x fits: every task normalises all rows
# after its gate, which on an H200 paid at batch 1 (llama3.2-1b / qwen3-1.7b steps −4%) and
# cost at batch 4 (+2–4%) and 16 (+20%) against one norm task per row
# (benchmarks/results/2026-11-22-nvidia-h200-decode_latency-session10-*).
NORM_TILE_BYTES = 8 * 1024
# fuse_norm_stats="auto" splits a norm between the projections around it when its input is
# larger than this, and leaves smaller ones to the prologue: at 4 KiB (batch 1, hidden 2048)
# the prologue measured 0.5–2.0% faster, at 8 KiB (batch 2, or qwen3-8b's batch 1) the split
# 0.3–1.8% faster but for qwen3-8b on an H200, +0.2% (H100 and H200, session 34).
NORM_SPLIT_MIN_BYTES = 4 * 1024


def _rms_matmul_cpu(sig: OpSig, rect, xs):
    from mpk.ops.registry import get_op

    x, b, w = xs
    a = sig.attrs
    norm = OpSig((tuple(x.shape), tuple(w.shape)), tuple(x.shape), sig.out_dtype,
                 {"eps": a["eps"], "has_weight": True, "compute_dtype": a["compute_dtype"], "norm_dtype": a["norm_dtype"]})
    h = get_op("rms_norm").cpu(norm, tuple((0, n) for n in x.shape), [x, w])
    out = torch.matmul(h, b).to(sig.out_dtype)
    return _silu_of_halves(sig, rect, out) if a.get("silu") else out


register(OpDef(
    kind="rms_matmul", type_id=22, input_regions=_normed_matmul_regions, cpu=_rms_matmul_cpu,
    split_order=_matmul_order, min_tile_elems=16,
    doc="out = rms_norm(x, w) @ b with rms_norm's roundings (rstd = rsqrt(mean(x²) + eps) in compute_dtype, "
        "x·rstd cast to norm_dtype, times w, cast to the output dtype): x [M, K], b [K, N], w [K] (an RMSNorm "
        "fused into the projection after it). With silu: b [K, 2N] and out = silu(gate)·up of the two halves",
))


def _matmul_silu_regions(sig: OpSig, rect):
    (_, k), (_, n2) = sig.in_shapes
    return [(rect[0], (0, k)), ((0, k), _gate_up_columns(n2, rect))]


def _matmul_silu_cpu(sig: OpSig, rect, xs):
    x, b = xs
    return _silu_of_halves(sig, rect, torch.matmul(x, b).to(sig.out_dtype))


register(OpDef(
    kind="matmul_silu", type_id=23, input_regions=_matmul_silu_regions, cpu=_matmul_silu_cpu,
    split_order=_matmul_order, min_tile_elems=16,
    doc="out = silu(h[:, :N/2]) * h[:, N/2:], h = x @ b rounded to the output dtype: x [M, K], b [K, N] "
        "(SiLU·mul as the gate·up projection's epilogue)",
))


def _embedding_regions(sig: OpSig, rect):
    w_shape, ids_shape = sig.in_shapes
    return [((0, w_shape[0]), rect[-1]), rect[:-1]]


def _embedding_cpu(sig: OpSig, rect, xs):
    w, ids = xs
    bad = ((ids < 0) | (ids >= w.shape[0])).nonzero()
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        row = tuple(lo + i for (lo, _), i in zip(rect[:-1], at))
        raise BadInputError(bad_input_message(BAD_TOKEN, int(ids[at]), row[0] if len(row) == 1 else row, w.shape[0]))
    return F.embedding(ids, w).to(sig.out_dtype)


register(OpDef(
    kind="embedding", type_id=21, input_regions=_embedding_regions, cpu=_embedding_cpu,
    doc="out[..., :] = weight[ids[...], :]",
))


# --- an RMSNorm split between the projection before it and the one after -----------------------
# ``matmul_norm_stats`` (the residual projection that produces a decoder layer's hidden state h)
# also writes h·g, g the next RMSNorm's weight, and the sums of h² over groups of 16 or 8
# columns; ``norm_stats_matmul`` (the projection after that norm) then streams h·g like a plain
# matmul's input and scales its sums by rstd = rsqrt(Σ groups / K + eps). The norm's own stage
# and event hop go, and no task normalises a row. Roundings differ from the unfused pair's
# (bf16(bf16(h·rstd)·g) there, bf16(h·g) and rstd in fp32 here): about one bf16 ulp of the
# normalised activation either way. A producer's tile holds whole groups, so the group size
# sets how evenly N splits over the workers (stats_group).

STATS_GROUP = 16  # columns per sum of squares by default: a half warp in the producing task's epilogue
STATS_GROUPS = (16, 8)  # the sizes the tasks take (a power of two ≥ 2: the sum's fp32 bits fill two elements)
STATS_SMEM_FLOATS = 8 * 64 * 16  # linalg.cuh: a norm_stats_matmul task's sums wait in its reduction area


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


register(OpDef(
    kind="matmul_norm_stats", type_id=24, input_regions=_norm_stats_regions, cpu=_norm_stats_cpu,
    splittable=lambda sig: (False, True, True, False), split_order=lambda sig: [2, 1],
    min_tile_elems=3 * STATS_GROUP,
    doc="h = a @ b + r (fp32 sums, one rounding) packed with what the RMSNorm after it needs: out [3, M, N/G, G] "
        "(G = 16 or 8) holds h, h·g (rounded) and, at the first two elements of each G-column group of part 2, the "
        "fp32 bits of that group's Σh² (butterfly order; the rest 0). a [M, K], b [K, N], r [M, N], g [N]; N % G == 0",
))


def stats_rstd(stats: torch.Tensor, eps: float, group: int) -> torch.Tensor:
    """rsqrt(mean + eps) of each row from part 2 of a ``matmul_norm_stats`` output of
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


def _stats_matmul_cpu(sig: OpSig, rect, xs):
    x, b, stats = xs
    rstd = stats_rstd(stats, sig.attrs["eps"], sig.attrs["group"])
    out = (torch.matmul(x.float(), b.float()) * rstd[:, None]).to(sig.out_dtype)
    return _silu_of_halves(sig, rect, out) if sig.attrs.get("silu") else out


register(OpDef(
    kind="norm_stats_matmul", type_id=25, input_regions=_normed_matmul_regions, cpu=_stats_matmul_cpu,
    split_order=_matmul_order, min_tile_elems=16,
    doc="out = rstd · (x @ b), rstd per row from a matmul_norm_stats output's sums (stats_rstd): x = its h·g "
        "[M, K], stats its part 2 viewed [M, K] (groups of attrs['group'] columns), b [K, N]; K % 256 == 0. "
        "With silu: b [K, 2N] and out = silu(gate)·up of the two halves, each rounded first",
))
