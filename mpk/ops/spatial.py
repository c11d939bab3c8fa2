"""``pool``: max and average pooling over the last 1 to 3 dims of a tensor, with kernel, stride,
padding, dilation (max), ceil_mode (it only sizes the output), count_include_pad and
divisor_override (average), or adaptive (each output position's window spans
[⌊o·L/O⌋, ⌈(o+1)·L/O⌉)). Upsampling needs no op of its own: torch decomposes it into index
arithmetic and ``_unsafe_index`` (a gather) before mpk sees it."""

from __future__ import annotations

import torch

from mpk.ir.regions import Rect
from mpk.ops.gpu import GpuSpec, OpInfo
from mpk.ops.registry import OpDef, OpSig, register

# Each spatial dim's (kernel, stride, padding, dilation) share one iparam, PACK_BITS bits each.
PACK_BITS = 16


def _nsp(sig: OpSig) -> int:
    return len(sig.attrs["kernel"])


def pool_window(sig: OpSig, d: int, o: int) -> tuple[int, int, int, int]:
    """Output position ``o`` of spatial dim ``d``'s window in the input: (lo, hi, step, count),
    the positions lo, lo + step, … below hi (clipped to the input), and the count an average
    divides by along this dim (the divisor is the product over the dims)."""
    a = sig.attrs
    n_in = sig.in_shapes[0][len(sig.out_shape) - _nsp(sig) + d]
    if a["adaptive"]:
        n_out = sig.out_shape[len(sig.out_shape) - _nsp(sig) + d]
        lo, hi = o * n_in // n_out, -(-(o + 1) * n_in // n_out)
        return lo, hi, 1, hi - lo
    k, s, p, dil = a["kernel"][d], a["stride"][d], a["padding"][d], a["dilation"][d]
    start = o * s - p
    if a["mode"] == "max":  # start + j·dil for j < k, inside the input
        lo = start + -(-max(0, -start) // dil) * dil
        return lo, min(start + (k - 1) * dil + 1, n_in), dil, 0
    end = min(start + k, n_in + p)  # the window as far as the padding reaches
    lo, hi = max(start, 0), min(end, n_in)
    return lo, hi, 1, (end - start) if a["count_include_pad"] else hi - lo


def _pool_regions(sig: OpSig, rect: Rect):
    nsp, lead = _nsp(sig), len(sig.out_shape) - _nsp(sig)
    region = list(rect[:lead])
    for d in range(nsp):
        # a dilated max window's first position need not grow with o (it skips the padding by dil)
        windows = [pool_window(sig, d, o) for o in range(*rect[lead + d])]
        lo, hi = min(w[0] for w in windows), max(w[1] for w in windows)
        region.append((lo, max(hi, lo + 1)))
    return [tuple(region)]


def _pool_cpu(sig: OpSig, rect: Rect, xs):
    # separable: a max, or a sum with the product of per-dim counts, one spatial dim at a time
    ct = torch.float64 if sig.out_dtype == torch.float64 else torch.float32
    x = xs[0].to(ct)
    nsp, lead = _nsp(sig), len(sig.out_shape) - _nsp(sig)
    start = _pool_regions(sig, rect)[0]
    is_max = sig.attrs["mode"] == "max"
    divisor = torch.ones((), dtype=ct)
    for d in range(nsp):
        ax, pieces, counts = lead + d, [], []
        for o in range(*rect[ax]):
            lo, hi, step, count = pool_window(sig, d, o)
            window = x[(slice(None),) * ax + (slice(lo - start[ax][0], hi - start[ax][0], step),)]
            pieces.append(window.amax(ax, keepdim=True) if is_max else window.sum(ax, keepdim=True))
            counts.append(count)
        x = torch.cat(pieces, ax)
        shape = [1] * len(sig.out_shape)
        shape[ax] = -1
        divisor = divisor * torch.tensor(counts, dtype=ct).reshape(shape)
    if not is_max:
        x = x / (sig.attrs["divisor"] or divisor)
    return x.to(sig.out_dtype)


def _pool_min_tile(sig: OpSig) -> int:
    window = 1
    for d in range(_nsp(sig)):
        n_in, n_out = sig.in_shapes[0][-_nsp(sig) + d], sig.out_shape[-_nsp(sig) + d]
        window *= -(-n_in // n_out) + 1 if sig.attrs["adaptive"] else sig.attrs["kernel"][d]
    return max(32, 4096 // window)


def pool_params(op: OpInfo) -> tuple[list[int], list[float]]:
    """iparam[0] 1: average (0: max); [1] 1: adaptive; [2] count_include_pad; [3] divisor_override
    (0: none); [4] the number of spatial dims (the last ones); [5 + d] spatial dim d's kernel |
    stride << 16 | padding << 32 | dilation << 48."""
    a = op.attrs
    packed = [a["kernel"][d] | a["stride"][d] << PACK_BITS | a["padding"][d] << 2 * PACK_BITS
              | a["dilation"][d] << 3 * PACK_BITS for d in range(len(a["kernel"]))]
    return [int(a["mode"] == "avg"), int(a["adaptive"]), int(a["count_include_pad"]), int(a["divisor"]),
            len(a["kernel"]), *packed], []


def _pool_check(op: OpInfo) -> None:
    for name in ("kernel", "stride", "padding", "dilation"):
        if any(not 0 <= v < 1 << (PACK_BITS - 1) for v in op.attrs[name]):
            raise op.error(f"pool {name} {list(op.attrs[name])} outside [0, {1 << (PACK_BITS - 1)}) (the task "
                           f"packs it in {PACK_BITS} bits)")


register(OpDef(
    kind="pool", type_id=47, input_regions=_pool_regions, cpu=_pool_cpu, min_tile_elems=_pool_min_tile,
    gpu=GpuSpec(params=pool_params, check=_pool_check, float64_exact=True),
    doc="out = max or average pooling of x over its last len(attrs['kernel']) dims; attrs: mode ('max' / 'avg'), "
        "adaptive (windows from the sizes alone; kernel … dilation then unused, all 0), kernel, stride, padding, "
        "dilation (one per spatial dim), count_include_pad, divisor (divisor_override, 0: none). NaN propagates "
        "through max. Accumulates in float32 (float64 for float64)",
))
