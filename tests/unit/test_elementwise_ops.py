"""Elementwise ops, reductions over any dims, (log-)softmax and cumsum over any dim, norms,
shuffles, indexing and padding through ``torch.compile(backend="mpk")`` against eager PyTorch on
the same inputs (for bfloat16 eager on the CPU, which accumulates as mpk does): float32 within
1e-5 of the reference's largest |value| (the CPU interpreter computes each tile with PyTorch;
the CUDA tasks in float32, whose transcendental functions may differ by an ulp), bfloat16
within 1e-2 (two roundings of 2^-8), integer and bool results exactly — int64 operands beyond
2^24, where a float32 path would round, included."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpk.testing.graphs import relative_error
from mpk.backend import COMPILED

F32_TOL, BF16_TOL, F64_TOL = 1e-5, 1e-2, 1e-12
TOL = {torch.float32: F32_TOL, torch.bfloat16: BF16_TOL, torch.float64: F64_TOL}

def _narrow_ints(x, y, i, j, k, v):
    """uint8 and int16 results wrap as torch's do (not through float32), numbers meet int32 in
    its width (2**33 wraps to 0) and bool masks in int64 (a mask times 2 is 2, not True)."""
    u, s = k.to(torch.uint8), i.to(torch.int16)
    b = x > 0
    return (~u, u - 1, -u, s * s, (s.long() * 2 ** 24 + 1).to(torch.int16), k < 2 ** 33, u == 259, u.amin(-1),
            s.sum(-1), s.argmax(0), b * 2 - 1, b != 2, torch.add(b, 3), b & True, torch.clamp_min(b, 3))


def _fills_and_scalars(x, y, i, j, k, v):
    """Fill values converted to the tensor's dtype, integer aranges from fractional bounds, a fill
    from a 0-d tensor, bool min / max with indices, reductions of a 0-d tensor."""
    d = x.device
    return (i.masked_fill(i < 0, 0.7), torch.arange(0, 5, 1.5, dtype=torch.int64, device=d),
            torch.arange(-2.5, 2, dtype=torch.int64, device=d), torch.empty_like(x).fill_(x[0, 0, 0]),
            *(x > 0).min(0), *(x > 0).max(-1), x[0, 0, 0].sum(0), x[0, 0, 0].argmax(0), torch.softmax(x[0, 0, 0], 0))


def _indexing(x, y, i, j, k, v):
    """gather, index_select, x[i], x[i, j] (negative entries from the end; index tensors that
    broadcast, adjacent or apart) and constant padding."""
    rows = k.abs().clamp(max=5).long()
    return (torch.gather(x, 1, rows), torch.index_select(x, 2, k[0, 0, :5].abs()), x[:, k[0, 0, :4].clamp(-6, 5)],
            x[k[0, :2, :3].clamp(-4, 3)], i[..., rows[0, 0, :3]], F.pad(x, (1, 2)),
            F.pad(y, (0, 0, -1, 3), value=-2.0), F.pad(i, (2, 1), value=7), F.pad(x, (0, 0)), x[:, k[0, 0, :0]],
            torch.gather(x[0, 0, 0], 0, k[0, 0, 0].clamp(0, 0).long()),
            x[k[:, :1, :1].clamp(-4, 3), k[:1, :, :1].clamp(-6, 5)],  # two index tensors, broadcast
            x[k[0, 0, :3].clamp(0, 3), :, k[1, 1, :3].clamp(-10, 9)],  # apart: their shape comes first
            x[:, k[0, :2, :2].clamp(0, 5), k[1, :2, :1].clamp(-10, 9)], x.new_ones(2, 3) + x.new_zeros(3).sum())


def _sorting(x, y, i, j, k, v):
    """Stable sorts and argsorts over any dim, both orders: int32 entries of -6…6 and bfloat16
    values tie, NaN sorts as the largest value, -0 equals 0, int64 beyond 2^32, bool, a row of
    2048 (the longest sorted whole), a 0-d tensor. (topk: test_topk_matches_a_stable_sort.)"""
    zeros = torch.zeros_like(x)
    z = torch.where(y > 1.2, float("nan"), torch.where(y < -0.8, -zeros, torch.where(y > 0.6, zeros, x)))
    return (*torch.sort(x, dim=-1, stable=True), *torch.sort(x, dim=1, descending=True, stable=True),
            torch.argsort(k, dim=-1, stable=True), *torch.sort(k, dim=0, descending=True, stable=True),
            *torch.sort(i, dim=-1, stable=True), *torch.sort(z, dim=2, stable=True), *torch.sort(z, dim=0, descending=True, stable=True),
            torch.argsort(x > 0, dim=-1, stable=True), *torch.sort(v[:, :2048], dim=-1, descending=True, stable=True),
            *torch.sort(x[0, 0, 0], stable=True))


def _float64_precision(x, y, i, j, k, v):
    """What float32 would lose (run with float64 x and y): a small step beside x, int64 beyond
    2^24 into float64 and back, copies, indexing and a float64 embedding table; and what float64
    must not gain: a 0-d float64 tensor with float32 ones computes in float32, as in torch."""
    return ((x + 1e-9) - x, i.double() + 0.5, (i.double() * 0.5).long(), x.transpose(1, 2).contiguous(),
            x.float() == x[0, 0, 0], x.float() * y[0, 0, 0],  # a 0-d float64 meets float32 in float32
            torch.cat([x, y], 2)[:, k[0, 0, :3].clamp(-6, 5)], F.embedding(k.abs().long(), y.reshape(24, 10)),
            x.to(torch.float32), torch.where(x > 0, x * (1 + 2 ** -40), y))


# name -> f(x, y, i, j, k, v): x, y float [4, 6, 10]; i, j int64 of magnitude up to 2^40; k int32;
# v float rows long enough for the CTA-per-row tasks [3, 8192]
CASES = {
    "abs_log": lambda x, y, *_: x.abs().log(),
    "sin_cos": lambda x, y, *_: torch.sin(x) + torch.cos(y),
    "reciprocal": lambda x, y, *_: (x.abs() + 0.5).reciprocal(),
    "erf_log1p_expm1": lambda x, y, *_: torch.erf(x) + torch.log1p(y.abs()) + torch.expm1(x),
    "rounding": lambda x, y, *_: (torch.floor(x * 4), torch.ceil(y * 4), torch.round(x * 4), torch.trunc(y * 4)),
    "sign": lambda x, y, *_: torch.sign(x),
    "maximum_minimum": lambda x, y, *_: (torch.maximum(x, y), torch.minimum(x, y), x.clamp_min(0.2)),
    "clamp": lambda x, y, *_: (x.clamp(-0.5, 0.5), x.clamp(min=y), x.clamp(max=0.1), F.hardtanh(x), F.relu6(x * 4)),
    "comparisons": lambda x, y, *_: (((x > y) & (x < 1)) | (x == y), (x >= 0.5) ^ (y <= -0.5), x != y, ~(x > 0),
                                     # a number meets a 16-bit float tensor rounded to its dtype
                                     x.clamp(0.3, 0.3) == 0.3, x.clamp(-0.8, -0.8) < -0.8,
                                     x.clamp(0.3, 0.3) == torch.full((), 0.3, device=x.device),
                                     x.clamp(2048, 2048) == x.new_full((1,), 2049, dtype=torch.int32)),
    "where": lambda x, y, *_: (torch.where(x > 0, x, 0.0), torch.where(x > y, x, y), x.masked_fill(y > 0.5, -3.0)),
    "masked_softmax": lambda x, y, *_: torch.softmax(x.masked_fill(y > 0.5, float("-inf")), -1),
    "activations": lambda x, y, *_: (F.leaky_relu(x, 0.1), F.elu(x), F.selu(x), F.celu(x, 0.7), F.softplus(x, 2, 5),
                                     F.hardsigmoid(x), F.hardswish(x), F.mish(x), F.logsigmoid(x),
                                     F.threshold(x, 0.1, 2.0), F.glu(x, -1), F.hardshrink(x), F.softsign(y), F.prelu(x, y[0, :, :1].flatten()[:6])),
    "reductions": lambda x, y, *_: (x.sum(0), x.mean((0, 2)), x.amax(1), x.amin(-1, keepdim=True), x.sum(),
                                    x.max(), y.min()),
    "arg_reductions": lambda x, y, *_: (x.argmin(1), x.argmax(), y.argmax(0, keepdim=True), *x.max(dim=1),
                                        *x.min(dim=0)),
    "variance_norms": lambda x, y, *_: (x.var(1), x.std(-1, correction=0), torch.linalg.vector_norm(x, dim=-1),
                                        F.normalize(y, dim=1), torch.linalg.vector_norm(x, 1, dim=(0, 1)),
                                        torch.linalg.vector_norm(y, float("inf"), dim=0)),
    "softmax_dims": lambda x, y, *_: (F.softmax(x, 0), F.log_softmax(x, 1), F.log_softmax(y, -1)),
    "stack": lambda x, y, *_: torch.stack([x, y], 1),
    "cumsum": lambda x, y, i, j, k, v: (x.cumsum(-1), y.cumsum(0), (x > 0).cumsum(1), k.cumsum(-1),
                                        i.cumsum(2), x.cumsum(1, dtype=torch.float64).float(), v.cumsum(-1)),
    "group_norm": lambda x, y, *_: (F.group_norm(x.reshape(2, 12, 10), 3, y.flatten()[:12] + 1, y.flatten()[12:24]),
                                    F.group_norm(x.reshape(4, 6, 10), 2)),
    "pixel_shuffle": lambda x, y, *_: F.pixel_shuffle(x.reshape(1, 4, 6, 10), 2) * 2,
    "long_rows": lambda *a: (a[5].argmin(-1), a[5].amin(-1, keepdim=True), F.log_softmax(a[5], -1),
                             a[5][:, 1:].argmin(-1)),
    "made_in_forward": lambda x, y, *_: (x + torch.zeros(10, device=x.device), torch.ones_like(x) * 2 + y,
                                         torch.full((4, 1, 1), 2.5, device=x.device) * x,
                                         x + torch.arange(10, device=x.device),
                                         torch.arange(2, 32, 3, device=x.device) * 2 ** 33,
                                         torch.arange(0.5, 3.0, 0.25, device=x.device) * y[0, 0],
                                         torch.empty(3, 2, device=x.device).fill_(1.5) + x[0, :3, :2],
                                         torch.zeros(2, dtype=torch.bool, device=x.device) | (x[0, 0, :2] > 0)),
    "int_arithmetic": lambda x, y, i, j, k, _: (i + j, i - 3, i * 3, -i, i.abs(), torch.sign(i), torch.maximum(i, j),
                                             i.clamp(-2 ** 39, 2 ** 39), k ** 3, torch.relu(i)),
    "int_logic": lambda x, y, i, j, k, _: (torch.where(i > j, i, j), (i == j) | (i < 0), i & j, i | 7, i ^ j, ~i,
                                        (k > 0) & (k < 5)),
    "int_casts": lambda x, y, i, j, k, _: (i.to(torch.int32), k.long() * 2 ** 33, (i > 0).long(), i.bool(), k.float()),
    "narrow_ints": _narrow_ints,
    "fills_and_scalars": _fills_and_scalars,
    "indexing": _indexing,
    "sorting": _sorting,
    "float64_precision": _float64_precision,
    "int_reductions": lambda x, y, i, j, k, _: (i.sum(-1), i.amax(0), i.amin(1), i.argmax(-1), i.argmin(0),
                                             (i > 0).sum(-1), k.sum(1), *i.max(dim=2)),
}


class _Zoo(torch.nn.Module):
    """Every case's outputs, flattened, in one graph (one build on the GPU)."""

    def __init__(self, names):
        super().__init__()
        self.names = names

    def forward(self, x, y, i, j, k, v):
        outs = []
        for name in self.names:
            o = CASES[name](x, y, i, j, k, v)
            outs.extend(o if isinstance(o, tuple) else (o,))
        return tuple(outs)


def _labels(names, args) -> list[str]:
    labels = []
    for name in names:
        o = CASES[name](*args)
        labels.extend(f"{name}[{n}]" for n in range(len(o) if isinstance(o, tuple) else 1))
    return labels


def _inputs(dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2 ** 31, ())))
    x, y = (torch.randn(4, 6, 10, generator=g).to(dtype) for _ in range(2))
    i, j = (torch.randint(-2 ** 40, 2 ** 40, (4, 6, 10), generator=g) for _ in range(2))
    j[0, 0, :4] = i[0, 0, :4]  # some equal pairs for ==, maximum and where
    k = torch.randint(-6, 7, (4, 6, 10), generator=g, dtype=torch.int32)
    v = torch.randn(3, 8192, generator=g).to(dtype)
    return [t.to(device) for t in (x, y, i, j, k, v)]


def _mismatches(out, ref, labels, tol) -> list[str]:
    bad = []
    for o, r, label in zip(out, ref, labels):
        if o.dtype != r.dtype or o.shape != r.shape:
            bad.append(f"{label}: {o.dtype} {tuple(o.shape)}, expected {r.dtype} {tuple(r.shape)}")
        elif r.numel() == 0:
            continue
        elif r.is_floating_point():
            err = relative_error(o.cpu().nan_to_num(), r.cpu().nan_to_num())
            if err > tol or not torch.equal(o.isnan().cpu(), r.isnan().cpu()):
                bad.append(f"{label}: relative error {err:.2e} (tolerance {tol:.0e})")
        elif not torch.equal(o.cpu(), r.cpu()):
            bad.append(f"{label}: {int((o.cpu() != r.cpu()).sum())} of {r.numel()} elements differ")
    return bad


def check_zoo(dtype: torch.dtype, executor: str, names=tuple(CASES)) -> None:
    """Compile the cases ``names`` as one graph for ``executor`` and compare each output with
    eager's."""
    device = "cuda" if executor == "gpu" else "cpu"
    args = _inputs(dtype, device)
    model = _Zoo(list(names))
    with torch.no_grad():
        # bfloat16: eager on the CPU, whose reductions and scans accumulate in float32 as mpk's
        # tasks do (CUDA's bfloat16 cumsum accumulates in bfloat16: 7 ulps off over 8192 terms)
        ref = model(*[a.cpu() for a in args]) if dtype == torch.bfloat16 else model(*args)
        out = torch.compile(model, backend="mpk", dynamic=False, options={"executor": executor})(*args)
    bad = _mismatches(out, ref, _labels(names, args), TOL[dtype])
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", [n for n in CASES if n != "float64_precision"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_case_matches_eager_on_the_cpu_interpreter(name, dtype):
    torch._dynamo.reset()
    check_zoo(dtype, "cpu", (name,))
    kinds = {op.kind for op in COMPILED[-1].graph.ops}
    assert kinds, "the case compiled to no op"


def test_integer_results_take_the_exact_integer_form():
    """Integer and bool results of integer or bool operands are marked for the CUDA task's
    64-bit form; comparisons of floats and casts to float are not."""
    torch._dynamo.reset()
    check_zoo(torch.float32, "cpu", ("int_arithmetic", "int_casts", "comparisons"))
    forms = {(op.attrs["fn"], op.attrs.get("form") == "int") for op in COMPILED[-1].graph.ops if op.kind == "pointwise"}
    assert {("add", True), ("mul", True), ("cast", True), ("gt", False), ("logical_and", True)} <= forms
    assert ("cast", False) in forms  # k.float(): an int32 → float32 conversion


def test_numbers_take_the_integer_operands_dtype():
    """The CUDA task computes integers in 64 bits, so the compiler converts a number to what
    torch would: 2**33 against int32 is 0, a fill value 0.7 into int64 is 0 (exact form kept)."""
    torch._dynamo.reset()
    check_zoo(torch.float32, "cpu", ("narrow_ints", "fills_and_scalars"))
    ops = {(op.attrs["fn"], tuple(tuple(a) for a in op.attrs["args"]), op.attrs.get("form") == "int")
           for op in COMPILED[-1].graph.ops if op.kind == "pointwise"}
    assert ("lt", (("in", 0), ("c", 0)), True) in ops  # k < 2**33
    assert ("eq", (("in", 0), ("c", 3)), True) in ops  # uint8 == 259
    assert ("where", (("in", 0), ("c", 0), ("in", 1)), True) in ops  # masked_fill(i < 0, 0.7)
    assert ("arange", (("c", -2), ("c", 1)), True) in ops  # arange(-2.5, 2, dtype=int64)


@pytest.mark.parametrize("fn,message", [
    (lambda i: i.masked_fill(i > 0, 2 ** 33), "the number 8589934592 as int32: value cannot be converted"),
    (lambda i: i.clamp(max=2 ** 33), "the number 8589934592 as int32: value cannot be converted"),
    (lambda i: F.pad(i, (2, -5)), r"pad \[2, -5\] cuts 5 of dim 0's 4 entries"),
])
def test_what_eager_refuses_is_refused_by_name(fn, message):
    """A fill value or bound that does not fit the integer dtype, a pad that cuts more than the
    dim holds: eager raises, mpk says which node and why (never a wrapped value or a wrong shape)."""
    torch._dynamo.reset()
    with pytest.raises(Exception, match=message), torch.no_grad():
        torch.compile(fn, backend="mpk", dynamic=False, options={"executor": "cpu"})(
            torch.tensor([1, -2, 3, 4], dtype=torch.int32))


def test_reductions_over_leading_dims_read_views_without_copies():
    """A reduction over one dim other than the last permutes its view (no copy op), and a
    softmax over dim 0 writes through the inverse permutation."""
    torch._dynamo.reset()
    x = torch.randn(5, 7, 3)
    f = lambda t: (t.sum(0), t.amax(1, keepdim=True), F.softmax(t, 0), F.log_softmax(t, 1))  # noqa: E731
    with torch.no_grad():
        out = torch.compile(f, backend="mpk", options={"executor": "cpu"})(x)
    for o, r in zip(out, f(x)):
        assert o.shape == r.shape and relative_error(o, r) <= F32_TOL
    assert [op.kind for op in COMPILED[-1].graph.ops] == ["reduce", "reduce", "softmax", "softmax"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_case_matches_eager_on_the_gpu(dtype):
    torch._dynamo.reset()
    check_zoo(dtype, "gpu")


def _topk_rows() -> list[tuple[torch.Tensor, int, int, bool]]:
    """(rows, k, dim, largest): ties in bfloat16 and int32 rows, NaNs, rows short and long (8192
    and more: the radix select), float64 and int64 (64-bit keys), k from 1 to 2048, and rows of
    0s and 1s, whose ~3000 equal entries at the k-th are more than shared memory takes at once."""
    b = torch.randn(3, 8192).bfloat16()
    b[0, ::97] = float("nan")
    ints = torch.randint(-6, 7, (5, 3000), dtype=torch.int32)
    bits = torch.randint(0, 2, (2, 6000), dtype=torch.int32)
    wide = torch.randint(-2 ** 40, 2 ** 40, (4, 2500))
    return [(b, 50, -1, True), (b, 7, -1, False), (b, 2048, 1, True), (ints, 300, 1, True), (ints, 5, -1, False),
            (torch.randn(2, 5000, dtype=torch.float64), 9, -1, True), (wide, 64, 1, False), (wide, 1, 1, True),
            (torch.randn(100, 6), 3, 0, True), (torch.randn(6, 100), 100, -1, False), (bits, 10, -1, True),
            (bits, 2000, -1, False)]


@pytest.mark.parametrize("executor", ["cpu", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_topk_matches_a_stable_sort(executor):
    """topk gives the first k of a stable sort, values and indices: equal entries (torch leaves
    their order open) by the lower index, NaN the largest value."""
    device = "cuda" if executor == "gpu" else "cpu"
    cases = _topk_rows()
    rows = [t.to(device) for t, *_ in cases]

    def f(*ts):
        return tuple(torch.topk(t, k, dim, largest) for t, (_, k, dim, largest) in zip(ts, cases))

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(f, backend="mpk", dynamic=False, options={"executor": executor})(*rows)
    for (values, indices), (t, k, dim, largest) in zip(out, cases):
        ref = torch.sort(t, dim=dim, descending=largest, stable=True)
        label = f"topk({str(t.dtype)[6:]} {tuple(t.shape)}, k={k}, dim={dim}, largest={largest})"
        assert torch.equal(indices.cpu(), ref.indices.narrow(dim, 0, k)), label
        assert torch.equal(values.cpu().nan_to_num(), ref.values.narrow(dim, 0, k).nan_to_num()), label


def test_sorting_more_than_shared_memory_holds_is_refused_by_name():
    """A row longer than SORT_MAX gives at most SORT_MAX results: a whole sort of a vocabulary
    is refused, naming the sizes, where it would otherwise not fit the GPU task."""
    from mpk.errors import UnsupportedOpError
    from mpk.inspection import compile_module

    class Sort(torch.nn.Module):
        def forward(self, t):
            return torch.sort(t, -1)

    class Topk(torch.nn.Module):
        def forward(self, t):
            return torch.topk(t, 2049)

    with pytest.raises(UnsupportedOpError, match=r"the first 5000 of 5000 entries in order: a row longer than 2048"):
        compile_module(Sort(), (torch.randn(2, 5000),))
    with pytest.raises(UnsupportedOpError, match=r"the first 2049 of 3000"):
        compile_module(Topk(), (torch.randn(3000),))
    compile_module(Sort(), (torch.randn(4, 2048),))  # a row of 2048 sorts whole


# Cases whose every op keeps float64 on the GPU (codegen.FLOAT64_EXACT: elementwise functions in
# double, copies and indexing through double); reductions, softmax and scans compute in float32
F64_CASES = ("abs_log", "sin_cos", "reciprocal", "erf_log1p_expm1", "rounding", "sign", "maximum_minimum", "clamp",
             "comparisons", "where", "activations", "stack", "pixel_shuffle", "made_in_forward", "sorting",
             "float64_precision")


@pytest.mark.parametrize("executor", ["cpu", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
def test_float64_stays_float64(executor):
    """float64 elementwise ops, copies and indexing match eager within 1e-12 (float32 would miss
    by ~1e-7, and (x + 1e-9) - x by 100%), the elementwise ops in their double form."""
    import warnings

    from mpk.errors import PrecisionWarning
    from mpk.executors.codegen import float32_computed

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        check_zoo(torch.float64, executor, F64_CASES)
    graph = COMPILED[-1]
    assert float32_computed(graph.tables) == []
    forms = {op.attrs.get("form") for op in graph.graph.ops if op.kind == "pointwise"}
    assert forms == {"f64", "int", None}, forms  # int: the int64 parts; None: float32 and bool results


def test_float64_computed_in_float32_is_named_in_a_warning():
    """A reduction, softmax or matmul over float64 computes in float32 on the GPU: generating
    its CUDA warns, naming those ops and not the elementwise ones beside them."""
    import warnings

    from mpk.errors import PrecisionWarning
    from mpk.executors.codegen import generate

    torch._dynamo.reset()
    x = torch.randn(5, 7, dtype=torch.float64)
    with torch.no_grad():
        torch.compile(lambda t: (t.sum(-1) * 2, torch.softmax(t + 1, -1), t @ t.T), backend="mpk",
                      options={"executor": "cpu"})(x)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        generate(COMPILED[-1].tables)
    messages = [str(w.message) for w in caught if issubclass(w.category, PrecisionWarning)]
    assert len(messages) == 1 and "3 op(s)" in messages[0], messages
    assert "(reduce)" in messages[0] and "(softmax)" in messages[0] and "pointwise" not in messages[0]


@pytest.mark.parametrize("executor", ["cpu", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("fn,index,bad", [
    (lambda x, idx: x[:, idx] * 2, [0, 7, -5], 7),  # x[idx] takes [-5, 5)
    (lambda x, idx: x[:, idx] * 2, [0, -6, 4], -6),
    (lambda x, idx: torch.gather(x, 1, idx.expand(3, 3)), [0, -1, 4], -1),  # gather takes [0, 5) only
], ids=["past_end", "before_start", "gather_negative"])
def test_an_index_outside_its_dim_is_named_not_read(executor, fn, index, bad):
    """The CPU interpreter and the CUDA task both refuse it (BadInputError, the value and the
    dim's size named); the CUDA task writes 0 instead of reading outside x."""
    from mpk.errors import BadInputError

    torch._dynamo.reset()
    device = "cuda" if executor == "gpu" else "cpu"
    x, idx = torch.randn(3, 5, device=device), torch.tensor(index, device=device)
    compiled = torch.compile(fn, backend="mpk", dynamic=False, options={"executor": executor})
    with torch.no_grad(), pytest.raises(BadInputError, match=rf"index \(gather / index_select / x\[idx\]\) {bad} at "
                                                           r"row \d+ is outside the 5 entries of the dim it indexes"):
        compiled(x, idx)


def _tiny_hf_model(name: str) -> torch.nn.Module:
    import transformers as T

    common = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=100)
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64,
                                              bos_token_id=0, eos_token_id=0))
    if name == "bert":
        return T.BertModel(T.BertConfig(num_hidden_layers=2, **common))
    if name == "t5":
        return T.T5EncoderModel(T.T5Config(num_layers=2, d_model=64, num_heads=4, d_ff=128, vocab_size=100, d_kv=16))
    config = dict(num_hidden_layers=2, num_key_value_heads=2, **common)
    return (T.LlamaForCausalLM(T.LlamaConfig(**config)) if name == "llama"
            else T.Qwen3ForCausalLM(T.Qwen3Config(head_dim=16, **config)))


@pytest.mark.parametrize("executor", ["cpu", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("name", ["gpt2", "llama", "qwen3", "bert", "t5"])
def test_hugging_face_models_compile_whole(name, executor):
    """transformers' own GPT-2, Llama, Qwen3 (a prefill: their masks built in forward from
    aranges, comparisons and two-tensor indexing), BERT and T5 encoders, 2 random float32
    layers: one mpk graph each (no fallback), within 1e-5 of eager's largest |value|."""
    torch._dynamo.reset()
    torch.manual_seed(int(torch.randint(0, 2 ** 31, ())))
    device = "cuda" if executor == "gpu" else "cpu"
    model = _tiny_hf_model(name).eval().to(device)
    kwargs = {"input_ids": torch.randint(0, 100, (2, 7), device=device)}
    if name in ("gpt2", "llama", "qwen3"):
        kwargs["use_cache"] = False
    before = len(COMPILED)
    with torch.no_grad():
        ref = model(**kwargs)
        out = torch.compile(model, backend="mpk", dynamic=False, options={"executor": executor})(**kwargs)
    field = "logits" if hasattr(ref, "logits") else "last_hidden_state"
    assert relative_error(getattr(out, field).cpu(), getattr(ref, field).cpu()) <= F32_TOL
    assert len(COMPILED) - before == 1
