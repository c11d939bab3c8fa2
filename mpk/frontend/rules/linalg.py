"""Rules for matmuls (mm / bmm / addmm / baddbmm / addbmm / linear) and their fused forms,
embedding, cat and roll, tril / triu, gather and indexing by tensors, and padding."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.frontend.rules.pointwise import emit_pointwise, is_integral
from mpk.frontend.rules.registry import handles, node_shape, norm_dim, slice_view
from mpk.frontend.rules.views import fresh
from mpk.frontend.values import Unsupported
from mpk.ir.views import View

if TYPE_CHECKING:
    pass

aten, prims, mpk_ops = torch.ops.aten, torch.ops.prims, torch.ops.mpk


@handles(aten.mm.default, aten.bmm.default)
def _mm(L, node, a: View, b: View):
    return L.emit("matmul", [a, b])


# The fused forms: one kind, its prologue and epilogue in the attrs (mpk.ops.linalg).

@handles(mpk_ops.matmul_silu_mul.default)
def _matmul_silu_mul(L, node, x: View, b: View):
    return L.emit("matmul", [x, b], {"epilogue": "silu_mul"})


def _silu_epilogue(silu_mul) -> dict:
    return {"epilogue": "silu_mul"} if silu_mul else {}


@handles(mpk_ops.rms_norm_matmul.default)
def _rms_norm_matmul(L, node, x: View, weight: View, eps, compute_dtype, norm_dtype, b: View, silu_mul=False):
    return L.emit("matmul", [x, b, weight], {"prologue": "rms_norm", "eps": float(eps),
                                             "compute_dtype": str(compute_dtype)[6:],
                                             "norm_dtype": str(norm_dtype)[6:], **_silu_epilogue(silu_mul)})


@handles(mpk_ops.matmul_norm_stats.default)
def _matmul_norm_stats(L, node, a: View, b: View, r: View, g: View, group=16):
    return L.emit("matmul", [a, b, r, g], {"epilogue": "norm_stats"})  # the group size is the output's last dim


@handles(mpk_ops.norm_stats_matmul.default)
def _norm_stats_matmul(L, node, packed: View, b: View, eps, silu_mul=False):
    _, M, groups, width = packed.shape
    hg, sums = (packed.then(("slice", 0, i, i + 1, 1)).then(("reshape", (M, groups * width))) for i in (1, 2))
    return L.emit("matmul", [hg, b, sums], {"prologue": "norm_stats", "eps": float(eps), "group": width,
                                            **_silu_epilogue(silu_mul)})


@handles(aten.addmm.default)
def _addmm(L, node, bias: View, a: View, b: View, *, beta=1, alpha=1):
    # beta = 0 ignores the bias, inf and NaN included (as torch.addmm does): not 0 · bias
    return L.emit("matmul", [a, b] + ([bias] if beta != 0 else []), {"alpha": alpha, "beta": beta})



@handles(aten.baddbmm.default)
def _baddbmm(L, node, bias: View, a: View, b: View, *, beta=1, alpha=1):
    # the matmul kind's own form (alpha·a @ b + beta·bias over batch dims): one op, nothing extra
    return L.emit("matmul", [a, b] + ([bias] if beta != 0 else []), {"alpha": alpha, "beta": beta})


@handles(aten.addbmm.default)
def _addbmm(L, node, bias: View, a: View, b: View, *, beta=1, alpha=1):
    # Σ_i a[i] @ b[i] is one product over the joined batch and contraction dims:
    # [M, B·K] @ [B·K, N] (a's permuted reshape is a copy op where it has no strided form)
    batch, m, k = a.shape
    n = b.shape[2]
    a2 = a.then(("permute", (1, 0, 2))).then(("reshape", (m, batch * k)))
    b2 = b.then(("reshape", (batch * k, n)))
    return L.emit("matmul", [a2, b2] + ([bias] if beta != 0 else []), {"alpha": alpha, "beta": beta})

@handles(aten.embedding.default)
def _embedding(L, node, weight: View, ids: View, *args):
    return L.emit("embedding", [weight, ids])


@handles(aten.cat.default)
def _cat(L, node, tensors, dim=0):
    # empty 1-d pieces join anything (torch.cat's legacy rule); all of them empty: an empty result
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or tensors[:1]
    d = norm_dim(dim, tensors[0].ndim)
    return L.emit("cat", tensors, {"dim": d}) if len(tensors) <= MAX_INPUTS else _cat_all(L, tensors, d, L.meta().dtype)


MAX_INPUTS = 8  # codegen.MAX_INPUTS: the most inputs a CUDA task takes (in most graphs)


def _cat_all(L, pieces: list[View], d: int, dtype: torch.dtype) -> View:
    """The pieces joined along dim d, by cats of at most ``MAX_INPUTS`` pieces (a tree of them)."""
    while len(pieces) > 1:
        groups = [pieces[i:i + MAX_INPUTS] for i in range(0, len(pieces), MAX_INPUTS)]
        pieces = [g[0] if len(g) == 1 else
                  L.emit("cat", g, {"dim": d}, shape=g[0].shape[:d] + (sum(p.shape[d] for p in g),) + g[0].shape[d + 1:],
                         dtype=dtype) for g in groups]
    return pieces[0]


@handles(aten.reflection_pad1d.default, aten.reflection_pad2d.default, aten.reflection_pad3d.default,
         aten.replication_pad1d.default, aten.replication_pad2d.default, aten.replication_pad3d.default)
def _mirror_pad(L, node, x: View, pad):
    """Reflect padding (position −i reads i, n − 1 + i reads n − 1 − i) or replicate padding
    (the edge entry repeated), one dim at a time from the last (pad holds (left, right) pairs
    from the last dim backwards; the dims are independent, so the corners come out as eager's):
    a cat of x with its mirrored entries (slices of one entry each) or its edge entries
    (a slice of one entry, expanded)."""
    reflect = "reflection" in node.target.overloadpacket.__name__
    for i in range(len(pad) // 2):
        d = x.ndim - 1 - i
        lo, hi, n = pad[2 * i], pad[2 * i + 1], x.shape[d]
        if lo < 0 or hi < 0 or (reflect and max(lo, hi) >= n) or (not reflect and n == 0 and lo + hi):
            raise Unsupported(f"{'reflect' if reflect else 'replicate'} pad {list(pad)} of dim {d}'s {n} entries "
                              f"(expected pads >= 0{', each below the dim' if reflect else ''})")
        if not lo and not hi:
            continue

        def entry(at: int, width: int = 1) -> View:
            one = slice_view(x, d, at, at + 1, 1)
            return one if width == 1 else one.then(("expand", one.shape[:d] + (width,) + one.shape[d + 1:]))

        if reflect:
            pieces = [entry(j) for j in range(lo, 0, -1)] + [x] + [entry(n - 2 - j) for j in range(hi)]
        else:
            pieces = ([entry(0, lo)] if lo else []) + [x] + ([entry(n - 1, hi)] if hi else [])
        x = _cat_all(L, pieces, d, L.meta().dtype)
    return fresh(L, node, x) if not any(pad) else x


@handles(aten.roll.default)
def _roll(L, node, x: View, shifts, dims=()):
    """``x.roll(shifts, dims)`` (a sliding-window cache's shift): along each dim the last
    ``shift`` entries move to the front, a cat of two slices of x; without dims the flattened
    tensor rolls and takes x's shape back."""
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims:
        flat = x.then(("reshape", (math.prod(x.shape),)))
        return _roll_dims(L, flat, shifts, [0]).then(("reshape", x.shape))
    return _roll_dims(L, x, shifts, [norm_dim(d, x.ndim) for d in dims])


def _roll_dims(L, x: View, shifts: list[int], dims: list[int]) -> View:
    """x rolled by ``shifts[i]`` along ``dims[i]``: one cat per dim whose shift is not a whole
    turn (such a dim, or an empty one, keeps x's view)."""
    for shift, d in zip(shifts, dims, strict=True):
        n = x.shape[d]
        s = shift % n if n else 0
        if s:
            x = L.emit("cat", [slice_view(x, d, n - s, n, 1), slice_view(x, d, 0, n - s, 1)], {"dim": d},
                       shape=x.shape)
    return x



@handles(aten.tril.default, aten.triu.default)
def _triangle(L, node, x: View, diagonal: int = 0):
    if x.ndim < 2:
        raise Unsupported(f"{node.target.overloadpacket.__name__} of a {x.ndim}-d tensor (it needs at least 2 dims)")
    return L.emit("triangle", [x], {"diagonal": int(diagonal), "upper": node.target is aten.triu.default})

MAX_INDEX_TENSORS = MAX_INPUTS - 1  # less x


@handles(aten.gather.default)
def _gather(L, node, x: View, dim, index: View, sparse_grad=False):
    if x.ndim == 0:  # a scalar's dim 0: one entry
        return L.emit("gather", [x.then(("reshape", (1,))), index.then(("reshape", (1,)))], {"dim": 0, "wrap": False},
                      shape=(1,)).then(("reshape", ()))
    return L.emit("gather", [x, index], {"dim": norm_dim(dim, x.ndim), "wrap": False})


def _pick(L, x: View, d0: int, indices: list[View], wrap: bool, dtype: torch.dtype) -> View:
    """x with its dims d0 … d0+k-1 picked by the k integer ``indices``, which broadcast
    together: the result's dims are x's before d0, the indices' common shape, x's after."""
    common = tuple(torch.broadcast_shapes(*(i.shape for i in indices)))
    trail = x.shape[d0 + len(indices):]
    shape = x.shape[:d0] + common + trail
    if math.prod(shape) == 0:  # nothing picked: an empty result
        return emit_pointwise(L, "cast", [0], shape=shape, dtype=dtype)
    spread = [i.then(("reshape", (1,) * (d0 + len(common) - i.ndim) + i.shape + (1,) * len(trail)))
              .then(("expand", shape)) for i in indices]
    return L.emit("gather", [x, *spread], {"dim": d0, "wrap": wrap}, shape=shape, dtype=dtype)


@handles(aten.index_select.default)
def _index_select(L, node, x: View, dim, index: View):
    if x.ndim == 0:
        x, index = x.then(("reshape", (1,))), index.then(("reshape", (1,)))
        return _pick(L, x, 0, [index], False, L.meta().dtype).then(("reshape", ()))
    return _pick(L, x, norm_dim(dim, x.ndim), [index.then(("reshape", (math.prod(index.shape),)))], False, L.meta().dtype)


@handles(aten.index.Tensor)
def _index(L, node, x: View, indices):
    """x[..., i, j, ...] with integer index tensors, which broadcast together; negative entries
    count from the end. Adjacent indexed dims keep their place in the result; indexed dims apart
    put the indices' shape first (torch's rule), here by moving those dims to the front."""
    given = [d for d, t in enumerate(indices) if t is not None]
    if not given:
        return fresh(L, node, x)
    for d in given:
        dt = L.graph.buffers[indices[d].buffer].dtype
        if not is_integral(dt) or dt == torch.bool:
            raise Unsupported("indexing by a bool mask (its result's size depends on the data)")
    if len(given) > MAX_INDEX_TENSORS:
        raise Unsupported(f"advanced indexing with {len(given)} index tensors; at most {MAX_INDEX_TENSORS}")
    d0 = given[0]
    if given != list(range(d0, d0 + len(given))):  # apart: the indexed dims to the front
        x = x.then(("permute", tuple(given) + tuple(d for d in range(x.ndim) if d not in given)))
        d0 = 0
    out = _pick(L, x, d0, [indices[d] for d in given], True, L.meta().dtype)
    if out.shape != node_shape(L):
        raise Unsupported(f"advanced indexing gave {out.shape}, expected {node_shape(L)}")
    return out


@handles(aten.constant_pad_nd.default)
def _constant_pad(L, node, x: View, pad, value=0):
    """Negative pads slice; positive ones cat blocks of the value, one dim at a time from the
    last (pad holds (left, right) pairs from the last dim backwards)."""
    padded = False
    for i in range(len(pad) // 2):
        d = x.ndim - 1 - i
        lo, hi = pad[2 * i], pad[2 * i + 1]
        if max(0, -lo) + max(0, -hi) > x.shape[d]:
            raise Unsupported(f"pad {list(pad)} cuts {max(0, -lo) + max(0, -hi)} of dim {d}'s {x.shape[d]} entries")
        x = slice_view(x, d, max(0, -lo), x.shape[d] - max(0, -hi), 1)
        pieces = []
        for width in (max(0, lo), None, max(0, hi)):
            if width is None:
                pieces.append(x)
            elif width:
                fill_shape = x.shape[:d] + (width,) + x.shape[d + 1:]
                pieces.append(emit_pointwise(L, "cast", [value], shape=fill_shape))
        if len(pieces) > 1:
            shape = x.shape[:d] + (sum(p.shape[d] for p in pieces),) + x.shape[d + 1:]
            x, padded = L.emit("cat", pieces, {"dim": d}, shape=shape, dtype=L.meta().dtype), True
    return x if padded else fresh(L, node, x)  # nothing padded: a view, copied where the caller receives it
