"""``Scheduler``: the token budget (decodes first, then prompt chunks), max_num_seqs,
preemption of the youngest sequence by recompute, retirement — driven without a model (each
sampled token is a fixed id)."""

from __future__ import annotations

import random

from mpk.engine.block_manager import BlockManager
from mpk.engine.sampling import SamplingParams
from mpk.engine.scheduler import Scheduler
from mpk.engine.sequence import Sequence


def seq(i: int, prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(i, None, [random.randrange(50) for _ in range(prompt_len)],
                    SamplingParams(temperature=0, max_tokens=max_tokens), seed=i, tokenizer=None)


def step(s: Scheduler) -> list[tuple[int, int]]:
    """One step with token 7 sampled for each sequence that completes: its (request, count) rows."""
    rows = s.schedule()
    s.advance(rows)
    for r in rows:
        if r.seq.num_computed == len(r.seq.token_ids):
            r.seq.append(7, frozenset(), 10_000)
            if r.seq.finished:
                s.retire(r.seq)
    return [(r.seq.request_id, r.count) for r in rows]


def test_decodes_first_then_prompt_chunks_within_the_budget():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=8)
    a, b = seq(0, 3, 3), seq(1, 20, 2)
    s.add(a)
    s.add(b)
    assert step(s) == [(0, 3), (1, 5)]  # a's whole prompt, b's first chunk
    assert step(s) == [(0, 1), (1, 7)]  # a decodes first, b's next chunk fills the budget
    assert step(s) == [(0, 1), (1, 7)]
    assert a.finished and len(a.output_token_ids) == 3 and not a.block.pages  # retired, pages freed at once
    assert step(s) == [(1, 1)] and len(b.output_token_ids) == 1  # b's last prompt token: its first sample
    assert step(s) == [(1, 1)] and b.finished and not s.has_work()
    assert s.blocks.num_free == 64


def test_at_most_max_num_seqs_run():
    s = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [seq(i, 3, 2) for i in range(5)]
    for q in seqs:
        s.add(q)
    assert step(s) == [(0, 3), (1, 3)] and len(s.waiting) == 3
    assert step(s) == [(0, 1), (1, 1)]  # both finish
    assert step(s) == [(2, 3), (3, 3)]


def test_the_youngest_is_preempted_and_recomputed_with_its_output():
    """Two sequences outgrow a pool of 4 pages of 4 tokens: the younger one is preempted (its
    pages freed, queued first), keeps its output and recomputes prompt + output later; both
    finish with all their tokens."""
    s = Scheduler(BlockManager(4, 4, prefix_caching=False), max_num_seqs=2, max_num_batched_tokens=16)
    old, young = seq(0, 6, 6), seq(1, 5, 6)
    s.add(old)
    s.add(young)
    assert step(s) == [(0, 6), (1, 5)]  # 2 + 2 pages: the pool is full
    assert step(s) == [(0, 1), (1, 1)]
    assert step(s) == [(0, 1), (1, 1)]  # old's 8 tokens fill its 2 pages
    assert step(s) == [(0, 1)]  # old needs a third page: young preempted
    assert s.num_preemptions == 1 and s.waiting[0] is young and young.num_computed == 0 and not young.block.pages
    assert len(young.output_token_ids) == 3  # kept: its prompt to recompute is 5 + 3 tokens
    while not old.finished:
        step(s)
    rows = step(s)
    assert rows == [(1, 8)]  # readmitted: prompt and output recomputed, then its fourth token sampled
    assert len(young.output_token_ids) == 4
    while s.has_work():
        step(s)
    assert young.finished and len(young.output_token_ids) == 6 and s.blocks.num_free == 4
