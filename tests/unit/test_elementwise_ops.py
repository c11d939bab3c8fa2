"""Elementwise ops, reductions over any dims, (log-)softmax and cumsum/cumprod over any dim, norms,
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

from mpk.backend import COMPILED
from mpk.testing.graphs import relative_error
from mpk.testing.op_zoo import CASES, Zoo, labels, zoo_inputs

F32_TOL, BF16_TOL, F64_TOL = 1e-5, 1e-2, 1e-12
TOL = {torch.float32: F32_TOL, torch.bfloat16: BF16_TOL, torch.float64: F64_TOL}

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
    args = zoo_inputs(dtype, device)
    model = Zoo(list(names))
    with torch.no_grad():
        # bfloat16: eager on the CPU, whose reductions and scans accumulate in float32 as mpk's
        # tasks do (CUDA's bfloat16 cumsum accumulates in bfloat16: 7 ulps off over 8192 terms)
        ref = model(*[a.cpu() for a in args]) if dtype == torch.bfloat16 else model(*args)
        out = torch.compile(model, backend="mpk", dynamic=False, options={"executor": executor})(*args)
    bad = _mismatches(out, ref, labels(names, args), TOL[dtype])
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


# Cases whose every op keeps float64 on the GPU (GpuSpec.float64_exact: elementwise functions in
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


def test_a_cat_of_more_pieces_than_a_task_takes_is_a_tree_of_cats():
    """torch.cat of 11 tensors: cats of at most 8 inputs each (a CUDA task's views), joined
    again; the result is eager's and the generated CUDA accepts every op."""
    from mpk.backend import COMPILED
    from mpk.executors.codegen import generate

    xs = [torch.randn(3, i + 1) for i in range(11)]
    torch._dynamo.reset()
    out = torch.compile(lambda *xs: torch.cat([x * 2 for x in xs], 1), backend="mpk",
                        options={"executor": "cpu"})(*xs)
    assert torch.equal(out, torch.cat([x * 2 for x in xs], 1))
    cats = [len(op.inputs) for op in COMPILED[-1].graph.ops if op.kind == "cat"]
    assert sorted(cats) == [2, 3, 8] and "cat" in generate(COMPILED[-1].tables)
