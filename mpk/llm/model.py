"""Llama and Qwen3 decoders built from a Hugging Face ``config.json``, written to be traced.

``DecoderLM.forward`` is ONE step over the paged KV cache (``mpk.ops.paged`` documents its
layout), its page table passed as tensors: a decode step (a token per sequence), or a ragged
step of any number of new tokens per sequence (prefill chunks and decodes together), so
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

    def forward(self, x, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache, num_splits: int,
                qo_indptr: torch.Tensor | None = None):
        c = self.cfg
        # the decode form passes no qo_indptr at all, so its traced graph is the decode step's
        ragged = {} if qo_indptr is None else {"qo_indptr": qo_indptr}
        h = torch.ops.mpk.rms_norm(x, self.input_norm, c.eps, torch.float32, x.dtype)
        qkv = torch.nn.functional.linear(h, self.qkv)
        q = torch.ops.mpk.rope_append(qkv, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache,
                                      self.q_norm, self.k_norm, self.index, c.heads, c.kv_heads, c.eps, **ragged)
        a = torch.ops.mpk.paged_attention(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, self.index,
                                          c.head_dim ** -0.5, num_splits, **ragged)
        x = x + torch.nn.functional.linear(a.reshape(x.shape[0], -1), self.o)
        h = torch.ops.mpk.rms_norm(x, self.post_norm, c.eps, torch.float32, x.dtype)
        gu = torch.nn.functional.linear(h, self.gate_up)
        return x + torch.nn.functional.linear(torch.ops.mpk.silu_mul(gu[:, : c.inter], gu[:, c.inter:]), self.down)


class DecoderLM(nn.Module):
    """A Llama/Qwen3 causal LM whose forward is one step over a paged KV cache.

    ``forward(tokens [T] int64, kv_cache, kv_indptr [B+1] int32, kv_indices [N] int32,
    kv_last_page_len [B] int32, qo_indptr=None, logits="last")``. The page table must already
    count the step's new tokens (``PagedKVCache.grow`` does that).

    * ``qo_indptr`` None: a decode step, one token per sequence (T == B); returns [B, vocab].
    * ``qo_indptr`` [B+1] int32: a ragged step. Sequence b's new tokens are rows
      ``qo_indptr[b] … qo_indptr[b+1] − 1`` of ``tokens`` (the last ``qo_indptr[b+1] −
      qo_indptr[b]`` positions its page table counts), attended causally; rows from
      ``qo_indptr[B]`` on are padding (valid token ids, nothing written to the cache). Returns
      with ``logits="last"`` each sequence's last new token's logits [B, vocab]; a sequence
      with no new tokens gets the logits of row ``max(qo_indptr[b] − 1, 0)`` (finite, someone
      else's: ignore them). ``logits="all"``: every row's [T, vocab] (padding rows finite,
      meaningless).

    ``num_splits``: KV chunks per sequence for attention, at most (a sequence uses one per 128
    positions; 0: the compiler picks).
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

    def forward(self, tokens, kv_cache, kv_indptr, kv_indices, kv_last_page_len, qo_indptr=None, logits="last"):
        # static shapes, so these checks cost nothing once compiled
        check_step_shapes(tokens, kv_indptr, kv_last_page_len, qo_indptr, logits)
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
            x = layer(x, self.cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache, self.num_splits, qo_indptr)
        if qo_indptr is not None and logits == "last":
            # each sequence's last new row, before the norm and the LM head (B rows, not T); an
            # empty sequence's index points at the row before its slot (or row 0): finite values
            x = torch.index_select(x, 0, (qo_indptr[1:] - 1).clamp_min(0))
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

    def new_cache(self, num_pages: int, page_size: int, tensor_parallel: tuple[int, int] | None = None) -> torch.Tensor:
        """A zero KV cache [layers, 2, num_pages, kv_heads, page_size, head_dim]. Under
        ``tensor_parallel`` (rank, world) it is rank-local: its memory holds only the rank's kv
        heads (mpk.distributed.binding.rank_local), which the rank's sharded step writes in place."""
        c, p = self.cfg, self.embed
        shape = (c.layers, 2, num_pages, c.kv_heads, page_size, c.head_dim)
        if tensor_parallel is None or tensor_parallel[1] == 1:
            return torch.zeros(shape, dtype=p.dtype, device=p.device)
        from mpk.distributed.binding import rank_local
        from mpk.distributed.shard import kv_head_range

        return rank_local(shape, 3, *kv_head_range(c.kv_heads, *tensor_parallel), p.dtype, p.device)

    def cache_bytes_per_page(self, page_size: int, world: int = 1) -> int:
        """The bytes a page of ``new_cache`` takes on one rank of ``world``."""
        c = self.cfg
        kv = c.kv_heads // world if c.kv_heads >= world else 1
        return c.layers * 2 * kv * page_size * c.head_dim * self.embed.dtype.itemsize


LOGITS = ("last", "all")


def check_step_shapes(tokens, kv_indptr, kv_last_page_len, qo_indptr, logits) -> None:
    """BadInputError naming the shapes unless they form a step: [B] tokens for a decode step
    (a shorter batch would leave sequences counted but never written), or [T] tokens and a
    [B + 1] int32 qo_indptr for a ragged one."""
    if logits not in LOGITS:
        raise BadInputError(f"logits={logits!r}; expected one of {LOGITS}")
    if qo_indptr is None:
        if tokens.dim() != 1 or kv_indptr.shape != (tokens.shape[0] + 1,) or kv_last_page_len.shape != tokens.shape:
            raise BadInputError(f"tokens {tuple(tokens.shape)}, kv_indptr {tuple(kv_indptr.shape)}, kv_last_page_len "
                                f"{tuple(kv_last_page_len.shape)}; expected [B], [B + 1] and [B]: one token per "
                                "sequence of the page table (or pass qo_indptr for a ragged step)")
        return
    B = kv_last_page_len.shape[0] if kv_last_page_len.dim() == 1 else -1
    if tokens.dim() != 1 or kv_indptr.shape != (B + 1,) or qo_indptr.shape != (B + 1,) \
            or qo_indptr.dtype != kv_indptr.dtype:
        raise BadInputError(f"tokens {tuple(tokens.shape)}, kv_indptr {tuple(kv_indptr.shape)}, kv_last_page_len "
                            f"{tuple(kv_last_page_len.shape)}, qo_indptr {tuple(qo_indptr.shape)} {qo_indptr.dtype}; "
                            f"expected [T], [B + 1], [B] and [B + 1] of the page table's {kv_indptr.dtype} (a ragged step's new rows "
                            "per sequence)")


def check_model_args(dtype: torch.dtype, max_len: int | None, num_splits: int) -> None:
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"dtype={dtype!r}; expected torch.bfloat16, torch.float16 or torch.float32")
    if max_len is not None and not is_count(max_len, 1):
        raise ValueError(f"max_len={max_len!r}; expected None (the config's max_position) or an int ≥ 1")
    if not is_count(num_splits):
        raise ValueError(f"num_splits={num_splits!r}; expected an int ≥ 0 (0: the compiler picks)")
