"""``conv``: N-d convolution and transposed convolution (aten.convolution), 1 to 3 spatial dims,
with stride, padding, dilation, groups and an optional bias. Output-tiled: a tile of
(batch, out channels, spatial…) reads the batch rows it holds, the input channels of the groups
its out channels belong to, and the input window its spatial range reaches."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mpk.ir.regions import Rect
from mpk.ops.gpu import GpuSpec, OpInfo
from mpk.ops.registry import OpDef, OpSig, register

# Each spatial dim's (stride, padding, dilation) share one iparam, PACK_BITS bits each.
PACK_BITS = 20


def _groups_touched(sig: OpSig, rect: Rect) -> tuple[int, int]:
    """The groups [g0, g1) the tile's out channels belong to."""
    per = sig.out_shape[1] // sig.attrs["groups"]
    return rect[1][0] // per, -(-rect[1][1] // per)


def _spatial_window(sig: OpSig, d: int, lo: int, hi: int) -> tuple[int, int]:
    """The input positions [a, b) (unclipped; a ≥ b: none) that output positions [lo, hi) of
    spatial dim ``d`` read."""
    s, p, dil = sig.attrs["stride"][d], sig.attrs["padding"][d], sig.attrs["dilation"][d]
    k = sig.in_shapes[1][2 + d]
    if sig.attrs["transposed"]:  # out o = i·s − p + j·dil: i from ⌈(lo + p − (k−1)·dil)/s⌉ to ⌊(hi−1+p)/s⌋
        return -(-(lo + p - (k - 1) * dil) // s), (hi - 1 + p) // s + 1
    return lo * s - p, (hi - 1) * s - p + (k - 1) * dil + 1


def _conv_regions(sig: OpSig, rect: Rect):
    x_shape, w_shape = sig.in_shapes[0], sig.in_shapes[1]
    g0, g1 = _groups_touched(sig, rect)
    cin = x_shape[1] // sig.attrs["groups"]
    x_region: list[tuple[int, int]] = [rect[0], (g0 * cin, g1 * cin)]
    for d in range(len(x_shape) - 2):
        a, b = _spatial_window(sig, d, *rect[2 + d])
        a, b = max(a, 0), min(b, x_shape[2 + d])
        x_region.append((a, b))
    reads_x = all(a < b for a, b in x_region)
    if sig.attrs["transposed"]:  # w: (C_in, C_out / groups, k…)
        w_region = ((g0 * cin, g1 * cin),) + tuple((0, n) for n in w_shape[1:])
    else:  # w: (C_out, C_in / groups, k…); whole groups (the tile is computed a group at a time)
        per = sig.out_shape[1] // sig.attrs["groups"]
        w_region = ((g0 * per, g1 * per),) + tuple((0, n) for n in w_shape[1:])
    regions: list[Rect | None] = [tuple(x_region) if reads_x else None, w_region if reads_x else None]
    if len(sig.in_shapes) == 3:
        regions.append((rect[1],))
    return regions


def _compute_dtype(sig: OpSig) -> torch.dtype:
    # the GPU task accumulates in float32 (double for float64): the reference does the same
    return torch.float64 if sig.out_dtype == torch.float64 else torch.float32


def _conv_cpu(sig: OpSig, rect: Rect, xs):
    x, w = xs[0], xs[1]
    bias = xs[2] if len(xs) == 3 else None
    ct = _compute_dtype(sig)
    tile = [b - a for a, b in rect]
    out = torch.zeros(tile, dtype=ct)
    if x is not None:
        nsp = len(tile) - 2
        g0, g1 = _groups_touched(sig, rect)
        x, w = x.to(ct), w.to(ct)
        stride, dil = sig.attrs["stride"], sig.attrs["dilation"]
        x_regions = _conv_regions(sig, rect)[0]
        if sig.attrs["transposed"]:
            # the slice's full transposed convolution (no padding) starts at output position
            # a·s − p (a: the slice's first input position); the tile is cut out of it
            fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nsp - 1]
            y = fn(x, w, stride=stride, dilation=dil, groups=g1 - g0)
            first = [x_regions[2 + d][0] * stride[d] - sig.attrs["padding"][d] for d in range(nsp)]
        else:
            # the slice padded with zeros to the whole window, convolved without padding
            pad: list[int] = []
            for d in reversed(range(nsp)):
                a, b = _spatial_window(sig, d, *rect[2 + d])
                pad += [x_regions[2 + d][0] - a, b - x_regions[2 + d][1]]
            fn = (F.conv1d, F.conv2d, F.conv3d)[nsp - 1]
            y = fn(F.pad(x, pad), w, stride=stride, dilation=dil, groups=g1 - g0)
            first = [rect[2 + d][0] for d in range(nsp)]
        per = sig.out_shape[1] // sig.attrs["groups"]
        c0 = rect[1][0] - g0 * per
        src, dst = [slice(None), slice(c0, c0 + tile[1])], [slice(None), slice(None)]
        for d in range(nsp):  # the overlap of y's positions with the tile's
            lo, hi = max(first[d], rect[2 + d][0]), min(first[d] + y.shape[2 + d], rect[2 + d][1])
            src.append(slice(lo - first[d], max(lo, hi) - first[d]))
            dst.append(slice(lo - rect[2 + d][0], max(lo, hi) - rect[2 + d][0]))
        out[tuple(dst)] = y[tuple(src)]
    if bias is not None:
        out += bias.to(ct).reshape([-1] + [1] * (len(tile) - 2))
    return out.to(sig.out_dtype)


def _conv_min_tile(sig: OpSig) -> int:
    # each output element is a (C_in / groups)·∏k-term sum: tiles shrink as it grows
    terms = 1
    for n in sig.in_shapes[1][1:]:
        terms *= n
    if sig.attrs["transposed"]:  # w: (C_in, C_out / groups, k…); the sum runs over C_in / groups
        terms = terms // sig.in_shapes[1][1] * (sig.in_shapes[0][1] // sig.attrs["groups"])
    return max(32, 4096 // max(1, terms))


def conv_params(op: OpInfo) -> tuple[list[int], list[float]]:
    """iparam[0] 1: transposed; [1] groups; [2 + d] spatial dim d's stride | padding << 20 |
    dilation << 40."""
    a = op.attrs
    packed = [a["stride"][d] | a["padding"][d] << PACK_BITS | a["dilation"][d] << 2 * PACK_BITS
              for d in range(len(a["stride"]))]
    return [int(a["transposed"]), a["groups"], *packed], []


def _conv_check(op: OpInfo) -> None:
    a = op.attrs
    for name in ("stride", "padding", "dilation"):
        if any(not 0 <= v < 1 << PACK_BITS for v in a[name]):
            raise op.error(f"conv {name} {list(a[name])} outside [0, {1 << PACK_BITS}) (the task packs it in "
                           f"{PACK_BITS} bits)")


register(OpDef(
    kind="conv", type_id=46, input_regions=_conv_regions, cpu=_conv_cpu, min_tile_elems=_conv_min_tile,
    gpu=GpuSpec(params=conv_params, check=_conv_check, float64_exact=True),
    doc="out = convolution(x, w, bias) over x's 1 to 3 spatial dims (inputs: x (N, C_in, spatial…), w, "
        "optionally bias (C_out,)); attrs: stride, padding, dilation (one per spatial dim), groups, transposed "
        "(w is then (C_in, C_out / groups, k…); output_padding only sizes the output). Accumulates in float32 "
        "(float64 for float64)",
))
