"""``Scheduler``: continuous batching over one ``BlockManager``.

Each step has a budget of ``max_num_batched_tokens`` new tokens. Running sequences that decode
take one token each first, then sequences still prefilling take chunks of their prompts (a long
prompt spans steps), then waiting sequences are admitted (prefix-cached pages taken, their
first chunk scheduled) while the budget, ``max_num_seqs`` and the page pool allow: decodes and
prefill chunks share one ragged step. When a running sequence needs a page the pool lacks, the
youngest running sequence not yet in the step is preempted by recompute: its pages are freed
and it waits again at the head of the queue, its prompt and generated tokens to be computed
again (its output so far is kept; seeded sampling continues where it stopped).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mpk.engine.block_manager import BlockManager
from mpk.engine.sequence import Sequence
from mpk.errors import OptionError


@dataclass
class ScheduledRow:
    """A sequence of the step and its ``count`` new tokens, from ``num_computed`` on."""

    seq: Sequence
    count: int

    @property
    def samples(self) -> bool:
        """The step computes the sequence's last token: its logits give the next one."""
        return self.seq.num_computed + self.count == len(self.seq.token_ids)


class Scheduler:
    """Waiting and running queues, and the step plan (see the module)."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise OptionError(f"max_num_seqs={max_num_seqs!r}, max_num_batched_tokens={max_num_batched_tokens!r}; "
                              "expected both ≥ 1")
        self.blocks, self.max_num_seqs, self.max_num_batched_tokens = blocks, max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the youngest
        self.num_preemptions = 0
        self._admitted = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledRow]:
        """The next step's rows, in table order (empty only when nothing waits or runs)."""
        rows: list[ScheduledRow] = []
        scheduled: set[int] = set()  # request ids in rows
        budget = self.max_num_batched_tokens
        for decoding in (True, False):
            for seq in list(self.running):  # a copy: preemption removes sequences
                if not budget:
                    break
                if seq not in self.running or (seq.to_compute == 1) != decoding or seq.request_id in scheduled:
                    continue
                n = min(seq.to_compute, budget)
                if self._grow_or_preempt(seq, n, scheduled):
                    rows.append(ScheduledRow(seq, n))
                    scheduled.add(seq.request_id)
                    budget -= n
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            admitted = self.blocks.admit(seq.block, seq.token_ids, budget)
            if admitted is None:
                break
            seq.num_computed, n = admitted
            self.waiting.popleft()
            self._admitted += 1
            seq.order = self._admitted
            self.running.append(seq)
            rows.append(ScheduledRow(seq, n))
            budget -= n
        return rows

    def _grow_or_preempt(self, seq: Sequence, n: int, scheduled: set[int]) -> bool:
        """Pages for ``seq``'s next ``n`` tokens, preempting the youngest running sequences not
        in the step until they fit; False if ``seq`` itself was preempted."""
        while not self.blocks.grow(seq.block, seq.num_computed + n):
            victim = max((s for s in self.running if s.request_id not in scheduled), key=lambda s: s.order)
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and queue it first, to recompute all its tokens."""
        self.running.remove(seq)
        self.blocks.release(seq.block)
        seq.num_computed = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def advance(self, rows: list[ScheduledRow]) -> None:
        """Count the step's tokens as computed (registering full pages for prefix caching)."""
        for r in rows:
            r.seq.num_computed += r.count
            self.blocks.commit(r.seq.block, r.seq.token_ids, r.seq.num_computed)

    def retire(self, seq: Sequence) -> None:
        """Remove a finished running sequence and free its pages now."""
        self.running.remove(seq)
        self.blocks.release(seq.block)

    def abort(self, request_id: int) -> Sequence | None:
        """Drop the waiting or running sequence of ``request_id`` (pages freed); returns it, or
        None if no unfinished sequence has that id."""
        for queue in (self.running, self.waiting):
            seq = next((s for s in queue if s.request_id == request_id), None)
            if seq is not None:
                queue.remove(seq)
                self.blocks.release(seq.block)
                seq.num_computed = 0
                return seq
        return None

    def abort_all(self) -> list[Sequence]:
        """Drop every sequence (pages freed); returns them."""
        dropped = [*self.running, *self.waiting]
        for seq in dropped:
            self.blocks.release(seq.block)
            seq.num_computed = 0
        self.running.clear()
        self.waiting.clear()
        return dropped
