"""Zero-copy views of a buffer as a chain of primitive steps.

Every view an op reads is a chain of four primitives over one contiguous buffer: ``permute``,
``slice`` (with step), ``expand`` (size-1 dims broadcast) and ``reshape`` (split / merge of
dims). The chain serves two consumers:

* the compiler maps a rect read through the view back to exact rects of the buffer
  (``View.base_regions``), which is what dependency analysis intersects with producer tiles;
* the tables describe the view as (shape, strides, offset) over the buffer
  (``View.strided``). A chain with no strided form (e.g. merging an expanded dim) is
  materialised by a copy op at lowering time, so the executors only ever see strided views.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from mpk.ir.regions import Rect, RectList, cap, cross, interval_to_rects, rect_to_intervals

Shape = tuple[int, ...]
Step = tuple  # ("permute", perm) | ("slice", dim, start, stop, step) | ("expand", shape) | ("reshape", shape)

_MAX_STEP_PIECES = 16


def contiguous_strides(shape: Shape) -> tuple[int, ...]:
    return tuple(prod(shape[i + 1:]) for i in range(len(shape)))


def reshape_groups(src: Shape, dst: Shape) -> list[tuple[range, range]]:
    """Pair runs of ``src`` dims with runs of ``dst`` dims that hold the same elements."""
    if prod(src) != prod(dst):
        raise ValueError(f"cannot reshape {src} into {dst}: {prod(src)} != {prod(dst)} elements")
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        i0, j0, ps, pd = i, j, 1, 1
        if i < len(src):
            ps, i = src[i], i + 1
        if j < len(dst):
            pd, j = dst[j], j + 1
        while ps != pd:
            if ps < pd:
                ps, i = ps * src[i], i + 1
            else:
                pd, j = pd * dst[j], j + 1
        groups.append((range(i0, i), range(j0, j)))
    return groups


def _step_out_shape(shape: Shape, step: Step) -> Shape:
    kind = step[0]
    if kind == "permute":
        perm = step[1]
        if sorted(perm) != list(range(len(shape))):
            raise ValueError(f"permutation {perm} does not fit a {len(shape)}-d tensor")
        return tuple(shape[p] for p in perm)
    if kind == "slice":
        _, dim, start, stop, st = step
        if not (0 <= start <= stop <= shape[dim]) or st < 1:
            raise ValueError(f"slice [{start}:{stop}:{st}] out of range for dim {dim} of size {shape[dim]}")
        out = list(shape)
        out[dim] = -(-(stop - start) // st)
        return tuple(out)
    if kind == "expand":
        new = step[1]
        if len(new) != len(shape) or any(s not in (1, n) for s, n in zip(shape, new)):
            raise ValueError(f"cannot expand {shape} to {new}")
        return tuple(new)
    if kind == "reshape":
        reshape_groups(shape, step[1])
        return tuple(step[1])
    raise ValueError(f"unknown view step {step!r}")


def _map_back(step: Step, in_shape: Shape, rect: Rect) -> RectList:
    """Rects of the step's input that the output rect ``rect`` reads (exact up to MAX_PIECES)."""
    kind = step[0]
    if kind == "permute":
        inv = [0] * len(rect)
        for i, p in enumerate(step[1]):
            inv[p] = i
        return [tuple(rect[inv[d]] for d in range(len(rect)))]
    if kind == "slice":
        _, dim, start, _, st = step
        a, b = rect[dim]
        if st == 1:
            pieces = [(start + a, start + b)]
        elif b - a <= _MAX_STEP_PIECES:
            pieces = [(start + st * i, start + st * i + 1) for i in range(a, b)]
        else:
            pieces = [(start + st * a, start + st * (b - 1) + 1)]
        return [rect[:dim] + (p,) + rect[dim + 1:] for p in pieces]
    if kind == "expand":
        return [tuple((0, 1) if n == 1 else r for n, r in zip(in_shape, rect))]
    # reshape: map each group independently, then take the cartesian product
    out_shape = tuple(step[1])
    parts: list[RectList] = []
    for src, dst in reshape_groups(in_shape, out_shape):
        sub = tuple(rect[j] for j in dst)
        dims_dst = tuple(out_shape[j] for j in dst)
        dims_src = tuple(in_shape[i] for i in src)
        pieces: RectList = []
        for lo, hi in rect_to_intervals(sub, dims_dst):
            pieces += interval_to_rects(lo, hi, dims_src)
        parts.append(cap(pieces))
    return cross(parts)


def _step_strides(step: Step, in_shape: Shape, strides: tuple[int, ...], offset: int):
    kind = step[0]
    if kind == "permute":
        return tuple(strides[p] for p in step[1]), offset
    if kind == "slice":
        _, dim, start, _, st = step
        s = list(strides)
        s[dim] = strides[dim] * st
        return tuple(s), offset + start * strides[dim]
    if kind == "expand":
        return tuple(0 if (n == 1 and m != 1) else s for n, m, s in zip(in_shape, step[1], strides)), offset
    out_shape = tuple(step[1])
    out = [0] * len(out_shape)
    for src, dst in reshape_groups(in_shape, out_shape):
        real = [i for i in src if in_shape[i] != 1]
        for a, b in zip(real, real[1:]):
            if strides[a] != strides[b] * in_shape[b]:
                return None
        s = strides[real[-1]] if real else 1
        for j in reversed(dst):
            out[j] = s
            s *= out_shape[j]
    return tuple(out), offset


@dataclass(frozen=True)
class View:
    """A tensor an op reads: ``buffer`` seen through ``steps``; ``shapes[k]`` is the shape after step k."""

    buffer: int
    base_shape: Shape
    steps: tuple[Step, ...] = ()
    shapes: tuple[Shape, ...] = ()

    @property
    def shape(self) -> Shape:
        return self.shapes[-1] if self.shapes else self.base_shape

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def then(self, step: Step) -> "View":
        out = _step_out_shape(self.shape, step)
        if step[0] == "reshape" and out == self.shape:
            return self
        if step[0] == "permute" and list(step[1]) == list(range(self.ndim)):
            return self
        if step[0] == "expand" and out == self.shape:
            return self
        if step[0] == "slice" and step[2] == 0 and step[3] == self.shape[step[1]] and step[4] == 1:
            return self
        return View(self.buffer, self.base_shape, self.steps + (step,), self.shapes + (out,))

    def base_regions(self, rect: Rect) -> RectList:
        """Exact rects of the buffer that the view's ``rect`` reads (bounding box past MAX_PIECES)."""
        rects: RectList = [rect]
        in_shapes = (self.base_shape,) + self.shapes[:-1]
        for step, in_shape in zip(reversed(self.steps), reversed(in_shapes)):
            nxt: RectList = []
            for r in rects:
                nxt += _map_back(step, in_shape, r)
            rects = cap(nxt)
        return rects

    def strided(self) -> tuple[tuple[int, ...], int] | None:
        """(strides, offset) in elements over the contiguous buffer, or None if not expressible."""
        strides, offset = contiguous_strides(self.base_shape), 0
        shape = self.base_shape
        for step, out_shape in zip(self.steps, self.shapes):
            res = _step_strides(step, shape, strides, offset)
            if res is None:
                return None
            (strides, offset), shape = res, out_shape
        return strides, offset


def identity_view(buffer: int, shape: Shape) -> View:
    return View(buffer, tuple(shape))
