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
from mpk.errors import BadInputError
from mpk.ops.paged import MIN_CHUNK, PAGE_SIZES, is_page_size, plan_size, rows_per_tile


def _run_whole(kind: str, inputs: list[torch.Tensor], out_dtype: torch.dtype, **attrs) -> torch.Tensor:
    out_shape = torch.broadcast_shapes(*[t.shape for t in inputs])
    sig = OpSig(tuple(tuple(t.shape) for t in inputs), tuple(out_shape), out_dtype, attrs)
    return get_op(kind).cpu(sig, full_rect(tuple(out_shape)), inputs).contiguous()


@torch.library.custom_op("mpk::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             compute_dtype: torch.dtype, norm_dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm as Llama/Qwen write it: normalise in ``compute_dtype``, cast to ``norm_dtype``, scale."""
    inputs = [x] + ([weight] if weight is not None else [])
    return _run_whole("rms_norm", inputs, rms_norm_out_dtype(weight, norm_dtype), eps=eps,
                      has_weight=weight is not None, compute_dtype=str(compute_dtype)[6:],
                      norm_dtype=str(norm_dtype)[6:])


def rms_norm_out_dtype(weight: torch.Tensor | None, norm_dtype: torch.dtype) -> torch.dtype:
    return norm_dtype if weight is None else torch.promote_types(norm_dtype, weight.dtype)


@rms_norm.register_fake
def _(x, weight, eps, compute_dtype, norm_dtype):
    return x.new_empty(x.shape, dtype=rms_norm_out_dtype(weight, norm_dtype))


def _matmul(inputs: list[torch.Tensor], out_shape, out_dtype: torch.dtype, **attrs) -> torch.Tensor:
    """The ``matmul`` kind's CPU tile over the whole output (attrs: its prologue / epilogue)."""
    sig = OpSig(tuple(tuple(t.shape) for t in inputs), tuple(out_shape), out_dtype, attrs)
    return get_op("matmul").cpu(sig, full_rect(sig.out_shape), inputs).contiguous()


def _silu_epilogue(silu_mul: bool) -> dict:
    return {"epilogue": "silu_mul"} if silu_mul else {}


@torch.library.custom_op("mpk::rms_norm_matmul", mutates_args=())
def rms_norm_matmul(x: torch.Tensor, weight: torch.Tensor, eps: float, compute_dtype: torch.dtype,
                    norm_dtype: torch.dtype, b: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    """``rms_norm(x, weight) @ b`` (with ``silu_mul``: then SiLU·mul of its two halves, as
    ``matmul_silu_mul``): a projection with its RMSNorm as prologue, with the unfused pair's
    roundings (mpk.ops.linalg: matmul, prologue "rms_norm"). Each task normalises its rows of x
    on chip; the normalised activations never reach memory."""
    M, N = x.shape[0], b.shape[1] // 2 if silu_mul else b.shape[1]
    return _matmul([x, b, weight], (M, N), rms_norm_out_dtype(weight, norm_dtype), prologue="rms_norm", eps=eps,
                   compute_dtype=str(compute_dtype)[6:], norm_dtype=str(norm_dtype)[6:], **_silu_epilogue(silu_mul))


@rms_norm_matmul.register_fake
def _(x, weight, eps, compute_dtype, norm_dtype, b, silu_mul=False):
    return x.new_empty((x.shape[0], b.shape[1] // 2 if silu_mul else b.shape[1]),
                       dtype=rms_norm_out_dtype(weight, norm_dtype))


def _norm_stats_shape(a, b, r, g, group: int) -> tuple[int, int, int, int]:
    from mpk.ops.linalg import STATS_GROUPS

    M, N = r.shape
    if group not in STATS_GROUPS:
        raise ValueError(f"matmul_norm_stats: group={group!r}; expected one of {STATS_GROUPS} (columns per sum of h²)")
    if r.dtype.itemsize != 2 or N % group:
        raise ValueError(f"matmul_norm_stats: h = r + a @ b is {str(r.dtype)[6:]} [{M}, {N}]; expected a 2-byte "
                         f"dtype (the sums are fp32 in element pairs) and a multiple of {group} columns")
    return 3, M, N // group, group


@torch.library.custom_op("mpk::matmul_norm_stats", mutates_args=())
def matmul_norm_stats(a: torch.Tensor, b: torch.Tensor, r: torch.Tensor, g: torch.Tensor,
                      group: int = 16) -> torch.Tensor:
    """``h = r + a @ b`` (a residual projection) packed with what the RMSNorm of weight ``g``
    after it needs: [3, M, N/group, group] of h, h·g and per-group sums of h² (mpk.ops.linalg:
    matmul, epilogue "norm_stats", defines the layout); ``norm_stats_matmul`` consumes it."""
    return _matmul([a, b, r, g], _norm_stats_shape(a, b, r, g, group), r.dtype, epilogue="norm_stats")


@matmul_norm_stats.register_fake
def _(a, b, r, g, group=16):
    return r.new_empty(_norm_stats_shape(a, b, r, g, group))


def norm_stats_parts(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, h·g, sums) of a ``matmul_norm_stats`` output, each viewed [M, N]."""
    _, M, groups, width = packed.shape
    return tuple(packed[i].reshape(M, groups * width) for i in range(3))


@torch.library.custom_op("mpk::norm_stats_matmul", mutates_args=())
def norm_stats_matmul(packed: torch.Tensor, b: torch.Tensor, eps: float, silu_mul: bool = False) -> torch.Tensor:
    """``rms_norm(h, g) @ b`` (with ``silu_mul``: then SiLU·mul of its two halves) from a
    ``matmul_norm_stats`` output: h·g @ b scaled by each row's rstd, which comes from the packed
    sums (mpk.ops.linalg: matmul, prologue "norm_stats")."""
    _, hg, sums = norm_stats_parts(packed)
    M, N = hg.shape[0], b.shape[1] // 2 if silu_mul else b.shape[1]
    return _matmul([hg, b, sums], (M, N), packed.dtype, prologue="norm_stats", eps=eps, group=packed.shape[3],
                   **_silu_epilogue(silu_mul))


@norm_stats_matmul.register_fake
def _(packed, b, eps, silu_mul=False):
    return packed.new_empty((packed.shape[1], b.shape[1] // 2 if silu_mul else b.shape[1]))


@torch.library.custom_op("mpk::matmul_silu_mul", mutates_args=())
def matmul_silu_mul(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``silu(h[:, :N/2]) * h[:, N/2:]`` with ``h = x @ b`` (a SwiGLU MLP's fused gate·up
    projection and its activation): each task computes its gate and up columns together and
    stores only the product; ``h`` never exists."""
    M, N = x.shape[0], b.shape[1]
    return _matmul([x, b], (M, N // 2), torch.promote_types(x.dtype, b.dtype), epilogue="silu_mul")


@matmul_silu_mul.register_fake
def _(x, b):
    return x.new_empty((x.shape[0], b.shape[1] // 2), dtype=torch.promote_types(x.dtype, b.dtype))


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


# --- attention over the paged KV cache (mpk.ops.paged documents the layout and both forms) ------

def _cache_dims(kv_cache: torch.Tensor) -> tuple[int, int]:
    if len(kv_cache.shape) != 6 or kv_cache.shape[1] != 2:
        raise ValueError(f"kv_cache has shape {tuple(kv_cache.shape)}; expected [layers, 2, pages, kv_heads, "
                         "page_size, head_dim]")
    return int(kv_cache.shape[4]), int(kv_cache.shape[5])  # page_size, head_dim


def check_paged(kv_cache, layer: int, batch: int, kv_indptr, kv_indices, kv_last_page_len) -> tuple[int, int]:
    """(page_size, head_dim) of a paged op's cache, after checking what the tasks assume of it
    and of the page table's shapes (anything with ``.shape``: tensors, or the lowering's views);
    a ValueError names the bad one. The table's entries are checked where they are read
    (``mpk.ops.paged.checked_lens``)."""
    page_size, head_dim = _cache_dims(kv_cache)
    if not is_page_size(page_size):
        raise ValueError(f"page_size {page_size}; expected {PAGE_SIZES}")
    if not 0 <= layer < kv_cache.shape[0]:
        raise ValueError(f"layer {layer}; the cache has layers 0…{kv_cache.shape[0] - 1}")
    if kv_cache.shape[2] < 1:  # the tasks read page 0 in place of a page id outside the cache
        raise ValueError(f"the cache has {kv_cache.shape[2]} pages; expected at least one")
    for name, t, want in (("kv_indptr", kv_indptr, (batch + 1,)), ("kv_last_page_len", kv_last_page_len, (batch,))):
        if tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want} for a batch of {batch}")
    if len(kv_indices.shape) != 1:
        raise ValueError(f"kv_indices has shape {tuple(kv_indices.shape)}; expected [num_entries]")
    return page_size, head_dim


def check_qo_indptr(qo_indptr, kv_indptr, kv_last_page_len) -> None:
    """The ragged form's static checks (anything with ``.shape`` and ``.dtype``): qo_indptr
    [B + 1], B the page table's batch, in the page table's integer type (the tasks read them as
    one type). A BadInputError (a ValueError) names what is wrong; its entries are checked where
    they are read (``mpk.ops.paged.qo_rows``)."""
    want = (kv_last_page_len.shape[0] + 1,)
    if tuple(qo_indptr.shape) != want:
        raise BadInputError(f"qo_indptr has shape {tuple(qo_indptr.shape)}; expected {want}: one row offset per "
                            f"sequence of the page table's batch of {want[0] - 1}, and the end")
    if qo_indptr.dtype != kv_indptr.dtype or qo_indptr.dtype not in (torch.int32, torch.int64):
        raise BadInputError(f"qo_indptr is {str(qo_indptr.dtype)[6:]}; expected the page table's integer type "
                            f"{str(kv_indptr.dtype)[6:]} (int32 or int64)")


def _batch(rows: int, kv_last_page_len, qo_indptr) -> int:
    """The page table's batch: one sequence per row in decode, its own in the ragged form."""
    return rows if qo_indptr is None else kv_last_page_len.shape[0]


def rope_append_attrs(qkv, kv_cache, kv_indptr, kv_indices, kv_last_page_len, q_norm, k_norm, layer, heads,
                      kv_heads, eps, qo_indptr=None) -> dict:
    batch = _batch(qkv.shape[0], kv_last_page_len, qo_indptr)
    page_size, head_dim = check_paged(kv_cache, layer, batch, kv_indptr, kv_indices, kv_last_page_len)
    if qo_indptr is not None:
        check_qo_indptr(qo_indptr, kv_indptr, kv_last_page_len)
    if not 1 <= kv_heads <= heads or heads % kv_heads or kv_heads != kv_cache.shape[3]:
        raise ValueError(f"heads {heads}, kv_heads {kv_heads}; expected kv_heads = the cache's {kv_cache.shape[3]} "
                         "and heads a multiple of it")
    if qkv.shape[-1] != (heads + 2 * kv_heads) * head_dim:
        raise ValueError(f"qkv has {qkv.shape[-1]} columns; expected (heads {heads} + 2·kv_heads {kv_heads})·"
                         f"head_dim {head_dim} = {(heads + 2 * kv_heads) * head_dim}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm: expected both (per-head qk-norm) or neither")
    attrs = dict(layer=layer, heads=heads, kv_heads=kv_heads, head_dim=head_dim, page_size=page_size,
                 eps=eps, qk_norm=q_norm is not None)
    return attrs if qo_indptr is None else {**attrs, "ragged": True}


def paged_attention_dims(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, layer: int,
                         num_splits: int, qo_indptr=None) -> tuple[int, int, int]:
    """(page_size, head_dim, kv_heads) of a paged attention, after checking its cache, page
    table, q [T, H, D] (anything with ``.shape``; decode: T = B), qo_indptr (the ragged form)
    and ``num_splits``; a ValueError names the bad one."""
    batch = _batch(q.shape[0], kv_last_page_len, qo_indptr)
    page_size, head_dim = check_paged(kv_cache, layer, batch, kv_indptr, kv_indices, kv_last_page_len)
    if qo_indptr is not None:
        check_qo_indptr(qo_indptr, kv_indptr, kv_last_page_len)
    KV = kv_cache.shape[3]
    if len(q.shape) != 3 or q.shape[1] % KV or q.shape[2] != head_dim:
        raise ValueError(f"q is {tuple(q.shape)}; expected [T, a multiple of kv_heads {KV}, head_dim {head_dim}]")
    if num_splits < 0:
        raise ValueError(f"num_splits {num_splits}; expected ≥ 0 (0: the compiler picks)")
    return page_size, head_dim, KV


@torch.library.custom_op("mpk::rope_append", mutates_args=("kv_cache",))
def rope_append(qkv: torch.Tensor, cos_sin: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                kv_last_page_len: torch.Tensor, kv_cache: torch.Tensor, q_norm: torch.Tensor | None,
                k_norm: torch.Tensor | None, layer: int, heads: int, kv_heads: int, eps: float,
                qo_indptr: torch.Tensor | None = None) -> torch.Tensor:
    """Split fused qkv rows [T, (heads + 2·kv_heads)·head_dim], apply per-head qk-norm (when
    given) and RoPE at each row's position, append the rows' k and v to layer ``layer`` of the
    paged cache (in place) and return the rotated q [T, heads, head_dim]. Without
    ``qo_indptr`` (decode) row b is sequence b's new token at its last position; with it
    (prefill, mixed batches) sequence b's new rows are qo_indptr[b]…qo_indptr[b+1] − 1 at the
    end of its length, and rows from qo_indptr[B] on are padding (zero q, no append):
    mpk.ops.paged documents the ragged form."""
    attrs = rope_append_attrs(qkv, kv_cache, kv_indptr, kv_indices, kv_last_page_len, q_norm, k_norm, layer, heads,
                              kv_heads, eps, qo_indptr)
    inputs = [qkv, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache]
    inputs += [q_norm, k_norm] if q_norm is not None else []
    inputs += [qo_indptr] if qo_indptr is not None else []
    sig = OpSig(tuple(tuple(t.shape) for t in inputs), (qkv.shape[0], heads, attrs["head_dim"]), qkv.dtype, attrs)
    whole = [t.cpu() if i != 5 else t for i, t in enumerate(inputs)]
    cache_slice = kv_cache[layer:layer + 1]
    work = cache_slice if kv_cache.device.type == "cpu" else cache_slice.cpu()
    whole[5] = work
    out = get_op("rope_append").cpu(sig, full_rect(sig.out_shape), whole)
    if work is not cache_slice:
        cache_slice.copy_(work)
    return out.to(qkv.device)


@rope_append.register_fake
def _(qkv, cos_sin, kv_indptr, kv_indices, kv_last_page_len, kv_cache, q_norm, k_norm, layer, heads, kv_heads, eps,
      qo_indptr=None):
    return qkv.new_empty((qkv.shape[0], heads, kv_cache.shape[5]))


def default_splits(batch: int, kv_heads: int, max_len: int, workers: int = 128) -> int:
    """KV chunks per sequence, for a cache of ``max_len`` positions per sequence: enough
    (b, kv head, chunk) tasks for one wave over ``workers`` with chunks of at least
    2 · ``MIN_CHUNK`` positions of the capacity — or, where that leaves fewer, tasks for half the
    workers with chunks of at least ``MIN_CHUNK`` that a sequence short of the capacity still
    fills. At run time a shorter sequence uses fewer chunks (``mpk.ops.paged.chunk_bounds``).
    Splitting costs a merge op, a stage as long as several of a task's round trips, and with one
    chunk there is none. Half the workers, not all, in the second case: shorter chunks on every
    worker cost more than they gain, while long chunks on half of them still pay."""
    pairs = max(1, batch * kv_heads)
    wave = min(workers // pairs, max_len // (2 * MIN_CHUNK))
    half = min(workers // (2 * pairs), (max_len - 1) // MIN_CHUNK)
    return max(1, wave, half)


@torch.library.custom_op("mpk::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                    kv_last_page_len: torch.Tensor, layer: int, scale: float, num_splits: int,
                    qo_indptr: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [T, H, D] over layer ``layer`` of the paged cache; GQA when H is a
    multiple of the cache's kv heads. Without ``qo_indptr`` (decode) row b is sequence b's new
    token and attends to its whole length; with it (prefill, mixed batches) sequence b's rows
    qo_indptr[b]…qo_indptr[b+1] − 1 are its newest positions, each attending causally up to its
    own, and rows from qo_indptr[B] on are padding (zero output): mpk.ops.paged documents the
    ragged form. ``num_splits`` KV chunks per sequence at most (a sequence uses one per
    ``MIN_CHUNK`` positions; 0: chosen by the compiler) are attended separately and merged with ⊕."""
    page_size, _, KV = paged_attention_dims(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, layer, num_splits,
                                            qo_indptr)
    T, H, D = q.shape
    C = max(1, num_splits)
    attrs = dict(layer=layer, scale=scale, page_size=page_size)
    tables = [t.cpu() for t in (kv_indptr, kv_indices, kv_last_page_len)]
    ins = [q.cpu(), kv_cache[layer:layer + 1].cpu()] + tables
    rows = T
    merge_ins, merge_attrs = [], {}
    if qo_indptr is not None:
        R = rows_per_tile(T, H // KV)
        attrs |= {"ragged": True, "rows": R}
        ins.append(qo_indptr.cpu())
        if C > 1:  # the balanced split (mpk.ops.paged: attn_plan), as the compiled graph runs it
            plan_attrs = dict(tokens=T, rows=R, chunks=C, target=C * -(-T // R), page_size=page_size)
            pins = [tables[0], tables[2], qo_indptr.cpu()]
            plan_sig = OpSig(tuple(tuple(t.shape) for t in pins), (plan_size(T, R, C),), torch.int32, plan_attrs)
            plan = get_op("attn_plan").cpu(plan_sig, full_rect(plan_sig.out_shape), pins)
            attrs["balanced"] = True
            ins.append(plan)
            rows, merge_ins, merge_attrs = -(-T // R) * R, [plan], {"rows": R}
    psig = OpSig(tuple(tuple(t.shape) for t in ins), (rows, KV, C, H // KV, D + 1), torch.float32, attrs)
    states = get_op("attn_partial").cpu(psig, full_rect(psig.out_shape), ins)
    msig = OpSig((psig.out_shape, *(tuple(t.shape) for t in merge_ins)), (T, H, D), q.dtype, merge_attrs)
    return get_op("attn_merge").cpu(msig, full_rect(msig.out_shape), [states, *merge_ins]).to(q.device)


@paged_attention.register_fake
def _(q, kv_cache, kv_indptr, kv_indices, kv_last_page_len, layer, scale, num_splits, qo_indptr=None):
    return q.new_empty(q.shape)


# --- sampling (mpk.ops.sampling) ----------------------------------------------------------------

def check_sample(logits, temperature, top_k, top_p, min_p, seed, counter) -> None:
    """The ``sample`` op's shapes and dtypes (anything with ``.shape`` and ``.dtype``): logits
    [B, V] float32 / float16 / bfloat16 and the per-row parameters [B] in
    ``mpk.ops.sampling.PARAM_DTYPES``; a BadInputError names the bad one."""
    from mpk.ops.sampling import LOGIT_DTYPES, PARAM_DTYPES

    if len(logits.shape) != 2 or logits.dtype not in LOGIT_DTYPES:
        raise BadInputError(f"sample(): logits are {str(logits.dtype)[6:]} {list(logits.shape)}; expected [B, V] "
                            "float32, float16 or bfloat16")
    B = logits.shape[0]
    for (name, dtype), t in zip(PARAM_DTYPES.items(), (temperature, top_k, top_p, min_p, seed, counter)):
        if tuple(t.shape) != (B,) or t.dtype != dtype:
            raise BadInputError(f"sample(): {name} is {str(t.dtype)[6:]} {list(t.shape)}; expected "
                                f"{str(dtype)[6:]} [{B}], one per row of logits")


@torch.library.custom_op("mpk::sample", mutates_args=())
def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` [B, V] (int64 [B]) under that row's temperature, top_k,
    top_p, min_p, seed and counter: ``mpk.engine.sampling.sample`` (mpk.ops.sampling says how
    a seed's int64 is read). In a compiled graph it is D + 1 ops inside the kernel (D = 2 for bf16/f16, 4 for float32): per-segment
    histograms (sample_partial, sample_digit), then a task per row (sample)."""
    from mpk.ops.sampling import sample_eager

    check_sample(logits, temperature, top_k, top_p, min_p, seed, counter)
    # the reference's tiles run on the CPU (exact int64 fixed point, as the interpreter's)
    args = [t.cpu() for t in (logits, temperature, top_k, top_p, min_p, seed, counter)]
    return sample_eager(args).to(logits.device)


@sample.register_fake
def _(logits, temperature, top_k, top_p, min_p, seed, counter):
    check_sample(logits, temperature, top_k, top_p, min_p, seed, counter)
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


# --- the start-of-iteration task (mpk.ops.iteration) ---------------------------------------------

def check_advance(next_tokens, tokens, kv_indptr, kv_indices, kv_last_page_len, seqs, pool, out, page_size: int,
                  max_len: int, stops: int) -> None:
    """``decode_advance``'s shapes and dtypes (anything with ``.shape`` and ``.dtype``), as
    mpk.ops.iteration lays them out; a BadInputError names the bad one."""
    from mpk.ops.iteration import POOL_FIELDS, SEQ_FIELDS

    B = next_tokens.shape[0] if len(next_tokens.shape) == 1 else -1
    want = {"next_tokens": ((B,), torch.int64), "tokens": ((B,), torch.int64), "kv_indptr": ((B + 1,), torch.int32),
            "kv_indices": (None, torch.int32), "kv_last_page_len": ((B,), torch.int32), "seqs": (None, torch.int32),
            "pool": (None, torch.int32), "out": (None, torch.int32)}
    given = dict(next_tokens=next_tokens, tokens=tokens, kv_indptr=kv_indptr, kv_indices=kv_indices,
                 kv_last_page_len=kv_last_page_len, seqs=seqs, pool=pool, out=out)
    for name, (shape, dtype) in want.items():
        t = given[name]
        if t.dtype != dtype or (shape is not None and tuple(t.shape) != shape):
            raise BadInputError(f"decode_advance(): {name} is {str(t.dtype)[6:]} {list(t.shape)}; expected "
                                f"{str(dtype)[6:]} {list(shape) if shape else ''} (mpk.ops.iteration)")
    if not is_page_size(page_size) or max_len < 2 or stops < 0:
        raise BadInputError(f"decode_advance(): page_size {page_size}, max_len {max_len}, stops {stops}; expected a "
                            f"page size in {PAGE_SIZES}, max_len ≥ 2 and stops ≥ 0")
    pages = -(-max_len // page_size)
    if (len(seqs.shape) != 2 or tuple(seqs.shape) != (B, SEQ_FIELDS + stops + pages) or len(pool.shape) != 1
            or pool.shape[0] < POOL_FIELDS or len(out.shape) != 2 or out.shape[1] != B or out.shape[0] < 1
            or kv_indices.shape[0] < B * pages):
        raise BadInputError(f"decode_advance(): seqs {list(seqs.shape)}, pool {list(pool.shape)}, out "
                            f"{list(out.shape)}, kv_indices {list(kv_indices.shape)}; expected [{B}, "
                            f"{SEQ_FIELDS} + {stops} + {pages}], [{POOL_FIELDS} + free pages], [K ≥ 1, {B}] and "
                            f"at least {B * pages} entries (every row's pages up to max_len)")


@torch.library.custom_op("mpk::decode_advance",
                         mutates_args=("tokens", "kv_indptr", "kv_indices", "kv_last_page_len", "seqs", "pool", "out"))
def decode_advance(next_tokens: torch.Tensor, tokens: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                   kv_last_page_len: torch.Tensor, seqs: torch.Tensor, pool: torch.Tensor, out: torch.Tensor,
                   page_size: int, max_len: int, stops: int) -> torch.Tensor:
    """The start-of-iteration task (mpk.ops.iteration): feed each live sequence's
    ``next_tokens`` back into ``tokens``, record it in the ring ``out``, grow the sequence (pages
    from ``pool``'s free list), rebuild the page table and check stop conditions, all in place.
    Returns this iteration's tokens [B] int64 (−1 for sequences already done)."""
    from mpk.ops.iteration import advance

    args = (next_tokens, tokens, kv_indptr, kv_indices, kv_last_page_len, seqs, pool, out)
    check_advance(*args, page_size, max_len, stops)
    work = [t.cpu() for t in args]
    emitted = advance(*work, page_size=page_size, max_len=max_len, stops=stops)
    for dst, src in zip(args[1:], work[1:]):
        if dst.device.type != "cpu":
            dst.copy_(src)
    return emitted.to(next_tokens.device)


@decode_advance.register_fake
def _(next_tokens, tokens, kv_indptr, kv_indices, kv_last_page_len, seqs, pool, out, page_size, max_len, stops):
    check_advance(next_tokens, tokens, kv_indptr, kv_indices, kv_last_page_len, seqs, pool, out, page_size, max_len,
                  stops)
    return next_tokens.new_empty(next_tokens.shape)
