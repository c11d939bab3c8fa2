"""``BlockManager``: pages from one pool, prefix caching of full pages by chained hash and
refcount, LRU eviction of freed cached pages; ``PageTable.write``: the step's rows in order."""

from __future__ import annotations

import random

import pytest
import torch

from mpk.engine.block_manager import BlockManager, BlockTable
from mpk.llm import DecoderLM
from mpk.llm.kv_cache import PageTable
from mpk.testing.decode import small_config

P = 4  # page size


def run(bm: BlockManager, tokens: list[int]) -> BlockTable:
    """Admit a sequence of ``tokens`` and compute all of it (commit)."""
    t = BlockTable()
    start, n = bm.admit(t, tokens, len(tokens))
    assert start + n == len(tokens)
    bm.commit(t, tokens, len(tokens))
    return t


def test_pages_come_from_one_pool_and_go_back():
    bm = BlockManager(10, P, prefix_caching=False)
    a, b = BlockTable(), BlockTable()
    assert bm.admit(a, list(range(9)), 100) == (0, 9) and len(a.pages) == 3
    assert bm.admit(b, list(range(40)), 100) is None and not b.pages  # 10 pages; 7 free
    assert bm.num_free == 7
    assert bm.admit(b, list(range(30)), 28) == (0, 28) and bm.num_free == 0
    assert not bm.grow(a, 13) and len(a.pages) == 3  # refused: nothing changed
    assert set(a.pages).isdisjoint(b.pages)
    bm.release(b)
    assert bm.num_free == 7 and bm.grow(a, 13) and len(a.pages) == 4
    bm.release(a)
    assert bm.num_free == 10 and not a.pages and bm.hit_pages == 0


def test_prefix_pages_are_shared_by_refcount_and_hits_counted():
    """A prompt starting with another's full pages takes them (not its last token's page) and
    computes from there; a shared page stays held until its last holder releases it."""
    bm = BlockManager(16, P)
    system = [random.randrange(100) for _ in range(2 * P + 1)]
    first = run(bm, system + [7, 8])
    t = BlockTable()
    assert bm.admit(t, system + [9], 100) == (2 * P, 2)
    assert t.pages[:2] == first.pages[:2] and t.pages[2] != first.pages[2]
    assert (bm.hit_pages, bm.hit_tokens) == (2, 2 * P)
    assert bm.refs[first.pages[0]] == 2
    # exactly two full pages: the second holds the last token, so only the first is taken
    u = BlockTable()
    assert bm.admit(u, system[:2 * P], 100) == (P, P) and u.pages[0] == first.pages[0]
    # a different token in page 0: nothing shared (the hash chains through every page)
    v = BlockTable()
    assert bm.admit(v, [system[0] + 1] + system[1:], 100) == (0, 2 * P + 1)
    # and in the last token of page 1: page 0 shared, not page 1
    w = system[:2 * P - 1] + [system[2 * P - 1] + 1, system[2 * P]]
    assert bm.admit(BlockTable(), w, 100) == (P, P + 1)
    shared, own = first.pages[0], first.pages[2]
    assert bm.refs[shared] == 4  # first, t, u and w
    bm.release(first)
    assert bm.refs[shared] == 3 and bm.refs[own] == 0 and bm.num_free == 16 - len(t.pages) - 1 - len(v.pages) - 2


def test_freed_cached_pages_are_reused_until_evicted_lru():
    """Released pages keep their hash: a later prompt hits them. When the pool has no
    uncached page left, the least recently freed cached page goes first, its hash dropped."""
    bm = BlockManager(6, P)
    a_tokens, b_tokens = list(range(2 * P + 1)), list(range(100, 100 + 2 * P + 1))
    a = run(bm, a_tokens)
    b = run(bm, b_tokens)
    a_pages = list(a.pages)
    bm.release(a)  # freed first: evicted first
    bm.release(b)
    assert bm.num_free == 6 and len(bm.cached_free) == 4
    c = BlockTable()
    assert bm.admit(c, b_tokens, 100) == (2 * P, 1)  # b's pages, reused
    bm.release(c)
    d = BlockTable()
    assert bm.admit(d, list(range(500, 500 + 4 * P)), 100) == (0, 4 * P)
    # 2 uncached pages, then the 2 least recently freed cached ones: a's (b's were used again later)
    assert set(d.pages) >= set(a_pages[:2])
    bm.release(d)
    assert bm.admit(BlockTable(), a_tokens, 100) == (0, 2 * P + 1)  # a's prefix is gone
    assert bm.hit_pages == 2


def test_a_page_table_lists_the_step_rows_in_order():
    model = DecoderLM(small_config("qwen3"), torch.float32, max_len=64)
    table = PageTable(model, 4, 8, P, capacity=12)
    table.write([[5, 2, 7], [5, 2], [1]], [10, 8, 2], [3, 1, 2])
    assert table.kv_indptr.tolist() == [0, 3, 5, 6, 6]
    assert table.kv_indices[:6].tolist() == [5, 2, 7, 5, 2, 1]
    assert table.kv_last_page_len.tolist() == [2, 4, 2, 0]
    assert table.qo_indptr.tolist() == [0, 3, 4, 6, 6]
    with pytest.raises(Exception, match="expected at most 4"):
        table.write([[0]] * 5, [1] * 5, [1] * 5)
