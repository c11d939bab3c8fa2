"""Hyper-rectangular regions of tensors.

A ``Rect`` is a tuple of half-open ``(start, stop)`` ranges, one per dimension. Tiles, the
slices a task reads and the slices it writes are all rects; a read through a reshaped view may
need a short list of rects (a ``RectList``) to be described exactly.
"""

from __future__ import annotations

from itertools import product
from math import prod

Range = tuple[int, int]
Rect = tuple[Range, ...]
RectList = list[Rect]

# Beyond this many pieces a region is replaced by its bounding box: still a superset, so
# dependencies stay safe, at the price of a possibly needless edge (never seen in practice).
MAX_PIECES = 256


def full_rect(shape: tuple[int, ...]) -> Rect:
    return tuple((0, n) for n in shape)


def rect_numel(rect: Rect) -> int:
    return prod(b - a for a, b in rect)


def bounding_box(rects: RectList) -> Rect:
    ndim = len(rects[0])
    return tuple((min(r[d][0] for r in rects), max(r[d][1] for r in rects)) for d in range(ndim))


def cap(rects: RectList) -> RectList:
    """Deduplicate, and fall back to the bounding box when the list grows too long."""
    uniq = sorted(set(rects))
    return [bounding_box(uniq)] if len(uniq) > MAX_PIECES else uniq


def cross(parts: list[RectList]) -> RectList:
    """Cartesian product of per-group rect lists into rects over all groups' dims."""
    out = [sum(combo, ()) for combo in product(*parts)]
    return cap(out)


def rect_to_intervals(rect: Rect, dims: tuple[int, ...]) -> list[Range]:
    """Row-major linear index intervals covered by ``rect`` in a space of shape ``dims``."""
    if not dims:
        return [(0, 1)]
    # Trailing dims the rect covers fully collapse into the contiguous run of the last
    # partial dim; each index combination of the dims before it gives one interval.
    k = len(dims) - 1
    while k > 0 and rect[k] == (0, dims[k]):
        k -= 1
    inner = prod(dims[k + 1:])
    lead_ranges = [range(a, b) for a, b in rect[:k]]
    lead_strides = [prod(dims[i + 1:]) for i in range(k)]
    n = prod(len(r) for r in lead_ranges)
    if n > MAX_PIECES:
        lo = sum(s * r.start for s, r in zip(lead_strides, lead_ranges)) + rect[k][0] * inner
        hi = sum(s * (r.stop - 1) for s, r in zip(lead_strides, lead_ranges)) + rect[k][1] * inner
        return [(lo, hi)]
    out: list[Range] = []
    for idx in product(*lead_ranges):
        base = sum(s * i for s, i in zip(lead_strides, idx))
        lo, hi = base + rect[k][0] * inner, base + rect[k][1] * inner
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def interval_to_rects(lo: int, hi: int, dims: tuple[int, ...]) -> RectList:
    """Exact decomposition of the linear interval [lo, hi) into at most 2·len(dims)-1 rects."""
    if not dims:
        return [()]
    inner = prod(dims[1:])
    a0, a1 = lo // inner, (hi - 1) // inner
    if a0 == a1:
        return [((a0, a0 + 1),) + r for r in interval_to_rects(lo - a0 * inner, hi - a0 * inner, dims[1:])]
    rects: RectList = []
    mid_lo, mid_hi = a0, a1 + 1
    if lo % inner:
        rects += [((a0, a0 + 1),) + r for r in interval_to_rects(lo % inner, inner, dims[1:])]
        mid_lo = a0 + 1
    if hi % inner:
        mid_hi = a1
    if mid_hi > mid_lo:
        rects.append(((mid_lo, mid_hi),) + tuple((0, n) for n in dims[1:]))
    if hi % inner:
        rects += [((a1, a1 + 1),) + r for r in interval_to_rects(0, hi % inner, dims[1:])]
    return rects


def tile_rect(grid: tuple[int, ...], bounds, tile: int) -> Rect:
    """Rect of tile number ``tile`` (row-major over ``grid``); ``bounds[d]`` holds the
    grid[d] + 1 boundaries of dim d."""
    rect = []
    for d in reversed(range(len(grid))):
        tile, i = divmod(tile, grid[d])
        rect.append((bounds[d][i], bounds[d][i + 1]))
    return tuple(reversed(rect))
