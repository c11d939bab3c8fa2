"""The ragged paged ops on the GPU (marker ``gpu``; skipped without CUDA): prefill, mixed batches
and chunked prefill through the GPU executor against the float64 references of
mpk.testing.ragged (q, the appended cache rows and attention; bounds derived there: P is
rounded to the 16-bit dtype where the tensor cores take P·V), each task path once — the
tensor-core block-of-rows task (attn_prefill), the row-by-row one (attn_partial kRagged) on the
tensor cores and on the CUDA cores — and the bad tables the tasks report. One compile a test."""

from __future__ import annotations

import random

import pytest
import torch

from mpk.backend import COMPILED
from mpk.errors import BadInputError
from mpk.executors.codegen import generate
from mpk.testing.ragged import RaggedBatch, RaggedCase, check_ragged, ragged_batch, ragged_step, random_case

pytestmark = pytest.mark.gpu
DEV = "cuda"
BF = torch.bfloat16
PROMPTS = [1, 7, 16, 17, 300]
# prefill chunks over cached prefixes, decodes, an idle sequence, one whose prefix ends on a
# page boundary
MIXED_PREFIX, MIXED_NEW = [40, 300, 0, 5, 17, 64, 33], [17, 64, 16, 1, 1, 0, 31]


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(random.randrange(1 << 30))


def _run(case: RaggedCase, splits: int):
    """The compiled step on the GPU: (q, out, cache) on the CPU, and the attention task it ran."""
    step = torch.compile(ragged_step(case, splits), backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "gpu"})
    args = case.args(device=DEV)
    with torch.no_grad():
        q, out = step(*args)
    src = generate(COMPILED[-1].tables)
    task = "attn_prefill" if "mpk::attn_prefill<" in src else "attn_partial"
    return q.cpu(), out.cpu(), args[5].cpu(), task


# (prompts or mixed, page size, heads, kv heads, head dim, qk-norm, splits): G = 1, 2, 4 (Qwen3-8B-like
# 32/8 at d = 128), 8, and G = 5, 6, 7, which leave some of a warp's 16 MMA rows unused; one
# chunk (the tasks write O) and several (merged)
BLOCK_CASES = [("prompts", 1, 8, 8, 64, False, 1), ("prompts", 16, 16, 8, 128, True, 2),
               ("prompts", 256, 32, 8, 128, True, 1), ("prompts", 16, 16, 2, 64, False, 3),
               ("mixed", 16, 32, 8, 128, True, 2), ("mixed", 1, 16, 2, 64, True, 1),
               ("prompts", 16, 28, 4, 64, False, 1), ("mixed", 16, 40, 8, 128, True, 2),
               ("prompts", 1, 12, 2, 64, True, 3)]


@pytest.mark.parametrize("rows,page_size,heads,kv_heads,dim,qk_norm,splits", BLOCK_CASES)
def test_ragged_step_on_the_tensor_cores_matches_float64(rows, page_size, heads, kv_heads, dim, qk_norm, splits):
    """bf16 steps of more than DECODE_ROWS rows: attention takes blocks of rows on the tensor
    cores (attn_prefill). Fresh prompts of 1, 7, 16, 17 and 300 rows with two padding rows, or a
    mixed batch (chunks over cached prefixes, decodes, an idle sequence) with three."""
    g = _gen()
    prefix, new, padding = ([0] * len(PROMPTS), PROMPTS, 2) if rows == "prompts" else (MIXED_PREFIX, MIXED_NEW, 3)
    case = random_case(ragged_batch(prefix, new, page_size, g, padding=padding), heads, kv_heads, dim, qk_norm, g, BF)
    q, out, cache, task = _run(case, splits)
    assert task == "attn_prefill"
    check_ragged(case, q, out, cache, p_rounded=True)


@pytest.mark.parametrize("dtype,prefix,new,dim", [(torch.float32, MIXED_PREFIX, MIXED_NEW, 128),
                                                  (BF, [40, 300, 0, 5], [1, 1, 9, 0], 128),
                                                  (BF, MIXED_PREFIX, MIXED_NEW, 256)],
                         ids=["fp32-cuda-cores", "bf16-few-rows", "bf16-dim256"])
def test_ragged_step_row_by_row_matches_float64(dtype, prefix, new, dim):
    """The row-by-row attention (attn_partial kRagged): fp32 (the CUDA cores) over a mixed
    batch, a bf16 step of at most DECODE_ROWS rows (one row a tile; the tensor cores over each
    row's G heads) of decodes and a short prefill, and a bf16 mixed batch of head dim 256 (no
    tensor-core block form; rope_append's widest rows); two chunks, merged."""
    g = _gen()
    heads, kv_heads = (16, 4) if dim == 128 else (8, 2)
    case = random_case(ragged_batch(prefix, new, 16, g, padding=2), heads, kv_heads, dim, True, g, dtype)
    q, out, cache, task = _run(case, 2)
    assert task == "attn_partial"
    check_ragged(case, q, out, cache, p_rounded=dtype == BF)


@pytest.mark.parametrize("rows", ["decodes", "chunk"])
def test_skewed_lengths_run_the_balanced_split(rows):
    """One long sequence among short ones (random lengths): 16 decode rows (attn_partial
    kRagged) or a 64-row chunk of the long one beside 15 decodes (attn_prefill), both through
    the balanced split (attn_plan made in the launch, items spread by it, attn_merge_planned)
    against float64."""
    g = _gen()
    short = torch.randint(1, 400, (15,), generator=g).tolist()
    new = [1] * 16 if rows == "decodes" else [64] + [1] * 15
    long = int(torch.randint(3000, 6000, (1,), generator=g))
    # (decodes: no padding row, which would make 17 rows, a prefill-sized step)
    case = random_case(ragged_batch([long] + short, new, 16, g, padding=int(rows == "chunk")), 32, 8, 128, True, g,
                       BF)
    q, out, cache, task = _run(case, 0 if rows == "decodes" else 4)
    assert task == ("attn_partial" if rows == "decodes" else "attn_prefill")
    assert "mpk::attn_plan<" in generate(COMPILED[-1].tables)
    check_ragged(case, q, out, cache, p_rounded=True)


def test_chunked_prefill_through_one_graph():
    """A 300-row prompt in chunks of 64 through one compiled step (a 64-row bucket: the last
    chunk of 44 rows has 20 padding rows), the page table grown before each chunk: every
    chunk's q, appended rows and attention against float64."""
    g = _gen()
    n, chunk, page_size, heads, kv_heads, dim = 300, 64, 16, 32, 8, 128
    whole = random_case(ragged_batch([0], [n], page_size, g, spare=0), heads, kv_heads, dim, True, g, BF)
    pages = whole.batch.pages[0]
    step = torch.compile(ragged_step(whole, 1), backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "gpu"})
    cache = whole.cache.to(DEV)
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        used = -(-(start + m) // page_size)
        batch = RaggedBatch([start + m], [m], chunk, page_size, [pages], torch.tensor([0, used], dtype=torch.int32),
                            torch.tensor(pages, dtype=torch.int32),
                            torch.tensor([(start + m - 1) % page_size + 1], dtype=torch.int32),
                            torch.tensor([0, m], dtype=torch.int32), whole.batch.num_pages)
        qkv = whole.qkv[start:start + chunk]
        qkv = torch.cat([qkv, torch.randn(chunk - len(qkv), qkv.shape[1], generator=g).to(BF)])  # padding rows
        part = RaggedCase(batch, heads, kv_heads, dim, qkv, cache.cpu(), whole.cos_sin, whole.q_norm, whole.k_norm,
                          whole.layer, whole.scale)
        with torch.no_grad():
            q, out = step(*part.args(cache=cache, device=DEV))
        check_ragged(part, q.cpu(), out.cpu(), cache.cpu(), p_rounded=True)


def test_bad_ragged_tables_are_reported():
    """The tasks check qo_indptr and each sequence's new rows against its length as they read
    them and report the first fault: a BadInputError after the launch naming the entry (worded
    as mpk.errors.BAD_INPUTS); the executor stays usable (the next good launch matches float64)."""
    g = _gen()
    case = random_case(ragged_batch([2, 5], [30, 4], 4, g, padding=2), 8, 2, 64, False, g, BF)
    step = torch.compile(ragged_step(case, 1), backend="mpk", fullgraph=True, dynamic=False,
                         options={"executor": "gpu"})
    limit = r"0…36 \(the step's token rows\), or breaks qo_indptr's order"
    for qo, message in (([0, 30, 29], rf"qo_indptr entry 29 at row 2 is outside {limit}"),
                        ([0, 33, 34], r"new-row count \(qo_indptr\[row \+ 1\] − qo_indptr\[row\]\) 33 at row 0 is "
                                      r"outside 0…32, the sequence's length in the page table")):
        args = list(case.args(device=DEV))
        args[-1] = torch.tensor(qo, dtype=torch.int32, device=DEV)
        with pytest.raises(BadInputError, match=message), torch.no_grad():
            step(*args)
    args = case.args(device=DEV)
    with torch.no_grad():
        q, out = step(*args)
    check_ragged(case, q.cpu(), out.cpu(), args[5].cpu(), p_rounded=True)
