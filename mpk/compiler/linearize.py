"""Step 5 — linearize: BFS over events gives task ids in which every event launches a
contiguous range [first_task, last_task), so an event is stored as two integers.

An event is visited once all its triggers have been placed, so the order is topological; the
end event comes last. A task never placed means a cycle (a compiler bug, reported as such).
"""

from __future__ import annotations

from collections import deque

from mpk.compiler.taskgraph import TaskGraph
from mpk.errors import CompileError


def linearize(tg: TaskGraph) -> TaskGraph:
    trig_event = [0] * tg.num_tasks
    for ei, e in enumerate(tg.events):
        for t in e.triggers:
            trig_event[t] = ei
    waiting = [len(e.triggers) for e in tg.events]
    # The start event first; an end event with nothing to wait for (no tasks) right after it.
    queue = deque([tg.start_event] + [i for i, w in enumerate(waiting) if w == 0 and i != tg.start_event])
    task_order: list[int] = []
    event_order: list[int] = []
    while queue:
        ei = queue.popleft()
        event_order.append(ei)
        for t in tg.events[ei].launches:
            task_order.append(t)
            nxt = trig_event[t]
            waiting[nxt] -= 1
            if waiting[nxt] == 0:
                queue.append(nxt)
    if len(task_order) != tg.num_tasks or len(event_order) != len(tg.events):
        raise CompileError(f"linearization placed {len(task_order)} of {tg.num_tasks} tasks and "
                           f"{len(event_order)} of {len(tg.events)} events: the task graph has a cycle")
    tg.task_order, tg.event_order = task_order, event_order
    return tg
