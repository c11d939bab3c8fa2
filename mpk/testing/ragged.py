"""Ragged (prefill / mixed-batch) paged attention test helpers: random batches of new rows
over random page tables, random steps (rope_append then paged_attention, both ragged), float64
references of both computed position by position through the page list (independently of the
tile code), and the check of a step's results against them.

Tolerances (mpk.testing.tolerance) for the check: attention (``attention_bound``) counts the
output's rounding, P's rounding to the 16-bit dtype where the tensor cores take P·V (the GPU;
the CPU's P·V is fp32), and the D-term score and n-term softmax sums in fp32; RoPE
(``rope_bound``) counts, with gain √2 through the rotation (``ROPE_GAIN``), the roundings
qk-norm makes (x·rstd and its rounding to the dtype, ·w and its rounding), the rotation's two
products and sum and the output's rounding, and the D-term sum of squares. v is copied: exact.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mpk.testing.decode import random_page_table
from mpk.testing.graphs import relative_error
from mpk.testing.tolerance import ROPE_GAIN, attention_bound, rounding_bound

EPS = 1e-6  # the qk-norm's epsilon in ragged_step


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


def rope_bound(dtype: torch.dtype, head_dim: int, qk_norm: bool) -> float:
    """Bound on rope_append's ``relative_error`` (q and the appended k; module docstring)."""
    norm = [ROPE_GAIN] * 4 if qk_norm else []
    if dtype == torch.float32:
        return rounding_bound(torch.float32, norm + [1, 1, 1, 1], k=head_dim if qk_norm else 0)
    # 16-bit: the norm's two roundings to the dtype and the output's; the rest in fp32
    return rounding_bound(dtype, norm[:2] + [1]) + rounding_bound(torch.float32, norm[2:] + [1, 1, 1],
                                                                   k=head_dim if qk_norm else 0)


@dataclasses.dataclass
class RaggedCase:
    """A ragged step's inputs (CPU tensors): random qkv rows, a random cache of two layers (every
    slot filled: the cached prefix and stale values in the slots the step appends to), cos/sin
    and qk-norm weights; the step runs over ``layer``."""

    batch: RaggedBatch
    heads: int
    kv_heads: int
    head_dim: int
    qkv: torch.Tensor
    cache: torch.Tensor
    cos_sin: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    layer: int = 1
    scale: float = 0.0

    def args(self, cache: torch.Tensor | None = None, device: str = "cpu") -> tuple:
        """The step's arguments on ``device`` (the cache: ``cache``, else a copy of the case's)."""
        cache = self.cache.to(device) if cache is None else cache
        ins = (self.qkv, self.cos_sin, *self.batch.tables())
        tail = (self.q_norm, self.k_norm, self.batch.qo_indptr)
        return (*(t.to(device) for t in ins), cache, *(None if t is None else t.to(device) for t in tail))


def random_case(batch: RaggedBatch, heads: int, kv_heads: int, head_dim: int, qk_norm: bool, g: torch.Generator,
                dtype: torch.dtype = torch.float32) -> RaggedCase:
    """A ``RaggedCase`` of fresh random values from ``g`` (cos/sin of random angles)."""
    cache = torch.randn(2, 2, batch.num_pages, kv_heads, batch.page_size, head_dim, generator=g).to(dtype)
    qkv = torch.randn(batch.tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    angles = torch.rand(max(batch.lens) + 3, head_dim // 2, generator=g, dtype=torch.float64) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).to(dtype)
    norms = [(0.5 + torch.rand(head_dim, generator=g)).to(dtype) for _ in range(2)] if qk_norm else [None, None]
    return RaggedCase(batch, heads, kv_heads, head_dim, qkv, cache, cos_sin, *norms, scale=head_dim ** -0.5)


def ragged_step(case: RaggedCase, splits: int):
    """rope_append then paged_attention over ``case``'s layer, both ragged: (q, out)."""
    def step(qkv, cos_sin, indptr, indices, last, cache, q_norm, k_norm, qo):
        q = torch.ops.mpk.rope_append(qkv, cos_sin, indptr, indices, last, cache, q_norm, k_norm, case.layer,
                                      case.heads, case.kv_heads, EPS, qo)
        return q, torch.ops.mpk.paged_attention(q, cache, indptr, indices, last, case.layer, case.scale, splits, qo)
    return step


def check_ragged(case: RaggedCase, q: torch.Tensor, out: torch.Tensor, cache: torch.Tensor,
                 p_rounded: bool = False) -> None:
    """A step's q, appended cache rows and attention output (CPU tensors) against float64 (the
    attention reference from the step's own q and cache, so that each op's error is its own),
    every other cache element untouched, padding rows zero and nothing NaN."""
    b, dtype = case.batch, case.qkv.dtype
    q_ref, k_ref, v_ref = dense_rope(case.qkv, case.cos_sin, b, case.heads, case.kv_heads, case.q_norm, case.k_norm,
                                     EPS)
    rope_tol = rope_bound(dtype, case.head_dim, case.q_norm is not None)
    assert relative_error(q, q_ref) <= rope_tol, (relative_error(q, q_ref), rope_tol)
    k, v = appended_slots(cache, case.layer, b)
    assert relative_error(k, k_ref) <= rope_tol and torch.equal(v, v_ref.to(dtype))
    untouched = ~slot_mask(cache, case.layer, b)
    assert torch.equal(cache[untouched], case.cache[untouched])
    ref = dense_ragged_attention(q, cache, b, case.layer, case.scale)
    tol = attention_bound(dtype, case.head_dim, max(b.lens), p_rounded)
    assert relative_error(out, ref) <= tol, (relative_error(out, ref), tol)
    padding = int(b.qo_indptr[-1])
    assert (out[padding:] == 0).all() and (q[padding:] == 0).all() and not out.isnan().any()
