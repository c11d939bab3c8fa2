"""Op kinds of mixture-of-experts layers: ``rounded_div`` (floor / trunc division: expert and slot
arithmetic on flat indices), ``one_hot`` (the expert mask), ``histogram`` (torch.histc and
torch.bincount with a static bin count: tokens per expert) and ``expert_matmul`` (the grouped
expert GEMM: a batched matmul whose one operand is an expert weight picked per row at run time).
Their CUDA tasks are in cuda/mpk_tasks/moe.cuh."""

from __future__ import annotations

import math

import torch

from mpk.errors import BAD_INDEX, BadInputError, bad_input_message
from mpk.ops.gpu import GpuSpec, float_bits
from mpk.ops.registry import OpDef, OpSig, broadcast_region, register


def _flat_position(at: tuple[int, ...], rect, shape) -> int:
    """Row-major position in a tensor of ``shape`` of element ``at`` of the tile at ``rect``."""
    flat = 0
    for d, n in enumerate(shape):
        flat = flat * n + rect[d][0] + at[d]
    return flat


def _check_range(values: torch.Tensor, n: int, rect, shape) -> None:
    """Raise BadInputError (BAD_INDEX) for the first value outside [0, n)."""
    bad = ((values < 0) | (values >= n)).nonzero()
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        raise BadInputError(bad_input_message(BAD_INDEX, int(values[at]), _flat_position(at, rect, shape), n))


# --- rounded_div --------------------------------------------------------------------------------

ROUNDING_MODES = ("floor", "trunc")  # the CUDA task's iparam[0] is the position


def _rounded_div_cpu(sig: OpSig, rect, xs):
    a, b = (x.to(sig.out_dtype) for x in xs)
    shape = tuple(hi - lo for lo, hi in rect)
    return torch.div(a, b, rounding_mode=sig.attrs["mode"]).expand(shape)


register(OpDef(
    kind="rounded_div", type_id=56, cpu=_rounded_div_cpu,
    input_regions=lambda sig, rect: [broadcast_region(s, sig.out_shape, rect) for s in sig.in_shapes],
    gpu=GpuSpec(params=lambda op: ([ROUNDING_MODES.index(op.attrs["mode"])], []), float64_exact=True),
    doc="out = torch.div(a, b, rounding_mode=attrs['mode']) in the output dtype, a and b broadcast: integers "
        "exactly, floats as eager rounds them (floor: from the exact remainder, 1 // 0.1 = 9)",
))


# --- one_hot ------------------------------------------------------------------------------------

def _one_hot_cpu(sig: OpSig, rect, xs):
    n = sig.out_shape[-1]
    _check_range(xs[0], n, rect[:-1], sig.in_shapes[0])
    classes = torch.arange(*rect[-1])
    return (xs[0].unsqueeze(-1) == classes).to(sig.out_dtype)


register(OpDef(
    kind="one_hot", type_id=53, input_regions=lambda sig, rect: [rect[:-1]], cpu=_one_hot_cpu,
    gpu=GpuSpec(),
    doc="out[…, c] = (x[…] == c) for c < out_shape[-1] (F.one_hot with num_classes given); an index outside "
        "[0, num_classes) is reported (BAD_INDEX) and its row written as 0",
))


# --- histogram: histc and bincount --------------------------------------------------------------

HISTOGRAM_MODES = ("histc", "bincount")  # the CUDA task's iparam[0] is the position


def _histogram_regions(sig: OpSig, rect):
    # any entry may land in any bin: every tile reads its inputs whole
    return [tuple((0, n) for n in shape) for shape in sig.in_shapes]


def _histogram_cpu(sig: OpSig, rect, xs):
    (lo, hi), = rect
    bins = sig.out_shape[0]
    x = xs[0].flatten()
    if sig.attrs["mode"] == "histc":
        return torch.histc(x, bins, sig.attrs["min"], sig.attrs["max"])[lo:hi].to(sig.out_dtype)
    _check_range(x, bins, ((0, x.numel()),), (x.numel(),))
    weights = xs[1].flatten() if len(xs) > 1 else None
    return torch.bincount(x, weights, minlength=bins)[lo:hi].to(sig.out_dtype)


def _histogram_min_tile(sig: OpSig) -> int:
    # each bin scans every entry
    return max(1, 1024 // max(1, math.prod(sig.in_shapes[0])))


def _histogram_params(op) -> tuple[list[int], list[float]]:
    a = op.attrs
    lo, hi = (a["min"], a["max"]) if a["mode"] == "histc" else (0.0, 0.0)
    return [HISTOGRAM_MODES.index(a["mode"]), float_bits(lo), float_bits(hi)], []


register(OpDef(
    kind="histogram", type_id=54, input_regions=_histogram_regions, cpu=_histogram_cpu,
    min_tile_elems=_histogram_min_tile, gpu=GpuSpec(params=_histogram_params, float64_exact=True),
    doc="attrs['mode'] 'histc': out = torch.histc(x, bins, attrs['min'], attrs['max']) (min == max: the data's "
        "range); 'bincount': out = torch.bincount(x, weights, minlength=bins) of 1-D x (and weights), the bin "
        "count static: a value outside [0, bins) is reported (BAD_INDEX) and skipped",
))


# --- expert_matmul: the grouped expert GEMM -----------------------------------------------------

def _expert_regions(sig: OpSig, rect):
    """a is [S|E, M, K], b is [S|E, K, N], index [S]; operand attrs['gathered'] is indexed by
    index[s] along its dim 0, so a tile reads all of its experts (which it needs is known at run
    time only), the other operand the tile's rows."""
    (a_shape, b_shape, _), g = sig.in_shapes, sig.attrs["gathered"]
    rows = rect[0]
    a = ((0, a_shape[0]) if g == 0 else rows, rect[1], (0, a_shape[2]))
    b = ((0, b_shape[0]) if g == 1 else rows, (0, b_shape[1]), rect[2])
    return [a, b, (rows,)]


def _expert_cpu(sig: OpSig, rect, xs):
    a, b, index = xs
    g = sig.attrs["gathered"]
    experts = (a if g == 0 else b).shape[0]
    index = torch.where(index < 0, index + experts, index)  # W[ids] counts a negative id from the end
    _check_range(index, experts, rect[:1], sig.in_shapes[2])
    if g == 0:
        a = a[index.long()]
    else:
        b = b[index.long()]
    # fp32 accumulation, one rounding to the output dtype (as eager's 16-bit bmm)
    acc = torch.float64 if sig.out_dtype == torch.float64 else torch.float32
    return torch.bmm(a.to(acc), b.to(acc)).to(sig.out_dtype)


register(OpDef(
    kind="expert_matmul", type_id=55, input_regions=_expert_regions, cpu=_expert_cpu,
    gpu=GpuSpec(params=lambda op: ([op.attrs["gathered"]], []), float64_exact=True),
    doc="out[s] = A_s @ B_s over [S, M, N] with A_s = a[index[s]] if attrs['gathered'] == 0 else a[s], "
        "B_s = b[index[s]] if attrs['gathered'] == 1 else b[s]: a batched matmul whose one operand is an "
        "expert's weight picked by the run-time index (the grouped GEMM of MoE layers); a negative index counts "
        "from the end (W[index]), one outside the experts is reported (BAD_INDEX) and its rows written as 0",
))
