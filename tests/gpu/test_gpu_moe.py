"""MoE routing on the GPU (marker ``gpu``; skipped without CUDA): the ``one_hot``, ``histogram``
and ``expert_matmul`` tasks and floor division against eager PyTorch, and a bf16 Mixtral-shaped
sparse MoE layer (plain torch, and transformers' block with the ``batched_mm`` experts) in one
persistent kernel against a float64 reference (transformers' block in float32: its router
shares the block's dtype).

Counts, one-hot masks and integer division are exact. The layer's bound counts its roundings to
bf16 (mpk.testing.tolerance): the gate·up projection (1), SiLU·mul (SILU_GAIN + 1), the down
projection (1), the routing weight's cast and its product (2) and the sum over the k experts
(1), with the hidden- and inter-term fp32 sums; routing runs in float32 (a float32 router), so
the experts picked agree with the reference's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mpk.testing.graphs import relative_error
from mpk.testing.tolerance import SILU_GAIN, rounding_bound

pytestmark = pytest.mark.gpu
DEV = "cuda"
OPTS = {"executor": "gpu", "fallback": "error"}
HIDDEN, INTER = 64, 32
LAYER_GAINS = 1 + (SILU_GAIN + 1) + 1 + 2 + 1


def _compile(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="mpk", fullgraph=True, options=OPTS)


def _routing_ops(idx, w, v, a, b):
    flat = idx.flatten()
    return (F.one_hot(idx, 6), torch.bincount(flat, minlength=6), torch.histc(v, bins=7, min=-3, max=3),
            torch.histc(v, bins=4), a // b, torch.div(a, b, rounding_mode="trunc"), v // (w[:35].view(5, 7) + 3),
            torch.tensor([1.0, -1.0, 0.3], device=v.device) // 0.1, flat.bincount(w, 6))


def test_routing_ops_match_eager():
    g = torch.Generator(device=DEV).manual_seed(0)
    idx = torch.randint(0, 6, (33, 2), device=DEV, generator=g)
    w = torch.randn(66, device=DEV, generator=g)
    # values on a 0.5 grid: ties, and none on a bin edge but the range's ends
    v = torch.randint(-6, 7, (5, 7), device=DEV, generator=g).float() / 2
    a = torch.randint(-1000, 1000, (7, 9), device=DEV, generator=g)
    b = torch.randint(1, 13, (7, 9), device=DEV, generator=g) * (1 - 2 * (torch.rand(7, 9, device=DEV) > 0.5).long())
    with torch.no_grad():
        out, ref = _compile(_routing_ops)(idx, w, v, a, b), _routing_ops(idx, w, v, a, b)
    for o, r in zip(out[:-1], ref[:-1]):
        assert o.dtype == r.dtype
        torch.testing.assert_close(o, r, rtol=0, atol=0)
    # eager's weighted bincount adds with atomics in any order; the task in entry order
    assert relative_error(out[-1], ref[-1]) <= rounding_bound(torch.float32, 0, k=66)


class PlainMoE(torch.nn.Module):
    """softmax → top-2 → renormalise in float32; SwiGLU experts as gathered weights and bmm."""

    def __init__(self, experts: int = 8, k: int = 2, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.k = k
        self.router = torch.nn.Parameter(torch.randn(experts, HIDDEN, device=DEV) * 0.1)
        self.gate_up = torch.nn.Parameter((torch.randn(experts, 2 * INTER, HIDDEN, device=DEV) * 0.1).to(dtype))
        self.down = torch.nn.Parameter((torch.randn(experts, HIDDEN, INTER, device=DEV) * 0.1).to(dtype))

    def forward(self, x):
        tokens = x.shape[0]
        probs = torch.softmax(x.to(self.router.dtype) @ self.router.t(), dim=-1)
        weights, experts = torch.topk(probs, self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        ids = experts.reshape(-1)
        xs = x.repeat_interleave(self.k, dim=0)
        gate, up = torch.bmm(self.gate_up[ids], xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(self.down[ids], (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)
        return (y.view(tokens, self.k, HIDDEN) * weights.unsqueeze(-1).to(y.dtype)).sum(1)


def _float64_copy(m: torch.nn.Module) -> torch.nn.Module:
    import copy

    return copy.deepcopy(m).double()


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_bf16_moe_layer_matches_float64(tokens):
    torch.manual_seed(tokens)
    m = PlainMoE().eval()
    x = torch.randn(tokens, HIDDEN, device=DEV).to(torch.bfloat16)
    with torch.no_grad():
        out = _compile(m)(x)
        ref = _float64_copy(m)(x.double())
    assert out.dtype == torch.bfloat16
    assert relative_error(out, ref) <= rounding_bound(torch.bfloat16, LAYER_GAINS, k=HIDDEN + INTER)


@pytest.mark.parametrize("tokens", [1, 64])
def test_mixtral_block_matches_float64(tokens):
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=8,
                                     num_experts_per_tok=2)
    cfg._experts_implementation = "batched_mm"  # the default loops over the experts hit (nonzero)
    torch.manual_seed(tokens)
    # float32: its router is a linear in the block's dtype, and bf16 router logits could pick other
    # experts than the reference's
    block = MixtralSparseMoeBlock(cfg).to(DEV).eval()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(1, tokens, HIDDEN, device=DEV)
    with torch.no_grad():
        out = _compile(block)(x)
        ref = _float64_copy(block)(x.double())
    out, ref = (out[0], ref[0]) if isinstance(ref, tuple) else (out, ref)
    assert relative_error(out, ref) <= rounding_bound(torch.float32, LAYER_GAINS, k=HIDDEN + INTER)
