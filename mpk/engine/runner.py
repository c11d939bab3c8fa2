"""``ModelRunner``: one engine step on the model — the page table written from the scheduled
sequences' block tables, their new tokens run through ``TokenBuckets`` (padded to a bucket),
the next token sampled for each sequence whose last token the step computed."""

from __future__ import annotations

from typing import Sequence

import torch

from mpk.engine.sampling import sample
from mpk.engine.scheduler import ScheduledRow
from mpk.errors import OptionError
from mpk.llm.buckets import CompileReport, TokenBuckets
from mpk.llm.kv_cache import PageTable, check_max_len
from mpk.llm.model import DecoderLM

EXECUTORS = ("gpu", "cpu", "eager")


def default_executor(device: torch.device) -> str:
    """"gpu" on CUDA; on the CPU eager PyTorch (the CPU interpreter is a slow reference)."""
    return "gpu" if device.type == "cuda" else "eager"


class ModelRunner:
    """``model`` over a cache of ``num_pages`` pages, in steps of up to ``max_num_seqs``
    sequences and ``max_num_batched_tokens`` new tokens. ``executor``: "gpu" (the mega-kernel),
    "cpu" (mpk's CPU interpreter) or "eager" (PyTorch, nothing compiled). ``buckets``: the step
    sizes compiled (``TokenBuckets``'; None: its default for ``max_num_batched_tokens``)."""

    def __init__(self, model: DecoderLM, max_num_seqs: int, max_num_batched_tokens: int, num_pages: int,
                 page_size: int, max_model_len: int, executor: str, buckets: Sequence[int] | None = None):
        if executor not in EXECUTORS:
            raise OptionError(f"executor={executor!r}; expected one of {EXECUTORS} (None: "
                              f"{default_executor(model.embed.device)!r} here)")
        check_max_len(model, max_model_len)
        self.model = model
        # every row may list up to max_model_len's pages (shared prefix pages repeat across rows)
        capacity = max_num_seqs * -(-max_model_len // page_size)
        self.table = PageTable(model, max_num_seqs, num_pages, page_size, capacity)
        eager = executor == "eager"
        self.buckets = TokenBuckets(model, self.table, max_num_batched_tokens, buckets, eager=eager,
                                    options=None if eager else {"executor": executor})

    def compile(self, progress: bool | None = None) -> CompileReport:
        """Compile every bucket now (else at the first step)."""
        return self.buckets.compile(progress)

    def execute(self, rows: list[ScheduledRow]) -> list[tuple[int, dict[int, float] | None] | None]:
        """Run the step of ``rows``; per row, (the sampled token, its logprobs if asked for) or
        None for a row whose prefill chunk is not its sequence's last."""
        seqs = [r.seq for r in rows]
        self.table.write([s.block.pages for s in seqs], [s.num_computed + r.count for s, r in zip(seqs, rows)],
                         [r.count for r in rows])
        tokens = [t for s, r in zip(seqs, rows) for t in s.token_ids[s.num_computed: s.num_computed + r.count]]
        logits = self.buckets.run(tokens, [r.count for r in rows])
        picked = [i for i, r in enumerate(rows) if r.samples]
        out: list[tuple[int, dict[int, float] | None] | None] = [None] * len(rows)
        if not picked:
            return out
        chosen = [seqs[i] for i in picked]
        x = logits[picked]
        dev = x.device

        def per_row(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor([getattr(s.params, name) for s in chosen], dtype=dtype, device=dev)

        ids = sample(x, per_row("temperature", torch.float32), per_row("top_k", torch.int64),
                     per_row("top_p", torch.float32), per_row("min_p", torch.float32),
                     [s.seed for s in chosen], [len(s.output_token_ids) for s in chosen]).tolist()
        want = [s.params.logprobs for s in chosen]
        lp = torch.log_softmax(x.float(), dim=-1) if any(k is not None for k in want) else None
        for j, (i, tok) in enumerate(zip(picked, ids)):
            probs = None
            if want[j] is not None:
                top = torch.topk(lp[j], want[j]) if want[j] else None
                probs = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist()))
                probs[tok] = float(lp[j, tok])
            out[i] = (tok, probs)
        return out
