"""The paged KV cache a step reads: ``PageTable`` (the cache tensor and the BSR page table,
``kv_indptr``, ``kv_indices``, ``kv_last_page_len``, with ``qo_indptr``, the rows of a ragged
step's new tokens, written in place) and ``PagedKVCache``, a page table with one fixed slot
per sequence over a ``mpk.engine.block_manager.BlockManager``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from mpk.engine.block_manager import BlockManager, BlockTable
from mpk.errors import MpkError
from mpk.llm.config import is_count
from mpk.llm.staging import PinnedWriter
from mpk.ops.paged import PAGE_SIZES, is_page_size

if TYPE_CHECKING:
    from mpk.llm.model import DecoderLM


def _indices(value: Any) -> list[int] | None:
    """An integer (Python or NumPy, not a bool) or an iterable of them (a list, range or array) as
    a list of ints; None for anything else."""
    def one(v: Any) -> int | None:
        return None if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) else int(v)

    if one(value) is not None:
        return [one(value)]
    try:
        items = [one(v) for v in value]
    except TypeError:
        return None
    return None if None in items else items


def check_max_len(model: DecoderLM, max_len: int) -> None:
    """ValueError unless the model's rope table covers ``max_len`` positions."""
    positions = model.cos_sin.shape[0]
    if max_len > positions:  # rope reads row len − 1 of the table; past it the step would fault
        raise ValueError(f"max_len {max_len} exceeds the model's rope table of {positions} positions; build "
                         f"the model with max_len ≥ {max_len} (DecoderLM / load_pretrained)")


class PageTable:
    """The KV cache of ``num_pages`` pages and the page table of a step over up to ``batch``
    sequences, as tensors whose addresses stay fixed across steps (CUDA graphs and mpk's bound
    buffers rely on that).

    ``write(pages, lens, new)`` makes row b sequence b's: its pages ``pages[b]``, its length
    ``lens[b]`` (counting the step's new tokens) and ``new[b]`` new rows (``qo_indptr``, read by
    a ragged step; a decode step ignores it); rows past ``len(pages)`` are empty. A page may
    appear in several rows (a shared prefix), so ``kv_indices`` holds ``capacity`` entries
    (default ``num_pages``). Under ``tensor_parallel`` (rank, world) the cache is rank-local
    (``DecoderLM.new_cache``): only the rank's kv heads are real; ``local`` views the cache's
    memory this process owns (the whole cache, or those heads).
    """

    def __init__(self, model: DecoderLM, batch: int, num_pages: int, page_size: int, capacity: int | None = None,
                 tensor_parallel: tuple[int, int] | None = None):
        if not is_page_size(page_size):
            raise ValueError(f"page_size {page_size!r}; expected {PAGE_SIZES}")
        if not (is_count(batch, 1) and is_count(num_pages, 1)):
            raise ValueError(f"batch {batch!r}, num_pages {num_pages!r}; expected both ints ≥ 1")
        capacity = num_pages if capacity is None else capacity
        self.batch, self.page_size, self.num_pages, self.capacity = batch, page_size, num_pages, capacity
        self.cache = model.new_cache(num_pages, page_size, tensor_parallel)
        self.local = self.cache  # the memory this process owns
        if tensor_parallel is not None and tensor_parallel[1] > 1:
            from mpk.distributed.shard import kv_head_range

            lo, hi = kv_head_range(model.cfg.kv_heads, *tensor_parallel)
            self.local = self.cache.narrow(3, lo, hi - lo)
        # the four table tensors are views of one buffer, so a step's table is one copy; each
        # starts at a multiple of 16 entries (64 bytes: the tasks' vector loads stay aligned)
        sizes = {"kv_indptr": batch + 1, "kv_indices": capacity, "kv_last_page_len": batch, "qo_indptr": batch + 1}
        starts, end = {}, 0
        for name, n in sizes.items():
            starts[name], end = end, end + -(-n // 16) * 16
        self._table = torch.zeros(end, dtype=torch.int32, device=model.embed.device)
        for name, n in sizes.items():
            setattr(self, name, self._table[starts[name]: starts[name] + n])
        self._starts = starts
        self._writer = PinnedWriter(self._table)
        self.step_lens = np.zeros(0, np.int64)  # the sequences' lengths the last write gave the step

    def args(self) -> tuple[torch.Tensor, ...]:
        """(cache, kv_indptr, kv_indices, kv_last_page_len): a decode step's arguments after the
        tokens; a ragged step adds ``qo_indptr``."""
        return self.cache, self.kv_indptr, self.kv_indices, self.kv_last_page_len

    def write(self, pages: Sequence[Sequence[int]], lens: Sequence[int], new: Sequence[int]) -> None:
        """Write the table of a step over ``len(pages)`` ≤ ``batch`` sequences (see the class)."""
        n = len(pages)
        if n > self.batch or len(lens) != n or len(new) != n:
            raise MpkError(f"a page table of {n} sequences ({len(lens)} lengths, {len(new)} new-row counts); "
                           f"expected at most {self.batch}, with one length and count each")
        ln = np.zeros(self.batch, np.int64)
        ln[:n] = lens
        self.step_lens = ln[:n]  # (the step's choice of graph looks at them: TokenBuckets)
        counts = -(-ln // self.page_size)
        indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        if indptr[-1] > self.capacity:
            raise MpkError(f"the step's sequences hold {indptr[-1]} pages; the page table holds {self.capacity}")
        flat = np.fromiter((p for b in range(n) for p in pages[b][: counts[b]]), np.int32, int(indptr[-1]))
        last = np.where(ln > 0, (ln - 1) % self.page_size + 1, 0).astype(np.int32)
        qo = np.zeros(self.batch + 1, np.int32)
        qo[1: n + 1] = np.cumsum(new)
        qo[n + 1:] = qo[n]
        host = self._writer.host()
        for name, values in (("kv_indptr", indptr), ("kv_indices", flat), ("kv_last_page_len", last),
                             ("qo_indptr", qo)):
            host[self._starts[name]: self._starts[name] + len(values)] = values
        self._writer.flush()


class PagedKVCache(PageTable):
    """A page table with one slot per sequence, each up to ``max_len`` tokens, over a pool of
    ``batch`` × its pages.

    ``grow(n)`` counts the next step's new tokens (pages taken as the last one fills) and
    writes the table; ``reset`` empties slots. Pages come interleaved across the slots, so a
    sequence's pages are not contiguous (the kernels must follow the table, not assume an
    order). ``lens``: each slot's length; ``new``: the last ``grow``'s counts (qo_indptr).
    ``tensor_parallel``: as PageTable's.
    """

    def __init__(self, model: DecoderLM, batch: int, max_len: int, page_size: int,
                 tensor_parallel: tuple[int, int] | None = None):
        if not (is_count(batch, 1) and is_count(max_len, 1)):
            raise ValueError(f"batch {batch!r}, max_len {max_len!r}; expected both ints ≥ 1")
        check_max_len(model, max_len)
        self.max_len = max_len
        self.pages_per_seq = -(-max_len // page_size)
        super().__init__(model, batch, batch * self.pages_per_seq, page_size, tensor_parallel=tensor_parallel)
        self.reset()

    @property
    def free(self) -> list[int]:
        """The pages no slot holds."""
        return self.blocks.free_pages

    def reset(self, seqs: int | list[int] | None = None) -> None:
        """Empty sequences ``seqs`` (an index or a list; default: every one), their pages back to
        the free list, keeping the cache tensor and the table tensors (and their addresses): the
        next prompt needs no second cache, and a finished sequence's slot can take a new prompt
        while the others decode on. A decode step writes one token of every sequence, so ``grow``
        the emptied ones before the next one (a ragged step leaves a sequence without new tokens
        alone)."""
        if seqs is None:
            self.blocks = BlockManager(self.num_pages, self.page_size, prefix_caching=False,
                                       interleave=self.pages_per_seq)
            self.tables = [BlockTable() for _ in range(self.batch)]
            self.lens = [0] * self.batch
            self.new = [0] * self.batch
        else:
            chosen = _indices(seqs)
            if chosen is None or not all(0 <= b < self.batch for b in chosen) or len(set(chosen)) < len(chosen):
                raise ValueError(f"reset({seqs!r}); expected a sequence index in [0, {self.batch}), a list of "
                                 "distinct ones, or None (every sequence)")
            for b in chosen:
                self.blocks.release(self.tables[b])
                self.lens[b] = 0
                self.new[b] = 0
        self._write()

    def grow(self, n: int | list[int] = 1) -> int:
        """Count ``n`` more tokens in every sequence, or ``n[b]`` in sequence b (0: none), and
        make them the next step's new rows: a decode step writes each sequence's last token, a
        ragged step the ``n[b]`` tokens of sequence b from row ``qo_indptr[b]`` on. Returns
        their total, the rows a ragged step needs (its tokens tensor may be longer: padding).
        A refused grow changes nothing."""
        counts = list(n) if isinstance(n, (list, tuple)) else [n] * self.batch
        if len(counts) != self.batch or not all(is_count(k) for k in counts):
            raise ValueError(f"grow({n!r}); expected a count ≥ 0 (an int) or one per sequence ({self.batch})")
        for b, k in enumerate(counts):
            if self.lens[b] + k > self.max_len:
                raise MpkError(f"sequence {b} would reach {self.lens[b] + k} tokens; max_len is {self.max_len}")
        for b, k in enumerate(counts):
            self.lens[b] += k
            self.blocks.grow(self.tables[b], self.lens[b])  # the pool holds every slot's max_len
        self.new = counts
        self._write()
        return sum(counts)

    def _write(self) -> None:
        self.write([t.pages for t in self.tables], self.lens, self.new)
