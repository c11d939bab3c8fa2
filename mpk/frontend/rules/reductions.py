"""Rules for reductions over any dims, (log-)softmax, cumsum/cumprod, sort/topk and the row ops:
norms, RoPE and SiLU·mul."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.frontend.rules.pointwise import emit_pointwise
from mpk.frontend.rules.registry import handles, node_shape, norm_dim
from mpk.frontend.values import Unavailable, Unsupported
from mpk.ir.views import View
from mpk.ops.rows import SORT_MAX

if TYPE_CHECKING:
    pass

aten, prims, mpk_ops = torch.ops.aten, torch.ops.prims, torch.ops.mpk


def _reduced_last(x: View, dims) -> tuple[View, tuple[int, ...]]:
    """``x`` with the dims ``dims`` (None or empty: all of them) moved to the end and merged into
    one last dim, and the shape of the dims kept (at least one: a full reduction keeps a dim
    of 1, which the caller's final reshape removes)."""
    if x.ndim == 0:  # a scalar's dim 0 / -1 (or all of its none): one row of one
        return x.then(("reshape", (1, 1))), (1,)
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    red = sorted({norm_dim(d, x.ndim) for d in dims}) if dims else list(range(x.ndim))
    keep = [d for d in range(x.ndim) if d not in red]
    if red != list(range(x.ndim - len(red), x.ndim)):
        x = x.then(("permute", tuple(keep + red)))
    kept = tuple(x.shape[:len(keep)]) or (1,)
    if len(red) != 1 or not keep:
        x = x.then(("reshape", kept + (math.prod(x.shape[len(keep):]),)))
    return x, kept


def _reduce_to(L, fn: str, x: View, dims, dtype: torch.dtype | None = None) -> View:
    """``fn`` (mpk.ops.rows.REDUCE_FNS) of ``x`` over ``dims``, shaped as the node's result."""
    row, kept = _reduced_last(x, dims)
    out = L.emit("reduce", [row], {"fn": fn, "keepdim": False}, shape=kept,
                 dtype=L.meta().dtype if dtype is None else dtype)
    return out.then(("reshape", node_shape(L)))


def _cast_for(L, x: View, dtype) -> View:
    """sum(dtype=...) / mean(dtype=...) reduce the converted values, as eager PyTorch does."""
    if dtype is None or dtype == L.graph.buffers[x.buffer].dtype:
        return x
    return emit_pointwise(L, "cast", [x], shape=x.shape, dtype=dtype)


def _reduce(fn: str):
    def handler(L, node, x: View, dims=None, keepdim=False, *, dtype=None):
        return _reduce_to(L, fn, _cast_for(L, x, dtype), dims)
    return handler


# (the .default forms take no dims: all of them)
handles(aten.sum.dim_IntList, aten.sum.default)(_reduce("sum"))
handles(aten.mean.dim, aten.mean.default)(_reduce("mean"))
handles(aten.amax.default, aten.max.default)(_reduce("amax"))
handles(aten.amin.default, aten.min.default)(_reduce("amin"))


@handles(aten.argmax.default, aten.argmin.default)
def _arg_extreme(L, node, x: View, dim=None, keepdim=False):
    # dim=None: the index into the flattened tensor, which the merged row's index is
    return _reduce_to(L, node.target.overloadpacket.__name__, x, dim)


@handles(aten.max.dim, aten.min.dim)
def _extreme_dim(L, node, x: View, dim, keepdim=False):
    name = node.target.overloadpacket.__name__
    values_dtype, index_dtype = (v.dtype for v in node.meta["val"])
    return (_reduce_to(L, "a" + name, x, dim, values_dtype), _reduce_to(L, "arg" + name, x, dim, index_dtype))


@handles(aten.var.correction, aten.std.correction)
def _var(L, node, x: View, dims=None, *, correction=None, keepdim=False):
    """Two passes in float32, as eager: the mean, then the sum of squared deviations."""
    if not L.graph.buffers[x.buffer].dtype.is_floating_point:
        raise Unsupported("variance of an integer tensor")
    correction = 1 if correction is None else correction
    row, kept = _reduced_last(x, dims)
    f32 = torch.float32
    mean = L.emit("reduce", [row], {"fn": "mean", "keepdim": True}, shape=kept + (1,), dtype=f32)
    dev = emit_pointwise(L, "sub", [row, mean], shape=row.shape, dtype=f32)
    sq = emit_pointwise(L, "mul", [dev, dev], shape=row.shape, dtype=f32)
    total = L.emit("reduce", [sq], {"fn": "sum", "keepdim": False}, shape=kept, dtype=f32)
    std = node.target is aten.std.correction
    var = emit_pointwise(L, "div", [total, max(0, row.shape[-1] - correction)], shape=kept,
                          dtype=f32 if std else None)
    return (emit_pointwise(L, "sqrt", [var], shape=kept) if std else var).then(("reshape", node_shape(L)))


@handles(aten.linalg_vector_norm.default)
def _vector_norm(L, node, x: View, ord=2, dim=None, keepdim=False, *, dtype=None):
    x = _cast_for(L, x, dtype)
    f32 = torch.float32
    if ord == 2:
        sq = emit_pointwise(L, "mul", [x, x], shape=x.shape, dtype=f32)
        return emit_pointwise(L, "sqrt", [_reduce_to(L, "sum", sq, dim, f32)], shape=node_shape(L))
    if ord in (1, math.inf, -math.inf):
        a = emit_pointwise(L, "abs", [x], shape=x.shape)
        return _reduce_to(L, {1: "sum", math.inf: "amax", -math.inf: "amin"}[ord], a, dim)
    raise Unsupported(f"vector norm of order {ord}; 1, 2, inf and -inf are lowered")


def _row_op(L, kind: str, x: View, dim, attrs: dict | None = None) -> View:
    """A row op (over the last dim) over dim ``dim``: moved last and back (views, no copies)."""
    if x.ndim == 0:  # a scalar's dim 0 / -1: a row of one
        return L.emit(kind, [x.then(("reshape", (1,)))], attrs, shape=(1,)).then(("reshape", ()))
    d = norm_dim(dim, x.ndim)
    if d == x.ndim - 1:
        return L.emit(kind, [x], attrs)
    moved, inverse = _moved_last(x, d)
    return L.emit(kind, [moved], attrs, shape=moved.shape).then(("permute", inverse))


def _moved_last(x: View, d: int) -> tuple[View, tuple[int, ...]]:
    """x with dim d moved last (a view), and the permutation that moves it back."""
    perm = tuple(i for i in range(x.ndim) if i != d) + (d,)
    return x.then(("permute", perm)), tuple(perm.index(i) for i in range(x.ndim))


@handles(aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int)
def _softmax(L, node, x: View, dim, half_to_float=False, **kwargs):
    return _row_op(L, "softmax", x, dim, {"log": "log" in node.target.overloadpacket.__name__})


@handles(aten.cumsum.default)
def _cumsum(L, node, x: View, dim, *, dtype=None):
    return _row_op(L, "cumsum", _cast_for(L, x, dtype), dim)


@handles(aten.cumprod.default)
def _cumprod(L, node, x: View, dim, *, dtype=None):
    return _row_op(L, "cumsum", _cast_for(L, x, dtype), dim, {"prod": True})


def _sorted(L, x: View, dim, k: int, descending: bool) -> tuple[View, View]:
    """x's first k entries along ``dim`` in sorted order and their indices along it: a stable
    sort (equal values keep their order), NaN the largest value, as torch sorts. The indices are
    a ``sort`` op over rows (dim moved last, a view), the values a gather of them."""
    if x.ndim == 0:  # a scalar sorts as a row of one, and gives itself (torch: for k = 0 too)
        values, indices = _sorted(L, x.then(("reshape", (1,))), 0, 1, descending)
        return values.then(("reshape", ())), indices.then(("reshape", ()))
    d = norm_dim(dim, x.ndim)
    n = x.shape[d]
    if not 0 <= k <= n:
        raise Unsupported(f"k={k} of a dim of {n} entries; expected 0 ≤ k ≤ {n}")
    if n > SORT_MAX and k > SORT_MAX:
        raise Unsupported(f"the first {k} of {n} entries in order: a row longer than {SORT_MAX} gives at most "
                          f"{SORT_MAX} (topk with k ≤ {SORT_MAX}; the GPU task keeps them in shared memory)")
    if n >= 2 ** 31:
        raise Unsupported(f"a sort over {n} entries; the GPU task counts positions in 32 bits")
    dtype = L.graph.buffers[x.buffer].dtype
    moved, inverse = _moved_last(x, d)
    shape = moved.shape[:-1] + (k,)
    if math.prod(shape) == 0:  # nothing to sort: empty results
        empty = [emit_pointwise(L, "cast", [0], shape=shape, dtype=t) for t in (dtype, torch.int64)]
        return empty[0].then(("permute", inverse)), empty[1].then(("permute", inverse))
    indices = L.emit("sort", [moved], {"descending": bool(descending)}, shape=shape, dtype=torch.int64)
    values = L.emit("gather", [moved, indices], {"dim": x.ndim - 1, "wrap": False}, shape=shape, dtype=dtype)
    return values.then(("permute", inverse)), indices.then(("permute", inverse))


@handles(aten.sort.default, aten.sort.stable)
def _sort(L, node, x: View, dim=-1, descending=False, *, stable=None):
    return _sorted(L, x, dim, x.shape[norm_dim(dim, x.ndim)] if x.ndim else 1, descending)


@handles(aten.topk.default)
def _topk(L, node, x: View, k, dim=-1, largest=True, sorted=True):  # noqa: A002 (aten's name)
    return _sorted(L, x, dim, int(k), largest)  # in order whether or not asked: torch allows it


@handles(aten.stack.default)
def _stack(L, node, tensors, dim=0):
    d = norm_dim(dim, tensors[0].ndim + 1)
    return L.emit("cat", [t.then(("reshape", t.shape[:d] + (1,) + t.shape[d:])) for t in tensors], {"dim": d})


@handles(aten.native_layer_norm.default, aten.layer_norm.default)
def _layer_norm(L, node, x: View, normalized_shape, weight=None, bias=None, eps=1e-5, *args):
    if len(normalized_shape) != 1:
        raise Unsupported(f"normalized_shape={list(normalized_shape)}; only the last dim is lowered")
    ins = [x] + [t for t in (weight, bias) if t is not None]
    out = L.emit("layer_norm", ins, {"eps": float(eps), "has_weight": weight is not None,
                                     "has_bias": bias is not None})
    if node.target is aten.native_layer_norm.default:
        return out, Unavailable("the mean output of layer_norm"), Unavailable("the rstd output of layer_norm")
    return out


@handles(aten.native_group_norm.default)
def _group_norm(L, node, x: View, weight, bias, N, C, HxW, group, eps):
    """A layer norm over each group's channels and positions, then the per-channel affine; the
    steps between stay in float32 and the last one rounds, as eager's one kernel does."""
    f32, out_dtype = torch.float32, L.meta().dtype
    rows = x.then(("reshape", (N, group, (C // group) * HxW)))
    y = L.emit("layer_norm", [rows], {"eps": float(eps), "has_weight": False, "has_bias": False},
               shape=rows.shape, dtype=f32 if weight is not None or bias is not None else out_dtype)
    y = y.then(("reshape", (N, C, HxW)))
    if weight is not None:
        y = emit_pointwise(L, "mul", [y, weight.then(("reshape", (C, 1)))], shape=y.shape,
                            dtype=f32 if bias is not None else out_dtype)
    if bias is not None:
        y = emit_pointwise(L, "add", [y, bias.then(("reshape", (C, 1)))], shape=y.shape, dtype=out_dtype)
    return (y.then(("reshape", x.shape)), Unavailable("the mean output of group_norm"),
            Unavailable("the rstd output of group_norm"))


@handles(mpk_ops.rms_norm.default)
def _rms_norm(L, node, x: View, weight, eps, compute_dtype, norm_dtype):
    ins = [x] + ([weight] if weight is not None else [])
    return L.emit("rms_norm", ins, {"eps": float(eps), "has_weight": weight is not None,
                                    "compute_dtype": str(compute_dtype)[6:],
                                    "norm_dtype": str(norm_dtype)[6:]})


@handles(mpk_ops.rope.default)
def _rope(L, node, x: View, cos: View, sin: View):
    if x.shape[-1] % 2:
        raise Unsupported(f"rotary embedding over an odd last dim ({x.shape[-1]})")
    return L.emit("rope", [x, cos, sin])


@handles(mpk_ops.silu_mul.default)
def _silu_mul(L, node, gate: View, up: View):
    return L.emit("silu_mul", [gate, up])
