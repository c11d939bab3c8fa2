"""Several decode iterations inside ONE launch: ``DecodeIteration`` (a decode step, the sampler
and the start-of-iteration task as one graph) and ``MultiStepDecode``, which holds that graph's
state over a shared KV cache and runs k iterations per launch.

One iteration: ``DecoderLM`` in decode form over the page table → the logits (padded with −inf
to the sampler's vector width where the vocabulary needs it) → ``torch.ops.mpk.sample`` (greedy
rows: temperature 0; the others under their parameters, seed and counter, so the same seed
gives the same tokens bit for bit) → ``torch.ops.mpk.decode_advance``, which feeds each token
back into the graph's own inputs (mpk.ops.iteration documents the state and the ordering
argument). Compiled once per batch size; ``run(k)`` is one launch of k iterations (the backend's
``iterations``) on the mpk executors, or k eager calls (the reference).

The host loads the state (``load``), runs, and reads back what came out (``read``): the
tokens of each iteration, each row's length, done flag and block table (the pages it took from
the free list), and how many free pages are left.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
from torch import nn

import mpk.frontend.fused_ops  # noqa: F401  (registers torch.ops.mpk.*)
from mpk.errors import BadInputError, MpkError, OptionError
from mpk.llm.config import is_count
from mpk.llm.model import DecoderLM
from mpk.ops.iteration import DONE, GEN, LEN, MAX, MAX_BATCH, POOL_FIELDS, SEQ_FIELDS, STEP, TOP, rebuild_table
from mpk.ops.paged import is_page_size
from mpk.ops.sampling import PARAM_DTYPES

VECTOR_BYTES = 16  # the sampler's CUDA task reads logits rows in 16-byte words
MAX_STOPS = 8  # stop token ids per row (EOS and stop_token_ids); a request with more decodes step by step


class DecodeIteration(nn.Module):
    """One iteration of the multi-step graph (the module docstring): returns this iteration's
    tokens [B] int64 (−1 for done rows)."""

    def __init__(self, model: DecoderLM, page_size: int, max_len: int, stops: int):
        super().__init__()
        self.model, self.page_size, self.max_len, self.stops = model, page_size, max_len, stops
        vec = VECTOR_BYTES // model.embed.dtype.itemsize
        self.pad = -model.cfg.vocab % vec

    def forward(self, tokens, kv_cache, kv_indptr, kv_indices, kv_last_page_len, seqs, pool, out, temperature, top_k,
                top_p, min_p, seed):
        logits = self.model(tokens, kv_cache, kv_indptr, kv_indices, kv_last_page_len)
        if self.pad:  # never drawn: probability 0, never the maximum
            logits = torch.nn.functional.pad(logits, (0, self.pad), value=float("-inf"))
        counter = seqs[:, GEN].to(torch.int64)  # the index of the token being generated
        nxt = torch.ops.mpk.sample(logits, temperature, top_k, top_p, min_p, seed, counter)
        return torch.ops.mpk.decode_advance(nxt, tokens, kv_indptr, kv_indices, kv_last_page_len, seqs, pool, out,
                                            self.page_size, self.max_len, self.stops)


@dataclass
class Row:
    """One sequence as a multi-step launch starts it: ``token`` its last token (not in the cache
    yet) at position ``length`` − 1, over ``pages`` (covering ``length``); ``generated`` tokens
    so far of at most ``max_tokens``; ``stop_ids``: the token ids that end it; the sampling
    parameters (temperature 0: greedy) and ``seed`` (any int; its 64 bits are used)."""

    token: int
    length: int
    pages: list[int]
    generated: int = 0
    max_tokens: int = 1 << 30
    stop_ids: Sequence[int] = ()
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0


@dataclass
class Burst:
    """What a launch of k iterations gave: ``tokens[b]`` row b's emitted tokens in order (its
    ring slots up to the first −1), ``pages[b]`` its block table after (the pages it popped
    appended), ``lengths``, ``done`` per row, and ``free_left`` the free list's size after (the
    first ``free_left`` pages ``load`` was given were not taken)."""

    tokens: list[list[int]]
    pages: list[list[int]]
    lengths: list[int]
    done: list[bool]
    free_left: int


class MultiStepDecode:
    """``model``'s decode step over ``cache`` (``PageTable.cache`` or ``DecoderLM.new_cache``) for
    ``batch`` sequences of up to ``max_len`` tokens, ``ring`` iterations per launch at most, with
    a free list of up to ``free_pages`` pages. ``executor``: "gpu" / "cpu" (mpk, one launch of k
    iterations) or "eager" (k calls of the module: the reference). ``options``: mpk's compile
    options (the executor's added)."""

    def __init__(self, model: DecoderLM, cache: torch.Tensor, batch: int, page_size: int, max_len: int, ring: int,
                 free_pages: int, executor: str = "gpu", options: dict | None = None, stops: int = MAX_STOPS):
        if not (is_count(batch, 1) and batch <= MAX_BATCH):
            raise OptionError(f"batch={batch!r}; expected an int in [1, {MAX_BATCH}] (decode_advance: a thread a row)")
        if not is_page_size(page_size) or not is_count(max_len, 2) or not is_count(ring, 1) \
                or not is_count(free_pages) or not is_count(stops):
            raise OptionError(f"page_size={page_size!r}, max_len={max_len!r}, ring={ring!r}, "
                              f"free_pages={free_pages!r}, stops={stops!r}; expected a power-of-two page size, "
                              "max_len ≥ 2, ring ≥ 1 and counts ≥ 0")
        if executor not in ("gpu", "cpu", "eager"):
            raise OptionError(f"executor={executor!r}; expected 'gpu', 'cpu' or 'eager'")
        self.batch, self.page_size, self.max_len, self.ring, self.stops = batch, page_size, max_len, ring, stops
        self.pages_per_seq = -(-max_len // page_size)
        dev = model.embed.device
        i32 = dict(dtype=torch.int32, device=dev)
        self.cache = cache
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.kv_indptr = torch.zeros(batch + 1, **i32)
        self.kv_indices = torch.zeros(batch * self.pages_per_seq, **i32)
        self.kv_last_page_len = torch.zeros(batch, **i32)
        self.seqs = torch.zeros(batch, SEQ_FIELDS + stops + self.pages_per_seq, **i32)
        self.pool = torch.zeros(POOL_FIELDS + free_pages, **i32)
        self.out = torch.full((ring, batch), -1, **i32)
        self.params = [torch.zeros(batch, dtype=d, device=dev) for name, d in PARAM_DTYPES.items() if name != "counter"]
        self.module = DecodeIteration(model, page_size, max_len, stops)
        self.executor = executor
        self._run: Callable = self.module if executor == "eager" else torch.compile(
            self.module, backend="mpk", fullgraph=True, dynamic=False,
            options={**(options or {}), "executor": executor})
        self.traced = executor == "eager"

    def args(self) -> tuple[torch.Tensor, ...]:
        return (self.tokens, self.cache, self.kv_indptr, self.kv_indices, self.kv_last_page_len, self.seqs, self.pool,
                self.out, *self.params)

    def trace(self):
        """Compile the graph without running it; its ``CompiledGraph`` (None for "eager", or
        when traced before), so that callers build several kernels together."""
        from mpk.backend import TracedOnly, trace_only

        if self.traced:
            return None
        limit = torch._dynamo.config.recompile_limit + 1  # one entry per batch size, beside the others'
        with torch._dynamo.config.patch(recompile_limit=limit), torch.no_grad(), trace_only():
            try:
                self._run(*self.args())
            except TracedOnly as traced:
                self.traced = True
                return traced.compiled
        raise MpkError("MultiStepDecode: the graph ran instead of being traced; expected the mpk backend")

    def load(self, rows: Sequence[Row], free: Sequence[int], padding_page: int | None = None) -> None:
        """Start a launch: row b is ``rows[b]``; rows past them (up to ``batch``) are done
        padding of length 1 on ``padding_page`` (its contents are garbage afterwards; required
        when there are such rows); ``free``: the pages the rows may take, popped from the end."""
        B, S = self.batch, self.stops
        if len(rows) > B or len(free) > self.pool.shape[0] - POOL_FIELDS:
            raise MpkError(f"{len(rows)} rows and {len(free)} free pages; this graph holds {B} rows and "
                           f"{self.pool.shape[0] - POOL_FIELDS} pages")
        if len(rows) < B and padding_page is None:
            raise MpkError(f"{len(rows)} rows of a batch of {B}: expected a padding_page for the rest")
        seqs = np.zeros(tuple(self.seqs.shape), np.int32)
        params = [np.zeros(B, np.float32), np.zeros(B, np.int32), np.ones(B, np.float32), np.zeros(B, np.float32),
                  np.zeros(B, np.int64)]
        tokens = np.zeros(B, np.int64)
        seqs[:, SEQ_FIELDS: SEQ_FIELDS + S] = -1
        for b, r in enumerate(rows):
            if (len(r.stop_ids) > S or len(r.pages) != -(-r.length // self.page_size)
                    or not 1 <= r.length < self.max_len):
                raise BadInputError(f"row {b}: {len(r.stop_ids)} stop ids, {len(r.pages)} pages for length {r.length}; "
                                    f"expected at most {S}, the pages of its length, 1 ≤ length < {self.max_len}")
            seqs[b, [LEN, GEN, MAX, DONE]] = r.length, r.generated, r.max_tokens, 0
            seqs[b, SEQ_FIELDS: SEQ_FIELDS + len(r.stop_ids)] = list(r.stop_ids)
            seqs[b, SEQ_FIELDS + S: SEQ_FIELDS + S + len(r.pages)] = r.pages
            tokens[b] = r.token
            seed = r.seed & ((1 << 64) - 1)
            for p, v in zip(params, (r.temperature, r.top_k, r.top_p, r.min_p, seed - (seed >> 63 << 64))):
                p[b] = v
        for b in range(len(rows), B):
            seqs[b, [LEN, GEN, MAX, DONE]] = 1, 0, 1, 1
            seqs[b, SEQ_FIELDS + S] = padding_page
        pool = np.zeros(self.pool.shape[0], np.int32)
        pool[STEP], pool[TOP] = 0, len(free)
        pool[POOL_FIELDS: POOL_FIELDS + len(free)] = free
        table = [torch.from_numpy(x) for x in (np.zeros(B + 1, np.int32), np.zeros(self.kv_indices.shape[0], np.int32),
                                               np.zeros(B, np.int32))]
        rebuild_table(torch.from_numpy(seqs), *table, self.page_size, S)
        host = [torch.from_numpy(tokens), *table, torch.from_numpy(seqs), torch.from_numpy(pool),
                torch.full(tuple(self.out.shape), -1, dtype=torch.int32), *map(torch.from_numpy, params)]
        dst = [self.tokens, self.kv_indptr, self.kv_indices, self.kv_last_page_len, self.seqs, self.pool, self.out,
               *self.params]
        for d, h in zip(dst, host):  # from pinned memory, queued on the stream like the launch
            d.copy_(h.pin_memory() if d.is_cuda else h, non_blocking=d.is_cuda)

    def run(self, k: int) -> None:
        """Run ``k`` iterations (≤ ``ring``): one launch on the mpk executors, k calls eagerly."""
        from mpk.backend import iterations

        if not is_count(k, 1) or k > self.ring:
            raise OptionError(f"run({k!r}); expected 1 … {self.ring} iterations (the ring's slots)")
        with torch.no_grad():
            if self.executor == "eager":
                for _ in range(k):
                    self._run(*self.args())
                return
            if not self.traced:
                self.trace()
            with iterations(k), torch.compiler.set_stance("fail_on_recompile"):
                self._run(*self.args())

    def read(self, k: int, rows: int) -> Burst:
        """What the last ``run(k)`` gave its first ``rows`` rows (waits for the launch)."""
        out = self.out[:k, :rows].cpu().numpy()
        seqs, pool = self.seqs[:rows].cpu().numpy(), self.pool[:POOL_FIELDS].cpu().numpy()
        table = seqs[:, SEQ_FIELDS + self.stops:]
        tokens, pages = [], []
        for b in range(rows):
            col = out[:, b]
            n = int(np.argmax(col < 0)) if (col < 0).any() else k
            tokens.append(col[:n].tolist())
            pages.append(table[b, : -(-int(seqs[b, LEN]) // self.page_size)].tolist())
        return Burst(tokens, pages, seqs[:, LEN].tolist(), (seqs[:, DONE] != 0).tolist(), int(pool[TOP]))
