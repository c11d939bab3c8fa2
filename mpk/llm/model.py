"""Llama and Qwen3 decoders built from a Hugging Face ``config.json``, written to be traced.

``DecoderLM.forward`` is ONE decode step: a token per sequence in, logits out, with the paged
KV cache (``mpk.ops.paged`` documents its layout) and its page table passed as tensors, so
``torch.compile(model, backend="mpk", fullgraph=True)`` traces the whole step into one graph
with static shapes. Projections are fused the way fast engines store them (q|k|v and
gate|up as one weight each); ``load_pretrained`` does the fusing from HF safetensors names.
"""

from __future__ import annotations

import torch
from torch import nn

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.errors import BAD_TOKEN, BadInputError, bad_input_message
from mpk.llm.config import LLMConfig, is_count, rope_table


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LLMConfig, index: int, dtype: torch.dtype, device):
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.cfg, self.index = cfg, index
        q, kv = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden, **kw))
        self.qkv = nn.Parameter(torch.empty(q + 2 * kv, cfg.hidden, **kw))
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim, **kw)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim, **kw)) if cfg.qk_norm else None
        self.o = nn.Parameter(torch.empty(cfg.hidden, q, **kw))
        self.post_norm = nn.Parameter(torch.ones(cfg.hidden, **kw))
        self.gate_up = nn.Parameter(torch.empty(2 * cfg.inter, cfg.hidden, **kw))
        self.down = nn.Parameter(torch.empty(cfg.hidden, cfg.inter, **kw))

    def forward(self, x, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache, num_splits: int):
        c = self.cfg
        h = torch.ops.mpk.rms_norm(x, self.input_norm, c.eps, torch.float32, x.dtype)
        qkv = torch.nn.functional.linear(h, self.qkv)
        q = torch.ops.mpk.rope_append(qkv, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache,
                                      self.q_norm, self.k_norm, self.index, c.heads, c.kv_heads, c.eps)
        a = torch.ops.mpk.paged_attention(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, self.index,
                                          c.head_dim ** -0.5, num_splits)
        x = x + torch.nn.functional.linear(a.reshape(x.shape[0], -1), self.o)
        h = torch.ops.mpk.rms_norm(x, self.post_norm, c.eps, torch.float32, x.dtype)
        gu = torch.nn.functional.linear(h, self.gate_up)
        return x + torch.nn.functional.linear(torch.ops.mpk.silu_mul(gu[:, : c.inter], gu[:, c.inter:]), self.down)


class DecoderLM(nn.Module):
    """A Llama/Qwen3 causal LM whose forward is one decode step over a paged KV cache.

    ``forward(tokens [B] int64, kv_cache, kv_indptr [B+1] int32, kv_indices [N] int32,
    kv_last_page_len [B] int32) -> logits [B, vocab]``; the page table must already count the
    token being decoded (``PagedKVCache.grow`` does that). ``num_splits``: KV chunks per
    sequence for attention, at most (a sequence uses one per 128 positions; 0: the compiler
    picks).
    """

    def __init__(self, cfg: LLMConfig, dtype: torch.dtype = torch.bfloat16, device=None, max_len: int | None = None,
                 num_splits: int = 0):
        super().__init__()
        check_model_args(dtype, max_len, num_splits)
        self.cfg, self.num_splits = cfg, num_splits
        kw = dict(dtype=dtype, device=device)
        self.embed = nn.Parameter(torch.empty(cfg.vocab, cfg.hidden, **kw))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden, **kw))
        self.lm_head = None if cfg.tied else nn.Parameter(torch.empty(cfg.vocab, cfg.hidden, **kw))
        self.register_buffer("cos_sin", rope_table(cfg, max_len or cfg.max_position, dtype).to(device),
                             persistent=False)

    def forward(self, tokens, kv_cache, kv_indptr, kv_indices, kv_last_page_len):
        # one token per sequence of the page table (a shorter batch would leave sequences counted
        # but never written); static shapes, so this costs nothing once compiled
        if tokens.dim() != 1 or kv_indptr.shape != (tokens.shape[0] + 1,) or kv_last_page_len.shape != tokens.shape:
            raise ValueError(f"tokens {tuple(tokens.shape)}, kv_indptr {tuple(kv_indptr.shape)}, kv_last_page_len "
                             f"{tuple(kv_last_page_len.shape)}; expected [B], [B + 1] and [B]: one token per sequence "
                             "of the page table")
        if kv_cache.dtype != self.embed.dtype:  # a cast in the append would silently round the cache
            raise ValueError(f"kv_cache is {kv_cache.dtype}; expected the model's dtype {self.embed.dtype} "
                             "(PagedKVCache(model, ...) allocates it so)")
        if not torch.compiler.is_compiling():  # eagerly: what the compiled step reports (BadInputError)
            bad = torch.nonzero((tokens < 0) | (tokens >= self.cfg.vocab)).flatten()
            if len(bad):
                row = int(bad[0])
                raise BadInputError(bad_input_message(BAD_TOKEN, int(tokens[row]), row, self.cfg.vocab))
        x = torch.nn.functional.embedding(tokens, self.embed)
        for layer in self.layers:
            x = layer(x, self.cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache, self.num_splits)
        x = torch.ops.mpk.rms_norm(x, self.norm, self.cfg.eps, torch.float32, x.dtype)
        return torch.nn.functional.linear(x, self.embed if self.lm_head is None else self.lm_head)

    def randomize(self, seed: int = 0, scale: float = 0.02) -> "DecoderLM":
        """Random weights (norm weights near 1), drawn on the CPU so every device agrees."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                base = 1.0 if "norm" in name else 0.0
                p.copy_(base + scale * torch.randn(p.shape, generator=g))
        return self

    def new_cache(self, num_pages: int, page_size: int) -> torch.Tensor:
        c, p = self.cfg, self.embed
        return torch.zeros(c.layers, 2, num_pages, c.kv_heads, page_size, c.head_dim, dtype=p.dtype, device=p.device)


def check_model_args(dtype: torch.dtype, max_len: int | None, num_splits: int) -> None:
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype={dtype!r}; expected torch.bfloat16, torch.float16 or torch.float32")
    if max_len is not None and not is_count(max_len, 1):
        raise ValueError(f"max_len={max_len!r}; expected None (the config's max_position) or an int ≥ 1")
    if not is_count(num_splits):
        raise ValueError(f"num_splits={num_splits!r}; expected an int ≥ 0 (0: the compiler picks)")
