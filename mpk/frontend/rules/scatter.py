"""Rules for scatter-style updates, what functionalization makes of in-place writes into a
tensor (``x[:, 2:5] = y``, ``x[i] = v``, ``x.index_add_(…)``, ``x.index_copy_(…)``): each
becomes an op whose output is the base with some elements replaced (the IR's ops write a fresh
buffer whole)."""

from __future__ import annotations

import math

import torch

from mpk.frontend.rules.pointwise import emit_pointwise
from mpk.frontend.rules.registry import handles, norm_dim
from mpk.frontend.rules.views import _reaches_output
from mpk.frontend.values import Unsupported
from mpk.ir.views import View

aten = torch.ops.aten


@handles(aten.copy.default)
def _copy(L, node, dst: View, src: View, non_blocking=False):
    """``dst.copy_(src)`` functionalized: src broadcast to dst's shape, in dst's dtype (the
    slice_scatter that follows puts it into the tensor dst views)."""
    if src.shape != dst.shape:
        src = src.then(("reshape", (1,) * (dst.ndim - src.ndim) + src.shape)).then(("expand", dst.shape))
    if L.graph.buffers[src.buffer].dtype != L.meta().dtype:
        return emit_pointwise(L, "cast", [src])
    return L.copy(src) if _reaches_output(node) else src


def _slice_scatter_op(L, base: View, src: View, dim: int, start: int, step: int) -> View:
    return L.emit("slice_scatter", [base, src], {"dim": dim, "start": start, "step": step})


@handles(aten.slice_scatter.default)
def _slice_scatter(L, node, base: View, src: View, dim=0, start=None, end=None, step=1):
    d = norm_dim(dim, base.ndim)
    n = base.shape[d]
    start = 0 if start is None else (start + n if start < 0 else start)
    start = max(0, min(start, n))
    if src.shape[d] == 0:  # nothing replaced: the base, as a buffer of its own
        return L.copy(base)
    return _slice_scatter_op(L, base, src, d, start, step)


@handles(aten.select_scatter.default)
def _select_scatter(L, node, base: View, src: View, dim, index):
    d = norm_dim(dim, base.ndim)
    index = index + base.shape[d] if index < 0 else index
    return _slice_scatter_op(L, base, src.then(("reshape", base.shape[:d] + (1,) + base.shape[d + 1:])), d, index, 1)


def _scatter_op(L, base: View, index: View, src: View, dim: int, reduce: str, include_self: bool = True,
                index_1d: bool = False, wrap: bool = False) -> View:
    if L.graph.buffers[index.buffer].dtype not in (torch.int64, torch.int32):
        raise Unsupported(f"an index of dtype {L.graph.buffers[index.buffer].dtype} (int64 or int32 lowers)")
    return L.emit("scatter", [base, index, src], {"dim": dim, "reduce": reduce, "include_self": include_self,
                                                  "index_1d": index_1d, "wrap": wrap})


def _line_src(src: View, base: View, dim: int, entries: int) -> View:
    """src broadcast to base's shape with ``entries`` positions along ``dim`` (index_put's values)."""
    shape = base.shape[:dim] + (entries,) + base.shape[dim + 1:]
    if src.shape != shape:
        src = src.then(("reshape", (1,) * (len(shape) - src.ndim) + src.shape)).then(("expand", shape))
    return src


def _masked_put(L, base: View, d: int, mask: View, values: View, accumulate: bool) -> View:
    """``x[..., mask] = v`` with one value for every masked position: where(mask, v, x) (with
    accumulate, x + where(mask, v, 0)), the mask broadcast over base's dims after it."""
    if mask.shape != base.shape[d:d + mask.ndim]:
        raise Unsupported(f"index_put with a boolean mask of shape {mask.shape} at dim {d} of {base.shape}")
    shape = (1,) * d + mask.shape + (1,) * (base.ndim - d - mask.ndim)
    cond = mask.then(("reshape", shape)).then(("expand", base.shape))
    value = values.then(("reshape", (1,) * base.ndim)).then(("expand", base.shape))
    dtype = L.graph.buffers[base.buffer].dtype
    if accumulate:
        return emit_pointwise(L, "add", [base, emit_pointwise(L, "where", [cond, value, 0], shape=base.shape,
                                                              dtype=dtype)], shape=base.shape, dtype=dtype)
    return emit_pointwise(L, "where", [cond, value, base], shape=base.shape, dtype=dtype)


@handles(aten.index_put.default)
def _index_put(L, node, base: View, indices, values: View, accumulate=False):
    picked = [(d, i) for d, i in enumerate(indices) if i is not None]
    masks = [(d, i) for d, i in picked if isinstance(i, View) and L.graph.buffers[i.buffer].dtype == torch.bool]
    if masks:
        if len(picked) == 1 and isinstance(values, View) and math.prod(values.shape) == 1:
            return _masked_put(L, base, masks[0][0], masks[0][1], values, bool(accumulate))
        raise Unsupported("index_put with a boolean mask (x[mask] = v) lowers for one mask and one value; "
                          "values for each masked position are data-dependent")
    if len(picked) != 1 or not isinstance(picked[0][1], View) or picked[0][1].ndim != 1:
        raise Unsupported("index_put lowers with one 1-D integer index tensor (x[..., idx] = v); got "
                          f"{len(picked)} index tensors of {[i.ndim for _, i in picked if isinstance(i, View)]} dims")
    d, index = picked[0]
    src = _line_src(values, base, d, index.shape[0])
    return _scatter_op(L, base, index, src, d, "sum" if accumulate else "none", index_1d=True, wrap=True)


@handles(aten.index_add.default)
def _index_add(L, node, base: View, dim, index: View, source: View, alpha=1):
    if alpha != 1:
        raise Unsupported(f"index_add with alpha={alpha} (alpha=1 lowers)")
    d = norm_dim(dim, base.ndim)
    if index.ndim == 0:
        index = index.then(("reshape", (1,)))
    return _scatter_op(L, base, index, _line_src(source, base, d, index.shape[0]), d, "sum", index_1d=True)


@handles(aten.index_copy.default)
def _index_copy(L, node, base: View, dim, index: View, source: View):
    """``x.index_copy_(dim, i, src)`` (a static KV cache's write at the cache positions): entries
    of src replace base's lines at i along dim, as index_add's scatter without the sum."""
    d = norm_dim(dim, base.ndim)
    if index.ndim == 0:
        index = index.then(("reshape", (1,)))
    return _scatter_op(L, base, index, _line_src(source, base, d, index.shape[0]), d, "none", index_1d=True)


@handles(aten.scatter.src, aten.scatter.value, aten.scatter.reduce, aten.scatter.value_reduce,
         aten.scatter_add.default, aten.scatter_reduce.two)
def _scatter(L, node, base: View, dim, index: View, src, reduce=None, include_self=True):
    d = norm_dim(dim, base.ndim)
    if not isinstance(src, View):  # scatter(…, value): a constant for every index entry
        src = emit_pointwise(L, "cast", [src], shape=index.shape, dtype=L.graph.buffers[base.buffer].dtype)
    if node.target is aten.scatter_add.default:
        reduce = "sum"
    elif node.target in (aten.scatter.reduce, aten.scatter.value_reduce):  # scatter(…, reduce="add")
        if reduce != "add":
            raise Unsupported(f"scatter with reduce={reduce!r} ('add' lowers)")
        reduce = "sum"
    elif node.target is aten.scatter_reduce.two:
        if reduce not in ("sum", "prod", "mean", "amax", "amin"):
            raise Unsupported(f"scatter_reduce with reduce={reduce!r} (sum, prod, mean, amax, amin lower)")
    else:
        reduce = "none"
    if base.ndim == 0:
        raise Unsupported("scatter into a 0-d tensor")
    return _scatter_op(L, base, index, src, d, reduce, include_self=bool(include_self))
