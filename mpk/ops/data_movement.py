"""``copy`` (materialise a view that has no strided form, reshaping it), ``cat``, ``gather`` and
``triangle`` (tril / triu)."""

from __future__ import annotations

import torch

from mpk.errors import BAD_INDEX, BadInputError, bad_input_message
from mpk.ir.views import reshape_groups
from mpk.ops.gpu import GpuSpec
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
    gpu=GpuSpec(float64_exact=True),  # elements are moved through double
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
    gpu=GpuSpec(params=lambda op: ([op.attrs["dim"]], []), float64_exact=True),
    doc="out = cat(inputs, dim)",
))


def _triangle_cpu(sig: OpSig, rect, xs):
    # the tile's own rows and columns decide which elements stay: j - i against the diagonal
    (r0, r1), (c0, c1) = rect[-2], rect[-1]
    offset = torch.arange(c0, c1).unsqueeze(0) - torch.arange(r0, r1).unsqueeze(1)
    diagonal = sig.attrs["diagonal"]
    keep = offset >= diagonal if sig.attrs["upper"] else offset <= diagonal
    return torch.where(keep, xs[0], torch.zeros((), dtype=xs[0].dtype)).to(sig.out_dtype)


register(OpDef(
    kind="triangle", type_id=43, input_regions=lambda sig, rect: [rect], cpu=_triangle_cpu,
    # iparam[0] the diagonal, [1] 1 for triu (keep j - i >= diagonal), 0 for tril (j - i <= diagonal)
    gpu=GpuSpec(params=lambda op: ([int(op.attrs["diagonal"]), int(op.attrs["upper"])], []), float64_exact=True),
    doc="out = triu(x, diagonal) if attrs['upper'] else tril(x, diagonal), over the last two dims "
        "(elements outside the triangle are 0)",
))


def _gather_layout(sig: OpSig) -> tuple[int, int, int]:
    """(d0, k, nb): x's dims d0 … d0+k-1 are indexed, by the k index inputs, whose common shape
    fills the output's dims d0 … d0+nb-1; the dims before and after are x's."""
    d0, k = sig.attrs["dim"], len(sig.in_shapes) - 1
    return d0, k, len(sig.out_shape) - (len(sig.in_shapes[0]) - k)


def _gather_regions(sig: OpSig, rect):
    d0, k, nb = _gather_layout(sig)
    x_shape = sig.in_shapes[0]
    x_region = rect[:d0] + tuple((0, x_shape[d0 + j]) for j in range(k)) + rect[d0 + nb:]
    return [x_region] + [rect] * k


def _gather_cpu(sig: OpSig, rect, xs):
    x, *indices = xs
    d0, k, nb = _gather_layout(sig)
    tile = tuple(hi - lo for lo, hi in rect)
    picks = []
    for j, index in enumerate(indices):
        n = x.shape[d0 + j]
        index = torch.where(index < 0, index + n, index) if sig.attrs["wrap"] else index
        bad = ((index < 0) | (index >= n)).nonzero()
        if len(bad):
            at = tuple(int(i) for i in bad[0])
            flat, stride = 0, 1
            for d in reversed(range(len(sig.out_shape))):  # the element's row-major position in the result
                flat += (rect[d][0] + at[d]) * stride
                stride *= sig.out_shape[d]
            raise BadInputError(bad_input_message(BAD_INDEX, int(indices[j][at]), flat, n))
        picks.append(index.long())

    def along(d):  # the tile's positions along output dim d, broadcast over the tile
        return torch.arange(tile[d]).reshape([-1 if e == d else 1 for e in range(len(tile))])

    where = [along(d) for d in range(d0)] + picks + [along(d) for d in range(d0 + nb, len(tile))]
    return x[tuple(where)].expand(tile).to(sig.out_dtype)


register(OpDef(
    kind="gather", type_id=42, input_regions=_gather_regions, cpu=_gather_cpu,
    gpu=GpuSpec(params=lambda op: ([op.attrs["dim"], int(op.attrs["wrap"])], []), float64_exact=True),
    doc="out[a…, b…, c…] = x[a…, index_0[a…, b…, c…], …, index_{k-1}[…], c…]: x's dims dim … dim+k-1 picked by "
        "the k index inputs (views of the output's shape; torch.gather has k = 1 and b one dim); attrs['wrap']: "
        "negative indices count from the end (x[idx]); an index outside its dim is reported (BAD_INDEX), its "
        "element written as 0",
))
