"""``PagedKVCache``: the host-side page allocator and the BSR page table (``kv_indptr``,
``kv_indices``, ``kv_last_page_len``) a step reads, with ``qo_indptr``, the rows of a ragged
step's new tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mpk.errors import MpkError
from mpk.llm.config import is_count
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


class PagedKVCache:
    """Host-side page allocator and the BSR page table a step reads.

    Pages are handed out in order from a free list; ``grow(n)`` counts the next step's new
    tokens (allocating pages as the last one fills) and writes the table tensors in place, so
    their addresses stay fixed across steps (CUDA graphs and mpk's bound buffers rely on
    that). ``qo_indptr`` [batch + 1] int32 holds the rows of the last ``grow``'s tokens: a
    decode step (``grow(1)``) ignores it, a ragged step (``DecoderLM.forward(..., qo_indptr)``)
    reads it.
    """

    def __init__(self, model: DecoderLM, batch: int, max_len: int, page_size: int):
        if not is_page_size(page_size):
            raise ValueError(f"page_size {page_size!r}; expected {PAGE_SIZES}")
        if not (is_count(batch, 1) and is_count(max_len, 1)):
            raise ValueError(f"batch {batch!r}, max_len {max_len!r}; expected both ints ≥ 1")
        positions = model.cos_sin.shape[0]
        if max_len > positions:  # rope reads row len − 1 of the table; past it the step would fault
            raise ValueError(f"max_len {max_len} exceeds the model's rope table of {positions} positions; build "
                             f"the model with max_len ≥ {max_len} (DecoderLM / load_pretrained)")
        self.batch, self.page_size, self.max_len = batch, page_size, max_len
        self.pages_per_seq = -(-max_len // page_size)
        num_pages = batch * self.pages_per_seq
        dev = model.embed.device
        self.cache = model.new_cache(num_pages, page_size)
        self.kv_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        self.kv_indices = torch.zeros(num_pages, dtype=torch.int32, device=dev)
        self.kv_last_page_len = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.qo_indptr = torch.zeros(batch + 1, dtype=torch.int32, device=dev)
        self.new = [0] * batch  # the last grow's counts: qo_indptr's host side
        self._qo_written = np.zeros(batch + 1, np.int32)
        self.reset()

    def reset(self, seqs: int | list[int] | None = None) -> None:
        """Empty sequences ``seqs`` (an index or a list; default: every one), their pages back to
        the free list, keeping the cache tensor and the table tensors (and their addresses): the
        next prompt needs no second cache, and a finished sequence's slot can take a new prompt
        while the others decode on. A decode step writes one token of every sequence, so ``grow``
        the emptied ones before the next one (a ragged step leaves a sequence without new tokens
        alone)."""
        if seqs is None:
            num_pages = self.batch * self.pages_per_seq
            # Pages interleaved across sequences, so a sequence's pages are not contiguous (the
            # kernels must follow the table, not assume an order).
            self.free = [p for i in range(self.pages_per_seq) for p in range(i, num_pages, self.pages_per_seq)][::-1]
            self.owned = np.zeros((self.batch, self.pages_per_seq), np.int32)  # row b: sequence b's pages in order
            self.lens = [0] * self.batch
            self.new = [0] * self.batch
        else:
            chosen = _indices(seqs)
            if chosen is None or not all(0 <= b < self.batch for b in chosen) or len(set(chosen)) < len(chosen):
                raise ValueError(f"reset({seqs!r}); expected a sequence index in [0, {self.batch}), a list of "
                                 "distinct ones, or None (every sequence)")
            for b in chosen:
                self.free.extend(self.owned[b, : -(-self.lens[b] // self.page_size)][::-1].tolist())
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
            have = -(-self.lens[b] // self.page_size)
            self.lens[b] += k
            for i in range(have, -(-self.lens[b] // self.page_size)):
                self.owned[b, i] = self.free.pop()
        self.new = counts
        self._write()
        return sum(counts)

    def args(self) -> tuple[torch.Tensor, ...]:
        """(cache, kv_indptr, kv_indices, kv_last_page_len): a decode step's arguments after the
        tokens; a ragged step adds ``qo_indptr``."""
        return self.cache, self.kv_indptr, self.kv_indices, self.kv_last_page_len

    def _write(self) -> None:
        lens = np.asarray(self.lens, np.int64)
        pages = -(-lens // self.page_size)
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        flat = np.concatenate([self.owned[b, :k] for b, k in enumerate(pages)]).astype(np.int32)
        last = np.where(lens > 0, (lens - 1) % self.page_size + 1, 0).astype(np.int32)
        qo = np.concatenate([[0], np.cumsum(self.new)]).astype(np.int32)
        # a decode loop's qo_indptr never changes: no copy for it each step
        writes = [(self.kv_indptr, indptr), (self.kv_indices[: len(flat)], flat), (self.kv_last_page_len, last)]
        if not np.array_equal(qo, self._qo_written):
            writes.append((self.qo_indptr, qo))
            self._qo_written = qo
        # From pinned host memory, asynchronously: a blocking copy would wait for the steps still
        # queued on the stream (sync=False), stalling the host each step. The caching host
        # allocator keeps each staging block until its copy has run.
        for dst, src in writes:
            host = torch.from_numpy(src)
            if dst.is_cuda:
                host = host.pin_memory()
            dst.copy_(host, non_blocking=dst.is_cuda)
