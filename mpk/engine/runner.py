"""``ModelRunner``: one engine step on the model — the page table written from the scheduled
sequences' block tables, their new tokens run through ``TokenBuckets`` (padded to a bucket),
the next token sampled for each sequence whose last token the step computed — or a burst of
decode iterations in one launch (``mpk.llm.multistep``), pages for it reserved from the block
manager into the launch's free list and the unused ones given back."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence as Seq

import torch

from mpk.engine.block_manager import BlockManager, BlockTable
from mpk.engine.sampling import sample
from mpk.engine.scheduler import ScheduledRow
from mpk.engine.sequence import Sequence
from mpk.errors import OptionError
from mpk.llm.buckets import CompileReport, TokenBuckets, build_kernels
from mpk.llm.kv_cache import PageTable, check_max_len
from mpk.llm.model import DecoderLM
from mpk.llm.multistep import MultiStepDecode, Row

EXECUTORS = ("gpu", "cpu", "eager")


def default_executor(device: torch.device) -> str:
    """"gpu" on CUDA; on the CPU eager PyTorch (the CPU interpreter is a slow reference)."""
    return "gpu" if device.type == "cuda" else "eager"


@dataclass(frozen=True)
class StepInputs:
    """One step as the host prepared it: each row's pages and length after the step, its new
    tokens' count, and those tokens in row order. Every rank of a tensor-parallel job runs the
    same (rank 0 broadcasts it)."""

    pages: list[list[int]]
    lens: list[int]
    counts: list[int]
    tokens: list[int]


class ModelRunner:
    """``model`` over a cache of ``num_pages`` pages, in steps of up to ``max_num_seqs``
    sequences and ``max_num_batched_tokens`` new tokens. ``executor``: "gpu" (the mega-kernel),
    "cpu" (mpk's CPU interpreter) or "eager" (PyTorch, nothing compiled). ``buckets``: the step
    sizes compiled (``TokenBuckets``'; None: its default for ``max_num_batched_tokens``).
    ``tensor_parallel``: (rank, world) of a tensor-parallel job, whose GPU steps compile this
    rank's shard (the ``tensor_parallel`` compile option); None: the whole model.
    ``decode_iterations``: > 1 compiles the multi-step decode graph (one per batch size 1, 2,
    4, … ``max_num_seqs``) that ``burst`` runs that many iterations of per launch."""

    def __init__(self, model: DecoderLM, max_num_seqs: int, max_num_batched_tokens: int, num_pages: int,
                 page_size: int, max_model_len: int, executor: str, buckets: Seq[int] | None = None,
                 tensor_parallel: tuple[int, int] | None = None, decode_iterations: int = 1):
        if executor not in EXECUTORS:
            raise OptionError(f"executor={executor!r}; expected one of {EXECUTORS} (None: "
                              f"{default_executor(model.embed.device)!r} here)")
        check_max_len(model, max_model_len)
        self.model = model
        # every row may list up to max_model_len's pages (shared prefix pages repeat across rows)
        capacity = max_num_seqs * -(-max_model_len // page_size)
        # a sharded step's cache is rank-local; replicas (the eager executor) hold it whole
        sharded = tensor_parallel if executor == "gpu" else None
        self.table = PageTable(model, max_num_seqs, num_pages, page_size, capacity, sharded)
        eager = executor == "eager"
        self.buckets = TokenBuckets(model, self.table, max_num_batched_tokens, buckets, eager=eager,
                                    options=None if eager else self.options(executor, tensor_parallel))
        self.executor, self.decode_iterations, self.max_model_len = executor, decode_iterations, max_model_len
        self.max_num_seqs = max_num_seqs
        self._multistep: dict[int, MultiStepDecode] = {}

    @staticmethod
    def options(executor: str, tensor_parallel: tuple[int, int] | None = None) -> dict:
        """mpk's compile options of the steps: the GPU executor returns at once (outputs ordered
        on the stream), so the host queues the sampling behind the step rather than waiting;
        a rank of a tensor-parallel job compiles its shard."""
        opts = {"executor": executor, "sync": False} if executor == "gpu" else {"executor": executor}
        if tensor_parallel is not None and tensor_parallel[1] > 1:
            opts["tensor_parallel"] = tuple(tensor_parallel)
        return opts

    def compile(self, progress: bool | None = None) -> CompileReport:
        """Compile every bucket (and the multi-step graphs) now, else at their first use."""
        report = self.buckets.compile(progress)
        if self.decode_iterations > 1:
            traced = []
            for size in self.burst_sizes():
                start = time.perf_counter()
                traced.append(self.multistep(size).trace())
                report.trace_s[f"multistep B={size}"] = time.perf_counter() - start
            report.build_s += build_kernels(traced, progress)
        return report

    def burst_sizes(self) -> list[int]:
        """The batch sizes of the multi-step graphs: 1, 2, 4, … below max_num_seqs, and it."""
        sizes = [1 << i for i in range(self.max_num_seqs.bit_length()) if 1 << i < self.max_num_seqs]
        return sizes + [self.max_num_seqs]

    def multistep(self, rows: int) -> MultiStepDecode:
        """The multi-step graph for ``rows`` sequences: the smallest batch size that holds them."""
        size = next(b for b in self.burst_sizes() if b >= rows)
        if size not in self._multistep:
            k, ps = self.decode_iterations, self.table.page_size
            # a row takes at most a page per page_size iterations, and one more at a boundary
            self._multistep[size] = MultiStepDecode(
                self.model, self.table.cache, size, ps, self.max_model_len, ring=k, free_pages=size * (k // ps + 2),
                executor=self.executor, options=None if self.executor == "eager" else self.options(self.executor))
        return self._multistep[size]

    def burst(self, seqs: list[Sequence], blocks: BlockManager, stop_ids: list[list[int]]) -> list[list[int]] | None:
        """Up to ``decode_iterations`` decode iterations of ``seqs`` (each decoding: its last
        token not in the cache, its pages covering it) in one launch; per sequence, the tokens
        it generated, in order (it stopped at a stop id in ``stop_ids``, its max_tokens or
        max_model_len, or when the reserved pages ran out). Their pages grow by what they took;
        the reservation's rest goes back to ``blocks``. None (nothing ran) when a padding row
        would need a page the pool lacks."""
        ms = self.multistep(len(seqs))
        ps = self.table.page_size
        left = [min(s.params.max_tokens - len(s.output_token_ids), self.max_model_len - len(s.token_ids)) for s in seqs]
        k = min(self.decode_iterations, max(left))
        # tokens fed back: at most min(k, left − 1); each needs its position's page
        need = sum(max(0, -(-(len(s.token_ids) + min(k, n - 1)) // ps) - len(s.block.pages))
                   for s, n in zip(seqs, left))
        padding = len(seqs) < ms.batch
        reserved = BlockTable()
        if not blocks.grow(reserved, min(need + padding, blocks.num_free) * ps) or (padding and not reserved.pages):
            return None
        pad_page = reserved.pages[0] if padding else None
        free = reserved.pages[1:] if padding else reserved.pages
        rows = [Row(s.token_ids[-1], len(s.token_ids), list(s.block.pages), len(s.output_token_ids),
                    s.params.max_tokens, ids, s.params.temperature, s.params.top_k, s.params.top_p, s.params.min_p,
                    s.seed)
                for s, ids in zip(seqs, stop_ids)]
        ms.load(rows, free, pad_page)
        ms.run(k)
        out = ms.read(k, len(seqs))
        for s, pages in zip(seqs, out.pages):
            s.block.pages.extend(pages[len(s.block.pages):])
        reserved.pages = ([pad_page] if padding else []) + free[: out.free_left]
        blocks.release(reserved)
        return out.tokens

    def execute(self, rows: list[ScheduledRow]) -> list[tuple[int, dict[int, float] | None] | None]:
        """Run the step of ``rows``; per row, (the sampled token, its logprobs if asked for) or
        None for a row whose prefill chunk is not its sequence's last."""
        seqs = [r.seq for r in rows]
        logits = self.forward(self.inputs(rows))
        picked = [i for i, r in enumerate(rows) if r.samples]
        out: list[tuple[int, dict[int, float] | None] | None] = [None] * len(rows)
        if not picked:
            return out
        chosen = [seqs[i] for i in picked]
        x = logits if len(picked) == len(rows) else logits[picked]
        ids = self.sample(x, chosen)
        # the step's one device→host copy (it waits for the step: with sync=False the host
        # queued the sampling while the kernel ran)
        tokens = ids.tolist()
        probs = self.logprobs(x, ids, tokens, [s.params.logprobs for s in chosen])
        for i, tok, p in zip(picked, tokens, probs):
            out[i] = (tok, p)
        return out

    @staticmethod
    def inputs(rows: list[ScheduledRow]) -> StepInputs:
        """The step of ``rows``, as every rank runs it."""
        seqs, counts = [r.seq for r in rows], [r.count for r in rows]
        tokens = [t for s, n in zip(seqs, counts) for t in s.token_ids[s.num_computed: s.num_computed + n]]
        return StepInputs([s.block.pages for s in seqs], [s.num_computed + n for s, n in zip(seqs, counts)], counts,
                          tokens)

    def forward(self, step: StepInputs) -> torch.Tensor:
        """Write the page table and run the step's graph; its logits (``TokenBuckets.run``)."""
        self.table.write(step.pages, step.lens, step.counts)
        return self.buckets.run(step.tokens, step.counts)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The next token of each of ``seqs`` (int64 [n], on the device) from its row of
        ``logits``: greedy rows (temperature 0) by argmax — the lowest id among ties, what
        ``sample`` gives them, without its sort over the vocabulary — the others by ``sample``
        under their parameters, seeds and counters (the index of the token being generated).
        The seam for an in-kernel sampler: whatever replaces this must give the same ids."""
        ids = torch.argmax(logits, dim=-1)
        drawn = [j for j, s in enumerate(seqs) if s.params.temperature > 0]
        if not drawn:
            return ids
        rest = [seqs[j] for j in drawn]
        # the per-row parameters in one host→device copy (top_k is exact in float64)
        params = torch.tensor([(s.params.temperature, s.params.top_k, s.params.top_p, s.params.min_p) for s in rest],
                              dtype=torch.float64).to(logits.device, non_blocking=True)
        index = torch.tensor(drawn).to(logits.device, non_blocking=True)
        ids[index] = sample(logits[index], params[:, 0].float(), params[:, 1].long(), params[:, 2].float(),
                            params[:, 3].float(), [s.seed for s in rest],
                            [len(s.token_ids) - len(s.prompt_token_ids) for s in rest])
        return ids

    @staticmethod
    def logprobs(logits: torch.Tensor, ids: torch.Tensor, tokens: list[int],
                 want: list[int | None]) -> list[dict[int, float] | None]:
        """Per row: None, or when ``want[j]`` is k the log-probabilities of its k most likely
        tokens and of its sampled one (``tokens[j]``, ``ids[j]`` on the device); every row that
        asks in one host copy."""
        asked = [j for j, k in enumerate(want) if k is not None]
        out: list[dict[int, float] | None] = [None] * len(want)
        if not asked:
            return out
        lp = torch.log_softmax(logits[asked].float(), dim=-1)
        k = max(want[j] for j in asked)
        top = torch.topk(lp, k)
        # float64 holds the float32 log-probs and the token ids (< 2**53) exactly: one copy
        host = torch.cat([lp.gather(1, ids[asked][:, None]), top.values, top.indices.float()], 1).double().tolist()
        for row, j in zip(host, asked):
            n = want[j]
            probs = {int(i): v for i, v in zip(row[1 + k: 1 + k + n], row[1: 1 + n])}
            probs[tokens[j]] = row[0]
            out[j] = probs
        return out
