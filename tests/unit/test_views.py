"""Property tests for ``mpk.ir.views`` and ``mpk.ir.regions`` against torch ground truth.

Random view chains (permute / slice with step 1 or 2 / expand of size-1 dims / reshape that
splits, merges, unsqueezes, squeezes or refactors dims) are applied both to an ``mpk`` ``View``
and, with the matching torch ops, to ``torch.arange(numel).view(base_shape)``; the torch result
holds, at every position, the id of the base element the view reads there.
"""

from __future__ import annotations

from contextlib import contextmanager
from math import prod
from unittest import mock

import pytest
import torch
from hypothesis import example, given, note, settings
from hypothesis import strategies as st

from mpk.ir import regions
from mpk.ir import views as views_mod
from mpk.ir.views import _MAX_STEP_PIECES, View

SETTINGS = settings(max_examples=200, deadline=None)


# --------------------------------------------------------------------------- generation


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def factorizations(draw, n: int, max_dims: int = 4) -> tuple[int, ...]:
    """A random shape of 1..max_dims dims whose product is ``n`` (size-1 dims allowed)."""
    k = draw(st.integers(1, max_dims))
    dims, rest = [], n
    for _ in range(k - 1):
        d = draw(st.sampled_from(_divisors(rest)))
        dims.append(d)
        rest //= d
    dims.append(rest)
    return tuple(draw(st.permutations(dims)))


@st.composite
def view_chains(draw, tricky: bool = False) -> tuple[tuple[int, ...], list[tuple]]:
    """(base_shape, steps): 1-4 base dims of size 1-6, then 1-4 valid steps.

    ``tricky``: at least 2 steps, the first a permute / step-2 slice / expand and the last a
    merging or refactoring reshape -- the chains that may have no strided form.
    """
    ndim = draw(st.integers(2 if tricky else 1, 4))
    # size 1 drawn twice as often: it is what expand, squeeze and the size-1 stride rules act on
    base = tuple(draw(st.lists(st.sampled_from([1, 1, 2, 3, 4, 5, 6]), min_size=ndim, max_size=ndim)))
    shape = base
    steps: list[tuple] = []
    nsteps = draw(st.integers(2 if tricky else 1, 4))
    # Half the time (always if tricky) the last step is a merging / refactoring reshape.
    end_with_reshape = tricky or draw(st.booleans())
    for k in range(nsteps):
        # Pick the primitive first (each about equally likely when applicable), then the kind of
        # reshape, so that permute/slice/expand followed by a merging reshape -- the chains with
        # no strided form -- come up often.
        reshapes = ["unsqueeze", "reshape_any"]
        if len(shape) >= 2:
            reshapes.append("merge")
        if any(len(_divisors(n)) > 2 for n in shape):
            reshapes.append("split")
        if 1 in shape:
            reshapes.append("squeeze")
        kinds = ["permute", "reshape"] + (["slice"] if shape else []) + (["expand"] if 1 in shape else [])
        if tricky and k == 0:
            kinds = [x for x in kinds if x != "reshape"]
        kind = "reshape" if end_with_reshape and k == nsteps - 1 else draw(st.sampled_from(kinds))
        if kind == "reshape":
            if end_with_reshape and k == nsteps - 1:
                reshapes = ["reshape_any"] + (["merge"] if len(shape) >= 2 else [])
            kind = draw(st.sampled_from(reshapes))
        if kind == "permute":
            perm = tuple(draw(st.permutations(range(len(shape)))))
            step, shape = ("permute", perm), tuple(shape[p] for p in perm)
        elif kind == "slice":
            dim = draw(st.integers(0, len(shape) - 1))
            length = draw(st.integers(1, shape[dim]))
            start = draw(st.integers(0, shape[dim] - length))
            stop = start + length
            stride = 2 if tricky and k == 0 else draw(st.sampled_from([1, 2]))
            step = ("slice", dim, start, stop, stride)
            shape = shape[:dim] + (-(-(stop - start) // stride),) + shape[dim + 1:]
        elif kind == "expand":
            new = tuple(draw(st.integers(1, 4)) if n == 1 else n for n in shape)
            step, shape = ("expand", new), new
        else:
            if kind == "split":
                dim = draw(st.sampled_from([i for i, n in enumerate(shape) if len(_divisors(n)) > 2]))
                a = draw(st.sampled_from(_divisors(shape[dim])[1:-1]))
                new = shape[:dim] + (a, shape[dim] // a) + shape[dim + 1:]
            elif kind == "merge":
                i = draw(st.integers(0, len(shape) - 2))
                j = draw(st.integers(i + 2, min(len(shape), i + 3)))
                new = shape[:i] + (prod(shape[i:j]),) + shape[j:]
            elif kind == "unsqueeze":
                i = draw(st.integers(0, len(shape)))
                new = shape[:i] + (1,) + shape[i:]
            elif kind == "squeeze":
                i = draw(st.sampled_from([i for i, n in enumerate(shape) if n == 1]))
                new = shape[:i] + shape[i + 1:]
            else:  # reshape_any: an arbitrary refactorisation (not just split / merge)
                new = draw(factorizations(prod(shape)))
            step, shape = ("reshape", new), new
        steps.append(step)
    return base, steps


@st.composite
def sub_rects(draw, shape: tuple[int, ...]) -> regions.Rect:
    """A non-empty sub-rect of ``shape``, often covering whole dims."""
    rect = []
    for n in shape:
        if draw(st.booleans()):
            rect.append((0, n))
        else:
            length = draw(st.integers(1, n))
            a = draw(st.integers(0, n - length))
            rect.append((a, a + length))
    return tuple(rect)


# --------------------------------------------------------------------------- ground truth


def _torch_step(t: torch.Tensor, step: tuple, use_view: bool) -> torch.Tensor:
    kind = step[0]
    if kind == "permute":
        return t.permute(*step[1]) if step[1] else t
    if kind == "slice":
        _, dim, start, stop, stride = step
        return t[(slice(None),) * dim + (slice(start, stop, stride),)]
    if kind == "expand":
        return t.expand(*step[1])
    return t.view(step[1]) if use_view else t.reshape(step[1])


def torch_chain(base: tuple[int, ...], steps, use_view: bool = False) -> torch.Tensor:
    """Element ids the chain reads; with ``use_view`` reshapes use ``.view`` (may raise)."""
    t = torch.arange(prod(base)).view(base)
    for step in steps:
        t = _torch_step(t, step, use_view)
    return t


def build_views(base, steps) -> list[View]:
    """The mpk view after each prefix of ``steps`` (index 0: the bare buffer)."""
    views = [View(0, base)]
    for step in steps:
        views.append(views[-1].then(step))
    return views


def _slices(rect: regions.Rect) -> tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in rect)


def _mask_of(shape: tuple[int, ...], ids: torch.Tensor) -> torch.Tensor:
    mask = torch.zeros(prod(shape), dtype=torch.bool)
    mask[ids.reshape(-1)] = True
    return mask


def _affine(ids: torch.Tensor) -> bool:
    """Whether ``ids`` is offset + sum_d stride_d * index_d for some integer strides/offset."""
    if ids.dim() == 0:
        return True
    offset = ids[(0,) * ids.dim()]
    expect = offset.clone()
    for d, n in enumerate(ids.shape):
        if n == 1:
            continue
        e = [0] * ids.dim()
        e[d] = 1
        stride = ids[tuple(e)] - offset
        shape = [1] * ids.dim()
        shape[d] = n
        expect = expect + stride * torch.arange(n).view(shape)
    return torch.equal(expect.expand(ids.shape), ids)


# --------------------------------------------------------------------------- view tests


@SETTINGS
@given(st.one_of(view_chains(), view_chains(tricky=True)))
def test_view_shape_matches_torch(chain):
    base, steps = chain
    note(f"base={base} steps={steps}")
    for k, v in enumerate(build_views(base, steps)):
        assert v.shape == tuple(torch_chain(base, steps[:k]).shape), f"prefix {k}"


def _exactness_expected(views: list[View], pieces: regions.RectList) -> bool:
    """Conservative: exact when fewer than MAX_PIECES pieces came back and no strided slice could
    have been bounded (a step>1 slice is only bounded when its rect range exceeds
    ``_MAX_STEP_PIECES`` elements, which needs the sliced output dim to be that long)."""
    if len(pieces) >= regions.MAX_PIECES:
        return False
    for prev, cur in zip(views, views[1:]):
        if cur is prev:
            continue
        step = cur.steps[-1]
        if step[0] == "slice" and step[4] > 1 and cur.shape[step[1]] > _MAX_STEP_PIECES:
            return False
    return True


_orig_cap = regions.cap
_orig_rect_to_intervals = regions.rect_to_intervals


@contextmanager
def spy_fallbacks():
    """Record whether any *intermediate* over-approximation ran inside ``base_regions``: ``cap``
    replacing > MAX_PIECES rects by their bounding box (also inside ``cross``), or
    ``rect_to_intervals`` replacing > MAX_PIECES intervals by one bounding interval (detected
    independently: the returned disjoint intervals hold more elements than the rect)."""
    seen: list[str] = []

    def cap(rects):
        if len(set(rects)) > regions.MAX_PIECES:
            seen.append(f"cap({len(set(rects))} rects)")
        return _orig_cap(rects)

    def rect_to_intervals(rect, dims):
        out = _orig_rect_to_intervals(rect, dims)
        if sum(hi - lo for lo, hi in out) != regions.rect_numel(rect):
            seen.append(f"rect_to_intervals({rect}, {dims})")
        return out

    with mock.patch.object(regions, "cap", cap), mock.patch.object(views_mod, "cap", cap), \
            mock.patch.object(views_mod, "rect_to_intervals", rect_to_intervals):
        yield seen


def _covered(base: tuple[int, ...], pieces: regions.RectList) -> torch.Tensor:
    """Flat mask of the base elements in the union of ``pieces`` (checking each piece's bounds)."""
    got = torch.zeros(base, dtype=torch.bool)
    for p in pieces:
        assert len(p) == len(base)
        assert all(0 <= a < b <= n for (a, b), n in zip(p, base)), f"piece {p} empty or outside {base}"
        got[_slices(p)] = True
    return got.reshape(-1)


@st.composite
def chains_with_rect(draw):
    base, steps = draw(st.one_of(view_chains(), view_chains(tricky=True)))
    return base, steps, draw(sub_rects(build_views(base, steps)[-1].shape))


@SETTINGS
@given(chains_with_rect())
@example(((6,), [("slice", 0, 1, 5, 1)], ((0, 4),)))
@example(((2, 6), [("slice", 1, 1, 6, 2)], ((0, 2), (1, 3))))
@example(((2, 3, 4), [("permute", (2, 0, 1))], ((1, 3), (0, 1), (1, 3))))
@example(((3, 1), [("expand", (3, 4))], ((1, 3), (2, 4))))
@example(((2, 3, 4), [("reshape", (4, 6))], ((1, 3), (2, 5))))
@example(((4, 6), [("permute", (1, 0)), ("reshape", (24,))], ((5, 19),)))
def test_base_regions_cover_exactly(args):
    base, steps, rect = args
    views = build_views(base, steps)
    view = views[-1]
    note(f"base={base} steps={steps} rect={rect}")
    with spy_fallbacks() as fallbacks:
        pieces = view.base_regions(rect)
    note(f"pieces={pieces} fallbacks={fallbacks}")

    assert pieces, "no pieces for a non-empty rect"
    got = _covered(base, pieces)
    want = _mask_of(base, torch_chain(base, steps)[_slices(rect)])
    missing = want & ~got
    assert not missing.any(), f"ids read but not covered: {missing.nonzero().flatten().tolist()}"
    # Exactness is also waived when an intermediate bounding-box fallback ran: the final list can
    # then be short yet inexact. That contradicts "exact whenever the result has <= MAX_PIECES
    # pieces" -- see test_base_regions_exact_despite_intermediate_fallback (xfail) below.
    if _exactness_expected(views, pieces) and not fallbacks:
        extra = got & ~want
        assert not extra.any(), f"ids covered but not read: {extra.nonzero().flatten().tolist()}"


# Known precision bug (found by test_base_regions_cover_exactly before the fallback waiver):
# when a reshape group needs more than MAX_PIECES linear intervals, ``rect_to_intervals`` returns
# one bounding interval (or ``cap`` one bounding box), and ``interval_to_rects`` / the remaining
# steps turn that into a handful of rects. The final list is short (<= MAX_PIECES), so the caller
# cannot tell it is inexact, and it is not even the bounding box of the true region. Still a
# superset, so dependencies stay safe; the cost is needless edges.
@pytest.mark.xfail(strict=True, reason=(
    "base_regions is inexact with few pieces after an intermediate MAX_PIECES fallback in "
    "rect_to_intervals (reshape group with > MAX_PIECES intervals)"))
@pytest.mark.parametrize("base, steps, rect", [
    # 270 one-element intervals -> bounding interval [0, 539): 4 pieces = ids 0..538, but only
    # the 270 even ids are read (exactly the 3 rects last-dim in {0}, {2}, {4}).
    ((3, 5, 6, 6), [("reshape", (270, 2))], ((0, 270), (0, 1))),
    # only base id 0 is read (exact: [((0, 1), (0, 1))]); got [((0, 1), (0, 1)), ((0, 1), (0, 2))]
    ((1, 2), [("expand", (520, 2)), ("reshape", (260, 4))], ((0, 260), (0, 1))),
])
def test_base_regions_exact_despite_intermediate_fallback(base, steps, rect):
    pieces = build_views(base, steps)[-1].base_regions(rect)
    assert len(pieces) <= regions.MAX_PIECES
    got = _covered(base, pieces)
    want = _mask_of(base, torch_chain(base, steps)[_slices(rect)])
    assert not (want & ~got).any()
    assert torch.equal(got, want), f"pieces {pieces} cover {got.nonzero().flatten().tolist()}"


@SETTINGS
@given(st.one_of(view_chains(), view_chains(tricky=True)))
@example(((1, 1), [("expand", (2, 3)), ("reshape", (6,))]))  # merged stride-0 dims: strided
@example(((2, 1), [("expand", (2, 3)), ("reshape", (6,))]))  # expanded dim merged: None
@example(((2, 3), [("permute", (1, 0)), ("reshape", (6,))]))  # transposed flatten: None
# None although the full chain reads affine ids again (transpose): the chain-level semantics
@example(((2, 3), [("permute", (1, 0)), ("reshape", (6,)), ("reshape", (3, 2))]))
@example(((4, 3), [("slice", 0, 0, 4, 2), ("reshape", (6,))]))  # step-2 rows merged: None
def test_strided_matches_torch(chain):
    base, steps = chain
    note(f"base={base} steps={steps}")
    views = build_views(base, steps)
    view = views[-1]
    truth = torch_chain(base, steps)
    res = view.strided()
    note(f"strided={res}")
    if res is not None:
        strides, offset = res
        assert len(strides) == view.ndim
        got = torch.arange(prod(base)).as_strided(view.shape, strides, offset)
        assert torch.equal(got, truth)
        return
    # No strided form. ``strided()`` is chain-level: it gives up at the first step whose output
    # is not strided, even if later steps would make the ids strided again (e.g. permute, flatten,
    # un-flatten), and lowering copies the prefix before that step (Lowerer.strided in
    # frontend/lower.py). So "None => the final ids are not affine" is NOT sound; the
    # sound claims are: (a) torch's ``.view`` of the same chain fails as well -- if it succeeded,
    # torch would have found strides for every step, i.e. a strided form that ``strided()``
    # missed; (b) at the first prefix where ``strided()`` is None, the ids that prefix reads
    # are really not affine in the index (a brute-force check independent of torch's
    # view algorithm). Claim (b) is NOT made for the full chain, which may be affine again.
    with pytest.raises(RuntimeError):
        torch_chain(base, steps, use_view=True)
    first = next(k for k, v in enumerate(views) if v.strided() is None)
    assert not _affine(torch_chain(base, steps[:first])), f"prefix {first} is strided"


# --------------------------------------------------------------------------- regions tests


@st.composite
def dims_and_interval(draw):
    dims = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    n = prod(dims)
    lo = draw(st.integers(0, n - 1))
    return dims, lo, draw(st.integers(lo + 1, n))


@SETTINGS
@given(dims_and_interval())
def test_interval_to_rects_exact_disjoint(args):
    dims, lo, hi = args
    rects = regions.interval_to_rects(lo, hi, dims)
    note(f"rects={rects}")
    assert 1 <= len(rects) <= 2 * len(dims) - 1
    count = torch.zeros(dims, dtype=torch.int64)
    for r in rects:
        assert len(r) == len(dims)
        assert all(0 <= a < b <= n for (a, b), n in zip(r, dims)), f"rect {r} empty or outside {dims}"
        count[_slices(r)] += 1
    count = count.reshape(-1)
    assert count.max() <= 1, "rects overlap"
    want = torch.zeros(prod(dims), dtype=torch.int64)
    want[lo:hi] = 1
    assert torch.equal(count, want)


def test_interval_to_rects_zero_dims():
    assert regions.interval_to_rects(0, 1, ()) == [()]
    assert regions.rect_to_intervals((), ()) == [(0, 1)]


@st.composite
def dims_and_rect(draw):
    dims = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=5)))
    return dims, draw(sub_rects(dims))


@SETTINGS
@given(dims_and_rect())
# more than MAX_PIECES leading index combinations: the bounding-interval fallback
@example(((6, 6, 6, 6, 6), ((0, 6), (0, 6), (0, 6), (1, 6), (2, 4))))
@example(((300, 2), ((0, 300), (0, 1))))
@example(((3, 4), ((0, 3), (0, 3))))  # runs one element apart must not merge
def test_rect_to_intervals_round_trip(args):
    dims, rect = args
    intervals = regions.rect_to_intervals(rect, dims)
    note(f"intervals={intervals}")
    n = prod(dims)
    want = torch.zeros(dims, dtype=torch.bool)
    want[_slices(rect)] = True
    want = want.reshape(-1)

    lin = torch.zeros(n, dtype=torch.int64)
    back = torch.zeros(dims, dtype=torch.bool)
    for (lo, hi), nxt in zip(intervals, intervals[1:] + [None]):
        assert 0 <= lo < hi <= n
        if nxt is not None:
            assert hi <= nxt[0], "intervals unsorted or overlapping"
        lin[lo:hi] += 1
        for r in regions.interval_to_rects(lo, hi, dims):
            back[_slices(r)] = True
    back = back.reshape(-1)
    # the rects round-trip to exactly the intervals' elements
    assert torch.equal(back, lin.bool())
    assert not (want & ~back).any(), "rect elements missing from its intervals"
    # Exact unless the leading index combinations exceed MAX_PIECES, and then it must have fallen
    # back to one bounding interval (trailing full dims fold into the runs, so a rect with many
    # leading combinations may still be exact: only "exact or a single interval" is asserted).
    if prod(b - a for a, b in rect[:-1]) <= regions.MAX_PIECES:
        assert torch.equal(back, want)
    else:
        assert torch.equal(back, want) or len(intervals) == 1


# --------------------------------------------------------------------------- every view kind


@st.composite
def kind_chains(draw) -> tuple[tuple[int, ...], list[tuple], regions.Rect]:
    """(base, steps, rect): 1-5 steps of every kind the frontend emits — slices with steps 1-3,
    select (a length-1 slice then the squeezing reshape, as rules/views.py lowers it), expand,
    permute, split / merge reshapes — and a sub-rect of the result."""
    base = tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4)))
    shape, steps = base, []
    for _ in range(draw(st.integers(1, 5))):
        kinds = ["permute", "slice", "reshape"] + (["select"] if len(shape) > 1 else []) + (
            ["expand"] if 1 in shape else [])
        kind = draw(st.sampled_from(kinds))
        if kind == "permute":
            perm = tuple(draw(st.permutations(range(len(shape)))))
            new_steps, shape = [("permute", perm)], tuple(shape[p] for p in perm)
        elif kind in ("slice", "select"):
            dim = draw(st.integers(0, len(shape) - 1))
            if kind == "select":
                i = draw(st.integers(0, shape[dim] - 1))
                out = shape[:dim] + shape[dim + 1:]
                new_steps, shape = [("slice", dim, i, i + 1, 1), ("reshape", out)], out
            else:
                start = draw(st.integers(0, shape[dim] - 1))
                stop = draw(st.integers(start + 1, shape[dim]))
                st_ = draw(st.integers(1, 3))
                new_steps = [("slice", dim, start, stop, st_)]
                shape = shape[:dim] + (-(-(stop - start) // st_),) + shape[dim + 1:]
        elif kind == "expand":
            new = tuple(draw(st.integers(1, 3)) if n == 1 else n for n in shape)
            new_steps, shape = [("expand", new)], new
        else:
            new = draw(factorizations(prod(shape)))
            new_steps, shape = [("reshape", new)], new
        steps += new_steps
    return base, steps, draw(sub_rects(shape))


@SETTINGS
@given(kind_chains())
@example(((6,), [("slice", 0, 1, 6, 3)], ((0, 2),)))
@example(((2, 6), [("slice", 1, 0, 1, 1), ("reshape", (2,))], ((1, 2),)))  # x[:, 0]
@example(((4, 6), [("permute", (1, 0)), ("slice", 1, 1, 4, 2)], ((2, 5), (0, 2))))
def test_every_view_kind_maps_back_exactly(args):
    """``View.base_regions`` (what depend intersects) and the tables' strided form (what the
    happens-before check maps rects through) against brute-force enumeration of the buffer
    elements a rect of the view touches."""
    from mpk.compiler.verify import strided_intervals

    base, steps, rect = args
    views = build_views(base, steps)
    view = views[-1]
    note(f"base={base} steps={steps} rect={rect}")
    want_ids = torch_chain(base, steps)[_slices(rect)]
    want = _mask_of(base, want_ids)
    with spy_fallbacks() as fallbacks:
        pieces = view.base_regions(rect)
    got = _covered(base, pieces)
    assert not (want & ~got).any(), f"ids read but not covered: {(want & ~got).nonzero().flatten().tolist()}"
    if _exactness_expected(views, pieces) and not fallbacks:
        assert torch.equal(got, want), f"pieces {pieces} over-cover"
    res = view.strided()
    if res is not None:
        lo, hi = strided_intervals(res[0], res[1], rect)
        flat = torch.zeros(prod(base), dtype=torch.bool)
        for a, b in zip(lo.tolist(), hi.tolist()):
            flat[a:b] = True
        assert torch.equal(flat, want), f"strided intervals {list(zip(lo.tolist(), hi.tolist()))}"
