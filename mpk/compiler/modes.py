"""Step 6 — modes: label each task JIT or AOT.

AOT tasks are placed on workers' queues ahead of time and wait there for their dependent
event; JIT tasks are handed to an idle worker by a scheduler when their event fires. Tasks of
data-dependent ops (attention: its work depends on sequence lengths known only at run time)
are JIT, and so is everything launched downstream of a JIT task until a global barrier: an
event whose ancestors include every JIT task linearized before it. When such an event fires
no data-dependent work can still be in flight, so static placement is exact again. (Requiring
*all* earlier tasks as ancestors would almost never hold: independent work, such as copies that
depend only on the start event, is linearized first and feeds later layers.)
"""

from __future__ import annotations

from mpk.compiler.taskgraph import TaskGraph
from mpk.ops import get_op


def assign_modes(tg: TaskGraph) -> TaskGraph:
    data_dependent = {op.id for op in tg.graph.ops if get_op(op.kind).data_dependent}
    jit = [tg.task_op[t] in data_dependent for t in range(tg.num_tasks)]
    barrier = [False] * len(tg.events)
    dep_event = [0] * tg.num_tasks
    for ei, e in enumerate(tg.events):
        for t in e.launches:
            dep_event[t] = ei
    position = {t: i for i, t in enumerate(tg.task_order)}
    ancestors: dict[int, int] = {}  # per event: bitset over linear positions
    jit_before = 0  # bitset of JIT tasks at positions already emitted
    for ei in tg.event_order:
        e = tg.events[ei]
        bits = 0
        for t in e.triggers:
            bits |= ancestors[dep_event[t]] | (1 << position[t])
        ancestors[ei] = bits
        # a barrier closes a JIT region: JIT work came before, and all of it is an ancestor
        barrier[ei] = jit_before != 0 and bits & jit_before == jit_before
        if not barrier[ei] and any(jit[t] for t in e.triggers):
            for t in e.launches:
                jit[t] = True
        for t in e.launches:
            if jit[t]:
                jit_before |= 1 << position[t]
    tg.jit, tg.barrier = jit, barrier
    return tg
