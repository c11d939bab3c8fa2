"""``copy`` (materialise a view that has no strided form, reshaping it), ``cat`` and ``gather``."""

from __future__ import annotations

import torch

from mpk.errors import BAD_INDEX, BadInputError, bad_input_message
from mpk.ir.views import reshape_groups
from mpk.ops.registry import OpDef, OpSig, register


def _copy_groups(sig: OpSig):
    return reshape_groups(sig.in_shapes[0], sig.out_shape)


def _copy_splittable(sig: OpSig) -> tuple[bool, ...]:
    # Only dims the reshape keeps as they are (one input dim ↔ one output dim of equal size)
    # may be split: then every tile reads one rect of the input.
    split = [False] * len(sig.out_shape)
    for src, dst in _copy_groups(sig):
        if len(src) == 1 and len(dst) == 1:
            split[dst[0]] = True
    return tuple(split)


def _copy_regions(sig: OpSig, rect):
    in_shape = sig.in_shapes[0]
    region = [(0, n) for n in in_shape]
    for src, dst in _copy_groups(sig):
        if len(src) == 1 and len(dst) == 1:
            region[src[0]] = rect[dst[0]]
    return [tuple(region)]


def _copy_cpu(sig: OpSig, rect, xs):
    return xs[0].reshape([b - a for a, b in rect]).to(sig.out_dtype)


register(OpDef(
    kind="copy", type_id=40, input_regions=_copy_regions, cpu=_copy_cpu, splittable=_copy_splittable,
    doc="out = reshape(x, out_shape): materialises a view (only dims the reshape keeps are split)",
))


def _cat_regions(sig: OpSig, rect):
    dim, lo = sig.attrs["dim"], 0
    regions: list = []
    for shape in sig.in_shapes:
        a, b = max(rect[dim][0], lo), min(rect[dim][1], lo + shape[dim])
        regions.append(rect[:dim] + ((a - lo, b - lo),) + rect[dim + 1:] if a < b else None)
        lo += shape[dim]
    return regions


def _cat_cpu(sig: OpSig, rect, xs):
    pieces = [x for x in xs if x is not None]
    if not pieces:  # an empty tile (a cat of empty tensors): no input region reaches it
        return torch.empty([hi - lo for lo, hi in rect], dtype=sig.out_dtype)
    return torch.cat(pieces, dim=sig.attrs["dim"]).to(sig.out_dtype)


register(OpDef(
    kind="cat", type_id=41, input_regions=_cat_regions, cpu=_cat_cpu,
    doc="out = cat(inputs, dim)",
))


def _gather_regions(sig: OpSig, rect):
    dim = sig.attrs["dim"]
    return [rect[:dim] + ((0, sig.in_shapes[0][dim]),) + rect[dim + 1:], rect]


def _gather_cpu(sig: OpSig, rect, xs):
    x, index = xs
    n, dim = x.shape[sig.attrs["dim"]], sig.attrs["dim"]
    index = torch.where(index < 0, index + n, index) if sig.attrs["wrap"] else index
    bad = ((index < 0) | (index >= n)).nonzero()
    if len(bad):
        at = tuple(int(i) for i in bad[0])
        flat, stride = 0, 1
        for d in reversed(range(len(sig.out_shape))):  # the element's row-major position in the result
            flat += (rect[d][0] + at[d]) * stride
            stride *= sig.out_shape[d]
        raise BadInputError(bad_input_message(BAD_INDEX, int(xs[1][at]), flat, n))
    return torch.gather(x, dim, index.long()).to(sig.out_dtype)


register(OpDef(
    kind="gather", type_id=42, input_regions=_gather_regions, cpu=_gather_cpu,
    doc="out[i…] = x[i… with dim replaced by index[i…]] (torch.gather); attrs['wrap']: negative indices count "
        "from the end (x[idx]); an index outside the dim is reported (BAD_INDEX), its element written as 0",
))
