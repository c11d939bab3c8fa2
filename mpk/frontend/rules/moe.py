"""Rules for mixture-of-experts routing: floor / trunc division (expert and slot arithmetic on
flat indices), one_hot, histc, bincount and the grouped expert GEMM (``mpk.expert_bmm``, made by
pattern fusion: mpk.frontend.moe)."""

from __future__ import annotations

import torch

from mpk.frontend.moe import bincount_dtype
from mpk.frontend.rules.pointwise import emit_pointwise
from mpk.frontend.rules.registry import handles, mpk_ops
from mpk.frontend.values import Unsupported
from mpk.ir.views import View
from mpk.ops.moe import ROUNDING_MODES

aten = torch.ops.aten


def _dtype(L, v) -> torch.dtype | None:
    return L.graph.buffers[v.buffer].dtype if isinstance(v, View) else None


def _rounded_div(L, a, b, mode: str) -> View:
    """a / b rounded toward -inf (floor) or 0 (trunc), as eager rounds it (mpk.ops.moe)."""
    if mode not in ROUNDING_MODES:
        raise Unsupported(f"division with rounding_mode={mode!r} (expected one of {ROUNDING_MODES} or None)")
    if not any(isinstance(v, View) for v in (a, b)):
        raise Unsupported("no tensor operand")
    out = L.meta()
    # a number becomes a 0-d tensor of the result's dtype, where eager computes with it
    a, b = (v if isinstance(v, View) else emit_pointwise(L, "cast", [v], shape=(), dtype=out.dtype) for v in (a, b))
    return L.emit("rounded_div", [a, b], {"mode": mode})


@handles(aten.floor_divide.default, aten.floor_divide.Scalar)
def _floor_divide(L, node, a, b):
    return _rounded_div(L, a, b, "floor")


@handles(aten.div.Tensor_mode, aten.div.Scalar_mode)
def _div_mode(L, node, a, b, rounding_mode=None):
    if rounding_mode is None:
        return emit_pointwise(L, "div", [a, b])
    return _rounded_div(L, a, b, rounding_mode)


def _index_dtype(L, v: View, what: str) -> None:
    if _dtype(L, v) not in (torch.int64, torch.int32):
        raise Unsupported(f"{what} of dtype {_dtype(L, v)} (int64 or int32 lowers)")


@handles(mpk_ops.one_hot.default)
def _one_hot(L, node, x: View, num_classes: int):
    _index_dtype(L, x, "one_hot of a tensor")
    return L.emit("one_hot", [x])


@handles(mpk_ops.bincount.default)
def _bincount(L, node, x: View, weights, minlength: int):
    if x.ndim != 1:
        raise Unsupported(f"bincount of a {x.ndim}-d tensor (a 1-d one lowers)")
    _index_dtype(L, x, "bincount of a tensor")
    inputs = [x] if weights is None else [x, weights]
    dtype = bincount_dtype(_dtype(L, weights))
    return L.emit("histogram", inputs, {"mode": "bincount"}, shape=(minlength,), dtype=dtype)


@handles(aten.histc.default)
def _histc(L, node, x: View, bins=100, min=0, max=0):
    if not _dtype(L, x).is_floating_point:
        raise Unsupported(f"histc of dtype {_dtype(L, x)} (a floating-point tensor lowers, as in eager)")
    if min > max:
        raise Unsupported(f"histc with min={min} > max={max} (expected min <= max)")
    return L.emit("histogram", [x], {"mode": "histc", "min": float(min), "max": float(max)})


@handles(mpk_ops.expert_bmm.default)
def _expert_bmm(L, node, a: View, b: View, index: View, gathered: int):
    _index_dtype(L, index, "an expert index")
    return L.emit("expert_matmul", [a, b, index], {"gathered": gathered})
