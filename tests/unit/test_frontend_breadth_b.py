"""Scatter-style updates: in-place slice writes (``x[:, 2:5] = y``, ``x[:, 3] = y``,
``copy_`` into a slice: slice_scatter / select_scatter after functionalization), ``index_put``
with one 1-D index or a boolean mask and one value, ``index_add``, ``index_copy``, ``scatter`` / ``scatter_add`` / ``scatter_reduce``. Each
compiles whole in strict mode on the CPU executor and equals eager exactly in float32, int64 and
bfloat16 (the ops move data, and sums fold in eager's entry order and rounding); random tilings run on the interpreter under several
schedules with the compiler's happens-before check and the element-level dependency oracle;
the generated CUDA builds for sm_90a."""

from __future__ import annotations

import random

import pytest
import torch

from mpk.errors import BadInputError
from mpk.executors import Interpreter, build
from mpk.executors.codegen import generate
from mpk.testing.graphs import check_dependencies, compile_with, random_partition, relative_error, trace_graph

OPTS = {"executor": "cpu", "num_workers": 8, "fallback": "error"}
SHAPES = [(6, 8), (33, 17), (4, 5, 9)]
aten = torch.ops.aten


def _rand(shape, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=g)
    return torch.randn(shape, generator=g, dtype=dtype)


# --- the patterns, as model code writes them ------------------------------------------------------

def slice_assign(x, y):
    x = x * 2
    x[:, 2:5] = y + 1  # slice_scatter
    return x


def strided_slice_assign(x, y):
    x = x.clone()
    x[:, 1::3] = y * 2  # slice_scatter with a step
    return x


def select_assign(x, y):
    x = x - 1
    x[:, 3] = y[:, 0]  # select_scatter
    return x


def copy_into_slice(x, y):
    x = x + 0
    x[1:3].copy_(y)  # copy_ into a slice: y broadcast over it, then slice_scatter
    return x


def index_assign(x, i, v):
    x = x * 3
    x[i] = v  # index_put, accumulate False
    return x


def index_put_accumulate(x, i, v):
    return (x + 1).index_put((i,), v, accumulate=True)


def masked_assign(x, m, v):
    x = x * 2
    x[m] = v  # index_put with a boolean mask: one value for every masked position
    return x


def masked_assign_dim1(x, m, v):
    x = x + 1
    x[:, m] = v
    return x


def masked_accumulate(x, m, v):
    return (x - 1).index_put((m,), v, accumulate=True)


def index_put_dim1_accumulate(x, i, v):
    return aten.index_put(x + 1, [None, i], v, True)  # x[:, i] += v, duplicates summed


def index_add(x, i, v):
    return (x * 2).index_add(1, i, v)


def index_copy(x, i, v):
    return (x + 1).index_copy(1, i, v)  # a static KV cache's write at the cache positions


def scatter_add(x, i, s):
    return (x + 1).scatter_add(1, i, s)


def scatter_sum_exclude_self(x, i, s):
    return x.scatter_reduce(1, i, s, "sum", include_self=False)


def scatter_amax(x, i, s):
    return x.scatter_reduce(1, i, s, "amax")


def scatter_amax_exclude_self(x, i, s):
    return x.scatter_reduce(1, i, s, "amax", include_self=False)


def scatter_prod(x, i, s):
    return x.scatter_reduce(1, i, s, "prod")


def scatter_mean(x, i, s):
    return x.scatter_reduce(1, i, s, "mean")


def scatter_mean_exclude_self(x, i, s):
    return x.scatter_reduce(1, i, s, "mean", include_self=False)


def scatter(x, i, s):
    return (x - 2).scatter(0, i, s)


def scatter_value(x, i):
    return x.scatter(0, i, 7)


def _patterns(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator):
    """(fn, args) for one base shape; indices repeat (duplicates) except where eager leaves a
    duplicate's result unspecified (assignment: index_put without accumulate, scatter)."""
    n0, n1, rest = shape[0], shape[1], shape[2:]
    x = _rand(shape, dtype, g)
    yield slice_assign, (x, _rand((n0, 3) + rest, dtype, g))
    yield strided_slice_assign, (x, _rand((n0, len(range(1, n1, 3))) + rest, dtype, g))
    yield select_assign, (x, _rand((n0, 2) + rest, dtype, g))
    yield copy_into_slice, (x, _rand(shape[1:], dtype, g))
    k = max(1, n0 // 2)
    i = torch.randperm(n0, generator=g)[:k]
    i = torch.where(torch.rand(k, generator=g) < 0.5, i - n0, i)  # negative indices count from the end
    yield index_assign, (x, i, _rand((k,) + shape[1:], dtype, g))
    m, v = torch.rand(shape, generator=g) < 0.5, _rand((), dtype, g)
    yield masked_assign, (x, m, v)
    yield masked_assign_dim1, (x, m[0, :, *(0 for _ in rest)], v)
    yield masked_accumulate, (x, m[:, :, *(0 for _ in rest)] if rest else m, v)
    k = 2 * max(n0, n1) + 1  # more entries than positions: duplicates for sure
    yield index_put_accumulate, (x, torch.randint(0, n0, (k,), generator=g), _rand((k,) + shape[1:], dtype, g))
    yield index_put_dim1_accumulate, (x, torch.randint(0, n1, (k,), generator=g), _rand((n0, k) + rest, dtype, g))
    yield index_add, (x, torch.randint(0, n1, (k,), generator=g), _rand((n0, k) + rest, dtype, g))
    k = max(1, n1 // 2)  # distinct positions: eager leaves a duplicate's copy unspecified
    yield index_copy, (x, torch.randperm(n1, generator=g)[:k], _rand((n0, k) + rest, dtype, g))
    src_shape = (max(1, n0 - 1), n1 + 3) + rest  # the index covers part of the base (dim 0) and repeats along dim 1
    dup, src = torch.randint(0, n1, src_shape, generator=g), _rand(src_shape, dtype, g)
    for fn in (scatter_add, scatter_sum_exclude_self, scatter_amax, scatter_amax_exclude_self, scatter_prod,
               scatter_mean, scatter_mean_exclude_self):
        yield fn, (x, dup, src)
    # scatter without a reduction: distinct targets along dim 0 in every column
    cols = n1 * (1 if not rest else int(torch.tensor(rest).prod()))
    uniq = torch.stack([torch.randperm(n0, generator=g)[:max(1, n0 - 1)] for _ in range(cols)], 1)
    uniq = uniq.reshape((uniq.shape[0],) + shape[1:])
    yield scatter, (x, uniq, _rand(uniq.shape, dtype, g))
    yield scatter_value, (x, uniq)


def _cases():
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        for si, shape in enumerate(SHAPES):
            for fn, _ in _patterns(shape, dtype, torch.Generator().manual_seed(0)):
                yield pytest.param(fn.__name__, dtype, si, id=f"{fn.__name__}-{str(dtype)[6:]}-{'x'.join(map(str, shape))}")


def _trace(fn, args):
    """The OpGraph of ``fn`` through the frontend, functionalized as AOTAutograd does (in-place
    writes become the scatter ops)."""
    return trace_graph(torch.func.functionalize(fn), args)


def _pattern(name: str, dtype: torch.dtype, si: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return next((fn, args) for fn, args in _patterns(SHAPES[si], dtype, g) if fn.__name__ == name)


@pytest.mark.parametrize("name,dtype,si", list(_cases()))
def test_compiles_whole_and_equals_eager(name, dtype, si):
    fn, args = _pattern(name, dtype, si, seed=random.randrange(2**31))  # fresh inputs each run
    torch._dynamo.reset()
    got = torch.compile(fn, backend="mpk", options=OPTS)(*args)
    expected = fn(*args)
    assert got.dtype == expected.dtype
    if dtype == torch.bfloat16 and name.startswith("index_put") and args[0].ndim > 1:
        # eager's 16-bit index_put(accumulate) of slices folds duplicates in an order and
        # precision of its own (neither index_add's per-entry rounding nor a float sum); mpk's
        # follows index_add. Both round at up to every entry: a few bf16 steps apart
        assert relative_error(got, expected) <= 2**-5
    else:
        assert torch.equal(got, expected), (got - expected).abs().max()


def _counts(x, i, v):
    """1-D updates as MoE routing writes them: per-expert counts and sums, a scatter with reduce="add"."""
    ones = torch.ones_like(i)
    return (torch.zeros_like(x).index_add(0, i, v), x.scatter_add(0, i, v), x.index_put((i,), v, accumulate=True),
            torch.zeros_like(i[:x.shape[0]]).scatter_add(0, i, ones), x.scatter(0, i, v, reduce="add"))


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(1, 3), (7, 40), (64, 500)])
def test_one_dim_counts_and_sums_equal_eager(n, k, dtype):
    g = torch.Generator().manual_seed(random.randrange(2**31))
    args = (_rand((n,), dtype, g), torch.randint(0, n, (k,), generator=g), _rand((k,), dtype, g))
    torch._dynamo.reset()
    got = torch.compile(_counts, backend="mpk", options=OPTS)(*args)
    for o, e in zip(got, _counts(*args)):
        assert o.dtype == e.dtype and torch.equal(o, e)


@pytest.mark.parametrize("name", ["slice_assign", "strided_slice_assign", "select_assign", "index_put_dim1_accumulate",
                                  "index_add", "index_copy", "scatter_add", "scatter_amax_exclude_self", "scatter"])
def test_random_tilings_are_ordered_and_exact(name):
    """Random tilings of every op (the scatter's tiles hold whole lines along its dim): the
    compiler's happens-before check passes (compile_with checks), the element-level oracle finds
    every read of a producer's tile ordered, and every schedule gives eager's result exactly —
    the interpreter hands each tile only its declared input regions and tracks races."""
    rng = random.Random()
    fn, args = _pattern(name, torch.float32, 1, seed=rng.randrange(2**31))
    graph = _trace(lambda *a: fn(*(t * 1 for t in a)), args)  # every input produced in the graph, by tiles
    tables = compile_with(graph, partition=random_partition(graph, rng)).tables
    assert check_dependencies(tables) > 0
    expected = fn(*args)
    interp = Interpreter(tables)
    for schedule in range(4):
        (out,) = interp.run(list(args), seed=schedule)
        assert torch.equal(out, expected), f"schedule {schedule}"


def test_out_of_range_index_is_reported():
    x, s = torch.randn(4, 6), torch.randn(4, 6)
    i = torch.randint(0, 6, (4, 6))
    i[2, 3] = 9
    graph = _trace(scatter_add, (x, torch.zeros_like(i), s))
    with pytest.raises(BadInputError, match="9"):
        Interpreter(compile_with(graph).tables).run([x, i, s])


def test_unsupported_forms_are_refused_with_the_reason():
    from torch._dynamo.exc import BackendCompilerFailed  # wraps mpk's UnsupportedOpError

    x, m, v = torch.randn(4, 6), torch.randn(4, 6) > 0, torch.randn(())
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed, match="boolean mask .* lowers for one mask and one value"):
        torch.compile(lambda x, m, v: x.index_put((m,), v.expand(3)), backend="mpk", options=OPTS)(x, m, v)
    torch._dynamo.reset()
    with pytest.raises(BackendCompilerFailed, match="alpha"):
        torch.compile(lambda x, i: x.index_add(0, i, x[:2], alpha=2), backend="mpk", options=OPTS)(x, torch.tensor([0, 0]))


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")
def test_scatter_tasks_compile_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))

    def fn(x, i, s, j, v):
        x = x * 2
        x[1:, 1::2] = s[:, :4]  # slice_scatter (of a slice_scatter)
        return scatter_amax(x, i, s).index_add(0, j, v), index_assign(x.long(), j[:1], v[:1].long())

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(6, 8, generator=g), torch.randint(0, 8, (5, 8), generator=g), torch.randn(5, 8, generator=g),
            torch.randint(0, 6, (9,), generator=g), torch.randn(9, 8, generator=g))
    graph = _trace(fn, args)
    kinds = {op.kind for op in graph.ops}
    assert {"slice_scatter", "scatter"} <= kinds, kinds
    src = generate(compile_with(graph, partition=random_partition(graph, random.Random(0))).tables)
    assert "task_slice_scatter" in src and "task_scatter" in src
    cubin = build.build_cubin(src, "sm_90a", tile_kernel=True)
    assert cubin.read_bytes()[:4] == b"\x7fELF"


def test_a_device_transfer_lowers_only_to_where_the_graphs_inputs_are():
    """The device-transfer rule's helpers: devices match with an unnamed index standing for any;
    the model's device is where every input of more than one element is (none when they are on
    two devices)."""
    from torch.fx import Graph

    from mpk.frontend.rules.views import _is_model_device, _same_device

    assert _same_device(torch.device("cuda"), torch.device("cuda:0"))
    assert not _same_device(torch.device("cuda:1"), torch.device("cuda:0"))
    assert not _same_device(torch.device("cpu"), torch.device("cuda"))
    g = Graph()
    for name, val in (("x", torch.empty(4, 8, device="meta")), ("s", torch.empty((), device="cpu"))):
        g.placeholder(name).meta["val"] = val
    assert _is_model_device(g, torch.device("meta")) and not _is_model_device(g, torch.device("cpu"))
    g.placeholder("y").meta["val"] = torch.empty(3, device="cpu")
    assert not _is_model_device(g, torch.device("meta")) and not _is_model_device(g, torch.device("cpu"))
