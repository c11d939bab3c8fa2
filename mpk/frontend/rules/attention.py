"""Rules for scaled dot-product attention in every ATen form it traces to."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.frontend.rules.registry import handles
from mpk.frontend.values import Unavailable, Unsupported
from mpk.ir.views import View

if TYPE_CHECKING:
    pass

aten, prims, mpk_ops = torch.ops.aten, torch.ops.prims, torch.ops.mpk


def _strip_head_repeat(v: View) -> View:
    """Undo HF ``repeat_kv`` (unsqueeze → expand → merge) so GQA reads the kv heads directly."""
    if len(v.steps) < 3 or [s[0] for s in v.steps[-3:]] != ["reshape", "expand", "reshape"]:
        return v
    before, unsqueezed, expanded, merged = ((v.base_shape,) + v.shapes)[-4:]
    if len(before) != 4:
        return v
    b, hkv, s, d = before
    rep = expanded[2]
    if unsqueezed != (b, hkv, 1, s, d) or expanded != (b, hkv, rep, s, d) or merged != (b, hkv * rep, s, d):
        return v
    return View(v.buffer, v.base_shape, v.steps[:-3], v.shapes[:-3])


def _attention(L, q: View, k: View, v: View, mask, dropout, causal, scale):
    if dropout:
        raise Unsupported(f"dropout_p={dropout} (inference only: expected 0)")
    if causal and mask is not None:
        raise Unsupported("both attn_mask and is_causal were given; expected one of them (or neither)")
    k, v = _strip_head_repeat(k), _strip_head_repeat(v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise Unsupported(f"q/k/v of ranks {q.ndim}/{k.ndim}/{v.ndim}; expected [B, H, S, D] each")
    if q.shape[1] % k.shape[1] or k.shape[1] != v.shape[1]:
        raise Unsupported(f"{q.shape[1]} query heads over {k.shape[1]} key / {v.shape[1]} value heads")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ins = [q, k, v] + ([mask] if mask is not None else [])
    out_shape = q.shape[:3] + (v.shape[-1],)
    return L.emit("attention", ins, {"causal": bool(causal), "scale": scale},
                  shape=out_shape, dtype=L.meta().dtype)


@handles(mpk_ops.attention.default)
def _mpk_attention(L, node, q, k, v, attn_mask, is_causal, scale, enable_gqa):
    return _attention(L, q, k, v, attn_mask, 0.0, is_causal, scale)


@handles(aten.scaled_dot_product_attention.default)
def _sdpa(L, node, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    return _attention(L, q, k, v, attn_mask, dropout_p, is_causal, scale)


@handles(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _sdpa_flash_cpu(L, node, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    out = _attention(L, q, k, v, attn_mask, dropout_p, is_causal, scale)
    return out, Unavailable("the logsumexp output of attention")


@handles(aten._scaled_dot_product_flash_attention.default)
def _sdpa_flash(L, node, q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    out = _attention(L, q, k, v, None, dropout_p, is_causal, scale)
    return (out,) + tuple(Unavailable("an auxiliary output of flash attention") for _ in range(8))


@handles(aten._scaled_dot_product_efficient_attention.default)
def _sdpa_efficient(L, node, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    out = _attention(L, q, k, v, attn_bias, dropout_p, is_causal, scale)
    return (out,) + tuple(Unavailable("an auxiliary output of efficient attention") for _ in range(3))


@handles(aten._scaled_dot_product_cudnn_attention.default)
def _sdpa_cudnn(L, node, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
    out = _attention(L, q, k, v, attn_bias, dropout_p, is_causal, scale)
    return (out,) + tuple(Unavailable("an auxiliary output of cudnn attention") for _ in range(8))
