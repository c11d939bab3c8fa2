"""``BlockManager``: one pool of KV-cache pages shared by every sequence, with prefix caching.

A sequence's pages are a ``BlockTable`` (page ids in position order). Pages come from a free
pool; with prefix caching, a page that a sequence has filled completely is registered under a
chained hash of (the previous page's hash, its token ids), so a later sequence whose tokens
start with the same full pages takes them (refcount + 1) instead of computing them again. A
page nobody holds any more keeps its hash and stays reusable until the pool runs out of pages
that hold nothing: then the least recently freed cached page is evicted. Only full pages are
shared, and a full page is never written again, so sharing needs no copy-on-write.

The block manager is host-side bookkeeping; ``mpk.llm.kv_cache.PageTable`` holds the tensors a
step reads, written from the block tables of the step's sequences.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

from mpk.errors import OptionError


@dataclass
class BlockTable:
    """A sequence's pages in position order; ``hashes[i]``: page i's prefix hash, for the
    leading full pages registered so far (``BlockManager.commit``)."""

    pages: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


def page_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The prefix hash of a full page: of its parent's hash (None for the first page) and its
    token ids, so equal hashes mean equal prefixes up to a collision (checked on a hit)."""
    return hash((parent, tuple(tokens)))


class BlockManager:
    """``num_pages`` pages of ``page_size`` tokens shared by all sequences.

    ``prefix_caching``: register full pages by prefix hash and share them (off: pages only
    come from and go back to the free pool). ``interleave``: the free pool hands out pages
    0, k, 2k, …, then 1, k + 1, … (k = ``interleave``), so that one sequence's pages are not
    contiguous in tests (kernels must follow the table). Counters: ``hit_pages`` and
    ``hit_tokens``, what ``take_prefix`` found cached.
    """

    def __init__(self, num_pages: int, page_size: int, prefix_caching: bool = True, interleave: int = 1):
        if not (isinstance(num_pages, int) and num_pages >= 1 and isinstance(page_size, int) and page_size >= 1):
            raise OptionError(f"num_pages={num_pages!r}, page_size={page_size!r}; expected ints ≥ 1")
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, prefix_caching
        # popped from the end: the first page handed out is the first of the order
        self.free_pages = [p for i in range(interleave) for p in range(i, num_pages, interleave)][::-1]
        self.refs = [0] * num_pages
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # unheld pages with a hash, LRU first
        self.page_of_hash: dict[int, int] = {}
        self.hash_of_page: dict[int, int] = {}
        self.tokens_of_page: dict[int, tuple[int, ...]] = {}
        self.hit_pages = self.hit_tokens = 0

    @property
    def num_free(self) -> int:
        """Pages a sequence can get now: unheld ones, cached or not."""
        return len(self.free_pages) + len(self.cached_free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def _cached_prefix(self, token_ids: Sequence[int]) -> list[int]:
        """The cached pages holding the leading full pages of ``token_ids`` but its last token
        (that one is computed for its logits)."""
        found: list[int] = []
        if not self.prefix_caching:
            return found
        parent = None
        for i in range((len(token_ids) - 1) // self.page_size):
            tokens = tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])
            h = page_hash(parent, tokens)
            page = self.page_of_hash.get(h)
            if page is None or self.tokens_of_page[page] != tokens:
                break
            found.append(page)
            parent = h
        return found

    def admit(self, table: BlockTable, token_ids: Sequence[int], budget: int) -> tuple[int, int] | None:
        """Start a sequence of ``token_ids`` with an empty ``table``: take its cached prefix
        pages and pages for up to ``budget`` tokens after them. Returns (cached tokens, tokens
        to compute now ≥ 1), or None (nothing changed) if the pool lacks the pages."""
        cached = self._cached_prefix(token_ids)
        start = len(cached) * self.page_size
        n = min(len(token_ids) - start, budget)
        reused_free = sum(p in self.cached_free for p in cached)  # taking them shrinks the pool
        if n < 1 or self.pages_for(start + n) - len(cached) > self.num_free - reused_free:
            return None
        for p in cached:
            self._hold(p)
        table.pages.extend(cached)
        table.hashes.extend(self.hash_of_page[p] for p in cached)
        self.hit_pages += len(cached)
        self.hit_tokens += start
        self.grow(table, start + n)
        return start, n

    def can_grow(self, table: BlockTable, tokens: int) -> bool:
        return self.pages_for(tokens) - len(table.pages) <= self.num_free

    def grow(self, table: BlockTable, tokens: int) -> bool:
        """Give ``table`` pages for ``tokens`` tokens in all; False (nothing changed) if the pool
        lacks them."""
        need = self.pages_for(tokens) - len(table.pages)
        if need > self.num_free:
            return False
        for _ in range(need):
            table.pages.append(self._take_free())
        return True

    def release(self, table: BlockTable) -> None:
        """Give back a sequence's pages (emptying ``table``): a page no one else holds returns
        to the pool, its hash (if any) kept until the page is evicted. Freed in reverse, so
        that a sequence's pages go back as it took them (its first page is handed out next)."""
        for p in reversed(table.pages):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                if p in self.hash_of_page:
                    self.cached_free[p] = None
                else:
                    self.free_pages.append(p)
        table.pages.clear()
        table.hashes.clear()

    def commit(self, table: BlockTable, token_ids: Sequence[int], computed: int) -> None:
        """Register the full pages among the first ``computed`` tokens (their k/v written) that
        ``table`` has not registered yet. A page whose prefix another page already holds stays
        unregistered (the first one is shared)."""
        if not self.prefix_caching:
            return
        for i in range(len(table.hashes), computed // self.page_size):
            tokens = tuple(token_ids[i * self.page_size:(i + 1) * self.page_size])
            h = page_hash(table.hashes[-1] if table.hashes else None, tokens)
            table.hashes.append(h)
            page = table.pages[i]
            if h not in self.page_of_hash and page not in self.hash_of_page:
                self.page_of_hash[h], self.hash_of_page[page], self.tokens_of_page[page] = page, h, tokens

    def _hold(self, page: int) -> None:
        self.cached_free.pop(page, None)
        self.refs[page] += 1

    def _take_free(self) -> int:
        if self.free_pages:
            page = self.free_pages.pop()
        else:  # evict the least recently freed cached page
            page, _ = self.cached_free.popitem(last=False)
            del self.page_of_hash[self.hash_of_page.pop(page)]
            del self.tokens_of_page[page]
        self.refs[page] = 1
        return page
