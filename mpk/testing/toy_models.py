"""Toy models for tests, examples and inspection presets: Llama- and Qwen3-style decoder stacks
written the way Hugging Face writes them (RMSNorm with fp32 upcast, rotate-half RoPE, repeat_kv
or enable_gqa, SiLU-gated MLP), a GELU/LayerNorm MLP block, and the seed paper's example.
Random weights; real checkpoints arrive with the LLM models."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    vocab: int = 96
    hidden: int = 64
    inter: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    qk_norm: bool = False  # Qwen3
    gqa_via_repeat: bool = True  # HF repeat_kv (expand + reshape) instead of enable_gqa
    eps: float = 1e-6
    theta: float = 10000.0


LLAMA = Config()
QWEN3 = Config(qk_norm=True, gqa_via_repeat=False, theta=1e6)
# Qwen3-8B shape (the largest decode-benchmark model) for compile-scale tests; never materialised on the CPU.
QWEN3_8B = Config(vocab=151936, hidden=4096, inter=12288, layers=36, heads=32, kv_heads=8, head_dim=128,
                  qk_norm=True, gqa_via_repeat=False, theta=1e6)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.to(torch.float32)
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps)).to(dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def repeat_kv(x, n_rep: int):
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden, c.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden, c.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.heads * c.head_dim, c.hidden, bias=False)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.eps)
            self.k_norm = RMSNorm(c.head_dim, c.eps)

    def forward(self, x, cos, sin, past_k=None, past_v=None):
        c = self.c
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, c.heads, c.head_dim)
        k = self.k_proj(x).view(b, s, c.kv_heads, c.head_dim)
        v = self.v_proj(x).view(b, s, c.kv_heads, c.head_dim).transpose(1, 2)
        if c.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if past_k is not None:  # decode: attend to the cache plus the new token, no mask
            k, v = torch.cat([past_k, k], dim=2), torch.cat([past_v, v], dim=2)
        causal = past_k is None
        if c.gqa_via_repeat:
            rep = c.heads // c.kv_heads
            o = F.scaled_dot_product_attention(q, repeat_kv(k, rep), repeat_kv(v, rep), is_causal=causal)
        else:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, s, c.heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden, c.inter, bias=False)
        self.up_proj = nn.Linear(c.hidden, c.inter, bias=False)
        self.down_proj = nn.Linear(c.inter, c.hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden, c.eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden, c.eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, past_k=None, past_v=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, past_k, past_v)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Token ids [B, S] → logits [B, S, vocab]. With ``past`` (per-layer k/v caches) it is a
    decode step over a cache of static length."""

    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab, c.hidden)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.hidden, c.eps)
        self.lm_head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, ids, cos, sin, past: list[torch.Tensor] | None = None):
        x = self.embed_tokens(ids)
        for i, layer in enumerate(self.layers):
            pk, pv = (past[2 * i], past[2 * i + 1]) if past is not None else (None, None)
            x = layer(x, cos, sin, pk, pv)
        return self.lm_head(self.norm(x))


def rope_tables(c: Config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (c.theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim))
    freqs = positions.float()[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def randomize(model: nn.Module, generator: torch.Generator, scale: float = 0.2) -> nn.Module:
    """Fresh random weights (never zeros; norm weights around 1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator) * scale
            p.copy_(1.0 + noise if name.endswith("norm.weight") or "layernorm" in name else noise)
    return model


class GeluMLPBlock(nn.Module):
    """Pre-LayerNorm GELU MLP block with biases and a residual, then softmax over features."""

    def __init__(self, d: int = 48, inter: int = 96, approximate: str = "none"):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, inter)
        self.fc2 = nn.Linear(inter, d)
        self.approximate = approximate

    def forward(self, x):
        h = x + self.fc2(F.gelu(self.fc1(self.ln(x)), approximate=self.approximate))
        return torch.softmax(h, dim=-1), h.amax(-1), h.argmax(-1)


class SeedExample(nn.Module):
    """The seed paper's running example: Q/K/V projections → attention → output projection →
    RMSNorm, for one token over ``heads`` heads (no cache: keys/values of the token itself)."""

    def __init__(self, hidden: int = 64, heads: int = 4):
        super().__init__()
        self.heads, self.hd = heads, hidden // heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)
        self.norm = RMSNorm(hidden, 1e-6)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.heads, self.hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.norm(self.o(o.transpose(1, 2).reshape(b, s, d)))
