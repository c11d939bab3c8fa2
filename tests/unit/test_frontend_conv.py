"""Convolutional networks' ops: convolution (1-D/2-D/3-D, stride, padding, dilation,
groups, transposed, bias), inference batch norm, max / average / adaptive pooling and upsampling
(nearest, nearest-exact, linear, bilinear, trilinear, bicubic). Each compiles whole in strict mode on the CPU executor and matches a
float64 eager reference within the rounding bound of its dtype and sum length
(mpk.testing.tolerance); max pooling and nearest upsampling move elements and are exact. Random
tilings run on the interpreter with the element-level dependency oracle (each tile reads only its
declared input regions), small models (ResNet, UNet and ConvNeXt blocks) match eager within
1e-5, and the generated CUDA builds for sm_90a."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from mpk.executors import Interpreter, build
from mpk.executors.codegen import generate
from mpk.frontend import fuse_patterns, lower
from mpk.testing.conv_models import ConvNeXtBlock, TinyResNet, UNetBlock, randomize_batch_norms
from mpk.testing.graphs import check_dependencies, compile_with, random_partition, relative_error
from mpk.testing.tolerance import rounding_bound

OPTS = {"executor": "cpu", "num_workers": 8, "fallback": "error"}
aten = torch.ops.aten
# torch.compile's path decomposes upsampling into index arithmetic and _unsafe_index; make_fx
# alone keeps the upsample ops, so graphs traced here take the same decompositions
UPSAMPLE_DECOMPS = get_decompositions([aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d,
                                       aten.upsample_bilinear2d])


def _compiled(fn, *args):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(fn, backend="mpk", options=OPTS, fullgraph=True)(*args)


def _rand(*shape, dtype=torch.float32, g: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype)


def _seed() -> torch.Generator:
    return torch.Generator().manual_seed(random.randrange(2**31))  # fresh inputs each run


# --- convolution -------------------------------------------------------------------------------

# (x shape, w shape, bias, kwargs); transposed cases name w as (C_in, C_out / groups, k…)
CONVS = {
    "1d": ((2, 3, 17), (4, 3, 3), True, {}),
    "1d_stride_pad_dil_groups": ((2, 4, 19), (6, 2, 3), True, {"stride": 2, "padding": 2, "dilation": 2, "groups": 2}),
    "1d_transposed": ((2, 4, 7), (4, 3, 4), True, {"stride": 3, "padding": 1, "output_padding": 2, "transposed": True}),
    "2d_stride_pad_groups": ((2, 4, 9, 10), (6, 2, 3, 3), True, {"stride": 2, "padding": 1, "groups": 2}),
    "2d_dilation_asymmetric": ((1, 3, 12, 11), (5, 3, 3, 2), False,
                               {"stride": (1, 2), "padding": (3, 0), "dilation": 2}),
    "2d_depthwise_7x7": ((2, 8, 9, 9), (8, 1, 7, 7), True, {"padding": 3, "groups": 8}),
    "2d_padding_beyond_kernel": ((1, 2, 5, 5), (3, 2, 2, 2), True, {"padding": 3}),  # windows of padding only
    "2d_transposed_groups": ((2, 4, 5, 6), (4, 3, 3, 2), True,
                             {"stride": 2, "padding": 1, "output_padding": 1, "groups": 2, "transposed": True}),
    "2d_transposed_dilation": ((1, 3, 4, 5), (3, 2, 3, 3), False,
                               {"stride": (2, 1), "dilation": 2, "transposed": True}),
    "3d_stride_pad": ((1, 2, 6, 7, 5), (3, 2, 3, 3, 3), True, {"stride": (1, 2, 1), "padding": 1}),
    "3d_transposed": ((1, 2, 3, 4, 3), (2, 3, 2, 2, 2), True, {"stride": 2, "transposed": True}),
}


def _conv_fn(nsp: int, kw: dict):
    kw = dict(kw)
    if kw.pop("transposed", False):
        fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nsp - 1]
    else:
        fn = (F.conv1d, F.conv2d, F.conv3d)[nsp - 1]
    return lambda x, w, b=None: fn(x, w, b, **kw)


def _conv_terms(w_shape, kw) -> int:
    """The length of one output element's sum: input channels per group times kernel volume."""
    k = math.prod(w_shape[2:])
    return (w_shape[0] // kw.get("groups", 1) if kw.get("transposed") else w_shape[1]) * k + 1


def _conv_case(name: str, dtype: torch.dtype):
    x_shape, w_shape, bias, kw = CONVS[name]
    g = _seed()
    out_ch = w_shape[1] * kw.get("groups", 1) if kw.get("transposed") else w_shape[0]
    args = [_rand(*x_shape, dtype=dtype, g=g), _rand(*w_shape, dtype=dtype, g=g)]
    if bias:
        args.append(_rand(out_ch, dtype=dtype, g=g))
    return _conv_fn(len(x_shape) - 2, kw), args, _conv_terms(w_shape, kw)


@pytest.mark.parametrize("name", list(CONVS))
def test_convolution_matches_eager(name):
    fn, args, k = _conv_case(name, torch.float32)
    got = _compiled(fn, *args)
    ref = fn(*(a.double() for a in args))
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert relative_error(got, ref) <= rounding_bound(torch.float32, 1, k=k)


@pytest.mark.parametrize("name,dtype", [("2d_stride_pad_groups", torch.float64),
                                        ("2d_transposed_groups", torch.float64),
                                        ("2d_depthwise_7x7", torch.bfloat16), ("3d_transposed", torch.bfloat16)])
def test_convolution_other_dtypes(name, dtype):
    # float64 stays float64; bfloat16 accumulates in float32 and rounds once
    fn, args, k = _conv_case(name, dtype)
    got = _compiled(fn, *args)
    ref = fn(*(a.double() for a in args))
    assert got.dtype == dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert relative_error(got, ref) <= rounding_bound(dtype, 1, k=k, acc=acc)


def test_unbatched_convolution():
    g = _seed()
    x, w = _rand(3, 8, 8, g=g), _rand(4, 3, 3, 3, g=g)
    got = _compiled(lambda x, w: F.conv2d(x, w, padding=1), x, w)
    assert relative_error(got, F.conv2d(x.double(), w.double(), padding=1)) <= rounding_bound(torch.float32, 1, k=28)


# --- pooling -----------------------------------------------------------------------------------

POOLS = {
    "max1d": ((2, 3, 17), lambda x: F.max_pool1d(x, 3, 2, 1)),
    "max1d_dilation_ceil": ((2, 3, 16), lambda x: F.max_pool1d(x, 3, 2, 1, dilation=2, ceil_mode=True)),
    "max2d_ceil": ((2, 3, 9, 10), lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True)),
    "max2d_dilation": ((1, 2, 11, 12), lambda x: F.max_pool2d(x, (2, 3), (1, 2), (1, 0), dilation=(2, 1))),
    "max3d": ((1, 2, 6, 7, 5), lambda x: F.max_pool3d(x, 3, 2, 1)),
    "avg1d": ((2, 3, 17), lambda x: F.avg_pool1d(x, 4, 3, 2, ceil_mode=True)),
    "avg2d_exclude_pad": ((2, 3, 9, 10), lambda x: F.avg_pool2d(x, 3, 2, 1, ceil_mode=True, count_include_pad=False)),
    "avg2d_include_pad": ((2, 3, 9, 10), lambda x: F.avg_pool2d(x, (3, 2), (2, 1), (1, 1), ceil_mode=True)),
    "avg2d_divisor": ((1, 2, 8, 8), lambda x: F.avg_pool2d(x, 3, 2, 1, divisor_override=5)),
    "avg3d": ((1, 2, 6, 7, 5), lambda x: F.avg_pool3d(x, 2, (2, 1, 2), count_include_pad=False, padding=1)),
    "adaptive_avg1d": ((2, 3, 17), lambda x: F.adaptive_avg_pool1d(x, 5)),
    "adaptive_avg2d": ((2, 3, 9, 10), lambda x: F.adaptive_avg_pool2d(x, (4, 3))),
    "adaptive_avg3d": ((1, 2, 6, 7, 5), lambda x: F.adaptive_avg_pool3d(x, (2, 3, 4))),
    "adaptive_max1d": ((2, 3, 17), lambda x: F.adaptive_max_pool1d(x, 5)),
    "adaptive_max2d": ((2, 3, 9, 10), lambda x: F.adaptive_max_pool2d(x, (4, 3))),
    "adaptive_max3d": ((1, 2, 6, 7, 5), lambda x: F.adaptive_max_pool3d(x, (2, 3, 4))),
    "max2d_unbatched": ((3, 9, 10), lambda x: F.max_pool2d(x, 2)),
}


@pytest.mark.parametrize("name", list(POOLS))
def test_pooling_matches_eager(name):
    shape, fn = POOLS[name]
    x = _rand(*shape, g=_seed())
    got = _compiled(fn, x)
    if name.startswith(("max", "adaptive_max")):  # a pick: exact
        assert torch.equal(got, fn(x))
    else:  # a sum of at most the whole input, a division
        assert relative_error(got, fn(x.double())) <= rounding_bound(torch.float32, 2, k=math.prod(shape[-3:]))


def test_max_pooling_propagates_nan():
    x = _rand(2, 3, 8, 8, g=_seed())
    x[0, 1, 2, 3] = float("nan")
    got = _compiled(lambda x: F.max_pool2d(x, 2), x)
    torch.testing.assert_close(got, F.max_pool2d(x, 2), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_pooling_other_dtypes(dtype):
    x = _rand(2, 3, 9, 10, dtype=dtype, g=_seed())

    def fn(x):
        return F.max_pool2d(x, 3, 2, 1), F.avg_pool2d(x, 3, 2, 1), F.adaptive_avg_pool2d(x, 2)

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    got, ref = _compiled(fn, x), fn(x.double())
    assert got[0].dtype == dtype and torch.equal(got[0].double(), ref[0])
    for o, r in zip(got[1:], ref[1:]):
        assert relative_error(o, r) <= rounding_bound(dtype, 1, k=30, acc=acc)


# --- upsampling --------------------------------------------------------------------------------

UPSAMPLES = {
    "nearest1d_scale": ((2, 3, 10), lambda x: F.interpolate(x, scale_factor=2.5, mode="nearest")),
    "nearest1d_size": ((2, 3, 10), lambda x: F.interpolate(x, size=17, mode="nearest")),
    "nearest2d_scale": ((2, 3, 5, 6), lambda x: F.interpolate(x, scale_factor=2, mode="nearest")),
    "nearest2d_downsize": ((2, 3, 9, 8), lambda x: F.interpolate(x, size=(4, 5), mode="nearest")),
    "nearest3d_size": ((1, 2, 3, 4, 5), lambda x: F.interpolate(x, size=(5, 7, 6), mode="nearest")),
    "bilinear_scale": ((2, 3, 5, 6), lambda x: F.interpolate(x, scale_factor=2, mode="bilinear")),
    "bilinear_scale_align": ((2, 3, 5, 6), lambda x: F.interpolate(x, scale_factor=(1.5, 2.5), mode="bilinear",
                                                                 align_corners=True)),
    "bilinear_size": ((2, 3, 5, 6), lambda x: F.interpolate(x, size=(11, 7), mode="bilinear")),
    "bilinear_size_align": ((2, 3, 5, 6), lambda x: F.interpolate(x, size=(11, 7), mode="bilinear",
                                                                align_corners=True)),
    "nearest_exact2d": ((2, 3, 5, 6), lambda x: F.interpolate(x, scale_factor=1.7, mode="nearest-exact")),
    "linear1d": ((2, 3, 10), lambda x: F.interpolate(x, size=17, mode="linear")),
    "trilinear_align": ((1, 2, 3, 4, 5), lambda x: F.interpolate(x, scale_factor=2, mode="trilinear",
                                                               align_corners=True)),
    "bicubic": ((2, 3, 5, 6), lambda x: F.interpolate(x, scale_factor=2, mode="bicubic")),
}


@pytest.mark.parametrize("name", list(UPSAMPLES))
def test_upsampling_matches_eager(name):
    shape, fn = UPSAMPLES[name]
    x = _rand(*shape, g=_seed())
    got = _compiled(fn, x)
    if name.startswith("nearest"):  # a pick: exact
        assert torch.equal(got, fn(x))
    else:
        # per spatial dim, the source position s = scale·(o + ½) − ½ is computed in float32
        # (torch's decomposition and eager alike) at up to the input's size: its rounding,
        # ≤ u·size, moves the weights by that; and the weights' and the weighted sum's roundings
        nsp, size = len(shape) - 2, max(shape[2:])
        assert relative_error(got, fn(x.double())) <= rounding_bound(torch.float32, nsp * (4 + 2 * size))


# --- batch norm --------------------------------------------------------------------------------

@pytest.mark.parametrize("nsp,affine", [(1, True), (2, True), (2, False), (3, True)])
def test_inference_batch_norm_matches_eager(nsp, affine):
    g = _seed()
    bn = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[nsp - 1](5, eps=1e-3, affine=affine)
    with torch.no_grad():
        bn.running_mean.copy_(_rand(5, g=g))
        bn.running_var.copy_(torch.rand(5, generator=g) + 0.5)
        if affine:
            bn.weight.copy_(_rand(5, g=g))
            bn.bias.copy_(_rand(5, g=g))
    bn.eval()
    x = _rand(*(2, 5) + (6, 5, 4)[:nsp], g=g)
    got = _compiled(bn, x)
    with torch.no_grad():
        ref = bn.double()(x.double())
    # var + eps, rsqrt, ·weight, mean·scale, the shift, x·scale and the sum: seven roundings, gain ≤ 1
    assert relative_error(got, ref) <= rounding_bound(torch.float32, 7)


# --- random tilings ----------------------------------------------------------------------------

def _trace(fn, args):
    """The OpGraph of ``fn`` as torch.compile's path lowers it (upsampling decomposed)."""
    gm = make_fx(fn, tracing_mode="fake", decomposition_table=UPSAMPLE_DECOMPS)(*args)
    gm.graph.eliminate_dead_code()  # max_pool1d squeezes the indices it drops
    fuse_patterns(gm)
    return lower(gm)


@pytest.mark.parametrize("name", ["1d_stride_pad_dil_groups", "2d_padding_beyond_kernel", "2d_transposed_groups",
                                  "2d_depthwise_7x7", "3d_transposed"])
def test_random_conv_tilings_read_only_their_regions(name):
    """Random tilings of a convolution, its input produced in the graph by tiles: the element-
    level oracle finds every read of a producer's tile ordered, and every schedule gives the
    same result (the interpreter hands each tile only its declared input regions)."""
    rng = random.Random()
    fn, args, k = _conv_case(name, torch.float32)
    graph = _trace(lambda x, *rest: fn(x * 1, *rest), args)
    tables = compile_with(graph, partition=random_partition(graph, rng)).tables
    assert check_dependencies(tables) > 0
    ref = fn(*(a.double() for a in args))
    interp = Interpreter(tables)
    for schedule in range(3):
        (out,) = interp.run(list(args), seed=schedule)
        assert relative_error(out, ref) <= rounding_bound(torch.float32, 1, k=k)


def test_random_pool_and_upsample_tilings_read_only_their_regions():
    rng = random.Random()
    x = _rand(2, 3, 11, 9, g=_seed())

    def fn(x):
        x = x * 1
        return (F.max_pool2d(x, 3, 2, 1, dilation=2, ceil_mode=True), F.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
                F.adaptive_avg_pool2d(x, (4, 5)), F.adaptive_max_pool2d(x, (3, 2)),
                F.interpolate(x, scale_factor=2, mode="bilinear"), F.interpolate(x, size=(7, 13), mode="nearest"))

    graph = _trace(fn, (x,))
    tables = compile_with(graph, partition=random_partition(graph, rng)).tables
    assert check_dependencies(tables) > 0
    ref = fn(x.double())
    interp = Interpreter(tables)
    for schedule in range(3):
        for o, r in zip(interp.run([x], seed=schedule), ref):
            assert relative_error(o, r) <= rounding_bound(torch.float32, 30, k=100)


# --- small models ------------------------------------------------------------------------------

@pytest.mark.parametrize("model,shape", [(TinyResNet, (2, 3, 32, 32)), (UNetBlock, (2, 3, 16, 16)),
                                         (ConvNeXtBlock, (2, 16, 9, 9))], ids=["resnet", "unet", "convnext"])
def test_small_models_match_eager(model, shape):
    g = _seed()
    torch.manual_seed(g.initial_seed())  # the layers' own initialisation
    m = randomize_batch_norms(model(), g)
    x = _rand(*shape, g=g)
    got = _compiled(m, x)
    with torch.no_grad():
        ref = m(x)
    assert relative_error(got, ref) <= 1e-5


# --- refusals and the CUDA build ---------------------------------------------------------------

def test_unsupported_forms_are_refused_with_the_reason():
    from torch._dynamo.exc import BackendCompilerFailed  # wraps mpk's UnsupportedOpError

    x = torch.randn(1, 2, 5, 5)
    mean, var = torch.zeros(2), torch.ones(2)
    with pytest.raises(BackendCompilerFailed, match="batch statistics"):
        _compiled(lambda x: F.batch_norm(x, mean.clone(), var.clone(), training=True), x)


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")
def test_conv_and_spatial_tasks_compile_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))

    def fn(x, w, b, wt, x1, w1, x3, w3, mean, var):
        y = F.batch_norm(F.conv2d(x, w, b, padding=1, groups=1), mean, var, training=False)
        y = F.max_pool2d(y, 2) + F.avg_pool2d(y, 2, count_include_pad=False, padding=1)[..., :4, :4]
        t = F.conv_transpose2d(y, wt, stride=2)
        return (F.adaptive_avg_pool2d(t, 3), F.adaptive_max_pool2d(t, 2), F.interpolate(y, scale_factor=2,
                mode="bilinear"), F.interpolate(y, size=(7, 9)), F.max_pool1d(F.conv1d(x1, w1, dilation=2), 2),
                F.avg_pool3d(F.conv3d(x3.double(), w3.double(), stride=2), 2))

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(1, 3, 8, 8, generator=g), torch.randn(4, 3, 3, 3, generator=g), torch.randn(4, generator=g),
            torch.randn(4, 2, 2, 2, generator=g), torch.randn(2, 3, 12, generator=g).bfloat16(),
            torch.randn(5, 3, 3, generator=g).bfloat16(), torch.randn(1, 2, 9, 9, 9, generator=g),
            torch.randn(2, 2, 3, 3, 3, generator=g), torch.randn(4, generator=g), torch.rand(4, generator=g) + 0.5)
    graph = _trace(fn, args)
    kinds = {op.kind for op in graph.ops}
    assert {"conv", "pool", "gather"} <= kinds, kinds
    src = generate(compile_with(graph, partition=random_partition(graph, random.Random(0))).tables)
    assert "task_conv" in src and "task_pool" in src
    cubin = build.build_cubin(src, "sm_90a", tile_kernel=True)
    assert cubin.read_bytes()[:4] == b"\x7fELF"
