"""Step 2b — prune: drop edges another path already implies.

Edge p→t is redundant when p is an ancestor of another predecessor q of t: t cannot start
before q, and q not before p. The common case is the residual stream: ``x + attn(norm(x))``
reads x directly and through the whole attention block. Kept, such edges make producers
trigger several events (dummy tasks at normalization) and hide global barriers.

Only pairs of producer ops (A, B) with A an op-level ancestor of B are examined; for B's tasks
the set of A-tasks among their ancestors is a bitset over A's tiles, built in topological op
order over the ops between A and B and shared by tasks with equal predecessor tuples.
"""

from __future__ import annotations

from collections import defaultdict

from mpk.compiler.taskgraph import TaskGraph


def _op_reachability(tg: TaskGraph) -> list[int]:
    """reach[a] has bit b set iff op b is reachable from op a (ops are in topological order)."""
    producer = {op.output: op.id for op in tg.graph.ops}
    consumers: dict[int, set[int]] = defaultdict(set)
    for op in tg.graph.ops:
        for v in op.inputs:
            if v.buffer in producer:
                consumers[producer[v.buffer]].add(op.id)
    reach = [0] * len(tg.graph.ops)
    for op in reversed(tg.graph.ops):
        for c in consumers[op.id]:
            reach[op.id] |= (1 << c) | reach[c]
    return reach


def prune(tg: TaskGraph) -> TaskGraph:
    reach = _op_reachability(tg)
    task_op, preds = tg.task_op, tg.preds
    first = {t.op_id: t.first_task for t in tg.tiles}
    memo: dict[tuple[int, tuple[int, ...]], int] = {}

    def anc_bits(a: int, task: int) -> int:
        """Bitset over op a's tiles: which of them are ancestors of ``task`` (op after a)."""
        stack = [(task, False)]
        while stack:
            t, expanded = stack.pop()
            key = (a, preds[t])
            if key in memo:
                continue
            pending = [p for p in preds[t] if task_op[p] != a and (reach[a] >> task_op[p]) & 1
                       and (a, preds[p]) not in memo]
            if pending and not expanded:
                stack.append((t, True))
                stack.extend((p, False) for p in pending)
                continue
            bits = 0
            for p in preds[t]:
                op = task_op[p]
                if op == a:
                    bits |= 1 << (p - first[a])
                elif (reach[a] >> op) & 1:
                    bits |= memo[(a, preds[p])]
            memo[key] = bits
        return memo[(a, preds[task])]

    removed = 0
    for t, ps in enumerate(preds):
        ops = {task_op[p] for p in ps}
        if len(ps) < 2 or len(ops) < 2:
            continue
        drop: set[int] = set()
        for a in ops:
            later = [p for p in ps if (reach[a] >> task_op[p]) & 1]
            if not later:
                continue
            implied = 0
            for q in later:
                implied |= anc_bits(a, q)
            drop.update(p for p in ps if task_op[p] == a and (implied >> (p - first[a])) & 1)
        if drop:
            preds[t] = tuple(p for p in ps if p not in drop)
            removed += len(drop)
    tg.num_edges -= removed
    tg.num_pruned_edges = removed
    return tg
