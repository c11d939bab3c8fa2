"""Rules for convolutional networks: convolution (the ``conv`` op), inference batch norm (a
per-channel scale and shift, as pointwise ops), max / average / adaptive pooling (the ``pool``
op) and ``_unsafe_index``, the gather torch's upsampling decompositions (nearest, bilinear)
index with."""

from __future__ import annotations

import torch

from mpk.frontend.rules.linalg import _index
from mpk.frontend.rules.pointwise import emit_pointwise
from mpk.frontend.rules.registry import handles
from mpk.frontend.values import Unavailable, Unsupported
from mpk.ir.views import View

aten = torch.ops.aten

handles(aten._unsafe_index.Tensor)(_index)  # x[..., i, j]: the indices are in range by construction


def _per_dim(value, n: int, what: str) -> tuple[int, ...]:
    """An int or a list of 1 or ``n`` ints, as ``n`` ints (torch's shorthand for every dim)."""
    values = [value] if isinstance(value, int) else list(value)
    if len(values) == 1:
        values *= n
    if len(values) != n or not all(isinstance(v, int) for v in values):
        raise Unsupported(f"{what} {value!r}: expected an int or {n} ints")
    return tuple(values)


def _dtype(L, v: View) -> torch.dtype:
    return L.graph.buffers[v.buffer].dtype


@handles(aten.convolution.default)
def _convolution(L, node, x: View, w: View, bias: View | None, stride, padding, dilation, transposed,
                 output_padding, groups):
    nsp = w.ndim - 2
    if nsp not in (1, 2, 3):
        raise Unsupported(f"convolution with {nsp} spatial dims (weight of shape {w.shape}); 1, 2 or 3 lower")
    if not _dtype(L, x).is_floating_point:
        raise Unsupported(f"convolution of dtype {_dtype(L, x)} (floating-point dtypes lower)")
    attrs = {"stride": _per_dim(stride, nsp, "stride"), "padding": _per_dim(padding, nsp, "padding"),
             "dilation": _per_dim(dilation, nsp, "dilation"), "groups": int(groups), "transposed": bool(transposed)}
    if any(s < 1 for s in attrs["stride"]) or any(d < 1 for d in attrs["dilation"]) or min(attrs["padding"]) < 0:
        raise Unsupported(f"convolution with stride {attrs['stride']}, padding {attrs['padding']}, dilation "
                          f"{attrs['dilation']} (strides and dilations ≥ 1, paddings ≥ 0 lower)")
    shape = tuple(L.meta().shape)
    inputs = [x, w] + ([bias] if bias is not None else [])
    if x.ndim == nsp + 1:  # unbatched: a batch of one
        inputs[0] = x.then(("reshape", (1,) + x.shape))
        return L.emit("conv", inputs, attrs, shape=(1,) + shape).then(("reshape", shape))
    return L.emit("conv", inputs, attrs)


# --- inference batch norm -------------------------------------------------------------------------

def _batch_norm(L, x: View, weight, bias, mean, var, eps: float) -> View:
    """(x − mean)·weight/√(var + eps) + bias per channel (dim 1), as eager's inference kernel
    computes it: scale = weight/√(var + eps), shift = bias − mean·scale, out = x·scale + shift."""
    if not isinstance(mean, View) or not isinstance(var, View):
        raise Unsupported("batch norm without running statistics (inference batch norm needs running_mean and "
                          "running_var)")
    if x.ndim < 2:
        raise Unsupported(f"batch norm of a {x.ndim}-d input (it needs (N, C, …))")
    c = x.shape[1]
    pdt = _dtype(L, var)
    scale = emit_pointwise(L, "rsqrt", [emit_pointwise(L, "add", [var, float(eps)], shape=(c,), dtype=pdt)],
                           shape=(c,), dtype=pdt)
    if weight is not None:
        scale = emit_pointwise(L, "mul", [weight, scale], shape=(c,), dtype=pdt)
    shift = emit_pointwise(L, "mul", [mean, scale], shape=(c,), dtype=pdt)
    shift = emit_pointwise(L, "sub", [bias, shift] if bias is not None else [0.0, shift], shape=(c,), dtype=pdt)
    per_channel = (c,) + (1,) * (x.ndim - 2)
    out_dtype = L.meta().dtype
    # a 16-bit input meets float32 statistics in float32: one rounding, at the end
    mid = torch.promote_types(out_dtype, pdt)
    y = emit_pointwise(L, "mul", [x, scale.then(("reshape", per_channel))], shape=x.shape, dtype=mid)
    return emit_pointwise(L, "add", [y, shift.then(("reshape", per_channel))], shape=x.shape, dtype=out_dtype)


_BN_STATS = Unavailable("the saved mean / inverse std of batch norm (training outputs)")


@handles(aten._native_batch_norm_legit_no_training.default)
def _bn_no_training(L, node, x: View, weight, bias, running_mean, running_var, momentum, eps):
    return _batch_norm(L, x, weight, bias, running_mean, running_var, eps), _BN_STATS, _BN_STATS


@handles(aten._native_batch_norm_legit.default, aten.native_batch_norm.default)
def _bn_native(L, node, x: View, weight, bias, running_mean, running_var, training, momentum, eps):
    if training:
        raise Unsupported("batch norm with training=True (batch statistics); mpk compiles inference: call "
                          "model.eval()")
    return _batch_norm(L, x, weight, bias, running_mean, running_var, eps), _BN_STATS, _BN_STATS


@handles(aten._native_batch_norm_legit_functional.default)
def _bn_functional(L, node, x: View, weight, bias, running_mean, running_var, training, momentum, eps):
    """What functionalization makes of batch norm that updates its running statistics: those
    come back unchanged in inference."""
    out, *_ = _bn_native(L, node, x, weight, bias, running_mean, running_var, training, momentum, eps)
    return out, _BN_STATS, _BN_STATS, running_mean, running_var


# --- pooling --------------------------------------------------------------------------------------

def _pool(L, x: View, nsp: int, mode: str, kernel=(), stride=(), padding=0, dilation=1,
          count_include_pad: bool = True, divisor=None, adaptive: bool = False) -> View:
    if x.ndim < nsp + 1:
        raise Unsupported(f"{nsp}-d pooling of a {x.ndim}-d input (it needs (C, spatial…) or (N, C, spatial…))")
    if not _dtype(L, x).is_floating_point:
        raise Unsupported(f"pooling of dtype {_dtype(L, x)} (floating-point dtypes lower)")
    if adaptive:
        zero = (0,) * nsp
        attrs = {"kernel": zero, "stride": zero, "padding": zero, "dilation": zero}
    else:
        k = _per_dim(kernel, nsp, "kernel_size")
        attrs = {"kernel": k, "stride": _per_dim(stride, nsp, "stride") if stride else k,
                 "padding": _per_dim(padding, nsp, "padding"), "dilation": _per_dim(dilation, nsp, "dilation")}
        if min(k) < 1 or min(attrs["stride"]) < 1 or min(attrs["dilation"]) < 1 or min(attrs["padding"]) < 0:
            raise Unsupported(f"pooling with kernel {k}, stride {attrs['stride']}, padding {attrs['padding']}, "
                              f"dilation {attrs['dilation']} (kernels, strides, dilations ≥ 1, paddings ≥ 0 lower)")
    if divisor is not None and divisor <= 0:
        raise Unsupported(f"divisor_override={divisor} (a positive divisor or None lowers)")
    attrs |= {"mode": mode, "adaptive": adaptive, "count_include_pad": bool(count_include_pad),
              "divisor": int(divisor or 0)}
    return L.emit("pool", [x], attrs, shape=tuple(L.meta().shape), dtype=L.meta().dtype)


_INDICES = Unavailable("the indices output of max pooling")


@handles(aten.max_pool1d_with_indices.default, aten.max_pool2d_with_indices.default,
         aten.max_pool3d_with_indices.default)
def _max_pool_with_indices(L, node, x: View, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _pool(L, x, _name_dims(node), "max", kernel_size, stride, padding, dilation), _INDICES


@handles(aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default)
def _max_pool(L, node, x: View, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _pool(L, x, _name_dims(node), "max", kernel_size, stride, padding, dilation)


@handles(aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default)
def _avg_pool(L, node, x: View, kernel_size, stride=(), padding=0, ceil_mode=False, count_include_pad=True,
              divisor_override=None):
    return _pool(L, x, _name_dims(node), "avg", kernel_size, stride, padding, 1, count_include_pad, divisor_override)


@handles(aten.adaptive_avg_pool1d.default, aten._adaptive_avg_pool2d.default, aten._adaptive_avg_pool3d.default,
         aten.adaptive_avg_pool2d.default, aten.adaptive_avg_pool3d.default)
def _adaptive_avg_pool(L, node, x: View, output_size):
    return _pool(L, x, _name_dims(node), "avg", adaptive=True)


@handles(aten.adaptive_max_pool1d.default, aten.adaptive_max_pool2d.default, aten.adaptive_max_pool3d.default)
def _adaptive_max_pool(L, node, x: View, output_size):
    return _pool(L, x, _name_dims(node), "max", adaptive=True), _INDICES


def _name_dims(node) -> int:
    """The spatial dims of a pooling op, from its name (…pool1d / 2d / 3d…)."""
    name = node.target.overloadpacket.__name__
    return next(int(ch) for ch in ("1", "2", "3") if f"pool{ch}d" in name)
