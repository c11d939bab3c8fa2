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
    kind="triangle", type_id=45, input_regions=lambda sig, rect: [rect], cpu=_triangle_cpu,
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


# --- scatter-style updates: the output is the base input with some elements replaced ----------

def _slice_positions(sig: OpSig, lo: int, hi: int) -> tuple[int, int]:
    """The src positions k whose target start + k·step along the dim lies in [lo, hi)."""
    start, step, n = sig.attrs["start"], sig.attrs["step"], sig.in_shapes[1][sig.attrs["dim"]]
    first = max(0, -(-(lo - start) // step))
    last = min(n, -(-(hi - start) // step))
    return first, max(first, last)


def _slice_scatter_regions(sig: OpSig, rect):
    # base is read where the tile keeps it (its whole rect: along the dim the replaced positions
    # interleave with the kept ones at a step), src where the tile's rect meets the slice
    dim = sig.attrs["dim"]
    k0, k1 = _slice_positions(sig, *rect[dim])
    return [rect, rect[:dim] + ((k0, k1),) + rect[dim + 1:] if k0 < k1 else None]


def _slice_scatter_cpu(sig: OpSig, rect, xs):
    base, src = xs
    out = base.to(sig.out_dtype, copy=True)
    if src is not None:
        dim, start, step = sig.attrs["dim"], sig.attrs["start"], sig.attrs["step"]
        k0, k1 = _slice_positions(sig, *rect[dim])
        first = start + k0 * step - rect[dim][0]  # the first replaced position, in the tile
        at = [slice(None)] * out.ndim
        at[dim] = slice(first, first + (k1 - k0 - 1) * step + 1, step)
        out[tuple(at)] = src.to(sig.out_dtype)
    return out


register(OpDef(
    kind="slice_scatter", type_id=43, input_regions=_slice_scatter_regions, cpu=_slice_scatter_cpu,
    gpu=GpuSpec(params=lambda op: ([op.attrs["dim"], op.attrs["start"], op.attrs["step"]], []),
                float64_exact=True),
    doc="out = base with out[…, start + k·step, …] = src[…, k, …] along attrs['dim'] (torch.slice_scatter; "
        "select_scatter is the slice of one position)",
))


SCATTER_REDUCES = ("none", "sum", "amax", "amin", "prod", "mean")  # the CUDA task's iparam[1] is the position


def _scatter_index_region(sig: OpSig, rect):
    """The rect of the index (and src) that can land in output ``rect``: the whole scatter dim
    (any entry along it may hit the tile's positions), the tile's rect clipped to the index's
    shape elsewhere; None where that is empty. A 1-D index (index_put / index_add) is read whole."""
    dim, index_shape = sig.attrs["dim"], sig.in_shapes[1]
    if sig.attrs["index_1d"]:
        return ((0, index_shape[0]),) if index_shape[0] else None
    region = tuple((0, n) if d == dim else (rect[d][0], min(rect[d][1], n)) for d, n in enumerate(index_shape))
    return region if all(a < b for a, b in region) else None


def _scatter_regions(sig: OpSig, rect):
    index = _scatter_index_region(sig, rect)
    if index is None:
        return [rect, None, None]
    dim = sig.attrs["dim"]
    src = rect[:dim] + (index[0],) + rect[dim + 1:] if sig.attrs["index_1d"] else index
    return [rect, index, src]


def _scatter_cpu(sig: OpSig, rect, xs):
    base, index, src = xs
    out = base.to(sig.out_dtype, copy=True)
    if index is None:
        return out
    dim, n, reduce = sig.attrs["dim"], sig.out_shape[sig.attrs["dim"]], sig.attrs["reduce"]
    if sig.attrs["wrap"]:
        index = torch.where(index < 0, index + n, index)
    bad = ((index < 0) | (index >= n)).nonzero()
    if len(bad):
        raise BadInputError(bad_input_message(BAD_INDEX, int(index[tuple(bad[0])]), tuple(int(i) for i in bad[0]), n))
    if sig.attrs["index_1d"] and reduce == "sum":
        # eager's index_add / index_put(accumulate) loop rounds a 16-bit sum at every entry,
        # where scatter_add sums in float32 and rounds once
        return out.index_add_(dim, index.long(), src.to(sig.out_dtype))
    if sig.attrs["index_1d"]:  # entry j of the index carries src's slice j along the dim
        index = index.reshape([-1 if d == dim else 1 for d in range(src.ndim)]).expand(src.shape)
    index = index.long()
    if reduce == "none":  # eager's loop over the entries in order: a duplicate's last entry wins
        return out.scatter_(dim, index, src.to(sig.out_dtype))
    return out.scatter_reduce_(dim, index, src.to(sig.out_dtype), reduce, include_self=sig.attrs["include_self"])


def _scatter_splittable(sig: OpSig) -> tuple[bool, ...]:
    # a tile owns whole lines along the scatter dim: every entry landing in them is its own to
    # fold in order, so duplicates need no atomics and sums keep eager's order
    return tuple(d != sig.attrs["dim"] for d in range(len(sig.out_shape)))


def _scatter_min_tile(sig: OpSig) -> int:
    # each output element scans every entry along the dim (the index's length there), so the
    # default 1024-element tile shrinks as that scan grows
    entries = sig.in_shapes[1][0 if sig.attrs["index_1d"] else sig.attrs["dim"]]
    return max(1, 1024 // max(1, entries))


register(OpDef(
    kind="scatter", type_id=44, input_regions=_scatter_regions, cpu=_scatter_cpu, splittable=_scatter_splittable,
    min_tile_elems=_scatter_min_tile,
    gpu=GpuSpec(params=lambda op: ([op.attrs["dim"], SCATTER_REDUCES.index(op.attrs["reduce"]),
                                    int(op.attrs["include_self"]), int(op.attrs["index_1d"]), int(op.attrs["wrap"])],
                                   []),
                float64_exact=True),
    doc="out = base with src's entries folded into out[…, index[…], …] along attrs['dim'] in entry order "
        "(torch.scatter / scatter_add / scatter_reduce; attrs['reduce'] in SCATTER_REDUCES, 'include_self'). "
        "attrs['index_1d']: index is 1-D and entry j carries src's slice j along the dim (index_put with one "
        "index tensor, index_add, index_copy; a 16-bit sum then rounds at every entry, as eager's does); attrs['wrap']: negative indices count from the end. An index outside the "
        "dim is reported (BAD_INDEX) and its entry skipped",
))
