"""Attention over a paged KV cache: ``rope_append``, ``attn_partial``, the two fused
(``rope_attn_partial``) and ``attn_merge``, in two forms — decode (one new token per sequence)
and ragged (any number per sequence: prefill, chunked prefill, mixed batches).

The cache of all layers is one tensor ``kv_cache [L, 2, num_pages, kv_heads, page_size, D]``
(k then v; HND pages). Which pages a sequence owns is a block-sparse (BSR) row as in
FlashInfer: sequence b owns pages ``kv_indices[kv_indptr[b]:kv_indptr[b+1]]`` and fills
``kv_last_page_len[b]`` (1…page_size) slots of its last page, so its length is
``(pages − 1)·page_size + last_len`` (0 with no pages). The token being decoded is already
counted: the caller grows the table before the step, ``rope_append`` writes the token's k/v at
position ``len − 1`` and attention reads positions ``0 … len − 1``.

Attention is split into KV chunks: tile (b, kv head, chunk c) of ``attn_partial`` covers the
positions ``chunk_bounds`` gives it — the runtime length in balanced chunks of at least
``MIN_CHUNK`` positions, at most C of them, the rest empty (the task grid is static, the length
is not) — for the ``G`` query heads of its kv head, and writes a partial state ``(O, LSE)``;
``attn_merge`` combines the C states of each head with ⊕ (in a fixed order, so results are
deterministic; the CUDA task uses the n-ary form, weights 2^(lse_c − max lse) / Σ, which is
what folding with ⊕ computes). With one chunk per sequence (``attrs['final']``, chosen when
C = 1) there is nothing to merge: the attention tasks write O in q's dtype, [B, KV, G, D]
viewed as [B, H, D] — bit for bit what the merge of the one state would write — and the
graph has no merge op.

LSE base: **2**. A state's ``lse`` is ``log2 Σ_j 2^(s_j)`` with ``s_j = q·k_j · scale · log2(e)``
and ``O`` is the softmax-weighted mean of v (already normalised). The empty set is
``(O = 0, lse = −inf)``, the identity of ⊕. ``merge_states`` is the one Python definition;
``cuda/mpk_tasks/paged_attention.cuh: attn_merge_impl`` is the CUDA one, tested against it
through paged attention with more chunks than positions.

**The ragged form** (``attrs['ragged']``; the ops' last input ``qo_indptr`` [B + 1], in the
page table's integer type; FlashInfer's layout) takes T token rows: sequence b's new rows are
t ∈ [qo_indptr[b], qo_indptr[b+1]); qo_indptr[0] = 0, it never decreases and qo_indptr[B] ≤ T.
The page table already counts the new rows (n_b ≥ qo_len_b), and row t sits at position
p_t = n_b − qo_indptr[b+1] + t: ``rope_append`` rotates row t's q and k at p_t (qk-norm first)
and writes its k/v to slot p_t; attention row t attends to positions 0…p_t (causal inside the
new rows, the whole cached prefix; GQA as in decode). Rows t ≥ qo_indptr[B] are padding (a
token-count bucket larger than the step): no append, zero q and output (states (0, −inf)); a
sequence with no new rows is untouched. ``qo_rows`` checks qo_indptr against the page table
(BadInputError codes 7–8 of mpk.errors.BAD_INPUTS; code 9, a row's position, is checked where
rows are rotated; the CUDA tasks report them alike) and maps
rows to (sequence, position). Decode is the form without ``qo_indptr``: T = B, row b is
sequence b's last position (its code paths and rope fusion are the ones above).

A ragged attention tile covers a block of rows, kv heads and chunks; its rows fall into
segments, the rows of one sequence each, and chunk c of a segment covers
``chunk_bounds(p_last + 1, c, C, False)`` of its positions (p_last: the position of the
segment's last row in the tile), each row masked to ≤ p_t. States are [T, KV, C, G, D + 1]
(final: [T, KV, G, D]). A tile holds at least ``rows_per_tile`` rows (``attrs['rows']``). There
is no rope fusion: a row attends to k/v that other rows append, in other tiles. Which rows those
are is run-time data, so an attention tile over kv head j reads q of *every* row for j's query
heads (its input region): that orders it after every rope_append tile appending kv head j. The
happens-before check sees the cache in key spaces by token row (``CACHE_KEY_DIMS``; in decode a
row is its sequence).

**The balanced split** (``attrs['balanced']``: the ragged form with C > 1 chunks). The grid
cannot know which sequences are long, so the chunks are not fixed per row block: ``attn_plan``
(one task a step, from the run-time page table) gives each block of R rows ⌈cost / L⌉ of the
W = blocks · C items of a kv head (``attention_plan``: FlashInfer's Algorithm 1), and the
attention tile of storage block i, slot c does item w = i·C + c: chunk w − block_start of its
block's items (``chunk_bounds`` with that count), its states stored at block i's rows, slot c
(states [blocks · R, KV, C, G, D + 1]). ``attn_merge`` with the plan as its second input folds
each row's items. A plan is made once per step and read by every layer's attention.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from mpk.errors import (
    BAD_POSITION,
    BAD_QO_INDPTR,
    BAD_QO_LEN,
    BAD_ROW_POSITION,
    BadInputError,
    bad_input_message,
)
from mpk.ir.views import Shape
from mpk.ops.gpu import DTYPE_SIZE, GpuSpec, OpInfo, Params, all_inputs, check_contiguous, index_ctype, one_ctype
from mpk.ops.registry import KeySpace, OpDef, OpSig, register
from mpk.ops.rows import rotate_half

LOG2E = 1.4426950408889634


# --- the CUDA side (cuda/mpk_tasks/paged_attention.cuh) ----------------------------------------
# The tasks are templates over head dim, group size and dtypes, instantiated per op.

ATTN_REGS = 32  # registers a lane holds q in: group × head dim ≤ 32·32 (also the attn_partial scratch bound)
# Paged attention's second K/V slot per warp (8 warps × 4 KiB steps), reserved where a warp's
# share of a chunk can run to this many steps: the reservation takes L1 from every task and
# pays only over long chunks; the threshold between those is a guess.
ATTN_SECOND_SLOT_BYTES = 8 * 4096
ATTN_SECOND_SLOT_MIN_STEPS = 8
_CACHE_INPUT = {"attn_partial": 1, "rope_attn_partial": 5}  # which input is the paged KV cache


def attention_steps(op: OpInfo) -> int:
    """The most K/V steps one warp of a paged attention op may take in a chunk: its page table's
    slots per sequence (kv_indices / batch, in positions) split into the op's chunks — or, for a
    sequence that uses fewer (``chunk_bounds``), one chunk of up to 2 · MIN_CHUNK − 1 positions —
    over the task's 8 warps of 2 KiB-row steps."""
    cache, indices = op.inputs[_CACHE_INPUT[op.kind]], op.inputs[3]
    out = op.out_shape
    chunks = 1 if op.attrs.get("final", False) else out[2]
    page_size, dim = cache.shape[4], cache.shape[5]
    step = 2048 // (dim * cache.dtype.itemsize)  # kAttnStep
    slots = math.prod(indices.shape)
    positions = slots // max(1, op.inputs[4].shape[0]) * page_size  # kv_last_page_len: [batch]
    longest = max(-(-positions // chunks), min(positions, 2 * MIN_CHUNK - 1))
    return -(-longest // (8 * step))


# The ragged form's tensor-core task (attn_prefill) stages a CTA-wide K/V step of this many bytes
# (K and V rows of 8192 / D positions) in the scratch area and the next step's in dynamic shared
# memory, so that one step's copies fly while the warps attend to the other.
PREFILL_STAGE_BYTES = 32768
PREFILL_MAX_GROUP = 8  # attn_prefill packs a block of ⌊16 / G⌋ rows' G heads into a warp's 16 MMA rows


def _attention_smem(op: OpInfo) -> int:
    if op.attrs.get("ragged") and _prefill_block(op):
        return PREFILL_STAGE_BYTES
    return ATTN_SECOND_SLOT_BYTES if attention_steps(op) >= ATTN_SECOND_SLOT_MIN_STEPS else 0


def _prefill_block(op: OpInfo) -> bool:
    """Whether a ragged attention op's tasks run a block of rows at a time on the tensor cores
    (attn_prefill: 16-bit K/V of head dim 64 or 128, G ≤ ``PREFILL_MAX_GROUP``, tiles of
    several rows); else each row on its own (attn_partial's loop, per row)."""
    cache, G = op.inputs[1], op.inputs[0].shape[1] // op.inputs[1].shape[3]
    return (op.attrs["rows"] > 1 and cache.dtype.itemsize == 2 and cache.shape[5] in (64, 128)
            and G <= PREFILL_MAX_GROUP)


def _rope_append_task(op: OpInfo) -> str:
    D, views, ragged = op.attrs["head_dim"], op.inputs, bool(op.attrs.get("ragged", False))
    if D % 64 or D > 256:
        raise op.error(f"rope_append needs a head dim that is a multiple of 64 and at most 256, got {D}")
    floats = len(views) - ragged  # qo_indptr (ragged) last
    ctype = one_ctype(op, [views[i] for i in (0, 1, 5, *range(6, floats))], True)
    vec = 16 // DTYPE_SIZE[ctype] if ragged else 1  # the ragged task copies qkv and cos_sin rows in 16-byte pieces
    for what, i in (("qkv", 0), ("cos_sin", 1), ("kv_cache", 5), ("q_norm", 6), ("k_norm", 7)):
        if i < floats:
            check_contiguous(op, what, views[i], vec if i < 2 else 1)
    index = index_ctype(op, list(views[2:5]) + ([views[-1]] if ragged else []))
    return f"mpk::rope_append_impl<{D // 32}, {ctype}, {index}{', true' if ragged else ''}>"


def _attn_partial_task(op: OpInfo) -> str:
    fused, views = op.kind == "rope_attn_partial", op.inputs
    cache = views[_CACHE_INPUT[op.kind]]
    kv, D = cache.shape[3], cache.shape[5]
    heads = op.attrs["heads"] if fused else views[0].shape[1]
    if op.attrs.get("ragged") and _prefill_block(op):
        return _attn_prefill_task(op)
    if D not in (64, 128, 256) or (heads // kv) * D > ATTN_REGS * 32:
        raise op.error(f"paged attention with head dim {D} and {heads // kv} query heads per kv head has no CUDA "
                       f"variant (head dim 64, 128 or 256, group × head dim ≤ {ATTN_REGS * 32})")
    if fused and heads // kv > 6:
        raise op.error(f"rope_attn_partial rotates {heads // kv} query heads, k and v with a warp each; the task has "
                       "8 warps (the frontend fuses groups of at most 6)")
    rope_views = [views[i] for i in (0, 1, *range(6, len(views)))] if fused else [views[0]]
    final = bool(op.attrs.get("final", False))  # writes O in the cache's type, no merge op
    ctype = one_ctype(op, [cache, *rope_views], final)
    for what, v in zip(("qkv", "cos_sin", "q_norm", "k_norm") if fused else ("q",), rope_views):
        check_contiguous(op, what, v, 1 if fused else D // 32)
    check_contiguous(op, "kv_cache", cache, 16 // DTYPE_SIZE[ctype])  # rows are copied in 16-byte pieces
    index = _page_table_ctype(op)
    # attn_partial's kRagged (each row on its own), kPlan (the balanced split) and kTableAfterGate
    # (the graph rewrites the page table for its next iteration: read it once the event fired)
    flags = [bool(op.attrs.get("ragged")), bool(op.attrs.get("balanced")), any(v.carried for v in views[2:5])]
    while flags and not flags[-1]:  # the template's defaults
        flags.pop()
    tail = "".join(", true" if f else ", false" for f in flags)
    return (f"mpk::attn_partial<{D // 32}, {heads // kv}, {ctype}, {index}, {'true' if fused else 'false'}, "
            f"{'true' if final else 'false'}{tail}>")


def _page_table_ctype(op: OpInfo) -> str:
    """The C type of an attention op's page table (and qo_indptr), which its tasks read before
    their gate opens (attn_partial in paged_attention.cuh): a table the graph computes could
    still be in the making, so they must be graph inputs."""
    views = op.inputs
    names = ("kv_indptr", "kv_indices", "kv_last_page_len") + (("qo_indptr",) if op.attrs.get("ragged") else ())
    tables = views[2:2 + len(names)]
    computed = [what for what, v in zip(names, tables) if not v.graph_input]
    if computed:
        raise op.error(f"paged attention reads {', '.join(computed)} before its inputs are ready, so they must be "
                       "graph inputs; this graph computes them — pass the page table in as tensors")
    return index_ctype(op, list(tables))


def _attn_prefill_task(op: OpInfo) -> str:
    q, cache = op.inputs[0], op.inputs[1]
    D, G, final = cache.shape[5], q.shape[1] // cache.shape[3], bool(op.attrs.get("final", False))
    ctype = one_ctype(op, [cache, q], final)
    check_contiguous(op, "q", q, 2)  # read in 32-bit words (MMA operand pairs)
    check_contiguous(op, "kv_cache", cache, 16 // DTYPE_SIZE[ctype])  # rows are copied in 16-byte pieces
    plan = ", true" if op.attrs.get("balanced") else ""
    return (f"mpk::attn_prefill<{D // 32}, {G}, {ctype}, {_page_table_ctype(op)}, "
            f"{'true' if final else 'false'}{plan}>")


def _attn_merge_task(op: OpInfo) -> str:
    D = op.inputs[0].shape[4] - 1  # states [B, KV, C, G, D + 1]
    if D not in (64, 128, 256):
        raise op.error(f"attn_merge with head dim {D}; the CUDA task takes 64, 128 or 256")
    task = "attn_merge_planned" if len(op.inputs) == 2 else "attn_merge_impl"  # (planned: the balanced split)
    return f"mpk::{task}<{D // 32}, {one_ctype(op, [], True)}>"


def _attn_vector_inputs(op: OpInfo) -> tuple[int, ...]:
    return (0, 1) if op.attrs.get("ragged") else all_inputs(op)  # (ragged: q and the cache)


def _attrs_params(ints: tuple[str, ...], floats: tuple[str, ...]) -> Callable[[OpInfo], Params]:
    return lambda op: ([int(op.attrs[k]) for k in ints], [op.attrs[k] for k in floats])


ROPE_APPEND_GPU = GpuSpec(params=_attrs_params(("heads", "kv_heads", "head_dim", "page_size", "qk_norm", "layer"),
                                               ("eps",)), task=_rope_append_task,
                          vector_inputs=lambda op: (0, 1) if op.attrs.get("ragged") else ())  # (ragged: qkv, cos_sin)
def _attn_params(op: OpInfo) -> Params:
    """layer, page_size (and the ragged form's rows a block: the balanced split's R); scale."""
    rows = [int(op.attrs["rows"])] if op.attrs.get("ragged") else []
    return [int(op.attrs["layer"]), int(op.attrs["page_size"])] + rows, [op.attrs["scale"]]


# the attention tasks read their first sequence's page table before the gate (self-gated)
ATTN_PARTIAL_GPU = GpuSpec(params=_attn_params, task=_attn_partial_task,
                           self_gated=True, smem_bytes=_attention_smem, vector_inputs=_attn_vector_inputs)
ROPE_ATTN_PARTIAL_GPU = GpuSpec(params=_attrs_params(("layer", "page_size", "heads", "kv_heads", "qk_norm"),
                                                     ("scale", "eps")),
                                task=_attn_partial_task, self_gated=True, smem_bytes=_attention_smem,
                                vector_inputs=lambda op: (5,))  # the cache, whose rows it copies in 16-byte pieces
ATTN_MERGE_GPU = GpuSpec(task=_attn_merge_task,  # (planned: rows a block)
                         params=lambda op: ([int(op.attrs["rows"])] if len(op.inputs) == 2 else [], []))


def seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """Length of each sequence of a BSR page table (int64)."""
    pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    return torch.where(pages > 0, (pages - 1) * page_size + kv_last_page_len.long(), torch.zeros_like(pages))


def checked_lens(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int,
                 num_pages: int) -> torch.Tensor:
    """``seq_lens`` of a page table the tasks can follow, else ``BadInputError`` naming the
    first bad entry: kv_indptr must start at ≥ 0, never decrease and end within kv_indices, a
    sequence with pages must fill 1…page_size slots of its last one, and its pages must be
    pages of the cache. (The eager path and the CPU interpreter check here; the CUDA tasks check
    the same as they read the table, skip what they cannot follow and report it:
    BadInputCode in cuda/mpk_tasks/common.cuh.)"""
    indptr, last = kv_indptr.long(), kv_last_page_len.long()
    pages = indptr[1:] - indptr[:-1]
    bad = torch.nonzero(pages < 0).flatten()
    if len(bad):
        b = int(bad[0])
        raise BadInputError(f"kv_indptr decreases at sequence {b} ({int(indptr[b])} → {int(indptr[b + 1])}); "
                            "expected non-decreasing page offsets")
    if int(indptr[0]) < 0 or int(indptr[-1]) > kv_indices.shape[0]:
        raise BadInputError(f"kv_indptr spans entries {int(indptr[0])}…{int(indptr[-1])} of kv_indices, which has "
                            f"{kv_indices.shape[0]}")
    bad = torch.nonzero((pages > 0) & ((last < 1) | (last > page_size))).flatten()
    if len(bad):
        b = int(bad[0])
        raise BadInputError(f"kv_last_page_len[{b}] = {int(last[b])}; expected 1…{page_size} (the page size) for a "
                            "sequence with pages")
    used = kv_indices[int(indptr[0]): int(indptr[-1])].long()
    bad = torch.nonzero((used < 0) | (used >= num_pages)).flatten()
    if len(bad):
        i = int(bad[0]) + int(indptr[0])
        b = int(torch.searchsorted(indptr, torch.tensor(i), right=True)) - 1
        raise BadInputError(f"kv_indices[{i}] = {int(kv_indices[i])} (a page of sequence {b}) is outside the cache's "
                            f"{num_pages} pages")
    return seq_lens(kv_indptr, kv_last_page_len, page_size)


def qo_rows(qo_indptr: torch.Tensor, lens: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ragged form's rows: (sequence, position) of each of the ``tokens`` rows (int64; −1 for
    a padding row), for sequences of lengths ``lens`` (``checked_lens``); else BadInputError
    naming the first bad entry: qo_indptr must start at 0, never decrease and end within the
    rows (code 7, the first entry at fault), and no sequence may have more new rows than its
    length (code 8). (The CUDA tasks check the same: qo_ok and ragged_row in
    cuda/mpk_tasks/paged_table.cuh.)"""
    qo = qo_indptr.long()
    fault = qo > tokens  # an entry at fault: past the rows, entry 0 not 0, or below the entry before it
    fault[0] |= qo[0] != 0
    fault[1:] |= qo[1:] < qo[:-1]
    bad = torch.nonzero(fault).flatten()
    if len(bad):
        i = int(bad[0])
        raise BadInputError(bad_input_message(BAD_QO_INDPTR, int(qo[i]), i, tokens))
    counts = qo[1:] - qo[:-1]
    bad = torch.nonzero(counts > lens).flatten()
    if len(bad):
        b = int(bad[0])
        raise BadInputError(bad_input_message(BAD_QO_LEN, int(counts[b]), b, int(lens[b])))
    seq = torch.full((tokens,), -1, dtype=torch.int64)
    pos = torch.full((tokens,), -1, dtype=torch.int64)
    used = int(qo[-1])
    seq[:used] = torch.repeat_interleave(torch.arange(len(counts)), counts)
    pos[:used] = lens[seq[:used]] - qo[seq[:used] + 1] + torch.arange(used)
    return seq, pos


def token_slots(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, b: int, positions: torch.Tensor,
                page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(page id, slot in page) of the given positions of sequence ``b``."""
    pages = kv_indices[int(kv_indptr[b]) + torch.div(positions, page_size, rounding_mode="floor")].long()
    return pages, positions % page_size


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(O_a, lse_a) ⊕ (O_b, lse_b), base 2; ``o_*`` [..., D], ``lse_*`` [...]. Associative and
    commutative up to rounding; (0, −inf) is the identity; two empty states give (0, −inf)."""
    m = torch.maximum(lse_a, lse_b)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w_a, w_b = torch.exp2(lse_a - m_safe), torch.exp2(lse_b - m_safe)
    s = w_a + w_b
    nonempty = s > 0
    lse = torch.where(nonempty, m_safe + torch.log2(torch.where(nonempty, s, torch.ones_like(s))),
                      torch.full_like(s, -math.inf))
    inv = torch.where(nonempty, 1.0 / torch.where(nonempty, s, torch.ones_like(s)), torch.zeros_like(s))
    o = (w_a * inv).unsqueeze(-1) * o_a + (w_b * inv).unsqueeze(-1) * o_b
    return o, lse


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """State of query rows ``q`` [..., G, D] over keys/values [..., n, D] (float32; n may be 0;
    leading dims batch, e.g. a tile's kv heads)."""
    if k.shape[-2] == 0:
        return q.new_zeros(q.shape[:-1] + v.shape[-1:]), q.new_full(q.shape[:-1], -math.inf)
    s = (q @ k.transpose(-1, -2)) * (scale * LOG2E)
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp2(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    return (p @ v) / denom, (m + torch.log2(denom)).squeeze(-1)


# --- rope_append ------------------------------------------------------------------------------
# inputs: qkv [T, (H + 2·KV)·D], cos_sin [max_pos, D] (cos | sin halves), kv_indptr [B+1],
# kv_indices [N], kv_last_page_len [B], kv_cache, then q_norm [D] and k_norm [D] if qk_norm,
# then qo_indptr [B+1] if ragged (decode: T = B); output q [T, H, D]. Tiles split rows and heads.

def _rope_append_regions(sig: OpSig, rect):
    (b0, b1) = rect[0]
    layer = sig.attrs["layer"]
    cache = sig.in_shapes[5]
    whole = [tuple((0, n) for n in s) for s in sig.in_shapes]
    regions = [((b0, b1), (0, sig.in_shapes[0][1]))] + whole[1:5]
    regions.append(((layer, layer + 1),) + tuple((0, n) for n in cache[1:]))
    return regions + whole[6:]


def rms_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Qwen3/Llama RMSNorm over the last dim: normalise in fp32, round to ``dtype``, scale."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return (y.float() * weight.float()).to(dtype).float()


def kv_heads_of_tile(h0: int, h1: int, heads: int, kv_heads: int) -> range:
    """The kv heads whose k/v a rope_append tile over query heads [h0, h1) appends: those
    whose group's first query head lies in the tile. Attention over kv head j reads that
    query head, so it depends on the tile that wrote j's cache slot."""
    group = heads // kv_heads
    return range(-(-h0 // group), -(-h1 // group))


# The cache as the happens-before check sees it: the page table is run-time data, so a tile's
# cache accesses are named by (layer, kv head, token row, position) keys, the position being 0
# for what the row's sequence cached before this step and 1 for the slot the row appends
# (decode: a row is its sequence). Each sequence owns its pages and each new row of a sequence
# its own slot, so distinct appended keys are distinct cache rows; the cached ones nobody
# writes in the step. A ragged attention tile reads every row's keys of its kv heads: rows
# inside kv heads make that one interval of keys.
CACHE_KEY_DIMS = ("layer", "kv head", "row", "position (0: cached before the step, 1: appended by it)")


def _cache_keys(sig: OpSig, cache_input: int) -> Shape:
    cache = sig.in_shapes[cache_input]
    return (cache[0], cache[3], sig.in_shapes[0][0], 2)


def _rope_append_writes(sig: OpSig, rect):
    (b0, b1), (h0, h1) = rect[0], rect[1]
    kvs = kv_heads_of_tile(h0, h1, sig.attrs["heads"], sig.attrs["kv_heads"])
    layer = sig.attrs["layer"]
    return [(5, ((layer, layer + 1), (kvs.start, kvs.stop), (b0, b1), (1, 2)))] if len(kvs) else []


def _rope_append_keys(sig: OpSig):
    return [KeySpace(5, _cache_keys(sig, 5), CACHE_KEY_DIMS, lambda sig, rect: None)]


def _rope_append_cpu(sig: OpSig, rect, xs):
    return _rope_rows(sig.attrs, sig.out_dtype, rect[0], rect[1], xs, append=True, tokens=sig.out_shape[0])


def _rope_rows(a: dict, dtype: torch.dtype, rows, heads, xs, append: bool, tokens: int = 0) -> torch.Tensor:
    """Rotated (and qk-normed) q of query heads ``heads`` for the token rows ``rows`` (of
    ``tokens``), in ``dtype``; with ``append``, the k/v of the kv heads whose group starts in
    ``heads`` are written to each row's cache slot (xs: rope_append's inputs). Decode: row b is
    sequence b at its last position; ragged: ``qo_rows`` (padding rows: zero q, no append)."""
    qkv, cos_sin, indptr, indices, last, cache, *rest = xs
    ragged = bool(a.get("ragged", False))
    norms = rest[:-1] if ragged else rest
    H, KV, D, ps = a["heads"], a["kv_heads"], a["head_dim"], a["page_size"]
    (b0, b1), (h0, h1) = rows, heads
    kvs = kv_heads_of_tile(h0, h1, H, KV) if append else range(0)
    x = qkv.reshape(b1 - b0, H + 2 * KV, D).float()
    q, k, v = x[:, h0:h1], x[:, H + kvs.start:H + kvs.stop], x[:, H + KV + kvs.start:H + KV + kvs.stop]
    if a["qk_norm"]:
        q, k = rms_rows(q, norms[0], a["eps"], dtype), rms_rows(k, norms[1], a["eps"], dtype)
    lens = checked_lens(indptr, indices, last, ps, cache.shape[2])
    if ragged:
        seq, pos = (r[b0:b1] for r in qo_rows(rest[-1], lens, tokens))
        code = BAD_ROW_POSITION  # the GPU tasks report the same (BadInputCode kBadRowPosition)
    else:
        seq, pos = torch.arange(b0, b1), lens[b0:b1] - 1
        code = BAD_POSITION  # (kBadPosition)
    live = seq >= 0
    bad = torch.nonzero(live & ((pos < 0) | (pos >= cos_sin.shape[0]))).flatten()
    if len(bad):
        raise BadInputError("rope_append: " + bad_input_message(code, int(pos[bad[0]]), b0 + int(bad[0]),
                                                                cos_sin.shape[0]))
    cs = cos_sin[torch.where(live, pos, 0)].float()
    cos, sin = torch.cat([cs[:, : D // 2]] * 2, -1)[:, None], torch.cat([cs[:, D // 2:]] * 2, -1)[:, None]
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    for i in torch.nonzero(live).flatten().tolist() if append else ():
        page, slot = token_slots(indptr, indices, int(seq[i]), pos[i:i + 1], ps)
        cache[0, 0, page[0], kvs.start:kvs.stop, slot[0]] = k[i].to(cache.dtype)
        cache[0, 1, page[0], kvs.start:kvs.stop, slot[0]] = v[i].to(cache.dtype)
    return torch.where(live[:, None, None], q, 0.0).to(dtype)


def _rope_append_order(sig: OpSig) -> list[int]:
    """Decode: heads first. Ragged: rows first, so that every tile rotates all heads of its rows
    and appends all their kv heads (split by heads, the tiles holding a kv group's k/v would do
    twice the others' work)."""
    return [0, 1] if sig.attrs.get("ragged") else [1, 0]


register(OpDef(
    kind="rope_append", type_id=15, input_regions=_rope_append_regions, cpu=_rope_append_cpu, gpu=ROPE_APPEND_GPU,
    splittable=lambda sig: (True, True, False), split_order=_rope_append_order, min_tile_elems=1,
    inplace_writes=_rope_append_writes, key_spaces=_rope_append_keys,
    doc="q = rope(qk_norm(q)); cache[p] ← (rope(qk_norm(k)), v) for the kv heads the tile owns (p: each row's "
        "position; decode: len − 1)",
))


# --- attn_plan: load-balanced split-KV for the ragged form -------------------------------------
# inputs: kv_indptr [B+1], kv_last_page_len [B], qo_indptr [B+1]; attrs: rows R, chunks C,
# target P; output plan int32 [W + NB + 1] (NB = ⌈T / R⌉ row blocks, W = NB · C work items per kv
# head): item_block[W] (the row block item w works for; −1: none), then block_start[NB + 1]
# (block i's items are w ∈ [block_start[i], block_start[i+1]), in chunk order).

def plan_size(tokens: int, rows: int, chunks: int) -> int:
    """The plan's length for ``tokens`` rows in blocks of ``rows``, ``chunks`` items a block."""
    blocks = -(-tokens // rows)
    return blocks * chunks + blocks + 1


def block_costs(seq: torch.Tensor, pos: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row block's attention work in K/V positions: Σ over its segments (one sequence's rows
    each) of the segment's last row's position + 1 (a block's rows read each position once, all
    together), for rows given as ``qo_rows`` gives them (int64 [NB])."""
    T = seq.shape[0]
    blocks = -(-T // rows)
    t = torch.arange(T)
    nxt = torch.cat([seq[1:], seq.new_full((1,), -2)])
    seg_end = (seq >= 0) & ((nxt != seq) | ((t + 1) % rows == 0))
    cost = torch.zeros(blocks, dtype=torch.int64)
    return cost.index_add_(0, t[seg_end] // rows, pos[seg_end] + 1)


def attention_plan(cost: torch.Tensor, chunks: int, target: int) -> torch.Tensor:
    """The plan (int32 [W + NB + 1], above) of blocks of work ``cost`` [NB]: a chunk length
    L = max(MIN_CHUNK, ⌈Σ cost / P⌉) with P = min(``target``, W − the non-empty blocks), and
    ⌈cost_i / L⌉ items for block i — FlashInfer's balanced split (Algorithm 1): every item about
    L positions, a long sequence's blocks many items, a short one's one, and at most W in all
    (Σ ⌈c_i / L⌉ ≤ Σ c_i / L + nonempty ≤ P + nonempty ≤ W). Integer arithmetic only:
    cuda/mpk_tasks/paged_plan.cuh computes the same plan."""
    NB, C = cost.shape[0], chunks
    W = NB * C
    live = int((cost > 0).sum())
    parts = max(1, min(target, W - live))
    L = max(MIN_CHUNK, -(-int(cost.sum()) // parts))
    k = -(-cost // L)
    start = torch.zeros(NB + 1, dtype=torch.int64)
    start[1:] = torch.cumsum(k, 0)
    items = torch.full((W,), -1, dtype=torch.int64)
    items[: int(start[-1])] = torch.repeat_interleave(torch.arange(NB), k)
    return torch.cat([items, start]).to(torch.int32)


def plan_items(plan: torch.Tensor, blocks: int, chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(item_block [W], block_start [NB + 1]) of a plan, int64."""
    W = blocks * chunks
    return plan[:W].long(), plan[W:W + blocks + 1].long()


def _plan_cpu(sig: OpSig, rect, xs):
    indptr, last, qo = xs
    a = sig.attrs
    lens = seq_lens(indptr, last, a["page_size"]).clamp_min(0)
    seq, pos = qo_rows(qo, lens, a["tokens"])
    return attention_plan(block_costs(seq, pos, a["rows"]), a["chunks"], a["target"])


def _plan_task(op: OpInfo) -> str:
    return f"mpk::attn_plan<{index_ctype(op, list(op.inputs))}>"


register(OpDef(
    kind="attn_plan", type_id=34, input_regions=lambda sig, rect: [((0, s[0]),) for s in sig.in_shapes],
    cpu=_plan_cpu, splittable=lambda sig: (False,), min_tile_elems=1 << 30,
    gpu=GpuSpec(params=_attrs_params(("tokens", "rows", "chunks", "target", "page_size"), ()), task=_plan_task),
    doc="the ragged attention's balanced split-KV plan from the run-time lengths: which row block each item "
        "works for",
))


# --- attn_partial -----------------------------------------------------------------------------
# inputs: q [T, H, D], kv_cache, kv_indptr, kv_indices, kv_last_page_len, then qo_indptr if
# ragged (decode: T = B); output: states [T, KV, C, G, D + 1] float32 (O in [..., :D], lse in
# [..., D]); with attrs ``final`` (one chunk per sequence) O itself, [T, KV, G, D] in q's dtype:
# what attn_merge would make of the one state (⊕ with the identity), bit for bit.

MIN_CHUNK = 128  # positions: cuda/mpk_tasks/paged_attention.cuh's kMinChunk
PAGE_SIZES = "a power of two in 1…256"  # the page sizes the paged tasks take, as error messages say it


def is_page_size(n: object) -> bool:
    """Whether ``n`` is a page size the paged tasks take (``PAGE_SIZES``)."""
    return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 256 and not n & (n - 1)


def chunk_bounds(n: int, c: int, C: int, rope: bool) -> tuple[int, int]:
    """Cache positions [t0, t1) that chunk c of C reads from a sequence of length n: its m cache
    positions (n, or n − 1 for ``rope_attn_partial``, whose last chunk's tile attends to the
    token being decoded from the rows it rotated) in as many balanced chunks as keep each at
    least ``MIN_CHUNK`` long, at most C (one when m is shorter); chunks past those are empty.
    A short sequence takes fewer, longer chunks: very short chunks cost more in merging and
    per-task overhead than they gain in parallelism."""
    m = max(0, n - int(rope))
    used = min(C, max(1, m // MIN_CHUNK))
    return (c * m // used, (c + 1) * m // used) if c < used else (m, m)


DECODE_ROWS = 16  # a ragged step of at most this many token rows is taken for a batch of decodes
MMA_ROWS = 64  # query rows (token rows × group) a ragged tile holds at least: half a pass of attn_prefill (8 warps × 16)


def rows_per_tile(tokens: int, group: int) -> int:
    """R, the fewest token rows a ragged attention tile holds (``attrs['rows']``). A step of up
    to ``DECODE_ROWS`` rows is mostly decodes, whose rows share no K/V: one row a tile spreads
    them over the most workers. A prefill's rows share their sequence's K/V: R·G = ``MMA_ROWS``
    query rows, half a pass of the tensor-core task (attn_prefill: its 8 warps read each K/V row
    once for all of them; where G divides 16, two warps a block here, each half the positions),
    keep the tiles of a few hundred tokens as many as the workers."""
    return 1 if tokens <= DECODE_ROWS else max(1, MMA_ROWS // group)


def _chunks(sig: OpSig) -> tuple[bool, int, int]:
    """(final, C, G) of an attn_partial / rope_attn_partial signature."""
    final = bool(sig.attrs.get("final", False))
    return (final, 1, sig.out_shape[2]) if final else (final, sig.out_shape[2], sig.out_shape[3])


def _partial_regions(sig: OpSig, rect):
    k0, k1 = rect[1]
    G, D, layer = _chunks(sig)[2], sig.in_shapes[0][2], sig.attrs["layer"]
    cache = sig.in_shapes[1]
    rows = _all_rows(sig, rect)
    return [(rows, (k0 * G, k1 * G), (0, D)),
            ((layer, layer + 1),) + tuple((0, n) for n in cache[1:])] + [((0, n[0]),) for n in sig.in_shapes[2:]]


def _all_rows(sig: OpSig, rect) -> tuple[int, int]:
    """The token rows whose appends a tile's attention may read: its own (decode: its
    sequences), or every row (ragged: which rows share a sequence is run-time data)."""
    return (0, sig.in_shapes[0][0]) if sig.attrs.get("ragged") else rect[0]


def _partial_keys(sig: OpSig):
    # any chunk may hold the last position (chunk_bounds depends on the run-time length)
    layer = sig.attrs["layer"]
    return [KeySpace(1, _cache_keys(sig, 1), CACHE_KEY_DIMS,
                     lambda sig, rect: ((layer, layer + 1), rect[1], _all_rows(sig, rect), (0, 2)))]


def _appends(sig: OpSig, rect) -> bool:
    """Whether a rope_attn_partial tile appends its kv heads' k/v: it holds the last chunk."""
    final, C, _ = _chunks(sig)
    return final or rect[2][1] == C


def _rope_attn_writes(sig: OpSig, rect):
    layer = sig.attrs["layer"]
    return [(5, ((layer, layer + 1), rect[1], rect[0], (1, 2)))] if _appends(sig, rect) else []


def _rope_attn_keys(sig: OpSig):
    layer = sig.attrs["layer"]
    return [KeySpace(5, _cache_keys(sig, 5), CACHE_KEY_DIMS,
                     lambda sig, rect: ((layer, layer + 1), rect[1], rect[0], (0, 2 if _appends(sig, rect) else 1)))]


def _partial_cpu(sig: OpSig, rect, xs):
    if sig.attrs.get("ragged"):
        return _ragged_partial_cpu(sig, rect, xs)
    q, cache, indptr, indices, last = xs
    a = sig.attrs
    final, C, G = _chunks(sig)
    ps, rope = a["page_size"], bool(a.get("rope", False))
    (b0, b1), (k0, k1) = rect[0], rect[1]
    lens = checked_lens(indptr, indices, last, ps, cache.shape[2])
    out = torch.empty(tuple(h - lo for lo, h in rect), dtype=torch.float32)
    for i, b in enumerate(range(b0, b1)):
        n = int(lens[b])
        for j, c in enumerate(range(1) if final else range(*rect[2])):
            t0, t1 = chunk_bounds(n, c, C, rope)
            positions = torch.arange(t0, t1)
            if rope and c == C - 1 and n > 0:  # the token being decoded: appended by this tile
                positions = torch.cat([positions, torch.tensor([n - 1])])
            page, slot = token_slots(indptr, indices, b, positions, ps)
            # the tile's kv heads at once: k, v [kv heads, n, D], q [kv heads, G, D]
            kk = cache[0, 0, page, k0:k1, slot].transpose(0, 1).float()
            vv = cache[0, 1, page, k0:k1, slot].transpose(0, 1).float()
            o, lse = attend_chunk(q[i, : (k1 - k0) * G].float().unflatten(0, (k1 - k0, G)), kk, vv, a["scale"])
            if final:
                out[i] = o
            else:
                out[i, :, j, :, :-1], out[i, :, j, :, -1] = o, lse
    return out.to(sig.out_dtype) if final else out


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """States of token rows ``q`` [R, KV, G, D] over keys/values [KV, n, D] (float32), row r
    over the first ``valid[r]`` of the n positions (0: the empty state)."""
    n = k.shape[-2]
    o, lse = q.new_zeros(q.shape[:-1] + v.shape[-1:]), q.new_full(q.shape[:-1], -math.inf)
    if n == 0:
        return o, lse
    s = torch.einsum("rkgd,knd->rkgn", q, k) * (scale * LOG2E)
    s = s.masked_fill((torch.arange(n)[None, :] >= valid[:, None])[:, None, None, :], -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    p = torch.exp2(s - m)
    denom = p.sum(dim=-1, keepdim=True)
    some = denom > 0
    o = torch.where(some, (p @ v) / torch.where(some, denom, torch.ones_like(denom)), o)
    lse = torch.where(some, m + torch.log2(torch.where(some, denom, torch.ones_like(denom))), -math.inf).squeeze(-1)
    return o, lse


def _ragged_partial_cpu(sig: OpSig, rect, xs):
    """The ragged form's tile (module docstring): q holds every row of the tile's heads."""
    if sig.attrs.get("balanced"):
        return _balanced_partial_cpu(sig, rect, xs)
    q, cache, indptr, indices, last, qo_indptr = xs
    a = sig.attrs
    final, C, G = _chunks(sig)
    (r0, r1), (k0, k1) = rect[0], rect[1]
    lens = checked_lens(indptr, indices, last, a["page_size"], cache.shape[2])
    seq, pos = qo_rows(qo_indptr, lens, sig.out_shape[0])
    out = torch.zeros(tuple(h - lo for lo, h in rect), dtype=torch.float32)
    if not final:
        out[..., -1] = -math.inf  # padding rows and empty chunks: the empty state
    t = r0
    while t < r1:  # the tile's segments: rows [t, end) of sequence b
        b, end = int(seq[t]), t + 1
        while end < r1 and int(seq[end]) == b:
            end += 1
        if b >= 0:
            rows = q[t:end, : (k1 - k0) * G].float().unflatten(1, (k1 - k0, G))  # q: the tile's heads
            for j, c in enumerate(range(1) if final else range(*rect[2])):
                t0, t1 = chunk_bounds(int(pos[end - 1]) + 1, c, C, False)
                page, slot = token_slots(indptr, indices, b, torch.arange(t0, t1), a["page_size"])
                kk = cache[0, 0, page, k0:k1, slot].transpose(0, 1).float()
                vv = cache[0, 1, page, k0:k1, slot].transpose(0, 1).float()
                o, lse = attend_rows(rows, kk, vv, (pos[t:end] + 1 - t0).clamp(0, t1 - t0), a["scale"])
                if final:
                    out[t - r0:end - r0] = o
                else:
                    out[t - r0:end - r0, :, j, :, :-1], out[t - r0:end - r0, :, j, :, -1] = o, lse
        t = end
    return out.to(sig.out_dtype) if final else out


def _balanced_partial_cpu(sig: OpSig, rect, xs):
    """The balanced ragged form's tile (``attrs['balanced']``, the plan the last input): storage
    row b, slot c is item w = ⌊b / R⌋·C + c's state of row b mod R of its block (attn_plan),
    over chunk w − block_start of that block's items, its segment's m as in ``_ragged_partial_cpu``
    with the block's rows for the tile's."""
    q, cache, indptr, indices, last, qo_indptr, plan = xs
    a = sig.attrs
    _, C, G = _chunks(sig)
    R, T = a["rows"], q.shape[0]
    (r0, r1), (k0, k1), (c0, c1) = rect[0], rect[1], rect[2]
    lens = checked_lens(indptr, indices, last, a["page_size"], cache.shape[2])
    seq, pos = qo_rows(qo_indptr, lens, T)
    items, start = plan_items(plan, -(-T // R), C)
    out = torch.zeros(tuple(h - lo for lo, h in rect), dtype=torch.float32)
    out[..., -1] = -math.inf  # unused items and padding rows: the empty state
    for b in range(r0, r1):
        for c in range(c0, c1):
            w = b // R * C + c
            i = int(items[w])
            t = i * R + b % R  # the row the item's state is of
            if i < 0 or t >= T or int(seq[t]) < 0:
                continue
            s = t  # the row's segment in its block ends at row s
            while s + 1 < min(i * R + R, T) and int(seq[s + 1]) == int(seq[t]):
                s += 1
            j, k = w - int(start[i]), int(start[i + 1] - start[i])
            t0, t1 = chunk_bounds(int(pos[s]) + 1, j, k, False)
            page, slot = token_slots(indptr, indices, int(seq[t]), torch.arange(t0, t1), a["page_size"])
            kk = cache[0, 0, page, k0:k1, slot].transpose(0, 1).float()
            vv = cache[0, 1, page, k0:k1, slot].transpose(0, 1).float()
            row = q[t:t + 1].float().unflatten(1, (k1 - k0, G))  # (q: the tile's heads)
            o, lse = attend_rows(row, kk, vv, (pos[t:t + 1] + 1 - t0).clamp(0, t1 - t0), a["scale"])
            out[b - r0, :, c - c0, :, :-1], out[b - r0, :, c - c0, :, -1] = o[0], lse[0]
    return out


def _chunk_splits(sig: OpSig) -> tuple[bool, ...]:
    """Tiles split rows, kv heads and chunks; never a group's heads or a head's dims."""
    return (True, True, False, False) if sig.attrs.get("final") else (True, True, True, False, False)


def _chunk_order(sig: OpSig) -> list[int]:
    """Decode: sequences first. Ragged: kv heads and chunks first, rows last, so that with
    ``_partial_min_tile`` a tile holds at least ``attrs['rows']`` rows."""
    final = bool(sig.attrs.get("final"))
    if sig.attrs.get("ragged"):
        return [1, 0] if final else [1, 2, 0]
    return [0, 1] if final else [0, 1, 2]


def _partial_min_tile(sig: OpSig) -> int:
    """Decode: one state. Ragged: ``attrs['rows']`` rows' states of one kv head and chunk."""
    G, width = _chunks(sig)[2], sig.out_shape[-1]
    return sig.attrs["rows"] * G * width if sig.attrs.get("ragged") else 1


PREFILL_TILES_PER_WORKER = 8


def _attention_grid(sig: OpSig, workers: int) -> tuple[int, ...] | None:
    """Balanced: a tile per (row block, kv head, item slot), so that a tile is one item.
    Ragged with one chunk (a prefill's rows): a causal row's work grows with its position, so
    one tile a worker leaves the workers of the last rows working longest; tiles of at least
    ``attrs['rows']`` rows, up to ``PREFILL_TILES_PER_WORKER`` per worker, dealt by their work
    (``_attention_cost``, mpk.compiler.place), give each worker an even share. A tile's passes
    over its sequence's K/V are as many as its rows need either way: finer tiles cost only their
    tasks' start-up. Otherwise the default grid (None)."""
    if sig.attrs.get("balanced"):
        S, KV, C = sig.out_shape[:3]
        return (S // sig.attrs["rows"], KV, C, 1, 1)
    if not (sig.attrs.get("ragged") and sig.attrs.get("final")):
        return None
    T, KV = sig.out_shape[:2]
    blocks = max(1, min(T // max(1, sig.attrs["rows"]), PREFILL_TILES_PER_WORKER * workers // KV))
    return (blocks, KV, 1, 1)


def _attention_cost(sig: OpSig, rect) -> float:
    """A prefill tile's work (ragged, one chunk): its rows times their mean position, as if the
    step were one prompt (its rows' sequences are run-time data); NaN (alike) otherwise."""
    if not (sig.attrs.get("ragged") and sig.attrs.get("final") and sig.attrs.get("rows", 1) > 1):
        return math.nan
    (a, b) = rect[0]
    return (b - a) * (a + b + 1) / 2


register(OpDef(
    kind="attn_partial", type_id=31, input_regions=_partial_regions, cpu=_partial_cpu, gpu=ATTN_PARTIAL_GPU,
    splittable=_chunk_splits, split_order=_chunk_order, default_grid=_attention_grid,
    min_tile_elems=_partial_min_tile, long_tasks=True, key_spaces=_partial_keys, tile_cost=_attention_cost,
    doc="partial (O, lse) of G query heads over one KV chunk of a paged sequence (final: O, one chunk)",
))


# --- rope_attn_partial ------------------------------------------------------------------------
# rope_append fused into attn_partial: rope_append's inputs (qkv, cos_sin, kv_indptr, kv_indices,
# kv_last_page_len, kv_cache[, q_norm, k_norm]); output states [B, KV, C, G, D + 1] float32.
# Tile (b, kv head j, chunk c) rotates the G query heads of j itself (every chunk's tile does;
# they are few), and the tile of the last chunk, the only one whose positions include the token
# being decoded, appends j's k/v to the cache. No other tile reads that slot, so the tiles of
# one op need no order among themselves; one op boundary fewer per layer than the pair.

def _rope_attn_cpu(sig: OpSig, rect, xs):
    a = sig.attrs
    final, C, G = _chunks(sig)
    (b0, b1), (k0, k1) = rect[0], rect[1]
    last_chunk = final or rect[2][1] == C
    q = _rope_rows(a, xs[0].dtype, (b0, b1), (k0 * G, k1 * G), xs, append=last_chunk)  # q rounds as qkv does
    indptr, indices, last, cache = xs[2:6]
    psig = OpSig((), sig.out_shape, sig.out_dtype,
                 {"page_size": a["page_size"], "scale": a["scale"], "final": final, "rope": True})
    return _partial_cpu(psig, rect, [q, cache, indptr, indices, last])


register(OpDef(
    kind="rope_attn_partial", type_id=33, input_regions=_rope_append_regions, cpu=_rope_attn_cpu,
    gpu=ROPE_ATTN_PARTIAL_GPU,
    splittable=_chunk_splits, split_order=_chunk_order,
    min_tile_elems=1, long_tasks=True, inplace_writes=_rope_attn_writes, key_spaces=_rope_attn_keys,
    doc="rope_append and attn_partial in one task: rotate the group's q, append k/v (last chunk), attend",
))


# --- attn_merge -------------------------------------------------------------------------------
# input: states [B, KV, C, G, D + 1]; output [B, H, D].

# Balanced (a plan the second input, attrs ``rows`` R): row t's states are its block's items
# (attn_plan), item w's at storage row ⌊w / C⌋·R + t mod R, slot w mod C.

def _merge_regions(sig: OpSig, rect):
    (b0, b1), (h0, h1) = rect[0], rect[1]
    S, _, C, G, D1 = sig.in_shapes[0]
    heads = (h0 // G, (h1 - 1) // G + 1)
    if len(sig.in_shapes) == 2:  # balanced: which items a row's are is run-time data
        return [((0, S), heads, (0, C), (0, G), (0, D1)), ((0, sig.in_shapes[1][0]),)]
    return [((b0, b1), heads, (0, C), (0, G), (0, D1))]


def _merge_cpu(sig: OpSig, rect, xs):
    states = xs[0]
    if len(xs) == 2:  # (balanced: the region holds every row's states)
        states = _gather_items(states, xs[1], sig.attrs["rows"], rect[0], sig.out_shape[0])
    (h0, h1) = rect[1]
    G = states.shape[3]
    first = (h0 // G) * G  # query head of the region's first state
    s = states.permute(0, 1, 3, 2, 4).flatten(1, 2)[:, h0 - first: h1 - first]  # [b, h, C, D+1]
    o, lse = torch.zeros(s.shape[:2] + (s.shape[-1] - 1,)), torch.full(s.shape[:2], -math.inf)
    for c in range(s.shape[2]):
        o, lse = merge_states(o, lse, s[:, :, c, :-1], s[:, :, c, -1])
    return o.to(sig.out_dtype)


def _gather_items(states: torch.Tensor, plan: torch.Tensor, R: int, rows: tuple[int, int], T: int) -> torch.Tensor:
    """Rows ``rows`` of a balanced attention's states as the plain form holds them, [rows, KV,
    items, G, D + 1] with a row's items in plan order (missing items: the empty state)."""
    S, KV, C, G, D1 = states.shape
    items, start = plan_items(plan, -(-T // R), C)
    count = start[1:] - start[:-1]
    width = max(1, int(count.max()) if len(count) else 1)
    out = torch.zeros((rows[1] - rows[0], KV, width, G, D1), dtype=states.dtype)
    out[..., -1] = -math.inf
    for t in range(*rows):
        i = t // R
        for j, w in enumerate(range(int(start[i]), int(start[i + 1]))):
            out[t - rows[0], :, j] = states[w // C * R + t % R, :, w % C]
    return out


register(OpDef(
    kind="attn_merge", type_id=32, input_regions=_merge_regions, cpu=_merge_cpu, gpu=ATTN_MERGE_GPU,
    splittable=lambda sig: (True, True, False), split_order=lambda sig: [1, 0], min_tile_elems=1,
    doc="out = ⊕ over chunks of the partial states",
))
