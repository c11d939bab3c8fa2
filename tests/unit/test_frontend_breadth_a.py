"""``tril`` / ``triu``, ``baddbmm`` / ``addbmm``, tensor constants made
inside forward, ``repeat`` / ``tile`` and ``roll`` through ``torch.compile(backend="mpk")`` in strict mode
(fallback "error") on the CPU interpreter, against eager PyTorch; a causal-mask and a BLOOM-style
ALiBi snippet; and the generated CUDA of a graph of the new tasks built for sm_90a.

Tolerances: element moves (tril, triu, repeat, constants) are exact; a matmul's float32 result is
compared with a float64 reference from the same inputs within ``rounding_bound`` of its roundings
and its K-term fp32 sum (mpk.testing.tolerance derives it)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mpk.backend import COMPILED
from mpk.executors import build
from mpk.testing.graphs import relative_error
from mpk.testing.tolerance import rounding_bound

OPTIONS = {"executor": "cpu", "num_workers": 8, "fallback": "error"}
needs_nvcc = pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")


def _compiled(fn, *args):
    torch._dynamo.reset()
    with torch.no_grad():
        return torch.compile(fn, backend="mpk", options=OPTIONS)(*args)


def _kinds() -> list[str]:
    return [op.kind for op in COMPILED[-1].graph.ops]


def _assert_exact(out, ref) -> None:
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        torch.testing.assert_close(o, r, rtol=0, atol=0, equal_nan=True)


# --- tril / triu ---------------------------------------------------------------------------------

DIAGONALS = (-3, -1, 0, 2, 9)


def _triangles(x):
    return tuple(f(x, d) for d in DIAGONALS for f in (torch.tril, torch.triu))


# (50, 70) and (3, 40, 60): several tiles per op at 8 workers, so each tile's mask comes from its
# own rows and columns; (1, 1) and (4, 1): degenerate triangles
@pytest.mark.parametrize("shape", [(5, 6), (50, 70), (3, 40, 60), (2, 3, 7, 4), (1, 1), (4, 1)])
def test_tril_triu_match_eager(shape):
    x = torch.randn(shape)
    x.view(-1)[::7] = float("nan")  # a NaN outside the triangle becomes 0, inside it stays
    _assert_exact(_compiled(_triangles, x), _triangles(x))
    assert set(_kinds()) == {"triangle"}


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float64])
def test_tril_triu_of_other_dtypes_and_strided_views(dtype):
    x = torch.randint(0, 3, (6, 9)).to(dtype)
    fn = lambda x: (torch.tril(x.t(), 1), torch.triu(x[1:, ::2], -1))  # noqa: E731
    _assert_exact(_compiled(fn, x), fn(x))


def test_tril_of_a_vector_is_refused_as_torch_refuses_it():
    with pytest.raises(Exception, match="tril"):
        _compiled(torch.tril, torch.randn(5))


def _attention_bound(head_dim: int, seq: int) -> float:
    # the scores' head_dim-term sum, the softmax's seq-term sum and P·V's seq-term sum in fp32,
    # and the roundings of scores, exp, P and the output (float32 each)
    return rounding_bound(torch.float32, 4, k=head_dim + 2 * seq)


@pytest.mark.parametrize("seq,head_dim", [(7, 8), (33, 16)])
def test_causal_mask_made_in_forward(seq, head_dim):
    """The causal mask as models build it inside forward: a bool tril of ones, and an additive
    -inf triu above the diagonal."""

    def attend(q, k, v):
        scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
        keep = torch.ones(seq, seq, dtype=torch.bool).tril()
        masked = scores.masked_fill(~keep, float("-inf")).softmax(-1) @ v
        additive = torch.full((seq, seq), float("-inf")).triu(diagonal=1)
        return masked, (scores + additive).softmax(-1) @ v

    q, k, v = (torch.randn(2, 3, seq, head_dim) for _ in range(3))
    out = _compiled(attend, q, k, v)
    ref = attend(q.double(), k.double(), v.double())
    for o, r in zip(out, ref):
        assert relative_error(o.double(), r) <= _attention_bound(head_dim, seq)
    assert "triangle" in _kinds()


# --- baddbmm / addbmm ----------------------------------------------------------------------------

@pytest.mark.parametrize("b,m,k,n,bias_shape,beta,alpha", [
    (3, 4, 7, 5, (3, 4, 5), 1.0, 1.0),
    (2, 17, 33, 9, (2, 17, 9), 0.5, -2.0),
    (4, 6, 16, 8, (1, 8), 2.0, 0.125),     # a bias broadcast over the batch and the rows
    (2, 5, 3, 4, (2, 5, 4), 0.0, 1.5),     # beta = 0: the bias is ignored, NaN included
])
def test_baddbmm_is_one_matmul(b, m, k, n, bias_shape, beta, alpha):
    bias, a, w = torch.randn(bias_shape), torch.randn(b, m, k), torch.randn(b, k, n)
    if beta == 0:
        bias[..., 0] = float("nan")
    fn = lambda bias, a, w: torch.baddbmm(bias, a, w, beta=beta, alpha=alpha)  # noqa: E731
    out = _compiled(fn, bias, a, w)
    assert _kinds() == ["matmul"]
    ref = alpha * (a.double() @ w.double()) + (beta * bias.double() if beta != 0 else 0)
    assert out.shape == ref.shape and relative_error(out.double(), ref) <= rounding_bound(torch.float32, 3, k=k)


@pytest.mark.parametrize("b,m,k,n,beta,alpha", [(3, 4, 7, 5, 1.0, 1.0), (5, 12, 9, 20, -0.5, 3.0),
                                               (2, 3, 4, 6, 0.0, 1.0)])
def test_addbmm_sums_the_batch_in_one_matmul(b, m, k, n, beta, alpha):
    bias, a, w = torch.randn(m, n), torch.randn(b, m, k), torch.randn(b, k, n)
    fn = lambda bias, a, w: torch.addbmm(bias, a, w, beta=beta, alpha=alpha)  # noqa: E731
    out = _compiled(fn, bias, a, w)
    assert _kinds().count("matmul") == 1  # and a copy joining a's batch with its columns
    ref = alpha * (a.double() @ w.double()).sum(0) + beta * bias.double()
    assert relative_error(out.double(), ref) <= rounding_bound(torch.float32, 3, k=b * k)


# --- tensors made inside forward -----------------------------------------------------------------

def test_tensor_constants_are_lifted_and_fills_computed():
    def fn(x, i):
        scale = torch.tensor([[1.0, -2.0, 0.5], [3.0, 0.25, -1.0]])
        offsets = torch.tensor([5, -7, 11])
        return (x * scale, i + offsets, x[:, [2, 0]], torch.ones(2, 3) + x, torch.zeros(3, dtype=torch.int64) - i,
                torch.arange(3) * i, torch.arange(1.0, 4.0, 0.5), torch.full((2, 3), 2.5) * x)

    x, i = torch.randn(2, 3), torch.randint(-9, 9, (3,))
    _assert_exact(_compiled(fn, x, i), fn(x, i))


def test_lifted_constants_reach_a_graph_that_falls_back():
    """With fallback="eager" the graph is split around an unsupported op; the lifted constants
    still arrive after the caller's arguments."""
    def fn(x):
        y = x * torch.tensor([2.0, -1.0, 0.5])
        return torch.nan_to_num(torch.log(y - 1.0), nan=0.0) + torch.tensor([1.0, 2.0, 3.0])

    x = torch.randn(4, 3)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.warns(UserWarning, match="fallback='eager'"):
        out = torch.compile(fn, backend="mpk", options=dict(OPTIONS, fallback="eager"))(x)
    torch.testing.assert_close(out, fn(x), rtol=1e-6, atol=1e-6)


# --- repeat / tile -------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,reps", [((4, 3), (2, 1)), ((4, 3), (1, 3)), ((4, 3), (2, 1, 3)),
                                        ((2, 3, 5), (3, 2, 2)), ((5,), (1, 1)), ((3, 1, 2), (1, 4, 1)),
                                        ((4, 3), (0, 2)), ((), (3, 2))])
def test_repeat_and_tile_match_eager(shape, reps):
    x = torch.randn(shape)
    fn = lambda x: (x.repeat(*reps), torch.tile(x, reps[1:]))  # noqa: E731  (tile: fewer reps than dims too)
    _assert_exact(_compiled(fn, x), fn(x))


def test_repeat_along_unit_dims_moves_no_data():
    # repeats only where x's dim (or a new leading one) is 1: a strided view, read by the add
    fn = lambda x: x.repeat(2, 1, 4, 1) + 1.0  # noqa: E731
    x = torch.randn(3, 1, 5)
    _assert_exact([_compiled(fn, x)], [fn(x)])
    assert _kinds() == ["pointwise"]


# --- roll ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,shifts,dims", [((6, 8), 3, 1), ((6, 8), -2, 0), ((2, 3, 4), -1, -2),
                                               ((4, 5, 9), (1, -7), (0, 2)), ((2, 3, 4), (2, 1, 3), (0, 1, 2)),
                                               ((3, 4), 5, None), ((5,), 10, 0), ((2, 0, 3), 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_roll_matches_eager(shape, shifts, dims, dtype):
    # no dims: the flattened tensor rolls; a shift of a whole turn, or along an empty dim, moves nothing
    x = torch.randn(shape).mul(100).to(dtype)
    fn = lambda x: ((x * 2).roll(shifts) if dims is None else (x * 2).roll(shifts, dims),)
    _assert_exact(_compiled(fn, x), fn(x))


def test_roll_is_one_cat_per_rolled_dim():
    fn = lambda x: x.roll((1, 0, 2), (0, 1, 2)) + 1.0
    x = torch.randn(3, 4, 5)
    _assert_exact([_compiled(fn, x)], [fn(x)])
    assert _kinds().count("cat") == 2


# --- model snippets ------------------------------------------------------------------------------

def _bloom_attention(hidden, w_qkv, heads: int):
    """BLOOM's attention scores: ALiBi slopes from constants made in forward, repeated over the
    batch, added to q·kᵀ by baddbmm; a causal mask from tril; softmax; ·v."""
    batch, seq, width = hidden.shape
    head_dim = width // heads
    base = torch.tensor(2.0 ** -(8.0 / heads))
    slopes = torch.pow(base, torch.arange(1, heads + 1, dtype=torch.float32)).to(hidden.dtype)  # powers of 2: exact
    alibi = slopes[:, None, None] * torch.arange(seq, dtype=hidden.dtype)[None, None, :]  # [H, 1, S]
    alibi = alibi.repeat(batch, 1, 1)  # [B·H, 1, S]
    q, k, v = (hidden @ w_qkv).view(batch, seq, 3, heads, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    q, k, v = (t.reshape(batch * heads, seq, head_dim) for t in (q, k, v))
    scores = alibi.baddbmm(q, k.transpose(1, 2), beta=1.0, alpha=1.0 / math.sqrt(head_dim))
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()
    probs = F.softmax(scores.masked_fill(~causal, torch.finfo(scores.dtype).min), dim=-1)
    return torch.bmm(probs, v).view(batch, heads, seq, head_dim)


@pytest.mark.parametrize("batch,seq,heads,head_dim", [(2, 9, 4, 8), (1, 20, 2, 16)])
def test_bloom_alibi_snippet(batch, seq, heads, head_dim):
    hidden = torch.randn(batch, seq, heads * head_dim)
    w_qkv = torch.randn(heads * head_dim, 3 * heads * head_dim) / math.sqrt(heads * head_dim)
    fn = lambda h, w: _bloom_attention(h, w, heads)  # noqa: E731
    out = _compiled(fn, hidden, w_qkv)
    ref = fn(hidden.double(), w_qkv.double())
    width = heads * head_dim  # the projection's sum feeds the scores: its roundings count too
    assert relative_error(out.double(), ref) <= _attention_bound(head_dim, seq) + rounding_bound(torch.float32, 2, k=width)
    assert {"triangle", "matmul"} <= set(_kinds())


# --- the CUDA tasks ------------------------------------------------------------------------------

class _NewOps(torch.nn.Module):
    def forward(self, x, bias, a, w, s):
        return (torch.tril(x, -1), torch.triu(x.to(torch.bfloat16), 2), torch.baddbmm(bias, a, w, beta=0.5, alpha=2.0),
                torch.addbmm(bias[0], a, w), x.repeat(2, 3) * torch.tensor([1.0, 2.0, 3.0, 4.0] * 3),
                torch.ones(5, 5, dtype=torch.bool).tril() & s)


@needs_nvcc
def test_generated_cuda_of_the_new_tasks_compiles_for_sm90a(tmp_path, monkeypatch):
    from mpk.executors.codegen import generate
    from mpk.inspection import compile_module

    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    args = (torch.randn(6, 4), torch.randn(3, 4, 5), torch.randn(3, 4, 7), torch.randn(3, 7, 5),
            torch.rand(5, 5) > 0.5)
    compiled = compile_module(_NewOps(), args, {"num_workers": 8})
    assert {"triangle", "matmul", "copy"} <= {op.kind for op in compiled.graph.ops}
    src = generate(compiled.tables)
    assert "task_triangle" in src
    cubin = build.build_cubin(src, "sm_90a", tile_kernel=True)
    assert cubin.read_bytes()[:4] == b"\x7fELF"


# --- Hugging Face's default cache ----------------------------------------------------------------

def _tiny_lm(family: str):
    transformers = pytest.importorskip("transformers")
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)
        return transformers.LlamaForCausalLM(cfg).eval()
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_default_cache_call_compiles_whole(family):
    """model(input_ids) as transformers calls it (use_cache=True: a DynamicCache that makes its
    empty key and value tensors with torch.tensor([]) inside forward) compiles in strict mode."""
    model = _tiny_lm(family)
    ids = torch.randint(0, 64, (2, 7))
    with torch.no_grad():
        ref = model(ids)
    out = _compiled(model, ids)
    # float32 against eager float32 (1e-5 of the largest |logit|)
    assert relative_error(out.logits, ref.logits) <= 1e-5
    keys = lambda o: [layer.keys for layer in o.past_key_values.layers]  # noqa: E731
    for k, r in zip(keys(out), keys(ref)):
        assert relative_error(k, r) <= 1e-5
