"""Convolutional networks' ops on the GPU (marker ``gpu``; skipped without CUDA): the ``conv``
and ``pool`` tasks, inference batch norm (pointwise tasks) and upsampling (gather and
pointwise tasks), in float32 and bfloat16, and small ResNet / UNet / ConvNeXt models, against
a float64 eager reference from the same inputs.

Max pooling and nearest upsampling move elements and are exact; a convolution is within
``rounding_bound`` of its output rounding and its fp32 sum of (C_in / groups)·∏k + 1 terms
(eager's own cuDNN float32 path may use TF32, so the reference is float64, not eager float32)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mpk.testing.conv_models import ConvNeXtBlock, TinyResNet, UNetBlock, randomize_batch_norms
from mpk.testing.graphs import relative_error
from mpk.testing.tolerance import rounding_bound

pytestmark = pytest.mark.gpu
DEV = "cuda"
OPTS = {"executor": "gpu", "fallback": "error"}


def _compiled(fn, *args):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(fn, backend="mpk", options=OPTS, fullgraph=True)(*args)


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# (x shape, w shape, bias, kwargs); transposed cases name w as (C_in, C_out / groups, k…)
CONVS = {
    "1d_stride_pad_dil_groups": ((2, 4, 19), (6, 2, 3), True, {"stride": 2, "padding": 2, "dilation": 2, "groups": 2}),
    "1d_transposed": ((2, 4, 7), (4, 3, 4), True, {"stride": 3, "padding": 1, "output_padding": 2, "transposed": True}),
    "2d_stride_pad_groups": ((2, 16, 33, 30), (32, 8, 3, 3), True, {"stride": 2, "padding": 1, "groups": 2}),
    "2d_dilation_asymmetric": ((1, 3, 12, 11), (5, 3, 3, 2), False,
                               {"stride": (1, 2), "padding": (3, 0), "dilation": 2}),
    "2d_depthwise_7x7": ((2, 32, 14, 14), (32, 1, 7, 7), True, {"padding": 3, "groups": 32}),
    "2d_padding_beyond_kernel": ((1, 2, 5, 5), (3, 2, 2, 2), True, {"padding": 3}),
    "2d_transposed_groups": ((2, 8, 9, 10), (8, 6, 3, 2), True,
                             {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2, "transposed": True}),
    "3d_stride_pad": ((1, 4, 8, 9, 7), (6, 4, 3, 3, 3), True, {"stride": (1, 2, 1), "padding": 1}),
    "3d_transposed": ((1, 2, 3, 4, 3), (2, 3, 2, 2, 2), True, {"stride": 2, "transposed": True}),
}


def _conv_fn(nsp: int, kw: dict):
    kw = dict(kw)
    if kw.pop("transposed", False):
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nsp - 1]
    else:
        fn = (F.conv1d, F.conv2d, F.conv3d)[nsp - 1]
    return lambda x, w, b=None: fn(x, w, b, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(CONVS))
def test_convolution_matches_eager(name, dtype):
    x_shape, w_shape, bias, kw = CONVS[name]
    out_ch = w_shape[1] * kw.get("groups", 1) if kw.get("transposed") else w_shape[0]
    args = [torch.randn(x_shape, device=DEV, dtype=dtype), torch.randn(w_shape, device=DEV, dtype=dtype)]
    if bias:
        args.append(torch.randn(out_ch, device=DEV, dtype=dtype))
    fn = _conv_fn(len(x_shape) - 2, kw)
    k = (w_shape[0] // kw.get("groups", 1) if kw.get("transposed") else w_shape[1]) * math.prod(w_shape[2:]) + 1
    got = _compiled(fn, *args)
    ref = fn(*(a.double() for a in args))
    assert got.dtype == dtype and got.shape == ref.shape
    assert relative_error(got, ref) <= rounding_bound(dtype, 1, k=k, acc=_acc(dtype))


POOLS = {
    "max1d_dilation_ceil": ((2, 3, 16), lambda x: F.max_pool1d(x, 3, 2, 1, dilation=2, ceil_mode=True)),
    "max2d_ceil": ((2, 8, 19, 20), lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True)),
    "max3d": ((1, 2, 6, 7, 5), lambda x: F.max_pool3d(x, 3, 2, 1)),
    "adaptive_max2d": ((2, 3, 9, 10), lambda x: F.adaptive_max_pool2d(x, (4, 3))),
    "avg1d": ((2, 3, 17), lambda x: F.avg_pool1d(x, 4, 3, 2, ceil_mode=True)),
    "avg2d_exclude_pad": ((2, 8, 19, 20), lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False)),
    "avg2d_divisor": ((1, 2, 8, 8), lambda x: F.avg_pool2d(x, 3, 2, 1, divisor_override=5)),
    "avg3d": ((1, 2, 6, 7, 5), lambda x: F.avg_pool3d(x, 2, (2, 1, 2), count_include_pad=False, padding=1)),
    "adaptive_avg2d": ((2, 3, 9, 10), lambda x: F.adaptive_avg_pool2d(x, (4, 3))),
    "adaptive_avg3d": ((1, 2, 6, 7, 5), lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4))),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(POOLS))
def test_pooling_matches_eager(name, dtype):
    shape, fn = POOLS[name]
    x = torch.randn(shape, device=DEV, dtype=dtype)
    x.view(-1)[::37] = float("nan") if "max" in name else 0.5  # NaN propagates through max pooling
    got = _compiled(fn, x)
    if "max" in name:  # a pick: exact
        torch.testing.assert_close(got, fn(x), rtol=0, atol=0, equal_nan=True)
    else:  # a sum of at most the window's elements, a division, the output's rounding
        assert relative_error(got, fn(x.double())) <= rounding_bound(dtype, 1, k=math.prod(shape[-3:]) + 1)


UPSAMPLES = {
    "nearest1d_scale": ((2, 3, 10), lambda x: F.interpolate(x, scale_factor=2.5, mode="nearest")),
    "nearest2d_scale": ((2, 3, 5, 6), lambda x: F.interpolate(x, scale_factor=2, mode="nearest")),
    "nearest3d_size": ((1, 2, 3, 4, 5), lambda x: F.interpolate(x, size=(5, 7, 6), mode="nearest")),
    "bilinear_scale": ((2, 3, 5, 6), lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")),
    "bilinear_size_align": ((2, 3, 5, 6), lambda x: F.interpolate(x, size=(11, 7), mode="bilinear",
                                                                align_corners=True)),
}


@pytest.mark.parametrize("name", list(UPSAMPLES))
def test_upsampling_matches_eager(name):
    shape, fn = UPSAMPLES[name]
    x = torch.randn(shape, device=DEV)
    got = _compiled(fn, x)
    if name.startswith("nearest"):
        assert torch.equal(got, fn(x))
    else:  # the float32 source position's rounding, ≤ u·size, moves the weights with gain ≤ size
        assert relative_error(got, fn(x.double())) <= rounding_bound(torch.float32, 4 + 2 * max(shape[2:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inference_batch_norm_matches_eager(dtype):
    bn = nn.BatchNorm2d(6, eps=1e-3).to(DEV)
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 1.5)
        bn.weight.normal_()
        bn.bias.normal_()
    bn = bn.eval().to(dtype)
    x = torch.randn(2, 6, 9, 10, device=DEV, dtype=dtype)
    got = _compiled(bn, x)
    with torch.no_grad():
        ref = bn.double()(x.double())
    assert got.dtype == dtype
    # var + eps, rsqrt, ·weight, mean·scale, the shift, x·scale and the sum: seven roundings, gain ≤ 1
    assert relative_error(got, ref) <= rounding_bound(dtype, 7)


@pytest.mark.parametrize("model,shape", [(lambda: TinyResNet(16), (2, 3, 64, 64)),
                                         (lambda: UNetBlock(8), (2, 3, 32, 32)),
                                         (lambda: ConvNeXtBlock(32), (2, 32, 14, 14))], ids=["resnet", "unet", "convnext"])
def test_small_models_match_eager(model, shape):
    m = randomize_batch_norms(model(), torch.Generator().manual_seed(0)).to(DEV)
    x = torch.randn(shape, device=DEV)
    got = _compiled(m, x)
    with torch.no_grad():
        ref = m.double()(x.double())
    # a few dozen roundings and, summed over the layers, at most ~2000 fp32 terms on the way
    assert relative_error(got, ref) <= rounding_bound(torch.float32, 40, k=2000)
