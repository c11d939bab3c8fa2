"""Ragged (prefill / mixed-batch) paged attention test helpers: random batches of new rows
over random page tables, and float64 references of ``rope_append`` and ``paged_attention`` in
the ragged form (mpk.ops.paged documents it), computed position by position through the page
list, independently of the tile code."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpk.testing.decode import random_page_table


@dataclass
class RaggedBatch:
    """A step's rows over a page table that already counts them: sequence b holds ``lens[b]``
    positions, the last ``qo_lens[b]`` of them new, as rows qo_indptr[b]…qo_indptr[b+1] − 1 of
    ``tokens`` (rows from qo_indptr[B] on are padding)."""

    lens: list[int]
    qo_lens: list[int]
    tokens: int
    page_size: int
    pages: list[list[int]]
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    qo_indptr: torch.Tensor
    num_pages: int

    def tables(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.kv_indptr, self.kv_indices, self.kv_last_page_len

    def rows(self) -> list[tuple[int, int, int]]:
        """(row, sequence, position) of every new row, in row order."""
        out = []
        for b, (n, m) in enumerate(zip(self.lens, self.qo_lens)):
            start = int(self.qo_indptr[b])
            out += [(start + i, b, n - m + i) for i in range(m)]
        return out


def ragged_batch(prefix: list[int], new: list[int], page_size: int, g: torch.Generator, padding: int = 0,
                 spare: int = 2) -> RaggedBatch:
    """Sequences with ``prefix[b]`` cached positions and ``new[b]`` new rows each, over shuffled
    (non-contiguous) pages with ``spare`` unused ones, and ``padding`` rows after the last."""
    lens = [p + n for p, n in zip(prefix, new)]
    pages, indptr, indices, last, num_pages = random_page_table(lens, page_size, g, spare=spare)
    qo = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    return RaggedBatch(lens, list(new), int(qo[-1]) + padding, page_size, pages, indptr, indices, last, qo, num_pages)


def _kv_rows(cache: torch.Tensor, layer: int, pages: list[int], page_size: int, n: int):
    t = torch.arange(n)
    page, slot = torch.tensor(pages, dtype=torch.int64)[t // page_size], t % page_size
    return cache[layer, 0, page, :, slot].double(), cache[layer, 1, page, :, slot].double()  # [n, KV, D]


def dense_ragged_attention(q: torch.Tensor, cache: torch.Tensor, batch: RaggedBatch, layer: int,
                           scale: float) -> torch.Tensor:
    """float64 causal softmax attention of the ragged rows q [T, H, D]: a new row at position p
    attends to positions 0…p of its sequence (GQA: head h reads kv head h // (H / KV)); padding
    rows are 0."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // cache.shape[3]
    for b, n in enumerate(batch.lens):
        if not batch.qo_lens[b]:
            continue
        k, v = _kv_rows(cache, layer, batch.pages[b], batch.page_size, n)
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, H, D]
        for t, _, p in (r for r in batch.rows() if r[1] == b):
            s = torch.einsum("hd,nhd->hn", q[t].double(), k[: p + 1]) * scale
            out[t] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v[: p + 1])
    return out


def dense_rope(qkv: torch.Tensor, cos_sin: torch.Tensor, batch: RaggedBatch, heads: int, kv_heads: int,
               q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float):
    """float64 qk-norm (when given) and RoPE (rotate-half) of every new row at its position:
    (q [T, H, D], k [T, KV, D], v [T, KV, D]), padding rows 0, no rounding on the way."""
    D = cos_sin.shape[1]
    x = qkv.double().reshape(qkv.shape[0], heads + 2 * kv_heads, D)
    q, k, v = x[:, :heads], x[:, heads:heads + kv_heads], x[:, heads + kv_heads:]
    if q_norm is not None:
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + eps) * q_norm.double()
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps) * k_norm.double()
    live = torch.zeros(qkv.shape[0], dtype=torch.bool)
    pos = torch.zeros(qkv.shape[0], dtype=torch.int64)
    for t, _, p in batch.rows():
        live[t], pos[t] = True, p
    cs = cos_sin[pos].double()
    cos, sin = torch.cat([cs[:, : D // 2]] * 2, -1)[:, None], torch.cat([cs[:, D // 2:]] * 2, -1)[:, None]

    def rot(x):
        return x * cos + torch.cat([-x[..., D // 2:], x[..., : D // 2]], -1) * sin

    keep = live[:, None, None]
    return torch.where(keep, rot(q), 0.0), torch.where(keep, rot(k), 0.0), torch.where(keep, v, 0.0)


def appended_slots(cache: torch.Tensor, layer: int, batch: RaggedBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's k and v [T, KV, D] at each new row's slot (padding rows 0)."""
    T, KV, D = batch.tokens, cache.shape[3], cache.shape[5]
    k, v = torch.zeros(T, KV, D, dtype=cache.dtype), torch.zeros(T, KV, D, dtype=cache.dtype)
    for t, b, p in batch.rows():
        page = batch.pages[b][p // batch.page_size]
        k[t], v[t] = cache[layer, 0, page, :, p % batch.page_size], cache[layer, 1, page, :, p % batch.page_size]
    return k, v


def slot_mask(cache: torch.Tensor, layer: int, batch: RaggedBatch) -> torch.Tensor:
    """True at the cache rows (every layer, k and v, every kv head) the new rows append to."""
    mask = torch.zeros(cache.shape[:5], dtype=torch.bool)
    for _, b, p in batch.rows():
        mask[layer, :, batch.pages[b][p // batch.page_size], :, p % batch.page_size] = True
    return mask
