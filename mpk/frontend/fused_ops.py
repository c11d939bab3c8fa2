"""mpk's fused ops as PyTorch custom ops (``torch.ops.mpk.*``).

Pattern fusion rewrites FX subgraphs into calls of these ops, so a rewritten graph still runs
eagerly (the fallback path relies on it) and models may call them directly. Each eager
implementation is the op kind's own CPU kernel applied to the whole tensor: one definition of
the math, shared with the CPU interpreter.
"""

from __future__ import annotations

import torch

from mpk.ir.regions import full_rect
from mpk.ops import OpSig, get_op


def _run_whole(kind: str, inputs: list[torch.Tensor], out_dtype: torch.dtype, **attrs) -> torch.Tensor:
    out_shape = torch.broadcast_shapes(*[t.shape for t in inputs])
    sig = OpSig(tuple(tuple(t.shape) for t in inputs), tuple(out_shape), out_dtype, attrs)
    return get_op(kind).cpu(sig, full_rect(tuple(out_shape)), inputs).contiguous()


@torch.library.custom_op("mpk::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             compute_dtype: torch.dtype, norm_dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm as Llama/Qwen write it: normalise in ``compute_dtype``, cast to ``norm_dtype``, scale."""
    inputs = [x] + ([weight] if weight is not None else [])
    return _run_whole("rms_norm", inputs, rms_norm_out_dtype(x, weight, norm_dtype), eps=eps,
                      has_weight=weight is not None, compute_dtype=str(compute_dtype)[6:],
                      norm_dtype=str(norm_dtype)[6:])


def rms_norm_out_dtype(x: torch.Tensor, weight: torch.Tensor | None, norm_dtype: torch.dtype) -> torch.dtype:
    return norm_dtype if weight is None else torch.promote_types(norm_dtype, weight.dtype)


@rms_norm.register_fake
def _(x, weight, eps, compute_dtype, norm_dtype):
    return x.new_empty(x.shape, dtype=rms_norm_out_dtype(x, weight, norm_dtype))


@torch.library.custom_op("mpk::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form: ``x·cos + cat(-x2, x1)·sin``."""
    dtype = torch.promote_types(x.dtype, torch.promote_types(cos.dtype, sin.dtype))
    return _run_whole("rope", [x, cos, sin], dtype)


@rope.register_fake
def _(x, cos, sin):
    dtype = torch.promote_types(x.dtype, torch.promote_types(cos.dtype, sin.dtype))
    return x.new_empty(torch.broadcast_shapes(x.shape, cos.shape, sin.shape), dtype=dtype)


@torch.library.custom_op("mpk::silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``."""
    return _run_whole("silu_mul", [gate, up], torch.promote_types(gate.dtype, up.dtype))


@silu_mul.register_fake
def _(gate, up):
    return gate.new_empty(torch.broadcast_shapes(gate.shape, up.shape),
                          dtype=torch.promote_types(gate.dtype, up.dtype))


@torch.library.custom_op("mpk::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
              is_causal: bool, scale: float | None, enable_gqa: bool) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` kept whole through AOTAutograd (which would otherwise
    pick a backend-specific kernel or decompose it into matmuls and a softmax)."""
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


@attention.register_fake
def _(q, k, v, attn_mask, is_causal, scale, enable_gqa):
    return q.new_empty(q.shape[:-1] + (v.shape[-1],))
