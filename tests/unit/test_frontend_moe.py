"""Mixture-of-experts routing: floor_divide and div's rounding modes, one_hot, histc,
bincount (its length static: minlength), the softmax → topk → renormalise routing, and the
grouped expert GEMM (``expert_matmul``: bmm of a per-row gathered expert weight, fused from
``W[ids]`` + bmm / matmul / einsum). Each compiles whole in strict mode on the CPU executor against
eager float32; a tiny Mixtral- / Qwen3-MoE-shaped layer (transformers' sparse MoE blocks with
the ``batched_mm`` experts, and a plain torch module) within 1e-5 relative, as do tiny Mixtral
and Qwen3-MoE causal LMs compiled whole; random tilings run on the interpreter with the
dependency oracle; the generated CUDA builds for sm_90a."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from mpk.backend import COMPILED
from mpk.errors import BadInputError
from mpk.executors import Interpreter, build
from mpk.executors.codegen import generate
from mpk.testing.graphs import check_dependencies, compile_with, random_partition, relative_error, trace_graph
from mpk.testing.tolerance import rounding_bound

OPTS = {"executor": "cpu", "num_workers": 8, "fallback": "error"}


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="mpk", fullgraph=True, options=OPTS)


def _kinds() -> set[str]:
    return {op.kind for op in COMPILED[-1].graph.ops}


# --- the elementwise and counting ops ------------------------------------------------------------

def test_floor_and_trunc_division_match_eager():
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-1000, 1000, (7, 9), generator=g)
    b = torch.randint(1, 13, (7, 9), generator=g) * torch.where(torch.rand(7, 9, generator=g) > 0.5, 1, -1)
    x, y = torch.randn(7, 9, generator=g) * 10, torch.randn(7, 9, generator=g) + 3
    x[0, :3], y[0, :3] = torch.tensor([1.0, -1.0, 0.3]), 0.1  # floor(1 / 0.1) = 10, but 1 // 0.1 = 9

    def fn(a, b, x, y):
        return (a // b, torch.floor_divide(a, 4), torch.div(a, b, rounding_mode="trunc"), a // -3,
                x // y, torch.div(x, y, rounding_mode="floor"), torch.div(x, 0.7, rounding_mode="trunc"),
                a // 2.5, x.double() // y)

    with torch.no_grad():
        out, ref = _compile(fn)(a, b, x, y), fn(a, b, x, y)
    assert "rounded_div" in _kinds()
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype
        torch.testing.assert_close(o, r, rtol=0, atol=0)


def test_one_hot_histc_bincount_match_eager():
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 6, (9, 2), generator=g)  # 18 draws of 6 values: ties
    w = torch.randn(18, generator=g)
    v = torch.randint(-3, 4, (5, 7), generator=g).float() + 0.5 * torch.randint(0, 2, (5, 7), generator=g)

    def fn(idx, w, v):
        flat = idx.flatten()
        return (F.one_hot(idx, 6), F.one_hot(flat, num_classes=8).sum(0), torch.bincount(flat, minlength=6),
                flat.bincount(w, 7), torch.histc(v, bins=7, min=-3, max=3), torch.histc(v, bins=4))

    with torch.no_grad():
        out, ref = _compile(fn)(idx, w, v), fn(idx, w, v)
    assert {"one_hot", "histogram"} <= _kinds()
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and o.shape == r.shape
        torch.testing.assert_close(o, r, rtol=0, atol=0)  # counts, and a weighted sum in eager's entry order


def test_out_of_range_values_are_reported():
    idx = torch.randint(0, 4, (6,))
    idx[3] = 9
    with torch.no_grad(), pytest.raises(BadInputError, match="9"):
        _compile(lambda i: torch.bincount(i, minlength=4) * 2)(idx)
    with torch.no_grad(), pytest.raises(BadInputError, match="9"):
        _compile(lambda i: F.one_hot(i, 4) + 1)(idx)

    w, x = torch.randn(5, 3, 4), torch.randn(6, 4)
    ids = torch.tensor([0, -1, 4, -5, 2, 1])  # negative ids count from the end, as W[ids] does
    fn = _compile(lambda x, w, i: torch.bmm(w[i], x.unsqueeze(-1)))
    with torch.no_grad():
        torch.testing.assert_close(fn(x, w, ids), torch.bmm(w[ids], x.unsqueeze(-1)))
        assert "expert_matmul" in _kinds()
        ids[2] = 7
        with pytest.raises(BadInputError, match="7"):
            fn(x, w, ids)


def test_data_dependent_sizes_are_refused_with_the_reason():
    from torch._dynamo.exc import BackendCompilerFailed  # wraps mpk's UnsupportedOpError

    idx = torch.randint(0, 4, (6,))
    with pytest.raises(BackendCompilerFailed, match="minlength"):
        _compile(lambda i: torch.bincount(i) + 1)(idx)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="num_classes"):  # Dynamo's own refusal
        _compile(lambda i: F.one_hot(i) + 1)(idx)


# --- routing and the grouped expert GEMM -----------------------------------------------------------

class PlainMoE(torch.nn.Module):
    """A Mixtral-style sparse MoE layer in plain torch: softmax → top-k → renormalise, the
    selected experts' SwiGLU MLPs as gathered weights and bmm, the weighted sum over k."""

    def __init__(self, hidden: int = 64, inter: int = 32, experts: int = 8, k: int = 2):
        super().__init__()
        self.k = k
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.gate_up = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden) * 0.1)
        self.down = torch.nn.Parameter(torch.randn(experts, hidden, inter) * 0.1)

    def routing(self, x):
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.k, dim=-1)
        return weights / weights.sum(-1, keepdim=True), experts

    def forward(self, x):
        tokens, hidden = x.shape
        weights, experts = self.routing(x)
        ids = experts.reshape(-1)
        xs = x.repeat_interleave(self.k, dim=0)
        gate, up = torch.bmm(self.gate_up[ids], xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (y.view(tokens, self.k, hidden) * weights.unsqueeze(-1)).sum(1)


class MatmulMoE(PlainMoE):
    """The same layer with an n-D expert index and matmul (``W[experts] @ x``)."""

    def forward(self, x):
        weights, experts = self.routing(x)
        gate, up = (self.gate_up[experts] @ x[:, None, :, None]).squeeze(-1).chunk(2, dim=-1)
        y = (self.down[experts] @ (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (y * weights.unsqueeze(-1)).sum(1)


class EinsumMoE(PlainMoE):
    """The same layer with the experts as einsums over the gathered weights."""

    def forward(self, x):
        tokens, hidden = x.shape
        weights, experts = self.routing(x)
        ids = experts.reshape(-1)
        xs = x.repeat_interleave(self.k, dim=0)
        gate, up = torch.einsum("sh,sih->si", xs, self.gate_up[ids]).chunk(2, dim=-1)
        y = torch.einsum("si,shi->sh", F.silu(gate) * up, self.down[ids])
        return torch.einsum("tkh,tk->th", y.view(tokens, self.k, hidden), weights)


class DenseMoE(PlainMoE):
    """The dense formulation: the top-k weights scattered into a [tokens, experts] matrix, every
    expert run on every token and weighted by its column."""

    def forward(self, x):
        weights, experts = self.routing(x)
        dense = torch.zeros(x.shape[0], self.gate_up.shape[0]).scatter(1, experts, weights)
        out = torch.zeros_like(x)
        for e in range(self.gate_up.shape[0]):
            gate, up = (x @ self.gate_up[e].t()).chunk(2, dim=-1)
            out = out + (F.silu(gate) * up) @ self.down[e].t() * dense[:, e:e + 1]
        return out


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("cls", [PlainMoE, MatmulMoE, EinsumMoE, DenseMoE])
def test_plain_moe_layer_matches_eager(cls, tokens):
    torch.manual_seed(tokens)
    m = cls().eval()
    x = torch.randn(tokens, 64)
    with torch.no_grad():
        out, ref = _compile(m)(x), m(x)
    if cls is not DenseMoE:
        assert "expert_matmul" in _kinds()  # the gathered weight is read in place, not copied
    assert relative_error(out, ref) <= 1e-5


def _transformers_block(name: str):
    transformers = pytest.importorskip("transformers")
    if name == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8,
                                         num_experts_per_tok=2)
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        cfg = transformers.Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=4,
                                          num_experts_per_tok=2, norm_topk_prob=True)
    # the default experts loop over the experts hit (nonzero: data-dependent shapes); batched_mm
    # gathers each token's expert weights and runs bmm, which lowers to expert_matmul
    cfg._experts_implementation = "batched_mm"
    block = Block(cfg).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return block


@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_transformers_sparse_moe_block_matches_eager(name, tokens):
    torch.manual_seed(tokens)
    block = _transformers_block(name)
    x = torch.randn(1, tokens, 64)
    with torch.no_grad():
        out, ref = _compile(block)(x), block(x)
    out, ref = (out[0], ref[0]) if isinstance(ref, tuple) else (out, ref)
    assert "expert_matmul" in _kinds()
    assert relative_error(out, ref) <= 1e-5


def _moe_ops(x, w, ids, v):
    """Every new kind in one graph (the custom ops as route_moe / pattern fusion make them)."""
    flat = ids.flatten()
    y = torch.bmm(w[flat], x.repeat_interleave(2, dim=0).unsqueeze(-1)).squeeze(-1)
    back = torch.einsum("sn,snk->sk", y, w[flat])  # the gathered weight transposed
    return (y, back, torch.ops.mpk.one_hot(ids, 5), torch.ops.mpk.bincount(flat, None, 5),
            torch.ops.mpk.bincount(flat, y[:, 0], 5), torch.histc(v, 6, -2, 2), flat // 2)


def _moe_args(seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(6, 16, generator=g), torch.randn(5, 12, 16, generator=g),
            torch.randint(0, 5, (6, 2), generator=g), torch.randn(4, 9, generator=g))


@pytest.mark.parametrize("seed", range(3))
def test_random_tilings_on_the_interpreter(seed):
    args = _moe_args(seed)
    graph = trace_graph(_moe_ops, args)
    kinds = [op.kind for op in graph.ops]
    assert kinds.count("expert_matmul") == 2 and {"one_hot", "histogram", "rounded_div"} <= set(kinds)
    compiled = compile_with(graph, partition=random_partition(graph, random.Random(seed)))
    check_dependencies(compiled.tables)
    outs = Interpreter(compiled.tables).run(list(args))
    for o, r in zip(outs, _moe_ops(*args)):
        bound = rounding_bound(torch.float32, 2, k=16 + 12) if o.is_floating_point() else 0
        assert relative_error(o, r) <= bound


@pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed")
def test_moe_tasks_compile_for_sm90a(tmp_path, monkeypatch):
    monkeypatch.setenv("MPK_CACHE_DIR", str(tmp_path))
    graph = trace_graph(_moe_ops, _moe_args(0))
    src = generate(compile_with(graph, partition=random_partition(graph, random.Random(0))).tables)
    for task in ("task_expert_matmul", "task_one_hot", "task_histogram", "task_rounded_div"):
        assert task in src
    cubin = build.build_cubin(src, "sm_90a", tile_kernel=True)
    assert cubin.read_bytes()[:4] == b"\x7fELF"


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_tiny_transformers_moe_model_compiles_whole(name):
    transformers = pytest.importorskip("transformers")
    common = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2,
              "max_position_embeddings": 64}
    if name == "mixtral":
        cfg = transformers.MixtralConfig(num_local_experts=4, **common)
        model_cls = transformers.MixtralForCausalLM
    else:
        cfg = transformers.Qwen3MoeConfig(num_experts=4, moe_intermediate_size=32, head_dim=16, **common)
        model_cls = transformers.Qwen3MoeForCausalLM
    cfg._experts_implementation = "batched_mm"
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_cls(cfg).eval()
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        out = _compile(model)(ids, use_cache=False).logits
        ref = model(ids, use_cache=False).logits
    assert "expert_matmul" in _kinds()
    assert relative_error(out, ref) <= 1e-5
