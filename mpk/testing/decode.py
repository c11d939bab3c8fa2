"""Decode-step test helpers: random toy decoders and decode steps, random page tables, a dense
reference of paged attention, and the checks that compare a compiled decode loop with eager
PyTorch and a float32 twin."""

from __future__ import annotations

import numpy as np
import torch

from mpk.llm.config import LLMConfig

# Llama 3.1's scaling with a short original context, so short prompts reach the scaled frequencies
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}


def small_config(family: str, **kw) -> LLMConfig:
    """A tiny Llama ("llama": tied, Llama 3 rope scaling) or Qwen3 ("qwen3": qk-norm) config for
    CPU tests; ``kw`` overrides fields."""
    base = dict(family=family, hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=97,
                tied=family == "llama", eps=1e-6, rope_theta=1e4 if family == "llama" else 1e6,
                rope_scaling=LLAMA3_SCALING if family == "llama" else None, max_position=256)
    return LLMConfig(**(base | kw))

def random_decoder(config, seed: int, batch: int, seq: int):
    """A toy decoder with fresh random weights and a prefill batch: (model, ids, cos, sin)."""
    from mpk.testing.toy_models import Decoder, randomize, rope_tables

    g = torch.Generator().manual_seed(seed)
    model = randomize(Decoder(config), g).eval()
    ids = torch.randint(0, config.vocab, (batch, seq), generator=g)
    cos, sin = rope_tables(config, torch.arange(seq))
    return model, ids, cos, sin


def random_decode_step(config, seed: int, batch: int = 2, cache_len: int = 9):
    """A toy decoder and one decode step over a random static cache of ``cache_len`` entries:
    (model, ids, cos, sin, past)."""
    from mpk.testing.toy_models import Decoder, randomize, rope_tables

    g = torch.Generator().manual_seed(seed)
    model = randomize(Decoder(config), g).eval()
    past = [torch.randn(batch, config.kv_heads, cache_len, config.head_dim, generator=g)
            for _ in range(2 * config.layers)]
    ids = torch.randint(0, config.vocab, (batch, 1), generator=g)
    cos, sin = rope_tables(config, torch.tensor([cache_len]))
    return model, ids, cos, sin, past


def random_page_table(lens: list[int], page_size: int, g: torch.Generator, spare: int = 2):
    """A BSR page table for sequences of ``lens`` over shuffled pages (plus ``spare`` unused
    ones): (pages per sequence, kv_indptr, kv_indices, kv_last_page_len, number of pages)."""
    counts = [-(-n // page_size) for n in lens]
    num_pages = sum(counts) + spare
    perm = torch.randperm(num_pages, generator=g).tolist()
    pages, pos = [], 0
    for k in counts:
        pages.append(perm[pos: pos + k])
        pos += k
    indptr = torch.tensor([0] + list(np.cumsum(counts)), dtype=torch.int32)
    indices = torch.tensor(sum(pages, []) + [0] * spare, dtype=torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 for n in lens], dtype=torch.int32)
    return pages, indptr, indices, last, num_pages


def dense_paged_attention(q, cache, lens, pages, page_size: int, layer: int, scale: float) -> torch.Tensor:
    """float64 softmax attention of q [B, H, D] over each sequence's cached positions, read
    position by position through the page list (GQA: head h uses kv head h // (H / KV))."""
    out = torch.empty(q.shape, dtype=torch.float64)
    B, H, _ = q.shape
    group = H // cache.shape[3]
    for b in range(B):
        t = torch.arange(lens[b])
        page, slot = torch.tensor(pages[b])[t // page_size], t % page_size
        k, v = cache[layer, 0, page, :, slot].double(), cache[layer, 1, page, :, slot].double()  # [n, KV, D]
        for h in range(H):
            p = torch.softmax(k[:, h // group] @ q[b, h].double() * scale, 0)
            out[b, h] = p @ v[:, h // group]
    return out


def lockstep(runs, tokens: torch.Tensor, first_grow) -> list[torch.Tensor]:
    """Teacher-forced decode side by side: step t grows every run's cache (by ``first_grow`` at
    the first, then by one) and runs each ``(step, cache)`` on ``tokens[t]`` ([steps, batch]).
    (Feeding back an arg-max instead let a random model settle on one token at batch 1, so
    every step repeated the first one's logits.) Returns each run's stacked float logits, in
    order."""
    logits = [[] for _ in runs]
    with torch.no_grad():
        for t in range(tokens.shape[0]):
            for (step, kv), out in zip(runs, logits):
                kv.grow(first_grow if t == 0 else 1)
                out.append(step(tokens[t], *kv.args()).float())
    return [torch.stack(out) for out in logits]


def float32_twin(model):
    """A float32 copy of a DecoderLM (the same weights; its RoPE table computed in float32):
    the truth a bf16 run's rounding is measured against."""
    from mpk.llm import DecoderLM

    twin = DecoderLM(model.cfg, torch.float32, model.embed.device, model.cos_sin.shape[0], model.num_splits)
    twin.load_state_dict(model.state_dict())
    return twin


def against_eager_and_float32(model, step, batch: int, max_len: int, page_size: int, steps: int, first_grow):
    """``lockstep`` of the bf16 eager ``model`` (leading), the compiled ``step`` and a float32
    twin, each with its own cache; asserts the compiled logits as close to the twin's as the
    eager path's are (largest and median error relative to the largest |logit| within 1.5× the
    eager path's: bf16 rounding of different summation orders) and top-1 agreement ≥ 99% with
    the eager path where its logits are decisive (few positions may hold none). Returns the
    (eager, compiled, float32 twin's) caches."""
    from mpk.llm import PagedKVCache
    from mpk.testing.parity import compare_logits

    twin = float32_twin(model)
    kv_eager, kv_step = PagedKVCache(model, batch, max_len, page_size), PagedKVCache(model, batch, max_len, page_size)
    kv_twin = PagedKVCache(twin, batch, max_len, page_size)
    tokens = torch.randint(0, model.cfg.vocab, (steps, batch), device=model.embed.device)
    refs, outs, truth = lockstep([(model, kv_eager), (step, kv_step), (twin, kv_twin)], tokens, first_grow)
    ours, eager = compare_logits(outs, truth), compare_logits(refs, truth)
    assert ours["max_rel"] <= 1.5 * eager["max_rel"] and ours["median_rel"] <= 1.5 * eager["median_rel"], (ours, eager)
    stats = compare_logits(outs, refs)
    assert stats["decisive_share"] == 0 or stats["top1_decisive"] >= 0.99, stats
    return kv_eager, kv_step, kv_twin


def norm_fusions(options: dict, batch: int, hidden: int) -> tuple[bool, bool]:
    """(prologue, split) of a bf16 decode step compiled with ``options``: whether its RMSNorms
    run inside the projection after them (x fits the prologue's tile) and whether those after
    a residual projection are split between the projections around them (fuse_norm_stats:
    "auto" splits above NORM_SPLIT_MIN_BYTES of x, or all with the prologue off)."""
    from mpk.ops.linalg import NORM_SPLIT_MIN_BYTES, NORM_TILE_BYTES

    nbytes = batch * hidden * 2
    prologue = options.get("fuse_norm_prologue", True) and nbytes <= NORM_TILE_BYTES
    stats = options.get("fuse_norm_stats", "auto")
    return prologue, stats is True or (stats == "auto" and (nbytes > NORM_SPLIT_MIN_BYTES or not prologue))


def check_arguments_inside_storage(model, step, batch: int, page_size: int, steps: int) -> None:
    """Decode ``steps`` teacher-forced steps through the compiled ``step`` twice, on fresh
    tensors and on arguments that start inside a larger storage — each step's tokens a row of
    one [steps, batch] tensor, the KV cache the middle third of a tensor of random values —
    and assert the two runs' logits and caches bit-identical (the same kernel on the same
    values), the storage around the cache untouched."""
    from mpk.llm import PagedKVCache

    fresh, inside = PagedKVCache(model, batch, 32, page_size), PagedKVCache(model, batch, 32, page_size)
    n = inside.cache.numel()  # a multiple of head_dim: the slice stays 16-byte aligned
    storage = torch.randn(3 * n, device=inside.cache.device).to(inside.cache.dtype)
    around = storage.clone()
    inside.cache = storage[n: 2 * n].view(inside.cache.shape).zero_()
    tokens = torch.randint(0, model.cfg.vocab, (steps, batch), device=model.embed.device)
    with torch.no_grad():
        for t in range(steps):
            for kv in (fresh, inside):
                kv.grow([1 + 3 * b for b in range(batch)] if t == 0 else 1)
            ref = step(tokens[t].clone(), *fresh.args())
            row = tokens[t]
            assert row.storage_offset() == t * batch
            assert torch.equal(step(row, *inside.args()), ref), t
    assert torch.equal(inside.cache, fresh.cache)
    assert torch.equal(storage[:n], around[:n]) and torch.equal(storage[2 * n:], around[2 * n:])
